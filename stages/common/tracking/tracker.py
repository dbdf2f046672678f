"""What a stage logs to: one `Tracker` protocol. A metric goes Tracker → journal line → sender thread →
MLflow. RunTracker is rank 0's open run (stages/common/tracking/runs.py: start_run); NullTracker does
nothing (tracking off, other ranks, benches); a stage may wrap either (extend_context's PrefixedTracker)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from stages.common import timing
from stages.common.tracking.sender import Sender, flush_s


@runtime_checkable
class Tracker(Protocol):
    """A stage's MLflow run as the stage sees it. False when no run is open (every call is then a no-op)."""

    @property
    def run_id(self) -> str | None: ...

    @property
    def lost(self) -> str | None:
        """Why the tracking server is taken as lost, while it is."""

    def __bool__(self) -> bool: ...

    def log_metrics(self, metrics: dict, step: int | None = None, time_ms: int | None = None) -> None: ...

    def log_series(self, series: dict[str, list[float]]) -> None:
        """Curves at once: {name: [value at step 0, 1, ...]}."""

    def set_tags(self, tags: dict) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def log_text(self, text: str, name: str) -> None: ...

    def register(self, record: dict) -> None:
        """Register a model version (stages.common.registry.version_record), after the records so far."""

    def log_checkpoint(self, folder: Path, step: int, points: list, label: str = "") -> None:
        """A checkpoint of `step` the run published, as a logged model of the run with the metric `points`
        (key, value, step, time in ms) the run logged; `label`: which of the run's trainings (its variant)."""

    def checkpoint_removed(self, folder: Path, why: str) -> None:
        """A checkpoint logged before is gone from disk (its logged model is tagged so, with `why`)."""

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until every record so far has been sent; whether it was."""

    def fail_from_thread(self, cause: str) -> None:
        """End the run FAILED, `cause` tagged, from another thread while the stage's main thread is stuck."""

    def end(self, status: str) -> bool:
        """End the run with `status`; whether its last records reached the server."""


class _EndClock:
    """The stage's end shares one wait on the server, PIPELINE_TRACKING_FLUSH_S, counted from the first of
    its waits (the registry's flush, the last system metrics, the run's last records): each returns when
    it is spent, whatever MLflow's own threads are blocked on."""

    end_by: float | None = None  # (time.monotonic()) when the stage's waits on the server stop

    def end_left(self) -> float:
        """Seconds left for the stage's end to wait on the server."""
        if self.end_by is None:
            self.end_by = time.monotonic() + flush_s()
        return max(0.0, self.end_by - time.monotonic())


class NullTracker(_EndClock):
    """No run: tracking off, a rank other than 0, a bench or a test of the loop."""

    run_id = None
    lost = None

    def __bool__(self) -> bool:
        return False

    def log_metrics(self, metrics: dict, step: int | None = None, time_ms: int | None = None) -> None:
        pass

    def log_series(self, series: dict[str, list[float]]) -> None:
        pass

    def set_tags(self, tags: dict) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_text(self, text: str, name: str) -> None:
        pass

    def register(self, record: dict) -> None:
        pass

    def log_checkpoint(self, folder: Path, step: int, points: list, label: str = "") -> None:
        pass

    def checkpoint_removed(self, folder: Path, why: str) -> None:
        pass

    def flush(self, timeout_s: float) -> bool:
        return True

    def fail_from_thread(self, cause: str) -> None:
        pass

    def end(self, status: str) -> bool:
        return True


class RunTracker(_EndClock):
    """Rank 0's open run: every call appends a record to its journal through its Sender (never waiting on
    the server). `ending`: what its end record tells the run's parent (parents.end_parent)."""

    def __init__(self, run_id: str, sender: Sender, ending: dict | None = None):
        self._run_id, self._sender, self._ending = run_id, sender, ending or {}

    @property
    def run_id(self) -> str:
        return self._run_id

    def __bool__(self) -> bool:
        return True

    @property
    def lost(self) -> str | None:
        return self._sender.lost

    def log_metrics(self, metrics: dict, step: int | None = None, time_ms: int | None = None) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        time_ms = int(time.time() * 1000) if time_ms is None else time_ms
        self._sender.put({"kind": "metrics", "values": values, "step": step, "time": time_ms})

    def log_series(self, series: dict[str, list[float]]) -> None:
        length = max((len(v) for v in series.values()), default=0)
        for step in range(length):
            self.log_metrics({k: v[step] for k, v in series.items() if step < len(v)}, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._sender.put({"kind": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def set_tags(self, tags: dict) -> None:
        self._sender.put({"kind": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def log_text(self, text: str, name: str) -> None:
        self._sender.put({"kind": "text", "text": text, "name": name})

    def register(self, record: dict) -> None:
        self._sender.put({"kind": "register", **record})

    def log_checkpoint(self, folder: Path, step: int, points: list, label: str = "") -> None:
        from stages.common.ckpt import MANIFEST

        manifest = hashlib.sha256((Path(folder) / MANIFEST).read_bytes()).hexdigest()
        record = {"folder": str(Path(folder).resolve()), "step": step, "manifest_sha256": manifest, "label": label}
        self._sender.put({"kind": "checkpoint", "points": [list(p) for p in points], **record})

    def checkpoint_removed(self, folder: Path, why: str) -> None:
        self._sender.put({"kind": "checkpoint_removed", "folder": str(Path(folder).resolve()), "why": why})

    @timing.phase("tracking")
    def flush(self, timeout_s: float) -> bool:
        """Also one of the stage's end's waits (end_left)."""
        sender = self._sender
        deadline = time.monotonic() + min(timeout_s, self.end_left())
        while sender.sent < sender.written and sender.lost is None and time.monotonic() < deadline:
            sender.wake.set()
            time.sleep(0.05)
        return sender.sent >= sender.written and sender.lost is None

    def fail_from_thread(self, cause: str) -> None:
        """(`failure`: hang, from stages.common.watchdog); sent within PIPELINE_TRACKING_FLUSH_S or kept."""
        self.set_tags({"failure": "hang", "failure_cause": cause[:5000]})
        self.end("FAILED")

    @timing.phase("tracking")
    def end(self, status: str) -> bool:
        """The records that do not reach the server within what is left of the stage's end (end_left) stay
        in the journal, for a later send."""
        self._sender.put({"kind": "end", "status": status, "time": int(time.time() * 1000), **self._ending})
        return self._sender.close(self.end_left())
