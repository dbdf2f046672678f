"""generate: sample text from any model folder the pipeline writes, to see what a model learned.

    python -m stages.generate data/pretrain/model "ROMEO:" [--max-new-tokens 200] [--temperature 0.8] [--top-k 50]
    python -m stages.generate data/pretrain/model "ROMEO:" --greedy

A tool, not a DAG stage: it reads a Hugging Face model folder (weights + tokenizer) and prints the
prompt followed by the sampled continuation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from stages.common import config, stage


def generate(
    model_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    greedy: bool = False,
    seed: int = 0,
) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise config.UserError(
            f"generate: {model_dir} holds no model (config.json); pass a folder such as data/pretrain/model"
        )
    if temperature <= 0 and not greedy:
        raise config.UserError("generate: --temperature must be > 0 (or use --greedy)")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        ids = torch.tensor([[tok.bos_token_id]])
    torch.manual_seed(seed)
    # Never past the model's configured context.
    room = model.config.max_position_embeddings - ids.shape[1]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max(0, min(max_new_tokens, room)),
            do_sample=not greedy,
            temperature=None if greedy else temperature,
            top_k=None if greedy else top_k,
            top_p=None,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return tok.decode(out[0], skip_special_tokens=True)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("model", help="a model folder, e.g. data/pretrain/model")
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    text = generate(a.model, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.greedy, a.seed)
    print(text)
    return text


if __name__ == "__main__":
    stage.entry(main)
