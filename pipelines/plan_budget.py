"""The planner's arithmetic: per-rank memory by part and phase, host memory per node, disk and time of one
training stage, from its parameters (pipelines.plan_trace.Param) and its traced step (Trace). No torch here.

Bytes per parameter, as the stages store them:
  weights      fp32 where a stage trains the whole model (autocast computes in bf16/fp16 over fp32 master
               weights); finetune_qlora's base in its load dtype (bf16 on GPUs, fp32 on CPUs), its adapters too
  NF4          4 bits per weight in the packed tensor (whatever its quant_storage dtype, the bytes are the
               same), one absmax per 64 weights: fp32, or with double quantization 8 bits plus one fp32
               constant per 256 of them (QLoRA's 4.127 bits per weight)
  gradients    one per trainable parameter, in its dtype
  optimizer    adamw: 2 states of the parameter's dtype; adamw8bit / paged_adamw8bit: 2 uint8 states and one
               fp32 absmax per 256 entries each, for tensors of 4,096 entries or more (smaller ones keep fp32
               states)
and finetune_qlora's encoded records on the host: int64 inputs and targets of seq_length per record.
Sharding: ddp holds every part whole on every process, plus DDP's gradient buckets (a second copy of the
gradients); fsdp divides parameters, gradients and optimizer states by the shard group (a frozen base's
adapters stay whole), and holds two decoder layers gathered (the one computing and the one prefetched) and
one layer's unsharded gradients; tensor and pipeline parallel divide the model by their degrees
(evenly: an approximation that ignores the embedding and head's place).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}
NF4_BLOCK, DOUBLE_QUANT_BLOCK, OPTIMIZER_8BIT_BLOCK, OPTIMIZER_8BIT_MIN = 64, 256, 256, 4096
CHECKPOINTS_ON_DISK = 3  # the checkpointer keeps 2 and writes the next before removing the oldest


@dataclass
class Layout:
    """How a stage's processes share the model: the train section's keys on these processes."""

    processes: int
    nodes: int
    strategy: str
    tensor: int = 1
    pipeline: int = 1
    replicate: int = 1
    schedule: str = "1f1b"

    @property
    def data(self) -> int:
        return self.processes // (self.tensor * self.pipeline)

    @property
    def shard(self) -> int:
        """The processes FSDP shards over (1: whole copies)."""
        return self.data // self.replicate if self.strategy == "fsdp" and self.processes > 1 else 1

    @property
    def split(self) -> int:
        """The model's division by tensor and pipeline parallel."""
        return self.tensor * self.pipeline


@dataclass
class Budget:
    """One stage's plan: bytes per rank by part and phase, host memory per node, disk, seconds."""

    parts: dict = field(default_factory=dict)
    """Per rank during training: params, grads, optimizer, activations, ... (bytes)."""
    phases: dict = field(default_factory=dict)
    """Peak bytes per rank (on the device) per phase: train, and publish or merge."""
    host: dict = field(default_factory=dict)
    """Peak host bytes per node per phase."""
    disk: dict = field(default_factory=dict)
    at_peak: dict = field(default_factory=dict)
    """Activations and gradients at the moment of the training peak."""
    host_parts: dict = field(default_factory=dict)
    flops: float = 0.0
    seconds: float = 0.0

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def host_peak(self) -> int:
        return max(self.host.values())


def nf4_bytes(numel: int, double_quant: bool) -> int:
    blocks = math.ceil(numel / NF4_BLOCK)
    constants = blocks + 4 * math.ceil(blocks / DOUBLE_QUANT_BLOCK) if double_quant else 4 * blocks
    return math.ceil(numel / 2) + constants


def optimizer_bytes(numel: int, param_bytes: int, optimizer: str) -> int:
    if optimizer == "adamw":
        return 2 * numel * param_bytes
    if numel < OPTIMIZER_8BIT_MIN:
        return 2 * numel * 4
    return 2 * numel + 2 * 4 * math.ceil(numel / OPTIMIZER_8BIT_BLOCK)


def weight_bytes(p, weight_dtype_bytes: int, double_quant: bool) -> int:
    return nf4_bytes(p.numel, double_quant) if p.quantized else p.numel * weight_dtype_bytes


