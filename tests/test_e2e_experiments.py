"""Queued and temporary DVC experiments on a copy of the shared ci run (tests/shared_run.py): DVC runs
them in copies of the repository under .dvc/tmp/exps, deleted afterwards; their MLflow runs still land
in the repository's store, a failed one's stage log is reachable with `dvc queue logs`, and `dvc exp
show` lists the ones that ran."""

from __future__ import annotations

import re
import time

import pytest
from shared_run import copy_of_run, sh

pytestmark = [pytest.mark.e2e, pytest.mark.long]


def wait_for_queue(clone, timeout: float = 900) -> str:
    """`dvc queue status` once no experiment is queued or running."""
    deadline = time.monotonic() + timeout
    while True:
        status = sh("dvc queue status", clone)
        if not re.search(r"\b(Queued|Running)\b", status):
            return status
        assert time.monotonic() < deadline, f"the queue did not finish in {timeout:.0f} s:\n{status}"
        time.sleep(5)


def test_queued_and_temporary_experiments_keep_their_records(tmp_path, mirror):
    import mlflow

    clone = copy_of_run(tmp_path / "clone")
    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipeline").experiment_id

    def study_runs() -> dict[str, str]:
        """{unscaled_growth: status} of the context_study runs in the repository's store."""
        runs = client.search_runs([experiment], "tags.stage = 'context_study'")
        return {r.data.params["unscaled_growth"]: r.info.status for r in runs}

    before = study_runs()
    sh("dvc exp run --queue -S context_study.unscaled_growth=1.35 -n growth-1.35", clone)
    sh("dvc exp run --queue -S context_study.unscaled_growth=0.5 -n growth-0.5", clone)  # fails: must be >= 1
    sh("dvc queue start -j 2", clone)
    status = wait_for_queue(clone)
    assert re.search(r"growth-1\.35.*Success", status) and re.search(r"growth-0\.5.*Failed", status), status
    assert "unscaled_growth must be >= 1" in sh("dvc queue logs growth-0.5", clone, check=False)
    sh("dvc exp run --temp -S context_study.unscaled_growth=1.45 -n growth-1.45", clone)

    runs = study_runs()
    assert runs.get("1.35") == "FINISHED" and runs.get("1.45") == "FINISHED", runs
    assert set(runs) - set(before) == {"1.35", "1.45"}, "each experiment's run is in the repository's store"
    # The failed one stopped before its run opened; its invocation is marked FAILED in the same store.
    failed = client.search_runs([experiment], "tags.pipeline_role = 'parent' and attributes.status = 'FAILED'")
    assert any(r.data.tags.get("unfinished_stages") == "context_study:FAILED" for r in failed)
    reports = client.search_runs([experiment], "tags.stage = 'report'")
    assert len(reports) >= 3, "report ran in the pipeline and in both experiments that succeeded"
    shown = sh("dvc exp show --csv", clone)
    assert "growth-1.35" in shown and "growth-1.45" in shown
    assert not list((clone / ".dvc/tmp/exps").rglob("mlflow.db")), "no store is left in DVC's copies"
