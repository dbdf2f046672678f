"""The planner on one GPU: planned peak device memory vs the CUDA allocator's peak, planned vs measured tokens/s.

    python bench/plan_gpu_check.py [--tokenized .gpu/ci] [--steps 5] [--peak-tflops 989] [--json FILE]
    python bench/plan_gpu_check.py --dry [--json FILE]     the same code on the CPU at the ci preset's size

Runs pretrain (bf16 autocast over fp32 weights), then finetune_qlora on pretrain's model as the DAG does, with
an NF4 base and with the unquantized (bf16) base: each `python -m stages.<name>` one process of its own on the
GPU, over the ci preset's params with a Llama of hidden 1024, 8 layers (16 heads, 8 KV heads, MLP 2816, the ci
tokenizer's vocabulary of 512: 95M parameters), 8 sequences of 512 tokens per step, 5 steps, no evaluation
during training and no checkpoints, MLflow off; finetune_qlora with rank-16 adapters on every linear layer,
the Alpaca template and its activation checkpointing. The size: pretrain holds ~3 GiB and the fine-tunes a
few hundred MiB, far above what the allocator holds besides tensors (cuBLAS workspaces, tens of MiB), while a
step takes milliseconds: each run is mostly its process's start and its publish, seconds.

Measured: each stage runs under this file's runner (--peak-to), which first leaves the cuBLAS workspaces
allocated (matmuls forward and backward in fp32 and bf16; backward runs in autograd's device thread, with a
handle and workspace of its own), then runs the stage with runpy after registering an exit function that
writes torch.cuda.max_memory_allocated(): a stage ends through stages.common.stage.exit_now, which runs the
exit functions before os._exit. Tokens/s are the stage's own (its measured file: the median step after the
first); finetune_qlora's own peak (the end of training) is printed too.

Planned: pipelines.plan on plan.Machine(gpus=1, gpu_mem=the device's memory) for the same params: its peak
per rank over the device's phases (training; finetune_qlora's merge) less its runtime reserve (--gpu-reserve:
the CUDA context and the allocator's slack, an allowance), against the measured peak less the workspaces
(which that allowance covers too): max_memory_allocated sees neither the context nor the slack. Goal:
within 15%. Time: the planner's seconds for the run's steps (FLOPs at MFU 0.4 of train.peak_tflops, which
--peak-tflops sets for the planner and the stage alike) as tokens/s, over the measured; the MFU at which
the two agree is printed beside. No goal there: MFU is the planner's stated assumption, and a model this
small runs far below it.

Inputs: the ci preset's tokenize output and instruction records, from --tokenized (what
`bench/gpu_check.sh --pack` makes: tokenize/, instructions.jsonl, params.yaml) when made under the same
prepare_data and tokenize params, else made here first (bench/ci_record_check.py's code).

--dry: the CPU (CUDA hidden), the ci preset's own model (2 layers of width 64, context 64), a notional
80 GiB GPU for the planner; the runner records the process's peak resident memory instead, so the ratios
compare unlike things: the dry run proves the code path. Figures (--json) are rewritten after each run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve()
sys.path.insert(0, str(ROOT))

MODEL = {"n_layers": 8, "hidden_size": 1024, "n_heads": 16, "n_kv_heads": 8, "intermediate_size": 2816}
SEQ = 512
TRAIN = {"batch_size": 8, "micro_batch_size": 8, "eval_every": 0, "eval_batches": 1, "checkpoint_every": 0}
# name: (stage, overrides of its section); pretrain first: the fine-tunes start from its model
CONFIGS = {
    "pretrain bf16": ("pretrain", {"train.precision": "bf16"}),
    "finetune_qlora nf4": ("finetune_qlora", {"quantization": "nf4"}),
    "finetune_qlora none": ("finetune_qlora", {"quantization": "none"}),
}
DRY_GPU_GIB = 80.0


def overrides(vocab: int, records: Path, steps: int, peak_tflops: float, dry: bool) -> list[str]:
    """The bench's params over the ci preset, as section.key=value (dry: the ci preset's model and lengths)."""
    out = [f"tokenize.vocab_size={vocab}", f"prepare_data.instructions={records}"]
    out += ["prepare_data.instructions_max_records=0"]
    if not dry:
        out += [f"pretrain.model.{k}={v}" for k, v in MODEL.items()]
        out += [f"pretrain.model.max_position_embeddings={SEQ}", f"pretrain.context_length={SEQ}"]
        out += [f"finetune_qlora.seq_length={SEQ}", "finetune_qlora.template=alpaca"]
        out += ["finetune_qlora.lora.r=16", "finetune_qlora.lora.alpha=32.0"]
    train = {**TRAIN, "steps": steps, "peak_tflops": peak_tflops}
    return out + [f"{section}.train.{k}={v}" for section in ("pretrain", "finetune_qlora") for k, v in train.items()]


def inputs(params: Path, packed: Path, work: Path) -> tuple[Path, Path]:
    """The ci preset's tokenize output and instruction records: the packed ones when made under these params,
    else made in `work`."""
    from ci_record_check import make_tokenized, tokenized_for

    tokenize = tokenized_for(params, packed, work)
    if not (tokenize.parent / "instructions.jsonl").is_file():  # (a pack made before it kept the records)
        print(f"no instruction records beside {tokenize}; making both anew", flush=True)
        tokenize = make_tokenized(work / "inputs", params)
    return tokenize, tokenize.parent / "instructions.jsonl"


def probe_workspaces() -> int:
    """Bytes the CUDA allocator holds for cuBLAS once matmuls ran forward and backward in fp32 and bf16: the
    workspaces, kept for the process's life."""
    import torch

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 256, device="cuda", dtype=dtype)
        w = torch.randn(256, 256, device="cuda", dtype=dtype, requires_grad=True)
        b = torch.zeros(256, device="cuda", dtype=dtype, requires_grad=True)
        (torch.nn.functional.linear(x, w, b) @ w).sum().backward()
        del x, w, b
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return held


