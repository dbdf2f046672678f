"""Sweeps (stages.common.sweep, pipelines/dag.py): a grid of a stage's params declared once in params.yaml,
run as one stage per point by both tools, each point with its own output folder and dvc.lock record, and
compared by stages.sweep_compare. On copies of the shared ci run: three points of pretrain's learning rate
under Snakemake and under `dvc repro` give the same outputs; a fourth point runs alone under both; the
points' MLflow runs nest under one parent run of the sweep."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from shared_run import copy_of_run, sh
from test_e2e import snakemake_ran

from pipelines import dag
from stages.common import registry, sweep
from stages.common.config import ConfigError

LR = {"stage": "pretrain", "grid": {"train.lr": [1.0e-3, 3.0e-3, 1.0e-2]}, "metric": "final_val_loss", "goal": "min"}


def test_points_are_named_and_ordered_as_dvc_names_a_matrix():
    grid = {"train.lr": [1.0e-3, 3e-4], "train.warmup_steps": [2, 4], "model.tie": [True]}
    sw = sweep.load({"sweeps": {"two": {**LR, "grid": grid}}})["two"]
    assert list(sw.points()) == ["0.001-2-true", "0.001-4-true", "0.0003-2-true", "0.0003-4-true"]
    assert sw.points()["0.0003-4-true"] == {"train.lr": 3e-4, "train.warmup_steps": 4, "model.tie": True}
    assert sw.aliases() == {"train.lr": "lr", "train.warmup_steps": "warmup_steps", "model.tie": "tie"}
    clash = sweep.load({"sweeps": {"c": {**LR, "grid": {"train.lr": [1], "optim.lr": [2]}}}})["c"]
    assert clash.aliases() == {"train.lr": "train_lr", "optim.lr": "optim_lr"}


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({**LR, "stage": "report"}, "sweeps.lr.stage: 'report' is not a stage that runs once"),
        ({**LR, "grid": {"train.lr": []}}, "sweeps.lr.grid.train.lr: a non-empty list"),
        ({**LR, "grid": {"pretrain.train.lr": [1]}}, "name the key inside the pretrain section"),
        ({**LR, "grid": {"train.lr": [1, 1.0]}}, "repeat one"),
        ({**LR, "grid": {"train.lr": ["a b"]}}, "a value is a number"),
        ({**LR, "goal": "lowest"}, "sweeps.lr.goal: 'lowest'; valid: min, max"),
        ({k: v for k, v in LR.items() if k != "metric"}, "give exactly stage, grid, metric and goal"),
    ],
)
def test_a_bad_declaration_is_one_error_naming_the_key(entry, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        sweep.load({"sweeps": {"lr": entry}}, {"pretrain", "train_gnn"})


def test_the_table_makes_a_stage_per_point_and_a_comparison(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(with_sweeps((dag.ROOT / "params.yaml").read_text(), {"lr": LR}))
    stages = dag.load_table(params=params)
    points, compare = stages["sweep_lr"], stages["sweep_lr_compare"]
    assert points.instances() == [(f"sweep_lr@{p}", p) for p in ("0.001", "0.003", "0.01")]
    assert points.runs() == "pretrain" and points.deps == stages["pretrain"].deps
    assert points.command("0.003").endswith(
        "--output data/sweeps/lr/0.003 --measured measured/sweep_lr/0.003.json train.lr=0.003"
    )
    assert compare.runs() == "sweep_compare" and compare.params == ("sweeps.lr",)
    assert [d for d in compare.deps if d.startswith("data/")] == [
        f"data/sweeps/lr/{p}" for p in ("0.001", "0.003", "0.01")
    ]
    # the report collects the pipeline, not the sweeps; the sweep leaves the pipeline's own stages as they were
    assert not any("sweeps" in d for d in stages["report"].deps)
    assert {n: s for n, s in stages.items() if not s.sweep} == dag.load_table()
    stage = dag.render_dvc(stages)
    assert "matrix:" in stage and "train.lr=${item.lr}" in stage and "data/sweeps/lr/${key}" in stage


def with_sweeps(params: str, sweeps: dict) -> str:
    """params.yaml's text with its sweeps section (the last, with its comments) replaced by `sweeps`."""
    return params.split("\nsweeps:")[0] + "\n" + yaml.safe_dump({"sweeps": sweeps})


def planned_points(out: str) -> set[str]:
    return set(re.findall(r"Running stage '(sweep_lr@[^']+)'", out))


def declare(clone: Path, values: list[float]) -> None:
    params = clone / "params.yaml"
    params.write_text(with_sweeps(params.read_text(), {"lr": {**LR, "grid": {"train.lr": values}}}))
    sh("python -m pipelines.dag write", clone)


def lock_md5s(clone: Path) -> dict[str, str]:
    stages = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    return {name: entry["outs"][0]["md5"] for name, entry in stages.items() if name.startswith("sweep_lr")}


