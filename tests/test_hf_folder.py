"""Hugging Face model folders as the stages read them (stages/common/hf_folder.py)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import ROOT, RunsCode

from stages import eval_harness, eval_perplexity, extend_context, finetune_qlora
from stages.common import config, hf_folder


def hub_folder(folder, weights: str, marker):
    """A model folder as the hub hands them out: config.json beside weights pickled by torch.save, crafted to
    run code (create `marker`) when unpickled."""
    from transformers import LlamaConfig

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)
    LlamaConfig(num_key_value_heads=2, max_position_embeddings=64, **tiny).save_pretrained(folder)
    torch.save({"model.embed_tokens.weight": RunsCode(marker)}, folder / weights)
    return folder


def test_a_folder_with_only_pickled_weights_is_refused_before_anything_loads_it(tmp_path):
    """A hub-style folder with pytorch_model.bin and no safetensors, given as a base model or a model to
    evaluate, and an adapter with adapter_model.bin: one error naming the file and the fix, and nothing is
    unpickled. Safetensors beside the pickle are what loads."""
    marker = tmp_path / "ran"
    model = hub_folder(tmp_path / "hub-model", "pytorch_model.bin", marker)
    fix = "convert them to safetensors where the folder is trusted (load it, then save_pretrained(folder, "
    refusal = re.escape(f"{model} holds its weights only pickled (pytorch_model.bin), a format that can run code")
    tail = re.escape(f"; {fix}") + r".*or give a folder with model\.safetensors$"

    cfg = config.load(finetune_qlora.Config, "finetune_qlora", ROOT / "params.yaml", [f"base={model}"])
    with pytest.raises(config.UserError, match=f"^finetune_qlora: --base {refusal}.*{tail}"):
        finetune_qlora.check_base(cfg)
    cfg = config.load(extend_context.Config, "extend_context", ROOT / "params.yaml", [])
    with pytest.raises(config.UserError, match=f"^extend_context: {refusal}.*{tail}"):
        extend_context.check_inputs(model, tmp_path / "data/tokenize", cfg)
    with pytest.raises(
        config.UserError, match=f"^eval_harness: --models {re.escape(f'hub={model}')}: {refusal}.*{tail}"
    ):
        eval_harness.model_folders([f"hub={model}"])
    with pytest.raises(config.UserError, match=f"^eval_perplexity: --models hub: {refusal}.*{tail}"):
        eval_perplexity.check_checkpoint(eval_perplexity.ModelSpec("hub", model, None))

    (model / "pytorch_model.bin").rename(model / "pytorch_model-00001-of-00001.bin")
    (model / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    assert "only pickled (pytorch_model.bin.index.json)" in hf_folder.pickled_weights(model)
    (model / "model.safetensors").write_bytes(b"")
    assert hf_folder.pickled_weights(model) is None, "safetensors beside the pickle: those load"

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    torch.save({"lora": RunsCode(marker)}, adapter / "adapter_model.bin")
    with pytest.raises(config.UserError, match=r"adapter holds its weights only pickled \(adapter_model.bin\)"):
        eval_perplexity.check_checkpoint(eval_perplexity.ModelSpec("tuned", model, adapter))
    assert not marker.exists(), "nothing was unpickled"
