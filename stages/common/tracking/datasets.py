"""A stage run's inputs as MLflow datasets: each data dep it reads (under the launcher, its DAG's:
contract.INPUTS; run by hand, the paths it hashed), named by its path, its digest DVC's hash of it (the md5
dvc.lock records for that dep: `<md5>.dir` for a folder) and its source type `dvc`. Hashed by rank 0 as the
run opens and sent as the run's `inputs` record (records.py), so a lost server loses none of them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from stages.common import contract, digest
from stages.common.config import UserError

SOURCE_TYPE = "dvc"
CONTEXT = "input"  # the dataset's role in the run (MLflow's tag mlflow.data.context)


def stage_inputs(given=()) -> list[str]:
    """The paths the run records: the data deps the launcher passed (contract.INPUTS), else `given`."""
    raw = os.environ.get(contract.INPUTS)
    if not raw:
        return [str(p) for p in given]
    try:
        paths = json.loads(raw)
    except ValueError:
        paths = None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise UserError(f"{contract.INPUTS} must be a JSON list of paths (the launcher sets it), got {raw[:200]!r}")
    return paths


def inputs_record(paths, root: Path) -> dict | None:
    """The `inputs` record of `paths` (relative to `root`, the repository the stage runs in), each with its
    DVC hash; None when none of them is there."""
    hashes = digest.dvc_md5s(paths, root)
    if not hashes:
        return None
    return {"kind": "inputs", "datasets": [{"name": name, "digest": md5} for name, md5 in hashes.items()]}


def send_inputs(client, run_id: str, r: dict) -> None:
    """The record's datasets as the run's dataset inputs (MLflow merges one logged again)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    client.log_inputs(
        run_id,
        datasets=[
            DatasetInput(
                Dataset(d["name"], d["digest"], SOURCE_TYPE, json.dumps({"path": d["name"], "md5": d["digest"]})),
                [InputTag(MLFLOW_DATASET_CONTEXT, CONTEXT)],
            )
            for d in r["datasets"]
        ],
    )
