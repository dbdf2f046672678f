"""The training losses: next-token cross-entropy in fp32 over the targets that carry a loss (not
IGNORE_INDEX: prompt tokens, padding), compiled or not, over vocabulary-sharded logits under tensor
parallelism, and the count of a step's targets over all ranks that makes a step's loss their mean."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch

from stages.common import runtime

if TYPE_CHECKING:
    from stages.common.mesh import Layout

IGNORE_INDEX = -100  # targets that carry no loss


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


def vocab_parallel_loss(layout: Layout):
    """The context a tensor-parallel model's loss is computed and differentiated in: cross-entropy of
    vocabulary-sharded logits, each rank over its columns (torch's loss_parallel); a no-op context
    otherwise."""
    if not layout.splits_layers:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def global_target_count(targets: list[torch.Tensor], rt: runtime.Runtime) -> torch.Tensor:
    """How many targets (not IGNORE_INDEX) one optimizer step holds, over its micro-batches and all
    ranks: the divisor that makes the step's loss the mean over tokens, however the masked (prompt)
    tokens fall across micro-batches and ranks."""
    count = sum((y != IGNORE_INDEX).sum() for y in targets).to(rt.device, torch.float64)
    if rt.distributed:
        torch.distributed.all_reduce(count)
    return count.clamp(min=1)
