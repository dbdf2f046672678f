"""Perplexity-evaluation throughput: the eval_perplexity stage vs a one-window-at-a-time loop.

    python bench/eval_throughput.py [--tokens 16384] [--context 256] [--stride 256] [--batch-size 16]
        [--repeats 3] [--no-bf16] [--precision auto|fp32|bf16] [--hidden 256] [--layers 4] [--heads 8]
        [--ffn 688] [--json FILE]

Builds a 5.3M-parameter Llama (hidden 256, 4 layers, 8 heads, ffn 688, random weights; the sizes are
options) and the
tokenize stage's byte-level BPE (vocab 4096) trained on TinyShakespeare (from PIPELINE_DATA_MIRROR or
the internet), saves both as a Hugging Face checkpoint, and evaluates the first `--tokens` tokens of
the text, same model, context and stride, in one process:
  stage     `python -m stages.eval_perplexity` (its main(), in process) with batch_size windows per
            forward pass; tokens/s as the stage reports it (the evaluation loop, not model loading)
  baseline  the loop of the Hugging Face perplexity guide: one window per forward pass (batch 1),
            labels with -100 for tokens an earlier window scored, the model's own loss times the
            number of scored tokens, summed; the same windows and targets as the stage
alternating `--repeats` times, and prints the best tokens/s of each, their ratio (goal: stage /
baseline >= 10) and whether the perplexities agree. Both run on the device the stage picks (CUDA when
available, in bf16; else the CPU in fp32), in the dtype `--precision` picks (the stage's `precision`:
`fp32` on a GPU compares the two loops without bf16 rounding). `--json FILE` writes the figures.

It also prints the bound physics puts on that ratio: the baseline's model FLOP/s (forward FLOPs per
token = 2 x non-embedding parameters, output head included, + 4 x layers x context x hidden, times
the tokens its windows hold) over the device's dense matrix-multiply rate, measured in the same run
(a 4096^3 multiply). Batching can speed a loop up at most by the inverse of that fraction.

On a CPU with bf16 instructions (AVX512-BF16 or AMX) the stage also runs with `precision: bf16`
(weights and activations in bf16), and its tokens/s and perplexity are printed beside the fp32 ones
with the bf16 matmul rate; elsewhere bf16 is emulated (~20x slower) and the bench says so instead.

On a 2-core CPU the bound is about 3x: one 256-token window is already a large enough matrix multiply
that batch 1 runs at ~0.35 of the matmul rate (~9k tokens/s), and the stage's batches at ~0.45
(the rest is attention, normalisation and softmax). Batch 1 falls far behind on GPUs, where a
batch-1 forward pass of a small model is bound by kernel launches, not by arithmetic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from stages import eval_perplexity, prepare_data, tokenize  # noqa: E402
from stages.common import loop, runtime, sources  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@torch.inference_mode()
def baseline(model, ids: torch.Tensor, context: int, stride: int) -> tuple[float, int, float]:
    """(nll sum, scored tokens, tokens in the windows, seconds) of the guide's loop, batch 1."""
    n = len(ids)
    nll_sum, n_tokens, scored_to, seen = 0.0, 0, 0, 0
    ids = ids.to(model.device)
    t0 = time.perf_counter()
    for begin in range(0, n - 1, stride):
        end = min(begin + context, n - 1)
        input_ids = ids[begin:end][None]
        labels = ids[begin + 1 : end + 1][None].clone()  # the next token of each position
        new = end - max(scored_to, begin)  # targets no earlier window scored
        labels[:, :-new] = -100
        loss = model(input_ids, labels=labels, shift_labels=labels, use_cache=False).loss
        nll_sum += loss.item() * new
        n_tokens += new
        seen += end - begin
        scored_to = end
        if end == n - 1:
            break
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return nll_sum, n_tokens, seen, time.perf_counter() - t0


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 4096, repeats: int = 5) -> float:
    """The device's dense matrix-multiply rate, FLOP/s: the fastest of `repeats` + 1 products (the first
    warms up), so that a moment of contention on a shared machine does not lower it."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 runs on CPUs that have bf16 instructions")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        raw = tmp / "input.txt"
        prepare_data.fetch(sources.TINYSHAKESPEARE, raw)
        (tmp / "corpus").mkdir()
        shutil.copy(raw, tmp / "corpus" / "train.txt")
        cfg = tokenize.Config(vocab_size=4096, min_frequency=2, train_max_bytes=0, batch_lines=4096, shard_tokens=1)
        tokenize.save_hf_tokenizer(tokenize.train_tokenizer(tmp / "corpus", cfg, show_progress=False), tmp / "model")
        tok = AutoTokenizer.from_pretrained(tmp / "model")
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tok),
                hidden_size=args.hidden,
                intermediate_size=args.ffn,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                max_position_embeddings=args.context,
                tie_word_embeddings=False,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
        model.save_pretrained(tmp / "model")
        params = sum(p.numel() for p in model.parameters())

        ids = tok(raw.read_text(), add_special_tokens=False)["input_ids"][: args.tokens]
        (tmp / "text.txt").write_text(tok.decode(ids))
        shutil.copy(ROOT / "params.yaml", tmp / "params.yaml")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
        stage_args = [
            "--params",
            str(tmp / "params.yaml"),
            "--models",
            f"bench={tmp / 'model'}",
            "--text",
            str(tmp / "text.txt"),
            "--output",
            str(tmp / "out"),
            f"contexts=[{args.context}]",
            f"stride={args.stride}",
            f"batch_size={args.batch_size}",
            "max_tokens=0",
            "prepend_bos=true",
            f"precision={args.precision}",
        ]
        # The same token stream the stage evaluates: bos, then the text's ids.
        stream = eval_perplexity.text_stream(
            tmp / "text.txt",
            tok,
            eval_perplexity.Config(
                contexts=(args.context,),
                stride=args.stride,
                batch_size=1,
                split="test",
                extrapolate=False,
                position_buckets=(),
                max_tokens=0,
                prepend_bos=True,
                precision=args.precision,
            ),
        ).ids
        stream = torch.from_numpy(stream[0 : len(stream)])
        device = runtime.init().device
        dtype = runtime.compute_dtype(device, args.precision)
        model = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=dtype).to(device).eval()
        base_tps, stage, rate = 0.0, None, 0.0
        # bf16 beside fp32 on CPUs that compute it natively (on GPUs the stage is in bf16 already)
        bf16 = device.type == "cpu" and dtype == torch.float32 and runtime.cpu_has_native_bf16() and not args.no_bf16
        stage_bf16, rate_bf16 = None, 0.0

        def measured_run(extra: list[str]) -> dict:
            """The stage's figures at the context, with the tokens/s it measured (out.measured.json)."""
            m = eval_perplexity.main([*stage_args, *extra])["models"]["bench"][f"ctx{args.context}"]
            speed = json.loads((tmp / "out.measured.json").read_text())["models"]["bench"]
            return {**m, **speed[f"ctx{args.context}"]}

        for _ in range(args.repeats):
            m = measured_run([])
            stage = m if stage is None or m["tokens_per_s"] > stage["tokens_per_s"] else stage
            nll_sum, n_tokens, seen, seconds = baseline(model, stream, args.context, args.stride)
            base_tps = max(base_tps, n_tokens / seconds)
            rate = max(rate, matmul_flops(device, dtype))
            if bf16:
                m = measured_run(["precision=bf16"])
                stage_bf16 = m if stage_bf16 is None or m["tokens_per_s"] > stage_bf16["tokens_per_s"] else stage_bf16
                rate_bf16 = max(rate_bf16, matmul_flops(device, torch.bfloat16))
        forward_fpt = loop.flops_per_token(model, args.context) / 3  # the forward third of forward + backward
        base_fraction = forward_fpt * base_tps * seen / n_tokens / rate

    base_ppl = math.exp(nll_sum / n_tokens)
    rel = abs(stage["perplexity"] - base_ppl) / base_ppl
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 logits round differently per batch shape
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    if args.json:
        figures = {
            "device": where,
            "dtype": str(dtype),
            "parameters": params,
            "context": args.context,
            "batch_size": args.batch_size,
            "stage_tokens_per_s": stage["tokens_per_s"],
            "baseline_tokens_per_s": base_tps,
            "ratio": stage["tokens_per_s"] / base_tps,
            "stage_perplexity": stage["perplexity"],
            "baseline_perplexity": base_ppl,
            "relative_difference": rel,
            "baseline_fraction_of_matmul": base_fraction,
        }
        args.json.write_text(json.dumps(figures, indent=1))
    print(
        f"model: Llama {params / 1e6:.1f}M params (random weights), vocab {len(tok)}, {device} {dtype}, "
        f"{where}; text: TinyShakespeare, {len(stream):,} tokens; "
        f"context {args.context}, stride {args.stride}; best of {args.repeats}"
    )
    print(
        f"stage    (batch {args.batch_size:>2}): {stage['tokens_per_s']:>10,.0f} tokens/s  "
        f"perplexity {stage['perplexity']:.6f} over {stage['tokens']:,} tokens"
    )
    print(f"baseline (batch  1): {base_tps:>10,.0f} tokens/s  perplexity {base_ppl:.6f} over {n_tokens:,} tokens")
    print(f"ratio stage/baseline: {stage['tokens_per_s'] / base_tps:.1f}x  (goal >= 10)")
    print(
        f"the baseline runs at {base_fraction:.2f} of the {rate / 1e9:,.0f} GFLOP/s matmul rate: batching can gain "
        f"at most {1 / base_fraction:.1f}x here; the stage runs at "
        f"{base_fraction * stage['tokens_per_s'] / base_tps:.2f} of it"
    )
    print(
        f"perplexities agree: {rel < tolerance and n_tokens == stage['tokens']} (relative difference {rel:.1e}, "
        f"tokens {stage['tokens']:,} vs {n_tokens:,})"
    )

    cpu = runtime.cpu_info()
    print(f"CPU: {cpu['cpu_model']}, torch capability {cpu['cpu_capability']}, flags {' '.join(cpu['cpu_flags'])}")
    if stage_bf16 is not None:
        print(
            f"stage in bf16 (batch {args.batch_size:>2}): {stage_bf16['tokens_per_s']:>10,.0f} tokens/s "
            f"({stage_bf16['tokens_per_s'] / stage['tokens_per_s']:.2f}x fp32), "
            f"perplexity {stage_bf16['perplexity']:.6f} (relative difference from fp32 "
            f"{abs(stage_bf16['perplexity'] - stage['perplexity']) / stage['perplexity']:.1e}); "
            f"bf16 matmul {rate_bf16 / 1e9:,.0f} GFLOP/s ({rate_bf16 / rate:.2f}x fp32)"
        )
    elif device.type == "cpu" and not args.no_bf16:
        print(
            "bf16: not measured: this CPU has neither AVX512-BF16 nor AMX-BF16, so bf16 is emulated (~20x slower "
            "than fp32); precision: auto keeps fp32 on CPUs"
        )


if __name__ == "__main__":
    main()
