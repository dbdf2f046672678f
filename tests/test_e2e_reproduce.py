"""On a copy of the shared ci run (tests/shared_run.py): a sweep point run as a DVC experiment, and what
`dvc metrics show` and `dvc plots show` make of the run; then a forced re-run of an unchanged stage, which
must reproduce the hashes of its outs. tests/test_e2e.py checks that both tools agree on what is current."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import pytest
import yaml
from shared_run import copy_of_run, sh
from test_e2e import FULL, dvc_ran, mlflow_groups

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def clone(tmp_path_factory, mirror) -> Path:
    return copy_of_run(tmp_path_factory.mktemp("reproduce") / "clone")


@pytest.mark.timeout(1800)
def test_an_experiment_is_recorded_and_a_forced_rerun_reproduces_every_out(clone):
    # A sweep point as a DVC experiment: the stages that read the changed section, recorded with its params
    # and metrics.
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

    # A re-run of an unchanged stage reproduces its out's hash: only what it measured (an out DVC does
    # not cache) changes, so only the report, which reads that, is re-run after it, and the report's own
    # out is again the same bytes. `dvc exp show` then marks nothing as changed ("!").
    sh("git add -A && git -c user.name=ci -c user.email=ci@localhost commit -qm run", clone)
    before = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    assert dvc_ran(sh("dvc repro -f -s tokenize", clone)) == {"tokenize"}
    assert dvc_ran(sh("dvc repro", clone)) == {"report"}
    after = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    changed = {
        o["path"]
        for name, entry in after.items()
        for o, old in zip(entry["outs"], before[name]["outs"], strict=True)
        if o["md5"] != old["md5"]
    }
    assert changed == {"measured/tokenize.json", "measured/report.json"}, changed
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)
    assert "!" not in sh("dvc exp show --csv", clone)

    # One MLflow group per invocation that ran stages: the shared run's, then dvc exp run, the forced
    # tokenize and the report after it.
    groups = mlflow_groups(clone)
    assert sorted(map(str, groups.values())) == sorted(
        map(str, [FULL, ["context_study", "report"], ["tokenize"], ["report"]])
    )
    assert sum(k.startswith("smk-") for k in groups) == 1 and sum(k.startswith("dvc-") for k in groups) == 3
