"""eval_perplexity's wikitext protocol against lm-evaluation-harness's own `wikitext` task.

The harness (pinned in requirements.lock) runs its task definition unchanged, on the mirror's WikiText-2
test split as a local dataset (tests/harness_wikitext.py), and scores the model the ci pipeline published
(data/pretrain/model of the shared run) with its `hf` model, fp32 on CPU. Word perplexity, byte perplexity
and bits per byte must equal the stage's to 1e-6 relative: once with windows that roll across documents
(the model's context of 64 tokens, two processes), once with a context longer than the document (one
window each). The pipeline's eval_harness stage, which runs the same task on the same model, must give
the harness's figures too. The document split, the detokenizer and the word and byte counts are compared with the
harness's over both splits of the mirror.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ci_params, run_stage
from shared_run import shared_run

from stages import eval_perplexity
from stages.common import wikitext

REL = 1e-6
FIGURES = ("word_perplexity", "byte_perplexity", "bits_per_byte")
# Rows of the hub's document-level WikiText-2 (EleutherAI/wikitext_document_level, wikitext-2-raw-v1), which
# the harness's task reads: the split below must give the same documents.
HUB_DOCUMENTS = {"test": 62, "valid": 60}
# sha256 of json.dumps(documents) as the split is cut today (the hub's generation script, read line by line,
# splits the same way): a change to the split shows here even where the counts stay.
DOCUMENTS_SHA256 = {
    "test": "ada3db8332b346ca750b7e4de2169583957e5cef452f0e1fcf90fe03e99930d2",
    "valid": "b45a38f6f4a4dd8cd86737ccd0fdf03d9e49d36581d3b372c90c0d653d7e834a",
}
# (max_documents, context): windows rolling across the first documents at the model's context (as the ci
# preset's eval_harness scores them); the first document (3,270 tokens of the ci tokenizer) inside one window.
CASES = ((2, 64), (1, 4096))


def harness_preprocessing():
    """The harness's preprocess_wikitext module (its detokenizer and counts), read from the installed package."""
    package = importlib.util.find_spec("lm_eval").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(
        "preprocess_wikitext", Path(package, "tasks/wikitext/preprocess_wikitext.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("split", sorted(HUB_DOCUMENTS))
def test_documents_detokenizer_and_counts_are_the_harness_s(mirror, split):
    text = (mirror / "wikitext-2-raw" / f"wiki.{split}.raw").read_text(encoding="utf-8")
    docs = wikitext.documents(text)
    assert len(docs) == HUB_DOCUMENTS[split]
    assert hashlib.sha256(json.dumps(docs).encode()).hexdigest() == DOCUMENTS_SHA256[split]
    assert text.endswith("\n".join(docs)) and not text[: len(text) - len("\n".join(docs))].strip()
    assert all(re.match(r" = [^=].* = $", d.split("\n")[0]) for d in docs), "each document opens with its title"
    harness = harness_preprocessing()
    for doc in docs:
        assert wikitext.detokenize(doc) == harness.wikitext_detokenizer({"page": doc})
        got = harness.process_results({"page": doc}, (-1.0,))
        assert wikitext.counts(doc) == (got["word_perplexity"][1], got["byte_perplexity"][1])


def test_document_windows_give_each_token_the_context_the_harness_gives_it():
    """eval_perplexity's windows of a document against the harness's own rolling windows (get_rolling_token_windows
    and make_disjoint_window, the input cut as its hf model cuts it): the same context before every token."""
    from lm_eval import utils

    prefix = -1
    for n in range(0, 30):
        for context in range(1, 12):
            tokens = list(range(100, 100 + n))
            ids = [prefix, *tokens]
            ours = {}
            for begin, length, first in eval_perplexity.document_windows(0, n, context):
                for j in range(first, length):  # reads ids[begin : begin + j + 1], predicts ids[begin + j + 1]
                    ours[ids[begin + j + 1]] = ids[begin : begin + j + 1]
            theirs = {}
            for pair in utils.get_rolling_token_windows(tokens, prefix, context, 1):
                given, predicted = utils.make_disjoint_window(pair)
                read = (given + predicted)[-(context + 1) :][:-1]
                for k, token in enumerate(predicted):
                    theirs[token] = read[: len(read) - len(predicted) + k + 1]
            assert ours == theirs, (n, context)


@pytest.fixture(scope="module")
def published(mirror, tmp_path_factory):
    """The ci pipeline's pretrain model, the test split's documents as the harness's dataset rows, and the
    harness's figures for each case."""
    root = tmp_path_factory.mktemp("parity")
    ci_params(root)
    model = shared_run() / "data" / "pretrain" / "model"
    raw = mirror / "wikitext-2-raw" / "wiki.test.raw"
    pages = root / "pages.jsonl"
    docs = wikitext.documents(raw.read_text(encoding="utf-8"))
    pages.write_text("".join(json.dumps({"page": d}) + "\n" for d in docs), encoding="utf-8")
    pairs = [str(x) for case in CASES for x in case]
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("harness_wikitext.py")),
            str(pages),
            str(root / "harness.json"),
            str(model),
            *pairs,
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model, raw, root, json.loads((root / "harness.json").read_text())


@pytest.mark.parametrize("case", range(len(CASES)), ids=["rolling-windows", "one-window"])
def test_wikitext_figures_equal_the_harness_s(published, case, monkeypatch):
    model, raw, root, harness = published
    documents, context = CASES[case]
    args = ["--models", f"pretrain={model}", "--text", str(raw), "--output", f"out{case}", "protocol=wikitext"]
    args += [
        f"contexts=[{context}]",
        f"max_documents={documents}",
        "max_tokens=0",
        "extrapolate=true",
        "position_buckets=[]",
        "precision=fp32",  # as the harness runs
    ]
    if case == 0:  # under torchrun, two processes sharing the windows
        run_stage("eval_perplexity", args, cwd=root, nproc=2)
        ours = json.loads((root / "out0" / "figures.json").read_text())
    else:
        monkeypatch.chdir(root)
        monkeypatch.setenv("PIPELINE_TRACKING", "off")  # tracking is not what is compared
        ours = eval_perplexity.main(args)
    m = ours["models"]["pretrain"][f"ctx{context}"]
    assert ours["protocol"] == "wikitext" and ours["documents"] == harness[case]["documents"] == documents
    rolls = m["tokens"] > context
    assert rolls == (case == 0), f"{m['tokens']} tokens in windows of {context}"
    for name in FIGURES:
        assert m[name] == pytest.approx(harness[case][name], rel=REL), name


def test_the_pipeline_s_eval_harness_stage_gives_the_harness_s_figures(published):
    """eval_harness@pretrain of the shared run: the ci preset's limit of 2 documents at the model's own
    context, i.e. the first case."""
    _, _, _, harness = published
    stage = json.loads((shared_run() / "data/eval_harness/pretrain/figures.json").read_text())["pretrain"]["wikitext"]
    assert CASES[0] == (2, 64) and harness[0]["documents"] == 2
    for name in FIGURES:
        assert stage[name] == pytest.approx(harness[0][name], rel=REL), name
