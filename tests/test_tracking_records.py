"""The kinds of records (stages/common/tracking/records.py: KINDS) as a client receives them: metric values
and tags batched until a record of another kind, each other kind one request, in order; a record the store
refuses (HTTP 4xx) named and passed over. A fake client, no store."""

from __future__ import annotations

import pytest

from stages.common import digest
from stages.common.tracking.records import KINDS, send_records


class Client:
    """Records each call as (method, run id, what it carried)."""

    def __init__(self, refuse: str | None = None):
        self.calls, self.refuse = [], refuse

    def _call(self, method: str, run_id: str, what) -> None:
        if method == self.refuse:
            from mlflow.exceptions import MlflowException
            from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

            raise MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE)  # (HTTP 400)
        self.calls.append((method, run_id, what))

    def log_batch(self, run_id, metrics=(), tags=(), params=()):
        self._call("log_batch", run_id, sorted([m.key for m in metrics] + [t.key for t in tags]))

    def log_text(self, run_id, text, name):
        self._call("log_text", run_id, name)

    def log_artifact(self, run_id, path, artifact_path=None):
        self._call("log_artifact", run_id, artifact_path)

    def set_terminated(self, run_id, status=None, end_time=None):
        self._call("set_terminated", run_id, status)

    def set_tag(self, run_id, key, value):
        self._call("set_tag", run_id, key)


def test_each_kind_reaches_the_client_in_order_metrics_and_tags_batched(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    records = [
        {"kind": "header", "run_id": "r"},
        {"kind": "metrics", "values": {"loss": 1.0}, "step": 1, "time": 1},
        {"kind": "tags", "tags": {"nodes": "a"}},
        {"kind": "text", "text": "pkgs", "name": "environment/requirements.txt"},
        {"kind": "artifact", "path": str(tmp_path / "a.txt"), "artifact_path": "plots"},
        {"kind": "artifact", "path": str(tmp_path / "gone.txt"), "artifact_path": None},
        {"kind": "sent", "upto": 10},
        {"kind": "metrics", "values": {"val_loss": 2.0}, "step": 2, "time": 2},
        {"kind": "end", "status": "FINISHED", "time": 3},
    ]
    client, progress = Client(), [0]
    send_records(client, "r", records, progress)
    assert client.calls == [
        ("log_batch", "r", ["loss", "nodes"]),
        ("log_text", "r", "environment/requirements.txt"),
        ("log_artifact", "r", "plots"),  # (a file gone since is named, not sent)
        ("log_batch", "r", ["val_loss"]),
        ("set_terminated", "r", "FINISHED"),
    ]
    assert progress == [len(records)]
    assert set(KINDS) == {r["kind"] for r in records} | {"register"}


def test_a_record_refused_by_the_store_or_the_caller_is_named_and_passed_over(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/w.bin").write_bytes(b"\0")
    content = digest.hash_files([tmp_path / "model"])
    register = {"kind": "register", "name": "tiny", "folder": str(tmp_path / "model"), "tags": {}}
    records = [
        {"kind": "text", "text": "x", "name": "a.txt"},
        {**register, "description": "", "content": "changed"},
        {"kind": "artifact", "path": "/etc/hostname", "artifact_path": None},
        {"kind": "end", "status": "FAILED", "time": 1},
    ]
    client = Client(refuse="log_text")
    send_records(client, "r", records, refused=lambda r: "not from the outputs" if r["kind"] == "artifact" else None)
    said = capsys.readouterr().err
    assert "the store refused a record of kind text" in said and "not from the outputs" in said
    assert f"{tmp_path / 'model'} is gone or changed since the run; not registered as tiny" in said
    assert client.calls == [("set_terminated", "r", "FAILED")]
    assert content  # (the folder as it is: a record with its content would be registered)


def test_a_lost_connection_stops_the_send_where_it_was():
    class Lost(Client):
        def log_text(self, run_id, text, name):
            raise ConnectionError("Connection refused")

    records = [
        {"kind": "metrics", "values": {"loss": 1.0}, "step": 1, "time": 1},
        {"kind": "text", "text": "x", "name": "a.txt"},
        {"kind": "end", "status": "FINISHED", "time": 2},
    ]
    client, progress = Lost(), [0]
    with pytest.raises(ConnectionError):
        send_records(client, "r", records, progress)
    assert progress == [1] and client.calls == [("log_batch", "r", ["loss"])]
