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
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from stages.common import runtime
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
    """Logs to an MLflow run on rank 0; does nothing on other ranks or when no run is open."""

    def __init__(self, run_id: str | None = None):
        self.run_id = run_id

    def __bool__(self) -> bool:
        return self.run_id is not None

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if self.run_id:
            import mlflow

            mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.run_id:
            import mlflow

            if Path(path).is_dir():
                mlflow.log_artifacts(str(path), artifact_path=artifact_path)
            else:
                mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def set_tags(self, tags: dict) -> None:
        if self.run_id:
            import mlflow

            mlflow.set_tags(tags)

    def log_text(self, text: str, name: str) -> None:
        if self.run_id:
            import mlflow

            mlflow.log_text(text, name)

    def fail_from_thread(self, cause: str) -> None:
        """End the run FAILED with `cause` tagged (`failure`: hang), from another thread while the stage's
        main thread is stuck (stages.common.watchdog): the client API, not the thread-bound active run."""
        if self.run_id:
            import mlflow

            client = mlflow.MlflowClient()
            client.set_tag(self.run_id, "failure", "hang")
            client.set_tag(self.run_id, "failure_cause", cause[:5000])
            client.set_terminated(self.run_id, status="FAILED")


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


def experiment(root: Path):
    """(client, id) of the experiment EXPERIMENT, created on first use with its kind and saved view."""
    import mlflow

    uri = tracking_uri(root)
    if uri.startswith("sqlite:"):
        # MLflow makes a new SQLite store's tables when a client first opens it, which fails in a process
        # that does it beside another ("table ... already exists"): one opening at a time.
        lock_path = parent_lock(root)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            client = mlflow.MlflowClient(uri)
    else:
        client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        location = (root / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
        try:
            experiment_id = client.create_experiment(EXPERIMENT, artifact_location=location)
        except mlflow.exceptions.MlflowException:  # created meanwhile by a parallel stage
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
    client, experiment_id = experiment(root)
    lock = parent_lock(root)
    parent = _parent_run(client, experiment_id, group, lock)
    _end_parent(client, parent, label, "KILLED" if killed else "FAILED", lock)
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
        monitor = SystemMetricsMonitor(run_id, node_id=platform.node(), tracking_uri=tracking_uri())
        monitor.start()
    finished = False
    try:
        yield
        finished = True
    finally:
        if monitor is not None:
            monitor.finish()
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
    import mlflow

    root = runtime.workspace()
    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    client, experiment_id = experiment(root)
    close_orphaned_runs(client, experiment_id, stage)
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
        **(tags or {}),
    }
    # A stage run once per item (eval_perplexity@pretrain, finetune_qlora@nf4) is named with its item,
    # as the launcher passes it on.
    label = os.environ.get("PIPELINE_STAGE", "")
    run_name = label if label.partition("@")[0] == stage else stage
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, parent_run_id=parent, tags=all_tags) as run:
        mlflow.log_params({k: json.dumps(v) if isinstance(v, (list, tuple)) else v for k, v in flatten(params).items()})
        mlflow.log_text(pip_freeze(), "environment/requirements.txt")
        status = "FAILED"
        try:
            yield Tracker(run.info.run_id)
            status = "FINISHED"
        except (runtime.Stopped, KeyboardInterrupt):
            status = "KILLED"  # stopped by a signal (after a checkpoint, for a training stage): re-run it
            raise
        finally:
            mlflow.end_run(status=status)
            if parent:
                _end_parent(client, parent, run_name, status, lock)
