"""Memory does not grow with the corpus: the data path (prepare_data -> tokenize -> pretrain) on two
generated corpora, one 4x the other, through bench/data_scale.py, with the same peak memory per process."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import MIRROR, ROOT

pytestmark = pytest.mark.system
SMALL_MB, RATIO = 8, 4
TOLERANCE = 0.15


def bench():
    spec = importlib.util.spec_from_file_location("data_scale", ROOT / "bench" / "data_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(900)
def test_peak_memory_per_process_is_flat_in_the_corpus_size(tmp_path, mirror):
    scale = bench()
    runs = {}
    for mb in (SMALL_MB, SMALL_MB * RATIO):
        work = tmp_path / f"{mb}mb"
        work.mkdir()
        corpus = work / "corpus.jsonl"
        scale.generate(corpus, mb, MIRROR)
        runs[mb] = scale.run_path(corpus, work, steps=2, train_max_mb=4)
    small, large = runs[SMALL_MB], runs[SMALL_MB * RATIO]
    assert large["tokens"] > 3.8 * small["tokens"], "the larger corpus holds ~4x the tokens"
    for stage in ("prepare_data", "tokenize", "pretrain"):
        a, b = max(small[stage]["peak_rss_mb"]), max(large[stage]["peak_rss_mb"])
        assert len(small[stage]["peak_rss_mb"]) == (1 if stage == "prepare_data" else 2), small[stage]
        assert abs(b - a) / a < TOLERANCE, f"{stage}: peak RSS {a} MB on {SMALL_MB} MB, {b} MB on 4x that"
