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


def pages(base: str, uri: str) -> list[str]:
    import mlflow

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return [base]  # no stage ran: nothing to show yet (and no empty store to create)
    exp = mlflow.MlflowClient(uri).get_experiment_by_name(store.EXPERIMENT)
    if exp is None:
        return [base]
    found = [store.view_url(base, exp.experiment_id), f"{base}/#/models?{store.UI_QUERY}"]
    for parent, compare in sweep_pages(mlflow.MlflowClient(uri), base, exp.experiment_id).values():
        found += [parent, compare]
    return found


def sweep_pages(client, base: str, experiment_id: str) -> dict[str, tuple[str, str]]:
    """{sweep: (its parent run's page, the compare view of its points)}: per point its newest finished run."""
    parents = client.search_runs(
        [experiment_id], "tags.pipeline_role = 'parent' and tags.pipeline_run LIKE 'sweep-%'", max_results=1000
    )
    found = {}
    for parent in parents:
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
        query = urllib.parse.urlencode(
            {
                "runs": json.dumps(list(points.values()), separators=(",", ":")),
                "experiments": json.dumps([experiment_id]),
            }
        )
        name = parent.data.tags["pipeline_run"].removeprefix("sweep-")
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
        found = pages(base, uri)
    except Exception as e:  # noqa: BLE001 - the server starts anyway; say why there are no links
        found = [base]
        print(f"(no experiment links: {uri} could not be read: {type(e).__name__})", flush=True)
    for page in found:
        print(f"open {page}", flush=True)


if __name__ == "__main__":
    main()
