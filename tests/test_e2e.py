"""The real DAG on the ci preset, through `snakemake` and `dvc repro`, in a copy of the ci run shared by
the tests (tests/shared_run.py: `snakemake --profile pipelines/profiles/local` in a fresh clone).

Both tools must agree on what is current: re-running either with nothing changed runs nothing; a params
change re-runs the stage and what follows (one of them as a DVC experiment, which `dvc exp show`, `dvc
metrics show` and `dvc plots show` then display); a deleted output re-runs only its stage and dependents;
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
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from shared_run import copy_of_run, env_for, sh, snakemake_output

pytestmark = pytest.mark.e2e
UP_TO_DATE = "Data and pipelines are up to date."
# What a change to tokenize re-runs (Snakemake rule names).
DOWNSTREAM = {
    "tokenize",
    "pretrain",
    "extend_context",
    "finetune_qlora",
    "eval_perplexity",
    "eval_harness",
    "context_study",
    "memory_study",
    "report",
}
# The stages of a whole run, as MLflow groups them (eval_perplexity, eval_harness and finetune_qlora run twice:
# two items).
FULL = sorted(["prepare_data", "train_gnn", "eval_perplexity", "eval_harness", "finetune_qlora", *DOWNSTREAM])


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
    """A private copy of the ci run shared by the tests (tests/shared_run.py): a fresh git repository of
    the working tree with the ci preset, in which `snakemake --profile pipelines/profiles/local` ran."""
    return copy_of_run(tmp_path_factory.mktemp("e2e") / "clone")


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


@pytest.mark.timeout(3600)  # the shared run (the whole DAG on 2 cores), then re-runs near its end
def test_snakemake_and_dvc_agree_on_what_is_current(clone):
    assert snakemake_ran(snakemake_output()) == {"prepare_data", *DOWNSTREAM, "train_gnn"}
    assert UP_TO_DATE in sh("dvc status", clone), "snakemake commits every stage to dvc.lock"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    names = {r.info.run_name for r in client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])}
    items = {"eval_perplexity@pretrain", "eval_perplexity@extend_context", "finetune_qlora@nf4", "finetune_qlora@none"}
    items |= {"eval_harness@pretrain", "eval_harness@extend_context"}
    assert items | {"pretrain", "report"} <= names, "stage runs are named with their item"
    results = (clone / "reports/results.md").read_text()
    assert "| result | paper | relation | published | ours | tolerance | pass | stage | data_hashes |" in results
    # What the stages measured is beside their outs, declared to both tools, and read by the report.
    measured = {f"measured/{n}.json" for n in ("tokenize", "pretrain", "extend_context", "train_gnn", "report")}
    measured |= {f"measured/{n}.json" for n in ("finetune_qlora/nf4", "eval_perplexity/pretrain")}
    assert all((clone / m).is_file() for m in measured | {"measured/memory_study.png"})
    assert json.loads((clone / "measured/pretrain.json").read_text())["tokens_per_s"] > 0
    assert "`measured/report.json`" in results and "tokens_per_s" not in results
    assert "### tokenize" in results and (clone / "reports/results.json").is_file()
    assert (
        "| GCN test accuracy on Cora (%), mean of 2 seeds | Kipf & Welling 2017 (GCN), Table 2 | = | 81.5 (n=100) |"
        in results
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
    # A real re-run through DVC, on a stage near the end of the DAG (the chain after tokenize takes minutes):
    # a sweep point as a DVC experiment, which sets the param in params.yaml and re-runs the stages that
    # read the changed section; recorded with its params and metrics.
    out = sh("dvc exp run -S context_study.unscaled_growth=1.3 -n growth-1.3", clone)
    assert dvc_ran(out) == {"context_study", "report"}
    assert "\n  unscaled_growth: 1.3" in (clone / "params.yaml").read_text()
    check_experiment_views(clone)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone), "dvc repro results count for snakemake"
    # A second params change after `dvc repro` (which leaves Snakemake no records of those stages): Snakemake
    # still sees it, through DVC, and would re-run the same stages DVC would.
    set_growth(clone, 1.4)
    assert "context_study" in sh("dvc status", clone)
    assert snakemake_ran(sh("snakemake --cores 2 -n", clone)) == {"context_study", "report"}
    set_growth(clone, 1.3)  # back to what dvc repro ran: its run is in DVC's run cache (used below)
    # A deleted output re-runs its stage and its dependents only (a plan: tests/test_e2e_records.py re-runs
    # the same two stages for real after an edit in place, and checks they are committed).
    sh("rm -rf data/context_study", clone)
    assert snakemake_ran(sh("snakemake --cores 2 -n", clone)) == {"context_study", "report"}
    assert "context_study" in sh("dvc status", clone)
    out = sh("dvc repro", clone)
    # DVC restores the deleted output from its run cache rather than recomputing identical work.
    assert "Stage 'context_study' is cached - skipping run, checking out outputs" in out
    assert "Stage 'extend_context' didn't change, skipping" in out and (clone / "data/context_study/study.md").is_file()
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)

    # Restoring from DVC's cache makes an upstream folder newer than its dependents; still current.
    sh("rm -rf data/prepare_data && dvc checkout", clone)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)
    assert UP_TO_DATE in sh("dvc status", clone)

    # One MLflow group per invocation that ran stages: the shared run's (snakemake), one from DVC.
    groups = mlflow_groups(clone)
    by_tool = {tool: sorted(str(v) for k, v in groups.items() if k.startswith(tool)) for tool in ("smk-", "dvc-")}
    study = ["context_study", "report"]
    assert by_tool["smk-"] == [str(FULL)]
    assert by_tool["dvc-"] == [str(study)]  # dvc exp run (dvc repro restored its output from the run cache)
    assert len(groups) == 2


def check_experiment_views(clone: Path) -> None:
    """What `dvc exp show`, `dvc metrics show` and `dvc plots show` make of the run and its experiment
    growth-1.3 (DVC's views of the records; tests/test_e2e_reproduce.py re-runs a stage unchanged)."""
    table = csv.DictReader(io.StringIO(sh("dvc exp show --csv", clone)))
    assert next(r for r in table if r["Experiment"] == "growth-1.3")["context_study.unscaled_growth"] == "1.3"
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


def working_in(folder: Path) -> list[int]:
    """Every process working in folder (the stage's workers run in sessions of their own, so a process
    group does not hold them all)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")).is_relative_to(folder):
                found.append(int(proc.name))
        except (OSError, ValueError):
            pass
    return found


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def kill_everything_in(folder: Path) -> None:
    """SIGKILL every process working in folder: what a lost machine does to a pipeline."""
    signal_all(working_in(folder), signal.SIGKILL)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def snakemake_main(pid: int) -> int:
    """Snakemake's main process: `pid` (the shell a test started) or its child running Snakemake."""
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and parent_of(int(p.name)) == pid]
    for proc in [pid, *children]:
        # (.venv/bin/snakemake runs as: python .venv/bin/snakemake ...)
        if any(Path(word.decode(errors="replace")).name == "snakemake" for word in cmdline(proc).split(b"\0")[:2]):
            return proc
    raise AssertionError(f"no Snakemake process at or below pid {pid}")


