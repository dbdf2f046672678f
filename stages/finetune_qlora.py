"""finetune_qlora: instruction-tune a causal LM with LoRA adapters on a 4-bit NF4 base, under FSDP2.

Loads the base model (`--base`: a Hugging Face folder, the pretrain stage's model or the base stage's
copy of a hub model)
with `BitsAndBytesConfig` (NF4, double quantization, compute dtype, and a quant storage dtype equal to
the dtype FSDP shards: fp32 on CPU, bf16 on GPU), adds PEFT LoRA adapters to the linear layers in
`target_modules`, and trains only the adapters with the codebase's one loop (stages/common/loop.py:
FSDP2 `fully_shard` per decoder layer then the root, AdamW, warmup + cosine, accumulation, clipping,
activation checkpointing, checkpoints and exact resume). `quantization: none` runs the same stage on
the unquantized base: the 16-bit (fp32 on CPU) LoRA baseline of the comparison.

Data: Alpaca-format records (instruction, input, output) from prepare_data's instructions.jsonl (or
any .jsonl given as --input). Each record becomes `bos + prompt + response + eos` with the Alpaca
prompt template; only response tokens (and the eos) carry loss, prompt and padding targets are -100.
Records are split into train/eval by a seeded permutation; a record whose prompt leaves no room
for a response within `seq_length` tokens is dropped, a longer response is cut.

Checkpoints (adapters, optimizer, step, RNG; the data position is the step) live in
checkpoints/finetune_qlora/<hash of params and inputs>/step-<n>/; re-running resumes from the newest.

Run:
    python -m stages.finetune_qlora --base data/pretrain/model --input data/prepare_data \\
        --output data/finetune_qlora/nf4 [key=value ...]
    torchrun --nproc-per-node 2 -m stages.finetune_qlora --input data/prepare_data \\
        --output data/finetune_qlora/none quantization=none
    snakemake --cores all data/finetune_qlora/nf4 data/finetune_qlora/none   # or: dvc repro finetune_qlora

Output (data/finetune_qlora/<quantization>/):
    adapter/       the LoRA adapter in PEFT format: PeftModel.from_pretrained(base, "adapter")
    model/         the merged model in full precision (base dequantized + adapter, made and written one weight
                   at a time; shards of at most 5 GB above that) with the tokenizer:
                   AutoModelForCausalLM.from_pretrained("model")
    figures.json   eval/train loss, linear-layer weight memory, trainable parameters, records
    metrics.json   eval loss, bits per linear-layer weight (DVC metrics)
    results.json   report rows (NF4 weight memory against 16-bit, as in the QLoRA paper)
    plots/loss.csv, eval_loss.csv, loss.png   the loss curves (DVC plots)
and, outside it (--measured, measured/finetune_qlora/<quantization>.json in the pipeline): tokens/s,
and the peak process memory of this run.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common import (
    atomic,
    config,
    hf_folder,
    instructions,
    loop,
    lora_merge,
    registry,
    runtime,
    stage,
    train_config,
)
from stages.common.stagerun import StageRun
from stages.models import llama

STAGE = "finetune_qlora"
QUANTIZATIONS = ("nf4", "none")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}
# QLoRA (Dettmers et al. 2023), section 3: NF4 with double quantization stores 4 + 0.127 bits per weight.
NF4_BITS_PER_WEIGHT = 4.127


@dataclass(frozen=True)
class LoRA:
    """The adapters (Hu et al. 2021): B A added to each target linear layer's weight, scaled by alpha / r."""

    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"r must be >= 1, got {self.r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("target_modules must name at least one module (or [all-linear])")


@dataclass(frozen=True)
class Config:
    quantization: str
    quant_storage: str
    double_quant: bool
    lora: LoRA
    template: str
    seq_length: int
    eval_fraction: float
    train: train_config.AdapterTrainConfig
    base: str = dataclasses.field(default="", metadata={"path": True})  # --base, set by main: not a param

    def __post_init__(self):
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: unknown {self.quantization!r}; valid: {', '.join(QUANTIZATIONS)}")
        if self.quant_storage != "auto" and self.quant_storage not in DTYPES:
            raise ValueError(f"quant_storage: unknown dtype {self.quant_storage!r}; valid: auto, {', '.join(DTYPES)}")
        if self.template not in ("alpaca", "short"):
            raise ValueError(f"template: unknown template {self.template!r}; valid: alpaca, short")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be between 0 and 1, got {self.eval_fraction}")
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        if self.train.compile:
            raise ValueError("train.compile: bitsandbytes' 4-bit kernels are opaque to torch.compile; set it false")
        if self.train.precision != "auto":
            raise ValueError(
                "train.precision: the base computes in its load dtype (bf16 on GPUs, fp32 on CPUs); set it to auto"
            )


