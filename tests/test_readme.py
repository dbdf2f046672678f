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
SHELL = {"source", "cd", "cat", "git", "export"}
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


def test_every_page_opens_with_its_readers_and_its_commands_are_counted():
    """Each docs/ page: a title, then who it is for. The counts per page (run / checked / make -n / marked)
    are printed (pytest -s)."""
    for page in readme_commands.PAGES:
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), f"{page.relative_to(ROOT)}: the first line is not a title"
        if page.parent.name == "docs":
            assert lines[2].startswith("For "), f"{page.relative_to(ROOT)}: no line saying who the page is for"
        counts = {how: 0 for how in ("run", "check", "make", "marked")}
        for command in dict.fromkeys(readme_commands.page_commands(page)):
            counts[readme_commands.HOW[command][0]] += 1
        print(
            f"{page.relative_to(ROOT)}: {len(lines)} lines; commands "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
        )


def prose(page) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def anchors(page) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", prose(page), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", readme_commands.PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_pages_and_to_repository_paths_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.relative_to(ROOT)}: the link {target} names no file"
        assert linked.is_relative_to(ROOT), f"{page.relative_to(ROOT)}: the link {target} leaves the repository"
        if anchor:
            assert anchor in anchors(linked), (
                f"{page.relative_to(ROOT)}: {target}: no such heading in {path or 'the page'}"
            )


REPOSITORY_PATH = r"`((?:stages|pipelines|containers|bench|tests|docs|\.ci)/[\w./-]*\w|[\w-]+\.(?:yaml|toml|lock|md))`"


@pytest.mark.parametrize("page", readme_commands.PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_files_and_make_targets_a_page_names_exist(page):
    """A repository file named in backticks exists (or is an output of the DAG or a file the tools write);
    `make <target>` names a target of the Makefile."""
    text = prose(page)
    written = {"dvc.lock", "results.md", "study.md", "mlflow.db", "params.yaml"}
    for path in re.findall(REPOSITORY_PATH, text):
        if "<" in path or path in written or path.endswith(".sif"):
            continue
        if "/" not in path and not (ROOT / path).exists():
            continue  # a file name alone: a file in a folder the text names
        assert (ROOT / path).exists(), f"{page.relative_to(ROOT)}: `{path}` does not exist"
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for target in re.findall(r"`make ([a-z][\w-]*)", text):
        assert target in targets, f"{page.relative_to(ROOT)}: `make {target}` is no target of the Makefile"


def known_key(params: dict, keys: list[str]) -> bool:
    """A dotted key of params.yaml, or of a `train` section (every field of TrainConfig, defaults too)."""
    import dataclasses

    from stages.common.train_config import TrainConfig

    train = {f.name for f in dataclasses.fields(TrainConfig)}
    if "train" in keys and len(keys) == keys.index("train") + 2 and keys[-1] in train:
        return True
    node = params
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


@pytest.mark.parametrize("page", readme_commands.PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_params_keys_a_page_names_exist(page):
    """`section.key` (and `train.key`, `model.key`: a key of any stage's sub-section) is a key of
    params.yaml, so a renamed key fails here."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    files = (
        "log",
        "json",
        "jsonl",
        "py",
        "md",
        "csv",
        "yaml",
        "png",
        "txt",
        "lock",
        "db",
        "safetensors",
        "pt",
        "bin",
        "html",
    )
    for key in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:[=:][^`]*)?`", prose(page)):
        keys = key.split(".")
        if keys[-1] in files:
            continue
        if keys[0] in params:
            assert known_key(params, keys), f"{page.relative_to(ROOT)}: `{key}` is no key of params.yaml"
        elif keys[0] in ("train", "model", "lora"):
            sections = [s for s in params.values() if isinstance(s, dict)]
            assert any(known_key(s, keys) for s in sections), (
                f"{page.relative_to(ROOT)}: `{key}` is no key of params.yaml"
            )


def test_the_layout_names_every_module():
    """docs/pipeline.md's layout names every module of stages/, stages/common/, stages/models/, pipelines/
    and bench/, and no module that is gone."""
    layout = (ROOT / "docs/pipeline.md").read_text().split("## Repository layout", 1)[1]
    named = set(re.findall(r"^\| `([\w/.]+\.(?:py|sh))` \|", layout, re.M))
    modules = {
        str(p.relative_to(ROOT))
        for folder in ("stages", "stages/common", "stages/models", "pipelines", "bench")
        for p in (ROOT / folder).glob("*")
        if p.suffix in (".py", ".sh") and p.name != "__init__.py"
    }
    assert not modules - named, f"docs/pipeline.md's layout does not name {sorted(modules - named)}"
    assert not named - modules, f"docs/pipeline.md's layout names modules that are gone: {sorted(named - modules)}"


def test_the_readme_links_every_page_of_docs():
    linked = {target.partition("#")[0] for target in re.findall(r"\]\((docs/[^)\s]+)\)", prose(ROOT / "README.md"))}
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert not pages - linked, f"README.md links no page {sorted(pages - linked)}"