def runner(out: Path, module: str, argv: list[str]) -> None:
    """`module` run as __main__ in this process; at exit, its peak memory written to `out` (on a GPU the
    allocator's peak; on a CPU the peak resident memory)."""
    import atexit
    import resource
    import runpy

    import torch

    cuda = torch.cuda.is_available()
    workspace = probe_workspaces() if cuda else 0

    def write() -> None:
        if cuda:
            peak, device = torch.cuda.max_memory_allocated(), torch.cuda.get_device_name()
        else:
            peak, device = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu"
        out.write_text(json.dumps({"device": device, "peak_bytes": peak, "workspace_bytes": workspace}))

    atexit.register(write)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def compare(name: str, planned: dict, machine, peak: dict, measured: dict) -> dict:
    """One config's row: planned against measured memory and tokens/s (MiB, tokens/s, ratios)."""
    b, s = planned["budget"], planned["spec"]
    reserve = b.parts.get("runtime reserve", 0)
    planned_tps = s.train["batch_size"] * s.seq * s.train["steps"] * s.runs / b.seconds
    row = {
        "config": name,
        "device": peak["device"],
        "planned_mib": (b.peak - reserve) / 2**20,
        "phase": b.peak_phase,
        "planned_train_mib": (b.phases["train"] - reserve) / 2**20,
        "reserve_mib": reserve / 2**20,
        "measured_peak_mib": peak["peak_bytes"] / 2**20,
        "workspace_mib": peak["workspace_bytes"] / 2**20,
        "stage_peak_mib": measured.get("peak_memory_mb"),
        "planned_tokens_per_s": planned_tps,
        "measured_tokens_per_s": measured["tokens_per_s"],
    }
    row["ratio"] = row["planned_mib"] / (row["measured_peak_mib"] - row["workspace_mib"])
    row["time_ratio"] = planned_tps / measured["tokens_per_s"]
    row["mfu_at_measured"] = machine.mfu / row["time_ratio"]
    return row


def show(row: dict, mfu: float, peak_tflops: float) -> str:
    own = f"; the stage's own training peak {row['stage_peak_mib']:,.0f}" if row["stage_peak_mib"] else ""
    return (
        f"{row['config']:20s} planned {row['planned_mib']:8,.0f} MiB ({row['phase']}; runtime reserve "
        f"{row['reserve_mib']:,.0f} not compared)  measured {row['measured_peak_mib']:8,.0f} MiB (of which "
        f"workspaces {row['workspace_mib']:,.0f}{own})  ratio {row['ratio']:.3f}\n"
        f"{'':20s} tokens/s planned {row['planned_tokens_per_s']:,.0f} (MFU {mfu:g} of {peak_tflops:g} TFLOP/s), "
        f"measured {row['measured_tokens_per_s']:,.0f}: ratio {row['time_ratio']:.3f}; they agree at MFU "
        f"{row['mfu_at_measured']:.3g}"
    )


