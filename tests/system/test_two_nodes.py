"""The pipeline across two SLURM nodes, made on this machine (slurm.TwoNodeSlurm: each slurmd in network
and UTS namespaces of its own, the filesystem shared). The whole ci pipeline runs through
`snakemake --profile pipelines/profiles/slurm` with pretrain and finetune_qlora on 2 nodes (one torchrun
per node, one process each) and the other stages as one-node jobs, tracked on an MLflow server that both
nodes reach. Checked, in order (each test builds on the one before):
  - every stage (and foreach item) is one sbatch job that completed; the ranks ran on both hostnames;
    the outputs equal a local run's (`--profile pipelines/profiles/local`, the same world size on one
    machine): every out's md5 in the two dvc.lock files (what the stages measured, measured/*, aside);
    stages ran at the same time on different nodes; a re-run has nothing to do and every stage is in
    dvc.lock;
  - one MLflow run per stage on the server, with each node's system metrics under its hostname;
  - commits from both nodes at once lose no dvc.lock entry;
  - the launcher refuses an allocation short of nodes and a rendezvous host on loopback;
  - losing a node mid-stage: the stage fails within seconds, keeping its checkpoints; with that node
    down, the stage re-run on one node (half the world) resumes with an uninterrupted run's losses;
  - a training job preempted with SLURM's warning signal checkpoints, is requeued and resumes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import slurm
from workspace import BIN, assert_same_outputs, copy_of_run, env_for, local_run, make_clone, sh

from pipelines import dag
from stages.common import ckpt

pytestmark = [pytest.mark.system, pytest.mark.timeout(3600)]

PORT = 5071
SERVER = f"http://{slurm.CONTROLLER_ADDRESS}:{PORT}"
RUN_ID = "two-nodes"
ON_TWO_NODES = ("pretrain", "finetune_qlora")
# The lost-node test's pretrain: long enough to lose a node in the middle, after two checkpoints.
PRETRAIN_STEPS = "pretrain:\n  train:\n    steps: 160\n    checkpoint_every: 20\n"
TABLE = dag.load_table()
STAGES = set(TABLE)  # Snakemake rules
JOBS = [name for st in TABLE.values() for name, _ in st.instances()]  # one per foreach item
FAIL_WITHIN_S = 120  # from killing a node's processes to the end of the stage's SLURM job


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = slurm.available() or slurm.namespaces_available()
    if why:
        pytest.skip(why)
    with slurm.TwoNodeSlurm(tmp_path_factory.mktemp("slurm-2n")) as c:
        yield c


def reachable_from(node: str, url: str) -> bool:
    probe = f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2).read()"
    cmd = ["nsenter", f"--net=/run/netns/pl-{node}", sys.executable, "-c", probe]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def server(two_nodes, tmp_path_factory):
    """An MLflow tracking server on the controller's address (the bridge), which both nodes reach."""
    state = tmp_path_factory.mktemp("mlflow-server")
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{state}/mlflow.db"]
    cmd += ["--artifacts-destination", str(state / "artifacts"), "--host", slurm.CONTROLLER_ADDRESS]
    cmd += ["--port", str(PORT), "--workers", "1"]
    log = open(state / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not all(reachable_from(n, f"{SERVER}/health") for n in slurm.NODES):
            assert proc.poll() is None, (state / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "the MLflow server did not answer both nodes within 2 minutes"
            time.sleep(1)
        yield SERVER
    finally:
        proc.terminate()
        proc.wait(30)


def set_resources(clone: Path, stage: str, resources: str) -> None:
    """Replace `nproc_per_node: N` in the stage's resources in the clone's pipelines/stages.yaml."""
    table = clone / "pipelines/stages.yaml"
    text = table.read_text()
    line = re.search(rf"\n  {stage}:\n(?:    .*\n)*?    resources: \{{([^}}]*)\}}", text)
    changed = re.sub(r"(nodes: \d+, )?nproc_per_node: \d+", resources, line.group(1))
    table.write_text(text.replace(line.group(0), line.group(0).replace(line.group(1), changed)))


def losses(path: Path, column: int = 1) -> np.ndarray:
    rows = path.read_text().splitlines()[1:]
    return np.array([float(r.split(",")[column]) for r in rows])


def jobs_of(out: str) -> dict[str, str]:
    """{rule (with its item): SLURM job id} of a Snakemake run's submissions."""
    found = re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", out)
    return {re.search(r"rule_([^/]+)/(?:([^/]+)/)?", log).expand(r"\1@\2").rstrip("@"): job for job, log in found}


def seconds(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


@pytest.fixture(scope="module")
def pipeline(two_nodes, server, tmp_path_factory):
    """The whole ci pipeline through the slurm profile on two nodes: (clone, {rule: job info}, its output)."""
    clone = make_clone(tmp_path_factory.mktemp("two-nodes"))
    for stage in ON_TWO_NODES:
        set_resources(clone, stage, "nodes: 2, nproc_per_node: 1")
    started = time.monotonic()
    # No GPUs on these nodes: a GPU request would be refused at sbatch.
    out = sh(
        f"{slurm.SNAKEMAKE} --config cpu_only=1 mlflow_tracking_uri={server}",
        clone,
        timeout=2400,
        PIPELINE_RUN_ID=RUN_ID,
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1",
    )
    print(f"the ci pipeline on two SLURM nodes took {time.monotonic() - started:.0f} s")
    return clone, {rule: two_nodes.job(job) for rule, job in jobs_of(out).items()}, out


def test_the_pipeline_runs_across_two_nodes_as_on_one(pipeline, tmp_path_factory):
    clone, jobs, out = pipeline
    # Every stage and foreach item went through sbatch, one job each, and completed in the clone.
    assert set(jobs) == set(JOBS), f"stages run through SLURM: {sorted(jobs)}"
    assert len(re.findall(r"has been submitted with SLURM jobid", out)) == len(JOBS), "one job per stage"
    assert {rule.partition("@")[0] for rule in jobs} == STAGES
    assert all(info["JobState"] == "COMPLETED" and info["WorkDir"] == str(clone) for info in jobs.values()), jobs
    assert all(Path(log).is_file() for log in re.findall(r"SLURM jobid \d+ \(log: (\S+)\)", out)), "SLURM logs"
    for rule, info in sorted(jobs.items()):
        print(f"{rule}: job {info['JobId']} on {info['NodeList']}, {info['StartTime']} .. {info['EndTime']}")
        assert info["NumNodes"] == ("2" if rule.partition("@")[0] in ON_TWO_NODES else "1"), info
    for log in ("pretrain", "finetune_qlora-nf4", "finetune_qlora-none"):
        text = (clone / f"logs/{log}.log").read_text()
        joined = re.search(r"preflight: 2 processes joined on 2 host\(s\): (.*)", text)
        assert joined and "--rdzv-endpoint=pnode" in text, text[-4000:]
        print(f"{log} ranks: {joined.group(1)}")
        assert set(re.findall(r"pnode\d", joined.group(1))) == {"pnode1", "pnode2"}
    assert not (clone / "mlflow.db").exists(), "nothing logged to the default store"

    # The same world size on one machine, through the local profile: the same outputs, byte for byte
    # (losses, models, tokenizer, tables): the same md5 of every out in both dvc.lock files. The two
    # clones are the same commit; this one asks for two nodes in pipelines/stages.yaml (no out records
    # the commit, so that edit changes none).
    local = local_run()
    head = sh("git rev-parse HEAD", local).strip()
    assert sh("git rev-parse HEAD", clone).strip() == head, "the clones differ: was the tree edited meanwhile?"
    assert_same_outputs(clone, local)

    # Stages at the same time on different nodes (tokenize and train_gnn both wait only for prepare_data;
    # each takes a whole node's 2 cores), and every stage recorded in dvc.lock.
    one_node = {r: i for r, i in jobs.items() if i["NumNodes"] == "1"}
    overlapping = [
        (a, b)
        for a, x in one_node.items()
        for b, y in one_node.items()
        if a < b
        and x["NodeList"] != y["NodeList"]
        and seconds(x["StartTime"]) < seconds(y["EndTime"])
        and seconds(y["StartTime"]) < seconds(x["EndTime"])
    ]
    print(f"stages that ran at once on different nodes: {overlapping}")
    assert overlapping, "no two stages ran at the same time on different nodes"
    assert "Nothing to be done" in sh(f"{slurm.SNAKEMAKE} --config cpu_only=1", clone)
    assert "Data and pipelines are up to date" in sh("dvc status", clone)


def test_each_stage_is_one_run_on_the_server_with_every_nodes_system_metrics(pipeline, server):
    import mlflow

    clone, jobs, _ = pipeline
    client = mlflow.MlflowClient(server)
    experiment = client.get_experiment_by_name("pipeline").experiment_id
    runs = client.search_runs([experiment], f"tags.pipeline_run = '{RUN_ID}'", max_results=200)
    (parent,) = [r for r in runs if r.data.tags.get("pipeline_role") == "parent"]
    names = sorted(r.info.run_name for r in runs if r is not parent)
    assert names == sorted(jobs), f"one run per stage: {names}"
    assert parent.info.status == "FINISHED" and all(r.info.status == "FINISHED" for r in runs)
    for r in runs:
        if r.info.run_name in ("pretrain", "finetune_qlora@nf4", "finetune_qlora@none"):
            assert r.data.tags["nodes"] in ("pnode1,pnode2", "pnode2,pnode1"), r.data.tags
            for node in slurm.NODES:
                for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes"):
                    series = client.get_metric_history(r.info.run_id, f"system/{node}/{name}")
                    assert series, (r.info.run_name, node, name, sorted(r.data.metrics))
            print(f"{r.info.run_name}: system metrics from {r.data.tags['nodes']}")
    (version,) = client.search_model_versions("name = 'pretrain'")
    assert version.run_id in {r.info.run_id for r in runs}


def test_commits_from_both_nodes_at_once_lose_no_entry(pipeline, two_nodes):
    """Every stage's `python -m pipelines.commit` as its own SLURM job, two per node at a time, all
    submitted at once into a directory without dvc.lock: every entry is there afterwards."""
    clone, _, _ = pipeline
    stages = [s for s in sh("dvc stage list --name-only", clone).split() if s]
    (clone / "dvc.lock").rename(clone / "dvc.lock.before")
    (clone / ".snakemake/dvc.lock.good").unlink()
    logs = clone / "commit-logs"
    logs.mkdir()
    submitted = []
    for i, stage in enumerate(stages):
        node = list(slurm.NODES)[i % 2]
        cmd = f"sbatch --parsable --nodelist={node} --ntasks=1 --cpus-per-task=1 --output={logs}/{stage}.log "
        cmd += f"--wrap='python -m pipelines.commit {stage}'"
        submitted.append(sh(cmd, clone).strip())
    infos = [two_nodes.wait_job(job, seconds=600) for job in submitted]
    failed = [
        (s, (logs / f"{s}.log").read_text()[-500:])
        for s, i in zip(stages, infos, strict=True)
        if i["JobState"] != "COMPLETED"
    ]
    assert not failed, failed
    nodes = {i["NodeList"] for i in infos}
    span = max(seconds(i["EndTime"]) for i in infos) - min(seconds(i["StartTime"]) for i in infos)
    print(f"{len(stages)} commits from {sorted(nodes)} in {span:.0f} s")
    assert nodes == set(slurm.NODES)
    import yaml

    assert set(yaml.safe_load((clone / "dvc.lock").read_text())["stages"]) == set(stages)
    assert "Data and pipelines are up to date" in sh("dvc status", clone)


def test_preflight_refuses_a_short_allocation_and_a_loopback_rendezvous(pipeline, two_nodes):
    """pretrain asks for 2 nodes: in a one-node allocation, and with a rendezvous host that resolves to a
    loopback address, the launcher stops before any process starts, with the fix in one message."""
    clone, _, _ = pipeline
    launch = "python -m pipelines.launch pretrain --input data/tokenize --output refused"
    cases = {
        "--nodes=1": "asks for 2 nodes, the SLURM allocation has 1; submit it with --nodes=2",
        "--nodes=2 --ntasks=2 --export=ALL,PIPELINE_RDZV_HOST=localhost": (
            "a loopback address the other 1 node(s) cannot reach; map localhost to its network address"
        ),
    }
    for i, (flags, message) in enumerate(cases.items()):
        log = clone / f"refused-{i}.log"
        job = sh(f"sbatch --parsable {flags} --output={log} --wrap='{launch}'", clone).strip()
        info = two_nodes.wait_job(job, seconds=300)
        text = log.read_text()
        print(f"sbatch {flags}: {info['JobState']}, {text.strip().splitlines()[-1]}")
        assert info["JobState"] == "FAILED" and message in text, text[-2000:]
        assert "preflight: " not in text and not (clone / "refused").exists(), "nothing started"


def stage_processes(netns: str, stage: str) -> list[int]:
    """The stage's processes in a node's network namespace, its workers first: torchrun's workers get
    SIGTERM when their agent dies (and would checkpoint), so they go first."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"stages.{stage}" in cmdline:
            found.append((0 if "torch.distributed.run" not in cmdline else 1, int(pid)))
    return [pid for _, pid in sorted(found)]


def test_a_lost_node_fails_the_stage_and_one_node_resumes_with_the_same_losses(pipeline, two_nodes):
    clone, _, _ = pipeline
    # pretrain long enough to lose a node in the middle; the uninterrupted run of the same world size on
    # one machine (its checkpoints elsewhere: the key is params and inputs, the same for both runs).
    (clone / "pipelines/presets/two-nodes.yaml").write_text(PRETRAIN_STEPS)
    sh("python -m pipelines.preset two-nodes", clone)
    one = f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node=2 -m stages.pretrain"
    reference = clone.parent / "uninterrupted"
    sh(
        f"{one} --input data/tokenize --output {reference}",
        clone,
        PIPELINE_TRACKING="off",
        PIPELINE_CHECKPOINTS=str(clone.parent / "uninterrupted-checkpoints"),
    )
    whole = losses(reference / "plots/loss.csv")
    assert len(whole) > 10, "the longer pretrain ran"
    env = env_for(clone, PIPELINE_RUN_ID=f"{RUN_ID}-lost")
    cmd = f"{slurm.SNAKEMAKE} pretrain --forcerun pretrain --config cpu_only=1"
    run = subprocess.Popen(
        cmd, shell=True, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 600
        while not list(clone.glob("checkpoints/pretrain/*/step-40")):  # mid-run: two checkpoints written
            assert run.poll() is None, run.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint at step 40 within 10 minutes"
            time.sleep(0.2)
        victims = stage_processes("pl-pnode2", "pretrain")
        assert len(victims) == 2, victims  # pnode2's torchrun agent and its worker
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        (job,) = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
        while two_nodes.job(job)["JobState"] in ("RUNNING", "COMPLETING"):
            assert time.monotonic() - killed < FAIL_WITHIN_S + 60, "the stage did not fail"
            time.sleep(0.2)
        failed_after = time.monotonic() - killed
        out = run.communicate(timeout=600)[0]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    state = two_nodes.job(job)["JobState"]
    print(f"pnode2 lost at step >= 40: the pretrain job ended {state} {failed_after:.1f} s after the kill")
    assert run.returncode != 0 and state == "FAILED", out[-4000:]
    assert failed_after < FAIL_WITHIN_S
    assert not (clone / "data/pretrain").exists(), "nothing half-published"
    kept = sorted(clone.glob("checkpoints/pretrain/*/step-*"), key=lambda p: int(p.name.split("-")[1]))
    newest = int(kept[-1].name.split("-")[1])
    assert newest >= 40 and ckpt.newest_intact_checkpoint(kept[-1].parent) == kept[-1]

    # pnode2 stays out (drained, as an administrator takes a failed node out of service): pretrain on
    # pnode1 alone, half the world size, from the newest checkpoint.
    subprocess.run(["scontrol", "update", "NodeName=pnode2", "State=DRAIN", "Reason=lost"], check=True)
    table = (clone / "pipelines/stages.yaml").read_text()
    try:
        set_resources(clone, "pretrain", "nodes: 1, nproc_per_node: 1")
        out = sh(
            f"{slurm.SNAKEMAKE} pretrain --config cpu_only=1", clone, timeout=1200, PIPELINE_RUN_ID=f"{RUN_ID}-resumed"
        )
    finally:
        (clone / "pipelines/stages.yaml").write_text(table)
        subprocess.run(["scontrol", "update", "NodeName=pnode2", "State=RESUME"], check=True)
    log = (clone / "logs/pretrain.log").read_text()
    (resumed_job,) = jobs_of(out).values()
    assert two_nodes.job(resumed_job)["NodeList"] == "pnode1"
    assert f"(step {newest})" in log, log[-3000:]
    resumed = losses(clone / "data/pretrain/plots/loss.csv")
    difference = float(np.max(np.abs(resumed - whole) / whole))
    print(f"resumed at step {newest} on pnode1 alone; largest relative loss difference {difference:.1e}")
    np.testing.assert_allclose(resumed, whole, rtol=1e-4)


def test_launcher_expands_the_allocation_hostlist(two_nodes):
    from pipelines import launch

    assert launch.slurm_hosts({"SLURM_JOB_NODELIST": "gpu[07-09],cpu1"}) == ["gpu07", "gpu08", "gpu09", "cpu1"]


def test_warning_signal_checkpoints_requeues_and_resumes(two_nodes, tmp_path_factory, mirror):
    """A one-node training job preempted with SLURM's warning signal checkpoints and exits, the job is
    requeued (on either node: the filesystem is shared), and its second start resumes where it stopped."""
    # tokenize's output from a copy of the ci run shared by the tests; none of its checkpoints
    work = copy_of_run(tmp_path_factory.mktemp("preempt") / "run")
    shutil.rmtree(work / "checkpoints")
    script = work / "pretrain.sbatch"
    # exec: the batch shell is the launcher itself, so `scancel --batch --signal` reaches it.
    script.write_text(
        "#!/bin/bash\nexec python -m pipelines.launch pretrain --input data/tokenize "
        "--output data/preempted train.steps=200 train.checkpoint_every=10 train.eval_every=200 train.log_every=10\n"
    )
    log = work / "pretrain.log"
    job_id = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--requeue",
            "--open-mode=append",
            "-o",
            str(log),
            "-c",
            "2",
            "-D",
            str(work),
            str(script),
        ],
        cwd=work,
        env=env_for(work),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()

    checkpoints = work / "checkpoints" / "pretrain"
    deadline = time.time() + 600
    while not list(checkpoints.glob("*/step-*")):
        assert time.time() < deadline, f"no checkpoint after 600 s:\n{log.read_text()[-3000:]}"
        assert two_nodes.job(job_id)["JobState"] in ("PENDING", "RUNNING"), log.read_text()[-3000:]
        time.sleep(1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)

    # The requeued job starts again after SLURM's requeue delay (AuthInfo=cred_expire, 30 s on this
    # cluster). It is not hurried: until then slurmd still holds the first start's revoked credential and
    # kills an early start.
    deadline = time.time() + 120
    while two_nodes.job(job_id)["Restarts"] == "0":
        assert time.time() < deadline, (
            f"job {job_id} was not requeued: {two_nodes.job(job_id)}\n{log.read_text()[-3000:]}"
        )
        time.sleep(1)
    info = two_nodes.wait_job(job_id, seconds=900)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text[-3000:]}"
    stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint saved", text)
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", text)
    assert stopped and resumed, text[-3000:]
    assert resumed.group(1) == stopped.group(1), "the second start resumes where the first stopped"
    assert "requeueing job " + job_id in text
    assert json.loads((work / "data/preempted/meta.json").read_text())["step"] == 200
