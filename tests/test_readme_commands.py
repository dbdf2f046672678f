"""The README's commands, as a user types them after `make run`: those marked `run` in
tests/readme_commands.py run as written in a copy of the shared ci run (tests/shared_run.py), and each
stage command passes `--check`. tests/test_readme.py checks every command without running it."""

from __future__ import annotations

import csv
import importlib
import io
import os
import re
import shlex

import pytest
import readme_commands
from conftest import MIRROR
from shared_run import copy_of_run, sh
from test_e2e import UP_TO_DATE, dvc_ran, snakemake_ran

from pipelines import dag

pytestmark = pytest.mark.e2e


def check(command: str) -> None:
    """A stage command with `--check`, as one process runs it (`torchrun ... -m` as `python -m`), in this
    process: the stage's main parses the command line and loads its params section, exactly as
    `python -m stages.<name> ... --check` does (with the shell's $VARIABLES expanded), without a new
    interpreter importing torch again."""
    argv = [os.path.expandvars(a) for a in shlex.split(re.sub(r"^torchrun --nproc-per-node \d+ ", "python ", command))]
    assert argv[:2] == ["python", "-m"] and argv[2].startswith("stages."), command
    with pytest.raises(SystemExit) as done:
        importlib.import_module(argv[2]).main([*argv[3:], "--check"])
    assert done.value.code == 0, f"`{command} --check` exited {done.value.code}"


@pytest.mark.timeout(900)
def test_readme_commands_run_as_written(tmp_path, mirror, monkeypatch):
    """In a copy of the shared ci run: the README's commands marked `run` run as written; its stage commands
    pass `--check` (their command line and params overrides, no compute); see tests/readme_commands.py."""
    clone = copy_of_run(tmp_path / "clone")
    # After `make run` a checkout holds .venv, made by make's first target: its stamp, so that the README's
    # make targets run their recipes in this environment (first on PATH) instead of installing a new one.
    (clone / ".venv").mkdir()
    (clone / ".venv/.installed").touch()
    monkeypatch.chdir(clone)  # (the stage commands' checks run in this process)
    monkeypatch.setenv("PIPELINE_DATA_MIRROR", str(MIRROR))
    # a text longer than the longest context evaluated
    (clone / "notes.txt").write_text((MIRROR / "tinyshakespeare/input.txt").read_text()[:60_000])
    params, dvc_yaml = (clone / "params.yaml").read_text(), (clone / "dvc.yaml").read_text()
    ran = []
    for command, (how, _) in readme_commands.HOW.items():
        if how == "check":
            check(command)
            ran.append(command)
        elif how == "run" and "pipelines.preset" not in command:
            out = sh(command, clone)
            if command.startswith(("dvc repro", "snakemake --cores")):
                assert not dvc_ran(out) and not snakemake_ran(out), f"`{command}` ran stages: {out[-3000:]}"
            ran.append(command)
    # The metrics-only view of `dvc exp show`: one column per headline metric, no params or hashes.
    recipe = sh("make --no-print-directory -n exp-show", clone).strip()
    header = next(csv.reader(io.StringIO(sh(recipe + " --csv", clone))))
    fixed = {"Experiment", "rev", "typ", "Created", "parent", "State", "Executor"}
    metrics = [c for c in header if c not in fixed]
    assert 0 < len(metrics) <= 50 and not [c for c in metrics if c.startswith(("pretrain.", "stages/"))], header
    kept = next(csv.reader(io.StringIO(sh(recipe + " --keep 'pretrain\\.train\\.lr$' --csv", clone))))
    assert "pretrain.train.lr" in kept
    # The eval example with an adapter wrote where it says; then the preset example, undone after.
    assert (clone / "data/eval_perplexity/compare/metrics.json").is_file()
    sh("rm -rf data/eval_perplexity/compare", clone)
    sh("python -m pipelines.preset llama3-8b-qlora", clone)
    assert "meta-llama/Meta-Llama-3-8B" in (clone / "params.yaml").read_text()
    stages = dag.parse_yaml((clone / "dvc.yaml").read_text())["stages"]  # (rewritten: the base stage, no pretrain)
    assert "base" in stages and "pretrain" not in stages
    ran.append("python -m pipelines.preset llama3-8b-qlora")
    (clone / "params.yaml").write_text(params)
    (clone / "dvc.yaml").write_text(dvc_yaml)
    assert UP_TO_DATE in sh("dvc status", clone)
    assert len(ran) == sum(how in ("run", "check") for how, _ in readme_commands.HOW.values())
