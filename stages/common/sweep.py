"""A sweep: one stage run at every point of a grid of its params, the points compared by one metric.

Declared in params.yaml's `sweeps` section, one entry per sweep:

    sweeps:
      lr:                           # the sweep's name
        stage: pretrain             # a stage of pipelines/stages.yaml that runs once (no foreach)
        grid:                       # keys of that stage's params section: each combination is a point
          train.lr: [1.0e-3, 3.0e-3, 1.0e-2]
        metric: final_val_loss      # a key of the stage's metrics.json (a.b for nested ones)
        goal: min                   # min | max: which point is best

The DAG (pipelines/dag.py) makes two stages of it for both tools: `sweep_<name>@<point>`, the stage once
per point, each with its own output folder data/sweeps/<name>/<point> and its own record in dvc.lock, and
`sweep_<name>_compare`, the table and plot of the points (stages.sweep_compare). A point's name is its
values joined by "-", as DVC names the stages of a `matrix` (0.001, or 0.001-10 for two keys); the
points run in the order of the grid's keys and values.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from stages.common.config import ConfigError

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

    def aliases(self) -> dict[str, str]:
        """{params key: the name DVC's matrix gives its values}: the key's last part, or the whole key with
        "_" for "." where two keys end alike."""
        last = [key.rpartition(".")[2] for key, _ in self.grid]
        return {
            key: (short if last.count(short) == 1 else key.replace(".", "_"))
            for (key, _), short in zip(self.grid, last, strict=True)
        }

    def points(self) -> dict[str, dict[str, object]]:
        """{point name: {params key: value}}, every combination of the grid's values in DVC's order."""
        keys = [key for key, _ in self.grid]
        out = {}
        for combination in itertools.product(*(values for _, values in self.grid)):
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
    if not isinstance(entry, dict) or set(entry) != {"stage", "grid", "metric", "goal"}:
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ConfigError(f"{at}: give exactly stage, grid, metric and goal (got {got})")
    stage = entry["stage"]
    if stages is not None and stage not in stages:
        raise ConfigError(f"{at}.stage: {stage!r} is not a stage that runs once; valid: {', '.join(sorted(stages))}")
    grid = entry["grid"]
    if not isinstance(grid, dict) or not grid:
        raise ConfigError(f"{at}.grid: a mapping of params key -> list of values, e.g. {{train.lr: [0.001, 0.003]}}")
    pairs = []
    for key, values in grid.items():
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise ConfigError(f"{at}.grid: {key!r} is not a key of the {stage} section (e.g. train.lr)")
        if key.split(".")[0] == stage:
            raise ConfigError(f"{at}.grid: {key}: name the key inside the {stage} section, without {stage}.")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{at}.grid.{key}: a non-empty list of values, e.g. [0.001, 0.003]")
        for v in values:
            if not isinstance(v, (bool, int, float, str)) or not VALUE.fullmatch(as_text(v)):
                raise ConfigError(
                    f"{at}.grid.{key}: {v!r}: a value is a number, true/false or a word of letters, digits, "
                    f"'.', '+' and '_'"
                )
        texts = [as_text(v) for v in values]
        distinct = {as_text(v) if isinstance(v, (bool, str)) else float(v) for v in values}  # (1 and 1.0 alike)
        if len(distinct) != len(texts):
            raise ConfigError(f"{at}.grid.{key}: the values {texts} repeat one")
        pairs.append((key, tuple(values)))
    metric, goal = entry["metric"], entry["goal"]
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"{at}.metric: a key of the {stage} stage's metrics.json, e.g. final_val_loss")
    if goal not in GOALS:
        raise ConfigError(f"{at}.goal: {goal!r}; valid: {', '.join(GOALS)}")
    return Sweep(name, stage, tuple(pairs), metric, goal)
