"""pipelines.plan: every preset fits the machines it targets, a config too large is refused naming the key
to change, and the planner's shortcuts (the step traced on few layers, the train section's defaults, the
micro-batch rule) agree with what they stand for. No training: the model lives on fake tensors."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from pipelines import plan, plan_trace
from pipelines.plan_budget import GIB

ROOT = Path(__file__).resolve().parents[1]
PARAMS = str(ROOT / "params.yaml")
# MiB per process before it builds anything: given, so the test measures no child process
PROCESS_MB = 500


def planned(preset: str | None, machine: plan.Machine, stage: str | None = None, overrides=()) -> dict:
    rows = plan.plan(plan.load_params(PARAMS, preset, list(overrides)), machine, stage)
    return {r["spec"].name: r for r in rows}


@pytest.mark.parametrize("procs", [1, 2])
def test_the_ci_preset_fits_its_cpu_processes(procs):
    rows = planned("ci", plan.Machine(procs=procs, process_mb=PROCESS_MB))
    assert {"pretrain", "extend_context", "finetune_qlora@nf4", "finetune_qlora@none"} <= set(rows)
    for name, r in rows.items():
        assert r["refused"] is None, name
        b = r["budget"]
        assert b.phases["train"] > PROCESS_MB * 2**20  # the process, plus its tensors
        assert b.host["train"] == r["layout"].processes * b.phases["train"]


@pytest.mark.parametrize(("gpus", "gpu_mem"), [(8, 80), (1, 24)])
def test_the_gpu_preset_fits_a_node_of_8_gpus_and_a_single_gpu_with_the_same_params(gpus, gpu_mem):
    rows = planned("gpu", plan.Machine(gpus=gpus, gpu_mem=gpu_mem, host_mem=125, process_mb=PROCESS_MB))
    for name in ("pretrain", "extend_context", "finetune_qlora@nf4", "finetune_qlora@none"):
        assert rows[name]["refused"] is None, rows[name]["refused"]
    pretrain = rows["pretrain"]
    assert (pretrain["spec"].micro, pretrain["spec"].accum) == ((8, 1) if gpus == 8 else (8, 8))
    assert pretrain["budget"].peak < 8 * GIB  # the header's 7.4 GiB per GPU


def test_llama3_8b_qlora_fits_8_gpus_of_80_gb_with_the_host_memory_its_header_names():
    machine = plan.Machine(gpus=8, gpu_mem=80, host_mem=48, process_mb=PROCESS_MB)
    rows = planned("llama3-8b-qlora", machine, "finetune_qlora")
    for name in ("finetune_qlora@nf4", "finetune_qlora@none"):
        r = rows[name]
        assert r["refused"] is None, r["refused"]
        assert "published shape" in r["origin"] or "config.json" in r["origin"] or "cache" in r["origin"]
    nf4, none = rows["finetune_qlora@nf4"]["budget"], rows["finetune_qlora@none"]["budget"]
    assert nf4.phases["train"] < none.phases["train"] < 16 * GIB  # the 4-bit base is the smaller
    assert nf4.peak_phase == "merge"  # rank 0 holds the whole NF4 base to merge, the others an eighth of it
    base = sum(p.numel for p in rows["finetune_qlora@nf4"]["params"] if not p.trainable)
    assert 8.0e9 < base < 8.1e9  # Llama-3-8B's 8.03B


def test_a_hub_base_plans_every_training_stage_of_its_dag_and_no_pretrain():
    """With base.model set, pretrain is not in the DAG and memory_study's model reads the base's vocabulary."""
    rows = planned("llama3-8b-qlora", plan.Machine(gpus=1, gpu_mem=80, host_mem=48, process_mb=PROCESS_MB))
    assert "pretrain" not in rows and {"extend_context", "finetune_qlora@nf4", "memory_study@baseline"} <= set(rows)
    study = rows["memory_study@baseline"]["spec"].source
    assert study["vocab_size"] == plan_trace.model_config("meta-llama/Meta-Llama-3-8B")[0].vocab_size == 128256


def test_a_node_whose_host_memory_cannot_hold_the_8b_stage_is_refused_naming_the_request():
    machine = plan.Machine(gpus=1, gpu_mem=24, process_mb=PROCESS_MB)
    assert planned("llama3-8b-qlora", machine, "finetune_qlora@nf4")["finetune_qlora@nf4"]["refused"] is None
    machine = plan.Machine(gpus=1, gpu_mem=24, host_mem=1.5, process_mb=PROCESS_MB)
    line = planned("llama3-8b-qlora", machine, "finetune_qlora@nf4")["finetune_qlora@nf4"]["refused"]
    assert re.match(r"plan: finetune_qlora@nf4 needs [\d.]+ GiB of host memory per node \((train|merge)\)", line), line
    assert "finetune_qlora's mem_mb_per_gpu in pipelines/stages.yaml" in line, line


@pytest.mark.parametrize("item", ["nf4", "none"])
def test_a_24_gb_gpu_trains_and_merges_the_8b_qlora_one_weight_at_a_time(item):
    machine = plan.Machine(gpus=1, gpu_mem=24, host_mem=48, process_mb=PROCESS_MB)
    r = planned("llama3-8b-qlora", machine, f"finetune_qlora@{item}")[f"finetune_qlora@{item}"]
    b = r["budget"]
    assert r["refused"] is None, r["refused"]
    assert b.phases["train"] < 24 * GIB and b.phases["merge"] < 24 * GIB
    # the merge holds the model as it trained and one weight in the making, not the base in fp32 (30 GiB)
    fp32_base = 4 * sum(p.numel for p in r["params"] if not p.trainable)
    assert b.phases["merge"] - b.parts["params"] - b.parts["runtime reserve"] < 0.05 * fp32_base
    assert b.host["merge"] < 0.2 * fp32_base  # one tensor at a time on the host too


def test_an_oversized_micro_batch_is_refused_naming_the_key():
    machine = plan.Machine(gpus=1, gpu_mem=2, host_mem=64, process_mb=PROCESS_MB)
    big = ["pretrain.train.batch_size=64", "pretrain.train.micro_batch_size=64"]
    line = planned(None, machine, "pretrain", big)["pretrain"]["refused"]
    assert line and "per GPU (train) against 2 GiB" in line, line
    assert "pretrain.train.activation_checkpointing" in line, line
    fits = planned(None, machine, "pretrain", [*big, "pretrain.train.micro_batch_size=8"])["pretrain"]
    assert fits["refused"] is None


def test_fsdp_divides_the_state_and_ddp_adds_its_buckets():
    machine = plan.Machine(procs=2, process_mb=PROCESS_MB)
    ddp = planned(None, machine, "pretrain")["pretrain"]["budget"].parts
    fsdp = planned(None, machine, "pretrain", ["pretrain.train.strategy=fsdp"])["pretrain"]["budget"].parts
    assert fsdp["params"] == pytest.approx(ddp["params"] / 2)
    assert fsdp["optimizer"] == pytest.approx(ddp["optimizer"] / 2)
    assert ddp["ddp buckets"] == ddp["gradients"] and "ddp buckets" not in fsdp


def test_the_step_traced_on_two_layers_carries_on_to_more():
    import torch

    mc, _ = plan_trace.model_config(plan.llama_keys(plan.load_params(PARAMS, None, [])["pretrain"]["model"], 4096))
    for ac, every in (("none", 1), ("full", 1), ("selective", 2)):
        whole = plan_trace.trace(plan_trace.build(mc, torch.float32), 2, 256, 2, torch.float32, ac, every)
        k = every if ac == "selective" else 1
        parts = []
        for n in (k, 2 * k):
            small = mc.__class__(**{**mc.to_dict(), "num_hidden_layers": n})
            parts.append(plan_trace.trace(plan_trace.build(small, torch.float32), 2, 256, 2, torch.float32, ac, every))
        carried = plan_trace.Extrapolated(parts[0], parts[1], (mc.num_hidden_layers - k) / k)
        assert carried.peak(1, 1)[0] == pytest.approx(whole.peak(1, 1)[0], rel=0.02), ac


def test_the_planner_follows_the_train_section():
    from stages.common import train_config

    defaults = {f.name: f.default for f in dataclasses.fields(train_config.TrainConfig)}
    assert {k: defaults[k] for k in plan.TRAIN_DEFAULTS} == plan.TRAIN_DEFAULTS
    for batch, largest in ((16, 8), (16, 3), (12, 5)):
        for data in (1, 2, 4):
            cfg = train_config.build(batch_size=batch, micro_batch_size=largest)
            expected = (train_config.micro_batch(cfg, data), train_config.grad_accum_steps(cfg, data))
            assert plan.micro_batch(batch, largest, data) == expected


def test_the_command_line_refuses_with_exit_code_2(capsys):
    code = plan.main(["--gpus", "1", "--gpu-mem", "8", "--host-mem", "48", "--process-mb", str(PROCESS_MB),
                      "--preset", "llama3-8b-qlora", "--stage", "finetune_qlora@nf4"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and "finetune_qlora@nf4" in out
    assert err.strip().count("\n") == 0 and "against 8 GiB" in err


def test_the_launcher_on_cpus_neither_plans_nor_loads_torch():
    import subprocess
    import sys

    code = "import sys; from pipelines import launch; "
    code += "print(launch.memory_problem('pretrain', [], 2, 1, {}), 'torch' in sys.modules)"
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["None", "False"], proc.stderr[-3000:]


def test_the_launchers_check_reads_the_stage_arguments():
    args = ["--input", "data/tokenize", "--params", PARAMS, "train.batch_size=64", "train.micro_batch_size=64"]
    line = plan.launch_check("pretrain", args, 1, 1, gpu_mem=2, host_mem=64)
    assert line.startswith("plan: pretrain needs ") and "pretrain.train.activation_checkpointing" in line, line
    assert plan.launch_check("pretrain", args[:4], 1, 1, gpu_mem=2, host_mem=64) is None


def test_the_planners_finetune_model_trains_in_the_modes_of_the_stages(tmp_path):
    """finetune_qlora loads its base with from_pretrained (eval mode); the loop trains it in training mode (its
    decoder layers checkpointed, the adapters' dropout on from the first step), and the planner traces the same
    modules in the same modes, with the same adapter dropout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages import finetune_qlora
    from stages.common import config

    mc = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(mc).save_pretrained(tmp_path)
    cfg = dataclasses.replace(config.load(finetune_qlora.Config, "finetune_qlora", PARAMS, []), base=str(tmp_path))
    stage = finetune_qlora.add_adapters(finetune_qlora.load_base(cfg, torch.device("cpu"), quantized=False), cfg)
    lora = plan.load_params(PARAMS, None, [])["finetune_qlora"]["lora"]
    planned_model = plan_trace.build(mc, torch.float32, lora=lora, frozen=True).train()

    def modes(model):
        return {name: (m.training, getattr(m, "p", None)) for name, m in model.named_modules()}

    assert not modes(stage)["base_model.model.model.layers.0"][0], "from_pretrained leaves it in eval mode"
    stage.train()
    assert modes(planned_model) == modes(stage)
    assert any(p for _, p in modes(stage).values())  # the adapters' dropout is planned too


def test_finetune_qlora_holds_its_encoded_records_on_the_host():
    machine = plan.Machine(procs=1, process_mb=PROCESS_MB)
    seq = plan.load_params(PARAMS, None, [])["finetune_qlora"]["seq_length"]
    for records, overrides in ((5_000, []), (300, ["prepare_data.instructions_max_records=300"])):
        rows = planned(None, machine, "finetune_qlora@nf4", overrides)
        assert rows["finetune_qlora@nf4"]["budget"].parts["records"] == 2 * 8 * records * seq
    gpu = plan.Machine(gpus=8, gpu_mem=80, host_mem=125, process_mb=PROCESS_MB)
    b = planned(None, gpu, "finetune_qlora@nf4")["finetune_qlora@nf4"]["budget"]
    assert "records" not in b.parts and b.host_parts["records"] == 2 * 8 * 5_000 * seq


def test_an_interpreter_baseline_is_measured_once_per_code_and_environment(tmp_path, monkeypatch):
    store = tmp_path / "baselines.json"
    spawned = []

    def measure(cmd, **kwargs):
        spawned.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="123456\n", stderr="")

    monkeypatch.setattr(plan.subprocess, "run", measure)
    assert plan.process_baseline("pretrain", {}, store) == 123456 * 1024 and len(spawned) == 1
    assert plan.process_baseline("pretrain", {}, store) == 123456 * 1024 and len(spawned) == 1, "read back"
    # another key (here: the stage's code changed) is measured again, beside the first
    monkeypatch.setattr(plan, "baseline_key", lambda section, libs: f"other {section}")
    assert plan.process_baseline("pretrain", {}, store) == 123456 * 1024 and len(spawned) == 2
    assert len(json.loads(store.read_text())) == 2
    # a damaged store is only a cache: measured again and rewritten
    store.write_text("{not json")
    assert plan.process_baseline("pretrain", {}, store) == 123456 * 1024 and len(spawned) == 3
    assert list(json.loads(store.read_text())) == ["other pretrain"]
