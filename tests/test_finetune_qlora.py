"""finetune_qlora on the ci model and the Alpaca subset: LoRA on a 4-bit NF4 base with paged 8-bit AdamW,
under FSDP2 with 2 CPU processes; the adapter reloads onto the 4-bit base, the merged model matches base +
adapter, exact resume, the loss mask, and errors raised before any compute."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY_MODEL, craft_checkpoint_item, loss_curve, run_stage

from stages import finetune_qlora as ft
from stages import pretrain
from stages.common import config, instructions, loop, losses, runtime, train_config
from stages.common.tracking.tracker import NullTracker

PRETRAIN = [
    *TINY_MODEL,
    "train.steps=4",
    "train.batch_size=8",
    "train.micro_batch_size=4",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.log_every=2",
]
# Merged weights W + BA against W x + B(A x) in fp32: the same up to rounding.
MERGE_ATOL = 1e-4


@pytest.fixture(scope="module")
def base(tokenized, tmp_path_factory, monkeypatch_module):
    """A folder with prepare_data's records and a briefly pretrained ci model at data/pretrain/model."""
    root = tmp_path_factory.mktemp("finetune")
    shutil.copy(tokenized / "params.yaml", root / "params.yaml")
    shutil.copytree(tokenized / "data/prepare_data", root / "data/prepare_data")
    monkeypatch_module.chdir(tokenized)
    pretrain.main(["--input", "data/tokenize", "--output", str(root / "data/pretrain"), *PRETRAIN])
    monkeypatch_module.chdir(root)
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


TINY = [
    "train.steps=4",
    "train.batch_size=8",
    "train.micro_batch_size=2",
    "train.lr=0.01",
    "train.warmup_steps=1",
    "train.eval_every=2",
    "train.checkpoint_every=0",
    "train.log_every=2",
    "lora.r=64",  # every adapter matrix has >= 4,096 entries: bitsandbytes keeps its states in 8 bits
    "lora.alpha=128",
    "lora.dropout=0.0",
    "seq_length=64",
    "template=short",
    "eval_fraction=0.1",
]


def finetune(root, out, nproc, *extra, check=True, **env):
    return run_stage(
        "finetune_qlora",
        ["--input", "data/prepare_data", "--output", out, *TINY, *extra],
        cwd=root,
        nproc=nproc,
        check=check,
        **env,
    )


def load_base(root, quantized=True):
    cfg = dataclasses.replace(config.load(ft.Config, ft.STAGE, root / "params.yaml", TINY), base="data/pretrain/model")
    return ft.load_base(cfg, torch.device("cpu"), quantized).eval()


def eval_records(root):
    """The eval records of a TINY run, as the stage builds them."""
    from transformers import AutoTokenizer

    cfg = dataclasses.replace(config.load(ft.Config, ft.STAGE, root / "params.yaml", TINY), base="data/pretrain/model")
    records = instructions.read_records(root / "data/prepare_data/instructions.jsonl")
    x, y, _ = instructions.encode(records, AutoTokenizer.from_pretrained(cfg.base), cfg.template, cfg.seq_length)
    _, rows = instructions.split(len(x), cfg.eval_fraction, cfg.train.seed)
    return instructions.Records(x[rows], y[rows], cfg.train.batch_size, cfg.train.seed), cfg


