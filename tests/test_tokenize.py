"""tokenize on real text: identical output for 1 and 2 processes, loads in transformers, counts, MLflow."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, TRACKED, run_stage, stage_env

from stages import tokenize
from stages.common import config, shards

ARGS = ["--input", "data/prepare_data", "--output"]


@pytest.fixture(scope="module")
def by_world_size(prepared, tmp_path_factory):
    """The ci corpus tokenized by 1 process and by 2 (torchrun, gloo), each with its own MLflow store."""
    runs = {}
    for nproc in (1, 2):
        root = tmp_path_factory.mktemp(f"tok{nproc}")
        shutil.copy(prepared / "params.yaml", root / "params.yaml")
        shutil.copytree(prepared / "data/prepare_data", root / "data/prepare_data")
        run_stage("tokenize", [*ARGS, "data/tokenize"], cwd=root, nproc=nproc, **TRACKED)
        runs[nproc] = root
    return runs


def test_two_processes_write_the_same_bytes_as_one(by_world_size):
    one, two = (by_world_size[n] / "data/tokenize" for n in (1, 2))
    names = sorted(p.relative_to(one).as_posix() for p in one.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(two).as_posix() for p in two.rglob("*") if p.is_file())
    # every file, figures too: the timings and the chunk counts are measured beside the output
    differing = [n for n in names if not filecmp.cmp(one / n, two / n, shallow=False)]
    assert not differing, f"differ between world sizes: {differing}"
    measured = {n: json.loads((by_world_size[n] / "data/tokenize.measured.json").read_text()) for n in (1, 2)}
    assert measured[2]["tokens_per_s"] > 0 and measured[2]["chunks"] >= 2 and measured[1]["resumed_chunks"] == 0
    assert len(json.loads((one / "meta.json").read_text())["splits"]["train"]["shards"]) > 1


def test_output_loads_in_transformers_and_decodes_to_the_text(by_world_size):
    from transformers import AutoTokenizer

    root = by_world_size[2]
    out = root / "data/tokenize"
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    meta = shards.read_meta(out)
    assert len(tok) == meta["vocab_size"] == 512 and meta["dtype"] == "uint16"
    assert tok.eos_token_id == meta["eos_token_id"] and tok.pad_token_id == meta["pad_token_id"] != tok.eos_token_id
    for split, counts in meta["splits"].items():
        ids = shards.load_split(out, split)
        text = (root / f"data/prepare_data/corpus/{split}.txt").read_text()
        assert counts["tokens"] == len(ids) and (ids == meta["eos_token_id"]).sum() == counts["documents"] == 1
        assert ids[-1] == meta["eos_token_id"] and meta["pad_token_id"] not in ids
        assert tok.decode(ids[:-1].tolist()) == text
        assert counts["bytes"] == len(text.encode()) and counts["words"] == len(text.split())
        assert all(len(m) <= meta["shard_tokens"] for m in shards.open_split(out, split))


def test_mlflow_has_one_run_per_stage_from_rank_zero(by_world_size):
    import mlflow

    root = by_world_size[2]
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipeline")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development", "the UI opens on training runs"
    runs = client.search_runs([experiment.experiment_id])
    assert [r.data.tags["stage"] for r in runs] == ["tokenize"], "one run, logged by rank 0 only"
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    assert len(run.data.tags["inputs_hash"]) == 64 and run.data.tags["git_commit"]
    assert run.data.params["vocab_size"] == "512" and run.data.metrics["tokens_per_s"] > 0
    assert run.data.metrics["train_tokens"] == shards.read_meta(root / "data/tokenize")["splits"]["train"]["tokens"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"meta.json", "tokenizer", "environment"} <= artifacts
    tok_files = {a.path for a in client.list_artifacts(run.info.run_id, "tokenizer")}
    assert "tokenizer/tokenizer.json" in tok_files
    freeze = client.download_artifacts(run.info.run_id, "environment/requirements.txt", str(root))
    assert "torch==2.13.0" in open(freeze).read()


def test_bad_input_fails_before_writing(prepared, tmp_path):
    shutil.copy(prepared / "params.yaml", tmp_path / "params.yaml")
    proc = run_stage(
        "tokenize",
        ["--input", str(prepared / "data/prepare_data"), "--output", "out", "vocab_size=200"],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2 and "tokenize.vocab_size must be at least 258" in proc.stderr
    proc = run_stage("tokenize", ["--input", "nowhere", "--output", "out"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "nowhere/corpus/train.txt not found; run prepare_data first" in proc.stderr
    assert not list(tmp_path.glob("*out*")) and not (tmp_path / "mlflow.db").exists()


PROSE = b"Now is the winter of our discontent made glorious summer by this sun of York;\n" * 64  # (5 kB)


def corpus(root, **splits: bytes):
    """prepare_data's output in root: each split one document of PROSE, or the bytes given."""
    folder = root / "corpus"
    folder.mkdir(parents=True)
    for split in tokenize.SPLITS:
        text = splits.get(split, PROSE)
        (folder / f"{split}.txt").write_bytes(text)
        np.save(folder / f"{split}.docs.npy", np.zeros(1 if text else 0, np.int64))
    return root


