"""stages.common.safetensors_writer: the bytes safetensors and save_pretrained write, one tensor made at a time."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.common import safetensors_writer
from stages.common.safetensors_writer import Entry


def tensors() -> dict[str, torch.Tensor]:
    """Mixed dtypes and names whose order differs from the file's (descending dtype, then name)."""
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.10.w": torch.randn(3, 5, generator=g),
        "model.layers.2.w": torch.randn(7, generator=g).to(torch.bfloat16),
        "b.scalar": torch.tensor(1.5, dtype=torch.float64),
        "a.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "c.half": torch.randn(2, 2, generator=g).half(),
        "d.mask": torch.tensor([True, False]),
        "é.unicode": torch.randn(1, generator=g),
    }


def entries(named: dict[str, torch.Tensor]) -> list[Entry]:
    return [Entry(name, tuple(t.shape), t.dtype, lambda t=t: t.clone()) for name, t in named.items()]


def test_a_file_is_byte_for_byte_what_safetensors_writes(tmp_path):
    named = tensors()
    save_file(named, tmp_path / "want.safetensors", metadata={"format": "pt"})
    safetensors_writer.write_file(tmp_path / "got.safetensors", entries(named), {"format": "pt"})
    assert (tmp_path / "got.safetensors").read_bytes() == (tmp_path / "want.safetensors").read_bytes()


@pytest.mark.parametrize("max_shard_size", ["50GB", 200])
def test_a_folder_is_what_save_pretrained_writes_sharded_or_not(tmp_path, max_shard_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "want", max_shard_size=max_shard_size)
    (tmp_path / "got").mkdir()
    files = safetensors_writer.write_weights(tmp_path / "got", entries(model.state_dict()), max_shard_size)
    want = sorted(p.name for p in (tmp_path / "want").iterdir() if "safetensors" in p.name)
    assert sorted(p.name for p in (tmp_path / "got").iterdir()) == want
    assert (len(files) > 1) == (max_shard_size == 200) == ("model.safetensors.index.json" in want)
    for name in want:
        assert (tmp_path / "got" / name).read_bytes() == (tmp_path / "want" / name).read_bytes(), name
    if len(files) > 1:
        index = json.loads((tmp_path / "got/model.safetensors.index.json").read_text())
        assert index["metadata"]["total_parameters"] == model.num_parameters()


def test_each_tensor_is_made_when_written_and_let_go_before_the_next(tmp_path):
    named = tensors()
    made: list[weakref.ref] = []

    def make(t):
        gc.collect()
        assert all(ref() is None for ref in made), "the tensor written before is still held"
        out = t.clone()
        made.append(weakref.ref(out))
        return out

    got = [Entry(name, tuple(t.shape), t.dtype, lambda t=t: make(t)) for name, t in named.items()]
    safetensors_writer.write_file(tmp_path / "w.safetensors", got, {"format": "pt"})
    assert len(made) == len(named)
    loaded = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in named.items())


def test_a_tensor_unlike_its_announcement_fails(tmp_path):
    wrong = Entry("w", (2, 2), torch.float32, lambda: torch.zeros(2, 3))
    with pytest.raises(
        RuntimeError, match=r"w was announced as torch.float32 \[2, 2\], made as torch.float32 \[2, 3\]"
    ):
        safetensors_writer.write_file(tmp_path / "w.safetensors", [wrong], {"format": "pt"})
