"""Plan a training stage's memory, disk and time before running it: per rank, per node, per phase.

    python -m pipelines.plan                                  # this machine's CPUs, params.yaml
    python -m pipelines.plan --gpus 8 --gpu-mem 80            # 8 GPUs of 80 GiB per node
    python -m pipelines.plan --preset llama3-8b-qlora --gpus 1 --gpu-mem 24 --stage finetune_qlora@nf4
    python -m pipelines.plan --nodes 2 --gpus 8 --gpu-mem 80 finetune_qlora.train.micro_batch_size=4
    python -m pipelines.plan --json                           # the same figures for machines (bytes)

For each training stage (pretrain, extend_context, finetune_qlora@nf4, finetune_qlora@none, memory_study@<technique>)
the stage's own model is built on the meta device (pipelines.plan_trace: params, a local Hugging Face
folder, the local hub cache, or a known published shape; nothing is downloaded), and one optimizer step
of its micro-batches is traced on fake tensors, so the activations are those of the real code
(scaled-dot-product attention, autocast, activation checkpointing where the stage's modules train in
training mode, the adapters' dropout, the fp32 loss). The parts per rank (pipelines.plan_budget:
parameters, gradients, optimizer states, NF4 weights, adapters, activations at the peak, DDP buckets,
FSDP's gathered layers, finetune_qlora's encoded records on the host) follow the train section's strategy
and precision, and the peak is taken per phase: training, and rank 0's publish (pretrain, extend_context)
or merge (finetune_qlora).

Processes: GPU stages take one per GPU, up to their `gpus_per_node` (pipelines/stages.yaml), as the
launcher starts them; on CPUs (`--gpus 0`) their `nproc_per_node`, or --procs. On CPUs every process also
holds the interpreter with its libraries: the planner measures it (`--process-mb` to give it), as the
resident memory of a fresh Python that imports the stage and its libraries (kept in .cache/plan/ for
the same stage code, interpreter, packages and machine: the next plan reads it). Not planned on CPUs: the
holes glibc's malloc keeps in its heap once its mmap threshold has risen (docs/parallelism.md measures
them). On GPUs the device also holds the CUDA context and the allocator's slack: `--gpu-reserve` GiB
(default 1), an allowance.

A stage that cannot fit its limits (--gpu-mem per GPU, host memory per node: --host-mem or the stage's
`mem_mb`, --disk) is refused, one line each, naming the figure, the limit and the key to change; the exit
code is then 2. The launcher (pipelines/launch.py) runs this check before it starts a training stage on
GPUs.

Time: the step's FLOPs (pipelines.plan_budget.step_flops) x steps over processes x the train section's
`peak_tflops` x --mfu (default 0.4, an assumption). Evaluation, saving and the merge are not timed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipelines import cluster, plan_budget
from pipelines.plan_budget import GIB, Layout
from stages.common import config

TRAINING = ("pretrain", "extend_context", "finetune_qlora", "memory_study")
# stages.common.train_config.TrainConfig's defaults for the keys a params section may leave out
TRAIN_DEFAULTS = {
    "optimizer": "adamw",
    "activation_checkpointing_every": 2,
    "offload": False,
    "precision": "auto",
    "reduce_dtype": "fp32",
    "tensor_parallel": 1,
    "pipeline_parallel": 1,
    "pipeline_schedule": "1f1b",
    "data_parallel_replicate": 1,
    "async_checkpoint": True,
}
STAGE_LIBRARIES = {"finetune_qlora": ("peft", "bitsandbytes")}
# Each stage's measured interpreter baseline, by what it follows from (process_baseline)
BASELINES = Path(__file__).resolve().parent.parent / ".cache" / "plan" / "process-baselines.json"
# Records of prepare_data's named instruction sources (stages.prepare_data.write_instructions): the Alpaca
# subset it fetches (sources.ALPACA_5K; the hub's whole train split only where that file cannot be had) and
# the hub's train split
KNOWN_RECORDS = {"alpaca": 5_000, "hub:tatsu-lab/alpaca": 52_002}


@dataclass
class Machine:
    gpus: int = 0
    """GPUs per node; 0: the stages run on CPUs."""
    gpu_mem: float | None = None
    """GiB per GPU."""
    nodes: int = 1
    procs: int | None = None
    """CPU processes per node instead of the stage's nproc_per_node."""
    host_mem: float | None = None
    """GiB per node instead of the stage's memory request (pipelines/stages.yaml, pipelines.cluster)."""
    disk: float | None = None
    mfu: float = 0.4
    gpu_reserve: float = 1.0
    process_mb: float | None = None