@pytest.mark.parametrize(
    "splits, override, message",
    [
        ({"train": b""}, [], "train.txt holds 0 bytes of text, the tokenizer needs at least 508 to learn "),
        (
            {"train": PROSE[:500]},
            [],
            "train.txt holds 500 bytes of text, the tokenizer needs at least 508 to learn tokenize.vocab_size 512 "
            "((vocab_size - 258) x min_frequency 2); give prepare_data more text",
        ),
        ({}, ["train_max_bytes=400"], "tokenize.train_max_bytes 400 trains on fewer bytes of "),
        ({"val": b""}, [], "val.txt holds 0 bytes of text, fewer than the 4,096 a val split needs"),
        ({"test": PROSE[:4000]}, [], "test.txt holds 4,000 bytes of text, fewer than the 4,096 a test split needs"),
        (
            {"train": PROSE + b"caf\xe9 au lait\n"},
            [],
            f"train.txt is not valid UTF-8 at byte {len(PROSE) + 3} (b'\\xe9'); re-encode it as UTF-8",
        ),
        ({"test": PROSE + b"\xe2\x82"}, [], f"test.txt is not valid UTF-8 at byte {len(PROSE)} (b'\\xe2')"),
    ],
    ids=["train-empty", "train-small", "train_max_bytes-small", "val-empty", "test-small", "latin1", "cut-character"],
)
def test_empty_small_or_undecodable_splits_fail_before_training(tmp_path, monkeypatch, splits, override, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path / "checkpoints"))
    params = tmp_path / "params.yaml"
    params.write_text(
        "tokenize: {vocab_size: 512, min_frequency: 2, train_max_bytes: 0, batch_lines: 64, shard_tokens: 4096}\n"
    )
    inp = corpus(tmp_path / "in", **splits)
    with pytest.raises(config.UserError, match=re.escape(message)):
        tokenize.main(["--params", str(params), "--input", str(inp), "--output", "out", *override])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "params.yaml"], "nothing written"


def test_utf8_check_names_the_byte_across_read_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize, "UTF8_BLOCK", 3)  # (characters cut by the blocks' borders)
    path = tmp_path / "text.txt"
    for text, where in [
        ("aé€😀b\n".encode(), None),
        (b"", None),
        ("a€".encode() + b"\xff", "byte 4 (b'\\xff')"),
        ("ab€".encode()[:-1], "byte 2 (b'\\xe2')"),  # (the file ends inside a character)
        (b"abc\xc3(", "byte 3 (b'\\xc3')"),
    ]:
        path.write_bytes(text)
        assert tokenize.utf8_error(path) == where, text


def test_a_truncated_tokenizer_file_is_one_error_in_the_stages_that_read_it(tmp_path, monkeypatch):
    """The tokenize output of a tiny corpus, its tokenizer.json then cut short: pretrain and eval_perplexity
    refuse it before any compute, naming the file and how to make it again."""
    from stages import eval_perplexity, pretrain

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path / "checkpoints"))
    params = tmp_path / "params.yaml"
    params.write_text(
        "tokenize: {vocab_size: 300, min_frequency: 2, train_max_bytes: 0, batch_lines: 64, shard_tokens: 4096}\n"
    )
    tokenize.main(["--params", str(params), "--input", str(corpus(tmp_path / "in")), "--output", "out"])
    assert pretrain.check_input(tmp_path / "out")["vocab_size"] == 300
    path = tmp_path / "out/tokenizer/tokenizer.json"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = (
        re.escape(f"{path} is not whole JSON (")
        + r".*\): the file is truncated or damaged; re-run tokenize \(dvc repro --force"
    )
    with pytest.raises(config.UserError, match=f"pretrain: {message}"):
        pretrain.check_input(tmp_path / "out")
    cfg = config.load(eval_perplexity.Config, "eval_perplexity", ROOT / "params.yaml", [])
    with pytest.raises(config.UserError, match=f"eval_perplexity: {message}"):
        eval_perplexity.shard_stream(tmp_path / "out", cfg)


