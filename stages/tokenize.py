"""tokenize: train a byte-level BPE tokenizer on the train split and pack every split into token shards.

Reads data/prepare_data/corpus/ and writes data/tokenize/: the tokenizer in Hugging Face format
(`AutoTokenizer.from_pretrained("data/tokenize/tokenizer")`), token shards per split and meta.json.
The shard format, special tokens and per-split counts are defined once, in stages/common/shards.py;
figures.json holds the counts, bytes per token and encoding throughput (tokens/s); metrics.json (DVC
metrics) the train tokens, test bytes per token and tokens/s.

The tokenizer is trained on rank 0 (the `tokenizers` trainer is itself multi-threaded). Encoding is
streamed: each rank reads its own contiguous byte range of a split line by line, encodes batches of
lines, and appends ids to a part file; rank 0 then joins the parts in rank order into shards, so the
output is byte-identical for any number of processes.

Run:
    python -m stages.tokenize --input data/prepare_data --output data/tokenize [key=value ...]
    torchrun --nproc-per-node 2 -m stages.tokenize --input data/prepare_data --output data/tokenize
    snakemake --cores all tokenize            # or: dvc repro tokenize
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.common import atomic, config, runtime, shards, stage, track

STAGE = "tokenize"
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Config:
    vocab_size: int
    min_frequency: int
    train_max_bytes: int
    batch_lines: int
    shard_tokens: int

    def __post_init__(self):
        floor = 256 + len(shards.SPECIAL_TOKENS)
        if self.vocab_size < floor:
            raise ValueError(
                f"vocab_size must be at least {floor} (256 byte symbols + {len(shards.SPECIAL_TOKENS)} special "
                f"tokens) for a byte-level BPE, got {self.vocab_size}"
            )
        if self.min_frequency < 1 or self.batch_lines < 1 or self.shard_tokens < 1:
            raise ValueError("min_frequency, batch_lines and shard_tokens must be >= 1")
        if self.train_max_bytes < 0:
            raise ValueError("train_max_bytes must be >= 0 (0 means the whole train split)")


def check_input(folder: Path) -> None:
    """Fail before any compute when prepare_data's output is missing or incomplete."""
    for split in SPLITS:
        for name in (f"{split}.txt", f"{split}.docs.npy"):
            if not (folder / "corpus" / name).is_file():
                raise config.UserError(
                    f"tokenize: {folder / 'corpus' / name} not found; run prepare_data first "
                    f"(snakemake prepare_data / dvc repro prepare_data) or pass --input"
                )


def iter_lines(path: Path, limit: int = 0):
    with open(path, encoding="utf-8") as fh:
        used = 0
        for line in fh:
            used += len(line.encode("utf-8"))
            if limit and used > limit:
                return
            yield line


