"""Instruction data: Alpaca records (instruction / input / output) as training sequences with a loss mask.

Each record becomes `bos + prompt + response + eos`, right-padded to a fixed length; the targets are
the sequence shifted by one, with IGNORE_INDEX (-100, no loss) on the prompt and the padding, so only
the response tokens and the eos are learned. `Records` serves them to the training loop as a pure
function of (step, index), like the loop's token windows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from stages.common import config, timing
from stages.common.losses import IGNORE_INDEX

TEMPLATES = {  # the Stanford Alpaca prompts
    "alpaca": (
        "Below is an instruction that describes a task. Write a response that appropriately completes "
        "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
    ),
    "alpaca_input": (
        "Below is an instruction that describes a task, paired with an input that provides further "
        "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
        "{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    ),
    "short": "### Instruction:\n{instruction}\n\n### Response:\n",
    "short_input": "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
}


def read_records(path: Path) -> list[dict]:
    """Alpaca records from a .jsonl file; a record without a string instruction or output is an error."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise config.UserError(f"{path}:{n}: not JSON ({e.msg}); each line must be one record") from None
            rec = rec if isinstance(rec, dict) else {}
            missing = [k for k in ("instruction", "output") if not isinstance(rec.get(k), str)]  # "" is an answer too
            if missing:
                raise config.UserError(
                    f"{path}:{n}: record lacks {' and '.join(missing)}; every record needs string "
                    f"fields instruction and output (input optional), as prepare_data writes them"
                )
            records.append(
                {"instruction": rec["instruction"], "input": rec.get("input") or "", "output": rec["output"]}
            )
    if len(records) < 2:
        raise config.UserError(f"{path}: {len(records)} record(s); need at least 2 for a train/eval split")
    return records


def prompt_of(rec: dict, template: str) -> str:
    return TEMPLATES[template + ("_input" if rec["input"].strip() else "")].format(**rec)


def encode(records: list[dict], tok, template: str, seq_length: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Inputs and targets, (N, seq_length) each: bos + prompt + response + eos, shifted by one for the
    targets; prompt and padding targets are IGNORE_INDEX. Returns (inputs, targets, records dropped)."""
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = tok([prompt_of(r, template) for r in records], add_special_tokens=False)["input_ids"]
    responses = tok([r["output"] for r in records], add_special_tokens=False)["input_ids"]
    inputs, targets = [], []
    for p, r in zip(prompts, responses, strict=True):
        ids = ([bos] + p + r + [tok.eos_token_id])[: seq_length + 1]
        if len(p) + 1 >= len(ids):  # no response token fits
            continue
        x = np.full(seq_length, pad, np.int64)
        y = np.full(seq_length, IGNORE_INDEX, np.int64)
        x[: len(ids) - 1] = ids[:-1]
        y[len(p) : len(ids) - 1] = ids[
            len(p) + 1 :
        ]  # target i predicts ids[i + 1]; the first response token at i = len(p)
        inputs.append(x)
        targets.append(y)
    return (
        np.stack(inputs) if inputs else np.zeros((0, seq_length), np.int64),
        np.stack(targets) if targets else np.zeros((0, seq_length), np.int64),
        len(records) - len(inputs),
    )


def split(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of train and eval records: a permutation seeded by `seed`, the first ones held out."""
    order = np.random.default_rng(seed).permutation(n)
    n_eval = max(1, round(n * eval_fraction))
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


class Records:
    """Encoded records as a batch source for the loop, a pure function of (step, index). Training steps
    walk through a fresh seeded permutation each epoch; evaluation batches (negative steps) take the
    records in order, wrapping around."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray, global_batch: int, seed: int):
        self.inputs, self.targets = torch.from_numpy(inputs), torch.from_numpy(targets)
        self.global_batch, self.seed = global_batch, seed

    def __len__(self) -> int:
        return len(self.inputs)

    def rows(self, step: int, index: int, size: int) -> torch.Tensor:
        n = len(self.inputs)
        if step < 0:
            return (torch.arange(size) + (-1 - step) * self.global_batch + index) % n
        pos = torch.arange(size) + step * self.global_batch + index
        out = torch.empty(size, dtype=torch.int64)
        for epoch in pos.div(n, rounding_mode="floor").unique().tolist():
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
            sel = pos // n == epoch
            out[sel] = perm[pos[sel] % n]
        return out

    @timing.phase("data")
    def batch(self, step: int, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows(step, index, size)
        return self.inputs[rows], self.targets[rows]
