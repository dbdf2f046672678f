"""The one training loop of the codebase: pretrain, extend_context and finetune_qlora call `train()`.

It owns what every causal-LM training run needs: data parallelism (DDP, or FSDP2 `fully_shard` per
decoder layer then the root), AdamW with weight-decay groups, linear warmup + cosine decay, gradient
accumulation and clipping, periodic validation, tokens/s and MFU, checkpoints (stages.common.ckpt)
every N steps and on a stop signal, and exact resume from the newest intact one. Its settings are the
`train` section of each training stage's params (TrainConfig).

Batches are a pure function of (seed, step): each step draws `batch_size` windows from the token
stream with a generator seeded by both, and rank r takes its slice. So the data position is the step,
and the losses do not depend on the number of processes or on where a run was resumed. Other data
(instruction records) comes as a batch source with the same `batch(step, index, size)` method; its
targets may hold IGNORE_INDEX where no loss is taken (prompt tokens, padding).

A model whose base is frozen (LoRA adapters on a quantized base) trains only its trainable
parameters, and its checkpoints hold only those (the frozen base is reloaded from its source).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import operator
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from stages.common import ckpt, config, mesh, pipeline, runtime, shards

STRATEGIES = ("ddp", "fsdp")
# AdamW in fp32, or bitsandbytes' 8-bit AdamW (block-wise quantized moments: 2 bytes per parameter
# instead of 8), optionally in paged memory that can spill to the host under GPU memory pressure.
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit")
# none; full: every decoder layer recomputes its activations in the backward pass; selective: every
# activation_checkpointing_every-th layer does (memory and speed between none and full).
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
IGNORE_INDEX = -100  # targets that carry no loss
# torch.compile modes; the max-autotune ones also tune the matrix multiplies (Triton on GPUs) and
# compile longer.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The dtype gradients are averaged over processes in: FSDP2's reduce-scatter (MixedPrecisionPolicy
# reduce_dtype), DDP's all-reduce (a compression hook), the all-reduce of replicated adapters. fp32 sums
# exactly as the one-process run does; bf16 and fp16 halve the bytes sent.
LAYOUT_KEYS = ckpt.LAYOUT_KEYS
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainConfig:
    """The `train` section of every training stage (pretrain, extend_context, finetune_qlora)."""

    # Whether the stage trains adapters on a frozen base. Under FSDP the frozen base is sharded and the
    # few trainable parameters stay whole on every rank (see wrap), so any optimizer can step them.
    FROZEN_BASE: ClassVar[bool] = False

    steps: int
    batch_size: int
    micro_batch_size: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    strategy: str
    activation_checkpointing: str
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    log_every: int
    seed: int
    peak_tflops: float
    compile: bool = False
    compile_mode: str = "default"
    precision: str = "auto"
    optimizer: str = "adamw"
    activation_checkpointing_every: int = 2
    offload: bool = False
    reduce_dtype: str = "fp32"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    data_parallel_replicate: int = 1
    """strategy fsdp: the data-parallel processes form this many replicas, each sharding the model over
    the rest (HSDP: gradients reduce-scattered within a replica, then all-reduced across replicas)."""

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: unknown strategy {self.strategy!r}; valid: {', '.join(STRATEGIES)}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"compile_mode: unknown torch.compile mode {self.compile_mode!r}; valid: {', '.join(COMPILE_MODES)}"
            )
        runtime.check_precision(self.precision)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if self.optimizer != "adamw" and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"optimizer: {self.optimizer} needs bitsandbytes (pip install bitsandbytes) or use adamw")
        if self.optimizer != "adamw" and self.strategy == "fsdp" and not self.FROZEN_BASE:
            raise ValueError(
                f"optimizer: {self.optimizer} keeps its states per whole parameter and cannot step FSDP's "
                f"sharded ones; use strategy ddp or optimizer adamw"
            )
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype: unknown dtype {self.reduce_dtype!r}; valid: {', '.join(REDUCE_DTYPES)}")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing: unknown policy {self.activation_checkpointing!r}; valid: "
                f"{', '.join(ACTIVATION_CHECKPOINTING)}"
            )
        if self.offload and self.strategy != "fsdp":
            raise ValueError("offload: FSDP2's CPU offload shards parameters to the host; set strategy fsdp")
        if self.pipeline_schedule not in pipeline.SCHEDULES:
            valid = ", ".join(pipeline.SCHEDULES)
            raise ValueError(f"pipeline_schedule: unknown schedule {self.pipeline_schedule!r}; valid: {valid}")
        for key in ("tensor_parallel", "pipeline_parallel"):
            degree = getattr(self, key)
            if degree > 1 and self.FROZEN_BASE:
                raise ValueError(f"{key}: adapters on a frozen base train under ddp or fsdp; set it 1")
            unsupported = {"offload": self.offload, "compile": self.compile}  # (name: set)
            # bitsandbytes steps whole tensors, not DTensor shards; and its state loads only grouped as saved,
            # which pipeline stages (each with other parameters) cannot share in one checkpoint
            unsupported["optimizer"] = self.optimizer != "adamw"
            # fp16's gradient scaler: not wired into the pipeline schedule, and its unscaling kernel takes
            # no mix of DTensor and plain gradients (tensor parallel)
            unsupported["precision"] = self.precision == "fp16"
            for name, on in unsupported.items():
                if degree > 1 and on:
                    raise ValueError(
                        f"{key}: {degree} is not supported with {name} {getattr(self, name)}; change {name} or "
                        f"set {key} 1"
                    )
        if self.data_parallel_replicate > 1 and self.strategy != "fsdp":
            raise ValueError(
                "data_parallel_replicate: replicas of FSDP2's shards (HSDP) need strategy fsdp; ddp replicates the "
                "model on every data-parallel process already: set it 1"
            )
        keys = ("steps", "batch_size", "micro_batch_size", "log_every", "activation_checkpointing_every")
        for key in (*keys, "tensor_parallel", "pipeline_parallel", "data_parallel_replicate"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be between 0 and lr ({self.lr}), got {self.min_lr}")

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        return runtime.compute_dtype(device, self.precision)

    @property
    def loss_compile_mode(self) -> str | None:
        """The mode lm_loss compiles the loss in; None without compile."""
        return self.compile_mode if self.compile else None

    def check_layout(self, where: str, rt: runtime.Runtime) -> None:
        """What a train section (at the dotted path `where`, e.g. preself.train) can only be checked against
        once the processes and the device are known; before any compute."""
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        problem = mesh.layout_problem(rt.world_size, tp, pp, self.data_parallel_replicate, self.strategy)
        if problem:
            raise config.UserError(f"params.yaml: {where}.{problem}")
        try:
            grad_accum_steps(self, rt.world_size // (tp * pp))
        except ValueError as e:
            layout = (
                " (processes here: the data-parallel ones, processes / (tensor x pipeline degree))"
                if tp * pp > 1
                else ""
            )
            raise config.UserError(f"params.yaml: {where}.{e}{layout}") from None
        if self.offload and not rt.distributed:
            raise config.UserError(
                f"params.yaml: {where}.offload: FSDP2's CPU offload shards over the processes of a torchrun run; "
                f"this one has a single process: run it with torchrun --nproc-per-node 2 or more, or set it false"
            )
        if self.offload and rt.device.type != "cuda":
            raise config.UserError(
                f"params.yaml: {where}.offload: FSDP2's CPU offload moves parameters, gradients and optimizer "
                f"states from GPU memory to the host; this run is on {rt.device.type}, where they are there already: "
                f"set it false"
            )


@dataclass(frozen=True)
class AdapterTrainConfig(TrainConfig):
    """The `train` section of a stage that trains adapters on a frozen base (finetune_qlora)."""

    FROZEN_BASE: ClassVar[bool] = True


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


def data_parallel(cfg: TrainConfig, rt: runtime.Runtime) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel ones. The processes of a tensor-parallel group
    (consecutive ranks), or of a pipeline, hold one model replica between them and read the same batches
    (mesh order: pipeline, data, tensor)."""
    size = rt.world_size // (cfg.tensor_parallel * cfg.pipeline_parallel)
    return rt.rank // cfg.tensor_parallel % size, size


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per optimizer step with `world_size` data-parallel processes."""
    per_step = cfg.micro_batch_size * world_size
    if cfg.batch_size % per_step:
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be a multiple of micro_batch_size x processes "
            f"({cfg.micro_batch_size} x {world_size}); change batch_size or micro_batch_size"
        )
    return cfg.batch_size // per_step


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


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

    def batch(self, step: int, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows [index, index + size) of the step's global batch: inputs and targets, (B, T) each."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.context - 1, (index + size,), generator=g)[index:]
        rows = np.stack([self.tokens[s : s + self.context + 1] for s in starts.tolist()]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]


def decoder_layers(model):
    """The decoder blocks of a causal LM, also under a PEFT wrapper (each is one FSDP unit)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def enable_activation_checkpointing(model, every_n_layers: int = 1) -> None:
    """transformers' activation checkpointing of every n-th decoder layer (`activation_checkpointing_enable`;
    `gradient_checkpointing_enable` in the transformers versions before the rename)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(every_n_layers=every_n_layers)


def checkpoint_activations(model, cfg: TrainConfig) -> None:
    """The train section's activation checkpointing policy, on the model's decoder layers."""
    if cfg.activation_checkpointing != "none":
        every = cfg.activation_checkpointing_every if cfg.activation_checkpointing == "selective" else 1
        enable_activation_checkpointing(model, every)


def wrap(model, cfg: TrainConfig, rt: runtime.Runtime):
    """Put the model on the device and under DDP or FSDP2 (one process: unwrapped).

    FSDP2 mixed precision: parameters are gathered in the compute dtype (bf16 or fp16; fp32 master
    weights stay sharded) and gradients reduced in `reduce_dtype`. A model with a frozen base (adapters)
    has only the base sharded: its trainable parameters are few (LoRA: well under 1% of a large base),
    stay whole on every rank and have their gradients all-reduced by the loop (replicated_params), so
    any optimizer, also bitsandbytes' 8-bit ones, steps them, and their optimizer states do not depend
    on the number of processes."""
    # (with offload the parameters stay on the host: fully_shard places the shards)
    if not cfg.offload and any(p.device != rt.device for p in model.parameters()):
        model.to(rt.device)  # quantized models are loaded onto their device already
    checkpoint_activations(model, cfg)
    if not rt.distributed:
        return torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model
    reduce_dtype = REDUCE_DTYPES[cfg.reduce_dtype]
    if cfg.tensor_parallel > 1 or cfg.data_parallel_replicate > 1:
        procs = mesh.device_mesh(cfg, rt)
        if cfg.tensor_parallel > 1:
            tensor_parallelize(model, procs["tp"])
        if data_parallel(cfg, rt)[1] == 1:
            return model
        return shard(model, cfg, rt, mesh.data_mesh(cfg, procs), reduce_dtype)
    if cfg.strategy == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        # No buffer broadcast before each forward: the model's buffers (RoPE frequencies) are the same
        # on every rank by construction, and the broadcast breaks torch.compile's graph.
        model = DDP(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None, broadcast_buffers=False)
        if reduce_dtype != torch.float32:  # gradients cast down for the all-reduce, back to fp32 after
            hooks = {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}
            model.register_comm_hook(None, hooks[reduce_dtype])
        return torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model
    from torch.distributed.device_mesh import init_device_mesh

    return shard(model, cfg, rt, init_device_mesh(rt.device.type, (rt.world_size,)), reduce_dtype)


def tensor_parallelize(model, tp_mesh) -> None:
    """Megatron-style tensor parallelism (torch.distributed.tensor.parallel). In every decoder layer,
    q/k/v and gate/up are split by output features (column-wise: each rank computes its heads and its
    part of the MLP width), o and down by input features (row-wise: the partial outputs are summed by
    one all-reduce each). The attention's and the MLP's input enters as one replicated DTensor, so the
    input gradients of q, k and v (and of gate and up) are summed locally and all-reduced once per
    block, not once per projection. The embedding is split by vocabulary rows (its partial lookups
    summed by one all-reduce) and the output head by vocabulary columns, whose sharded logits the loss
    takes as they are (vocab_parallel_loss): no rank holds the whole (B, T, V) logits. Norms stay whole
    on every rank. A model whose head is tied to its embedding keeps both whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    block_input = {"use_local_output": False}  # (a DTensor, so that the projections share its gradient)
    plan = {
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            **block_input,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), **block_input),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, plan)
    if not model.config.tie_word_embeddings:
        ends = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        # (a pipeline stage's part holds the embedding, or the head, or neither)
        present = {name: style for name, style in ends.items() if operator.attrgetter(name)(model) is not None}
        parallelize_module(model, tp_mesh, present)


