"""report: collect every stage's metrics, reproduced results and plots into reports/results.{md,json}.

reports/ is a function of the stage outputs it reads, the params and the code (no commit, no timing),
so a re-run of an unchanged pipeline writes it byte for byte. What the stages measured (--measured-inputs:
measured/<stage>.json, throughput, seconds, peak memory, and the rows that check measured figures) is
collected into --measured (measured/report.json) instead, which results.md points to.

Each stage's output folder may hold
    figures.json   every figure of the stage (shown in the report; eval_perplexity's hold the perplexities
                   the regression check reads)
    metrics.json   the stage's headline figures (its DVC metrics), read where there is no figures.json
    results.json   a list of reproduced results, one object per row with the keys
                   result, paper, published, ours, tolerance, and optionally
                     relation  "=" (the default: |ours - published| <= tolerance), ">=" (ours >=
                               published - tolerance) or "<=" (ours <= published + tolerance), for
                               findings that are bounds rather than figures
                     data      names of the raw files the row depends on (keys of prepare_data's
                               meta.json `files`)
                     spread    for figures that are means over runs (seeds): {"n", "sd", "published_n",
                               "published_sd"} (published_sd null where the paper gives none); the row
                               then passes by the spread rule below, and `tolerance` is the fallback
                               used only where no spread can be estimated
    plots/*.png    figures, linked from the report

Every row of the report has one schema (ROW_FIELDS): result, paper, relation, published figure,
ours, tolerance, pass (ours against published under the relation), stage, data hashes, spread. (The
commit that made the outputs is in each stage's MLflow run and its registered models' lineage.)

Spread rule (SPREAD_RULE): a mean over our n runs with standard deviation sd, against a paper's mean over
its n_p runs with deviation sd_p, passes when |ours - published| <= t * sqrt(sd^2/n + sd_p^2/n_p), t the
99.5% quantile of Student's t with the Welch-Satterthwaite degrees of freedom: Welch's two-sided test at
the 1% level, whether the two means could come from one distribution of runs, without assuming equal
spreads or run counts: a faithful reproduction fails one report in a hundred. Where the paper gives no
deviation its runs are assumed to spread as ours do (the spread is the method's, under the same
protocol), and the degrees of freedom are then our runs' less one (one estimate of the spread). With
fewer than MIN_RUNS runs of ours the spread is not estimated (t explodes as the degrees of freedom fall,
so any mean would pass), nor where both deviations are 0: the row's fixed tolerance applies. The row says
which (`spread.rule`, `spread.assumed`). The rule covers run-to-run noise only: a systematic difference
between implementations fails it, as it should.
A stage run once per item (data/<stage>/<item>, e.g. finetune_qlora/nf4 and finetune_qlora/none)
also gets a comparison table: the metrics its items share, one column per item.

Regression: our own perplexities (every model and context of the eval_perplexity stages) against the
values recorded from an earlier run with the same params (`recorded`, pipelines/recorded.yaml; a
record is keyed by a hash of the params sections that determine the perplexities, REGRESSION_SECTIONS;
with another base model than the pipeline's own pretrain, params.yaml's `base` section stands in for
`pretrain`'s, so a run on a hub model never compares with a record of the own pretrain, nor with one of
another hub model or revision).
Each becomes a row of the same schema, within `regression_tolerance` (relative) of the recorded value.
Without a record for these params, the report names the nearest record and the settings that differ
(records keep their params sections). After a change meant to move them: `python -m pipelines.record`.

Registry: with MLflow tracking on, every model whose rows all pass (a stage's rows are about its model,
a regression row about the model it evaluated) gets the alias `reproduced` in the MLflow model registry,
on the version registered from the very output folder this report read (stages/common/registry.py).

Run:
    python -m stages.report --output reports --inputs data/prepare_data data/tokenize ...
    snakemake --cores all report              # or: dvc repro report
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from stages.common import atomic, config, digest, environment, registry, runtime, stage
from stages.common.tracking import runs

STAGE = "report"
ROW_FIELDS = (
    "result",
    "paper",
    "relation",
    "published",
    "ours",
    "tolerance",
    "pass",
    "stage",
    "data_hashes",
    "spread",
)
SPREAD_RULE = "Welch t, 1% two-sided"
SPREAD_KEYS = ("n", "sd", "published_n", "published_sd")
MIN_RUNS = 5  # runs of ours below which the spread rule is not applied (t(0.995, 4) = 4.6 already)
ROW_INPUT_FIELDS = ("result", "paper", "published", "ours", "tolerance")
RELATIONS = {
    "=": lambda ours, published, tol: abs(ours - published) <= tol,
    ">=": lambda ours, published, tol: ours >= published - tol,
    "<=": lambda ours, published, tol: ours <= published + tol,
}


# The params sections that determine the eval_perplexity stages' numbers; with base.model set, `base` (the
# model and its revision) stands where `pretrain` does, which is then not in the DAG.
REGRESSION_SECTIONS = ("prepare_data", "tokenize", "pretrain", "extend_context", "eval_perplexity")
# Keys of those sections that no perplexity depends on (prepare_data's evaluation sets feed eval_harness only).
REGRESSION_IGNORED = {"prepare_data": ("benchmarks",)}
# Keys added after records were made, left out of the fingerprint at the value those records were made with.
REGRESSION_DEFAULTS = {"eval_perplexity": {"protocol": "stream", "max_documents": 0}}
MAX_DIFFERENCES = 20  # differing settings listed under a missing record


@dataclass(frozen=True)
class Config:
    strict: bool
    recorded: str
    regression_tolerance: float

    def __post_init__(self):
        if not 0 <= self.regression_tolerance < 1:
            raise ValueError("regression_tolerance must be in [0, 1)")


def stage_label(folder: Path) -> str:
    """data/tokenize -> tokenize; data/eval_perplexity/pretrain -> eval_perplexity/pretrain."""
    parts = folder.parts
    return "/".join(parts[1:]) if len(parts) > 1 and parts[0] == "data" else folder.name


def read_rows(folder: Path, label: str, data_files: dict) -> list[dict]:
    path = folder / "results.json"
    if not path.is_file():
        return []
    return check_rows(json.loads(path.read_text()), path, label, data_files)


def spread_tolerance(spread: dict, fallback: float, where: str) -> tuple[float, dict]:
    """(tolerance, the row's spread with its rule and assumptions) for a figure that is a mean over runs."""
    if not isinstance(spread, dict) or set(spread) != set(SPREAD_KEYS):
        raise config.UserError(f"{where}: spread must hold exactly {', '.join(SPREAD_KEYS)}")
    n, sd, pn, psd = (spread[k] for k in SPREAD_KEYS)
    counts_ok = all(isinstance(v, int) and v >= 1 for v in (n, pn)) and (n < 2 or sd is not None)
    if not counts_ok or any(v is not None and not (isinstance(v, (int, float)) and v >= 0) for v in (sd, psd)):
        raise config.UserError(f"{where}: spread needs run counts >= 1 and deviations >= 0 (or null), got {spread}")
    if n < MIN_RUNS or (psd is not None and pn < 2) or not (sd or psd):
        why = f"fewer than {MIN_RUNS} runs of ours" if n < MIN_RUNS else "no spread to estimate"
        return fallback, {**spread, "rule": "fixed tolerance", "assumed": why}
    from scipy.stats import t

    if psd is None:  # one estimate of the spread, ours, for both sides
        a, b = sd**2 / n, sd**2 / pn
        dof, assumed = n - 1, "published sd taken as ours (the paper gives none)"
    else:  # Welch-Satterthwaite
        a, b = sd**2 / n, psd**2 / pn
        dof, assumed = (a + b) ** 2 / (a**2 / (n - 1) + b**2 / (pn - 1)), None
    tolerance = float(t.ppf(0.995, dof) * math.sqrt(a + b))
    return round(tolerance, 4), {**spread, "rule": SPREAD_RULE, "assumed": assumed}


def check_rows(rows: list[dict], path: Path, label: str, data_files: dict) -> list[dict]:
    """Rows of `path` in the report's schema, each with its verdict."""
    out = []
    for i, row in enumerate(rows):
        missing = [k for k in ROW_INPUT_FIELDS if k not in row]
        if missing:
            raise config.UserError(
                f"{path}: row {i} lacks {', '.join(missing)} (each row needs {', '.join(ROW_INPUT_FIELDS)})"
            )
        ours, published, tol = row["ours"], row["published"], row["tolerance"]
        relation = row.get("relation", "=")
        if relation not in RELATIONS:
            raise config.UserError(f"{path}: row {i} has relation {relation!r}; use one of {', '.join(RELATIONS)}")
        spread = row.get("spread")
        if spread is not None:
            if relation != "=":
                raise config.UserError(f"{path}: row {i} has a spread and relation {relation!r}; spreads test '='")
            tol, spread = spread_tolerance(spread, tol, f"{path}: row {i}")
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ours, published, tol))
        passed = bool(math.isfinite(ours) and RELATIONS[relation](ours, published, tol)) if numeric else None
        hashes = {name: data_files[name] for name in row.get("data", ()) if name in data_files}
        values = {
            **row,
            "relation": relation,
            "pass": passed,
            "stage": label,
            "data_hashes": hashes,
            "tolerance": tol,
            "spread": spread,
        }
        out.append({k: values[k] for k in ROW_FIELDS})
    return out


