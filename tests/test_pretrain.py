"""pretrain on real tokens: DDP = FSDP = one process, outputs load in transformers, exact resume, errors."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL, RunsCode, craft_checkpoint_item, loss_curve, run_stage

from stages import pretrain
from stages.common import ckpt, config, provenance

TINY = [
    *TINY_MODEL,
    "train.steps=8",
    "train.batch_size=8",
    "train.micro_batch_size=2",
    "train.warmup_steps=2",
    "train.eval_every=4",
    "train.eval_batches=1",
    "train.checkpoint_every=0",
    "train.log_every=2",
    "train.seed=1337",
]
# The first losses of TINY on the ci corpus, one process, fp32 CPU (update only for a deliberate change).
RECORDED_LOSSES = [6.24940824508667, 6.242489337921143, 6.190092086791992, 6.123337268829346]


def run(root, out, nproc, *extra, check=True, **env):
    return run_stage(
        "pretrain",
        ["--input", "data/tokenize", "--output", out, *TINY, *extra],
        cwd=root,
        nproc=nproc,
        check=check,
        **env,
    )


def logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def trained_here(tokenized, args: list[str]) -> dict:
    """pretrain.main(args) in this process, in the tokenized folder (what it returns)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tokenized)
        return pretrain.main(["--input", "data/tokenize", *args])


@pytest.fixture(scope="module")
def one_process(tokenized) -> dict:
    """TINY trained by one process, in tokenized/one: the model the other layouts and the resumed runs
    must train."""
    return trained_here(tokenized, ["--output", "one", *TINY])


@pytest.fixture(scope="module")
def three_steps(tokenized) -> dict:
    """3 steps of TINY in fp32, eager, in tokenized/fp32: what the compiled and the autocast runs train near."""
    return trained_here(tokenized, ["--output", "fp32", *TINY, "train.steps=3", "train.eval_every=3"])


def test_ddp_fsdp_and_one_process_train_the_same_model(tokenized, one_process):
    """The same params (a global batch of 8, micro-batches of at most 2) train the same model on 1, 2, 4
    and 8 processes: 4 micro-batches of 2 accumulated on one, 2 on each of 2, 1 on each of 4, 1 of 1 on
    each of 8."""
    run(tokenized, "ddp", 2, "train.strategy=ddp")
    run(tokenized, "fsdp", 2, "train.strategy=fsdp")
    run(tokenized, "ddp4", 4, "train.strategy=ddp")
    run(tokenized, "fsdp8", 8, "train.strategy=fsdp")
    ref = np.array(one_process["history"]["loss"])
    assert ref[-1] < ref[0] - 0.1, f"loss decreases: {ref}"
    np.testing.assert_allclose(ref[: len(RECORDED_LOSSES)], RECORDED_LOSSES, rtol=1e-5)
    for out in ("ddp", "fsdp", "ddp4", "fsdp8"):
        np.testing.assert_allclose(loss_curve(tokenized, out), ref, rtol=1e-5, err_msg=out)
    # The saved models load in transformers and compute what the trained model computes.
    ids = torch.from_numpy(
        np.fromfile(tokenized / "data/tokenize/val_0000.bin", dtype=np.uint16)[:64].astype(np.int64)
    )[None]
    with torch.no_grad():
        trained = one_process["model"].eval()(input_ids=ids).logits
    torch.testing.assert_close(logits(tokenized / "one/model", ids), trained, rtol=0, atol=0)
    for out in ("ddp", "fsdp"):
        torch.testing.assert_close(logits(tokenized / f"{out}/model", ids), trained, rtol=1e-4, atol=1e-5)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenized / "fsdp/model")
    meta = json.loads((tokenized / "fsdp/meta.json").read_text())
    assert len(tok) == meta["model_config"]["vocab_size"] and meta["tokens_seen"] == 8 * 8 * 64
    assert meta["step"] == 8 and meta["final_val_loss"] is not None and "git_commit" not in meta
    assert meta["code_sha256"] == provenance.code_digest("stages.pretrain")["sha256"] and meta["packages"]["torch"]
    metrics = json.loads((tokenized / "fsdp/metrics.json").read_text())
    assert set(metrics) == {"final_val_loss"}, "the headline figures only, nothing measured"
    assert "tokens_per_s" not in json.loads((tokenized / "fsdp/figures.json").read_text())
    # What the run measured is outside its output (--measured; by default beside it).
    measured = json.loads((tokenized / "fsdp.measured.json").read_text())
    assert measured["output"] == "fsdp" and measured["tokens_per_s"] > 0 and 0 < measured["mfu"] < 1
    assert (tokenized / "fsdp/plots/loss.png").stat().st_size > 0
    # generate samples from any model folder; greedy decoding is deterministic and keeps the prompt.
    from stages import generate

    text = generate.generate(tokenized / "one/model", "ROMEO:", max_new_tokens=12, greedy=True)
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")
    assert generate.generate(tokenized / "one/model", "ROMEO:", max_new_tokens=12, greedy=True) == text


