"""Pretrain MFU on one device: the stage's training loop on a ~1B-parameter Llama at context 2048.

    python bench/pretrain_mfu.py [--hidden 2048] [--layers 16] [--heads 16] [--ffn 5632] [--vocab 32000]
        [--context 2048] [--micro-batch 8] [--steps 20] [--no-compile] [--peak-tflops 990]
        [--profile FILE] [--json FILE] [--dry]

The step pretrain trains with (`stages.common.loop.build`, then `loop.step` per step: micro-batches, the
compiled loss, clipping, the AdamW update) with `precision: auto` (bf16 autocast on a GPU, fp32 weights
and AdamW states) and `compile: true`, one process, random tokens. By default the model is a
Llama of hidden 2048, 16 layers, 16 heads, MLP 5632, vocab 32000 (~950M parameters) at context 2048,
8 sequences per step. Figures printed:
  tokens/s              median of the steps after the first quarter (compilation and warm-up left out)
  MFU                   model FLOPs per token (6 x non-embedding parameters, output head included,
                        + 12 x layers x context x hidden) x tokens/s, over the datasheet peak
                        (--peak-tflops: the H100/H200 SXM dense bf16 figure, 990) and over the dense
                        bf16 matmul rate measured here, now (the fastest of twenty 8192^3 products)
  peak memory           the CUDA allocator's peak (GPU)
With --profile FILE, one more of those steps runs under torch.profiler and FILE gets the kernels that took the
most device time and a breakdown by kind (matmul, attention, the rest): what limits the step.
--dry runs the same code at tiny size on the CPU (a 2-layer model, context 128, 6 steps; fp32 there,
where bf16 is not native; one thread) in seconds, so a run on a GPU machine spends its time measuring.
Goal (GPU): MFU >= 0.40 of the dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval_throughput import matmul_flops  # noqa: E402

from stages import pretrain  # noqa: E402
from stages.common import loop, runtime, train_config  # noqa: E402

DRY = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 160, "vocab": 512, "context": 128, "micro_batch": 4, "steps": 6}


def make_model(args):
    """The model the pretrain stage builds, at the bench's sizes."""
    spec = pretrain.ModelConfig(
        n_layers=args.layers,
        hidden_size=args.hidden,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        intermediate_size=args.ffn,
        max_position_embeddings=args.context,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    vocab = {"vocab_size": args.vocab, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
    return pretrain.build_model(spec, vocab)


def train_cfg(args) -> train_config.TrainConfig:
    return train_config.build(
        steps=args.steps,
        batch_size=args.micro_batch,
        micro_batch_size=args.micro_batch,
        lr=3e-4,
        min_lr=3e-5,
        eval_batches=0,
        log_every=10**9,
        peak_tflops=args.peak_tflops,
        compile=not args.no_compile,
        precision="auto",
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kind_of(name: str) -> str:
    low = name.lower()
    if low in ("aten::mm", "aten::bmm", "aten::addmm") or any(
        k in low for k in ("gemm", "matmul", "cublas", "cutlass", "xmma", "nvjet")
    ):
        return "matmul"
    if any(k in low for k in ("flash", "attention", "fmha", "sdpa")):
        return "attention"
    return "other"


def profile_step(tr: loop.Trainer, index: int, path: Path) -> dict:
    """Step `index` of the trainer under torch.profiler (the shapes and the compiled loss of the measured
    steps: no recompilation): top kernels and time by kind."""
    from torch.profiler import ProfilerActivity, profile

    device, dtype = tr.rt.device, runtime.compute_dtype(tr.rt.device, tr.cfg.precision)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        loop.step(tr, index)
        sync(device)
    key = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    if device.type == "cuda":  # kernels only: their time is the device's busy time
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, key) for e in events) or 1.0
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + getattr(e, key)
    fractions = {k: v / total for k, v in sorted(by_kind.items())}
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:25]
    lines = [f"one training step, {device}, {dtype}: {total / 1e3:.1f} ms of {key}"]
    lines += [f"  {kind:<10} {share:6.1%}" for kind, share in fractions.items()]
    lines += ["", f"{'share':>7} {'ms':>9} {'calls':>6}  kernel"]
    lines += [f"{getattr(e, key) / total:7.1%} {getattr(e, key) / 1e3:9.2f} {e.count:6d}  {e.key[:110]}" for e in top]
    path.write_text("\n".join(lines) + "\n")
    return {"step_ms": total / 1e3, "time_by_kind": fractions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=990.0, help="the device's dense bf16 datasheet peak")
    parser.add_argument("--profile", type=Path, help="write a one-step profile here")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--dry", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    if args.dry:
        for key, value in DRY.items():
            setattr(args, key, value)
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the first quarter is left out)")
    if args.dry:
        # One thread: on a shared CPU, another process slows both the steps and the matmul by taking turns on
        # the core, alike, where it would stall a two-thread matmul tenfold for as long as it runs.
        torch.set_num_threads(1)
    device = torch.device("cpu") if args.dry else runtime.init().device
    if device.type != "cuda" and not args.dry:
        print("no CUDA GPU here: run with --dry for a check at tiny size on the CPU", file=sys.stderr)
        sys.exit(2)
    rt = runtime.Runtime(0, 1, 0, 1, device)
    cfg = train_cfg(args)
    dtype = runtime.compute_dtype(device, cfg.precision)
    model = make_model(args)
    params = sum(p.numel() for p in model.parameters())
    fpt = loop.flops_per_token(model, args.context)
    rate = matmul_flops(device, dtype, 8192 if device.type == "cuda" else 512, repeats=20)
    tokens = np.random.default_rng(0).integers(0, args.vocab, size=4 * args.steps * args.micro_batch * args.context)
    tokens = tokens.astype(np.uint16 if args.vocab <= 2**16 else np.uint32)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    tr = loop.build(model, tokens, tokens, cfg, args.context, rt)
    steps = [loop.step(tr, i) for i in range(args.steps)]
    wall = time.perf_counter() - t0
    steady = [tr.tokens_per_step / s.seconds for s in steps[args.steps // 4 :]]
    tps = statistics.median(steady)
    figures = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else runtime.cpu_info()["cpu_model"],
        "torch": torch.__version__,
        "parameters": params,
        "flops_per_token": fpt,
        "context": args.context,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "compile": cfg.compile,
        "dtype": str(dtype),
        "tokens_per_s": tps,
        "tokens_per_s_spread": [min(steady), max(steady)],
        "matmul_tflops": rate / 1e12,
        "mfu_vs_peak": fpt * tps / (args.peak_tflops * 1e12),
        "mfu_vs_matmul": fpt * tps / rate,
        "peak_tflops": args.peak_tflops,
        "final_loss": steps[-1].loss,
        "wall_s": wall,
    }
    if device.type == "cuda":
        figures["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.json:  # before profiling: a profile that runs out of time loses nothing measured
        args.json.write_text(json.dumps(figures, indent=1))
    if args.profile:
        figures["profile"] = profile_step(tr, args.steps, args.profile)
    print(
        f"Llama {params / 1e6:.1f}M parameters ({fpt / 1e6:,.1f} MFLOP/token), context {args.context}, "
        f"batch {args.micro_batch}, {args.steps} steps, {dtype}, compile {cfg.compile}, {figures['device']}"
    )
    print(
        f"tokens/s {tps:,.0f} (steps {args.steps // 4 + 1}-{args.steps}: {min(steady):,.0f} to {max(steady):,.0f}); "
        f"final loss {figures['final_loss']:.3f}; {wall:.0f} s in all, compilation included"
    )
    print(
        f"MFU {figures['mfu_vs_peak']:.3f} of the {args.peak_tflops:.0f} TFLOP/s peak (goal >= 0.40); "
        f"{figures['mfu_vs_matmul']:.3f} of the {rate / 1e12:.1f} TFLOP/s {dtype} matmul measured here"
    )
    if "peak_memory_gib" in figures:
        print(f"peak CUDA memory {figures['peak_memory_gib']:.1f} GiB")
    if args.profile:
        kinds = ", ".join(f"{k} {v:.0%}" for k, v in figures["profile"]["time_by_kind"].items())
        print(f"profiled step: {figures['profile']['step_ms']:.1f} ms; {kinds}; kernels in {args.profile}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
