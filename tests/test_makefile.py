"""The Makefile on a fresh clone: every target that runs a project tool builds .venv first, and .venv is
made by Python 3.11 only. Each test runs make in a copy of the Makefile (with empty files for the stamp's
prerequisites), never in the repository: nothing here builds or touches the real .venv."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from conftest import ROOT

# Targets that run no project tool, so need no environment.
NO_TOOL = {"clean": "removes files only"}
# The stamp's first step: its echo in `make -n` shows the environment is built before the target's recipe.
MAKES_VENV = re.compile(r"^test -x \.venv/bin/python \|\| \S* -m venv \.venv$", re.M)


def phony_targets() -> list[str]:
    (line,) = re.findall(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M)
    return line.split()


@pytest.fixture
def fresh(tmp_path):
    """A folder like a fresh clone, for make: the Makefile and its prerequisite files, no .venv."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for name in ("requirements.lock", "pyproject.toml", "pipelines/gc-threshold.pth", "pipelines/plots.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    return tmp_path


def make(folder, *args) -> subprocess.CompletedProcess:
    # (as a make of its own, not a sub-make of `make test`: its messages then read `make: ...`, not `make[1]: ...`)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    cmd = ["make", "--no-print-directory", *args]
    return subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env=env)


def fake_python(folder, version: str):
    """An interpreter that says it is Python `version` and writes what else it is asked to run to `called`."""
    path = folder / f"python{version}"
    answer = f'--version) echo "Python {version}";; *) echo "$@" > called; exit 1;;'
    path.write_text(f'#!/bin/sh\ncase "$1" in {answer} esac\n')
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("target", [t for t in phony_targets() if t not in NO_TOOL])
def test_every_target_that_runs_a_tool_builds_the_environment_first_on_a_fresh_clone(fresh, target):
    proc = make(fresh, "-n", target, "PYTHON=python3.11")
    assert MAKES_VENV.search(proc.stdout), f"make {target} runs without .venv on a fresh clone: add $(STAMP)"


@pytest.mark.parametrize("target", sorted(NO_TOOL))
def test_the_targets_that_need_no_environment_run_no_tool(fresh, target):
    proc = make(fresh, "-n", target)
    assert proc.returncode == 0 and not MAKES_VENV.search(proc.stdout), proc.stdout
    assert all(line.split()[0] == "rm" for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.parametrize("version", ["3.9.2", "3.12.1"])
def test_a_python_other_than_3_11_is_refused_with_one_line_before_venv_is_made(fresh, version):
    python = fake_python(fresh, version)
    proc = make(fresh, "pull", f"PYTHON={python}")
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if not line.startswith("make: ***")]
    assert ours == [
        f"make: .venv needs Python 3.11; PYTHON={python} is Python {version}: install it (apt-get install "
        "python3.11-venv) or name one: make PYTHON=/path/to/python3.11 pull"
    ], proc.stderr
    assert not (fresh / ".venv").exists() and not (fresh / "called").exists()


def test_no_python_at_all_is_refused_with_one_line(fresh):
    proc = make(fresh, "venv", "PYTHON=")
    assert proc.returncode != 0
    assert "make: .venv needs Python 3.11; there is no python3.11 or python3 on PATH: install it" in proc.stderr
    assert not (fresh / ".venv").exists()


def test_python_3_11_goes_on_to_make_the_venv(fresh):
    python = fake_python(fresh, "3.11.9")
    make(fresh, "venv", f"PYTHON={python}")
    assert (fresh / "called").read_text().split() == ["-m", "venv", ".venv"]
