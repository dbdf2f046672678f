"""The comparison of a sweep's points: the best point by the metric and goal, the table in the sweep's
order, the plot, the DVC metrics, the MLflow run, and each refusal before anything is written."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from conftest import TRACKED, run_stage

from stages import sweep_compare
from stages.common import config


def sweep_tree(root, grid, values, metric="final_val_loss", goal="min", name="lr"):
    """params.yaml declaring sweep `name` of pretrain, and each point's folder with its metrics.json
    ({point: metric value}; a dotted metric is written nested)."""
    entry = {"stage": "pretrain", "grid": grid, "metric": metric, "goal": goal}
    (root / "params.yaml").write_text(
        yaml.safe_dump({"pretrain": {"seed": 0}, "sweeps": {name: entry}}, sort_keys=False)
    )
    for point, value in values.items():
        folder = root / "data/sweeps" / name / point
        folder.mkdir(parents=True)
        doc = {"final_train_loss": 9.0}
        *parents, last = metric.split(".")
        here = doc
        for part in parents:
            here = here.setdefault(part, {})
        here[last] = value
        (folder / "metrics.json").write_text(json.dumps(doc))
    return [f"{p}=data/sweeps/{name}/{p}" for p in values]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("PIPELINE_RUN_ID", raising=False)
    return tmp_path


LR = {"train.lr": [0.0001, 0.001, 0.003, 0.01]}


def test_min_picks_the_lowest_first_of_a_tie_never_nan_and_writes_table_metrics_and_plot(tree, capsys):
    points = sweep_tree(tree, LR, {"0.0001": math.nan, "0.001": 4.5, "0.003": 4.21, "0.01": 4.21})
    result = sweep_compare.main(["--sweep", "lr", "--points", *points, "--output", "data/sweeps/lr/compare"])
    out = tree / "data/sweeps/lr/compare"
    assert result["best"] == "0.003"
    assert [r["point"] for r in result["rows"]] == ["0.0001", "0.001", "0.003", "0.01"]
    assert [r["best"] for r in result["rows"]] == [False, False, True, False]
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "sweep_compare: lr: best 0.003 (final_val_loss 4.21, min) of 4 points -> data/sweeps/lr/compare/table.md"
    )
    table = (out / "table.md").read_text().splitlines()
    assert table[0] == "# Sweep lr: pretrain, final_val_loss (min is best)"
    assert table[2] == "| point | train.lr | final_val_loss | best |"
    assert table[4:8] == [
        "| 0.0001 | 0.0001 | nan |  |",
        "| 0.001 | 0.001 | 4.5 |  |",
        "| 0.003 | 0.003 | 4.21 | best |",
        "| 0.01 | 0.01 | 4.21 |  |",
    ]
    assert table[8:] == [
        "",
        "In MLflow: each point's run under the sweep's parent run `pipeline sweep-lr` (tag `pipeline_run = sweep-lr`);"
        " `make mlflow-ui` prints its page and the compare view of the points.",
    ]
    csv = (out / "table.csv").read_text().splitlines()
    assert csv == [
        "point,train.lr,final_val_loss",
        "0.0001,0.0001,nan",
        "0.001,0.001,4.5",
        "0.003,0.003,4.21",
        "0.01,0.01,4.21",
    ]
    assert json.loads((out / "metrics.json").read_text()) == {
        "best_point": "0.003",
        "final_val_loss": 4.21,
        "points": 4,
    }
    figures = json.loads((out / "figures.json").read_text())
    assert figures["best"] == "0.003" and figures["goal"] == "min"
    assert figures["points"]["0.001"] == {"values": {"train.lr": 0.001}, "metric": 4.5}
    assert math.isnan(figures["points"]["0.0001"]["metric"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sweep"] == "lr" and len(meta["code_sha256"]) == 64 and "lock_sha256" in meta["environment"]
    assert result["plot"] == {"x_scale": "log", "lines": ["final_val_loss"]}  # (lr spans a factor 100)
    import matplotlib.image

    assert matplotlib.image.imread(out / "plots/final_val_loss.png").shape[2] in (3, 4)


def test_without_points_given_a_point_an_earlier_sweep_shares_is_read_from_its_folder(tree):
    """A later sweep's point at which pretrain runs as at an earlier sweep's point is that sweep's: its folder
    is read, and the table says which stage ran it."""
    sweep_tree(tree, {"train.lr": [0.001, 0.003]}, {"0.001": 4.5, "0.003": 4.25})
    params = yaml.safe_load((tree / "params.yaml").read_text())
    params["sweeps"]["again"] = {**params["sweeps"]["lr"], "grid": {"train.lr": [3.0e-3, 0.03]}}
    (tree / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (tree / "data/sweeps/again/0.03").mkdir(parents=True)
    (tree / "data/sweeps/again/0.03/metrics.json").write_text(json.dumps({"final_val_loss": 4.75}))
    result = sweep_compare.main(["--sweep", "again"])
    assert [(r["point"], r["metric"], r["stage"]) for r in result["rows"]] == [
        ("0.003", 4.25, "sweep_lr@0.003"),
        ("0.03", 4.75, "sweep_again@0.03"),
    ]
    table = (tree / "data/sweeps/again/compare/table.md").read_text()
    assert "\nRun for an earlier sweep of pretrain and read from there: 0.003 by sweep_lr@0.003.\n" in table


def test_max_picks_the_highest_of_a_nested_metric(tree):
    points = sweep_tree(tree, LR, {"0.0001": 0.5, "0.001": 0.7, "0.003": math.nan, "0.01": 0.6}, "eval.acc", "max")
    result = sweep_compare.main(["--sweep", "lr", "--points", *points, "--output", "compare"])
    assert result["best"] == "0.001"
    metrics = json.loads((tree / "compare/metrics.json").read_text())
    assert metrics == {"best_point": "0.001", "eval.acc": 0.7, "points": 4}
    assert (tree / "compare/plots/eval.acc.png").is_file()


def test_every_point_nan_has_no_best(tree, capsys):
    points = sweep_tree(tree, {"train.lr": [0.001, 0.003]}, {"0.001": math.nan, "0.003": math.nan})
    result = sweep_compare.main(["--sweep", "lr", "--points", *points, "--output", "compare"])
    assert result["best"] is None and not any(r["best"] for r in result["rows"])
    assert "lr: no best (every final_val_loss is nan) of 2 points" in capsys.readouterr().out
    assert json.loads((tree / "compare/metrics.json").read_text())["best_point"] is None


def test_a_two_key_grid_has_both_columns_and_one_line_per_value_of_the_second_key(tree):
    grid = {"train.lr": [0.001, 0.01], "train.batch_size": [8, 16, 32]}
    values = {"0.001-8": 5.0, "0.001-16": 4.8, "0.001-32": 4.9, "0.01-8": 4.7, "0.01-16": 4.4, "0.01-32": 4.6}
    sweep_tree(tree, grid, values)
    result = sweep_compare.main(["--sweep", "lr"])  # (every point at data/sweeps/lr/<point>, the default)
    out = tree / "data/sweeps/lr/compare"
    assert result["best"] == "0.01-16"
    assert [r["point"] for r in result["rows"]] == list(values)
    table = (out / "table.md").read_text().splitlines()
    assert table[2] == "| point | train.lr | train.batch_size | final_val_loss | best |"
    assert table[4] == "| 0.001-8 | 0.001 | 8 | 5 |  |" and table[8] == "| 0.01-16 | 0.01 | 16 | 4.4 | best |"
    assert (out / "table.csv").read_text().splitlines()[0] == "point,train.lr,train.batch_size,final_val_loss"
    lines = ["train.batch_size=8", "train.batch_size=16", "train.batch_size=32"]
    assert result["plot"] == {"x_scale": "linear", "lines": lines}  # (lr spans a factor 10)
    assert (out / "plots/final_val_loss.png").is_file()


def refusal_cases():
    good = ["0.001=data/sweeps/lr/0.001", "0.003=data/sweeps/lr/0.003"]
    return [
        (["--sweep", "wd", "--points", *good], "params.yaml: sweeps has no sweep 'wd' (declared: lr)"),
        (["--sweep", "lr", "--points", *good, "0.1=data/x"], "names point 0.1, which sweep lr does not have"),
        (["--sweep", "lr", "--points", good[0]], "misses point 0.003 of sweep lr; pass every point: 0.001, 0.003"),
        (["--sweep", "lr", "--points", good[0], "0.003=data/gone"], "data/gone/metrics.json not found"),
    ]


@pytest.mark.parametrize("args, message", refusal_cases())
def test_each_refusal_is_one_line_and_writes_nothing(tree, args, message):
    sweep_tree(tree, {"train.lr": [0.001, 0.003]}, {"0.001": 4.0, "0.003": 3.9})
    with pytest.raises(config.UserError, match=r"^[^\n]+$") as refused:
        sweep_compare.main([*args, "--output", "compare"])
    assert message in str(refused.value)
    assert sorted(p.name for p in tree.iterdir()) == ["data", "params.yaml"]


def test_a_metric_the_points_lack_is_refused_naming_the_keys_they_have(tree):
    points = sweep_tree(tree, {"train.lr": [0.001]}, {"0.001": 4.0}, metric="val.loss")
    entry = yaml.safe_load((tree / "params.yaml").read_text())
    entry["sweeps"]["lr"]["metric"] = "val_loss"
    (tree / "params.yaml").write_text(yaml.safe_dump(entry, sort_keys=False))
    with pytest.raises(config.UserError) as refused:
        sweep_compare.main(["--sweep", "lr", "--points", *points, "--output", "compare"])
    assert str(refused.value) == (
        "sweep_compare: data/sweeps/lr/0.001/metrics.json has no val_loss (sweeps.lr.metric); "
        "its keys: final_train_loss, val.loss"
    )
    assert not (tree / "compare").exists()


def test_the_run_logs_the_declaration_each_point_and_the_best(tree, monkeypatch):
    import mlflow

    monkeypatch.setenv("PIPELINE_TRACKING", TRACKED["PIPELINE_TRACKING"])
    points = sweep_tree(tree, {"train.lr": [0.001, 0.003]}, {"0.001": 4.5, "0.003": 4.2})
    sweep_compare.main(["--sweep", "lr", "--points", *points, "--output", "compare"])
    client = mlflow.MlflowClient(f"sqlite:///{tree / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("pipeline").experiment_id], "tags.stage = 'sweep_compare'"
    )
    assert run.info.status == "FINISHED" and run.data.tags["sweep"] == "lr"
    assert run.data.params == {
        "name": "lr",
        "stage": "pretrain",
        "metric": "final_val_loss",
        "goal": "min",
        "grid": "train.lr: 0.001, 0.003",
    }
    assert run.data.metrics == {"0.001.final_val_loss": 4.5, "0.003.final_val_loss": 4.2, "best.final_val_loss": 4.2}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"table.md", "plots"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/final_val_loss.png"]


def test_it_runs_as_a_module(tmp_path):
    points = sweep_tree(tmp_path, {"train.lr": [0.001, 0.003]}, {"0.001": 4.5, "0.003": 4.2})
    proc = run_stage("sweep_compare", ["--sweep", "lr", "--points", *points, "--output", "compare"], tmp_path)
    assert proc.stdout.strip().endswith("best 0.003 (final_val_loss 4.2, min) of 2 points -> compare/table.md")
    refused = run_stage("sweep_compare", ["--sweep", "wd", "--output", "other"], tmp_path, check=False)
    assert refused.returncode == 2 and refused.stderr.startswith("error: params.yaml: sweeps has no sweep 'wd'")
    assert not (tmp_path / "other").exists()
