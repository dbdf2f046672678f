"""The planner against the stages: planned peak memory per rank vs the peak resident memory measured on CPU.

    python bench/plan_check.py [--tokenize data/tokenize] [--instructions data/prepare_data/instructions.jsonl]
        [--only NAME ...] [--json FILE]

Runs the real stages (`python -m stages.<name>`, or torchrun with 2 CPU processes) on small configs: the
ci preset's params with a 4-layer Llama of width 256 (MLP 688, vocabulary of the given tokenizer), 256
tokens per sequence, 8 sequences per step, 2 steps, no evaluation during training and no checkpoints, MLflow
off. For each, python -m pipelines.plan's figure for the same params and processes is printed beside the
largest process's peak resident memory (VmHWM: the run's wrapper reads getrusage(RUSAGE_CHILDREN)'s
ru_maxrss, the largest of its descendants, torchrun's workers included), and their ratio.

The planner's per-rank peak on CPU adds the process baseline, what a stage's process holds besides its
tensors and records (interpreter, libraries, tokenizer, threads, the kernels' buffers). The bench measures it
once per stage as an "empty process": the same stage run at the ci preset's own size (2 layers of width 64,
its tensors a few MiB), less the planner's tensor figure for that run; it is printed as `process` and given
to the planner (--process-mb) for the other configs. Also printed: what the planner measures when not given
one, a fresh Python that only imports the stage and its libraries.

Configs: pretrain in fp32 and bf16 autocast, activation checkpointing none and full, 1 process and 2 (DDP;
FSDP2 with full checkpointing); finetune_qlora with an NF4 base and with the unquantized base (1 process;
its base a random Llama of the same shape saved here with the tokenizer; the planner counts the records of
--instructions, which the stage reads). Goal: planned within 15% of measured for each.

What the planner leaves out on CPU is glibc's malloc: once a process frees a block it had mapped, glibc
raises its mmap threshold to that size and keeps the holes of its heap resident. In the environment
MALLOC_MMAP_THRESHOLD_=131072 the threshold stays fixed, and the measured peaks are what the tensors take.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = {"n_layers": 4, "hidden_size": 256, "n_heads": 8, "n_kv_heads": 8, "intermediate_size": 688}
TRAIN = {"steps": 2, "batch_size": 8, "micro_batch_size": 8, "eval_every": 0, "eval_batches": 1, "checkpoint_every": 0}
# name: (stage, processes, overrides of its section)
CONFIGS = {
    "pretrain fp32, AC none, 1 proc": ("pretrain", 1, {}),
    "pretrain fp32, AC full, 1 proc": ("pretrain", 1, {"train.activation_checkpointing": "full"}),
    "pretrain bf16, AC none, 1 proc": ("pretrain", 1, {"train.precision": "bf16"}),
    "pretrain fp32, AC none, 2 procs (ddp)": ("pretrain", 2, {}),
    "pretrain bf16, AC full, 2 procs (fsdp)": (
        "pretrain",
        2,
        {"train.precision": "bf16", "train.activation_checkpointing": "full", "train.strategy": "fsdp"},
    ),  # fmt: skip
    "finetune_qlora nf4, 1 proc": ("finetune_qlora", 1, {"quantization": "nf4"}),
    "finetune_qlora none, 1 proc": ("finetune_qlora", 1, {"quantization": "none"}),
}
WRAPPER = (
    "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
    "print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)"
)


def overrides(vocab: int, base: Path, records: Path, tiny: bool = False) -> list[str]:
    """The bench's params over the ci preset, as section.key=value (`tiny`: the ci preset's own model and
    context, for the process baseline). The planner's base and records are the stage's (--base, --input)."""
    out = [f"tokenize.vocab_size={vocab}", f"base.model={base}"]
    out += [f"prepare_data.instructions={records}", "prepare_data.instructions_max_records=0"]
    if not tiny:
        out += [f"pretrain.model.{k}={v}" for k, v in MODEL.items()]
        out += ["pretrain.model.max_position_embeddings=256", "pretrain.context_length=256"]
        out += ["finetune_qlora.seq_length=256", "finetune_qlora.template=alpaca"]
    out += [f"pretrain.train.{k}={v}" for k, v in TRAIN.items()]
    out += [f"finetune_qlora.train.{k}={v}" for k, v in {**TRAIN, "batch_size": 4, "micro_batch_size": 4}.items()]
    return out


def make_base(folder: Path, tokenizer: Path, vocab: int, tiny: bool = False) -> None:
    """A random Llama of the bench's shape in Hugging Face format, with the tokenizer: finetune_qlora's base."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = {"n_layers": 2, "hidden_size": 64, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 128} if tiny else MODEL
    mc = LlamaConfig(
        vocab_size=vocab, hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"], num_key_value_heads=m["n_kv_heads"],
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(mc).save_pretrained(folder)
    shutil.copytree(tokenizer, folder, dirs_exist_ok=True)


def measure(stage: str, procs: int, args: list[str], work: Path) -> int:
    """The largest process's peak resident bytes of one stage run in `work`."""
    import os

    launcher = [sys.executable] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"
    ]  # fmt: skip
    env = {**os.environ, "PIPELINE_TRACKING": "off", "PYTHONPATH": str(ROOT)}
    env.pop("PIPELINE_RUN_ID", None)
    cmd = [sys.executable, "-c", WRAPPER, *launcher, "-m", f"stages.{stage}", *args]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1].split()
    if last[0] != "maxrss_kib" or last[2] != "0":
        raise RuntimeError(f"{stage} failed:\n{proc.stderr[-3000:]}")
    return int(last[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenize", type=Path, default=Path("data/tokenize"))
    parser.add_argument("--instructions", type=Path, default=Path("data/prepare_data/instructions.jsonl"))
    parser.add_argument("--only", nargs="*", help="run only the configs whose name contains one of these")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from pipelines import plan, preset

    tokenize, instructions = args.tokenize.resolve(), args.instructions.resolve()
    vocab = json.loads((tokenize / "meta.json").read_text())["vocab_size"]
    rows, baselines = [], {}
    with tempfile.TemporaryDirectory(prefix="plan-check-") as tmp:
        work = Path(tmp)
        shutil.copy(ROOT / "params.yaml", work / "params.yaml")
        preset.apply("ci", work / "params.yaml")
        make_base(work / "base", tokenize / "tokenizer", vocab)
        make_base(work / "tiny", tokenize / "tokenizer", vocab, tiny=True)

        def run(stage: str, procs: int, mine: list[str], item: str, process_mb: float | None, base: Path):
            params = plan.load_params(str(work / "params.yaml"), None, mine)
            (planned,) = plan.plan(params, plan.Machine(procs=procs, process_mb=process_mb), item)
            n = len(list(work.glob("params-*.yaml")))
            (work / f"params-{n}.yaml").write_text(json.dumps(params))  # (YAML reads JSON)
            paths = ["--input", str(tokenize if stage == "pretrain" else instructions), "--output", f"out/{n}"]
            paths += ["--base", str(base)] if stage == "finetune_qlora" else []
            return planned["budget"], measure(stage, procs, [*paths, "--params", f"params-{n}.yaml"], work)

        for name, (stage, procs, extra) in CONFIGS.items():
            if args.only and not any(o in name for o in args.only):
                continue
            item = f"{stage}@{extra['quantization']}" if "quantization" in extra else stage
            if stage not in baselines:  # the empty process: the stage at the ci size, less its planned tensors
                tiny = [*overrides(vocab, work / "tiny", instructions, tiny=True)]
                tiny += [f"{stage}.{k}={v}" for k, v in extra.items()]
                b, measured = run(stage, 1, tiny, item, 0, work / "tiny")
                imports = plan.process_baseline(stage, {})
                baselines[stage] = (measured - b.peak) / 2**20
                print(
                    f"{stage}: process baseline {baselines[stage]:.0f} MiB (the ci-size run {measured / 2**20:.0f} MiB "
                    f"less its planned tensors {b.peak / 2**20:.0f} MiB); a Python that only imports the stage and "
                    f"its libraries: {imports / 2**20:.0f} MiB",
                    flush=True,
                )
            mine = [*overrides(vocab, work / "base", instructions), *(f"{stage}.{k}={v}" for k, v in extra.items())]
            b, measured = run(stage, procs, mine, item, baselines[stage], work / "base")
            row = {
                "config": name,
                "planned_mib": b.peak / 2**20,
                "phase": b.peak_phase,
                "process_mib": baselines[stage],
                "activations_mib": b.at_peak["activations"] / 2**20,
                "measured_mib": measured / 2**20,
            }
            row["ratio"] = row["planned_mib"] / row["measured_mib"]
            rows.append(row)
            print(
                f"{name:42s} planned {row['planned_mib']:7.0f} MiB ({row['phase']}, process {row['process_mib']:.0f}, "
                f"activations {row['activations_mib']:.0f})  measured {row['measured_mib']:7.0f} MiB  "
                f"ratio {row['ratio']:.3f}",
                flush=True,
            )
    print("\n| config | planned peak MiB (phase) | of which process | measured peak RSS MiB | planned / measured |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['planned_mib']:,.0f} ({r['phase']}) | {r['process_mib']:,.0f} | "
            f"{r['measured_mib']:,.0f} | {r['ratio']:.3f} |"
        )
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    print(f"\nwithin 15%: {within} of {len(rows)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