@pytest.mark.parametrize(
    "layout, save",
    [
        (["train.strategy=fsdp", "train.reduce_dtype=bf16", "train.precision=fp16"], "async"),
        (["train.strategy=ddp", "train.reduce_dtype=fp16", "train.optimizer=adamw8bit"], "sync"),
    ],
    ids=["fsdp-fp16-async", "ddp-adamw8bit-sync"],
)
def test_resume_after_kills_equals_an_uninterrupted_run(tokenized, layout, save):
    """FSDP with fp16 autocast, whose gradient scaler is part of the checkpoint (gradients reduce-scattered
    in bf16), and DDP with 8-bit optimizer states (gradients all-reduced in fp16). Asynchronous checkpoints
    (written while training goes on) are killed in step 7, with step 6's save in flight and unpublished;
    synchronous ones in the middle of writing step 6's. The uninterrupted run saves the other way."""
    ckpt_root = tokenized / f"ckpts-{layout[-1]}"
    env = {"PIPELINE_CHECKPOINTS": str(ckpt_root)}
    args = [*layout, "train.checkpoint_every=2", f"train.async_checkpoint={save == 'async'}"]
    whole, resumed = f"whole-{layout[-1]}", f"resumed-{layout[-1]}"
    run(tokenized, whole, 2, *args, f"train.async_checkpoint={save != 'async'}", **env)
    assert not list(ckpt_root.glob("pretrain/*/step-*")), "a finished run removes its checkpoints"
    fault = {"async": "PIPELINE_FAULT_SAVE_IN_FLIGHT", "sync": "PIPELINE_FAULT_IN_CHECKPOINT"}[save]
    proc = run(tokenized, resumed, 2, *args, check=False, **{fault: "6"}, **env)
    assert proc.returncode != 0
    # step-2 and step-4 are complete and hold the state of their own step
    kept = sorted(p.name for p in ckpt_root.glob("pretrain/*/*"))
    assert "step-4" in kept and "step-6" not in kept and all(n.startswith(("step-", ".step-")) for n in kept)
    assert any(n.startswith(".step-6.tmp-") for n in kept), "killed while step 6's checkpoint was written"
    (step4,) = ckpt_root.glob("pretrain/*/step-4")
    extra = torch.load(step4 / "extra.pt", weights_only=True)
    assert extra["step"] == 4 and extra["history"]["step"] == [1, 2, 3, 4] and ckpt.checkpoint_problem(step4) is None
    if "train.precision=fp16" in layout:
        assert extra["grad_scaler"]["scale"] > 1
    proc = run(tokenized, resumed, 2, *args, **env)
    assert "resuming from" in proc.stdout + proc.stderr and "step 4" in proc.stdout + proc.stderr
    np.testing.assert_array_equal(loss_curve(tokenized, resumed), loss_curve(tokenized, whole))
    from safetensors.torch import load_file

    a = load_file(tokenized / whole / "model/model.safetensors")
    b = load_file(tokenized / resumed / "model/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_checkpoints_and_the_rerun_resumes(tokenized):
    import signal
    import subprocess
    import sys
    import time

    from conftest import stage_env

    ckpt_root = tokenized / "ckpts-term"
    env = stage_env(tokenized, PIPELINE_CHECKPOINTS=str(ckpt_root))
    cmd = [
        sys.executable,
        "-m",
        "stages.pretrain",
        "--input",
        "data/tokenize",
        "--output",
        "term",
        *TINY,
        "train.steps=400",
        "train.eval_every=0",
    ]
    log = tokenized / "term.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=tokenized, env=env, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline and "train:" not in log.read_text() and proc.poll() is None:
            time.sleep(0.2)  # wait until training runs (the progress bar is up)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 143, log.read_text()
    saved = list(ckpt_root.glob("pretrain/*/step-*"))
    assert len(saved) == 1 and not (tokenized / "term").exists()
    step = int(saved[0].name[5:])
    assert 0 < step < 400


def test_a_diverged_loss_stops_the_run_at_its_step_and_publishes_nothing(tokenized):
    """A learning rate far too high: the loss becomes nan, and the run stops there with one error naming the
    step and the fix (exit 2, the refusal's); the checkpoints before that step stay, none of it or after,
    and there is no output."""
    ckpt_root = tokenized / "ckpts-diverged"
    proc = run(
        tokenized, "diverged", 2, "train.lr=1000", "train.checkpoint_every=1", "train.async_checkpoint=false",
        check=False, PIPELINE_CHECKPOINTS=str(ckpt_root),
    )  # fmt: skip
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    # (the line follows the progress bar's last \r)
    said = re.search(
        r"error: training diverged: the loss is (?:nan|-?inf) at step (\d+) of 8 \(train\.lr 1000.*", proc.stderr
    )
    assert said, proc.stderr[-3000:]
    step, line = int(said.group(1)), said.group(0)
    assert "lower train.lr" in line and not (tokenized / "diverged").exists()
    saved = sorted(int(p.name[5:]) for p in ckpt_root.glob("pretrain/*/step-*"))
    assert saved and max(saved) == step - 1, (saved, step)  # (the newest ones kept, the last before the nan)


def test_ctrl_c_under_the_launcher_and_torchrun_saves_a_checkpoint(tokenized):
    """Ctrl-C signals the terminal's foreground process group (the launcher and torchrun; torchrun's
    workers run in a session of their own and hear it from torchrun): both ranks finish the step, save
    a checkpoint and stop, with no KeyboardInterrupt. With an asynchronous checkpoint every step, the
    stop comes while the previous step's is in flight: it is published first, then the stop's step is
    saved synchronously."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import stage_env

    ckpt_root = tokenized / "ckpts-int"
    env = stage_env(tokenized, PIPELINE_CHECKPOINTS=str(ckpt_root), PIPELINE_NPROC_PER_NODE="2")
    cmd = [
        sys.executable,
        "-m",
        "pipelines.launch",
        "pretrain",
        "--input",
        "data/tokenize",
        "--output",
        "int",
        *TINY,
        "train.steps=400",
        "train.eval_every=0",
        "train.checkpoint_every=1",
    ]
    log = tokenized / "int.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=tokenized, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.time() + 180
        while time.time() < deadline and "train:" not in log.read_text() and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    text = log.read_text()
    # torchrun exits 1 after its workers' 143; the launcher exits 143 for it (preempted, re-run resumes)
    assert proc.returncode == 143 and "KeyboardInterrupt" not in text, (proc.returncode, text[-4000:])
    assert "SIGINT received: finishing the step, then saving" in text and "stopped by SIGINT after step" in text, text[
        -4000:
    ]
    (folder,) = (p for p in ckpt_root.glob("pretrain/*") if p.is_dir())
    saved = ckpt.checkpoints(folder)
    assert len(saved) == 2 and not (tokenized / "int").exists()
    step = int(saved[0].name[5:])
    assert 1 < step < 400 and f"stopped by SIGINT after step {step};" in text
    assert saved[1].name == f"step-{step - 1}", "the checkpoint in flight at the stop is published"
    for path, at in zip(saved, (step, step - 1), strict=True):
        assert ckpt.checkpoint_problem(path) is None, "the checkpoint is complete and intact"
        extra = torch.load(path / "extra.pt", weights_only=True)
        assert extra["step"] == at and len(extra["history"]["loss"]) == at


def _stage_processes(folder, output: str) -> list[int]:
    """Pids of the processes running a stage with `--output <output>` in `folder`."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == folder:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if b"--output" in argv and output.encode() in argv:
                    found.append(int(proc.name))
        except (OSError, ValueError):
            pass
    return found


def test_a_second_run_refuses_and_training_dies_with_its_launcher(tokenized):
    """While a run trains, the same stage with the same params and inputs refuses to start, naming the
    busy checkpoint folder. SIGKILL to the launcher's process group (torchrun's workers run in their own
    sessions) stops the workers too, and they save a checkpoint on the way out. (The first run is paused,
    every process of it, while the second starts: mid-training, its lock held, and no CPU taken.)"""
    import signal
    import subprocess
    import sys
    import time

    from conftest import stage_env

    ckpt_root = tokenized / "ckpts-kill"
    env = stage_env(tokenized, PIPELINE_CHECKPOINTS=str(ckpt_root), PIPELINE_NPROC_PER_NODE="2")
    args = [
        "--input",
        "data/tokenize",
        "--output",
        "killed",
        *TINY,
        "train.steps=5000",
        "train.eval_every=0",
        "train.checkpoint_every=0",
    ]
    log = tokenized / "killed.log"
    with open(log, "w") as fh:
        first = subprocess.Popen(
            [sys.executable, "-m", "pipelines.launch", "pretrain", *args],
            cwd=tokenized,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + 180
        while time.time() < deadline and "train:" not in log.read_text() and first.poll() is None:
            time.sleep(0.2)
        paused = _stage_processes(tokenized, "killed")
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            second = subprocess.run(
                [sys.executable, "-m", "pipelines.launch", "pretrain", *args],
                cwd=tokenized,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
        assert first.poll() is None, "the first run is still training"
        assert second.returncode != 0
        assert "is in use by another run" in second.stderr and str(ckpt_root / "pretrain") in second.stderr, (
            second.stderr
        )
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        deadline = time.time() + 120  # a guard against orphans training on, not a speed check
        while _stage_processes(tokenized, "killed") and time.time() < deadline:
            time.sleep(0.5)
    assert not _stage_processes(tokenized, "killed"), "workers outlived their launcher"
    saved = list(ckpt_root.glob("pretrain/*/step-*"))
    assert len(saved) == 1 and not (tokenized / "killed").exists(), log.read_text()[-3000:]

    assert ckpt.checkpoint_problem(saved[0]) is None


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.strategy=zero"], "pretrain.train.strategy: unknown strategy 'zero'; valid: ddp, fsdp"),
        (
            ["context_length=128"],
            "context_length \\(128\\) must be between 1 and model.max_position_embeddings \\(64\\)",
        ),
        (
            ["train.compile_mode=fast"],
            "pretrain.train.compile_mode: unknown torch.compile mode 'fast'; valid: default, ",
        ),
        (["train.precision=fp8"], "pretrain.train.precision: unknown precision 'fp8'; valid: auto, fp32, bf16, fp16"),
        (["train.reduce_dtype=fp8"], "pretrain.train.reduce_dtype: unknown dtype 'fp8'; valid: fp32, bf16, fp16"),
        (
            ["train.strategy=fsdp", "train.optimizer=adamw8bit"],
            "pretrain.train.optimizer: adamw8bit .* cannot step FSDP's sharded ones; use strategy ddp",
        ),
        (["train.strategy=fsdp", "train.offload=true"], "pretrain.train.offload: .* a single process"),
    ],
)
def test_bad_params_fail_before_training(tokenized, monkeypatch, override, message):
    monkeypatch.chdir(tokenized)
    with pytest.raises(config.UserError, match=message):
        pretrain.main(["--input", "data/tokenize", "--output", "bad", *TINY, *override])
    assert not (tokenized / "bad").exists()


def test_bad_inputs_fail_before_training(tokenized, tmp_path, monkeypatch):
    monkeypatch.chdir(tokenized)
    broken = tmp_path / "tok"
    shutil.copytree(tokenized / "data/tokenize", broken)
    meta = json.loads((broken / "meta.json").read_text())
    (broken / "meta.json").write_text(json.dumps({**meta, "vocab_size": meta["vocab_size"] + 1}))
    with pytest.raises(config.UserError, match="has 512 tokens but .*meta.json says vocab_size 513"):
        pretrain.main(["--input", str(broken), "--output", "bad", *TINY])
    (broken / "meta.json").write_text(json.dumps(meta))
    (broken / "train_0000.bin").unlink()
    with pytest.raises(config.UserError, match="token shard .*train_0000.bin is missing"):
        pretrain.main(["--input", str(broken), "--output", "bad", *TINY])
    with pytest.raises(config.UserError, match="meta.json not found: run the tokenize stage first"):
        pretrain.main(["--input", str(tmp_path / "nowhere"), "--output", "bad", *TINY])
    assert not (tokenized / "bad").exists()


def test_activation_checkpointing_changes_memory_not_losses(tokenized, monkeypatch):
    monkeypatch.chdir(tokenized)
    args = ["--input", "data/tokenize", *TINY, "train.steps=3", "train.eval_every=0"]
    plain = pretrain.main([*args, "--output", "plain"])
    assert not any(layer.gradient_checkpointing for layer in plain["model"].model.layers)
    # full: every layer recomputes its activations; selective, every 2nd: layers 0, 2, ... (2 layers here)
    for policy, checkpointed in (("full", [True, True]), ("selective", [True, False])):
        out = pretrain.main([*args, "--output", policy, f"train.activation_checkpointing={policy}"])
        assert [layer.gradient_checkpointing for layer in out["model"].model.layers] == checkpointed
        np.testing.assert_allclose(out["history"]["loss"], plain["history"]["loss"], rtol=1e-6)


def test_8bit_optimizers_train_close_to_adamw_with_a_quarter_of_its_state(tokenized, monkeypatch):
    monkeypatch.chdir(tokenized)
    args = ["--input", "data/tokenize", *TINY, "train.steps=6", "train.eval_every=0", "train.lr=0.003"]
    base = pretrain.main([*args, "--output", "adamw"])
    moments = 2 * 4 * sum(p.numel() for p in base["model"].parameters())  # two fp32 moments per parameter
    assert moments <= base["optimizer_state_bytes"] <= 1.01 * moments  # (plus a step count per tensor)
    for name in ("adamw8bit", "paged_adamw8bit"):
        out = pretrain.main([*args, "--output", name, f"train.optimizer={name}"])
        ratio = out["optimizer_state_bytes"] / base["optimizer_state_bytes"]
        # 2 bytes of moments per parameter (0.25) plus block scales, two shared 256-entry code tables,
        # and 32-bit states for the tensors under 4,096 entries (norms, k/v here); ~0.25 at larger sizes.
        assert ratio <= 0.35, (name, ratio)
        np.testing.assert_allclose(out["history"]["loss"][-1], base["history"]["loss"][-1], rtol=0.02)


def test_compiled_model_and_loss_train_like_eager(tokenized, monkeypatch, three_steps):
    monkeypatch.chdir(tokenized)
    args = ["--input", "data/tokenize", *TINY, "train.steps=3", "train.eval_every=3"]
    eager = three_steps["history"]
    compiled = pretrain.main([*args, "--output", "compiled", "train.compile=true"])["history"]
    # Fused kernels sum in another order: equal to float32 rounding, not bitwise.
    np.testing.assert_allclose(compiled["loss"], eager["loss"], rtol=1e-4)
    np.testing.assert_allclose(compiled["val_loss"], eager["val_loss"], rtol=1e-4)
    from transformers import AutoModelForCausalLM

    # The saved weights carry no compile-wrapper prefixes: every one loads, and they are the trained ones.
    want = AutoModelForCausalLM.from_pretrained(tokenized / "fp32/model").state_dict()
    got = AutoModelForCausalLM.from_pretrained(tokenized / "compiled/model").state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4)


