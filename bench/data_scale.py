"""The data path at scale: peak memory per process and throughput of prepare_data -> tokenize -> pretrain.

    python bench/data_scale.py [--mb 4096] [--work DIR] [--keep]

Generates a corpus of about `--mb` megabytes deterministically from the shared text data
(PIPELINE_DATA_MIRROR): the lines of TinyShakespeare and of WikiText-2's validation and test files,
pooled; document k of the .jsonl corpus holds `text` = 8 to 64 consecutive pooled lines starting at a
position drawn from numpy's PCG64 generator seeded with 0 (so every run, on any machine, writes the same
bytes). Then, each in its own processes with MLflow tracking off:
  prepare_data   1 process: stream the .jsonl into train/val/test text files
  tokenize       torchrun, 2 processes: train the BPE tokenizer on the first 64 MB of train, encode all
  pretrain       torchrun, 2 processes: a few steps of a small Llama, windows read through memory maps
and prints, per stage: wall time, MB/s of corpus (tokens/s for pretrain) and the peak resident memory of
each of its processes (VmHWM, read from /proc while it runs; goal <= 1.5 GB per process). `--json`
prints the figures as one JSON object. tests/system/test_data_scale.py runs the same path on two small corpora
and checks that peak memory does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ("tinyshakespeare/input.txt", "wikitext-2-raw/wiki.valid.raw", "wikitext-2-raw/wiki.test.raw")
GOAL_MB = 1536
TINY_LLAMA = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.max_position_embeddings=256",
    "context_length=256",
]


def source_lines(mirror: Path) -> list[str]:
    lines = []
    for name in TEXTS:
        path = mirror / name
        if not path.is_file():
            raise SystemExit(
                f"data_scale: {path} not found; build a mirror with `make mirror DIR=<folder>` and set "
                "PIPELINE_DATA_MIRROR=<folder>"
            )
        lines += [ln for ln in path.read_text(encoding="utf-8").splitlines(keepends=True) if ln.strip()]
    return lines


def generate(path: Path, megabytes: float, mirror: Path) -> int:
    """Write the corpus (see the module docstring); returns its size in bytes."""
    lines = source_lines(mirror)
    rng = np.random.Generator(np.random.PCG64(0))
    target, size = int(megabytes * 2**20), 0
    with open(path, "w", encoding="utf-8") as fh:
        while size < target:
            starts = rng.integers(0, len(lines), 64)
            counts = rng.integers(8, 65, 64)
            block = "".join(
                json.dumps({"text": "".join(lines[s : s + n])}, ensure_ascii=False) + "\n"
                for s, n in zip(starts.tolist(), counts.tolist(), strict=True)
            )
            fh.write(block)
            size += len(block.encode("utf-8"))
    return size


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def peak_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run_measured(cmd: list[str], cwd: Path, env: dict) -> dict:
    """Run `cmd`; return its seconds and the peak resident MB of each stage process it started (the
    processes running a stages.* module; torchrun's own agent is left out)."""
    peaks: dict[int, int] = {}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()
    names: dict[int, str] = {}

    def watch():
        while not done.is_set():
            for p in descendants(proc.pid):
                kb = peak_kb(p)
                if kb is not None:
                    peaks[p] = max(peaks.get(p, 0), kb)
                    names[p] = cmdline(p) or names.get(p, "")  # after exec: a forked child shows its parent's first
            time.sleep(0.05)

    t0 = time.perf_counter()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out = proc.communicate()[0]
    seconds = time.perf_counter() - t0
    done.set()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"data_scale: {' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}")
    stage_mb = sorted(
        round(kb / 1024, 1)
        for p, kb in peaks.items()
        if "-m stages." in names[p] and "torch.distributed.run" not in names[p]
    )
    return {"seconds": round(seconds, 2), "peak_rss_mb": stage_mb, "output": out}


def run_path(corpus: Path, work: Path, steps: int = 3, train_max_mb: int = 64) -> dict:
    """prepare_data -> tokenize -> pretrain on `corpus` in `work`; the figures of each stage."""
    shutil.copy(ROOT / "params.yaml", work / "params.yaml")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PIPELINE_TRACKING": "off",
        "PIPELINE_CHECKPOINTS": str(work / "checkpoints"),
    }
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    size_mb = corpus.stat().st_size / 2**20
    figures = {"corpus_mb": round(size_mb, 1)}
    prep = run_measured(
        [py, "-m", "stages.prepare_data", "--output", "data/prepare_data", f"corpus={corpus}", "text_field=text"]
        + ["max_bytes=0", "instructions=none", "graphs=[]"],
        work,
        env,
    )
    tok = run_measured(
        [*torchrun, "-m", "stages.tokenize", "--input", "data/prepare_data", "--output", "data/tokenize"]
        + [f"train_max_bytes={train_max_mb << 20}"],
        work,
        env,
    )
    pre = run_measured(
        [*torchrun, "-m", "stages.pretrain", "--input", "data/tokenize", "--output", "data/pretrain", *TINY_LLAMA]
        + [f"train.steps={steps}", "train.batch_size=8", "train.micro_batch_size=4", "train.warmup_steps=1"]
        + ["train.eval_every=0", "train.checkpoint_every=0", "train.log_every=1"],
        work,
        env,
    )
    meta = json.loads((work / "data/pretrain.measured.json").read_text())  # what the stage measured
    for name, result in (("prepare_data", prep), ("tokenize", tok), ("pretrain", pre)):
        figures[name] = {k: v for k, v in result.items() if k != "output"}
        figures[name]["mb_per_s"] = round(size_mb / result["seconds"], 2)
    figures["pretrain"]["tokens_per_s"] = meta.get("tokens_per_s")
    figures["tokens"] = json.loads((work / "data/tokenize/meta.json").read_text())["splits"]["train"]["tokens"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4096, help="corpus size in MB (default 4096)")
    parser.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mirror = Path(os.environ.get("PIPELINE_DATA_MIRROR") or ROOT.parent / "shared" / "data")
    work = Path(args.work or tempfile.mkdtemp(prefix="data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        corpus = work / "corpus.jsonl"
        t0 = time.perf_counter()
        generate(corpus, args.mb, mirror)
        generate_s = time.perf_counter() - t0
        figures = {**run_path(corpus, work, args.steps), "generate_s": round(generate_s, 1)}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"corpus: {figures['corpus_mb']:,.0f} MB of .jsonl, {figures['tokens']:,} train tokens "
        f"(generated in {generate_s:.0f} s)"
    )
    for name in ("prepare_data", "tokenize", "pretrain"):
        f = figures[name]
        peak = max(f["peak_rss_mb"])
        rate = f"{f['mb_per_s']:8.1f} MB/s" if name != "pretrain" else f"{f['tokens_per_s'] or 0:8,.0f} tok/s"
        print(
            f"{name:13s} {f['seconds']:8.1f} s  {rate}  peak RSS per process (MB): {f['peak_rss_mb']}"
            f"  {'ok' if peak <= GOAL_MB else 'MISSED'} (goal <= {GOAL_MB})"
        )


if __name__ == "__main__":
    main()
