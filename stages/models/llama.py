"""The Llama model's own parallel plans (transformers' LlamaForCausalLM, also under a PEFT wrapper):
its decoder layers (each one FSDP unit), its tensor-parallel plan, which degrees its shapes allow, and
its pipeline-stage part and forward (stages.common.pipeline runs them)."""

from __future__ import annotations

import operator

import torch


def decoder_layers(model):
    """The decoder blocks of a causal LM, also under a PEFT wrapper (each is one FSDP unit)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def tensor_parallelize(model, tp_mesh) -> None:
    """Megatron-style tensor parallelism (torch.distributed.tensor.parallel). In every decoder layer,
    q/k/v and gate/up are split by output features (column-wise: each rank computes its heads and its
    part of the MLP width), o and down by input features (row-wise: the partial outputs are summed by
    one all-reduce each). The attention's and the MLP's input enters as one replicated DTensor, so the
    input gradients of q, k and v (and of gate and up) are summed locally and all-reduced once per
    block, not once per projection. The embedding is split by vocabulary rows (its partial lookups
    summed by one all-reduce) and the output head by vocabulary columns, whose sharded logits the loss
    takes as they are (vocab_parallel_loss): no rank holds the whole (B, T, V) logits. Norms stay whole
    on every rank. A model whose head is tied to its embedding keeps both whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    block_input = {"use_local_output": False}  # (a DTensor, so that the projections share its gradient)
    plan = {
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            **block_input,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), **block_input),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, plan)
    if not model.config.tie_word_embeddings:
        ends = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        # (a pipeline stage's part holds the embedding, or the head, or neither)
        present = {name: style for name, style in ends.items() if operator.attrgetter(name)(model) is not None}
        parallelize_module(model, tp_mesh, present)


def tensor_parallel_problem(model_config, degree: int) -> str | None:
    """Why a model cannot be split `degree` ways by tensor_parallelize, or None."""
    c = model_config
    sizes = [
        ("attention heads", c.num_attention_heads),
        ("key/value heads", c.num_key_value_heads),
        ("MLP width (intermediate_size)", c.intermediate_size),
    ]
    if not c.tie_word_embeddings:  # (the embedding and head are split by vocabulary, in equal parts)
        sizes.append(("vocabulary entries (vocab_size)", c.vocab_size))
    for name, value in sizes:
        if value % degree:
            return f"the model's {value} {name} are not divisible by tensor_parallel {degree}"
    return None


def keep_stage_part(model, layers: range, first: bool, last: bool) -> None:
    """Remove from `model` (in place) what a pipeline stage running decoder `layers` does not run: the
    other layers (the kept ones keep their indices, so their parameter names are the whole model's), the
    embedding unless `first`, the final norm and the head unless `last`."""
    inner = model.model
    for name in list(inner.layers._modules):
        if int(name) not in layers:
            del inner.layers._modules[name]
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = None
        model.lm_head = None


class StageForward(torch.nn.Module):
    """One pipeline stage's forward: token ids (first stage) or hidden states in, hidden states or logits
    (last) out; the layers run as in transformers' LlamaModel (rotary embeddings and causal mask from the
    positions)."""

    def __init__(self, model, first: bool, last: bool):
        super().__init__()
        self.lm, self.first, self.last = model, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        inner = self.lm.model
        hidden = inner.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=inner.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
        )
        rotary = inner.rotary_emb(hidden, position_ids=positions)
        for layer in inner.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if self.last:
            hidden = self.lm.lm_head(inner.norm(hidden))
        return hidden
