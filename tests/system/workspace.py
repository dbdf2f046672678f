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


_local_runs: dict[str, Path] = {}


def local_run(tmp_path_factory) -> Path:
    """A clone in which `snakemake --profile pipelines/profiles/local` ran the ci pipeline once; made on
    first use and shared by the tests of one pytest session (they only read it)."""
    if "ci" not in _local_runs:
        clone = make_clone(tmp_path_factory.mktemp("local-run"))
        sh("snakemake --profile pipelines/profiles/local --cores 2", clone)
        _local_runs["ci"] = clone
    return _local_runs["ci"]


def output_hashes(root: Path, folders=("data", "reports")) -> dict[str, str]:
    """sha256 of every file under the pipeline's output folders, by path relative to root."""
    out = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and path.name != ".snakemake_timestamp":
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (system packages and daemons)")


def need_commands(*names: str, why: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.skip(f"{why}: {', '.join(missing)} not installed (bash tests/system/install.sh)")
