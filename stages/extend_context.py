"""extend_context: scaled-RoPE variants of a pretrained Llama for a longer context, optionally fine-tuned.

Takes a model trained at context L (`--base`, Hugging Face format; default the pretrain stage's) and
writes one model per variant for the extended context s x L (`factor` in params), each in Hugging
Face format with its RoPE scaling in `config.rope_parameters`, so `AutoModelForCausalLM` loads it
intact:

    unscaled     the base model as it is (RoPE unchanged; max_position_embeddings s x L)
    <variant>    each entry of `variants`: position interpolation (`linear`), dynamic NTK (`dynamic`),
                 YaRN (`yarn`) or Llama-3 wavelength bands (`llama3`), zero-shot (weights unchanged)
    <name>-ft    each entry of `finetune`, trained for `steps` steps at context s x L; `unscaled-ft`
                 is the direct fine-tune without scaling (the control of the Position Interpolation paper)

Fine-tuning uses the codebase's one training loop (stages/common/loop.py: DDP or FSDP2, warmup +
cosine, accumulation, checkpoints every `train.checkpoint_every` steps and on a stop signal, exact resume). Each
fine-tune resumes from checkpoints/extend_context/<hash of params, variant and inputs>/; a finished
one is kept there as `final/` until the stage publishes, so a re-run after a crash skips it.

The eval_perplexity stage evaluates every variant at L, 2L, 4L and 8L (data/eval_perplexity/extend_context)
and the context_study stage compares them with the published findings.

Run:
    python -m stages.extend_context --base data/pretrain/model --input data/tokenize --output data/extend_context
    torchrun --nproc-per-node 2 -m stages.extend_context --base data/pretrain/model --input data/tokenize \\
        --output data/extend_context factor=2 train.steps=50
    snakemake --cores all extend_context      # or: dvc repro extend_context

Output (data/extend_context/):
    model/<variant>/   config.json, model.safetensors, tokenizer files
    meta.json          per variant: method, fine-tuned or not, rope_parameters, max_position_embeddings;
                       `order`: the variants, zero-shot ones first
    figures.json       per fine-tuned variant: final train/val loss at s x L
    metrics.json       per fine-tuned variant: final val loss (DVC metrics)
    plots/finetune_loss/<variant>.csv, plots/finetune_loss.png   fine-tuning loss curves (DVC plots)
and, outside it (--measured, measured/extend_context.json in the pipeline): each fine-tune's tokens/s.
"""

from __future__ import annotations

import copy
import gc
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common import atomic, ckpt, config, hf_folder, loop, registry, runtime, shards, stage, train_config
from stages.common.stagerun import StageRun
from stages.common.tracking.tracker import Tracker

STAGE = "extend_context"
UNSCALED = "unscaled"
# rope_type -> (keys a variant must give, keys it may give), besides rope_type itself. factor,
# rope_theta and original_max_position_embeddings come from the stage's params and the base model.
ROPE_TYPES = {
    "linear": ((), ()),
    "dynamic": ((), ()),
    "yarn": ((), ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("low_freq_factor", "high_freq_factor"), ()),
}


@dataclass(frozen=True)
class Config:
    factor: float
    original_context: int
    variants: dict
    finetune: tuple[str, ...]
    train: train_config.TrainConfig

    def __post_init__(self):
        if not self.factor > 1:
            raise ValueError(f"factor must be greater than 1 (the context grows s-fold), got {self.factor}")
        if self.original_context < 0:
            raise ValueError("original_context must be >= 0 (0 = the base model's max_position_embeddings)")
        for name, spec in self.variants.items():
            check_variant(name, spec)
        unknown = [n for n in self.finetune if n != UNSCALED and n not in self.variants]
        if unknown or len(set(self.finetune)) != len(self.finetune):
            raise ValueError(
                f"finetune: {unknown[0] if unknown else 'a repeated name'} is not a variant; valid: "
                f"{', '.join([UNSCALED, *self.variants])}, each at most once"
            )


