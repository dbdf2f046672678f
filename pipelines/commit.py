"""Record a finished stage in dvc.lock: what every Snakemake rule runs after its stage.

    python -m pipelines.commit <dvc stage>     # dvc commit --force <stage>, one at a time, checked
    python -m pipelines.commit --repair        # restore a damaged dvc.lock from the last good copy

DVC rewrites dvc.lock in place, so a kill in the middle of a commit can leave it empty or cut short;
from then on every `dvc` command fails on it, and each rule's commit with it. Here every commit runs
under one lock file (DVC also locks the repository; parallel rules wait their turn instead of
failing), between two checks of dvc.lock:
  - before: a damaged dvc.lock (see `lock_problem`: unparsable, not DVC's format, a record cut short,
    stages of the good copy missing) is restored from `.snakemake/dvc.lock.good`, with a warning (the
    stage whose commit was cut short then shows as changed, and re-runs);
  - after: the committed dvc.lock is kept as the new good copy.
A failed commit prints DVC's own error and exits non-zero: the rule fails in the open, never silently.
The Snakefile calls `repair()` when it loads, so a damaged dvc.lock never reaches `dvc status` either.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pipelines import timebudget
from pipelines.dag import parse_yaml
from stages.common import contract, timing

LOCK_FILE = Path("dvc.lock")
GOOD_COPY = Path(".snakemake/dvc.lock.good")
COMMIT_LOCK = Path(".snakemake/dvc-commit.lock")
PIPELINE_LOCK = Path(".snakemake/pipeline.lock")
_held_pipeline_lock = None  # the open file whose flock this process holds until it exits


HASH = re.compile(r"[0-9a-f]{32}(\.dir)?")


def _entry_problem(entry) -> bool:
    """A dep/out record without its path, content hash or size (a record cut short)."""
    return not (
        isinstance(entry, dict)
        and isinstance(entry.get("path"), str)
        and HASH.fullmatch(str(entry.get("md5", "")))
        and isinstance(entry.get("size"), int)
    )


def lock_problem(path: Path = LOCK_FILE) -> str | None:
    """Why dvc.lock cannot be used, or None; a missing file is fine (nothing committed yet). DVC writes
    it in place, in its order (cmd, deps, params, outs per stage), so a file cut short mostly still parses
    as YAML: besides DVC's own schema, every stage must end with its outputs, and every dep and output
    record must be whole."""
    if not path.exists():
        return None
    try:
        data = parse_yaml(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        return f"it does not parse ({str(e).splitlines()[0]})"
    if not data:
        return "it holds no stages"
    try:
        from dvc.schema import COMPILED_LOCKFILE_SCHEMA

        COMPILED_LOCKFILE_SCHEMA(data)
    except Exception as e:  # voluptuous' errors, whatever their class
        return f"it is not in DVC's lock format ({str(e).splitlines()[0][:200]})"
    if not isinstance(data.get("stages"), dict) or not data["stages"]:
        return "it holds no stages"
    for name, entry in data["stages"].items():
        if not isinstance(entry, dict):
            return f"the entry of stage {name} is incomplete (cut short?)"
        records = [*(entry.get("deps") or []), *(entry.get("outs") or [])]
        if not entry.get("outs") or any(_entry_problem(r) for r in records):
            return f"the entry of stage {name} is incomplete (cut short?)"
    return None


def lost_stages(path: Path = LOCK_FILE, good: Path = GOOD_COPY) -> list[str]:
    """Stages of the pipeline recorded in the good copy but missing from dvc.lock: what a file cut
    between two stages loses."""
    if not (path.exists() and good.exists()):
        return []
    from pipelines.dag import load_table

    names = {name for st in load_table().values() for name, _ in st.instances()}
    ours = set((parse_yaml(path.read_text()) or {}).get("stages") or {})
    theirs = set((parse_yaml(good.read_text()) or {}).get("stages") or {})
    return sorted((theirs - ours) & names)


def _copy(src: Path, dest: Path) -> None:
    """Copy through a temporary file and rename: readers see the old file or the new one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dest)


