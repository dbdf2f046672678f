"""On a copy of the shared ci run (tests/shared_run.py), with its dvc.lock and measured/ committed: each link
of `python -m pipelines.verify` broken, then mended by the commands verify printed for it, run as printed,
after which every link holds again. Together they run every mend verify prints but two: the one for an
out whose bytes differ from DVC's cache (`--rehash`: tests/test_e2e_remote.py runs it, it needs a remote)
and the one for a stage whose code does not import (an edit by hand: tests/test_e2e_records.py). The
scenarios run in order on one copy, each leaving it whole."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from shared_run import copy_of_run, env_for, sh

pytestmark = pytest.mark.e2e
GIT = "git -c user.name=ci -c user.email=ci@localhost"


@pytest.fixture(scope="module")
def clone(tmp_path_factory, mirror) -> Path:
    clone = copy_of_run(tmp_path_factory.mktemp("verify") / "clone")
    sh(f"git add -A && {GIT} commit -qm run", clone)  # (dvc.lock and measured/ are committed with a run)
    return clone


def verify(clone: Path) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.verify"], cwd=clone, env=env_for(clone), capture_output=True, text=True
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, proc.stdout


def broken(clone: Path) -> list[str]:
    """The BROKEN lines of verify, which must exit 1."""
    code, out = verify(clone)
    lines = [line for line in out.splitlines() if line.startswith("BROKEN")]
    assert code == 1 and lines, out
    return lines


def mend_of(line: str) -> str:
    """The command of a BROKEN line's mend: as printed, up to its first " (" (what it does, an alternative)."""
    return line.split("; mend: ", 1)[1].split(" (", 1)[0]


def mend(clone: Path, lines: list[str]) -> list[str]:
    """Run each mend of `lines` once, in the order printed; then every link holds. The commands run."""
    commands = list(dict.fromkeys(mend_of(line) for line in lines))
    for command in commands:
        sh(command, clone, timeout=1800)
    code, out = verify(clone)
    assert code == 0 and "every link holds" in out, f"after {commands}:\n{out}"
    return commands


def keeping_size_and_time(path: Path, edit) -> None:
    """Rewrite `path` as edit(text) (the same length), its time kept: what DVC's state records."""
    st = path.stat()
    text = path.read_text()
    changed = edit(text)
    assert changed != text and len(changed) == len(text)
    path.write_text(changed)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def other_ours(text: str, result: str | None = None) -> str:
    """`text` (a file of report rows, keys sorted) with the last digit of a row's `ours` changed: the row of
    `result`, or the first."""
    end = text.index(json.dumps(result)) if result else len(text)
    at = text.rindex('"ours":', 0, end) if result else text.index('"ours":')
    match = re.compile(r'"ours":\s*-?[\d.]*\d').match(text, at)
    assert match, result
    end = match.end() - 1
    return text[:end] + ("1" if text[end] != "1" else "2") + text[end + 1 :]


def test_report_rows_edited_with_size_and_time_kept_are_mended_by_relinking_and_rereading(clone):
    """A row of reports/results.json and a row of measured/report.json, edited
    without changing the files' size or time: `dvc status` passes them, so `dvc repro report` would do
    nothing. And the alias `reproduced` removed from pretrain, whose rows pass. verify names each, and its
    mends (the report relinked with the out the row came from, the report forced to read the measured
    files again and set the alias) make them whole."""
    import mlflow

    assert "Data and pipelines are up to date" in sh("dvc status", clone)  # (DVC records each file's hash)
    report = clone / "reports/results.json"
    row = json.loads(report.read_text())["rows"][0]
    keeping_size_and_time(report, lambda t: other_ours(t, row["result"]))
    assert json.loads(report.read_text())["rows"][0]["ours"] != row["ours"]
    measured = clone / "measured/report.json"
    measured_row = json.loads(measured.read_text())["rows"][0]
    keeping_size_and_time(measured, other_ours)
    assert "Data and pipelines are up to date" in sh("dvc status", clone)
    assert "didn't change, skipping" in sh("dvc repro report", clone)  # (the mend it is not)
    # and the alias that the report's passing rows give pretrain, removed from the registry
    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    client.delete_registered_model_alias("pretrain", "reproduced")

    lines = broken(clone)
    assert re.search(rf"^BROKEN +report +row '{re.escape(row['result'])}' shows", "\n".join(lines), re.M), lines
    assert any(f"row '{measured_row['result']}' of measured/report.json" in line for line in lines), lines
    assert any(line.startswith("BROKEN  registry    models:/pretrain (data/pretrain, stage pretrain) v1: no version")
               for line in lines), lines  # fmt: skip
    commands = mend(clone, lines)
    assert commands == [f"dvc checkout --relink reports data/{row['stage']}", "dvc repro -f -s report"]


