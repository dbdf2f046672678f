"""Pretrain throughput: the stage's training loop vs a bare PyTorch loop and the Hugging Face Trainer.

    python bench/pretrain_throughput.py [--steps 15] [--repeats 2] [--compile [MODE ...]] [--no-bf16]

Same Llama model (hidden 256, 4 layers, 8 heads, MLP 688, vocab 4096: 5.3M parameters), same random
token data, batch 8 x 256, AdamW, fp32, one process on all cores, in one run; the runs alternate and
each reports its best. Figures printed:
  stage / bare loop     stages.common.loop.train vs fetch a batch, forward, backward, fused AdamW step,
                        nothing else
  stage / Trainer       vs transformers.Trainer with the same optimizer (fused AdamW), schedule, clipping
  stage FLOP/s / matmul model FLOPs per token x tokens/s, over a 2048^3 fp32 matmul's FLOP/s measured
                        here, now (model FLOPs per token = 6 x non-embedding parameters, output head
                        included, + 12 x layers x context x hidden)
  kernel ceiling        the tokens/s of a step that did nothing but its matrix multiplies (forward and
                        both backward products of every linear layer) and its attention (forward and
                        backward), each timed alone at the model's shapes: no implementation built on
                        these kernels can run much faster (timed separately, so a run may edge past
                        it). The model's multiplies are narrow (256 wide), so the ceiling is well
                        below the 2048^3 rate; printed as a fraction of it.
The matmul rate and the ceiling are measured in every repeat too, each keeping its best.
With --compile, the stage also runs with `compile: true` (torch.compile of the model and the loss; its
first step, which compiles, is left out like every first step) in each given `compile_mode` (by
default: default), and those figures are printed beside the eager ones.
On a CPU with bf16 instructions (AVX512-BF16 or AMX) the stage and the bare loop also run with bf16
autocast (the stage's `precision: bf16`), beside a 2048^3 bf16 matmul; their figures are printed
against the fp32 ones. On other CPUs bf16 is emulated (~20x slower) and the bench says so instead.
The first step of every run (allocation, warm-up) is left out of its timing.
Goals: >= 1.0x the bare loop, >= 1.05x Trainer, >= 0.6 of the matmul rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.common import loop, runtime, train_config  # noqa: E402
from stages.common.tracking.tracker import NullTracker  # noqa: E402

HIDDEN, LAYERS, HEADS, FFN, VOCAB, CONTEXT, BATCH = 256, 4, 8, 688, 4096, 256, 8


def make_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            max_position_embeddings=CONTEXT,
            tie_word_embeddings=False,
        )
    )


def loop_cfg(steps: int, compile_mode: str | None = None, precision: str = "fp32") -> train_config.TrainConfig:
    return train_config.build(
        steps=steps,
        batch_size=BATCH,
        micro_batch_size=BATCH,
        lr=1e-3,
        min_lr=1e-4,
        eval_batches=0,
        log_every=10**9,
        compile=compile_mode is not None,
        compile_mode=compile_mode or "default",
        precision=precision,
    )


def run_stage(tokens: np.ndarray, steps: int, compile_mode: str | None = None, precision: str = "fp32") -> float:
    rt = runtime.Runtime(0, 1, 0, 1, torch.device("cpu"))
    cfg = loop_cfg(steps, compile_mode, precision)
    with tempfile.TemporaryDirectory() as tmp:
        out = loop.train(make_model(), tokens, tokens, cfg, CONTEXT, rt, Path(tmp), NullTracker(), runtime.StopFlag())
    return out.tokens_per_s


def run_bare(tokens: np.ndarray, steps: int, dtype: torch.dtype = torch.float32) -> float:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    windows = loop.Windows(tokens, CONTEXT, 0)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = windows.batch(step, 0, BATCH)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return BATCH * CONTEXT * (steps - 1) / sum(times[1:])


def run_trainer(tokens: np.ndarray, steps: int) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    windows = loop.Windows(tokens, CONTEXT, 0)
    rows = [windows.batch(step, 0, BATCH)[0] for step in range(steps)]
    data = [{"input_ids": r, "labels": r} for batch in rows for r in batch]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=BATCH,
            max_steps=steps,
            learning_rate=1e-3,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            max_grad_norm=1.0,
            warmup_steps=2,
            lr_scheduler_type="cosine",
            save_strategy="no",
            report_to=[],
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            dataloader_num_workers=0,
            seed=0,
        )
        Trainer(model=make_model(), args=args, train_dataset=data, callbacks=[clock]).train()
    return BATCH * CONTEXT * (len(clock.times) - 1) / sum(clock.times[1:])


def matmul_flops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def kernel_ceiling(model, repeats: int = 3) -> float:
    """Tokens/s of a training step that only ran its matmuls and attention, each timed alone."""
    from collections import Counter

    n = BATCH * CONTEXT
    shapes = Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))
    seconds = 0.0
    for (fan_in, fan_out), count in shapes.items():
        x, w, g = torch.randn(n, fan_in), torch.randn(fan_out, fan_in), torch.randn(n, fan_out)

        def products(x=x, w=w, g=g):  # forward, input grad, weight grad
            return x @ w.t(), g @ w, g.t() @ x

        products()
        seconds += count * min(_timed(products) for _ in range(repeats))
    c = model.config
    q, k, v = (
        torch.randn(BATCH, c.num_attention_heads, CONTEXT, c.hidden_size // c.num_attention_heads, requires_grad=True)
        for _ in range(3)
    )

    def attention():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    attention()
    seconds += c.num_hidden_layers * min(_timed(attention) for _ in range(repeats))
    return n / seconds


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--compile",
        nargs="*",
        metavar="MODE",
        choices=train_config.COMPILE_MODES,
        help="also run the stage with compile: true in these compile modes (none given: default)",
    )
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 runs on CPUs that have bf16 instructions")
    args = parser.parse_args()
    bf16 = runtime.cpu_has_native_bf16() and not args.no_bf16
    modes = args.compile or (["default"] if args.compile is not None else [])
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=2_000_000).astype(np.uint16)
    best = {"stage": 0.0, "bare": 0.0, "trainer": 0.0}
    rate, ceiling = 0.0, 0.0
    for _ in range(args.repeats):
        rate = max(rate, matmul_flops())
        ceiling = max(ceiling, kernel_ceiling(make_model()))
        best["stage"] = max(best["stage"], run_stage(tokens, args.steps))
        best["bare"] = max(best["bare"], run_bare(tokens, args.steps))
        best["trainer"] = max(best["trainer"], run_trainer(tokens, args.steps))
        for mode in modes:
            best[mode] = max(best.get(mode, 0.0), run_stage(tokens, args.steps, compile_mode=mode))
        if bf16:
            best["rate_bf16"] = max(best.get("rate_bf16", 0.0), matmul_flops(dtype=torch.bfloat16))
            best["stage_bf16"] = max(best.get("stage_bf16", 0.0), run_stage(tokens, args.steps, precision="bf16"))
            best["bare_bf16"] = max(best.get("bare_bf16", 0.0), run_bare(tokens, args.steps, torch.bfloat16))
    fpt = loop.flops_per_token(make_model(), CONTEXT)
    print(
        f"model: {sum(p.numel() for p in make_model().parameters()) / 1e6:.1f}M parameters, "
        f"{fpt / 1e6:.1f} MFLOP/token; batch {BATCH}x{CONTEXT}, {args.steps} steps, best of {args.repeats}, "
        f"{threads} threads, fp32"
    )
    for name, label in (("stage", "stage (loop.train)"), ("bare", "bare PyTorch loop"), ("trainer", "HF Trainer")):
        print(f"{label:<20} {best[name]:>10,.0f} tokens/s")
    print(f"matmul 2048^3 fp32   {rate / 1e9:>10,.1f} GFLOP/s")
    print(f"stage / bare loop:      {best['stage'] / best['bare']:.2f}  (goal >= 1.0)")
    print(f"stage / Trainer:        {best['stage'] / best['trainer']:.2f}  (goal >= 1.05)")
    print(f"stage FLOP/s / matmul:  {fpt * best['stage'] / rate:.2f}  (goal >= 0.6)")
    print(
        f"kernel ceiling: {ceiling:,.0f} tokens/s, FLOP/s / matmul {fpt * ceiling / rate:.2f}; "
        f"the stage runs at {best['stage'] / ceiling:.2f} of it"
    )
    for mode in modes:
        print(
            f"compiled stage, compile_mode {mode}: {best[mode]:,.0f} tokens/s; "
            f"/ bare loop {best[mode] / best['bare']:.2f}, "
            f"/ Trainer {best[mode] / best['trainer']:.2f}, FLOP/s / matmul {fpt * best[mode] / rate:.2f}, "
            f"/ kernel ceiling {best[mode] / ceiling:.2f}"
        )

    cpu = runtime.cpu_info()
    print(f"CPU: {cpu['cpu_model']}, torch capability {cpu['cpu_capability']}, flags {' '.join(cpu['cpu_flags'])}")
    if bf16:
        print(f"matmul 2048^3 bf16   {best['rate_bf16'] / 1e9:>10,.1f} GFLOP/s  ({best['rate_bf16'] / rate:.2f}x fp32)")
        print(
            f"bf16 autocast: stage {best['stage_bf16']:,.0f} tokens/s "
            f"({best['stage_bf16'] / best['stage']:.2f}x the fp32 "
            f"stage), bare loop {best['bare_bf16']:,.0f} tokens/s; stage / bare loop "
            f"{best['stage_bf16'] / best['bare_bf16']:.2f}, stage FLOP/s / bf16 matmul "
            f"{fpt * best['stage_bf16'] / best['rate_bf16']:.2f}"
        )
    elif not args.no_bf16:
        print(
            "bf16: not measured: this CPU has neither AVX512-BF16 nor AMX-BF16, so bf16 is emulated (~20x slower "
            "than fp32); precision: auto keeps fp32 on CPUs"
        )


if __name__ == "__main__":
    main()