def main() -> None:
    if sys.argv[1:2] == ["--peak-to"]:  # the runner: --peak-to FILE -m MODULE ARGS...
        runner(Path(sys.argv[2]), sys.argv[4], sys.argv[5:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenized", type=Path, default=ROOT / ".gpu/ci", help="a folder gpu_check.sh --pack made")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak, per GPU")
    parser.add_argument("--gpu-reserve", type=float, default=1.0, help="the planner's runtime reserve, GiB")
    parser.add_argument("--dry", action="store_true", help="the CPU, at the ci preset's size: the code path only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch
    from ci_record_check import ci_params, stage_env

    from pipelines import plan

    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("plan_gpu_check: no CUDA GPU here; --dry runs the same code on the CPU at the ci size")
    torch.set_num_threads(1)  # (the planner traces while a stage runs: it leaves the stage the cores)
    gpu_mem = DRY_GPU_GIB if args.dry else torch.cuda.get_device_properties(0).total_memory / 2**30
    machine = plan.Machine(gpus=1, gpu_mem=gpu_mem, gpu_reserve=args.gpu_reserve)
    env = stage_env(**({"CUDA_VISIBLE_DEVICES": ""} if args.dry else {}))
    figures = {"dry": args.dry, "gpu_mem_gib": gpu_mem, "mfu": machine.mfu, "peak_tflops": args.peak_tflops}
    rows = figures["rows"] = []
    with tempfile.TemporaryDirectory(prefix="plan-gpu-") as tmp:
        work = Path(tmp)
        params_path = ci_params(work)
        tokenize, records = inputs(params_path, args.tokenized.resolve(), work)
        vocab = json.loads((tokenize / "meta.json").read_text())["vocab_size"]
        ours = overrides(vocab, records, args.steps, args.peak_tflops, args.dry)
        for n, (name, (stage, extra)) in enumerate(CONFIGS.items()):
            params = plan.load_params(str(params_path), None, [*ours, *(f"{stage}.{k}={v}" for k, v in extra.items())])
            (work / f"params-{n}.yaml").write_text(json.dumps(params))  # (YAML reads JSON)
            paths = ["--input", str(tokenize if stage == "pretrain" else records), "--output", f"out/{n}"]
            paths += ["--base", "out/0/model"] if stage == "finetune_qlora" else []
            paths += ["--params", f"params-{n}.yaml", "--measured", f"measured-{n}.json"]
            cmd = [sys.executable, str(RUNNER), "--peak-to", f"peak-{n}.json", "-m", f"stages.{stage}", *paths]
            print(f"$ {' '.join(cmd)}", flush=True)
            proc = subprocess.Popen(cmd, cwd=work, env=env)
            item = f"{stage}@{extra['quantization']}" if "quantization" in extra else stage
            (planned,) = plan.plan(params, machine, item)  # (while the stage runs)
            if proc.wait() != 0:
                raise SystemExit(f"plan_gpu_check: {name} failed (exit {proc.returncode}); its output is above")
            peak = json.loads((work / f"peak-{n}.json").read_text())
            measured = json.loads((work / f"measured-{n}.json").read_text())
            rows.append(compare(name, planned, machine, peak, measured))
            figures["device"] = peak["device"]
            print(show(rows[-1], machine.mfu, args.peak_tflops), flush=True)
            if args.json:
                args.json.write_text(json.dumps(figures, indent=1))
    what = "peak RSS (CPU, dry: not comparable)" if args.dry else "CUDA peak less workspaces"
    print(f"\n| config | planned peak MiB (phase) | measured {what} MiB | ratio | tokens/s planned / measured |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['planned_mib']:,.0f} ({r['phase']}) | "
            f"{r['measured_peak_mib'] - r['workspace_mib']:,.0f} | {r['ratio']:.3f} | {r['time_ratio']:.3f} |"
        )
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    print(f"\nwithin 15%: {within} of {len(rows)}" + (" (dry: the code path only)" if args.dry else ""))


if __name__ == "__main__":
    main()
