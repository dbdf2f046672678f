"""prepare_data: materialize every raw input of the pipeline into data/prepare_data/, verified.

Owns all raw inputs: the pretraining corpus (split into train/val/test), the instruction data for
fine-tuning, and the Planetoid graphs. Known files are verified against their published sha256; a
missing file or a checksum mismatch stops before anything is written.

Where inputs come from, in order: the mirror directory in `PIPELINE_DATA_MIRROR` (laid out like
`shared/data`: tinyshakespeare/, wikitext-2-raw/, alpaca-5k/, planetoid/), then the public internet
(TinyShakespeare and Planetoid from their canonical GitHub files, WikiText-2, Alpaca and any other
dataset from the Hugging Face datasets hub).

Run:
    python -m stages.prepare_data --output data/prepare_data [key=value ...]
    torchrun --nproc-per-node 2 -m stages.prepare_data --output data/prepare_data
    snakemake --cores all prepare_data        # or: dvc repro prepare_data

Output (data/prepare_data/):
    corpus/{train,val,test}.txt       UTF-8 text, documents back to back, each ending in a newline
    corpus/{train,val,test}.docs.npy  int64 byte offset of each document's start in the .txt
    instructions.jsonl                records with string fields instruction, input, output
    planetoid/<Name>/raw/ind.*        the raw files PyG's Planetoid(root, name) reads
    meta.json                         sources, per-split counts and the sha256 of every file written
    figures.json                      bytes, lines and documents per split; instruction records
    metrics.json                      train bytes, instruction records (DVC metrics)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.common import atomic, ckpt, config, runtime, sources, stage, track

STAGE = "prepare_data"
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Config:
    corpus: str
    text_field: str
    val_fraction: float
    test_fraction: float
    max_bytes: int
    instructions: str
    instructions_max_records: int
    graphs: tuple[str, ...]

    def __post_init__(self):
        if not (
            0 < self.val_fraction < 1 and 0 < self.test_fraction < 1 and self.val_fraction + self.test_fraction < 1
        ):
            raise ValueError("val_fraction and test_fraction must each be in (0, 1) and sum to less than 1")
        if self.max_bytes < 0 or self.instructions_max_records < 0:
            raise ValueError("max_bytes and instructions_max_records must be >= 0 (0 means no limit)")
        bad = [g for g in self.graphs if g not in sources.PLANETOID_NAMES]
        if bad:
            raise ValueError(f"graphs: unknown graph {bad[0]!r}; valid: {', '.join(sources.PLANETOID_NAMES)}")


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
            got = ckpt.sha256_file(src)
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
            got = ckpt.sha256_file(dest)
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


def split_text_file(path: Path, cfg: Config) -> dict[str, list[str]]:
    """One document per split: contiguous slices of the file's lines by byte share."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"corpus {path} is empty (0 bytes); point prepare_data.corpus at a text file with content")
    bounds = ((1 - cfg.val_fraction - cfg.test_fraction) * size, (1 - cfg.test_fraction) * size)
    parts = {s: [] for s in SPLITS}
    offset = 0
    with open(path, "rb") as fh:
        for raw in fh:
            split = "train" if offset < bounds[0] else "val" if offset < bounds[1] else "test"
            parts[split].append(decode_line(raw, str(path), offset))
            offset += len(raw)
    if not any(line.strip() for line in parts["train"] + parts["val"] + parts["test"]):
        raise DataError(f"corpus {path} holds only whitespace; point prepare_data.corpus at real text")
    return {s: ["".join(lines)] for s, lines in parts.items()}


def split_records(docs: list[str], cfg: Config, name: str) -> dict[str, list[str]]:
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"corpus {name} has no non-empty documents in field '{cfg.text_field}'")
    n_train = int(len(docs) * (1 - cfg.val_fraction - cfg.test_fraction))
    n_val = int(len(docs) * cfg.val_fraction)
    return {"train": docs[:n_train], "val": docs[n_train : n_train + n_val], "test": docs[n_train + n_val :]}


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty (0 bytes); give a .jsonl file with one JSON record per line")
    records = []
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
            records.append(rec)
    return records


