"""Start one stage with the processes its resources ask for: the command prefix of every DAG stage.

    python -m pipelines.launch <stage>[@<item>] [stage arguments ...]

Reads the stage's `resources` in pipelines/stages.yaml and runs `python -m stages.<stage>` directly
for one process, or `torchrun --standalone --nproc-per-node N -m stages.<stage>` for several (gloo on
CPU, nccl on GPU; --standalone picks a free port, so parallel stages do not collide). On a machine with
GPUs, a stage that asks for GPUs gets one process per visible GPU, up to `gpus_per_node`.
`PIPELINE_NPROC_PER_NODE` overrides the process count for every stage.

Outside Snakemake (under `dvc repro`), a stage that succeeds also drops Snakemake's provenance records
of its outputs: they describe the previous Snakemake run, and would make Snakemake re-run a stage
that DVC has just brought up to date. Without them Snakemake judges those outputs by modification time.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from pipelines.dag import fill, load_table


def visible_gpus() -> int:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


def command(stage: str, args: list[str]) -> list[str]:
    name = stage.split("@", 1)[0]
    table = load_table()
    if name not in table:
        raise SystemExit(f"launch: unknown stage {name!r}; stages: {', '.join(table)}")
    res = table[name].resources
    nproc = int(res["nproc_per_node"])
    if res.get("gpus_per_node", 0) and visible_gpus():
        nproc = min(int(res["gpus_per_node"]), visible_gpus())
    nproc = int(os.environ.get("PIPELINE_NPROC_PER_NODE", nproc))
    module = ["-m", f"stages.{name}", *args]
    if nproc <= 1:
        return [sys.executable, *module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *module]


def forget_snakemake_records(stage: str) -> None:
    name, _, item = stage.partition("@")
    outs = [fill(o, item or None) for o in load_table()[name].outs]
    if Path(".snakemake/metadata").is_dir():
        # PIPELINE_NO_SYNC: DVC holds its repository lock now, so the Snakefile must not ask `dvc status`.
        subprocess.run([sys.executable, "-m", "snakemake", "--quiet", "all", "--cleanup-metadata", *outs],
                       env={**os.environ, "PIPELINE_NO_SYNC": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    cmd = command(sys.argv[1], sys.argv[2:])
    print("launch:", " ".join(cmd), file=sys.stderr, flush=True)
    child = subprocess.Popen(cmd)
    # Preemption and time limits signal the launcher; the stage must hear them to checkpoint.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    if code == 0 and not os.environ.get("PIPELINE_SNAKEMAKE"):
        forget_snakemake_records(sys.argv[1])
    raise SystemExit(code)


if __name__ == "__main__":
    main()
