"""A training run's checkpoints as it trains: its train state (steps done, loss history, RNG state,
fp16's scaler), the resume from the newest intact checkpoint, which steps save, and the saves themselves,
synchronous or asynchronous (the write overlapping the next steps; published once every rank's write
is done). Where checkpoints live, how they are verified and read as data only: stages.common.ckpt.
"""

from __future__ import annotations

import copy
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stages.common import atomic, faults, runtime, timing
from stages.common.ckpt import (
    WRITER_FILE,
    checkpoint_reader,
    checkpoints,
    data_only_load_planner,
    newest_intact_checkpoint,
    write_manifest,
    writer_record,
)

# (torch.distributed.checkpoint is imported where a checkpoint is saved or loaded: it brings in DTensor
# and sympy, a second of start-up for every process of the stages that never train)


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
    is in flight: the next save, a stop's save (synchronous) and the end of training wait for it first.

    `on_publish(folder, step, history)` and `on_remove(folder, why)` are told, on rank 0, of each checkpoint
    published and of each removed to keep the newest `keep` (the training loop records them in MLflow)."""

    def __init__(
        self, folder: Path, every: int, steps: int, rt: runtime.Runtime, keep: int = 2,
        asynchronous: bool = False, timeout_s: float = runtime.COLLECTIVE_TIMEOUT_S, writer: dict | None = None,
        on_publish=None, on_remove=None,
    ):  # fmt: skip
        self.folder, self.every, self.steps, self.rt, self.keep = Path(folder), every, steps, rt, keep
        self.on_publish, self.on_remove = on_publish, on_remove
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

    @timing.phase("checkpoint")
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

    @timing.phase("checkpoint")
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

    @timing.phase("checkpoint")
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

    @timing.phase("checkpoint")
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
            if self.on_publish is not None:
                self.on_publish(pending.final, pending.step, pending.extra["history"])
            for old in checkpoints(self.folder)[self.keep :]:
                shutil.rmtree(old, ignore_errors=True)
                if self.on_remove is not None:
                    self.on_remove(old, f"removed at step {pending.step}: the newest {self.keep} are kept")
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
