"""Checkpoints: where they live, how they are saved, verified and loaded.

DVC deletes a stage's declared outputs before re-running it and Snakemake deletes the outputs of a
failed job, so in-progress checkpoints live outside declared outputs, in

    checkpoints/<stage>/<key>/step-<n>/

where <key> hashes the stage's params and the content of its inputs. A stage resumes only from the
folder whose key matches: change a param or an input and it starts fresh. A checkpoint holds the
sharded model and optimizer state (torch.distributed.checkpoint, every rank its shard), the step,
loss history and RNG state (extra.pt, plain data), and a manifest of its files' sizes and sha256,
written last; it is published by renaming (stages.common.atomic), so a crash mid-save leaves no
`step-*` folder, and a damaged one is passed over on resume. The folder is locked (flock) by the run
that trains into it. This module is the store: the folder's key and lock, the manifest, the writer
record, and reading a checkpoint as data only. A run's train state, what it resumes and when it saves
are stages.common.checkpointer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common import atomic, contract, runtime
from stages.common.config import UserError
from stages.common.digest import sha256_file

# (torch.distributed.checkpoint is imported where a checkpoint is saved or loaded: it brings in DTensor
# and sympy, a second of start-up for every process of the stages that never train)

CHECKPOINT_ROOT = contract.checkpoint_root()  # (read once, when the stage starts)


def checkpoint_key(params: dict, inputs_hash: str) -> str:
    blob = json.dumps({"params": params, "inputs": inputs_hash}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def checkpoint_dir(stage: str, params: dict, inputs_hash: str, root: str | Path | None = None) -> Path:
    """The one folder this stage may resume from for these params and inputs."""
    return Path(root or CHECKPOINT_ROOT) / stage / checkpoint_key(params, inputs_hash)


def checkpoints(folder: str | Path) -> list[Path]:
    """The complete `step-<n>` folders under `folder`, newest first (temporary, half-written ones have
    hidden names and never match)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = [p for p in folder.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]), reverse=True)


MANIFEST = "manifest.json"
# Files up to this size are hashed whole; larger ones (model and optimizer shards) by their first and
# last MiB, besides their size, so a checkpoint saved on a stop signal is not held up reading back
# gigabytes (torchrun and SLURM kill a process about 30 s after the signal).
WHOLE_HASH_BYTES = 256 * 2**20
EDGE_BYTES = 2**20


def file_digest(path: Path) -> dict:
    size = path.stat().st_size
    if size <= WHOLE_HASH_BYTES:
        return {"bytes": size, "sha256": sha256_file(path)}
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(EDGE_BYTES))
        fh.seek(size - EDGE_BYTES)
        h.update(fh.read(EDGE_BYTES))
    return {"bytes": size, "sha256_ends": h.hexdigest()}


