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
    # Planetoid raw files are byte copies of the mirror's; instructions keep the first records.
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