def wait_until_nothing_works_in(folder: Path, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while working_in(folder):
        assert time.time() < deadline, f"processes still work in {folder} after {timeout_s} s: {working_in(folder)}"
        time.sleep(0.2)


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
    assert "snakemake --profile pipelines/profiles/local --cores all ||" in (ROOT / "Makefile").read_text()
    run = "snakemake --profile pipelines/profiles/local --cores 2 pretrain"

    # Ctrl-C: the terminal signals the foreground process group; pretrain saves a checkpoint and exits,
    # and the re-run resumes from that checkpoint (not only from a periodic one).
    # (steps: enough that the stop, sent once the first checkpoint is on disk, lands while pretrain trains)
    set_pretrain(clone, steps=120, checkpoint_every=20, eval_every=120)
    start_and_stop_mid_pretrain(clone, run, lambda proc: os.killpg(proc.pid, signal.SIGINT))
    log = (clone / "logs/pretrain.log").read_text()
    # (SIGINT, or SIGTERM when Snakemake stops its jobs first: either way a save, never a traceback)
    saved = re.search(r"stopped by SIG(?:INT|TERM) after step (\d+); checkpoint saved", log)
    assert saved and "KeyboardInterrupt" not in log, log[-3000:]
    assert snakemake_ran(sh(run, clone)) == {"pretrain"}
    assert resumed_step(clone) == int(saved.group(1))
    assert json.loads((clone / "data/pretrain/meta.json").read_text())["step"] == 120
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

    # A lost machine: no process survives to clean up. The next run removes the lock Snakemake left.
    set_pretrain(clone, steps=100)
    start_and_stop_mid_pretrain(clone, run, lambda proc: kill_everything_in(clone))
    out = sh(run, clone)
    assert snakemake_ran(out) == {"pretrain"} and "removed the locks of a Snakemake that ended" in out
    assert resumed_step(clone) >= 20
    assert json.loads((clone / "data/pretrain/meta.json").read_text())["step"] == 100

    # Snakemake's main process killed alone (SIGKILL: it cannot stop its jobs). The stage notices within
    # seconds, saves a checkpoint and ends: nothing is published or committed for the dead run, whose
    # MLflow parent ends KILLED, and the next run resumes without `snakemake --unlock`.
    set_pretrain(clone, steps=110)
    lock = (clone / "dvc.lock").read_bytes()
    start_and_stop_mid_pretrain(clone, run, lambda proc: os.kill(snakemake_main(proc.pid), signal.SIGKILL))
    wait_until_nothing_works_in(clone, 60)
    log = (clone / "logs/pretrain.log").read_text()
    saved = re.search(r"stopped by SIGTERM after step (\d+); checkpoint saved", log)
    assert saved and "launch: Snakemake (pid" in log, log[-3000:]
    assert not (clone / "data/pretrain").exists() and (clone / "dvc.lock").read_bytes() == lock
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("pipeline").experiment_id],
        filter_string="tags.pipeline_role = 'parent'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    assert parent.info.status == "KILLED" and parent.data.tags["unfinished_stages"] == "pretrain:KILLED"
    # Killed again once pretrain has ended, while its `dvc commit` runs: the commit completes, and the
    # output DVC now records stays current for Snakemake too (not re-made for its incomplete mark).
    commit = subprocess.Popen(
        run, shell=True, cwd=clone, env=env_for(clone), start_new_session=True, stdout=subprocess.DEVNULL
    )
    deadline = time.time() + 600
    while not any(b"pipelines.commit\0pretrain" in cmdline(pid) for pid in working_in(clone)):
        assert commit.poll() is None and time.time() < deadline, "pretrain's commit never started"
        time.sleep(0.05)
    os.kill(snakemake_main(commit.pid), signal.SIGKILL)
    commit.wait(60)
    wait_until_nothing_works_in(clone, 60)
    assert resumed_step(clone) == int(saved.group(1))
    assert json.loads((clone / "data/pretrain/meta.json").read_text())["step"] == 110
    assert "pretrain" not in sh("dvc status pretrain", clone)
    assert "Nothing to be done" in sh(run, clone)

    # Both tools at once on one stage: the run that trains holds its checkpoint folder, the other stops
    # with a clear error; the first publishes, and afterwards both tools see the stage current. The first
    # is paused (SIGSTOP, every process of it) while the second runs: mid-training whatever the machine's
    # speed, its lock held as by a run that trains.
    set_pretrain(clone, steps=140)
    checkpoints = clone / "checkpoints" / "pretrain"
    before = set(checkpoints.glob("*/step-*"))
    others = set(working_in(clone))
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
    first = [pid for pid in working_in(clone) if pid not in others]
    signal_all(first, signal.SIGSTOP)
    try:
        second = subprocess.run(
            run, shell=True, cwd=clone, env=env_for(clone), capture_output=True, text=True, timeout=600
        )
    finally:
        signal_all(first, signal.SIGCONT)
    assert dvc.poll() is None, "the second tool ran while the first still trained"
    assert second.returncode != 0 and "is in use by another run" in (clone / "logs/pretrain.log").read_text()
    out, _ = dvc.communicate(timeout=900)
    assert dvc.returncode == 0, out[-3000:]
    assert json.loads((clone / "data/pretrain/meta.json").read_text())["step"] == 140
    assert "pretrain" not in sh("dvc status pretrain", clone)
    assert "Nothing to be done" in sh(f"{run} -n", clone)
