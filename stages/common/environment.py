"""The packages a stage runs on, against the versions its pipeline records for them.

Each stage belongs to a container family (the image named by its `resources.container` in
pipelines/stages.yaml: containers/<family>.sif), and pipelines/packages/<family>.txt, generated from
requirements.lock by `python -m pipelines.dag write`, pins the packages that family's stages import with
everything they require. That file is a dependency of each of those stages in dvc.yaml, so dvc.lock says
an output was made with those versions. Before any compute a stage compares the versions installed
where it runs (importlib.metadata: no package is imported) with the file, and refuses a difference:

    error: environment: train_gnn runs on packages that pipelines/packages/gnn.txt does not record:
    torch-geometric 2.8.1 recorded, 2.8.0.post1 installed; run `make venv` ...

PIPELINE_ENVIRONMENT=any runs it anyway, outside `dvc repro` and Snakemake only (their dvc.lock would
record the family file's versions as those that made the outputs): the run's MLflow tag `environment`
says so, and the differences go into its output's meta.json (`environment`), so no record names
versions that did not run. A version is the recorded one when pip's `==` would take it (torch 2.13.0+cpu
is torch 2.13.0: requirements.lock drops local labels).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from pathlib import Path

from stages.common import config, provenance

VARIABLE = "PIPELINE_ENVIRONMENT"
CHOICES = ("pinned", "any")  # the default: the recorded versions or nothing; any: what is installed, recorded
PACKAGES = "pipelines/packages/{family}.txt"
TABLE = "pipelines/stages.yaml"
SHOWN = 6  # differences named in one line; the rest are counted


def family(container: str) -> str:
    """The container family of a stage whose `resources.container` is `container` (containers/<family>.sif)."""
    return Path(container).stem


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stage_family(section: str, root: Path = provenance.CODE_ROOT) -> str | None:
    """The family of stage `section` in the stage table under `root`; None when the table has no such
    stage (a bench's own run)."""
    import yaml

    try:
        doc = yaml.load((root / TABLE).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError:
        return None
    entry = (doc.get("stages") or {}).get(section)
    if entry is None:
        return None
    resources = {**(doc.get("defaults") or {}).get("resources", {}), **(entry.get("resources") or {})}
    return family(resources["container"])


def recorded(path: Path) -> dict[str, str]:
    """{distribution: version} of a family's package file (its `name==version` lines)."""
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            pins[name] = version
    return pins


@functools.cache
def installed() -> dict[str, str]:
    """{normalized distribution name: version} of what this interpreter imports (the first of a name on
    sys.path, as imports find it). One pass over the installed metadata; no package is imported."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalized(name), dist.version)
    return found


def same_version(pinned: str, version: str) -> bool:
    """Whether `version` is what `==pinned` installs (local labels such as +cpu aside)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion

    try:
        return SpecifierSet(f"=={pinned}").contains(version, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return pinned == version


def differences(pins: dict[str, str], have: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """[(distribution, recorded version, installed version or None)] where the two differ."""
    out = []
    for name, version in pins.items():
        now = have.get(normalized(name))
        if now is None or not same_version(version, now):
            out.append((name, version, now))
    return out


def describe(found: list[tuple[str, str, str | None]]) -> str:
    """`torch-geometric 2.8.1 recorded, 2.8.0.post1 installed; ...` (the first SHOWN, then a count)."""
    shown = [f"{n} {want} recorded, {have or 'not'} installed" for n, want, have in found[:SHOWN]]
    more = f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    return "; ".join(shown) + more


def stage_differences(section: str, root: Path = provenance.CODE_ROOT):
    """(the family's package file relative to `root`, its differences from what is installed here), or
    (None, []) for a stage the table does not name or a family without a package file."""
    fam = stage_family(section, root)
    if fam is None or not (root / PACKAGES.format(family=fam)).is_file():
        return None, []
    name = PACKAGES.format(family=fam)
    return name, differences(recorded(root / name), installed())


def choice() -> str:
    value = os.environ.get(VARIABLE, "").strip().lower() or "pinned"
    if value not in CHOICES:
        raise config.UserError(f"{VARIABLE}={value}: unknown; valid: {', '.join(CHOICES)} (or unset: pinned)")
    return value


def under_pipeline() -> bool:
    """Run by `dvc repro`/`dvc exp run` (DVC_ROOT) or by Snakemake (PIPELINE_SNAKEMAKE): dvc.lock will
    record the family's package file as what made the outputs."""
    return bool(os.environ.get("DVC_ROOT") or os.environ.get("PIPELINE_SNAKEMAKE"))


def check(section: str) -> None:
    """Before any compute: refuse to run stage `section` on packages other than its family's recorded
    ones (config.UserError, one line naming each difference and the fix), unless PIPELINE_ENVIRONMENT=any
    outside dvc repro and Snakemake."""
    wanted = choice()
    name, found = stage_differences(section)
    if not found:
        return
    what = f"environment: {section} runs on packages that {name} does not record: {describe(found)}"
    if under_pipeline():
        raise config.UserError(
            f"{what}; under dvc repro or Snakemake dvc.lock records {name} as what made the outputs, so "
            f"{VARIABLE}=any does not apply: run `make venv` to install the pinned versions, or pin these in "
            f"requirements.lock and run `make dag`"
        )
    if wanted != "any":
        raise config.UserError(
            f"{what}; run `make venv` to install the pinned versions, or set {VARIABLE}=any to run on these "
            f"(the run and its output record them)"
        )
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {what}; running on them, as {VARIABLE}=any asks (recorded on the run)", flush=True)


def run_tags(section: str) -> dict[str, str]:
    """The MLflow tag of a run that opted out ({} otherwise): `environment`, naming the differences."""
    if choice() != "any":
        return {}
    name, found = stage_differences(section)
    if name is None:
        return {}
    said = describe(found) if found else f"the installed packages are those {name} records"
    return {"environment": f"{VARIABLE}=any: {said}"[:5000]}  # (MLflow's longest tag value)


def output_record(section: str) -> dict:
    """What an output's meta.json adds when its run opted out and its packages differ from the recorded
    ones: {"environment": {"opted_out": ..., "packages": {name: {"recorded": v, "installed": v}}}}; {}
    otherwise, so that the outputs of runs on the same packages hash alike."""
    if choice() != "any":
        return {}
    name, found = stage_differences(section)
    if not found:
        return {}
    packages = {n: {"recorded": want, "installed": have} for n, want, have in found}
    return {"environment": {"opted_out": f"{VARIABLE}=any", "file": name, "packages": packages}}
