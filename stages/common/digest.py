"""Content hashes: of files and folders (the checkpoint key's inputs, what the report read), of one
file (a download checked against its recorded sha256), and DVC's own (what dvc.lock records)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path


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


def dvc_md5(path: str | Path, root: str | Path | None = None) -> str:
    """DVC's content hash of a file or folder: `<md5>` or `<md5>.dir`, the value dvc.lock records for it,
    computed by DVC's own functions (files DVC ignores under `root`, the repository, are left out as DVC
    leaves them out)."""
    from dvc.ignore import DvcIgnoreFilter
    from dvc_objects.fs.local import LocalFileSystem

    fs = LocalFileSystem()
    path = Path(path).resolve()
    root = Path(root or Path.cwd()).resolve()
    ignore = DvcIgnoreFilter(fs, str(root)) if path.is_relative_to(root) else None
    return _build_md5(fs, path, ignore, None)


def dvc_md5s(paths, root: str | Path | None = None) -> dict[str, str]:
    """dvc_md5 of each of `paths`, relative to `root` ({path as given: hash}; one not there is left out). In a DVC
    repository (`root`) through DVC's record of the hashes it computed before, by file inode, size and
    time, as `dvc` itself hashes: what `dvc repro` or `dvc commit` hashed a moment ago is not read again."""
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    root = Path(root or Path.cwd()).resolve()
    there = {str(p): (root / p).resolve() for p in paths if (root / p).exists()}  # (relative to `root`)
    try:
        repo = Repo(str(root), uninitialized=False)
    except NotDvcRepoError:
        return {p: dvc_md5(path, root) for p, path in there.items()}
    with repo:
        if Path(repo.root_dir).resolve() != root:  # (a folder inside another repository: hashed as by hand)
            return {p: dvc_md5(path, root) for p, path in there.items()}
        found = {}
        for p, path in there.items():
            if path.is_relative_to(root):
                found[p] = _build_md5(repo.fs, path, repo.dvcignore, repo.state)
            else:
                found[p] = _build_md5(repo.fs, path, None, None)
        return found


def _build_md5(fs, path: Path, ignore, state) -> str:
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB

    with tempfile.TemporaryDirectory() as scratch:
        _, _, obj = build(HashFileDB(fs, scratch), str(path), fs, "md5", dry_run=True, ignore=ignore, state=state)
    return obj.hash_info.value
