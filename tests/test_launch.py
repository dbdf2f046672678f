"""pipelines/launch.py's check of a training stage's train section against the processes it is about to
start: the layout and the global batch, refused with the stage's own line (exit 2) before any start."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from conftest import stage_env

from pipelines import launch
from stages.common import config, runtime, train_config

ROOT = Path(__file__).resolve().parent.parent


def stage_refusal(cls: type, where: str, section: dict, processes: int) -> str:
    """The line a stage ends with when its train section's check (stage.launch) refuses `processes`."""
    train = config.build(cls, where, section)
    with pytest.raises(config.UserError) as refused:
        train.check_layout(where, runtime.Runtime(0, processes, 0, processes, torch.device("cpu")))
    return f"error: {refused.value}"


def test_the_training_stages_are_those_whose_config_has_a_train_section():
    for stage, cls in launch.TRAIN_SECTIONS.items():
        module = importlib.import_module(f"stages.{stage}")
        assert typing.get_type_hints(module.Config)["train"] is cls, stage
    users = {p.stem for p in (ROOT / "stages").glob("*.py") if "train_config" in p.read_text()}
    assert users == set(launch.TRAIN_SECTIONS)


def test_a_layout_the_processes_cannot_form_is_refused_before_any_start(monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    env = {"PIPELINE_NPROC_PER_NODE": "2"}
    cmd = launch.command("pretrain", ["--input", "data/tokenize", "train.tensor_parallel=2"], env)
    assert "--nproc-per-node=2" in cmd and cmd[-1] == "train.tensor_parallel=2"
    assert launch.command("pretrain", ["pretrain.train.pipeline_parallel=2"], env)
    with pytest.raises(launch.Refused, match="pretrain.train.tensor_parallel: 4 does not divide the 2 processes"):
        launch.command("pretrain", ["train.tensor_parallel=4"], env)
    four = {"PIPELINE_NPROC_PER_NODE": "4"}
    assert launch.command("pretrain", ["train.pipeline_parallel=2"], four)  # two pipelines of 2 stages
    with pytest.raises(launch.Refused, match="data_parallel_replicate: 3 does not divide the 4 data-parallel"):
        launch.command("pretrain", ["train.strategy=fsdp", "train.data_parallel_replicate=3"], four)
    with pytest.raises(launch.Refused, match="2 data-parallel x 2 tensor-parallel; .* set strategy fsdp"):
        launch.command("pretrain", ["train.tensor_parallel=2"], four)
    # a bad value, a missing params file: the stage's to report, with its own message
    assert launch.command("pretrain", ["train.tensor_parallel=many"], env)
    assert launch.command("pretrain", ["--params", "missing.yaml", "train.tensor_parallel=4"], env)


def test_the_launcher_refuses_a_batch_as_the_stage_would(tmp_path):
    """The launcher asks the train section the stage's own check asks, with the same params file and
    overrides: the same line, for the batch over the data-parallel processes as for the layout."""
    params = tmp_path / "other.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    sections = config.read_yaml(params)
    for stage, overrides, processes in [
        ("pretrain", {"batch_size": 12}, 8),
        ("pretrain", {"batch_size": 6, "strategy": "fsdp", "tensor_parallel": 2}, 8),  # 4 data-parallel
        ("pretrain", {"tensor_parallel": 3}, 8),
        ("extend_context", {"batch_size": 6}, 4),
        ("finetune_qlora", {"batch_size": 10}, 4),
    ]:
        args = ["--params", str(params), *(f"train.{k}={v}" for k, v in overrides.items())]
        line = launch.layout_problem(stage, args, processes)
        section = {**sections[stage]["train"], **overrides}
        assert line == stage_refusal(launch.TRAIN_SECTIONS[stage], f"{stage}.train", section, processes), stage
    assert "it can by 1, 2, 3, 4, 6, 12" in launch.layout_problem("pretrain", ["train.batch_size=12"], 8)
    for stage in launch.TRAIN_SECTIONS:  # the params the pipeline runs, on its processes
        assert launch.layout_problem(stage, [], 2 if stage != "memory_study" else 1) is None, stage


def test_memory_study_s_techniques_are_checked_as_it_checks_them():
    """Each technique on one process (memory_study refuses more itself, with its own line)."""
    from stages import memory_study

    overrides = ["techniques.tp2={tensor_parallel: 2, strategy: fsdp}"]
    line = launch.layout_problem("memory_study", overrides, 1)
    section = config.apply_overrides("memory_study", config.read_yaml(ROOT / "params.yaml")["memory_study"], overrides)
    train = config.build(train_config.TrainConfig, "memory_study.train", section["train"])
    technique = memory_study.technique_config(train, "tp2", section["techniques"]["tp2"])
    with pytest.raises(config.UserError) as refused:
        technique.check_layout("memory_study.techniques.tp2", runtime.Runtime(0, 1, 0, 1, torch.device("cpu")))
    assert line == f"error: {refused.value}" and "memory_study.techniques.tp2.tensor_parallel: 2" in line
    # (the baseline at tensor_parallel 2 makes the 8-bit techniques invalid: the stage's to report)
    assert launch.layout_problem("memory_study", ["train.tensor_parallel=2", "train.strategy=fsdp"], 1) is None
    assert launch.layout_problem("memory_study", [], 8) is None


def test_a_batch_8_processes_cannot_share_is_refused_before_anything_starts(tmp_path):
    """python -m pipelines.launch at 8 processes with a batch of 12: one line, the stage's, exit 2, and no
    process started (no `launch: <command>` line, nothing of the stage's: its missing input is not reached)."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    env = stage_env(tmp_path, PIPELINE_NPROC_PER_NODE="8", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.launch", "pretrain", "--input", "data/missing", "train.batch_size=12"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    section = {**config.read_yaml(ROOT / "params.yaml")["pretrain"]["train"], "batch_size": 12}
    assert proc.stderr.strip().splitlines() == [stage_refusal(train_config.TrainConfig, "pretrain.train", section, 8)]
    assert "torch.distributed.run" not in proc.stderr and not (tmp_path / "data").exists()