@dataclass
class StageSpec:
    """One training stage's run as the planner sees it."""

    name: str
    section: str
    source: dict | str
    train: dict
    seq: int
    gpu: bool
    weight_dtype: str
    compute_dtype: str
    trace_weight_bytes: int
    micro: int = 1
    accum: int = 1
    lora: dict | None = None
    quantized: bool = False
    double_quant: bool = False
    runs: int = 1
    """Trainings one after another (extend_context's fine-tunes)."""
    models_out: int = 1
    records: int = 0
    """Instruction records the stage encodes (finetune_qlora), held on the host while it trains."""
    notes: list = field(default_factory=list)


def micro_batch(batch: int, largest: int, data: int) -> tuple[int, int]:
    """(micro-batch, accumulation) per data-parallel process: stages.common.train_config.micro_batch's rule."""
    if batch % data:
        raise config.ConfigError(f"train.batch_size ({batch}) cannot be shared by {data} data-parallel processes")
    share = batch // data
    micro = max(m for m in range(1, min(share, largest) + 1) if share % m == 0)
    return micro, share // micro


def llama_keys(model: dict, vocab: int) -> dict:
    """pretrain's ModelConfig as LlamaConfig keys (stages.pretrain.build_model)."""
    return {
        "vocab_size": vocab,
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"],
        "max_position_embeddings": model["max_position_embeddings"],
        "rope_theta": model["rope_theta"],
        "tie_word_embeddings": False,
    }


def specs(params: dict, stage: str | None, machine: Machine, layout_of) -> list[StageSpec]:
    """The training stages of `params` (one, with `stage`: a name or name@item)."""
    vocab = params["tokenize"]["vocab_size"]
    pretrained = llama_keys(params["pretrain"]["model"], vocab)
    base = base_of(params, pretrained)
    out = []
    for section in TRAINING:
        sec = params.get(section)
        if not sec or (section == "pretrain" and isinstance(base, str)):  # (a base model: no pretrain in the DAG)
            continue
        items = {"finetune_qlora": ("nf4", "none"), "memory_study": tuple(sec.get("techniques", {}))}.get(
            section, (None,)
        )
        for item in items:
            name = f"{section}@{item}" if item else section
            if stage and stage not in (name, section):
                continue
            out.append(spec_of(section, item, sec, base, machine, layout_of))
            if section == "finetune_qlora":
                out[-1].records = instruction_records(params.get("prepare_data") or {}, out[-1].notes)
    if stage and not out:
        raise config.ConfigError(f"plan: no training stage {stage!r}; stages: {', '.join(TRAINING)} (name@item)")
    return out


def instruction_records(prepare: dict, notes: list) -> int:
    """How many records prepare_data writes for finetune_qlora: its source's (a named one, or a local .jsonl
    counted), at most `instructions_max_records`; 0, with a note, when neither says (a hub dataset)."""
    source, cap = prepare.get("instructions", "alpaca"), prepare.get("instructions_max_records") or 0
    count = KNOWN_RECORDS.get(source)
    if count is None and Path(source).suffix == ".jsonl" and Path(source).is_file():
        with open(source, "rb") as fh:
            count = sum(1 for line in fh if line.strip())
    if count is None and not cap:
        notes.append(f"the records of {source} not counted (prepare_data.instructions_max_records bounds them)")
    return min(count, cap) if count is not None and cap else count or cap


def base_of(params: dict, pretrained: dict) -> dict | str:
    """The base model of extend_context and finetune_qlora: the pretrain stage's (its model section), or the
    model params.yaml's base.model names (a hub id or a folder; the base stage copies it)."""
    return (params.get("base") or {}).get("model") or pretrained


