"""Sweeps (stages.common.sweep, pipelines/dag.py): a grid of a stage's params declared once in params.yaml,
run as one stage per point by both tools, each point with its own output folder and dvc.lock record, and
compared by stages.sweep_compare. On copies of the shared ci run: three points of pretrain's learning rate
under Snakemake and under `dvc repro` give the same outputs; a fourth point runs alone under both; a point
that diverges fails alone (the others published, its MLflow run FAILED with the cause, `pipelines.sweep`
naming it); a sweep killed with SIGKILL resumes only its unfinished point; the points' MLflow runs nest
under one parent run of the sweep."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml
from browser import answers, chromium, render, visible_text
from conftest import free_port, running_server
from kill_fuzz import kill_all
from shared_run import BIN, ROOT, copy_of_run, env_for, sh
from test_e2e import snakemake_ran

from pipelines import dag
from stages.common import registry, sweep
from stages.common.config import ConfigError

ARTIFACTS = ROOT / "tests" / "system" / "artifacts"
LR = {"stage": "pretrain", "grid": {"train.lr": [1.0e-3, 3.0e-3, 1.0e-2]}, "metric": "final_val_loss", "goal": "min"}


def without(entry: dict, key: str) -> dict:
    return {k: v for k, v in entry.items() if k != key}


def test_points_are_named_by_their_values_in_grid_or_list_order():
    grid = {"train.lr": [1.0e-3, 3e-4], "train.warmup_steps": [2, 4], "model.tie": [True]}
    sw = sweep.load({"sweeps": {"two": {**LR, "grid": grid}}})["two"]
    assert list(sw.points()) == ["0.001-2-true", "0.001-4-true", "0.0003-2-true", "0.0003-4-true"]
    assert sw.points()["0.0003-4-true"] == {"train.lr": 3e-4, "train.warmup_steps": 4, "model.tie": True}
    assert sw.aliases() == {"train.lr": "lr", "train.warmup_steps": "warmup_steps", "model.tie": "tie"}
    clash = sweep.load({"sweeps": {"c": {**LR, "grid": {"train.lr": [1], "optim.lr": [2]}}}})["c"]
    assert clash.aliases() == {"train.lr": "train_lr", "optim.lr": "optim_lr"}
    listed = [{"train.lr": 3e-3, "train.warmup_steps": 8}, {"train.warmup_steps": 2, "train.lr": 1e-3}]
    sw = sweep.load({"sweeps": {"w": {**without(LR, "grid"), "points": listed}}})["w"]
    assert sw.points() == {
        "0.003-8": {"train.lr": 3e-3, "train.warmup_steps": 8},
        "0.001-2": {"train.lr": 1e-3, "train.warmup_steps": 2},
    }
    assert sw.grid == (("train.lr", (3e-3, 1e-3)), ("train.warmup_steps", (8, 2)))


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({**LR, "stage": "report"}, "sweeps.lr.stage: 'report' is not a stage that runs once"),
        ({**LR, "grid": {"train.lr": []}}, "sweeps.lr.grid.train.lr: a non-empty list"),
        ({**LR, "grid": {"pretrain.train.lr": [1]}}, "name the key inside the pretrain section"),
        ({**LR, "grid": {"train.lr": [1, 1.0]}}, "repeat one"),
        ({**LR, "grid": {"train.lr": ["a b"]}}, "a value is a number"),
        ({**LR, "goal": "lowest"}, "sweeps.lr.goal: 'lowest'; valid: min, max"),
        (without(LR, "metric"), "give stage, metric, goal and one of grid or points"),
        ({**LR, "points": [{"train.lr": 1}]}, "give stage, metric, goal and one of grid or points"),
        ({**without(LR, "grid"), "points": []}, "sweeps.lr.points: a non-empty list of points"),
        ({**without(LR, "grid"), "points": [{"train.lr": 1}, {"train.lr": 2, "train.seed": 1}]}, "points[1]: the keys"),
        ({**without(LR, "grid"), "points": [{"train.lr": 1}, {"train.lr": 1.0}]}, "points[1]: the same point as"),
        ({**without(LR, "grid"), "points": [{"train.lr": 1}, {"train.lr": "1"}]}, "points[1]: the same point as"),
        ({**without(LR, "grid"), "points": [{"train.lr": "a b"}]}, "sweeps.lr.points[0].train.lr: 'a b': a value"),
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
    assert "foreach:" in stage and "train.lr=${item.lr}" in stage and "data/sweeps/lr/${key}" in stage


def test_a_later_sweep_shares_each_point_at_which_the_stage_runs_as_at_an_earlier_ones():
    params = {"pretrain": {"train": {"lr": 0.001, "warmup_steps": 30, "betas": [0.9, 0.95]}}, "train_gnn": {}}
    listed = [{"train.lr": 3e-3, "train.warmup_steps": 8}, {"train.lr": 1e-3, "train.warmup_steps": 30}]
    declared = {
        "w": {**without(LR, "grid"), "points": listed},
        "lr": {**LR, "grid": {"train.lr": [1.0, 0.001, 3.0e-3]}},
        "again": {**LR, "grid": {"train.lr": [3.0e-3, 1]}},  # (1 and 1.0: one point)
        "gnn": {**LR, "stage": "train_gnn", "grid": {"train.lr": [0.001]}},  # (another stage: never shared)
    }
    sweeps = sweep.load({"sweeps": declared})
    assert sweep.homes(sweeps, params) == {
        "w": {"0.003-8": ("w", "0.003-8"), "0.001-30": ("w", "0.001-30")},
        "lr": {"1.0": ("lr", "1.0"), "0.001": ("w", "0.001-30"), "0.003": ("lr", "0.003")},
        "again": {"0.003": ("lr", "0.003"), "1": ("lr", "1.0")},
        "gnn": {"0.001": ("gnn", "0.001")},
    }
    # with another warmup in params.yaml, pretrain at lr's 0.001 runs otherwise than at w's 0.001-30
    params["pretrain"]["train"]["warmup_steps"] = 2
    assert sweep.homes(sweeps, params)["lr"]["0.001"] == ("lr", "0.001")


def test_a_shared_point_is_one_stage_whose_folder_the_later_comparison_reads(tmp_path):
    """The point runs once, as the earlier sweep's stage; the later comparison reads its folder; a sweep all of
    whose points others run has a comparison only."""
    params = tmp_path / "params.yaml"
    declared = {
        "lr": LR,
        "again": {**LR, "grid": {"train.lr": [3.0e-3, 3.0e-2]}},
        "same": {**LR, "grid": {"train.lr": [0.01]}},
    }
    params.write_text(with_sweeps((dag.ROOT / "params.yaml").read_text(), declared))
    stages = dag.load_table(params=params)
    assert stages["sweep_again"].instances() == [("sweep_again@0.03", "0.03")]
    assert stages["sweep_lr"].instances() == [(f"sweep_lr@{p}", p) for p in ("0.001", "0.003", "0.01")]
    assert "sweep_same" not in stages and "sweep_same_compare" in stages
    compare = stages["sweep_again_compare"]
    assert [d for d in compare.deps if d.startswith("data/")] == ["data/sweeps/lr/0.003", "data/sweeps/again/0.03"]
    assert "--points 0.003=data/sweeps/lr/0.003 0.03=data/sweeps/again/0.03 " in compare.cmd()
    assert [d for d in stages["sweep_same_compare"].deps if d.startswith("data/")] == ["data/sweeps/lr/0.01"]


def with_sweeps(params: str, sweeps: dict) -> str:
    """params.yaml's text with its sweeps section (the last, with its comments) replaced by `sweeps`."""
    return params.split("\nsweeps:")[0] + "\n" + yaml.safe_dump({"sweeps": sweeps}, sort_keys=False)


