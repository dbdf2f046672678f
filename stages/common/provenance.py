"""What made an output besides its params and inputs: the stage's code and the packages it runs on.

A stage's code is the files of every module `stages.<name>` imports within this repository, at any
depth (grimp reads the imports from the source; imports under TYPE_CHECKING do not run and do not
count). The same list is the stage's code deps in dvc.yaml (pipelines/dag.py), so what DVC and
Snakemake re-run a stage for is what its checkpoints and records name:

    code_files("stages.pretrain")   ['stages/__init__.py', ..., 'stages/pretrain.py']
    code_digest("stages.pretrain")  {"sha256": <of the files' hashes>, "files": {path: sha256}}
    packages("stages.pretrain")     {"torch": "2.13.0", "transformers": ..., ...}: the installed
                                    versions of the distributions the stage's modules import

Every MLflow run is also tagged with the commit of the code (git_commit) and carries the whole
environment (pip_freeze) as an artifact.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import subprocess
from pathlib import Path

CODE_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stages", "pipelines")


@functools.lru_cache(maxsize=2)
def import_graph(external: bool):
    import grimp

    return grimp.build_graph(
        *PACKAGES, cache_dir=None, exclude_type_checking_imports=True, include_external_packages=external
    )


def module_file(root: Path, module: str) -> Path:
    base = root.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def code_files(module: str, root: Path = CODE_ROOT) -> list[str]:
    """The repository files (relative to `root`) that run when `module` is imported: the module, every
    module of `stages` and `pipelines` it imports, transitively, and each one's package `__init__.py`.
    KeyError when `module` is not in the repository."""
    graph = import_graph(False)
    if module not in graph.modules:
        raise KeyError(module)
    files = set()
    for name in {module} | graph.find_upstream_modules(module):
        parts = name.split(".")
        files |= {module_file(root, ".".join(parts[:i])) for i in range(1, len(parts))}  # its packages
        files.add(module_file(root, name))
    return sorted(str(f.relative_to(root)) for f in files)


@functools.lru_cache(maxsize=8)
def code_digest(module: str) -> dict:
    """{"sha256": one hash of the stage's code, "files": {path: sha256 of its bytes}}."""
    files = {p: hashlib.sha256((CODE_ROOT / p).read_bytes()).hexdigest() for p in code_files(module)}
    blob = "".join(f"{p}\0{h}\n" for p, h in sorted(files.items())).encode()
    return {"sha256": hashlib.sha256(blob).hexdigest(), "files": files}


@functools.lru_cache(maxsize=8)
def packages(module: str) -> dict[str, str]:
    """{distribution: installed version} of the distributions whose top-level packages the stage's
    modules import (this repository aside). Their own requirements are pinned with them in
    pipelines/packages/<family>.txt, and the whole environment is an artifact of the MLflow run."""
    graph = import_graph(True)
    if module not in graph.modules:
        raise KeyError(module)
    imported = {m.split(".")[0] for m in graph.find_upstream_modules(module)} - set(PACKAGES)
    providers = importlib.metadata.packages_distributions()
    found = {}
    for top in imported:
        for dist in providers.get(top, ()):
            try:
                found[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def changed_files(old: dict, new: dict) -> list[str]:
    """The files whose hashes differ between two code_digest records (added and removed ones too)."""
    a, b = old.get("files", {}), new.get("files", {})
    return sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))


def git_commit(root: Path | None = None) -> str:
    """The commit of the code (HEAD of the repository holding this package), with '-dirty' when tracked
    files differ from it (dvc.lock aside: the pipeline itself rewrites it as stages finish); 'unknown'
    outside git."""
    cwd = str(root or CODE_ROOT)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = [line[3:] for line in dirty.stdout.splitlines() if line[3:] != "dvc.lock"]
    return head.stdout.strip() + ("-dirty" if changed else "")


def pip_freeze() -> str:
    """The installed distributions, in `pip freeze` format (without spawning pip)."""
    seen = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={d.version}"
    return "\n".join(sorted(seen.values(), key=str.lower)) + "\n"
