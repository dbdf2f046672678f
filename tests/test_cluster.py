"""Cluster and container files: the Snakemake profiles, multi-node launch commands under SLURM, and the
pinned container definitions named by every stage. (Running them for real: tests/system/, make test-system.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import collector_thresholds

from pipelines import cluster, launch, lock, verify
from pipelines.dag import Stage, load_table

ROOT = Path(__file__).resolve().parent.parent
LOCK = {pin.name: pin.version for pin in lock.parse((ROOT / "requirements.lock").read_text())}


def test_profiles_load_and_name_their_executor():
    local = yaml.safe_load((ROOT / "pipelines/profiles/local/config.yaml").read_text())
    slurm = yaml.safe_load((ROOT / "pipelines/profiles/slurm/config.yaml").read_text())
    assert "executor" not in local and local["cores"] == "all"
    assert slurm["executor"] == "slurm"
    # Accounting (sacct) is often off; squeue always answers.
    assert slurm["slurm-status-command"] == "squeue" and slurm["slurm-requeue"] is True
    assert slurm["slurm-keep-successful-logs"] is True
    # The partitions, as config a `--config` on the command line does not replace.
    (partitions,) = slurm["configfiles"]
    assert set(yaml.safe_load((ROOT / partitions).read_text())) == {"gpu_partition", "cpu_partition"}


def with_resources(stage: str, **res) -> dict[str, Stage]:
    table = load_table()
    st = table[stage]
    table[stage] = Stage(**{**st.__dict__, "resources": {**st.resources, **res}})
    return table


PARTITIONS = yaml.safe_load((ROOT / "pipelines/profiles/slurm/partitions.yaml").read_text())


def rules_through_the_slurm_profile(tmp_path: Path, *config: str) -> dict[str, dict]:
    """{rule: its resources} as Snakemake builds them with the slurm profile (what the SLURM executor
    plugin submits), for `--config` values."""
    dump = tmp_path / "rules.json"
    cmd = [sys.executable, "-m", "snakemake", "--profile", "pipelines/profiles/slurm", "--list-rules"]
    subprocess.run([*cmd, "--config", f"dump_rules={dump}", *config], cwd=ROOT, check=True, capture_output=True)
    return {name: rule["resources"] for name, rule in json.loads(dump.read_text()).items()}


def test_each_stage_asks_slurm_for_the_cores_memory_and_partition_of_its_processes(tmp_path):
    """On GPUs a node runs one process per GPU: gpus_per_node x (cpus_per_gpu, mem_mb_per_gpu) on the GPU
    partition. Every other stage, and every stage with cpu_only=1, runs nproc_per_node processes of
    (cpus_per_process, mem_mb_per_process) on the CPU partition and asks for no GPU."""
    table = load_table()
    on_gpus = rules_through_the_slurm_profile(tmp_path)
    cpu_only = rules_through_the_slurm_profile(tmp_path, "cpu_only=1")
    assert set(on_gpus) == set(cpu_only) == set(table)
    for name, st in table.items():
        res = st.resources
        gpus = res["gpus_per_node"]
        cpu_run = {
            "slurm_partition": PARTITIONS["cpu_partition"],
            "cpus_per_task": res["nproc_per_node"] * res["cpus_per_process"],
            "mem_mb": res["nproc_per_node"] * res["mem_mb_per_process"],
            "gpus_per_node": 0,
        }
        gpu_run = {
            "slurm_partition": PARTITIONS["gpu_partition"],
            "cpus_per_task": gpus * res["cpus_per_gpu"],
            "mem_mb": gpus * res["mem_mb_per_gpu"],
            "gpus_per_node": gpus,
            "gres": f"gpu:{gpus}",
        }
        for rule, wanted in ((on_gpus[name], gpu_run if gpus else cpu_run), (cpu_only[name], cpu_run)):
            assert {k: rule.get(k) for k in wanted} == wanted, name
            assert ("gres" in rule) == ("gres" in wanted), f"{name}: a GPU request only on the GPU partition"
            assert (rule["nodes"], rule["tasks"], rule["runtime"]) == (res["nodes"],) * 2 + (res["runtime_min"],)
    # the numbers behind docs/cluster.md's table
    assert {k: on_gpus["pretrain"][k] for k in ("slurm_partition", "cpus_per_task", "mem_mb", "gres")} == {
        "slurm_partition": "gpu",
        "cpus_per_task": 64,
        "mem_mb": 128000,
        "gres": "gpu:8",
    }
    assert {k: cpu_only["pretrain"][k] for k in ("slurm_partition", "cpus_per_task", "mem_mb")} == {
        "slurm_partition": "main",
        "cpus_per_task": 2,
        "mem_mb": 8000,
    }
    assert on_gpus["tokenize"] == cpu_only["tokenize"] and on_gpus["tokenize"]["slurm_partition"] == "main"
    # --config names a partition for one run; without the profile (a local run) no partition is set
    assert rules_through_the_slurm_profile(tmp_path, "gpu_partition=a100")["pretrain"]["slurm_partition"] == "a100"
    assert "slurm_partition" not in cluster.slurm_resources(table["pretrain"].resources)


class SubmittedJob:
    """What the SLURM executor plugin reads of a Snakemake job: its resources and threads."""

    def __init__(self, resources: dict, threads: int):
        self.resources = type("Resources", (dict,), {"__getattr__": dict.__getitem__})(resources)
        self.threads = threads


def test_a_gpu_node_is_one_task_with_every_core_of_its_processes():
    """The plugin's own sbatch line for pretrain's rule: one task per node with 8 GPUs x 8 cores, not a
    task per GPU each with all of them; its job step (srun inside the allocation) gets those cores too."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string
    from snakemake_executor_plugin_slurm_jobstep import get_cpu_setting

    params = dict(run_uuid="u", slurm_logfile="log", comment_str="c", account="", partition="", workdir="")
    table = load_table()
    for cpu_only in (False, True):
        res = cluster.slurm_resources(table["pretrain"].resources, cpu_only=cpu_only)
        job = SubmittedJob(res, threads=table["pretrain"].resources["nproc_per_node"])
        sbatch = (get_submit_command(job, params) + set_gres_string(job)).split()
        cores = 2 if cpu_only else 64
        assert f"--cpus-per-task={cores}" in sbatch and get_cpu_setting(job, not cpu_only) == f"--cpus-per-task={cores}"
        assert sbatch[sbatch.index("--mem") + 1] == ("8000" if cpu_only else "128000") and "--nodes=1" in sbatch
        assert not any(a.startswith("--ntasks-per-gpu") for a in sbatch), sbatch
        assert ("--gres=gpu:8" in sbatch) != cpu_only and not any(a.startswith("--gpus") for a in sbatch)
        assert ("--ntasks=1" in sbatch) == cpu_only  # on GPUs SLURM's default: one task per node


