"""One self-contained HTML page of a pipeline run: the reproduced-results table, every stage's metrics
and the plots, from what the `report` stage wrote (reports/results.json) and the plot files it lists;
then what the stages measured (throughput, seconds, memory, and the rows checking them), from the file
results.json names (measured/report.json).

    python -m pipelines.html_report                       # reports/results.json -> report.html
    python -m pipelines.html_report --results reports/results.json --output report.html

Plots are embedded as data URIs, so the page needs no server and no network (open it anywhere, attach
it to a CI run). It is written outside reports/, which DVC tracks as the report stage's output.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
from pathlib import Path

from pipelines import timebudget
from stages.common.config import flatten

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 80em; color: #1f272d; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #c8ced3; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #eef1f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { color: #277c43; font-weight: 600; } .fail { color: #c82d4c; font-weight: 600; }
figure { display: inline-block; margin: 0 1em 1em 0; } img { max-width: 38em; border: 1px solid #c8ced3; }
code { font-size: 0.9em; }
"""


def cell(value) -> str:
    if value is None:
        return "<td></td>"
    if isinstance(value, bool):
        return f'<td class="{"pass" if value else "fail"}">{"PASS" if value else "FAIL"}</td>'
    if isinstance(value, float):
        return f'<td class="num">{value:.4g}</td>'
    if isinstance(value, int):
        return f'<td class="num">{value}</td>'
    if isinstance(value, dict):  # data hashes: name and the hash's first 12 characters
        return (
            "<td>"
            + "<br>".join(
                f"<code>{html.escape(Path(k).name)}:{html.escape(str(v)[:12])}</code>" for k, v in value.items()
            )
            + "</td>"
        )
    return f"<td>{html.escape(str(value))}</td>"


def spread_text(spread: dict | None) -> str | None:
    """A row's spread in words: our runs, the paper's, the rule, what was assumed."""
    if not spread:
        return None
    sd = lambda v: f" sd {v:.4g}" if v is not None else ""  # noqa: E731
    text = (
        f"ours: {spread['n']} runs{sd(spread['sd'])}; paper: {spread['published_n']} runs{sd(spread['published_sd'])}"
    )
    return text + f"; {spread['rule']}" + (f" ({spread['assumed']})" if spread.get("assumed") else "")


def row_values(row: dict, fields: list[str]) -> list:
    return [spread_text(row.get(f)) if f == "spread" else row.get(f, "") for f in fields]


def table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (
        f'<figure><img alt="{html.escape(str(path))}" src="data:image/png;base64,{data}">'
        f"<figcaption><code>{html.escape(str(path))}</code></figcaption></figure>"
    )


def render(results: dict, root: Path) -> str:
    fields = results["row_fields"]
    parts = ["<h1>Pipeline results</h1>", *base_parts(results.get("base")), "<h2>Reproduced results</h2>"]
    parts += [
        table(fields, [row_values(row, fields) for row in results["rows"]])
        if results["rows"]
        else "<p>No stage reproduced a published result in this run.</p>",
        "<h2>Stage metrics</h2>",
    ]
    for stage, metrics in results["stage_metrics"].items():
        parts += [f"<h3>{html.escape(stage)}</h3>", table(["metric", "value"], sorted(flatten(metrics).items()))]
    plots = [p for p in results.get("plots", []) if str(p).endswith(".png")]
    parts.append("<h2>Plots</h2>")
    for plot in plots:
        path = root / plot
        parts.append(image(path) if path.is_file() else f"<p>missing plot <code>{html.escape(plot)}</code></p>")
    parts += measured_parts(results, root)
    parts += time_parts(root)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Pipeline results</title>'
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n"
    )


def base_parts(base: dict | None) -> list[str]:
    """The base model line of a run on another model than the pipeline's own pretrain (none otherwise)."""
    if not base:
        return []
    at = f" at commit <code>{html.escape(str(base['commit']))}</code>" if base.get("commit") else ""
    return [
        f"<p>Base model: <code>{html.escape(str(base['model']))}</code>{at}, copied by the base stage "
        "(data/base); no pretrain.</p>"
    ]


def measured_parts(results: dict, root: Path) -> list[str]:
    """The measured figures' section, from the file results.json names (none when it names none)."""
    if not results.get("measured"):
        return []
    path = root / results["measured"]
    if not path.is_file():
        return [f"<h2>Measured</h2><p>missing <code>{html.escape(results['measured'])}</code></p>"]
    measured = json.loads(path.read_text())
    fields = measured["row_fields"]
    parts = [
        "<h2>Measured</h2><p>Throughput, seconds and memory of this run: they differ from run to run, "
        f"so they live outside the outputs, in <code>{html.escape(results['measured'])}</code>.</p>",
    ]
    if measured["rows"]:
        parts.append(table(fields, [row_values(row, fields) for row in measured["rows"]]))
    for stage, figures in measured["stages"].items():
        parts += [f"<h3>{html.escape(stage)}</h3>", table(["figure", "value"], sorted(flatten(figures).items()))]
    parts += [image(root / p) for p in measured["plots"] if (root / p).is_file()]
    return parts


def time_parts(root: Path) -> list[str]:
    """Where each stage's wall time went (pipelines.timebudget), from measured/time/ (none without it)."""
    records = timebudget.load(root / timebudget.FOLDER)
    if not records:
        return []
    head, body = timebudget.rows(records)
    return [
        "<h2>Where the time went</h2><p>Seconds of wall time per stage run, by phase (the last run of each "
        f"stage, <code>{html.escape(str(timebudget.FOLDER))}/</code>).</p>",
        table(head, body),
    ]


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="reports/results.json", help="what the report stage wrote")
    ap.add_argument("--output", default="report.html")
    args = ap.parse_args(argv)
    results_path = Path(args.results)
    if not results_path.is_file():
        raise SystemExit(f"html_report: {results_path} not found; run the pipeline first (make run)")
    results = json.loads(results_path.read_text())
    # Plot paths in results.json are relative to the repository (where the report stage ran).
    out = Path(args.output)
    out.write_text(render(results, Path.cwd()))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
