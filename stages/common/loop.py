"""The one training loop of the codebase: pretrain, extend_context and finetune_qlora call `fit()`.

A run of a train section (stages.common.train_config) has three parts. `build()` lays the model out over
the processes as the run's Layout (stages.common.mesh) says: a pipeline stage's part
(stages.common.pipeline), or the model wrapped by stages.common.parallel (DDP, FSDP2, HSDP, tensor
parallel); then the optimizer and fp16's scaler (stages.common.optim): a `Trainer`. `step()` is one
optimizer step of it: gradient accumulation over micro-batches, the loss (stages.common.losses),
clipping, the update; benches call it alone. `train()` builds, resumes the train state from the newest
intact checkpoint (stages.common.checkpointer), then runs the steps with their bookkeeping:
periodic validation (`evaluate`), tokens/s and MFU, the tracker, and the checkpoints the Checkpointer
decides on (every N steps, and on a stop signal). `fit()` adds the stop protocol; `full_state_dict`
and `write_curves` are what a stage publishes from it.

Batches are a pure function of (seed, step): each step draws `batch_size` windows from the token
stream with a generator seeded by both (`Windows`), and rank r takes its slice. So the data position
is the step, and the losses do not depend on the number of processes or on where a run was resumed.
Other data (instruction records) comes as a batch source with the same `batch(step, index, size)`
method; its targets may hold IGNORE_INDEX where no loss is taken (prompt tokens, padding).

A model whose base is frozen (LoRA adapters on a quantized base) trains only its trainable
parameters, and its checkpoints hold only those (the frozen base is reloaded from its source).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from stages.common import checkpointer, config, faults, parallel, pipeline, runtime, shards, timing, watchdog
from stages.common.losses import IGNORE_INDEX, global_target_count, lm_loss, vocab_parallel_loss
from stages.common.mesh import Layout
from stages.common.optim import clip_grad_norm, lr_at, make_grad_scaler, make_optimizer, optimizer_state_bytes
from stages.common.parallel import all_reduce_grads, checkpoint_activations, replicated_params, wrap
from stages.common.train_config import TrainConfig, grad_accum_steps, micro_batch
from stages.models.llama import tensor_parallel_problem

if TYPE_CHECKING:
    from stages.common.stagerun import StageRun


class Diverged(config.UserError):
    """The loss became inf or nan: the params (a learning rate too high) are the cause, so it is the user's
    to fix. Nothing from the step on is saved; a run with other params starts afresh (stages.common.ckpt)."""


@dataclass
class TrainResult:
    history: dict
    """Per step: step, loss, lr; per evaluation: val_step, val_loss (the resumed part included)."""
    model: torch.nn.Module
    """The trained model as wrapped for training (DDP, FSDP, compiled)."""
    stopped: bool
    """A stop signal ended the run early; a checkpoint holds its progress."""
    flops_per_token: float
    compute_dtype: str
    tokens_per_s: float
    """From the median step time of this run, the first left out when there are others (warm-up)."""
    mfu: float
    optimizer_state_bytes: int = 0
    """This process's optimizer states at the end (a shard of them under FSDP)."""
    tokens_per_cpu_s: float = 0.0
    """Tokens per second of CPU time (all threads of all processes, this one's times the number of
    processes), from the median step, the first left out: what a step costs in compute on a CPU, which
    other jobs sharing the machine hardly move."""


def flops_per_token(model, context_length: int) -> float:
    """6 x non-embedding parameters (output head counted) + 12 x layers x context x hidden."""
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - c.vocab_size * c.hidden_size
    return 6 * n + 12 * c.num_hidden_layers * context_length * c.hidden_size


