"""prepare_data: materialize every raw input of the pipeline into data/prepare_data/, verified.

Owns all raw inputs: the pretraining corpus (split into train/val/test), the instruction data for
fine-tuning, and the Planetoid graphs. Known files are verified against their published sha256; a
missing file or a checksum mismatch stops before anything is written.

The corpus streams, line by line and document by document, from the source into the split files, so
memory stays flat whatever its size: a text file is cut into train/val/test by byte share, a .jsonl
file's documents (the `text_field` of each record; every record is checked first, in a first pass) by
position, a hub dataset row by row in the datasets library's streaming mode. `max_bytes` keeps whole lines
of each split up to that size.

Where inputs come from, in order: the mirror directory in `PIPELINE_DATA_MIRROR` (tinyshakespeare/,
wikitext-2-raw/, alpaca-5k/, planetoid/ as in stages/common/sources.py; `python -m pipelines.mirror DIR`
builds one), then the public internet (TinyShakespeare, the Alpaca 5k subset and Planetoid from their
pinned GitHub files; WikiText-2, the whole Alpaca and any other dataset from the Hugging Face datasets hub).

Run:
    python -m stages.prepare_data --output data/prepare_data [key=value ...]
    torchrun --nproc-per-node 2 -m stages.prepare_data --output data/prepare_data
    snakemake --cores all prepare_data        # or: dvc repro prepare_data

Output (data/prepare_data/):
    corpus/{train,val,test}.txt       UTF-8 text, documents back to back, each ending in a newline
    corpus/{train,val,test}.docs.npy  int64 byte offset of each document's start in the .txt
    instructions.jsonl                records with string fields instruction, input, output
    planetoid/<Name>/raw/ind.*        the raw files PyG's Planetoid(root, name) reads
    benchmarks/wikitext-2-raw/wiki.test.raw   WikiText-2's raw test split as published (`benchmarks`), for
                                      eval_harness's wikitext task
    meta.json                         sources, per-split counts, the sha256 of every file written, the
                                      environment the run ran in
    figures.json                      bytes, lines and documents per split; instruction records
    metrics.json                      train bytes, instruction records (DVC metrics)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.common import atomic, ckpt, config, digest, environment, runtime, sources, stage
from stages.common.tracking import runs

STAGE = "prepare_data"
SPLITS = ("train", "val", "test")
LINES = re.compile(r"[^\n]*\n|[^\n]+\Z")
# Evaluation sets copied verbatim (what eval_harness reads): name -> (split files, folder in the output).
BENCHMARKS = {"wikitext2": ({"test": sources.WIKITEXT2["test"]}, "benchmarks/wikitext-2-raw")}
PIECE_BYTES = 16 << 10  # in a mixture, longer documents are interleaved in pieces of whole lines this size


@dataclass(frozen=True)
class Config:
    corpus: str | tuple[dict, ...]  # one source, or a mixture: [{source: ..., weight: ...}, ...]
    text_field: str
    val_fraction: float
    test_fraction: float
    max_bytes: int
    instructions: str
    instructions_max_records: int
    graphs: tuple[str, ...]
    benchmarks: tuple[str, ...] = ("wikitext2",)

    def __post_init__(self):
        if not (
            0 < self.val_fraction < 1 and 0 < self.test_fraction < 1 and self.val_fraction + self.test_fraction < 1
        ):
            raise ValueError("val_fraction and test_fraction must each be in (0, 1) and sum to less than 1")
        if self.max_bytes < 0 or self.instructions_max_records < 0:
            raise ValueError("max_bytes and instructions_max_records must be >= 0 (0 means no limit)")
        if not isinstance(self.corpus, str):
            mixture_sources(self.corpus)  # checks the mixture's entries
        bad = [g for g in self.graphs if g not in sources.PLANETOID_NAMES]
        if bad:
            raise ValueError(f"graphs: unknown graph {bad[0]!r}; valid: {', '.join(sources.PLANETOID_NAMES)}")
        bad = [b for b in self.benchmarks if b not in BENCHMARKS]
        if bad:
            raise ValueError(f"benchmarks: unknown benchmark {bad[0]!r}; valid: {', '.join(BENCHMARKS)}")


def mixture_sources(entries) -> list[tuple[str, float]]:
    """[(source, weight)] of a mixture; a malformed entry or a weight <= 0 is a ValueError naming it."""
    if not entries:
        raise ValueError("corpus: a mixture needs at least one {source: ..., weight: ...} entry")
    out = []
    for i, entry in enumerate(entries):
        where = f"corpus[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"source", "weight"}:
            raise ValueError(f"{where} must be a mapping with the keys source and weight, got {entry!r}")
        source, weight = entry["source"], entry["weight"]
        if not isinstance(source, str) or not source:
            raise ValueError(f"{where}.source must be a corpus name or path, got {source!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{where}.weight (source {source}) must be a number > 0, got {weight!r}")
        out.append((source, float(weight)))
    names = [s for s, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"corpus: a mixture names each source once, got {names}")
    return out


class DataError(config.UserError):
    """A raw input is missing, corrupt or unusable; the message says what was expected and how to fix it."""


# ---------------------------------------------------------------------------------------------- fetch
def mirror_dir() -> Path | None:
    value = os.environ.get("PIPELINE_DATA_MIRROR")
    return Path(value) if value else None


def fetch(raw: sources.RawFile, dest: Path) -> str:
    """Copy `raw` from the mirror or download it to `dest`, verifying its sha256. Returns the sha256."""
    mirror = mirror_dir()
    where = []
    if mirror is not None:
        src = mirror / raw.mirror
        if src.is_file():
            got = digest.sha256_file(src)
            if got != raw.sha256:
                raise DataError(
                    f"checksum mismatch for {src}: sha256 {got}, expected {raw.sha256} ({raw.size} bytes); "
                    f"replace it with the published file{' from ' + raw.url if raw.url else ''}"
                )
            shutil.copyfile(src, dest)
            return got
        where.append(f"not in the mirror ({src})")
    if raw.url:
        try:
            with urllib.request.urlopen(raw.url, timeout=60) as resp, open(dest, "wb") as out:
                shutil.copyfileobj(resp, out)
        except OSError as e:
            where.append(f"download from {raw.url} failed ({e})")
        else:
            got = digest.sha256_file(dest)
            if got != raw.sha256:
                raise DataError(f"checksum mismatch for the download of {raw.url}: sha256 {got}, expected {raw.sha256}")
            return got
    hint = f"set PIPELINE_DATA_MIRROR to a directory holding {raw.mirror} (sha256 {raw.sha256}, {raw.size} bytes)"
    raise DataError(f"{Path(raw.mirror).name}: {'; '.join(where) or 'no mirror set and no public URL'}; {hint}")


def load_hub(dataset: str, **kwargs):
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is pinned in requirements.lock
        raise DataError(f"reading {dataset} from the hub needs the `datasets` package: {e}") from None
    try:
        return datasets.load_dataset(dataset, **kwargs)
    except Exception as e:
        raise DataError(
            f"could not load {dataset!r} from the Hugging Face datasets hub ({type(e).__name__}: {e}); "
            "check the id and your connection, or use a local file / PIPELINE_DATA_MIRROR"
        ) from None


# --------------------------------------------------------------------------------------------- corpus
def decode_line(raw: bytes, name: str, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{name} is not valid UTF-8: byte {offset + e.start} ({raw[e.start : e.start + 1]!r}); "
            "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


class SplitWriter:
    """One split's text file and document offsets, written as documents stream in, line by line: each
    document ends with a newline; with a byte budget (max_bytes) the split keeps whole lines up to it
    and ends at the first line that does not fit. Memory holds one line, whatever the corpus size."""

    def __init__(self, folder: Path, split: str, budget: int):
        self.split, self.budget = split, budget
        self.text = open(folder / f"{split}.txt", "wb")  # noqa: SIM115 - closed by close()
        self.offsets_path = folder / f".{split}.docs.raw"
        self.offsets = open(self.offsets_path, "wb")  # noqa: SIM115 - closed by close()
        self.size = self.documents = self.lines = 0
        self.full = self.in_doc = self.doc_cut = False
        self.seen_text = self.kept_text = False  # a non-blank line offered / kept

    def start(self) -> None:
        self.in_doc = self.doc_cut = False  # the offset is taken at the document's first kept line

    def add(self, line: str) -> None:
        if line.strip():
            self.seen_text = True
        if self.full or self.doc_cut:
            return
        data = (line if line.endswith("\n") else line + "\n").encode("utf-8")
        if self.budget and self.size + len(data) > self.budget:
            # a document keeps its lines that fit; one whose first line does not fit ends the split
            self.doc_cut = True
            self.full = not self.in_doc
            return
        if not self.in_doc:
            self.offsets.write(np.int64(self.size).tobytes())
            self.documents += 1
            self.in_doc = True
        self.text.write(data)
        self.size += len(data)
        self.lines += 1
        self.kept_text = self.kept_text or bool(line.strip())

    def add_document(self, doc: str) -> None:
        self.start()
        for line in LINES.findall(doc):  # lines end at "\n" only (str.splitlines also cuts at \r, \f, ...)
            self.add(line)

    def close(self) -> None:
        self.text.close()
        self.offsets.close()

    def finish(self) -> dict:
        self.close()
        offsets = np.memmap(self.offsets_path, dtype=np.int64, mode="r") if self.documents else np.zeros(0, np.int64)
        np.save(self.text.name.removesuffix(".txt") + ".docs.npy", np.asarray(offsets))
        del offsets
        self.offsets_path.unlink()
        return {"bytes": self.size, "documents": self.documents, "lines": self.lines}


def check_splits(writers: dict[str, SplitWriter], name: str, cfg: Config, whole: int) -> None:
    """Every split of corpus `name` must hold text: else one error naming the setting to change."""
    if not any(w.seen_text for w in writers.values()):
        raise DataError(f"corpus {name} holds only whitespace; point prepare_data.corpus at real text")
    for split, w in writers.items():
        if w.kept_text:
            continue
        if w.seen_text:  # max_bytes cut it away (it keeps whole lines)
            fix = f"raise prepare_data.max_bytes (now {cfg.max_bytes}) above its first line"
        elif whole < 1000:
            fix = f"the corpus holds only {whole} bytes: use a larger corpus"
        elif split == "train":
            fix = "lower val_fraction/test_fraction"
        else:
            fix = f"raise prepare_data.{split[:4]}_fraction"
        raise DataError(f"the {split} split of {name} is empty; {fix}")


def split_text_file(path: Path, cfg: Config, writers: dict[str, SplitWriter]) -> int:
    """One document per split: contiguous runs of the file's lines by byte share. Returns the file's size."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"corpus {path} is empty (0 bytes); point prepare_data.corpus at a text file with content")
    bounds = ((1 - cfg.val_fraction - cfg.test_fraction) * size, (1 - cfg.test_fraction) * size)
    offset = 0
    for w in writers.values():
        w.start()
    with open(path, "rb") as fh:
        for raw in fh:
            split = "train" if offset < bounds[0] else "val" if offset < bounds[1] else "test"
            writers[split].add(decode_line(raw, str(path), offset))
            offset += len(raw)
    return size


