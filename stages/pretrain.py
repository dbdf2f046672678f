"""pretrain: train a Llama model from scratch on the tokenize stage's shards.

Builds `LlamaForCausalLM` from the model section of params (no hub weights; the vocabulary is the
tokenizer's), trains it with the codebase's one loop (stages/common/loop.py: DDP or FSDP2, AdamW,
warmup + cosine, accumulation, clipping, validation, checkpoints), and writes the final model in
Hugging Face format with its tokenizer.

Checkpoints live in checkpoints/pretrain/<hash of params and inputs>/step-<n>/ (sharded, written
atomically, every `train.checkpoint_every` steps and on a stop signal); re-running after a crash or preemption
resumes from the newest complete one, with the same losses as an uninterrupted run.

Run:
    python -m stages.pretrain --input data/tokenize --output data/pretrain [key=value ...]
    torchrun --nproc-per-node 2 -m stages.pretrain --input data/tokenize --output data/pretrain train.strategy=fsdp
    snakemake --cores all pretrain            # or: dvc repro pretrain

Output (data/pretrain/):
    model/         config.json, model.safetensors, tokenizer files: AutoModelForCausalLM/AutoTokenizer load it
    meta.json      step, tokens seen, final train/val loss, parameter count, model config, compute
                   dtype, the CPU the kernels were chosen for, the code's hash and the package versions
    figures.json   final train/val loss, tokens seen, parameters
    metrics.json   final val loss (DVC metrics)
    plots/loss.csv, val_loss.csv, loss.png   the loss curves (DVC plots)
and, outside it (--measured, measured/pretrain.json in the pipeline): tokens/s and MFU of this run.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from stages.common import atomic, config, loop, runtime, shards, stage, train_config
from stages.common.stagerun import StageRun

STAGE = "pretrain"


@dataclass(frozen=True)
class ModelConfig:
    """A Llama decoder (the vocabulary is the tokenizer's)."""

    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float

    def __post_init__(self):
        if min(self.n_layers, self.hidden_size, self.n_heads, self.n_kv_heads, self.intermediate_size) < 1:
            raise ValueError("n_layers, hidden_size, n_heads, n_kv_heads and intermediate_size must be >= 1")
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("hidden_size must be a multiple of n_heads, and n_heads of n_kv_heads")


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    context_length: int
    train: train_config.TrainConfig

    def __post_init__(self):
        if not 1 <= self.context_length <= self.model.max_position_embeddings:
            raise ValueError(
                f"context_length ({self.context_length}) must be between 1 and model.max_position_embeddings "
                f"({self.model.max_position_embeddings}); lower it or raise model.max_position_embeddings"
            )


def build_model(cfg: ModelConfig, vocab: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = LlamaConfig(
        vocab_size=vocab["vocab_size"],
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        bos_token_id=vocab["bos_token_id"],
        eos_token_id=vocab["eos_token_id"],
        pad_token_id=vocab["pad_token_id"],
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(mc)


def check_input(folder: Path) -> dict:
    """The tokenize stage's output, checked before any compute."""
    try:
        meta = shards.read_meta(folder)
    except FileNotFoundError as e:
        raise config.UserError(f"pretrain: {e}") from None
    for split in ("train", "val"):
        try:
            shards.check_split(folder, split)
        except config.UserError as e:
            raise config.UserError(f"pretrain: {e}") from None
    tok_dir = folder / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        raise config.UserError(f"pretrain: no tokenizer in {tok_dir}; re-run tokenize")
    try:
        shards.check_tokenizer(folder)
    except config.UserError as e:
        raise config.UserError(f"pretrain: {e}") from None
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(tok_dir))
    if n != meta["vocab_size"]:
        raise config.UserError(
            f"pretrain: tokenizer in {tok_dir} has {n} tokens but {folder}/meta.json says "
            f"vocab_size {meta['vocab_size']}; re-run tokenize"
        )
    return meta


def save_outputs(tmp: Path, model_sd: dict, cfg: Config, meta_in: dict, inp: Path, result: loop.TrainResult) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = result.history
    model = build_model(cfg.model, meta_in)
    model.load_state_dict(model_sd)
    model.save_pretrained(tmp / "model")
    shutil.copytree(inp / "tokenizer", tmp / "model", dirs_exist_ok=True)
    n_params = sum(p.numel() for p in model.parameters())
    steps = hist["step"][-1]
    meta = {
        "step": steps,
        "tokens_seen": steps * cfg.train.batch_size * cfg.context_length,
        "final_train_loss": hist["loss"][-1],
        "final_val_loss": hist["val_loss"][-1] if hist["val_loss"] else None,
        "parameters": n_params,
        "flops_per_token": result.flops_per_token,
        "model_config": model.config.to_dict(),
        "compute_dtype": result.compute_dtype,
        "optimizer_state_bytes": result.optimizer_state_bytes,  # rank 0's (its shard under fsdp)
        "cpu": runtime.cpu_info(),
        **stage.code_record(STAGE),
    }
    atomic.write_json(tmp / "meta.json", meta)
    figures = {k: meta[k] for k in ("final_train_loss", "final_val_loss", "tokens_seen", "parameters")}
    stage.write_metrics(tmp, figures, {"final_val_loss": figures["final_val_loss"]})
    loop.write_curves(tmp / "plots", hist)
    val = dict(zip(hist["val_step"], hist["val_loss"], strict=True))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(hist["step"], hist["loss"], label="train")
    if val:
        ax.plot(list(val), list(val.values()), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"pretrain: {n_params / 1e6:.1f}M parameters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(tmp / "plots/loss.png", dpi=100)
    plt.close(fig)
    return meta


def run(
    cfg: Config, inp: Path, output: Path, measured: Path, meta_in: dict, rt: runtime.Runtime, stop: runtime.StopFlag
) -> dict:
    """Build the model and data, train, publish. The wrapped (DDP/FSDP) model lives only in here: it
    must be gone before the process group is torn down, or gloo's shutdown can deadlock on it."""
    runtime.seed_everything(cfg.train.seed)
    model = build_model(cfg.model, meta_in)
    # memory-mapped: each process holds the pages its windows read, not the split
    train_tokens, val_tokens = shards.open_stream(inp, "train"), shards.open_stream(inp, "val")
    run = StageRun(STAGE, cfg, rt, stop, stage.inputs_hash([inp], rt))
    with run.checkpoints() as folder, run.tracked():
        result = loop.fit(model, train_tokens, val_tokens, cfg.train, cfg.context_length, run)
        model_sd = loop.full_state_dict(result.model, rt)
        meta = run.publish(output, lambda tmp: save_outputs(tmp, model_sd, cfg, meta_in, inp, result))
        speed = {"tokens_per_s": result.tokens_per_s, "mfu": result.mfu, "tokens_per_cpu_s": result.tokens_per_cpu_s}
        run.spent.append(folder.path)  # the run is complete; its checkpoints are spent
        run.finish(
            output,
            measured=(measured, speed),
            artifacts=((output / "plots/loss.png", "plots"), output / "meta.json"),
            models={None: output / "model"},
            inputs=(inp,),
        )
    val = meta["final_val_loss"]
    runtime.print0(
        f"pretrain: {meta['parameters'] / 1e6:.2f}M parameters, {meta['step']} steps, train loss "
        f"{meta['final_train_loss']:.4f}, val loss {'-' if val is None else f'{val:.4f}'} -> {output}",
        rt=rt,
    )
    # One process: hand back the trained model itself (tests compare it with what was saved).
    return {**meta, "history": result.history, "model": None if rt.distributed else result.model}


def main(argv=None) -> dict:
    args, cfg = stage.setup(__doc__, STAGE, Config, {"input": "data/tokenize", "output": "data/pretrain"}, argv)
    inp, output = Path(args.input), Path(args.output)
    meta_in = check_input(inp)
    measured = Path(args.measured)
    return stage.launch(STAGE, lambda rt, stop: run(cfg, inp, output, measured, meta_in, rt, stop), train=cfg.train)


if __name__ == "__main__":
    stage.entry(main)
