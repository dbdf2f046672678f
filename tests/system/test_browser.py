"""The MLflow UI, as `make mlflow-ui` serves it, over a real pipeline run.

A scratch clone runs the ci pipeline; the server is started with the exact command of the Makefile's
mlflow-ui target (on 127.0.0.1, a free port); its REST API must show every stage's run nested under the
one parent run of the invocation, with metrics and artifacts; headless Chromium then renders the
experiment page, whose DOM must list the runs. Screenshots of the runs page and of a stage's run page are
kept in tests/system/artifacts/.
The server is stopped by its PID.
"""

from __future__ import annotations

import html
import json
import re
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from workspace import BIN, ROOT, env_for, local_run, sh

from pipelines import dag

# Image builds and pipeline runs outlast the suite's per-test limit on 2 shared cores.
pytestmark = [pytest.mark.system, pytest.mark.timeout(1800)]
ARTIFACTS = ROOT / "tests" / "system" / "artifacts"
STAGES = set(dag.load_table())


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory, mirror):
    if chromium() is None:
        pytest.skip("Chromium not installed (bash tests/system/install.sh browser)")
    clone = local_run(tmp_path_factory)
    port = free_port()
    # The command `make mlflow-ui` runs, as make prints it (-n: without running the venv step).
    recipe = sh(f"make --no-print-directory -n mlflow-ui MLFLOW_PORT={port}", clone)
    line = next(ln for ln in recipe.splitlines() if ln.startswith("mlflow server"))
    assert "--host 127.0.0.1" in line and str(clone / "mlflow.db") in line
    args = shlex.split(line)
    log = open(tmp_path_factory.mktemp("mlflow-server") / "server.log", "w")
    proc = subprocess.Popen(
        [str(BIN / args[0]), *args[1:]], cwd=clone, env=env_for(clone), stdout=log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "the MLflow server did not answer within 180 s"
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def pipeline_runs(base: str) -> tuple[str, dict, list[dict]]:
    exp = api(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=pipeline")["experiment"]
    runs = api(base, "/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 100})[
        "runs"
    ]

    def tags(r):
        return {t["key"]: t["value"] for t in r["data"].get("tags", [])}

    parents = [r for r in runs if tags(r).get("pipeline_role") == "parent"]
    assert len(parents) == 1, f"one pipeline invocation, one parent run; got {len(parents)}"
    children = [r for r in runs if tags(r).get("mlflow.parentRunId") == parents[0]["info"]["run_id"]]
    return exp["experiment_id"], parents[0], children


def test_rest_api_groups_stage_runs_with_metrics_and_artifacts(server):
    _, parent, children = pipeline_runs(server)
    stages = {t["value"] for r in children for t in r["data"]["tags"] if t["key"] == "stage"}
    assert stages == STAGES
    assert parent["info"]["status"] == "FINISHED", "every stage finished, so the pipeline's run did"
    for run in children:
        name = run["info"]["run_name"]
        assert run["info"]["status"] == "FINISHED", name
        assert run["data"].get("metrics"), f"{name}: no metrics"
        files = api(server, f"/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}")["files"]
        assert any(f["path"] == "environment" for f in files), f"{name}: artifacts {files}"
    pretrain = next(r for r in children if r["info"]["run_name"] == "pretrain")
    history = api(server, f"/api/2.0/mlflow/metrics/get-history?run_id={pretrain['info']['run_id']}&metric_key=loss")
    assert len(history["metrics"]) >= 2, "pretrain logged its loss curve"


def render(url: str, profile: Path, *extra: str) -> str:
    """The page's DOM after its scripts ran (or Chromium's output for a screenshot)."""
    browser = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1600,1000",
        "--virtual-time-budget=30000",
    ]
    return subprocess.run(
        [*browser, *(extra or ("--dump-dom",)), url], capture_output=True, text=True, timeout=300
    ).stdout


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def test_experiment_page_lists_the_runs_in_chromium(server, tmp_path):
    experiment_id, parent, children = pipeline_runs(server)
    runs_page = f"{server}/#/experiments/{experiment_id}/runs"
    text = visible_text(render(runs_page, tmp_path / "profile"))
    # The stage runs sit under the collapsed parent row: the page counts them with it.
    assert parent["info"]["run_name"] in text, f"the parent run is not on the rendered page:\n{text[:3000]}"
    assert f"{len(children) + 1} matching runs" in text, text[:3000]

    pretrain = next(r for r in children if r["info"]["run_name"] == "pretrain")
    run_page = f"{server}/#/experiments/{experiment_id}/runs/{pretrain['info']['run_id']}"
    text = visible_text(render(run_page, tmp_path / "profile"))
    assert f"Parent run {parent['info']['run_name']}" in text, text[:3000]
    for metric in pretrain["data"]["metrics"]:
        assert metric["key"] in text, f"metric {metric['key']} not on the run page"

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for page, name in ((runs_page, "mlflow-experiment.png"), (run_page, "mlflow-run-pretrain.png")):
        shot = ARTIFACTS / name
        shot.unlink(missing_ok=True)
        render(page, tmp_path / "profile", f"--screenshot={shot}")
        assert shot.is_file() and shot.stat().st_size > 10_000, f"Chromium wrote no screenshot of {page}"


def test_dvc_plots_render_offline_in_chromium(tmp_path_factory, mirror, tmp_path):
    """`make plots` (`dvc plots show` with the offline template) over a pipeline run draws every line plot
    with the network cut off: the page template carries the Vega libraries instead of loading them from a CDN."""
    if chromium() is None:
        pytest.skip("Chromium not installed (bash tests/system/install.sh browser)")
    clone = local_run(tmp_path_factory)
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
