"""Shared fixtures: the data mirror, a scratch working directory with the ci preset, torchrun."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from shared_run import MIRROR, ROOT, require_mirror  # noqa: F401  (the repository and the data mirror, for the tests)

# The repositories the tests make with `dvc init` (remotes, clones) have DVC's usage reports on: after
# each command DVC starts a `dvc daemon analytics` process, which tries to reach DVC's servers. The
# project's own repository turns them off in .dvc/config; every command a test starts inherits this.
os.environ["DVC_NO_ANALYTICS"] = "1"

# Importing DVC sets up its console loggers once per process on the sys.stdout and sys.stderr of that moment.
# Imported first inside a test, those are that test's capture (capsys), closed when it ends, and every later
# DVC message in the worker (`Repo.init`'s "Initialized DVC repository.") fails with "I/O operation on closed
# file". Imported here, they are pytest's session-long capture.
import dvc  # noqa: E402, F401

# The order in which the pytest-xdist workers take the modules: the longest first, so that the workers
# finish together. A worker is handed its next module while it still runs its last queued test (xdist keeps
# two tests queued). tests/test_e2e.py comes first: it makes the shared ci run (tests/shared_run.py, about
# 5 minutes) that the e2e records, experiments and README commands read; the long training modules come
# next, so the other workers train meanwhile instead of waiting on that run. The README commands (minutes)
# come among the long modules: handed out last, the other workers would be done long before them.
ORDER = [
    "tests/system/test_two_nodes.py",
    "tests/system/test_containers.py",  # (make test-system: the image build beside the two-node module)
    "tests/test_kill_fuzz.py",  # (make test-system: the whole pipeline, killed and resumed)
    "tests/test_e2e.py",
    "tests/test_parallel.py",
    "tests/test_pretrain.py",
    "tests/test_e2e_records.py",
    "tests/test_e2e_reproduce.py",
    "tests/test_e2e_experiments.py",
    "tests/test_e2e_remote.py",
    "tests/test_readme_commands.py",
    "tests/system/test_browser.py",
    "tests/test_extend_context.py",
    "tests/test_finetune_qlora.py",
    "tests/test_memory_study.py",
    "tests/test_node_loss.py",
    "tests/test_bench.py",
]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Modules in ORDER, then the others. make test runs the tests in pytest-xdist workers with
    `--dist loadfile` (a module's tests in one worker, so its module fixtures are made once) and
    `--no-loadscope-reorder` (modules handed out in this order)."""
    rank = {name: i for i, name in enumerate(ORDER)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(ORDER)))


# CPU seconds of each test (its own process and every process it started and waited for, their children
# included), beside the JUnit report when there is one (<report>.cpu.tsv: .ci/summary.py prints the tests
# that use most). On 2 busy cores a test's wall time says little about its cost; this does.
CPU_AT_SETUP = pytest.StashKey[float]()
CPU_LOG = pytest.StashKey[str]()


def pytest_configure(config) -> None:
    report = config.getoption("xmlpath", None)
    if report:  # (made absolute before any test changes the working directory)
        config.stash[CPU_LOG] = os.path.abspath(f"{report}.cpu.tsv")


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    item.stash[CPU_AT_SETUP] = cpu_seconds()


@pytest.hookimpl(trylast=True)  # (after the fixtures' teardown)
def pytest_runtest_teardown(item, nextitem) -> None:
    if CPU_LOG in item.config.stash and CPU_AT_SETUP in item.stash:
        line = f"{cpu_seconds() - item.stash[CPU_AT_SETUP]:.1f}\t{item.nodeid}\n"
        with contextlib.suppress(OSError), open(item.config.stash[CPU_LOG], "a") as log:  # (a measurement only)
            log.write(line)  # (one short line per write: whole lines from any worker)


# The tiny Llama the stage tests train (2 layers of width 64, context 64): pretrain overrides.
TINY_MODEL = [
    "model.n_layers=2",
    "model.hidden_size=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.intermediate_size=128",
    "model.max_position_embeddings=64",
    "context_length=64",
]


# Stage runs of the tests log nothing to MLflow (PIPELINE_TRACKING=off: outputs are unchanged, and the
# import of MLflow and the opening of its store are a third of a tiny stage's CPU); a test that reads
# what a stage logged passes **TRACKED.
TRACKED = {"PIPELINE_TRACKING": "on"}


class RunsCode:
    """Unpickled by anything but a data-only reader, this creates `marker`: a file crafted to run code
    (a checkpoint's extra.pt or DCP metadata, a raw Planetoid file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def craft_checkpoint_item(step: Path, marker: Path) -> str:
    """Overwrite, in place, one non-tensor item of the DCP checkpoint in `step` (an optimizer group's lr,
    a torch.save'd blob inside a shard) with a pickle that creates `marker` when unpickled, and rewrite
    the checkpoint's manifest to match. Checks first that torch's own reading of such an item
    (DefaultLoadPlanner.load_bytes: torch.load with weights_only=False) would run it. Returns the item."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from stages.common import ckpt

    metadata = ckpt.read_metadata(step / "state/.metadata")
    name = next(
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata) and k.endswith(".lr")
    )
    info = metadata.storage_data[MetadataIndex(name)]
    payload = pickle.dumps(RunsCode(marker))
    assert len(payload) <= info.length
    with open(step / "state" / info.relative_path, "r+b") as fh:
        fh.seek(info.offset)
        fh.write(payload)
        fh.seek(info.offset)
        crafted = fh.read(info.length)
    try:
        torch.load(io.BytesIO(crafted), weights_only=False)
    except Exception:  # noqa: BLE001 - what it returns is no torch file; what matters is that it ran
        pass
    assert Path(marker).exists(), "the crafted item runs code in torch's own reader"
    Path(marker).unlink()
    ckpt.write_manifest(step)
    return name


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# MLflow's server starts job runners (eight processes that poll) for its GenAI jobs, which nothing here
# uses: over 100 s of CPU in its first minute and 2 GB of memory (the Makefile's mlflow-ui leaves them out too).
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
SERVER_START_S = 300  # (an MLflow server took over 2 minutes to answer on a loaded 2-core machine)


