"""The seam between the pipeline tools and the stages (stages/common/contract.py): the tools that only read
files start without torch, and lint-imports names a tool that reaches the training stack."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stages.common import contract

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

STARTS_WITHOUT_TORCH = """
import contextlib, io, runpy, sys
sys.argv = [sys.argv[1], "--help"]
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    runpy.run_module(sys.argv[0], run_name="__main__")
heavy = sorted(m for m in ("torch", "transformers", "mlflow") if m in sys.modules)
print(" ".join(heavy) or "none")
"""

CHECKS_WITHOUT_TORCH = """
import sys
from pipelines import launch
lines = {stage: launch.layout_problem(stage, ["train.batch_size=12"], 8) for stage in launch.TRAIN_SECTIONS}
# (memory_study measures one process at a time, and refuses more itself)
print(all(line for stage, line in lines.items() if stage != "memory_study"), "torch" in sys.modules)
"""


@pytest.mark.parametrize("tool", ["pipelines.plots", "pipelines.html_report"])
def test_a_tool_that_reads_files_starts_without_torch(tool):
    proc = subprocess.run(
        [sys.executable, "-c", STARTS_WITHOUT_TORCH, tool], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "none", f"{tool} --help loads {proc.stdout.strip()}"


def test_the_launcher_and_the_contract_import_without_torch():
    code = "import sys, pipelines.launch, stages.common.contract, stages.common.atomic; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr[-3000:]


def test_the_launcher_checks_a_train_section_without_torch():
    """The launcher's check of each training stage's train section (its layout and batch, asked of
    stages.common.train_config and stages.common.mesh) loads no torch, also when it refuses."""
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS_WITHOUT_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused, torch_loaded = proc.stdout.split()
    assert refused == "True" and torch_loaded == "False", proc.stdout


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="lint-imports is not installed in this environment")
def test_lint_imports_names_a_tool_that_reaches_the_training_stack(tmp_path):
    for part in ("stages", "pipelines"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    plots = tmp_path / "pipelines/plots.py"
    plots.write_text(plots.read_text() + "\nfrom stages.common import runtime  # noqa: E402, F401\n")
    train = tmp_path / "stages/common/train_config.py"  # (the launcher asks it about a stage's processes)
    train.write_text(train.read_text() + "\nimport torch  # noqa: E402, F401\n")
    proc = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "the pipeline tools never import torch through the stages BROKEN" in out, out[-3000:]
    assert "pipelines.plots -> stages.common.runtime" in out, out[-3000:]
    assert "the launcher and the train section's checks never import torch BROKEN" in out, out[-3000:]
    assert "stages.common.train_config -> torch" in out, out[-3000:]


def test_the_launcher_reads_the_last_line_a_stage_leaves(tmp_path, monkeypatch):
    stopped, line_file = contract.launch_files(12345)
    assert stopped != line_file and "12345" in stopped.name
    line_file = tmp_path / "line"
    monkeypatch.setenv(contract.LAST_LINE_FILE, str(line_file))
    monkeypatch.delenv(contract.LAUNCH_HOST, raising=False)
    contract.leave_last_line(contract.REFUSED_EXIT, "error: first")
    contract.leave_last_line(contract.HANG_EXIT, "error: second")  # the first process to leave one wins
    assert contract.read_last_line(line_file) == (contract.REFUSED_EXIT, "error: first")
    assert contract.read_last_line(tmp_path / "none") is None


def test_a_lock_names_its_holder_to_the_next_taker(tmp_path):
    path = tmp_path / "folder.lock"
    held, _ = contract.try_lock(path)
    assert held is not None
    code = "import sys; from stages.common import contract; from pathlib import Path; "
    code += "h, who = contract.try_lock(Path(sys.argv[1])); print(h is None, who)"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip() == f"True {contract.identity()}", proc.stderr[-3000:]
    held.close()
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip().startswith("False"), proc.stderr[-3000:]
