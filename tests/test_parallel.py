"""Tensor parallel (TP 2) and its 2D composition with FSDP2 (2 x 2, 4 processes) train pretrain's model
with the losses of one process; the published model gives the one-process logits; a TP run resumes
bit-identically after SIGKILL, and a checkpoint moves between layouts: TP 2 -> FSDP 2 -> one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import loss_curve
from test_pretrain import TINY, logits, run

from stages import pretrain
from stages.common import config

# Equal to one process up to float32 summation order (the row-wise layers' all-reduce adds partial sums).
RTOL = 1e-4


def max_relative_difference(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))))


def test_tensor_parallel_and_2d_train_like_one_process(tokenized, monkeypatch):
    monkeypatch.chdir(tokenized)
    single = pretrain.main(["--input", "data/tokenize", "--output", "par-one", *TINY])
    run(tokenized, "par-tp2", 2, "train.tensor_parallel=2")
    run(tokenized, "par-fsdp2-tp2", 4, "train.strategy=fsdp", "train.tensor_parallel=2")
    ref = np.array(single["history"]["loss"])
    ids = torch.from_numpy(
        np.fromfile(tokenized / "data/tokenize/val_0000.bin", dtype=np.uint16)[:64].astype(np.int64)
    )[None]
    want = logits(tokenized / "par-one/model", ids)
    for out in ("par-tp2", "par-fsdp2-tp2"):
        losses = loss_curve(tokenized, out)
        print(f"{out}: largest relative loss difference from one process {max_relative_difference(losses, ref):.2e}")
        np.testing.assert_allclose(losses, ref, rtol=RTOL)
        # The published Hugging Face model is whole (gathered from the shards) and loads in transformers.
        torch.testing.assert_close(logits(tokenized / f"{out}/model", ids), want, rtol=1e-4, atol=1e-5)


def test_tensor_parallel_resumes_exactly_and_checkpoints_move_between_layouts(tokenized):
    every = ["train.checkpoint_every=2"]
    tp2 = [*every, "train.tensor_parallel=2"]
    run(tokenized, "par-whole", 2, *tp2)
    whole = loss_curve(tokenized, "par-whole")
    # Same layout: SIGKILL while the step-6 checkpoint is written; the re-run resumes from step 4.
    env = {"PIPELINE_CHECKPOINTS": str(tokenized / "ckpts-par-same")}
    assert run(tokenized, "par-same", 2, *tp2, check=False, PIPELINE_FAULT_IN_CHECKPOINT="6", **env).returncode
    proc = run(tokenized, "par-same", 2, *tp2, **env)
    assert "resuming from" in proc.stdout + proc.stderr and "step 4" in proc.stdout + proc.stderr
    np.testing.assert_array_equal(loss_curve(tokenized, "par-same"), whole)
    # Across layouts: TP 2 dies at step 4 (step 2 kept), FSDP 2 resumes it and dies at step 6 (step 4
    # kept), one process resumes that and finishes. The checkpoint folder is the same for every layout.
    env = {"PIPELINE_CHECKPOINTS": str(tokenized / "ckpts-par-moves")}
    assert run(tokenized, "par-moves", 2, *tp2, check=False, PIPELINE_FAULT_IN_CHECKPOINT="4", **env).returncode
    fsdp = [*every, "train.strategy=fsdp"]
    proc = run(tokenized, "par-moves", 2, *fsdp, check=False, PIPELINE_FAULT_IN_CHECKPOINT="6", **env)
    assert proc.returncode and "resuming from" in proc.stdout + proc.stderr and "step 2" in proc.stdout + proc.stderr
    assert "step-4" in [p.name for p in (tokenized / "ckpts-par-moves").glob("pretrain/*/step-*")]
    proc = run(tokenized, "par-moves", 1, *every, **env)
    assert "resuming from" in proc.stdout + proc.stderr and "step 4" in proc.stdout + proc.stderr
    moved = loss_curve(tokenized, "par-moves")
    difference = max_relative_difference(moved, whole)
    print(f"TP 2 -> FSDP 2 -> one process: largest relative loss difference from TP 2 uninterrupted {difference:.2e}")
    np.testing.assert_allclose(moved, whole, rtol=RTOL)


@pytest.mark.parametrize(
    "nproc, override, message",
    [
        (1, ["train.tensor_parallel=2"], "tensor_parallel: 2 does not divide the 1 processes of this run"),
        (
            1,
            ["train.tensor_parallel=2", "train.optimizer=adamw8bit"],
            "tensor_parallel: 2 is not supported with optimizer adamw8bit",
        ),
    ],
)
def test_bad_layouts_fail_before_training(tokenized, monkeypatch, nproc, override, message):
    monkeypatch.chdir(tokenized)
    with pytest.raises(config.UserError, match=message):
        pretrain.main(["--input", "data/tokenize", "--output", "bad", *TINY, *override])
    assert not (tokenized / "bad").exists()


def test_heads_not_divisible_by_the_degree_fail_before_training(tokenized):
    # 4 heads, 2 key/value heads: 4-way tensor parallel cannot split the key/value heads.
    proc = run(tokenized, "bad-tp4", 4, "train.tensor_parallel=4", "train.micro_batch_size=8", check=False)
    assert proc.returncode != 0
    assert "the model's 2 key/value heads are not divisible by tensor_parallel 4" in proc.stdout + proc.stderr
    assert not (tokenized / "bad-tp4").exists()
