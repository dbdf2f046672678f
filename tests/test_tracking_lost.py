"""A tracking server lost in the middle of a stage: training never waits on it.

A real `mlflow server` behind a TCP proxy that the test switches (Proxy), in make test-system:
  - `hang`: it accepts and never answers (the requests in flight too), then answers again while the stage
    still trains: one warning naming the server within seconds, "answers again", and every step's metrics
    on the server in the end, none lost;
  - `hang` until after the stage ended, its system metrics on (MLflow's monitor thread blocked in a
    request): the stage publishes its outputs and exits 0 within PIPELINE_TRACKING_FLUSH_S (plus
    END_MARGIN_S) of publishing them, naming the file that keeps its records; `python -m
    stages.common.tracking.journal resend` sends them once the server is back: every step, the artifacts, the model
    version it could not register, the run FINISHED.
In make test, on the SQLite store: what a killed stage kept is sent once, from where it stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import MLFLOW_SERVER_ENV, TINY_MODEL, free_port, running_server, stage_env
from shared_run import BIN

# Steps of the stage: enough to outlast the hang and its recovery (it is stopped by the test once seen).
LONG_STEPS = ["train.steps=100000", "train.eval_every=0", "train.checkpoint_every=0"]
SHORT_STEPS = ["train.steps=200", "train.eval_every=100", "train.checkpoint_every=0"]
# What a stage does after publishing its outputs besides waiting for the server (its measured figures, the
# model's digest for the registry, leaving the process), on a loaded machine: its end, MLflow's threads
# blocked or not, takes at most PIPELINE_TRACKING_FLUSH_S more than this.
END_MARGIN_S = 4.0


class Proxy:
    """TCP between the stages and the MLflow server, in one of three modes: `pass`; `refuse`, as a killed
    server (open connections reset, new ones closed at once); `hang`, a server that accepts and never
    answers (nothing forwarded either way, on open connections too)."""

    def __init__(self, target: int):
        self.target, self.mode, self.pairs = target, "pass", []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, mode: str) -> None:
        self.mode = mode
        if mode == "refuse":
            for pair in self.pairs:
                for s in pair:
                    self._reset(s)
            self.pairs.clear()

    @staticmethod
    def _reset(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close with RST
            s.close()

    def _accept(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            if self.mode == "refuse":
                self._reset(conn)
                continue
            if self.mode == "hang":
                self.pairs.append((conn,))  # held open, never read
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.pairs.append((conn, upstream))
            threading.Thread(target=self._pump, args=(conn, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                while self.mode == "hang":
                    time.sleep(0.05)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import urllib.request

    state = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{state}/mlflow.db"]
    cmd += ["--artifacts-destination", str(state / "artifacts"), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--workers", "1"]

    def ready():
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return True
        except OSError:
            return False

    env = {**os.environ, **MLFLOW_SERVER_ENV}
    with running_server(cmd, state / "server.log", ready, "the MLflow server", env=env):
        yield port


def stage(tokenized: Path, out: str, proxy: Proxy, steps: list[str], **env) -> subprocess.Popen:
    env = stage_env(
        tokenized,
        **{
            "PIPELINE_TRACKING": "on",
            "PIPELINE_CHECKPOINTS": str(tokenized / f"ckpts-{Path(out).name}"),
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{proxy.port}",
            "PIPELINE_TRACKING_FLUSH_S": "3",
            "PIPELINE_SYSTEM_METRICS": "off",
            **env,
        },
    )
    cmd = [sys.executable, "-m", "stages.pretrain", "--input", "data/tokenize", "--output", out, *TINY_MODEL, *steps]
    log = open(tokenized / f"{Path(out).name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=tokenized, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_for(what: str, check, proc: subprocess.Popen, log: Path, timeout_s: float = 240):
    """Poll `check` until it returns something true; fail naming `what`, with the stage's log."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return found


