"""How a training run's processes are laid out: a (pipeline, data replicate, data shard, tensor) mesh.

The train section's layout keys set the degrees: `pipeline_parallel` stages, `tensor_parallel` ranks
per model replica's layer, and of the data-parallel processes left (processes / (pipeline x tensor)),
`data_parallel_replicate` replicas (under strategy fsdp: HSDP, each replica sharded over the rest;
1: plain FSDP or DDP). Ranks fill the mesh row-major in that order: consecutive ranks form a
tensor-parallel group, then the data-parallel ranks of one pipeline stage, then the stages.

A run has one `Layout` (the loop's build makes it): the degrees, this process's data-parallel rank and the
run's one DeviceMesh, which the wrappers (stages.common.parallel) and the pipeline split share.
`layout_problem` is the one check of the degrees against the processes: the train section's
(TrainConfig.check_layout, before any compute), `Layout.of`, and the launcher's, before it starts them.
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
        tp, pp, replicate = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.data_parallel_replicate
        problem = layout_problem(rt.world_size, tp, pp, replicate, cfg.strategy)
        if problem:
            raise ValueError(problem)
        dp = rt.world_size // (tp * pp)
        return cls(pp, replicate, dp // replicate, tp, rt.rank, rt.device.type)

    @property
    def processes(self) -> int:
        return self.pipeline * self.data_size * self.tensor

    @property
    def data_size(self) -> int:
        """The data-parallel processes: each reads its own share of a step's batch."""
        return self.replicate * self.shard

    @property
    def data_rank(self) -> int:
        """This process's rank among the data-parallel ones. The processes of a tensor-parallel group
        (consecutive ranks), or of a pipeline, hold one model replica between them and read the same
        batches (mesh order: pipeline, data, tensor)."""
        return self.rank // self.tensor % self.data_size

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
