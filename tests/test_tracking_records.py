"""The kinds of records (stages/common/tracking/records.py: KINDS) as a client receives them: metric values
and tags batched until a record of another kind, each other kind one request, in order; a record the store
refuses (HTTP 4xx) named and passed over. A fake client, no store."""

from __future__ import annotations

import json

import pytest

from stages.common import config, digest
from stages.common.tracking import models
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
    assert set(KINDS) == {r["kind"] for r in records} | {"register", "inputs", "checkpoint", "checkpoint_removed"}


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


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory):
    """(client, experiment id, folder) of a temporary SQLite store, artifacts in its folder."""
    import mlflow

    from stages.common.tracking import store

    root = tmp_path_factory.mktemp("store")
    store._make_sqlite_store(root / "mlflow.db")
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    return client, client.create_experiment("pipeline", artifact_location=(root / "mlartifacts").as_uri()), root


def test_inputs_reach_the_run_as_datasets_with_dvc_md5s(sqlite_store, tmp_path, monkeypatch):
    from stages.common.tracking import datasets

    client, experiment_id, _ = sqlite_store
    (tmp_path / "data/tokenize").mkdir(parents=True)
    (tmp_path / "data/tokenize/shard-0.bin").write_bytes(b"\1\2")
    (tmp_path / "data/prepare_data.txt").write_text("corpus")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_INPUTS", '["data/tokenize", "data/prepare_data.txt", "data/gone"]')
    paths = datasets.stage_inputs(["given/by/the/stage"])  # (the launcher's list wins)
    record = datasets.inputs_record(paths, tmp_path)
    run_id = client.create_run(experiment_id).info.run_id
    send_records(client, run_id, [record])
    found = {d.dataset.name: d for d in client.get_run(run_id).inputs.dataset_inputs}
    assert set(found) == {"data/tokenize", "data/prepare_data.txt"}, "a path that is not there is left out"
    for name, given in found.items():
        assert given.dataset.digest == digest.dvc_md5(name) and given.dataset.source_type == "dvc"
        assert {t.key: t.value for t in given.tags} == {"mlflow.data.context": "input"}
    assert found["data/tokenize"].dataset.digest.endswith(".dir")
    monkeypatch.setenv("PIPELINE_INPUTS", "data/tokenize")
    with pytest.raises(config.UserError, match="PIPELINE_INPUTS must be a JSON list"):
        datasets.stage_inputs()


def test_dvc_hashes_through_dvcs_state_follow_a_changed_file(tmp_path, monkeypatch):
    """In a DVC repository, hashes come through DVC's record of earlier ones (by inode, size and time):
    equal to a fresh hash, and a file changed since is hashed again."""
    from dvc.repo import Repo

    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path / "site"))  # (DVC's record, kept in the test's folder)

    Repo.init(str(tmp_path), no_scm=True).close()
    (tmp_path / "data").mkdir()
    (tmp_path / "data/a.txt").write_text("one")
    first = digest.dvc_md5s(["data"], tmp_path)
    assert first == {"data": digest.dvc_md5(tmp_path / "data", tmp_path)}
    (tmp_path / "data/a.txt").write_text("two, longer")
    again = digest.dvc_md5s([tmp_path / "data"], tmp_path)
    assert again == {str(tmp_path / "data"): digest.dvc_md5(tmp_path / "data", tmp_path)} != first


def test_a_published_model_is_a_logged_model_with_metrics_and_the_version_comes_from_it(sqlite_store, tmp_path):
    from mlflow.entities import Metric, Param

    from stages.common import registry
    from stages.common.tracking import store

    client, experiment_id, _ = sqlite_store
    folder = tmp_path / "data/finetune_qlora/nf4/model"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    run_id = client.create_run(experiment_id, tags={"stage": "finetune_qlora"}).info.run_id
    client.log_batch(
        run_id,
        metrics=[Metric("eval_loss", 2.5, 1, 3), Metric("system/host/cpu", 9.0, 1, 0)],
        params=[Param("quantization", "nf4")],
    )
    record = registry.version_record("finetune_qlora-nf4", folder, {"git_commit": "abc"}, "QLoRA", "nf4", ["nf4"])
    send_records(client, run_id, [{"kind": "register", **record}])
    send_records(client, run_id, [{"kind": "register", **record}])  # (sent again: one version, one model)
    (version,) = client.search_model_versions("name = 'finetune_qlora-nf4'")
    (model,) = client.search_logged_models([experiment_id], filter_string="name = 'finetune_qlora-nf4'")
    assert version.source == f"models:/{model.model_id}" and version.run_id == run_id == model.source_run_id
    assert version.tags == {k: model.tags[k] for k in version.tags} and version.tags["dvc_md5"].endswith(".dir")
    assert model.status == "READY" and model.params == {"quantization": "nf4"} and model.model_type == "finetune_qlora"
    assert {m.key: m.value for m in model.metrics} == {"eval_loss": 2.5}, "the run's last values, no system metrics"
    history = client.get_metric_history(run_id, "eval_loss")
    assert [(m.step, m.value) for m in history] == [(3, 2.5)], "the run's curve as it was"
    assert json.loads(model.tags["mlflow.modelVersions"]) == [{"name": "finetune_qlora-nf4", "version": "1"}]
    assert [o.model_id for o in client.get_run(run_id).outputs.model_outputs] == [model.model_id]
    # The version's files: links to the published ones in the logged model's artifacts.
    stored = store.local_path(client.get_model_version_download_uri("finetune_qlora-nf4", "1"))
    assert (stored / "model.safetensors").stat().st_ino == (folder / "model.safetensors").stat().st_ino
    assert client.get_run(run_id).data.tags["registered_model.finetune_qlora-nf4"] == "1"


