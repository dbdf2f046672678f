"""Unsent files (logs/mlflow-unsent/<run id>.jsonl, stages/common/tracking/journal.py) are replayed by another
process: the next stage that starts, or `python -m stages.common.tracking.journal resend`. Replayed are only
the lines a stage of this workspace signed for the run the file is named after, and a replayed record
uploads files from inside the workspace's outputs (data/, measured/, reports/) only, links followed.
Everything else is one line naming the file and why, nothing uploaded. On a local SQLite store, in this process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stages.common import digest
from stages.common.tracking import journal
from stages.common.tracking.sender import Sender
from stages.common.tracking.store import experiment, tracking_uri


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A workspace with its SQLite store and its files' key, made once (making a store takes seconds)."""
    root = tmp_path_factory.mktemp("ws")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        client, experiment_id = experiment(root)
    journal.journal_key(root)
    return root, client, experiment_id


@pytest.fixture
def workspace(store, monkeypatch):
    """(root, client, run id): the workspace, in it, with a new open run."""
    root, client, experiment_id = store
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.delenv("PIPELINE_RUN_ID", raising=False)
    yield root, client, client.create_run(experiment_id).info.run_id
    assert not list((root / journal.UNSENT).glob("*")), "a test leaves no unsent file to the next"


def header(run_id: str, root: Path) -> dict:
    return {"kind": "header", "run_id": run_id, "uri": tracking_uri(root), "root": str(root), "stage": "probe"}


def write_journal(root: Path, name: str, records: list[dict], seal: journal.Seal | None = None) -> Path:
    """An unsent file `name`.jsonl under root's logs, its lines signed by `seal` (or not signed at all)."""
    path = root / journal.UNSENT / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [seal.line(r) if seal else (json.dumps(r) + "\n").encode() for r in records]
    path.write_bytes(b"".join(lines))
    return path


def uploaded(client, run_id: str) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id)}


def test_a_file_a_stage_of_this_workspace_did_not_write_uploads_nothing(workspace, tmp_path, capsys):
    root, client, run_id = workspace
    seal = journal.Seal(journal.journal_key(root), run_id, root)
    steal = {"kind": "artifact", "path": "/etc/hostname", "artifact_path": None}
    end = {"kind": "end", "status": "FINISHED", "time": 1}
    # A copy of this workspace (its key too) elsewhere: its files are signed for that root.
    elsewhere = tmp_path / "copy"
    forged = {
        "written by hand": ([header(run_id, root), steal, end], None, run_id),
        "a line added to a signed file": ([header(run_id, root), end], seal, run_id),
        "a signed file under another run's name": ([header(run_id, root), end], seal, "0" * 32),
        "lines that are not records": ([[], "header", steal], None, run_id),
        "another workspace's file": (
            [header(run_id, elsewhere), steal, end],
            journal.Seal(journal.journal_key(root), run_id, elsewhere),
            run_id,
        ),
    }
    for what, (records, signer, name) in forged.items():
        path = write_journal(root, name, records, signer)
        if what == "a line added to a signed file":
            with open(path, "ab") as fh:
                fh.write((json.dumps(steal) + "\n").encode())
        journal.leftover_files(root, tracking_uri(root))  # (reads its first line)
        with pytest.raises(journal.JournalRefused, match=f"^{path} not sent: .*; see who wrote it") as refused:
            journal.resend(path)
        print(f"{what}: {refused.value}")
        assert path.exists(), what
        path.unlink()

    # The start of the next stage replays leftovers: one line each, nothing uploaded, the run left open.
    path = write_journal(root, run_id, [header(run_id, root), steal, end])
    capsys.readouterr()
    assert journal.leftover_files(root, tracking_uri(root)) == [path]
    other = client.create_run(client.get_run(run_id).info.experiment_id).info.run_id
    sender = Sender(client, other, tracking_uri(root), root, {}, [path])
    assert sender.close(30)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"tracking: {path} not sent: record 1 is not signed by this workspace's stages "
        f"({journal.KEY_FILE}); see who wrote it into {journal.UNSENT}/, then remove it"
    ], lines
    # ... and so does the resend command
    with pytest.raises(SystemExit):
        journal.main(["resend"])
    assert f"error: {path} not sent" in capsys.readouterr().err
    assert uploaded(client, run_id) == set() and client.get_run(run_id).info.status == "RUNNING"
    path.unlink()


