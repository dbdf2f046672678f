"""Where a sweep stands, point by point, also while a point has failed and its comparison cannot run:

    python -m pipelines.sweep            # every sweep of params.yaml
    python -m pipelines.sweep lr         # one sweep

For each point: `current` with its metric (dvc.lock holds its record and DVC finds nothing changed), else
the state of its newest MLflow run, `FAILED` with the cause the run was tagged with (a diverged loss, a
refused input), `KILLED`, `RUNNING`, or `out of date` / `not run`. A point an earlier sweep of the same
stage runs too (stages.common.sweep.homes) is that sweep's stage, named beside it. The comparison stage
(stages.sweep_compare) runs once every point is current; until then, this is the table of the sweep.
Exit 0 when every point is current, 1 when one is not.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from pipelines.sync import dvc_status, is_stale
from stages.common import config, sweep
from stages.common.tracking import store


def newest_runs(name: str, root: Path) -> dict[str, object]:
    """{point: its newest MLflow run} of sweep `name`; {} with tracking off or no store yet."""
    uri = store.tracking_uri(root)
    if store.tracking_off() or (uri.startswith("sqlite:") and not Path(uri.removeprefix("sqlite:///")).exists()):
        return {}
    client = store.open_client(root)
    exp = client.get_experiment_by_name(store.EXPERIMENT)
    if exp is None:
        return {}
    runs = client.search_runs(
        [exp.experiment_id], f"tags.sweep = '{name}'", max_results=5000, order_by=["attributes.start_time DESC"]
    )
    newest: dict[str, object] = {}
    for run in runs:
        if run.data.tags.get("stage") != "sweep_compare":
            newest.setdefault(run.data.tags.get("sweep.point"), run)
    return newest


def point_states(
    sw: sweep.Sweep, root: Path, status: dict | None, runs, homes: dict[str, tuple[str, str]] | None = None
) -> list[dict]:
    """One row per point: point, values, stage (the DAG's that runs it), state, metric (current points), cause
    (failed ones). `runs`: {point: newest run} of the sweep, or a function of a sweep's name giving that;
    `homes`: {point: (sweep, point)} where a point is run (stages.common.sweep.homes; default: its own)."""
    homes = homes or {p: (sw.name, p) for p in sw.points()}
    runs_of = runs if callable(runs) else (lambda name: runs if name == sw.name else {})

    recorded = set()
    lock = root / "dvc.lock"
    if lock.is_file():
        import yaml

        recorded = set((yaml.safe_load(lock.read_text()) or {}).get("stages", {}))
    rows = []
    for point, values in sw.points().items():
        home = homes[point]
        stage, folder = sweep.point_stage(home), root / sweep.point_folder(home)
        row = {"point": point, "values": values, "stage": stage, "state": "not run", "metric": None, "cause": ""}
        current = stage in recorded and status is not None and not is_stale(status.get(stage, []))
        if current and (folder / "metrics.json").is_file():
            row["state"] = "current"
            try:
                row["metric"] = sweep.read_metric(sw, point, folder, "pipelines.sweep", stage)
            except config.UserError as e:
                row["cause"] = str(e)
        else:
            run = runs_of(home[0]).get(home[1])
            if run is not None and run.info.status != "FINISHED":
                row["state"] = run.info.status
                row["cause"] = run.data.tags.get("failure_cause", "")
                row["run_id"] = run.info.run_id
            elif stage in recorded:
                row["state"] = "out of date"
        rows.append(row)
    return rows


def render(sw: sweep.Sweep, rows: list[dict]) -> str:
    keys = [key for key, _ in sw.grid]
    done = sum(r["state"] == "current" for r in rows)
    lines = [
        f"sweep {sw.name}: {sw.stage}, {sw.metric} ({sw.goal} is best); {done} of {len(rows)} points current",
        "",
        "| point | " + " | ".join(keys) + f" | state | {sw.metric} | cause |",
        "|---|" + "---|" * (len(keys) + 3),
    ]
    for r in rows:
        values = " | ".join(sweep.as_text(r["values"][k]) for k in keys)
        metric = "" if r["metric"] is None else f"{r['metric']:.6g}"
        cause = r["cause"].replace("|", "\\|").replace("\n", " ")
        elsewhere = r.get("stage") and r["stage"].partition("@")[0] != f"sweep_{sw.name}"
        point = f"{r['point']} ({r['stage']})" if elsewhere else r["point"]
        lines.append(f"| {point} | {values} | {r['state']} | {metric} | {cause} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="sweeps of params.yaml's sweeps section (default: all)")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    root = Path.cwd()
    try:
        params = config.read_yaml(root / "params.yaml")
        sweeps = sweep.load(params)
        unknown = [n for n in args.names if n not in sweeps]
        if unknown:
            raise config.UserError(
                f"no sweep {unknown[0]} in params.yaml's sweeps section; declared: {', '.join(sweeps) or 'none'}"
            )
    except config.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chosen = [sweeps[n] for n in args.names or sweeps]
    if not chosen:
        print("params.yaml declares no sweep (its sweeps section; docs/sweeps.md)")
        return 0
    status = dvc_status(root)
    homes = sweep.homes(sweeps, params)
    runs_of = functools.cache(lambda name: newest_runs(name, root))  # (a sweep's runs, read once)
    tables, every = [], []
    for sw in chosen:
        rows = point_states(sw, root, status, runs_of, homes[sw.name])
        every += [{"sweep": sw.name, **r} for r in rows]
        tables.append(render(sw, rows))
    print(json.dumps(every, indent=1, default=str) if args.json else "\n".join(tables), end="")
    return 0 if all(r["state"] == "current" for r in every) else 1


if __name__ == "__main__":
    sys.exit(main())
