"""Print the pages of the MLflow UI to open for this repository's store: `make mlflow-ui` runs it first.

    python -m pipelines.ui [PORT [STORE]]

STORE is the backend store URI the server serves (default: the stages' store, stages/common/tracking/store.py).

The runs table in the saved view `training` (the columns a user compares across stage runs, see
stages/common/tracking/store.py: VIEW_COLUMNS) and the registered models, both in the UI's model-training mode;
then, per sweep (docs/sweeps.md), its parent run and the compare view of its points (parallel coordinates,
contour: the swept params against the metrics).
Before any stage ran, the experiment does not exist yet and only the server's address is printed.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from pathlib import Path

from stages.common.tracking import store


def pages(base: str, uri: str, root: Path | None = None) -> list[str]:
    """The pages to open, in order; before each sweep's two a line `sweep <name>: ...` (not a page). `root`:
    the repository whose params.yaml declares the sweeps (the points one sweep shares with another)."""
    import mlflow

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return [base]  # no stage ran: nothing to show yet (and no empty store to create)
    exp = mlflow.MlflowClient(uri).get_experiment_by_name(store.EXPERIMENT)
    if exp is None:
        return [base]
    found = [store.view_url(base, exp.experiment_id), f"{base}/#/models?{store.UI_QUERY}"]
    homes = {}
    if root is not None and (root / "params.yaml").is_file():
        from stages.common import config, sweep

        try:
            declared = config.read_yaml(root / "params.yaml")
            homes = sweep.homes(sweep.load(declared), declared)
        except config.ConfigError:  # (a declaration being edited: each sweep's own points still show)
            homes = {}
    for name, (parent, compare) in sweep_pages(mlflow.MlflowClient(uri), base, exp.experiment_id, homes).items():
        found += [f"sweep {name}: its parent run, then the compare view of its points", parent, compare]
    return found


def sweep_pages(client, base: str, experiment_id: str, homes: dict | None = None) -> dict[str, tuple[str, str]]:
    """{sweep: (its parent run's page, the compare view of its points)}: per point its newest finished run;
    a point an earlier sweep runs (`homes`: stages.common.sweep.homes of params.yaml), that sweep's run of it."""
    parents = client.search_runs(
        [experiment_id], "tags.pipeline_role = 'parent' and tags.pipeline_run LIKE 'sweep-%'", max_results=1000
    )
    found = {}
    for parent in parents:
        name = parent.data.tags["pipeline_run"].removeprefix("sweep-")
        runs = client.search_runs(
            [experiment_id],
            f"tags.mlflow.parentRunId = '{parent.info.run_id}' and attributes.status = 'FINISHED'",
            max_results=5000,
            order_by=["attributes.start_time DESC"],
        )
        points: dict[str, str] = {}
        for run in runs:
            if "sweep.point" in run.data.tags and run.data.tags.get("stage") != "sweep_compare":
                points.setdefault(run.data.tags["sweep.point"], run.info.run_id)
        for point, (sweep, there) in ((homes or {}).get(name) or {}).items():
            if sweep != name:
                newest = client.search_runs(
                    [experiment_id],
                    f"tags.sweep = '{sweep}' and tags.`sweep.point` = '{there}' and attributes.status = 'FINISHED'",
                    max_results=1,
                    order_by=["attributes.start_time DESC"],
                )
                if newest:
                    points[point] = newest[0].info.run_id
        query = urllib.parse.urlencode(
            {
                "runs": json.dumps(list(points.values()), separators=(",", ":")),
                "experiments": json.dumps([experiment_id]),
            }
        )
        found[name] = (
            f"{base}/#/experiments/{experiment_id}/runs/{parent.info.run_id}?{store.UI_QUERY}",
            f"{base}/#/compare-runs?{query}",
        )
    return found


def main() -> None:
    port = sys.argv[1] if len(sys.argv) > 1 else "5000"
    uri = sys.argv[2] if len(sys.argv) > 2 else store.tracking_uri(Path.cwd())
    base = f"http://127.0.0.1:{port}"
    try:
        found = pages(base, uri, Path.cwd())
    except Exception as e:  # noqa: BLE001 - the server starts anyway; say why there are no links
        found = [base]
        print(f"(no experiment links: {uri} could not be read: {type(e).__name__})", flush=True)
    for page in found:
        print(page if page.startswith("sweep ") else f"open {page}", flush=True)


if __name__ == "__main__":
    main()
