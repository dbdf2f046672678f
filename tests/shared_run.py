"""The ci pipeline, run once per tree and shared by every test that only reads its outputs.

`make test` and `make test-system` are two pytest runs; both read one run of the ci pipeline
(`snakemake --profile pipelines/profiles/local`, as `make run` starts it, in a fresh clone of the working
tree) instead of running it themselves. The run lives in .cache/ci-run/<key>/, where the key hashes
everything the run's outputs follow from: every file of the working tree that a clone holds, the installed
packages and Python, the data mirror's bytes, the CPU (kernels follow its flags) and the PIPELINE_*
environment. A change to any of them is a new key, so a stale run is never read; the first test that asks
makes it (the others, in any pytest-xdist worker or the later pytest run, wait on a file lock), and older
keys are removed then.

    shared_run()          the run's clone: read it, never write to it (checked on every call)
    copy_of_run(dest)     a private copy for a test that changes the pipeline (paths inside moved to dest)
    snakemake_output()    what the run's snakemake printed (which rules ran)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_mirror = os.environ.get("PIPELINE_DATA_MIRROR")
MIRROR = Path(_mirror) if _mirror else ROOT.parent / "shared" / "data"
BIN = Path(sys.executable).parent
CACHE = ROOT / ".cache" / "ci-run"
# A fixed date: clones of the same tree get the same commit id, which stages record in their outputs.
FIXED_DATE = "2000-01-01T00:00:00Z"


def env_for(cwd: Path, **extra) -> dict:
    """The environment of a pipeline command in `cwd`: the project's Python first on PATH, the mirror,
    the embedded MLflow store of `cwd` and one MLflow group per invocation unless `extra` sets them."""
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
    """Run a shell command in `cwd` (env_for); its stdout and stderr. check: fail with its output."""
    proc = subprocess.run(
        cmd, shell=True, cwd=cwd, env=env_for(cwd, **extra), capture_output=True, text=True, timeout=timeout
    )
    out = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, f"`{cmd}` failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def tree_files(root: Path = ROOT) -> list[str]:
    """The files a clone of `root` holds: tracked and new ones, ignored ones left out."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.split(b"\0")
    return sorted(name.decode() for name in listed if name and (root / name.decode()).is_file())


def make_clone(dest: Path) -> Path:
    """The working tree (tracked and new files) as a fresh git repository at dest, with the ci preset."""
    for name in tree_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    sh(
        "git init -q && python -m pipelines.preset ci && git add -A && "
        "git -c user.name=ci -c user.email=ci@localhost commit -qm clone",
        dest,
        GIT_AUTHOR_DATE=FIXED_DATE,
        GIT_COMMITTER_DATE=FIXED_DATE,
    )
    return dest


def _cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(next((ln for ln in lines if ln.startswith(k)), "") for k in ("model name", "flags"))


def tree_key(root: Path = ROOT, mirror: Path = MIRROR) -> str:
    """The hash of what the ci run's outputs follow from (see the module docstring)."""
    h = hashlib.sha256()

    def add(*parts) -> None:
        for part in parts:
            h.update(part if isinstance(part, bytes) else str(part).encode())
            h.update(b"\0")

    for name in tree_files(root):
        add("file", name, hashlib.sha256((root / name).read_bytes()).digest())
    add("python", sys.version, sys.executable)
    for dist in sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()):
        add("package", dist)
    add("mirror", mirror.resolve())
    for path in sorted(p for p in mirror.rglob("*") if p.is_file()):
        add(path.relative_to(mirror), hashlib.sha256(path.read_bytes()).digest())
    add("cpu", _cpu())
    for key in sorted(k for k in os.environ if k.startswith("PIPELINE_") and k != "PIPELINE_DATA_MIRROR"):
        add("env", key, os.environ[key])
    return h.hexdigest()[:20]


def output_hashes(root: Path, folders=("data", "reports")) -> dict[str, str]:
    """sha256 of every file under the pipeline's output folders, by path relative to root."""
    out = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and path.name != ".snakemake_timestamp":
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# What the tests read of a run beyond its outputs: DVC's record and the MLflow store.
RECORDS = ("dvc.lock", "mlflow.db", "params.yaml")


def _fingerprint(clone: Path) -> dict[str, str]:
    records = {name: hashlib.sha256((clone / name).read_bytes()).hexdigest() for name in RECORDS}
    return {**output_hashes(clone), **records}


def _make(entry: Path) -> None:
    from filelock import FileLock

    with FileLock(str(entry.parent / "prune.lock")):  # other keys: runs of trees that are gone
        for other in entry.parent.iterdir():
            if other.name.split(".")[0] not in (entry.name, "prune"):
                if other.is_dir():
                    shutil.rmtree(other, ignore_errors=True)
                else:
                    other.unlink(missing_ok=True)
    shutil.rmtree(entry, ignore_errors=True)  # an earlier attempt that did not finish
    (entry / "run").mkdir(parents=True)
    clone = make_clone(entry / "run")
    out = sh("snakemake --profile pipelines/profiles/local --cores 2", clone, timeout=2400)
    (entry / "snakemake.out").write_text(out)
    (entry / "fingerprint.json").write_text(json.dumps(_fingerprint(clone), indent=0, sort_keys=True))
    (entry / "done").touch()


def shared_run() -> Path:
    """The clone in which the ci pipeline ran for this tree; made by the first caller (any process),
    waited for by the others. Fails if a test wrote into it."""
    from filelock import FileLock

    CACHE.mkdir(parents=True, exist_ok=True)
    entry = CACHE / tree_key()
    with FileLock(str(CACHE / f"{entry.name}.lock")):
        if not (entry / "done").exists():
            _make(entry)
    clone = entry / "run"
    recorded = json.loads((entry / "fingerprint.json").read_text())
    now = _fingerprint(clone)
    changed = sorted(p for p in recorded.keys() | now.keys() if recorded.get(p) != now.get(p))
    assert not changed, (
        f"the shared ci run in {clone} was changed by a test ({changed[:10]}); tests only read it "
        f"(copy_of_run gives a private copy). Remove {entry} to make it again"
    )
    return clone


def snakemake_output() -> str:
    """What `snakemake` printed while it made the shared run."""
    return (shared_run().parent / "snakemake.out").read_text()


def copy_of_run(dest: Path) -> Path:
    """A private copy of the shared run at dest (which must not exist): files with their times (Snakemake
    compares them), and the MLflow store's artifact locations moved from the shared run to dest."""
    source = shared_run()
    subprocess.run(["cp", "-a", str(source), str(dest)], check=True)
    relocate_store(dest / "mlflow.db", source.as_posix(), dest.as_posix())
    return dest


def relocate_store(db: Path, old: str, new: str) -> None:
    """Replace the folder `old` by `new` in every text value of an MLflow sqlite store (artifact
    locations are absolute paths and file URIs)."""
    with sqlite3.connect(db) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for _, column, kind, *_ in con.execute(f'PRAGMA table_info("{table}")').fetchall():
                if any(t in kind.upper() for t in ("CHAR", "TEXT", "CLOB")):
                    con.execute(
                        f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) WHERE instr("{column}", ?) > 0',
                        (old, new, old),
                    )
