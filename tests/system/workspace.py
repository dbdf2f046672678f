"""What the system tests share: a scratch clone of the working tree with the ci preset, shell commands
with the project's Python first on PATH, and content hashes of a run's outputs.

The system tests need root and Debian packages; tests/system/install.sh installs them (make test-system
runs it first). Each test skips with the reason when what it needs is missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_mirror = os.environ.get("PIPELINE_DATA_MIRROR")
MIRROR = Path(_mirror) if _mirror else ROOT.parent / "shared" / "data"
BIN = Path(sys.executable).parent


def env_for(cwd: Path, **extra) -> dict:
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "PIPELINE_DATA_MIRROR": str(MIRROR),
        "PYTHONPATH": str(cwd),
        **extra,
    }
    for key in ("MLFLOW_TRACKING_URI", "PIPELINE_RUN_ID", "PIPELINE_SNAKEMAKE"):
        if key not in extra:
            env.pop(key, None)
    return env


def sh(cmd: str, cwd: Path, timeout: int = 1200, check: bool = True, **extra) -> str:
    proc = subprocess.run(
        cmd, shell=True, cwd=cwd, env=env_for(cwd, **extra), capture_output=True, text=True, timeout=timeout
    )
    out = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, f"`{cmd}` failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def make_clone(dest: Path) -> Path:
    """The working tree (tracked and new files) as a fresh git repository, with the ci preset."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    # A fixed date: clones of the same tree get the same commit id, which stages record in their outputs.
    sh(
        "git init -q && python -m pipelines.preset ci && git add -A && "
        "git -c user.name=ci -c user.email=ci@localhost commit -qm clone",
        dest,
        GIT_AUTHOR_DATE="2000-01-01T00:00:00Z",
        GIT_COMMITTER_DATE="2000-01-01T00:00:00Z",
    )
    return dest


def local_run(tmp_path_factory) -> Path:
    """A clone in which `snakemake --profile pipelines/profiles/local` ran the ci pipeline once; made by the
    first test that asks (the others, in any xdist worker, wait for it) and only read afterwards."""
    from conftest import made_once

    def make(clone: Path) -> None:
        make_clone(clone)
        sh("snakemake --profile pipelines/profiles/local --cores 2", clone)

    return made_once(tmp_path_factory, "local-run", make)


def output_hashes(root: Path, folders=("data", "reports")) -> dict[str, str]:
    """sha256 of every file under the pipeline's output folders, by path relative to root."""
    out = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and path.name != ".snakemake_timestamp":
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# Files whose bytes differ between two runs of the same code on the same data: the measured timings in
# them. JSON files among them must still agree once those keys are dropped.
TIMINGS = {
    "tokens_per_s",
    "tokens_per_cpu_s",
    "mfu",
    "encode_s",
    "tokenizer_train_s",
    "train_s",
    "train_s_per_seed",
    "wall_s",
    "peak_memory_mb",
    "peak_mb",
    "activation_mb",
    "ours",  # memory_study's rows: ratios of measured memory and speed
}  # measured, not computed: they vary from run to run
UNSTABLE = {
    "data/tokenize/metrics.json": "tokens_per_s",
    "data/tokenize/figures.json": "encode_s, tokenizer_train_s, tokens_per_s",
    "data/pretrain/metrics.json": "tokens_per_s, mfu",
    "data/pretrain/figures.json": "tokens_per_s, mfu",
    "data/eval_perplexity/pretrain/figures.json": "tokens_per_s per context",
    "data/extend_context/figures.json": "tokens_per_s per fine-tune",
    "data/finetune_qlora/nf4/figures.json": "tokens_per_s, peak_memory_mb",
    "data/finetune_qlora/none/figures.json": "tokens_per_s, peak_memory_mb",
    "data/eval_perplexity/extend_context/figures.json": "tokens_per_s per context",
    "data/train_gnn/figures.json": "train_s_per_seed, wall_s",
    "data/memory_study/figures.json": "peak_mb, activation_mb, tokens_per_s, tokens_per_cpu_s per technique",
    "data/eval_perplexity/pretrain/metrics.json": "tokens_per_s per context",
    "data/eval_perplexity/pretrain/table.csv": "its tokens_per_s rows",
    "data/extend_context/metrics.json": "tokens_per_s per fine-tune",
    "data/finetune_qlora/nf4/metrics.json": "tokens_per_s, peak_memory_mb",
    "data/finetune_qlora/none/metrics.json": "tokens_per_s, peak_memory_mb",
    "data/eval_perplexity/extend_context/metrics.json": "tokens_per_s per context",
    "data/eval_perplexity/extend_context/table.csv": "its tokens_per_s rows",
    "data/train_gnn/metrics.json": "train_s_per_seed, wall_s",
    "data/train_gnn/seeds.json": "train_s per seed",
    "data/memory_study/metrics.json": "peak_mb, activation_mb, tokens_per_s, tokens_per_cpu_s per technique",
    "data/memory_study/table.csv": "its measured columns",
    "data/memory_study/results.json": "rows of measured ratios",
    "data/memory_study/plots/memory.png": "a plot of measured memory",
    "reports/results.json": "every stage's metrics, timings included",
    "reports/results.md": "every stage's metrics, timings included",
}


def without_keys(value, keys):
    """value (JSON) without the given keys, at any depth."""
    if isinstance(value, dict):
        return {k: without_keys(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without_keys(v, keys) for v in value]
    return value


def assert_same_outputs(ours: Path, theirs: Path, differing_keys: dict[str, tuple] | None = None) -> None:
    """The files under data/ and reports/ of two runs of the ci pipeline are the same, byte for byte,
    except the files in UNSTABLE; those of them that are JSON agree once their timings are dropped.
    differing_keys {key: (ours, theirs)}: a JSON key whose values are known to differ between the two runs
    (the git commit of a clone with an edited file); a file that differs only there passes."""
    import json

    differing_keys = differing_keys or {}

    def load(root: Path, path: str):
        return json.loads((root / path).read_text())

    a, b = output_hashes(ours), output_hashes(theirs)
    assert sorted(a) == sorted(b), "the same files in data/ and reports/"
    differ = sorted(p for p in a if a[p] != b[p])
    for path in [p for p in differ if p.endswith(".json")] if differing_keys else []:
        x, y = load(ours, path), load(theirs, path)
        for key, values in differing_keys.items():
            if key in x or key in y:
                assert (x.get(key), y.get(key)) == values, f"{path}: {key} is {x.get(key)!r}, {y.get(key)!r}"
        if path not in UNSTABLE:
            known = set(differing_keys)
            assert without_keys(x, known) == without_keys(y, known), f"{path} differs from the local run's"
            differ.remove(path)
    assert set(differ) <= set(UNSTABLE), f"files differ from the local run: {sorted(set(differ) - set(UNSTABLE))}"
    assert len(a) > len(UNSTABLE) + 20, "most outputs compared byte for byte"
    for path in differ:
        if path.startswith("data/") and path.endswith(".json"):
            x, y = (without_keys(load(root, path), TIMINGS | set(differing_keys)) for root in (ours, theirs))
            assert x == y, f"{path} differs beyond its timings"


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (system packages and daemons)")


def need_commands(*names: str, why: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.skip(f"{why}: {', '.join(missing)} not installed (bash tests/system/install.sh)")
