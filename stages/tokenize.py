"""tokenize: train a byte-level BPE tokenizer on the train split and pack every split into token shards.
With `--tokenizer FOLDER` (a model folder: the base stage's copy of a hub model), encode with that model's
tokenizer instead of training one, so the shards speak the vocabulary of the model that will read them.

Reads data/prepare_data/corpus/ and writes data/tokenize/: the tokenizer in Hugging Face format
(`AutoTokenizer.from_pretrained("data/tokenize/tokenizer")`), token shards per split and meta.json.
The shard format, special tokens and per-split counts are defined once, in stages/common/shards.py;
figures.json holds the counts and bytes per token; metrics.json (DVC metrics) the train tokens and test
bytes per token. What the run measured (seconds to train the tokenizer and to encode, tokens/s, the chunks
it encoded and those it resumed) goes to --measured (measured/tokenize.json in the pipeline), outside the
output, whose bytes depend only on the corpus, the params and the code.

The tokenizer is trained on rank 0 (the `tokenizers` trainer is itself multi-threaded). Encoding is
streamed in bounded memory: each split is cut into chunks of whole lines (at most 64 MiB of text, at
least one per process), the ranks take the chunks in turn, read each line by line, encode batches of
lines and write the ids to one file per chunk; rank 0 then joins the chunks in file order into shards,
one chunk at a time. The output is byte-identical for any number of processes.

Resuming: the tokenizer, the chunk plan and every finished chunk are kept in
checkpoints/tokenize/<hash of params and corpus>/ until the stage publishes. A run stopped mid-way
(SIGTERM, Ctrl-C, SIGKILL, a lost node) and started again keeps them and encodes only the rest, with
output byte-identical to an uninterrupted run; a second run started meanwhile stops with a clear error.
Each finished chunk records the size and sha256 of its ids: a chunk that no longer matches (truncated,
appended to, changed) is named in a warning and encoded again, and the join checks every chunk it reads.

Run:
    python -m stages.tokenize --input data/prepare_data --output data/tokenize [key=value ...]
    python -m stages.tokenize --tokenizer data/base/model --input data/prepare_data --output data/tokenize
    torchrun --nproc-per-node 2 -m stages.tokenize --input data/prepare_data --output data/tokenize
    snakemake --cores all tokenize            # or: dvc repro tokenize
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import itertools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.common import atomic, ckpt, config, digest, environment, registry, runtime, shards, stage
from stages.common.tracking.tracker import Tracker

STAGE = "tokenize"
SPLITS = ("train", "val", "test")
# The most text one unit of resumable work holds (PIPELINE_TOKENIZE_CHUNK_BYTES overrides it).
CHUNK_BYTES = 64 << 20
JOIN_TOKENS = 1 << 20  # ids read at a time when chunks are joined into shards


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


def min_train_bytes(cfg: Config) -> int:
    """The least train text that can teach the configured vocabulary. A byte-level BPE starts from 256 byte
    symbols and the special tokens and learns one merge per further token; a merge needs a pair seen
    min_frequency times and turns each of those pairs into one symbol, so learning every merge takes at
    least (vocab_size - base) x min_frequency bytes. On less (an empty split: none) the trainer stops early
    and the stage would publish a smaller vocabulary than params.yaml asks for. Never less than one byte."""
    return max(1, (cfg.vocab_size - 256 - len(shards.SPECIAL_TOKENS)) * cfg.min_frequency)


# The least text of the val and test splits. A loss over ~1,000 tokens has a standard error near 0.1 nats
# (per-token losses spread over ~3 nats), already too coarse to compare runs by; 4 KiB of text is about
# that many tokens of a byte-level BPE (3-4 bytes per token).
MIN_HELD_OUT_BYTES = 4096
UTF8_BLOCK = 16 << 20  # bytes read at a time when a split is checked for UTF-8


def utf8_error(path: Path) -> str | None:
    """Where `path` stops being UTF-8 ("byte N (b'...')"), or None; read in blocks of bounded size."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(UTF8_BLOCK)
            held = decoder.getstate()[0]  # (the start of a character cut by the previous block)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                return f"byte {offset - len(held) + e.start} ({e.object[e.start : e.start + 1]!r})"
            if not block:
                return None
            offset += len(block)