def spec_of(section: str, item, sec: dict, pretrained: dict | str, machine: Machine, layout_of) -> StageSpec:
    train = {**TRAIN_DEFAULTS, **sec["train"]}
    name = f"{section}@{item}" if item else section
    gpu = machine.gpus > 0
    if section == "memory_study":
        train = {**train, **sec["techniques"][item]}
    precision = train["precision"]
    compute = "bf16" if precision == "bf16" or (precision == "auto" and gpu) else precision
    compute = "fp32" if compute == "auto" else compute
    s = StageSpec(name, section, pretrained, train, 0, gpu, "fp32", compute, 4)
    if section == "pretrain":
        s.seq = sec["context_length"]
    elif section == "memory_study":  # (its own model, on the shards of the base's vocabulary)
        from pipelines import plan_trace

        vocab = pretrained["vocab_size"] if isinstance(pretrained, dict) else None
        s.source = llama_keys(sec["model"], vocab or plan_trace.model_config(pretrained)[0].vocab_size)
        s.seq = max(sec["contexts"])
    elif section == "extend_context":
        from pipelines import plan_trace

        original = sec["original_context"] or plan_trace.model_config(pretrained)[0].max_position_embeddings
        s.seq = int(round(sec["factor"] * original))
        s.runs = max(1, len(sec["finetune"]))
        s.models_out = 1 + len(sec["variants"]) + len(sec["finetune"])
        s.notes.append(f"{len(sec['finetune'])} fine-tunes at {s.seq} tokens, one after another")
    else:
        s.seq = sec["seq_length"]
        s.quantized = (item or sec["quantization"]) == "nf4"
        s.double_quant = bool(sec["double_quant"]) and s.quantized
        s.lora = dict(sec["lora"])
        s.weight_dtype = s.compute_dtype = "bf16" if gpu else "fp32"
        storage = sec["quant_storage"]
        if s.quantized:
            s.notes.append(f"NF4 storage {s.weight_dtype if storage == 'auto' else storage}")
    layout = layout_of(s)
    fsdp_mixed = layout.shard > 1 and compute != "fp32"
    s.trace_weight_bytes = plan_budget.DTYPE_BYTES[s.weight_dtype if section == "finetune_qlora" else
                                                   (compute if fsdp_mixed else "fp32")]  # fmt: skip
    s.micro, s.accum = micro_batch(train["batch_size"], train["micro_batch_size"], layout.data)
    return s


def resources(section: str) -> dict:
    from pipelines.dag import load_table

    return load_table()[section].resources


def layout_for(machine: Machine):
    def layout_of(s: StageSpec) -> Layout:
        res = resources(s.section)
        if machine.gpus:
            per_node = min(int(res.get("gpus_per_node", 0)) or 1, machine.gpus)
        else:
            per_node = machine.procs or int(res["nproc_per_node"])
        t = s.train
        return Layout(
            per_node * machine.nodes, machine.nodes, t["strategy"], t["tensor_parallel"], t["pipeline_parallel"],
            t["data_parallel_replicate"], t["pipeline_schedule"],
        )  # fmt: skip

    return layout_of


def baseline_key(section: str, libs: tuple[str, ...]) -> str:
    """What a stage's interpreter baseline follows from: the stage's code, the interpreter, every installed
    package and its version, the libraries imported beside the stage, and the machine (kernels and their
    tables follow the CPU)."""
    from stages.common import environment, provenance

    record = {
        "section": section,
        "code": provenance.code_digest(f"stages.{section}")["sha256"],
        "python": [sys.executable, sys.version],
        "packages": sorted(environment.installed().items()),
        "libs": list(libs),
        "machine": [os.uname().nodename, os.uname().machine, os.cpu_count()],
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def process_baseline(section: str, cache: dict, store: Path | None = BASELINES) -> int:
    """Resident bytes of a fresh Python that has imported the stage and its libraries (VmHWM): what every
    process of the stage holds before it builds a tensor. Measured once per key (baseline_key) and kept in
    `store` (a few seconds of imports each; the next plan of the same code and environment reads it)."""
    if section not in cache:
        libs = ("transformers.models.llama.modeling_llama", "matplotlib.pyplot", *STAGE_LIBRARIES.get(section, ()))
        key = baseline_key(section, libs) if store is not None else None
        kept = read_baselines(store) if store is not None else {}
        if key in kept:
            cache[section] = kept[key]
            return cache[section]
        code = f"import stages.{section}, " + ", ".join(libs) + "\n"
        code += "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        cache[section] = int(out.stdout.split()[-1]) * 1024
        if store is not None:
            from stages.common import atomic

            store.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(store, {**read_baselines(store), key: cache[section]})
    return cache[section]


def read_baselines(store: Path) -> dict[str, int]:
    """{key: bytes} kept by process_baseline; an unreadable file counts as empty (it is only a cache)."""
    try:
        kept = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in kept.items() if isinstance(v, int)} if isinstance(kept, dict) else {}


