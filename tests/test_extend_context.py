"""extend_context: each RoPE scaling against its paper's formula, saved variants, fine-tuning and resume."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import craft_checkpoint_item, run_stage

from stages import extend_context
from stages.common import config, shards

L, S, THETA, HEAD_DIM = 64, 4.0, 10000.0, 16


def base_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=L,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
        tie_word_embeddings=False,
    )


def rotary(spec: dict | None, positions: int):
    """cos of the model's rotary embedding at positions 0..n-1, (n, head_dim)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(extend_context.scaled_config(base_config(), spec, S, L))
    x = torch.zeros(1, positions, HEAD_DIM)
    cos, sin = model.model.rotary_emb(x, torch.arange(positions)[None])
    return cos[0].double(), sin[0].double()


def expected(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0):
    """cos/sin as RoPE applies them: angle = position x frequency, each frequency used for two dims."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


# The papers' formulas, written out here rather than taken from the implementation under test.
theta_i = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)  # RoFormer frequencies
wavelength = 2 * math.pi / theta_i


def test_unscaled_is_plain_rope_and_linear_divides_positions_by_s():
    pos = torch.arange(4 * L)
    for got, want in zip(rotary(None, 4 * L), expected(theta_i, pos), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Position interpolation (Chen et al. 2023): position m is read as m / s.
    for got, want in zip(rotary({"rope_type": "linear"}, 4 * L), expected(theta_i, pos / S), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_dynamic_ntk_rescales_the_base_only_beyond_L():
    for n in (L, 2 * L, 3 * L + 5):
        # Dynamic NTK: base' = base * (s * n / L - (s - 1)) ** (d / (d - 2)) for a sequence of n > L tokens.
        base = THETA * ((S * n / L) - (S - 1)) ** (HEAD_DIM / (HEAD_DIM - 2)) if n > L else THETA
        inv = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        for got, want in zip(rotary({"rope_type": "dynamic"}, n), expected(inv, torch.arange(n)), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_yarn_ramps_frequencies_by_rotations_per_context_and_scales_attention():
    alpha, beta = 1.0, 32.0
    spec = {"rope_type": "yarn", "beta_fast": beta, "beta_slow": alpha}
    # YaRN (Peng et al. 2023): r = L / wavelength rotations per trained context. Dimensions that turn
    # more than beta times keep their frequency, fewer than alpha times are interpolated (theta / s),
    # and the ramp between them is linear over the dimension index, between the (floored/ceiled)
    # dimensions where r = beta and r = alpha, as in the paper's reference implementation.
    dim_at = lambda r: HEAD_DIM * math.log(L / (r * 2 * math.pi)) / (2 * math.log(THETA))  # noqa: E731
    low, high = max(math.floor(dim_at(beta)), 0), min(math.ceil(dim_at(alpha)), HEAD_DIM - 1)
    gamma = ((torch.arange(HEAD_DIM // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv = theta_i * (1 - gamma) + theta_i / S * gamma
    r = L / wavelength
    assert torch.equal(inv[r > beta], theta_i[r > beta]) and torch.allclose(inv[r < alpha], theta_i[r < alpha] / S)
    # Attention temperature: sqrt(1 / t) = 0.1 ln s + 1 multiplies cos and sin (so q.k by its square).
    scale = 0.1 * math.log(S) + 1
    for got, want in zip(rotary(spec, 4 * L), expected(inv, torch.arange(4 * L), scale), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_llama3_keeps_short_wavelengths_divides_long_ones_and_blends_between():
    low_f, high_f = 1.0, 4.0
    spec = {"rope_type": "llama3", "low_freq_factor": low_f, "high_freq_factor": high_f}
    smooth = (L / wavelength - low_f) / (high_f - low_f)
    inv = torch.where(
        wavelength < L / high_f,
        theta_i,
        torch.where(wavelength > L / low_f, theta_i / S, (1 - smooth) * theta_i / S + smooth * theta_i),
    )
    bands = [(wavelength < L / high_f).sum(), ((wavelength >= L / high_f) & (wavelength <= L / low_f)).sum()]
    assert min(bands) > 0  # the test model has frequencies in every band
    for got, want in zip(rotary(spec, 4 * L), expected(inv, torch.arange(4 * L)), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("variants={big: {rope_type: longer}}", "unknown scaling type 'longer'; valid: linear, dynamic, yarn, llama3"),
        ("factor=1", "factor must be greater than 1"),
        ("factor=0.5", "factor must be greater than 1"),
        (
            "variants={l3: {rope_type: llama3, low_freq_factor: 1}}",
            "rope_type llama3 needs low_freq_factor, high_freq_factor; add high_freq_factor",
        ),
        ("variants={y: {rope_type: yarn, beta: 3}}", "variants.y.beta: not a key of rope_type yarn"),
        ("finetune=[ntk]", "finetune: ntk is not a variant; valid: unscaled, linear, dynamic, yarn, llama3"),
        (
            "train.precision=fp8",
            "extend_context.train.precision: unknown precision 'fp8'; valid: auto, fp32, bf16, fp16",
        ),
    ],
)
def test_bad_params_are_clear_errors(workdir, override, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        extend_context.main(["--base", "nowhere", override])


def test_missing_base_weights_is_a_clear_error(tokenized, tmp_path):
    base = tmp_path / "base"
    base_config().save_pretrained(base)
    with pytest.raises(config.UserError, match="has no weights"):
        extend_context.main(
            [
                "--params",
                str(tokenized / "params.yaml"),
                "--base",
                str(base),
                "--input",
                str(tokenized / "data/tokenize"),
            ]
        )


@pytest.fixture(scope="module")
def base_model(tokenized, tmp_path_factory):
    """A random tiny Llama with the tokenize stage's vocabulary, saved with its tokenizer (a stand-in
    for the pretrain stage's output)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("base") / "model"
    c = base_config()
    c.vocab_size = shards.read_meta(tokenized / "data/tokenize")["vocab_size"]
    torch.manual_seed(0)
    LlamaForCausalLM(c).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenized / "data/tokenize/tokenizer").save_pretrained(folder)
    return folder