def test_replayed_records_upload_from_the_workspace_outputs_only(workspace, tmp_path, capsys):
    root, client, run_id = workspace
    seal = journal.Seal(journal.journal_key(root), run_id, root)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_text("not an output")
    (root / "data/stage/model").mkdir(parents=True)
    (root / "data/stage/model/weights.bin").write_bytes(b"\0" * 8)
    (root / "measured").mkdir()
    (root / "measured/stage.json").write_text("{}")
    (root / "data/stage/link.txt").symlink_to(secret / "key.txt")
    (root / "data/stage/folder").mkdir()
    (root / "data/stage/folder/inside.txt").symlink_to(secret / "key.txt")
    (root / "data/stage/linked").symlink_to(secret)

    def artifact(path: str, artifact_path: str | None = None) -> dict:
        return {"kind": "artifact", "path": str(root / path), "artifact_path": artifact_path}

    refused = ["data/../../secret/key.txt", "data/stage/link.txt", "data/stage/folder", "data/stage/linked"]
    records = [header(run_id, root), {"kind": "metrics", "values": {"loss": 1.5}, "step": 1, "time": 1}]
    records += [artifact("measured/stage.json"), artifact("data/stage/model", "model"), *map(artifact, refused)]
    content = digest.hash_files([secret])
    records.append(
        {"kind": "register", "name": "stolen", "folder": str(secret), "tags": {}, "description": "", "content": content}
    )
    records.append({"kind": "end", "status": "FINISHED", "time": 2})
    path = write_journal(root, run_id, records, seal)
    capsys.readouterr()
    assert journal.resend(path) == len(records) - 1 and not path.exists()
    said = [line for line in capsys.readouterr().err.splitlines() if "not sent" in line]
    assert len(said) == len(refused) + 1, said
    assert all(line.startswith(f"tracking: {path}: a record of kind ") for line in said), said
    assert all("lies outside the workspace's outputs (data/, measured/, reports/ of " in line for line in said)
    assert uploaded(client, run_id) == {"stage.json", "model"}
    run = client.get_run(run_id)
    assert run.data.metrics == {"loss": 1.5} and run.info.status == "FINISHED"
    assert client.search_registered_models() == []


def test_a_line_another_writer_adds_to_a_live_file_is_not_sent(workspace, capsys):
    """The stage's own sender reads its records back from its file: a line appended by someone else is
    passed over, named; the stage's own records go out."""
    root, client, run_id = workspace
    sender = Sender(client, run_id, tracking_uri(root), root, {})
    with open(sender.path, "ab") as fh:
        fh.write((json.dumps({"kind": "artifact", "path": "/etc/hostname", "artifact_path": None}) + "\n").encode())
    sender.put({"kind": "metrics", "values": {"loss": 2.0}, "step": 1, "time": 1})
    assert sender.close(30)
    assert "not written by this run; passed over" in capsys.readouterr().err
    assert uploaded(client, run_id) == set() and client.get_run(run_id).data.metrics == {"loss": 2.0}


def test_the_key_is_made_once_and_kept_from_other_users(tmp_path):
    key = journal.journal_key(tmp_path)
    assert len(key) == 32 and journal.journal_key(tmp_path) == key
    assert os.stat(tmp_path / journal.KEY_FILE).st_mode & 0o777 == 0o600
    assert journal.journal_key(tmp_path / "none", make=False) is None
