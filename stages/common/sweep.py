"""A sweep: one stage run at every point of a grid of its params, the points compared by one metric.

Declared in params.yaml's `sweeps` section, one entry per sweep:

    sweeps:
      lr:                           # the sweep's name
        stage: pretrain             # a stage of pipelines/stages.yaml that runs once (no foreach)
        grid:                       # keys of that stage's params section: each combination is a point
          train.lr: [1.0e-3, 3.0e-3, 1.0e-2]
        metric: final_val_loss      # a key of the stage's metrics.json (a.b for nested ones)
        goal: min                   # min | max: which point is best
      warmup:
        stage: pretrain
        points:                     # instead of a grid: the points themselves, each giving the same keys
          - {train.lr: 1.0e-3, train.warmup_steps: 2}
          - {train.lr: 3.0e-3, train.warmup_steps: 8}
        metric: final_val_loss
        goal: min

The DAG (pipelines/dag.py) makes two stages of it for both tools: `sweep_<name>@<point>`, the stage once
per point, each with its own output folder data/sweeps/<name>/<point> and its own record in dvc.lock, and
`sweep_<name>_compare`, the table and plot of the points (stages.sweep_compare). A point's name is its
values joined by "-" (0.001, or 0.001-10 for two keys), the key of its entry in DVC's `foreach`; the points
run in the order of the grid's keys and values, or of the list.

Two sweeps of one stage share the points they have in common (`homes`): a point of a later sweep (in
params.yaml's order) with which the stage would run exactly as at a point of an earlier one (its params
section, the point's values set, equal: 1 and 1.0 alike) is that point, run once by the earlier sweep's
stage; the later sweep's comparison reads it from there. So the `warmup` sweep above runs its first point
only if pretrain's warmup_steps is not 2 in params.yaml.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from stages.common.config import ConfigError, UserError, flatten

GOALS = ("min", "max")
NAME = re.compile(r"[a-z][a-z0-9_]*")
KEY = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*")
VALUE = re.compile(r"[A-Za-z0-9_.+-]+")  # what a point's name, a folder and a wildcard may hold


@dataclass(frozen=True)
class Sweep:
    name: str
    stage: str
    grid: tuple[tuple[str, tuple], ...]  # (params key of the stage's section, its values), in declared order
    metric: str
    goal: str
    # The `points` form: each point's values in the order of grid's keys (whose values are then the distinct
    # ones, in order of appearance); empty for a grid, whose points are every combination.
    listed: tuple[tuple, ...] = ()

    def aliases(self) -> dict[str, str]:
        """{params key: its name in a point's DVC foreach item}: the key's last part, or the whole key with
        "_" for "." where two keys end alike."""
        last = [key.rpartition(".")[2] for key, _ in self.grid]
        return {
            key: (short if last.count(short) == 1 else key.replace(".", "_"))
            for (key, _), short in zip(self.grid, last, strict=True)
        }

    def points(self) -> dict[str, dict[str, object]]:
        """{point name: {params key: value}}: the listed points, or every combination of the grid's values,
        the last key's changing fastest."""
        keys = [key for key, _ in self.grid]
        out = {}
        for combination in self.listed or itertools.product(*(values for _, values in self.grid)):
            out["-".join(as_text(v) for v in combination)] = dict(zip(keys, combination, strict=True))
        return out


def as_text(value) -> str:
    """A value as DVC writes it into a command and a stage name (`true`/`false` for booleans)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def load(params: dict, stages: set[str] | None = None, where: str = "params.yaml") -> dict[str, Sweep]:
    """The sweeps of params.yaml's `sweeps` section (empty when there is none), each checked: a bad entry is
    one ConfigError naming the key and the fix. `stages`: the stages a sweep may name (those of the table
    that run once)."""
    section = params.get("sweeps") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: sweeps must be a mapping of sweep name -> {{stage, grid, metric, goal}}")
    return {name: check(name, entry, stages, where) for name, entry in section.items()}


def check(name, entry, stages: set[str] | None, where: str) -> Sweep:
    at = f"{where}: sweeps.{name}"
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"{at}: a sweep's name is lower-case letters, digits and _, starting with a letter")
    form = set(entry) - {"stage", "metric", "goal"} if isinstance(entry, dict) else set()
    if not isinstance(entry, dict) or len(entry) - len(form) != 3 or form not in ({"grid"}, {"points"}):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ConfigError(f"{at}: give stage, metric, goal and one of grid or points (got {got})")
    stage = entry["stage"]
    if stages is not None and stage not in stages:
        raise ConfigError(f"{at}.stage: {stage!r} is not a stage that runs once; valid: {', '.join(sorted(stages))}")
    if "grid" in entry:
        grid, listed = check_grid(f"{at}.grid", stage, entry["grid"]), ()
    else:
        grid, listed = check_points(f"{at}.points", stage, entry["points"])
    metric, goal = entry["metric"], entry["goal"]
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"{at}.metric: a key of the {stage} stage's metrics.json, e.g. final_val_loss")
    if goal not in GOALS:
        raise ConfigError(f"{at}.goal: {goal!r}; valid: {', '.join(GOALS)}")
    return Sweep(name, stage, grid, metric, goal, listed)


def check_key(at: str, stage: str, key) -> None:
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise ConfigError(f"{at}: {key!r} is not a key of the {stage} section (e.g. train.lr)")
    if key.split(".")[0] == stage:
        raise ConfigError(f"{at}: {key}: name the key inside the {stage} section, without {stage}.")


def check_value(at: str, v) -> None:
    if not isinstance(v, (bool, int, float, str)) or not VALUE.fullmatch(as_text(v)):
        raise ConfigError(
            f"{at}: {v!r}: a value is a number, true/false or a word of letters, digits, '.', '+' and '_'"
        )


def same(v):
    """What makes two values one point: 1 and 1.0 alike."""
    return as_text(v) if isinstance(v, (bool, str)) else float(v)


def check_grid(at: str, stage: str, grid) -> tuple:
    if not isinstance(grid, dict) or not grid:
        raise ConfigError(f"{at}: a mapping of params key -> list of values, e.g. {{train.lr: [0.001, 0.003]}}")
    pairs = []
    for key, values in grid.items():
        check_key(at, stage, key)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{at}.{key}: a non-empty list of values, e.g. [0.001, 0.003]")
        for v in values:
            check_value(f"{at}.{key}", v)
        if len({same(v) for v in values}) != len(values):
            raise ConfigError(f"{at}.{key}: the values {[as_text(v) for v in values]} repeat one")
        pairs.append((key, tuple(values)))
    return tuple(pairs)


def check_points(at: str, stage: str, points) -> tuple[tuple, tuple]:
    """(grid: each key with its distinct values in order, the points' values in the keys' order)."""
    if not isinstance(points, list) or not points or not all(isinstance(p, dict) and p for p in points):
        raise ConfigError(
            f"{at}: a non-empty list of points, each a mapping of params key -> value, "
            f"e.g. [{{train.lr: 0.001, train.warmup_steps: 2}}, {{train.lr: 0.003, train.warmup_steps: 8}}]"
        )
    keys = list(points[0])
    for key in keys:
        check_key(at, stage, key)
    rows, seen = [], {}
    for i, point in enumerate(points):
        if set(point) != set(keys):
            raise ConfigError(f"{at}[{i}]: the keys {sorted(point)}; every point gives the keys of the first: {keys}")
        for key in keys:
            check_value(f"{at}[{i}].{key}", point[key])
        row = tuple(point[key] for key in keys)
        found = seen.setdefault(tuple(same(v) for v in row), i)
        found = seen.setdefault("-".join(as_text(v) for v in row), found)  # (its name: "1" and 1 alike)
        if found != i:
            raise ConfigError(f"{at}[{i}]: the same point as {at.rpartition(': ')[2]}[{found}]; give each point once")
        rows.append(row)
    grid = tuple((key, tuple({same(r[k]): r[k] for r in rows}.values())) for k, key in enumerate(keys))
    return grid, tuple(rows)


def homes(sweeps: dict[str, Sweep], params: dict) -> dict[str, dict[str, tuple[str, str]]]:
    """{sweep: {point: (the sweep whose stage runs it, its name there)}}, every point of every sweep: its own
    sweep and name, or those of the first earlier sweep of the same stage with a point at which the stage
    runs with the same params (its section of `params`, flattened, with the point's values set)."""
    first: dict[tuple, tuple[str, str]] = {}
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for sw in sweeps.values():
        section = params.get(sw.stage)
        base = flatten(section) if isinstance(section, dict) else {}
        out[sw.name] = {}
        for point, values in sw.points().items():
            ran = {**base, **values}
            key = (sw.stage, json.dumps({k: same_param(v) for k, v in ran.items()}, sort_keys=True))
            out[sw.name][point] = first.setdefault(key, (sw.name, point))
    return out


def same_param(v):
    """`same` for a value of a params section, which may also be a list, a mapping or null."""
    if isinstance(v, (list, tuple)):
        return [same_param(x) for x in v]
    if isinstance(v, dict):
        return {str(k): same_param(x) for k, x in v.items()}
    return v if v is None else same(v)


def point_stage(home: tuple[str, str]) -> str:
    """The DAG stage that runs a point, from its home (sweep, point): sweep_<sweep>@<point>."""
    return f"sweep_{home[0]}@{home[1]}"


def point_folder(home: tuple[str, str]) -> str:
    """A point's output folder, from its home (sweep, point): data/sweeps/<sweep>/<point>."""
    return f"data/sweeps/{home[0]}/{home[1]}"


def read_metric(sw: Sweep, point: str, folder: Path, who: str, stage: str = "") -> float:
    """The sweep's metric in the point's metrics.json (a.b for a nested key); NaN stays NaN. `stage`: the
    stage that runs the point (default: the sweep's own, sweep_<name>@<point>)."""
    stage = stage or point_stage((sw.name, point))
    path = folder / "metrics.json"
    if not path.is_file():
        raise UserError(f"{who}: {path} not found; run the sweep's point first: dvc repro {stage}")
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{who}: {path} is not JSON ({e}); run {stage} again") from None
    flat = flatten(doc) if isinstance(doc, dict) else {}
    if sw.metric not in flat:
        raise UserError(
            f"{who}: {path} has no {sw.metric} (sweeps.{sw.name}.metric); its keys: {', '.join(flat) or 'none'}"
        )
    value = flat[sw.metric]
    if value is None:  # (a writer of strict JSON writes NaN as null)
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(
            f"{who}: {path}: {sw.metric} is {value!r}, not a number; set sweeps.{sw.name}.metric to a numeric key"
        )
    return float(value)