def vocab_parallel_loss(cfg: TrainConfig):
    """The context a tensor-parallel model's loss is computed and differentiated in: cross-entropy of
    vocabulary-sharded logits, each rank over its columns (torch's loss_parallel); a no-op context
    otherwise."""
    if cfg.tensor_parallel == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def tensor_parallel_problem(model_config, degree: int) -> str | None:
    """Why a model cannot be split `degree` ways by tensor_parallelize, or None."""
    c = model_config
    sizes = [
        ("attention heads", c.num_attention_heads),
        ("key/value heads", c.num_key_value_heads),
        ("MLP width (intermediate_size)", c.intermediate_size),
    ]
    if not c.tie_word_embeddings:  # (the embedding and head are split by vocabulary, in equal parts)
        sizes.append(("vocabulary entries (vocab_size)", c.vocab_size))
    for name, value in sizes:
        if value % degree:
            return f"the model's {value} {name} are not divisible by tensor_parallel {degree}"
    return None


def shard(model, cfg: TrainConfig, rt: runtime.Runtime, data_mesh, reduce_dtype: torch.dtype, root=None):
    """FSDP2 over `data_mesh` (2D: HSDP, replicated over its first dimension and sharded over its second):
    fully_shard per decoder layer, then the root (`root`: a module around the model that runs its forward,
    a pipeline stage's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": data_mesh}
    if cfg.offload:  # parameters, gradients and optimizer states live on the host between uses
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    dtype = cfg.compute_dtype(rt.device)
    if dtype != torch.float32 or reduce_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=reduce_dtype
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    if len(trainable) < sum(1 for _ in model.parameters()):  # a frozen base: its adapters stay whole
        kwargs["ignored_params"] = set(trainable)
        for p in trainable:  # (under offload the base stays on the host; the adapters compute on the device)
            p.data = p.data.to(rt.device)
    for layer in decoder_layers(model):
        if cfg.compile:
            layer.compile(mode=cfg.compile_mode)
        fully_shard(layer, **kwargs)
    fully_shard(model if root is None else root, **kwargs)
    return model


def replicated_params(model, cfg: TrainConfig, rt: runtime.Runtime, pipe: pipeline.Pipeline | None = None):
    """The trainable parameters whose gradients no wrapper averages, and the process group the loop
    averages them over (None: all processes): those FSDP left whole (the adapters of a frozen base), and
    a pipeline stage's under ddp, which the loop all-reduces over the stage's replicas once per step
    (after the schedule's last backward, as DDP would). Empty under DDP and FSDP of a whole model, and
    in one process."""
    if pipe is not None:
        return (list(model.parameters()), pipe.replicas) if pipe.replicas is not None else ([], None)
    if not rt.distributed or cfg.strategy != "fsdp" or cfg.tensor_parallel * cfg.pipeline_parallel > 1:
        return [], None
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)], None


def all_reduce_grads(params: list[torch.nn.Parameter], reduce_dtype: torch.dtype, group=None) -> None:
    """Average the gradients of replicated parameters over the processes of `group` (None: all), in one
    flat all-reduce in `reduce_dtype` (a missing gradient counts as zeros, so every rank sends the same
    layout)."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1).to(reduce_dtype) for p in params])
    flat /= torch.distributed.get_world_size(group)  # (before the sum, which could overflow in fp16)
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def make_grad_scaler(cfg: TrainConfig, rt: runtime.Runtime):
    """fp16's gradient scaler (None otherwise): the loss is multiplied by a scale that keeps small
    gradients above fp16's underflow; steps whose gradients overflow are skipped and the scale halved.
    Under FSDP the sharded scaler agrees on an overflow across ranks."""
    if cfg.compute_dtype(rt.device) != torch.float16:
        return None
    if rt.distributed and cfg.strategy == "fsdp":  # DTensor gradients
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=rt.device.type)
    return torch.amp.GradScaler(rt.device.type)


