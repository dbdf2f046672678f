"""Where stages write: atomic output folders and the in-progress checkpoint location.

DVC deletes a stage's declared outputs before re-running it and Snakemake deletes the outputs of a
failed job, so in-progress checkpoints live outside declared outputs, in

    checkpoints/<stage>/<key>/

where <key> hashes the stage's params and the content of its inputs. A stage resumes only from the
folder whose key matches: change a param or an input and it starts fresh. Every folder a stage
publishes (outputs and checkpoints) is written under a temporary name and renamed into place, so a
reader never sees a half-written one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from stages.common import dist

CHECKPOINT_ROOT = Path(os.environ.get("PIPELINE_CHECKPOINTS", "checkpoints"))


def hash_files(paths) -> str:
    """sha256 over the relative paths and contents of every file under `paths` (sorted, streamed)."""
    h = hashlib.sha256()
    for root in sorted(Path(p) for p in paths):
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
        for f in files:
            rel = f.relative_to(root) if f != root else Path(f.name)
            h.update(str(rel).encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            h.update(b"\0")
    return h.hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_key(params: dict, inputs_hash: str) -> str:
    blob = json.dumps({"params": params, "inputs": inputs_hash}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def checkpoint_dir(stage: str, params: dict, inputs_hash: str, root: str | Path | None = None) -> Path:
    """The one folder this stage may resume from for these params and inputs."""
    return Path(root or CHECKPOINT_ROOT) / stage / checkpoint_key(params, inputs_hash)


def _tmp_sibling(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_dir(final: str | Path, rt: dist.Runtime | None = None):
    """Yield a temporary folder beside `final`; on success it is renamed to `final` (replacing an old
    one), on error removed. With a distributed `rt` every rank writes into the same folder (it needs a
    filesystem shared by the ranks) and rank 0 renames it once all ranks succeeded; with `rt=None` the
    caller is the only writer."""
    final = Path(final)
    collective = rt is not None and rt.distributed
    tmp = None
    if rt is None or rt.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_sibling(final)
        tmp.mkdir()
    if collective:
        tmp = Path(dist.broadcast_object(str(tmp) if tmp else None))
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        all_ok = not dist.any_rank(not ok) if collective else ok
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
            dist.barrier()


def write_text(path: str | Path, text: str) -> None:
    """Write a text file via a temporary file and rename: readers see the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | Path, obj) -> None:
    """Write JSON via a temporary file and rename."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete `step-<n>` folder under `folder` (temporary, half-written ones are hidden
    names and never match), or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    steps = [p for p in folder.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return max(steps, key=lambda p: int(p.name[5:]), default=None)
