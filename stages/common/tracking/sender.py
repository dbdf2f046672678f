"""A stage's records reach MLflow from a thread of their own, through its journal on disk: training
appends a line and goes on, whatever the server does. A server that refuses, fails or stops answering is
taken as lost within seconds (one warning naming it); the records wait in the journal, are sent when it
answers again, and at the end the stage waits at most PIPELINE_TRACKING_FLUSH_S in all for them and for
its system metrics (RunTracker.end_left) before it exits anyway, its outputs published. A journal left
unsent is sent by the next stage of the workspace that reaches the server (or `python -m
stages.common.tracking.journal resend`), if a stage of the workspace wrote it (journal.Seal).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from pathlib import Path

from stages.common.config import UserError
from stages.common.tracking import journal
from stages.common.tracking.records import reason, say, send_records
from stages.common.tracking.store import server_problem

STALL_S = 5.0  # a request unanswered this long: the server is taken as lost
PROBE_S = 2.0  # while lost, its health is asked this often
FLUSH_S = 30.0
# MLflow's HTTP client retries a request 7 times over minutes by default; here a request gives up sooner
# (the sender tries again on its own). A value the user set wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def flush_s() -> float:
    value = os.environ.get("PIPELINE_TRACKING_FLUSH_S", str(FLUSH_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise UserError(f"PIPELINE_TRACKING_FLUSH_S must be a number of seconds >= 0, got {value!r}")
    return seconds


class Sender:
    """The records of run `run_id` (rank 0's stage run), appended to its unsent file in workspace `root`
    (signed: Seal) and sent by a thread."""

    def __init__(self, client, run_id: str, uri: str, root: Path, header: dict, leftovers: list[Path] = ()):
        self.client, self.run_id, self.uri, self.root = client, run_id, uri, root
        self.path = path = root / journal.UNSENT / f"{run_id}.jsonl"
        self.seal = journal.Seal(journal.journal_key(root), run_id, root)
        for attempt in range(3):  # (a stage ending beside this one removes the empty folder)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.file = open(path, "ab")  # noqa: SIM115 - open for the run's life
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        fcntl.flock(self.file, fcntl.LOCK_EX)  # held while this process lives: its file is not a leftover
        self.file.write(self.seal.line({"kind": "header", "run_id": run_id, "uri": uri, "root": str(root), **header}))
        self.file.flush()
        self.sent = self.file.tell()  # (the header is not a record to send)
        self.written = self.sent
        self.lost: str | None = None  # why the server is taken as lost, while it is
        self.busy_since: float | None = None  # when the request in flight started (metrics and tags)
        self.closing = False
        self.accepting = True  # False once the run has ended: its records are all in the file
        self.leftovers = list(leftovers)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mlflow-sender", daemon=True)
        self.thread.start()
        self.watch = threading.Thread(target=self._watch, name="mlflow-sender-watch", daemon=True)
        self.watch.start()

    def put(self, record: dict) -> None:
        """Append one record (never waits on the server)."""
        if self.accepting:
            self._append(record)

    def _append(self, record: dict) -> None:
        line = self.seal.line(record)
        with self.lock:
            if self.file.closed:
                return
            self.file.write(line)
            self.file.flush()
            self.written = self.file.tell()
        self.wake.set()

    def _lose(self, why: str) -> None:
        with self.lock:
            first, self.lost = self.lost is None, self.lost or why
        if first:
            say(
                f"the MLflow server {self.uri} is not taking this run's records ({why}); training goes on, "
                f"the records wait in {self.path} and are sent when it answers"
            )

    def _watch(self) -> None:
        while not self.file.closed:
            with self.lock:
                started = self.busy_since
                stalled = started is not None and time.monotonic() - started > STALL_S and self.lost is None
            if stalled:
                self._lose(f"no answer for {STALL_S:.0f} s")
            time.sleep(0.5)

    def _unsent(self) -> list[tuple[dict, int]]:
        with self.lock:
            end = self.written
        with open(self.path, "rb") as fh:
            found = journal.read_records(fh, self.sent, end)
        for i, (record, at) in enumerate(found):
            if not self.seal.holds(record):  # appended by another writer: never sent, passed as if it were
                say(f"{self.path}, the line ending at byte {at}: not written by this run; passed over")
                found[i] = ({"kind": "sent", "upto": at}, at)
        return found

    def _advance(self, pending: list[tuple[dict, int]], n: int) -> None:
        """The first `n` of `pending` are sent: noted in the file, where a later resend starts."""
        if n == 0:
            return
        if any(r["kind"] != "sent" for r, _ in pending[:n]):
            self._append({"kind": "sent", "upto": pending[n - 1][1]})
        self.sent = pending[n - 1][1]

    def _busy(self, kind: str | None) -> None:
        """Note a request in flight (or none): a batch of metrics and tags unanswered for STALL_S means a
        lost server; an upload (an artifact, a model) may take longer and fails by its own time-outs."""
        with self.lock:
            self.busy_since = time.monotonic() if kind in ("metrics", "tags") else None

    def _run(self) -> None:
        try:
            self._send_until_closed()
        except (OSError, ValueError):  # the file closed under it: the process is ending
            pass

    def _send_until_closed(self) -> None:
        while True:
            self.wake.wait(PROBE_S)
            self.wake.clear()
            if self.lost is not None:
                problem = server_problem(self.uri, timeout_s=PROBE_S * 2)
                if problem:
                    continue
            pending = self._unsent()
            progress = [0]
            try:
                send_records(self.client, self.run_id, [r for r, _ in pending], progress, self._busy)
                if not pending:  # (others' leftovers only when this run's own records are in)
                    while self.leftovers:
                        try:
                            journal.resend(self.leftovers.pop(0), self.client, self.root)
                        except journal.JournalRefused as e:
                            say(str(e))
                        except (UserError, FileNotFoundError):  # being sent, or sent, by another stage
                            pass
            except Exception as e:  # noqa: BLE001 - kept on disk and sent again; the stage goes on
                self._advance(pending, progress[0])
                self._lose(reason(e))
                continue
            finally:
                self._busy(None)
            self._advance(pending, len(pending))
            if self.lost is not None:
                with self.lock:
                    self.lost = None
                say(f"the MLflow server {self.uri} answers again; the records kept meanwhile are sent")
            if self.closing and self.sent == self.written:
                return

    def close(self, timeout_s: float) -> bool:
        """The run has ended: wait up to `timeout_s` for every record to be sent; True when they were (the
        file is then removed). Else the reason is printed, and the thread goes on sending while the
        process lives, the file locked; what is left then is a leftover for a later send."""
        self.accepting = False
        self.closing = True
        self.wake.set()
        self.thread.join(timeout_s)
        done = not self.thread.is_alive() and self.sent == self.written
        if not done:
            say(
                f"run {self.run_id}'s last records did not reach {self.uri} by the stage's end "
                f"(PIPELINE_TRACKING_FLUSH_S={flush_s():g}; {self.lost or 'still sending'}); they are kept in "
                f"{self.path}, sent by the next stage that reaches the server, or by `python -m "
                f"stages.common.tracking.journal resend {self.path}`"
            )
            return False
        with self.lock:
            self.path.unlink(missing_ok=True)
            self.file.close()
        for folder in (self.path.parent, self.path.parent.parent):  # the folders, where nothing else is kept
            with contextlib.suppress(OSError):
                folder.rmdir()
        return True
