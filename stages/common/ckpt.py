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
that trains into it. A run's `Checkpointer` owns its train state (steps done, history, RNG, fp16's
scaler): it resumes it, decides which steps save, and saves them synchronously or asynchronously (the
write overlapping the next steps; published, as above, once every rank's write is done).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import io
import json
import pickle
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stages.common import atomic, contract, faults, runtime
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


# ------------------------------------------------------------------------- model and optimizer state
def fqn(name: str) -> str:
    """A parameter name as torch.distributed.checkpoint writes it (no DDP/compile wrapper prefixes)."""
    return ".".join(part for part in name.split(".") if part not in ("module", "_orig_mod", "_fsdp_wrapped_module"))


def state_dicts(model, optimizer) -> tuple[dict, dict, object]:
    """Model and optimizer state for a checkpoint, and the StateDictOptions that took them. With a frozen
    base only the trainable parameters (quantized bases also put packing statistics in the state dict;
    those are left out too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    trainable = {fqn(n) for n, p in model.named_parameters() if p.requires_grad}
    frozen = any(not p.requires_grad for p in model.parameters())
    # AdamW's state flattened to one entry per parameter name (its moments and its group's settings), so
    # that it loads under another layout: other processes, other pipeline stages. (bitsandbytes' 8-bit
    # optimizers cannot load a flattened state; they keep the grouped one, and train in the layouts
    # whose groups hold the same parameters on every process: ddp, and fsdp with adapters.)
    flatten = isinstance(optimizer, torch.optim.AdamW)
    options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen, flatten_optimizer_state_dict=flatten)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if frozen:
        model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    return model_sd, optim_sd, options


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


def new_history() -> dict:
    """A run's loss history: per step its step, loss and lr; per evaluation val_step and val_loss."""
    return {"step": [], "loss": [], "lr": [], "val_step": [], "val_loss": []}


@dataclass
class TrainState:
    """What a run has done, beside its model and optimizer: the steps done and their history."""

    step: int = 0
    history: dict = field(default_factory=new_history)


@dataclass
class PendingSave:
    """A checkpoint saved but not yet published."""

    step: int
    final: Path
    tmp: Path
    """The hidden folder it is written into (atomic.begin), renamed to `final` when published."""
    extra: dict
    """extra.pt's content, taken at the save's step (train state, history, RNG state, fp16's scaler)."""
    write: Future | None = None
    """The background write of the model and optimizer state (asynchronous saves)."""


class _Staged:
    """An AsyncStager for a state already copied to host memory (Checkpointer.save stages it itself):
    async_save writes what it is given."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


_STAGED = _Staged()


class Checkpointer:
    """A training run's checkpoints in `folder`: resumes the train state (steps done, history, RNG state,
    fp16's gradient scaler) from the newest intact checkpoint, and decides which steps save: every
    `every` steps before the last one (0: none), and the step a stop signal ended the run on. Keeps the
    newest `keep`. The stage holds the folder's lock (stage.checkpoints) around the run.

    `asynchronous`: a due step's save only copies the model and optimizer state to host memory (a DCP
    DefaultStager kept for the run: every tensor copied, CPU ones too; every rank told whether any copy failed
    before DCP's async_save starts the write) and takes the rest of the train state; a background thread writes
    the copy while training goes on, its collectives on a gloo process group of their own (they never interleave
    with the loop's). The loop asks every step, in the all-reduce it makes anyway, whether some rank still
    writes (`writing`); the first step at which none does, every rank publishes it (`finish`). At most one save
    is in flight: the next save, a stop's save (synchronous) and the end of training wait for it first."""

    def __init__(
        self, folder: Path, every: int, steps: int, rt: runtime.Runtime, keep: int = 2,
        asynchronous: bool = False, timeout_s: float = runtime.COLLECTIVE_TIMEOUT_S, writer: dict | None = None,
    ):  # fmt: skip
        self.folder, self.every, self.steps, self.rt, self.keep = Path(folder), every, steps, rt, keep
        self.writer = writer or writer_record("")  # (a Folder's; outside a stage: code unknown)
        self.asynchronous = asynchronous
        self.pending: PendingSave | None = None
        self.stager, self.group = None, None
        if asynchronous:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Staged on the calling thread (no staging thread), into plain host memory (neither pinned nor
            # shared: no CUDA needed); the stager keeps its copy between saves and refills it.
            self.stager = DefaultStager(StagingOptions(False, False, False, False))
            if rt.distributed:  # (a collective: every rank makes its Checkpointer at the same point)
                import datetime

                import torch.distributed as dist

                self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def resume(self, model, optimizer, scaler=None) -> TrainState:
        """Load the newest intact checkpoint into model, optimizer and scaler (rank 0 picks it, passing a
        damaged one over with a warning; every rank loads it), or a fresh state without one. Checkpoints
        that killed runs left half-written (hidden) are removed first."""
        rt = self.rt
        if rt.is_main:
            atomic.sweep(self.folder)
        latest = runtime.broadcast_object(newest_intact_checkpoint(self.folder) if rt.is_main else None)
        if latest is None:
            return TrainState()
        extra = self._load(latest, model, optimizer)
        if scaler is not None and "grad_scaler" in extra:
            scaler.load_state_dict(extra["grad_scaler"])
        runtime.print0(f"resuming from {latest} (step {extra['step']})", rt=rt)
        return TrainState(extra["step"], extra["history"])

    def due(self, done: int, stopped: bool) -> bool:
        """Whether the step that made `done` steps saves (`stopped`: a stop signal ends the run after it)."""
        return stopped or bool(self.every and done % self.every == 0 and done < self.steps)

    def writing(self) -> bool:
        """Whether this rank's background write of the checkpoint in flight is still running."""
        return self.pending is not None and self.pending.write is not None and not self.pending.write.done()

    def step_done(
        self, state: TrainState, model, optimizer, scaler=None, stopped: bool = False, writing: bool = False
    ) -> Path | None:
        """After a step, on every rank: publish the checkpoint in flight unless a rank still writes it
        (`writing`: `writing()` of any rank), then save the state if the step is due (`due`; synchronously
        on a stop). The checkpoint published, saved or started, or None."""
        if self.pending is not None and state.step > self.pending.step:
            faults.kill_if_due("save_in_flight", self.pending.step)  # killed with a save in flight, unpublished
        published = self.finish() if self.pending is not None and not writing else None
        if not self.due(state.step, stopped):
            return published
        return self.save(state, model, optimizer, scaler, wait=stopped)

    def save(self, state: TrainState, model, optimizer, scaler=None, wait: bool = True) -> Path:
        """Sharded model + optimizer state (every rank writes its shard), plus the train state, RNG state
        and fp16's gradient scaler (the same on every rank); published by renaming, so a crash mid-write
        leaves no `step-*` folder behind. A save in flight is published first. Asynchronous and not
        `wait`: returns once the state is copied, the write goes on (published by `step_done`/`finish`);
        else written and published before it returns."""
        import torch.distributed.checkpoint as dcp

        self.finish()
        rt = self.rt
        final = self.folder / f"step-{state.step}"
        model_sd, optim_sd, _ = state_dicts(model, optimizer)
        extra = {"step": state.step, "history": copy.deepcopy(state.history), "torch_rng": torch.get_rng_state()}
        if scaler is not None:
            extra["grad_scaler"] = scaler.state_dict()
        tmp = atomic.begin(final, rt)
        pending = PendingSave(state.step, final, tmp, extra)
        tensors = {"model": model_sd, "optim": optim_sd}
        asynchronous = self.asynchronous and not wait
        error = None
        if asynchronous:
            # The copy to host memory first, on every rank, and every rank told whether it failed (it can
            # fail on one rank alone) before any rank starts a write: a write started would go on in its
            # thread, and make the folder again after the others removed it.
            try:
                tensors = self.stager.stage(tensors)
            except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
                error = e
            self._abandon_if_any_failed(error, final, tmp)
        try:
            if asynchronous:
                from torch.distributed.checkpoint import FileSystemWriter

                pending.write = dcp.async_save(
                    tensors,
                    # The state is in host memory already: no copy ahead from a GPU, which in the writing
                    # thread (whose current device is GPU 0) would open a CUDA context on GPU 0 per rank.
                    storage_writer=FileSystemWriter(str(tmp / "state"), per_thread_copy_ahead=0),
                    process_group=self.group,
                    async_stager=_STAGED,
                )
            else:
                dcp.save(tensors, checkpoint_id=str(tmp / "state"))
        except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
            error = e
        self._abandon_if_any_failed(error, final, tmp)
        self.pending = pending
        if pending.write is None:
            self.finish()
        return final

    def _abandon_if_any_failed(self, error: Exception | None, final: Path, tmp: Path) -> None:
        """On every rank: when some rank's part of a save failed, all remove its folder together and raise
        (this rank's error, or that another failed); none goes on to train."""
        if runtime.any_rank(error is not None):
            atomic.publish(final, tmp, self.rt, ok=False)
            raise error or RuntimeError(f"another rank failed while saving {final}; it was not written")

    def finish(self) -> Path | None:
        """Publish the checkpoint in flight (on every rank, at the same step): wait for this rank's write;
        extra.pt and the writer record (rank 0); every rank's shard on disk (barrier) before the manifest;
        the rename; the oldest beyond `keep` removed. The published folder, or None when none was in flight."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        rt = self.rt
        ok = False
        try:
            if pending.write is not None:
                pending.write.result()  # (raises what the background write raised)
            if rt.is_main:
                torch.save(pending.extra, pending.tmp / "extra.pt")
                atomic.write_json(pending.tmp / WRITER_FILE, self.writer)
            runtime.barrier()  # every rank's shard is on disk before the manifest records them
            if rt.is_main:
                write_manifest(pending.tmp)
            faults.kill_if_due("in_checkpoint", pending.step)  # (the resume tests' kill)
            ok = True
        finally:
            atomic.publish(pending.final, pending.tmp, rt, ok)
        if rt.is_main:
            for old in checkpoints(self.folder)[self.keep :]:
                shutil.rmtree(old, ignore_errors=True)
        runtime.barrier()
        return pending.final

    def close(self) -> None:
        """Free the staging copy and the process group of asynchronous saves (after `finish`). A write still
        running (a run that ended on an error) keeps them: the interpreter waits for that thread at exit,
        and its folder stays hidden (unpublished)."""
        if self.writing():
            return
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None

    @staticmethod
    def _load(path: Path, model, optimizer) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_sd, optim_sd, options = state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        # metadata and every item read as data only
        dcp.load(state, storage_reader=checkpoint_reader(path / "state"), planner=data_only_load_planner())
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
        extra = torch.load(path / "extra.pt", weights_only=True)  # data only: a checkpoint never runs code
        torch.set_rng_state(extra["torch_rng"])
        return extra
