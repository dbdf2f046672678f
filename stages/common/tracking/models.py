"""A published model folder as an MLflow logged model of the stage's run, and a new version of its registered
model made from it. The logged model (named as the registered model) holds the folder as its artifacts (hard
links into a local artifact store, an upload elsewhere), the run's params, the lineage tags of
stages/common/registry.py (version_record) and the stage's final metrics, logged against it (`model_id`), so
`search_logged_models` ranks a stage's models; the version's source is `models:/<model id>`, with the same
tags. Sent as the run's `register` record (stages/common/tracking/records.py), never from the training loop."""

from __future__ import annotations

import json
import os
import re
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


def mlflow_name(text: str) -> str:
    """`text` as a model's name in MLflow: the characters it refuses there (/ : . % " ') as _."""
    return re.sub(r"[/:.%\"']", "_", text)


CHECKPOINT_TYPE = "checkpoint"  # (the logged model's model_type: `search_logged_models` tells them apart)


def _checkpoint_of(client, run, folder: str):
    found = client.search_logged_models(
        [run.info.experiment_id],
        filter_string=f"source_run_id = '{run.info.run_id}' AND tags.`checkpoint.path` = '{folder}'",
        max_results=1,
    )
    return found[0] if found else None


def checkpoint_model(client, run_id: str, record: dict):
    """A checkpoint a training run published (`record`: its folder, step, manifest sha256, the run's metric
    points of its step, and `label`, which of the run's trainings) as a READY logged model of the run,
    `<run name>-step-<step>` (`<run name>-<label>-step-<step>`; mlflow_name: `sweep_lr@0_001-step-5`),
    of model_type "checkpoint": its params the
    run's, its metrics those points logged against it, its tags where it lies (`checkpoint.path`), its step,
    its manifest and whether it is still kept there (`checkpoint.kept`). Its files stay where the stage keeps
    them (resumable; pruned as training goes on, removed once the stage's output is published): not copied."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric

    run = client.get_run(run_id)
    model = _checkpoint_of(client, run, record["folder"])
    if model is not None and model.status == LoggedModelStatus.READY:
        return model
    if model is None:
        tags = {
            "checkpoint.path": record["folder"],
            "checkpoint.step": str(record["step"]),
            "checkpoint.manifest_sha256": record["manifest_sha256"],
            "checkpoint.kept": "true",
            "stage": run.data.tags.get("stage", ""),
        }
        step = f"{record['label']}-step-{record['step']}" if record.get("label") else f"step-{record['step']}"
        model = client.create_logged_model(
            run.info.experiment_id,
            name=mlflow_name(f"{run.info.run_name}-{step}"),
            source_run_id=run_id,
            tags=tags,
            params=dict(run.data.params),
            model_type=CHECKPOINT_TYPE,
        )
    # (the run's own points: logged again with the model's id, they add none to the run's curves)
    points = [Metric(key, value, ms, step, model_id=model.model_id) for key, value, step, ms in record["points"]]
    if points:
        client.log_batch(run_id, metrics=points)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, record["step"])])
    return client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)


def checkpoint_removed(client, run_id: str, record: dict) -> None:
    """Every logged model of the checkpoint in `record["folder"]` still tagged as kept, this run's or an
    earlier one's (a killed run's checkpoint, resumed by this one): `checkpoint.kept=false`, and why
    (`checkpoint.removed`)."""
    run = client.get_run(run_id)
    kept = client.search_logged_models(
        [run.info.experiment_id],
        filter_string=f"tags.`checkpoint.path` = '{record['folder']}' AND tags.`checkpoint.kept` = 'true'",
        max_results=100,
    )
    for model in kept:
        client.set_logged_model_tags(model.model_id, {"checkpoint.kept": "false", "checkpoint.removed": record["why"]})


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
