"""Atomic publishing: a reader sees the old file or folder, or the complete new one, never a half-written one.

Everything a stage publishes (its output folder, checkpoints, JSON files) is written under a hidden
temporary name beside its final path and renamed into place. The name holds its writer:
`.<name>.tmp-<random>.<pid>.<pid namespace>.<host>`. A writer killed before its rename leaves that
temporary behind; the next write of the same name (and `sweep`) removes the ones whose writer is known to be
gone: written on this host, in this pid namespace, by a process that no longer runs. Others are left alone
(another host's writer cannot be checked from here; nothing reads a hidden temporary). A writer's work
folder beside its output (`scratch`: downloads, intermediate files) is named the same way,
`.<name>.work-<random>...`, and removed the same way.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a runtime is received: writing files never loads torch)
    from stages.common import runtime


@functools.cache
def _pid_namespace() -> str:
    try:  # "pid:[4026531836]": pids are compared only within one namespace
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]") or "0"
    except OSError:
        return "0"


KINDS = ("tmp", "work")  # a write not yet renamed into place; a writer's work folder (scratch)


def _tmp_sibling(final: Path, kind: str = "tmp") -> Path:
    owner = f"{os.getpid()}.{_pid_namespace()}.{socket.gethostname()}"
    return final.with_name(f".{final.name}.{kind}-{uuid.uuid4().hex[:8]}.{owner}")


def _writer_gone(tmp_name: str) -> bool:
    """True when the temporary `tmp_name` (a name made by `_tmp_sibling`) was written by a process of
    this host and pid namespace that has ended."""
    tail = next((tmp_name.rpartition(f".{kind}-")[2] for kind in KINDS if f".{kind}-" in tmp_name), "")
    parts = tail.split(".", 3)
    if len(parts) != 4 or not parts[1].isdigit():
        return False  # not named by its writer: cannot tell
    _, pid, namespace, host = parts
    if host != socket.gethostname() or namespace != _pid_namespace() or namespace == "0":
        return False
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def sweep(parent: str | Path, name: str = "*") -> list[Path]:
    """Remove the hidden temporaries and work folders `.<name>.tmp-*`, `.<name>.work-*` in `parent` whose
    writers are gone (see the module's docstring); the paths removed."""
    parent = Path(parent)
    removed = []
    stem = name if name == "*" else glob.escape(name)
    found = [tmp for kind in KINDS for tmp in parent.glob(f".{stem}.{kind}-*")] if parent.is_dir() else []
    for tmp in sorted(found):
        if _writer_gone(tmp.name):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


@contextlib.contextmanager
def folder(final: str | Path, rt: runtime.Runtime | None = None):
    """Yield a temporary folder beside `final`; on success it is renamed to `final` (replacing an old
    one), on error removed. With a distributed `rt` every rank writes into the same folder (it needs a
    filesystem shared by the ranks) and rank 0 renames it once all ranks succeeded; with `rt=None` the
    caller is the only writer."""
    tmp = begin(final, rt)
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        publish(final, tmp, rt, ok)


@contextlib.contextmanager
def scratch(final: str | Path):
    """Yield a hidden work folder beside `final` for what its writer needs only while it writes (downloads,
    intermediate files as big as the output, which /tmp may not hold); removed on exit. Where the writer
    is killed, the next write of `final` (or `sweep`) removes it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep(final.parent, final.name)
    work = _tmp_sibling(final, "work")
    work.mkdir()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def begin(final: str | Path, rt: runtime.Runtime | None = None) -> Path:
    """The first half of `folder`: a new temporary folder beside `final` (on every rank: rank 0's). A
    writer that outlives one call (an asynchronous checkpoint) calls `publish` later, at a point every
    rank reaches."""
    final = Path(final)
    tmp = None
    if rt is None or rt.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        sweep(final.parent, final.name)
        tmp = _tmp_sibling(final)
        tmp.mkdir()
    if rt is not None and rt.distributed:
        tmp = Path(rt.broadcast(str(tmp) if tmp else None))
    return tmp


def publish(final: str | Path, tmp: Path, rt: runtime.Runtime | None, ok: bool) -> None:
    """The second half of `folder`: rename `tmp` to `final` when every rank's part is `ok`, else remove
    it. Raises where this rank's part succeeded but another rank's failed (where this one failed, its
    own error is the caller's to raise)."""
    final = Path(final)
    collective = rt is not None and rt.distributed
    all_ok = not rt.any(not ok) if collective else ok
    if rt is None or rt.is_main:
        if all_ok:
            if final.exists():
                old = _tmp_sibling(final)
                final.rename(old)
                shutil.rmtree(old)
            tmp.rename(final)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if collective:
        rt.barrier()
    if ok and not all_ok:
        raise RuntimeError(f"another rank failed while writing {final}; it was not published")


def write_text(path: str | Path, text: str) -> None:
    """Write a text file via a temporary file and rename: readers see the old file or the new one."""
    path = Path(path)
    sweep(path.parent, path.name)
    tmp = _tmp_sibling(path)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | Path, obj) -> None:
    """Write JSON via a temporary file and rename."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
