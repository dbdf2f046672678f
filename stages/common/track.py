"""MLflow tracking: one run per stage execution, logged from rank 0 only.

Default store: `sqlite:///<repo>/mlflow.db` with artifacts in `<repo>/mlartifacts`; the
`MLFLOW_TRACKING_URI` environment variable points elsewhere (a tracking server on a cluster).

Runs of one pipeline invocation are nested under one parent run, tagged `pipeline_run=<id>`. The id is
`PIPELINE_RUN_ID` when set (the Snakefile sets it once per `snakemake` invocation and its jobs inherit
it), else derived from the `dvc repro`/`dvc exp run` process the stage runs under (its pid and start
time), else the stage run stands alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import importlib.metadata
import itertools
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

from stages.common import atomic, digest, runtime
from stages.common.config import UserError

EXPERIMENT = os.environ.get("MLFLOW_EXPERIMENT_NAME", "pipeline")
# The experiment's kind: model training, not a GenAI app. (MLflow 3.17's UI picks its views from a
# switch of its own, remembered per browser, defaulting to GenAI; the links `make mlflow-ui` prints set
# it to model training: UI_QUERY.)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
UI_QUERY = "workflowType=machine_learning"
# The runs table as `make mlflow-ui` opens it (#/experiments/<id>/runs?viewStateShareKey=training&...):
# a saved view of the MLflow UI (also in its "Views" menu), with the columns a user compares across the
# stage runs, newest first, stage runs nested under their pipeline run.
VIEW = "training"
VIEW_COLUMNS = (
    "tags.`git_commit`",
    "metrics.`loss`",
    "metrics.`val_loss`",
    "metrics.`eval_loss`",
    "metrics.`tokens_per_s`",
    "metrics.`mfu`",
    "metrics.`peak_memory_mb`",
    "metrics.`gcn_test_acc_mean`",
    "metrics.`gat_test_acc_mean`",
    "metrics.`rows_passed`",
    "metrics.`rows_failed`",
    "params.`train.steps`",
    "params.`train.lr`",
    "params.`train.strategy`",
    "params.`train.optimizer`",
    "params.`model.n_layers`",
    "params.`model.hidden_size`",
    "params.`context_length`",
    "params.`vocab_size`",
    "params.`quantization`",
)


def tracking_off() -> bool:
    """`PIPELINE_TRACKING=off`: stages log nothing to MLflow (a machine without it); outputs are unchanged."""
    value = os.environ.get("PIPELINE_TRACKING", "on").strip().lower()
    if value not in ("on", "off"):
        raise UserError(f"PIPELINE_TRACKING must be 'on' or 'off', got {value!r}")
    return value == "off"


def view_tag() -> tuple[str, str]:
    """The experiment tag holding the saved view VIEW, in the MLflow UI's format."""
    state = {"orderByKey": "attributes.start_time", "orderByAsc": False, "selectedColumns": list(VIEW_COLUMNS)}
    envelope = {"name": "Training runs", "createdAt": int(time.time() * 1000), "state": json.dumps(state)}
    return f"mlflow.sharedViewState.{VIEW}", json.dumps(envelope)


def _view_state(tag: str | None):
    try:
        return json.loads(json.loads(tag)["state"])
    except (TypeError, ValueError, KeyError):
        return None


def view_url(base: str, experiment_id: str) -> str:
    """The page of the experiment's runs table in the saved view."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW}&{UI_QUERY}"


def tracking_uri(root: Path | None = None) -> str:
    """MLFLOW_TRACKING_URI, else the repository's SQLite store (mlflow.db in runtime.workspace())."""
    root = Path(root or runtime.workspace()).resolve()
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"


CODE_ROOT = Path(__file__).resolve().parents[2]


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


