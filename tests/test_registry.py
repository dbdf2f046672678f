"""The MLflow model registry: a published model becomes a version with its lineage, loads back with the
folder's logits, is evaluated by `models:/` URI, and gets the alias `reproduced` when its rows pass."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, TRACKED, run_stage

from stages import eval_perplexity, report
from stages.common import config, digest, registry

STEPS = ["train.steps=4", "train.batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1"]
EVAL = ["--input", "data/tokenize", "contexts=[32]", "max_tokens=2000", "batch_size=4"]


@pytest.fixture(scope="module")
def registered(tokenized, tmp_path_factory) -> Path:
    """pretrain (2 processes) in a folder of its own, tracked to its own MLflow store."""
    root = tmp_path_factory.mktemp("registry")
    shutil.copy(tokenized / "params.yaml", root / "params.yaml")
    shutil.copytree(tokenized / "data/tokenize", root / "data/tokenize")
    args = ["--input", "data/tokenize", "--output", "data/pretrain", *TINY_MODEL, *STEPS, "train.eval_every=0"]
    run_stage("pretrain", args, cwd=root, nproc=2, **TRACKED)
    return root


@pytest.fixture
def in_registry(registered, monkeypatch) -> Path:
    monkeypatch.chdir(registered)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{registered / 'mlflow.db'}")
    monkeypatch.delenv("PIPELINE_TRACKING", raising=False)
    return registered


def logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(24).reshape(2, 12)).logits


def test_a_published_model_is_a_registered_version_with_its_lineage(in_registry):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{in_registry / 'mlflow.db'}")
    (version,) = client.search_model_versions("name = 'pretrain'")
    run = client.get_run(version.run_id)
    assert run.data.tags["stage"] == "pretrain" and run.data.tags["registered_model.pretrain"] == str(version.version)
    tags = version.tags
    assert tags["dvc_md5"] == digest.dvc_md5("data/pretrain/model") and tags["dvc_md5"].endswith(".dir")
    assert tags["output"] == "data/pretrain" and tags["output_dvc_md5"] == digest.dvc_md5("data/pretrain")
    assert tags["input.data/tokenize"] == digest.dvc_md5("data/tokenize")
    assert tags["inputs_hash"] == run.data.tags["inputs_hash"] and tags["git_commit"] == run.data.tags["git_commit"]
    assert tags["params_sha256"] == registry.params_sha256(config.as_dict(_pretrain_config(in_registry)))

    folder, uri = registry.resolve("models:/pretrain/1")
    assert uri == "models:/pretrain/1"
    assert torch.equal(logits(folder), logits(Path("data/pretrain/model")))
    # A local artifact store holds links to the published files, not a second copy.
    weights = folder / "model.safetensors"
    assert weights.stat().st_ino == Path("data/pretrain/model/model.safetensors").stat().st_ino


def _pretrain_config(root: Path):
    from stages import pretrain

    overrides = [*TINY_MODEL, *STEPS, "train.eval_every=0"]
    return config.load(pretrain.Config, "pretrain", root / "params.yaml", overrides)


def test_report_marks_the_version_whose_rows_pass_and_eval_reads_it(in_registry):
    import mlflow

    def doc(passed):
        row = {"stage": "eval_perplexity/pretrain", "pass": passed}
        return {"rows": [], "regression": {"rows": [row], "models": ["pretrain"]}}

    inputs = [Path("data/pretrain"), Path("data/tokenize")]
    assert report.mark_reproduced(doc(False), inputs) == {}
    with pytest.raises(config.UserError, match=r"models:/pretrain@reproduced .*registered models: pretrain"):
        registry.resolve("models:/pretrain@reproduced")
    assert report.mark_reproduced(doc(True), inputs) == {"pretrain": 1}
    client = mlflow.MlflowClient(f"sqlite:///{in_registry / 'mlflow.db'}")
    assert str(client.get_model_version_by_alias("pretrain", "reproduced").version) == "1"

    out = eval_perplexity.main(
        ["--models", "folder=data/pretrain/model", "models:/pretrain@reproduced", "--output", "out/eval", *EVAL]
    )
    assert set(out["models"]) == {"folder", "pretrain"}
    for context, figures in out["models"]["folder"].items():
        assert out["models"]["pretrain"][context]["nll"] == figures["nll"], context
    (run,) = client.search_runs(
        [client.get_experiment_by_name("pipeline").experiment_id], "tags.stage = 'eval_perplexity'"
    )
    assert run.data.tags["model.pretrain"] == "models:/pretrain/1"


def test_an_unknown_registered_model_is_one_clear_error(in_registry):
    proc = run_stage(
        "eval_perplexity", ["--models", "models:/nope@reproduced", *EVAL], cwd=in_registry, check=False, **TRACKED
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "models:/nope@reproduced" in proc.stderr and "registered models: pretrain" in proc.stderr
    proc = run_stage(
        "eval_perplexity", ["--models", "models:/pretrain", *EVAL], cwd=in_registry, check=False, **TRACKED
    )
    assert proc.returncode == 2 and "models:/<name>@<alias> or models:/<name>/<version>" in proc.stderr


def test_a_version_kept_elsewhere_is_downloaded_whole_once(tmp_path, monkeypatch):
    """A version whose artifacts are not a local folder is downloaded into the checkpoints' registry folder
    under a work folder named by its writer: a download killed half-way is removed by the next one, and
    what lands is the whole model folder."""
    from stages.common import atomic, ckpt

    source = tmp_path / "store" / "model"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    monkeypatch.setattr(ckpt, "CHECKPOINT_ROOT", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    dest = tmp_path / "checkpoints" / "registry" / "pretrain" / "3"
    dest.parent.mkdir(parents=True)
    killed = atomic._tmp_sibling(dest, "work").name.replace(f".{os.getpid()}.", ".999999999.")
    (dest.parent / killed / "model").mkdir(parents=True)  # (a writer with no such pid: gone)
    assert registry.download(source.as_uri(), "pretrain", 3) == dest
    assert (dest / "config.json").read_text() == "{}"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["3"], "the killed download and the work folder removed"
