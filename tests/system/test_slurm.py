"""The ci pipeline on a real single-node SLURM cluster, through `snakemake --profile pipelines/profiles/slurm`.

Every stage must go through sbatch (a SLURM job id per stage, each job COMPLETED in slurmctld), and the
outputs must equal those of a local run (`--profile pipelines/profiles/local`) file by file, by content
hash, except the files listed in UNSTABLE. A second test preempts a training stage with SLURM's warning
signal: the stage checkpoints and exits, the job is requeued, and its second start resumes.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import slurm
from workspace import env_for, local_run, make_clone, output_hashes, sh

from pipelines import dag

# Image builds and pipeline runs outlast the suite's per-test limit on 2 shared cores.
pytestmark = [pytest.mark.system, pytest.mark.timeout(3000)]
STAGES = set(dag.load_table())  # Snakemake rules
JOBS = [name for st in dag.load_table().values() for name, _ in st.instances()]  # one per foreach item

# Files whose bytes differ between two runs of the same code on the same data: the measured timings in
# them. JSON files among them must still agree once those keys are dropped.
TIMINGS = {
    "tokens_per_s",
    "tokens_per_cpu_s",
    "mfu",
    "encode_s",
    "tokenizer_train_s",
    "train_s",
    "train_s_per_seed",
    "wall_s",
    "peak_memory_mb",
    "peak_mb",
    "activation_mb",
    "ours",  # memory_study's rows: ratios of measured memory and speed
}  # measured, not computed: they vary from run to run
UNSTABLE = {
    "data/tokenize/metrics.json": "tokens_per_s",
    "data/tokenize/figures.json": "encode_s, tokenizer_train_s, tokens_per_s",
    "data/pretrain/metrics.json": "tokens_per_s, mfu",
    "data/pretrain/figures.json": "tokens_per_s, mfu",
    "data/eval_perplexity/pretrain/figures.json": "tokens_per_s per context",
    "data/extend_context/figures.json": "tokens_per_s per fine-tune",
    "data/finetune_qlora/nf4/figures.json": "tokens_per_s, peak_memory_mb",
    "data/finetune_qlora/none/figures.json": "tokens_per_s, peak_memory_mb",
    "data/eval_perplexity/extend_context/figures.json": "tokens_per_s per context",
    "data/train_gnn/figures.json": "train_s_per_seed, wall_s",
    "data/memory_study/figures.json": "peak_mb, activation_mb, tokens_per_s, tokens_per_cpu_s per technique",
    "data/eval_perplexity/pretrain/metrics.json": "tokens_per_s per context",
    "data/eval_perplexity/pretrain/table.csv": "its tokens_per_s rows",
    "data/extend_context/metrics.json": "tokens_per_s per fine-tune",
    "data/finetune_qlora/nf4/metrics.json": "tokens_per_s, peak_memory_mb",
    "data/finetune_qlora/none/metrics.json": "tokens_per_s, peak_memory_mb",
    "data/eval_perplexity/extend_context/metrics.json": "tokens_per_s per context",
    "data/eval_perplexity/extend_context/table.csv": "its tokens_per_s rows",
    "data/train_gnn/metrics.json": "train_s_per_seed, wall_s",
    "data/train_gnn/seeds.json": "train_s per seed",
    "data/memory_study/metrics.json": "peak_mb, activation_mb, tokens_per_s, tokens_per_cpu_s per technique",
    "data/memory_study/table.csv": "its measured columns",
    "data/memory_study/results.json": "rows of measured ratios",
    "data/memory_study/plots/memory.png": "a plot of measured memory",
    "reports/results.json": "every stage's metrics, timings included",
    "reports/results.md": "every stage's metrics, timings included",
}


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm.available()
    if why:
        pytest.skip(why)
    with slurm.LocalSlurm(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def test_pipeline_through_slurm_equals_local_run(cluster, tmp_path_factory, mirror):
    local = local_run(tmp_path_factory)

    remote = make_clone(tmp_path_factory.mktemp("slurm-run"))
    tracking = remote / "cluster-tracking.db"
    # No GPUs on this node: a GPU request would be refused at sbatch.
    out = sh(
        f"{slurm.SNAKEMAKE} --config cpu_only=1 mlflow_tracking_uri=sqlite:///{tracking}",
        remote,
        timeout=2400,
    )

    submitted = dict(re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", out))
    assert submitted, f"no job went through sbatch:\n{out[-4000:]}"
    by_rule = {}
    for job_id, log in submitted.items():
        info = cluster.job(job_id)
        assert info["JobState"] == "COMPLETED", f"SLURM job {job_id}: {info}"
        rule = Path(log).relative_to(remote / ".snakemake/slurm_logs").parts[0].removeprefix("rule_")
        by_rule[rule] = job_id
        assert Path(log).is_file(), f"no SLURM log for job {job_id}"
    assert set(by_rule) == STAGES, f"stages run through SLURM: {sorted(by_rule)}"
    assert len(submitted) == len(JOBS), "one sbatch job per stage (and foreach item)"
    for job_id in by_rule.values():
        assert cluster.job(job_id)["WorkDir"] == str(remote)

    ours, theirs = output_hashes(remote), output_hashes(local)
    assert sorted(ours) == sorted(theirs), "the same files in data/ and reports/"
    differ = sorted(p for p in ours if ours[p] != theirs[p])
    assert set(differ) <= set(UNSTABLE), f"files differ from the local run: {sorted(set(differ) - set(UNSTABLE))}"
    assert len(ours) > len(UNSTABLE) + 20, "most outputs compared byte for byte"
    for path in differ:
        if path.startswith("data/") and path.endswith(".json"):
            a, b = (json.loads((root / path).read_text()) for root in (remote, local))
            assert without_timings(a) == without_timings(b), f"{path} differs beyond its timings"

    # The slurm run logged to the tracking URI it was given, one parent run grouping all stages.
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tracking}")
    runs = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id], max_results=100)
    stages = {r.data.tags.get("stage") for r in runs if r.data.tags.get("pipeline_role") != "parent"}
    assert stages >= {"prepare_data", "tokenize", "pretrain", "train_gnn", "report"}
    assert len({r.data.tags["pipeline_run"] for r in runs}) == 1
    assert not (remote / "mlflow.db").exists(), "nothing logged to the default store"

    assert "Nothing to be done" in sh(f"{slurm.SNAKEMAKE} --config cpu_only=1", remote)
    assert "Data and pipelines are up to date." in sh("dvc status", remote)


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
