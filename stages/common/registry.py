"""The MLflow model registry: every published model becomes a version of a registered model, with its lineage.

Names: a stage's model is registered under the stage's name (`pretrain`), a stage's model per item or
variant as `<stage>-<item>` (`extend_context-yarn-ft`, `finetune_qlora-nf4`). Each model is first an MLflow
logged model of the stage's run, of the same name (stages/common/tracking/models.py: the Hugging Face folder
as its artifacts, hard links into a local artifact store, so no second copy on disk; the run's params; the
stage's final metrics), and the version is made from it (source `models:/<model id>`). Both carry its
lineage as tags:

    git_commit        the code that trained it
    dvc_md5           DVC's content hash of the model folder (`<md5>.dir`, as `dvc` computes it)
    output            the stage's output folder, and output_dvc_md5 its hash: the `md5` of that out in dvc.lock
    params_sha256     sha256 of the stage's params section as the stage read it (overrides applied)
    inputs_hash       the stage's own content hash of its inputs (also on the run)
    input.<path>      DVC's content hash of each input the stage read (for pretrain's data/tokenize and
                      extend_context's data/tokenize, the `md5` of that dep in dvc.lock; a file or
                      subfolder of a dep, e.g. finetune_qlora's instructions.jsonl, has its own hash)

The report stage sets the alias `reproduced` on the version whose report rows all pass. A version loads
as the stage wrote it: `AutoModelForCausalLM.from_pretrained(resolve("models:/pretrain@reproduced"))`, and
`eval_perplexity --models models:/pretrain@reproduced` evaluates it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from stages.common import atomic, config, digest, provenance
from stages.common.tracking import models, store

ALIAS = "reproduced"


def model_name(stage: str, item: str | None = None) -> str:
    """`<stage>` or `<stage>-<item>`, with the characters MLflow refuses in a model's name (/ : . % " ') as _
    (a sweep point's `sweep_lr-0.001` is registered as `sweep_lr-0_001`)."""
    return models.mlflow_name(f"{stage}-{item}" if item else stage)


def params_sha256(section: dict) -> str:
    return hashlib.sha256(json.dumps(section, sort_keys=True).encode()).hexdigest()


def tag_key(text: str) -> str:
    """`text` as an MLflow tag key (letters, digits, _ . - space : / only; no empty path parts)."""
    key = re.sub(r"[^\w.\- :/]", "_", text)
    return "/".join(part for part in key.split("/") if part not in ("", ".", ".."))


def origin(folder: str | Path) -> dict:
    """Where a model folder that the base stage wrote came from (base_model, base_revision, base_commit, from
    its meta.json beside it), for the records of the stages that start from it; {} for any other folder."""
    try:
        record = json.loads((Path(folder).parent / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or "base_model" not in record:
        return {}
    return {key: record[key] for key in ("base_model", "base_revision", "base_commit") if record.get(key)}


def lineage(output: Path, inputs: list[Path], section: dict, inputs_hash: str) -> dict:
    """The lineage tags shared by the models a stage published in `output` (see the module docstring)."""
    return {
        "git_commit": provenance.git_commit(),
        "output": str(output),
        "output_dvc_md5": digest.dvc_md5(output),
        "params_sha256": params_sha256(section),
        "inputs_hash": inputs_hash,
        **{tag_key(f"input.{p}"): digest.dvc_md5(p) for p in inputs if Path(p).exists()},
        **{key: value for p in inputs for key, value in origin(p).items()},  # (a hub base: its commit)
    }


def version_record(
    name: str, folder: Path, tags: dict, description: str, item: str | None = None, items: list | tuple = ()
) -> dict:
    """What registering the model in `folder` as a new version of `name` takes: its folder, its tags (its
    stage's lineage) with its own `dvc_md5`, taken now, the registered model's description, and which of
    the stage's models it is (`item` of `items`: whose metrics its logged model gets, tracking.models)."""
    folder = Path(folder).resolve()
    tags = {**tags, "dvc_md5": digest.dvc_md5(folder)}
    content = digest.hash_files([folder])  # (checked again before a later send registers it: tracking.records)
    return {
        "name": name,
        "folder": str(folder),
        "tags": tags,
        "description": description,
        "content": content,
        "item": item,
        "items": [i for i in items if i is not None],
    }


def versions_with(name: str, key: str, value: str) -> list:
    """The versions of registered model `name` whose tag `key` equals `value`, newest first."""
    from mlflow.exceptions import MlflowException

    try:
        found = store.open_client().search_model_versions(f"name = '{name}' and tags.`{key}` = '{value}'")
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return []
    return sorted(found, key=lambda v: int(v.version), reverse=True)


def is_registered(name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        store.open_client().get_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return False
    return True


def set_alias(name: str, version: int, alias: str = ALIAS) -> None:
    store.open_client().set_registered_model_alias(name, alias, str(version))


def is_uri(text: str) -> bool:
    return text.startswith("models:/")


def resolve(uri: str) -> tuple[Path, str]:
    """A registered model version as a local folder, and the version's `models:/<name>/<version>` URI.
    `uri` is `models:/<name>@<alias>` or `models:/<name>/<version>`; a version in a local artifact store
    is read where it is, any other is downloaded."""
    from mlflow.exceptions import MlflowException

    ref = uri.removeprefix("models:/")
    name, at, alias = ref.partition("@")
    if not at:
        name, _, number = ref.rpartition("/")
    where = f"{uri} (registry {store.tracking_uri()})"
    if not name or not (alias if at else number.isdigit()):
        raise config.UserError(f"{uri}: write a registered model as models:/<name>@<alias> or models:/<name>/<version>")
    problem = store.server_problem(store.tracking_uri())
    if problem:
        raise config.UserError(
            f"{where}: the tracking server does not answer ({problem}); start it or fix MLFLOW_TRACKING_URI"
        )
    client = store.open_client()
    try:
        version = client.get_model_version_by_alias(name, alias) if at else client.get_model_version(name, number)
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        known = sorted(m.name for m in client.search_registered_models(max_results=1000))
        raise config.UserError(
            f"{where}: no such registered model version; registered models: {', '.join(known) or 'none'} "
            f"(a stage that publishes a model registers it; `report` sets the alias '{ALIAS}')"
        ) from None
    source = client.get_model_version_download_uri(name, version.version)
    if source.startswith("runs:/"):  # the artifact of a run: where that run keeps its artifacts
        run_id, _, path = source.removeprefix("runs:/").partition("/")
        source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{path}"
    local = store.local_path(source)
    if local is None or not local.is_dir():
        local = download(source, name, int(version.version))
    return local, f"models:/{name}/{version.version}"


def download(source: str, name: str, version: int) -> Path:
    """A version kept elsewhere (a tracking server's artifact store), downloaded once into
    <checkpoints>/registry/<name>/<version>: the ranks of a run, and later runs, share it."""
    import mlflow

    from stages.common import ckpt

    dest = Path(ckpt.CHECKPOINT_ROOT) / "registry" / name / str(version)
    if not dest.is_dir():
        with atomic.scratch(dest) as tmp:  # (a download killed half-way: removed by the next one)
            # (the artifact lands under its own name in the folder given: tmp/model/config.json ...)
            uri = store.tracking_uri()
            got = Path(mlflow.artifacts.download_artifacts(source, dst_path=str(tmp), tracking_uri=uri))
            try:
                got.rename(dest)
            except OSError:  # another rank got there first: the same files
                pass
    return dest
