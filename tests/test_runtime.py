"""Checkpoint location, atomic folders, SIGTERM handling and the distributed helpers under real gloo."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT, RunsCode, run_probe

from stages.common import atomic, checkpointer, ckpt, digest, runtime


def test_checkpoint_dir_depends_on_params_and_inputs(tmp_path):
    a = ckpt.checkpoint_dir("pretrain", {"lr": 1e-3}, "abc", root=tmp_path)
    assert a == ckpt.checkpoint_dir("pretrain", {"lr": 1e-3}, "abc", root=tmp_path)
    assert a.parent == tmp_path / "pretrain"
    assert a != ckpt.checkpoint_dir("pretrain", {"lr": 2e-3}, "abc", root=tmp_path)
    assert a != ckpt.checkpoint_dir("pretrain", {"lr": 1e-3}, "abd", root=tmp_path)


def test_hash_files_sees_content_and_names(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d/x").write_text("1")
    h1 = digest.hash_files([tmp_path / "d"])
    (tmp_path / "d/x").write_text("2")
    h2 = digest.hash_files([tmp_path / "d"])
    (tmp_path / "d/x").rename(tmp_path / "d/y")
    assert len({h1, h2, digest.hash_files([tmp_path / "d"])}) == 3


def test_atomic_dir_replaces_on_success_and_leaves_nothing_on_error(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old").write_text("old")
    with atomic.folder(final) as tmp:
        assert tmp != final and tmp.parent == tmp_path
        (tmp / "new").write_text("new")
        assert (final / "old").exists(), "the old folder stays readable until the rename"
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    with pytest.raises(RuntimeError):
        with atomic.folder(final) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("crash")
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_temporaries_of_writers_that_ended_are_removed_by_the_next_write(tmp_path):
    """A writer killed before its rename leaves `.<name>.tmp-*` (and its work folder `.<name>.work-*`)
    behind: the next write of that name, and a checkpointer's resume, remove them when their writer is known
    to be gone (this host and pid namespace, the process ended); a live writer's, another host's and an
    unnamed one stay."""
    ended = subprocess.run(
        [sys.executable, "-c", "from pathlib import Path; from stages.common import atomic; "
         "import os, sys; t = atomic.begin(sys.argv[1]); (t / 'half').write_text('x'); "
         "work = atomic.scratch(sys.argv[1]); work.__enter__(); "
         "atomic._tmp_sibling(Path(sys.argv[2])).write_text('half'); print(t.name, flush=True); os._exit(0)",
         str(tmp_path / "out"), str(tmp_path / "m.json")],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    alive = subprocess.Popen(["sleep", "60"])
    try:
        mine = atomic._tmp_sibling(tmp_path / "out").name
        others = {
            "alive": mine.replace(f".{os.getpid()}.", f".{alive.pid}.", 1),
            "other host": mine.rsplit(".", 1)[0] + ".elsewhere",
            "unnamed": ".out.tmp-abc",
            "other name": ended.replace(".out.", ".out2.", 1),
        }
        for name in others.values():
            (tmp_path / name).mkdir()
        assert (tmp_path / ended).is_dir() and len(list(tmp_path.glob(".m.json.tmp-*"))) == 1
        assert len(list(tmp_path.glob(".out.work-*"))) == 1
        with atomic.folder(tmp_path / "out") as tmp:
            (tmp / "whole").write_text("x")
        atomic.write_json(tmp_path / "m.json", {})
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {"out", "m.json", *others.values()}, left
        assert [p.name for p in atomic.sweep(tmp_path)] == [others["other name"]]
    finally:
        alive.kill()
        alive.wait()
    assert not (ckpt_folder := tmp_path / "ckpts").exists()
    ckpt_folder.mkdir()
    (ckpt_folder / others["alive"].replace(".out.", ".step-4.", 1)).mkdir()  # its writer has now ended
    saver = checkpointer.Checkpointer(ckpt_folder, every=2, steps=8, rt=runtime.init())
    import torch

    model = torch.nn.Linear(2, 2)
    assert saver.resume(model, torch.optim.SGD(model.parameters())).step == 0
    assert list(ckpt_folder.iterdir()) == []


def test_checkpoints_ignore_half_written(tmp_path):
    assert ckpt.checkpoints(tmp_path) == []
    for name in ("step-5", "step-20", ".step-30.tmp-abc", "step-x"):
        (tmp_path / name).mkdir()
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-20", "step-5"]


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch
    from pathlib import Path
    from stages.common import atomic, runtime
    rt = runtime.init()
    stop = runtime.handle_signals()
    assert rt.world_size == 2 and rt.device.type == "cpu"
    assert runtime.gather_objects(rt.rank) == [0, 1]
    assert runtime.broadcast_object("from0" if rt.is_main else None) == "from0"
    assert runtime.all_reduce_sum(torch.tensor([rt.rank + 1.0])).item() == 3.0
    out = Path(sys.argv[1])
    with atomic.folder(out, rt) as tmp:
        (tmp / f"rank{rt.rank}").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    if rt.rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    assert runtime.any_rank(bool(stop)), "a SIGTERM on one rank stops every rank"
    runtime.print0("ok", rt=rt)
    runtime.teardown()
""")