def split_documents(docs, count: int, writers: dict[str, SplitWriter], cfg: Config, name: str) -> int:
    """Documents (an iterable, read once) by position: the first share to train, then val, then test;
    blank documents are skipped and `count` is the number of the others. Returns their bytes."""
    if not count:
        raise DataError(f"corpus {name} has no non-empty documents in field '{cfg.text_field}'")
    n_train = int(count * (1 - cfg.val_fraction - cfg.test_fraction))
    n_val = int(count * cfg.val_fraction)
    whole, i = 0, 0
    for doc in docs:
        if not doc.strip():
            continue
        split = "train" if i < n_train else "val" if i < n_train + n_val else "test"
        writers[split].add_document(doc)
        whole += len(doc.encode("utf-8"))
        i += 1
    return whole


def iter_jsonl(path: Path, required: tuple[str, ...]):
    """The records of a .jsonl file, one at a time, each checked: one clear error naming the line."""
    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty (0 bytes); give a .jsonl file with one JSON record per line")
    offset = 0
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            line = decode_line(raw, str(path), offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {n} is not valid JSON ({e.msg}); each line must be one JSON object"
                ) from None
            missing = (
                [k for k in required if not isinstance(rec.get(k), str)] if isinstance(rec, dict) else list(required)
            )
            if missing:
                raise DataError(f"{path}: line {n} lacks string field(s) {', '.join(missing)}")
            yield rec


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    return list(iter_jsonl(path, required))


