"""A real single-node SLURM cluster: a training stage preempted with SLURM's warning signal checkpoints
and exits, the job is requeued, and its second start resumes where the first stopped.

The whole ci pipeline through `snakemake --profile pipelines/profiles/slurm`, every stage an sbatch job
with outputs equal to a local run's, is tests/system/test_two_nodes.py (on a two-node cluster).
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import slurm
from workspace import env_for, make_clone, sh

# Training runs and SLURM's requeue delay outlast the suite's per-test limit on 2 shared cores; one
# SLURM cluster on this machine at a time (the xdist group of test_two_nodes.py too).
pytestmark = [pytest.mark.system, pytest.mark.timeout(3000), pytest.mark.xdist_group("slurm")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm.available()
    if why:
        pytest.skip(why)
    with slurm.LocalSlurm(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def test_launcher_expands_the_allocation_hostlist(cluster):
    from pipelines import launch

    assert launch.slurm_hosts({"SLURM_JOB_NODELIST": "gpu[07-09],cpu1"}) == ["gpu07", "gpu08", "gpu09", "cpu1"]


def test_warning_signal_checkpoints_requeues_and_resumes(cluster, tmp_path_factory, mirror):
    work = make_clone(tmp_path_factory.mktemp("preempt"))
    sh("snakemake --profile pipelines/profiles/local --cores 2 tokenize", work)
    script = work / "pretrain.sbatch"
    # exec: the batch shell is the launcher itself, so `scancel --batch --signal` reaches it.
    script.write_text(
        "#!/bin/bash\nexec python -m pipelines.launch pretrain --input data/tokenize "
        "--output data/pretrain train.steps=400 train.checkpoint_every=10 train.eval_every=400 train.log_every=10\n"
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
        assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), log.read_text()[-3000:]
        time.sleep(1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)

    # The requeued job starts again after SLURM's requeue delay (about 2 minutes). It is not hurried:
    # until then slurmd still holds the first start's revoked credential and kills an early start.
    deadline = time.time() + 120
    while cluster.job(job_id)["Restarts"] == "0":
        assert time.time() < deadline, (
            f"job {job_id} was not requeued: {cluster.job(job_id)}\n{log.read_text()[-3000:]}"
        )
        time.sleep(1)
    info = cluster.wait_job(job_id, seconds=900)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text[-3000:]}"
    stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint saved", text)
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", text)
    assert stopped and resumed, text[-3000:]
    assert resumed.group(1) == stopped.group(1), "the second start resumes where the first stopped"
    assert "requeueing job " + job_id in text
    assert json.loads((work / "data/pretrain/meta.json").read_text())["step"] == 400
