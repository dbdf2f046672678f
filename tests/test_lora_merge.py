"""stages.common.lora_merge: the merged model written one weight at a time is, byte for byte, what PEFT's
merge_and_unload and save_pretrained write for the dequantized (or fp32) base, for NF4 and plain bases with
tied and untied embeddings; above the shard size, shards that load as that model."""

from __future__ import annotations

import pytest
import torch

from stages.common import lora_merge


def base_folder(tmp_path, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def load(base, quantized: bool):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {"dtype": torch.float32, "device_map": {"": "cpu"}}
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
            bnb_4bit_quant_storage=torch.float32,
        )
    return AutoModelForCausalLM.from_pretrained(base, **kwargs)


def adapted(base, quantized: bool, folder):
    """The base with LoRA on every linear layer, its B matrices made non-zero, and the adapter saved to `folder`."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(load(base, quantized), lora, autocast_adapter_dtype=False)
    with torch.no_grad():  # B starts at zero: give the adapters a delta to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    model.save_pretrained(folder)
    return model


def peft_merged(base, quantized: bool, adapter):
    """What the stage wrote before: the whole base dequantized (or cast) to fp32, PEFT's merge_and_unload."""
    from peft import PeftModel

    reference = load(base, quantized)
    reference = reference.dequantize(dtype=torch.float32) if quantized else reference.float()
    return PeftModel.from_pretrained(reference, adapter).merge_and_unload()


@pytest.mark.parametrize(("quantized", "tied"), [(True, False), (False, False), (True, True), (False, True)])
def test_the_merged_folder_is_byte_for_byte_what_peft_merge_and_save_pretrained_write(tmp_path, quantized, tied):
    base = base_folder(tmp_path, tied)
    model = adapted(base, quantized, tmp_path / "adapter")
    assert lora_merge.save_merged(model, tmp_path / "got", upcast=not quantized) == ["model.safetensors"]
    peft_merged(base, quantized, tmp_path / "adapter").save_pretrained(tmp_path / "want")
    want = sorted(p.name for p in (tmp_path / "want").iterdir())
    assert sorted(p.name for p in (tmp_path / "got").iterdir()) == want
    for name in want:
        assert (tmp_path / "got" / name).read_bytes() == (tmp_path / "want" / name).read_bytes(), name


def test_a_model_above_the_shard_size_is_written_in_shards_that_load_as_the_merged_model(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = base_folder(tmp_path, tied=True)
    model = adapted(base, True, tmp_path / "adapter")
    files = lora_merge.save_merged(model, tmp_path / "got", upcast=False, max_shard_size=40_000)
    assert len(files) > 1 and (tmp_path / "got/model.safetensors.index.json").is_file()
    for f in files:  # at most the shard size, or one tensor alone
        assert (tmp_path / "got" / f).stat().st_size < 40_000 + 2_000 or len(load_file(tmp_path / "got" / f)) == 1
    want = peft_merged(base, True, tmp_path / "adapter")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "got", dtype=torch.float32)
    assert got.state_dict().keys() == want.state_dict().keys()
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in got.state_dict().items())


def test_the_merge_leaves_the_model_it_reads_unchanged(tmp_path):
    """One process merges its trained model itself, which the stage then hands back."""
    model = adapted(base_folder(tmp_path, tied=False), False, tmp_path / "adapter")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lora_merge.save_merged(model, tmp_path / "merged", upcast=True)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
