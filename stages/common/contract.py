"""What the launcher (pipelines.launch) and a stage's processes agree on, defined once for both sides.

The launcher starts a stage with the environment named here, reads the files the stage leaves (its last
line and exit code, the stopped mark), and maps the stage's end to one exit code. Stages and tools read
the same roots (the workspace, the checkpoints) and lock with the same kernel locks. Only the standard
library: a tool that reads files imports this without loading torch.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import IO

# How a stage ends, as its launcher (and a scheduler) reads it.
REFUSED_EXIT = 2  # it refused its input (a UserError): one line names the cause
PREFLIGHT_EXIT = 3  # a process gave up waiting for the others in preflight
HANG_EXIT = 124  # a rank made no progress (stages.common.watchdog; as GNU timeout's 124)
STOPPED_EXIT = 143  # 128 + SIGTERM: stopped by a signal after saving a checkpoint; re-running resumes

# Set by the launcher for the stage it starts.
LAUNCHED = "PIPELINE_LAUNCHED"  # started by pipelines.launch
STAGE = "PIPELINE_STAGE"  # <stage>[@<item>]
STOPPED_FILE = "PIPELINE_STOPPED_FILE"  # the stage touches it when a signal stopped it after a checkpoint
LAST_LINE_FILE = "PIPELINE_ERROR_FILE"  # "<exit code>\t<line>" of the first process that refused or hung
LAUNCH_HOST = "PIPELINE_LAUNCH_HOST"  # the host those files are on
WORLD_SIZE = "PIPELINE_WORLD_SIZE"  # the processes the launcher started (nproc per node x nodes)
TIME_FILE = "PIPELINE_TIME_FILE"  # + .rank<N>.json: a rank's times at a good end (stages.common.timing)
INPUTS = "PIPELINE_INPUTS"  # JSON list: the data deps of the stage in the DAG, which its MLflow run records
SWEEP = "PIPELINE_SWEEP"  # JSON {"sweep", "point", "values": {key: value}}: the sweep point the stage runs
# Read by the launcher or the stage, set by the user or the DAG tools.
NPROC_PER_NODE = "PIPELINE_NPROC_PER_NODE"  # processes per node for every stage, over its resources
PREFLIGHT_TIMEOUT = "PIPELINE_PREFLIGHT_TIMEOUT"  # seconds every process has to join one all-reduce
RDZV_HOST = "PIPELINE_RDZV_HOST"  # where the nodes of a multi-node stage meet
RDZV_TIMEOUT = "PIPELINE_RDZV_TIMEOUT"  # seconds a node has to join the rendezvous
SNAKEMAKE = "PIPELINE_SNAKEMAKE"  # set by the Snakefile for its jobs
SNAKEMAKE_PID = "PIPELINE_SNAKEMAKE_PID"  # "<pid>:<host>" of the local Snakemake the stage dies with
VERIFY_INPUTS = "PIPELINE_VERIFY_INPUTS"  # off: the launcher does not hash a stage's inputs against dvc.lock
CHECKPOINTS = "PIPELINE_CHECKPOINTS"  # the checkpoint root
DVC_ROOT = "DVC_ROOT"  # set by DVC: the repository's root, also for queued and temporary experiments


def workspace() -> Path:
    """The repository whose records (the MLflow store, checkpoints) a stage keeps: DVC_ROOT where DVC
    runs the stage, which names the repository's root also for queued and temporary experiments (they
    run in a copy under .dvc/tmp/exps that DVC deletes afterwards), else the working directory."""
    return Path(os.environ.get(DVC_ROOT) or Path.cwd()).resolve()


def checkpoint_root() -> Path:
    """PIPELINE_CHECKPOINTS, else checkpoints/ in the repository (DVC_ROOT: also for a queued or temporary
    DVC experiment, whose copy of the repository DVC deletes), else in the working directory."""
    if os.environ.get(CHECKPOINTS):
        return Path(os.environ[CHECKPOINTS])
    return Path(os.environ[DVC_ROOT]) / "checkpoints" if os.environ.get(DVC_ROOT) else Path("checkpoints")


def launch_files(launcher_pid: int) -> tuple[Path, Path]:
    """(stopped mark, last-line file) of the launcher with this pid, on its host."""
    tmp = Path(tempfile.gettempdir())
    return tmp / f"pipeline-stopped-{launcher_pid}", tmp / f"pipeline-error-{launcher_pid}"


def time_file(launcher_pid: int) -> Path:
    """The stem of the files the ranks of this launcher's stage leave their times in (TIME_FILE)."""
    return Path(tempfile.gettempdir()) / f"pipeline-times-{launcher_pid}"


def leave_last_line(code: int, line: str) -> None:
    """Leave the stage's last line and exit code where its launcher reads them after torchrun exits
    (LAST_LINE_FILE, on the launcher's host, LAUNCH_HOST): the first process to leave one wins."""
    path = os.environ.get(LAST_LINE_FILE)
    if not path or os.environ.get(LAUNCH_HOST, socket.gethostname()) != socket.gethostname():
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # another rank's line is there already
        return
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{code}\t{line}\n")


def read_last_line(path: Path) -> tuple[int, str] | None:
    """(exit code, line) a stage left in `path` (leave_last_line), or None."""
    try:
        said = path.read_text().strip().split("\t", 1)
    except OSError:
        return None
    return (int(said[0]), said[1]) if len(said) == 2 and said[0].isdigit() and said[1] else None


def mark_stopped() -> None:
    """Tell this node's launcher that a signal stopped the stage after a checkpoint (the first process of
    the node): torchrun reports its workers' 143 as its own exit 1, and the launcher exits 143 for it."""
    if os.environ.get(STOPPED_FILE) and os.environ.get("LOCAL_RANK", "0") == "0":
        Path(os.environ[STOPPED_FILE]).touch()


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (prctl PR_SET_PDEATHSIG), so a
    stage never trains on unobserved after its launcher or torchrun was killed: SIGTERM makes it save a
    checkpoint and stop. A no-op elsewhere. Also usable as a Popen preexec_fn."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def process_start(pid: int) -> str | None:
    """When process `pid` started (field 22 of /proc/<pid>/stat: tells a reused pid from the first
    holder), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def identity() -> str:
    """This process as a lock's holder names it: "<pid> <host>"."""
    return f"{os.getpid()} {os.uname().nodename}"


def try_lock(path: Path) -> tuple[IO | None, str]:
    """Take the kernel's exclusive lock (flock) of `path` without waiting: it goes with the process, even
    one killed by SIGKILL. (open handle, "") when taken, this process's identity written in the file;
    (None, the holder's identity) when another process holds it. OSError where the filesystem has no
    locks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        return None, holder
    except OSError:
        handle.close()
        raise
    handle.seek(0)
    handle.truncate()
    handle.write(f"{identity()}\n")
    handle.flush()
    return handle, ""


def sweep_point() -> dict | None:
    """The sweep point this stage runs (pipelines.launch sets SWEEP for a sweep's point), or None."""
    text = os.environ.get(SWEEP)
    if not text:
        return None
    point = json.loads(text)
    return point if isinstance(point, dict) and {"sweep", "point", "values"} <= set(point) else None


def model_prefix(section: str) -> str:
    """The registered-model name of a stage's model (`<section>`), or of a sweep point's (`sweep_<name>-<point>`:
    a point's model is not another version of the swept stage's)."""
    point = sweep_point()
    return f"sweep_{point['sweep']}-{point['point']}" if point else section
