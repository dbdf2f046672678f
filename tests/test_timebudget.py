"""The time budget: each stage's wall time by phase (stages.common.timing, kept by rank 0 and written by
pipelines.launch), the table `make run` prints (pipelines.timebudget), and the same table in
docs/pipeline.md from the committed measured/time/."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from shared_run import ROOT, shared_run, snakemake_output

from pipelines import html_report, timebudget
from stages.common import timing


@pytest.fixture
def clock(monkeypatch):
    """timing's clocks made a counter the test moves: `clock.tick(s)`."""

    class Clock:
        now = 1000.0

        def tick(self, seconds: float) -> None:
            self.now += seconds

    c = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", lambda: c.now)
    monkeypatch.setattr(timing.time, "time", lambda: c.now)
    monkeypatch.setattr(timing, "_stack", [])
    monkeypatch.setattr(timing, "_body", [])
    monkeypatch.setattr(timing, "_spent", dict.fromkeys(timing.PHASES, 0.0))
    return c


def test_a_nested_phase_takes_its_time_from_the_outer_one_and_the_rest_is_compute(clock):
    timing.body_started()
    clock.tick(5)  # compute
    with timing.phase("evaluation"):
        clock.tick(2)
        with timing.phase("data"):
            clock.tick(3)
        clock.tick(1)

    @timing.phase("checkpoint")
    def save():
        clock.tick(4)
        with timing.phase("checkpoint"):  # the same phase again, inside: counted once
            clock.tick(1)

    save()
    clock.tick(0.5)
    timing.body_ended()
    record = timing.record()
    assert record["phases"] == {"data": 3, "evaluation": 3, "checkpoint": 5, "tracking": 0, "outputs": 0}
    assert record["compute"] == 5.5
    assert record["body"][1] - record["body"][0] == 16.5


def test_time_spent_in_another_thread_is_not_charged(clock):
    timing.body_started()

    def background():
        with timing.phase("checkpoint"):
            clock.tick(7)

    worker = threading.Thread(target=background)
    worker.start()
    worker.join()
    timing.body_ended()
    assert timing.record()["phases"]["checkpoint"] == 0
    with pytest.raises(ValueError, match="phase 'sleep'"):
        timing.phase("sleep")


def test_an_error_inside_a_timed_context_is_passed_on_and_its_exit_is_timed(clock):
    class Manager:
        exited = None

        def __enter__(self):
            clock.tick(1)
            return "tracker"

        def __exit__(self, *exc):
            self.exited = exc[0]
            clock.tick(2)
            return False

    timing.body_started()
    manager = Manager()
    with pytest.raises(KeyError):
        with timing.entered_in("tracking", manager) as value:
            assert value == "tracker"
            clock.tick(10)
            raise KeyError("boom")
    timing.body_ended()
    assert manager.exited is KeyError
    assert timing.record()["phases"]["tracking"] == 3 and timing.record()["compute"] == 10


def test_a_stage_record_splits_the_launcher_s_wall_and_the_table_adds_up():
    rank0 = {
        "created": 100.0,
        "body": [108.0, 150.0],
        "ended": 151.0,
        "phases": {"data": 2.0, "evaluation": 6.0, "checkpoint": 3.0, "tracking": 4.0, "outputs": 1.0},
        "compute": 26.0,
    }
    record = timebudget.stage_record("pretrain", 99.0, 153.5, 2, rank0)
    assert record["seconds"] == {
        "start-up": 9.0,
        "data": 2.0,
        "compute": 26.0,
        "evaluation": 6.0,
        "checkpoint": 3.0,
        "tracking": 4.0,
        "outputs": 1.0,
        "bookkeeping": 3.5,
    }
    assert sum(record["seconds"].values()) == pytest.approx(record["ended"] - record["started"])
    other = {**record, "stage": "train_gnn", "started": 140.0, "ended": 160.0}  # side by side, partly
    assert timebudget.covered([record, other]) == pytest.approx(61.0)
    text = timebudget.table([record, other], since=90.0, now=200.0)
    assert "| pretrain | 2 | 9.0 | 2.0 | 26.0 |" in text and "| all stages |" in text
    assert text.endswith("outside every stage (Snakemake's DAG, scheduling and checks between jobs): 49 s")


def test_the_docs_table_is_the_committed_measurements(tmp_path):
    """docs/pipeline.md shows measured/time/ as committed (make run rewrites both); a page without the
    marks is refused."""
    doc = (ROOT / "docs/pipeline.md").read_text()
    shown = doc.split(timebudget.MARK_BEGIN, 1)[1].split(timebudget.MARK_END, 1)[0].strip()
    assert shown == timebudget.table(timebudget.load(ROOT / timebudget.FOLDER)), (
        "docs/pipeline.md's time budget is not measured/time/'s: python -m pipelines.timebudget --docs docs/pipeline.md"
    )
    page = tmp_path / "page.md"
    page.write_text("no marks\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.timebudget", "--folder", str(tmp_path), "--docs", str(page)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "page.md has no time-budget marks" in proc.stderr


def test_every_stage_of_the_ci_run_has_its_time_budget_by_phase(tmp_path):
    """The shared ci run (snakemake, as make run): one record per stage run, rank 0's phases where the
    stage spends them, the commit in the bookkeeping; the table and the HTML report show them."""
    run = shared_run()
    ran = sorted(set(re.findall(r"pipelines\.launch (\S+)", snakemake_output())))
    records = {r["stage"]: r for r in timebudget.load(run / timebudget.FOLDER)}
    assert sorted(records) == ran
    for name, record in records.items():
        seconds = record["seconds"]
        assert seconds["start-up"] > 0 and seconds["bookkeeping"] > 0 and record["committed"] > 0, name
        assert sum(seconds.values()) == pytest.approx(record["ended"] - record["started"], abs=0.05), name
    pretrain = records["pretrain"]["seconds"]
    # (its batches are microseconds each at the ci preset's size: data rounds to 0.0 s there)
    assert all(pretrain[p] > 0 for p in ("compute", "evaluation", "checkpoint", "tracking", "outputs")), pretrain
    for name in ("eval_perplexity@pretrain", "eval_harness@extend_context"):
        assert records[name]["seconds"]["evaluation"] > 0 and records[name]["seconds"]["checkpoint"] == 0, name
    assert records["pretrain"]["processes"] == 2
    printed = subprocess.run(
        [sys.executable, "-m", "pipelines.timebudget", "--since", "0"],
        cwd=run,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert all(f"| {name} |" in printed for name in ran) and "outside every stage" in printed
    results = json.loads((run / "reports/results.json").read_text())
    page = html_report.render(results, run)
    assert "Where the time went" in page and "eval_harness@extend_context" in page.split("Where the time went")[1]
    assert Path(run / timebudget.FOLDER / "eval_harness" / "extend_context.json").is_file()