def write_manifest(folder: str | Path) -> None:
    """Record the size and sha256 (see WHOLE_HASH_BYTES) of every file in a checkpoint folder, written
    last, once every rank's files are complete, so a later run can tell an intact checkpoint from a
    damaged one."""
    folder = Path(folder)
    files = {
        str(f.relative_to(folder)): file_digest(f)
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    atomic.write_json(folder / MANIFEST, files)


def manifest_problem(folder: str | Path) -> str | None:
    """Why a checkpoint folder does not match its manifest (missing, truncated, changed or extra
    files, or no manifest at all), or None when it matches. A manifest is written last, after every
    rank's files: a folder without one was not published by this code, and is not trusted."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"it has no {MANIFEST} (every checkpoint this code publishes has one)"
    except (OSError, ValueError):
        return f"its {MANIFEST} is unreadable"
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return f"its {MANIFEST} is unreadable"
    present = {str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file() and f.name != MANIFEST}
    if present != set(files):
        missing, extra = sorted(set(files) - present), sorted(present - set(files))
        return f"files differ from its {MANIFEST} (missing: {missing[:3]}, unexpected: {extra[:3]})"
    for rel, want in files.items():
        size = (folder / rel).stat().st_size
        if size != want.get("bytes"):
            return f"{rel} holds {size:,} bytes, its {MANIFEST} says {want.get('bytes')}"
        if file_digest(folder / rel) != want:
            return f"{rel} differs from its {MANIFEST} (sha256)"
    return None


def newest_intact_checkpoint(folder: str | Path) -> Path | None:
    """The newest checkpoint under `folder` for which `problem(path)` finds nothing, or None. Each
    damaged one passed over is named in a warning (it stays on disk for inspection; the next save
    replaces or prunes it)."""
    for path in checkpoints(folder):
        why = checkpoint_problem(path)
        if why is None:
            return path
        print(f"warning: not resuming from checkpoint {path}: {why}; trying an older one", flush=True)
    return None


@contextlib.contextmanager
def exclusive(folder: str | Path, rt: runtime.Runtime):
    """Hold the lock of a checkpoint folder while a run trains into it (rank 0 holds it for all ranks).
    A second run of the same stage, params and inputs (from the other DAG tool, or a launcher's orphans)
    stops on every rank with one clear error instead of resuming from, or writing over, checkpoints in
    flight. The lock is the kernel's (flock): it goes with the process, even one killed by SIGKILL."""
    folder = Path(folder)
    path = folder.with_name(folder.name + ".lock")
    handle, problem = None, None
    if rt.is_main:
        try:
            handle, holder = contract.try_lock(path)
            if handle is None:
                problem = (
                    f"checkpoint folder {folder} is in use by another run (pid, host: {holder}); wait for it to "
                    f"finish or stop it, then re-run (it resumes from the checkpoints)"
                )
        except OSError as e:  # e.g. a network filesystem without locks
            problem = (
                f"cannot lock checkpoint folder {folder} ({e}); put {contract.CHECKPOINTS} on a filesystem "
                f"with flock support (a local disk, NFS with lockd)"
            )
    problem = runtime.broadcast_object(problem)  # every rank stops together
    if problem:
        raise UserError(problem)
    try:
        yield
    finally:
        if handle is not None:
            handle.close()


def discard(folder: str | Path) -> None:
    """Remove a finished run's checkpoint folder. Its lock file stays: removing it while another process
    waits on it would let a third run lock a new file of the same name beside the second."""
    shutil.rmtree(folder, ignore_errors=True)


# Who wrote a checkpoint: its stage's code hash and the torch version (writer_record; a Folder's `writer`),
# saved beside each checkpoint's state and compared before one is resumed.
WRITER_FILE = "writer.json"
# The writer record's key for a resume across a code or torch change ("<old> -> <new>") in the run that
# wrote the checkpoint, or in one it built on (stage.resume_problem).
ACROSS_CODE = "resumed_across_code"


@dataclass(frozen=True)
class Folder:
    """A run's checkpoint folder, held (locked) while it trains into it, and the writer record its
    checkpoints get: the run's code and torch, and a resume across a change it made or built on."""

    path: Path
    writer: dict

    @property
    def across_code(self) -> str | None:
        return self.writer.get(ACROSS_CODE)


def writer_record(module: str) -> dict:
    from stages.common import provenance

    try:
        digest = provenance.code_digest(module)
    except KeyError:  # not a stage module
        digest = {"sha256": "unknown", "files": {}}
    return {"code_sha256": digest["sha256"], "code_files": digest["files"], "torch": torch.__version__}


def read_writer(path: Path) -> dict:
    """The writer record of the checkpoint at `path` ({} when it has none)."""
    try:
        return json.loads((Path(path) / WRITER_FILE).read_text())
    except (OSError, ValueError):
        return {}


def writer_change(written: dict, writer: dict) -> str | None:
    """What differs between the code and torch that wrote a checkpoint and this run's, or None."""
    from stages.common import provenance

    changes = []
    if written.get("code_sha256") != writer["code_sha256"]:
        files = provenance.changed_files({"files": written.get("code_files", {})}, {"files": writer["code_files"]})
        named = f" ({', '.join(files[:5])}{', ...' if len(files) > 5 else ''} changed)" if written else ""
        changes.append(
            f"code {str(written.get('code_sha256', 'unrecorded'))[:12]} -> {writer['code_sha256'][:12]}{named}"
        )
    if written.get("torch") != writer["torch"]:
        changes.append(f"torch {written.get('torch', 'unrecorded')} -> {writer['torch']}")
    return "; ".join(changes) or None


def set_aside(folder: Path) -> Path:
    """Move a checkpoint folder out of the way (kept, renamed with the time), so a run starts afresh."""
    import time

    aside = folder.with_name(f"{folder.name}.set-aside-{time.strftime('%Y%m%dT%H%M%S')}")
    folder.rename(aside)
    return aside


# DCP writes a checkpoint's index, state/.metadata, with pickle, and its reader loads it with pickle.load:
# a crafted file would run code on resume, and manifests are not authenticated. Here it is read by an
# unpickler that admits only what DCP writes there: its metadata classes, the storage record of its file
# layout, tensor sizes, dtypes and layouts, and the path it was saved to.
METADATA_MODULE = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == METADATA_MODULE:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path: Path):
    """DCP's metadata file read as data (MetadataUnpickler): a pickle that names anything else raises
    pickle.UnpicklingError before any of it runs."""
    return MetadataUnpickler(io.BytesIO(Path(path).read_bytes())).load()


def checkpoint_reader(path: Path):
    """DCP's file-system reader for the checkpoint in `path`, reading its metadata as data only."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from: files that do not match its manifest (truncated,
    changed, missing, or no manifest), or an extra.pt, DCP metadata or DCP item that is not plain data.
    None when it is intact."""
    problem = manifest_problem(path)
    if problem is None:
        try:
            torch.load(path / "extra.pt", weights_only=True)
        except Exception as e:  # whatever the unpickler refuses
            problem = f"extra.pt does not load as plain data ({type(e).__name__})"
    if problem is None:
        try:
            metadata = read_metadata(path / "state" / ".metadata")
        except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses, or a missing file
            return f"state/.metadata does not load as a checkpoint's metadata ({type(e).__name__}: {e})"
        problem = bytes_items_problem(path / "state", metadata)
    return problem


def bytes_items_problem(state: Path, metadata) -> str | None:
    """Why one of the checkpoint's non-tensor items (DCP keeps each, e.g. an optimizer group's lr or betas,
    as a torch.save'd blob inside a shard) is not plain data, or None. Each is read as DataOnlyLoadPlanner
    reads it on resume, weights-only, so that a crafted item is named here and the checkpoint passed over
    rather than failing the load."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    for name, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = metadata.storage_data.get(MetadataIndex(name))
        if info is None:
            return f"state/.metadata names item {name} but not where it is stored"
        if info.transform_descriptors:  # (this code never writes transformed items)
            return f"item {name} is stored transformed ({', '.join(info.transform_descriptors)})"
        try:
            with open(state / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                blob = fh.read(info.length)
            torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses, or a missing file
            return f"item {name} in state/{info.relative_path} does not load as plain data ({type(e).__name__})"
    return None


def data_only_load_planner():
    """DCP's default load planner, except that a non-tensor item is unpickled weights-only (plain data:
    numbers, strings, containers, tensors), where torch's own reads it with weights_only=False: a crafted
    item raises instead of running code. Tensors are read weights-only by DCP's file reader already."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class DataOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            data = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], data)
            else:
                self.state_dict[read_item.dest_index.fqn] = data

    return DataOnlyLoadPlanner()
