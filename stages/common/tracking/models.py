"""A published model folder as a new version of a registered model, from the stage's run: the folder is
stored as the run's artifact `models/<name>` (hard links into a local artifact store, an upload
elsewhere) and the version carries the lineage tags of stages/common/registry.py (version_record).
Sent as the run's `register` record (stages/common/tracking/records.py), never from the training loop."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stages.common.tracking.store import local_path


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # published files are replaced, never written in place: sharing them is safe
    except OSError:
        shutil.copy2(src, dst)  # another filesystem, or links not allowed


def store_folder(client, run_id: str, folder: Path, artifact_path: str) -> None:
    """`folder` as the artifact `artifact_path` of run `run_id`."""
    run = client.get_run(run_id)
    local = local_path(run.info.artifact_uri)
    if local is None:
        client.log_artifacts(run_id, str(folder), artifact_path)
        return
    dest = local / artifact_path
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp, copy_function=_link_or_copy)
    tmp.rename(dest)


def register_version(client, run_id: str, record: dict) -> int:
    """Register `record` (stages.common.registry.version_record: the model's folder, stored as the run's
    artifact `models/<name>`, and its lineage tags) as a new version of its model, from run `run_id`."""
    from mlflow.exceptions import MlflowException

    name, folder = record["name"], Path(record["folder"])
    # Once per run and name: a registration sent again (its writer stopped before noting it as sent)
    # finds its version.
    for found in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        return int(found.version)
    artifact_path = f"models/{name}"
    store_folder(client, run_id, folder, artifact_path)
    try:
        client.create_registered_model(name, description=record["description"])
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(
        name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags=record["tags"]
    )
    client.set_tag(run_id, f"registered_model.{name}", str(version.version))
    return int(version.version)
