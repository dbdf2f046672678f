"""pipelines.crate on the shared ci run (tests/shared_run.py): the run's Workflow Run RO-Crate is valid at
the REQUIRED level of the Provenance Run Crate profile, checked offline by rocrate-validator from its own
hash-locked venv; it reads back with the `rocrate` library, one action per stage run; the same run gives
the same bytes; `pipelines.verify --against` it finds every out of the run identical, and in a copy whose
params.yaml changed since the run (no re-run) names the changed value."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from shared_run import copy_of_run, env_for, shared_run

from pipelines.dag import load_table

pytestmark = pytest.mark.e2e


def run(args: list[str], root: Path) -> subprocess.CompletedProcess:
    """A command of this checkout's code (cwd: the worktree, so the validator's venv is kept in its .cache)
    about the run in `root`."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env_for(ROOT), capture_output=True, text=True)


def types(entity) -> list[str]:
    """An entity's @type as a list (rocrate gives a single type as a string)."""
    return entity.type if isinstance(entity.type, list) else [entity.type]


def pypi_unreachable() -> str | None:
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError as e:
        return f"PyPI is unreachable ({e}): the validator's venv cannot be installed"
    return None


@pytest.fixture(scope="module")
def crate(tmp_path_factory, mirror) -> Path:
    out = tmp_path_factory.mktemp("crate") / "run.crate.zip"
    proc = run(["-m", "pipelines.crate", "--root", str(shared_run()), "--out", str(out)], ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout.strip())
    return out


def test_the_crate_is_valid_offline_and_reads_back_with_one_action_per_stage_run(crate, tmp_path):
    proc = run(["-m", "pipelines.crate", "check", str(crate)], ROOT)
    if proc.returncode == 2 and "could not install the validator" in proc.stderr + proc.stdout:
        reason = pypi_unreachable()
        if reason:
            pytest.skip(reason)
    print(proc.stdout.strip())
    assert proc.returncode == 0 and " valid: " in proc.stdout and "0 issue(s)" in proc.stdout, proc.stdout + proc.stderr

    from rocrate.rocrate import ROCrate

    read = ROCrate(str(crate))
    lock = yaml.safe_load((shared_run() / "dvc.lock").read_text())["stages"]
    table = load_table(shared_run() / "pipelines/stages.yaml")
    labels = [name for st in table.values() for name, _ in st.instances() if name in lock]
    kinds = {}
    for entity in read.get_entities():
        for kind in {"CreateAction", "ControlAction", "OrganizeAction"} & set(types(entity)):
            kinds.setdefault(kind, []).append(entity)
    counts = {kind: len(found) for kind, found in sorted(kinds.items())}
    print(f"actions: {sum(counts.values())} ({counts}) for {len(labels)} stage runs")
    assert counts == {"ControlAction": len(labels), "CreateAction": len(labels) + 1, "OrganizeAction": 1}
    assert read.mainEntity.id == "Snakefile" and "ComputationalWorkflow" in read.mainEntity.type
    for label in labels:
        action = read.get(f"#action/{label}")
        assert action.get("identifier") is not None, f"{label}: no MLflow run"
        found = action["result"] if isinstance(action["result"], list) else [action["result"]]
        results = {e["name"]: e["md5"] for e in found if {"File", "Dataset"} & set(types(e))}
        assert results == {o["path"]: o["md5"] for o in lock[label]["outs"]}, label
    again = tmp_path / "again.crate.zip"
    assert run(["-m", "pipelines.crate", "--root", str(shared_run()), "--out", str(again)], ROOT).returncode == 0
    assert again.read_bytes() == crate.read_bytes()


def test_verify_against_the_crate_finds_every_out_identical_and_names_a_changed_param(crate, tmp_path):
    proc = run(["-m", "pipelines.verify", "--root", str(shared_run()), "--against", str(crate)], ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outs = [line for line in proc.stdout.splitlines() if line.startswith(("identical", "within", "differs"))]
    assert outs and all(line.startswith("identical") for line in outs), outs
    assert "same machine" in proc.stdout and "params, code and environment: as in the crate" in proc.stdout

    copy = copy_of_run(tmp_path / "copy")
    before = yaml.safe_load((copy / "params.yaml").read_text())["context_study"]["unscaled_growth"]
    text, n = re.subn(r"(?m)^(  unscaled_growth: ).*$", rf"\g<1>{before * 2}", (copy / "params.yaml").read_text())
    assert n == 1
    (copy / "params.yaml").write_text(text)
    proc = run(["-m", "pipelines.verify", "--root", str(copy), "--against", str(crate)], ROOT)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    changed = [line for line in proc.stdout.splitlines() if line.startswith("differs")]
    assert changed == [
        f"{'differs':<29} params  stage context_study: context_study.unscaled_growth is {before!r} in the crate, "
        f"{before * 2!r} here"
    ], proc.stdout[-3000:]