def train_tokenizer(corpus: Path, cfg: Config, show_progress: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(shards.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(iter_lines(corpus / "train.txt", cfg.train_max_bytes), trainer)
    return tok


def save_hf_tokenizer(tok, folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=shards.EOS_TOKEN,
        eos_token=shards.EOS_TOKEN,
        pad_token=shards.PAD_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(folder)


def line_range(path: Path, rank: int, world: int) -> tuple[int, int]:
    """Byte range [start, end) of whole lines owned by `rank`: the lines starting inside its share."""
    size = path.stat().st_size

    def line_start_at_or_after(pos: int) -> int:
        if pos <= 0:
            return 0
        if pos >= size:
            return size
        with open(path, "rb") as fh:
            fh.seek(pos - 1)
            if fh.read(1) == b"\n":
                return pos
            fh.readline()
            return fh.tell()

    return line_start_at_or_after(size * rank // world), line_start_at_or_after(size * (rank + 1) // world)


def read_batches(txt: Path, doc_ends: set[int], start: int, end: int, batch_lines: int):
    """Yield (lines, ends_document, bytes) for the whole lines in [start, end), `batch_lines` at a time."""
    with open(txt, "rb") as src:
        src.seek(start)
        pos = batch_start = start
        lines, ends_doc = [], []
        while pos < end:
            raw = src.readline()
            pos += len(raw)
            lines.append(raw.decode("utf-8"))
            ends_doc.append(pos in doc_ends)
            if len(lines) == batch_lines or pos >= end:
                yield lines, ends_doc, pos - batch_start
                lines, ends_doc, batch_start = [], [], pos


def encode_range(tok, txt: Path, doc_ends: set[int], start: int, end: int, out: Path, cfg: Config, bar) -> dict:
    """Encode the lines in [start, end) into the raw id file `out`; an eos follows each document end.

    The encoder releases the GIL, so one worker thread encodes the next batch while this thread turns
    the previous one into ids on disk."""
    eos = tok.token_to_id(shards.EOS_TOKEN)
    dtype = shards.dtype_for(tok.get_vocab_size())
    counts = {"tokens": 0, "bytes": end - start, "words": 0, "documents": 0}

    def write(encoded, lines, ends_doc, nbytes):
        pieces = []
        for enc, is_end in zip(encoded, ends_doc, strict=True):
            pieces.append(enc.ids)
            if is_end:
                pieces.append((eos,))
        ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=dtype)
        ids.tofile(fh)
        counts["tokens"] += len(ids)
        counts["documents"] += sum(ends_doc)
        counts["words"] += sum(len(line.split()) for line in lines)
        bar.update(nbytes)

    with open(out, "wb") as fh, ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for lines, ends_doc, nbytes in read_batches(txt, doc_ends, start, end, cfg.batch_lines):
            future = pool.submit(tok.encode_batch_fast, lines, add_special_tokens=False)
            if pending:
                write(pending[0].result(), *pending[1:])
            pending = (future, lines, ends_doc, nbytes)
        if pending:
            write(pending[0].result(), *pending[1:])
    return counts


def tokenize(cfg: Config, inp: Path, output: Path, rt: runtime.Runtime, tracker: track.Tracker) -> dict:
    corpus = inp / "corpus"
    with atomic.folder(output, rt) as tmp:
        t0 = time.perf_counter()
        if rt.is_main:
            tok = train_tokenizer(corpus, cfg, show_progress=os.isatty(2))
            save_hf_tokenizer(tok, tmp / "tokenizer")
            tok.save(str(tmp / ".tokenizer.json"))
        runtime.barrier()
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tmp / ".tokenizer.json"))
        train_s = time.perf_counter() - t0
        vocab = tok.get_vocab_size()
        dtype = shards.dtype_for(vocab)

        t1 = time.perf_counter()
        parts = {}
        total = sum((corpus / f"{s}.txt").stat().st_size for s in SPLITS)
        with runtime.progress(total=total, unit="B", unit_scale=True, desc="tokenize", rt=rt) as bar:
            for split in SPLITS:
                txt = corpus / f"{split}.txt"
                offsets = np.load(corpus / f"{split}.docs.npy")
                doc_ends = set(offsets[1:].tolist()) | {txt.stat().st_size}
                start, end = line_range(txt, rt.rank, rt.world_size)
                part = tmp / f".part-{split}-{rt.rank:05d}"
                parts[split] = encode_range(tok, txt, doc_ends, start, end, part, cfg, bar)
        encode_s = max(runtime.gather_objects(time.perf_counter() - t1))
        all_parts = runtime.gather_objects(parts)

        meta = None
        if rt.is_main:
            meta = {
                "format": shards.FORMAT,
                "dtype": dtype.name,
                "vocab_size": vocab,
                "bos_token_id": tok.token_to_id(shards.EOS_TOKEN),
                "eos_token_id": tok.token_to_id(shards.EOS_TOKEN),
                "pad_token_id": tok.token_to_id(shards.PAD_TOKEN),
                "shard_tokens": cfg.shard_tokens,
                "splits": {},
            }
            for split in SPLITS:
                writer = shards.ShardWriter(tmp, split, dtype, cfg.shard_tokens)
                for r in range(rt.world_size):
                    part = tmp / f".part-{split}-{r:05d}"
                    writer.write(np.fromfile(part, dtype=dtype))
                    part.unlink()
                counts = {k: sum(p[split][k] for p in all_parts) for k in ("tokens", "bytes", "words", "documents")}
                meta["splits"][split] = {**counts, "shards": writer.close()}
            (tmp / ".tokenizer.json").unlink()
            atomic.write_json(tmp / "meta.json", meta)
            n_tokens = sum(s["tokens"] for s in meta["splits"].values())
            metrics = {
                "vocab_size": vocab,
                "tokenizer_train_s": train_s,
                "encode_s": encode_s,
                "tokens_per_s": n_tokens / max(encode_s, 1e-9),
                **{f"{s}_{k}": v for s, d in meta["splits"].items() for k, v in d.items() if k != "shards"},
                **{f"{s}_bytes_per_token": d["bytes"] / max(d["tokens"], 1) for s, d in meta["splits"].items()},
            }
            headline = ("train_tokens", "test_bytes_per_token", "tokens_per_s")
            stage.write_metrics(tmp, metrics, {k: metrics[k] for k in headline})
            tracker.log_metrics(metrics)
    if rt.is_main:
        tracker.log_artifact(output / "tokenizer", "tokenizer")
        tracker.log_artifact(output / "meta.json")
    return runtime.broadcast_object(meta)


def run(cfg: Config, inp: Path, output: Path, rt: runtime.Runtime) -> dict:
    # The tokenizers thread pool would otherwise claim every core in every process.
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // rt.local_world_size)))
    with stage.tracked(STAGE, cfg, [inp / "corpus"], rt) as (tracker, _):
        meta = tokenize(cfg, inp, output, rt, tracker)
    runtime.print0(
        "tokenize: "
        + ", ".join(f"{s} {d['tokens']:,} tokens" for s, d in meta["splits"].items())
        + f" (vocab {meta['vocab_size']}) -> {output}",
        rt=rt,
    )
    return meta


def main(argv=None) -> dict:
    args, cfg = stage.setup(__doc__, STAGE, Config, {"input": "data/prepare_data", "output": "data/tokenize"}, argv)
    inp, output = Path(args.input), Path(args.output)
    check_input(inp)
    return stage.launch(STAGE, lambda rt, stop: run(cfg, inp, output, rt))


if __name__ == "__main__":
    stage.entry(main)
