"""The README's commands, as a user types them after `make run`: those marked `run` in
tests/readme_commands.py run as written in a copy of the shared ci run (tests/shared_run.py), and each
stage command passes `--check`. tests/test_readme.py checks every command without running it."""

from __future__ import annotations

import csv
import io
import re

import pytest
import readme_commands
from conftest import MIRROR
from shared_run import copy_of_run, sh
from test_e2e import UP_TO_DATE, dvc_ran, snakemake_ran

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(900)
def test_readme_commands_run_as_written(tmp_path, mirror):
    """In a copy of the shared ci run: the README's commands marked `run` run as written; its stage commands
    pass `--check` (their command line and params overrides, no compute); see tests/readme_commands.py."""
    clone = copy_of_run(tmp_path / "clone")
    # a text longer than the longest context evaluated
    (clone / "notes.txt").write_text((MIRROR / "tinyshakespeare/input.txt").read_text()[:60_000])
    params = (clone / "params.yaml").read_text()
    ran = []
    for command, (how, _) in readme_commands.HOW.items():
        if how == "check":
            sh(re.sub(r"^torchrun --nproc-per-node \d+ ", "python ", command) + " --check", clone)
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
    assert 0 < len(metrics) <= 40 and not [c for c in metrics if c.startswith(("pretrain.", "stages/"))], header
    kept = next(csv.reader(io.StringIO(sh(recipe + " --keep 'pretrain\\.train\\.lr$' --csv", clone))))
    assert "pretrain.train.lr" in kept
    # The eval example with an adapter wrote where it says; then the preset example, undone after.
    assert (clone / "data/eval_perplexity/compare/metrics.json").is_file()
    sh("rm -rf data/eval_perplexity/compare", clone)
    sh("python -m pipelines.preset llama3-8b-qlora", clone)
    assert "meta-llama/Meta-Llama-3-8B" in (clone / "params.yaml").read_text()
    ran.append("python -m pipelines.preset llama3-8b-qlora")
    (clone / "params.yaml").write_text(params)
    assert UP_TO_DATE in sh("dvc status", clone)
    assert len(ran) == sum(how in ("run", "check") for how, _ in readme_commands.HOW.values())
