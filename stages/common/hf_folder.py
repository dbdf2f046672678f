"""Hugging Face model folders as stages read them: what a model (or PEFT adapter) folder lacks of its
weights, and weights in a form no stage loads, before any compute."""

from __future__ import annotations

import json
from pathlib import Path

from stages.common.config import UserError


def weight_files(adapter: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(safetensors, pickled) names of a model folder's weights, or a PEFT adapter folder's: the single file,
    then the index of shards. (transformers is imported here, by the stages that read model folders.)"""
    from transformers.utils import (
        ADAPTER_SAFE_WEIGHTS_NAME,
        ADAPTER_WEIGHTS_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    if adapter:
        return (ADAPTER_SAFE_WEIGHTS_NAME,), (ADAPTER_WEIGHTS_NAME,)
    return (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


def pickled_weights(folder: str | Path, adapter: bool = False) -> str | None:
    """Why the folder's weights are not loaded, as "<cause>; <fix>": they are pickled only (pytorch_model.bin
    or its shards, adapter_model.bin), with no safetensors beside them. Unpickling a file can run any code
    it holds, so the stages load safetensors only (from_pretrained(..., use_safetensors=True)). None when
    safetensors are there, or no weights at all (weights_problem says so)."""
    folder = Path(folder)
    safe, pickled = weight_files(adapter)
    found = [name for name in pickled if (folder / name).is_file()]
    if not found or any((folder / name).is_file() for name in safe):
        return None
    return (
        f"holds its weights only pickled ({found[0]}), a format that can run code when loaded and that no stage "
        f"loads; convert them to safetensors where the folder is trusted (load it, then save_pretrained(folder, "
        f"safe_serialization=True)), or give a folder with {safe[0]}"
    )


def weights_problem(folder: str | Path, adapter: bool = False) -> str | None:
    """What a Hugging Face model folder (or PEFT adapter folder) lacks of its weights: every weight file
    (single or sharded), or a shard its index names. None when they are all there."""
    folder = Path(folder)
    names = tuple(name for kind in weight_files(adapter) for name in kind)
    found = [name for name in names if (folder / name).is_file()]
    if not found:
        return f"has no weights ({' or '.join(names)})"
    if found[0].endswith(".index.json"):  # sharded: every shard the index names must be there
        shards = json.loads((folder / found[0]).read_text())["weight_map"].values()
        missing = sorted(f for f in set(shards) if not (folder / f).is_file())
        if missing:
            return f"lacks {missing[0]} (listed in {found[0]})"
    return None


def check(
    folder: str | Path,
    where: str,
    missing: str,
    incomplete: str = "the checkpoint is incomplete",
    adapter: bool = False,
) -> None:
    """Refuse, in one line that starts with `where`, a folder no stage can load as a Hugging Face model (or
    PEFT adapter): no config file (`missing`: the fix), weights pickled only, weights missing (`incomplete`:
    the fix)."""
    folder = Path(folder)
    name = "adapter_config.json" if adapter else "config.json"
    if not (folder / name).is_file():
        raise UserError(f"{where} has no {name}; {missing}")
    pickled = pickled_weights(folder, adapter)
    if pickled:
        raise UserError(f"{where} {pickled}")
    problem = weights_problem(folder, adapter)
    if problem:
        raise UserError(f"{where} {problem}; {incomplete}")
