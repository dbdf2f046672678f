"""What a stage asks a SLURM cluster for: the rule resources the Snakefile builds from the stage's
`resources` in pipelines/stages.yaml, which the SLURM executor plugin turns into one sbatch per stage
(`-p`, `--nodes`, `--cpus-per-task`, `--mem`, `--gres`, `-t`).

    python -m pipelines.cluster     print the table of docs/cluster.md (tests/test_cluster.py checks it)

A stage that asks for GPUs (`gpus_per_node` > 0) runs one process per GPU (pipelines/launch.py), so a
GPU node is sized per GPU: `cpus_per_gpu` cores and `mem_mb_per_gpu` of host memory for each. The GPU
partition gets it. Every other stage runs `nproc_per_node` processes on CPUs, each with
`cpus_per_process` cores and `mem_mb_per_process` of host memory, on the CPU partition; with
`--config cpu_only=1` (a cluster or test nodes without GPUs) so does a GPU stage, asking for no GPU.
SLURM gets the node's totals: one task per node (the launcher starts the processes in it) holding all
of their cores, and `--mem` per node.
"""

from __future__ import annotations

PARTITION_KINDS = ("gpu", "cpu")


def on_gpus(resources: dict, cpu_only: bool) -> bool:
    return bool(resources["gpus_per_node"]) and not cpu_only


def processes(resources: dict, cpu_only: bool) -> tuple[int, int, int]:
    """(processes, cores, host memory in MB) per node."""
    if on_gpus(resources, cpu_only):
        count, cores, mem_mb = (resources[k] for k in ("gpus_per_node", "cpus_per_gpu", "mem_mb_per_gpu"))
    else:
        count, cores, mem_mb = (resources[k] for k in ("nproc_per_node", "cpus_per_process", "mem_mb_per_process"))
    return int(count), int(count) * int(cores), int(count) * int(mem_mb)


def slurm_resources(resources: dict, cpu_only: bool = False, partitions: dict | None = None) -> dict:
    """The Snakemake resources of the stage's rule. `partitions`: {"gpu": name, "cpu": name} (a kind
    without a name goes to the cluster's default partition)."""
    gpus = resources["gpus_per_node"] if on_gpus(resources, cpu_only) else 0
    _, cpus, mem_mb = processes(resources, cpu_only)
    request = {
        "nodes": resources["nodes"],
        # One task per node: SLURM shrinks an allocation of N nodes with fewer tasks to fewer nodes.
        "tasks": resources["nodes"],
        "cpus_per_task": cpus,
        "mem_mb": mem_mb,  # per node (sbatch --mem)
        "runtime": resources["runtime_min"],
        "gpus_per_node": gpus,
    }
    if gpus:
        # SLURM counts generic resources per node. tasks_per_gpu 0: the plugin would otherwise ask for
        # `tasks` tasks per GPU (--ntasks-per-gpu), each with all the node's cores.
        request |= {"gres": f"gpu:{gpus}", "tasks_per_gpu": 0}
    partition = (partitions or {}).get("gpu" if gpus else "cpu")
    if partition:
        request["slurm_partition"] = str(partition)
    return request


def markdown_table(stages: dict) -> str:
    """Each stage's request per node, on GPUs and with cpu_only=1 (docs/cluster.md)."""
    rows = [
        "| stage | partition | nodes | GPUs per node | CPUs per node (per process) | memory per node, MB (per process) "
        "| `cpu_only=1`: CPUs (per process) | `cpu_only=1`: memory, MB (per process) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, st in stages.items():
        res = st.resources
        cells = [f"`{name}`", "gpu" if on_gpus(res, False) else "cpu", str(res["nodes"]), str(res["gpus_per_node"])]
        for cpu_only in (False, True):
            count, cpus, mem_mb = processes(res, cpu_only)
            cells += [f"{cpus} ({cpus // count})", f"{mem_mb} ({mem_mb // count})"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    from pipelines.dag import load_table

    print(markdown_table(load_table()), end="")
