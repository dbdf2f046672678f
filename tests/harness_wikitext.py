"""lm-evaluation-harness's own `wikitext` task on a local copy of the split, in a process of its own.

    python tests/harness_wikitext.py PAGES.jsonl OUT.json MODEL LIMIT MAX_LENGTH [LIMIT MAX_LENGTH ...]

PAGES.jsonl holds the split's documents as the hub's document-level WikiText holds them ({"page": ...}
per line). The task is the harness's wikitext.yaml, included unchanged; only its dataset is pointed at
PAGES.jsonl (the hub is never asked). For each (LIMIT, MAX_LENGTH) pair the harness's `hf` model scores
the first LIMIT documents with MODEL (a Hugging Face folder), fp32 on CPU, in windows of MAX_LENGTH
tokens (0: the harness's default, the model's max_position_embeddings). OUT.json: a list of the
harness's figures per pair ({"word_perplexity": ..., "byte_perplexity": ..., "bits_per_byte": ...,
"documents": ...}).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"


def main(pages: str, out: str, model: str, *pairs: str) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    task = Path(lm_eval.__file__).parent / "tasks" / "wikitext" / "wikitext.yaml"
    results = []
    with tempfile.TemporaryDirectory() as tasks:
        (Path(tasks) / "wikitext_local.yaml").write_text(
            f"include: {task}\n"
            "task: wikitext_local\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    test: {Path(pages).resolve()}\n"
            "training_split: null\n"
            "validation_split: null\n"
        )
        manager = TaskManager(include_path=tasks)
        for limit, max_length in zip(pairs[::2], pairs[1::2], strict=True):
            args = f"pretrained={model},dtype=float32" + (f",max_length={max_length}" if int(max_length) else "")
            run = lm_eval.simple_evaluate(
                model="hf",
                model_args=args,
                tasks=["wikitext_local"],
                device="cpu",
                batch_size=64,
                limit=int(limit) or None,
                task_manager=manager,
            )
            figures = run["results"]["wikitext_local"]
            names = ("word_perplexity", "byte_perplexity", "bits_per_byte")
            results.append({**{n: figures[f"{n},none"] for n in names}, "documents": figures["sample_len"]})
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