def fmt(value, verdict: bool = False) -> str:
    """A table cell; with `verdict`, a row's pass column (true: pass, false: FAIL)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return ("pass" if value else "FAIL") if verdict else str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k.rsplit('/', 1)[-1]}:{v[:12]}" for k, v in value.items()) or "-"
    return str(value)


TABLE_FIELDS = tuple(f for f in ROW_FIELDS if f != "spread")  # the spread is written into its row's cells


def row_cells(row: dict) -> str:
    """A row of the markdown table: with a spread, ours and published as mean ± sd (n runs) and the
    tolerance with its rule; an assumed deviation is starred."""
    cells = {k: fmt(row[k], k == "pass") for k in TABLE_FIELDS}
    spread = row.get("spread")
    if spread:

        def pm(mean, sd, n, assumed):
            return (
                f"{fmt(mean)} ± {fmt(sd)}{'*' if assumed else ''} (n={n})" if sd is not None else f"{fmt(mean)} (n={n})"
            )

        borrowed = (spread["assumed"] or "").startswith("published sd taken as ours")
        cells["ours"] = pm(row["ours"], spread["sd"], spread["n"], False)
        published_sd = spread["sd"] if borrowed else spread["published_sd"]
        cells["published"] = pm(row["published"], published_sd, spread["published_n"], borrowed)
        cells["tolerance"] = f"{fmt(row['tolerance'])} ({spread['rule']})"
    return "| " + " | ".join(cells.values()) + " |"


def render_markdown(doc: dict) -> str:
    lines = ["# Results", ""]
    base = doc.get("base")
    if base:
        at = f" at commit `{base['commit']}`" if base["commit"] else ""
        if base["revision"] and base["revision"] != base["commit"]:  # a branch or tag, resolved when it ran
            at += f" (revision `{base['revision']}`)"
        lines += [f"Base model: `{base['model']}`{at}, copied by the base stage (data/base); no pretrain.", ""]
    if doc.get("measured"):
        lines += [
            f"Measured figures (throughput, seconds, peak memory: they differ from run to run) and the "
            f"{doc['measured_rows']} row(s) that check them are in `{doc['measured']}`.",
            "",
        ]
    lines += [
        "## Reproduced results",
        "",
        "| " + " | ".join(TABLE_FIELDS) + " |",
        "|" + "---|" * len(TABLE_FIELDS),
    ]
    lines += [row_cells(row) for row in doc["rows"]]
    if not doc["rows"]:
        lines.append("| " + " | ".join(["-"] * len(TABLE_FIELDS)) + " |")
        lines += ["", "_No stage of this pipeline reproduces a published result yet._"]
    if any(row["spread"] for row in doc["rows"]):
        lines += [
            "",
            f"Rows with ± are means over runs; they pass by {SPREAD_RULE} (Welch's test whether both means could "
            "come from one distribution of runs: |ours − published| ≤ t · √(sd²/n + sd_p²/n_p)); a starred "
            "deviation is assumed (the paper gives none: its runs are taken to spread as ours).",
        ]
    reg = doc.get("regression")
    if reg is not None and reg["source"]:
        lines += ["", "## Regression against a recorded run", ""]
        if reg["rows"]:
            lines += [
                f"Our perplexities against those recorded under the same params (fingerprint `{reg['params']}`, "
                f"recorded {reg['recorded']}).",
                "",
                "| " + " | ".join(TABLE_FIELDS) + " |",
                "|" + "---|" * len(TABLE_FIELDS),
            ]
            lines += [row_cells(row) for row in reg["rows"]]
        else:
            lines.append(
                f"_No recorded perplexities for these params (fingerprint `{reg['params']}`); "
                "record this run's with `python -m pipelines.record`._"
            )
            near = reg.get("nearest")
            if near:
                name = f"`{near['params']}`" + (f" ({near['preset']})" if near.get("preset") else "")
                shown = near["differences"][:MAX_DIFFERENCES]
                lines += ["", f"The nearest record, {name}, differs in {len(near['differences'])} setting(s):", ""]
                lines += [f"- `{d}`" for d in shown]
                if len(near["differences"]) > len(shown):
                    lines.append(f"- … and {len(near['differences']) - len(shown)} more")
    lines += ["", "## Stage metrics", ""]
    for label, metrics in doc["stage_metrics"].items():
        lines += [f"### {label}", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {fmt(v)} |" for k, v in sorted(config.flatten(metrics).items())]
        lines.append("")
    for name, items in doc["comparisons"].items():
        flat = {item: config.flatten(metrics) for item, metrics in items.items()}
        keys = sorted(set.intersection(*(set(m) for m in flat.values())))
        if not keys:  # items that score different models (eval_harness@pretrain, @extend_context): nothing side by side
            continue
        lines += [f"## Comparison: {name}", "", "| metric | " + " | ".join(flat) + " |", "|---|" + "---|" * len(flat)]
        lines += [f"| {k} | " + " | ".join(fmt(m[k]) for m in flat.values()) + " |" for k in keys]
        lines.append("")
    if doc["plots"]:
        lines += ["## Plots", ""]
        for plot in doc["plots"]:
            rel = Path("..") / plot if not Path(plot).is_absolute() else Path(plot)
            lines += [f"![{plot}]({rel.as_posix()})", ""]
    return "\n".join(lines).rstrip() + "\n"


def base_model(inputs: list[Path]) -> dict | None:
    """The model, revision and commit the base stage copied (its meta.json) where data/base is among the
    inputs; None where the base is the pipeline's own pretrain."""
    for folder in inputs:
        if stage_label(folder) == "base" and (folder / "meta.json").is_file():
            meta = json.loads((folder / "meta.json").read_text())
            return {k: meta.get(f"base_{k}") for k in ("model", "revision", "commit")}
    return None