def plan_stage(s: StageSpec, machine: Machine, layout: Layout, baselines: dict) -> dict:
    """The stage's budget (pipelines.plan_budget.Budget) and what it was built from."""
    import torch

    from pipelines import plan_trace

    mc, origin = plan_trace.model_config(s.source)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    trace_dtype = {4: torch.float32, 2: dtypes[s.compute_dtype if s.compute_dtype != "fp32" else "bf16"]}
    model_kwargs = {"lora": s.lora, "frozen": s.lora is not None, "quantized": s.quantized}
    full = plan_trace.build(mc, trace_dtype[s.trace_weight_bytes], **model_kwargs)
    params = plan_trace.params(full, s.quantized)
    trace = traced(plan_trace, mc, s, layout, trace_dtype[s.trace_weight_bytes], model_kwargs, dtypes)
    if machine.process_mb is not None:
        baseline = int(machine.process_mb * 2**20)
    else:
        baseline = process_baseline(s.section, baselines)
    runtime = int(machine.gpu_reserve * GIB) if s.gpu else baseline
    b = plan_budget.per_rank(s, params, trace, layout, baseline, runtime)
    plan_budget.publish(s, params, b, layout, baseline)
    plan_budget.host_memory(s, b, layout)
    hub = isinstance(s.source, str) and not (s.source.startswith(("/", ".")) or "/" not in s.source)
    stored_dtype = str(mc.to_dict().get("dtype") or mc.to_dict().get("torch_dtype") or "float32")
    stored = plan_budget.DTYPE_BYTES.get(stored_dtype.removeprefix("torch."), 4)
    hub = hub and not Path(s.source).exists()
    b.disk = plan_budget.disk(s, params, s.models_out, hub, stored)
    tokens = s.train["batch_size"] * s.seq
    ac, every = s.train["activation_checkpointing"], s.train["activation_checkpointing_every"]
    b.flops = plan_budget.step_flops(params, mc, s.seq, tokens, ac, every) * s.train["steps"] * s.runs
    b.seconds = b.flops / (layout.processes * s.train["peak_tflops"] * 1e12 * machine.mfu)
    return {"budget": b, "origin": origin, "params": params, "layout": layout}


def traced(plan_trace, mc, s: StageSpec, layout: Layout, dtype, model_kwargs: dict, dtypes: dict):
    """The step traced on k and 2k decoder layers (k: the checkpointing period), extrapolated to the
    stage's layers (per pipeline stage): decoder layers are identical, so each adds the same."""
    ac, every = s.train["activation_checkpointing"], s.train["activation_checkpointing_every"]
    k = every if ac == "selective" else 1
    layers = mc.num_hidden_layers // layout.pipeline
    autocast = dtypes[s.compute_dtype]
    micro_batches = min(s.accum, 2)
    if layers <= 2 * k:
        model = plan_trace.build(mc, dtype, **model_kwargs)
        return plan_trace.trace(model, s.micro, s.seq, micro_batches, autocast, ac, every)
    runs = []
    for n in (k, 2 * k):
        small = mc.__class__(**{**mc.to_dict(), "num_hidden_layers": n})
        model = plan_trace.build(small, dtype, **model_kwargs)
        runs.append(plan_trace.trace(model, s.micro, s.seq, micro_batches, autocast, ac, every))
    return plan_trace.Extrapolated(runs[0], runs[1], (layers - k) / k)


def check(s: StageSpec, result: dict, machine: Machine, host_limit: float) -> str | None:
    """One line when the stage cannot fit: the figure, the limit, the key to change; None when it fits."""
    b = result["budget"]
    if machine.gpus and machine.gpu_mem and b.peak > machine.gpu_mem * GIB:
        phase = b.peak_phase
        if phase == "merge":
            key = (
                "the merge (stages/common/lora_merge.py) holds the whole model as it trained, plus one weight in fp32, "
                "on rank 0's GPU: no params key lowers it; plan on a larger GPU"
            )
        else:
            key = f"change {biggest_key(s, b)}"
        return f"plan: {s.name} needs {gib(b.phases[phase])} per GPU ({phase}) against {machine.gpu_mem:g} GiB; {key}"
    if host_limit and b.host_peak > host_limit:
        phase = max(b.host, key=b.host.get)
        return (
            f"plan: {s.name} needs {gib(b.host[phase])} of host memory per node ({phase}) against {gib(host_limit)}; "
            f"raise {s.section}'s {'mem_mb_per_gpu' if s.gpu else 'mem_mb_per_process'} in pipelines/stages.yaml "
            "(or give --host-mem)" + (f", or change {biggest_key(s, b)}" if phase == "train" and not s.gpu else "")
        )
    total_disk = sum(b.disk.values())
    if machine.disk and total_disk > machine.disk * GIB:
        return f"plan: {s.name} writes {gib(total_disk)} against {machine.disk:g} GiB of disk; free space or --disk"
    return None