def test_runtime_under_torchrun_with_two_processes(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
            str(tmp_path / "out"),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok") == 1, "print0 prints once"


def test_single_process_runtime_has_no_group():
    rt = runtime.init()
    assert (rt.rank, rt.world_size, rt.is_main, rt.distributed) == (0, 1, True, False)
    assert runtime.gather_objects(7) == [7] and runtime.broadcast_object(3) == 3 and runtime.any_rank(False) is False
    import torch

    assert runtime.compute_dtype(torch.device("cpu")) == torch.float32


def test_manifest_tells_intact_checkpoints_from_damaged_ones(tmp_path, capsys):
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = pickle.dumps(Metadata(state_dict_metadata={}))  # DCP's index of the shards
    for step in (2, 4):
        (tmp_path / f"step-{step}/state").mkdir(parents=True)
        (tmp_path / f"step-{step}/state/.metadata").write_bytes(metadata)
        (tmp_path / f"step-{step}/state/shard.distcp").write_bytes(b"x" * 100)
        torch.save({"step": step}, tmp_path / f"step-{step}/extra.pt")
        ckpt.write_manifest(tmp_path / f"step-{step}")
    assert ckpt.manifest_problem(tmp_path / "step-4") is None
    assert ckpt.newest_intact_checkpoint(tmp_path).name == "step-4"
    (tmp_path / "step-4/state/shard.distcp").write_bytes(b"x" * 99)
    assert ckpt.manifest_problem(tmp_path / "step-4") == "state/shard.distcp holds 99 bytes, its manifest.json says 100"
    (tmp_path / "step-4/state/shard.distcp").write_bytes(b"z" * 100)
    assert "state/shard.distcp differs from its manifest.json" in ckpt.manifest_problem(tmp_path / "step-4")
    (tmp_path / "step-4/state/shard.distcp").unlink()
    assert "missing: ['state/shard.distcp']" in ckpt.manifest_problem(tmp_path / "step-4")
    assert ckpt.newest_intact_checkpoint(tmp_path).name == "step-2"
    assert f"not resuming from checkpoint {tmp_path / 'step-4'}" in capsys.readouterr().out
    (tmp_path / "step-2/manifest.json").write_text("{")
    assert ckpt.newest_intact_checkpoint(tmp_path) is None
    # Without a manifest (deleted, or never published by this code) a checkpoint is not trusted.
    (tmp_path / "step-6/state").mkdir(parents=True)
    (tmp_path / "step-6/state/.metadata").write_bytes(metadata)
    torch.save({"step": 6}, tmp_path / "step-6/extra.pt")
    assert ckpt.manifest_problem(tmp_path / "step-6").startswith("it has no manifest.json")
    assert ckpt.newest_intact_checkpoint(tmp_path) is None
    assert f"not resuming from checkpoint {tmp_path / 'step-6'}: it has no manifest.json" in capsys.readouterr().out


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_checkpointer_saves_the_steps_it_decides_on_and_resumes_the_whole_train_state(tmp_path, asynchronous):
    """Every 3 of 8 steps before the last, and the step a stop ends a run on; the newest two kept. A
    resume loads model, optimizer, steps, history, RNG and fp16's scaler as they were at the saved step.
    Asynchronous: a save is written while training goes on and published (`step-*`) only when no rank
    writes any more (here: always some, as far as each step knows) or before the next save or a stop's."""
    import copy

    import torch

    rt = runtime.init()
    saver = checkpointer.Checkpointer(tmp_path, every=3, steps=8, rt=rt, asynchronous=asynchronous)
    assert [done for done in range(1, 9) if saver.due(done, stopped=False)] == [3, 6]
    assert saver.due(5, stopped=True) and not checkpointer.Checkpointer(tmp_path, 0, 8, rt).due(6, stopped=False)

    def parts(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=2.0**seed)

    model, optimizer, scaler = parts(7)
    state, at = checkpointer.TrainState(), {}
    for done in range(1, 8):
        model(torch.randn(3, 4)).sum().backward()  # (draws from the RNG too)
        optimizer.step()
        optimizer.zero_grad()
        state.step = done
        state.history["step"].append(done)
        at[done] = copy.deepcopy((model.state_dict(), optimizer.state_dict())), torch.get_rng_state()
        saved = saver.step_done(state, model, optimizer, scaler, stopped=done == 7, writing=True)
        assert (saved is not None) == (done in (3, 6, 7))
        if asynchronous and done in (3, 6):
            assert saver.pending.step == done and not (tmp_path / f"step-{done}").exists(), "in flight, unpublished"
    assert saver.pending is None and sorted(p.name for p in tmp_path.glob("step-*")) == ["step-6", "step-7"]
    saver.close()

    for step in (7, 6):  # step 6's checkpoint holds step 6's state, though training went on while it was written
        torch.manual_seed(99)
        other, other_optimizer, other_scaler = parts(3)
        resumed = checkpointer.Checkpointer(tmp_path, 3, 8, rt).resume(other, other_optimizer, other_scaler)
        (weights, moments), rng = at[step]
        assert (resumed.step, resumed.history["step"]) == (step, list(range(1, step + 1)))
        assert torch.equal(torch.get_rng_state(), rng) and other_scaler.get_scale() == 2.0**7
        assert all(torch.equal(weights[k], v) for k, v in other.state_dict().items())
        got = other_optimizer.state_dict()["state"]
        assert all(torch.equal(moments["state"][i]["exp_avg"], got[i]["exp_avg"]) for i in got)
        shutil.rmtree(tmp_path / f"step-{step}")
    assert checkpointer.Checkpointer(tmp_path / "none", 3, 8, rt).resume(other, other_optimizer).step == 0


def test_a_checkpoint_copy_that_fails_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    """An asynchronous save whose copy to host memory fails on rank 1 alone (tests/checkpoint_failure_probe.py):
    both ranks raise, the hidden folder is removed, and their collectives stay in step."""
    (tmp_path / "ckpts").mkdir()
    run_probe("checkpoint_failure_probe.py", [tmp_path / "ckpts"], tmp_path, nproc=2)


def two_checkpoints(folder) -> runtime.Runtime:
    """Checkpoints of steps 1 and 2 of a small model and its AdamW (lr 0.1) in `folder`; the runtime."""
    import torch

    rt = runtime.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    saver = checkpointer.Checkpointer(folder, every=1, steps=4, rt=rt)
    state = checkpointer.TrainState()
    for done in (1, 2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        state.step = done
        saver.step_done(state, model, optimizer)
    return rt


def test_a_checkpoint_whose_dcp_metadata_would_run_code_is_passed_over(tmp_path, capsys):
    """DCP's state/.metadata is a pickle that torch's own reader loads with pickle.load. One crafted to run
    code, with its manifest rewritten to match (or deleted), is never unpickled: the checkpoint is named as
    damaged and the run resumes from the older one."""
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    rt = two_checkpoints(tmp_path / "ckpt")
    newest = tmp_path / "ckpt/step-2"
    metadata = ckpt.read_metadata(newest / "state/.metadata")  # what DCP writes reads as data
    metadata.planner_data = RunsCode(tmp_path / "code-ran")
    (newest / "state/.metadata").write_bytes(pickle.dumps(metadata))
    FileSystemReader(newest / "state").read_metadata()
    assert (tmp_path / "code-ran").exists(), "the crafted metadata runs code in torch's own reader"
    (tmp_path / "code-ran").unlink()

    ckpt.write_manifest(newest)
    for case in ("manifest rewritten", "manifest deleted"):
        if case == "manifest deleted":
            (newest / ckpt.MANIFEST).unlink()
        why = "it has no manifest.json" if case == "manifest deleted" else "state/.metadata does not load"
        problem = ckpt.checkpoint_problem(newest)
        assert problem.startswith(why), problem
        other = torch.nn.Linear(4, 2)
        resumed = checkpointer.Checkpointer(tmp_path / "ckpt", 1, 4, rt).resume(
            other, torch.optim.AdamW(other.parameters())
        )
        assert resumed.step == 1, case
        assert f"not resuming from checkpoint {newest}: {why}" in capsys.readouterr().out, case
        assert not (tmp_path / "code-ran").exists(), f"{case}: loading a checkpoint ran code"
    with pytest.raises(pickle.UnpicklingError, match="is not part of a checkpoint's metadata"):
        ckpt.checkpoint_reader(newest / "state").read_metadata()  # what every rank's load reads it with


def test_a_checkpoint_item_that_would_run_code_is_never_unpickled(tmp_path, capsys):
    """DCP keeps each non-tensor value of the state (an optimizer group's lr, betas, ...) as a torch.save'd
    blob in a shard, which torch's own load planner unpickles with weights_only=False. One crafted to run
    code, with the manifest rewritten to match, is named at the intactness check and passed over; loaded
    anyway, it raises instead of running; with the manifest deleted, the checkpoint is refused too."""
    import torch
    from conftest import craft_checkpoint_item
    from torch.distributed.checkpoint.api import CheckpointException

    rt = two_checkpoints(tmp_path / "ckpt")
    newest, marker = tmp_path / "ckpt/step-2", tmp_path / "code-ran"
    item = craft_checkpoint_item(newest, marker)
    problem = ckpt.checkpoint_problem(newest)
    assert problem.startswith(f"item {item} in state/__0_0.distcp does not load as plain data"), problem

    def fresh():
        other = torch.nn.Linear(4, 2)
        return other, torch.optim.AdamW(other.parameters(), lr=0.5)

    resumed = checkpointer.Checkpointer(tmp_path / "ckpt", 1, 4, rt).resume(*fresh())
    assert resumed.step == 1 and f"not resuming from checkpoint {newest}: item {item}" in capsys.readouterr().out
    with pytest.raises(CheckpointException, match="Weights only load failed"):  # every rank's load, checked or not
        checkpointer.Checkpointer._load(newest, *fresh())
    model_, optimizer_ = fresh()
    checkpointer.Checkpointer._load(tmp_path / "ckpt/step-1", model_, optimizer_)  # plain items load as before
    assert optimizer_.param_groups[0]["lr"] == 0.1
    (newest / ckpt.MANIFEST).unlink()
    assert ckpt.checkpoint_problem(newest).startswith("it has no manifest.json")
    assert checkpointer.Checkpointer(tmp_path / "ckpt", 1, 4, rt).resume(*fresh()).step == 1
    assert not marker.exists(), "a checkpoint item ran code"


def test_a_resume_across_code_travels_with_the_checkpoints_it_wrote(tmp_path, monkeypatch, capsys):
    """A run that resumed checkpoints of other code (PIPELINE_RESUME=across-code) writes checkpoints that
    record it; stopped and re-run with no opt-in, the next run resumes those (same code) and is tagged
    the same, its own checkpoints too. Setting the folder aside (PIPELINE_RESUME=fresh) ends it."""
    import dataclasses

    import torch

    from stages.common.stagerun import StageRun

    @dataclasses.dataclass(frozen=True)
    class Params:
        lr: float = 0.1

    rt = runtime.init()
    monkeypatch.setattr(ckpt, "CHECKPOINT_ROOT", tmp_path)
    folder = ckpt.checkpoint_dir("pretrain", {"lr": 0.1}, "inputs")
    this = ckpt.writer_record("stages.pretrain")
    (folder / "step-2").mkdir(parents=True)
    atomic.write_json(folder / "step-2" / ckpt.WRITER_FILE, {**this, "code_sha256": "0" * 64})
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())

    def train_to(run: StageRun, step: int) -> None:  # a run's save of `step`, the older checkpoints pruned
        saver = checkpointer.Checkpointer(run.folder.path, every=1, steps=10, rt=rt, keep=1, writer=run.folder.writer)
        saver.save(checkpointer.TrainState(step), model, optimizer)

    monkeypatch.setenv("PIPELINE_RESUME", "across-code")
    run = StageRun("pretrain", Params(), rt, runtime.StopFlag(), "inputs")
    with run.checkpoints():
        across = run.across_code
        assert across.startswith("code 000000000000, torch") and run.folder.across_code == across
        train_to(run, 4)
    assert [p.name for p in ckpt.checkpoints(folder)] == ["step-4"]
    assert ckpt.read_writer(folder / "step-4")[ckpt.ACROSS_CODE] == across
    monkeypatch.delenv("PIPELINE_RESUME")
    for step in (6, 8):  # stopped and re-run, twice, with no opt-in
        run = StageRun("pretrain", Params(), rt, runtime.StopFlag(), "inputs")
        with run.checkpoints():
            assert run.across_code == across, step
            train_to(run, step)
        assert ckpt.read_writer(folder / f"step-{step}")[ckpt.ACROSS_CODE] == across
    monkeypatch.setenv("PIPELINE_RESUME", "fresh")
    run = StageRun("pretrain", Params(), rt, runtime.StopFlag(), "inputs")
    with run.checkpoints():
        assert run.across_code is None and ckpt.ACROSS_CODE not in run.folder.writer and not ckpt.checkpoints(folder)
    assert "checkpoints resumed across code set aside in" in capsys.readouterr().out


def test_a_resume_across_code_is_tagged_on_the_run_and_its_models_whichever_opens_first(tmp_path, monkeypatch):
    """A stage that opens its MLflow run before its checkpoint folders (extend_context: one run, a folder per
    fine-tuned variant) learns of a resume across a change only once a folder opens: the run is tagged then,
    as it is when the folder opens first (pretrain, finetune_qlora), and so are the models it registers."""
    import dataclasses
    import functools

    import mlflow
    import torch

    from stages.common.stagerun import StageRun

    @dataclasses.dataclass(frozen=True)
    class Params:
        lr: float = 0.1

    rt = runtime.init()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("PIPELINE_TRACKING", "on")
    monkeypatch.setenv("PIPELINE_RESUME", "across-code")
    monkeypatch.setattr(ckpt, "CHECKPOINT_ROOT", tmp_path / "ckpts")
    other = {**ckpt.writer_record("stages.extend_context"), "code_sha256": "0" * 64}
    model = tmp_path / "out/model"
    model.mkdir(parents=True)
    torch.save({}, tmp_path / "out/weights.pt")  # (an out to record lineage of)
    (model / "config.json").write_text("{}")
    for first, variant in (("checkpoints", "a"), ("tracked", "b")):
        folder = ckpt.checkpoint_dir("extend_context", {"lr": 0.1, "variant": variant}, "inputs")
        (folder / "step-2").mkdir(parents=True)
        atomic.write_json(folder / "step-2" / ckpt.WRITER_FILE, other)
        run = StageRun("extend_context", Params(), rt, runtime.StopFlag(), "inputs")
        with contextlib.ExitStack() as stack:
            opened = {"checkpoints": functools.partial(run.checkpoints, variant=variant), "tracked": run.tracked}
            for name in (first, *({"checkpoints", "tracked"} - {first})):
                stack.enter_context(opened[name]())
            run.finish(tmp_path / "out", models={variant: model}, inputs=(tmp_path / "out/weights.pt",))
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])
    assert len(runs) == 2 and all(r.data.tags.get(ckpt.ACROSS_CODE, "").startswith("code 000000000000") for r in runs)
    for variant in "ab":
        (version,) = client.search_model_versions(f"name = 'extend_context-{variant}'")
        assert version.tags[ckpt.ACROSS_CODE].startswith("code 000000000000"), variant


