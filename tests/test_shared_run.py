"""The shared ci run's key (tests/shared_run.py): anything its outputs follow from changes it, so a stale
run is never read; and a copy's MLflow store points at the copy."""

from __future__ import annotations

import sqlite3
import subprocess

import pytest
import shared_run


@pytest.fixture
def tree(tmp_path):
    root, mirror = tmp_path / "tree", tmp_path / "mirror"
    (root / "stages").mkdir(parents=True)
    (root / "stages/pretrain.py").write_text("steps = 10\n")
    (root / ".gitignore").write_text("/.cache/\n")
    subprocess.run("git init -q && git add -A", shell=True, cwd=root, check=True)
    (mirror / "corpus").mkdir(parents=True)
    (mirror / "corpus/input.txt").write_text("to be or not to be\n")
    return root, mirror


def test_the_key_follows_the_tree_the_data_and_the_environment(tree, monkeypatch):
    root, mirror = tree
    monkeypatch.delenv("PIPELINE_TRACKING", raising=False)
    key = shared_run.tree_key(root, mirror)
    assert shared_run.tree_key(root, mirror) == key, "the same inputs, the same key"
    (root / ".cache").mkdir()
    (root / ".cache/run.log").write_text("ignored files are no input")
    assert shared_run.tree_key(root, mirror) == key

    changes = {
        "an edited tracked file": lambda: (root / "stages/pretrain.py").write_text("steps = 11\n"),
        "a new file not yet added": lambda: (root / "stages/new.py").write_text(""),
        "the data's bytes": lambda: (mirror / "corpus/input.txt").write_text("to be or not to be?\n"),
        "a PIPELINE_ setting": lambda: monkeypatch.setenv("PIPELINE_TRACKING", "off"),
    }
    seen = {key}
    for what, change in changes.items():
        change()
        new = shared_run.tree_key(root, mirror)
        assert new not in seen, f"{what} leaves the key as it was"
        seen.add(new)


def test_a_copy_of_the_store_points_at_the_copy(tmp_path):
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE runs (run_uuid VARCHAR(32), artifact_uri VARCHAR(200), step INTEGER)")
        con.execute("CREATE TABLE tags (key VARCHAR(250), value VARCHAR(8000))")
        con.execute("INSERT INTO runs VALUES ('r1', 'file:///cache/ci-run/k/run/mlartifacts/1/r1/artifacts', 3)")
        con.execute("INSERT INTO runs VALUES ('r2', 's3://bucket/run/r2', 4)")
        con.execute("INSERT INTO tags VALUES ('log', 'saved in /cache/ci-run/k/run/logs')")
    shared_run.relocate_store(db, "/cache/ci-run/k/run", "/tmp/e2e/clone")
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT artifact_uri, step FROM runs ORDER BY run_uuid").fetchall() == [
            ("file:///tmp/e2e/clone/mlartifacts/1/r1/artifacts", 3),
            ("s3://bucket/run/r2", 4),
        ]
        assert con.execute("SELECT value FROM tags").fetchone() == ("saved in /tmp/e2e/clone/logs",)
