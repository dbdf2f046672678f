"""Losing a node: pretrain as two torchrun agents ("nodes") meeting at one c10d rendezvous, as the
launcher starts them on a cluster (here both on this machine, one process each). One node is killed
mid-run, agent and worker, by SIGKILL: the other fails within a bounded time, publishing nothing and
keeping its checkpoints; re-run on the one node left (half the world size), the stage resumes from the
newest checkpoint with the losses of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TRACKED, free_port, loss_curve, stage_env
from test_pretrain import TINY, run

from stages.common import ckpt

STEPS = ["train.steps=80", "train.checkpoint_every=20"]  # killed after step 40: half-way
FAIL_WITHIN_S = 120  # from the kill to the surviving node's exit


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def node(tokenized, port: int, ckpts, out: str, *extra: str, **env) -> subprocess.Popen:
    """One node: a torchrun agent with one process, in a session of its own (killed as a whole)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=node-loss"]
    cmd += ["--rdzv-conf=join_timeout=60", "-m", "stages.pretrain", "--input", "data/tokenize", "--output", out]
    return subprocess.Popen(
        [*cmd, *TINY, *STEPS, *extra],
        cwd=tokenized,
        env=stage_env(tokenized, PIPELINE_CHECKPOINTS=str(ckpts), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.long
@pytest.mark.parametrize("lost", ["other", "rendezvous"])
def test_a_lost_node_fails_the_stage_in_bounded_time_and_one_node_resumes(tokenized, lost):
    """`lost`: the node that hosts the rendezvous store (the allocation's first), or the other one."""
    ckpts = tokenized / f"ckpts-node-loss-{lost}"
    out_dir = f"nodes-{lost}"
    port = free_port()
    host = node(tokenized, port, ckpts, out_dir)
    time.sleep(2)  # (the first agent up hosts the rendezvous store)
    other = node(tokenized, port, ckpts, out_dir)
    second, first = (host, other) if lost == "rendezvous" else (other, host)  # second: the one killed
    try:
        deadline = time.monotonic() + 300
        while not list(ckpts.glob("pretrain/*/step-40")):  # mid-run: two checkpoints written
            assert first.poll() is None and second.poll() is None, "a node ended before the kill"
            assert time.monotonic() < deadline, "no checkpoint at step 40 within 5 minutes"
            time.sleep(0.2)
        for pid in [second.pid, *descendants(second.pid)]:  # the node is gone at once: agent and worker
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out = first.communicate(timeout=FAIL_WITHIN_S + 60)[0]
        failed_after = time.monotonic() - killed
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    print(f"lost {lost}: the surviving node failed {failed_after:.1f} s after the other was killed")
    assert first.returncode != 0, out[-3000:]
    assert failed_after < FAIL_WITHIN_S, out[-3000:]
    assert not (tokenized / out_dir).exists()  # nothing half-published
    kept = sorted(ckpts.glob("pretrain/*/step-*"), key=lambda p: int(p.name.split("-")[1]))
    newest = int(kept[-1].name.split("-")[1])
    assert newest >= 40 and ckpt.newest_intact_checkpoint(kept[-1].parent) == kept[-1]
    # One node left: half the world, resumed from the newest checkpoint.
    proc = run(tokenized, out_dir, 1, *STEPS, PIPELINE_CHECKPOINTS=str(ckpts))
    assert f"(step {newest})" in proc.stdout + proc.stderr
    resumed = loss_curve(tokenized, out_dir)
    whole = tokenized / "nodes-whole"
    if not whole.exists():
        run(tokenized, whole.name, 1, *STEPS, PIPELINE_CHECKPOINTS=str(tokenized / "ckpts-node-whole"))
    difference = float(np.max(np.abs(resumed - loss_curve(tokenized, whole.name)) / loss_curve(tokenized, whole.name)))
    print(f"lost {lost}: resumed at step {newest} on one node; largest relative loss difference {difference:.1e}")
    np.testing.assert_allclose(resumed, loss_curve(tokenized, whole.name), rtol=1e-4)


def test_each_node_logs_its_system_metrics_into_the_stages_one_run(tokenized):
    """Two torchrun agents (nodes, here on one machine, told apart by MLflow's node id): one MLflow run
    for the stage, holding each node's CPU and memory series under system/<node>/."""
    import mlflow

    uri = f"sqlite:///{tokenized / 'nodes-metrics.db'}"
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5", **TRACKED}
    port, ckpts = free_port(), tokenized / "ckpts-nodes-metrics"
    agents = []
    for i in range(2):
        agents.append(
            node(
                tokenized,
                port,
                ckpts,
                "nodes-metrics",
                # (a run lasts seconds beyond its steps: at 8 steps the nodes sent 9 and 5 samples on an
                # idle machine, more on a loaded one)
                "train.steps=8",
                "train.checkpoint_every=0",
                MLFLOW_SYSTEM_METRICS_NODE_ID=f"node{i}",
                **env,
            )
        )
        time.sleep(1)
    try:
        outs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id], "tags.stage = 'pretrain'")
    assert run.data.tags["world_size"] == "2" and run.data.tags["nodes"] == socket.gethostname()
    for n in ("node0", "node1"):
        for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes"):
            series = client.get_metric_history(run.info.run_id, f"system/{n}/{name}")
            assert series and all(m.value >= 0 for m in series), (n, name, sorted(run.data.metrics))
    assert not [k for k in run.data.metrics if k.startswith("system/") and k.split("/")[1] not in ("node0", "node1")]
