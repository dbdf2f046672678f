"""Pipeline parallelism: a causal LM split by decoder layers into stages, run by a
torch.distributed.pipelining schedule (GPipe or 1F1B) over the step's micro-batches. With more processes
than stages, a stage's layers can be split by tensor parallel, and each stage can run on several
data-parallel processes, each pipeline on its own batches (under ddp the loop averages a stage's
gradients over its copies; under fsdp FSDP2 shards the stage over them).

Each process keeps its part of the transformers model itself, with the other parts removed (the
embedding on the first stage, the final norm and head on the last, its run of decoder layers under
their own indices; the model's own code, stages.models.llama, cuts the part and runs its forward), so
parameter names are the whole model's: checkpoints (DCP) load under any other
layout, and the published model is the parts gathered on rank 0.
"""

from __future__ import annotations

import torch

from stages.common import mesh, runtime
from stages.common.losses import cross_entropy, vocab_parallel_loss
from stages.common.parallel import REDUCE_TORCH_DTYPES, shard
from stages.models import llama

# Marks a model that is one pipeline stage's part of the whole (see full_state_dict).
PART = "pipeline_part"
# Marks the process that sends its stage's part to rank 0 when the model is published.
PUBLISHER = "pipeline_publisher"


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The decoder layers of `stage`: an equal run of consecutive layers per stage."""
    per = n_layers // stages
    return range(stage * per, (stage + 1) * per)


def layout_problem(n_layers: int, stages: int, micro_batches: int, tied_embeddings: bool = False) -> str | None:
    """Why a model and step cannot be pipelined over `stages` stages, or None."""
    if tied_embeddings:
        return (
            "the model ties its output head to its input embedding (tie_word_embeddings), which sit on the first "
            "and last stages: their gradients would not be summed; untie them or set pipeline_parallel 1"
        )
    if n_layers % stages:
        return f"the model's {n_layers} decoder layers are not divisible by pipeline_parallel {stages}"
    if micro_batches < stages:
        return (
            f"a step has {micro_batches} micro-batches per pipeline (batch_size / data-parallel processes, in "
            f"micro-batches of at most micro_batch_size), fewer than its {stages} stages: the pipeline would idle; "
            f"raise batch_size or lower micro_batch_size"
        )
    return None


class Pipeline:
    """This process's stage of the model and the schedule that runs a step's micro-batches through all
    stages. The losses are the loop's (summed cross-entropy times the step's scale), so the gradients
    are those of the one-process run; the schedule does not rescale them."""

    def __init__(self, model, cfg, micro_batches: int, rt: runtime.Runtime, layout: mesh.Layout):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stages = layout.pipeline
        # (a mesh when a stage runs on several processes: data-parallel copies, tensor-parallel ranks)
        procs = layout.mesh if layout.stage_size > 1 else None
        self.stage = layout.pipeline_rank
        self.group = procs["pp"].get_group() if procs else torch.distributed.group.WORLD  # (a pipeline's stages)
        self.first, self.last = self.stage == 0, self.stage == stages - 1
        own = stage_layers(len(llama.decoder_layers(model)), stages, self.stage)
        llama.keep_stage_part(model, own, self.first, self.last)
        setattr(model, PART, True)
        self.model = model.to(rt.device)  # (this stage's part only)
        self.layout = layout
        if layout.splits_layers:  # (3D: each stage's layers split like a whole model's)
            llama.tensor_parallelize(model, procs["tp"])
        self.scale = 1.0
        self.device = rt.device
        module = llama.StageForward(model, self.first, self.last)
        # Under ddp the loop averages the stage's gradients over its replicas after the step: one flat
        # all-reduce, the bytes DDP's buckets would send, without DDP's bucket rebuilding, which fails
        # under a schedule's partial backward passes here (torch 2.13, gloo).
        copies = layout.data_parallel
        self.replicas = procs["dp_shard"].get_group() if copies and cfg.strategy == "ddp" else None
        if copies and cfg.strategy == "fsdp":
            module = shard_stage(module, cfg, rt, layout)
        # One process per stage sends its part when the model is published (its copies and tensor-parallel
        # peers hold the same part).
        setattr(model, PUBLISHER, layout.leads_stage)
        pipe_stage = PipelineStage(module, self.stage, stages, rt.device, group=self.group)
        kind = ScheduleGPipe if cfg.pipeline_schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(pipe_stage, micro_batches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        loss = cross_entropy(logits, y, reduction="sum")  # (vocabulary-sharded logits: under loss_parallel)
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss) * self.scale

    def run(self, x: torch.Tensor, y: torch.Tensor, scale: float, train: bool = True) -> torch.Tensor:
        """Run a batch (its rows: the micro-batches in order) through the pipeline; the summed loss times
        `scale` on the last stage, zero elsewhere. `train`: forward and backward (gradients accumulate)."""
        self.scale = scale
        losses = []
        args = (x,) if self.first else ()
        target = y if self.last else None
        with vocab_parallel_loss(self.layout):
            if train:
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                with torch.no_grad():
                    self.schedule.eval(*args, target=target, losses=losses)
        if not self.last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()


def shard_stage(module: llama.StageForward, cfg, rt: runtime.Runtime, layout: mesh.Layout) -> llama.StageForward:
    """A stage's module under FSDP2 over its replicas (the processes that run the same stage on other
    batches): per decoder layer and over the stage. The schedule syncs gradients after the step's last
    backward only (pipelining drives FSDP2's gradient sync)."""
    shard(module.lm, cfg, rt, layout.data_mesh, REDUCE_TORCH_DTYPES[cfg.reduce_dtype], root=module)
    return module


def full_state_dict(model, rt: runtime.Runtime) -> dict:
    """The whole model's state on rank 0, gathered from the stages' parts (CPU tensors; FSDP2's and tensor
    parallel's shards gathered within each stage first)."""
    from torch.distributed.tensor import DTensor

    # (every process gathers its shards: full_tensor is a collective of its copies and peers)
    part = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in model.state_dict().items()}
    if not getattr(model, PUBLISHER, True):
        part = {}
    parts = [None] * rt.world_size if rt.is_main else None
    torch.distributed.gather_object(part, parts, dst=0)
    return {k: v for p in parts for k, v in p.items()} if rt.is_main else {}
