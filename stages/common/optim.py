"""The optimizer side of a training step: the learning-rate schedule, AdamW (fused) or bitsandbytes'
8-bit AdamW, fp16's gradient scaler, gradient clipping over mixed DTensor and plain gradients, and the
bytes the optimizer's states take."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from stages.common import runtime

if TYPE_CHECKING:
    from stages.common.mesh import Layout
    from stages.common.train_config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model, cfg: TrainConfig, layout: Layout):
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
        if layout.splits_layers:
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, foreach=False)
        fused = not (cfg.precision == "fp16" and cfg.strategy == "fsdp")
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=fused)
    import bitsandbytes as bnb

    cls = bnb.optim.AdamW8bit if cfg.optimizer == "adamw8bit" else bnb.optim.PagedAdamW8bit
    return cls(groups, lr=cfg.lr, betas=betas)


def make_grad_scaler(cfg: TrainConfig, rt: runtime.Runtime):
    """fp16's gradient scaler (None otherwise): the loss is multiplied by a scale that keeps small
    gradients above fp16's underflow; steps whose gradients overflow are skipped and the scale halved.
    Under FSDP the sharded scaler agrees on an overflow across ranks."""
    if runtime.compute_dtype(rt.device, cfg.precision) != torch.float16:
        return None
    if rt.distributed and cfg.strategy == "fsdp":  # DTensor gradients
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=rt.device.type)
    return torch.amp.GradScaler(rt.device.type)


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