def test_bf16_and_fp16_precisions_train_under_autocast_with_fp32_weights(tokenized, monkeypatch, three_steps):
    """precision: bf16 or fp16 (with a gradient scaler) on a CPU: autocast in that dtype, fp32 master
    weights; the losses stay near fp32's, and meta.json records the dtype and the CPU the kernels ran on
    (they decide the last digits)."""
    monkeypatch.chdir(tokenized)
    args = ["--input", "data/tokenize", *TINY, "train.steps=3", "train.eval_every=3"]
    fp32 = three_steps
    for precision in ("bf16", "fp16"):
        low = pretrain.main([*args, "--output", precision, f"train.precision={precision}"])
        assert low["history"]["loss"] != fp32["history"]["loss"], f"{precision} autocast rounds differently"
        np.testing.assert_allclose(low["history"]["loss"], fp32["history"]["loss"], rtol=2e-2)
        np.testing.assert_allclose(low["history"]["val_loss"], fp32["history"]["val_loss"], rtol=2e-2)
        assert all(p.dtype == torch.float32 for p in low["model"].parameters())
    from stages.common import runtime

    for out, dtype in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16"), ("fp16", "torch.float16")):
        meta = json.loads((tokenized / out / "meta.json").read_text())
        assert meta["compute_dtype"] == dtype and meta["cpu"] == runtime.cpu_info()
        assert meta["cpu"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_damaged_or_tampered_checkpoints_are_passed_over(tokenized, tmp_path, one_process):
    """A checkpoint whose extra.pt or one of whose DCP items would run code, or whose shard is truncated,
    is never loaded: the re-run warns naming it and resumes from the newest intact one (or starts afresh),
    and trains the uninterrupted model."""
    ckpt_root = tmp_path / "ckpts"
    env = {"PIPELINE_CHECKPOINTS": str(ckpt_root)}
    args = ("train.checkpoint_every=2",)
    whole = one_process["history"]["loss"]
    assert run(tokenized, tmp_path / "out", 1, *args, check=False, PIPELINE_FAULT_IN_CHECKPOINT="6", **env).returncode
    (folder,) = (p for p in ckpt_root.glob("pretrain/*") if p.is_dir())
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2", "step-4"]
    # step-4's extra.pt replaced by a pickle that runs code, and one of step-2's DCP items (an optimizer
    # group's lr), each with its manifest rewritten to match: neither is loaded, the run starts afresh
    marker = tmp_path / "code-ran"
    extra = torch.load(folder / "step-4/extra.pt", weights_only=True)
    torch.save({**extra, "payload": RunsCode(marker)}, folder / "step-4/extra.pt")
    from stages.common import ckpt

    ckpt.write_manifest(folder / "step-4")
    item = craft_checkpoint_item(folder / "step-2", marker)
    proc = run(tokenized, tmp_path / "out", 1, *args, check=False, PIPELINE_FAULT_IN_CHECKPOINT="6", **env)
    log = proc.stdout + proc.stderr
    assert not marker.exists(), "loading a checkpoint ran code"
    assert f"not resuming from checkpoint {folder / 'step-4'}: extra.pt does not load as plain data" in log, log
    assert f"not resuming from checkpoint {folder / 'step-2'}: item {item} in state/" in log, log
    assert not re.search(r"^resuming from", log, re.M), log
    # the re-run wrote a fresh step-4; truncate one of its shard files
    shard = sorted((folder / "step-4/state").glob("*.distcp"))[0]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    proc = run(tokenized, tmp_path / "out", 1, *args, **env)
    log = proc.stdout + proc.stderr
    assert f"not resuming from checkpoint {folder / 'step-4'}: state/{shard.name} holds" in log, log
    assert "(step 2)" in log
    np.testing.assert_allclose(loss_curve(tmp_path, "out"), whole, rtol=0, atol=5e-7)  # loss.csv keeps 6 decimals
    from safetensors.torch import load_file

    a, b = load_file(tokenized / "one/model/model.safetensors"), load_file(tmp_path / "out/model/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed run trains the same model"


def test_truncated_token_shard_fails_before_training(tokenized, tmp_path, monkeypatch):
    monkeypatch.chdir(tokenized)
    broken = tmp_path / "tok"
    shutil.copytree(tokenized / "data/tokenize", broken)
    shard = broken / "train_0000.bin"
    for size in (shard.stat().st_size - 1000, shard.stat().st_size - 1001):  # whole ids cut, then half an id
        with open(shard, "r+b") as fh:
            fh.truncate(size)
        with pytest.raises(
            config.UserError,
            match=f"pretrain: token shard .*train_0000.bin holds {size:,} bytes, but "
            ".*meta.json counts .* the shard is truncated or corrupted; re-run tokenize",
        ):
            pretrain.main(["--input", str(broken), "--output", "bad", *TINY])
    assert not (tokenized / "bad").exists()


def test_memory_mapped_stream_gives_the_windows_of_the_loaded_split(tokenized):
    """Training reads the shards through memory maps (shards.TokenStream): every slice, across shard
    borders too, and so every training batch, is the same as from the split loaded whole."""
    from stages.common import loop, shards

    folder = tokenized / "data/tokenize"
    whole, stream = shards.load_split(folder, "train"), shards.open_stream(folder, "train")
    assert len(shards.read_meta(folder)["splits"]["train"]["shards"]) > 1 and len(stream) == len(whole)
    borders = np.cumsum([len(p) for p in shards.open_split(folder, "train")])[:-1]
    for start, stop in [(0, 10), (0, len(whole)), (5, 5), (len(whole) - 3, len(whole) + 9)] + [
        (b - k, b + k) for b in borders for k in (1, 65)
    ]:
        got = stream[start:stop]
        assert got.dtype == np.int64 and np.array_equal(got, whole[start:stop]), (start, stop)
    a, b = loop.Windows(whole, 64, seed=3), loop.Windows(stream, 64, seed=3)
    for step in range(5):
        for x, y in zip(a.batch(step, 2, 6), b.batch(step, 2, 6), strict=True):
            assert torch.equal(x, y)
    with pytest.raises(TypeError):
        stream[3]


def test_a_checkpoint_of_other_code_is_resumed_only_when_asked(tokenized, tmp_path, monkeypatch, capsys):
    """A checkpoint records its stage's code hash and torch version. With other code (here: the record
    this run computes, as after an edit of stages/common/mesh.py) the stage refuses it before training,
    naming both and the two ways on; PIPELINE_RESUME=across-code resumes it and tags the MLflow run and
    the registered model; PIPELINE_RESUME=fresh sets it aside and starts over."""
    import mlflow

    from stages.common import provenance

    ckpt_root = tmp_path / "ckpts"
    args = ["train.checkpoint_every=2"]

    def killed_at_step_4():
        proc = run(tokenized, tmp_path / "out", 1, *args, check=False, PIPELINE_FAULT_IN_CHECKPOINT="4",
                   PIPELINE_CHECKPOINTS=str(ckpt_root))  # fmt: skip
        assert proc.returncode != 0
        (folder,) = (p for p in ckpt_root.glob("pretrain/*") if p.is_dir() and "set-aside" not in p.name)
        return folder

    folder = killed_at_step_4()
    written = json.loads((folder / "step-2/writer.json").read_text())
    code = provenance.code_digest("stages.pretrain")
    assert written["code_sha256"] == code["sha256"] and written["torch"] == torch.__version__
    assert written["code_files"]["stages/common/mesh.py"] == code["files"]["stages/common/mesh.py"]
    monkeypatch.chdir(tokenized)
    monkeypatch.setattr(ckpt, "CHECKPOINT_ROOT", ckpt_root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    real = ckpt.writer_record

    def edited(module):
        record = real(module)
        files = {**record["code_files"], "stages/common/mesh.py": "0" * 64}
        return {**record, "code_files": files, "code_sha256": "e" * 64}

    monkeypatch.setattr(ckpt, "writer_record", edited)
    argv = ["--input", "data/tokenize", "--output", str(tmp_path / "out"), *TINY, *args]
    message = (
        r"written by other code than this run's \(code [0-9a-f]{12} -> eeeeeeeeeeee \(stages/common/mesh.py "
        r"changed\)\).* PIPELINE_RESUME=fresh; or resume anyway: PIPELINE_RESUME=across-code"
    )
    with pytest.raises(config.UserError, match=message):
        pretrain.main(argv)
    assert not (tmp_path / "out").exists() and (folder / "step-2").is_dir()

    monkeypatch.setenv("PIPELINE_RESUME", "across-code")
    capsys.readouterr()
    pretrain.main(argv)
    assert f"resuming from {folder / 'step-2'} (step 2)" in capsys.readouterr().out
    across = f"code {code['sha256'][:12]}, torch {torch.__version__} -> code eeeeeeeeeeee, torch {torch.__version__}"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (version,) = client.search_model_versions("name = 'pretrain'")
    assert version.tags["resumed_across_code"] == across and version.tags["code_sha256"] == "e" * 64
    assert client.get_run(version.run_id).data.tags["resumed_across_code"] == across

    folder = killed_at_step_4()
    monkeypatch.setenv("PIPELINE_RESUME", "fresh")
    pretrain.main(argv)
    out = capsys.readouterr().out
    assert "checkpoints of other code set aside in" in out and "resuming from" not in out, out
    (aside,) = ckpt_root.glob(f"pretrain/{folder.name}.set-aside-*")
    assert (aside / "step-2/writer.json").is_file(), "the old checkpoints are kept"
    run_ = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id], order_by=["start_time DESC"])[
        0
    ]
    assert "resumed_across_code" not in run_.data.tags and run_.data.tags["code_sha256"] == "e" * 64


def test_a_rank_that_stops_making_progress_ends_the_run_naming_it(tokenized, tmp_path):
    """Rank 1 of 2 stops for good before step 5 (a fault injected), rank 0 waits in that step's gradient
    all-reduce. Instead of the collective timeout (1800 s), the hang watchdog ends the stage after
    train.hang_timeout_s (8 s; a step here takes well under a second, also on a busy machine): every
    rank's Python stacks in the log, rank 1 and its host named in the last line, exit 124 through the
    launcher, the MLflow run FAILED with the cause tagged, and the step-2 checkpoint intact (step 4's,
    asynchronous, was still unpublished: it is lost with the run): a re-run resumes from step 2 and finishes."""
    import socket
    import subprocess
    import sys

    import mlflow
    from conftest import TRACKED, stage_env

    from stages.common import watchdog

    shutil.copy(tokenized / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "tmp").mkdir()
    env = stage_env(
        tmp_path,
        PIPELINE_NPROC_PER_NODE="2",
        PIPELINE_CHECKPOINTS=str(tmp_path / "ckpts"),
        TMPDIR=str(tmp_path / "tmp"),
        **TRACKED,
    )
    args = ["--input", str(tokenized / "data/tokenize"), "--output", "out", *TINY, "train.checkpoint_every=2"]
    cmd = [sys.executable, "-m", "pipelines.launch", "pretrain", *args, "train.hang_timeout_s=8"]
    # (timeout: the guard against the 1800 s collective timeout this test is about)
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**env, "PIPELINE_FAULT_STALL": "1:4"}, capture_output=True, text=True, timeout=180
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == watchdog.HANG_EXIT, log[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    host = socket.gethostname()
    where = r"\(in step 5, after checkpoint step-4\)"
    assert re.match(rf"error: hang: rank 1 on {re.escape(host)} {where} made no progress for \d+ s", last), last
    assert "preflight: collectives time out after 1800 s (pretrain.train.collective_timeout_s)" in log, log[-3000:]
    rank0, rank1 = log.index("[rank 0] "), log.index("[rank 1] ")
    assert "waits in a collective; Python stacks:" in log[rank0:rank1], log[rank0:]
    assert "does not wait in a collective; Python stacks:" in log[rank1:], log[rank1:]
    assert "in injected_stall" in log[rank1:] and "in _train" in log[rank0:rank1], log[rank0:]
    assert not (tmp_path / "out").exists() and not list((tmp_path / "tmp").glob("pipeline-*"))

    (folder,) = (p for p in (tmp_path / "ckpts/pretrain").iterdir() if p.is_dir())
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2"]
    assert ckpt.checkpoint_problem(folder / "step-2") is None, "the last checkpoint is kept intact"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id], "tags.stage = 'pretrain'")
    assert run.info.status == "FAILED" and run.data.tags["failure"] == "hang", run
    assert "rank 1 on" in run.data.tags["failure_cause"]

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "(step 2)" in again.stdout + again.stderr, again.stderr[-3000:]