def make_optimizer(model, cfg: TrainConfig):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # (adapters are all matrices; checkpoints keep no empty group)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        # The fused kernel (CPU and CUDA) is the fastest AdamW; it is also what transformers.Trainer uses.
        # Under tensor parallel, the per-parameter kernel: the parameters are DTensors on two meshes beside
        # plain tensors, which the multi-tensor kernels do not take in one list. Not fused beside FSDP's
        # sharded gradient scaler (fp16) either: its overflow flag has the wrong shape for the fused kernel.
        if cfg.tensor_parallel > 1:
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, foreach=False)
        fused = not (cfg.precision == "fp16" and cfg.strategy == "fsdp")
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=fused)
    import bitsandbytes as bnb

    cls = bnb.optim.AdamW8bit if cfg.optimizer == "adamw8bit" else bnb.optim.PagedAdamW8bit
    return cls(groups, lr=cfg.lr, betas=betas)


def clip_grad_norm(params, max_norm: float, stages=None) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most `max_norm`; the norm before. For a model
    whose parameters are DTensors on several meshes (tensor parallel) beside plain tensors, where
    torch.nn.utils.clip_grad_norm_ would combine norms of different kinds: each gradient's norm is
    computed whole (a DTensor's over its mesh). `stages`: the process group of a pipeline's stages, each
    holding other parameters; their squared norms are summed over it."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for g in grads:  # (on the gradients' device: nccl reduces no host tensor)
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        total += (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(total.device) ** 2
    if stages is not None:
        torch.distributed.all_reduce(total, group=stages)
    total = total.sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of this process's optimizer states (moments, and 8-bit optimizers' block scales)."""
    states = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    states = [getattr(v, "_local_tensor", v) for v in states]  # a DTensor's own shard under FSDP
    # Counted once per storage: 8-bit optimizers give every parameter the same quantization maps.
    unique = {(v.untyped_storage().data_ptr(), v.device): v for v in states}
    return sum(v.untyped_storage().nbytes() for v in unique.values())


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of (B, T, V) logits, in fp32, against (B, T) targets other than IGNORE_INDEX."""
    return torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


@functools.cache
def compiled_cross_entropy(mode: str):
    """cross_entropy under torch.compile: the fp32 cast, log-softmax and target gather fuse into passes
    over the logits, and the (B, T, V) log-probabilities are never written out."""
    return torch.compile(cross_entropy, mode=mode)


def lm_loss(
    model, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean", compile_mode: str | None = None
) -> torch.Tensor:
    """Next-token cross-entropy over targets other than IGNORE_INDEX, their mean or sum; y is x shifted
    by one, (B, T) each. Logits in fp32. With a compile_mode, the loss runs compiled in that mode."""
    from torch.distributed.tensor import DTensor

    logits = model(input_ids=x, use_cache=False).logits  # (B, T, V); no KV cache while training
    if isinstance(logits, DTensor):  # sharded by vocabulary (tensor parallel, under vocab_parallel_loss)
        return cross_entropy(logits, y, reduction).full_tensor()  # (replicated: no communication)
    loss_fn = cross_entropy if compile_mode is None else compiled_cross_entropy(compile_mode)
    return loss_fn(logits, y, reduction)


def global_target_count(targets: list[torch.Tensor], rt: runtime.Runtime) -> torch.Tensor:
    """How many targets (not IGNORE_INDEX) one optimizer step holds, over its micro-batches and all
    ranks: the divisor that makes the step's loss the mean over tokens, however the masked (prompt)
    tokens fall across micro-batches and ranks."""
    count = sum((y != IGNORE_INDEX).sum() for y in targets).to(rt.device, torch.float64)
    if rt.distributed:
        torch.distributed.all_reduce(count)
    return count.clamp(min=1)


def autocast(cfg: TrainConfig, rt: runtime.Runtime):
    """Autocast to the compute dtype (bf16, fp16); a no-op context in fp32."""
    dtype = cfg.compute_dtype(rt.device)
    return torch.autocast(rt.device.type, dtype=dtype, enabled=dtype != torch.float32)


@torch.no_grad()
def evaluate(model, windows, cfg: TrainConfig, rt: runtime.Runtime, pipe: pipeline.Pipeline | None = None) -> float:
    """Mean loss per target token over `eval_batches` global batches of fixed validation windows (same
    every call); `windows` is a Windows or another batch source. `pipe`: the model's pipeline stages."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss sum, target count
    dp_rank, dp_size = data_parallel(cfg, rt)
    accum = grad_accum_steps(cfg, dp_size)
    for b in range(cfg.eval_batches):
        if pipe is not None:  # the step's micro-batches through the pipeline; the last stage has the loss
            micro = [
                windows.batch(-1 - b, (m * dp_size + dp_rank) * cfg.micro_batch_size, cfg.micro_batch_size)
                for m in range(accum)
            ]
            x, y = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
            with autocast(cfg, rt):
                loss = pipe.run(x.to(rt.device), y.to(rt.device), 1.0, train=False)
            count = float((y != IGNORE_INDEX).sum()) if pipe.last else 0.0
            total += torch.tensor([loss.item(), count], dtype=torch.float64, device=rt.device)
            continue
        for m in range(accum):
            index = (m * dp_size + dp_rank) * cfg.micro_batch_size
            x, y = windows.batch(-1 - b, index, cfg.micro_batch_size)
            with autocast(cfg, rt), vocab_parallel_loss(cfg):
                loss = lm_loss(
                    model, x.to(rt.device), y.to(rt.device), reduction="sum", compile_mode=cfg.loss_compile_mode
                )
            total += torch.tensor(
                [loss.item(), float((y != IGNORE_INDEX).sum())], dtype=torch.float64, device=rt.device
            )
    model.train()
    if rt.distributed:  # (tensor-parallel ranks count their batches alike: the ratio is the same)
        torch.distributed.all_reduce(total)
    return (total[0] / total[1]).item()


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
) -> TrainResult:
    """Train `model` (a transformers causal LM, or a PEFT model around one) for cfg.steps optimizer
    steps of sequences of `context_length` tokens, resuming from the newest intact checkpoint in
    `ckpt_folder`. The data are token streams (np.ndarray or memory-mapped shards.TokenStream, cut into
    Windows) or batch sources with
    `batch(step, index, size) -> (inputs, targets)`. A stop signal ends it after the step with a
    checkpoint (`stopped`). Stages hold the folder's lock (stage.checkpoints) around it and their
    publishing, so no second run resumes from or writes into the same folder meanwhile."""
    dp_rank, dp_size = data_parallel(cfg, rt)
    accum = grad_accum_steps(cfg, dp_size)
    fpt = flops_per_token(model, context_length)
    pipe = None
    problem = tensor_parallel_problem(model.config, cfg.tensor_parallel) if cfg.tensor_parallel > 1 else None
    if problem:
        raise config.UserError(f"train.tensor_parallel: {problem}; choose a degree that divides them")
    if cfg.pipeline_parallel > 1:
        c = model.config
        problem = pipeline.layout_problem(c.num_hidden_layers, cfg.pipeline_parallel, accum, c.tie_word_embeddings)
        if problem:
            raise config.UserError(f"train.pipeline_parallel: {problem}")
        checkpoint_activations(model, cfg)
        pipe = pipeline.Pipeline(model, cfg, accum, rt)
        model = pipe.model  # this stage's part
    else:
        model = wrap(model, cfg, rt)
    optimizer = make_optimizer(model, cfg)
    replicated, replica_group = replicated_params(model, cfg, rt, pipe)
    scaler = make_grad_scaler(cfg, rt)
    streams = (np.ndarray, shards.TokenStream)
    train_w = Windows(train_data, context_length, cfg.seed) if isinstance(train_data, streams) else train_data
    val_w = Windows(val_data, context_length, cfg.seed) if isinstance(val_data, streams) else val_data
    history = {"step": [], "loss": [], "lr": [], "val_step": [], "val_loss": []}
    start = 0
    # Rank 0 picks the newest intact checkpoint (a damaged one is skipped with a warning); all ranks load it.
    latest = runtime.broadcast_object(ckpt.newest_intact_checkpoint(ckpt_folder) if rt.is_main else None)
    if latest is not None:
        extra = ckpt.load_checkpoint(latest, model, optimizer)
        start, history = extra["step"], extra["history"]
        if scaler is not None and "grad_scaler" in extra:
            scaler.load_state_dict(extra["grad_scaler"])
        runtime.print0(f"resuming from {latest} (step {start})", rt=rt)
    dtype = cfg.compute_dtype(rt.device)
    runtime.warn_if_emulated_bf16(rt.device, dtype, rt)
    tokens_per_step = cfg.batch_size * context_length
    stopped = False
    bar = runtime.progress(total=cfg.steps, initial=start, desc="train", rt=rt)
    step_times = []  # seconds of each step's forward/backward/update (validation and saving excluded)
    step_cpu_times = []  # the same steps' CPU seconds of this process
    for step in range(start, cfg.steps):
        t0, cpu0 = time.perf_counter(), time.process_time()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=rt.device)
        micro = [
            train_w.batch(step, (m * dp_size + dp_rank) * cfg.micro_batch_size, cfg.micro_batch_size)
            for m in range(accum)
        ]
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
            no_sync = dp_size > 1 and not last and cfg.strategy == "ddp"
            sync = model.no_sync() if no_sync else contextlib.nullcontext()
            with sync, autocast(cfg, rt), vocab_parallel_loss(cfg):
                loss = lm_loss(model, x, y, reduction="sum", compile_mode=cfg.loss_compile_mode) * scale.to(
                    torch.float32
                )
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.detach()
        all_reduce_grads(replicated, REDUCE_DTYPES[cfg.reduce_dtype], replica_group)
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip the true gradients
        if cfg.tensor_parallel > 1 or pipe is not None:
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
            loss_sum /= rt.world_size // cfg.pipeline_parallel  # (the last stage holds a pipeline's loss)
        loss_value = loss_sum.item()
        step_times.append(time.perf_counter() - t0)
        step_cpu_times.append(time.process_time() - cpu0)
        history["step"].append(step + 1)
        history["loss"].append(loss_value)
        history["lr"].append(lr)
        bar.update(1)
        done = step + 1
        tps = tokens_per_step / max(step_times[-1], 1e-9)
        metrics = {
            "loss": loss_value,
            "lr": lr,
            "tokens_per_s": tps,
            "mfu": fpt * tps / rt.world_size / (cfg.peak_tflops * 1e12),
        }
        if math.isfinite(float(grad_norm)):  # (not on an fp16 step that overflowed and was skipped)
            metrics["grad_norm"] = float(grad_norm)
        if scaler is not None:
            metrics["loss_scale"] = scaler.get_scale()
        if done % cfg.log_every == 0 or done == cfg.steps:
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tps:,.0f}")
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
            metrics["val_loss"] = evaluate(model, val_w, cfg, rt, pipe)
            history["val_step"].append(done)
            history["val_loss"].append(metrics["val_loss"])
        tracker.log_metrics(metrics, step=done)
        stopped = runtime.any_rank(bool(stop))
        if stopped or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps):
            state = {"grad_scaler": scaler.state_dict()} if scaler is not None else {}
            ckpt.save_checkpoint(ckpt_folder, done, model, optimizer, history, rt, state=state)
        if stopped:
            runtime.print0(
                f"stopped by {stop.signal or 'a signal to another rank'} after step {done}; checkpoint "
                f"saved, re-run to resume",
                rt=rt,
            )
            break
    bar.close()
    # Throughput from the median step time of this run, the first step (warm-up, allocation) left out
    # when there are others: the median is not moved by a few steps slowed by other jobs on the machine.
    timed, cpu_timed = step_times[1:] or step_times, step_cpu_times[1:] or step_cpu_times
    tps = tokens_per_step / max(float(np.median(timed)), 1e-9) if timed else 0.0
    # (every process spends about the same CPU time on its share of the step's tokens)
    cpu_tps = tokens_per_step / max(float(np.median(cpu_timed)) * rt.world_size, 1e-9) if cpu_timed else 0.0
    return TrainResult(
        history=history,
        model=model,
        stopped=stopped,
        flops_per_token=fpt,
        compute_dtype=str(dtype),
        tokens_per_s=tps,
        mfu=fpt * tps / rt.world_size / (cfg.peak_tflops * 1e12),
        optimizer_state_bytes=optimizer_state_bytes(optimizer),
        tokens_per_cpu_s=cpu_tps,
    )


def fit(model, train_data, val_data, cfg: TrainConfig, context: int, rt, folder: Path, tracker, stop):
    """train(); a stop signal (the loop saved a checkpoint) is tagged on the run and raised as Stopped."""
    result = train(model, train_data, val_data, cfg, context, rt, folder, tracker, stop)
    if result.stopped:
        tracker.set_tags({"stopped_by": stop.signal or "SIGTERM", "resume_from": str(folder)})
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
        names = {ckpt.fqn(n) for n, p in model.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in sd.items() if ckpt.fqn(k) in names}
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
