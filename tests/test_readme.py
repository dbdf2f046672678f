"""The README's shell commands: each is tried (here, or in tests/test_readme_commands.py) or marked with the
reason it is not (tests/readme_commands.py). Here, fast, for every command: its program exists, the
repository paths it names exist, the data paths it reads are outputs of the DAG, and make targets resolve."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess

import pytest
import readme_commands
import yaml
from conftest import ROOT

COMMANDS = readme_commands.commands()
# Programs a README command may start with, beyond the ones checked one by one below.
SHELL = {"source", "cat", "git", "export"}
SYSTEM = {"podman", "apptainer", "docker"}  # container tools: optional here


def dag_outputs() -> set[str]:
    table = yaml.safe_load((ROOT / "pipelines/stages.yaml").read_text())["stages"]
    outs = set()
    for spec in table.values():
        for out in spec["outs"]:
            outs |= {out.replace("${item}", str(item)) for item in spec.get("foreach", [None])}
    return outs


def words(command: str) -> list[str]:
    return shlex.split(command.replace("<", "").replace(">", ""))


def test_every_readme_command_is_tried_or_marked_with_a_reason():
    missing = [c for c in COMMANDS if c not in readme_commands.HOW]
    assert not missing, f"README commands neither tried nor marked (add them to tests/readme_commands.py): {missing}"
    stale = [c for c in readme_commands.HOW if c not in COMMANDS]
    assert not stale, f"tests/readme_commands.py lists commands the README no longer has: {stale}"
    assert all(how in ("run", "check", "make", "marked") for how, _ in readme_commands.HOW.values())
    assert all(reason for how, reason in readme_commands.HOW.values() if how == "marked")


@pytest.mark.parametrize("command", COMMANDS)
def test_the_program_of_each_command_exists(command):
    for part in re.split(r"\s*(?:&&|\|\|?|;)\s*", command):
        program, *rest = words(part)
        while re.fullmatch(r"[A-Za-z_]\w*=\S*", program) and rest:  # VAR=value before the program
            program, *rest = rest
        if program == "make":
            continue  # targets: below
        if program in ("python", "torchrun"):
            module = rest[rest.index("-m") + 1] if "-m" in rest else None
            if module:
                assert importlib.util.find_spec(module) is not None, f"{command}: no module {module}"
        elif program.startswith(("bench/", "pipelines/", "./")):
            assert os.access(ROOT / program, os.X_OK), f"{command}: {program} is not an executable file here"
        elif program in SYSTEM:
            if shutil.which(program) is None:
                pytest.skip(f"{program} not installed here: its README command is not checked")
        elif program not in SHELL:
            assert shutil.which(program), f"{command}: {program} is not on PATH (is it in requirements.lock?)"


@pytest.mark.parametrize("command", COMMANDS)
def test_paths_a_command_names_exist_or_are_dag_outputs(command):
    outputs = dag_outputs()
    written = set()
    for flag, value in zip(words(command), words(command)[1:], strict=False):
        if flag in ("--output", "-o"):
            written.add(value)
    for token in words(command):
        for path in re.findall(r"(?:^|[=+,])((?:data|containers|pipelines|stages|bench)/[\w./@-]*)", token):
            path = path.rstrip("/")
            if path.startswith("data/"):
                under = any(path == o or path.startswith(o + "/") for o in outputs | written)
                assert under, f"{command}: {path} is no output of the DAG (pipelines/stages.yaml) nor of the command"
            elif path.endswith(".sif"):
                continue  # built by the command
            else:
                assert (ROOT / path).exists(), f"{command}: {path} does not exist"


@pytest.mark.parametrize("command", [c for c, (how, _) in readme_commands.HOW.items() if how == "make"])
def test_make_targets_resolve(command):
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", *words(command)[1:]], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
