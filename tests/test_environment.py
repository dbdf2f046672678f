"""The packages a stage runs on against those its family records (stages/common/environment.py): the
check every stage makes before any compute, the opt-out and what its records then say, and what
`python -m pipelines.verify` reports. In-process, with the installed versions faked."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines import verify
from stages import prepare_data
from stages.common import config, environment, stage
from stages.common.tracking import runs

ROOT = Path(__file__).resolve().parent.parent
GNN = "pipelines/packages/gnn.txt"
LM = "pipelines/packages/lm.txt"


def install(monkeypatch, **versions) -> None:
    """Fake the installed packages: every version the family files record, but for `versions`
    (name with underscores for dashes: a version, or None for not installed)."""
    have = {}
    for name in (GNN, LM):
        have |= {environment.normalized(n): v for n, v in environment.recorded(ROOT / name).items()}
    for name, version in versions.items():
        have[environment.normalized(name)] = version
    monkeypatch.setattr(environment, "installed", lambda: {k: v for k, v in have.items() if v is not None})


@pytest.fixture(autouse=True)
def by_hand(monkeypatch):
    """A stage started by hand, with the default choice."""
    for key in ("PIPELINE_ENVIRONMENT", "DVC_ROOT", "PIPELINE_SNAKEMAKE"):
        monkeypatch.delenv(key, raising=False)


def test_a_stage_on_other_versions_than_its_family_records_stops_before_any_compute(monkeypatch):
    install(monkeypatch, torch_geometric="2.8.0.post1", xxhash=None)
    ran = []
    with pytest.raises(config.UserError) as refused:
        stage.launch("train_gnn", lambda rt, stop: ran.append(rt))
    line = str(refused.value)
    assert not ran
    assert "\n" not in line
    assert "torch-geometric 2.8.1 recorded, 2.8.0.post1 installed; xxhash 4.1.0 recorded, not installed" in line
    assert GNN in line and "`make venv`" in line and "PIPELINE_ENVIRONMENT=any" in line
    # Another family's packages are not this stage's; a local label (torch's +cpu) is the pinned version.
    install(monkeypatch, torch_geometric="2.8.0.post1")
    environment.check("tokenize")
    install(monkeypatch, torch="2.13.0+cpu")
    environment.check("train_gnn")
    install(monkeypatch, torch="2.12.0")
    with pytest.raises(config.UserError, match="torch 2.13.0 recorded, 2.12.0 installed"):
        environment.check("pretrain")
    monkeypatch.setenv("PIPELINE_ENVIRONMENT", "anything")
    with pytest.raises(config.UserError, match="PIPELINE_ENVIRONMENT=anything: unknown; valid: pinned, any"):
        environment.check("pretrain")


def test_a_run_that_opted_out_records_the_versions_it_ran_on(monkeypatch, capsys):
    # Without the opt-out, no record of it.
    install(monkeypatch)
    assert "environment" not in stage.record_tags("train_gnn")
    assert "environment" not in stage.code_record("pretrain")
    monkeypatch.setenv("PIPELINE_ENVIRONMENT", "any")
    install(monkeypatch, torch_geometric="2.8.0.post1")
    environment.check("train_gnn")
    assert "running on them, as PIPELINE_ENVIRONMENT=any asks" in capsys.readouterr().out
    tag = stage.record_tags("train_gnn")["environment"]
    assert tag == "PIPELINE_ENVIRONMENT=any: torch-geometric 2.8.1 recorded, 2.8.0.post1 installed"
    install(monkeypatch, torch="2.12.0")
    assert stage.code_record("pretrain")["environment"] == {
        "opted_out": "PIPELINE_ENVIRONMENT=any",
        "file": LM,
        "packages": {"torch": {"recorded": "2.13.0", "installed": "2.12.0"}},
    }
    # Opted out on the recorded versions: the run says so; the output is a pinned run's (its hash too).
    install(monkeypatch)
    assert (
        stage.record_tags("train_gnn")["environment"]
        == f"PIPELINE_ENVIRONMENT=any: the installed packages are those {GNN} records"
    )
    assert "environment" not in stage.code_record("pretrain")


def test_a_stage_that_opens_its_run_itself_tags_it_too(workdir, monkeypatch):
    """prepare_data, context_study and report open their MLflow runs without stage.tracked; the opt-out
    reaches them all the same (prepare_data, the cheapest, run here)."""
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    monkeypatch.setenv("PIPELINE_ENVIRONMENT", "any")
    install(monkeypatch, xxhash="4.0.0")
    opened, start_run = [], runs.start_run

    def recording(section, params, inputs_hash, rt, tags=None):
        opened.append(tags)
        return start_run(section, params, inputs_hash, rt, tags=tags)

    monkeypatch.setattr(runs, "start_run", recording)
    prepare_data.main(["--output", "out", "instructions=none", "graphs=[]"])
    assert opened == [{"environment": "PIPELINE_ENVIRONMENT=any: xxhash 4.1.0 recorded, 4.0.0 installed"}]


@pytest.mark.parametrize("tool", ["DVC_ROOT", "PIPELINE_SNAKEMAKE"])
def test_under_dvc_or_snakemake_the_opt_out_is_refused_as_dvc_lock_would_record_the_pinned_versions(monkeypatch, tool):
    monkeypatch.setenv("PIPELINE_ENVIRONMENT", "any")
    monkeypatch.setenv(tool, "/repo" if tool == "DVC_ROOT" else "1")
    install(monkeypatch, torch_geometric="2.8.0.post1")
    with pytest.raises(config.UserError) as refused:
        stage.launch("train_gnn", lambda rt, stop: pytest.fail("the stage ran"))
    line = str(refused.value)
    assert "torch-geometric 2.8.1 recorded, 2.8.0.post1 installed" in line
    assert f"dvc.lock records {GNN}" in line and "`make venv`" in line and "requirements.lock" in line
    install(monkeypatch)
    environment.check("train_gnn")  # the recorded versions: the opt-out changes nothing


def test_verify_notes_installed_packages_that_differ_from_the_family_files_of_dvc_lock(monkeypatch, capsys):
    lock = {
        "stages": {
            "train_gnn": {"deps": [{"path": GNN, "md5": "0" * 32}, {"path": "stages/train_gnn.py"}]},
            "pretrain": {"deps": [{"path": LM, "md5": "1" * 32}]},
            "tokenize": {"deps": [{"path": LM, "md5": "1" * 32}]},
        }
    }
    install(monkeypatch, torch_geometric="2.8.0.post1")
    r = verify.Report()
    verify.check_environment(ROOT, lock, r)
    lines = capsys.readouterr().out.splitlines()
    assert r.broken == 0
    assert lines == [
        f"note    environment the packages installed here differ from {GNN} (recorded for 1 stage(s) of dvc.lock: "
        f"train_gnn): torch-geometric 2.8.1 recorded, 2.8.0.post1 installed; a re-run of those stages here is "
        f"refused: `make venv` installs the recorded versions (in containers/gnn.sif the stages run on the "
        f"image's own)",
        f"ok      environment the packages installed here are those of {LM} (recorded for 2 stage(s) of dvc.lock: "
        f"pretrain, tokenize)",
    ]