def raw_data_files(inputs: list[Path]) -> dict:
    """{raw file name: its hash}, from prepare_data's meta.json where it is among the inputs."""
    for folder in inputs:
        if (folder / "meta.json").is_file() and stage_label(folder) == "prepare_data":
            return json.loads((folder / "meta.json").read_text()).get("files", {})
    return {}


def build_report(inputs: list[Path]) -> dict:
    data_files = raw_data_files(inputs)
    rows, stage_metrics, plots = [], {}, []
    for folder in inputs:
        if not folder.is_dir():
            raise config.UserError(f"report: {folder} not found; run the stage that writes it first")
        label = stage_label(folder)
        # every figure where the stage wrote them (figures.json), else its headline metrics
        for name in ("figures.json", "metrics.json"):
            if (folder / name).is_file():
                stage_metrics[label] = json.loads((folder / name).read_text())
                break
        rows += read_rows(folder, label, data_files)
        plots += sorted(str(p) for p in folder.glob("plots/*.png"))
    base = base_model(inputs)
    return {
        "row_fields": list(ROW_FIELDS),
        **({"base": base} if base else {}),  # (a run on the own pretrain: its report as before, byte for byte)
        "rows": rows,
        "stage_metrics": stage_metrics,
        "comparisons": comparisons(stage_metrics),
        "plots": plots,
    }