@pytest.mark.long
@pytest.mark.timeout(1500)
def test_a_sweep_runs_alike_under_both_tools_and_a_new_point_runs_alone(tmp_path):
    smk, dvc = copy_of_run(tmp_path / "smk"), copy_of_run(tmp_path / "dvc")
    for clone in (smk, dvc):
        declare(clone, LR["grid"]["train.lr"])
        assert "define the same stages" in sh("python -m pipelines.dag check", clone)
    out = sh("snakemake --profile pipelines/profiles/local", smk)
    assert snakemake_ran(out) == {"sweep_lr", "sweep_lr_compare"}, out[-3000:]
    out = sh("dvc repro", dvc)
    assert planned_points(out) == {"sweep_lr@0.001", "sweep_lr@0.003", "sweep_lr@0.01"}, out[-3000:]
    # one record per point and the comparison, the same bytes under both tools
    assert lock_md5s(smk) == lock_md5s(dvc) and len(lock_md5s(smk)) == 4
    for clone in (smk, dvc):
        assert "Data and pipelines are up to date." in sh("dvc status", clone)
        assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)
    losses = {
        p: json.loads((smk / f"data/sweeps/lr/{p}/metrics.json").read_text())["final_val_loss"]
        for p in ("0.001", "0.003", "0.01")
    }
    assert len(set(losses.values())) == 3, "each point trained with its own learning rate"
    best = json.loads((smk / "data/sweeps/lr/compare/metrics.json").read_text())
    assert best["best_point"] == min(losses, key=losses.get), best

    # a fourth point: only it (and the comparison) runs, under both tools
    before = lock_md5s(smk)
    for clone in (smk, dvc):
        declare(clone, [*LR["grid"]["train.lr"], 3.0e-2])
    out = sh("snakemake --profile pipelines/profiles/local", smk)
    assert snakemake_ran(out) == {"sweep_lr", "sweep_lr_compare"}
    assert re.findall(r"wildcards: item=(\S+)", out) == ["0.03"], out[-3000:]
    assert planned_points(sh("dvc repro", dvc)) == {"sweep_lr@0.03"}
    after = lock_md5s(smk)
    assert {k: v for k, v in after.items() if k in before and k != "sweep_lr_compare"} == {
        k: v for k, v in before.items() if k != "sweep_lr_compare"
    }
    assert after == lock_md5s(dvc) and "sweep_lr@0.03" in after

    # every point's MLflow run nests under the sweep's one parent, its learning rate a param
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{smk / 'mlflow.db'}")
    exp = client.get_experiment_by_name("pipeline").experiment_id
    (parent,) = client.search_runs([exp], "tags.pipeline_run = 'sweep-lr' and tags.pipeline_role = 'parent'")
    runs = client.search_runs([exp], max_results=1000)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    points = {r.info.run_name: r for r in children if r.data.tags.get("stage") == "pretrain"}
    assert sorted(points) == ["sweep_lr@0.001", "sweep_lr@0.003", "sweep_lr@0.01", "sweep_lr@0.03"]
    for name, run in points.items():  # the point's values as params (the stage's section) and as tags
        value = name.partition("@")[2]
        assert run.data.params["train.lr"] == run.data.tags["sweep.train.lr"] == value, run.data.tags
        assert run.data.tags["sweep"] == "lr" and run.data.tags["sweep.point"] == value
    assert all(r.info.status == "FINISHED" for r in children) and len(children) == 6, "4 points, 2 comparisons"
    # each point's model is a model of its own, and the sweep's models rank by their validation loss
    ranked = client.search_logged_models(
        experiment_ids=[exp],
        filter_string="name LIKE 'sweep_lr-%'",
        order_by=[{"field_name": "metrics.val_loss", "ascending": True}],
    )
    best = json.loads((smk / "data/sweeps/lr/compare/metrics.json").read_text())["best_point"]
    assert [m.name for m in ranked][0] == registry.model_name("sweep_lr", best) == f"sweep_lr-{best.replace('.', '_')}"
    assert len(ranked) == 4, [m.name for m in ranked]
    registered = {m.name for m in client.search_registered_models()}
    assert registered >= {registry.model_name("sweep_lr", p.partition("@")[2]) for p in points}
    assert "every link holds" in sh("python -m pipelines.verify", smk)


def test_a_point_whose_values_the_stage_refuses_stops_both_tools_before_any_job(tmp_path):
    params = tmp_path / "params.yaml"
    bad = {**LR, "grid": {"train.lr": [0.001, "fast"]}}
    params.write_text(with_sweeps((dag.ROOT / "params.yaml").read_text(), {"lr": bad}))
    with pytest.raises(ConfigError, match=r"sweeps\.lr \(train\.lr=fast\): .*pretrain\.train\.lr"):
        dag.check_params(params)


def test_a_bad_declaration_stops_make_dag_and_snakemake_in_one_line(tmp_path):
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=dag.ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    params = tmp_path / "params.yaml"
    params.write_text(with_sweeps(params.read_text(), {"lr": {**LR, "grid": {"train.lr": [0.001, 0.001]}}}))
    says = "sweeps.lr.grid.train.lr: the values ['0.001', '0.001'] repeat one"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    write = subprocess.run(
        [sys.executable, "-m", "pipelines.dag", "write"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert write.returncode == 2 and write.stderr.strip().endswith(says) and len(write.stderr.splitlines()) == 1
    plan = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    out = plan.stdout + plan.stderr
    assert plan.returncode != 0 and "WorkflowError" in out and says in out, out[-2000:]