def biggest_key(s: StageSpec, b) -> str:
    """The params key that lowers the largest part of the training peak."""
    where = f"{s.section}.techniques.{s.name.split('@')[1]}" if s.section == "memory_study" else f"{s.section}.train"
    parts = {
        "activations": b.at_peak.get("activations", 0),
        "optimizer": b.parts.get("optimizer", 0),
        "state": b.parts.get("params", 0) + b.parts.get("ddp buckets", 0) + b.parts.get("gradients", 0),
    }
    largest = max(parts, key=parts.get)
    if largest == "optimizer" and s.train["optimizer"] == "adamw":
        return f"{where}.optimizer (adamw8bit: 2 bytes of state per parameter instead of 8)"
    if largest == "state" and s.train["strategy"] == "ddp" and b.parts.get("params", 0) and not s.lora:
        return f"{where}.strategy (fsdp shards parameters, gradients and optimizer states)"
    if s.train["activation_checkpointing"] != "full":
        return f"{where}.activation_checkpointing (full) or {where}.micro_batch_size"
    return f"{where}.micro_batch_size"


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def load_params(path: str, preset: str | None, overrides: list[str]) -> dict:
    """params.yaml with a preset's overlay and `section.key=value` overrides."""
    params = config.read_yaml(path)
    if preset:
        from pipelines.preset import preset_path

        params = config.merge(params, config.read_yaml(preset_path(preset)))
    by_section: dict[str, list[str]] = {}
    for item in overrides:
        section = item.split(".", 1)[0]
        if section not in params or "=" not in item:
            raise config.ConfigError(f"plan: override {item!r} must look like <section>.<key>=<value>")
        by_section.setdefault(section, []).append(item)
    for section, items in by_section.items():
        params[section] = config.apply_overrides(section, params[section], items)
    return params


def plan(params: dict, machine: Machine, stage: str | None = None) -> list[dict]:
    """Every training stage's (or one's) plan: spec, budget, limits and the refusal line if any."""
    layout_of = layout_for(machine)
    baselines: dict = {}
    chosen = specs(params, stage, machine, layout_of)
    if machine.process_mb is None:  # each stage's interpreter, measured at once (seconds each, independent)
        from concurrent.futures import ThreadPoolExecutor

        sections = sorted({s.section for s in chosen})
        with ThreadPoolExecutor(len(sections) or 1) as pool:
            for section, rss in zip(sections, pool.map(lambda x: process_baseline(x, {}), sections), strict=True):
                baselines[section] = rss
    rows = []
    for s in chosen:
        layout = layout_of(s)
        result = plan_stage(s, machine, layout, baselines)
        res = resources(s.section)
        host_limit = machine.host_mem * GIB if machine.host_mem else cluster.processes(res, not machine.gpus)[2] * 2**20
        rows.append({"spec": s, **result, "host_limit": host_limit, "refused": check(s, result, machine, host_limit)})
    return rows


def as_json(rows: list[dict], machine: Machine) -> dict:
    out = {"machine": machine.__dict__, "stages": {}}
    for r in rows:
        s, b, layout = r["spec"], r["budget"], r["layout"]
        out["stages"][s.name] = {
            "model": r["origin"],
            "parameters": sum(p.numel for p in r["params"]),
            "trainable": sum(p.numel for p in r["params"] if p.trainable),
            "processes": layout.processes,
            "micro_batch": s.micro,
            "accumulation": s.accum,
            "per_rank_bytes": {k: int(v) for k, v in b.parts.items()},
            "at_peak_bytes": b.at_peak,
            "peak_bytes": b.phases,
            "host_bytes_per_node": b.host,
            "host_limit_bytes": r["host_limit"],
            "disk_bytes": {k: int(v) for k, v in b.disk.items()},
            "flops": b.flops,
            "seconds": b.seconds,
            "refused": r["refused"],
        }
    return out


