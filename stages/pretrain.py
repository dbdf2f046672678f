"""pretrain: train a Llama model from scratch on the tokenize stage's shards.

Builds `LlamaForCausalLM` from the model section of params (no hub weights; the vocabulary is the
tokenizer's), trains it with the codebase's one loop (stages/common/loop.py: DDP or FSDP2, AdamW,
warmup + cosine, accumulation, clipping, validation, checkpoints), and writes the final model in
Hugging Face format with its tokenizer.

Checkpoints live in checkpoints/pretrain/<hash of params and inputs>/step-<n>/ (sharded, written
atomically, every `checkpoint_every` steps and on SIGTERM); re-running after a crash or preemption
resumes from the newest complete one, with the same losses as an uninterrupted run.

Run:
    python -m stages.pretrain --input data/tokenize --output data/pretrain [key=value ...]
    torchrun --nproc-per-node 2 -m stages.pretrain --input data/tokenize --output data/pretrain strategy=fsdp
    snakemake --cores all pretrain            # or: dvc repro pretrain

Output (data/pretrain/):
    model/         config.json, model.safetensors, tokenizer files: AutoModelForCausalLM/AutoTokenizer load it
    meta.json      step, tokens seen, final train/val loss, git commit, parameter count, model config,
                   compute dtype and the CPU the kernels were chosen for
    metrics.json   final train/val loss, tokens/s, MFU
    plots/loss.csv, val_loss.csv, loss.png   the loss curves (DVC plots)
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

from stages.common import ckpt, config, dist, loop, shards, track

STAGE = "pretrain"


@dataclass(frozen=True)
class Config:
    # model
    n_layers: int
    """Decoder layers."""
    hidden_size: int
    """Model width."""
    n_heads: int
    """Attention heads (hidden_size must be a multiple)."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than n_heads)."""
    intermediate_size: int
    """MLP width."""
    max_position_embeddings: int
    """The model's configured context; context_length may not exceed it."""
    rope_theta: float
    """RoPE base frequency."""
    # training
    context_length: int
    """Tokens per training window."""
    steps: int
    """Optimizer steps."""
    batch_size: int
    """Sequences per optimizer step over all processes (tokens per step = batch_size x context_length)."""
    micro_batch_size: int
    """Sequences per forward pass per process; accumulation = batch_size / (micro_batch_size x processes)."""
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    strategy: str
    """ddp | fsdp (FSDP2 fully_shard per decoder layer, then the root)."""
    activation_checkpointing: bool
    compile: bool
    """torch.compile the model (per layer under fsdp) and the loss."""
    compile_mode: str
    """torch.compile mode: default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs."""
    precision: str
    """auto (bf16 autocast on GPUs, fp32 on CPUs) | fp32 | bf16 (autocast; fast on CPUs with AVX512-BF16/AMX)."""
    eval_every: int
    """Validation loss every N steps (0: only never)."""
    eval_batches: int
    """Global batches of fixed validation windows per evaluation."""
    checkpoint_every: int
    """Save a checkpoint every N steps (0: only on SIGTERM)."""
    log_every: int
    seed: int
    peak_tflops: float
    """Peak dense FLOP/s of one process's device, in TFLOP/s, for MFU (fp32 CPU here ~0.1; H100 bf16 ~990)."""

    def __post_init__(self):
        if self.strategy not in loop.STRATEGIES:
            raise ValueError(f"strategy: unknown strategy {self.strategy!r}; valid: {', '.join(loop.STRATEGIES)}")
        loop.check_compile_mode(self.compile_mode)
        dist.check_precision(self.precision)
        if self.context_length > self.max_position_embeddings:
            raise ValueError(
                f"context_length ({self.context_length}) exceeds max_position_embeddings "
                f"({self.max_position_embeddings}); lower it or raise max_position_embeddings"
            )
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("hidden_size must be a multiple of n_heads, and n_heads of n_kv_heads")
        if min(self.n_layers, self.steps, self.batch_size, self.micro_batch_size, self.log_every) < 1:
            raise ValueError("n_layers, steps, batch_size, micro_batch_size and log_every must be >= 1")
        if self.warmup_steps < 0 or self.eval_every < 0 or self.checkpoint_every < 0:
            raise ValueError("warmup_steps, eval_every and checkpoint_every must be >= 0")


def loop_config(cfg: Config) -> loop.LoopConfig:
    names = {f.name for f in dataclasses.fields(loop.LoopConfig)}
    return loop.LoopConfig(**{k: v for k, v in dataclasses.asdict(cfg).items() if k in names})


def build_model(cfg: Config, vocab: dict):
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
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(tok_dir))
    if n != meta["vocab_size"]:
        raise config.UserError(
            f"pretrain: tokenizer in {tok_dir} has {n} tokens but {folder}/meta.json says "
            f"vocab_size {meta['vocab_size']}; re-run tokenize"
        )
    return meta