def test_the_requests_in_the_docs_are_the_tables():
    docs = (ROOT / "docs/cluster.md").read_text()
    assert cluster.markdown_table(load_table()) in docs, (
        "docs/cluster.md: the table of requests is out of date; paste the output of `python -m pipelines.cluster`"
    )


def test_multi_node_stage_starts_one_torchrun_per_node_with_c10d_on_the_first(monkeypatch):
    monkeypatch.setattr(launch, "load_table", lambda: with_resources("pretrain", nodes=2, nproc_per_node=4))
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    seen = []

    def hosts(env):
        seen.append(env.get("SLURM_JOB_NODELIST"))
        return ["gpu17", "gpu18"] if env.get("SLURM_JOB_NODELIST") else []

    monkeypatch.setattr(launch, "slurm_hosts", hosts)
    monkeypatch.setattr(launch, "resolve", lambda host: {"gpu17": ["10.0.0.17"]}.get(host, []))
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[17-18]"}
    cmd = launch.command("pretrain", ["--input", "data/tokenize"], env)
    assert seen == ["gpu[17-18]"]
    assert cmd[:4] == ["srun", "--overlap", "--nodes=2", "--ntasks=2"]
    assert cmd[4:7] == ["--ntasks-per-node=1", "--nodelist=gpu17,gpu18", "--kill-on-bad-exit=1"]
    assert cmd[7:10] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nnodes=2" in cmd and "--nproc-per-node=4" in cmd and "--rdzv-backend=c10d" in cmd
    assert "--rdzv-endpoint=gpu17:29642" in cmd and "--rdzv-id=4242" in cmd
    assert "--rdzv-conf=join_timeout=300" in cmd  # a node that never comes fails the start in 5 minutes
    assert cmd[-4:] == ["-m", "stages.pretrain", "--input", "data/tokenize"]
    assert not any(a.startswith("--cpus-per-task") for a in cmd)  # none asked for: SLURM's default
    # every core the job asked for per node goes to its torchrun (under task/cgroup a task gets one otherwise)
    cmd = launch.command("pretrain", ["--input", "data/tokenize"], {**env, "SLURM_CPUS_PER_TASK": "64"})
    assert cmd[7:11] == ["--cpus-per-task=64", sys.executable, "-m", "torch.distributed.run"]

    with pytest.raises(SystemExit, match="SLURM allocation"):
        launch.command("pretrain", [], {})
    with pytest.raises(SystemExit, match="has 1; submit it with --nodes=2"):
        launch.command("pretrain", [], {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1"})
    # inside a one-node step of a two-node job (Snakemake's srun around the rule): the node list counts
    seen.clear()
    step = {**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1"}
    assert "--nnodes=2" in launch.command("pretrain", [], step) and seen == ["gpu[17-18]"]


def test_a_rendezvous_host_the_other_nodes_cannot_reach_is_refused(monkeypatch):
    """Before srun starts anything: a first node whose name resolves to a loopback address (the usual
    127.0.1.1 line of /etc/hosts) or to nothing; PIPELINE_RDZV_HOST names another address."""
    # real resolution: localhost is loopback on every machine
    assert "localhost resolves to 127.0.0.1" in launch.rendezvous_problem("localhost", 2)
    assert "a loopback address the other 1 node(s) cannot reach" in launch.rendezvous_problem("localhost", 2)
    assert "does not resolve" in launch.rendezvous_problem("no-such-node.invalid", 2)
    monkeypatch.setattr(launch, "load_table", lambda: with_resources("pretrain", nodes=2, nproc_per_node=1))
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    monkeypatch.setattr(launch, "slurm_hosts", lambda env: ["node1", "node2"])
    monkeypatch.setattr(launch, "resolve", {"node1": ["127.0.1.1"], "10.1.2.3": ["10.1.2.3"]}.get)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"}
    with pytest.raises(SystemExit, match="node1 resolves to 127.0.1.1, a loopback address .* PIPELINE_RDZV_HOST"):
        launch.command("pretrain", [], env)
    cmd = launch.command("pretrain", [], {**env, "PIPELINE_RDZV_HOST": "10.1.2.3", "PIPELINE_RDZV_TIMEOUT": "60"})
    assert "--rdzv-endpoint=10.1.2.3:29407" in cmd and "--rdzv-conf=join_timeout=60" in cmd


def test_preflight_refuses_a_world_the_launcher_did_not_start(tokenized, monkeypatch):
    from test_pretrain import TINY

    from stages import pretrain
    from stages.common import config

    monkeypatch.chdir(tokenized)
    monkeypatch.setenv("PIPELINE_WORLD_SIZE", "2")
    with pytest.raises(config.UserError, match="preflight: 1 processes joined, the stage's resources start 2"):
        pretrain.main(["--input", "data/tokenize", "--output", "preflight", *TINY])
    assert not (tokenized / "preflight").exists()


def test_preflight_gives_up_on_a_process_that_never_joins(tmp_path):
    """Rank 1 never reaches the all-reduce: rank 0 says why and exits after the timeout, never hangs."""
    script = tmp_path / "missing.py"
    script.write_text(
        "import time\n"
        "from stages.common import runtime\n"
        "rt = runtime.init()\n"
        "if rt.rank == 1:\n"
        "    time.sleep(120)\n"
        "runtime.preflight(rt, timeout_s=3)\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": str(ROOT)})
    elapsed = time.monotonic() - started
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "preflight: rank 0 of 2 waited 3 s for the others to join one all-reduce" in proc.stderr
    assert elapsed < 90  # (rank 1 would sleep 120 s: the run ended on rank 0's timeout)


def test_single_node_stage_keeps_a_standalone_rendezvous(monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    cmd = launch.command("tokenize", [], {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    assert "--standalone" in cmd and "srun" not in cmd


def test_the_process_count_override_sets_the_stages_of_several_processes_only(monkeypatch):
    """PIPELINE_NPROC_PER_NODE=4 (a whole pipeline at 4 processes per node): every stage that runs several
    processes runs 4, and the stages of one process by nature (memory_study measures one process at a time;
    the report, the study and the data preparation are one process) keep one, so no stage is refused."""
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    four = {"PIPELINE_NPROC_PER_NODE": "4"}
    several = {
        "tokenize",
        "pretrain",
        "extend_context",
        "finetune_qlora",
        "eval_perplexity",
        "eval_harness",
        "train_gnn",
    }
    table = launch.load_table()
    for stage in table:
        assert launch.processes(stage, four) == (4 if stage in several else 1, 1), stage
    assert several < set(table)


def test_a_process_count_that_is_not_a_positive_integer_is_one_line_before_any_start(tmp_path, monkeypatch, capsys):
    """PIPELINE_NPROC_PER_NODE=abc (or 0, or -1): the launcher ends with one line naming the variable and what
    it takes, exit code 2, before it starts anything."""
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    for value in ("0", "-1", "2.5", ""):
        with pytest.raises(SystemExit) as ended:
            launch.processes("pretrain", {"PIPELINE_NPROC_PER_NODE": value})
        assert ended.value.code == 2
        assert f"PIPELINE_NPROC_PER_NODE={value!r} is not a number of processes" in capsys.readouterr().err
    assert launch.processes("pretrain", {"PIPELINE_NPROC_PER_NODE": "3"}) == (3, 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_NPROC_PER_NODE": "abc", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.launch", "tokenize"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr == (
        "error: launch: PIPELINE_NPROC_PER_NODE='abc' is not a number of processes; set it to a positive integer "
        "(1, 2, ...: processes per node), or unset it for tokenize's own (2)\n"
    ), proc.stderr
    assert not list(tmp_path.iterdir()), "nothing started, nothing written"


def test_every_stage_names_a_container_that_is_defined_and_passed_to_snakemake(tmp_path):
    dump = tmp_path / "rules.json"
    subprocess.run(
        [sys.executable, "-m", "snakemake", "--list-rules", "--config", f"dump_rules={dump}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    rules = json.loads(dump.read_text())
    for name, st in load_table().items():
        image = st.resources["container"]
        family = re.fullmatch(r"containers/(\w+)\.sif", image)
        assert family, f"stage {name}: container {image!r} is not containers/<family>.sif"
        for definition in ("Dockerfile", "apptainer.def"):
            assert (ROOT / "containers" / family.group(1) / definition).is_file(), f"{name}: no {definition}"
        assert rules[name]["container"] == image, f"rule {name} does not pass its container to Snakemake"
    assert rules["train_gnn"]["container"] == "containers/gnn.sif"


def definitions():
    return sorted(ROOT.glob("containers/*/Dockerfile")) + sorted(ROOT.glob("containers/*/apptainer.def"))


def test_container_definitions_pin_the_base_by_digest_and_packages_by_the_lock():
    digests = set()
    for path in definitions():
        text = path.read_text()
        base = re.findall(r"^(?:ARG BASE_IMAGE=|From:\s*)(\S+)", text, re.M)
        assert base and all(re.search(r"@sha256:[0-9a-f]{64}$", b) for b in base), f"{path}: base not by digest"
        digests.update(b.split("@", 1)[1] for b in base)
        assert "requirements.lock" in text, f"{path}: does not install requirements.lock"
        for name, version in re.findall(r"\b([A-Za-z][\w.-]*)==([\w.+-]+)", text):
            if name in LOCK:
                assert LOCK[name] == version, f"{path}: {name}=={version}, requirements.lock has {LOCK[name]}"
            else:
                assert name == "pyg-lib", f"{path}: {name} is pinned outside requirements.lock"
    assert len(digests) == 1, f"one base image digest for every family: {digests}"
    gnn = (ROOT / "containers/gnn/Dockerfile").read_text()
    # pyg-lib wheels are built per torch release: the index must be the locked torch's.
    assert (
        f"torch-{LOCK['torch']}+" in gnn
        and f"torch-{LOCK['torch']}+" in (ROOT / "containers/gnn/apptainer.def").read_text()
    )


def test_every_python_the_project_builds_starts_with_the_collectors_thresholds():
    """pipelines/gc-threshold.pth sets the garbage collector's thresholds at start-up: in .venv (make venv
    copies it into site-packages: this interpreter, without its site-packages, has Python's own) and in
    every image (each container definition copies it)."""
    wanted = collector_thresholds()
    said = {
        flags: subprocess.run(
            [sys.executable, *flags, "-c", "import gc; print(gc.get_threshold())"], capture_output=True, text=True
        ).stdout.strip()
        for flags in ((), ("-S",))
    }
    assert said == {(): str(wanted), ("-S",): "(700, 10, 10)"}, said
    for path in definitions():
        assert "pipelines/gc-threshold.pth" in path.read_text(), f"{path} does not copy pipelines/gc-threshold.pth"


def test_the_launcher_stops_a_stage_whose_input_is_not_what_dvc_lock_records(tmp_path, monkeypatch):
    """Under DVC or Snakemake, eval_perplexity@pretrain's inputs (data/pretrain, data/tokenize) are hashed
    against the outs dvc.lock records for the stages that made them (a folder: DVC's listing in its cache):
    a file with other bytes is named with its stage; another stage's outs, records of a stage the pipeline
    no longer has, a listing the cache lacks, and a launch by hand are not checked."""
    import hashlib

    files = {"data/tokenize/train.bin": b"tokens", "data/pretrain/model/model.safetensors": b"weights"}
    files |= {"data/pretrain/meta.json": b"{}", "data/train_gnn/metrics.json": b"{}"}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    stages = {}
    for stage, folder in (
        ("tokenize", "data/tokenize"),
        ("pretrain", "data/pretrain"),
        ("train_gnn", "data/train_gnn"),
    ):
        listing = [
            {"md5": hashlib.md5(data).hexdigest(), "relpath": name.removeprefix(f"{folder}/")}
            for name, data in files.items()
            if name.startswith(f"{folder}/")
        ]
        text = json.dumps(listing)
        md5 = hashlib.md5(text.encode()).hexdigest() + ".dir"
        cached = tmp_path / ".dvc/cache/files/md5" / md5[:2] / md5[2:]
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(text)
        stages[stage] = {"cmd": "-", "outs": [{"path": folder, "md5": md5}]}
    stages["tokenize_v1"] = {"cmd": "-", "outs": [{"path": "data/tokenize/train.bin", "md5": "0" * 32}]}  # stale
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": stages}))
    label = "eval_perplexity@pretrain"
    monkeypatch.delenv("PIPELINE_SNAKEMAKE", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert verify.damaged_input(label, tmp_path) is None

    (tmp_path / "data/train_gnn/metrics.json").write_bytes(b"[]")  # not an input of this stage
    assert verify.damaged_input(label, tmp_path) is None
    (tmp_path / "data/pretrain/model/model.safetensors").write_bytes(b"weighTs")  # its size kept
    line = verify.damaged_input(label, tmp_path)
    assert line and line.startswith("data/pretrain/model/model.safetensors, an input made by pretrain, is not what"), (
        line
    )
    assert f"md5 {hashlib.md5(b'weights').hexdigest()}, its bytes {hashlib.md5(b'weighTs').hexdigest()}" in line

    (tmp_path / ".dvc/cache").rename(tmp_path / "shared-cache")  # `dvc cache dir ../shared-cache`
    (tmp_path / ".dvc/config").write_text("[cache]\n    dir = ../shared-cache\n")
    assert verify.damaged_input(label, tmp_path) == line
    monkeypatch.setenv("PIPELINE_VERIFY_INPUTS", "off")
    assert verify.damaged_input(label, tmp_path) is None
    monkeypatch.delenv("PIPELINE_VERIFY_INPUTS")

    monkeypatch.delenv("DVC_ROOT")
    assert verify.damaged_input(label, tmp_path) is None, "a launch by hand reads what it is given"
    monkeypatch.setenv("PIPELINE_SNAKEMAKE", "1")
    assert verify.damaged_input(label, tmp_path) is not None
    shutil.rmtree(tmp_path / "shared-cache")
    assert verify.damaged_input(label, tmp_path) is None, "no listing in the cache: left to DVC"
