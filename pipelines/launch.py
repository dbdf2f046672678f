"""Start one stage with the processes its resources ask for: the command prefix of every DAG stage.

    python -m pipelines.launch <stage>[@<item>] [stage arguments ...]

Reads the stage's `resources` in pipelines/stages.yaml and runs `python -m stages.<stage>` directly
for one process, or `torchrun --standalone --nproc-per-node N -m stages.<stage>` for several (gloo on
CPU, nccl on GPU; --standalone picks a free port, so parallel stages do not collide). On a machine with
GPUs, a stage that asks for GPUs gets one process per visible GPU, up to `gpus_per_node`.
`PIPELINE_NPROC_PER_NODE` overrides the process count of every stage that runs several processes (its
resources ask for more than one, or for GPUs); a stage of one process by nature (prepare_data, base,
context_study, memory_study, which measures one process at a time, report) keeps one. A training stage whose `train`
section the processes cannot run (a parallel layout, tensor_parallel x pipeline_parallel, they cannot
form; a global batch they cannot share evenly) is refused here before any process starts, with the line
the stage's own check ends with (stages.common.train_config: TrainConfig.refusal), exit code 2. On GPUs,
a training stage that the memory planner (pipelines.plan) finds too large for the GPUs' memory or the
node's host memory (its memory request inside SLURM) is refused too, in one line naming the figure, the
limit and the key to change (exit code 2); on CPUs the planner is not consulted.

Inside a SLURM allocation of several nodes (a stage with `nodes: N > 1`, submitted by the slurm profile)
it starts one `torchrun` per node with `srun`, all meeting at a c10d rendezvous on the allocation's
first node (port 29400 + job id mod 1000, id = the job id):

    srun --overlap --nodes=N --ntasks-per-node=1 --cpus-per-task=C python -m torch.distributed.run --nnodes=N \
         --nproc-per-node=P --rdzv-backend=c10d --rdzv-endpoint=<first node>:<port> --rdzv-id=<job id> \
         --rdzv-conf=join_timeout=300 -m stages.<stage> ...

C: the allocation's SLURM_CPUS_PER_TASK (every core the stage asked for per node), when set: srun does not
take it from the environment (SLURM 22.05 and later), and under task/cgroup a task without it gets one core.

Preflight, before srun starts anything: an allocation with fewer nodes than the stage asks for, and a
first node whose name resolves only to a loopback address (or to nothing) are refused, naming the fix
(PIPELINE_RDZV_HOST: the address to meet at instead). A node that never joins fails the rendezvous after
PIPELINE_RDZV_TIMEOUT seconds (300). The stage itself then checks, before it reads any data, that its
world is the size started here (PIPELINE_WORLD_SIZE, set for it) and that every process joins one
all-reduce within PIPELINE_PREFLIGHT_TIMEOUT seconds (stages.common.runtime.preflight). These names, the exit
codes and the files a stage leaves for the launcher are stages.common.contract's.

Preemption: SIGTERM (what SLURM sends at preemption and near the time limit) and SLURM's warning
signal USR1 (`sbatch --requeue --signal=B:USR1@<seconds>`, for a stage submitted on its own) reach the
stage as SIGTERM; it saves a checkpoint and exits 143. When the warning signal stopped it inside a SLURM
job, the launcher requeues that job (`scontrol requeue`), whose next start resumes from the checkpoint.

A stage that refuses its input ends with one line naming the cause and exit code 2 (a hang, found by
stages.common.watchdog: 124); under torchrun (which reports a failed worker as its own exit 1, with pages
of its own) the launcher repeats that line last and exits with that code.

Under a local Snakemake, a stage also dies with that Snakemake (watch_snakemake): when Snakemake's main
process is gone, even by SIGKILL, the stage gets SIGTERM, saves a checkpoint and ends with 143 (its
pipeline's MLflow run KILLED), instead of finishing and committing for a run no one observes.

Under `dvc repro` or Snakemake, where dvc.lock records every finished stage's outputs, the launcher first
hashes the stage's inputs that another stage made against those records (pipelines.verify.damaged_input): a file whose
bytes differ (a damaged object of DVC's cache checked out by `dvc pull`, a file changed in place with
its size and time kept: both pass DVC's own checks) stops the stage before it starts, in one line with
the mend, exit code 2.

A sweep's point (`sweep_<name>@<point>`, pipelines/dag.py) runs the swept stage's module; the MLflow runs of
a sweep nest under the sweep's own parent run (PIPELINE_RUN_ID `sweep-<name>`), whichever invocation runs them.

Outside Snakemake (under `dvc repro`), a stage that succeeds also drops Snakemake's provenance records
of its outputs: they describe the previous Snakemake run, and would make Snakemake re-run a stage
that DVC has just brought up to date. Without them Snakemake judges those outputs by modification time.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipelines import timebudget, verify
from pipelines.dag import LAUNCH, TABLE, fill, load_table, parse_yaml
from pipelines.sync import forget_records
from stages.common import config, contract, timing, train_config


class Refused(Exception):
    """Input the stage would refuse, found before any process starts: the stage's own line (exit 2)."""