def check_variant(name: str, spec) -> None:
    where = f"variants.{name}"
    if name == UNSCALED or name.endswith("-ft") or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(
            f"{where}: a variant name is letters, digits, '_' or '-', not '{UNSCALED}' and not ending in '-ft'"
        )
    if not isinstance(spec, dict) or "rope_type" not in spec:
        raise ValueError(f"{where} must be a mapping with a rope_type ({' | '.join(ROPE_TYPES)}), got {spec!r}")
    rope_type = spec["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}.rope_type: unknown scaling type {rope_type!r}; valid: {', '.join(ROPE_TYPES)}")
    required, optional = ROPE_TYPES[rope_type]
    missing = [k for k in required if k not in spec]
    if missing:
        raise ValueError(f"{where}: rope_type {rope_type} needs {', '.join(required)}; add {missing[0]}")
    extra = sorted(set(spec) - {"rope_type", *required, *optional})
    if extra:
        raise ValueError(
            f"{where}.{extra[0]}: not a key of rope_type {rope_type}; "
            f"valid: {', '.join([*required, *optional]) or 'none besides rope_type'}"
        )
    if rope_type == "llama3" and not 0 < spec["low_freq_factor"] < spec["high_freq_factor"]:
        raise ValueError(f"{where}: llama3 needs 0 < low_freq_factor < high_freq_factor")


def scaled_config(base_config, spec: dict | None, factor: float, original: int):
    """The base model's config with the variant's RoPE scaling (spec None: unscaled, only longer)."""
    c = copy.deepcopy(base_config)
    theta = c.rope_parameters["rope_theta"]
    extended = int(round(factor * original))
    if spec is None:
        c.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        c.max_position_embeddings = extended
        return c
    rope = {**spec, "rope_theta": theta, "factor": float(factor)}
    if spec["rope_type"] in ("yarn", "llama3"):
        rope["original_max_position_embeddings"] = original
    c.rope_parameters = rope
    # Dynamic NTK reads max_position_embeddings as the trained length and rescales beyond it.
    c.max_position_embeddings = original if spec["rope_type"] == "dynamic" else extended
    return c