@contextlib.contextmanager
def commit_lock():
    """One commit (or repair) of dvc.lock at a time, across processes."""
    COMMIT_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(COMMIT_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


READ_ONLY_FLAGS = {
    "--cleanup-metadata",  # forgets Snakemake's records of files (pipelines/sync.py), runs no job
    "--dry-run",
    "--dryrun",
    "--list-rules",
    "--list",
    "-l",
    "--list-target-rules",
    "--lt",
    "--rulegraph",
    "--dag",
    "--d3dag",
    "--filegraph",
    "--summary",
    "-S",
    "--detailed-summary",
    "-D",
    "--lint",
    "--version",
}


def plans_only(argv: list[str]) -> bool:
    """Whether a Snakemake command line only plans or reports (-n, also in a group of short flags like
    -np; --dry-run, --list-rules, --dag, --summary, ...): it runs nothing, so it needs no lock."""
    return any(
        a in READ_ONLY_FLAGS or (a.startswith("-") and not a.startswith("--") and a[1:].isalpha() and "n" in a)
        for a in argv
    )


def hold_pipeline_lock(path: Path = PIPELINE_LOCK) -> str | None:
    """Take the lock of a pipeline run in this directory and hold it until this process exits; return
    None, or why it is held. Snakemake's own directory lock is checked, then written: two invocations
    started at the same moment can both pass it and rebuild the same outputs. This one is the kernel's
    (flock): one process gets it, and it goes with the process, even one killed by SIGKILL (no
    `--unlock` needed afterwards). It holds across login nodes on a filesystem with flock support
    (NFS with lockd, Lustre mounted with -o flock)."""
    global _held_pipeline_lock
    if _held_pipeline_lock is not None:  # this process holds it already (the Snakefile loaded again)
        return None
    handle, holder = contract.try_lock(path)
    if handle is None:
        return f"another pipeline is running in this directory ({holder})"
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held_pipeline_lock = handle
    return None


def clear_dead_snakemake_locks(locks: Path = Path(".snakemake/locks")) -> list[str]:
    """Remove the directory locks a Snakemake that died without unlocking (SIGKILL, a lost login session)
    left behind, which would stop every later run until `snakemake --unlock`. Call only while holding the
    pipeline lock (hold_pipeline_lock): every Snakemake running this Snakefile here holds it, so a lock
    file seen then belongs to none that is alive. Returns the files removed."""
    removed = []
    for lock in sorted(locks.glob("*.lock")) if locks.is_dir() else []:
        lock.unlink(missing_ok=True)
        removed.append(str(lock))
    return removed


def repair() -> str:
    """Restore a damaged dvc.lock from the good copy, or refresh that copy from a whole one. Returns what
    was done. Takes the commit lock: never reads a dvc.lock that a rule's commit is writing."""
    with commit_lock():
        return _repair()


def _repair() -> str:
    problem = lock_problem()
    if problem is None:
        lost = lost_stages()
        if not lost:
            if LOCK_FILE.exists():
                _copy(LOCK_FILE, GOOD_COPY)
            return "ok"
        problem = f"stages {', '.join(lost[:3])} of the last good copy are missing (cut short?)"
    if GOOD_COPY.exists() and lock_problem(GOOD_COPY) is None:
        _copy(LOCK_FILE, LOCK_FILE.with_name("dvc.lock.damaged"))
        _copy(GOOD_COPY, LOCK_FILE)
        print(
            f"warning: dvc.lock was damaged ({problem}), probably by a kill during `dvc commit`; restored the last "
            f"good copy from {GOOD_COPY} (the damaged file is dvc.lock.damaged); stages committed after that copy "
            f"show as changed and re-run",
            file=sys.stderr,
            flush=True,
        )
        return "restored"
    raise SystemExit(
        f"dvc.lock is damaged ({problem}) and there is no good copy at {GOOD_COPY}: restore it from git "
        f"(git checkout dvc.lock) or delete it (every stage then counts as changed)"
    )


def commit(stage: str) -> int:
    with commit_lock():
        _repair()
        proc = subprocess.run(
            [sys.executable, "-m", "dvc", "commit", "--force", "--quiet", stage], capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr, end="")
            print(
                f"error: `dvc commit {stage}` failed (exit {proc.returncode}); its outputs are not recorded in "
                f"dvc.lock. Fix the cause above and re-run",
                file=sys.stderr,
                flush=True,
            )
            return proc.returncode
        problem = lock_problem()
        if problem:
            print(f"error: dvc.lock is damaged after `dvc commit {stage}` ({problem})", file=sys.stderr, flush=True)
            return 1
        _copy(LOCK_FILE, GOOD_COPY)
    return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", nargs="?", help="the DVC stage to commit (e.g. pretrain, finetune_qlora@nf4)")
    parser.add_argument("--repair", action="store_true", help="only check dvc.lock, restoring it if damaged")
    args = parser.parse_args(argv)
    if args.repair or not args.stage:
        print(f"dvc.lock: {repair()}")
        return
    code = commit(args.stage)
    if code == 0:  # (this process's seconds, into the stage's time budget: pipelines.timebudget)
        timebudget.add_commit(args.stage, time.time() - timing.process_created())
    raise SystemExit(code)


if __name__ == "__main__":
    main()