def write_source(name: str, cfg: Config, workdir: Path, writers: dict[str, SplitWriter]) -> tuple[int, dict]:
    """Stream corpus `name` into the split writers. Returns (its bytes, its description with the sha256
    of its raw files)."""
    if name == "tinyshakespeare":
        raw = workdir / "tinyshakespeare.txt"
        source = {"corpus": name, "sha256": {"input.txt": fetch(sources.TINYSHAKESPEARE, raw)}}
        return split_text_file(raw, cfg, writers), source
    if name == "wikitext2":
        source, whole = {"corpus": name, "sha256": {}}, 0
        for split, raw in sources.WIKITEXT2.items():
            dest = workdir / Path(raw.mirror).name
            source["sha256"][dest.name] = fetch_wikitext2(split, raw, dest)
            writers[split].start()  # each split file is one document
            with open(dest, "rb") as fh:
                offset = 0
                for line in fh:
                    writers[split].add(decode_line(line, str(dest), offset))
                    offset += len(line)
            whole += offset
        return whole, source
    if name.startswith("hub:"):
        return write_hub_corpus(name, cfg, writers), {"corpus": name, "sha256": {}}
    path = Path(name)
    if not path.is_file():
        raise DataError(
            f"prepare_data.corpus: {name!r} is neither a known corpus (tinyshakespeare, wikitext2), "
            "a hub:<dataset id>, nor an existing .txt/.jsonl file"
        )
    source = {"corpus": name, "sha256": {path.name: digest.sha256_file(path)}}
    if path.suffix == ".jsonl":
        field = cfg.text_field
        count = sum(1 for r in iter_jsonl(path, (field,)) if r[field].strip())  # checks every record first
        docs = (r[field] for r in iter_jsonl(path, (field,)))
        return split_documents(docs, count, writers, cfg, name), source
    return split_text_file(path, cfg, writers), source