def check_input(folder: Path, cfg: Config, trains: bool = True) -> None:
    """Fail before any compute when prepare_data's output is missing or incomplete, a split is empty or
    too small to train (`trains`: a tokenizer is trained on it) or measure on, or its text is not UTF-8."""
    for split in SPLITS:
        for name in (f"{split}.txt", f"{split}.docs.npy"):
            if not (folder / "corpus" / name).is_file():
                raise config.UserError(
                    f"tokenize: {folder / 'corpus' / name} not found; run prepare_data first "
                    f"(snakemake prepare_data / dvc repro prepare_data) or pass --input"
                )
    more = "give prepare_data more text (a larger corpus, or a higher prepare_data.max_bytes) and run it again"
    for split in SPLITS:
        path = folder / "corpus" / f"{split}.txt"
        size = path.stat().st_size
        if split == "train" and trains:
            least = min_train_bytes(cfg)
            used = min(size, cfg.train_max_bytes or size)
            why = (
                f"at least {least:,} to learn tokenize.vocab_size {cfg.vocab_size} ((vocab_size - 258) x "
                f"min_frequency {cfg.min_frequency})"
            )
            if used < least and size >= least:
                raise config.UserError(
                    f"tokenize: tokenize.train_max_bytes {cfg.train_max_bytes:,} trains on fewer bytes of {path} "
                    f"than the tokenizer needs: {why}; raise train_max_bytes (0: the whole split)"
                )
            if size < least:
                raise config.UserError(
                    f"tokenize: {path} holds {size:,} bytes of text, the tokenizer needs {why}; {more}, "
                    "or lower tokenize.vocab_size"
                )
        elif split != "train" and size < MIN_HELD_OUT_BYTES:
            raise config.UserError(
                f"tokenize: {path} holds {size:,} bytes of text, fewer than the {MIN_HELD_OUT_BYTES:,} a {split} "
                f"split needs for a loss to compare runs by; raise prepare_data.{split}_fraction (or max_bytes), or "
                "give it a larger corpus, and run it again"
            )
        where = utf8_error(path)
        if where:
            raise config.UserError(
                f"tokenize: {path} is not valid UTF-8 at {where}; re-encode it as UTF-8 (e.g. iconv -f latin1 "
                f"-t utf-8) or run prepare_data again, which writes UTF-8"
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


@dataclass(frozen=True)
class Vocabulary:
    """The tokenizer the shards are encoded with (a `tokenizers.Tokenizer`), the special tokens that end a
    document and pad a batch, and how its Hugging Face form is saved beside the shards."""

    tok: object
    eos: str
    pad: str
    save: object  # save(folder): the tokenizer in Hugging Face format


@functools.cache
def given_vocabulary(folder: Path) -> Vocabulary:
    """A model's own tokenizer (its fast, `tokenizers`-backed form), checked before any compute (loaded
    once per process: the check's is the run's)."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise config.UserError(
            f"tokenize: --tokenizer {folder}: cannot load its tokenizer ({str(e).splitlines()[0]})"
        ) from None
    if not hf.is_fast:
        raise config.UserError(
            f"tokenize: --tokenizer {folder}: its tokenizer has no fast (tokenizers) form to encode with"
        )
    if hf.eos_token is None:
        raise config.UserError(f"tokenize: --tokenizer {folder}: its tokenizer has no eos token to end documents with")
    return Vocabulary(hf.backend_tokenizer, hf.eos_token, hf.pad_token or hf.eos_token, hf.save_pretrained)


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


def line_start(path: Path, pos: int) -> int:
    """The byte offset of the first line of `path` starting at or after `pos`."""
    size = path.stat().st_size
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


def plan_chunks(path: Path, world_size: int) -> list[tuple[int, int]]:
    """The split's units of work: byte ranges [start, end) of whole lines, at most CHUNK_BYTES each and at
    least one per process, in file order."""
    size = path.stat().st_size
    cap = int(os.environ.get("PIPELINE_TOKENIZE_CHUNK_BYTES", CHUNK_BYTES))
    n = max(world_size, -(-size // cap))
    cuts = sorted({line_start(path, size * k // n) for k in range(n)} | {size})
    return list(itertools.pairwise(cuts))


def read_batches(txt: Path, offsets: np.ndarray, start: int, end: int, batch_lines: int):
    """Yield (lines, ends_document, bytes) for the whole lines in [start, end), `batch_lines` at a time.
    `offsets` are the documents' start offsets (a memory map): a line ends a document where the next
    document starts, or at the end of the file."""
    size = txt.stat().st_size
    nxt = int(np.searchsorted(offsets, start, side="right"))  # the next document start after `start`

    def next_end() -> int:
        return int(offsets[nxt]) if nxt < len(offsets) else size

    with open(txt, "rb") as src:
        src.seek(start)
        pos = batch_start = start
        lines, ends_doc = [], []
        while pos < end:
            raw = src.readline()
            pos += len(raw)
            while next_end() < pos:
                nxt += 1
            lines.append(raw.decode("utf-8"))
            ends_doc.append(pos == next_end())
            if len(lines) == batch_lines or pos >= end:
                yield lines, ends_doc, pos - batch_start
                lines, ends_doc, batch_start = [], [], pos


def encode_range(
    vocab: Vocabulary, txt: Path, offsets: np.ndarray, start: int, end: int, out: Path, cfg: Config, bar
) -> tuple[dict, dict]:
    """Encode the lines in [start, end) into the raw id file `out`; an eos follows each document end.
    Returns the chunk's counts and the size and sha256 of the ids written.

    The encoder releases the GIL, so one worker thread encodes the next batch while this thread turns
    the previous one into ids on disk."""
    tok = vocab.tok
    eos = tok.token_to_id(vocab.eos)
    dtype = shards.dtype_for(tok.get_vocab_size())
    counts = {"tokens": 0, "bytes": end - start, "words": 0, "documents": 0}
    written = hashlib.sha256()

    def write(encoded, lines, ends_doc, nbytes):
        pieces = []
        for enc, is_end in zip(encoded, ends_doc, strict=True):
            pieces.append(enc.ids)
            if is_end:
                pieces.append((eos,))
        ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=dtype)
        ids.tofile(fh)
        written.update(ids.tobytes())
        counts["tokens"] += len(ids)
        counts["documents"] += sum(ends_doc)
        counts["words"] += sum(len(line.split()) for line in lines)
        bar.update(nbytes)

    with open(out, "wb") as fh, ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for lines, ends_doc, nbytes in read_batches(txt, offsets, start, end, cfg.batch_lines):
            future = pool.submit(tok.encode_batch_fast, lines, add_special_tokens=False)
            if pending:
                write(pending[0].result(), *pending[1:])
            pending = (future, lines, ends_doc, nbytes)
        if pending:
            write(pending[0].result(), *pending[1:])
    return counts, {"bytes": counts["tokens"] * dtype.itemsize, "sha256": written.hexdigest()}


def trained_vocabulary(cfg: Config, corpus: Path, work: Path, rt: runtime.Runtime) -> Vocabulary:
    """The tokenizer of this run: trained on rank 0 and kept in `work`, or the one an interrupted run kept."""
    from tokenizers import Tokenizer

    saved = work / "tokenizer.json"
    if rt.is_main and not saved.is_file():
        tok = train_tokenizer(corpus, cfg, show_progress=os.isatty(2))
        tok.save(str(work / ".tokenizer.json.tmp"))
        os.replace(work / ".tokenizer.json.tmp", saved)
    runtime.barrier()
    tok = Tokenizer.from_file(str(saved))
    return Vocabulary(tok, shards.EOS_TOKEN, shards.PAD_TOKEN, lambda folder: save_hf_tokenizer(tok, folder))


def chunk_done(work: Path, split: str, k: int) -> bool:
    return (work / f"{split}-{k:06d}.json").is_file()


def chunk_problem(work: Path, split: str, k: int) -> str | None:
    """Why a finished chunk cannot be joined as it is: its ids differ in size or sha256 from what the run
    that encoded it recorded (truncated, appended to, changed), or its record is unreadable. None when intact."""
    name = work / f"{split}-{k:06d}"
    try:
        record = json.loads(name.with_suffix(".json").read_text())
        want, _ = record["ids"], record["counts"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its record {name.name}.json is unreadable"
    ids = name.with_suffix(".ids")
    if not ids.is_file():
        return f"{ids.name} is missing"
    if ids.stat().st_size != want["bytes"]:
        return f"{ids.name} holds {ids.stat().st_size:,} bytes, its record says {want['bytes']:,}"
    if digest.sha256_file(ids) != want["sha256"]:
        return f"{ids.name} differs from its record (sha256)"
    return None


def chunks_to_encode(work: Path, chunks: list) -> list:
    """The chunks not finished, and the finished ones that are damaged (named in a warning; encoded again)."""
    todo = []
    for chunk in chunks:
        split, k = chunk[:2]
        if chunk_done(work, split, k):
            why = chunk_problem(work, split, k)
            if why is None:
                continue
            print(f"warning: tokenize: encoding chunk {split}-{k:06d} of {work} again: {why}", flush=True)
        todo.append(chunk)
    return todo


def encode_chunks(vocab: Vocabulary, cfg: Config, corpus: Path, work: Path, rt: runtime.Runtime) -> dict:
    """Encode every chunk of every split not encoded yet (the plan is made once, by the first run: any
    later world size follows it). Chunk k of a split becomes <split>-<k>.ids, then <split>-<k>.json with
    its counts: a chunk is done when its .json exists. Returns this process's tokens and seconds."""
    if rt.is_main and not (work / "plan.json").is_file():
        plan = {split: plan_chunks(corpus / f"{split}.txt", rt.world_size) for split in SPLITS}
        atomic.write_json(work / "plan.json", plan)
    runtime.barrier()
    plan = json.loads((work / "plan.json").read_text())
    chunks = [(split, k, a, b) for split in SPLITS for k, (a, b) in enumerate(plan[split])]
    # Rank 0 decides what is left (a rank looking later would see chunks finished meanwhile).
    todo = runtime.broadcast_object(chunks_to_encode(work, chunks) if rt.is_main else None)
    if len(todo) < len(chunks):
        runtime.print0(f"tokenize: resuming, {len(chunks) - len(todo)} of {len(chunks)} chunks already encoded", rt=rt)
    t0, tokens = time.perf_counter(), 0
    total = sum(b - a for _, _, a, b in todo)
    with runtime.progress(total=total, unit="B", unit_scale=True, desc="tokenize", rt=rt) as bar:
        offsets = {split: np.load(corpus / f"{split}.docs.npy", mmap_mode="r") for split in SPLITS}
        for split, k, start, end in todo[rt.rank :: rt.world_size]:
            txt = corpus / f"{split}.txt"
            name = work / f"{split}-{k:06d}"
            name.with_suffix(".json").unlink(missing_ok=True)  # (a damaged chunk's record goes first)
            counts, ids = encode_range(vocab, txt, offsets[split], start, end, work / f".{name.name}.tmp", cfg, bar)
            os.replace(work / f".{name.name}.tmp", name.with_suffix(".ids"))
            atomic.write_json(name.with_suffix(".json"), {"counts": counts, "ids": ids})
            tokens += counts["tokens"]
    return {
        "tokens": tokens,
        "seconds": time.perf_counter() - t0,
        "chunks": len(chunks),
        "resumed": len(chunks) - len(todo),
    }


def tokenize(
    cfg: Config,
    inp: Path,
    output: Path,
    measured: Path,
    rt: runtime.Runtime,
    tracker: Tracker,
    work: Path,
    given: Path | None = None,
) -> dict:
    corpus = inp / "corpus"
    if rt.is_main:
        work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    vocabulary = given_vocabulary(given) if given else trained_vocabulary(cfg, corpus, work, rt)
    tok = vocabulary.tok
    train_s = time.perf_counter() - t0
    vocab = tok.get_vocab_size()
    dtype = shards.dtype_for(vocab)
    encoded = runtime.gather_objects(encode_chunks(vocabulary, cfg, corpus, work, rt))
    encode_s = max(e["seconds"] for e in encoded)

    meta = None
    with atomic.folder(output, rt) as tmp:
        if rt.is_main:
            vocabulary.save(tmp / "tokenizer")
            meta = {
                "format": shards.FORMAT,
                "dtype": dtype.name,
                "vocab_size": vocab,
                "bos_token_id": tok.token_to_id(vocabulary.eos),
                "eos_token_id": tok.token_to_id(vocabulary.eos),
                "pad_token_id": tok.token_to_id(vocabulary.pad),
                "shard_tokens": cfg.shard_tokens,
                **({"tokenizer": str(given), **registry.origin(given)} if given else {}),
                "splits": {},
                **environment.output_record(STAGE),
            }
            plan = json.loads((work / "plan.json").read_text())
            missing = [f"{sp}-{k:06d}" for sp in SPLITS for k in range(len(plan[sp])) if not chunk_done(work, sp, k)]
            if missing:
                raise RuntimeError(f"tokenize: chunks {', '.join(missing[:5])} of {work} were not encoded")
            for split in SPLITS:
                # the chunks in file order, one at a time: the split never is in memory whole
                writer = shards.ShardWriter(tmp, split, dtype, cfg.shard_tokens)
                counts = {"tokens": 0, "bytes": 0, "words": 0, "documents": 0}
                for k in range(len(plan[split])):
                    name = work / f"{split}-{k:06d}"
                    record, joined = json.loads(name.with_suffix(".json").read_text()), hashlib.sha256()
                    with open(name.with_suffix(".ids"), "rb") as fh:
                        while len(ids := np.fromfile(fh, dtype=dtype, count=JOIN_TOKENS)):
                            joined.update(ids.tobytes())
                            writer.write(ids)
                    if joined.hexdigest() != record["ids"]["sha256"]:
                        raise RuntimeError(
                            f"tokenize: chunk {name} changed after it was checked (sha256 differs from its "
                            "record); run the stage again to encode it afresh"
                        )
                    for key, value in record["counts"].items():
                        counts[key] += value
                meta["splits"][split] = {**counts, "shards": writer.close()}
            atomic.write_json(tmp / "meta.json", meta)
            n_tokens = sum(e["tokens"] for e in encoded)
            speed = {
                "tokenizer_train_s": train_s,
                "encode_s": encode_s,
                "tokens_per_s": n_tokens / max(encode_s, 1e-9),  # encoded by this run (a resumed one skips some)
                "resumed_chunks": encoded[0]["resumed"],
                "chunks": encoded[0]["chunks"],  # (at least one per process)
            }
            metrics = {
                "vocab_size": vocab,
                **{f"{s}_{k}": v for s, d in meta["splits"].items() for k, v in d.items() if k != "shards"},
                **{f"{s}_bytes_per_token": d["bytes"] / max(d["tokens"], 1) for s, d in meta["splits"].items()},
            }
            headline = ("train_tokens", "test_bytes_per_token")
            stage.write_metrics(tmp, metrics, {k: metrics[k] for k in headline})
            tracker.log_metrics(metrics | speed)
    if rt.is_main:
        stage.write_measured(measured, output, speed)
        tracker.log_artifact(measured)
        tracker.log_artifact(output / "tokenizer", "tokenizer")
        tracker.log_artifact(output / "meta.json")
    return runtime.broadcast_object(meta)


def run(cfg: Config, inp: Path, output: Path, measured: Path, rt: runtime.Runtime, given: Path | None = None) -> dict:
    # The tokenizers thread pool would otherwise claim every core in every process.
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // rt.local_world_size)))
    digest = stage.inputs_hash([inp / "corpus", *([given] if given else [])], rt)
    # The work folder (tokenizer, chunk plan, encoded chunks) of these params and corpus: a run stopped
    # mid-way, even by SIGKILL, keeps what it finished, and the next run picks up from there.
    import tokenizers

    # (chunks encoded by another version of the tokenizers library are not mixed with this one's)
    key = {"tokenizers": tokenizers.__version__}
    with (
        stage.checkpoints(STAGE, cfg, digest, rt, **key) as work,
        stage.tracked(STAGE, cfg, digest, rt) as (tracker, _),
    ):
        meta = tokenize(cfg, inp, output, measured, rt, tracker, work.path, given)
        if rt.is_main:
            ckpt.discard(work.path)
    runtime.print0(
        "tokenize: "
        + ", ".join(f"{s} {d['tokens']:,} tokens" for s, d in meta["splits"].items())
        + f" (vocab {meta['vocab_size']}) -> {output}",
        rt=rt,
    )
    return meta


def main(argv=None) -> dict:
    paths = {"input": "data/prepare_data", "output": "data/tokenize", "tokenizer": ""}
    args, cfg = stage.setup(__doc__, STAGE, Config, paths, argv)
    inp, output = Path(args.input), Path(args.output)
    given = Path(args.tokenizer) if args.tokenizer else None
    check_input(inp, cfg, trains=given is None)
    if given:
        given_vocabulary(given)  # (one line on a folder without a usable tokenizer, before any compute)
    measured = Path(args.measured)
    return stage.launch(STAGE, lambda rt, stop: run(cfg, inp, output, measured, rt, given))


if __name__ == "__main__":
    stage.entry(main)
