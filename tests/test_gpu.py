"""GPU-only paths: bf16 compute, FSDP2 mixed precision and nccl. They skip, saying why, without a GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL, loss_curve, run_probe, run_stage

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here: bf16/nccl paths run on GPU machines"
)

TINY = [
    *TINY_MODEL,
    "train.steps=12",
    "train.batch_size=8",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
    "train.eval_every=6",
    "train.eval_batches=1",
    "train.checkpoint_every=6",
    "train.log_every=2",
]


def test_bf16_on_one_gpu_trains_and_saves_a_loadable_model(tokenized):
    from stages.common import runtime

    assert runtime.compute_dtype(torch.device("cuda")) == torch.bfloat16
    run_stage("pretrain", ["--input", "data/tokenize", "--output", "gpu1", *TINY], cwd=tokenized)
    curve = loss_curve(tokenized, "gpu1")
    assert curve[-1] < curve[0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tokenized / "gpu1/model")
    assert next(model.parameters()).dtype == torch.float32, "weights are kept and saved in fp32"
    assert json.loads((tokenized / "gpu1.measured.json").read_text())["tokens_per_s"] > 0


def test_nccl_group_of_one_and_fsdp2_bf16_policy_train_like_one_process(tmp_path):
    """On one GPU: a nccl process group of one, and the loop's FSDP2 branch (bf16 parameters, fp32
    reduction) through it, gives the losses of the unwrapped bf16 model."""
    out = tmp_path / "probe.json"
    run_probe("fsdp_one_rank_probe.py", [out], tmp_path, nproc=1)
    result = json.loads(out.read_text())
    assert result["backend"] == "nccl" and result["world_size"] == 1 and result["dtype"] == "torch.bfloat16"
    assert np.isfinite(result["fsdp"]).all() and result["fsdp"][-1] < result["fsdp"][0]
    np.testing.assert_allclose(result["fsdp"], result["plain"], rtol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl with 2 processes needs 2 GPUs")
def test_fsdp_bf16_mixed_precision_matches_ddp_under_nccl(tokenized):
    run_stage(
        "pretrain", ["--input", "data/tokenize", "--output", "ddp", *TINY, "train.strategy=ddp"], cwd=tokenized, nproc=2
    )
    run_stage(
        "pretrain",
        ["--input", "data/tokenize", "--output", "fsdp", *TINY, "train.strategy=fsdp"],
        cwd=tokenized,
        nproc=2,
    )
    # bf16 compute: the same losses to bf16 precision, not bitwise.
    np.testing.assert_allclose(loss_curve(tokenized, "fsdp"), loss_curve(tokenized, "ddp"), rtol=2e-2)


def test_extend_context_fine_tunes_yarn_in_bf16(tokenized):
    run_stage("pretrain", ["--input", "data/tokenize", "--output", "gpu_base", *TINY], cwd=tokenized)
    run_stage(
        "extend_context",
        [
            "--base",
            "gpu_base/model",
            "--input",
            "data/tokenize",
            "--output",
            "gpu_ext",
            "finetune=[yarn]",
            "train.steps=4",
            "train.batch_size=4",
            "train.micro_batch_size=4",
        ],
        cwd=tokenized,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tokenized / "gpu_ext/model/yarn-ft").cuda()
    assert model.config.rope_parameters["rope_type"] == "yarn"
    metrics = json.loads((tokenized / "gpu_ext/figures.json").read_text())
    assert np.isfinite(metrics["yarn-ft"]["final_train_loss"])
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(torch.randint(0, 256, (1, 4 * 64), device="cuda")).logits  # beyond the trained 64
    assert torch.isfinite(logits).all()


def test_qlora_with_bf16_storage_and_compute_under_fsdp_and_nccl(tokenized):
    """NF4 base with bf16 quant storage and compute, adapters in bf16 (one dtype for FSDP to shard),
    2 processes under nccl where there are 2 GPUs; the merged model is saved in fp32."""
    nproc = min(2, torch.cuda.device_count())
    run_stage("pretrain", ["--input", "data/tokenize", "--output", "qbase", *TINY], cwd=tokenized)
    args = [
        "--input",
        "data/prepare_data",
        "--output",
        "qlora",
        "--base",
        "qbase/model",
        "template=short",
        "seq_length=64",
        "train.steps=6",
        "train.batch_size=8",
        "train.micro_batch_size=2",
        "train.lr=0.01",
        "lora.r=4",
        "train.eval_every=3",
        "train.checkpoint_every=0",
    ]
    run_stage("finetune_qlora", args, cwd=tokenized, nproc=nproc)
    meta = json.loads((tokenized / "qlora/meta.json").read_text())
    assert meta["storage_dtype"] == meta["compute_dtype"] == "torch.bfloat16" and meta["world_size"] == nproc
    metrics = json.loads((tokenized / "qlora/figures.json").read_text())
    assert np.isfinite(metrics["eval_loss"]) and 4.1 < metrics["linear_weight_bits_per_weight"] < 4.2
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tokenized / "qlora/model")
    assert next(merged.parameters()).dtype == torch.float32
    assert PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tokenized / "qbase/model"), tokenized / "qlora/adapter"
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 CPU offload shards over 2 processes: needs 2 GPUs")
def test_fsdp_cpu_offload_trains_like_without_it(tokenized):
    args = ["--input", "data/tokenize", *TINY, "train.strategy=fsdp"]
    run_stage("pretrain", [*args, "--output", "on_gpu"], cwd=tokenized, nproc=2)
    run_stage("pretrain", [*args, "--output", "offloaded", "train.offload=true"], cwd=tokenized, nproc=2)
    np.testing.assert_allclose(loss_curve(tokenized, "offloaded"), loss_curve(tokenized, "on_gpu"), rtol=2e-2)


def test_paged_8bit_adamw_trains_on_gpu(tokenized):
    args = ["--input", "data/tokenize", "--output", "paged", *TINY, "train.optimizer=paged_adamw8bit"]
    run_stage("pretrain", args, cwd=tokenized)
    curve = loss_curve(tokenized, "paged")
    assert np.isfinite(curve).all() and curve[-1] < curve[0]
    meta = json.loads((tokenized / "paged/meta.json").read_text())
    assert 0 < meta["optimizer_state_bytes"] < 0.3 * 8 * meta["parameters"]


def test_fp16_with_a_gradient_scaler_trains_like_fp32(tokenized):
    args = ["--input", "data/tokenize", *TINY]
    run_stage("pretrain", [*args, "--output", "fp32", "train.precision=fp32"], cwd=tokenized)
    run_stage("pretrain", [*args, "--output", "fp16", "train.precision=fp16"], cwd=tokenized)
    curve = loss_curve(tokenized, "fp16")
    assert np.isfinite(curve).all()
    np.testing.assert_allclose(curve, loss_curve(tokenized, "fp32"), rtol=2e-2)
    assert json.loads((tokenized / "fp16/meta.json").read_text())["compute_dtype"] == "torch.float16"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel under nccl needs 2 GPUs")
def test_tensor_parallel_in_bf16_under_nccl_trains_like_ddp(tokenized):
    args = ["--input", "data/tokenize", *TINY]
    run_stage("pretrain", [*args, "--output", "ddp-ref", "train.strategy=ddp"], cwd=tokenized, nproc=2)
    run_stage("pretrain", [*args, "--output", "tp2", "train.tensor_parallel=2"], cwd=tokenized, nproc=2)
    np.testing.assert_allclose(loss_curve(tokenized, "tp2"), loss_curve(tokenized, "ddp-ref"), rtol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="2D FSDP2 x tensor parallel under nccl needs 4 GPUs")
def test_2d_fsdp_and_tensor_parallel_in_bf16_under_nccl_trains_like_ddp(tokenized):
    args = ["--input", "data/tokenize", *TINY]
    run_stage("pretrain", [*args, "--output", "ddp4", "train.strategy=ddp"], cwd=tokenized, nproc=4)
    layout = ["train.strategy=fsdp", "train.tensor_parallel=2"]
    run_stage("pretrain", [*args, "--output", "fsdp2-tp2", *layout], cwd=tokenized, nproc=4)
    np.testing.assert_allclose(loss_curve(tokenized, "fsdp2-tp2"), loss_curve(tokenized, "ddp4"), rtol=2e-2)
