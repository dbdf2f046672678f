"""A published model folder as an MLflow logged model of the stage's run, and a new version of its registered
model made from it. The logged model (named as the registered model) holds the folder as its artifacts (hard
links into a local artifact store, an upload elsewhere), the run's params, the lineage tags of
stages/common/registry.py (version_record) and the stage's final metrics, logged against it (`model_id`), so
`search_logged_models` ranks a stage's models; the version's source is `models:/<model id>`, with the same
tags. Sent as the run's `register` record (stages/common/tracking/records.py), never from the training loop."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from stages.common.tracking.store import local_path


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # published files are replaced, never written in place: sharing them is safe
    except OSError:
        shutil.copy2(src, dst)  # another filesystem, or links not allowed


def store_folder(folder: Path, artifact_uri: str, upload) -> None:
    """`folder`'s files as the artifacts at `artifact_uri`: linked into a local store, else `upload()`."""
    dest = local_path(artifact_uri)
    if dest is None:
        upload()
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp, copy_function=_link_or_copy)
    shutil.rmtree(dest, ignore_errors=True)  # (empty, or left by a send cut short)
    tmp.rename(dest)


def final_metrics(metrics: list, item: str | None = None, items=()) -> dict:
    """{key for the model: the run's last value of a metric (an mlflow Metric)} that describes the model of
    `item`: its system metrics left out; a stage that trains several models in one run (extend_context's
    variants) names theirs `<item>.<key>`, taken as `<key>` for that item's model, left out of the others'."""
    own, shared = {}, {}
    for metric in metrics:
        head, dot, rest = metric.key.partition(".")
        if metric.key.startswith("system/"):
            continue
        if dot and head == item:
            own[rest] = metric
        elif not (dot and head in items):
            shared[metric.key] = metric
    return {**shared, **own}


def logged_model(client, run, record: dict):
    """The READY logged model of `record` (stages.common.registry.version_record) from `run`: the one a send
    cut short made, or a new one."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric

    name, run_id = record["name"], run.info.run_id
    found = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"name = '{name}' AND source_run_id = '{run_id}'", max_results=1
    )
    if found and found[0].status == LoggedModelStatus.READY:
        return found[0]
    model = found[0] if found else None
    if model is None:
        model = client.create_logged_model(
            run.info.experiment_id,
            name=name,
            source_run_id=run_id,
            tags=record["tags"],
            params=dict(run.data.params),
            model_type=run.data.tags.get("stage"),
        )
    folder = Path(record["folder"])
    store_folder(folder, model.artifact_location, lambda: client.log_model_artifacts(model.model_id, str(folder)))
    # A model's metric is also a point of the run's: logged at the time and step of the run's last value,
    # under the model's key, it adds none to the run's curves (MLflow keeps one of two equal points).
    last = [Metric.from_proto(m) for m in run.data.to_proto().metrics]
    metrics = final_metrics(last, record.get("item"), record.get("items", ()))
    items = [Metric(k, m.value, m.timestamp, m.step, model_id=model.model_id) for k, m in sorted(metrics.items())]
    for i in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[i : i + 1000])
    if model.model_id not in {o.model_id for o in (run.outputs.model_outputs if run.outputs else [])}:
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])  # (the run page lists it)
    return client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)


def register_version(client, run_id: str, record: dict) -> int:
    """Register `record` (stages.common.registry.version_record: the model's folder and its lineage tags) as
    a logged model of run `run_id` and a new version of its registered model made from it."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    name = record["name"]
    # Once per run and name: a registration sent again (its writer stopped before noting it as sent)
    # finds its version.
    for found in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        return int(found.version)
    model = logged_model(client, client.get_run(run_id), record)
    try:
        client.create_registered_model(name, description=record["description"])
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    # A store opened directly finds the logged model of a `models:/<id>` source through the process's
    # tracking URI (a server finds it itself): this client's, for the call (MLflow's own helper).
    with _use_tracking_uri(client.tracking_uri):
        version = client.create_model_version(
            name, source=model.model_uri, run_id=run_id, tags=record["tags"], model_id=model.model_id
        )
    # (what mlflow.register_model notes on a logged model: the UI lists its versions from it)
    listed = json.loads(model.tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    entry = [*listed, {"name": name, "version": str(version.version)}]
    client.set_logged_model_tags(model.model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(entry)})
    client.set_tag(run_id, f"registered_model.{name}", str(version.version))
    return int(version.version)
