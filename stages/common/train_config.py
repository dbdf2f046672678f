"""The `train` section of every training stage: TrainConfig (what the loop is told), its choices and
checks, and the arithmetic of its batch over the data-parallel processes.

Its values are checked when the section is loaded (`__post_init__`: a bad key is one clear error before
any compute), against a number of processes (`refusal`: their layout, stages.common.mesh, and the batch
over the data-parallel ones; the launcher asks it before it starts them) and against the processes and
device once they are known (`check_layout`, called by stage.launch). It imports no torch: the pipeline tools
read it. Tests and benches build one with `build(**keys)`: the small run's values in RUN_DEFAULTS with
`keys` over them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from stages.common import config, mesh
from stages.common.precision import check_precision

if TYPE_CHECKING:
    from stages.common import runtime

# The pipeline schedules: GPipe (all forwards, then all backwards) and 1F1B (one forward, one backward).
SCHEDULES = ("gpipe", "1f1b")
STRATEGIES = ("ddp", "fsdp")
# AdamW in fp32, or bitsandbytes' 8-bit AdamW (block-wise quantized moments: 2 bytes per parameter
# instead of 8), optionally in paged memory that can spill to the host under GPU memory pressure.
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit")
# none; full: every decoder layer recomputes its activations in the backward pass; selective: every
# activation_checkpointing_every-th layer does (memory and speed between none and full).
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
# torch.compile modes; the max-autotune ones also tune the matrix multiplies (Triton on GPUs) and
# compile longer.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# How the processes share the model, not what it computes: a checkpoint saved under one layout resumes
# under another (DCP reshards on load), so these keys of a train section are not part of the checkpoint
# folder's key (TrainConfig.checkpoint_params).
LAYOUT_KEYS = (
    "strategy", "tensor_parallel", "pipeline_parallel", "pipeline_schedule", "data_parallel_replicate", "offload",
)  # fmt: skip
# How a run is watched, and how it saves (a run resumes the checkpoints of the other mode): not what it
# computes either.
WATCH_KEYS = ("hang_timeout_s", "collective_timeout_s")
SAVE_KEYS = ("async_checkpoint",)
# The dtype gradients are averaged over processes in: FSDP2's reduce-scatter (MixedPrecisionPolicy
# reduce_dtype), DDP's all-reduce (a compression hook), the all-reduce of replicated adapters. fp32 sums
# exactly as the one-process run does; bf16 and fp16 halve the bytes sent. (Their torch dtypes:
# stages.common.parallel.REDUCE_TORCH_DTYPES.)
REDUCE_DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainConfig:
    """The `train` section of every training stage (pretrain, extend_context, finetune_qlora)."""

    # Whether the stage trains adapters on a frozen base. Under FSDP the frozen base is sharded and the
    # few trainable parameters stay whole on every rank (see wrap), so any optimizer can step them.
    FROZEN_BASE: ClassVar[bool] = False
    # The keys that leave a checkpoint folder's key: how the run is laid out, watched and saved.
    UNKEYED: ClassVar[tuple[str, ...]] = (*LAYOUT_KEYS, *WATCH_KEYS, *SAVE_KEYS)

    steps: int
    batch_size: int
    micro_batch_size: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    strategy: str
    activation_checkpointing: str
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    log_every: int
    seed: int
    peak_tflops: float
    compile: bool = False
    compile_mode: str = "default"
    precision: str = "auto"
    optimizer: str = "adamw"
    activation_checkpointing_every: int = 2
    offload: bool = False
    reduce_dtype: str = "fp32"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    data_parallel_replicate: int = 1
    """strategy fsdp: the data-parallel processes form this many replicas, each sharding the model over
    the rest (HSDP: gradients reduce-scattered within a replica, then all-reduced across replicas)."""
    hang_timeout_s: float = 300.0
    """The hang watchdog's floor (stages.common.watchdog): a rank without progress for this long, or for
    10 median steps when that is longer, ends the run (exit 124), naming the rank and its host."""
    collective_timeout_s: float = 1800.0
    """The process group's timeout: how long one collective may wait for the others."""
    async_checkpoint: bool = True
    """Checkpoints are written in the background while training goes on (the step that saves only copies
    the state to host memory; published atomically once every rank's write is done); false: the step
    waits for the whole write. The same checkpoints either way; a stop signal's checkpoint is synchronous."""

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: unknown strategy {self.strategy!r}; valid: {', '.join(STRATEGIES)}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"compile_mode: unknown torch.compile mode {self.compile_mode!r}; valid: {', '.join(COMPILE_MODES)}"
            )
        check_precision(self.precision)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if self.optimizer != "adamw" and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"optimizer: {self.optimizer} needs bitsandbytes (pip install bitsandbytes) or use adamw")
        if self.optimizer != "adamw" and self.strategy == "fsdp" and not self.FROZEN_BASE:
            raise ValueError(
                f"optimizer: {self.optimizer} keeps its states per whole parameter and cannot step FSDP's "
                f"sharded ones; use strategy ddp or optimizer adamw"
            )
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype: unknown dtype {self.reduce_dtype!r}; valid: {', '.join(REDUCE_DTYPES)}")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing: unknown policy {self.activation_checkpointing!r}; valid: "
                f"{', '.join(ACTIVATION_CHECKPOINTING)}"
            )
        if self.offload and self.strategy != "fsdp":
            raise ValueError("offload: FSDP2's CPU offload shards parameters to the host; set strategy fsdp")
        if self.pipeline_schedule not in SCHEDULES:
            valid = ", ".join(SCHEDULES)
            raise ValueError(f"pipeline_schedule: unknown schedule {self.pipeline_schedule!r}; valid: {valid}")
        for key in ("tensor_parallel", "pipeline_parallel"):
            degree = getattr(self, key)
            if degree > 1 and self.FROZEN_BASE:
                raise ValueError(f"{key}: adapters on a frozen base train under ddp or fsdp; set it 1")
            unsupported = {"offload": self.offload, "compile": self.compile}  # (name: set)
            # bitsandbytes steps whole tensors, not DTensor shards; and its state loads only grouped as saved,
            # which pipeline stages (each with other parameters) cannot share in one checkpoint
            unsupported["optimizer"] = self.optimizer != "adamw"
            # fp16's gradient scaler: not wired into the pipeline schedule, and its unscaling kernel takes
            # no mix of DTensor and plain gradients (tensor parallel)
            unsupported["precision"] = self.precision == "fp16"
            for name, on in unsupported.items():
                if degree > 1 and on:
                    raise ValueError(
                        f"{key}: {degree} is not supported with {name} {getattr(self, name)}; change {name} or "
                        f"set {key} 1"
                    )
        if self.data_parallel_replicate > 1 and self.strategy != "fsdp":
            raise ValueError(
                "data_parallel_replicate: replicas of FSDP2's shards (HSDP) need strategy fsdp; ddp replicates the "
                "model on every data-parallel process already: set it 1"
            )
        keys = ("steps", "batch_size", "micro_batch_size", "log_every", "activation_checkpointing_every")
        for key in (*keys, "tensor_parallel", "pipeline_parallel", "data_parallel_replicate"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        for key in ("hang_timeout_s", "collective_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0 seconds, got {getattr(self, key)}")
        if self.collective_timeout_s < self.hang_timeout_s:
            raise ValueError(
                f"collective_timeout_s ({self.collective_timeout_s:g}) must be at least hang_timeout_s "
                f"({self.hang_timeout_s:g}): a stalled peer is then named by the watchdog, not lost in a timeout"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be between 0 and lr ({self.lr}), got {self.min_lr}")

    @classmethod
    def checkpoint_params(cls, section: dict) -> dict:
        """The keys of a train section (as a dict) that a checkpoint folder's key holds: all but UNKEYED."""
        return {k: v for k, v in section.items() if k not in cls.UNKEYED}

    @property
    def loss_compile_mode(self) -> str | None:
        """The mode lm_loss compiles the loss in; None without compile."""
        return self.compile_mode if self.compile else None

    def refusal(self, where: str, processes: int) -> str | None:
        """Why `processes` cannot run this train section (at the dotted path `where`, e.g. pretrain.train),
        as the one line a stage refuses them with: their layout (mesh.Layout.over), or the global batch over
        the data-parallel ones (micro_batch, naming the process counts that work); None when they can."""
        try:
            layout = mesh.Layout.over(self, processes)
        except ValueError as e:
            return f"params.yaml: {where}.{e}"
        try:
            grad_accum_steps(self, layout.data_size)
        except ValueError as e:
            split = " (processes here: the data-parallel ones, processes / (tensor x pipeline degree))"
            return f"params.yaml: {where}.{e}{split if layout.splits_model else ''}"
        return None

    def check_layout(self, where: str, rt: runtime.Runtime) -> None:
        """What a train section (at the dotted path `where`, e.g. pretrain.train) can only be checked against
        once the processes and the device are known; before any compute."""
        refusal = self.refusal(where, rt.world_size)
        if refusal:
            raise config.UserError(refusal)
        if self.offload and not rt.distributed:
            raise config.UserError(
                f"params.yaml: {where}.offload: FSDP2's CPU offload shards over the processes of a torchrun run; "
                f"this one has a single process: run it with torchrun --nproc-per-node 2 or more, or set it false"
            )
        if self.offload and rt.device.type != "cuda":
            raise config.UserError(
                f"params.yaml: {where}.offload: FSDP2's CPU offload moves parameters, gradients and optimizer "
                f"states from GPU memory to the host; this run is on {rt.device.type}, where they are there already: "
                f"set it false"
            )


@dataclass(frozen=True)
class AdapterTrainConfig(TrainConfig):
    """The `train` section of a stage that trains adapters on a frozen base (finetune_qlora)."""

    FROZEN_BASE: ClassVar[bool] = True


# The most data-parallel processes named when a batch cannot be shared (one node of 8 GPUs, and 2 to 4 nodes)
MAX_NAMED_PROCESSES = 32


def micro_batch(cfg: TrainConfig, data_size: int) -> int:
    """The sequences each of `data_size` data-parallel processes puts through one forward and backward: the
    largest number that divides its share of the global batch (batch_size / data_size) and is at most
    micro_batch_size. The params fix the global batch and the largest micro-batch (a memory bound); the
    processes and the accumulation follow, so the same params train the same way on 1, 2, 4 or 8 of them.
    ValueError, naming the process counts that work, when the batch cannot be shared evenly."""
    if cfg.batch_size % data_size:
        counts = [n for n in range(1, min(cfg.batch_size, MAX_NAMED_PROCESSES) + 1) if cfg.batch_size % n == 0]
        raise ValueError(
            f"batch_size ({cfg.batch_size} sequences per step) cannot be shared evenly by {data_size} data-parallel "
            f"processes; it can by {', '.join(map(str, counts))}: run on one of those, or set batch_size to a "
            f"multiple of {data_size}"
        )
    share = cfg.batch_size // data_size
    return max(m for m in range(1, min(share, cfg.micro_batch_size) + 1) if share % m == 0)


def grad_accum_steps(cfg: TrainConfig, data_size: int) -> int:
    """Micro-batches per optimizer step on each of `data_size` data-parallel processes (see micro_batch)."""
    return cfg.batch_size // data_size // micro_batch(cfg, data_size)


# A small valid run (the tests' and benches' starting point): build(**keys) sets what they vary.
RUN_DEFAULTS = {
    "steps": 8,
    "batch_size": 8,
    "micro_batch_size": 4,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup_steps": 2,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,
    "strategy": "ddp",
    "activation_checkpointing": "none",
    "eval_every": 0,
    "eval_batches": 2,
    "checkpoint_every": 0,
    "log_every": 1,
    "seed": 0,
    "peak_tflops": 1.0,
}


def build(cls: type[TrainConfig] | None = None, **keys) -> TrainConfig:
    """A TrainConfig (or `cls`, e.g. AdapterTrainConfig) of RUN_DEFAULTS with `keys` over them."""
    return (cls or TrainConfig)(**{**RUN_DEFAULTS, **keys})


def with_keys(train: TrainConfig, where: str, keys: dict) -> TrainConfig:
    """`train` with `keys` over it, checked like a section of its own at the dotted path `where` (a
    ConfigError naming `<where>.<key>`): a memory_study technique's train section."""
    return config.build(type(train), where, {**config.as_dict(train), **keys})