def build_measured(files: list[Path], data_files: dict) -> dict:
    """What the stages measured (stage.write_measured files): {"rows": the rows checking measured figures,
    with their verdicts; "stages": {stage label: figures}; "plots": the plots beside them (.png)}."""
    rows, stages, plots = [], {}, []
    for path in files:
        if not path.is_file():
            raise config.UserError(f"report: {path} not found; run the stage that measures it first")
        doc = json.loads(path.read_text())
        label = stage_label(Path(doc.get("output", path.stem)))
        rows += check_rows(doc.get("rows", []), path, label, data_files)
        stages[label] = {k: v for k, v in doc.items() if k not in ("output", "rows")}
        if path.with_suffix(".png").is_file():
            plots.append(str(path.with_suffix(".png")))
    return {"row_fields": list(ROW_FIELDS), "rows": rows, "stages": stages, "plots": plots}


def params_fingerprint(params: dict) -> str:
    """Which record a run compares with: a hash of the params sections behind its perplexities."""
    return hashlib.sha256(json.dumps(regression_params(params), sort_keys=True).encode()).hexdigest()[:16]


def perplexities(stage_metrics: dict) -> dict:
    """{eval stage label: {model: {context: token perplexity}}} from the eval_perplexity stages' metrics."""
    out = {}
    for label, metrics in stage_metrics.items():
        if label.split("/")[0] == "eval_perplexity":
            out[label] = {
                model: {int(v["context"]): v["perplexity"] for v in by_ctx.values()}
                for model, by_ctx in metrics.get("models", {}).items()
            }
    return out


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise config.UserError(
            f"report.recorded: {path} not found; set report.recorded to the file of recorded "
            'perplexities (pipelines/recorded.yaml) or to "" for none'
        )
    return config.read_yaml(path).get("records") or []


