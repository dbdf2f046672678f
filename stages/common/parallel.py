"""How a model is spread over the processes of a run: DDP, FSDP2 (per decoder layer, then the root;
HSDP over two mesh dimensions), tensor parallelism through the model's own plan (stages.models.llama),
activation checkpointing, and the gradients no wrapper averages (replicated adapters, a pipeline
stage's under ddp). The pipeline-parallel split is stages.common.pipeline's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stages.common import mesh, runtime
from stages.common.train_config import TrainConfig
from stages.models import llama

if TYPE_CHECKING:
    from stages.common import pipeline

# The torch dtypes of a train section's reduce_dtype choices (train_config.REDUCE_DTYPES).
REDUCE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def wrap(model, cfg: TrainConfig, rt: runtime.Runtime, layout: mesh.Layout):
    """Put the model on the device and under DDP or FSDP2 (one process: unwrapped), laid out as `layout`.

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
    reduce_dtype = REDUCE_TORCH_DTYPES[cfg.reduce_dtype]
    if layout.splits_layers:
        llama.tensor_parallelize(model, layout.mesh["tp"])
        if not layout.data_parallel:
            return model
    if cfg.strategy == "ddp":  # (tensor parallel with data-parallel copies is FSDP2's: mesh.layout_problem)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        # No buffer broadcast before each forward: the model's buffers (RoPE frequencies) are the same
        # on every rank by construction, and the broadcast breaks torch.compile's graph.
        model = DDP(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None, broadcast_buffers=False)
        if reduce_dtype != torch.float32:  # gradients cast down for the all-reduce, back to fp32 after
            hooks = {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}
            model.register_comm_hook(None, hooks[reduce_dtype])
        return torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model
    return shard(model, cfg, rt, layout.data_mesh, reduce_dtype)


def shard(model, cfg: TrainConfig, rt: runtime.Runtime, data_mesh, reduce_dtype: torch.dtype, root=None):
    """FSDP2 over `data_mesh` (2D: HSDP, replicated over its first dimension and sharded over its second):
    fully_shard per decoder layer, then the root (`root`: a module around the model that runs its forward,
    a pipeline stage's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": data_mesh}
    if cfg.offload:  # parameters, gradients and optimizer states live on the host between uses
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    dtype = runtime.compute_dtype(rt.device, cfg.precision)
    if dtype != torch.float32 or reduce_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=reduce_dtype
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    if len(trainable) < sum(1 for _ in model.parameters()):  # a frozen base: its adapters stay whole
        kwargs["ignored_params"] = set(trainable)
        for p in trainable:  # (under offload the base stays on the host; the adapters compute on the device)
            p.data = p.data.to(rt.device)
    for layer in llama.decoder_layers(model):
        if cfg.compile:
            layer.compile(mode=cfg.compile_mode)
        fully_shard(layer, **kwargs)
    fully_shard(model if root is None else root, **kwargs)
    return model


def replicated_params(
    model, cfg: TrainConfig, rt: runtime.Runtime, layout: mesh.Layout, pipe: pipeline.Pipeline | None = None
):
    """The trainable parameters whose gradients no wrapper averages, and the process group the loop
    averages them over (None: all processes): those FSDP left whole (the adapters of a frozen base), and
    a pipeline stage's under ddp, which the loop all-reduces over the stage's replicas once per step
    (after the schedule's last backward, as DDP would). Empty under DDP and FSDP of a whole model, and
    in one process."""
    if pipe is not None:
        return (list(model.parameters()), pipe.replicas) if pipe.replicas is not None else ([], None)
    if not rt.distributed or cfg.strategy != "fsdp" or layout.splits_model:
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
