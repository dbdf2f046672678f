"""The real DAG on the ci preset, through `snakemake --cores 2` and `dvc repro`, in a scratch clone.

Both tools must agree on what is current: re-running either with nothing changed runs nothing; a params
change re-runs the stage and what follows; a deleted output re-runs only its stage and dependents;
after one tool runs, the other sees everything up to date. MLflow groups each invocation's runs.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import MIRROR, ROOT

pytestmark = pytest.mark.e2e
UP_TO_DATE = "Data and pipelines are up to date."
# What a change to tokenize re-runs (Snakemake rule names).
DOWNSTREAM = {
    "tokenize",
    "pretrain",
    "extend_context",
    "finetune_qlora",
    "eval_perplexity",
    "context_study",
    "memory_study",
    "report",
}


def env_for(cwd: Path) -> dict:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PIPELINE_DATA_MIRROR": str(MIRROR),
        "PYTHONPATH": str(cwd),
    }
    for key in ("MLFLOW_TRACKING_URI", "PIPELINE_RUN_ID", "PIPELINE_SNAKEMAKE"):
        env.pop(key, None)  # the embedded defaults: sqlite in the clone, one group per invocation
    return env


def sh(cmd: str, cwd: Path) -> str:
    proc = subprocess.run(cmd, shell=True, cwd=cwd, env=env_for(cwd), capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{cmd}` failed:\n{out[-6000:]}"
    return out


def snakemake_ran(out: str) -> set[str]:
    return set(re.findall(r"^\s*(?:local)?rule (\w+):", out, re.M)) - {"all"}


def dvc_ran(out: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w@]+)'", out))


def set_vocab(clone: Path, size: int) -> None:
    params = clone / "params.yaml"
    params.write_text(re.sub(r"(\n  vocab_size:) \d+", rf"\1 {size}", params.read_text(), count=1))


def set_growth(clone: Path, value: float) -> None:
    params = clone / "params.yaml"
    params.write_text(re.sub(r"(\n  unscaled_growth:) [\d.]+", rf"\1 {value}", params.read_text(), count=1))


@pytest.fixture(scope="module")
def clone(tmp_path_factory, mirror) -> Path:
    """The working tree (tracked and new files) as a fresh git repository, with the ci preset."""
    dest = tmp_path_factory.mktemp("clone")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            (dest / name.decode()).write_bytes(src.read_bytes())
    sh(
        "git init -q && python -m pipelines.preset ci && git add -A && "
        "git -c user.name=ci -c user.email=ci@localhost commit -qm clone",
        dest,
    )
    return dest


def mlflow_groups(clone: Path) -> dict[str, list[str]]:
    """pipeline_run id -> stages of its child runs (only runs nested under a parent)."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id], max_results=1000)
    parents = {r.info.run_id: r.data.tags["pipeline_run"] for r in runs if r.data.tags.get("pipeline_role") == "parent"}
    groups: dict[str, list[str]] = {}
    for r in runs:
        parent = r.data.tags.get("mlflow.parentRunId")
        if parent in parents:
            assert r.data.tags["pipeline_run"] == parents[parent]
            groups.setdefault(parents[parent], []).append(r.data.tags["stage"])
    assert len(parents) == len(groups), "every parent run holds the runs of its invocation"
    return {k: sorted(v) for k, v in groups.items()}