def regression_params(params: dict) -> dict:
    """The params sections behind the perplexities (what the fingerprint hashes), less the keys that do not
    reach them (REGRESSION_IGNORED); with another base model, its section in place of pretrain's (the records
    of the own pretrain keep their fingerprints)."""
    names = REGRESSION_SECTIONS
    if isinstance(params.get("base"), dict) and params["base"].get("model"):
        names = tuple("base" if name == "pretrain" else name for name in names)
    sections = {name: params.get(name) for name in names}
    for name, section in sections.items():
        if isinstance(section, dict):
            ignored, defaults = REGRESSION_IGNORED.get(name, ()), REGRESSION_DEFAULTS.get(name, {})
            sections[name] = {
                k: v for k, v in section.items() if k not in ignored and not (k in defaults and v == defaults[k])
            }
    return sections


def params_differences(ours: dict, recorded: dict) -> list[str]:
    """'section.key: ours (recorded: theirs)' for every setting that differs, nested keys flattened; a section
    on one side only (pretrain's or base's, across base models) is one line, with its count of settings."""
    absent = "(absent)"
    alone = set(ours) ^ set(recorded)

    def side(doc: dict, name: str) -> str:
        return f"{len(config.flatten({name: doc[name]}))} setting(s)" if name in doc else absent

    lines = {name: f"{name}: {side(ours, name)} (recorded: {side(recorded, name)})" for name in alone}
    a = config.flatten({k: v for k, v in ours.items() if k not in alone})
    b = config.flatten({k: v for k, v in recorded.items() if k not in alone})
    lines |= {
        k: f"{k}: {a.get(k, absent)} (recorded: {b.get(k, absent)})"
        for k in set(a) | set(b)
        if a.get(k, absent) != b.get(k, absent)
    }
    return [lines[k] for k in sorted(lines)]


