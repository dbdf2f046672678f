"""Content hashes: of files and folders (the checkpoint key's inputs, what the report read) and of one
file (a download checked against its recorded sha256)."""

from __future__ import annotations

import hashlib
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