def write_split_files(name: str, cfg: Config, workdir: Path, out: Path, budget: int) -> tuple[dict, dict]:
    """Corpus `name` into out/{split}.txt and .docs.npy, checked. Returns (per-split counts, description)."""
    out.mkdir()
    writers = {split: SplitWriter(out, split, budget) for split in SPLITS}
    try:
        whole, source = write_source(name, cfg, workdir, writers)
        stats = {split: w.finish() for split, w in writers.items()}
    finally:
        for w in writers.values():
            w.close()
    check_splits(writers, name, cfg, whole)
    return stats, source


def documents(folder: Path, split: str):
    """The documents of a split written by SplitWriter, in order, as (bytes, lines); a document longer
    than PIECE_BYTES (a text file's split is one document) comes in pieces of whole lines of at most
    that size (or one line), each a document of its own."""
    txt = folder / f"{split}.txt"
    offsets = np.load(folder / f"{split}.docs.npy", mmap_mode="r")
    size = txt.stat().st_size
    with open(txt, "rb") as fh:
        for k in range(len(offsets)):
            left = (int(offsets[k + 1]) if k + 1 < len(offsets) else size) - int(offsets[k])
            piece, piece_bytes = [], 0
            while left > 0:
                raw = fh.readline()
                left -= len(raw)
                if piece and piece_bytes + len(raw) > PIECE_BYTES:
                    yield piece_bytes, piece
                    piece, piece_bytes = [], 0
                piece.append(raw.decode("utf-8"))
                piece_bytes += len(raw)
            if piece:
                yield piece_bytes, piece