def test_a_published_checkpoint_is_a_logged_model_of_its_step_then_marked_removed(sqlite_store, tmp_path):
    """A checkpoint a training run published: a READY logged model `<run>-step-<n>` of type checkpoint with the
    run's params and the run's own points of its step as metrics (the run's curves unchanged), once however
    often it is sent; its removal (pruned, or the stage done) tagged on it."""
    from mlflow.entities import Metric, Param

    from stages.common.loop import Logged

    client, experiment_id, _ = sqlite_store
    run_id = client.create_run(experiment_id, run_name="pretrain", tags={"stage": "pretrain"}).info.run_id
    logged = Logged()
    for step, loss, val in ((1, 4.0, None), (2, 3.5, 3.75), (3, 3.25, None), (4, 3.0, None)):
        metrics = {"loss": loss, "lr": 0.001 * step, "tokens_per_s": 99.0} | ({"val_loss": val} if val else {})
        client.log_batch(run_id, metrics=[Metric(k, v, 1000 + step, step) for k, v in metrics.items()])
        logged.add(metrics, step, 1000 + step)
        if step == 3:
            logged.mark(3)  # (saved at step 3, published after step 4: its points are step 3's)
    client.log_batch(run_id, params=[Param("train.lr", "0.001")])
    folder = tmp_path / "checkpoints/step-3"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    record = {"kind": "checkpoint", "folder": str(folder), "step": 3, "manifest_sha256": "ab", "label": ""}
    record["points"] = [list(p) for p in logged.at(3)]
    send_records(client, run_id, [record])
    send_records(client, run_id, [record])  # (sent again: one model)
    (model,) = client.search_logged_models([experiment_id], filter_string="name = 'pretrain-step-3'")
    assert model.status == "READY" and model.model_type == "checkpoint" and model.params == {"train.lr": "0.001"}
    assert {m.key: (m.value, m.step) for m in model.metrics} == {
        "loss": (3.25, 3),
        "lr": (0.003, 3),
        "val_loss": (3.75, 2),
    }, "the step's loss and lr, the last validation before it"
    assert model.tags["checkpoint.path"] == str(folder) and model.tags["checkpoint.kept"] == "true"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [
        (1, 4.0),
        (2, 3.5),
        (3, 3.25),
        (4, 3.0),
    ], "the run's curve as it was"
    assert model.model_id in [o.model_id for o in client.get_run(run_id).outputs.model_outputs]
    # removed by a later run (which resumed from it: the run before was killed), it is no longer kept
    later = client.create_run(experiment_id, run_name="pretrain", tags={"stage": "pretrain"}).info.run_id
    send_records(client, later, [{"kind": "checkpoint_removed", "folder": str(folder), "why": "the newest 2 kept"}])
    model = client.get_logged_model(model.model_id)
    assert model.tags["checkpoint.kept"] == "false" and model.tags["checkpoint.removed"] == "the newest 2 kept"
    # one of several trainings in a run (extend_context's variants): named with its label
    other = tmp_path / "checkpoints/yarn/step-3"
    other.mkdir(parents=True)
    send_records(client, run_id, [{**record, "folder": str(other), "label": "yarn-ft", "points": []}])
    (labelled,) = client.search_logged_models([experiment_id], filter_string="name = 'pretrain-yarn-ft-step-3'")
    assert labelled.tags["checkpoint.path"] == str(other)


def test_a_model_of_several_in_one_run_gets_its_own_metrics():
    from mlflow.entities import Metric

    def values(metrics: dict, item: str, items: list) -> dict:
        found = models.final_metrics([Metric(k, v, 1, 0) for k, v in metrics.items()], item, items)
        return {k: m.value for k, m in found.items()}

    metrics = {"yarn-ft.val_loss": 2.0, "pi-ft.val_loss": 3.0, "tokens_per_s": 9.0, "system/h/cpu": 1.0}
    assert values(metrics, "yarn-ft", ["yarn-ft", "pi-ft"]) == {"val_loss": 2.0, "tokens_per_s": 9.0}
    assert values({"eval_loss": 1.0}, "nf4", ["nf4"]) == {"eval_loss": 1.0}
