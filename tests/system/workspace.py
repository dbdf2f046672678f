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
from shared_run import BIN, MIRROR, ROOT, copy_of_run, env_for, make_clone, output_hashes, sh, shared_run

from pipelines import dag

__all__ = ["BIN", "MIRROR", "ROOT", "copy_of_run", "env_for", "make_clone", "output_hashes", "sh"]


def local_run() -> Path:
    """The clone in which `snakemake --profile pipelines/profiles/local` ran the ci pipeline: the run
    shared with make test (tests/shared_run.py), made by the first test that asks; only read."""
    return shared_run()


def assert_same_outputs(ours: Path, theirs: Path) -> None:
    """Two runs of the ci pipeline made the same outputs: every out's md5 in the two dvc.lock files is the
    same, with no exception, and DVC finds `ours` as its dvc.lock records it. (What the stages
    measured, measured/*, DVC records without caching: timings that differ from run to run by nature,
    outside the outs, not compared.) Prints the count of outs and of identical ones."""
    import yaml

    def outs(root: Path) -> dict[str, str]:
        lock = yaml.safe_load((root / "dvc.lock").read_text())
        found = {}
        for entry in lock["stages"].values():
            for out in entry.get("outs", ()):
                if not out["path"].startswith(f"{dag.MEASURED_DIR}/"):
                    found[out["path"]] = out.get("md5")
        return found

    a, b = outs(ours), outs(theirs)
    assert sorted(a) == sorted(b), f"the same outs in both dvc.lock files: {sorted(set(a) ^ set(b))}"
    same = [p for p in a if a[p] == b[p]]
    print(f"dvc.lock outs: {len(a)}, identical: {len(same)}")
    assert len(same) == len(a), f"outs that differ from the local run's: {sorted(set(a) - set(same))}"
    # (the other run, the shared one, is only read; its files are checked against its records in make test)
    assert "Data and pipelines are up to date" in sh("dvc status", ours), f"dvc status in {ours}"


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (system packages and daemons)")


def need_commands(*names: str, why: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.skip(f"{why}: {', '.join(missing)} not installed (bash tests/system/install.sh)")