def per_rank(spec, params, trace, layout: Layout, baseline: int, runtime: int) -> Budget:
    """The training phase's parts on one rank and its peak; `spec`: pipelines.plan.StageSpec. `baseline`: a
    process's resident memory before it builds anything (host); `runtime`: what the device holds besides
    tensors (on a CPU the baseline itself; on a GPU the CUDA context and the allocator's slack)."""
    w = DTYPE_BYTES[spec.weight_dtype]
    frozen_base = any(not p.trainable for p in params)
    shard, split = layout.shard, layout.split
    trainable = [p for p in params if p.trainable]
    frozen = [p for p in params if not p.trainable]
    divide_trainable = 1 if frozen_base else shard  # a frozen base's adapters stay whole under fsdp
    b = Budget()
    parts = b.parts
    parts["params"] = (
        sum(weight_bytes(p, w, spec.double_quant) for p in frozen) / shard
        + sum(p.numel * w for p in trainable) / divide_trainable
    ) / split
    grad_bytes = sum(p.numel * w for p in trainable) / divide_trainable / split
    parts["optimizer"] = sum(optimizer_bytes(p.numel, w, spec.train["optimizer"]) for p in trainable)
    parts["optimizer"] /= divide_trainable * split
    if layout.strategy == "ddp" and layout.data > 1 and split == 1:
        parts["ddp buckets"] = grad_bytes
    if shard > 1:
        gather = DTYPE_BYTES[spec.compute_dtype] if not frozen_base else w
        layers = {}
        for p in params:
            if p.layer is not None:
                layers[p.layer] = layers.get(p.layer, 0) + (
                    weight_bytes(p, w, spec.double_quant) if p.quantized else p.numel * gather
                )
        layer = max(layers.values(), default=0)
        unsharded_grads = 0 if frozen_base else layer / gather * (gather + DTYPE_BYTES[spec.train["reduce_dtype"]])
        parts["fsdp gathered layers"] = 2 * layer + unsharded_grads
    quantized = [p.numel for p in params if p.quantized]
    if quantized:  # bitsandbytes dequantizes one weight at a time for each matmul, forward and backward
        parts["nf4 dequantized weight"] = max(quantized) * DTYPE_BYTES[spec.compute_dtype]
    if spec.train.get("offload") and shard > 1:  # FSDP2's CPU offload: the sharded state lives on the host
        for key in ("params", "optimizer"):
            parts[f"{key} (host, offloaded)"] = parts.pop(key)
    in_flight = 1.0
    if layout.pipeline > 1:
        accum = spec.accum
        in_flight = (min(accum, layout.pipeline) if layout.schedule == "1f1b" else accum) / layout.pipeline
    grad_scale = w / spec.trace_weight_bytes / divide_trainable / split
    peak, act, grads = trace.peak(in_flight / layout.tensor, grad_scale)
    parts["gradients"] = grad_bytes
    parts["activations"] = act
    b.at_peak = {"activations": act, "gradients": grads}
    staging = 0
    if spec.train["checkpoint_every"] and spec.train.get("async_checkpoint", True):
        # DCP's stager keeps a host copy of the rank's checkpointed state between saves
        staging = sum(p.numel * w for p in trainable) / divide_trainable / split + parts.get("optimizer", 0)
    # finetune_qlora's encoded records on the host: (records, seq) int64 inputs and targets, the train/eval
    # split's copies that the loop reads (the stage frees the encoded arrays once split)
    records = 2 * 8 * spec.records * spec.seq
    b.host_parts = {"checkpoint staging": staging, "records": records, "process": baseline}
    if not spec.gpu:
        parts["checkpoint staging"] = staging
        parts["records"] = records
    parts["process" if not spec.gpu else "runtime reserve"] = runtime
    on_device = sum(v for k, v in parts.items() if k not in ("gradients", "activations") and "(host" not in k)
    b.phases["train"] = int(on_device + peak)
    return b


def publish(spec, params, b: Budget, layout: Layout, baseline: int) -> None:
    """Rank 0's phase after training: pretrain/extend_context gather the whole fp32 model to the host and build
    a fresh one to save; finetune_qlora's merge (stages/common/lora_merge.py) makes and writes the merged model
    one weight at a time from the trained model (one process) or the base reloaded as it trained (rank 0)."""
    full = sum(p.numel for p in params)
    held = b.parts.get("params", 0) + b.parts.get("ddp buckets", 0)  # the trained model still lives during publish
    if spec.section == "finetune_qlora":
        b.phases["merge"] = int(merge_on_device(spec, params, b, baseline))
        if spec.gpu:
            b.host["merge"] = int(merge_on_host(spec, params) + baseline * layout.processes / layout.nodes)
    elif spec.section in ("pretrain", "extend_context"):
        on_host = 2 * 4 * full  # the gathered state dict and the model built to save it
        if spec.gpu:
            b.host["publish"] = int(on_host + baseline * layout.processes / layout.nodes)
        else:
            b.phases["publish"] = int(held + on_host + baseline)


