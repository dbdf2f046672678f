"""Tensor parallel (TP 2), pipeline parallel (PP 2, GPipe and 1F1B) and 2D FSDP2 x TP (2 x 2, 4 processes)
train pretrain's model with the losses of one process; the published model gives the one-process logits;
TP and PP runs resume bit-identically after SIGKILL, and a checkpoint moves between layouts:
TP 2 -> PP 2 x FSDP 2 -> one process. The parallelism study's bytes sent equal their analytic figures
(HSDP and PP x DDP among its layouts). Errors for layouts the model or the batch cannot take."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from conftest import loss_curve
from test_pretrain import TINY, logits, run

from stages import pretrain
from stages.common import ckpt, config
from stages.models import llama

# Equal to one process up to float32 summation order (the row-wise layers' all-reduce adds partial sums).
RTOL = 1e-4


def max_relative_difference(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))))


def kill(tokenized, out, nproc, args, kill_at, resume_from, ckpts):
    """Run with a SIGKILL while the step-`kill_at` checkpoint is written; the one before is kept."""
    env = {"PIPELINE_CHECKPOINTS": str(tokenized / ckpts)}
    proc = run(tokenized, out, nproc, *args, check=False, PIPELINE_FAULT_IN_CHECKPOINT=str(kill_at), **env)
    assert proc.returncode != 0 and not (tokenized / out).exists()
    if resume_from:
        assert "resuming from" in proc.stdout + proc.stderr and f"(step {resume_from})" in proc.stdout + proc.stderr
    assert f"step-{kill_at - 2}" in [p.name for p in (tokenized / ckpts).glob("pretrain/*/step-*")]


def resume(tokenized, out, nproc, args, resume_from, ckpts):
    proc = run(tokenized, out, nproc, *args, PIPELINE_CHECKPOINTS=str(tokenized / ckpts))
    assert "resuming from" in proc.stdout + proc.stderr and f"(step {resume_from})" in proc.stdout + proc.stderr
    return loss_curve(tokenized, out)


def test_layouts_train_like_one_process_resume_exactly_and_checkpoints_move_between_them(
    tokenized, monkeypatch, capsys
):
    monkeypatch.chdir(tokenized)
    every = ["train.steps=10", "train.checkpoint_every=2"]  # (overrides TINY's 8 steps: the later value wins)
    layouts = {
        "tp2": (2, [*every, "train.tensor_parallel=2"]),
        "pp2": (2, [*every, "train.pipeline_parallel=2", "train.pipeline_schedule=gpipe"]),
        "fsdp2-tp2": (4, [*every, "train.strategy=fsdp", "train.tensor_parallel=2"]),
    }
    single = pretrain.main(["--input", "data/tokenize", "--output", "par-one", *TINY, "train.steps=10"])
    ref = np.array(single["history"]["loss"])
    ids = torch.from_numpy(
        np.fromfile(tokenized / "data/tokenize/val_0000.bin", dtype=np.uint16)[:64].astype(np.int64)
    )[None]
    want = logits(tokenized / "par-one/model", ids)
    curves = {}
    for name, (nproc, args) in layouts.items():
        run(tokenized, f"par-{name}", nproc, *args)
        curves[name] = loss_curve(tokenized, f"par-{name}")
        difference = max_relative_difference(curves[name], ref)
        print(f"{name}: largest relative loss difference from one process {difference:.2e}")
        np.testing.assert_allclose(curves[name], ref, rtol=RTOL)
        # The published Hugging Face model is whole (gathered from the shards) and loads in transformers.
        torch.testing.assert_close(logits(tokenized / f"par-{name}/model", ids), want, rtol=1e-4, atol=1e-5)
    # Same layout: killed while the step-6 checkpoint is written; the re-run resumes from step 4.
    for name in ("tp2", "pp2"):
        nproc, args = layouts[name]
        kill(tokenized, f"par-same-{name}", nproc, args, 6, None, f"ckpts-par-{name}")
        if name == "tp2":  # TP 2's steps 2 and 4, for the run across layouts below
            shutil.copytree(tokenized / "ckpts-par-tp2", tokenized / "ckpts-par-moves")
        resumed = resume(tokenized, f"par-same-{name}", nproc, args, 4, f"ckpts-par-{name}")
        np.testing.assert_array_equal(resumed, curves[name])
    # Across layouts, one checkpoint folder for all of them: TP 2's step 4 (written above, before it died),
    # resumed by two pipelines of 2 stages (1F1B), each stage FSDP2-sharded over its 2 copies, which die at
    # step 8 (step 6 kept); one process resumes that and finishes.
    pp_fsdp = [*every, "train.pipeline_parallel=2", "train.strategy=fsdp"]
    kill(tokenized, "par-moves", 4, pp_fsdp, 8, 4, "ckpts-par-moves")
    monkeypatch.setattr(ckpt, "CHECKPOINT_ROOT", tokenized / "ckpts-par-moves")  # (one process: this one)
    capsys.readouterr()
    pretrain.main(["--input", "data/tokenize", "--output", "par-moves", *TINY, *every])
    printed = capsys.readouterr().out
    assert "resuming from" in printed and "(step 6)" in printed
    moved = loss_curve(tokenized, "par-moves")
    difference = max_relative_difference(moved, ref)
    print(f"TP 2 -> PP 2 x FSDP 2 -> one process: largest relative loss difference from one process {difference:.2e}")
    np.testing.assert_allclose(moved, ref, rtol=RTOL)


@pytest.mark.long
def test_3d_layout_trains_like_one_process(tokenized, monkeypatch):
    """8 processes: 2 pipeline stages x 2 FSDP2 copies of each x tensor parallel 2 within each copy."""
    monkeypatch.chdir(tokenized)
    single = pretrain.main(["--input", "data/tokenize", "--output", "par3d-one", *TINY])
    three_d = ["train.pipeline_parallel=2", "train.strategy=fsdp", "train.tensor_parallel=2"]
    run(tokenized, "par-3d", 8, *three_d)
    curve = loss_curve(tokenized, "par-3d")
    ref = single["history"]["loss"]
    print(f"3D: largest relative loss difference from one process {max_relative_difference(curve, ref):.2e}")
    np.testing.assert_allclose(curve, ref, rtol=RTOL)


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.tensor_parallel=2"], "tensor_parallel: 2 does not divide the 1 processes of this run"),
        (["train.pipeline_parallel=2"], "pipeline_parallel: 2 does not divide the 1 processes of this run"),
        (["train.data_parallel_replicate=2"], "data_parallel_replicate: replicas of FSDP2's shards \\(HSDP\\) need"),
        (["train.tensor_parallel=2", "train.optimizer=adamw8bit"], "not supported with optimizer adamw8bit"),
        (["train.pipeline_parallel=2", "train.precision=fp16"], "not supported with precision fp16"),
        (["train.tensor_parallel=2", "train.precision=fp16"], "tensor_parallel: 2 is not supported with precision"),
        (["train.pipeline_schedule=zero_bubble"], "unknown schedule 'zero_bubble'; valid: gpipe, 1f1b"),
        (
            ["train.tensor_parallel=2", "train.pipeline_parallel=2"],
            "pipeline_parallel: tensor_parallel x pipeline_parallel = 4 does not divide the 1 processes",
        ),
    ],
)
def test_bad_layouts_fail_before_training(tokenized, monkeypatch, override, message):
    monkeypatch.chdir(tokenized)
    with pytest.raises(config.UserError, match=message):
        pretrain.main(["--input", "data/tokenize", "--output", "bad", *TINY, *override])
    assert not (tokenized / "bad").exists()


def test_layout_checks_name_what_does_not_divide():
    from types import SimpleNamespace

    from stages.common import pipeline

    sizes = {"intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": False}
    c = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, **sizes)
    assert llama.tensor_parallel_problem(c, 2) is None
    assert "2 key/value heads are not divisible by tensor_parallel 4" in llama.tensor_parallel_problem(c, 4)
    c = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3, **sizes)
    assert "128 MLP width (intermediate_size) are not divisible" in llama.tensor_parallel_problem(c, 3)
    c = SimpleNamespace(num_attention_heads=4, num_key_value_heads=4, **{**sizes, "vocab_size": 510})
    assert "510 vocabulary entries (vocab_size) are not divisible by tensor_parallel 4" in (
        llama.tensor_parallel_problem(c, 4)
    )
    assert llama.tensor_parallel_problem(SimpleNamespace(**vars(c) | {"tie_word_embeddings": True}), 4) is None
    assert pipeline.layout_problem(4, 2, 2) is None
    assert "3 decoder layers are not divisible by pipeline_parallel 2" in pipeline.layout_problem(3, 2, 2)
    assert "1 micro-batches per pipeline" in pipeline.layout_problem(4, 2, 1)
    assert "ties its output head to its input embedding" in pipeline.layout_problem(4, 2, 2, tied_embeddings=True)
    assert [list(pipeline.stage_layers(4, 2, s)) for s in (0, 1)] == [[0, 1], [2, 3]]


def test_a_batch_the_pipeline_cannot_take_fails_before_training(tokenized):
    """Checked where the model and the processes are known, on every rank alike (the tensor-parallel
    checks of the model, unit-tested above, are raised the same way)."""
    proc = run(tokenized, "bad-layout", 2, "train.pipeline_parallel=2", "train.batch_size=2", check=False)
    message = "1 micro-batches per pipeline .* fewer than its 2 stages"
    assert proc.returncode != 0 and re.search(message, proc.stdout + proc.stderr), proc.stderr[-2000:]
    assert not (tokenized / "bad-layout").exists()


def test_parallel_study_measures_the_analytic_bytes_and_tensor_parallel_halves_the_state(tokenized, tmp_path):
    """bench/parallel_study.py on the tiny model: the bytes each layout sends, counted from the ops that
    ran, equal the figure derived from the shapes alone, so every layout issues exactly the traffic its
    design implies (FSDP's re-gather for the backward, one all-reduce per block input under TP, ...)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "study"
    layouts = "ddp2,fsdp2,tp2,pp2,fsdp2-tp2,hsdp2x2,pp2-ddp2"
    cmd = [sys.executable, str(ROOT / "bench/parallel_study.py"), "--input", str(tokenized / "data/tokenize")]
    # one torchrun per process count (the bytes, losses and state of a layout do not depend on what ran
    # before it in the process; its peak memory, not checked here, restarts with it)
    cmd += ["--model", "tiny", "--steps", "3", "--layouts", layouts, "--out", str(out), "--one-launch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    rows = json.loads((out / "figures.json").read_text())["layouts"]
    assert list(rows) == layouts.split(",")
    for name, row in rows.items():  # (the step's few scalar all-reduces are all the analytic figure leaves out)
        assert row["comm_ratio"] == pytest.approx(1.0, abs=0.01), name
        assert row["loss"] == pytest.approx(rows["ddp2"]["loss"], rel=RTOL), name
    assert set(rows["ddp2"]["calls"]) == {"all_reduce"}
    assert {"all_gather", "reduce_scatter"} <= set(rows["fsdp2"]["calls"])
    assert rows["pp2"]["calls"]["send"] > 0 and "all_gather" not in rows["pp2"]["calls"]
    assert rows["hsdp2x2"]["calls"]["all_reduce"] > rows["fsdp2"]["calls"]["all_reduce"]  # (across replicas)
    # TP 2, FSDP 2 and PP 2 each hold about half the training state DDP holds on every rank
    for name in ("tp2", "fsdp2", "pp2"):
        assert rows[name]["state_mib"] / rows["ddp2"]["state_mib"] <= 0.55, name
    assert rows["fsdp2-tp2"]["state_mib"] / rows["ddp2"]["state_mib"] <= 0.3
    assert (out / "parallel.png").stat().st_size > 0
    assert len((out / "table.csv").read_text().splitlines()) == 1 + len(rows)


def test_parallel_study_refuses_an_unknown_layout(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    cmd = [sys.executable, str(ROOT / "bench/parallel_study.py"), "--layouts", "ddp2,tp3", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--layouts: unknown tp3; valid: ddp2" in proc.stderr
