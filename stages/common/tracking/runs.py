"""The stage's MLflow run: opened on rank 0 with its params and tags (start_run), every node's system
metrics in it (node_metrics), ended with the stage's status; runs left open by a killed process are
closed first (orphans.py), and the run is nested under its pipeline invocation's parent run (parents.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from pathlib import Path

from stages.common import config, contract, provenance, runtime
from stages.common.config import UserError
from stages.common.tracking import datasets, journal, orphans, parents, store
from stages.common.tracking.records import say
from stages.common.tracking.sender import HTTP_DEFAULTS, Sender, flush_s
from stages.common.tracking.tracker import NullTracker, RunTracker, Tracker


def system_metrics_off() -> bool:
    """`PIPELINE_SYSTEM_METRICS=off`: no per-node system metrics (the stage's own metrics are unchanged)."""
    value = os.environ.get("PIPELINE_SYSTEM_METRICS", "on").strip().lower()
    if value not in ("on", "off"):
        raise UserError(f"PIPELINE_SYSTEM_METRICS must be 'on' or 'off', got {value!r}")
    return value == "off"


@contextlib.contextmanager
def node_metrics(tracker: RunTracker | NullTracker, rt: runtime.Runtime):
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
        monitor = SystemMetricsMonitor(run_id, node_id=platform.node(), tracking_uri=store.tracking_uri())
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


def _check_server() -> None:
    """Rank 0 only (some stages open their run on rank 0 alone); under torchrun its exit stops the others."""
    problem = store.server_problem(store.tracking_uri())
    if problem:
        raise UserError(
            f"MLflow tracking server {store.tracking_uri()} is unreachable ({problem}); start it, point "
            f"MLFLOW_TRACKING_URI at a running one, or unset it to track to ./mlflow.db"
        )
    flush_s()  # (a bad setting stops the stage here)
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _run_tags(stage: str, inputs_hash: str, rt: runtime.Runtime, group: str | None, parent: str | None) -> dict:
    return {
        "stage": stage,
        "git_commit": provenance.git_commit(),
        "inputs_hash": inputs_hash,
        "world_size": str(rt.world_size),
        "device": str(rt.device),
        "host": platform.node(),
        # the process that owns the run: a later start finds it gone if it was killed (close_orphaned_runs)
        "pid": str(os.getpid()),
        "pid_start": orphans.process_start(os.getpid()) or "",
        "pid_space": orphans.pid_space(),
        # kernels, and so the last digits of results, depend on these
        **{k: ",".join(v) if isinstance(v, list) else v for k, v in runtime.cpu_info().items()},
        **({"pipeline_run": group} if group else {}),
        **({"mlflow.parentRunId": parent} if parent else {}),
    }


def _sweep_tags(point: dict | None) -> dict:
    if not point:
        return {}
    values = {f"sweep.{key}": str(value) for key, value in point["values"].items()}
    return {"sweep": point["sweep"], "sweep.point": point["point"], **values}


def _log_params(client, run_id: str, params: dict) -> None:
    from mlflow.entities import Param

    values = {k: json.dumps(v) if isinstance(v, (list, tuple)) else v for k, v in config.flatten(params).items()}
    items = [Param(k, str(v)) for k, v in values.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])


def _open_run(stage: str, params: dict, inputs_hash: str, rt: runtime.Runtime, tags: dict, inputs) -> RunTracker:
    """The stage's new run, in the experiment and under its invocation's parent run, its params logged and
    its `inputs` (datasets.stage_inputs) recorded as datasets."""
    import mlflow
    from mlflow.tracking.context.registry import resolve_tags

    root = contract.workspace()
    uri = store.tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    with store.access_checked(uri):  # a server with users: the account and its permission, before any compute
        client, experiment_id = store.experiment(root)
        orphans.close_orphaned_runs(client, experiment_id, stage)
        leftovers = journal.leftover_files(root, uri)
        group, parent, lock = parents.pipeline_run_id(), None, store.parent_lock(root)
        if group:
            parent = parents.parent_run(client, experiment_id, group, lock)
        # A stage run once per item (eval_perplexity@pretrain, finetune_qlora@nf4) is named with its item,
        # as the launcher passes it on.
        label = os.environ.get("PIPELINE_STAGE", "")
        point = contract.sweep_point()  # (a sweep's point: named by it, its values as tags for the compare view)
        # A sweep's point, or its comparison, is named by its stage in the DAG (sweep_lr@0.001, sweep_lr_compare).
        run_name = label if label and (label.partition("@")[0] == stage or point or tags.get("sweep")) else stage
        all_tags = {**_run_tags(stage, inputs_hash, rt, group, parent), **_sweep_tags(point), **tags}
        run_id = client.create_run(experiment_id, run_name=run_name, tags=resolve_tags(all_tags)).info.run_id
        _log_params(client, run_id, params)
    end = {"parent": parent, "label": run_name, "lock": str(lock)}
    sender = Sender(client, run_id, uri, root, {"stage": stage}, leftovers)
    _record_inputs(sender, run_id, datasets.stage_inputs(inputs))
    return RunTracker(run_id, sender, end)


def _record_inputs(sender: Sender, run_id: str, paths: list[str]) -> None:
    """The run's data inputs as datasets (their paths relative to the folder the stage runs in, as DVC's)."""
    try:
        record = datasets.inputs_record(paths, Path.cwd())
    except Exception as e:  # noqa: BLE001 - a record of the inputs; the stage reads them itself
        sender.put({"kind": "tags", "tags": {"inputs_error": f"{type(e).__name__}: {e}"[:500]}})
        say(f"run {run_id}: its inputs are not recorded as datasets ({type(e).__name__}: {e})")
        return
    if record:
        sender.put(record)


@contextlib.contextmanager
def start_run(stage: str, params: dict, inputs_hash: str, rt: runtime.Runtime, tags: dict | None = None, inputs=()):
    """Open the stage's MLflow run on rank 0 (yield a RunTracker; a NullTracker on other ranks), and end it
    as the block ends: FINISHED, KILLED (a stop signal: re-run it) or FAILED, with the exception tagged
    (`failure`, its type; `failure_cause`, type and message).

    Tags: stage, git commit, input content hash, pipeline invocation, world size, device; params
    are the stage's params section; the environment (`pip freeze`) is an artifact; its data inputs are
    datasets with their DVC hashes (the launcher's list of its DAG's deps, else the paths `inputs`).
    """
    if not rt.is_main or store.tracking_off():
        yield NullTracker()
        return
    _check_server()
    tracker: Tracker = _open_run(stage, params, inputs_hash, rt, tags or {}, inputs)
    tracker.log_text(provenance.pip_freeze(), "environment/requirements.txt")
    status = "FAILED"
    try:
        yield tracker
        status = "FINISHED"
    except (runtime.Stopped, KeyboardInterrupt):
        status = "KILLED"  # stopped by a signal (after a checkpoint, for a training stage): re-run it
        raise
    except Exception as e:  # (the run ends FAILED with its cause, as the stage's last line says it)
        tracker.set_tags({"failure": type(e).__name__, "failure_cause": f"{type(e).__name__}: {e}"[:5000]})
        raise
    finally:
        tracker.end(status)
