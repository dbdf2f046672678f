"""The pipeline's parent runs: the runs of one pipeline invocation are nested under one parent run, tagged
`pipeline_run=<id>`. The id is `PIPELINE_RUN_ID` when set (the Snakefile sets it once per `snakemake`
invocation and its jobs inherit it), else derived from the `dvc repro`/`dvc exp run` process the stage
runs under (its pid and start time), else the stage run stands alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from stages.common import contract, provenance
from stages.common.config import UserError
from stages.common.tracking import store
from stages.common.tracking.orphans import proc_stat


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
                return "dvc-" + hashlib.sha256(f"{pid}:{proc_stat(pid)[19]}".encode()).hexdigest()[:12]
            pid = int(proc_stat(pid)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def parent_run(client, experiment_id: str, group: str, lock_path: Path) -> str:
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
            tags={"pipeline_run": group, "pipeline_role": "parent", "git_commit": provenance.git_commit()},
        )
        client.set_terminated(run.info.run_id)
        return run.info.run_id


def end_parent(client, parent: str, stage: str, status: str, lock_path: Path) -> None:
    """The invocation's parent run after one of its stages ended: a stage that failed or was stopped
    marks it FAILED or KILLED (FAILED wins) and names itself in the tag `unfinished_stages`; a stage that
    finished leaves it FINISHED only while no stage of the invocation has done otherwise, but for a sweep's
    comparison, which ends its sweep's parent FINISHED (the earlier failures kept in
    `earlier_unfinished_stages`)."""
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = client.get_run(parent)
        unfinished = run.data.tags.get("unfinished_stages", "")
        if status == "FINISHED":
            if unfinished and completes_sweep(run, stage):
                # A sweep's comparison ran: every point of the sweep as now declared is current, whatever
                # failed on the way (a point since dropped or run again), which stays on record.
                client.set_tag(parent, "earlier_unfinished_stages", unfinished)
                client.delete_tag(parent, "unfinished_stages")
                unfinished = ""
            if not unfinished:
                client.set_terminated(parent)
            return
        worst = "FAILED" if "FAILED" in (status, run.info.status) else status
        entry = f"{stage}:{status}"
        if entry not in unfinished.split(","):  # the stage's run, then its launcher, report the same end
            client.set_tag(parent, "unfinished_stages", ",".join(filter(None, [unfinished, entry])))
        client.set_terminated(parent, worst)


def completes_sweep(parent_run, stage: str) -> bool:
    """Whether `stage` is the comparison of the sweep whose parent run this is (sweep_<name>_compare under
    the parent of group sweep-<name>)."""
    name = stage.removeprefix("sweep_").removesuffix("_compare")
    return stage == f"sweep_{name}_compare" and parent_run.data.tags.get("pipeline_run") == f"sweep-{name}"


def record_stage_end(label: str, code: int) -> str | None:
    """After a stage's processes exited with `code` (the launcher calls this): mark the pipeline's parent
    run FAILED (or KILLED, for exit 143 or a stop signal) as `end_parent` does, also for a stage that
    failed before it opened its own run (bad params, a missing input), creating the parent run when
    none of the invocation's stages had. Returns the parent's id; None without a pipeline invocation,
    with tracking off, or with a tracking server that does not answer."""
    group = pipeline_run_id()
    if code == 0 or not group or store.tracking_off() or store.server_problem(store.tracking_uri()):
        return None
    killed = code in (143, 130, -15, -2)
    root = contract.workspace()
    try:
        with store.access_checked(store.tracking_uri(root)):
            client, experiment_id = store.experiment(root)
            lock = store.parent_lock(root)
            parent = parent_run(client, experiment_id, group, lock)
            end_parent(client, parent, label, "KILLED" if killed else "FAILED", lock)
    except UserError:  # refused: the stage said so as it started, and nothing can be marked
        return None
    return parent