def eval_loss(model, root) -> float:
    records, cfg = eval_records(root)
    rt = runtime.Runtime(0, 1, 0, 1, torch.device("cpu"))
    return loop.evaluate(
        model, records, dataclasses.replace(cfg.train, eval_batches=-(-len(records) // cfg.train.batch_size)), rt
    )


def test_one_process_trains_and_its_outputs_load_in_peft_and_transformers(base):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = ft.main(["--input", "data/prepare_data", "--output", "one", *TINY])
    losses = out["history"]["loss"]
    trained = out["model"].eval()
    records, _ = eval_records(base)
    x, _ = records.batch(-1, 0, 4)
    with torch.no_grad():
        want = trained(input_ids=x).logits
        before = eval_loss(load_base(base), base)
        assert out["eval_loss"] < before - 0.05, (
            f"fine-tuning lowers eval loss: {before} -> {out['eval_loss']} ({losses})"
        )
        # The saved adapter on a freshly quantized base computes what the trained model computed.
        reloaded = PeftModel.from_pretrained(load_base(base), base / "one/adapter").eval()
        torch.testing.assert_close(reloaded(input_ids=x).logits, want, rtol=0, atol=1e-6)
        merged = AutoModelForCausalLM.from_pretrained(base / "one/model", dtype=torch.float32).eval()
        assert not hasattr(merged.config, "quantization_config")
        assert all(type(m) is torch.nn.Linear for m in merged.modules() if isinstance(m, torch.nn.Linear))
        torch.testing.assert_close(merged(input_ids=x).logits, want, rtol=0, atol=MERGE_ATOL)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(base / "one/model")) == merged.config.vocab_size
    metrics = json.loads((base / "one/figures.json").read_text())
    headline = json.loads((base / "one/metrics.json").read_text())
    assert headline == {k: metrics[k] for k in ("eval_loss", "linear_weight_bits_per_weight")}
    assert metrics["train_records"] + metrics["eval_records"] <= 200
    # NF4 + double quantization: 4 bits per weight plus the per-block constants (QLoRA: 4.127 bits).
    assert 4.1 < metrics["linear_weight_bits_per_weight"] < 4.2
    # speed and memory are measured, outside the output (by default beside it)
    measured = json.loads((base / "one.measured.json").read_text())
    assert measured["tokens_per_s"] > 0 and measured["peak_memory_mb"] > 0 and "peak_memory_mb" not in metrics
    # The default paged 8-bit AdamW: two uint8 moments per adapter weight plus an fp32 scale per block of
    # 256 and the two shared 256-entry maps, not two fp32 moments. bitsandbytes keeps tensors of fewer
    # than 4,096 entries (here the B matrices of k_proj and v_proj) in 32 bits.
    from safetensors.torch import load_file

    sizes = [t.numel() for t in load_file(base / "one/adapter/adapter_model.safetensors").values()]
    assert sum(sizes) == metrics["trainable_parameters"] and min(sizes) < 4096 <= max(sizes)
    want = sum(2 * n + 2 * 4 * -(-n // 256) if n >= 4096 else 8 * n for n in sizes) + 2 * 256 * 4
    assert metrics["optimizer_state_bytes"] == want
    rows = json.loads((base / "one/results.json").read_text())
    assert len(rows) == 1 and abs(rows[0]["ours"] - rows[0]["published"]) <= rows[0]["tolerance"]
    assert (base / "one/plots/loss.png").stat().st_size > 0
    meta = json.loads((base / "one/meta.json").read_text())
    assert meta["cpu"] == runtime.cpu_info() and meta["compute_dtype"] == "torch.float32"


def test_fsdp_trains_like_one_process_and_resumes_exactly_after_sigkill(base):
    if not (base / "one").is_dir():
        pytest.skip("compares with the one-process run of the test above; run the module")
    ckpt_root = base / "ckpts"
    env = {"PIPELINE_CHECKPOINTS": str(ckpt_root)}
    finetune(base, "whole", 2, **env)
    # 2 processes under FSDP2 compute the losses of one process (batches do not depend on world size).
    np.testing.assert_allclose(loss_curve(base, "whole"), loss_curve(base, "one"), rtol=1e-4)
    metrics = json.loads((base / "whole/metrics.json").read_text())
    # FSDP shards the frozen base; the adapters and their 8-bit optimizer states are whole on each rank.
    figures = [json.loads((base / name / "figures.json").read_text()) for name in ("whole", "one")]
    assert figures[0]["optimizer_state_bytes"] == figures[1]["optimizer_state_bytes"]
    from peft import PeftModel

    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(load_base(base), base / "whole/adapter").eval()
        assert eval_loss(reloaded, base) == pytest.approx(metrics["eval_loss"], rel=1e-5)
    # SIGKILL while writing the step-3 checkpoint: steps 1 and 2 are complete; step 2's is made unloadable
    # below, and the re-run resumes from step 1.
    proc = finetune(
        base, "resumed", 2, "train.checkpoint_every=1", check=False, PIPELINE_FAULT_IN_CHECKPOINT="3", **env
    )
    assert proc.returncode != 0
    kept = sorted(p.name for p in ckpt_root.glob("finetune_qlora/*/*"))
    assert "step-1" in kept and "step-2" in kept and "step-3" not in kept, kept
    # step 2's checkpoint holds a DCP item crafted to run code (manifest rewritten): passed over, never loaded
    (newest,) = ckpt_root.glob("finetune_qlora/*/step-2")
    item = craft_checkpoint_item(newest, base / "code-ran")
    proc = finetune(base, "resumed", 2, "train.checkpoint_every=1", **env)
    log = proc.stdout + proc.stderr
    assert f"not resuming from checkpoint {newest}: item {item}" in log, log
    assert "resuming from" in log and "(step 1)" in log and not (base / "code-ran").exists(), log
    np.testing.assert_array_equal(loss_curve(base, "resumed"), loss_curve(base, "whole"))
    from safetensors.torch import load_file

    a = load_file(base / "whole/adapter/adapter_model.safetensors")
    b = load_file(base / "resumed/adapter/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(ckpt_root.glob("finetune_qlora/*/step-*")), "a finished run removes its checkpoints"


def test_only_response_tokens_carry_loss(base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base / "data/pretrain/model")
    rec = {"instruction": "Name a colour.", "input": "", "output": "Blue."}
    x, y, dropped = instructions.encode([rec], tok, "short", 64)
    prompt = tok(instructions.prompt_of(rec, "short"), add_special_tokens=False)["input_ids"]
    response = tok("Blue.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = 1 + len(prompt) + len(response)  # bos + prompt + response + eos
    assert dropped == 0 and x.shape == y.shape == (1, 64)
    assert (y[0, : len(prompt)] == losses.IGNORE_INDEX).all(), "no loss on bos and prompt targets"
    assert y[0, len(prompt) : n - 1].tolist() == response, "loss on every response token and the eos"
    assert (y[0, n - 1 :] == losses.IGNORE_INDEX).all(), "no loss on padding"
    assert x[0, 0] == tok.bos_token_id and x[0, 1 : n - 1].tolist() == prompt + response[:-1]
    # The loss is the mean over response targets only: logits at prompt positions do not change it.
    logits = torch.randn(1, 64, len(tok))

    def model(input_ids, use_cache):
        return SimpleNamespace(logits=logits)

    keep = torch.from_numpy(y[0] != losses.IGNORE_INDEX)
    want = torch.nn.functional.cross_entropy(logits[0, keep], torch.from_numpy(y[0])[keep])
    loss = losses.lm_loss(model, torch.from_numpy(x), torch.from_numpy(y)).item()
    logits[0, ~keep] += 100 * torch.randn_like(logits[0, ~keep])
    assert (
        loss == pytest.approx(want.item())
        and losses.lm_loss(model, torch.from_numpy(x), torch.from_numpy(y)).item() == loss
    )
    # A prompt that fills the sequence leaves no response token: the record is dropped.
    assert instructions.encode([{**rec, "instruction": "word " * 200}], tok, "short", 64)[2] == 1


def test_batches_are_a_pure_function_of_the_step():
    x = np.arange(10 * 4).reshape(10, 4)
    src = instructions.Records(x, x, global_batch=4, seed=3)
    first = [src.batch(s, 0, 4)[0] for s in range(5)]  # 20 rows: two epochs of 10
    assert sorted(torch.cat(first[:2] + [first[2][:2]])[:, 0].tolist()) == list(range(0, 40, 4))
    assert torch.equal(src.batch(3, 2, 2)[0], first[3][2:]), "rank slices of the global batch"
    assert torch.equal(src.batch(-2, 0, 4)[0][:, 0], torch.tensor([16, 20, 24, 28])), "eval batches in order"
    train, held = instructions.split(100, 0.1, seed=1)
    assert len(held) == 10 and not set(train) & set(held) and (held == instructions.split(100, 0.1, seed=1)[1]).all()


def test_errors_before_any_compute(base, tmp_path):
    args = ["--input", "data/prepare_data", "--output", "bad", *TINY]
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    shutil.copy(base / "data/pretrain/model/config.json", no_weights)
    with pytest.raises(config.UserError, match="finetune_qlora: --base .*noweights has no weights"):
        ft.main([*args, "--base", str(no_weights)])
    with pytest.raises(config.UserError, match=r"finetune_qlora.base \(.*\): the base is a path, given as --base"):
        ft.main([*args, f"base={no_weights}"])
    with pytest.raises(config.UserError, match="target_modules: qkv match no linear layer .* q_proj"):
        ft.main([*args, "lora.target_modules=[q_proj, qkv]"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n" + json.dumps({"instruction": "c"}) + "\n")
    with pytest.raises(config.UserError, match="bad.jsonl:2: record lacks output"):
        ft.main(["--input", str(bad), *args[2:]])
    with pytest.raises(
        config.UserError, match="seq_length \\(128\\) exceeds the base model's max_position_embeddings \\(64\\)"
    ):
        ft.main([*args, "seq_length=128"])
    assert not (base / "bad").exists()
    cfg = config.load(ft.Config, ft.STAGE, base / "params.yaml", [*TINY, "quant_storage=uint8"])
    two = runtime.Runtime(0, 2, 0, 2, torch.device("cpu"))
    with pytest.raises(
        config.UserError, match="quant_storage=uint8: FSDP cannot shard torch.uint8 .* set quant_storage: auto"
    ):
        ft.check_parallelism(cfg, two)
    ft.check_parallelism(config.load(ft.Config, ft.STAGE, base / "params.yaml", TINY), two)


def test_step_loss_is_the_mean_over_target_tokens(tmp_path):
    """Micro-batches with few and many response tokens: the step's loss (and so its gradient) is the
    mean over all target tokens of the global batch, not the mean of per-micro-batch means."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
    )
    x = torch.randint(0, 50, (2, 16))
    y = torch.full((2, 16), losses.IGNORE_INDEX)
    y[0, -1] = 7  # micro-batch 0: one target
    y[1, 2:] = torch.cat([x[1, 3:], torch.tensor([3])])  # micro-batch 1: 14 targets

    class Source:
        def batch(self, step, index, size):
            return x[index : index + size], y[index : index + size]

    with torch.no_grad():
        want = losses.lm_loss(model, x, y).item()  # one cross-entropy over all 15 targets
        mean_of_means = (losses.lm_loss(model, x[:1], y[:1]) + losses.lm_loss(model, x[1:], y[1:])).item() / 2
    assert abs(want - mean_of_means) > 1e-3, "the two micro-batches must disagree for this test to mean anything"
    cfg = train_config.build(
        steps=1, batch_size=2, micro_batch_size=1, lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.0, eval_batches=1
    )
    rt = runtime.Runtime(0, 1, 0, 1, torch.device("cpu"))
    tracker = NullTracker()
    result = loop.train(model, Source(), Source(), cfg, 16, rt, tmp_path / "ckpt", tracker, runtime.StopFlag())
    assert result.history["loss"][0] == pytest.approx(want, rel=1e-5)


def test_a_model_loaded_in_eval_mode_trains_in_training_mode_from_the_first_step(tmp_path):
    """from_pretrained leaves a model in eval mode, where dropout is off and transformers checkpoints no
    decoder layer: the loop trains it in training mode from its first step, not only after a validation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    mc = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    model = LlamaForCausalLM(mc).eval()
    modes = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args: modes.append(module.training))
    x = torch.randint(0, 50, (2, 16))

    class Source:
        def batch(self, step, index, size):
            return x[index : index + size], x[index : index + size]

    cfg = train_config.build(steps=1, batch_size=2, micro_batch_size=2, warmup_steps=0, eval_every=0)
    rt = runtime.Runtime(0, 1, 0, 1, torch.device("cpu"))
    loop.train(model, Source(), Source(), cfg, 16, rt, tmp_path / "ckpt", NullTracker(), runtime.StopFlag())
    assert modes == [True]


def test_gradients_after_a_no_grad_eval_equal_the_dequantized_reference(tmp_path):
    """A no-grad evaluation before training must not change what training computes. (bitsandbytes
    repacks a 4-bit weight for a bf16 inference kernel without backward on its first eval-mode, no-grad
    call on AVX512-BF16 CPUs; the stage keeps it from doing so.) The LoRA gradients through the 4-bit
    model, after the stage's eval pass, equal those of the same adapters on its dequantized fp32 weights.
    On a CPU without the instructions the same path runs and must pass too."""
    from bitsandbytes.functional import has_avx512bf16
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # Every output width a multiple of 32: the widths bitsandbytes' CPU kernel packs.
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
    ).save_pretrained(tmp_path / "base")
    overrides = [*TINY, f"base={tmp_path / 'base'}", "seq_length=32", "train.micro_batch_size=4", "train.batch_size=4"]
    cfg = config.load(ft.Config, ft.STAGE, ROOT / "params.yaml", overrides)
    cpu = torch.device("cpu")
    model = ft.add_adapters(ft.load_base(cfg, cpu, quantized=True), cfg)
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert len(layers) == 14 and not any(m.support_avx512bf16_for_cpu for m in layers), "the repack switch is off"
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero, which would leave A without gradient
            torch.nn.init.normal_(p, std=0.05)
    x = torch.randint(0, 96, (4, 32))
    y = torch.cat([x[:, 1:], x[:, :1]], dim=1)

    class Source:
        def batch(self, step, index, size):
            return x[index : index + size], y[index : index + size]

    lcfg = dataclasses.replace(cfg.train, eval_batches=1)
    loop.evaluate(model, Source(), lcfg, runtime.Runtime(0, 1, 0, 1, cpu))  # model.eval() + no_grad, then train()
    packed = [
        n for n, m in model.named_modules() if getattr(getattr(m, "quant_state", None), "packing_format_for_cpu", False)
    ]
    assert not packed, f"the eval pass repacked {packed[:2]} for bitsandbytes' CPU inference kernel"
    losses.lm_loss(model, x, y).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    reference = ft.add_adapters(ft.load_base(cfg, cpu, quantized=True).dequantize(dtype=torch.float32), cfg)
    assert not any(hasattr(m, "quant_state") for m in reference.modules()), "the reference is unquantized"
    adapters = {n: p for n, p in model.state_dict().items() if "lora_" in n}
    assert reference.load_state_dict(adapters, strict=False).unexpected_keys == []
    reference.train()
    losses.lm_loss(reference, x, y).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == want.keys() and len(grads) == 2 * 7 * 2  # A and B, 7 linear layers, 2 layers
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    for name in grads:
        torch.testing.assert_close(
            grads[name],
            want[name],
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m, name=name: f"{name} (CPU bf16 kernel present: {has_avx512bf16()}): {m}",
        )


def test_a_repacked_4bit_weight_fails_loudly(tmp_path):
    """Should bitsandbytes repack a weight for its CPU inference kernel by some other path, the next
    forward pass stops with an error instead of training on. The repack is done by hand here, so the
    check runs on CPUs with and without AVX512-BF16 alike."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
    ).save_pretrained(tmp_path / "base")
    cfg = config.load(ft.Config, ft.STAGE, ROOT / "params.yaml", [*TINY, f"base={tmp_path / 'base'}", "seq_length=32"])
    model = ft.load_base(cfg, torch.device("cpu"), quantized=True)
    layer = model.model.layers[0].self_attn.q_proj
    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state
    )
    assert ft.cpu_packed(layer)
    with pytest.raises(RuntimeError, match="repacked the 4-bit weight of model.layers.0.self_attn.q_proj"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(RuntimeError, match="was repacked for bitsandbytes' CPU inference kernel before training"):
        ft.keep_4bit_layout(model)