def table(rows: list[dict], machine: Machine) -> str:
    where = f"{machine.nodes} node(s) x {machine.gpus} GPU(s)" if machine.gpus else f"{machine.nodes} node(s), CPUs"
    limit = f", {machine.gpu_mem:g} GiB per GPU" if machine.gpu_mem else ""
    lines = [f"plan: {where}{limit}; figures per rank unless marked, MFU {machine.mfu:g}"]
    head = ("stage", "procs", "micro x accum", "params", "grads", "optimizer", "activations", "other", "peak/rank",
            "host/node", "disk", "time")  # fmt: skip
    body = []
    for r in rows:
        s, b = r["spec"], r["budget"]
        main = ("params", "gradients", "optimizer", "activations")
        other = sum(v for k, v in b.parts.items() if k not in main and "(host" not in k)
        body.append((
            s.name, str(r["layout"].processes), f"{s.micro} x {s.accum}",
            *(gib(b.parts.get(k, 0)) for k in main), gib(other), f"{gib(b.peak)} ({b.peak_phase})",
            f"{gib(b.host_peak)} / {gib(r['host_limit'])}", gib(sum(b.disk.values())), duration(b.seconds),
        ))  # fmt: skip
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += [fmt.format(*head), *(fmt.format(*row) for row in body), ""]
    for r in rows:
        s, b = r["spec"], r["budget"]
        other = ", ".join(f"{k} {gib(v)}" for k, v in b.parts.items() if k not in ("params", "gradients") and v)
        disk = ", ".join(f"{k} {gib(v)}" for k, v in b.disk.items() if v)
        phases = ", ".join(f"{k} {gib(v)}" for k, v in b.phases.items())
        host = ", ".join(f"{k} {gib(v)}" for k, v in b.host.items() if v)
        n = sum(p.numel for p in r["params"])
        lines.append(
            f"{s.name}: {n / 1e6:,.2f}M parameters ({sum(p.numel for p in r['params'] if p.trainable) / 1e6:,.2f}M "
            f"trainable) from {r['origin']}; {s.seq} tokens; {'; '.join(s.notes) + '; ' if s.notes else ''}"
            f"per rank: {other}; peak by phase: {phases}; host per node: {host}; disk: {disk or 'none'}"
        )
    return "\n".join(lines)


def duration(seconds: float) -> str:
    return (
        f"{seconds / 3600:.1f} h"
        if seconds >= 3600
        else f"{seconds / 60:.1f} min"
        if seconds >= 60
        else f"{seconds:.0f} s"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--preset", help="a preset of pipelines/presets over the params")
    parser.add_argument("--stage", help="one stage: pretrain, extend_context, finetune_qlora[@nf4], memory_study[@...]")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node (0: CPUs)")
    parser.add_argument("--gpu-mem", type=float, help="GiB per GPU")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--procs", type=int, help="CPU processes per node instead of the stage's")
    parser.add_argument("--host-mem", type=float, help="GiB of host memory per node instead of the stage's request")
    parser.add_argument("--disk", type=float, help="GiB of free disk")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization assumed for the time")
    parser.add_argument("--gpu-reserve", type=float, default=1.0, help="GiB per GPU for the CUDA context and slack")
    parser.add_argument("--process-mb", type=float, help="MiB per CPU process before it builds anything (measured)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    machine = Machine(
        args.gpus, args.gpu_mem, args.nodes, args.procs, args.host_mem, args.disk, args.mfu, args.gpu_reserve,
        args.process_mb,
    )  # fmt: skip
    try:
        rows = plan(load_params(args.params, args.preset, args.overrides), machine, args.stage)
    except (config.ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(rows, machine), indent=1) if args.json else table(rows, machine))
    refused = [r["refused"] for r in rows if r["refused"]]
    for line in refused:
        print(line, file=sys.stderr)
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())


def launch_check(stage: str, args: list[str], nproc: int, nodes: int, gpu_mem: float | None, host_mem: float):
    """The launcher's check before a training stage starts on GPUs (pipelines/launch.py): the stage's
    params file and key=value arguments as the stage reads them; the refusal line, or None."""
    from pipelines.launch import params_and_overrides

    name, _, item = stage.partition("@")
    path, given = params_and_overrides(args)
    overrides = [arg if arg.startswith(f"{name}.") else f"{name}.{arg}" for arg in given]
    machine = Machine(gpus=nproc, gpu_mem=gpu_mem, nodes=nodes, host_mem=host_mem)
    rows = plan(load_params(path, None, overrides), machine, stage if item else name)
    return next((r["refused"] for r in rows if r["refused"]), None)
