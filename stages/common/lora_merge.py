"""A LoRA fine-tune's merged model, made and written one weight at a time.

Each target layer's weight is taken as the trained model computed with it (a 4-bit weight dequantized by
bitsandbytes, as transformers' `dequantize` does), in fp32, plus scale * B A (PEFT's merge: the same
operations in the same dtype), then moved to the host and written (stages.common.safetensors_writer)
before the next one is made. Beyond the loaded model, the peak is one weight with its delta, not the
whole dequantized model. The folder holds what PEFT's `merge_and_unload()` and `save_pretrained` write
for the dequantized model: config.json, generation_config.json and the weights, byte for byte while they
fit one file; above MAX_SHARD_SIZE, shards in the state dict's order with their index (save_pretrained
may list a plain model's tensors in another order, so its shards can hold them differently)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import torch

from stages.common import safetensors_writer
from stages.common.safetensors_writer import Entry

# The hub's customary shard size (save_pretrained's default is 50GB: an 8B model in fp32 would be one file)
MAX_SHARD_SIZE = "5GB"


def save_merged(model, folder: Path, upcast: bool, max_shard_size: int | str = MAX_SHARD_SIZE) -> list[str]:
    """Write `model` (a PeftModel with its adapters) merged into `folder`; the weight files written.
    `upcast`: every floating tensor in fp32 (the plain base's `.float()`); else only the 4-bit and merged
    weights are, the rest keep their load dtype (what `dequantize(dtype=torch.float32)` leaves)."""
    base = model.get_base_model()
    entries = list(merged_entries(base, upcast))
    folder.mkdir(parents=True, exist_ok=True)
    files = safetensors_writer.write_weights(folder, entries, max_shard_size)
    # the config save_pretrained writes for the dequantized model: no quantization, the first weight's dtype
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    first = next(e for e in entries if e.parameter and e.dtype.is_floating_point)
    config.dtype = str(first.dtype).removeprefix("torch.")
    config.architectures = [type(base).__name__]
    config.save_pretrained(folder)
    if base.can_generate():
        base.generation_config.save_pretrained(folder)
    return files


def merged_entries(base, upcast: bool) -> Iterator[Entry]:
    """The merged model's state dict, in its order, as entries whose tensors are made when written. A tensor
    tied to an earlier one (an lm_head tied to the embedding) is written once, under the first name."""
    from peft.tuners.lora import LoraLayer

    seen: set[int] = set()

    def plain(name: str, tensor: torch.Tensor, parameter: bool) -> Iterator[Entry]:
        if id(tensor) in seen:
            return
        seen.add(id(tensor))
        if is_4bit(tensor):
            shape = tuple(tensor.quant_state.shape)
            yield Entry(name, shape, torch.float32, lambda: dequantized(tensor), parameter)
            return
        dtype = torch.float32 if upcast and tensor.is_floating_point() else tensor.dtype
        # cast on the host: only a merged weight takes room on the device
        yield Entry(name, tuple(tensor.shape), dtype, lambda: tensor.detach().to("cpu").to(dtype), parameter)

    def visit(prefix: str, module: torch.nn.Module) -> Iterator[Entry]:
        if isinstance(module, LoraLayer):
            layer = module.get_base_layer()
            if not isinstance(layer, torch.nn.Linear):
                raise RuntimeError(f"lora_merge: {prefix}: adapters on a {type(layer).__name__} are not merged here")
            weight = layer.weight
            seen.add(id(weight))
            shape = tuple(weight.quant_state.shape) if is_4bit(weight) else tuple(weight.shape)
            yield Entry(f"{prefix}weight", shape, torch.float32, lambda: merged_weight(module))
            if layer.bias is not None:
                yield from plain(f"{prefix}bias", layer.bias, True)
            return  # the adapters themselves are no part of the merged model
        for name, p in module.named_parameters(recurse=False):
            yield from plain(prefix + name, p, True)
        for name, b in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield from plain(prefix + name, b, False)
        for name, child in module.named_children():
            yield from visit(f"{prefix}{name}.", child)

    yield from visit("", base)


def is_4bit(tensor: torch.Tensor) -> bool:
    return getattr(tensor, "quant_state", None) is not None


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit weight as transformers' `dequantize(dtype=torch.float32)` makes it."""
    import bitsandbytes as bnb

    return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).to(torch.float32)


def merged_weight(layer) -> torch.Tensor:
    """A LoRA layer's weight with its active adapters merged, in fp32 on the layer's device: PEFT's
    `Linear.merge` on the fp32 weight, `weight += (B @ A) * scaling`, with A and B in fp32 (as PEFT loads
    an adapter onto an fp32 base)."""
    weight = layer.get_base_layer().weight
    merged = dequantized(weight) if is_4bit(weight) else weight.detach().to(torch.float32, copy=True)
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if layer.fan_in_fan_out or adapter in layer.lora_variant or layer.lora_bias[adapter]:
            raise RuntimeError(f"lora_merge: adapter {adapter!r} is not plain LoRA (fan_in_fan_out, DoRA or a bias)")
        a = layer.lora_A[adapter].weight.to(torch.float32)
        b = layer.lora_B[adapter].weight.to(torch.float32)
        merged += (b @ a) * layer.scaling[adapter]
    return merged
