"""Record the last run's perplexities as the regression baseline of the report (pipelines/recorded.yaml).

The report compares every perplexity of the eval_perplexity stages with the record made under the
same params (a hash of the sections in stages.report.REGRESSION_SECTIONS). Record after a change that
is meant to move them, then commit the file:

    python -m pipelines.record                  # this workspace: params.yaml, data/eval_perplexity/*
    python -m pipelines.record --params other.yaml --data /path/to/run/data
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
from pathlib import Path

import yaml

from pipelines import dag
from stages import report
from stages.common import atomic, config, provenance

RECORDED = Path(__file__).resolve().parent / "recorded.yaml"
HEADER = """\
# Perplexities recorded from runs of the pipeline: the report's regression baseline (report.recorded).
# One record per params fingerprint (a hash of the params sections behind the perplexities); a run
# compares with the record of its own params, each perplexity within report.regression_tolerance.
# Written by `python -m pipelines.record` after a run; not edited by hand.
"""


def collect(data: Path, params_file: Path) -> dict:
    """{eval stage label: {model: {context: perplexity}}} from data/eval_perplexity/<item>/figures.json of each
    eval_perplexity stage in the DAG of `params_file` (a folder of the other base model's DAG, left by an
    earlier run, is passed over: the report under these params never reads it)."""
    items = dag.load_table(params=params_file)["eval_perplexity"].foreach
    files = [data / "eval_perplexity" / item / "figures.json" for item in items]
    metrics = {f"eval_perplexity/{p.parent.name}": json.loads(p.read_text()) for p in files if p.is_file()}
    found = report.perplexities(metrics)
    if not any(found.values()):
        raise SystemExit(f"record: no perplexities under {data / 'eval_perplexity'}; run the pipeline first")
    return {
        label: {model: {ctx: round(v, 4) for ctx, v in sorted(by_ctx.items())} for model, by_ctx in models.items()}
        for label, models in found.items()
    }


def record(params_file: Path, data: Path, path: Path = RECORDED, preset: str = "") -> dict:
    params = config.read_yaml(params_file)
    entry = {
        "params": report.params_fingerprint(params),
        "recorded": f"{datetime.date.today().isoformat()}, commit {provenance.git_commit()[:12]}",
        **({"preset": preset} if preset else {}),
        "perplexity": collect(data, params_file),
        # the params behind them, for the report to name what differs when no record matches
        "sections": report.regression_params(params),
    }
    records = (yaml.safe_load(path.read_text()) or {}).get("records") or [] if path.is_file() else []
    records = [r for r in records if r.get("params") != entry["params"]] + [entry]
    out = io.StringIO()
    out.write(HEADER)
    yaml.safe_dump({"records": records}, out, sort_keys=False)
    atomic.write_text(path, out.getvalue())
    return entry


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--data", type=Path, default=Path("data"), help="the run's data folder")
    parser.add_argument("--output", type=Path, default=RECORDED)
    parser.add_argument("--preset", default="", help="a name for the params, shown in the file (e.g. default, ci)")
    args = parser.parse_args(argv)
    entry = record(args.params, args.data, args.output, args.preset)
    n = sum(len(by_ctx) for models in entry["perplexity"].values() for by_ctx in models.values())
    print(f"record: {n} perplexities under params {entry['params']} -> {args.output}")


if __name__ == "__main__":
    main()
