"""pipelines.commit: a damaged dvc.lock is restored from its last good copy, a failed commit is loud."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

from pipelines import commit

LOCK = """schema: '2.0'
stages:
  tokenize:
    cmd: python -m pipelines.launch tokenize --input data/prepare_data --output data/tokenize
    deps:
    - path: data/prepare_data
      hash: md5
      md5: 0123456789abcdef0123456789abcdef.dir
      size: 1000
      nfiles: 4
    params:
      params.yaml:
        tokenize:
          vocab_size: 512
    outs:
    - path: data/tokenize
      hash: md5
      md5: 1123456789abcdef0123456789abcdef.dir
      size: 2000
      nfiles: 5
  pretrain:
    cmd: python -m pipelines.launch pretrain --input data/tokenize --output data/pretrain
    deps:
    - path: data/tokenize
      hash: md5
      md5: 1123456789abcdef0123456789abcdef.dir
      size: 2000
      nfiles: 5
    outs:
    - path: data/pretrain/meta.json
      hash: md5
      md5: 2123456789abcdef0123456789abcdef
      size: 300
"""


def test_damaged_lock_is_restored_from_the_last_good_copy(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert commit.repair() == "ok" and not commit.GOOD_COPY.exists(), "no dvc.lock yet: nothing to keep"
    (tmp_path / "dvc.lock").write_text(LOCK)
    assert commit.repair() == "ok" and commit.GOOD_COPY.read_text() == LOCK
    for damaged, why in (
        ("", "it holds no stages"),
        (LOCK[:120], "the entry of stage tokenize is incomplete"),
        ("stages: [\n", "it does not parse"),
        ("- a\n", "not in DVC's lock format"),
    ):
        (tmp_path / "dvc.lock").write_text(damaged)
        assert why in commit.lock_problem()
        assert commit.repair() == "restored" and (tmp_path / "dvc.lock").read_text() == LOCK
        assert (tmp_path / "dvc.lock.damaged").read_text() == damaged
        assert "dvc.lock was damaged" in capsys.readouterr().err
    commit.GOOD_COPY.unlink()
    (tmp_path / "dvc.lock").write_text("")
    with pytest.raises(SystemExit, match="no good copy .*git checkout dvc.lock"):
        commit.repair()


def test_a_failed_commit_fails_the_rule_with_dvcs_error(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.commit", "nosuchstage"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    assert (
        "error: `dvc commit nosuchstage` failed" in proc.stderr
        and "nosuchstage" in proc.stderr.split("error:")[0] + proc.stderr
    )


def test_every_cut_of_a_lock_file_is_caught(tmp_path):
    """DVC rewrites dvc.lock in place: a kill leaves a prefix of it, which mostly still parses as YAML.
    Every prefix cut at a line end (what a write of whole lines leaves) is told from the whole file."""
    good = tmp_path / "good.lock"
    good.write_text(LOCK)
    assert commit.lock_problem(good) is None
    lines = LOCK.splitlines(keepends=True)
    cut = tmp_path / "dvc.lock"
    for n in range(len(lines)):
        cut.write_text("".join(lines[:n]))
        assert commit.lock_problem(cut) or commit.lost_stages(cut, good), f"a cut after line {n} passes"
