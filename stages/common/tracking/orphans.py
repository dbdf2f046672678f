"""Runs left RUNNING by a process that is gone (SIGKILL, a lost machine): found by the pid and start time
their stage tagged, and marked KILLED when the stage runs again."""

from __future__ import annotations

import os
from pathlib import Path


def proc_stat(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat ([1] is the parent pid, [19] the start time in clock ticks since
    boot); the command-name field before them may hold spaces, so split after its closing parenthesis."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_start(pid: int) -> str | None:
    """The start time of a live process (clock ticks since boot), or None: with the pid, it names one process."""
    try:
        return proc_stat(pid)[19]
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
        if pid and pid.isdigit() and process_start(int(pid)) != started:
            client.set_tag(run.info.run_id, "stopped_by", "killed: its process ended without closing the run")
            client.set_terminated(run.info.run_id, status="KILLED")
            closed.append(run.info.run_id)
    return closed