def nearest_record(records: list[dict], params: dict) -> dict | None:
    """The record whose stored params differ from these in the fewest settings, with those settings."""
    ours = regression_params(params)
    found = [(params_differences(ours, r["sections"]), r) for r in records if isinstance(r.get("sections"), dict)]
    if not found:
        return None
    differences, record = min(found, key=lambda f: len(f[0]))
    return {"params": record["params"], "preset": record.get("preset"), "differences": differences}


def regression(stage_metrics: dict, params: dict, cfg: Config) -> dict:
    """Rows comparing this run's perplexities with the record made under the same params; without one,
    the nearest record and the settings that differ from it."""
    fingerprint = params_fingerprint(params)
    records = read_records(Path(cfg.recorded)) if cfg.recorded else []
    record = next((r for r in records if r.get("params") == fingerprint), None)
    rows, subjects = [], []
    if record is not None:
        ours = perplexities(stage_metrics)
        for label, models in record["perplexity"].items():
            for model, by_ctx in models.items():
                for ctx, value in by_ctx.items():
                    got = ours.get(label, {}).get(model, {}).get(int(ctx))
                    tol = round(cfg.regression_tolerance * value, 6)
                    rows.append(
                        {
                            "result": f"token perplexity, {model} at {ctx} tokens",
                            "paper": f"recorded run ({record['recorded']})",
                            "relation": "=",
                            "published": value,
                            "ours": got,
                            "tolerance": tol,
                            "pass": got is not None and math.isfinite(got) and abs(got - value) <= tol,
                            "stage": label,
                            "data_hashes": {},
                            "spread": None,
                        }
                    )
                    subjects.append(evaluated_model(label, model))
    return {
        "source": cfg.recorded,
        "params": fingerprint,
        "recorded": record["recorded"] if record else None,
        "rows": rows,
        "models": subjects,  # the registered name of the model each row is about
        "nearest": None if record is not None else nearest_record(records, params),
    }


def evaluated_model(label: str, model: str) -> str:
    """The registered name of a model an eval_perplexity stage scored: eval_perplexity/pretrain's model
    `pretrain` is `pretrain`, eval_perplexity/extend_context's `yarn-ft` is `extend_context-yarn-ft`."""
    source = label.partition("/")[2]
    return registry.model_name(source, None if model == source else model)


def row_subjects(doc: dict) -> dict[str, tuple[str, list]]:
    """{registered model name: (label of the stage output holding it, passes of the rows about it)}: a
    stage's rows are about its model (finetune_qlora/nf4 -> finetune_qlora-nf4), a regression row
    about the model it evaluated. Names no stage registered find no versions later."""
    subjects: dict[str, tuple[str, list]] = {}
    for row in doc["rows"]:
        stage_name, _, item = row["stage"].partition("/")
        subjects.setdefault(registry.model_name(stage_name, item or None), (row["stage"], []))[1].append(row["pass"])
    regression = doc["regression"]
    for row, name in zip(regression["rows"], regression.get("models", ()), strict=True):
        subjects.setdefault(name, (row["stage"].partition("/")[2], []))[1].append(row["pass"])
    return subjects