def steps_logged(client, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


def stage_run(client, since_ms: int):
    """The MLflow run of the pretrain stage started after `since_ms`, once the server has it."""
    experiment = client.get_experiment_by_name("pipeline")
    if experiment is None:
        return None
    runs = client.search_runs(
        [experiment.experiment_id], "tags.stage = 'pretrain'", order_by=["attributes.start_time DESC"], max_results=1
    )
    return runs[0] if runs and runs[0].info.start_time >= since_ms else None


@contextlib.contextmanager
def training_beside(tokenized: Path, server: int, out: str, steps: list[str], **env):
    """A pretrain stage writing `out` (with `env`), tracked through a Proxy to the server, once its run has
    metrics there: yields (client, proxy, log, process, run); the process is killed if the test leaves it
    running."""
    import mlflow

    client = mlflow.MlflowClient(f"http://127.0.0.1:{server}")
    proxy = Proxy(server)
    log = tokenized / f"{Path(out).name}.log"
    since = int(time.time() * 1000)
    proc = stage(tokenized, out, proxy, steps, **env)
    try:
        run = wait_for("the stage's run on the server", lambda: stage_run(client, since), proc, log)
        wait_for("its first metrics", lambda: steps_logged(client, run.info.run_id), proc, log)
        yield client, proxy, log, proc, run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.long  # (make test-system: a minute each of a stage beside a real server)
def test_a_server_that_hangs_then_returns_loses_nothing_and_holds_nothing_up(tokenized, server):
    with training_beside(tokenized, server, "lost-hang", LONG_STEPS) as (client, proxy, log, proc, run):
        proxy.set("hang")
        hung_at = time.monotonic()
        wait_for("the warning", lambda: "is not taking this run's records" in log.read_text(), proc, log, 60)
        warned_after = time.monotonic() - hung_at
        assert f"the MLflow server http://127.0.0.1:{proxy.port} is not taking" in log.read_text()
        proxy.set("pass")
        wait_for("the return", lambda: "answers again" in log.read_text(), proc, log, 120)
        # (steps take seconds on a loaded machine: stop once more than 10 are on the server, not at once)
        wait_for("steps after the return", lambda: len(steps_logged(client, run.info.run_id)) > 10, proc, log)
        proc.send_signal(signal.SIGTERM)  # the stage stops (its run KILLED) after sending what it kept
        assert proc.wait(120) == 143, log.read_text()[-3000:]
    logged = steps_logged(client, run.info.run_id)
    assert logged == list(range(1, len(logged) + 1)) and len(logged) > 10, f"steps lost: {logged[:20]}..."
    assert client.get_run(run.info.run_id).info.status == "KILLED"
    assert not list((tokenized / "logs/mlflow-unsent").glob("*.jsonl"))
    print(f"warned {warned_after:.1f} s after the server hung; {len(logged)} steps on the server")


@pytest.mark.long
def test_a_server_lost_until_the_end_gets_the_records_later(tokenized, server):
    # Its artifacts in data/, where a stage's outputs are: records kept on disk are sent from there only.
    out, flush_s = "data/lost-end", 8.0
    env = {
        "PIPELINE_TRACKING_FLUSH_S": str(flush_s),
        "PIPELINE_SYSTEM_METRICS": "on",
        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1",  # (its thread asks the server every second)
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "600",  # ... and waits for its answer until the stage ends
    }
    published = tokenized / out / "model/model.safetensors"
    with training_beside(tokenized, server, out, SHORT_STEPS, **env) as (client, proxy, log, proc, run):
        proxy.set("hang")
        wait_for("the published outputs", lambda: published.is_file() or proc.poll() is not None, proc, log, 600)
        published_at = time.monotonic()
        assert proc.wait(600) == 0, log.read_text()[-3000:]
        ended_s = time.monotonic() - published_at
    assert ended_s <= flush_s + END_MARGIN_S, (
        f"the stage exited {ended_s:.1f} s after publishing its outputs, with PIPELINE_TRACKING_FLUSH_S={flush_s}"
    )
    lines = log.read_text()
    assert "is not taking this run's records" in lines and "did not reach" in lines, lines[-3000:]
    assert "the model version(s) are registered when the run's kept records are sent" in lines
    assert published.is_file(), "the outputs are published"
    (kept,) = (tokenized / "logs/mlflow-unsent").glob(f"{run.info.run_id}.jsonl")
    assert str(kept) in lines
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    print(f"the stage exited {ended_s:.1f} s after publishing its outputs (PIPELINE_TRACKING_FLUSH_S={flush_s})")
    proxy.set("pass")
    env = stage_env(tokenized, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{proxy.port}")
    sent = subprocess.run(
        [sys.executable, "-m", "stages.common.tracking.journal", "resend"],
        cwd=tokenized,
        env=env,
        capture_output=True,
        text=True,
    )
    assert sent.returncode == 0 and f"kept in {kept}" in sent.stderr, sent.stdout + sent.stderr
    assert steps_logged(client, run.info.run_id) == list(range(1, 201))
    finished = client.get_run(run.info.run_id)
    assert finished.info.status == "FINISHED" and "val_loss" in finished.data.metrics
    assert {"meta.json", "plots", "environment"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    # the model version the stage could not register, registered from the kept records
    (version,) = client.search_model_versions(f"name = 'pretrain' and run_id = '{run.info.run_id}'")
    assert finished.data.tags["registered_model.pretrain"] == version.version and "dvc_md5" in version.tags
    assert not kept.exists()


def test_kept_records_are_sent_once_from_where_their_writer_stopped(tmp_path, monkeypatch):
    """What a killed stage left in its unsent file: the records after its last `sent` mark go out, a line
    cut short by the kill is passed over, a model version sent twice is registered once, and a file whose
    writer still runs is left to it."""
    import fcntl

    import mlflow

    from stages.common import contract, registry, runtime
    from stages.common.config import UserError
    from stages.common.tracking import journal, runs

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("PIPELINE_RUN_ID", raising=False)
    (tmp_path / "model").mkdir()
    (tmp_path / "model/weights.bin").write_bytes(b"\0" * 64)
    record = registry.version_record("tiny", tmp_path / "model", {"lineage": "x"}, "a model")
    with runs.start_run("probe", {}, "", runtime.Runtime(0, 1, 0, 1, None)) as tracker:
        tracker.register(record)
        tracker.register(record)  # (as a resend after a kill would)
        run_id = tracker.run_id
    client = mlflow.MlflowClient(uri)
    assert len(client.search_model_versions("name = 'tiny'")) == 1
    assert not (tmp_path / journal.UNSENT).exists(), "a stage whose records all went out leaves no file"

    # A file as a killed writer leaves it (its lines signed as a stage signs them): `a` sent and marked, `b`
    # not, then half a line.
    kept = tmp_path / journal.UNSENT / f"{run_id}.jsonl"
    kept.parent.mkdir(parents=True)
    root = contract.workspace()
    seal = journal.Seal(journal.journal_key(root), run_id, root)
    lines = [{"kind": "header", "run_id": run_id, "uri": uri, "root": str(root)}]
    lines += [{"kind": "metrics", "values": {"a": 1.0}, "step": 1, "time": 1}]
    head = b"".join(map(seal.line, lines))
    lines = [{"kind": "sent", "upto": len(head)}, {"kind": "metrics", "values": {"b": 2.0}, "step": 1, "time": 1}]
    kept.write_bytes(head + b"".join(map(seal.line, lines)) + b'{"kind": "metr')
    with open(kept, "rb") as live:  # its writer still running: not a leftover
        fcntl.flock(live, fcntl.LOCK_EX)
        assert journal.leftover_files(tmp_path, uri) == []
        with pytest.raises(UserError, match="being written by a running stage"):
            journal.resend(kept)
    assert journal.leftover_files(tmp_path, uri) == [kept]
    assert journal.resend(kept) == 1 and not kept.exists()
    metrics = client.get_run(run_id).data.metrics
    assert metrics.get("b") == 2.0 and "a" not in metrics


def test_the_end_of_a_stage_waits_the_flush_time_in_all_whatever_mlflow_is_blocked_on(tmp_path, monkeypatch):
    """A server that never answers, and MLflow's system-metrics monitor blocked in a request: the stage's
    end (the registry's flush, the last system metrics, the run's end) returns within
    PIPELINE_TRACKING_FLUSH_S, not one flush time for each wait; the records stay in the unsent file."""
    import json

    from stages.common import runtime
    from stages.common.tracking import runs
    from stages.common.tracking.sender import HTTP_DEFAULTS, Sender
    from stages.common.tracking.tracker import RunTracker

    hung = threading.Event()  # set when the test ends: the blocked threads return

    class HungClient:
        def __getattr__(self, name):
            return lambda *args, **kwargs: hung.wait()

    class HungMonitor:  # MLflow's SystemMetricsMonitor, whose thread waits on the server
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            pass

        def finish(self):
            hung.wait()

    flush_s = 2.0
    monkeypatch.setenv("PIPELINE_TRACKING_FLUSH_S", str(flush_s))
    monkeypatch.setenv("PIPELINE_SYSTEM_METRICS", "on")
    for key, value in HTTP_DEFAULTS.items():  # (node_metrics sets them in the environment)
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("mlflow.system_metrics.system_metrics_monitor.SystemMetricsMonitor", HungMonitor)
    sender = Sender(HungClient(), "r1", "http://127.0.0.1:9", tmp_path, {})
    tracker = RunTracker("r1", sender)
    try:
        with runs.node_metrics(tracker, runtime.Runtime(0, 1, 0, 1, None)):
            tracker.log_metrics({"loss": 1.0}, step=1)  # its request never answered
            ending = time.monotonic()
            assert not tracker.flush(flush_s)  # (stage.register_models)
        assert not tracker.end("FINISHED")  # (start_run)
        ended_s = time.monotonic() - ending
        kept = [json.loads(line)["kind"] for line in sender.path.read_text().splitlines()]
    finally:
        hung.set()
    assert ended_s <= flush_s + 0.5, f"the stage's end took {ended_s:.1f} s, with PIPELINE_TRACKING_FLUSH_S={flush_s}"
    assert kept == ["header", "metrics", "end"]
