"""The Tracker protocol (stages/common/tracking/tracker.py): every tracker a stage logs to implements all
of it, so stage code calls it without probing; a hang ends the stage's run through any of them."""

from __future__ import annotations

import types

import pytest

from stages.common.tracking.tracker import NullTracker, RunTracker, Tracker


def test_every_tracker_implements_the_whole_protocol():
    from stages.extend_context import PrefixedTracker

    members = {name for name in vars(Tracker) if not name.startswith("_")} | {"__bool__"}
    for cls in (NullTracker, RunTracker, PrefixedTracker):
        missing = sorted(m for m in members if not any(m in vars(c) for c in cls.__mro__[:-1] if c is not Tracker))
        assert not missing, f"{cls.__name__} lacks {missing}"
    assert isinstance(NullTracker(), Tracker) and isinstance(PrefixedTracker(NullTracker(), "yarn"), Tracker)
    assert not NullTracker() and not PrefixedTracker(NullTracker(), "yarn")


def test_a_hang_in_extend_context_ends_its_run_failed(tmp_path, monkeypatch):
    """extend_context logs each fine-tune through a PrefixedTracker around the stage's run: the training
    loop's hang watchdog, built from it, ends that run FAILED with the hang tagged (on a local SQLite store,
    in this process; the watchdog is caught as the loop builds it, and fired by hand)."""
    import mlflow

    from stages.common import loop, runtime, watchdog
    from stages.common.tracking import runs
    from stages.extend_context import PrefixedTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("PIPELINE_TRACKING", "on")
    monkeypatch.setenv("PIPELINE_SYSTEM_METRICS", "off")
    monkeypatch.delenv("PIPELINE_RUN_ID", raising=False)
    monkeypatch.delenv("PIPELINE_STAGE", raising=False)

    class Built(Exception):
        pass

    hooks = []

    def watchdog_of(rank, world_size, floor_s, on_hang=None, store=None):
        hooks.append(on_hang)
        raise Built

    monkeypatch.setattr(watchdog, "Watchdog", watchdog_of)
    rt = runtime.Runtime(0, 1, 0, 1, None)
    cfg = types.SimpleNamespace(hang_timeout_s=8.0)
    with runs.start_run("extend_context", {}, "", rt) as tracker:
        variant = PrefixedTracker(tracker, "yarn")
        with pytest.raises(Built):
            loop.train(None, None, None, cfg, 64, rt, tmp_path / "ckpts", variant, runtime.StopFlag())
        (on_hang,) = hooks
        assert on_hang is not None, "the loop's watchdog has no way to end the run"
        on_hang("hang: rank 1 on host (in step 5) made no progress for 9 s")
        run_id = tracker.run_id
    run = mlflow.MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FAILED", run.info.status
    assert run.data.tags["failure"] == "hang" and "rank 1 on host" in run.data.tags["failure_cause"]