def test_an_unreachable_tracking_server_is_one_clear_error(tmp_path):
    """MLflow's client retries an unreachable server for minutes; a stage asks once and stops with the URI."""
    code = (
        "from stages.common import config, runtime\nfrom stages.common.tracking import runs\n"
        "rt = runtime.Runtime(0, 1, 0, 1, None)\n"
        "try:\n"
        "    with runs.start_run('probe', {}, '', rt): print('tracked')\n"
        "except config.UserError as e: print('error:', e)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:9",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )  # a guard against the hang itself, not a speed check
    assert "error: MLflow tracking server http://127.0.0.1:9 is unreachable" in proc.stdout, proc.stdout + proc.stderr
    assert "unset it to track to ./mlflow.db" in proc.stdout


def test_a_run_left_running_by_sigkill_is_marked_killed_on_the_next_start(tmp_path, monkeypatch):
    import mlflow

    from stages.common.tracking import runs, store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = (
        "import os, signal\nfrom stages.common import runtime\nfrom stages.common.tracking import runs\n"
        "with runs.start_run('probe', {}, '', runtime.Runtime(0, 1, 0, 1, None)):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": uri}
    env.pop("PIPELINE_RUN_ID", None)
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env).returncode == -signal.SIGKILL
    client = mlflow.MlflowClient(uri)
    (killed,) = client.search_runs([client.get_experiment_by_name(store.EXPERIMENT).experiment_id])
    assert killed.info.status == "RUNNING", "SIGKILL left it open"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("PIPELINE_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    with runs.start_run("probe", {}, "", runtime.Runtime(0, 1, 0, 1, None)):
        assert client.get_run(killed.info.run_id).info.status == "KILLED"
    assert client.get_run(killed.info.run_id).data.tags["stopped_by"].startswith("killed")


def test_stages_opening_a_new_mlflow_store_at_once_all_track(tmp_path):
    """A stage killed while it made a new SQLite store's tables leaves no store; then four processes open
    it at the same moment (as stages started together on a fresh checkout do): each gets its client and
    the one experiment, none fails making the store's tables, and the killed one's work folder is gone."""
    killed = (
        "import os\nfrom pathlib import Path\nfrom mlflow.store.db import utils\n"
        "from stages.common.tracking import store\n"
        "utils._upgrade_db = lambda engine: os._exit(9)  # killed after the first tables, before the rest\n"
        "store.experiment(Path.cwd())\n"
    )
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom stages.common.tracking import store\n"
        "import mlflow.store.tracking.sqlalchemy_store  # (imported before the start: they open together)\n"
        "Path(f'ready-{sys.argv[1]}').touch()\n"
        "while not Path('go').exists():\n    time.sleep(0.01)\n"
        "client, experiment_id = store.experiment(Path.cwd())\nprint(experiment_id)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    maker = subprocess.run([sys.executable, "-c", killed], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert maker.returncode == 9, maker.stderr[-2000:]
    assert not (tmp_path / "mlflow.db").exists(), "a half-made store was left in place"
    assert list(tmp_path.glob(".mlflow.db.work-*")), "the killed maker's work folder"
    probe, pipe = [sys.executable, "-c", code], subprocess.PIPE
    procs = [
        subprocess.Popen([*probe, str(i)], cwd=tmp_path, env=env, stdout=pipe, stderr=pipe, text=True) for i in range(4)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < 4:  # every process at the start line
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a process did not start"
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1, "one experiment"
    assert not list(tmp_path.glob(".mlflow.db.work-*")), "the killed maker's work folder was removed"


def test_a_pipeline_parent_run_ends_with_the_worst_status_of_its_stages(tmp_path, monkeypatch):
    """Stages of one invocation end one after another: FINISHED while all finished, then KILLED after a
    stopped stage, then FAILED after a failed one; a stage finishing later changes none of that."""
    import mlflow

    from stages.common import runtime
    from stages.common.tracking import runs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("PIPELINE_RUN_ID", "inv-1")
    monkeypatch.delenv("PIPELINE_STAGE", raising=False)
    rt = runtime.Runtime(0, 1, 0, 1, None)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")

    def stage(name, error=None):
        with contextlib.suppress(type(error) if error else ()), runs.start_run(name, {}, "", rt):
            if error:
                raise error
        parent = client.search_runs(
            [client.get_experiment_by_name("pipeline").experiment_id], "tags.pipeline_role = 'parent'"
        )
        assert len(parent) == 1
        return parent[0].info.status, parent[0].data.tags.get("unfinished_stages")

    assert stage("tokenize") == ("FINISHED", None)
    assert stage("pretrain", runtime.Stopped()) == ("KILLED", "pretrain:KILLED")
    assert stage("train_gnn") == ("KILLED", "pretrain:KILLED")
    assert stage("report", RuntimeError("boom")) == ("FAILED", "pretrain:KILLED,report:FAILED")
    assert stage("memory_study", runtime.Stopped()) == ("FAILED", "pretrain:KILLED,report:FAILED,memory_study:KILLED")


def test_a_stage_failing_before_its_run_opens_marks_its_pipeline_failed(tmp_path):
    """Bad input stops a stage before it opens an MLflow run; its launcher marks the pipeline's parent
    run FAILED (creating it: no stage of the invocation had opened one) and names the stage once. With one
    process and under torchrun with two, the stage's one line is the last thing printed, and the exit code 2."""
    import mlflow
    from conftest import TRACKED, stage_env

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    args = ["--input", "data/missing", "--output", "data/pretrain"]
    for nproc in ("1", "2"):
        env = {**stage_env(tmp_path, PIPELINE_NPROC_PER_NODE=nproc, **TRACKED), "PIPELINE_RUN_ID": "inv-fail"}
        (tmp_path / "tmp").mkdir(exist_ok=True)
        env["TMPDIR"] = str(tmp_path / "tmp")  # where the launcher keeps its files
        proc = subprocess.run(
            [sys.executable, "-m", "pipelines.launch", "pretrain", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2, (nproc, proc.stderr[-2000:])
        assert last.startswith("error: ") and "data/missing" in last and "not found" in last, (nproc, last)
        assert not list((tmp_path / "tmp").glob("pipeline-*")), "the launcher removes its files"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("pipeline")
    runs = client.search_runs([exp.experiment_id])
    assert [r.data.tags["pipeline_role"] for r in runs] == ["parent"], "no stage run opened"
    assert runs[0].info.status == "FAILED" and runs[0].data.tags["pipeline_run"] == "inv-fail"
    assert runs[0].data.tags["unfinished_stages"] == "pretrain:FAILED"


def test_git_commit_is_dirty_for_changed_code_not_for_dvc_lock(tmp_path):
    from stages.common import provenance

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    (tmp_path / "stage.py").write_text("x = 1\n")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=tmp_path, check=True)
    head = provenance.git_commit(tmp_path)
    assert len(head) == 40
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")  # the pipeline recording its stages
    assert provenance.git_commit(tmp_path) == head
    (tmp_path / "stage.py").write_text("x = 2\n")
    assert provenance.git_commit(tmp_path) == head + "-dirty"


def test_the_hang_limit_is_a_floor_or_ten_median_steps():
    from stages.common.watchdog import FIRST_STEP_FACTOR, HANG_STEP_MULTIPLE, hang_limit

    assert hang_limit(300, []) == FIRST_STEP_FACTOR * 300, "before the first step: loading, compiling"
    assert hang_limit(300, [1.0, 2.0, 100.0]) == 300, "one slow step does not move the median"
    assert hang_limit(5, [1.0, 2.0, 100.0]) == HANG_STEP_MULTIPLE * 2.0


@pytest.mark.parametrize("refuse", [False, True], ids=["finished", "refused"])
def test_a_stage_ends_after_its_threads_exit_handlers_and_output_but_skips_the_teardown(tmp_path, refuse):
    """stage.entry ends a stage with os._exit (the teardown of torch's modules is a second of CPU): only
    after its threads that are not daemons have ended and the exit handlers have run, with everything
    printed to a pipe (block-buffered) delivered, and with the stage's exit code (2: a refused input)."""
    script = textwrap.dedent(
        f"""
        import atexit, sys, threading, time
        from pathlib import Path
        from stages.common import config, stage

        atexit.register(lambda: Path("handler").write_text("ran"))

        def main():
            threading.Thread(target=lambda: (time.sleep(0.5), Path("thread").write_text("ended"))).start()
            print("x" * 100_000)
            if {refuse}:
                raise config.UserError("the input is wrong")

        stage.entry(main)
        Path("teardown").write_text("reached")  # (exit_now ends the process before this line)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == (2 if refuse else 0), proc.stderr[-3000:]
    assert proc.stdout == "x" * 100_000 + "\n"
    assert (tmp_path / "handler").read_text() == "ran" and (tmp_path / "thread").read_text() == "ended"
    assert not (tmp_path / "teardown").exists()
    assert proc.stderr.strip().splitlines()[-1:] == (["error: the input is wrong"] if refuse else [])


def test_a_refusal_under_a_bare_torchrun_is_said_once_even_when_rank_0_is_last_to_refuse(tmp_path):
    """Every rank refuses the same input and rank 0 prints the line. Rank 1 refusing first (here rank 0 is
    3 s behind it) would have torchrun stop rank 0 before its line is out: rank 1 waits for it instead."""
    script = tmp_path / "refuse.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            from stages.common import config, stage

            def main():
                if os.environ["RANK"] == "0":
                    time.sleep(3)
                raise config.UserError("the input is wrong")

            stage.entry(main)
            """
        )
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert proc.stderr.count("error: the input is wrong") == 1, proc.stderr[-3000:]
