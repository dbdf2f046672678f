"""The ci pipeline, run once per tree and shared by every test that only reads its outputs.

`make test` and `make test-system` are two pytest runs; both read one run of the ci pipeline
(`snakemake --profile pipelines/profiles/local`, as `make run` starts it, in a fresh clone of the working
tree) instead of running it themselves. The run lives in .cache/ci-run/<key>/, where the key hashes
everything the run's outputs follow from: every file of the working tree that a clone holds, the installed
packages and Python, the data mirror's bytes, the CPU (kernels follow its flags) and the PIPELINE_*
environment. A change to any of them is a new key, so a stale run is never read; the first test that asks
makes it (the others, in any pytest-xdist worker or the later pytest run, wait on a file lock), and older
keys are removed then, the lines of the key that changed written to .cache/ci-run/replaced.log.

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
import site
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_mirror = os.environ.get("PIPELINE_DATA_MIRROR")
# Unset, a sibling mirror folder of the checkout if one is kept there (as the Makefile and .ci/run do).
MIRROR = Path(_mirror) if _mirror else ROOT.parent / "shared" / "data"
MIRROR_MISSING = (
    f"no data mirror at {MIRROR}: build one with `make mirror DIR=<folder>` and set PIPELINE_DATA_MIRROR=<folder>"
    if _mirror
    else "no data mirror (PIPELINE_DATA_MIRROR is unset): build one with `make mirror DIR=<folder>` and set "
    "PIPELINE_DATA_MIRROR=<folder>"
)
BIN = Path(sys.executable).parent
CACHE = ROOT / ".cache" / "ci-run"
# A fixed date: clones of the same tree get the same commit id, which stages record in their outputs.
FIXED_DATE = "2000-01-01T00:00:00Z"


def require_mirror() -> Path:
    """The data mirror; without one, the calling test is skipped with the one line that says how to make it."""
    if not (MIRROR / "tinyshakespeare" / "input.txt").is_file():
        import pytest

        pytest.skip(MIRROR_MISSING)
    return MIRROR


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


# Commands of the tests that took long, with the test that ran them (.ci/summary.py prints the slowest).
COMMAND_LOG = ROOT / ".cache" / "ci" / "commands.tsv"
LONG_COMMAND_S = 20


def sh(cmd: str, cwd: Path, timeout: int = 1200, check: bool = True, **extra) -> str:
    """Run a shell command in `cwd` (env_for); its stdout and stderr. check: fail with its output."""
    started = time.monotonic()
    proc = subprocess.run(
        cmd, shell=True, cwd=cwd, env=env_for(cwd, **extra), capture_output=True, text=True, timeout=timeout
    )
    seconds = time.monotonic() - started
    if seconds > LONG_COMMAND_S:
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" (", 1)[0]
        COMMAND_LOG.parent.mkdir(parents=True, exist_ok=True)
        with open(COMMAND_LOG, "a") as log:  # (one short line per write: whole lines from any worker)
            log.write(f"{seconds:.0f}\t{test}\t{' '.join(cmd.split())[:160]}\n")
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


def key_parts(root: Path = ROOT, mirror: Path = MIRROR) -> list[str]:
    """What the ci run's outputs follow from (see the module docstring), one line each."""
    parts = [f"file {name} {hashlib.sha256((root / name).read_bytes()).hexdigest()}" for name in tree_files(root)]
    parts.append(f"python {sys.version} {sys.executable}")
    # The environment's installed distributions: from its site-packages folders only, not from whatever
    # else an import put on sys.path in this process (setuptools adds its vendored packages).
    installed = importlib.metadata.distributions(path=site.getsitepackages())
    parts += sorted({f"package {d.metadata['Name']}=={d.version}" for d in installed})
    parts.append(f"mirror {mirror.resolve()}")
    for path in sorted(p for p in mirror.rglob("*") if p.is_file()):
        parts.append(f"mirror-file {path.relative_to(mirror)} {hashlib.sha256(path.read_bytes()).hexdigest()}")
    parts.append(f"cpu {hashlib.sha256(_cpu().encode()).hexdigest()}")
    for key in sorted(k for k in os.environ if k.startswith("PIPELINE_") and k != "PIPELINE_DATA_MIRROR"):
        parts.append(f"env {key}={os.environ[key]}")
    return parts


def tree_key(root: Path = ROOT, mirror: Path = MIRROR, parts: list[str] | None = None) -> str:
    """The hash of key_parts: a new value whenever anything the run follows from changes."""
    parts = key_parts(root, mirror) if parts is None else parts
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


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
    return {**output_hashes(clone, ("data", "reports", "measured")), **records}


def _make(entry: Path, parts: list[str]) -> None:
    from filelock import FileLock

    with FileLock(str(entry.parent / "prune.lock")):  # other keys: runs of trees that are gone
        for other in entry.parent.iterdir():
            if other.name.split(".")[0] in (entry.name, "prune", "replaced"):
                continue
            if (other / "key.txt").is_file():  # why it is replaced, for whoever wonders at the time it took
                before = set((other / "key.txt").read_text().splitlines())
                changed = sorted(before ^ set(parts), key=lambda line: line.split(" ")[:2])
                with open(entry.parent / "replaced.log", "a") as log:
                    log.write(f"{other.name} -> {entry.name}:\n" + "".join(f"  {line}\n" for line in changed[:40]))
            if other.is_dir():
                shutil.rmtree(other, ignore_errors=True)
            else:
                other.unlink(missing_ok=True)
    shutil.rmtree(entry, ignore_errors=True)  # an earlier attempt that did not finish
    (entry / "run").mkdir(parents=True)
    (entry / "key.txt").write_text("\n".join(parts) + "\n")
    clone = make_clone(entry / "run")
    out = sh("snakemake --profile pipelines/profiles/local --cores 2", clone, timeout=2400)
    (entry / "snakemake.out").write_text(out)
    (entry / "fingerprint.json").write_text(json.dumps(_fingerprint(clone), indent=0, sort_keys=True))
    (entry / "done").touch()


def shared_run() -> Path:
    """The clone in which the ci pipeline ran for this tree; made by the first caller (any process),
    waited for by the others. Fails if a test wrote into it; skips the test where there is no data mirror
    (the run reads it)."""
    from filelock import FileLock

    require_mirror()
    CACHE.mkdir(parents=True, exist_ok=True)
    parts = key_parts()
    entry = CACHE / tree_key(parts=parts)
    with FileLock(str(CACHE / f"{entry.name}.lock")):
        if not (entry / "done").exists():
            _make(entry, parts)
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


if __name__ == "__main__":  # .ci/run prints the key before each test phase: the same tree, the same run
    print(f"shared ci run key: {tree_key()}")