def load_corpus(cfg: Config, workdir: Path) -> tuple[dict[str, list[str]], dict]:
    """Documents per split, and a description of the source (with the sha256 of the raw files)."""
    name = cfg.corpus
    if name == "tinyshakespeare":
        raw = workdir / "tinyshakespeare.txt"
        sha = fetch(sources.TINYSHAKESPEARE, raw)
        return split_text_file(raw, cfg), {"corpus": name, "sha256": {"input.txt": sha}}
    if name == "wikitext2":
        docs, shas = {}, {}
        for split, raw in sources.WIKITEXT2.items():
            dest = workdir / Path(raw.mirror).name
            try:
                shas[dest.name] = fetch(raw, dest)
            except DataError as e:
                if mirror_dir() is not None:
                    raise DataError(
                        f"wikitext2 {split} split: {e} (or unset it to read wikitext-2-raw-v1 from the hub)"
                    ) from None
                ds = load_hub(sources.WIKITEXT2_HUB[0], name=sources.WIKITEXT2_HUB[1])
                hub_split = {"val": "validation"}.get(split, split)
                # Hub rows are the raw file's lines; blank lines are stored as "".
                dest.write_text("".join(t if t else "\n" for t in ds[hub_split]["text"]), encoding="utf-8")
                shas[dest.name] = ckpt.sha256_file(dest)
            docs[split] = [decode_line(dest.read_bytes(), str(dest), 0)]
        return docs, {"corpus": name, "sha256": shas}
    if name.startswith("hub:"):
        dataset, _, conf = name[4:].partition(":")
        ds = load_hub(dataset, **({"name": conf} if conf else {}))
        if cfg.text_field not in ds[next(iter(ds))].column_names:
            raise DataError(f"hub dataset {dataset} has no column '{cfg.text_field}'; set prepare_data.text_field")
        if {"validation", "test"} <= set(ds):
            docs = {
                s: list(ds[h][cfg.text_field]) for s, h in zip(SPLITS, ("train", "validation", "test"), strict=True)
            }
            docs = {s: [d for d in v if d.strip()] for s, v in docs.items()}
        else:
            docs = split_records(list(ds["train"][cfg.text_field]), cfg, name)
        return docs, {"corpus": name, "sha256": {}}
    path = Path(name)
    if not path.is_file():
        raise DataError(
            f"prepare_data.corpus: {name!r} is neither a known corpus (tinyshakespeare, wikitext2), "
            "a hub:<dataset id>, nor an existing .txt/.jsonl file"
        )
    sha = ckpt.sha256_file(path)
    if path.suffix == ".jsonl":
        recs = read_jsonl(path, (cfg.text_field,))
        return split_records([r[cfg.text_field] for r in recs], cfg, name), {"corpus": name, "sha256": {path.name: sha}}
    return split_text_file(path, cfg), {"corpus": name, "sha256": {path.name: sha}}


def truncate(text: str, max_bytes: int) -> str:
    """At most `max_bytes` UTF-8 bytes of `text`, cut after a newline (never mid-line)."""
    data = text.encode("utf-8")
    if max_bytes == 0 or len(data) <= max_bytes:
        return text
    cut = data.rfind(b"\n", 0, max_bytes)
    return data[: cut + 1].decode("utf-8") if cut >= 0 else ""


def write_corpus(docs: dict[str, list[str]], cfg: Config, out: Path) -> dict:
    out.mkdir()
    stats = {}
    for split in SPLITS:
        budget = cfg.max_bytes
        offsets, chunks, size = [], [], 0
        for doc in docs[split]:
            doc = doc if doc.endswith("\n") else doc + "\n"
            if budget:
                doc = truncate(doc, budget - size)
                if not doc:
                    break
            offsets.append(size)
            chunks.append(doc)
            size += len(doc.encode("utf-8"))
        text = "".join(chunks)
        if not text.strip():
            whole = sum(len(d.encode("utf-8")) for part in docs.values() for d in part)
            if any(d.strip() for d in docs[split]):  # max_bytes cut it away (it keeps whole lines)
                fix = f"raise prepare_data.max_bytes (now {cfg.max_bytes}) above its first line"
            elif whole < 1000:
                fix = f"the corpus holds only {whole} bytes: use a larger corpus"
            elif split == "train":
                fix = "lower val_fraction/test_fraction"
            else:
                fix = f"raise prepare_data.{split[:4]}_fraction"
            raise DataError(f"the {split} split of {cfg.corpus} is empty; {fix}")
        (out / f"{split}.txt").write_text(text, encoding="utf-8")
        np.save(out / f"{split}.docs.npy", np.asarray(offsets, dtype=np.int64))
        stats[split] = {"bytes": size, "documents": len(offsets), "lines": text.count("\n")}
    return stats


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
    with tempfile.TemporaryDirectory(prefix="prepare_data-") as work, atomic.folder(output) as tmp:
        work = Path(work)
        docs, source = load_corpus(cfg, work)
        meta = {"corpus": {**source, "splits": write_corpus(docs, cfg, tmp / "corpus")}}
        if cfg.instructions != "none":
            meta["instructions"] = write_instructions(cfg, tmp, work)
        meta["graphs"] = {"names": list(cfg.graphs), "raw_sha256": write_graphs(cfg, tmp)}
        meta["files"] = {str(p.relative_to(tmp)): ckpt.sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        atomic.write_json(tmp / "meta.json", meta)
        figures = metrics_of(meta)
        headline = {k: figures[k] for k in ("train_bytes", "instruction_records") if k in figures}
        stage.write_metrics(tmp, figures, headline)
    return meta


def metrics_of(meta: dict) -> dict:
    """The stage's DVC/MLflow metrics: size of every split and of the instruction data."""
    out = {f"{s}_{k}": v for s, d in meta["corpus"]["splits"].items() for k, v in d.items()}
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
    with track.start_run(STAGE, config.as_dict(cfg), "", rt) as tracker:
        meta = prepare(cfg, output)
        tracker.set_tags({"inputs_hash": ckpt.checkpoint_key({}, json.dumps(meta["corpus"]["sha256"], sort_keys=True))})
        tracker.log_metrics(metrics_of(meta))
        tracker.log_artifact(output / "meta.json")
    return meta


if __name__ == "__main__":
    stage.entry(main)
