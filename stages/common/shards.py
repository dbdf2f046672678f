"""The token-shard contract: how the tokenize stage writes a split and how every later stage reads it.

Folder `data/tokenize/` holds:
    tokenizer/             a Hugging Face tokenizer (`AutoTokenizer.from_pretrained` loads it)
    <split>_<NNNN>.bin     token ids of the split, flat, little-endian, no header; NNNN counts from 0000.
                           Concatenating a split's shards in order gives its whole token stream; a
                           shard holds at most `shard_tokens` ids, so documents may cross shard borders.
    meta.json              the fields below

Token stream of a split: for each document (see prepare_data), the ids of its text followed by one
`eos_token_id`. Text is encoded line by line, each line keeping its trailing newline, so the stream
does not depend on how lines are spread over processes. No bos is inserted (the eos before a
document starts it), and `pad_token_id` never appears in shards (it is for batching).

dtype: "uint16" while the vocabulary has at most 65,536 ids, else "uint32".

meta.json:
    format, dtype, vocab_size, bos_token_id, eos_token_id, pad_token_id, shard_tokens
    splits.<split>.tokens     ids in the split, eos included
    splits.<split>.bytes      UTF-8 bytes of the split's text (the bits-per-byte denominator)
    splits.<split>.words      whitespace-separated words, `len(text.split())` (word perplexity)
    splits.<split>.documents  documents, i.e. eos ids
    splits.<split>.shards     shard file names in order
    environment               what the run ran in (stages.common.environment.output_record)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stages.common.config import UserError

FORMAT = "flat little-endian token ids, no header"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # ids 0 and 1
REDO = "re-run tokenize (dvc repro --force tokenize, or snakemake --forcerun tokenize)"


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:04d}.bin"


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: run the tokenize stage first (snakemake tokenize / dvc repro tokenize)"
        )
    return json.loads(path.read_text())


def check_split(folder: str | Path, split: str) -> None:
    """Every shard of the split is present and holds the ids meta.json counts (all but the last
    `shard_tokens`, the last the rest): a truncated, padded or missing shard is one clear error, raised
    before any compute, naming the file and the fix."""
    folder = Path(folder)
    meta = read_meta(folder)
    if split not in meta["splits"]:
        raise KeyError(f"{folder}: no split {split!r}; have {', '.join(meta['splits'])}")
    names, total = meta["splits"][split]["shards"], meta["splits"][split]["tokens"]
    itemsize = np.dtype(meta["dtype"]).itemsize
    for i, name in enumerate(names):
        path = folder / name
        want = meta["shard_tokens"] if i < len(names) - 1 else total - meta["shard_tokens"] * (len(names) - 1)
        if not path.is_file():
            raise UserError(f"token shard {path} is missing; {REDO}")
        size = path.stat().st_size
        if size != want * itemsize:
            raise UserError(
                f"token shard {path} holds {size:,} bytes, but {folder / 'meta.json'} counts {want:,} "
                f"{meta['dtype']} ids ({want * itemsize:,} bytes): the shard is truncated or corrupted; {REDO}"
            )


def check_tokenizer(folder: str | Path) -> None:
    """Every JSON file of the output's tokenizer/ (tokenizer.json, its config and special tokens) is whole:
    a truncated one is one clear error, raised before any compute, naming the file and the fix (the
    tokenizers library would fail on it with a bare parse error). Its presence is the caller's check."""
    for path in sorted((Path(folder) / "tokenizer").glob("*.json")):
        try:
            json.loads(path.read_bytes())
        except ValueError as e:  # (a JSONDecodeError, or bytes that are not UTF-8)
            raise UserError(f"{path} is not whole JSON ({e}): the file is truncated or damaged; {REDO}") from None


def same_tokenizer(folder: str | Path, model: str | Path) -> bool:
    """Whether the shards in `folder` speak the vocabulary of the tokenizer saved with `model` (a model
    folder without a tokenizer of its own is taken to use the shards')."""
    from transformers import AutoTokenizer

    if not any((Path(model) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return True
    ours = AutoTokenizer.from_pretrained(Path(folder) / "tokenizer")
    return ours.get_vocab() == AutoTokenizer.from_pretrained(model).get_vocab()


def open_split(folder: str | Path, split: str) -> list[np.memmap]:
    """The split's shards as read-only memory maps, in order (checked against meta.json first)."""
    folder = Path(folder)
    check_split(folder, split)
    meta = read_meta(folder)
    dtype = np.dtype(meta["dtype"])
    return [np.memmap(folder / name, dtype=dtype, mode="r") for name in meta["splits"][split]["shards"]]


class TokenStream:
    """A split's token stream read through read-only memory maps of its shards: `len()` and slices
    `[start:stop]` (int64 arrays, crossing shard borders where needed), the same ids as load_split's
    array without holding the split in memory: a process keeps only the pages it reads, shared with
    the other processes of the node through the page cache."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0, *(len(p) for p in self.parts)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a TokenStream takes [start:stop] slices")
        start, stop, _ = key.indices(len(self))
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            offset = int(self.starts[shard])
            end = min(stop, int(self.starts[shard + 1]))
            pieces.append(np.asarray(self.parts[shard][start - offset : end - offset], dtype=np.int64))
            start, shard = end, shard + 1
        if not pieces:
            return np.zeros(0, np.int64)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def open_stream(folder: str | Path, split: str) -> TokenStream:
    """The split's token stream, memory-mapped (checked against meta.json first)."""
    return TokenStream(open_split(folder, split))


def load_split(folder: str | Path, split: str) -> np.ndarray:
    """The whole token stream of a split in memory (int64)."""
    parts = open_split(folder, split)
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)


class ShardWriter:
    """Append token ids; files roll over every `shard_tokens` ids."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.names: list[str] = []
        self.total = 0
        self._fh = None
        self._room = 0

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while len(ids):
            if self._room == 0:
                self._roll()
            take = ids[: self._room]
            take.tofile(self._fh)
            self._room -= len(take)
            self.total += len(take)
            ids = ids[len(take) :]

    def _roll(self) -> None:
        if self._fh:
            self._fh.close()
        name = shard_name(self.split, len(self.names))
        self.names.append(name)
        self._fh = open(self.folder / name, "wb")
        self._room = self.shard_tokens

    def close(self) -> list[str]:
        if self._fh:
            self._fh.close()
        return self.names