# The training stages the memory planner checks before they start on GPUs.
PLANNED = ("pretrain", "extend_context", "finetune_qlora")


def visible_gpus() -> int:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


def resolve(host: str) -> list[str]:
    """The addresses `host` resolves to here (empty when it does not resolve)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except OSError:
        return []


def rendezvous_problem(host: str, nodes: int) -> str | None:
    """Why the other nodes could not reach a rendezvous on `host`, or None: a name that does not
    resolve, or one that resolves only to loopback addresses (a common /etc/hosts line maps a node's
    own name to 127.0.1.1; torchrun would then listen where no other node can connect, and hang)."""
    addresses = resolve(host)
    fix = (
        f"map {host} to its network address in /etc/hosts or DNS, or set {contract.RDZV_HOST} to an address "
        f"of the allocation's first node that every node reaches"
    )
    if not addresses:
        return f"launch: the rendezvous host {host} of this {nodes}-node stage does not resolve; {fix}"
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return (
            f"launch: the rendezvous host {host} resolves to {', '.join(addresses)}, a loopback address the other "
            f"{nodes - 1} node(s) cannot reach; {fix}"
        )
    return None


def slurm_hosts(env: dict) -> list[str]:
    """The allocation's node names, in SLURM's order (the first one hosts the rendezvous). Inside a job
    step of fewer nodes (Snakemake's `srun -n1` around a rule), SLURM_JOB_NODELIST can name the step's
    nodes and SLURM_NODELIST the job's: the longer list is the allocation."""
    lists = dict.fromkeys(env[k] for k in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(k))
    expanded = [
        subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        for nodelist in lists
    ]
    return max(expanded, key=len, default=[])


# The training stages and the class of their `train` section (their Config's; tests/test_launch.py compares).
TRAIN_SECTIONS = {
    "pretrain": train_config.TrainConfig,
    "extend_context": train_config.TrainConfig,
    "finetune_qlora": train_config.AdapterTrainConfig,
    "memory_study": train_config.TrainConfig,
}


def params_and_overrides(args: list[str]) -> tuple[str, list[str]]:
    """The params file and the key=value overrides of a stage's command line, as the stage reads them."""
    params, overrides, values = "params.yaml", [], iter(args)
    for arg in values:
        if arg == "--params":
            params = next(values, params)
        elif arg.startswith("--params="):
            params = arg.split("=", 1)[1]
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
    return params, overrides


def train_sections(stage: str, section: dict) -> dict[str, train_config.TrainConfig]:
    """The train sections a training stage checks against its processes as it starts, by the dotted path
    its refusal names: its `train` section (stage.launch), or each of memory_study's techniques (the
    baseline's among them; checked only in one process: it refuses more itself, naming the fix)."""
    train = config.build(TRAIN_SECTIONS[stage], f"{stage}.train", section.get("train"))
    if stage != "memory_study":
        return {f"{stage}.train": train}
    sections = {}
    for name, keys in (section.get("techniques") or {}).items():
        where = f"{stage}.techniques.{name}"
        sections[where] = train_config.with_keys(train, where, keys)
    return sections


def layout_problem(stage: str, args: list[str], processes: int) -> str | None:
    """The line a training stage would refuse `processes` with (its train section's layout or global batch:
    TrainConfig.refusal), its params file and key=value overrides read as the stage reads them, or None.
    Anything the stage itself rejects for another reason (a bad value, a missing file) is left to it."""
    if stage not in TRAIN_SECTIONS or (stage == "memory_study" and processes > 1):
        return None
    params, overrides = params_and_overrides(args)
    try:
        section = config.apply_overrides(stage, config.read_yaml(params).get(stage) or {}, overrides)
        sections = train_sections(stage, section)
    except (OSError, ValueError, TypeError, AttributeError):  # (config.ConfigError is a ValueError)
        return None
    refusals = (train.refusal(where, processes) for where, train in sections.items())
    refusal = next((r for r in refusals if r), None)
    return f"error: {refusal}" if refusal else None


def gpu_memory_gib() -> float | None:
    """The smallest visible GPU's memory in GiB (nvidia-smi), or None when it cannot be read."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    sizes = [float(v) for v in out.stdout.split() if v.replace(".", "", 1).isdigit()]
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and all(d.strip().isdigit() for d in listed.split(",") if d.strip()):
        sizes = [sizes[int(d)] for d in listed.split(",") if d.strip() and int(d) < len(sizes)]
    return min(sizes) / 1024 if out.returncode == 0 and sizes else None


def host_memory_gib(stage: str, env: dict) -> float:
    """The host memory a stage may use per node: the allocation's inside a SLURM job (SLURM_MEM_PER_NODE, MB),
    else the node's MemTotal."""
    if env.get("SLURM_MEM_PER_NODE", "").isdigit():
        return float(env["SLURM_MEM_PER_NODE"]) / 1024
    with open("/proc/meminfo") as fh:
        return int(fh.readline().split()[1]) / 2**20


def memory_problem(stage: str, args: list[str], nproc: int, nodes: int, env: dict) -> str | None:
    """The planner's refusal (pipelines.plan) of a training stage on GPUs, or None: it fits, it is not a
    training stage, or the run is on CPUs (where the planner, which loads torch, is not consulted)."""
    name, _, item = stage.partition("@")
    gpus = visible_gpus()
    if name not in PLANNED or not gpus or not load_table()[name].resources.get("gpus_per_node", 0):
        return None
    from pipelines import plan  # (torch and transformers: only here, on GPU machines)

    return plan.launch_check(stage, args, nproc, nodes, gpu_memory_gib(), host_memory_gib(name, env))


def processes(stage: str, env: dict) -> tuple[int, int]:
    """(processes per node, nodes) the stage runs on: its resources, and the GPUs or override here."""
    name = stage.split("@", 1)[0]
    table = load_table()
    if name not in table:
        if name in parse_yaml(TABLE.read_text())["stages"]:
            raise SystemExit(
                f"launch: stage {name} is not in the pipeline for params.yaml's base model (base.model: the "
                f"pipeline's own pretrain when empty, the base stage's copy of another model when set)"
            )
        raise SystemExit(f"launch: unknown stage {name!r}; stages: {', '.join(table)}")
    res = table[name].resources
    nproc = int(res["nproc_per_node"])
    if res.get("gpus_per_node", 0) and visible_gpus():
        nproc = min(int(res["gpus_per_node"]), visible_gpus())
    override = env.get(contract.NPROC_PER_NODE)
    if override is not None and (int(res["nproc_per_node"]) > 1 or int(res.get("gpus_per_node", 0)) > 0):
        if not (override.strip().isdecimal() and int(override) > 0):
            # (int() would end the launcher in a traceback; 0 or less would start one process, which its
            # preflight then refuses)
            print(
                f"error: launch: {contract.NPROC_PER_NODE}={override!r} is not a number of processes; set it to a "
                f"positive integer (1, 2, ...: processes per node), or unset it for {name}'s own ({nproc})",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(2)
        nproc = int(override)
    return nproc, int(res["nodes"])


def command(stage: str, args: list[str], env: dict | None = None) -> list[str]:
    env = os.environ if env is None else env
    name = stage.split("@", 1)[0]
    nproc, nodes = processes(stage, env)
    runs = load_table()[name].runs()  # (a sweep's points run the swept stage's module)
    refusal = layout_problem(runs, args, nproc * nodes)
    if refusal:
        raise Refused(refusal)
    module = ["-m", f"stages.{runs}", *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if nodes > 1:
        if not env.get("SLURM_JOB_ID"):
            raise SystemExit(
                f"launch: stage {name} asks for {nodes} nodes; run it in a SLURM allocation "
                "(snakemake --profile pipelines/profiles/slurm) or set its resources.nodes to 1"
            )
        # The allocation's nodes, from its node list: inside a job step of fewer nodes (Snakemake's own
        # `srun -n1` around the rule) SLURM's node counts describe the step.
        hosts = slurm_hosts(env)
        have = len(hosts) or int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
        if have < nodes:
            raise SystemExit(
                f"launch: stage {name} asks for {nodes} nodes, the SLURM allocation has {have}; submit it with "
                f"--nodes={nodes} (the slurm profile does, from its resources in pipelines/stages.yaml)"
            )
        job = int(env["SLURM_JOB_ID"])
        host = env.get(contract.RDZV_HOST) or (hosts[0] if hosts else None)
        if host is None:
            raise SystemExit(f"launch: stage {name}: no SLURM_JOB_NODELIST to meet on; set {contract.RDZV_HOST}")
        problem = rendezvous_problem(host, nodes)
        if problem:
            raise SystemExit(problem)
        endpoint = f"{host}:{29400 + job % 1000}"
        # A node that never joins fails the rendezvous after this many seconds instead of torchrun's 600.
        join = int(env.get(contract.RDZV_TIMEOUT, "300"))
        # --overlap: the step Snakemake runs this launcher in already holds a task of the allocation.
        cpus = env.get("SLURM_CPUS_PER_TASK")
        return [
            "srun",
            "--overlap",
            f"--nodes={nodes}",
            f"--ntasks={nodes}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(hosts[:nodes])}",
            "--kill-on-bad-exit=1",
            *([f"--cpus-per-task={cpus}"] if cpus else []),
            *torchrun,
            f"--nnodes={nodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={job}",
            f"--rdzv-conf=join_timeout={join}",
            *module,
        ]
    if nproc <= 1:
        return [sys.executable, *module]
    return [*torchrun, "--standalone", f"--nproc-per-node={nproc}", *module]


def watch_snakemake(stop, interval_s: float = 1.0) -> None:
    """Under a local Snakemake (PIPELINE_SNAKEMAKE_PID: its pid and host, set by the Snakefile), call
    stop() once that Snakemake is gone: killed by SIGKILL it cannot stop its jobs, and a stage that went on
    would finish, publish and commit for a run that no longer exists, its work redone by the next. Jobs
    on other hosts (a cluster executor's) are left alone: they outlive the process that submitted them."""
    pid, _, host = os.environ.get(contract.SNAKEMAKE_PID, "").partition(":")
    if not pid.isdigit() or host != os.uname().nodename:
        return
    started = contract.process_start(int(pid))
    if started is None:
        return

    def watch():
        while contract.process_start(int(pid)) == started:
            time.sleep(interval_s)
        print(
            f"launch: Snakemake (pid {pid}) is gone: stopping the stage (it saves a checkpoint; the next run "
            f"resumes from it)",
            file=sys.stderr,
            flush=True,
        )
        stop()

    threading.Thread(target=watch, name="watch-snakemake", daemon=True).start()


def forget_snakemake_records(stage: str) -> None:
    name, _, item = stage.partition("@")
    outs = [fill(o, item or None) for o in load_table()[name].outputs()]
    if Path(".snakemake/metadata").is_dir():
        # (with PIPELINE_NO_SYNC: DVC holds its repository lock now, so the Snakefile must not ask `dvc status`)
        forget_records(outs)


def mark_pipeline(stage: str, code: int) -> None:
    """A stage that did not finish marks its pipeline's MLflow parent run FAILED or KILLED, also when it
    stopped before opening its own run (stages/common/tracking/parents.py: record_stage_end). Tracking never
    changes the stage's exit code."""
    try:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # no store notices after the stage's last line
        from stages.common.tracking import parents

        parents.record_stage_end(stage, code)
    except Exception as e:  # noqa: BLE001 - a tracking problem must not hide the stage's own failure
        print(f"launch: could not mark the pipeline's MLflow run: {e}", file=sys.stderr, flush=True)


def stale_dag(stage: str, args: list[str], env: dict) -> str | None:
    """Why this is the command of a dvc.yaml made for another pipeline than the table gives for params.yaml
    now (base.model changed since `make dag`), or None. A command run by hand or by Snakemake (which reads
    params.yaml as it loads) is never stale."""
    dvc_yaml = Path("dvc.yaml")
    if env.get(contract.SNAKEMAKE) or not dvc_yaml.is_file():
        return None
    name, _, item = stage.partition("@")
    try:
        entry = (parse_yaml(dvc_yaml.read_text()) or {}).get("stages", {}).get(name)
    except Exception:  # noqa: BLE001 - an unreadable dvc.yaml is DVC's to report
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("do", entry).get("cmd"), str):
        return None
    recorded = fill(entry.get("do", entry)["cmd"], item or None)
    if " ".join([*LAUNCH.split(), stage, *args]) != " ".join(recorded.split()):
        return None  # (not dvc.yaml's command: a run by hand)
    table = load_table()
    wanted = table[name].command(item or None) if name in table else None
    if wanted is not None and " ".join(wanted.split()) == " ".join(recorded.split()):
        return None
    return (
        "dvc.yaml was made for another base model than params.yaml's base.model names now; run "
        "`python -m pipelines.dag write` (make dag), then dvc repro again"
    )


def data_inputs(label: str) -> str:
    """The data deps of stage `label` (`<stage>[@<item>]`) in the table, as a JSON list (contract.INPUTS):
    its MLflow run records each as a dataset with its DVC hash."""
    name, _, item = label.partition("@")
    table = load_table()
    return json.dumps(table[name].data_deps(item or None) if name in table else [])


def sweep_env(stage: str) -> dict[str, str]:
    """What a sweep's stage runs with; {} for any other stage. Its MLflow parent is the sweep's own
    (PIPELINE_RUN_ID `sweep-<name>`), not the invocation's: its points, run by any number of invocations (a
    point added later), nest under one parent. A point also gets contract.SWEEP: its sweep, name and values."""
    name, _, item = stage.partition("@")
    st = load_table().get(name)
    if st is None or not st.sweep:
        return {}
    env = {"PIPELINE_RUN_ID": f"sweep-{st.sweep}"}
    if item in st.sets:
        env[contract.SWEEP] = json.dumps({"sweep": st.sweep, "point": item, "values": dict(st.sets[item])})
    return env


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    os.environ.update(sweep_env(sys.argv[1]))  # (the launcher marks the sweep's parent too)
    try:
        stale = stale_dag(sys.argv[1], sys.argv[2:], os.environ)
        if stale:
            raise Refused(f"error: launch: {sys.argv[1]}: {stale}")
        cmd = command(sys.argv[1], sys.argv[2:])
        damaged = verify.damaged_input(sys.argv[1], contract.workspace())
        if damaged:
            raise Refused(f"error: launch: {sys.argv[1]}: {damaged}")
    except Refused as refused:  # (as the stage's own refusal: its pipeline's run is marked, one line, exit 2)
        mark_pipeline(sys.argv[1], contract.REFUSED_EXIT)
        print(refused, file=sys.stderr, flush=True)
        raise SystemExit(contract.REFUSED_EXIT) from None
    nproc, nodes = processes(sys.argv[1], os.environ)
    too_big = memory_problem(sys.argv[1], sys.argv[2:], nproc, nodes, os.environ)
    if too_big:
        mark_pipeline(sys.argv[1], contract.REFUSED_EXIT)
        print(f"error: launch: {too_big}", file=sys.stderr, flush=True)
        raise SystemExit(contract.REFUSED_EXIT)
    print("launch:", " ".join(cmd), file=sys.stderr, flush=True)
    # The child runs in a process group of its own, so Ctrl-C at a terminal reaches it once, through
    # this launcher (torchrun's shutdown breaks on a second signal), and it dies with the launcher:
    # killed with it, even by SIGKILL, it gets SIGTERM and its stage saves a checkpoint.
    # A stage stopped by a signal (checkpoint saved) leaves this file behind: torchrun reports its
    # workers' exit 143 as its own exit 1, and the launcher exits 143 for it.
    # A stage refusing its input (a UserError: one line, exit 2), or ended by its hang watchdog, leaves its
    # exit code and line in the other file: under torchrun the launcher repeats the line last and exits with
    # that code, after torchrun's report of the failed workers.
    stopped, error = contract.launch_files(os.getpid())
    stopped.unlink(missing_ok=True)
    error.unlink(missing_ok=True)
    times = contract.time_file(os.getpid())
    # No terminal input: a background process group reading it would be stopped (SIGTTIN).
    # srun inside a job step of fewer nodes (Snakemake's around a rule) takes that step's nodes and
    # counts for the allocation's; the torchrun per node needs the job's.
    base = dict(os.environ)
    if cmd[0] == "srun":
        step = ("NTASKS", "NPROCS", "TASKS_PER_NODE", "STEP_NUM_NODES", "JOB_CPUS_PER_NODE")
        step = tuple(f"SLURM_{name}" for name in step)
        base = {k: v for k, v in base.items() if k not in step}
        hosts = slurm_hosts(base)
        base |= {"SLURM_JOB_NODELIST": ",".join(hosts), "SLURM_NODELIST": ",".join(hosts)}
        base |= {"SLURM_JOB_NUM_NODES": str(len(hosts)), "SLURM_NNODES": str(len(hosts))}
    child = subprocess.Popen(
        cmd,
        process_group=0,
        preexec_fn=contract.die_with_parent,
        stdin=subprocess.DEVNULL,
        env={
            **base,
            contract.LAUNCHED: "1",
            contract.STAGE: sys.argv[1],
            contract.STOPPED_FILE: str(stopped),
            contract.LAST_LINE_FILE: str(error),
            contract.LAUNCH_HOST: socket.gethostname(),  # (the files are on this host)
            contract.WORLD_SIZE: str(nproc * nodes),  # what the stage's preflight expects
            contract.TIME_FILE: str(times),
            contract.INPUTS: data_inputs(sys.argv[1]),
        },
    )
    warned, forwarded = [], []

    # Preemption and time limits signal the launcher; the stage must hear them to checkpoint. Stages
    # checkpoint on SIGTERM and SIGINT; SLURM's warning signal (USR1) reaches them as SIGTERM. Only the
    # first signal is passed on: the stage is already stopping.
    def forward(signum, frame):
        if signum == signal.SIGUSR1:
            warned.append(signum)
        if forwarded:
            print(
                f"launch: {signal.Signals(signum).name} again: the stage is already saving and stopping "
                f"(SIGKILL pid {child.pid} to abort)",
                file=sys.stderr,
                flush=True,
            )
            return
        forwarded.append(signum)
        # srun needs two SIGINTs within a second to signal its tasks, and one SIGTERM.
        keep_int = signum == signal.SIGINT and cmd[0] != "srun"
        child.send_signal(signal.SIGINT if keep_int else signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    watch_snakemake(lambda: forward(signal.SIGTERM, None))
    code = child.wait()
    # (exit code, line): a UserError (2) or the hang watchdog (contract.HANG_EXIT)
    said = contract.read_last_line(error) if code != 0 else None
    error.unlink(missing_ok=True)
    refused = said[1] if said else ""
    if said:
        code = said[0]  # the stage's own exit code, whatever torchrun made of it
    elif code != 0 and stopped.exists():
        code = contract.STOPPED_EXIT  # stopped after a checkpoint: re-running resumes (schedulers read it as preempted)
    stopped.unlink(missing_ok=True)
    if code == 0 and not os.environ.get(contract.SNAKEMAKE):
        forget_snakemake_records(sys.argv[1])
    record_times(sys.argv[1], times, nproc * nodes, code)
    if warned and code != 0 and os.environ.get("SLURM_JOB_ID"):
        requeue(os.environ["SLURM_JOB_ID"], code)  # first: the job's time limit is near
    if code != 0:
        mark_pipeline(sys.argv[1], code)
    if refused and nproc * nodes > 1:
        print(refused, file=sys.stderr, flush=True)  # the user's line, last (one process printed it last)
    raise SystemExit(code)


def record_times(stage: str, times: Path, processes: int, code: int) -> None:
    """The time budget of a stage the DAG tools ran (pipelines.timebudget): rank 0's times and this
    launcher's, in measured/time/. The ranks' files are removed whatever the end."""
    rank0 = times.with_name(f"{times.name}.rank0.json")
    try:
        if code == 0 and (os.environ.get(contract.SNAKEMAKE) or os.environ.get(contract.DVC_ROOT)):
            record = json.loads(rank0.read_text())
            launched = timing.process_created()
            timebudget.write(stage, timebudget.stage_record(stage, launched, time.time(), processes, record))
    except (OSError, ValueError, KeyError, TypeError):  # (a measurement: the stage's result stands without it)
        pass
    for path in times.parent.glob(f"{times.name}.rank*.json"):
        path.unlink(missing_ok=True)


def requeue(job_id: str, code: int) -> None:
    """Put the SLURM job back in the queue after the stage stopped on the warning signal; its next
    start runs the same command, which resumes from the stage's checkpoint."""
    print(
        f"launch: stage stopped on SLURM's warning signal (exit {code}); requeueing job {job_id}",
        file=sys.stderr,
        flush=True,
    )
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        print(
            f"launch: scontrol requeue {job_id} failed: {proc.stderr.strip()} "
            "(submit with --requeue, or re-run the pipeline to resume)",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()
