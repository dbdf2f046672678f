"""The MLflow UI, as `make mlflow-ui` serves it, over a real pipeline run.

A scratch clone runs the ci pipeline; a second invocation adds a stage that fails on bad params. The
server is started with the exact command of the Makefile's mlflow-ui target (on 127.0.0.1, a free port);
its REST API must show every stage's run nested under the one parent run of the pipeline, with metrics
and artifacts, the failed invocation's parent run FAILED, and the registered models with the alias the
report set. Headless Chromium then renders the pages `make mlflow-ui` prints: the training runs table in
its saved view (not the GenAI overview), a stage's run page, the failed invocation's run page and the
registered models page. Their screenshots are kept in tests/system/artifacts/.
The server is stopped with the processes it started.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import urllib.request

import pytest
from browser import answers, chromium, render, visible_text
from conftest import free_port, running_server
from workspace import BIN, ROOT, env_for, local_run, sh

from pipelines import dag

# Image builds and pipeline runs outlast the suite's per-test limit on 2 shared cores.
pytestmark = [pytest.mark.system, pytest.mark.timeout(1800)]
ARTIFACTS = ROOT / "tests" / "system" / "artifacts"
STAGES = set(dag.load_table())


def api(base: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


FAILING_RUN = "smk-failing-stage"


@pytest.fixture(scope="module")
def server(tmp_path_factory, mirror):
    """(address, pages `make mlflow-ui` prints) of the server over a copy of the pipeline run's store, to
    which a second invocation added a stage that failed on bad params before opening its run."""
    if chromium() is None:
        pytest.skip("Chromium not installed (bash tests/system/install.sh browser)")
    clone = local_run()
    store = tmp_path_factory.mktemp("mlflow-store") / "mlflow.db"
    shutil.copy(clone / "mlflow.db", store)  # the shared run stays as it was
    env = {**env_for(clone), "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    failing = subprocess.run(
        [str(BIN / "python"), "-m", "pipelines.launch", "context_study", "--output", str(store.parent / "unused")]
        + ["context_study.unscaled_growth=0.5"],
        cwd=clone,
        env={**env, "PIPELINE_RUN_ID": FAILING_RUN},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failing.returncode == 2 and "unscaled_growth must be >= 1" in failing.stderr, failing.stderr[-2000:]
    port = free_port()
    # The commands `make mlflow-ui` runs, as make prints them (-n: without running the venv step): the pages
    # to open, then the server (here over the copied store).
    recipe = sh(f"make --no-print-directory -n mlflow-ui MLFLOW_PORT={port}", clone).splitlines()
    line = next(ln for ln in recipe if "mlflow server" in ln)
    assert "--host 127.0.0.1" in line and str(clone / "mlflow.db") in line
    words = shlex.split(line)
    assigned = dict(w.split("=", 1) for w in words[: words.index("mlflow")])  # (VAR=value before the command)
    args = [a.replace(str(clone / "mlflow.db"), str(store)) for a in words[len(assigned) :]]
    pages_line = next(ln for ln in recipe if "pipelines.ui" in ln).lstrip("-@")
    pages_cmd = [a.replace(str(clone / "mlflow.db"), str(store)) for a in shlex.split(pages_line)]
    assert pages_cmd[-1] == f"sqlite:///{store}", "the pages are those of the store the server serves"
    printed = subprocess.run(
        [str(BIN / pages_cmd[0]), *pages_cmd[1:]], cwd=clone, env=env, capture_output=True, text=True, check=True
    ).stdout
    pages = [ln.removeprefix("open ") for ln in printed.splitlines() if ln.startswith("open ")]
    base = f"http://127.0.0.1:{port}"

    log = tmp_path_factory.mktemp("mlflow-server") / "server.log"
    cmd = [str(BIN / args[0]), *args[1:]]
    with running_server(
        cmd, log, lambda: answers(base), "the MLflow server", cwd=clone, env={**env_for(clone), **assigned}
    ):
        yield base, pages


def tags(run: dict) -> dict:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def pipeline_runs(base: str) -> tuple[str, dict, list[dict], dict]:
    """(experiment id, the pipeline's parent run, its stage runs, the failing invocation's parent run)."""
    exp = api(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=pipeline")["experiment"]
    runs = api(base, "/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 100})[
        "runs"
    ]
    parents = {tags(r)["pipeline_run"]: r for r in runs if tags(r).get("pipeline_role") == "parent"}
    assert len(parents) == 2 and FAILING_RUN in parents, f"two invocations, two parent runs; got {sorted(parents)}"
    failed = parents.pop(FAILING_RUN)
    (parent,) = parents.values()
    children = [r for r in runs if tags(r).get("mlflow.parentRunId") == parent["info"]["run_id"]]
    return exp["experiment_id"], parent, children, failed


def registered_models(base: str) -> dict[str, dict]:
    """{name: {alias: version}} of the registry."""
    found = api(base, "/api/2.0/mlflow/registered-models/search?max_results=100")["registered_models"]
    return {m["name"]: {a["alias"]: a["version"] for a in m.get("aliases", [])} for m in found}


def test_rest_api_groups_stage_runs_with_metrics_and_artifacts(server):
    base, _ = server
    _, parent, children, failed = pipeline_runs(base)
    stages = {tags(r)["stage"] for r in children}
    assert stages == STAGES
    assert parent["info"]["status"] == "FINISHED", "every stage finished, so the pipeline's run did"
    assert failed["info"]["status"] == "FAILED" and tags(failed)["unfinished_stages"] == "context_study:FAILED"
    for run in children:
        name = run["info"]["run_name"]
        assert run["info"]["status"] == "FINISHED", name
        assert run["data"].get("metrics"), f"{name}: no metrics"
        files = api(base, f"/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}")["files"]
        assert any(f["path"] == "environment" for f in files), f"{name}: artifacts {files}"
    pretrain = next(r for r in children if r["info"]["run_name"] == "pretrain")
    history = api(base, f"/api/2.0/mlflow/metrics/get-history?run_id={pretrain['info']['run_id']}&metric_key=loss")
    assert len(history["metrics"]) >= 2, "pretrain logged its loss curve"
    models = registered_models(base)
    assert {"pretrain", "finetune_qlora-nf4", "finetune_qlora-none"} <= set(models), sorted(models)
    assert models["pretrain"] == {"reproduced": "1"}, "the regression rows of the pretrain model pass"


def test_experiment_page_lists_the_runs_in_chromium(server, tmp_path):
    base, pages = server
    experiment_id, parent, children, failed = pipeline_runs(base)
    # The page `make mlflow-ui` prints first: the training runs table in the saved view, not the GenAI overview.
    runs_page, models_page = pages
    assert (
        runs_page
        == f"{base}/#/experiments/{experiment_id}/runs?viewStateShareKey=training&workflowType=machine_learning"
    )
    text = visible_text(render(runs_page, tmp_path / "profile", width=5000))  # wide: every column drawn
    assert "Training runs" in text and "No data available" not in text, text[:3000]
    # The stage runs sit under the collapsed parent rows: the page counts them with them.
    assert parent["info"]["run_name"] in text, f"the parent run is not on the rendered page:\n{text[:3000]}"
    assert f"{len(children) + 2} matching runs" in text, text[:3000]
    for column in ("val_loss", "tokens_per_s", "train.lr", "git_commit"):
        assert column in text, f"column {column} is not in the saved view:\n{text[:3000]}"

    pretrain = next(r for r in children if r["info"]["run_name"] == "pretrain")
    run_page = f"{base}/#/experiments/{experiment_id}/runs/{pretrain['info']['run_id']}?workflowType=machine_learning"
    text = visible_text(render(run_page, tmp_path / "profile"))
    assert f"Parent run {parent['info']['run_name']}" in text, text[:3000]
    for metric in pretrain["data"]["metrics"]:
        assert metric["key"] in text, f"metric {metric['key']} not on the run page"
    assert "Registered models pretrain v1" in text, text[:3000]

    # The invocation whose stage failed before opening a run: its run page says so.
    failed_page = f"{base}/#/experiments/{experiment_id}/runs/{failed['info']['run_id']}?workflowType=machine_learning"
    text = visible_text(render(failed_page, tmp_path / "profile"))
    assert "Status Failed" in text and "unfinished_stages : context_study:FAILED" in text, text[:3000]

    # The registered models, with the alias the report set.
    assert models_page == f"{base}/#/models?workflowType=machine_learning"
    text = visible_text(render(models_page, tmp_path / "profile"))
    for name, aliases in registered_models(base).items():
        assert name in text, f"registered model {name} not on the page:\n{text[:3000]}"
        for alias, version in aliases.items():
            assert f"@ {alias} : Version {version}" in text, text[:3000]

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shots = {
        runs_page: "mlflow-experiment.png",
        run_page: "mlflow-run-pretrain.png",
        failed_page: "mlflow-run-failed-pipeline.png",
        models_page: "mlflow-registered-models.png",
    }
    for page, name in shots.items():
        shot = ARTIFACTS / name
        shot.unlink(missing_ok=True)
        # wide: more columns of the runs table; tall: the registry's first-visit notice, centred, below the table
        size = {"width": 2400} if page == runs_page else {"height": 2000} if page == models_page else {}
        render(page, tmp_path / "profile", f"--screenshot={shot}", **size)
        assert shot.is_file() and shot.stat().st_size > 10_000, f"Chromium wrote no screenshot of {page}"


def test_dvc_plots_render_offline_in_chromium(tmp_path_factory, mirror, tmp_path):
    """`make plots` (`dvc plots show` with the offline template) over a pipeline run draws every line plot
    with the network cut off: the page template carries the Vega libraries instead of loading them from a CDN."""
    if chromium() is None:
        pytest.skip("Chromium not installed (bash tests/system/install.sh browser)")
    clone = local_run()
    recipe = sh("make --no-print-directory -n plots", clone)
    assert "python -m pipelines.plots" in recipe and "dvc plots show --html-template" in recipe
    sh("python -m pipelines.plots", clone)
    sh(f"dvc plots show --html-template .dvc/plots/offline.html -o {tmp_path / 'plots'}", clone)
    page = tmp_path / "plots" / "index.html"
    text = page.read_text()
    assert not re.search(r"<script[^>]+src=", text), "the page loads a script from elsewhere"

    line_plots = [next(iter(e)) for e in dag.dvc_document(dag.load_table())["plots"] if isinstance(e, dict)]
    files = [f for p in map(clone.joinpath, line_plots) for f in (sorted(p.glob("*.csv")) if p.is_dir() else [p])]
    empty = [str(f.relative_to(clone)) for f in files if len(f.read_text().splitlines()) < 2]
    assert not empty, f"line plots without data (DVC draws them blank): {empty}"
    # A proxy that refuses every connection: nothing outside the file can load.
    dom = render(page.as_uri(), tmp_path / "profile", "--proxy-server=127.0.0.1:9", "--dump-dom")
    drawn = re.findall(r'<svg[^>]*class="marks"[^>]*width="(\d+)"', dom)
    # one drawn plot per CSV file (a folder plot is one plot per file in it)
    assert len([w for w in drawn if int(w) > 0]) == len(files), ([str(f.relative_to(clone)) for f in files], drawn)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dvc-plots.png"
    shot.unlink(missing_ok=True)
    render(page.as_uri(), tmp_path / "profile", "--proxy-server=127.0.0.1:9", f"--screenshot={shot}")
    assert shot.is_file() and shot.stat().st_size > 10_000, "Chromium wrote no screenshot of the plots page"