def _proc_stat(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat ([1] is the parent pid, [19] the start time in clock ticks since
    boot); the command-name field before them may hold spaces, so split after its closing parenthesis."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def pipeline_run_id() -> str | None:
    """The id shared by every stage of one pipeline invocation (see the module docstring)."""
    if os.environ.get("PIPELINE_RUN_ID"):
        return os.environ["PIPELINE_RUN_ID"]
    pid = os.getppid()
    try:
        while pid > 1:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            words = [Path(a.decode(errors="replace")).name for a in argv[:4]]
            if "dvc" in words and ("repro" in words or "exp" in words):
                return "dvc-" + hashlib.sha256(f"{pid}:{_proc_stat(pid)[19]}".encode()).hexdigest()[:12]
            pid = int(_proc_stat(pid)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class Tracker:
    """Logs to an MLflow run on rank 0, through its Sender (never waiting on the server); does nothing on
    other ranks or when no run is open."""

    def __init__(self, run_id: str | None = None, sender: Sender | None = None):
        self.run_id, self.sender = run_id, sender
        self.end_by: float | None = None  # (time.monotonic()) when the stage's waits on the server stop

    def end_left(self) -> float:
        """Seconds left for the stage's end to wait on the server. Its waits (the registry's flush, the last
        system metrics, the run's last records) share PIPELINE_TRACKING_FLUSH_S, counted from the first of
        them: each returns when it is spent, whatever MLflow's own threads are blocked on."""
        if self.end_by is None:
            self.end_by = time.monotonic() + flush_s()
        return max(0.0, self.end_by - time.monotonic())

    def __bool__(self) -> bool:
        return self.run_id is not None

    @property
    def lost(self) -> str | None:
        """Why the tracking server is taken as lost, while it is."""
        return self.sender.lost if self.sender else None

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if self.run_id:
            values = {k: float(v) for k, v in metrics.items()}
            self.sender.put({"kind": "metrics", "values": values, "step": step, "time": int(time.time() * 1000)})

    def log_series(self, series: dict[str, list[float]]) -> None:
        """Curves at once: {name: [value at step 0, 1, ...]}."""
        if self.run_id:
            length = max((len(v) for v in series.values()), default=0)
            for step in range(length):
                self.log_metrics({k: v[step] for k, v in series.items() if step < len(v)}, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.run_id:
            self.sender.put({"kind": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def set_tags(self, tags: dict) -> None:
        if self.run_id:
            self.sender.put({"kind": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def log_text(self, text: str, name: str) -> None:
        if self.run_id:
            self.sender.put({"kind": "text", "text": text, "name": name})

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s`, and within the stage's end (end_left: this is one of its waits), until
        every record so far has been sent; whether it was."""
        if not self.run_id:
            return True
        deadline = time.monotonic() + min(timeout_s, self.end_left())
        while self.sender.sent < self.sender.written and self.sender.lost is None and time.monotonic() < deadline:
            self.sender.wake.set()
            time.sleep(0.05)
        return self.sender.sent >= self.sender.written and self.sender.lost is None

    def fail_from_thread(self, cause: str) -> None:
        """End the run FAILED with `cause` tagged (`failure`: hang), from another thread while the stage's
        main thread is stuck (stages.common.watchdog); sent within PIPELINE_TRACKING_FLUSH_S or kept."""
        if self.run_id:
            self.set_tags({"failure": "hang", "failure_cause": cause[:5000]})
            self.end("FAILED")

    def end(self, status: str, **fields) -> bool:
        """End the run with `status` (and `fields`, for its parent run); whether its last records reached
        the server within what is left of the stage's end (end_left). Those that did not stay in the
        unsent file, for a later send."""
        self.sender.put({"kind": "end", "status": status, "time": int(time.time() * 1000), **fields})
        return self.sender.close(self.end_left())


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _parent_run(client, experiment_id: str, group: str, lock_path: Path) -> str:
    """Find or create the parent run of invocation `group`; a file lock keeps parallel stages from
    creating two."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.pipeline_run = '{group}' and tags.pipeline_role = 'parent'",
            max_results=1,
        )
        if found:
            return found[0].info.run_id
        run = client.create_run(
            experiment_id,
            run_name=f"pipeline {group}",
            tags={"pipeline_run": group, "pipeline_role": "parent", "git_commit": git_commit()},
        )
        client.set_terminated(run.info.run_id)
        return run.info.run_id


def _end_parent(client, parent: str, stage: str, status: str, lock_path: Path) -> None:
    """The invocation's parent run after one of its stages ended: a stage that failed or was stopped
    marks it FAILED or KILLED (FAILED wins) and names itself in the tag `unfinished_stages`; a stage that
    finished leaves it FINISHED only while no stage of the invocation has done otherwise."""
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = client.get_run(parent)
        unfinished = run.data.tags.get("unfinished_stages", "")
        if status == "FINISHED":
            if not unfinished:
                client.set_terminated(parent)
            return
        worst = "FAILED" if "FAILED" in (status, run.info.status) else status
        entry = f"{stage}:{status}"
        if entry not in unfinished.split(","):  # the stage's run, then its launcher, report the same end
            client.set_tag(parent, "unfinished_stages", ",".join(filter(None, [unfinished, entry])))
        client.set_terminated(parent, worst)


def server_problem(uri: str, timeout_s: float = 10.0) -> str | None:
    """Why the tracking server at an http(s) URI does not answer its health check, or None (also for
    local stores). MLflow's own client retries for minutes before it fails; this asks once."""
    if not uri.startswith(("http://", "https://")):
        return None
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as e:
        return f"its /health answered HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))
    return None


# A server with users (MLflow's basic-auth app) answers these for a request it refuses.
ACCESS_REFUSED = ("UNAUTHENTICATED", "PERMISSION_DENIED")


def access_refused_line(error: Exception, uri: str) -> str | None:
    """The one line for a tracking server that refuses this user (MLflow's basic-auth app: MLflow's client
    sends MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, else those of ~/.mlflow/credentials), or
    None for another failure. The user is named, the password never."""
    from mlflow.utils.credentials import read_mlflow_creds

    code = getattr(error, "error_code", None)
    user = read_mlflow_creds().username or ""  # (the variables, else ~/.mlflow/credentials)
    if code == "UNAUTHENTICATED" and not user:
        return (
            f"MLflow tracking server {uri} asks for a user: set MLFLOW_TRACKING_USERNAME and "
            f"MLFLOW_TRACKING_PASSWORD to an account of it (its admin creates one)"
        )
    if code == "UNAUTHENTICATED":
        return (
            f"MLflow tracking server {uri} refused user {user!r}: MLFLOW_TRACKING_USERNAME or "
            f"MLFLOW_TRACKING_PASSWORD is wrong"
        )
    if code == "PERMISSION_DENIED":
        return (
            f"MLflow tracking server {uri} does not let user {user!r} write to experiment {EXPERIMENT!r}: "
            f"its admin grants EDIT on it, or use an account that has it"
        )
    return None


@contextlib.contextmanager
def access_checked(uri: str):
    """Inside the block, a request the tracking server refuses for this user is a UserError naming why."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as e:
        line = access_refused_line(e, uri)
        if line is None:
            raise
        raise UserError(line) from None


def _process_start(pid: int) -> str | None:
    """The start time of a live process (clock ticks since boot), or None: with the pid, it names one process."""
    try:
        return _proc_stat(pid)[19]
    except (OSError, IndexError):
        return None


def pid_space() -> str:
    """Where a pid means one process: this boot of this machine and this pid namespace (containers on
    one host share its name but not its pids)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def close_orphaned_runs(client, experiment_id: str, stage: str) -> list[str]:
    """Mark KILLED the runs of `stage` still RUNNING although the process that opened them, in this pid
    space, is gone (SIGKILL or a lost machine leave no chance to close them). Returns their ids."""
    space = pid_space()
    if not space:
        return []
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.stage = '{stage}' and tags.pid_space = '{space}' and attributes.status = 'RUNNING'",
        max_results=100,
    )
    closed = []
    for run in found:
        pid, started = run.data.tags.get("pid"), run.data.tags.get("pid_start")
        if pid and pid.isdigit() and _process_start(int(pid)) != started:
            client.set_tag(run.info.run_id, "stopped_by", "killed: its process ended without closing the run")
            client.set_terminated(run.info.run_id, status="KILLED")
            closed.append(run.info.run_id)
    return closed


def _make_sqlite_store(path: Path) -> None:
    """Make a new SQLite store, whole or not at all. MLflow makes a store's tables one statement at a
    time, outside any transaction, so a store whose making was killed half-way fails every later
    opening ("table ... already exists"). Here the tables are made in a work folder beside `path` and the
    finished file renamed into place; a killed making leaves only that folder, which the next one
    removes (stages/common/atomic.py)."""
    from mlflow.store.db import utils

    with atomic.scratch(path) as work:
        engine = utils.create_sqlalchemy_engine(f"sqlite:///{work / path.name}")
        try:
            utils._initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(work / path.name, path)


def open_client(root: Path | None = None):
    """A client of the tracking store (`tracking_uri(root)`). A new SQLite store is made here, whole and
    once: MLflow would make its tables when a client first opens it, which fails in a process that does
    it beside another ("table ... already exists")."""
    import mlflow

    root = root or runtime.workspace()
    uri = tracking_uri(root)
    if not uri.startswith("sqlite:"):
        return mlflow.MlflowClient(uri)
    lock_path = parent_lock(root)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:  # one opening at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        store = Path(uri.removeprefix("sqlite:///"))
        if not store.exists():
            _make_sqlite_store(store)
        return mlflow.MlflowClient(uri)


def experiment(root: Path):
    """(client, id) of the experiment EXPERIMENT, created on first use with its kind and saved view."""
    import mlflow

    uri = tracking_uri(root)
    client = open_client(root)
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        location = (root / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
        try:
            experiment_id = client.create_experiment(EXPERIMENT, artifact_location=location)
        except mlflow.exceptions.MlflowException as e:  # created meanwhile by a parallel stage
            if e.error_code in ACCESS_REFUSED:
                raise
            experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    else:
        experiment_id = exp.experiment_id
    tags = {} if exp is None else exp.tags
    if tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
        client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
    key, view = view_tag()
    if _view_state(tags.get(key)) != _view_state(view):
        client.set_experiment_tag(experiment_id, key, view)
    return client, experiment_id


def parent_lock(root: Path) -> Path:
    """The file lock serializing changes to parent runs."""
    if tracking_uri(root).startswith("sqlite:"):
        return root / "mlflow.db.lock"
    return Path(tempfile.gettempdir()) / "mlflow-pipeline.lock"


def record_stage_end(label: str, code: int) -> str | None:
    """After a stage's processes exited with `code` (the launcher calls this): mark the pipeline's parent
    run FAILED (or KILLED, for exit 143 or a stop signal) as `_end_parent` does, also for a stage that
    failed before it opened its own run (bad params, a missing input), creating the parent run when
    none of the invocation's stages had. Returns the parent's id; None without a pipeline invocation,
    with tracking off, or with a tracking server that does not answer."""
    group = pipeline_run_id()
    if code == 0 or not group or tracking_off() or server_problem(tracking_uri()):
        return None
    killed = code in (143, 130, -15, -2)
    root = runtime.workspace()
    try:
        with access_checked(tracking_uri(root)):
            client, experiment_id = experiment(root)
            lock = parent_lock(root)
            parent = _parent_run(client, experiment_id, group, lock)
            _end_parent(client, parent, label, "KILLED" if killed else "FAILED", lock)
    except UserError:  # refused: the stage said so as it started, and nothing can be marked
        return None
    return parent


def system_metrics_off() -> bool:
    """`PIPELINE_SYSTEM_METRICS=off`: no per-node system metrics (the stage's own metrics are unchanged)."""
    value = os.environ.get("PIPELINE_SYSTEM_METRICS", "on").strip().lower()
    if value not in ("on", "off"):
        raise UserError(f"PIPELINE_SYSTEM_METRICS must be 'on' or 'off', got {value!r}")
    return value == "off"


@contextlib.contextmanager
def node_metrics(tracker: Tracker, rt: runtime.Runtime):
    """Every node's system metrics in the stage's one run: the first process of each node samples its
    CPU, memory, disk and network (and GPUs, through NVML, where present) with MLflow's
    SystemMetricsMonitor, named by node: `system/<hostname>/cpu_utilization_percentage`, ... Sampled
    every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds (MLflow's default: 10). Every rank enters;
    on success the run stays open until each node has sent its last sample."""
    run_id = runtime.broadcast_object(tracker.run_id if tracker else None)
    if run_id and rt.distributed:
        hosts = runtime.gather_objects(platform.node())
        tracker.set_tags({"nodes": ",".join(dict.fromkeys(hosts))})  # rank 0's tracker; a no-op elsewhere
    monitor = None
    if run_id and rt.local_rank == 0 and not system_metrics_off():
        import logging

        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        monitor = SystemMetricsMonitor(run_id, node_id=platform.node(), tracking_uri=tracking_uri())
        monitor.start()
    finished = False
    try:
        yield
        finished = True
    finally:
        if monitor is not None:  # its last samples, sent by its thread: waited for within the stage's end
            import threading

            ending = threading.Thread(target=monitor.finish, name="mlflow-system-metrics-end", daemon=True)
            ending.start()
            ending.join(tracker.end_left())
        if finished and run_id and rt.distributed:
            runtime.barrier()


@contextlib.contextmanager
def start_run(stage: str, params: dict, inputs_hash: str, rt: runtime.Runtime, tags: dict | None = None):
    """Open the stage's MLflow run on rank 0 (yield a Tracker; a silent one on other ranks).

    Tags: stage, git commit, input content hash, pipeline invocation, world size, device; params
    are the stage's params section; the environment (`pip freeze`) is an artifact.
    """
    if not rt.is_main or tracking_off():
        yield Tracker(None)
        return
    # Rank 0 only (some stages open their run on rank 0 alone); under torchrun its exit stops the others.
    problem = server_problem(tracking_uri())
    if problem:
        raise UserError(
            f"MLflow tracking server {tracking_uri()} is unreachable ({problem}); start it, point "
            f"MLFLOW_TRACKING_URI at a running one, or unset it to track to ./mlflow.db"
        )
    flush_s()  # (a bad setting stops the stage here)
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import mlflow
    from mlflow.entities import Param
    from mlflow.tracking.context.registry import resolve_tags

    root = runtime.workspace()
    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    with access_checked(uri):  # a server with users: the account and its permission, before any compute
        client, experiment_id = experiment(root)
        close_orphaned_runs(client, experiment_id, stage)
        leftovers = leftover_files(root, uri)
        group = pipeline_run_id()
        parent = None
        lock = parent_lock(root)
        if group:
            parent = _parent_run(client, experiment_id, group, lock)
        all_tags = {
            "stage": stage,
            "git_commit": git_commit(),
            "inputs_hash": inputs_hash,
            "world_size": str(rt.world_size),
            "device": str(rt.device),
            "host": platform.node(),
            # the process that owns the run: a later start finds it gone if it was killed (close_orphaned_runs)
            "pid": str(os.getpid()),
            "pid_start": _process_start(os.getpid()) or "",
            "pid_space": pid_space(),
            # kernels, and so the last digits of results, depend on these
            **{k: ",".join(v) if isinstance(v, list) else v for k, v in runtime.cpu_info().items()},
            **({"pipeline_run": group} if group else {}),
            **({"mlflow.parentRunId": parent} if parent else {}),
            **(tags or {}),
        }
        # A stage run once per item (eval_perplexity@pretrain, finetune_qlora@nf4) is named with its item,
        # as the launcher passes it on.
        label = os.environ.get("PIPELINE_STAGE", "")
        run_name = label if label.partition("@")[0] == stage else stage
        run = client.create_run(experiment_id, run_name=run_name, tags=resolve_tags(all_tags))
        run_id = run.info.run_id
        values = {k: json.dumps(v) if isinstance(v, (list, tuple)) else v for k, v in flatten(params).items()}
        items = [Param(k, str(v)) for k, v in values.items()]
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i : i + 100])
    end = {"parent": parent, "label": run_name, "lock": str(lock)}
    sender = Sender(client, run_id, uri, root, {"stage": stage}, leftovers)
    tracker = Tracker(run_id, sender)
    tracker.log_text(pip_freeze(), "environment/requirements.txt")
    status = "FAILED"
    try:
        yield tracker
        status = "FINISHED"
    except (runtime.Stopped, KeyboardInterrupt):
        status = "KILLED"  # stopped by a signal (after a checkpoint, for a training stage): re-run it
        raise
    finally:
        tracker.end(status, **end)


# ------------------------------------------------------------------ sending without holding training up
# A stage's records reach MLflow from a thread of their own, through a file on disk: training appends a
# line and goes on, whatever the server does. A server that refuses, fails or stops answering is taken as
# lost within seconds (one warning naming it); the records wait in the file, are sent when it answers
# again, and at the end the stage waits at most PIPELINE_TRACKING_FLUSH_S in all for them and for its
# system metrics (Tracker.end_left) before it exits anyway, its outputs published. A file left unsent is
# sent by the next stage of the workspace that reaches the server (or `python -m stages.common.track
# resend`), if a stage of the workspace wrote it (Seal).
UNSENT = Path("logs") / "mlflow-unsent"
STALL_S = 5.0  # a request unanswered this long: the server is taken as lost
PROBE_S = 2.0  # while lost, its health is asked this often
FLUSH_S = 30.0
# MLflow's HTTP client retries a request 7 times over minutes by default; here a request gives up sooner
# (the sender tries again on its own). A value the user set wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def flush_s() -> float:
    value = os.environ.get("PIPELINE_TRACKING_FLUSH_S", str(FLUSH_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise UserError(f"PIPELINE_TRACKING_FLUSH_S must be a number of seconds >= 0, got {value!r}")
    return seconds


def _reason(e: Exception) -> str:
    """A request's failure in a few words (MLflow's own message quotes the whole urllib3 chain)."""
    text = str(e)
    for pattern, words in (
        ("Connection refused", "connection refused"),
        ("NewConnectionError", "connection refused"),
        ("Read timed out", "no answer"),
        ("RemoteDisconnected", "connection closed by the server"),
        ("Connection reset", "connection reset"),
        ("Connection aborted", "connection closed by the server"),
    ):
        if pattern in text:
            return words
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first[:200]}"


def _say(message: str) -> None:
    print(f"tracking: {message}", file=sys.stderr, flush=True)


def _refused(e: Exception) -> bool:
    """Whether the store answered a request with a client error (HTTP 4xx: a bad value, say), which
    sending it again would meet again; a lost connection or a server error is worth another try."""
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException) and e.get_http_status_code() < 500


def send_records(
    client, run_id: str, records: list[dict], progress: list[int] | None = None, busy=None, refused=None
) -> None:
    """Send `records` (lines of an unsent file) to run `run_id` in order, metrics and tags batched;
    `progress[0]` counts the first records sent (or refused by the store: named, then passed over);
    `busy(kind)` is told the kind of each request before it goes out; `refused(record)` says why a record
    is not to be sent (printed, the record passed over), or None."""
    from mlflow.entities import Metric, RunTag

    metrics, tags = [], []
    progress = progress if progress is not None else [0]
    busy = busy or (lambda kind: None)

    def done(n: int) -> None:
        progress[0] = n

    def flush_batch(upto: int) -> None:
        busy("metrics")
        try:
            for i in range(0, max(len(metrics), len(tags)), 1000):
                client.log_batch(run_id, metrics=metrics[i : i + 1000], tags=tags[i : i + 100] if i == 0 else [])
            for i in range(100, len(tags), 100):
                client.log_batch(run_id, tags=tags[i : i + 100])
        except Exception as e:
            if not _refused(e):
                raise
            _say(f"run {run_id}: the store refused {len(metrics)} metric values and {len(tags)} tags ({_reason(e)})")
        metrics.clear()
        tags.clear()
        done(upto)

    for i, r in enumerate(records):
        kind = r["kind"]
        if kind in ("header", "sent"):
            continue
        if kind == "metrics":
            metrics.extend(Metric(k, v, r["time"], r["step"] or 0) for k, v in r["values"].items())
            continue
        if kind == "tags":
            tags.extend(RunTag(k, str(v)[:8000]) for k, v in r["tags"].items())
            continue
        flush_batch(i)
        why = refused(r) if refused else None
        if why:
            _say(why)
            done(i + 1)
            continue
        busy(kind)
        try:
            _send_one(client, run_id, r)
        except Exception as e:
            if not _refused(e):
                raise
            _say(f"run {run_id}: the store refused a record of kind {kind} ({_reason(e)})")
            if kind == "register":
                with contextlib.suppress(Exception):
                    client.set_tag(run_id, "registry_error", f"{r['name']}: {_reason(e)}"[:500])
        done(i + 1)
    flush_batch(len(records))


# ----------------------------------------------------------------------------- the model registry
def local_path(uri: str) -> Path | None:
    """The folder a file: artifact URI names, or None for other stores."""
    parsed = urlparse(uri)
    if parsed.scheme == "file" or (parsed.scheme == "" and uri.startswith("/")):
        return Path(unquote(parsed.path))
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # published files are replaced, never written in place: sharing them is safe
    except OSError:
        shutil.copy2(src, dst)  # another filesystem, or links not allowed


def store_folder(client, run_id: str, folder: Path, artifact_path: str) -> None:
    """`folder` as the artifact `artifact_path` of run `run_id`."""
    run = client.get_run(run_id)
    local = local_path(run.info.artifact_uri)
    if local is None:
        client.log_artifacts(run_id, str(folder), artifact_path)
        return
    dest = local / artifact_path
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp, copy_function=_link_or_copy)
    tmp.rename(dest)


def register_version(client, run_id: str, record: dict) -> int:
    """Register `record` (stages.common.registry.version_record: the model's folder, stored as the run's
    artifact `models/<name>`, and its lineage tags) as a new version of its model, from run `run_id`."""
    from mlflow.exceptions import MlflowException

    name, folder = record["name"], Path(record["folder"])
    # Once per run and name: a registration sent again (its writer stopped before noting it as sent)
    # finds its version.
    for found in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        return int(found.version)
    artifact_path = f"models/{name}"
    store_folder(client, run_id, folder, artifact_path)
    try:
        client.create_registered_model(name, description=record["description"])
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(
        name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags=record["tags"]
    )
    client.set_tag(run_id, f"registered_model.{name}", str(version.version))
    return int(version.version)


def _send_one(client, run_id: str, r: dict) -> None:
    kind = r["kind"]
    if kind == "text":
        client.log_text(run_id, r["text"], r["name"])
    elif kind == "artifact":
        path = Path(r["path"])
        if not path.exists():
            _say(f"run {run_id}: artifact {path} is gone; not sent")
        elif path.is_dir():
            client.log_artifacts(run_id, str(path), r["artifact_path"])
        else:
            client.log_artifact(run_id, str(path), r["artifact_path"])
    elif kind == "register":  # a model version the stage could not register while the server was lost
        folder = Path(r["folder"])
        if folder.is_dir() and digest.hash_files([folder]) == r["content"]:
            version = register_version(client, run_id, r)
            _say(f"run {run_id}: {folder} registered as {r['name']} version {version}")
        else:
            _say(f"run {run_id}: {folder} is gone or changed since the run; not registered as {r['name']}")
    elif kind == "end":
        client.set_terminated(run_id, status=r["status"], end_time=r["time"])
        if r.get("parent"):
            _end_parent(client, r["parent"], r["label"], r["status"], Path(r["lock"]))


def _read_records(fh, start: int, end: int | None = None) -> list[tuple[dict, int]]:
    """The records of an unsent file from byte `start` (to `end`), each with the offset after its line. A
    last line without its newline (a write cut short by a kill or a full disk) is left out, as is a line
    that does not parse (named)."""
    fh.seek(start)
    data = fh.read() if end is None else fh.read(end - start)
    found, offset = [], start
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        offset += len(line)
        if line.strip():
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(line)
                found.append((record, offset))
            except ValueError:
                where = f"{getattr(fh, 'name', 'an unsent file')}, byte {offset - len(line)}"
                _say(f"{where}: a damaged line passed over")
    return found


def _open_locked(path: Path, mode: str):
    """`path` opened and locked (flock, without waiting), or OSError: a live writer holds it, or it was
    removed meanwhile (sent by another process: its lock was taken on the file just unlinked)."""
    fh = open(path, mode)  # noqa: SIM115 - returned
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fh.fileno()).st_nlink == 0:
            raise FileNotFoundError(path)
    except OSError:
        fh.close()
        raise
    return fh


# ------------------------------------------------------------------ whose records an unsent file holds
# An unsent file is replayed by another process (the next stage that starts, `resend`), whose records may
# upload local files. So it is replayed only when a stage of this workspace wrote it, line by line: each
# line carries an HMAC-SHA256, keyed by the workspace's secret KEY_FILE (made by the first stage that tracks,
# readable by its owner alone), over the run id, the workspace's root and the record; its header names
# the run the file is named after and the root. Someone who can write into logs/ but cannot read KEY_FILE
# cannot forge a line, move one to another run's file or another workspace, or make a file of another run;
# they can still delete or cut a file (its records are then not sent) or put back lines a stage of this
# workspace wrote for the same run (sent again: MLflow keeps one of two equal metric points, a model
# version is registered once per run, an artifact is uploaded again from where it was). Whoever can read
# KEY_FILE can sign lines; then the second check still holds: the files a replayed record uploads must
# lie, symlinks followed, inside the workspace's OUTPUT_ROOTS.
KEY_FILE = Path(".cache") / "tracking.key"
# The workspace's folders whose files stages log as artifacts and register as models (dvc.yaml's outs).
OUTPUT_ROOTS = ("data", "measured", "reports")


class JournalRefused(UserError):
    """An unsent file that is not replayed (named, with why): none of its records are sent."""


def journal_key(root: Path, make: bool = True) -> bytes | None:
    """The secret of workspace `root` that signs its unsent files: made on first use (`make`), whole, by
    the first of the stages that start at once; None when there is none and `make` is False."""
    path = root / KEY_FILE
    if make and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # (never replaces: a key that signed a file stays)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        key = bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        key = b""
    if len(key) != 32:
        raise UserError(f"{path} is not a key a stage made; remove it (the unsent files it signed are then not sent)")
    return key


class Seal:
    """Signs and checks the lines of run `run_id`'s unsent file in workspace `root`."""

    def __init__(self, key: bytes, run_id: str, root: Path):
        self.key, self.bound = key, f"{run_id}\n{root}\n".encode()

    def _mac(self, body: str) -> str:
        return hmac.new(self.key, self.bound + body.encode(), hashlib.sha256).hexdigest()

    def line(self, record: dict) -> bytes:
        """`record` as a signed line (ASCII: non-ASCII is escaped)."""
        body = json.dumps(record, default=str, sort_keys=True)
        return (json.dumps({**json.loads(body), "mac": self._mac(body)}) + "\n").encode()

    def holds(self, record: dict) -> bool:
        """Whether `record` (a line read back) was signed by a stage of this workspace for this run."""
        mac = record.get("mac")
        body = json.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True)
        return isinstance(mac, str) and hmac.compare_digest(mac, self._mac(body))


def check_journal(path: Path, lines: list[tuple[dict, int]], root: Path) -> tuple[dict, Seal]:
    """The header and Seal of the unsent file `path` (its records: `lines`), or JournalRefused naming why:
    it is replayed only if a stage of workspace `root` wrote it for the run it is named after."""

    def refuse(why: str) -> JournalRefused:
        return JournalRefused(f"{path} not sent: {why}; see who wrote it into {UNSENT}/, then remove it")

    header = lines[0][0] if lines else {}
    if header.get("kind") != "header" or header.get("run_id") != path.stem:
        raise refuse(f"its header does not name run {path.stem}, the run the file is named after")
    if header.get("root") != str(root):
        raise refuse(f"it was written for workspace {header.get('root')}, not this one ({root})")
    key = journal_key(root, make=False)
    if key is None:
        raise refuse(f"this workspace has no {KEY_FILE} to check its lines with")
    seal = Seal(key, path.stem, root)
    for n, (record, _) in enumerate(lines, 1):
        if not seal.holds(record):
            raise refuse(f"record {n} is not signed by this workspace's stages ({KEY_FILE})")
    return header, seal


def outside_outputs(path: Path, root: Path) -> str | None:
    """Why `path` (a file, or a folder and all it holds) may not be uploaded from a replayed record: some
    part of it, links followed, lies outside the workspace's OUTPUT_ROOTS; None when it may."""
    roots = [(root / name).resolve() for name in OUTPUT_ROOTS]
    found = [path]
    if path.is_dir() and not path.is_symlink():
        for folder, dirs, files in os.walk(path):  # (a linked folder inside is listed, not entered)
            found += [Path(folder, name) for name in dirs + files]
    for item in found:
        real = item.resolve()
        if not any(real.is_relative_to(r) for r in roots):
            places = ", ".join(f"{name}/" for name in OUTPUT_ROOTS)
            return f"{item} lies outside the workspace's outputs ({places} of {root})"
    return None


class Sender:
    """The records of run `run_id` (rank 0's stage run), appended to its unsent file in workspace `root`
    (signed: Seal) and sent by a thread."""

    def __init__(self, client, run_id: str, uri: str, root: Path, header: dict, leftovers: list[Path] = ()):
        import threading

        self.client, self.run_id, self.uri, self.root = client, run_id, uri, root
        self.path = path = root / UNSENT / f"{run_id}.jsonl"
        self.seal = Seal(journal_key(root), run_id, root)
        for attempt in range(3):  # (a stage ending beside this one removes the empty folder)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.file = open(path, "ab")  # noqa: SIM115 - open for the run's life
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        fcntl.flock(self.file, fcntl.LOCK_EX)  # held while this process lives: its file is not a leftover
        self.file.write(self.seal.line({"kind": "header", "run_id": run_id, "uri": uri, "root": str(root), **header}))
        self.file.flush()
        self.sent = self.file.tell()  # (the header is not a record to send)
        self.written = self.sent
        self.lost: str | None = None  # why the server is taken as lost, while it is
        self.busy_since: float | None = None  # when the request in flight started (metrics and tags)
        self.closing = False
        self.accepting = True  # False once the run has ended: its records are all in the file
        self.leftovers = list(leftovers)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mlflow-sender", daemon=True)
        self.thread.start()
        self.watch = threading.Thread(target=self._watch, name="mlflow-sender-watch", daemon=True)
        self.watch.start()

    def put(self, record: dict) -> None:
        """Append one record (never waits on the server)."""
        if self.accepting:
            self._append(record)

    def _append(self, record: dict) -> None:
        line = self.seal.line(record)
        with self.lock:
            if self.file.closed:
                return
            self.file.write(line)
            self.file.flush()
            self.written = self.file.tell()
        self.wake.set()

    def _lose(self, why: str) -> None:
        with self.lock:
            first, self.lost = self.lost is None, self.lost or why
        if first:
            _say(
                f"the MLflow server {self.uri} is not taking this run's records ({why}); training goes on, "
                f"the records wait in {self.path} and are sent when it answers"
            )

    def _watch(self) -> None:
        while not self.file.closed:
            with self.lock:
                started = self.busy_since
                stalled = started is not None and time.monotonic() - started > STALL_S and self.lost is None
            if stalled:
                self._lose(f"no answer for {STALL_S:.0f} s")
            time.sleep(0.5)

    def _unsent(self) -> list[tuple[dict, int]]:
        with self.lock:
            end = self.written
        with open(self.path, "rb") as fh:
            found = _read_records(fh, self.sent, end)
        for i, (record, at) in enumerate(found):
            if not self.seal.holds(record):  # appended by another writer: never sent, passed as if it were
                _say(f"{self.path}, the line ending at byte {at}: not written by this run; passed over")
                found[i] = ({"kind": "sent", "upto": at}, at)
        return found

    def _advance(self, pending: list[tuple[dict, int]], n: int) -> None:
        """The first `n` of `pending` are sent: noted in the file, where a later resend starts."""
        if n == 0:
            return
        if any(r["kind"] != "sent" for r, _ in pending[:n]):
            self._append({"kind": "sent", "upto": pending[n - 1][1]})
        self.sent = pending[n - 1][1]

    def _busy(self, kind: str | None) -> None:
        """Note a request in flight (or none): a batch of metrics and tags unanswered for STALL_S means a
        lost server; an upload (an artifact, a model) may take longer and fails by its own time-outs."""
        with self.lock:
            self.busy_since = time.monotonic() if kind in ("metrics", "tags") else None

    def _run(self) -> None:
        try:
            self._send_until_closed()
        except (OSError, ValueError):  # the file closed under it: the process is ending
            pass

    def _send_until_closed(self) -> None:
        while True:
            self.wake.wait(PROBE_S)
            self.wake.clear()
            if self.lost is not None:
                problem = server_problem(self.uri, timeout_s=PROBE_S * 2)
                if problem:
                    continue
            pending = self._unsent()
            progress = [0]
            try:
                send_records(self.client, self.run_id, [r for r, _ in pending], progress, self._busy)
                if not pending:  # (others' leftovers only when this run's own records are in)
                    while self.leftovers:
                        try:
                            resend(self.leftovers.pop(0), self.client, self.root)
                        except JournalRefused as e:
                            _say(str(e))
                        except (UserError, FileNotFoundError):  # being sent, or sent, by another stage
                            pass
            except Exception as e:  # noqa: BLE001 - kept on disk and sent again; the stage goes on
                self._advance(pending, progress[0])
                self._lose(_reason(e))
                continue
            finally:
                self._busy(None)
            self._advance(pending, len(pending))
            if self.lost is not None:
                with self.lock:
                    self.lost = None
                _say(f"the MLflow server {self.uri} answers again; the records kept meanwhile are sent")
            if self.closing and self.sent == self.written:
                return

    def close(self, timeout_s: float) -> bool:
        """The run has ended: wait up to `timeout_s` for every record to be sent; True when they were (the
        file is then removed). Else the reason is printed, and the thread goes on sending while the
        process lives, the file locked; what is left then is a leftover for a later send."""
        self.accepting = False
        self.closing = True
        self.wake.set()
        self.thread.join(timeout_s)
        done = not self.thread.is_alive() and self.sent == self.written
        if not done:
            _say(
                f"run {self.run_id}'s last records did not reach {self.uri} by the stage's end "
                f"(PIPELINE_TRACKING_FLUSH_S={flush_s():g}; {self.lost or 'still sending'}); they are kept in "
                f"{self.path}, sent by the next stage that reaches the server, or by `python -m "
                f"stages.common.track resend {self.path}`"
            )
            return False
        with self.lock:
            self.path.unlink(missing_ok=True)
            self.file.close()
        for folder in (self.path.parent, self.path.parent.parent):  # the folders, where nothing else is kept
            with contextlib.suppress(OSError):
                folder.rmdir()
        return True


def leftover_files(root: Path, uri: str) -> list[Path]:
    """Unsent files under `root` of runs of `uri` whose writers are gone (their lock is free)."""
    found = []
    for path in sorted((root / UNSENT).glob("*.jsonl")):
        try:
            with _open_locked(path, "rb") as fh:  # (the lock is released on close)
                header = json.loads(fh.readline())
        except (OSError, ValueError):
            continue  # written now by a live stage, sent meanwhile, or not a file of ours
        if isinstance(header, dict) and header.get("uri") == uri:
            found.append(path)
    return found


def resend(path: Path, client=None, root: Path | None = None) -> int:
    """Send the records of an unsent file whose writer is gone, then remove it; the number sent. Only a
    file a stage of workspace `root` (default: this one) wrote for its run is sent (check_journal, else
    JournalRefused), and its artifacts and model folders only from inside the workspace's outputs. Without
    `client`, one of the tracking server the file names, once it answers."""
    import mlflow

    root = Path(root or runtime.workspace()).resolve()
    try:
        fh = _open_locked(path, "rb+")
    except FileNotFoundError:
        raise
    except OSError:
        raise UserError(f"{path} is being written by a running stage; it sends it itself") from None
    with fh:
        lines = _read_records(fh, 0)
        header, seal = check_journal(path, lines, root)
        sent_to = header["run_id"]
        if client is None:
            problem = server_problem(header["uri"])
            if problem:
                raise UserError(f"the tracking server of {path} does not answer ({problem}); try again once it does")
            client = mlflow.MlflowClient(header["uri"])
        upto = max((r["upto"] for r, _ in lines if r["kind"] == "sent"), default=0)
        # Records after the last one noted as sent (one sent just before its writer died is sent twice:
        # MLflow keeps one of two equal metric points, and a model version is registered once per run);
        # the run's end last.
        pending = [(r, at) for r, at in lines[1:] if at > upto and r["kind"] not in ("header", "sent")]
        ordered = sorted(pending, key=lambda p: p[0]["kind"] == "end")

        def refused(record: dict) -> str | None:
            if record["kind"] not in ("artifact", "register"):
                return None
            why = outside_outputs(Path(record["path" if record["kind"] == "artifact" else "folder"]), root)
            return why and f"{path}: a record of kind {record['kind']} not sent: {why}"

        progress = [0]
        try:
            send_records(client, sent_to, [r for r, _ in ordered], progress, refused=refused)
        except BaseException:
            done = {id(r) for r, _ in ordered[: progress[0]]}
            prefix = list(itertools.takewhile(lambda p: id(p[0]) in done, pending))  # sent, in the file's order
            if prefix:
                fh.seek(0, os.SEEK_END)
                end = fh.tell()
                if lines and end > lines[-1][1]:  # a cut last line: dropped before a line is added
                    fh.truncate(lines[-1][1])
                    fh.seek(lines[-1][1])
                fh.write(seal.line({"kind": "sent", "upto": prefix[-1][1]}))
            raise
        path.unlink()
    _say(f"sent {len(pending)} records kept in {path} to run {sent_to}")
    return len(pending)


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m stages.common.track",
        description="Send the MLflow records a stage kept on disk while its tracking server was lost.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("resend", help="send unsent files (default: every one under logs/mlflow-unsent/)")
    cmd.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    files = args.files or sorted((runtime.workspace() / UNSENT).glob("*.jsonl"))
    if not files:
        print("nothing to send")
    failed = []
    for path in files:
        try:
            resend(path)
        except (UserError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            failed.append(path)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
