"""pipelines.verify --against on hand-made runs: a dvc.lock and the outs beside it, in tmp_path. The other
run's results are read from its own folder, never from this workspace; a lock file without its outs is
compared by its records only, and says so. (tests/test_e2e_records.py compares a whole ci run.)"""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines import verify
from stages.common import environment

OUT = "data/train_gnn"
MEASURED = "measured/train_gnn.json"


def make_run(folder, md5: str, accuracy: float | None) -> dict:
    """A run's folder: its dvc.lock (one stage, one out and one measured file) and, unless `accuracy` is None,
    the out's results.json row. Returns the lock."""
    lock = {
        "schema": "2.0",
        "stages": {"train_gnn": {"cmd": "python -m pipelines.launch train_gnn", "outs": [
            {"path": OUT, "md5": md5, "size": 1, "nfiles": 1},
            {"path": MEASURED, "md5": "c" * 32, "size": 1},
        ]}},
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dvc.lock").write_text(yaml.safe_dump(lock))
    if accuracy is not None:
        (folder / OUT).mkdir(parents=True)
        row = {"result": "GCN test accuracy on Cora (%)", "ours": accuracy, "tolerance": 0.6}
        (folder / OUT / "results.json").write_text(json.dumps([row]))
    return lock


@pytest.fixture
def run(tmp_path):
    root = tmp_path / "run"
    return root, make_run(root, "a" * 32 + ".dir", 81.8)


def test_a_lock_file_in_the_repository_is_compared_by_its_records_not_with_this_workspaces_outs(run, capsys):
    root, lock = run
    published = root / "published.lock"
    published.write_text((root / "dvc.lock").read_text().replace("a" * 32, "b" * 32))
    assert verify.compare(root, lock, published) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"by records only: {published} comes without its run's outs"), out
    assert out[1:] == [
        f"{'differs':<29} {OUT}",
        f"{'measured':<29} {MEASURED}",
        "0 identical, 0 within the recorded tolerance, 1 differs, 1 measured",
    ]


def test_a_lock_file_with_the_same_records_is_identical(run, capsys):
    root, lock = run
    published = root.parent / "published.lock"
    published.write_text((root / "dvc.lock").read_text())
    assert verify.compare(root, lock, published) == 0
    assert "1 identical, 0 within the recorded tolerance, 0 differs, 1 measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("accuracy", "verdict", "code"), [(81.5, "within the recorded tolerance", 0), (80.0, "differs", 1)]
)
def test_another_runs_folder_is_compared_within_the_tolerance_from_its_own_outs(
    run, tmp_path, capsys, accuracy, verdict, code
):
    root, lock = run
    other = tmp_path / "other"
    make_run(other, "b" * 32 + ".dir", accuracy)
    for against in (other, other / "dvc.lock"):
        assert verify.compare(root, lock, against) == code
        out = capsys.readouterr().out
        assert "by records only" not in out and f"{verdict:<29} {OUT}\n" in out, out


def test_another_runs_folder_without_the_out_differs_and_says_where(run, tmp_path, capsys):
    root, lock = run
    other = tmp_path / "other"
    make_run(other, "b" * 32 + ".dir", None)
    assert verify.compare(root, lock, other) == 1
    assert f"{'differs':<29} {OUT} (not in {other})\n" in capsys.readouterr().out


@pytest.mark.parametrize("against", [".", "dvc.lock"])
def test_this_runs_own_folder_or_lock_is_refused_with_one_line(run, capsys, against):
    root, _ = run
    with pytest.raises(SystemExit) as exit_:
        verify.main(["--root", str(root), "--against", str(root / against)])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "that is this run's own dvc.lock; give another run's folder (its dvc.lock and outs)" in error, error


def test_against_names_the_packages_and_the_image_that_differ_between_two_runs_records(run, tmp_path, capsys):
    root, lock = run
    other = tmp_path / "other"
    make_run(other, "b" * 32 + ".dir", 81.9)
    ours = {
        "lock_sha256": "1" * 64,
        "container_family": "gnn",
        "packages": {"torch": "2.13.0", "torch-geometric": "2.8.1"},
    }
    theirs = {**ours, "packages": {"torch": "2.13.0", "torch-geometric": "2.8.0"}}
    theirs["image"] = {"runtime": "podman", "name": "localhost/pipeline-gnn", "id": "9" * 64}
    for folder, record in ((root, ours), (other, theirs)):
        record["packages_sha256"] = environment.packages_sha256(record["packages"])
        (folder / OUT / "meta.json").write_text(json.dumps({"environment": record}))
    assert verify.compare(root, lock, other) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{'within the recorded tolerance':<29} {OUT}",
        f"{'environment differs':<29} {OUT}: torch-geometric 2.8.1 here, 2.8.0 there; image none here, podman "
        "localhost/pipeline-gnn 999999999999 there",
        f"{'measured':<29} {MEASURED}",
        "0 identical, 1 within the recorded tolerance, 0 differs, 1 measured",
    ]
    # The same environment on both sides: no line for it.
    (other / OUT / "meta.json").write_text(json.dumps({"environment": ours}))
    verify.compare(root, lock, other)
    assert "environment" not in capsys.readouterr().out