def planned_points(out: str) -> set[str]:
    return set(re.findall(r"Running stage '(sweep_lr@[^']+)'", out))


def declare(clone: Path, values: list[float]) -> None:
    params = clone / "params.yaml"
    params.write_text(with_sweeps(params.read_text(), {"lr": {**LR, "grid": {"train.lr": values}}}))
    sh("python -m pipelines.dag write", clone)


def lock_dep(record: dict, path: str) -> str:
    (md5,) = [d["md5"] for d in record["deps"] if d["path"] == path]
    return md5


def recorded(clone: Path) -> set[str]:
    """The sweep's stages dvc.lock holds a whole record of, read while a tool may be writing it."""
    try:
        stages = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
        return {name for name, entry in stages.items() if name.startswith("sweep_lr") and entry.get("outs")}
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return set()


def lock_md5s(clone: Path) -> dict[str, str]:
    stages = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    return {name: entry["outs"][0]["md5"] for name, entry in stages.items() if name.startswith("sweep_lr")}


VALUES = [*LR["grid"]["train.lr"], 3.0e-2, 3.0e-4, 6.0e-3, 1.0e-4]  # (the lr sweep's points at its end)


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, Path]:
    """The lr sweep on two copies of the shared ci run, one under Snakemake and one under `dvc repro`: three
    points, a fourth, a point that diverges beside a good one, then two more killed after one of them
    finished and resumed; each step checks what each tool ran. (smk, dvc): the two copies at the end."""
    tmp_path = tmp_path_factory.mktemp("sweep")
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

    # a point that diverges fails alone: under both tools (Snakemake's profile keeps going, `dvc repro -k`)
    # the other new point runs and is published, the comparison waits, and the sweep's status names the
    # failed point with its cause
    for clone in (smk, dvc):
        declare(clone, [*LR["grid"]["train.lr"], 3.0e-2, 1000, 3.0e-4])
    out = sh("snakemake --profile pipelines/profiles/local; echo exit=$?", smk)
    assert sorted(re.findall(r"wildcards: item=(\S+)", out)) == ["0.0003", "1000"] and "exit=0" not in out, out[-3000:]
    assert "sweep_lr_compare" not in snakemake_ran(out), out[-3000:]
    out = sh("dvc repro --keep-going; echo exit=$?", dvc)
    assert planned_points(out) == {"sweep_lr@1000", "sweep_lr@0.0003"} and "exit=0" not in out, out[-3000:]
    for clone in (smk, dvc):
        assert "sweep_lr@0.0003" in lock_md5s(clone) and "sweep_lr@1000" not in lock_md5s(clone)
        assert not (clone / "data/sweeps/lr/1000").exists(), "a diverged point publishes nothing"
        status = sh("python -m pipelines.sweep lr; echo exit=$?", clone)
        assert "5 of 6 points current" in status and status.rstrip().endswith("exit=1"), status
        (failed,) = [line for line in status.splitlines() if line.startswith("| 1000 |")]
        assert "| FAILED |" in failed and "training diverged: the loss is nan at step" in failed, status
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{smk / 'mlflow.db'}")
    exp = client.get_experiment_by_name("pipeline").experiment_id
    (parent,) = client.search_runs([exp], "tags.pipeline_run = 'sweep-lr' and tags.pipeline_role = 'parent'")
    assert parent.info.status == "FAILED" and parent.data.tags["unfinished_stages"] == "sweep_lr@1000:FAILED"
    assert lock_md5s(smk) == lock_md5s(dvc)

    # a sweep killed (SIGKILL, every process) after one of its two new points resumes only the other one
    for clone, cmd in ((smk, "snakemake --profile pipelines/profiles/local --cores 2"), (dvc, "dvc repro")):
        declare(clone, VALUES)
        proc = subprocess.Popen(  # (exec: the tool is the child this test reaps, not a zombie holding DVC's lock)
            f"exec {cmd}", shell=True, cwd=clone, env=env_for(clone), start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while not {"sweep_lr@0.006", "sweep_lr@0.0001"} & recorded(clone):
            assert proc.poll() is None and time.monotonic() < deadline, f"{cmd} ended or stalled before a new point"
            time.sleep(0.5)
        kill_all(clone)
        proc.wait(30)
        (done,) = {"sweep_lr@0.006", "sweep_lr@0.0001"} & recorded(clone)
        rest = ({"0.006", "0.0001"} - {done.partition("@")[2]}).pop()
        out = sh(cmd, clone)
        if clone is smk:
            assert re.findall(r"wildcards: item=(\S+)", out) == [rest], out[-3000:]
            assert snakemake_ran(out) == {"sweep_lr", "sweep_lr_compare"}, out[-3000:]
        else:
            assert planned_points(out) == {f"sweep_lr@{rest}"}, out[-3000:]
        assert "7 of 7 points current" in sh("python -m pipelines.sweep lr", clone)
    assert lock_md5s(smk) == lock_md5s(dvc) and len(lock_md5s(smk)) == 8, "7 points and the comparison"

    # a second sweep of pretrain at points the first has run: each tool runs only its comparison, which reads
    # the first sweep's folders, and its status names the stage that ran each point
    for clone, cmd in ((smk, "snakemake --profile pipelines/profiles/local"), (dvc, "dvc repro")):
        params = clone / "params.yaml"
        params.write_text(with_sweeps(params.read_text(), {"lr": {**LR, "grid": {"train.lr": VALUES}}, "again": AGAIN}))
        sh("python -m pipelines.dag write", clone)
        out = sh(cmd, clone)
        ran = snakemake_ran(out) if clone is smk else set(re.findall(r"Running stage '([^']+)'", out))
        assert ran == {"sweep_again_compare"}, out[-3000:]
        status = sh("python -m pipelines.sweep again", clone)
        assert "2 of 2 points current" in status and "| 0.003 (sweep_lr@0.003) | 0.003 | current |" in status, status
    again = json.loads((smk / "data/sweeps/again/compare/figures.json").read_text())
    assert {p: v["metric"] for p, v in again["points"].items()} == {
        p: json.loads((smk / f"data/sweeps/lr/{p}/metrics.json").read_text())["final_val_loss"]
        for p in ("0.03", "0.003")
    }
    return smk, dvc


AGAIN = {**LR, "grid": {"train.lr": [3.0e-2, 3.0e-3]}}  # (points of the lr sweep: shared, not run again)


@pytest.mark.long
@pytest.mark.timeout(1500)
def test_a_sweep_runs_alike_under_both_tools_resumes_after_a_failed_point_and_a_kill(swept):
    """(What each tool ran, step by step, is checked as the sweep runs: the fixture `swept`.) In MLflow: every
    point's run nests under the sweep's one parent, its learning rate a param and a tag, its datasets its
    inputs with their md5s in dvc.lock; the diverged point's run FAILED with its cause; no killed run is left
    RUNNING; the sweep's logged models rank by the metric as the comparison does; verify finds every link."""
    smk, _ = swept
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{smk / 'mlflow.db'}")
    exp = client.get_experiment_by_name("pipeline").experiment_id
    (parent,) = client.search_runs([exp], "tags.pipeline_run = 'sweep-lr' and tags.pipeline_role = 'parent'")
    # FAILED while its point had failed, FINISHED once the comparison ran; the failure kept on record
    assert parent.info.status == "FINISHED" and "unfinished_stages" not in parent.data.tags, parent.data.tags
    assert "sweep_lr@1000:FAILED" in parent.data.tags["earlier_unfinished_stages"].split(","), parent.data.tags
    runs = client.search_runs([exp], max_results=1000)
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"], "a killed run left RUNNING"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    points = {
        r.info.run_name: r for r in children if r.data.tags.get("stage") == "pretrain" and r.info.status == "FINISHED"
    }
    assert sorted(points) == sorted(f"sweep_lr@{sweep.as_text(v)}" for v in VALUES), sorted(points)
    records = yaml.safe_load((smk / "dvc.lock").read_text())["stages"]
    for name, run in points.items():  # the point's values as params (the stage's section) and as tags
        value = name.partition("@")[2]
        assert run.data.params["train.lr"] == run.data.tags["sweep.train.lr"] == value, run.data.tags
        assert run.data.tags["sweep"] == "lr" and run.data.tags["sweep.point"] == value
        # its datasets: its data inputs, each with the md5 of its record in dvc.lock
        digests = {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs}
        assert digests == {"data/tokenize": lock_dep(records[name], "data/tokenize")}, (name, digests)
    (diverged,) = [r for r in children if r.info.run_name == "sweep_lr@1000"]
    assert diverged.info.status == "FAILED" and diverged.data.tags["failure"] == "Diverged", diverged.data.tags
    assert "lower train.lr" in diverged.data.tags["failure_cause"]
    # each point's model is a model of its own, and the sweep's models rank by their validation loss
    ranked = client.search_logged_models(
        experiment_ids=[exp],
        filter_string="name LIKE 'sweep_lr-%'",
        order_by=[{"field_name": "metrics.val_loss", "ascending": True}],
    )
    best = json.loads((smk / "data/sweeps/lr/compare/metrics.json").read_text())["best_point"]
    assert [m.name for m in ranked][0] == registry.model_name("sweep_lr", best) == f"sweep_lr-{best.replace('.', '_')}"
    assert len(ranked) == 7, [m.name for m in ranked]
    registered = {m.name for m in client.search_registered_models()}
    assert registered >= {registry.model_name("sweep_lr", p.partition("@")[2]) for p in points}
    # the second sweep's parent holds its comparison alone, and its compare view the lr sweep's runs of its points
    (again,) = client.search_runs([exp], "tags.pipeline_run = 'sweep-again' and tags.pipeline_role = 'parent'")
    assert again.info.status == "FINISHED", again.data.tags
    from pipelines import ui

    declared = yaml.safe_load((smk / "params.yaml").read_text())
    homes = sweep.homes(sweep.load(declared), declared)
    _, compare = ui.sweep_pages(client, "http://ui", exp, homes)["again"]
    shown = json.loads(urllib.parse.parse_qs(compare.split("?", 1)[1])["runs"][0])
    assert sorted(shown) == sorted(points[f"sweep_lr@{p}"].info.run_id for p in ("0.03", "0.003")), shown
    assert "every link holds" in sh("python -m pipelines.verify", smk)