# ----------------------------------------------------------------------------------------------- model
def storage_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    return runtime.compute_dtype(device) if cfg.quant_storage == "auto" else DTYPES[cfg.quant_storage]


def check_base(cfg: Config) -> dict:
    """The base model's config, checked before any compute: weights present, target modules exist."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(cfg.base)
    hf_folder.check(
        path,
        f"finetune_qlora: --base {path}",
        "run the stage that writes it first (pretrain, or base for a hub model: params base.model), or pass "
        "--base a Hugging Face model folder",
        "re-run the stage that wrote it or pass --base a complete model folder",
    )
    try:
        mc = AutoConfig.from_pretrained(cfg.base)
    except OSError as e:
        raise config.UserError(
            f"finetune_qlora: --base {cfg.base}: cannot load its config.json ({str(e).splitlines()[0]})"
        ) from None
    if "all-linear" not in cfg.lora.target_modules:
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(mc)
        linear = {name.rsplit(".", 1)[-1] for name, m in shell.named_modules() if isinstance(m, torch.nn.Linear)}
        unknown = [t for t in cfg.lora.target_modules if t not in linear]
        if unknown:
            raise config.UserError(
                f"finetune_qlora.lora.target_modules: {', '.join(unknown)} match no linear layer of "
                f"{cfg.base}; its linear layers are {', '.join(sorted(linear))} (or use [all-linear])"
            )
    return mc.to_dict()


def check_parallelism(cfg: Config, rt: runtime.Runtime) -> None:
    """FSDP flattens and shards parameters of one dtype: the packed 4-bit weights must share the dtype
    of the other parameters (norms, embeddings, adapters)."""
    storage, compute = storage_dtype(cfg, rt.device), runtime.compute_dtype(rt.device)
    if cfg.quantization == "nf4" and cfg.train.strategy == "fsdp" and rt.distributed and storage != compute:
        raise config.UserError(
            f"finetune_qlora.quant_storage={cfg.quant_storage}: FSDP cannot shard {storage} packed weights beside "
            f"{compute} parameters; set quant_storage: auto ({str(compute).removeprefix('torch.')} here) "
            "or train.strategy: ddp"
        )


def load_base(cfg: Config, device: torch.device, quantized: bool):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = runtime.compute_dtype(device)
    kwargs = {"dtype": dtype, "device_map": {"": device}, "use_safetensors": True}
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=cfg.double_quant,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=storage_dtype(cfg, device),
        )
    model = AutoModelForCausalLM.from_pretrained(cfg.base, **kwargs)
    if quantized:
        keep_4bit_layout(model)
    return model


def keep_4bit_layout(model) -> None:
    """Keep every 4-bit weight in the layout that trains, on every CPU.

    bitsandbytes (0.50 here) repacks a 4-bit weight in place, for good, into a layout for its AVX512-BF16
    CPU kernel the first time the layer runs in eval mode with an input that needs no grad (any no-grad
    evaluation) on a CPU that has the instructions. From then on every call, training ones too, goes to
    that kernel: bf16 math and no backward, so the gradients reaching earlier layers' adapters are
    wrong, on those CPUs only. Here the layer's switch for it is turned off (a weight already repacked
    is refused), and a hook fails loudly should a bitsandbytes version repack by another path: training and
    evaluation compute with the dequantized weights in the compute dtype everywhere (evaluation is
    bit-equal to the training forward pass, and results do not depend on the CPU's instructions)."""
    import bitsandbytes as bnb

    for name, mod in model.named_modules():
        if not isinstance(mod, bnb.nn.Linear4bit):
            continue
        # bitsandbytes' inverse of the repacking does not restore the per-block constants exactly, so a
        # repacked weight is refused, not unpacked: load the base afresh.
        if cpu_packed(mod):
            raise RuntimeError(
                f"finetune_qlora: {name} was repacked for bitsandbytes' CPU inference kernel before "
                f"training; load the base model afresh (load_base) instead of reusing an evaluated one"
            )
        mod.support_avx512bf16_for_cpu = False  # the switch Linear4bit.forward reads before repacking
        # before the call (a repack from outside forward) and after it (a repack inside forward)
        mod.register_forward_pre_hook(functools.partial(_refuse_cpu_packing, name=name))
        mod.register_forward_hook(functools.partial(_refuse_cpu_packing, name=name))


def cpu_packed(layer) -> bool:
    """Whether a 4-bit layer's weight is in bitsandbytes' CPU inference layout."""
    return bool(getattr(getattr(layer.weight, "quant_state", None), "packing_format_for_cpu", False))


def _refuse_cpu_packing(layer, *args, name: str):
    if cpu_packed(layer):
        import bitsandbytes

        raise RuntimeError(
            f"finetune_qlora: bitsandbytes {bitsandbytes.__version__} repacked the 4-bit weight of "
            f"{name} for its CPU inference kernel (bf16, no backward), which would corrupt training; "
            f"use the bitsandbytes version in requirements.lock"
        )


def lora_config(cfg: Config):
    from peft import LoraConfig

    targets = "all-linear" if "all-linear" in cfg.lora.target_modules else list(cfg.lora.target_modules)
    return LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def add_adapters(model, cfg: Config):
    from peft import get_peft_model

    # Adapters in the dtype of the base (no fp32 upcast under bf16): FSDP shards parameters of one dtype.
    return get_peft_model(model, lora_config(cfg), autocast_adapter_dtype=False)


def linear_weight_memory(model) -> tuple[int, int]:
    """(bytes the decoder layers' linear weights take as stored, how many weights they represent).
    4-bit layers count their packed weights and per-block constants; the NF4 and 8-bit code tables
    (16 and 256 values per layer, the same in every layer) are left out, as in the QLoRA paper."""
    stored = count = 0
    for layer in llama.decoder_layers(model):
        for mod in layer.modules():
            if not isinstance(mod, torch.nn.Linear):  # bitsandbytes' Linear4bit is one too
                continue
            w = mod.weight
            stored += w.numel() * w.element_size()
            qs = getattr(w, "quant_state", None)
            if qs is not None:
                stored += qs.absmax.numel() * qs.absmax.element_size()
                if qs.nested:
                    stored += qs.state2.absmax.numel() * qs.state2.absmax.element_size() + 4  # + the fp32 offset
            count += mod.in_features * mod.out_features
    return stored, count


def peak_memory_mb(device: torch.device) -> float:
    """Peak resident memory of this process (on GPU: peak allocated device memory), MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------------- outputs
def with_adapter(cfg: Config, device: torch.device, adapter_sd: dict):
    """The base loaded as it trained, with the trained adapter's state."""
    model = add_adapters(load_base(cfg, device, cfg.quantization == "nf4"), cfg)
    missing, unexpected = model.load_state_dict(adapter_sd, strict=False)
    lora_missing = [k for k in missing if "lora_" in k]
    if unexpected or lora_missing or not adapter_sd:
        raise RuntimeError(
            f"adapter state does not fit the model: unexpected {unexpected[:3]}, missing {lora_missing[:3]}"
        )
    return model


def save_adapter_and_merged(tmp: Path, adapter_sd: dict, cfg: Config, tok, device: torch.device, trained=None) -> None:
    """adapter/ in PEFT format, then model/: the base dequantized to fp32 with the adapter merged in, made
    and written one weight at a time (stages.common.lora_merge), so the device holds the base as it trained
    plus one merged weight, not the whole model in fp32. `trained`: the trained model where this process
    holds it whole (one process), merged as it is; else the base is loaded again and given the adapter."""
    quantized = cfg.quantization == "nf4"
    model = trained if trained is not None else with_adapter(cfg, device, adapter_sd)
    lora = model.peft_config["default"]
    lora.target_modules = sorted(lora.target_modules)  # a set after all-linear: saved sorted, the file is reproducible
    model.save_pretrained(tmp / "adapter")
    # Dequantized weights are exactly what the trained model computed with (not the original fp weights).
    lora_merge.save_merged(model, tmp / "model", upcast=not quantized)
    tok.save_pretrained(tmp / "model")


def write_plots(tmp: Path, hist: dict, cfg: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loop.write_curves(tmp / "plots", hist, "eval_loss")
    val = dict(zip(hist["val_step"], hist["val_loss"], strict=True))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(hist["step"], hist["loss"], label="train (response tokens)")
    if val:
        ax.plot(list(val), list(val.values()), "o-", label="eval")
    ax.set(
        xlabel="step", ylabel="loss (nats/token)", title=f"finetune_qlora: LoRA r={cfg.lora.r}, base {cfg.quantization}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(tmp / "plots/loss.png", dpi=100)
    plt.close(fig)


def result_rows(cfg: Config, metrics: dict) -> list[dict]:
    if cfg.quantization != "nf4" or not cfg.double_quant:
        return []
    return [
        {
            "result": "NF4 + double quantization: linear-layer weight memory / 16-bit",
            "paper": "Dettmers et al. 2023 (QLoRA), section 3",
            "published": round(NF4_BITS_PER_WEIGHT / 16, 4),
            "ours": round(metrics["linear_weight_fraction_of_16bit"], 4),
            "tolerance": 0.01,
        }
    ]


# ------------------------------------------------------------------------------------------------- run
def run(
    cfg: Config,
    records: list[dict],
    records_path: Path,
    output: Path,
    measured: Path,
    rt: runtime.Runtime,
    stop: runtime.StopFlag,
) -> dict:
    """Train and publish. The wrapped model lives only in here (it must be gone before teardown)."""
    from transformers import AutoTokenizer

    runtime.seed_everything(cfg.train.seed)
    tok = AutoTokenizer.from_pretrained(cfg.base)
    inputs, targets, dropped = instructions.encode(records, tok, cfg.template, cfg.seq_length)
    if len(inputs) < 2:
        raise config.UserError(
            f"finetune_qlora: only {len(inputs)} of {len(records)} records leave room for a response "
            f"in seq_length={cfg.seq_length} tokens; raise seq_length"
        )
    train_rows, eval_rows = instructions.split(len(inputs), cfg.eval_fraction, cfg.train.seed)
    batch, seed = cfg.train.batch_size, cfg.train.seed
    train_src = instructions.Records(inputs[train_rows], targets[train_rows], batch, seed)
    eval_src = instructions.Records(inputs[eval_rows], targets[eval_rows], batch, seed)
    del inputs, targets  # (the split's copies train; the encoded arrays go: 0.4 GiB per process on all of Alpaca)
    # eval_batches 0: enough global batches to cover every eval record once
    train_cfg = dataclasses.replace(cfg.train, eval_batches=cfg.train.eval_batches or math.ceil(len(eval_src) / batch))
    model = load_base(cfg, rt.device, cfg.quantization == "nf4")
    linear_bytes, linear_weights = linear_weight_memory(model)
    model = add_adapters(model, cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    runtime.print0(
        f"finetune_qlora: {len(train_src)} train / {len(eval_src)} eval records ({dropped} too long), "
        f"{trainable / 1e6:.3f}M trainable parameters, base {cfg.quantization}",
        rt=rt,
    )
    steps = cfg.train.steps
    digest = stage.inputs_hash([records_path, Path(cfg.base)] if Path(cfg.base).exists() else [records_path], rt)
    run = StageRun(STAGE, cfg, rt, stop, digest)
    with run.checkpoints() as folder, run.tracked(tags={"base": cfg.base, **registry.origin(cfg.base)}) as tracker:
        result = loop.fit(model, train_src, eval_src, train_cfg, cfg.seq_length, run)
        hist = result.history
        if hist["val_step"] and hist["val_step"][-1] == steps:
            eval_loss = hist["val_loss"][-1]
        else:  # the final eval, also the last point of the eval-loss curve
            eval_loss = loop.evaluate(result.model, eval_src, train_cfg, rt)
            hist = {**hist, "val_step": [*hist["val_step"], steps], "val_loss": [*hist["val_loss"], eval_loss]}
        peak = max(runtime.gather_objects(peak_memory_mb(rt.device)))
        adapter_sd = loop.full_state_dict(result.model, rt, trainable_only=True)
        trained = None if rt.distributed else result.model
        del model, result.model
        gc.collect()
        metrics = {
            "eval_loss": eval_loss,
            "final_train_loss": hist["loss"][-1],
            "linear_weight_mb": linear_bytes / 2**20,
            "linear_weight_bits_per_weight": 8 * linear_bytes / linear_weights,
            "linear_weight_fraction_of_16bit": linear_bytes / (2 * linear_weights),
            "trainable_parameters": trainable,
            "optimizer_state_bytes": result.optimizer_state_bytes,
            "train_records": len(train_src),
            "eval_records": len(eval_src),
        }
        speed = {"tokens_per_s": result.tokens_per_s, "peak_memory_mb": peak}
        tracker.log_metrics(
            {"eval_loss": eval_loss, "linear_weight_mb": metrics["linear_weight_mb"], **speed}, step=steps
        )
        meta = {
            "base": cfg.base,
            **registry.origin(cfg.base),
            "quantization": cfg.quantization,
            "step": steps,
            "dropped_records": dropped,
            "storage_dtype": str(storage_dtype(cfg, rt.device)),
            "compute_dtype": str(runtime.compute_dtype(rt.device)),
            "world_size": rt.world_size,
            "cpu": runtime.cpu_info(),
            **stage.code_record(STAGE),
        }

        def write(tmp: Path) -> None:
            save_adapter_and_merged(tmp, adapter_sd, cfg, tok, rt.device, trained)
            headline = ("eval_loss", "linear_weight_bits_per_weight")
            stage.write_metrics(tmp, metrics, {k: metrics[k] for k in headline})
            atomic.write_json(tmp / "results.json", result_rows(cfg, metrics))
            atomic.write_json(tmp / "meta.json", meta)
            write_plots(tmp, hist, cfg)

        run.publish(output, write)
        run.spent.append(folder.path)  # the run is complete; its checkpoints are spent
        run.finish(
            output,
            measured=(measured, speed),
            artifacts=((output / "plots/loss.png", "plots"), output / "figures.json", (output / "adapter", "adapter")),
            models={cfg.quantization: output / "model"},
            inputs=(records_path, Path(cfg.base)),
        )
    runtime.print0(
        f"finetune_qlora ({cfg.quantization}): eval loss {eval_loss:.4f}, peak memory {peak:.0f} MiB, linear "
        f"weights {metrics['linear_weight_mb']:.2f} MiB ({metrics['linear_weight_bits_per_weight']:.2f} bits/weight) "
        f"-> {output}",
        rt=rt,
    )
    # One process: hand back the trained model itself (tests compare it with what was saved).
    return {**metrics, **speed, "history": hist, "model": trained}


def check_records(inp: Path) -> tuple[Path, list[dict]]:
    records_path = inp / "instructions.jsonl" if inp.is_dir() else inp
    if not records_path.is_file():
        raise config.UserError(
            f"finetune_qlora: no instruction records at {records_path}; run prepare_data "
            f"(prepare_data.instructions must not be none) or pass --input FILE.jsonl"
        )
    return records_path, instructions.read_records(records_path)


def main(argv=None) -> dict:
    paths = {"input": "data/prepare_data", "output": "data/finetune_qlora/nf4", "base": "data/pretrain/model"}
    args, cfg = stage.setup(__doc__, STAGE, Config, paths, argv)
    if cfg.base:
        raise config.UserError(f"finetune_qlora.base ({cfg.base}): the base is a path, given as --base; remove the key")
    cfg = dataclasses.replace(cfg, base=args.base)
    output = Path(args.output)
    records_path, records = check_records(Path(args.input))
    base_config = check_base(cfg)
    if cfg.seq_length > base_config.get("max_position_embeddings", cfg.seq_length):
        raise config.UserError(
            f"params.yaml: finetune_qlora.seq_length ({cfg.seq_length}) exceeds the base model's "
            f"max_position_embeddings ({base_config['max_position_embeddings']}); lower seq_length"
        )

    def body(rt, stop):
        check_parallelism(cfg, rt)
        return run(cfg, records, records_path, output, Path(args.measured), rt, stop)

    return stage.launch(STAGE, body, train=cfg.train)


if __name__ == "__main__":
    stage.entry(main)
