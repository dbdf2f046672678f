"""On a copy of the shared ci run (tests/shared_run.py): a forced re-run of an unchanged stage, which must
reproduce the hashes of its outs. tests/test_e2e.py checks that both tools agree on what is current, and
runs a DVC experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from shared_run import copy_of_run, sh
from test_e2e import FULL, dvc_ran, mlflow_groups

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def clone(tmp_path_factory, mirror) -> Path:
    return copy_of_run(tmp_path_factory.mktemp("reproduce") / "clone")


@pytest.mark.timeout(1800)
def test_a_forced_rerun_of_an_unchanged_stage_reproduces_every_out(clone):
    # A re-run of an unchanged stage reproduces its out's hash: only what it measured (an out DVC does
    # not cache) changes, so only the report, which reads that, is re-run after it, and the report's own
    # out is again the same bytes. `dvc exp show` then marks nothing as changed ("!").
    sh("git add -A && git -c user.name=ci -c user.email=ci@localhost commit -qm run", clone)
    before = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    assert dvc_ran(sh("dvc repro -f -s tokenize", clone)) == {"tokenize"}
    assert dvc_ran(sh("dvc repro", clone)) == {"report"}
    after = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    changed = {
        o["path"]
        for name, entry in after.items()
        for o, old in zip(entry["outs"], before[name]["outs"], strict=True)
        if o["md5"] != old["md5"]
    }
    assert changed == {"measured/tokenize.json", "measured/report.json"}, changed
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)
    assert "!" not in sh("dvc exp show --csv", clone)

    # One MLflow group per invocation that ran stages: the shared run's, then the forced tokenize and the
    # report after it.
    groups = mlflow_groups(clone)
    assert sorted(map(str, groups.values())) == sorted(map(str, [FULL, ["tokenize"], ["report"]]))
    assert sum(k.startswith("smk-") for k in groups) == 1 and sum(k.startswith("dvc-") for k in groups) == 2
