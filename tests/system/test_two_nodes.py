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
  - a rank stalled on the second node ends the stage in seconds, named with its host (hang watchdog);
  - losing a node mid-stage: the stage fails within seconds, keeping its checkpoints; with that node
    down, the stage re-run on one node (half the world) resumes with an uninterrupted run's losses;
  - a training job preempted with SLURM's warning signal checkpoints, is requeued and resumes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import slurm
from conftest import MLFLOW_SERVER_ENV, running_server
from workspace import BIN, assert_same_outputs, copy_of_run, env_for, local_run, make_clone, sh

from pipelines import dag
from stages.common import ckpt

pytestmark = [pytest.mark.system, pytest.mark.timeout(3600)]

PORT = 5071
SERVER = f"http://{slurm.CONTROLLER_ADDRESS}:{PORT}"
RUN_ID = "two-nodes"
ON_TWO_NODES = ("pretrain", "finetune_qlora")
# The lost-node test's pretrain: long enough to lose a node in the middle, after two checkpoints.
PRETRAIN_STEPS = "pretrain:\n  train:\n    steps: 80\n    checkpoint_every: 20\n"
TABLE = dag.load_table()
STAGES = set(TABLE)  # Snakemake rules
JOBS = [name for st in TABLE.values() for name, _ in st.instances()]  # one per foreach item
FAIL_WITHIN_S = 120  # from killing a node's processes to the end of the stage's SLURM job
# The tracking server's accounts (name, password): fresh passwords each run, so a leak is found by grep.
ADMIN = ("admin", f"admin-{secrets.token_hex(12)}")
WRITER = ("alice", f"alice-{secrets.token_hex(12)}")  # the pipeline's runs
READER = ("bob", f"bob-{secrets.token_hex(12)}")  # may read, may not write to the pipeline's experiment
SERVER_STATE: dict[str, Path] = {}  # where the server keeps the runs' artifacts
SSH_PORT = 2222  # the SSH server on pnode2 (a DVC remote)
# What a change to eval_perplexity's params re-runs (DVC stage names): context_study reads its output.
AFTER_EVAL = {"eval_perplexity@pretrain", "eval_perplexity@extend_context", "context_study", "report"}


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
    """An MLflow tracking server with users (MLflow's basic-auth app) on the controller's address (the
    bridge), which both nodes reach. Any account may read (default_permission READ); WRITER creates the
    pipeline's experiment and so may write to it; READER may only read."""
    state = tmp_path_factory.mktemp("mlflow-server")
    SERVER_STATE["artifacts"] = state / "artifacts"
    (state / "auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{state}/auth.db\n"
        f"admin_username = {ADMIN[0]}\nadmin_password = {ADMIN[1]}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "auth_cache_ttl_seconds = 60\n"  # (else each request costs a password-hash check: docs/reproducing.md)
    )
    cmd = [str(BIN / "mlflow"), "server", "--app-name", "basic-auth"]
    cmd += ["--backend-store-uri", f"sqlite:///{state}/mlflow.db"]
    cmd += ["--artifacts-destination", str(state / "artifacts"), "--host", slurm.CONTROLLER_ADDRESS]
    cmd += ["--port", str(PORT), "--workers", "1"]
    env = {**os.environ, **MLFLOW_SERVER_ENV, "MLFLOW_AUTH_CONFIG_PATH": str(state / "auth.ini")}
    env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secrets.token_hex(16)

    def ready():
        return all(reachable_from(n, f"{SERVER}/health") for n in slurm.NODES)

    with running_server(cmd, state / "server.log", ready, "the MLflow server (from both nodes)", env=env):
        from mlflow.server import get_app_client

        with signed_in(ADMIN):
            users = get_app_client("basic-auth", tracking_uri=SERVER)
            for name, password in (WRITER, READER):
                users.create_user(name, password)
        yield SERVER


