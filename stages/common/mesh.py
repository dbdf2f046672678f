"""How a training run's processes are laid out: a (pipeline, data replicate, data shard, tensor) mesh.

The train section's layout keys set the degrees: `pipeline_parallel` stages, `tensor_parallel` ranks
per model replica's layer, and of the data-parallel processes left (processes / (pipeline x tensor)),
`data_parallel_replicate` replicas (under strategy fsdp: HSDP, each replica sharded over the rest;
1: plain FSDP or DDP). Ranks fill the mesh row-major in that order: consecutive ranks form a
tensor-parallel group, then the data-parallel ranks of one pipeline stage, then the stages.

A run has one `Layout` (the loop's build makes it): the degrees, this process's data-parallel rank and the
run's one DeviceMesh, which the wrappers (stages.common.parallel) and the pipeline split share. The code
that lays the model out asks it the layout's questions (data_size, splits_layers, pipelined, stage_size, ...)
instead of working them out from the train section's degrees. `layout_problem` is the one check of the
degrees against the processes, run by `Layout.over` (and `Layout.of`): the train section's
(TrainConfig.refusal: the stage's check before any compute, and the launcher's before it starts them).
It imports no torch until a running stage asks for the DeviceMesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def layout_problem(
    processes: int, tensor_parallel: int = 1, pipeline_parallel: int = 1, data_parallel_replicate: int = 1,
    strategy: str = "ddp",
) -> str | None:  # fmt: skip
    """Why `processes` cannot form a train section's layout, as '<key>: <why>; <what to change>', or None."""
    tp, pp, replicate = tensor_parallel, pipeline_parallel, data_parallel_replicate
    if processes % (tp * pp):
        key, degree = ("tensor_parallel", tp) if pp == 1 else ("pipeline_parallel", pp)
        what = f"tensor_parallel x pipeline_parallel = {tp * pp}" if tp > 1 and pp > 1 else str(degree)
        return (
            f"{key}: {what} does not divide the {processes} processes of this run; start a multiple of {tp * pp} "
            f"processes or change it"
        )
    dp = processes // (tp * pp)
    if dp % replicate:
        return (
            f"data_parallel_replicate: {replicate} does not divide the {dp} data-parallel processes (processes / "
            f"(tensor x pipeline degree)); start a multiple of {replicate * tp * pp} processes or change it"
        )
    if tp > 1 and dp > 1 and strategy == "ddp":
        return (
            f"tensor_parallel: {processes} processes = {dp} data-parallel x {tp} tensor-parallel"
            f"{f' x {pp} pipeline stages' if pp > 1 else ''}; the data dimension of a layout with tensor parallel "
            f"is sharded by FSDP2, not replicated by DDP: set strategy fsdp (or run {tp * pp} processes)"
        )
    return None


@dataclass
class Layout:
    """One run's layout: its degrees along DIMS, this process's place among the data-parallel ones, and
    the run's DeviceMesh (made on first use, once). `Layout.of` makes it from a train section and the
    processes, after the one check of the layout (`layout_problem`, which the launcher runs too)."""

    pipeline: int
    replicate: int
    """Data-parallel replicas (HSDP: each replica sharded over `shard` processes)."""
    shard: int
    tensor: int
    rank: int
    device_type: str = "cpu"
    _mesh: object = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, cfg, rt) -> Layout:
        """The layout of a train section (cfg) on the processes of `rt`; ValueError naming the key when they
        cannot form it."""
        return cls.over(cfg, rt.world_size, rt.rank, rt.device.type)

    @classmethod
    def over(cls, cfg, processes: int, rank: int = 0, device_type: str = "cpu") -> Layout:
        """The layout of a train section (cfg) over `processes` (as process `rank`), before any process
        starts; ValueError naming the key when they cannot form it."""
        tp, pp, replicate = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.data_parallel_replicate
        problem = layout_problem(processes, tp, pp, replicate, cfg.strategy)
        if problem:
            raise ValueError(problem)
        dp = processes // (tp * pp)
        return cls(pp, replicate, dp // replicate, tp, rank, device_type)

    @property
    def processes(self) -> int:
        return self.pipeline * self.data_size * self.tensor

    @property
    def data_size(self) -> int:
        """The data-parallel processes: each reads its own share of a step's batch."""
        return self.replicate * self.shard

    @property
    def data_parallel(self) -> bool:
        """Whether the model has copies (or shards, under FSDP) on several data-parallel processes."""
        return self.data_size > 1

    @property
    def data_rank(self) -> int:
        """This process's rank among the data-parallel ones. The processes of a tensor-parallel group
        (consecutive ranks), or of a pipeline, hold one model replica between them and read the same
        batches (mesh order: pipeline, data, tensor)."""
        return self.rank // self.tensor % self.data_size

    @property
    def splits_layers(self) -> bool:
        """Whether a layer's weights are split over a tensor-parallel group (its parameters are DTensors)."""
        return self.tensor > 1

    @property
    def pipelined(self) -> bool:
        """Whether the model's decoder layers are split into pipeline stages."""
        return self.pipeline > 1

    @property
    def splits_model(self) -> bool:
        """Whether several processes hold one copy of the model between them (tensor or pipeline parallel)."""
        return self.tensor * self.pipeline > 1

    @property
    def stage_size(self) -> int:
        """The processes of one pipeline stage (all of them without pipeline parallel): its data-parallel
        copies times its tensor-parallel ranks. Each holds the step's loss of its batches on the last stage."""
        return self.data_size * self.tensor

    @property
    def leads_stage(self) -> bool:
        """Whether this process is the first of its pipeline stage (data-parallel and tensor-parallel place 0)."""
        return self.rank % self.stage_size == 0

    @property
    def pipeline_rank(self) -> int:
        """This process's pipeline stage (0 without pipeline parallel; mesh order: pipeline first)."""
        return self.rank // self.stage_size

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh's size along DIMS."""
        return self.pipeline, self.replicate, self.shard, self.tensor

    @property
    def mesh(self):
        """The run's DeviceMesh over DIMS (dimensions of size 1 included, so that every name exists)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device_type, self.shape, mesh_dim_names=DIMS)
        return self._mesh

    @property
    def data_mesh(self):
        """The mesh the data-parallel wrapper runs over: both data dimensions for HSDP, else the shard one."""
        return self.mesh["dp_replicate", "dp_shard"] if self.replicate > 1 else self.mesh["dp_shard"]