def save_outputs(tmp: Path, model_sd: dict, cfg: Config, meta_in: dict, inp: Path, result: dict) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = result["history"]
    model = build_model(cfg, meta_in)
    model.load_state_dict(model_sd)
    model.save_pretrained(tmp / "model")
    shutil.copytree(inp / "tokenizer", tmp / "model", dirs_exist_ok=True)
    n_params = sum(p.numel() for p in model.parameters())
    steps = hist["step"][-1]
    meta = {
        "step": steps,
        "tokens_seen": steps * cfg.batch_size * cfg.context_length,
        "final_train_loss": hist["loss"][-1],
        "final_val_loss": hist["val_loss"][-1] if hist["val_loss"] else None,
        "git_commit": track.git_commit(),
        "parameters": n_params,
        "flops_per_token": result["flops_per_token"],
        "model_config": model.config.to_dict(),
        "compute_dtype": result["compute_dtype"],
        "cpu": dist.cpu_info(),
    }
    ckpt.write_json(tmp / "meta.json", meta)
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
    cfg: Config, lcfg: loop.LoopConfig, inp: Path, output: Path, meta_in: dict, rt: dist.Runtime, stop: dist.StopFlag
) -> dict:
    """Train and publish. The wrapped (DDP/FSDP) model lives only in here: it must be gone before the
    process group is torn down, or gloo's shutdown can deadlock on it."""
    dist.seed_everything(cfg.seed)
    inputs_hash = dist.broadcast_object(ckpt.hash_files([inp]) if rt.is_main else None)
    ckpt_folder = ckpt.checkpoint_dir(STAGE, config.as_dict(cfg), inputs_hash)
    train_tokens = shards.load_split(inp, "train")
    val_tokens = shards.load_split(inp, "val")
    # The checkpoint folder is this run's until it has published and discarded it (ckpt.exclusive).
    with (
        ckpt.exclusive(ckpt_folder, rt),
        track.start_run(STAGE, config.as_dict(cfg), inputs_hash, rt, tags={"checkpoints": str(ckpt_folder)}) as tracker,
    ):
        result = loop.train(build_model(cfg, meta_in), train_tokens, val_tokens, lcfg, rt, ckpt_folder, tracker, stop)
        if result["stopped"]:
            tracker.set_tags({"stopped_by": stop.signal or "SIGTERM", "resume_from": str(ckpt_folder)})
            return {"stopped": True}
        model_sd = loop.full_state_dict(result["model"], rt)
        meta = None
        with ckpt.atomic_dir(output, rt) as tmp:
            if rt.is_main:
                meta = save_outputs(tmp, model_sd, cfg, meta_in, inp, result)
                ckpt.write_json(
                    tmp / "metrics.json",
                    {k: meta[k] for k in ("final_train_loss", "final_val_loss", "tokens_seen", "parameters")}
                    | {"tokens_per_s": result["tokens_per_s"], "mfu": result["mfu"]},
                )
        if rt.is_main:
            tracker.log_artifact(output / "plots/loss.png", "plots")
            tracker.log_artifact(output / "meta.json")
            ckpt.discard(ckpt_folder)  # the run is complete; its checkpoints are spent
    meta = dist.broadcast_object(meta)
    # One process: hand back the trained model itself (tests compare it with what was saved).
    return {
        **meta,
        "history": result["history"],
        "stopped": False,
        "model": None if rt.distributed else result["model"],
    }


def main(argv=None) -> dict:
    args, overrides = config.parse_cli(__doc__, {"input": "data/tokenize", "output": "data/pretrain"}, argv)
    cfg = config.load(Config, STAGE, args.params, overrides)
    inp, output = Path(args.input), Path(args.output)
    meta_in = check_input(inp)
    rt = dist.init()
    stop = dist.handle_sigterm()
    try:
        lcfg = loop_config(cfg)
        try:
            loop.grad_accum_steps(lcfg, rt.world_size)
        except ValueError as e:
            raise config.UserError(f"params.yaml: pretrain.{e}") from None
        out = run(cfg, lcfg, inp, output, meta_in, rt, stop)
    finally:
        dist.teardown()
    if out["stopped"]:
        raise SystemExit(143)  # preempted: a checkpoint holds the progress; re-running resumes from it
    val = out["final_val_loss"]
    dist.print0(
        f"pretrain: {out['parameters'] / 1e6:.2f}M parameters, {out['step']} steps, train loss "
        f"{out['final_train_loss']:.4f}, val loss {'-' if val is None else f'{val:.4f}'} -> {output}",
        rt=rt,
    )
    return out


if __name__ == "__main__":
    config.run(main)