def merge_on_device(spec, params, b: Budget, baseline: int) -> float:
    """The merge's peak on rank 0's device: the whole model as it trained (one process: the trained model
    itself; several: rank 0 loads the base again and gives it the adapters) and one merged weight in the
    making: the largest decoder-layer weight in fp32, B A and its scaled delta (every other tensor goes to
    the host as it is)."""
    w = DTYPE_BYTES[spec.weight_dtype]
    loaded = sum(weight_bytes(p, w, spec.double_quant) for p in params if not p.trainable)
    loaded += sum(p.numel for p in params if p.trainable) * w
    weight = max((p.numel for p in params if merged_in_fp32(p)), default=0)
    runtime = b.parts.get("runtime reserve", 0) if spec.gpu else baseline
    return loaded + 3 * 4 * weight + runtime


def merge_on_host(spec, params) -> float:
    """The merge's host memory besides the processes (on GPUs): the gathered adapter state, and the largest
    tensor on its way to the file (a merged or dequantized weight in fp32; any other in its load dtype, and
    cast to fp32 there too for the unquantized base)."""
    w = DTYPE_BYTES[spec.weight_dtype]
    adapters = sum(p.numel for p in params if p.trainable) * w
    cast = 0 if spec.quantized or w == 4 else 4
    return adapters + max(p.numel * (4 if merged_in_fp32(p) else w + cast) for p in params if not p.trainable)


def merged_in_fp32(p) -> bool:
    """A frozen weight the merge dequantizes or merges adapters into: the decoder layers' linear weights."""
    return not p.trainable and (p.quantized or (p.layer is not None and len(p.shape) == 2))


def host_memory(spec, b: Budget, layout: Layout) -> None:
    """Peak host memory per node: on CPUs every process's memory; on GPUs each process's runtime, its
    checkpoint staging copy, records and offloaded state, and rank 0's publish or merge (above)."""
    per_node = layout.processes // layout.nodes
    baseline = b.host_parts["process"]
    if not spec.gpu:
        b.host["train"] = per_node * b.phases["train"]
        for phase in ("publish", "merge"):
            if phase in b.phases:  # rank 0 in its phase, the others holding their trained model
                others = (per_node - 1) * (b.parts.get("params", 0) + b.parts.get("ddp buckets", 0) + baseline)
                b.host[phase] = int(b.phases[phase] + others)
        return
    offloaded = sum(v for k, v in b.parts.items() if "(host" in k)
    held = b.host_parts["checkpoint staging"] + b.host_parts["records"]
    b.host["train"] = int(per_node * (baseline + held + offloaded))


def disk(spec, params, runs_models: int, hub_download: bool, stored_bytes: int) -> dict:
    """Bytes a stage writes or brings: the base from the hub (in its stored dtype), the outputs (models in
    fp32 safetensors, adapters), DVC's cache copy of the outputs, and its checkpoints."""
    full = sum(p.numel for p in params)
    base = sum(p.numel for p in params if not p.trainable)
    trainable = full - base
    w = DTYPE_BYTES[spec.weight_dtype]
    out = {"hub download": base * stored_bytes if hub_download else 0}
    if spec.section == "finetune_qlora":
        outputs = 4 * base + trainable * w
    elif spec.section == "memory_study":
        outputs = 0
    else:
        outputs = 4 * full * runs_models
    out["outputs"] = outputs
    out["dvc cache copy"] = outputs
    state = trainable * w + sum(optimizer_bytes(p.numel, w, spec.train["optimizer"]) for p in params if p.trainable)
    out["checkpoints"] = state * CHECKPOINTS_ON_DISK if spec.train["checkpoint_every"] else 0
    return out


def step_flops(params, mc, seq: int, tokens: int, checkpointing: str, every: int) -> float:
    """FLOPs of one optimizer step: 2 per weight and token forward, 2 backward for the input gradients and 2
    more for the weight gradients where weights train; attention's two (T x T) matmuls (4 x layers x T x
    hidden per token forward, twice that backward); a recomputed forward per checkpointed layer."""
    embed = mc.vocab_size * mc.hidden_size
    matmul = sum(p.numel for p in params if len(p.shape) == 2) - embed  # (the embedding is a lookup)
    trained = sum(p.numel for p in params if p.trainable and len(p.shape) == 2)
    if any(p.trainable and len(p.shape) == 2 and p.numel == embed and "embed" in p.name for p in params):
        trained -= embed
    layers = mc.num_hidden_layers
    attention = 4 * layers * seq * mc.hidden_size
    forward = 2 * matmul + attention
    per_token = forward + 2 * matmul + 2 * trained + 2 * attention
    if checkpointing != "none":
        share = 1.0 if checkpointing == "full" else math.ceil(layers / every) / layers
        per_token += share * (forward - 2 * mc.vocab_size * mc.hidden_size)  # (not the head)
    return per_token * tokens