def check_inputs(base: Path, data: Path, cfg: Config):
    """The base model's config and the token shards' meta, checked before any compute."""
    from transformers import AutoConfig

    hf_folder.check(base, f"extend_context: {base}", "pass --base a Hugging Face model folder")
    base_config = AutoConfig.from_pretrained(base)
    rope_type = (base_config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        raise config.UserError(
            f"extend_context: {base} already uses RoPE scaling ({rope_type}); extend an unscaled model"
        )
    original = cfg.original_context or base_config.max_position_embeddings
    try:
        meta = shards.read_meta(data)
    except FileNotFoundError as e:
        raise config.UserError(f"extend_context: {e}") from None
    if meta["vocab_size"] > base_config.vocab_size:
        raise config.UserError(
            f"extend_context: the shards in {data} use {meta['vocab_size']} token ids but the base "
            f"model has {base_config.vocab_size}; use the tokenizer the base model was trained with"
        )
    if not shards.same_tokenizer(data, base):
        raise config.UserError(
            f"extend_context: the shards in {data} were encoded with another tokenizer than {base}'s; encode the "
            f"corpus with the base's (python -m stages.tokenize --tokenizer {base}: the DAG's, with base.model set)"
        )
    if cfg.finetune:
        for split in ("train", "val"):
            try:
                shards.check_split(data, split)
            except config.UserError as e:
                raise config.UserError(f"extend_context: {e}") from None
        context = int(round(cfg.factor * original))
        n = min(meta["splits"][s]["tokens"] for s in ("train", "val"))
        if n < context + 2:
            raise config.UserError(
                f"extend_context: a split of {data} has {n} tokens, fewer than one fine-tuning "
                f"window of {context + 1}; lower extend_context.factor or use a longer corpus"
            )
    return base_config, original


class PrefixedTracker:
    """One MLflow run for the stage; each fine-tune logs its metrics under `<variant>.` (a Tracker around
    the stage's own: everything else, a hang's failure included, goes to that run as it is)."""

    def __init__(self, tracker: Tracker, prefix: str):
        self.tracker, self.prefix = tracker, prefix

    @property
    def run_id(self) -> str | None:
        return self.tracker.run_id

    @property
    def lost(self) -> str | None:
        return self.tracker.lost

    def __bool__(self) -> bool:
        return bool(self.tracker)

    def log_metrics(self, metrics: dict, step: int | None = None, time_ms: int | None = None) -> None:
        self.tracker.log_metrics({f"{self.prefix}.{k}": v for k, v in metrics.items()}, step=step, time_ms=time_ms)

    def log_series(self, series: dict[str, list[float]]) -> None:
        self.tracker.log_series({f"{self.prefix}.{k}": v for k, v in series.items()})

    def set_tags(self, tags: dict) -> None:
        self.tracker.set_tags(tags)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.tracker.log_artifact(path, artifact_path)

    def log_text(self, text: str, name: str) -> None:
        self.tracker.log_text(text, name)

    def register(self, record: dict) -> None:
        self.tracker.register(record)

    def log_checkpoint(self, folder: Path, step: int, points: list, label: str = "") -> None:
        points = [(f"{self.prefix}.{key}", *rest) for key, *rest in points]
        self.tracker.log_checkpoint(folder, step, points, label or self.prefix)

    def checkpoint_removed(self, folder: Path, why: str) -> None:
        self.tracker.checkpoint_removed(folder, why)

    def flush(self, timeout_s: float) -> bool:
        return self.tracker.flush(timeout_s)

    def fail_from_thread(self, cause: str) -> None:
        self.tracker.fail_from_thread(cause)

    def end(self, status: str) -> bool:
        return self.tracker.end(status)


def finetune(name: str, model_config, base: Path, data: Path, context: int, run: StageRun) -> dict:
    """Fine-tune one variant at s x L (context tokens) in the run's checkpoint folder (held); its final
    weights end in <folder>/final/ (HF format), kept until the stage publishes, so a re-run after a crash
    skips a finished variant."""
    from transformers import AutoModelForCausalLM

    cfg, rt, folder = run.cfg, run.rt, run.folder.path
    final = folder / "final"
    if final.is_dir():
        runtime.print0(f"extend_context: {name} already fine-tuned in {final}", rt=rt)
        return ckpt_summary(final)
    runtime.seed_everything(cfg.train.seed)
    # fp32 master weights everywhere; on GPU the loop computes in bf16 under autocast.
    model = AutoModelForCausalLM.from_pretrained(base, config=model_config, dtype=torch.float32, use_safetensors=True)
    train_tokens, val_tokens = shards.open_stream(data, "train"), shards.open_stream(data, "val")
    result = loop.fit(model, train_tokens, val_tokens, cfg.train, context, run, PrefixedTracker(run.tracker, name))
    state = loop.full_state_dict(result.model, rt)
    del result.model, model
    gc.collect()
    hist = result.history
    summary = {
        "final_train_loss": hist["loss"][-1],
        "final_val_loss": hist["val_loss"][-1] if hist["val_loss"] else None,
        "tokens_per_s": result.tokens_per_s,
        "steps": hist["step"][-1],
        "history": {k: hist[k] for k in ("step", "loss", "val_step", "val_loss")},
    }

    def write(tmp: Path) -> None:
        trained = AutoModelForCausalLM.from_config(model_config)
        trained.load_state_dict(state)
        trained.save_pretrained(tmp)
        atomic.write_json(tmp / "summary.json", summary)

    stage.publish(final, rt, write)
    if rt.is_main:
        for step_dir in ckpt.checkpoints(folder):
            if run.tracker is not None:
                run.tracker.checkpoint_removed(step_dir, "removed once the fine-tune's model was published")
            shutil.rmtree(step_dir, ignore_errors=True)
    return summary


def ckpt_summary(final: Path) -> dict:
    return json.loads((final / "summary.json").read_text())


def copy_model_files(src: Path, dest: Path, skip: tuple[str, ...] = ()) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in skip:
            shutil.copy2(f, dest / f.name)


def plot_finetunes(summaries: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One curve per file (DVC draws each file of the folder as a plot of its own, compared across revisions)
    (folder / "finetune_loss").mkdir(parents=True, exist_ok=True)
    for name, s in summaries.items():
        with open(folder / "finetune_loss" / f"{name}.csv", "w") as fh:
            fh.write("step,train_loss\n")
            curve = zip(s["history"]["step"], s["history"]["loss"], strict=True)
            fh.writelines(f"{step},{loss:.6f}\n" for step, loss in curve)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in summaries.items():
        ax.plot(s["history"]["step"], s["history"]["loss"], label=name)
    ax.set(xlabel="step", ylabel="train loss (nats/token)", title="Fine-tuning at the extended context")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "finetune_loss.png", dpi=100)
    plt.close(fig)


def write_outputs(
    tmp: Path,
    base: Path,
    configs: dict,
    summaries: dict,
    finals: dict,
    cfg: Config,
    original: int,
    device: torch.device,
) -> dict:
    """Write every variant (rank 0): zero-shot ones are the base weights with a new config.json."""
    weights_and_config = ("config.json",)
    variants = {}
    for name, model_config in configs.items():
        dest = tmp / "model" / name
        copy_model_files(base, dest, skip=weights_and_config)
        model_config.save_pretrained(dest)
        variants[name] = {"method": name, "finetuned": False}
    for name, final in finals.items():
        dest = tmp / "model" / f"{name}-ft"
        copy_model_files(base, dest, skip=weights_and_config)
        copy_model_files(final, dest, skip=("summary.json",))
        variants[f"{name}-ft"] = {"method": name, "finetuned": True}
    for v in variants.values():
        c = configs[v["method"]]
        v.update(rope_parameters=c.rope_parameters, max_position_embeddings=c.max_position_embeddings)
    meta = {
        "base": str(base),
        **registry.origin(base),
        "original_context": original,
        "factor": cfg.factor,
        "extended_context": int(round(cfg.factor * original)),
        "finetune_steps": cfg.train.steps,
        "variants": variants,
        "order": list(variants),
        "compute_dtype": str(runtime.compute_dtype(device, cfg.train.precision)),
        "cpu": runtime.cpu_info(),
        **stage.code_record(STAGE),
    }
    atomic.write_json(tmp / "meta.json", meta)
    metrics = {
        "extended_context": meta["extended_context"],
        **{f"{n}-ft": {k: s[k] for k in ("final_train_loss", "final_val_loss")} for n, s in summaries.items()},
    }
    stage.write_metrics(
        tmp, metrics, {"val_loss": {n: m["final_val_loss"] for n, m in metrics.items() if isinstance(m, dict)}}
    )
    if summaries:
        plot_finetunes({f"{n}-ft": s for n, s in summaries.items()}, tmp / "plots")
    return meta


def run(
    base: Path, data: Path, output: Path, measured: Path, cfg: Config, configs: dict, original: int, rt, stop
) -> dict:
    """Fine-tune the variants in `finetune`, then publish every variant. Wrapped models live only in here."""
    context = int(round(cfg.factor * original))
    run = StageRun(STAGE, cfg, rt, stop, stage.inputs_hash([base, data], rt))
    summaries, finals = {}, {}
    with run.tracked(tags={"base": str(base), **registry.origin(base)}):
        for name in cfg.finetune:
            runtime.print0(f"extend_context: fine-tuning {name} at context {context}", rt=rt)
            with run.checkpoints(variant=name) as folder:
                summaries[name] = finetune(name, configs[name], base, data, context, run)
            finals[name] = folder.path / "final"
        meta = run.publish(
            output, lambda tmp: write_outputs(tmp, base, configs, summaries, finals, cfg, original, rt.device)
        )
        speed = {f"{n}-ft": {"tokens_per_s": s["tokens_per_s"]} for n, s in summaries.items()}
        final_metrics = config.flatten(stage.read_figures(output)) if rt.is_main else {}
        run.spent.extend(final.parent for final in finals.values())  # published: the fine-tunes' checkpoints
        run.finish(
            output,
            measured=(measured, speed),
            metrics={**{k: v for k, v in final_metrics.items() if v is not None}, **config.flatten(speed)},
            artifacts=(output / "meta.json", *(((output / "plots", "plots"),) if summaries else ())),
            models={name: output / "model" / name for name in meta["variants"]},
            inputs=(base, data),
        )
    runtime.print0(
        f"extend_context: {len(meta['variants'])} variants for context {context} "
        f"(L = {original}, s = {cfg.factor:g}) -> {output}/model",
        rt=rt,
    )
    return {"meta": meta, "summaries": summaries}


def main(argv=None) -> dict:
    paths = {"base": "data/pretrain/model", "input": "data/tokenize", "output": "data/extend_context"}
    args, cfg = stage.setup(__doc__, STAGE, Config, paths, argv)
    base, data, output = Path(args.base), Path(args.input), Path(args.output)
    base_config, original = check_inputs(base, data, cfg)
    configs = {UNSCALED: scaled_config(base_config, None, cfg.factor, original)}
    configs |= {name: scaled_config(base_config, spec, cfg.factor, original) for name, spec in cfg.variants.items()}
    return stage.launch(
        STAGE,
        lambda rt, stop: run(base, data, output, Path(args.measured), cfg, configs, original, rt, stop),
        train=cfg.train,
    )


if __name__ == "__main__":
    stage.entry(main)
