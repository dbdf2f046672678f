"""FSDP2 with the loop's mixed-precision policy in a process group of one; run under torchrun (1 process).

    python -m torch.distributed.run --standalone --nproc-per-node 1 tests/fsdp_one_rank_probe.py <out.json>

The process group is nccl on a GPU (gloo on a CPU). The stage's loop trains a tiny random Llama for a
few steps twice from the same weights and batches: plainly (one process: no wrapper) and through the
loop's FSDP2 branch (`fully_shard` per decoder layer and the whole model, bf16 parameters and fp32
gradient reduction on GPUs), the group's collectives included. It writes both loss curves.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist

from stages.common import loop, runtime, train_config
from stages.common.tracking.tracker import NullTracker


class OneRankGroup(runtime.Runtime):
    """A runtime that takes the distributed paths (wrapping, all-reduces) with a group of one."""

    @property
    def distributed(self) -> bool:
        return True


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def curve(strategy: str, rt: runtime.Runtime, tokens: np.ndarray) -> list[float]:
    cfg = train_config.build(
        steps=6, lr=1e-2, min_lr=1e-3, warmup_steps=1, strategy=strategy, eval_batches=0, log_every=100
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = loop.train(model(), tokens, tokens, cfg, 64, rt, Path(tmp), NullTracker(), runtime.StopFlag())
    return out.history["loss"]


def main() -> None:
    rt = runtime.init()
    torch_dist.init_process_group("nccl" if rt.device.type == "cuda" else "gloo")
    # a repeating sequence, so that a few steps visibly learn
    tokens = np.tile(np.random.default_rng(0).integers(0, 256, size=97), 200).astype(np.uint16)
    group = OneRankGroup(rt.rank, rt.world_size, rt.local_rank, rt.local_world_size, rt.device)
    result = {
        "backend": torch_dist.get_backend(),
        "world_size": torch_dist.get_world_size(),
        "dtype": str(runtime.compute_dtype(rt.device)),
        "plain": curve("ddp", rt, tokens),
        "fsdp": curve("fsdp", group, tokens),
    }
    Path(sys.argv[1]).write_text(json.dumps(result))
    runtime.teardown()


if __name__ == "__main__":
    main()