def stage_args(tokenized, base, out):
    return [
        "--params",
        str(tokenized / "params.yaml"),
        "--base",
        str(base),
        "--input",
        str(tokenized / "data/tokenize"),
        "--output",
        str(out),
    ]


def run_here(args: list[str], cwd) -> None:
    """The stage with one process, as run_stage runs it (in `cwd`, untracked), in this process: no second
    interpreter importing torch."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("PIPELINE_TRACKING", "off")
        extend_context.main(args)


def test_two_processes_write_every_variant_and_resume_exactly(tokenized, base_model, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    common = ["finetune=[unscaled,linear]", "train.steps=4", "train.checkpoint_every=1"]
    run_stage(
        "extend_context",
        [*stage_args(tokenized, base_model, tmp_path / "a"), *common],
        cwd=tmp_path,
        nproc=2,
        PIPELINE_CHECKPOINTS=str(tmp_path / "ckpt_a"),
    )
    # Killed while writing the checkpoint after step 3, then re-run: resumes from step 1 (step 2's is made
    # unloadable below) and ends identical.
    killed = run_stage(
        "extend_context",
        [*stage_args(tokenized, base_model, tmp_path / "b"), *common],
        cwd=tmp_path,
        nproc=2,
        check=False,
        PIPELINE_CHECKPOINTS=str(tmp_path / "ckpt_b"),
        PIPELINE_FAULT_IN_CHECKPOINT="3",
    )
    assert killed.returncode != 0 and not (tmp_path / "b").exists()
    # step 2's checkpoint holds a DCP item crafted to run code (manifest rewritten): passed over, never loaded
    (newest,) = (tmp_path / "ckpt_b").glob("extend_context/*/step-2")
    item = craft_checkpoint_item(newest, tmp_path / "code-ran")
    resumed = run_stage(
        "extend_context",
        [*stage_args(tokenized, base_model, tmp_path / "b"), *common],
        cwd=tmp_path,
        nproc=2,
        PIPELINE_CHECKPOINTS=str(tmp_path / "ckpt_b"),
    )
    assert f"not resuming from checkpoint {newest}: item {item}" in resumed.stdout, resumed.stdout
    assert "(step 1)" in resumed.stdout and "resuming from" in resumed.stdout
    assert not (tmp_path / "code-ran").exists(), "loading a checkpoint ran code"
    assert not list((tmp_path / "ckpt_b").rglob("step-*"))  # spent checkpoints are removed once published

    meta = json.loads((tmp_path / "a/meta.json").read_text())
    assert set(meta["variants"]) == {"unscaled", "linear", "dynamic", "yarn", "llama3", "unscaled-ft", "linear-ft"}
    assert meta["original_context"] == L and meta["extended_context"] == 2 * L  # the ci preset's factor 2
    losses = [
        json.loads((tmp_path / run / "figures.json").read_text())["linear-ft"]["final_train_loss"] for run in "ab"
    ]
    assert losses[0] == losses[1]
    headline = json.loads((tmp_path / "a/metrics.json").read_text())
    assert set(headline) == {"val_loss"} and set(headline["val_loss"]) == {"unscaled-ft", "linear-ft"}
    x = torch.randint(0, 400, (2, 3 * L))  # positions beyond L, and beyond s x L
    for name, v in meta["variants"].items():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "a/model" / name)
        assert a.config.rope_parameters["rope_type"] == v["rope_parameters"]["rope_type"]
        with torch.no_grad():
            logits = a(x).logits
            if v["finetuned"]:
                b = AutoModelForCausalLM.from_pretrained(tmp_path / "b/model" / name)
                assert torch.equal(logits, b(x).logits), f"{name}: resumed run differs"
            else:
                # A zero-shot variant is the base's weights under the variant's RoPE, built here directly.
                spec = (
                    None
                    if name == "unscaled"
                    else {
                        k: w
                        for k, w in v["rope_parameters"].items()
                        if k not in ("factor", "rope_theta", "original_max_position_embeddings")
                    }
                )
                ref = LlamaForCausalLM.from_pretrained(
                    base_model,
                    config=extend_context.scaled_config(a.config.__class__.from_pretrained(base_model), spec, 2.0, L),
                )
                torch.testing.assert_close(logits, ref(x).logits, atol=0, rtol=0)
    assert (tmp_path / "a/plots/finetune_loss.png").is_file()
    curves = sorted(p.name for p in (tmp_path / "a/plots/finetune_loss").iterdir())
    assert curves == ["linear-ft.csv", "unscaled-ft.csv"]


def test_tensor_pipeline_and_2d_parallel_fine_tunes_equal_one_process(tokenized, base_model, tmp_path):
    """YaRN's fine-tune (its attention scaled, its rotary embedding computed by each pipeline stage) split
    over 2 processes by tensor parallel, and by pipeline parallel (1F1B), and over 4 by FSDP2 x tensor
    parallel (2D): the losses of one process."""
    common = ["finetune=[yarn]", "train.steps=10", "train.checkpoint_every=0"]
    layouts = {
        "one": (1, []),
        "tp2": (2, ["train.tensor_parallel=2"]),
        "pp2": (2, ["train.pipeline_parallel=2"]),
        "fsdp2-tp2": (4, ["train.strategy=fsdp", "train.tensor_parallel=2"]),
    }
    curves = {}
    for out, (nproc, extra) in layouts.items():
        args = [*stage_args(tokenized, base_model, tmp_path / out), *common, *extra]
        if nproc == 1:
            run_here(args, tmp_path)
        else:
            run_stage("extend_context", args, tmp_path, nproc)
        curves[out] = np.loadtxt(tmp_path / out / "plots/finetune_loss/yarn-ft.csv", delimiter=",", skiprows=1)[:, 1]
    assert len(curves["one"]) == 10
    for out in ("tp2", "pp2", "fsdp2-tp2"):
        np.testing.assert_allclose(curves[out], curves["one"], rtol=1e-4, err_msg=out)


def test_eval_reads_a_folder_of_variants(tokenized, base_model, tmp_path, monkeypatch):
    from stages import eval_perplexity

    run_here([*stage_args(tokenized, base_model, tmp_path / "ec"), "finetune=[]"], tmp_path)
    monkeypatch.chdir(tmp_path)
    shutil.copy(tokenized / "params.yaml", tmp_path / "params.yaml")
    metrics = eval_perplexity.main(
        [
            "--models",
            "extend_context=ec/model",
            "--input",
            str(tokenized / "data/tokenize"),
            "--output",
            "ev",
            "contexts=[64,128]",
            "max_tokens=600",
        ]
    )
    assert set(metrics["models"]) == {"unscaled", "linear", "dynamic", "yarn", "llama3"}
    ppl = {m: v["ctx64"]["perplexity"] for m, v in metrics["models"].items()}
    assert ppl["unscaled"] == pytest.approx(ppl["dynamic"], rel=1e-6)  # dynamic NTK changes nothing up to L
    assert ppl["linear"] != ppl["unscaled"]  # interpolation changes every frequency, also within L