def test_outs_changed_or_missing_are_mended_by_checking_them_out(clone):
    """The report deleted, a model's out and a measured file changed: each restored as recorded."""
    (clone / "reports/results.json").unlink()
    with open(clone / "data/train_gnn/results.json", "a") as fh:
        fh.write("\n")
    with open(clone / "measured/pretrain.json", "a") as fh:
        fh.write("\n")
    lines = broken(clone)
    assert mend(clone, lines) == [
        "dvc checkout --relink reports",
        "dvc checkout --force data/train_gnn",
        "git checkout measured/pretrain.json",
        "dvc checkout --force reports",
        "dvc repro",  # (the report's inputs changed: the outs checked out before it, it has nothing to do)
    ], lines


def test_a_changed_param_is_mended_by_dvc_repro(clone):
    params = clone / "params.yaml"
    params.write_text(params.read_text().replace("regression_tolerance: 0.02 ", "regression_tolerance: 0.025"))
    (line,) = broken(clone)
    assert re.match(r"BROKEN +causes +stage report: changed since dvc\.lock: params\.yaml", line), line
    assert mend(clone, [line]) == ["dvc repro"]


def test_damaged_records_of_dvc_and_a_damaged_checkpoint_are_mended(clone):
    """dvc.lock unreadable, dvc.yaml unreadable (dvc status fails), a checkpoint without its manifest."""
    sh(f"git add -A && {GIT} commit -qm 'the run as it stands'", clone)  # (dvc.lock's committed record)
    lock = clone / "dvc.lock"
    lock.write_text(lock.read_text() + "\n: [\n")
    (line,) = broken(clone)
    assert "dvc.lock is unreadable" in line and mend(clone, [line]) == ["git checkout dvc.lock"]

    with open(clone / "dvc.yaml", "a") as fh:
        fh.write("garbage: [\n")
    (line,) = broken(clone)
    assert "dvc status fails: './dvc.yaml' is invalid" in line, line
    assert mend(clone, [line]) == ["python -m pipelines.dag write"]

    step = clone / "checkpoints/pretrain/0123abcd/step-00000002"
    step.mkdir(parents=True)
    (step / "extra.pt").write_bytes(b"cut short")
    (line,) = broken(clone)
    assert line.startswith(f"BROKEN  checkpoints {step.relative_to(clone)}: "), line
    assert mend(clone, [line]) == [f"rm -r {step.relative_to(clone)}"]


def test_registered_versions_deleted_or_beside_a_stray_one_are_broken_and_registered_again(clone):
    """Versions deleted from the registry (one of a stage's several models, a whole registered model, the
    version with the alias) are each named, as is a recorded version whose params no longer match while a
    newer version registered from another folder stands beside it; the mends (each stage forced to run
    again, which registers its models from the same out, and the report, which sets the alias) make every
    link hold."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    (yarn,) = client.search_model_versions("name = 'extend_context-yarn'")
    client.delete_model_version("extend_context-yarn", yarn.version)
    client.delete_registered_model("finetune_qlora-nf4")
    (pretrain,) = client.search_model_versions("name = 'pretrain'")
    assert client.get_registered_model("pretrain").aliases == {"reproduced": pretrain.version}
    client.delete_model_version("pretrain", pretrain.version)
    (linear,) = client.search_model_versions("name = 'extend_context-linear'")
    client.set_model_version_tag("extend_context-linear", linear.version, "params_sha256", "0" * 64)
    stray = {**linear.tags, "output": "elsewhere/extend_context", "output_dvc_md5": "1" * 32 + ".dir"}
    # (a version made from a logged model's `models:/<id>` source: MLflow's SQLite registry looks the model up
    # through the process's tracking URI, not the client's; as stages.common.tracking.models does)
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(client.tracking_uri):
        client.create_model_version("extend_context-linear", linear.source, linear.run_id, tags=stray)

    lines = broken(clone)
    assert len(lines) == 4, lines
    where = {
        "extend_context-yarn": "(data/extend_context, stage extend_context): has no versions",
        "finetune_qlora-nf4": "(data/finetune_qlora/nf4, stage finetune_qlora@nf4): not in the registry",
        "pretrain": "(data/pretrain, stage pretrain): has no versions",
        "extend_context-linear": f"(data/extend_context, stage extend_context) v{linear.version}: params_sha256 000",
    }
    for name, what in where.items():
        assert any(line.startswith(f"BROKEN  registry    models:/{name} {what}") for line in lines), (name, lines)
    commands = mend(clone, lines)
    assert "dvc repro -f -s pretrain && dvc repro -f -s report" in commands, commands
    assert len(commands) == 3, commands