def run_id_of(page: str, part: str) -> str:
    """The id after /experiments/ or /runs/ in a page's address."""
    return page.split(f"/{part}/", 1)[1].split("/", 1)[0].split("?", 1)[0]


@pytest.mark.long
@pytest.mark.timeout(900)
def test_the_sweep_in_the_mlflow_ui_in_chromium(request, tmp_path):
    """`make mlflow-ui` over the sweep's store: the pages it prints include the sweep's parent run and the
    compare view of its points, which lists every point with the parallel-coordinates plot; a point's page
    shows its parent and its dataset with the md5 dvc.lock records. Screenshot in tests/system/artifacts/."""
    if chromium() is None:
        pytest.skip("Chromium not installed (bash tests/system/install.sh browser)")
    smk, _ = request.getfixturevalue("swept")
    port = free_port()
    store = f"sqlite:///{smk / 'mlflow.db'}"
    printed = sh(f"python -m pipelines.ui {port}", smk).splitlines()
    pages = [ln.removeprefix("open ") for ln in printed if ln.startswith("open ")]
    assert len(pages) == 6 and {ln for ln in printed if not ln.startswith("open ")} == {
        f"sweep {name}: its parent run, then the compare view of its points" for name in ("lr", "again")
    }, printed
    base = f"http://127.0.0.1:{port}"
    at = printed.index("sweep lr: its parent run, then the compare view of its points")
    parent_page, compare_page = (ln.removeprefix("open ") for ln in printed[at + 1 : at + 3])
    assert "/#/compare-runs?runs=" in compare_page and "/runs/" in parent_page, pages

    import mlflow

    # (the server as `make mlflow-ui` starts it; tests/system/test_browser.py checks that recipe)
    server = [str(BIN / "mlflow"), "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port)]
    env = {**env_for(smk), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = tmp_path / "server.log"
    with running_server([*server, "--workers", "1"], log, lambda: answers(base), "the MLflow server", cwd=smk, env=env):
        text = visible_text(render(compare_page, tmp_path / "profile"))
        assert f"Comparing {len(VALUES)} Runs from 1 Experiment" in text, text[:3000]
        assert "Parallel Coordinates Plot" in text and "Contour Plot" in text, text[:3000]
        for value in VALUES:
            assert f"sweep_lr@{sweep.as_text(value)}" in text, f"point {value} is not in the compare view"
        text = visible_text(render(parent_page, tmp_path / "profile"))
        assert "pipeline sweep-lr" in text and "Status Finished" in text, text[:3000]
        # a point's page: its parent, and its dataset with the md5 of dvc.lock's record
        client = mlflow.MlflowClient(store)
        (run,) = client.search_runs([run_id_of(parent_page, "experiments")], "attributes.run_name = 'sweep_lr@0.001'")
        record = yaml.safe_load((smk / "dvc.lock").read_text())["stages"]["sweep_lr@0.001"]
        page = parent_page.replace(run_id_of(parent_page, "runs"), run.info.run_id)
        text = visible_text(render(page, tmp_path / "profile"))
        assert "Parent run pipeline sweep-lr" in text, text[:3000]
        assert f"Datasets data/tokenize ({lock_dep(record, 'data/tokenize')})" in text, text[:3000]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "mlflow-sweep-compare.png"
        shot.unlink(missing_ok=True)
        render(compare_page, tmp_path / "profile", f"--screenshot={shot}", height=1400)
        assert shot.is_file() and shot.stat().st_size > 10_000, "Chromium wrote no screenshot of the compare view"


def test_the_status_names_each_point_current_failed_out_of_date_or_not_run(tmp_path):
    from types import SimpleNamespace

    from pipelines import sweep as status_of

    sw = sweep.load({"sweeps": {"lr": {**LR, "grid": {"train.lr": [1e-3, 3e-3, 1e-2, 1000]}}}})["lr"]
    lock = {"stages": {"sweep_lr@0.001": {}, "sweep_lr@0.003": {}, "sweep_lr@0.01": {}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    for point, loss in (("0.001", 4.5), ("0.003", 4.25)):
        (tmp_path / f"data/sweeps/lr/{point}").mkdir(parents=True)
        (tmp_path / f"data/sweeps/lr/{point}/metrics.json").write_text(json.dumps({"final_val_loss": loss}))
    status = {"sweep_lr@0.003": [{"changed deps": {"params.yaml": "modified"}}], "sweep_lr@1000": []}
    failed = SimpleNamespace(
        info=SimpleNamespace(status="FAILED", run_id="r1"),
        data=SimpleNamespace(tags={"failure_cause": "Diverged: training diverged: the loss is nan at step 7"}),
    )
    rows = status_of.point_states(sw, tmp_path, status, {"1000": failed})
    assert [(r["point"], r["state"], r["metric"]) for r in rows] == [
        ("0.001", "current", 4.5),
        ("0.003", "out of date", None),  # (its params changed since its record)
        ("0.01", "out of date", None),  # (a record, and no output folder)
        ("1000", "FAILED", None),
    ]
    table = status_of.render(sw, rows)
    assert "1 of 4 points current" in table and "| 1000 | 1000 | FAILED |  | Diverged: training diverged" in table
    assert status_of.point_states(sw, tmp_path, None, {})[0]["state"] == "out of date", "DVC could not tell"
    # a point run by an earlier sweep's stage: its record, folder and runs are that stage's, named in the table
    again = sweep.load({"sweeps": {"again": {**LR, "grid": {"train.lr": [1e-3, 1000]}}}})["again"]
    homes = {"0.001": ("lr", "0.001"), "1000": ("lr", "1000")}
    rows = status_of.point_states(again, tmp_path, status, lambda name: {"1000": failed} if name == "lr" else {}, homes)
    assert [(r["stage"], r["state"], r["metric"]) for r in rows] == [
        ("sweep_lr@0.001", "current", 4.5),
        ("sweep_lr@1000", "FAILED", None),
    ]
    assert "| 0.001 (sweep_lr@0.001) | 0.001 | current | 4.5 |" in status_of.render(again, rows)


def test_a_points_crate_action_records_the_params_it_ran_with():
    """dvc.lock records a point's params as the swept stage's section; the point ran with its values."""
    from pipelines import crate

    rec = {
        "cmd": "python -m pipelines.launch sweep_lr@0.003 --input data/tokenize --output data/sweeps/lr/0.003 "
        "--measured measured/sweep_lr/0.003.json train.lr=0.003",
        "params": {"params.yaml": {"base.model": "", "pretrain": {"train": {"lr": 0.001, "steps": 10}}}},
    }
    assert crate.ran_with(rec, "pretrain") == {"base.model": "", "pretrain.train.lr": 0.003, "pretrain.train.steps": 10}


def test_a_point_whose_values_the_stage_refuses_stops_both_tools_before_any_job(tmp_path):
    params = tmp_path / "params.yaml"
    bad = {**LR, "grid": {"train.lr": [0.001, "fast"]}}
    params.write_text(with_sweeps((dag.ROOT / "params.yaml").read_text(), {"lr": bad}))
    with pytest.raises(ConfigError, match=r"sweeps\.lr \(train\.lr=fast\): .*pretrain\.train\.lr"):
        dag.check_params(params)


def test_a_list_of_points_is_the_same_stages_for_dvc_and_snakemake(tmp_path):
    """A sweep given as a list of points of two keys: DVC's parse of the written dvc.yaml and Snakemake's
    rules name the same stages with the same commands (`python -m pipelines.dag check`)."""
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=dag.ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    for changed in ("pipelines/dag.py", "stages/common/sweep.py"):  # (this tree's, committed or not)
        (tmp_path / changed).write_bytes((dag.ROOT / changed).read_bytes())
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)  # (DVC reads a repository)
    listed = [{"train.lr": 3e-3, "train.warmup_steps": 8}, {"train.lr": 1e-3, "train.warmup_steps": 2}]
    params = tmp_path / "params.yaml"
    text = params.read_text().replace("  warmup_steps: 30\n", "  warmup_steps: 2\n", 1)
    assert text != params.read_text()
    # and two sweeps sharing w's points: lr one of its two, again its only one (a comparison, no point stage)
    declared = {
        "w": {**without(LR, "grid"), "points": listed},
        "lr": {**LR, "grid": {"train.lr": [1e-3, 1e-2]}},
        "again": {**without(LR, "grid"), "points": [{"train.lr": 3e-3, "train.warmup_steps": 8}]},
    }
    params.write_text(with_sweeps(text, declared))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for cmd in (["write"], ["check"]):
        done = subprocess.run(
            [sys.executable, "-m", "pipelines.dag", *cmd], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
    assert "define the same stages" in done.stdout, done.stdout
    written = yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]
    stage = written["sweep_w"]
    assert stage["foreach"] == {
        "0.003-8": {"lr": "0.003", "warmup_steps": "8"},
        "0.001-2": {"lr": "0.001", "warmup_steps": "2"},
    }
    assert stage["do"]["cmd"].endswith("train.lr=${item.lr} train.warmup_steps=${item.warmup_steps}")
    assert list(written["sweep_lr"]["foreach"]) == ["0.01"] and "sweep_again" not in written
    assert "data/sweeps/w/0.003-8" in written["sweep_again_compare"]["deps"]


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
