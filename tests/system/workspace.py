"""What the system tests share: a scratch clone of the working tree with the ci preset, shell commands
with the project's Python first on PATH, and content hashes of a run's outputs.

The system tests need root and Debian packages; tests/system/install.sh installs them (make test-system
runs it first). Each test skips with the reason when what it needs is missing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from shared_run import BIN, MIRROR, ROOT, env_for, make_clone, output_hashes, sh, shared_run

__all__ = ["BIN", "MIRROR", "ROOT", "env_for", "make_clone", "output_hashes", "sh"]


def local_run() -> Path:
    """The clone in which `snakemake --profile pipelines/profiles/local` ran the ci pipeline: the run
    shared with make test (tests/shared_run.py), made by the first test that asks; only read."""
    return shared_run()


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