def mark_reproduced(doc: dict, inputs: list[Path]) -> dict[str, int]:
    """Set the registry alias `reproduced` on each model whose report rows all pass: on the newest
    version registered from the output folder the report read (matched by its DVC hash). Returns
    {name: version}."""
    folders = {stage_label(p): p for p in inputs}
    hashes, marked = {}, {}
    for name, (label, passes) in sorted(row_subjects(doc).items()):
        if not passes or not all(p is True for p in passes) or label not in folders or not registry.is_registered(name):
            continue
        if label not in hashes:
            hashes[label] = digest.dvc_md5(folders[label])
        found = registry.versions_with(name, "output_dvc_md5", hashes[label])
        if found:
            registry.set_alias(name, int(found[0].version))
            marked[name] = int(found[0].version)
    return marked


def comparisons(stage_metrics: dict) -> dict:
    """{stage: {item: metrics}} for every stage run once per item with two items or more."""
    groups: dict[str, dict] = {}
    for label, metrics in stage_metrics.items():
        stage, sep, item = label.partition("/")
        if sep:
            groups.setdefault(stage, {})[item] = metrics
    return {stage: items for stage, items in groups.items() if len(items) > 1}


def main(argv=None) -> dict:
    paths = {"output": "reports", "inputs": [], "measured_inputs": []}
    args, cfg = stage.setup(__doc__, STAGE, Config, paths, argv)
    inputs, measured_inputs = [Path(p) for p in args.inputs], [Path(p) for p in args.measured_inputs]

    def body(rt, stop):
        doc = None
        if rt.is_main:
            metric_files = [p / n for p in inputs for n in ("figures.json", "metrics.json") if (p / n).is_file()]
            with runs.start_run(
                STAGE, config.as_dict(cfg), digest.hash_files(metric_files), rt, tags=environment.run_tags(STAGE)
            ) as tracker:
                doc = build_report(inputs)
                doc["regression"] = regression(doc["stage_metrics"], config.read_yaml(args.params), cfg)
                measured = build_measured(measured_inputs, raw_data_files(inputs))
                if measured_inputs:
                    doc["measured"], doc["measured_rows"] = args.measured, len(measured["rows"])
                output = Path(args.output)
                with atomic.folder(output) as tmp:
                    atomic.write_json(tmp / "results.json", doc)
                    (tmp / "results.md").write_text(render_markdown(doc), encoding="utf-8")
                if measured_inputs:
                    stage.write_measured(args.measured, output, measured)
                    tracker.log_artifact(args.measured)
                passed = [r["pass"] for r in doc["rows"] + measured["rows"]]
                regressed = [r["pass"] for r in doc["regression"]["rows"]]
                tracker.log_metrics(
                    {
                        "rows": len(passed),
                        "rows_passed": passed.count(True),
                        "rows_failed": passed.count(False),
                        "regression_rows": len(regressed),
                        "regression_rows_failed": regressed.count(False),
                    }
                )
                tracker.log_artifact(output / "results.md")
                tracker.log_artifact(output / "results.json")
                if tracker:
                    reproduced = mark_reproduced(doc, inputs)
                    tracker.set_tags({"reproduced_models": ",".join(f"{k}:{v}" for k, v in reproduced.items())})
                    if reproduced:
                        print(
                            f"report: registry alias '{registry.ALIAS}' set on "
                            + ", ".join(f"{k} version {v}" for k, v in reproduced.items())
                        )
            print(
                f"report: {len(doc['rows'])} reproduced result(s), {len(doc['regression']['rows'])} regression row(s), "
                f"{len(measured['rows'])} row(s) of measured figures, {len(doc['stage_metrics'])} stage(s) -> "
                f"{args.output}/results.md"
            )
            checked = doc["rows"] + doc["regression"]["rows"] + measured["rows"]
            failed = [r["result"] for r in checked if r["pass"] is False]
            if cfg.strict and failed:
                raise config.UserError(f"report: outside tolerance: {', '.join(failed)} (report.strict is true)")
        return runtime.broadcast_object(doc)

    return stage.launch(STAGE, body)


if __name__ == "__main__":
    stage.entry(main)
