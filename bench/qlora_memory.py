"""QLoRA memory: peak memory of LoRA fine-tuning on an NF4 base vs on the unquantized base, in one run.

    python bench/qlora_memory.py [--hidden 1024] [--layers 16] [--steps 2] [--batch 4] [--seq 128]
        [--device auto|cpu|cuda] [--json FILE]

A random-initialized Llama (hidden 1024, 16 layers, MLP 2816, vocab 32000: ~270M parameters) is saved
once; then each variant runs in a fresh process of its own (so each peak is its own): load the base
the way finetune_qlora does (`quantization: nf4` with fp32 quant storage, as FSDP shards on CPU, or
`none`: fp32), add LoRA (r 16) to every linear layer, and take a few AdamW steps on a batch of 4 x 128
tokens with activation checkpointing. Figures printed, nf4 / none:
  peak anonymous memory   the process's largest RssAnon (heap: weights, activations, optimizer state),
                          sampled every 5 ms, above what it held before loading the model
  peak resident memory    VmHWM, the kernel's high-water mark (also counts pages of the memory-mapped
                          weight file read while loading)
  linear-layer weights    bytes of the decoder layers' linear weights as stored (QLoRA: ~4.127/32 of fp32)
Goal: nf4 linear-layer weights <= 0.35x, and a clearly lower peak anonymous memory.

On a GPU (`--device auto` picks CUDA when there is one) the variants load as finetune_qlora does there:
NF4 with bf16 quant storage and bf16 compute, against LoRA on the bf16 base; the figure that counts is
the CUDA allocator's peak (`torch.cuda.max_memory_allocated`, from before loading to the last step).
Goal there: nf4 peak CUDA memory <= 0.45x bf16 LoRA's on a ~1B model (--hidden 2048 --layers 16).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(base: str, quantization: str, steps: int, device: str, batch: int, seq: int) -> dict:
    """One variant in this process: load, add adapters, train a few steps; memory figures in MiB."""
    import torch

    from stages import finetune_qlora as ft
    from stages.common import config, parallel

    torch.manual_seed(0)
    peak = {"anon": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak["anon"] = max(peak["anon"], status_kib("RssAnon"))
            time.sleep(0.005)

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = status_kib("RssAnon")
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    params = config.read_yaml(Path(__file__).resolve().parent.parent / "params.yaml")["finetune_qlora"]
    overrides = {"base": base, "quantization": quantization, "lora": {"r": 16}}
    cfg = config.build(ft.Config, ft.STAGE, config.merge(params, overrides))
    model = ft.load_base(cfg, device, quantization == "nf4")
    linear_bytes, _ = ft.linear_weight_memory(model)
    model = ft.add_adapters(model, cfg)
    parallel.enable_activation_checkpointing(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    x = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / steps
    done.set()
    sampler.join()
    cuda = {"peak_cuda_mb": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {}
    return {
        **cuda,
        "dtype": str(next(p for p in model.parameters() if p.requires_grad).dtype),
        "peak_anon_mb": (peak["anon"] - start) / 1024,
        "peak_rss_mb": status_kib("VmHWM") / 1024,
        "linear_weight_mb": linear_bytes / 2**20,
        "s_per_step": seconds,
        "loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", nargs=2, metavar=("BASE", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.device, args.batch, args.seq)))
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="qlora-bench-") as tmp:
        torch.manual_seed(0)
        mc = LlamaConfig(
            vocab_size=32000,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=args.hidden // 64,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(mc)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        runs = {}
        for quantization in ("nf4", "none"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    *("--child", tmp, quantization, "--steps", str(args.steps), "--device", args.device),
                    *("--batch", str(args.batch), "--seq", str(args.seq)),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[quantization] = json.loads(out.stdout.strip().splitlines()[-1])
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"Llama {n_params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers), LoRA r=16 on all "
        f"linear layers, batch {args.batch} x {args.seq}, {args.steps} AdamW steps, "
        f"{runs['none']['dtype'].removeprefix('torch.')} compute, {where}"
    )
    if args.json:
        args.json.write_text(json.dumps({"device": where, "parameters": n_params, **runs}, indent=1))
    print(f"{'':24s} {'nf4':>10s} {'none':>10s} {'nf4 / none':>11s}")
    cuda = (("peak_cuda_mb", "peak CUDA memory (MiB)"),) if args.device == "cuda" else ()
    for key, label in (
        *cuda,
        ("peak_anon_mb", "peak anonymous (MiB)"),
        ("peak_rss_mb", "peak resident (MiB)"),
        ("linear_weight_mb", "linear weights (MiB)"),
        ("s_per_step", "seconds per step"),
    ):
        a, b = runs["nf4"][key], runs["none"][key]
        print(f"{label:24s} {a:10.1f} {b:10.1f} {a / b:10.3f}x")


if __name__ == "__main__":
    main()