def test_shard_writer_rolls_over_and_dtype_follows_vocab(tmp_path):
    writer = shards.ShardWriter(tmp_path, "train", shards.dtype_for(70_000), shard_tokens=4)
    writer.write(np.arange(6))
    writer.write(np.arange(6, 10))
    assert writer.close() == ["train_0000.bin", "train_0001.bin", "train_0002.bin"]
    assert shards.dtype_for(65_536) == np.uint16 and shards.dtype_for(65_537) == np.uint32
    parts = [np.fromfile(tmp_path / n, dtype=np.uint32).tolist() for n in writer.names]
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_run_stopped_mid_way_resumes_to_the_same_bytes(by_world_size, tmp_path, sig):
    """Two processes in small chunks, stopped (SIGTERM to torchrun, or SIGKILL to every process) after some
    chunks; two kept chunks are then damaged. One process finishes the job from the intact chunks kept,
    encoding the damaged ones again, with the bytes of an uninterrupted run."""
    shutil.copy(by_world_size[1] / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(by_world_size[1] / "data/prepare_data", tmp_path / "data/prepare_data")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "stages.tokenize"]
    env = stage_env(tmp_path, PIPELINE_TOKENIZE_CHUNK_BYTES="2048")
    # A chunk takes a millisecond or so: a run may finish them all between two looks, before the signal
    # lands. Then it is started again from nothing, until one is stopped mid-way.
    for attempt in range(1, 6):
        shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
        shutil.rmtree(tmp_path / "data/tokenize", ignore_errors=True)
        proc = subprocess.Popen([*cmd, *ARGS, "data/tokenize"], cwd=tmp_path, env=env, start_new_session=True)
        deadline = time.time() + 300
        while len(list(tmp_path.glob("checkpoints/tokenize/*/*-*.json"))) < 10 and proc.poll() is None:
            assert time.time() < deadline, "tokenize did not finish 10 chunks in 300 s"
            time.sleep(0.02)
        try:
            if sig == signal.SIGKILL:
                os.killpg(proc.pid, sig)  # every process at once, as when a node is lost
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass  # (it had ended)
        proc.wait(60)
        work = next(tmp_path.glob("checkpoints/tokenize/*/"), None)
        plan = json.loads((work / "plan.json").read_text()) if work else {}
        done, total = len(list(work.glob("*-*.json"))) if work else 0, sum(len(c) for c in plan.values())
        if work and not (tmp_path / "data/tokenize").exists() and 10 <= done < total:
            break
        print(f"attempt {attempt}: {done} of {total} chunks finished when the signal came; starting again")
    assert not (tmp_path / "data/tokenize").exists() and 10 <= done < total
    # Two finished chunks damaged while the stage was down: one with bytes appended, one with a byte changed.
    appended, changed = (p.with_suffix(".ids") for p in sorted(work.glob("*-*.json"))[:2])
    with open(appended, "ab") as fh:
        fh.write(b"\0" * 8)
    flipped = bytearray(changed.read_bytes())
    flipped[0] ^= 0xFF
    changed.write_bytes(bytes(flipped))

    out = run_stage("tokenize", [*ARGS, "data/tokenize"], cwd=tmp_path).stdout
    where = work.relative_to(tmp_path)  # (the stage names its work folder as it was given)
    assert f"encoding chunk {appended.stem} of {where} again: {appended.name} holds" in out, out
    assert f"encoding chunk {changed.stem} of {where} again: {changed.name} differs from its record" in out, out
    done -= 2
    assert re.search(rf"resuming, {done} of \d+ chunks already encoded", out), out
    one, again = by_world_size[1] / "data/tokenize", tmp_path / "data/tokenize"
    names = sorted(p.relative_to(one).as_posix() for p in one.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(again).as_posix() for p in again.rglob("*") if p.is_file())
    assert all(filecmp.cmp(one / n, again / n, shallow=False) for n in names), "the same bytes as one run"
    assert json.loads((tmp_path / "data/tokenize.measured.json").read_text())["resumed_chunks"] == done
    assert not work.exists(), "the published run's work folder is spent"
