"""The planner's model side: a stage's model built without memory, and one training step traced on fake tensors.

The model is the stage's own transformers `LlamaForCausalLM` (or any causal LM a config.json names), with
PEFT's LoRA adapters for finetune_qlora, built on the meta device: its parameters' names, shapes, dtypes
and which train are exact, and nothing is allocated. Its config comes from the params (pretrain's
`model` section), a local Hugging Face folder, the local hub cache, or, for Meta-Llama-3-8B when none of
those has it, the published shape (`KNOWN`): nothing is downloaded.

`trace` then runs the stage's micro-batches of one optimizer step (forward, fp32 cross-entropy as
stages.common.losses computes it, backward; autocast and activation checkpointing as the train section
sets them, in training mode) under torch's FakeTensorMode,
where every tensor has a shape, a dtype and a device but no data, and counts the bytes of every storage
the step creates while it lives (a dispatch mode: each op's outputs, freed when their storage is; the
gradients apart, so that sharding can divide them). What it records is, after each op, (bytes of
activations and temporaries, bytes of gradients): the timeline the planner's peak is taken from.
Parameters and optimizer states are counted from the shapes (pipelines.plan_budget).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

# Published shapes of hub models the planner may meet without their config.json on this machine
# (gated models whose files need a login). Only the shape: a planner figure, not a model.
KNOWN = {
    "meta-llama/Meta-Llama-3-8B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
}


@dataclass
class Param:
    """One parameter of the model as the stage builds it."""

    name: str
    numel: int
    trainable: bool
    quantized: bool
    """A linear weight the stage loads in 4-bit NF4 (finetune_qlora, quantization nf4)."""
    layer: int | None
    """The decoder layer it belongs to (None: embedding, final norm, head)."""
    shape: tuple[int, ...] = ()


@dataclass
class Trace:
    """What one traced optimizer step holds over time, besides parameters and optimizer states."""

    samples: list[tuple[int, int]] = field(default_factory=list)
    """After each op: (activation and temporary bytes, gradient bytes)."""

    def peak(self, activation_scale: float = 1.0, grad_scale: float = 1.0) -> tuple[int, int, int]:
        """(peak bytes, its activation part, its gradient part), activations and gradients scaled."""
        best = (0, 0, 0)
        for other, grad in self.samples:
            total = other * activation_scale + grad * grad_scale
            if total > best[0]:
                best = (int(total), int(other * activation_scale), int(grad * grad_scale))
        return best


@dataclass
class Extrapolated:
    """A step traced on k and on 2k decoder layers, carried on to k + steps x k layers: each further k
    identical layers add what the second k added."""

    first: Trace
    second: Trace
    steps: float

    def peak(self, activation_scale: float = 1.0, grad_scale: float = 1.0) -> tuple[int, int, int]:
        a, b = self.first.peak(activation_scale, grad_scale), self.second.peak(activation_scale, grad_scale)
        return tuple(int(x + (y - x) * self.steps) for x, y in zip(a, b, strict=True))


def model_config(source: dict | str):
    """(transformers config, where it came from): a dict of LlamaConfig keys, or a base (folder or hub id)."""
    from transformers import AutoConfig, LlamaConfig

    if isinstance(source, dict):
        return LlamaConfig(**source), "params"
    path = Path(source)
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path), f"{path}/config.json"
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True), "the local hub cache"
    except (OSError, ValueError):
        pass
    if source in KNOWN:
        return LlamaConfig(**KNOWN[source]), f"its published shape ({source}'s config.json is not on this machine)"
    raise FileNotFoundError(
        f"no config.json for {source!r}: not a folder, not in the local hub cache; run the stage that makes it, or "
        f"download the model (huggingface-cli download {source} config.json)"
    )


def build(mc, dtype, lora: dict | None = None, frozen: bool = False, quantized: bool = False):
    """The model on the meta device, in `dtype`, with LoRA adapters (`lora`: r, alpha, dropout, target_modules)
    on a frozen base when given."""
    import torch
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(mc)
    finally:
        torch.set_default_dtype(previous)
    if frozen or lora:
        model.requires_grad_(False)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = "all-linear" if "all-linear" in lora["target_modules"] else list(lora["target_modules"])
        config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora.get("dropout", 0.0),
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config, autocast_adapter_dtype=False)
    return model


def params(model, quantized: bool) -> list[Param]:
    """Every parameter: its size, whether it trains, whether the stage stores it in 4-bit (the frozen linear
    weights of the decoder layers, as bitsandbytes quantizes them: transformers leaves the head out)."""
    import re

    import torch

    linear = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    out = []
    for name, p in model.named_parameters():
        found = re.search(r"\.layers\.(\d+)\.", name)
        layer = int(found.group(1)) if found else None
        q = quantized and name in linear and not p.requires_grad and layer is not None
        out.append(Param(name, p.numel(), p.requires_grad, q, layer, tuple(p.shape)))
    return out


class LiveBytes:
    """A dispatch mode that counts the bytes of the storages created under it while they live; gradients
    (found by a hook on each trainable parameter) apart."""

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.track(out)
                return out

        self.mode = Mode()
        self.live: dict[int, int] = {}
        self.grad_keys: set[int] = set()
        self.other = self.grad = 0
        self.samples: list[tuple[int, int]] = []
        self.static = {self.key(t) for t in (*model.parameters(), *model.buffers())}
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.on_grad)

    @staticmethod
    def key(t) -> int:
        return t.untyped_storage()._cdata

    def track(self, out) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            k = st._cdata
            if k in self.live or k in self.static:
                continue
            self.live[k] = st.nbytes()
            self.other += self.live[k]
            weakref.finalize(st, self.free, k)
        self.samples.append((self.other, self.grad))

    def free(self, k: int) -> None:
        n = self.live.pop(k, 0)
        if k in self.grad_keys:
            self.grad_keys.discard(k)
            self.grad -= n
        else:
            self.other -= n

    def on_grad(self, p) -> None:
        k = self.key(p.grad)
        if k in self.live and k not in self.grad_keys:
            self.grad_keys.add(k)
            self.other -= self.live[k]
            self.grad += self.live[k]


def trace(model, micro_batch: int, seq: int, micro_batches: int, autocast_dtype, checkpointing: str, every: int):
    """One optimizer step's forward and backward passes over `micro_batches` micro-batches of (micro_batch,
    seq) tokens on fake tensors (CPU kernels' shapes: scaled-dot-product attention keeps no (T, T) scores),
    gradients accumulating across them as the loop's do, in training mode as the loop trains (dropout, and
    the activation checkpointing transformers applies only in training mode). The optimizer step itself
    allocates nothing lasting beyond its states (fused AdamW; bitsandbytes' 8-bit AdamW in place)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if checkpointing != "none":
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable(every_n_layers=every if checkpointing == "selective" else 1)
    model.train()
    vocab = (
        model.config.vocab_size if hasattr(model.config, "vocab_size") else model.config.get_text_config().vocab_size
    )
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        counter = LiveBytes(model)
        with counter.mode:
            for _ in range(micro_batches):
                x = torch.randint(0, vocab, (micro_batch, seq))
                y = torch.randint(0, vocab, (micro_batch, seq))
                with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
                    logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
                    loss = torch.nn.functional.cross_entropy(
                        logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"
                    )
                del logits
                loss.backward()
                del loss, x, y
    return Trace(counter.samples)


def config_json(mc) -> str:
    return json.dumps({k: v for k, v in mc.to_dict().items() if isinstance(v, (int, float, str))}, sort_keys=True)
