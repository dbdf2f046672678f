"""Where a pipeline run's wall time went, per stage: the table `make run` prints at its end.

    python -m pipelines.timebudget                  # every stage's last run (measured/time/)
    python -m pipelines.timebudget --since EPOCH    # the stages that ran since then, and what was outside them
    python -m pipelines.timebudget --docs FILE      # also rewrite the table between FILE's time-budget marks

Each stage run under a DAG tool (Snakemake, or `dvc repro`) leaves measured/time/<stage>.json
(measured/time/<stage>/<item>.json per item): pipelines.launch writes it from the times its rank 0 kept
(stages.common.timing) and its own, and pipelines.commit adds the seconds of its dvc.lock commit. The
columns, in seconds of wall time:

    start-up     the stage process's interpreter, imports, command line, input checks and process group,
                 and its exit
    data         reading and batching inputs                 evaluation   validation, an evaluation stage's scoring
    compute      the rest: the work the stage exists for     checkpoint   saving and resuming checkpoints
    tracking     MLflow records and the inputs' hash         outputs      writing the output folder
    bookkeeping  the launcher's checks (inputs against dvc.lock, the DAG's staleness), torchrun's start and
                 exit, and the commit to dvc.lock

With --since, one more line: the wall time since then outside every stage (Snakemake's DAG, scheduling,
its checks between jobs). The records are measurements, kept with measured/ but outside DVC's outs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from stages.common import atomic, timing

FOLDER = Path("measured") / "time"
COLUMNS = ("start-up", "data", "compute", "evaluation", "checkpoint", "tracking", "outputs", "bookkeeping")
MARK_BEGIN, MARK_END = "<!-- time-budget: python -m pipelines.timebudget --docs -->", "<!-- /time-budget -->"


def record_path(stage: str, folder: Path = FOLDER) -> Path:
    """measured/time/<stage>.json, or measured/time/<stage>/<item>.json for `stage@item`."""
    name, _, item = stage.partition("@")
    return folder / name / f"{item}.json" if item else folder / f"{name}.json"


def stage_record(stage: str, launched: float, ended: float, processes: int, rank0: dict) -> dict:
    """A stage run's record: rank 0's times (stages.common.timing.record) within the launcher's wall,
    `launched` (the launcher process's creation) to `ended`."""
    body = rank0["body"]
    rank_wall = rank0["ended"] - rank0["created"]
    seconds = {
        "start-up": (body[0] - rank0["created"]) + (rank0["ended"] - body[1]),
        **{name: rank0["phases"].get(name, 0.0) for name in timing.PHASES},
        "compute": rank0["compute"],
        "bookkeeping": max(0.0, (ended - launched) - rank_wall),
    }
    return {
        "stage": stage,
        "processes": processes,
        "started": round(launched, 3),
        "ended": round(ended, 3),
        "seconds": {name: round(max(0.0, seconds[name]), 2) for name in COLUMNS},
    }


def write(stage: str, record: dict, folder: Path = FOLDER) -> Path:
    path = record_path(stage, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, record)
    return path


def add_commit(stage: str, seconds: float, folder: Path = FOLDER) -> None:
    """pipelines.commit's seconds, added to the stage's bookkeeping (a record of this run only: one
    written before the commit started)."""
    path = record_path(stage, folder)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if record.get("committed") or record.get("ended", 0) < time.time() - seconds - 600:
        return
    record["seconds"]["bookkeeping"] = round(record["seconds"]["bookkeeping"] + seconds, 2)
    record["committed"] = round(seconds, 2)
    record["ended"] = round(record["ended"] + seconds, 3)
    atomic.write_json(path, record)


def load(folder: Path = FOLDER, since: float | None = None) -> list[dict]:
    """The stage records under `folder` (started at or after `since`), in the order they started."""
    records = []
    for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "seconds" in record and (since is None or record["started"] >= since):
            records.append(record)
    return sorted(records, key=lambda r: r["started"])


def covered(records: list[dict]) -> float:
    """Seconds of wall time inside at least one stage (stages that ran side by side counted once)."""
    total, reach = 0.0, None
    for start, end in sorted((r["started"], r["ended"]) for r in records):
        if reach is None or start > reach:
            total, reach = total + (end - start), end
        elif end > reach:
            total, reach = total + (end - reach), end
    return total


def rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per stage run, then all stages' sums and each column's share of them."""
    head = ["stage", "processes", *COLUMNS, "wall"]
    body, totals = [], dict.fromkeys(COLUMNS, 0.0)
    for r in records:
        for name in COLUMNS:
            totals[name] += r["seconds"][name]
        seconds = [f"{r['seconds'][c]:.1f}" for c in COLUMNS]
        body.append([r["stage"], str(r["processes"]), *seconds, f"{sum(r['seconds'].values()):.1f}"])
    everything = sum(totals.values())
    body.append(["all stages", "", *(f"{totals[c]:.1f}" for c in COLUMNS), f"{everything:.1f}"])
    body.append(["share", "", *(f"{100 * totals[c] / everything:.0f}%" if everything else "" for c in COLUMNS), ""])
    return head, body


def table(records: list[dict], since: float | None = None, now: float | None = None) -> str:
    """The markdown table (rows), and with `since` the wall time outside every stage since then."""
    if not records:
        return "no stage times recorded (measured/time/): run the pipeline with snakemake or dvc repro"
    head, body = rows(records)
    lines = ["| " + " | ".join(row) + " |" for row in [head, ["---"] * len(head), *body]]
    if since is not None:
        wall = (now or time.time()) - since
        inside = covered(records)
        lines.append("")
        lines.append(
            f"{len(records)} stage run(s) in {wall:.0f} s of wall time; outside every stage (Snakemake's DAG, "
            f"scheduling and checks between jobs): {max(0.0, wall - inside):.0f} s"
        )
    return "\n".join(lines)


def rewrite_docs(path: Path, text: str) -> bool:
    """Replace the table between `path`'s time-budget marks; False when the marks are not there."""
    doc = path.read_text()
    if MARK_BEGIN not in doc or MARK_END not in doc:
        return False
    head, rest = doc.split(MARK_BEGIN, 1)
    _, tail = rest.split(MARK_END, 1)
    path.write_text(f"{head}{MARK_BEGIN}\n{text}\n{MARK_END}{tail}")
    return True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--since", type=float, default=None, help="only the stages started since (epoch seconds)")
    parser.add_argument("--folder", type=Path, default=FOLDER, help=f"the stage records (default: {FOLDER})")
    parser.add_argument("--docs", type=Path, default=None, help="a page whose time-budget table to rewrite")
    args = parser.parse_args(argv)
    print(table(load(args.folder, args.since), args.since))
    if args.docs is not None:
        if not rewrite_docs(args.docs, table(load(args.folder))):
            raise SystemExit(f"timebudget: {args.docs} has no time-budget marks ({MARK_BEGIN} ... {MARK_END})")


if __name__ == "__main__":
    main()
