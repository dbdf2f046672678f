"""sweep_compare: the points of a sweep side by side, and the best one by the sweep's metric.

Reads the sweep's declaration in params.yaml (`sweeps.<name>`: stage, grid, metric, goal; see
stages.common.sweep) and the swept stage's metrics.json at every point, and writes:

    table.md, table.csv     one row per point, in the sweep's order: its grid values and the metric,
                            the best point marked
    figures.json            every point's values and metric, and the best point
    metrics.json            the best point, its metric, and how many points (DVC metrics)
    meta.json               the code and environment that made it
    plots/<metric>.png      the metric against the first grid key, one line per combination of the others

The best point has the lowest metric (goal: min) or the highest (max); of equal ones the first in the
sweep's order, and a point whose metric is NaN is never best.

Run:
    python -m stages.sweep_compare --sweep lr --points 0.001=data/sweeps/lr/0.001 0.003=data/sweeps/lr/0.003 \\
        --output data/sweeps/lr/compare
    snakemake --cores all sweep_lr_compare    # or: dvc repro sweep_lr_compare
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
from pathlib import Path

from stages.common import atomic, config, digest, environment, stage, sweep
from stages.common.tracking import runs

STAGE = "sweep_compare"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--sweep", required=True, help="the sweep's name in params.yaml's sweeps section")
    parser.add_argument(
        "--points",
        nargs="+",
        metavar="POINT=FOLDER",
        help="every point's output folder (default: data/sweeps/<sweep>/<point>)",
    )
    parser.add_argument("--output", help="default: data/sweeps/<sweep>/compare")
    return parser.parse_args(argv)


def point_folders(sw: sweep.Sweep, given: list[str] | None, homes: dict | None = None) -> dict[str, Path]:
    """{point: its folder}, in the sweep's order; --points must name every point of the sweep, once. Without
    it, a point's folder is data/sweeps/<sweep>/<point> of the sweep that runs it (`homes`, by default its own:
    stages.common.sweep.homes)."""
    points = list(sw.points())
    if given is None:
        return {p: Path(sweep.point_folder((homes or {}).get(p, (sw.name, p)))) for p in points}
    folders: dict[str, Path] = {}
    for item in given:
        name, sep, folder = item.partition("=")
        if not sep or not folder:
            raise config.UserError(
                f"{STAGE}: --points {item}: give each point as POINT=FOLDER, "
                f"e.g. {points[0]}=data/sweeps/{sw.name}/{points[0]}"
            )
        if name not in points:
            raise config.UserError(
                f"{STAGE}: --points names point {name}, which sweep {sw.name} does not have; "
                f"its points: {', '.join(points)}"
            )
        if name in folders:
            raise config.UserError(f"{STAGE}: --points names point {name} twice; give each point once")
        folders[name] = Path(folder)
    missing = [p for p in points if p not in folders]
    if missing:
        raise config.UserError(
            f"{STAGE}: --points misses point {missing[0]} of sweep {sw.name}; pass every point: {', '.join(points)}"
        )
    return {p: folders[p] for p in points}


def read_metric(sw: sweep.Sweep, point: str, folder: Path, home: tuple[str, str] | None = None) -> float:
    return sweep.read_metric(sw, point, folder, STAGE, sweep.point_stage(home or (sw.name, point)))


def best_point(values: dict[str, float], goal: str) -> str | None:
    """The point of the lowest (min) or highest (max) value; the first of equal ones; never a NaN one."""
    best = None
    for point, v in values.items():
        if math.isnan(v):
            continue
        if best is None or (v < values[best] if goal == "min" else v > values[best]):
            best = point
    return best


def render(sw: sweep.Sweep, rows: list[dict]) -> str:
    keys = [key for key, _ in sw.grid]
    lines = [
        f"# Sweep {sw.name}: {sw.stage}, {sw.metric} ({sw.goal} is best)",
        "",
        "| point | " + " | ".join(keys) + f" | {sw.metric} | best |",
        "|---|" + "---|" * (len(keys) + 2),
    ]
    for r in rows:
        values = " | ".join(sweep.as_text(r["values"][k]) for k in keys)
        lines.append(f"| {r['point']} | {values} | {r['metric']:.6g} | {'best' if r['best'] else ''} |")
    own = f"sweep_{sw.name}"
    shared = [f"{r['point']} by {r['stage']}" for r in rows if r.get("stage") and r["stage"].partition("@")[0] != own]
    if shared:
        lines += ["", f"Run for an earlier sweep of {sw.stage} and read from there: {', '.join(shared)}."]
    lines += [
        "",
        f"In MLflow: each point's run under the sweep's parent run `pipeline sweep-{sw.name}` (tag "
        f"`pipeline_run = sweep-{sw.name}`); `make mlflow-ui` prints its page and the compare view of the points.",
    ]
    return "\n".join(lines) + "\n"


def plot(sw: sweep.Sweep, rows: list[dict], best: str | None, folder: Path) -> dict:
    """The metric against the first grid key, one line per combination of the other keys' values (labelled
    key=value, ...), the best point starred. Returns {"x_scale", "lines": their labels}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (x_key, xs), others = sw.grid[0], sw.grid[1:]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in xs)
    position = {sweep.as_text(v): (v if numeric else i) for i, v in enumerate(xs)}
    by_point = {r["point"]: r for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = []
    for combination in itertools.product(*(values for _, values in others)):
        line = [
            r
            for r in rows
            if all(
                sweep.as_text(r["values"][k]) == sweep.as_text(v) for (k, _), v in zip(others, combination, strict=True)
            )
        ]
        label = ", ".join(f"{k}={sweep.as_text(v)}" for (k, _), v in zip(others, combination, strict=True)) or sw.metric
        ax.plot(
            [position[sweep.as_text(r["values"][x_key])] for r in line],
            [r["metric"] for r in line],
            marker="o",
            label=label,
        )
        labels.append(label)
    if best is not None:
        r = by_point[best]
        x = position[sweep.as_text(r["values"][x_key])]
        ax.plot([x], [r["metric"]], marker="*", markersize=16, color="crimson", linestyle="none", label=f"best: {best}")
        ax.annotate(
            f"best {best}\n{r['metric']:.4g}", (x, r["metric"]), textcoords="offset points", xytext=(8, 8), fontsize=8
        )
    if numeric and min(xs) > 0 and max(xs) > 10 * min(xs):
        ax.set_xscale("log")
    if not numeric:
        ax.set_xticks(range(len(xs)), [sweep.as_text(v) for v in xs])
    ax.set(xlabel=x_key, ylabel=sw.metric, title=f"Sweep {sw.name} of {sw.stage} ({sw.goal} is best)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', sw.metric)}.png", dpi=110)
    scale = ax.get_xscale()
    plt.close(fig)
    return {"x_scale": scale, "lines": labels}


def write_compare(folder: Path, sw: sweep.Sweep, rows: list[dict], best: str | None) -> dict:
    keys = [key for key, _ in sw.grid]
    (folder / "table.md").write_text(render(sw, rows), encoding="utf-8")
    with open(folder / "table.csv", "w") as fh:
        fh.write(",".join(["point", *keys, sw.metric]) + "\n")
        fh.writelines(
            ",".join([r["point"], *(sweep.as_text(r["values"][k]) for k in keys), str(r["metric"])]) + "\n"
            for r in rows
        )
    figures = {
        "sweep": sw.name,
        "stage": sw.stage,
        "metric": sw.metric,
        "goal": sw.goal,
        "points": {r["point"]: {"values": r["values"], "metric": r["metric"]} for r in rows},
        "best": best,
    }
    value = next((r["metric"] for r in rows if r["point"] == best), math.nan)
    stage.write_metrics(folder, figures, {"best_point": best, sw.metric: value, "points": len(rows)})
    atomic.write_json(folder / "meta.json", {"sweep": sw.name, **stage.code_record(STAGE)})
    return plot(sw, rows, best, folder / "plots")


def metric_key(name: str) -> str:
    """`name` as an MLflow metric key: a character MLflow refuses (the + of 1e+20) becomes _."""
    return re.sub(r"[^\w.\- /]", "_", name)


def main(argv=None) -> dict:
    args = parse_args(argv)
    params = config.read_yaml(args.params)
    sweeps = sweep.load(params, where=args.params)
    if args.sweep not in sweeps:
        raise config.UserError(
            f"{args.params}: sweeps has no sweep {args.sweep!r} (declared: {', '.join(sweeps) or 'none'}); "
            f"declare it under sweeps or pass --sweep with a declared one"
        )
    sw = sweeps[args.sweep]
    output = Path(args.output or f"data/sweeps/{sw.name}/compare")
    homes = sweep.homes(sweeps, params)[sw.name]
    folders = point_folders(sw, args.points, homes)
    metrics = {p: read_metric(sw, p, folder, homes[p]) for p, folder in folders.items()}
    best = best_point(metrics, sw.goal)
    rows = [
        {"point": p, "values": values, "metric": metrics[p], "best": p == best, "stage": sweep.point_stage(homes[p])}
        for p, values in sw.points().items()
    ]
    declared = {
        "name": sw.name,
        "stage": sw.stage,
        "metric": sw.metric,
        "goal": sw.goal,
        "grid": "; ".join(f"{k}: {', '.join(sweep.as_text(v) for v in vs)}" for k, vs in sw.grid),
    }

    def body(rt, stop):
        drawn = {}
        if rt.is_main:
            inputs_hash = digest.hash_files([folder / "metrics.json" for folder in folders.values()])
            tags = {"sweep": sw.name, **environment.run_tags(STAGE)}
            with runs.start_run(STAGE, declared, inputs_hash, rt, tags=tags) as tracker:
                with atomic.folder(output) as tmp:
                    drawn = write_compare(tmp, sw, rows, best)
                tracker.log_metrics({metric_key(f"{r['point']}.{sw.metric}"): r["metric"] for r in rows})
                if best is not None:
                    tracker.log_metrics({metric_key(f"best.{sw.metric}"): metrics[best]})
                tracker.log_artifact(output / "table.md", None)
                tracker.log_artifact(output / "plots", "plots")
            said = (
                f"best {best} ({sw.metric} {metrics[best]:.6g}, {sw.goal})"
                if best is not None
                else f"no best (every {sw.metric} is nan)"
            )
            print(f"{STAGE}: {sw.name}: {said} of {len(rows)} points -> {output}/table.md")
        return {"rows": rows, "best": best, "plot": drawn}

    return stage.launch(STAGE, body)


if __name__ == "__main__":
    stage.entry(main)