@contextlib.contextmanager
def running_server(cmd: list[str], log: Path, ready, what: str, **popen):
    """Run a server (`cmd`, its output to `log`) in a process group of its own until the block ends; wait
    until `ready()` first. On the way out, failed start included, the group is stopped: TERM, then KILL
    after 30 s (`mlflow server` leaves its uvicorn and job processes running when only it is stopped)."""
    import signal
    import time

    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, **popen
        )
        try:
            deadline = time.monotonic() + SERVER_START_S
            while not ready():
                assert proc.poll() is None, (
                    f"{what} ended ({proc.returncode}):\n" + log.read_text(errors="replace")[-3000:]
                )
                assert time.monotonic() < deadline, f"{what} did not answer within {SERVER_START_S} s"
                time.sleep(0.5)
            yield proc
        finally:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # (what is left of the group once its leader ended)


def stage_env(workdir: Path, **extra) -> dict:
    env = {
        **os.environ,
        "PIPELINE_TRACKING": "off",
        # the repository first, then what the caller had (packages installed beside the environment)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
        "PIPELINE_DATA_MIRROR": str(MIRROR),
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",
        **extra,
    }
    env.pop("PIPELINE_RUN_ID", None)
    return env


def run_stage(module: str, args: list[str], cwd: Path, nproc: int = 1, check: bool = True, **env):
    """Run `python -m stages.<module>` (nproc 1) or torchrun with `nproc` CPU processes, in `cwd`."""
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    )
    proc = subprocess.run(
        [*launcher, "-m", f"stages.{module}", *args],
        cwd=cwd,
        env=stage_env(cwd, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"stages.{module} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_probe(script: str, args: list, cwd: Path, nproc: int) -> None:
    """Run tests/<script> under torchrun with `nproc` processes in `cwd`; fail with its stderr."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(ROOT / "tests" / script),
            *map(str, args),
        ],
        cwd=cwd,
        env=stage_env(cwd),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="session")
def mirror() -> Path:
    return require_mirror()


def collector_thresholds() -> tuple[int, int, int]:
    """The garbage collector's thresholds that pipelines/gc-threshold.pth sets in every Python the project
    builds (.venv, the images), read from the file's one import line."""
    text = (ROOT / "pipelines/gc-threshold.pth").read_text()
    (line,) = [line for line in text.splitlines() if not line.startswith("#")]
    found = re.fullmatch(r"import gc; gc.set_threshold\(([\d_]+), (\d+), (\d+)\)", line)
    return tuple(int(n.replace("_", "")) for n in found.groups())


def ci_params(dest: Path) -> Path:
    """params.yaml with the ci preset applied, at dest/params.yaml."""
    from pipelines import preset

    shutil.copy(ROOT / "params.yaml", dest / "params.yaml")
    preset.apply("ci", dest / "params.yaml")
    return dest / "params.yaml"


@pytest.fixture
def workdir(tmp_path, monkeypatch, mirror) -> Path:
    """A scratch cwd with ci params, its own MLflow store, and the mirror in the environment."""
    ci_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    for key, value in stage_env(tmp_path).items():
        if key in ("PIPELINE_DATA_MIRROR", "MLFLOW_TRACKING_URI"):
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("PIPELINE_RUN_ID", raising=False)
    return tmp_path


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The folder `name`, filled by make(folder) once per pytest run: by the first test that asks, in
    whichever pytest-xdist worker; the others wait for it (a file lock) and then only read it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder
    root, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            make(root)
            done.touch()
    return root


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, mirror) -> Path:
    """prepare_data on the ci preset, run once per session (a folder holding data/prepare_data)."""

    def make(root: Path) -> None:
        ci_params(root)
        run_stage("prepare_data", ["--output", "data/prepare_data"], cwd=root)

    return made_once(tmp_path_factory, "prepared", make)


@pytest.fixture(scope="session")
def tokenized(prepared, tmp_path_factory) -> Path:
    """prepare_data's output plus tokenize (one process) on the ci preset, in a folder of its own."""

    def make(root: Path) -> None:
        shutil.copy(prepared / "params.yaml", root / "params.yaml")
        shutil.copytree(prepared / "data/prepare_data", root / "data/prepare_data")
        # Tracked: this makes the folder's MLflow store before the tests that train in it in-process, in
        # several workers at once, share it (MLflow's first opening of a store is not safe from two at once).
        # Where MLflow is not installed (a bare GPU machine: bench/gpu_check.sh) nothing tracks.
        tracked = TRACKED if importlib.util.find_spec("mlflow") else {}
        run_stage("tokenize", ["--input", "data/prepare_data", "--output", "data/tokenize"], cwd=root, **tracked)

    return made_once(tmp_path_factory, "tokenized", make)


def loss_curve(root: Path, out: str):
    """The per-step train losses a pretrain run wrote to <out>/plots/loss.csv."""
    import numpy as np

    rows = (root / out / "plots/loss.csv").read_text().splitlines()[1:]
    return np.array([float(r.split(",")[1]) for r in rows])
