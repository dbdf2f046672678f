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

Every run also records the environment it ran in, measured where it runs (run_record): the sha256 of
requirements.lock as found then, the family, the installed version of each package the family's file
names, as importlib.metadata reports it, and inside a container its image (an Apptainer image's sha256,
a podman image's id). Each output's meta.json holds it as `environment`, each MLflow run as tags
(tags_of); `python -m pipelines.verify` names what differs from the environment it runs in
(record_changes). Outputs made on the same environment stay byte-identical: nothing in it changes
from run to run.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
from pathlib import Path

from stages.common import atomic, config, digest, provenance

VARIABLE = "PIPELINE_ENVIRONMENT"
CHOICES = ("pinned", "any")  # the default: the recorded versions or nothing; any: what is installed, recorded
PACKAGES = "pipelines/packages/{family}.txt"
TABLE = "pipelines/stages.yaml"
SHOWN = 6  # differences named in one line; the rest are counted
LOCK = "requirements.lock"
SIDECAR = ".sha256"  # beside an Apptainer image: its sha256, for as long as its size and mtime are the same
CONTAINERENV = Path("/run/.containerenv")  # podman's, in each of its containers
TAG_LENGTH = 5000  # MLflow's longest tag value


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


def lock_sha256(root: Path = provenance.CODE_ROOT) -> str | None:
    """The sha256 of requirements.lock under `root` as it is now (None when there is none)."""
    try:
        return digest.sha256_file(root / LOCK)
    except OSError:
        return None


def family_installed(fam: str, root: Path = provenance.CODE_ROOT) -> dict[str, str]:
    """{distribution: installed version, as importlib.metadata reports it (torch 2.13.0+cpu)} of each
    package family `fam`'s file names; one not installed is left out. {} without the family's file."""
    try:
        names = recorded(root / PACKAGES.format(family=fam))
    except OSError:
        return {}
    have = installed()
    return {name: have[normalized(name)] for name in sorted(names, key=normalized) if normalized(name) in have}


def packages_sha256(packages: dict[str, str]) -> str:
    """One hash of a {distribution: version} record: of its sorted `name==version` lines."""
    lines = sorted(f"{normalized(n)}=={v}\n" for n, v in packages.items())
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def image_sha256(path: Path) -> str | None:
    """The sha256 of an Apptainer image, from its sidecar `<image>.sha256` while the image's size and mtime
    are those the sidecar names; else hashed (a multi-GB file: once) and the sidecar written, where the
    folder can be written to. None when the image cannot be read from here."""
    sidecar = path.with_name(path.name + SIDECAR)
    try:
        stat = path.stat()
    except OSError:
        return None
    try:
        kept = json.loads(sidecar.read_text())
        if kept["size"] == stat.st_size and kept["mtime_ns"] == stat.st_mtime_ns:
            return str(kept["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        sha = digest.sha256_file(path)
    except OSError:
        return None
    try:
        atomic.write_json(sidecar, {"sha256": sha, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    except OSError:  # (a read-only folder: hashed again by the next run)
        pass
    return sha


def containerenv(text: str) -> dict[str, str]:
    """{key: value} of podman's /run/.containerenv (`key="value"` lines: engine, name, id, image, imageid)."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key:
            found[key] = value.strip().strip('"')
    return found


def image_record(env=None, containerenv_file: Path = CONTAINERENV) -> dict | None:
    """The container image this process runs in: Apptainer or Singularity (APPTAINER_CONTAINER,
    SINGULARITY_CONTAINER: the image file) {"runtime", "name", "sha256"}; podman or docker
    (/run/.containerenv, or the `container` variable) {"runtime", "name", "id"} as far as the container
    tells them (podman names the image and its id to a container run with --privileged). None outside a
    container."""
    env = os.environ if env is None else env
    for runtime in ("apptainer", "singularity"):
        if env.get(f"{runtime.upper()}_CONTAINER"):
            path = Path(env[f"{runtime.upper()}_CONTAINER"]).absolute()
            sha = image_sha256(path)
            return {"runtime": runtime, "name": path.name, **({"sha256": sha} if sha else {})}
    try:
        fields = containerenv(containerenv_file.read_text())
    except OSError:
        if not env.get("container"):
            return None
        return {"runtime": env["container"]}
    record = {"runtime": fields.get("engine", "").split("-")[0] or env.get("container") or "podman"}
    if fields.get("image"):
        record["name"] = fields["image"]
    if fields.get("imageid"):
        record["id"] = fields["imageid"]
    return record


@functools.cache
def current_image() -> dict | None:
    """image_record of this process (an image does not change under a running process)."""
    return image_record()


def run_record(section: str, root: Path = provenance.CODE_ROOT) -> dict:
    """The environment stage `section` runs in, measured here and now: {"lock_sha256": of requirements.lock
    under `root`, "container_family", "packages": {distribution: installed version} of the family's
    file, "packages_sha256": their hash, "image": the container's (image_record; no key outside one)}.
    Without a family (a bench's own run) only the lock and the image."""
    record: dict = {"lock_sha256": lock_sha256(root)}
    fam = stage_family(section, root)
    if fam is not None:
        packages = family_installed(fam, root)
        record |= {"container_family": fam, "packages": packages, "packages_sha256": packages_sha256(packages)}
    image = current_image()
    if image is not None:
        record["image"] = image
    return record


def tags_of(record: dict) -> dict[str, str]:
    """A run_record as MLflow tags: lock_sha256, container_family, packages_sha256, packages_installed (the
    `name==version` lines), image.runtime, image.name, image.sha256 or image.id."""
    tags = {k: str(record[k]) for k in ("lock_sha256", "container_family", "packages_sha256") if record.get(k)}
    if "packages" in record:
        lines = "\n".join(f"{n}=={v}" for n, v in sorted(record["packages"].items(), key=lambda kv: normalized(kv[0])))
        tags["packages_installed"] = lines[:TAG_LENGTH]  # (packages_sha256 stands for the whole list)
    tags |= {f"image.{k}": str(v) for k, v in (record.get("image") or {}).items()}
    return tags


def image_label(image: dict | None) -> str | None:
    """`apptainer lm.sif sha256:1a2b3c4d5e6f`, `podman <image> 9f8e7d6c5b4a`; None for no container."""
    if not image:
        return None
    short = f"sha256:{image['sha256'][:12]}" if image.get("sha256") else str(image.get("id", ""))[:12]
    return " ".join(str(x) for x in (image.get("runtime"), image.get("name"), short) if x)


def record_changes(old: dict, new: dict) -> list[tuple[str, str | None, str | None]]:
    """[(what, in `old`, in `new`)] where two run_records differ: `requirements.lock` (its sha256's first
    12 digits), `container family`, each distribution whose installed version differs (None: not
    installed), `image` (image_label; None: no container)."""
    found: list[tuple[str, str | None, str | None]] = []
    a, b = old.get("lock_sha256"), new.get("lock_sha256")
    if a != b:
        found.append((LOCK, a and a[:12], b and b[:12]))
    if old.get("container_family") != new.get("container_family"):
        found.append(("container family", old.get("container_family"), new.get("container_family")))
    if old.get("packages_sha256") != new.get("packages_sha256"):
        pa = {normalized(n): (n, v) for n, v in (old.get("packages") or {}).items()}
        pb = {normalized(n): (n, v) for n, v in (new.get("packages") or {}).items()}
        for key in sorted(set(pa) | set(pb)):
            va, vb = pa.get(key, (None, None))[1], pb.get(key, (None, None))[1]
            if va != vb:
                found.append(((pa.get(key) or pb[key])[0], va, vb))
    if (old.get("image") or None) != (new.get("image") or None):
        found.append(("image", image_label(old.get("image")), image_label(new.get("image"))))
    return found


def describe_changes(found: list[tuple[str, str | None, str | None]], old: str = "recorded", new: str = "now") -> str:
    """`requirements.lock 1a2b3c4d5e6f recorded, 9f8e7d6c5b4a now; torch 2.12.0 recorded, 2.13.0 now; image
    apptainer lm.sif sha256:... recorded, none now` (the first SHOWN, then a count)."""
    missing = {LOCK: "none", "container family": "none", "image": "none"}
    shown = [
        f"{what} {a or missing.get(what, 'not installed')} {old}, {b or missing.get(what, 'not installed')} {new}"
        for what, a, b in found[:SHOWN]
    ]
    more = f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    return "; ".join(shown) + more


def run_tags(section: str) -> dict[str, str]:
    """The MLflow tags of the environment a run of stage `section` runs in (tags_of its run_record),
    and for a run that opted out, `environment`, naming the differences from the family's file."""
    tags = tags_of(run_record(section))
    if choice() != "any":
        return tags
    name, found = stage_differences(section)
    if name is None:
        return tags
    said = describe(found) if found else f"the installed packages are those {name} records"
    return tags | {"environment": f"{VARIABLE}=any: {said}"[:TAG_LENGTH]}


def output_record(section: str) -> dict:
    """What an output's meta.json records of the environment that made it: {"environment": run_record},
    with, for a run that opted out on packages other than the recorded ones, "opted_out", "file" (the
    family's) and "differences" ({name: {"recorded": v, "installed": v}}). Runs on the same environment
    record the same, so their outputs hash alike."""
    record = run_record(section)
    if choice() == "any":
        name, found = stage_differences(section)
        if found:
            record |= {"opted_out": f"{VARIABLE}=any", "file": name}
            record["differences"] = {n: {"recorded": want, "installed": have} for n, want, have in found}
    return {"environment": record}