def mix(parts: list[tuple[Path, float]], split: str, writer: SplitWriter) -> list[dict]:
    """Interleave the sources' documents of `split` by weight: the next document always comes from the
    source with the fewest bytes written per unit of weight (the first such source on a tie), and the
    split ends when the source whose turn it is has no document left (or max_bytes is reached), so every
    source holds its weight's share of the split to within one document. Returns each source's counts."""
    streams = [documents(folder, split) for folder, _ in parts]
    counts = [{"bytes": 0, "documents": 0} for _ in parts]
    while not writer.full:
        i = min(range(len(parts)), key=lambda j: (counts[j]["bytes"] / parts[j][1], j))
        doc = next(streams[i], None)
        if doc is None:
            break
        before = (writer.size, writer.documents)
        writer.start()
        for line in doc[1]:
            writer.add(line)
        counts[i]["bytes"] += writer.size - before[0]  # what max_bytes let through
        counts[i]["documents"] += writer.documents - before[1]
    return counts


def write_corpus(cfg: Config, workdir: Path, out: Path) -> tuple[dict, dict]:
    """Stream the corpus (one source, or a mixture of several) into out/{split}.txt and .docs.npy.
    Returns (per-split counts, description of the source(s) with the sha256 of the raw files)."""
    if isinstance(cfg.corpus, str):
        return write_split_files(cfg.corpus, cfg, workdir, out, cfg.max_bytes)
    # A mixture: each source split on its own (in full, in the work folder), then interleaved by weight.
    parts, described = [], []
    for i, (name, weight) in enumerate(mixture_sources(cfg.corpus)):
        folder = workdir / f"source-{i}"
        (workdir / f"raw-{i}").mkdir()
        stats, source = write_split_files(name, cfg, workdir / f"raw-{i}", folder, 0)
        parts.append((folder, weight))
        described.append({**source, "weight": weight, "splits": stats})
    out.mkdir()
    total = sum(w for _, w in parts)
    splits = {}
    for split in SPLITS:
        writer = SplitWriter(out, split, cfg.max_bytes)
        try:
            used = mix(parts, split, writer)
            splits[split] = writer.finish()
        finally:
            writer.close()
        if not writer.kept_text:
            raise DataError(
                f"the {split} split of the mixture is empty; raise prepare_data.max_bytes or use larger sources"
            )
        for source, counts in zip(described, used, strict=True):
            source.setdefault("used", {})[split] = {
                **counts,
                "share": round(counts["bytes"] / max(splits[split]["bytes"], 1), 6),
                "target_share": round(source["weight"] / total, 6),
            }
    sha = {f"{i}:{k}": v for i, d in enumerate(described) for k, v in d["sha256"].items()}
    return splits, {"corpus": "mixture", "sources": described, "sha256": sha}


