"""The records of a run, as the journal keeps them and the store takes them: one table (KINDS) says, for
each kind of record, how it is sent, whether it is batched, and which local file a replayed one uploads.
Sending needs only a client (an `mlflow.MlflowClient`, or any object with its methods)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stages.common import digest
from stages.common.tracking import datasets, models
from stages.common.tracking.parents import end_parent


def say(message: str) -> None:
    print(f"tracking: {message}", file=sys.stderr, flush=True)


def reason(e: Exception) -> str:
    """A request's failure in a few words (MLflow's own message quotes the whole urllib3 chain)."""
    text = str(e)
    for pattern, words in (
        ("Connection refused", "connection refused"),
        ("NewConnectionError", "connection refused"),
        ("Read timed out", "no answer"),
        ("RemoteDisconnected", "connection closed by the server"),
        ("Connection reset", "connection reset"),
        ("Connection aborted", "connection closed by the server"),
    ):
        if pattern in text:
            return words
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first[:200]}"


def refused_by_store(e: Exception) -> bool:
    """Whether the store answered a request with a client error (HTTP 4xx: a bad value, say), which
    sending it again would meet again; a lost connection or a server error is worth another try."""
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException) and e.get_http_status_code() < 500


def _metric_items(r: dict) -> list:
    from mlflow.entities import Metric

    return [Metric(k, v, r["time"], r["step"] or 0) for k, v in r["values"].items()]


def _tag_items(r: dict) -> list:
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)[:8000]) for k, v in r["tags"].items()]


def _send_text(client, run_id: str, r: dict) -> None:
    client.log_text(run_id, r["text"], r["name"])


def _send_artifact(client, run_id: str, r: dict) -> None:
    path = Path(r["path"])
    if not path.exists():
        say(f"run {run_id}: artifact {path} is gone; not sent")
    elif path.is_dir():
        client.log_artifacts(run_id, str(path), r["artifact_path"])
    else:
        client.log_artifact(run_id, str(path), r["artifact_path"])


def _send_register(client, run_id: str, r: dict) -> None:
    """A model version (registered from the run's sender, or from kept records once the server is back)."""
    folder = Path(r["folder"])
    if not (folder.is_dir() and digest.hash_files([folder]) == r["content"]):
        say(f"run {run_id}: {folder} is gone or changed since the run; not registered as {r['name']}")
        return
    try:
        version = models.register_version(client, run_id, r)
    except Exception as e:
        if refused_by_store(e):
            with contextlib.suppress(Exception):
                client.set_tag(run_id, "registry_error", f"{r['name']}: {reason(e)}"[:500])
        raise
    say(f"run {run_id}: {folder} registered as {r['name']} version {version}")


def _send_end(client, run_id: str, r: dict) -> None:
    client.set_terminated(run_id, status=r["status"], end_time=r["time"])
    if r.get("parent"):
        end_parent(client, r["parent"], r["label"], r["status"], Path(r["lock"]))


@dataclass(frozen=True)
class Kind:
    """How records of one kind reach the store."""

    send: Callable | None = None  # (client, run id, record): one request of its own
    batch: Callable | None = None  # record -> the items it adds to the next log_batch
    uploads: str | None = None  # the field naming a local file or folder it uploads
    last: bool = False  # replayed after every other record of its file


KINDS = {
    "header": Kind(),  # the journal's first line: which run, store and workspace (not sent)
    "sent": Kind(),  # the records before byte `upto` reached the store (not sent)
    "metrics": Kind(batch=_metric_items),
    "tags": Kind(batch=_tag_items),
    "text": Kind(send=_send_text),
    "inputs": Kind(send=datasets.send_inputs),  # the run's data deps as MLflow datasets
    "artifact": Kind(send=_send_artifact, uploads="path"),
    "register": Kind(send=_send_register, uploads="folder"),
    "checkpoint": Kind(send=lambda client, run_id, r: models.checkpoint_model(client, run_id, r)),
    "checkpoint_removed": Kind(send=lambda client, run_id, r: models.checkpoint_removed(client, run_id, r)),
    "end": Kind(send=_send_end, last=True),
}
NOT_SENT = KINDS["header"]


class _Batch:
    """Metric values and tags gathered until a record of another kind, sent in one log_batch each 1000."""

    def __init__(self, client, run_id: str, busy):
        self.client, self.run_id, self.busy = client, run_id, busy
        self.items: dict[str, list] = {"metrics": [], "tags": []}

    def add(self, kind: str, items: list) -> None:
        self.items[kind].extend(items)

    def send(self) -> None:
        metrics, tags = self.items["metrics"], self.items["tags"]
        self.busy("metrics")
        try:
            for i in range(0, max(len(metrics), len(tags)), 1000):
                self.client.log_batch(
                    self.run_id, metrics=metrics[i : i + 1000], tags=tags[i : i + 100] if i == 0 else []
                )
            for i in range(100, len(tags), 100):
                self.client.log_batch(self.run_id, tags=tags[i : i + 100])
        except Exception as e:
            if not refused_by_store(e):
                raise
            say(f"run {self.run_id}: the store refused {len(metrics)} metric values and {len(tags)} tags ({reason(e)})")
        metrics.clear()
        tags.clear()


def send_records(
    client, run_id: str, records: list[dict], progress: list[int] | None = None, busy=None, refused=None
) -> None:
    """Send `records` (lines of an unsent file) to run `run_id` in order, metrics and tags batched;
    `progress[0]` counts the first records sent (or refused by the store: named, then passed over);
    `busy(kind)` is told the kind of each request before it goes out; `refused(record)` says why a record
    is not to be sent (printed, the record passed over), or None."""
    progress = progress if progress is not None else [0]
    busy = busy or (lambda kind: None)
    batch = _Batch(client, run_id, busy)
    for i, r in enumerate(records):
        kind = KINDS.get(r["kind"], NOT_SENT)
        if kind.batch:
            batch.add(r["kind"], kind.batch(r))
        if not kind.send:
            continue
        batch.send()
        progress[0] = i
        why = refused(r) if refused else None
        if why:
            say(why)
        else:
            _send_one(client, run_id, r, kind, busy)
        progress[0] = i + 1
    batch.send()
    progress[0] = len(records)


def _send_one(client, run_id: str, r: dict, kind: Kind, busy) -> None:
    busy(r["kind"])
    try:
        kind.send(client, run_id, r)
    except Exception as e:
        if not refused_by_store(e):
            raise
        say(f"run {run_id}: the store refused a record of kind {r['kind']} ({reason(e)})")
