"""prepare_data on the real mirror: verified copies, deterministic splits, clear errors, no partial output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_stage

from stages import prepare_data
from stages.common import config


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_outputs_match_sources_and_are_deterministic(prepared, mirror, tmp_path):
    out = prepared / "data/prepare_data"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["corpus"]["sha256"]["input.txt"] == sha256(mirror / "tinyshakespeare/input.txt")
    source = (mirror / "tinyshakespeare/input.txt").read_text()
    train = (out / "corpus/train.txt").read_text()
    assert source.startswith(train) and 0 < len(train.encode()) <= 100_000, "train is a prefix cut at max_bytes"
    for split in ("train", "val", "test"):
        text = (out / f"corpus/{split}.txt").read_bytes()
        assert text.endswith(b"\n") and len(text) == meta["corpus"]["splits"][split]["bytes"]
        assert np.load(out / f"corpus/{split}.docs.npy").tolist() == [0]
    # Planetoid raw files and the benchmarks are byte copies of the mirror's; instructions keep the first records.
    bench = "benchmarks/wikitext-2-raw/wiki.test.raw"
    assert meta["benchmarks"]["sha256"] == {bench: sha256(mirror / "wikitext-2-raw/wiki.test.raw")}
    assert sha256(out / bench) == "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"
    for rel, digest in meta["graphs"]["raw_sha256"].items():
        assert digest == sha256(mirror / rel) == sha256(out / rel)
    records = [json.loads(line) for line in (out / "instructions.jsonl").read_text().splitlines()]
    first = json.loads((mirror / "alpaca-5k/alpaca_data_5k.jsonl").read_text().splitlines()[0])
    assert len(records) == 200 and records[0] == {k: first[k] for k in ("instruction", "input", "output")}
    assert meta["files"]["corpus/train.txt"] == sha256(out / "corpus/train.txt")
    # Same inputs, same bytes: a second run under torchrun (rank 0 writes) reproduces every file.
    (tmp_path / "params.yaml").write_text((prepared / "params.yaml").read_text())
    run_stage("prepare_data", ["--output", "again"], cwd=tmp_path, nproc=2)
    again = json.loads((tmp_path / "again/meta.json").read_text())
    assert again["files"] == meta["files"]


def test_jsonl_corpus_keeps_documents(workdir):
    docs = [{"text": f"document {i}\nsecond line {i}"} for i in range(20)]
    (workdir / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    meta = prepare_data.main(
        [
            "--output",
            "out",
            "corpus=docs.jsonl",
            "instructions=none",
            "graphs=[]",
            "val_fraction=0.1",
            "test_fraction=0.1",
        ]
    )
    assert [meta["corpus"]["splits"][s]["documents"] for s in ("train", "val", "test")] == [16, 2, 2]
    text = (workdir / "out/corpus/val.txt").read_text()
    offsets = np.load(workdir / "out/corpus/val.docs.npy").tolist()
    assert text[offsets[1] :].startswith("document 17\n") and text.count("document") == 2


def assert_nothing_written(folder: Path, name: str) -> None:
    assert not (folder / name).exists(), f"{name} was left behind"
    assert not list(folder.glob(f".{name}.tmp-*")), "a temporary folder was left behind"
    assert not list(folder.glob(f".{name}.work-*")), "a work folder was left behind"


def make_mirror(tmp_path: Path, content: bytes) -> Path:
    mirror = tmp_path / "fake-mirror"
    (mirror / "tinyshakespeare").mkdir(parents=True)
    (mirror / "tinyshakespeare/input.txt").write_bytes(content)
    return mirror


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing corpus", "'nowhere.txt' is neither a known corpus"),
        ("checksum mismatch", "checksum mismatch for .*input.txt: sha256 [0-9a-f]{64}, expected 86c4e6aa"),
        ("empty corpus", "corpus empty.txt is empty \\(0 bytes\\)"),
        ("tiny corpus", "split of tiny.txt is empty; the corpus holds only 8 bytes: use a larger corpus"),
        ("non-UTF-8 text", "bad.txt is not valid UTF-8: byte 6"),
        (
            "missing mirror file",
            "wiki.train.raw: not in the mirror .* set PIPELINE_DATA_MIRROR to a directory holding "
            "wikitext-2-raw/wiki.train.raw \\(sha256 6707892f",
        ),
    ],
)
def test_bad_data_fails_clearly_before_writing(workdir, monkeypatch, case, message):
    (workdir / "empty.txt").write_bytes(b"")
    (workdir / "tiny.txt").write_bytes(b"to be.\nx")
    (workdir / "bad.txt").write_bytes(b"hello \xff world\n")
    overrides = {
        "missing corpus": ["corpus=nowhere.txt"],
        "checksum mismatch": [],
        "empty corpus": ["corpus=empty.txt"],
        "tiny corpus": ["corpus=tiny.txt"],
        "non-UTF-8 text": ["corpus=bad.txt"],
        "missing mirror file": ["corpus=wikitext2"],
    }[case]
    if case == "checksum mismatch":
        monkeypatch.setenv("PIPELINE_DATA_MIRROR", str(make_mirror(workdir, b"not shakespeare\n")))
    with pytest.raises(prepare_data.DataError, match=message):
        prepare_data.main(["--output", "data/prepare_data", *overrides])
    assert_nothing_written(workdir / "data", "prepare_data")


def test_cli_prints_one_line_error(workdir):
    (workdir / "bad.txt").write_bytes(b"caf\xe9\n")
    proc = run_stage("prepare_data", ["--output", "out", "corpus=bad.txt"], cwd=workdir, nproc=2, check=False)
    assert proc.returncode != 0
    assert "error: bad.txt is not valid UTF-8: byte 3" in proc.stderr
    assert "stages/prepare_data.py" not in proc.stderr, "the error is one line, not a traceback of the stage"
    assert_nothing_written(workdir, "out")


def test_config_errors_come_before_any_work(workdir):
    with pytest.raises(config.ConfigError, match="prepare_data.max_bytes must be an int"):
        prepare_data.main(["--output", "out", "max_bytes=lots"])
    assert_nothing_written(workdir, "out")


def test_a_mixture_interleaves_whole_documents_by_weight(workdir, mirror):
    """TinyShakespeare (one document per split, taken in 16 KiB pieces) and a .jsonl of documents, 1:3:
    each split ends when the source whose turn it is runs out, with every source within one piece of
    its share; the jsonl's documents come through whole and in order; meta.json records the mixture."""
    docs = [{"text": f"record {i} " + "word " * (40 + i % 50) + "\n" + "more " * 20} for i in range(3000)]
    (workdir / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    mixture = "corpus=[{source: tinyshakespeare, weight: 1}, {source: docs.jsonl, weight: 3}]"
    meta = prepare_data.main(["--output", "out", mixture, "instructions=none", "graphs=[]"])
    corpus = meta["corpus"]
    assert corpus["corpus"] == "mixture" and [s["weight"] for s in corpus["sources"]] == [1.0, 3.0]
    assert corpus["sources"][0]["sha256"]["input.txt"].startswith("86c4e6aa")
    for split in ("train", "val", "test"):
        total = corpus["splits"][split]["bytes"]
        shakespeare, records = (s["used"][split] for s in corpus["sources"])
        assert shakespeare["bytes"] + records["bytes"] == total
        assert abs(records["bytes"] - 0.75 * total) <= prepare_data.PIECE_BYTES, (split, records, total)
    # The jsonl's train documents, whole and in their order, each at a document start.
    text = (workdir / "out/corpus/train.txt").read_text()
    offsets = np.load(workdir / "out/corpus/train.docs.npy").tolist()
    starts = [text[o:].split("\n", 1)[0] for o in offsets]
    numbers = [int(s.split()[1]) for s in starts if s.startswith("record ")]
    assert numbers == list(range(len(numbers))) and len(numbers) == corpus["sources"][1]["used"]["train"]["documents"]
    assert "First Citizen:" in text and corpus["sources"][0]["used"]["train"]["documents"] > 1
    figures = json.loads((workdir / "out/figures.json").read_text())
    assert figures["source1_train_share"] == corpus["sources"][1]["used"]["train"]["share"]


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{source: docs.jsonl, weight: 0}", r"corpus\[1\]\.weight \(source docs.jsonl\) must be a number > 0, got 0"),
        ("{source: docs.jsonl, weight: -2}", r"corpus\[1\]\.weight \(source docs.jsonl\) must be a number > 0"),
        ("{source: docs.jsonl}", r"corpus\[1\] must be a mapping with the keys source and weight"),
        ("{source: nowhere.jsonl, weight: 1}", r"'nowhere.jsonl' is neither a known corpus"),
        ("{source: broken.jsonl, weight: 1}", r"broken.jsonl is not valid UTF-8: byte 51"),
    ],
)
def test_a_bad_mixture_is_one_clear_error_and_writes_nothing(workdir, entry, message):
    (workdir / "docs.jsonl").write_text(json.dumps({"text": "a document\n" * 50}) + "\n")
    # a record whose text holds a byte that is not UTF-8 (byte 51 of the file)
    (workdir / "broken.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "fine too"}\n{"text": "caf\xe9"}\n')
    mixture = f"corpus=[{{source: tinyshakespeare, weight: 1}}, {entry}]"
    with pytest.raises(config.UserError, match=message):
        prepare_data.main(["--output", "out", mixture, "instructions=none", "graphs=[]"])
    assert_nothing_written(workdir, "out")


@pytest.mark.parametrize("splits", [("train", "validation", "test"), ("train",)])
def test_a_hub_corpus_streams_row_by_row(workdir, monkeypatch, splits):
    """`hub:<id>` through the datasets library's streaming mode, here on a local dataset folder (read
    offline like a hub repository): its own splits, or its train split cut by position."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = workdir / "local_dataset"
    folder.mkdir()
    for split in splits:
        rows = [{"text": f"{split} document {i}\nits second line\n", "id": i} for i in range(40)] + [
            {"text": " ", "id": -1}
        ]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare_data.main(["--output", "out", f"corpus=hub:{folder}", "instructions=none", "graphs=[]"])
    counts = [meta["corpus"]["splits"][s]["documents"] for s in ("train", "val", "test")]
    val = (workdir / "out/corpus/val.txt").read_text()
    if len(splits) == 3:
        assert counts == [40, 40, 40] and val.startswith("validation document 0\nits second line\n")
    else:  # 40 documents (the blank one skipped): 90% / 5% / 5% by position, as for a .jsonl file
        assert counts == [36, 2, 2] and val.startswith("train document 36\n")
    with pytest.raises(prepare_data.DataError, match="has no text column 'body'; set prepare_data.text_field"):
        prepare_data.main(
            ["--output", "out2", f"corpus=hub:{folder}", "text_field=body", "instructions=none", "graphs=[]"]
        )
    assert_nothing_written(workdir, "out2")