def fetch_wikitext2(split: str, raw: sources.RawFile, dest: Path) -> str:
    """A WikiText-2 split file from the mirror or its URL, else from the hub (rows are the file's lines)."""
    try:
        return fetch(raw, dest)
    except DataError as e:
        if mirror_dir() is not None:
            raise DataError(
                f"wikitext2 {split} split: {e} (or unset it to read wikitext-2-raw-v1 from the hub)"
            ) from None
    ds = load_hub(sources.WIKITEXT2_HUB[0], name=sources.WIKITEXT2_HUB[1])
    hub_split = {"val": "validation"}.get(split, split)
    with open(dest, "w", encoding="utf-8") as fh:  # the file's blank lines are " \n", stored as ""
        for row in ds[hub_split]:
            fh.write(row["text"] or " \n")
    got = digest.sha256_file(dest)
    if got != raw.sha256:
        raise DataError(
            f"wikitext2 {split} split: the hub's rows ({'/'.join(sources.WIKITEXT2_HUB)}) rebuild a file with sha256 "
            f"{got}, not the published {raw.sha256}; set PIPELINE_DATA_MIRROR to a directory holding {raw.mirror}"
        )
    return got


def write_hub_corpus(name: str, cfg: Config, writers: dict[str, SplitWriter]) -> int:
    """A hub dataset's text column in the datasets library's streaming mode (rows arrive as they are
    read; nothing is downloaded whole): its own train/validation/test splits when it has them, else its
    train split cut by position (streamed twice: once to count the documents)."""
    dataset, _, conf = name[4:].partition(":")
    ds = load_hub(dataset, streaming=True, **({"name": conf} if conf else {}))
    field = cfg.text_field

    def rows(split: str):
        try:
            for row in ds[split]:
                if not isinstance(row.get(field), str):
                    raise DataError(f"hub dataset {dataset} has no text column '{field}'; set prepare_data.text_field")
                yield row[field]
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"reading hub dataset {dataset} ({split}) failed: {type(e).__name__}: {e}") from None

    if "train" not in ds:
        raise DataError(f"hub dataset {dataset} has no train split (it has {', '.join(ds)})")
    if {"validation", "test"} <= set(ds):
        whole = 0
        for split, hub_split in zip(SPLITS, ("train", "validation", "test"), strict=True):
            for text in rows(hub_split):
                if text.strip():
                    writers[split].add_document(text)
                    whole += len(text.encode("utf-8"))
        return whole
    count = sum(1 for text in rows("train") if text.strip())
    return split_documents(rows("train"), count, writers, cfg, name)