@pytest.fixture(scope="module")
def ssh_remote(two_nodes, tmp_path_factory):
    """An OpenSSH server on pnode2 (in its network namespace; key authentication only) serving a folder
    as a DVC remote: (its ssh:// URL, the client's key). The folder is on the shared filesystem, as the
    nodes' is; what reaches it from pnode1 goes through SSH."""
    sshd = Path("/usr/sbin/sshd")
    if not sshd.exists():
        pytest.skip("no OpenSSH server (Debian's openssh-server; tests/system/install.sh ssh installs it)")
    home = tmp_path_factory.mktemp("ssh")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / key)], check=True)
    shutil.copy(home / "client_key.pub", home / "authorized_keys")
    (home / "sshd_config").write_text(
        f"Port {SSH_PORT}\nListenAddress {slurm.NODES['pnode2']}\nHostKey {home / 'host_key'}\n"
        f"AuthorizedKeysFile {home / 'authorized_keys'}\nPidFile {home / 'sshd.pid'}\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nSubsystem sftp internal-sftp\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation directory
    log = open(home / "sshd.log", "wb")
    cmd = ["nsenter", "--net=/run/netns/pl-pnode2", str(sshd), "-D", "-e", "-f", str(home / "sshd_config")]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    client = ["ssh", "-p", str(SSH_PORT), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
    client += ["-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5"]
    on_pnode1 = ["nsenter", "--net=/run/netns/pl-pnode1"]
    try:
        deadline = time.time() + 60
        login = [*on_pnode1, *client, "-i", str(home / "client_key"), "root@pnode2", "true"]
        while subprocess.run(login, capture_output=True).returncode:
            assert proc.poll() is None, (home / "sshd.log").read_text()[-3000:]
            assert time.time() < deadline, (home / "sshd.log").read_text()[-3000:]
            time.sleep(0.5)
        password_only = [*on_pnode1, *client, "-o", "PubkeyAuthentication=no", "root@pnode2", "true"]
        refused = subprocess.run(password_only, capture_output=True, text=True)
        assert refused.returncode != 0 and "Permission denied (publickey)" in refused.stderr, refused.stderr
        yield f"ssh://pnode2:{SSH_PORT}{home / 'store'}", home / "client_key"
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def signed_in(account: tuple[str, str]):
    """MLflow's client in this process as `account` (it reads the standard variables per request)."""
    before = {k: os.environ.get(k) for k in credentials(account)}
    os.environ.update(credentials(account))
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def credentials(account: tuple[str, str]) -> dict[str, str]:
    """The environment of a command run as `account`."""
    return {"MLFLOW_TRACKING_USERNAME": account[0], "MLFLOW_TRACKING_PASSWORD": account[1]}


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
        **credentials(WRITER),
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
    with signed_in(READER):
        check_runs(mlflow.MlflowClient(server), jobs)


def check_runs(client, jobs: dict) -> None:
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


def test_the_server_refuses_a_stage_without_an_account_or_permission_in_one_line(pipeline, server):
    """Against the server with users: no account, a wrong password, and an account that may only read the
    pipeline's experiment. Each stage (eval_perplexity, 2 processes) stops as it opens its run, before any
    compute, with one line naming the cause and the fix as its last, exit code 2; nothing published, no
    run opened; the password is not in what it printed."""
    clone, _, _ = pipeline
    launch = [sys.executable, "-m", "pipelines.launch", "eval_perplexity@pretrain", "--models"]
    launch += ["pretrain=data/pretrain/model", "--input", "data/tokenize", "--output", "data/refused"]
    wrong = (WRITER[0], WRITER[1][::-1])
    cases = {
        "no account": ({}, f"MLflow tracking server {server} asks for a user: set MLFLOW_TRACKING_USERNAME"),
        "wrong password": (credentials(wrong), f"MLflow tracking server {server} refused user 'alice': "),
        "may only read": (
            credentials(READER),
            f"MLflow tracking server {server} does not let user 'bob' write to experiment 'pipeline': ",
        ),
    }
    with signed_in(READER):
        import mlflow

        client = mlflow.MlflowClient(server)
        experiment = client.get_experiment_by_name("pipeline").experiment_id
        before = len(client.search_runs([experiment], max_results=1000))
    for case, (account, line) in cases.items():
        env = env_for(clone, MLFLOW_TRACKING_URI=server, PIPELINE_NPROC_PER_NODE="2", **account)
        if not account:
            env = {k: v for k, v in env.items() if not k.startswith("MLFLOW_TRACKING_USER")}
        started = time.monotonic()
        proc = subprocess.run(launch, cwd=clone, env=env, capture_output=True, text=True, timeout=300)
        said = (proc.stdout + proc.stderr).strip()
        print(f"{case}: exit {proc.returncode} in {time.monotonic() - started:.1f} s: {said.splitlines()[-1]}")
        assert proc.returncode == 2 and said.splitlines()[-1].startswith(f"error: {line}"), said[-3000:]
        assert WRITER[1] not in said and READER[1] not in said and wrong[1] not in said
        assert not (clone / "data/refused").exists()
    with signed_in(READER):
        assert len(client.search_runs([experiment], max_results=1000)) == before, "no run opened"


def test_no_password_is_written_into_logs_outputs_or_the_tracking_server(pipeline, server):
    """The accounts' passwords (in the environment of every stage of the two-node run) appear nowhere in
    the clone (logs, SLURM logs, outputs, measured/, dvc.lock, MLflow's unsent records) nor in what the
    server keeps of the runs: params, tags and artifacts."""
    import mlflow

    clone, _, _ = pipeline
    secrets_ = [WRITER[1], READER[1], ADMIN[1]]
    found = subprocess.run(["grep", "-rlF", *[f"-e{s}" for s in secrets_], str(clone)], capture_output=True)
    assert found.returncode == 1, f"a password in: {found.stdout.decode()}"
    with signed_in(READER):
        client = mlflow.MlflowClient(server)
        experiment = client.get_experiment_by_name("pipeline").experiment_id
        runs = client.search_runs([experiment], max_results=1000)
        assert runs
        for run in runs:
            text = json.dumps([run.data.params, run.data.tags])
            assert not any(s in text for s in secrets_), run.info.run_name
    artifacts = SERVER_STATE["artifacts"]
    assert any(artifacts.rglob("requirements.txt")), "the runs' artifacts are on the server's destination"
    found = subprocess.run(["grep", "-rlF", *[f"-e{s}" for s in secrets_], str(artifacts)], capture_output=True)
    assert found.returncode == 1, f"a password in: {found.stdout.decode()}"


def test_results_pushed_from_one_node_over_ssh_are_pulled_on_the_other_and_nothing_reruns(pipeline, ssh_remote, server):
    """Node 1 pushes the two-node run (`make push`: outs, run cache and what its entries name) to the SSH
    remote on node 2; on node 2, a fresh clone of the same commit pulls: `dvc status` is up to date,
    `snakemake -n` has nothing to do and `dvc repro` runs nothing. A change to eval_perplexity's params
    alone then re-runs exactly the stages after it, on node 2, tracked on the server; a clone without
    dvc.lock's records restores every stage from the remote's run cache without running one; and node 2
    evaluates `models:/pretrain@reproduced`, registered by the run, to the run's own figures."""
    from test_e2e import UP_TO_DATE, dvc_ran

    clone, _, _ = pipeline
    url, key = ssh_remote
    git = "git -c user.name=ci -c user.email=ci@localhost"
    sh(f"dvc remote add -d team {url} && {git} add -A && {git} commit -qm 'the run and the team remote'", clone)
    on = {node: f"srun --nodes=1 --ntasks=1 --cpus-per-task=2 --nodelist={node}" for node in slurm.NODES}
    started = time.monotonic()
    sh(f"dvc remote modify --local team keyfile {key} && {on['pnode1']} python -m pipelines.share push", clone)
    pushed = time.monotonic() - started

    node2 = clone.parent / "on-pnode2"
    sh(f"git clone -q {clone} {node2} && cd {node2} && dvc remote modify --local team keyfile {key}", clone.parent)
    started = time.monotonic()
    sh(f"{on['pnode2']} dvc pull", node2)
    pulled = time.monotonic() - started
    said = {cmd: sh(f"{on['pnode2']} {cmd}", node2) for cmd in ("dvc status", "snakemake --cores 2 -n", "dvc repro")}
    for cmd, out in said.items():
        print(f"pnode2$ {cmd}\n{out.strip()}")
    print(f"make push on pnode1 {pushed:.1f} s, dvc pull on pnode2 {pulled:.1f} s (over SSH)")
    assert UP_TO_DATE in said["dvc status"]
    assert "Nothing to be done" in said["snakemake --cores 2 -n"]
    assert dvc_ran(said["dvc repro"]) == set() and UP_TO_DATE in said["dvc repro"]
    assert not (node2 / "logs").exists(), "no stage started"

    params = node2 / "params.yaml"
    params.write_text(params.read_text().replace("max_tokens: 2048", "max_tokens: 1024", 1))
    out = sh(f"{on['pnode2']} dvc repro", node2, MLFLOW_TRACKING_URI=server, **credentials(WRITER))
    assert dvc_ran(out) == AFTER_EVAL, out[-3000:]
    sh(f"{git} commit -qam 'eval_perplexity on fewer tokens'", node2)

    bare = clone.parent / "no-lock-on-pnode2"
    sh(f"git clone -q {clone} {bare} && {git} -C {bare} rm -q dvc.lock", clone.parent)
    sh(f"dvc remote modify --local team keyfile {key}", bare)  # (sh runs in `bare`)
    out = sh(f"{on['pnode2']} dvc repro --pull", bare)
    cached = set(re.findall(r"Stage '([\w@]+)' is cached - skipping run, checking out outputs", out))
    assert dvc_ran(out) == set() and cached == set(JOBS), out[-3000:]
    assert not (bare / "logs").exists() and not (bare / "mlflow.db").exists()

    out = bare.parent / "registered-on-pnode2"
    launch = "python -m pipelines.launch eval_perplexity --models models:/pretrain@reproduced"
    launch += f" --input data/tokenize --output {out}"
    sh(f"{on['pnode2']} {launch}", bare, MLFLOW_TRACKING_URI=server, **credentials(WRITER))
    ours = json.loads((out / "figures.json").read_text())
    theirs = json.loads((clone / "data/eval_perplexity/pretrain/figures.json").read_text())
    (registered,) = ours["models"].values()
    figures = {k: v["perplexity"] for k, v in registered.items() if k.startswith("ctx")}
    assert figures == {k: v["perplexity"] for k, v in theirs["models"]["pretrain"].items() if k.startswith("ctx")}
    print(f"models:/pretrain@reproduced on pnode2: perplexity by context {figures}, as the run's")


def test_a_push_over_ssh_killed_half_way_is_completed_by_the_next(ssh_remote, tmp_path):
    """As on a folder remote (tests/test_e2e_remote.py): `dvc push` to the SSH remote on pnode2, SIGKILLed
    once part of the objects are there, leaves none partial; the next push sends the rest, and a fresh
    clone pulls every file whole."""
    from test_e2e_remote import killed_push_round_trip

    url, key = ssh_remote
    store = Path(url.removeprefix(f"ssh://pnode2:{SSH_PORT}") + "-killed")
    killed_push_round_trip(tmp_path, f"{url}-killed", store, {"keyfile": str(key)})


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


def test_a_rank_stalled_on_the_other_node_ends_the_stage_naming_that_node(pipeline, two_nodes, server):
    """pretrain on two nodes, one process each; rank 1 (on pnode2) stops for good before step 5 (a fault
    injected). The hang watchdog ends the SLURM job after train.hang_timeout_s, not at the collective
    timeout: rank 1's stacks reach rank 0 through the process group's store across the hosts, the last
    line names rank 1 and pnode2, the job's exit code is the watchdog's, the run on the server is FAILED
    with the cause, nothing is published and the last checkpoint is intact."""
    from stages.common import watchdog

    clone, _, _ = pipeline
    log = clone / "stalled.log"
    checkpoints = clone.parent / "stalled-checkpoints"
    launch = (
        "python -m pipelines.launch pretrain --input data/tokenize --output data/stalled "
        "train.steps=8 train.checkpoint_every=2 train.eval_every=8 train.log_every=1 train.hang_timeout_s=8"
    )
    exports = f"ALL,PIPELINE_FAULT_STALL=1:4,PIPELINE_CHECKPOINTS={checkpoints},PIPELINE_RUN_ID={RUN_ID}-stalled"
    flags = f"--nodes=2 --ntasks=2 --export={exports} --output={log}"
    job = sh(f"sbatch --parsable {flags} --wrap='{launch}'", clone, MLFLOW_TRACKING_URI=server, **credentials(WRITER))
    job = job.strip()
    info = two_nodes.wait_job(job, seconds=600)
    text = log.read_text()
    stamps = [seconds(info[k]) for k in ("StartTime", "EndTime")]
    print(f"stalled rank 1 on pnode2: job {info['JobState']} {info['ExitCode']} after {stamps[1] - stamps[0]:.0f} s")
    last = text.strip().splitlines()[-1]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == f"{watchdog.HANG_EXIT}:0", f"{info}\n{text[-3000:]}"
    where = r"\(in step 5, after checkpoint step-4\)"
    assert re.match(rf"error: hang: rank 1 on pnode2 {where} made no progress", last), last
    assert stamps[1] - stamps[0] < 120, "well before the collective timeout"
    rank0, rank1 = text.index("[rank 0] pnode1 "), text.index("[rank 1] pnode2 ")
    assert "waits in a collective; Python stacks:" in text[rank0:rank1], text[-4000:]
    assert "in injected_stall" in text[rank1:], text[-4000:]
    assert not (clone / "data/stalled").exists(), "nothing published"
    (folder,) = (p for p in (checkpoints / "pretrain").iterdir() if p.is_dir())
    kept = ckpt.newest_intact_checkpoint(folder)
    assert kept is not None and kept.name in ("step-2", "step-4"), sorted(p.name for p in folder.iterdir())

    import mlflow

    failed = "tags.stage = 'pretrain' and attributes.status = 'FAILED'"
    with signed_in(READER):
        client = mlflow.MlflowClient(server)
        runs = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id], failed)
    assert any(r.data.tags.get("failure") == "hang" and "pnode2" in r.data.tags.get("failure_cause", "") for r in runs)


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
