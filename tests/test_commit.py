"""pipelines.commit: a damaged dvc.lock is restored from its last good copy, a failed commit is loud."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipelines import commit

from conftest import ROOT

LOCK = "schema: '2.0'\nstages:\n  tokenize:\n    cmd: python -m pipelines.launch tokenize\n"


def test_damaged_lock_is_restored_from_the_last_good_copy(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert commit.repair() == "ok" and not commit.GOOD_COPY.exists(), "no dvc.lock yet: nothing to keep"
    (tmp_path / "dvc.lock").write_text(LOCK)
    assert commit.repair() == "ok" and commit.GOOD_COPY.read_text() == LOCK
    for damaged, why in (("", "it holds no stages"), (LOCK[:40], "the entry of stage tokenize is incomplete"), ("stages: [\n", "it does not parse"), ("- a\n", "not in DVC's lock format")):
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
    proc = subprocess.run([sys.executable, "-m", "pipelines.commit", "nosuchstage"], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "error: `dvc commit nosuchstage` failed" in proc.stderr and "nosuchstage" in proc.stderr.split("error:")[0] + proc.stderr