# ------------------------------------------------------------------------------- instructions, graphs
def write_instructions(cfg: Config, out: Path, workdir: Path) -> dict:
    keys = ("instruction", "input", "output")
    if cfg.instructions == "alpaca":
        try:
            src = workdir / "alpaca.jsonl"
            fetch(sources.ALPACA_5K, src)
            records, source = read_jsonl(src, keys), "alpaca-5k"
        except DataError:
            if mirror_dir() is not None:
                raise
            records, source = list(load_hub(sources.ALPACA_HUB, split="train")), sources.ALPACA_HUB
    elif cfg.instructions.startswith("hub:"):
        records, source = list(load_hub(cfg.instructions[4:], split="train")), cfg.instructions
        if records and any(not isinstance(records[0].get(k), str) for k in keys):
            raise DataError(f"hub dataset {cfg.instructions[4:]} lacks string fields {', '.join(keys)}")
    else:
        path = Path(cfg.instructions)
        if not path.is_file():
            raise DataError(
                f"prepare_data.instructions: {cfg.instructions!r} is not alpaca, hub:<id>, none "
                "or an existing .jsonl file"
            )
        records, source = read_jsonl(path, keys), str(path)
    if cfg.instructions_max_records:
        records = records[: cfg.instructions_max_records]
    if not records:
        raise DataError(f"instruction data {source} has no records")
    with open(out / "instructions.jsonl", "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps({k: r[k] for k in keys}, ensure_ascii=False) + "\n")
    return {"source": source, "records": len(records)}


def write_benchmarks(cfg: Config, out: Path) -> dict:
    """The evaluation sets of `benchmarks`, byte for byte as published: {path in the output: sha256}."""
    shas = {}
    for name in cfg.benchmarks:
        files, folder = BENCHMARKS[name]
        (out / folder).mkdir(parents=True)
        for split, raw in files.items():
            dest = out / folder / Path(raw.mirror).name
            shas[str(dest.relative_to(out))] = fetch_wikitext2(split, raw, dest)
    return shas


def write_graphs(cfg: Config, out: Path) -> dict:
    shas = {}
    for name in cfg.graphs:
        raw_dir = out / "planetoid" / name / "raw"
        raw_dir.mkdir(parents=True)
        for fname, raw in sources.planetoid_files(name).items():
            shas[f"planetoid/{name}/raw/{fname}"] = fetch(raw, raw_dir / fname)
    return shas


# ----------------------------------------------------------------------------------------------- main
def prepare(cfg: Config, output: Path) -> dict:
    # Downloads and a mixture's per-source splits go beside the output (as big as it), not to /tmp.
    with atomic.scratch(output) as work, atomic.folder(output) as tmp:
        splits, source = write_corpus(cfg, work, tmp / "corpus")
        meta = {"corpus": {**source, "splits": splits}}
        if cfg.instructions != "none":
            meta["instructions"] = write_instructions(cfg, tmp, work)
        meta["graphs"] = {"names": list(cfg.graphs), "raw_sha256": write_graphs(cfg, tmp)}
        meta["benchmarks"] = {"names": list(cfg.benchmarks), "sha256": write_benchmarks(cfg, tmp)}
        meta["files"] = {str(p.relative_to(tmp)): digest.sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta |= environment.output_record(STAGE)
        atomic.write_json(tmp / "meta.json", meta)
        figures = metrics_of(meta)
        headline = {k: figures[k] for k in ("train_bytes", "instruction_records") if k in figures}
        stage.write_metrics(tmp, figures, headline)
    return meta


def metrics_of(meta: dict) -> dict:
    """The stage's DVC/MLflow metrics: size of every split and of the instruction data."""
    out = {f"{s}_{k}": v for s, d in meta["corpus"]["splits"].items() for k, v in d.items()}
    for i, source in enumerate(meta["corpus"].get("sources", ())):
        out |= {f"source{i}_{s}_share": used["share"] for s, used in source["used"].items()}
    if "instructions" in meta:
        out["instruction_records"] = meta["instructions"]["records"]
    return out


def main(argv=None) -> dict:
    args, cfg = stage.setup(__doc__, STAGE, Config, {"output": "data/prepare_data"}, argv)

    def body(rt, stop):
        # Copying and verifying files is rank 0's job; the other ranks learn how it went.
        meta, error = None, None
        if rt.is_main:
            try:
                meta = run_tracked(cfg, Path(args.output), rt)
            except DataError as e:
                error = e
        error = runtime.broadcast_object(error)
        if error:
            raise error
        meta = runtime.broadcast_object(meta)
        sizes = ", ".join(f"{s} {d['bytes']:,} bytes" for s, d in meta["corpus"]["splits"].items())
        runtime.print0(f"prepare_data: {meta['corpus']['corpus']} ({sizes}) -> {args.output}", rt=rt)
        return meta

    return stage.launch(STAGE, body)


def run_tracked(cfg: Config, output: Path, rt: runtime.Runtime) -> dict:
    with runs.start_run(STAGE, config.as_dict(cfg), "", rt, tags=environment.run_tags(STAGE)) as tracker:
        meta = prepare(cfg, output)
        tracker.set_tags({"inputs_hash": ckpt.checkpoint_key({}, json.dumps(meta["corpus"]["sha256"], sort_keys=True))})
        tracker.log_metrics(metrics_of(meta))
        tracker.log_artifact(output / "meta.json")
    return meta


if __name__ == "__main__":
    stage.entry(main)
