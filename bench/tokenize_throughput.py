"""Tokenize throughput: the stage's encoder vs plain `tokenizers` encode_batch, same text, same cores.

    python bench/tokenize_throughput.py [--copies 5] [--repeats 3]

Builds a corpus of TinyShakespeare repeated `--copies` times (from PIPELINE_DATA_MIRROR or the
internet), trains the stage's tokenizer once, then alternates, `--repeats` times:
  stage     stages.tokenize.encode_range over the whole file: streaming read, batched encode,
            eos handling, ids written to disk
  baseline  Tokenizer.encode_batch over the same lines, already in memory, then each encoding's
            `.ids` (the token ids, which is what the stage produces too); nothing written
and prints the best tokens/s of each and their ratio (goal: stage / baseline >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages import prepare_data, tokenize  # noqa: E402
from stages.common import sources  # noqa: E402


class NullBar:
    def update(self, n):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        raw = tmp / "input.txt"
        prepare_data.fetch(sources.TINYSHAKESPEARE, raw)
        corpus = tmp / "corpus"
        corpus.mkdir()
        text = raw.read_text() * args.copies
        (corpus / "train.txt").write_text(text)
        cfg = tokenize.Config(
            vocab_size=args.vocab_size, min_frequency=2, train_max_bytes=0, batch_lines=4096, shard_tokens=1 << 24
        )
        tok = tokenize.train_tokenizer(corpus, cfg, show_progress=False)
        txt = corpus / "train.txt"
        size = txt.stat().st_size
        lines = text.splitlines(keepends=True)

        best = {"stage": 0.0, "baseline": 0.0}
        tokens = 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            one_document = np.zeros(1, np.int64)  # the file is one document: an eos at its end
            counts = tokenize.encode_range(tok, txt, one_document, 0, size, tmp / "ids.bin", cfg, NullBar())
            stage_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            ids = [e.ids for e in tok.encode_batch(lines, add_special_tokens=False)]
            base_s = time.perf_counter() - t0
            base_tokens = sum(map(len, ids))
            tokens = counts["tokens"]
            assert tokens == base_tokens + 1, "same text, same ids (plus the stage's one eos)"
            best["stage"] = max(best["stage"], tokens / stage_s)
            best["baseline"] = max(best["baseline"], base_tokens / base_s)

    print(
        f"text: TinyShakespeare x{args.copies} ({size / 1e6:.1f} MB, {tokens:,} tokens), vocab {args.vocab_size}, "
        f"{threads} threads, best of {args.repeats}"
    )
    print(f"stage    (stages.tokenize.encode_range): {best['stage']:>12,.0f} tokens/s")
    print(f"baseline (Tokenizer.encode_batch, ids): {best['baseline']:>12,.0f} tokens/s")
    print(f"ratio stage/baseline: {best['stage'] / best['baseline']:.2f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