@pytest.mark.timeout(3600)  # the whole DAG on 2 cores, then the part after tokenize again
def test_snakemake_and_dvc_agree_on_what_is_current(clone):
    out = sh("snakemake --cores 2", clone)
    assert snakemake_ran(out) == {"prepare_data", *DOWNSTREAM, "train_gnn"}
    assert UP_TO_DATE in sh("dvc status", clone), "snakemake commits every stage to dvc.lock"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    names = {r.info.run_name for r in client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])}
    items = {"eval_perplexity@pretrain", "eval_perplexity@extend_context", "finetune_qlora@nf4", "finetune_qlora@none"}
    assert items | {"pretrain", "report"} <= names, "stage runs are named with their item"
    results = (clone / "reports/results.md").read_text()
    assert (
        "| result | paper | relation | published | ours | tolerance | pass | stage | git_commit | data_hashes |"
        in results
    )
    assert "### tokenize" in results and (clone / "reports/results.json").is_file()
    assert (
        "| GCN test accuracy on Cora (%), mean of 2 seeds | Kipf & Welling 2017 (GCN), Table 2 | = | 81.5 |" in results
    )
    assert "data/train_gnn/plots/accuracy.png" in results
    # The context-extension study: every method x length cell filled, its findings in the report.
    study = json.loads((clone / "data/context_study/study.json").read_text())
    assert study["lengths"] == [64, 128, 256, 512] and len(study["perplexity"]) == 7
    assert all(len(row) == 4 for row in study["perplexity"].values())
    assert "| unscaled: perplexity at 2L / at L | Chen et al. 2023 (Position Interpolation) | >= | 1.2 |" in results
    assert "## Comparison: finetune_qlora" in results and "| eval_loss |" in results.split("## Comparison")[1]
    # Our perplexities against the run recorded for the ci params (pipelines/recorded.yaml): all within tolerance.
    regression = json.loads((clone / "reports/results.json").read_text())["regression"]
    assert len(regression["rows"]) == 4 + 7 * 4 and all(r["pass"] for r in regression["rows"]), regression

    check_registry(clone)

    assert "Nothing to be done" in sh("snakemake --cores 2", clone)
    assert dvc_ran(sh("dvc repro", clone)) == set()

    # A key of a sub-section (pretrain.train.lr) changes pretrain's params for DVC (and report's, which
    # reads the sections behind the perplexities; the stages between follow from pretrain's outputs), and
    # makes Snakemake re-run pretrain and what depends on it (dry runs: nothing changes).
    params = (clone / "params.yaml").read_text()
    set_pretrain(clone, lr=0.002)
    changed = json.loads(sh("dvc status --json", clone))
    assert changed == {s: [{"changed deps": {"params.yaml": {"pretrain": "modified"}}}] for s in ("pretrain", "report")}
    assert snakemake_ran(sh("snakemake --cores 2 -n", clone)) == DOWNSTREAM - {"tokenize", "memory_study"}
    (clone / "params.yaml").write_text(params)

    # A params change of tokenize: both tools would re-run tokenize and what follows, never prepare_data or
    # train_gnn (no path from tokenize). Dry runs: the real re-runs below (after a deleted output, a params
    # change near the end of the DAG) prove that re-run stages are committed, without the whole chain again.
    set_vocab(clone, 600)
    changed = json.loads(sh("dvc status --json", clone))
    assert set(changed) == {"tokenize", "report"}, changed  # report reads tokenize's section too
    assert snakemake_ran(sh("snakemake --cores 2 -n", clone)) == DOWNSTREAM
    (clone / "params.yaml").write_text(params)
    assert UP_TO_DATE in sh("dvc status", clone)
    # A real re-run through DVC, on a stage near the end of the DAG (the chain after tokenize takes minutes).
    set_growth(clone, 1.3)
    assert dvc_ran(sh("dvc repro", clone)) == {"context_study", "report"}
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone), "dvc repro results count for snakemake"
    # A second params change after `dvc repro` (which leaves Snakemake no records of those stages): Snakemake
    # still sees it, through DVC, and would re-run the same stages DVC would.
    set_growth(clone, 1.4)
    assert "context_study" in sh("dvc status", clone)
    assert snakemake_ran(sh("snakemake --cores 2 -n", clone)) == {"context_study", "report"}
    # A sweep point as a DVC experiment: the same two stages, recorded with its params and metrics.
    assert dvc_ran(sh("dvc exp run -S context_study.unscaled_growth=1.25 -n growth-1.25", clone)) == {
        "context_study",
        "report",
    }
    table = csv.DictReader(io.StringIO(sh("dvc exp show --csv", clone)))
    assert next(r for r in table if r["Experiment"] == "growth-1.25")["context_study.unscaled_growth"] == "1.25"
    metrics = sh("dvc metrics show", clone)
    assert all(f"data/{s}/metrics.json" in metrics for s in ("pretrain", "train_gnn", "context_study")), metrics
    # `dvc plots show`, offline: no script loads from elsewhere, every line plot is on the page.
    # Plain `dvc plots show` needs nothing beyond the clone (its page loads Vega from a CDN) ...
    sh(f"dvc plots show -o {clone.parent / 'plain_plots'}", clone)
    assert "vegaEmbed" in (clone.parent / "plain_plots/index.html").read_text()
    # ... and `make plots` renders offline.
    sh("python -m pipelines.plots && dvc plots show --html-template .dvc/plots/offline.html", clone)
    page = (clone / "dvc_plots/index.html").read_text()
    assert not re.search(r"<script[^>]+src=", page) and "vegaEmbed" in page
    assert all(p in page for p in ("data/pretrain/plots/val_loss.csv", "data/finetune_qlora/nf4/plots/loss.csv"))
    evals = (clone / "data/finetune_qlora/nf4/plots/eval_loss.csv").read_text().splitlines()
    assert len(evals) >= 2, "the final eval loss is the last point of its curve"

    # A deleted output re-runs its stage and its dependents only.
    sh("rm -rf data/context_study", clone)
    assert snakemake_ran(sh("snakemake --cores 2", clone)) == {"context_study", "report"}
    assert UP_TO_DATE in sh("dvc status", clone)
    sh("rm -rf data/context_study", clone)
    out = sh("dvc repro", clone)
    # DVC restores the deleted output from its run cache rather than recomputing identical work.
    assert "Stage 'context_study' is cached - skipping run, checking out outputs" in out
    assert "Stage 'extend_context' didn't change, skipping" in out and (clone / "data/context_study/study.md").is_file()
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)

    # Restoring from DVC's cache makes an upstream folder newer than its dependents; still current.
    sh("rm -rf data/prepare_data && dvc checkout", clone)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)
    assert UP_TO_DATE in sh("dvc status", clone)

    # One MLflow group per invocation that ran stages: two from snakemake, two from DVC.
    groups = mlflow_groups(clone)
    by_tool = {tool: sorted(str(v) for k, v in groups.items() if k.startswith(tool)) for tool in ("smk-", "dvc-")}
    downstream = sorted(["eval_perplexity", "finetune_qlora", *DOWNSTREAM])  # each runs twice (two items)
    full = sorted(["prepare_data", "train_gnn", *downstream])
    study = ["context_study", "report"]
    assert by_tool["smk-"] == sorted(map(str, [full, study]))
    assert by_tool["dvc-"] == [str(study)] * 2  # dvc repro, dvc exp run
    assert len(groups) == 4

    # dvc.lock emptied by a kill in the middle of a `dvc commit`: Snakemake restores its last good copy
    # when it loads (every load refreshes that copy), and both tools see everything current again.
    sh("snakemake --cores 2 -n", clone)
    (clone / "dvc.lock").write_text("")
    out = sh("snakemake --cores 2 -n", clone)
    assert "dvc.lock was damaged (it holds no stages)" in out and "Nothing to be done" in out, out[-3000:]
    assert UP_TO_DATE in sh("dvc status", clone)

    # The environment's snakemake started by its path, without the environment on PATH: the rules run its
    # python and dvc, not the system's.
    bare = {**env_for(clone), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "snakemake"),
            "context_study",
            "--cores",
            "2",
            "--forcerun",
            "context_study",
        ],
        cwd=clone,
        env=bare,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and snakemake_ran(proc.stdout + proc.stderr) == {"context_study"}, proc.stderr[-3000:]
    assert "context_study:" not in sh("dvc status", clone), "the rule's dvc commit ran too"

    # A stage that stops before it opens its MLflow run still marks its invocation's run FAILED. Under
    # DVC: bad params. Under Snakemake (its load checks params before any job): a damaged input, with
    # PIPELINE_NO_SYNC so that it does not first re-run the stage that wrote it.
    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipeline").experiment_id

    def failed_parents() -> list:
        return client.search_runs([experiment], "tags.pipeline_role = 'parent' and attributes.status = 'FAILED'")

    params = (clone / "params.yaml").read_text()
    try:
        set_growth(clone, 0.5)
        proc = subprocess.run(
            "dvc repro context_study", shell=True, cwd=clone, env=env_for(clone), capture_output=True, text=True
        )
        assert proc.returncode != 0 and "unscaled_growth must be >= 1" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    finally:
        (clone / "params.yaml").write_text(params)
    (failed,) = failed_parents()
    assert failed.data.tags["pipeline_run"].startswith("dvc-")
    assert failed.data.tags["unfinished_stages"] == "context_study:FAILED"

    figures = clone / "data/eval_perplexity/extend_context/figures.json"
    saved = figures.read_bytes()
    figures.unlink()
    try:
        proc = subprocess.run(
            "snakemake --cores 2 --forcerun context_study context_study",
            shell=True,
            cwd=clone,
            env={**env_for(clone), "PIPELINE_NO_SYNC": "1"},
            capture_output=True,
            text=True,
        )
        assert proc.returncode != 0 and "figures.json not found" in (clone / "logs/context_study.log").read_text()
    finally:
        figures.write_bytes(saved)
        sh("dvc checkout context_study", clone)  # Snakemake removed the failed job's output
    smk = [r for r in failed_parents() if r.data.tags["pipeline_run"].startswith("smk-")]
    assert len(smk) == 1 and smk[0].data.tags["unfinished_stages"] == "context_study:FAILED"
    assert UP_TO_DATE in sh("dvc status", clone)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)