class Windows:
    """Training windows of `context + 1` tokens drawn from a token stream, a pure function of (seed, step)."""

    def __init__(self, tokens: np.ndarray | shards.TokenStream, context: int, seed: int):
        if len(tokens) < context + 2:
            raise ValueError(f"the split has {len(tokens)} tokens, fewer than one window of {context + 1}")
        self.tokens, self.context, self.seed = tokens, context, seed

    @timing.phase("data")
    def batch(self, step: int, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows [index, index + size) of the step's global batch: inputs and targets, (B, T) each."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.context - 1, (index + size,), generator=g)[index:]
        rows = np.stack([self.tokens[s : s + self.context + 1] for s in starts.tolist()]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]


def autocast(cfg: TrainConfig, rt: runtime.Runtime):
    """Autocast to the compute dtype (bf16, fp16); a no-op context in fp32."""
    dtype = runtime.compute_dtype(rt.device, cfg.precision)
    return torch.autocast(rt.device.type, dtype=dtype, enabled=dtype != torch.float32)


@timing.phase("evaluation")
@torch.no_grad()
def evaluate(
    model, windows, cfg: TrainConfig, rt: runtime.Runtime, pipe: pipeline.Pipeline | None = None,
    layout: Layout | None = None, beat=None,
) -> float:  # fmt: skip
    """Mean loss per target token over `eval_batches` global batches of fixed validation windows (same
    every call); `windows` is a Windows or another batch source. `pipe`: the model's pipeline stages;
    `layout`: the run's (by default the train section's on these processes); `beat()`: called after each
    batch (the hang watchdog's)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss sum, target count
    layout = layout or Layout.of(cfg, rt)
    dp_rank, dp_size = layout.data_rank, layout.data_size
    accum, size = grad_accum_steps(cfg, dp_size), micro_batch(cfg, dp_size)
    for b in range(cfg.eval_batches):
        if pipe is not None:  # the step's micro-batches through the pipeline; the last stage has the loss
            micro = [windows.batch(-1 - b, (m * dp_size + dp_rank) * size, size) for m in range(accum)]
            x, y = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
            with autocast(cfg, rt):
                loss = pipe.run(x.to(rt.device), y.to(rt.device), 1.0, train=False)
            count = float((y != IGNORE_INDEX).sum()) if pipe.last else 0.0
            total += torch.tensor([loss.item(), count], dtype=torch.float64, device=rt.device)
            if beat is not None:
                beat()
            continue
        for m in range(accum):
            x, y = windows.batch(-1 - b, (m * dp_size + dp_rank) * size, size)
            with autocast(cfg, rt), vocab_parallel_loss(layout):
                loss = lm_loss(
                    model, x.to(rt.device), y.to(rt.device), reduction="sum", compile_mode=cfg.loss_compile_mode
                )
            total += torch.tensor(
                [loss.item(), float((y != IGNORE_INDEX).sum())], dtype=torch.float64, device=rt.device
            )
        if beat is not None:
            beat()
    model.train()
    if rt.distributed:  # (tensor-parallel ranks count their batches alike: the ratio is the same)
        torch.distributed.all_reduce(total)
    return (total[0] / total[1]).item()


@dataclass
class Trainer:
    """What a step needs, laid out over the processes: made once per run by `build`."""

    model: torch.nn.Module
    """The model as it trains: wrapped (DDP, FSDP2, tensor parallel, compiled), or this rank's pipeline part."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    """fp16's loss scaler; None in other precisions."""
    pipe: pipeline.Pipeline | None
    replicated: list
    """Parameters whose gradients this code all-reduces itself (parallel.replicated_params)."""
    replica_group: object
    cfg: TrainConfig
    rt: runtime.Runtime
    layout: Layout
    train_windows: object
    """A Windows or another batch source."""
    val_windows: object
    context_length: int
    flops_per_token: float

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.context_length


@dataclass
class Step:
    """One optimizer step's figures."""

    loss: float
    """Mean loss per target token of the global batch."""
    lr: float
    grad_norm: float
    """Before clipping; not finite on an fp16 step that overflowed (and was skipped)."""
    seconds: float
    cpu_seconds: float
    """This process's CPU time for the step."""


def build(model, train_data, val_data, cfg: TrainConfig, context_length: int, rt: runtime.Runtime) -> Trainer:
    """Lay `model` out over the processes as the train section says (a pipeline stage's part, or the model
    wrapped: DDP, FSDP2, HSDP, tensor parallel), then its optimizer, fp16's scaler and the batch sources.
    Token streams (np.ndarray, shards.TokenStream) are cut into Windows; other data are batch sources with
    `batch(step, index, size) -> (inputs, targets)`."""
    fpt = flops_per_token(model, context_length)
    layout = Layout.of(cfg, rt)
    pipe = None
    problem = tensor_parallel_problem(model.config, layout.tensor) if layout.splits_layers else None
    if problem:
        raise config.UserError(f"train.tensor_parallel: {problem}; choose a degree that divides them")
    if layout.pipelined:
        c = model.config
        accum = grad_accum_steps(cfg, layout.data_size)
        problem = pipeline.layout_problem(c.num_hidden_layers, layout.pipeline, accum, c.tie_word_embeddings)
        if problem:
            raise config.UserError(f"train.pipeline_parallel: {problem}")
        checkpoint_activations(model, cfg)
        pipe = pipeline.Pipeline(model, cfg, accum, rt, layout)
        model = pipe.model  # this stage's part
    else:
        model = wrap(model, cfg, rt, layout)
    optimizer = make_optimizer(model, cfg, layout)
    replicated, replica_group = replicated_params(model, cfg, rt, layout, pipe)
    streams = (np.ndarray, shards.TokenStream)
    train_w = Windows(train_data, context_length, cfg.seed) if isinstance(train_data, streams) else train_data
    val_w = Windows(val_data, context_length, cfg.seed) if isinstance(val_data, streams) else val_data
    return Trainer(
        model=model,
        optimizer=optimizer,
        scaler=make_grad_scaler(cfg, rt),
        pipe=pipe,
        replicated=replicated,
        replica_group=replica_group,
        cfg=cfg,
        rt=rt,
        layout=layout,
        train_windows=train_w,
        val_windows=val_w,
        context_length=context_length,
        flops_per_token=fpt,
    )


def step(tr: Trainer, index: int) -> Step:
    """Optimizer step `index` (0-based): its learning rate, its global batch's micro-batches (this rank's
    share) through forward and backward, gradients reduced and clipped, the update."""
    cfg, rt, model, optimizer, scaler, pipe = tr.cfg, tr.rt, tr.model, tr.optimizer, tr.scaler, tr.pipe
    dp_rank, dp_size = tr.layout.data_rank, tr.layout.data_size
    accum, size = grad_accum_steps(cfg, dp_size), micro_batch(cfg, dp_size)
    t0, cpu0 = time.perf_counter(), time.process_time()
    lr = lr_at(index, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=rt.device)
    micro = [tr.train_windows.batch(index, (m * dp_size + dp_rank) * size, size) for m in range(accum)]
    # Each micro-batch's summed loss over the step's target count: the gradients, averaged over the
    # data-parallel ranks by DDP/FSDP, are those of the mean loss per target token of the whole global
    # batch. (The count is summed over all ranks: tensor-parallel ranks count the same batch, so
    # world_size / count = data-parallel size / the batch's count.)
    scale = rt.world_size / global_target_count([y for _, y in micro], rt)
    if pipe is not None:  # the micro-batches in order through the stages (GPipe or 1F1B)
        x, y = torch.cat([x for x, _ in micro]).to(rt.device), torch.cat([y for _, y in micro]).to(rt.device)
        with autocast(cfg, rt):
            loss_sum += pipe.run(x, y, scale.to(torch.float32))
        micro = []
    for m, (x, y) in enumerate(micro):
        x, y = x.to(rt.device), y.to(rt.device)
        last = m == accum - 1
        # DDP: all-reduce gradients only on the last micro-batch of the step.
        no_sync = tr.layout.data_parallel and not last and cfg.strategy == "ddp"
        sync = model.no_sync() if no_sync else contextlib.nullcontext()
        with sync, autocast(cfg, rt), vocab_parallel_loss(tr.layout):
            loss = lm_loss(model, x, y, reduction="sum", compile_mode=cfg.loss_compile_mode) * scale.to(torch.float32)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += loss.detach()
    all_reduce_grads(tr.replicated, parallel.REDUCE_TORCH_DTYPES[cfg.reduce_dtype], tr.replica_group)
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients
    if tr.layout.splits_model:  # (DTensor gradients, or a pipeline stage's part of them)
        grad_norm = clip_grad_norm(model.parameters(), cfg.grad_clip, pipe.group if pipe is not None else None)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if scaler is not None:
        scaler.step(optimizer)  # skipped when a gradient overflowed; the scale is halved then
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if rt.distributed:
        torch.distributed.all_reduce(loss_sum)
        loss_sum /= tr.layout.stage_size  # (the last stage holds a pipeline's loss)
    loss_value = loss_sum.item()
    return Step(loss_value, lr, float(grad_norm), time.perf_counter() - t0, time.process_time() - cpu0)


def train(
    model,
    train_data,
    val_data,
    cfg: TrainConfig,
    context_length: int,
    rt: runtime.Runtime,
    ckpt_folder: Path,
    tracker,
    stop: runtime.StopFlag,
    writer: dict | None = None,
) -> TrainResult:
    """Train `model` (a transformers causal LM, or a PEFT model around one) for cfg.steps optimizer
    steps of sequences of `context_length` tokens (`build`, then `step` after step), resuming from the
    newest intact checkpoint in `ckpt_folder`; each step is logged to `tracker`, validated every
    `eval_every` steps and saved every `checkpoint_every` (written in the background with
    `async_checkpoint`: see checkpointer.Checkpointer). A stop signal ends it after the step with a checkpoint
    (`stopped`). Stages hold the folder's lock (stage.checkpoints) around it and their
    publishing, so no second run resumes from or writes into the same folder meanwhile. A hang watchdog
    (stages.common.watchdog) ends the run when a rank makes no progress for train.hang_timeout_s. `writer`:
    the record each checkpoint gets (a ckpt.Folder's)."""
    watch = watchdog.Watchdog(
        rt.rank,
        rt.world_size,
        cfg.hang_timeout_s,
        on_hang=tracker.fail_from_thread,
        store=watchdog.default_store(),
    )
    # (without periodic checkpoints the only one is a stop's, which is synchronous)
    asynchronous = cfg.async_checkpoint and 0 < cfg.checkpoint_every < cfg.steps
    saver, logged = None, Logged()
    try:
        saver = checkpointer.Checkpointer(
            ckpt_folder, cfg.checkpoint_every, cfg.steps, rt, asynchronous=asynchronous,
            timeout_s=cfg.collective_timeout_s, writer=writer,
            on_publish=lambda folder, step, _: tracker.log_checkpoint(folder, step, logged.at(step)),
            on_remove=tracker.checkpoint_removed,
        )  # fmt: skip
        return _train(model, train_data, val_data, cfg, context_length, rt, saver, tracker, stop, watch, logged)
    finally:
        if saver is not None:
            saver.close()
        watch.close()


def _train(model, train_data, val_data, cfg, context_length, rt, saver, tracker, stop, watch, logged) -> TrainResult:
    tr = build(model, train_data, val_data, cfg, context_length, rt)
    model, optimizer, scaler = tr.model, tr.optimizer, tr.scaler
    # Training mode from the first step: a model from_pretrained loaded is in eval mode, where dropout is off
    # and transformers checkpoints no decoder layer (activation_checkpointing would act only after the first
    # validation, which ends with model.train()).
    model.train()
    state = saver.resume(model, optimizer, scaler)
    history = state.history
    dtype = runtime.compute_dtype(rt.device, cfg.precision)
    runtime.warn_if_emulated_bf16(rt.device, dtype, rt)
    stopped = False
    bar = runtime.progress(total=cfg.steps, initial=state.step, desc="train", rt=rt)
    steps: list[Step] = []  # (their times: forward/backward/update; validation and saving excluded)
    watch.beat(state.step, f"in step {state.step + 1}, the first of this run")
    for index in range(state.step, cfg.steps):
        faults.injected_stall(rt.rank, index)
        out = step(tr, index)
        if not math.isfinite(out.loss):  # (the loss is all ranks' own: they stop together)
            raise Diverged(
                f"training diverged: the loss is {out.loss} at step {index + 1} of {cfg.steps} (train.lr "
                f"{cfg.lr}, warmup_steps {cfg.warmup_steps}); lower train.lr or lengthen the warmup and run "
                f"again (nothing from this step on was saved)"
            )
        steps.append(out)
        done = state.step = index + 1
        watch.beat(done, f"in step {done + 1}", step_s=out.seconds)
        history["step"].append(done)
        history["loss"].append(out.loss)
        history["lr"].append(out.lr)
        bar.update(1)
        tps = tr.tokens_per_step / max(out.seconds, 1e-9)
        metrics = {"loss": out.loss, "lr": out.lr, "tokens_per_s": tps, "mfu": mfu(tr, tps)}
        if math.isfinite(out.grad_norm):  # (not on an fp16 step that overflowed and was skipped)
            metrics["grad_norm"] = out.grad_norm
        if scaler is not None:
            metrics["loss_scale"] = scaler.get_scale()
        if done % cfg.log_every == 0 or done == cfg.steps:
            bar.set_postfix(loss=f"{out.loss:.3f}", tok_s=f"{tps:,.0f}")
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
            beat = functools.partial(watch.beat, where=f"in the validation after step {done}")
            metrics["val_loss"] = evaluate(model, tr.val_windows, cfg, rt, tr.pipe, tr.layout, beat)
            history["val_step"].append(done)
            history["val_loss"].append(metrics["val_loss"])
        now_ms = int(time.time() * 1000)
        tracker.log_metrics(metrics, step=done, time_ms=now_ms)
        logged.add(metrics, done, now_ms)
        # One all-reduce: a stop signal on some rank, and whether some rank still writes a checkpoint in
        # the background (the checkpointer publishes it at the first step where none does: all ranks alike).
        stopped, writing = runtime.any_ranks(bool(stop), saver.writing())
        if saver.due(done, stopped):
            logged.mark(done)
        checkpoint = saver.step_done(state, model, optimizer, scaler, stopped, writing)
        if checkpoint is not None:  # (saved, started or published)
            watch.beat(where=f"in step {done + 1}, after checkpoint {checkpoint.name}")
        if stopped:
            runtime.print0(
                f"stopped by {stop.signal or 'a signal to another rank'} after step {done}; checkpoint "
                f"saved, re-run to resume",
                rt=rt,
            )
            break
    checkpoint = saver.finish()  # the checkpoint in flight, if any, waited for and published
    if checkpoint is not None:
        watch.beat(where=f"after step {state.step}, after checkpoint {checkpoint.name}")
    bar.close()
    # Throughput from the median step time of this run, the first step (warm-up, allocation) left out
    # when there are others: the median is not moved by a few steps slowed by other jobs on the machine.
    timed = steps[1:] or steps
    tps = tr.tokens_per_step / max(float(np.median([s.seconds for s in timed])), 1e-9) if timed else 0.0
    # (every process spends about the same CPU time on its share of the step's tokens)
    cpu_s = float(np.median([s.cpu_seconds for s in timed])) * rt.world_size if timed else 0.0
    return TrainResult(
        history=history,
        model=model,
        stopped=stopped,
        flops_per_token=tr.flops_per_token,
        compute_dtype=str(dtype),
        tokens_per_s=tps,
        mfu=mfu(tr, tps),
        optimizer_state_bytes=optimizer_state_bytes(optimizer),
        tokens_per_cpu_s=tr.tokens_per_step / max(cpu_s, 1e-9) if timed else 0.0,
    )


class Logged:
    """The points of the metrics a checkpoint's model is known by, as the run logged them (key, value, step,
    time in ms): its step's training loss and learning rate, and the last validation loss at or before it.
    Logged again against the checkpoint's logged model (tracking.models), they are the run's own points."""

    KEYS = ("loss", "lr", "val_loss")

    def __init__(self):
        self.last: dict[str, tuple] = {}
        self.marked: dict[int, list[tuple]] = {}

    def add(self, metrics: dict, step: int, time_ms: int) -> None:
        for key in self.KEYS:
            if key in metrics:
                self.last[key] = (key, float(metrics[key]), step, time_ms)

    def mark(self, step: int) -> None:
        """A checkpoint of `step` is saved: its points, kept until it is published (later, when written in
        the background)."""
        self.marked[step] = list(self.last.values())

    def at(self, step: int) -> list[tuple]:
        return [p for p in self.marked.pop(step, self.last.values()) if p[2] <= step]


def mfu(tr: Trainer, tokens_per_s: float) -> float:
    """Model FLOPs utilization of one process at `tokens_per_s` (all processes together)."""
    return tr.flops_per_token * tokens_per_s / tr.rt.world_size / (tr.cfg.peak_tflops * 1e12)


def fit(model, train_data, val_data, cfg: TrainConfig, context: int, run: StageRun, tracker=None) -> TrainResult:
    """train() in the run's checkpoint folder (held: StageRun.checkpoints), logged to `tracker` (default: the
    run's own); a stop signal (the loop saved a checkpoint) is tagged on the run and raised as Stopped."""
    tracker = run.tracker if tracker is None else tracker
    folder = run.folder
    result = train(
        model, train_data, val_data, cfg, context, run.rt, folder.path, tracker, run.stop, writer=folder.writer
    )
    if result.stopped:
        tracker.set_tags({"stopped_by": run.stop.signal or "SIGTERM", "resume_from": str(folder.path)})
        raise runtime.Stopped
    return result


def full_state_dict(model, rt: runtime.Runtime, trainable_only: bool = False) -> dict:
    """The whole model's state on CPU, on rank 0 (gathered from FSDP shards or taken from DDP);
    with `trainable_only`, just the trainable parameters (the adapters of a frozen base)."""
    if getattr(model, pipeline.PART, False):  # one pipeline stage's part on each rank
        return pipeline.full_state_dict(model, rt)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    sd = get_model_state_dict(model, options=options)
    if trainable_only:
        names = {checkpointer.fqn(n) for n, p in model.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in sd.items() if checkpointer.fqn(k) in names}
    return {k.removeprefix("_orig_mod."): v for k, v in sd.items()} if rt.is_main else {}


def write_curves(folder: Path, history: dict, val_column: str = "val_loss") -> None:
    """The loss curves as DVC plot files: loss.csv (step, train_loss) every step and <val_column>.csv
    (step, <val_column>) at each evaluation. Two files, so no step has an empty cell that a plot
    would draw as zero."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "loss.csv", "w") as fh:
        fh.write("step,train_loss\n")
        fh.writelines(f"{s},{v:.6f}\n" for s, v in zip(history["step"], history["loss"], strict=True))
    with open(folder / f"{val_column}.csv", "w") as fh:
        fh.write(f"step,{val_column}\n")
        fh.writelines(f"{s},{v:.6f}\n" for s, v in zip(history["val_step"], history["val_loss"], strict=True))
