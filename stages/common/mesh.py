"""How a training run's processes are laid out: a (pipeline, data replicate, data shard, tensor) mesh.

The train section's layout keys set the degrees: `pipeline_parallel` stages, `tensor_parallel` ranks
per model replica's layer, and of the data-parallel processes left (processes / (pipeline x tensor)),
`data_parallel_replicate` replicas (under strategy fsdp: HSDP, each replica sharded over the rest;
1: plain FSDP or DDP). Ranks fill the mesh row-major in that order: consecutive ranks form a
tensor-parallel group, then the data-parallel ranks of one pipeline stage, then the stages.
"""

from __future__ import annotations

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


def shape(processes: int, cfg) -> tuple[int, int, int, int]:
    """The mesh's size along DIMS for a train section (cfg) on `processes` processes."""
    tp, pp, replicate = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.data_parallel_replicate
    dp = processes // (tp * pp)
    return pp, replicate, dp // replicate, tp


def device_mesh(cfg, rt):
    """The run's DeviceMesh over DIMS (dimensions of size 1 included, so that every name exists)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rt.device.type, shape(rt.world_size, cfg), mesh_dim_names=DIMS)


def data_mesh(cfg, mesh):
    """The mesh the data-parallel wrapper runs over: both data dimensions for HSDP, else the shard one."""
    return mesh["dp_replicate", "dp_shard"] if cfg.data_parallel_replicate > 1 else mesh["dp_shard"]
