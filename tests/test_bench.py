"""The GPU check's dry mode: the same script, tests and benchmarks at tiny size on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, TRACKED, stage_env

from stages.common import config
from stages.common.tracking import store


@pytest.mark.long
@pytest.mark.timeout(1550)
def test_gpu_check_dry_runs_every_step_and_writes_its_figures(tmp_path, mirror):
    out = tmp_path / "out"
    env = {**stage_env(tmp_path, **TRACKED), "PYTHON": sys.executable}
    env.pop("PYTHONPATH")
    proc = subprocess.run(
        ["bash", str(ROOT / "bench/gpu_check.sh"), "--dry", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1450,  # (the dry steps' limits add up to 1320 s: room for a slow or shared machine)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads((out / "figures.json").read_text())
    assert {name: step["exit"] for name, step in figures["steps"].items()} == dict.fromkeys(
        ("tests", "pretrain", "eval", "eval_fp32", "qlora", "ci_record", "plan"), 0
    )
    pretrain = figures["pretrain"]
    assert pretrain["compile"] and pretrain["tokens_per_s"] > 0 and 0 < pretrain["mfu_vs_matmul"] < 1.5
    assert set(pretrain["profile"]["time_by_kind"]) <= {"matmul", "attention", "other"}
    assert "aten::" in (out / "profile.txt").read_text()
    assert figures["eval_fp32"]["relative_difference"] < 1e-6, "batched and batch-1 perplexities differ"
    assert figures["qlora"]["nf4"]["linear_weight_mb"] < 0.35 * figures["qlora"]["none"]["linear_weight_mb"]
    # the ci preset's perplexities on this CPU, in fp32 and bf16, against the CPU record (the GPU's oracle)
    record = figures["ci_record"]
    assert record["fp32"]["pass"] and record["fp32"]["max_relative_difference"] < 1e-4, record["fp32"]
    assert record["bf16"]["pass"] and len(record["bf16"]["rows"]) == len(record["fp32"]["rows"]) == 4
    # the planner against each stage run: a planned and a measured peak and tokens/s, reported but no goal in dry
    plan = figures["plan"]
    assert plan["dry"] and [row["config"] for row in plan["rows"]] == [
        "pretrain bf16", "finetune_qlora nf4", "finetune_qlora none"
    ]  # fmt: skip
    for row in plan["rows"]:
        assert row["planned_mib"] > 0 and row["measured_peak_mib"] > 0 and row["measured_tokens_per_s"] > 0, row
    assert not any("planner" in goal for goal in figures["goals"]) and len(figures["reported"]) == 6
    # without a GPU the GPU tests skip, and the check says so rather than claiming they passed on one
    assert "skipped" in figures["tests"]["summary"] and any("dry" in goal for goal in figures["goals"])
    # the stages ran without MLflow: no store appeared, whatever the caller's setting
    assert not list(tmp_path.rglob("mlflow.db"))
    logs = {"tests.log", "pretrain.log", "profile.txt", "eval.log", "qlora.log", "ci_record.log", "plan.log"}
    assert {"env.txt", *logs, "figures.json"} == {p.name for p in out.iterdir()}


def test_gpu_check_refuses_a_machine_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: bench/gpu_check.sh would run for real")
    proc = subprocess.run(
        ["bash", str(ROOT / "bench/gpu_check.sh"), str(tmp_path / "out")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--dry" in proc.stderr


def test_tracking_switch_takes_on_or_off_only(monkeypatch):
    monkeypatch.setenv("PIPELINE_TRACKING", "OFF")
    assert store.tracking_off()
    monkeypatch.setenv("PIPELINE_TRACKING", "no")
    with pytest.raises(config.UserError, match="PIPELINE_TRACKING must be 'on' or 'off'"):
        store.tracking_off()
