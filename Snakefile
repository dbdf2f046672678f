# The pipeline for Snakemake: one rule per stage of pipelines/stages.yaml (the table dvc.yaml is also
# generated from), with the same commands, inputs and outputs as `dvc repro`.
#
#   snakemake --cores all                      # the whole pipeline (make run)
#   snakemake --cores all tokenize             # one stage and what it needs
#   snakemake --rulegraph | dot -Tpng > dag.png
#   snakemake --profile pipelines/profiles/slurm   # one sbatch job per stage (pipelines/profiles/)
#
# After each stage, `dvc commit` records its outputs in dvc.lock (pipelines/commit.py: one commit at a
# time, a damaged dvc.lock restored from its last good copy), so `dvc status` agrees with Snakemake about
# what is current.
import importlib.util
import json
import os
import re
import sys
import uuid
from pathlib import Path

from pipelines.cluster import PARTITION_KINDS, slurm_resources
from pipelines.commit import clear_dead_snakemake_locks, hold_pipeline_lock, plans_only, repair as repair_dvc_lock
from pipelines.dag import check_params, fill, is_dir, load_table, parse_yaml
from snakemake.exceptions import WorkflowError
from stages.common.config import ConfigError
from pipelines.sync import align, rule_sections

# One id per invocation groups this run's stages in MLflow (jobs, local or on a cluster, inherit it).
os.environ.setdefault("PIPELINE_RUN_ID", "smk-" + uuid.uuid4().hex[:12])
os.environ["PIPELINE_SNAKEMAKE"] = "1"  # tells pipelines.launch that Snakemake keeps its own records
if workflow.is_main_process and workflow.local_exec:
    # The stages of a local run die with this process (pipelines/launch.py: watch_snakemake), also when
    # it is killed by SIGKILL and cannot stop them: they save a checkpoint instead of finishing unobserved.
    os.environ["PIPELINE_SNAKEMAKE_PID"] = f"{os.getpid()}:{os.uname().nodename}"
# The rules' `python` and `dvc` are those of the environment Snakemake runs in, also when it is started
# as .venv/bin/snakemake without activating the environment (jobs, local or sbatch, inherit PATH); not
# when Snakemake lives in an environment of its own (pipx, conda base) without the project's packages.
if importlib.util.find_spec("torch") is not None:
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# --config mlflow_tracking_uri=...: the stages log there (a tracking server, for cluster runs).
if config.get("mlflow_tracking_uri"):
    os.environ["MLFLOW_TRACKING_URI"] = str(config["mlflow_tracking_uri"])
# --config cpu_only=1: request no GPUs from the scheduler (clusters or test nodes without them): every
# stage runs its CPU processes on the CPU partition.
CPU_ONLY = bool(config.get("cpu_only"))
# --config gpu_partition=... cpu_partition=...: the SLURM partitions for stages on GPUs and on CPUs
# (the slurm profile names them in pipelines/profiles/slurm/partitions.yaml).
PARTITIONS = {kind: config.get(f"{kind}_partition") for kind in PARTITION_KINDS}

try:
    STAGES = load_table()
except ConfigError as e:  # (params.yaml's sweeps: one line naming the key, before any job)
    raise WorkflowError(str(e)) from None
if workflow.is_main_process and not config.get("dump_rules"):
    # One pipeline run at a time in this directory, held until this process exits (pipelines/commit.py).
    running = hold_pipeline_lock()
    if running and not plans_only(sys.argv[1:]):
        raise WorkflowError(
            f"{running}; wait for it to finish or stop it (Ctrl-C, or scancel its jobs), then run this again: "
            f"two runs here would rebuild the same outputs. `snakemake -n` shows the plan meanwhile"
        )
    try:
        # a bad key fails here, before Snakemake removes any output (a check that passed is not made again
        # for the same params and stage code)
        check_params("params.yaml", memo=Path(".snakemake/params-checked"))
    except ConfigError as e:
        raise WorkflowError(str(e)) from None
    if not running and clear_dead_snakemake_locks():
        print("note: removed the locks of a Snakemake that ended without unlocking (killed?)", file=sys.stderr)
    if running:  # a dry run beside a running pipeline: that run owns dvc.lock and the outputs' times
        print(f"note: {running}; not syncing with DVC (the plan may show its stages as pending)", file=sys.stderr)
    elif not os.environ.get("PIPELINE_NO_SYNC"):
        repair_dvc_lock()
        # Outputs DVC restored or rebuilt count as current when dvc.lock says so, outputs of stages DVC
        # sees as changed count as stale, and outputs changed in place are re-made (see pipelines/sync.py).
        align(snakefile=workflow.main_snakefile)
with open("params.yaml") as fh:
    PARAMS = parse_yaml(fh.read())


def wildcard(text):
    return text.replace("${item}", "{item}")


rule all:
    input:
        [o for st in STAGES.values() for _, item in st.instances() for o in (fill(x, item) for x in st.outputs())],
    default_target: True


for st in STAGES.values():
    rule:
        name:
            st.name
        input:
            [wildcard(d) for d in st.deps],
        output:
            # (and what it measured: measured/<stage>.json, outside the outs; pipelines/dag.py)
            [directory(wildcard(o)) if is_dir(o) else wildcard(o) for o in st.outputs()],
        params:
            # Rules made in a loop must capture per-stage values here: `shell` is evaluated at run time.
            cmd=(lambda wc, st=st: st.command(wc.item)) if st.matrix else wildcard(st.cmd()),
            dvc_stage=st.name + ("@{item}" if st.foreach else ""),
            # Recorded by Snakemake, so changing a section re-runs the stage (rerun trigger "params"); records
            # of another run's sections on outputs DVC holds as current are forgotten (pipelines/sync.py).
            sections=rule_sections(st, PARAMS),
        log:
            "logs/" + st.name + ("-{item}" if st.foreach else "") + ".log",
        threads: st.resources["nproc_per_node"]
        resources:
            # What sbatch asks for per node: partition, CPUs, memory, GPUs, time (pipelines/cluster.py)
            **slurm_resources(st.resources, cpu_only=CPU_ONLY, partitions=PARTITIONS),
        # Used with --software-deployment-method apptainer (docs/containers.md).
        container: st.resources["container"]
        wildcard_constraints:
            item="|".join(re.escape(i) for i in st.foreach) or "[^/]+",
        shell:
            "{params.cmd} > {log} 2>&1"
            " && python -m pipelines.commit {params.dvc_stage} >> {log} 2>&1"


if config.get("dump_rules"):
    # The rules exactly as Snakemake holds them, for tests/test_dag.py.
    with open(config["dump_rules"], "w") as fh:
        json.dump({r.name: {"input": [str(i) for i in r.input], "output": [str(o) for o in r.output],
                            "params": json.loads(r.params.sections), "cmd": r.params.cmd if isinstance(r.params.cmd, str) else {i: STAGES[r.name].command(i) for i in STAGES[r.name].foreach}, "foreach": list(STAGES[r.name].foreach) if r.name in STAGES else None,
                            "container": r.container_img,
                            "resources": {k: v.value for k, v in r.resources.items() if not (k.startswith("_") or v.is_evaluable())}}
                   for r in workflow.rules if r.name != "all"}, fh, indent=1)