def check_registry(clone: Path) -> None:
    """After a whole pipeline: every published model is a registered version whose lineage is dvc.lock's,
    the report set the alias `reproduced` on the models whose rows pass, and eval_perplexity reads a
    registered model by alias with the numbers of its folder."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    variants = [
        f"extend_context-{v}" for v in json.loads((clone / "data/extend_context/meta.json").read_text())["variants"]
    ]
    models = {m.name: m for m in client.search_registered_models()}
    assert set(models) == {"pretrain", "finetune_qlora-nf4", "finetune_qlora-none", *variants}
    lock = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    for stage, name, deps in (
        ("pretrain", "pretrain", ["data/tokenize"]),
        ("extend_context", variants[0], ["data/tokenize"]),
        ("finetune_qlora@nf4", "finetune_qlora-nf4", []),
    ):
        (version,) = client.search_model_versions(f"name = '{name}'")
        assert version.tags["output_dvc_md5"] == lock[stage]["outs"][0]["md5"], name
        for dep in lock[stage]["deps"]:
            if dep["path"] in deps:
                assert version.tags[f"input.{dep['path']}"] == dep["md5"], (name, dep["path"])
    results = json.loads((clone / "reports/results.json").read_text())
    nf4 = [r["pass"] for r in results["rows"] if r["stage"] == "finetune_qlora/nf4"]
    expected = {"pretrain", *variants} | ({"finetune_qlora-nf4"} if nf4 and all(nf4) else set())
    assert {name for name, m in models.items() if "reproduced" in m.aliases} == expected
    sh(
        "python -m stages.eval_perplexity --models folder=data/pretrain/model models:/pretrain@reproduced "
        "--input data/tokenize --output ../registered_eval contexts=[64] max_tokens=4000",
        clone,
    )
    figures = json.loads((clone.parent / "registered_eval/figures.json").read_text())["models"]
    assert figures["pretrain"]["ctx64"]["nll"] == figures["folder"]["ctx64"]["nll"]


@pytest.mark.timeout(900)
def test_readme_commands_run_as_written(clone):
    """After the run above: the README's commands marked `run` run as written; its stage commands pass
    `--check` (their command line and params overrides, no compute); see tests/readme_commands.py."""
    import readme_commands

    # a text longer than the longest context evaluated
    (clone / "notes.txt").write_text((MIRROR / "tinyshakespeare/input.txt").read_text()[:60_000])
    params = (clone / "params.yaml").read_text()  # as the test above left them
    ran = []
    for command, (how, _) in readme_commands.HOW.items():
        if how == "check":
            sh(re.sub(r"^torchrun --nproc-per-node \d+ ", "python ", command) + " --check", clone)
            ran.append(command)
        elif how == "run" and "pipelines.preset" not in command:
            out = sh(command, clone)
            if command.startswith(("dvc repro", "snakemake --cores")):
                assert not dvc_ran(out) and not snakemake_ran(out), f"`{command}` ran stages: {out[-3000:]}"
            ran.append(command)
    # The metrics-only view of `dvc exp show`: one column per headline metric, no params or hashes.
    recipe = sh("make --no-print-directory -n exp-show", clone).strip()
    header = next(csv.reader(io.StringIO(sh(recipe + " --csv", clone))))
    fixed = {"Experiment", "rev", "typ", "Created", "parent", "State", "Executor"}
    metrics = [c for c in header if c not in fixed]
    assert 0 < len(metrics) <= 40 and not [c for c in metrics if c.startswith(("pretrain.", "stages/"))], header
    kept = next(csv.reader(io.StringIO(sh(recipe + " --keep 'pretrain\\.train\\.lr$' --csv", clone))))
    assert "pretrain.train.lr" in kept
    # The eval example with an adapter wrote where it says; then the preset example, undone after.
    assert (clone / "data/eval_perplexity/compare/metrics.json").is_file()
    sh("rm -rf data/eval_perplexity/compare", clone)
    sh("python -m pipelines.preset llama3-8b-qlora", clone)
    assert "meta-llama/Meta-Llama-3-8B" in (clone / "params.yaml").read_text()
    ran.append("python -m pipelines.preset llama3-8b-qlora")
    (clone / "params.yaml").write_text(params)
    assert UP_TO_DATE in sh("dvc status", clone)
    assert len(ran) == sum(how in ("run", "check") for how, _ in readme_commands.HOW.values())


def kill_everything_in(folder: Path) -> int:
    """SIGKILL every process working in folder (the stage's workers run in sessions of their own, so
    a process group does not hold them all): what a lost machine does to a pipeline."""
    killed = 0
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")).is_relative_to(folder):
                os.kill(int(proc.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            pass
    return killed


def set_pretrain(clone: Path, **values) -> None:
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["pretrain"]["train"].update(values)
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def start_and_stop_mid_pretrain(clone: Path, run: str, stop) -> None:
    """Start the pipeline, wait for pretrain's first checkpoint of this run, then stop it with `stop`."""
    checkpoints = clone / "checkpoints" / "pretrain"
    before = set(checkpoints.glob("*/step-*"))
    proc = subprocess.Popen(
        run,
        shell=True,
        cwd=clone,
        env=env_for(clone),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 600
    while not set(checkpoints.glob("*/step-*")) - before:
        assert proc.poll() is None, "the pipeline ended before pretrain wrote a checkpoint"
        assert time.time() < deadline, "no pretrain checkpoint after 600 s"
        time.sleep(0.2)
    stop(proc)
    proc.wait(120)
    assert not (clone / "data/pretrain/meta.json").exists(), "the stop landed after pretrain had finished"


def resumed_step(clone: Path) -> int:
    log = (clone / "logs/pretrain.log").read_text()
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", log)
    assert resumed, log[-3000:]
    return int(resumed.group(1))


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_stopped_pipeline_resumes_from_the_stage_checkpoint(clone):
    """The pipeline stopped mid-pretrain, by Ctrl-C and by a lost machine (every process killed): the
    re-run, with the profile `make run` uses, finishes pretrain from its newest checkpoint."""
    assert "\tsnakemake --profile pipelines/profiles/local --cores all\n" in (ROOT / "Makefile").read_text()
    run = "snakemake --profile pipelines/profiles/local --cores 2 pretrain"

    # Ctrl-C: the terminal signals the foreground process group; pretrain saves a checkpoint and exits,
    # and the re-run resumes from that checkpoint (not only from a periodic one).
    set_pretrain(clone, steps=400, checkpoint_every=20, eval_every=400)
    start_and_stop_mid_pretrain(clone, run, lambda proc: os.killpg(proc.pid, signal.SIGINT))
    log = (clone / "logs/pretrain.log").read_text()
    # (SIGINT, or SIGTERM when Snakemake stops its jobs first: either way a save, never a traceback)
    saved = re.search(r"stopped by SIG(?:INT|TERM) after step (\d+); checkpoint saved", log)
    assert saved and "KeyboardInterrupt" not in log, log[-3000:]
    assert snakemake_ran(sh(run, clone)) == {"pretrain"}
    assert resumed_step(clone) == int(saved.group(1))
    assert json.loads((clone / "data/pretrain/meta.json").read_text())["step"] == 400
    # In MLflow the stopped invocation's parent run ends KILLED, naming the stage; the re-run's FINISHED.
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    parents = client.search_runs(
        [client.get_experiment_by_name("pipeline").experiment_id],
        filter_string="tags.pipeline_role = 'parent'",
        order_by=["attributes.start_time DESC"],
        max_results=2,
    )
    assert [p.info.status for p in parents] == ["FINISHED", "KILLED"], [p.info for p in parents]
    assert parents[1].data.tags["unfinished_stages"] == "pretrain:KILLED"

    # A lost machine: no process survives to clean up. Snakemake keeps its lock until told to drop it.
    set_pretrain(clone, steps=300)
    start_and_stop_mid_pretrain(clone, run, lambda proc: kill_everything_in(clone))
    sh("snakemake --unlock", clone)
    assert snakemake_ran(sh(run, clone)) == {"pretrain"}
    assert resumed_step(clone) >= 20
    assert json.loads((clone / "data/pretrain/meta.json").read_text())["step"] == 300

    # Both tools at once on one stage: the run that trains holds its checkpoint folder, the other stops
    # with a clear error; the first publishes, and afterwards both tools see the stage current.
    set_pretrain(clone, steps=1500)
    checkpoints = clone / "checkpoints" / "pretrain"
    before = set(checkpoints.glob("*/step-*"))
    dvc = subprocess.Popen(
        "dvc repro pretrain",
        shell=True,
        cwd=clone,
        env=env_for(clone),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 600
    while not set(checkpoints.glob("*/step-*")) - before:
        assert dvc.poll() is None and time.time() < deadline, "dvc repro pretrain wrote no checkpoint"
        time.sleep(0.2)
    second = subprocess.run(run, shell=True, cwd=clone, env=env_for(clone), capture_output=True, text=True, timeout=600)
    assert dvc.poll() is None, "the second tool ran while the first still trained"
    assert second.returncode != 0 and "is in use by another run" in (clone / "logs/pretrain.log").read_text()
    out, _ = dvc.communicate(timeout=900)
    assert dvc.returncode == 0, out[-3000:]
    assert json.loads((clone / "data/pretrain/meta.json").read_text())["step"] == 1500
    assert "pretrain" not in sh("dvc status pretrain", clone)
    assert "Nothing to be done" in sh(f"{run} -n", clone)
