"""Parallelism study: what each layout of the processes costs per rank and on the wire, measured.

    python bench/parallel_study.py [--input data/tokenize] [--model 63m|tiny] [--steps 5]
        [--layouts ddp2,fsdp2,tp2,pp2,ddp4,fsdp4,tp4,pp4,fsdp2-tp2,hsdp2x2,pp2-ddp2,pp2-tp2]
        [--out reports/parallel_study] [--one-launch]

Trains pretrain's Llama from one seed on the tokenize stage's shards for --steps optimizer steps
under each layout, each in a fresh `torchrun` (gloo on CPUs, nccl on GPUs; with --one-launch the layouts of
one process count share one, for tests), in fp32, with the
codebase's loop (stages/common/loop.py) and a global batch of 8 x context tokens per step:

    ddpN     DDP over N processes              fsdpN    FSDP2 over N processes
    tpN      tensor parallel N                 ppN      pipeline parallel N stages (1F1B)
    fsdp2-tp2  FSDP2 over 2 x tensor parallel 2 (2D, 4 processes)
    hsdp2x2    HSDP: 2 replicas, each FSDP2-sharded over 2 processes
    pp2-ddp2   2 pipelines of 2 stages, each stage's gradients averaged over its 2 copies
    pp2-tp2    2 pipeline stages, each split by tensor parallel 2

Per layout:
    loss            training loss at the last step: every layout trains the same model, so these agree
                    to float summation order
    state_mib       parameters + gradients + optimizer states a rank holds (its shards), mean over ranks;
                    gradients have their parameters' shapes
    peak_mib        the largest peak memory of a rank (CPU: VmHWM, the whole process; GPU: allocator)
    comm_mib        bytes a rank sends in the last step, mean over ranks, counted from the communication
                    ops as they run (stages.common.comm.CommCounter: ring algorithm's bytes per op)
    analytic_mib    the same from the model's and the batch's shapes alone (analytic_bytes); the step's
                    scalar all-reduces (loss, target count, gradient norm) are left out of it
    tokens_per_s    from the median step (the first left out); on a shared CPU a noisy figure

Checks (printed; exit status 1 when one fails): TP 2's state per rank <= 0.55 x DDP 2's; every layout's
comm_mib within 10% of its analytic figure; every layout's loss equal to DDP's (rtol 1e-4).
Writes to --out: table.csv, table.md, figures.json, parallel.png.

Models: 63m is 8 layers x 768 (12 heads, MLP 2,048) and the tokenizer's vocabulary (63M parameters
with 4,096), context 256, 2 sequences per micro-batch; tiny is 4 layers x 64, context 32. About 15
minutes on 2 CPU cores at 63m, one on tiny.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stages.common.tracking.tracker import NullTracker  # noqa: E402  (no torch: the parent process starts fast)

MODELS = {
    "63m": {
        "model": {"n_layers": 8, "hidden_size": 768, "n_heads": 12, "n_kv_heads": 12, "intermediate_size": 2048},
        "context": 256,
        "micro_batch_size": 2,
    },
    "tiny": {
        "model": {"n_layers": 4, "hidden_size": 64, "n_heads": 4, "n_kv_heads": 4, "intermediate_size": 128},
        "context": 32,
        "micro_batch_size": 2,
    },
}
BATCH = 8  # sequences per optimizer step
LAYOUTS = {  # name: (processes, train keys)
    "ddp2": (2, {"strategy": "ddp"}),
    "fsdp2": (2, {"strategy": "fsdp"}),
    "tp2": (2, {"tensor_parallel": 2}),
    "pp2": (2, {"pipeline_parallel": 2}),
    "ddp4": (4, {"strategy": "ddp"}),
    "fsdp4": (4, {"strategy": "fsdp"}),
    "tp4": (4, {"tensor_parallel": 4}),
    "pp4": (4, {"pipeline_parallel": 4}),
    "fsdp2-tp2": (4, {"strategy": "fsdp", "tensor_parallel": 2}),
    "hsdp2x2": (4, {"strategy": "fsdp", "data_parallel_replicate": 2}),
    "pp2-ddp2": (4, {"pipeline_parallel": 2}),
    "pp2-tp2": (4, {"pipeline_parallel": 2, "tensor_parallel": 2}),
}
STATE_GOAL = 0.55  # TP 2's state per rank / DDP 2's
COMM_TOLERANCE = 0.10
LOSS_RTOL = 1e-4
MIB = 2**20


def train_section(steps: int, micro_batch_size: int, keys: dict) -> dict:
    from stages.common import train_config

    changed = {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 1, "eval_batches": 0, "precision": "fp32"}
    return {
        **train_config.RUN_DEFAULTS,
        "steps": steps,
        "batch_size": BATCH,
        "micro_batch_size": micro_batch_size,
        **changed,
        **keys,
    }


# --------------------------------------------------------------------------------------- analytic
def parameter_counts(model: dict, vocab: int) -> dict:
    """Parameters of pretrain's Llama: per decoder layer (split by tensor parallel, and whole: its two
    norms) and at its ends (embedding and head: split by tensor parallel; final norm: whole)."""
    h, i = model["hidden_size"], model["intermediate_size"]
    kv = h // model["n_heads"] * model["n_kv_heads"]
    return {
        "layer_split": 2 * h * h + 2 * h * kv + 3 * h * i,
        "layer_whole": 2 * h,
        "ends_split": 2 * vocab * h,
        "ends_whole": h,
        "layers": model["n_layers"],
    }


def analytic_bytes(name: str, model: dict, vocab: int, context: int, micro_batch_size: int) -> float:
    """Bytes a rank sends per optimizer step under a layout (mean over ranks), fp32, from the shapes:

    DDP       one all-reduce of all gradients (no sync on the step's other micro-batches)
    FSDP      per micro-batch: all-gather of every layer's parameters for the forward and again for the
              backward, of the root's (embedding, final norm, head) once (kept for the backward), and a
              reduce-scatter of all gradients
    TP        per micro-batch, all-reduces of (b, T, H) activations: the embedding's output, each layer's
              attention and MLP outputs (forward) and input gradients (backward), the head's input
              gradient; plus the vocabulary-parallel loss's three (b, T) all-reduces (max, sum of
              exponentials, target logit)
    PP        per micro-batch, each stage boundary sends (b, T, H) activations forward and their
              gradients back
    FSDP x TP FSDP's traffic over the data dimension on the tensor-parallel shards, plus TP's
    HSDP      FSDP's within a replica, plus per micro-batch an all-reduce of the gradient shards across
              the replicas
    PP x DDP  PP's, plus one all-reduce per step of each stage's gradients (a stage holds 1/PP of the
              parameters on average)
    PP x TP   PP's (each tensor-parallel rank sends its copy of the activations), plus TP's for a stage's
              share of the layers (the embedding's on the first stage, the head's and the loss's on the last)
    """
    nproc, keys = LAYOUTS[name]
    tp, pp = keys.get("tensor_parallel", 1), keys.get("pipeline_parallel", 1)
    dp = nproc // (tp * pp)
    replicas = keys.get("data_parallel_replicate", 1)
    micro = BATCH // (micro_batch_size * dp)  # micro-batches per step per replica
    c = parameter_counts(model, vocab)
    if tp > 1 and model.get("tie_word_embeddings"):
        raise ValueError("the study's model has untied embeddings")
    layer = c["layer_split"] / tp + c["layer_whole"]
    ends = c["ends_split"] / tp + c["ends_whole"]
    params = (c["layers"] * layer + ends) / pp  # a tensor-parallel rank's, a pipeline stage's on average
    e = 4  # fp32
    activation = micro_batch_size * context * model["hidden_size"] * e
    sent = 0.0
    if pp > 1:
        sent += micro * 2 * (pp - 1) / pp * activation
    if tp > 1:
        per_micro = (4 * c["layers"] + 2) * activation + 3 * micro_batch_size * context * e
        sent += micro * 2 * (tp - 1) / tp * per_micro / pp
    if dp > 1 and keys.get("strategy") == "fsdp":
        if pp > 1:
            raise ValueError("the study has no analytic figure for FSDP2 beside pipeline stages")
        shard = dp // replicas
        gathered = ends + 2 * c["layers"] * layer
        sent += micro * (shard - 1) / shard * (gathered + params) * e
        sent += micro * 2 * (replicas - 1) / replicas * params / shard * e
    elif dp > 1:
        sent += 2 * (dp - 1) / dp * params * e
    return sent


# --------------------------------------------------------------------------------------- one layout
def vm_hwm_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


class LastStepCounter(NullTracker):
    """A tracker for loop.train that counts the communication of the last step only: the counter is
    entered once the step before is logged, and left when the last one is."""

    def __init__(self, steps: int):
        from stages.common.comm import CommCounter

        super().__init__()
        self.steps, self.counter, self.sent, self.calls, self.by_kind = steps, CommCounter(), None, {}, {}

    def log_metrics(self, metrics: dict, step: int, time_ms: int | None = None) -> None:
        if step == self.steps - 1:
            self.counter.__enter__()
        elif step == self.steps:
            self.counter.__exit__(None, None, None)
            self.sent, self.calls = self.counter.sent, dict(self.counter.calls)
            self.by_kind = dict(self.counter.by_kind)


def reset_peak_memory() -> bool:
    """Start a new peak for vm_hwm_mib (Linux: 5 to /proc/self/clear_refs resets VmHWM); False if refused."""
    import gc

    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def child(spec_paths: list[str]) -> None:
    """Layouts of one process count under one torchrun, one after another: train, measure, rank 0 writes
    every rank's figures. Each layout builds its own mesh, model and optimizer from the same seed."""
    import torch

    from stages import pretrain
    from stages.common import loop, runtime, shards, train_config

    rt = runtime.init()
    for spec_path in spec_paths:
        spec = json.loads(Path(spec_path).read_text())
        cfg = train_config.TrainConfig(**spec["train"])
        peak_is_own = reset_peak_memory() or spec_path == spec_paths[0]
        runtime.seed_everything(cfg.seed)
        inp = Path(spec["input"])
        model = pretrain.build_model(pretrain.ModelConfig(**spec["model"]), shards.read_meta(inp))
        n_params = sum(p.numel() for p in model.parameters())
        tokens = shards.open_stream(inp, "train")
        tracker = LastStepCounter(cfg.steps)
        with tempfile.TemporaryDirectory() as folder:
            result = loop.train(
                model, tokens, tokens, cfg, spec["context"], rt, Path(folder), tracker, runtime.StopFlag()
            )
        local = [getattr(p, "_local_tensor", p) for p in result.model.parameters()]
        param_bytes = sum(t.numel() * t.element_size() for t in local)
        cuda = rt.device.type == "cuda"
        figures = {
            "rank": rt.rank,
            "param_bytes": param_bytes,
            "grad_bytes": param_bytes,  # (every parameter trains; its gradient has its shape)
            "optimizer_bytes": result.optimizer_state_bytes,
            "peak_mib": torch.cuda.max_memory_allocated() / MIB if cuda else vm_hwm_mib(),
            "peak_is_own": cuda or peak_is_own,
            "sent_bytes": tracker.sent,
            "calls": tracker.calls,
            "sent_by_kind": tracker.by_kind,
            "loss": result.history["loss"][-1],
            "tokens_per_s": result.tokens_per_s,
            "parameters": n_params,
        }
        del result, model
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ranks = runtime.gather_objects(figures)
        if rt.is_main:
            Path(spec["result"]).write_text(json.dumps(ranks))
    runtime.teardown()


def run_layouts(names: list[str], args, vocab: int, folder: Path) -> dict[str, dict]:
    """Layouts of one process count, in one torchrun (or each in its own: len(names) == 1); their rows."""
    nproc = LAYOUTS[names[0]][0]
    size = MODELS[args.model]
    specs = []
    for name in names:
        spec = {
            "input": str(Path(args.input).resolve()),
            "model": {**size["model"], "max_position_embeddings": size["context"], "rope_theta": 10000.0},
            "context": size["context"],
            "train": train_section(args.steps, size["micro_batch_size"], LAYOUTS[name][1]),
            "result": str(folder / f"{name}.json"),
        }
        specs.append(folder / f"{name}.spec.json")
        specs[-1].write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [str(Path(__file__).resolve()), "--child", ",".join(map(str, specs))]
    from stages.memory_study import MALLOC_ENV, THREAD_ENV  # (resident memory that tracks the live tensors)

    env = {**os.environ, **MALLOC_ENV, **THREAD_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:  # the first rank's traceback: the others' usually report its loss
        lines = proc.stderr.splitlines()
        start = next((i for i, line in enumerate(lines) if "Traceback" in line), max(0, len(lines) - 40))
        raise SystemExit(
            f"parallel_study: layouts {','.join(names)} failed ({proc.returncode}):\n" + "\n".join(lines[start:][:60])
        )
    return {name: layout_row(name, json.loads((folder / f"{name}.json").read_text()), args, vocab) for name in names}


def layout_row(name: str, ranks: list[dict], args, vocab: int) -> dict:
    size = MODELS[args.model]
    n = len(ranks)
    state = sum(r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in ranks) / n
    analytic = analytic_bytes(name, size["model"], vocab, size["context"], size["micro_batch_size"])
    sent = sum(r["sent_bytes"] for r in ranks) / n
    return {
        "layout": name,
        "processes": LAYOUTS[name][0],
        "loss": ranks[0]["loss"],
        "param_mib": sum(r["param_bytes"] for r in ranks) / n / MIB,
        "optimizer_mib": sum(r["optimizer_bytes"] for r in ranks) / n / MIB,
        "state_mib": state / MIB,
        # a peak the process reached under an earlier layout of its launch (no VmHWM reset) is not this one's
        "peak_mib": max(r["peak_mib"] for r in ranks) if all(r["peak_is_own"] for r in ranks) else float("nan"),
        "comm_mib": sent / MIB,
        "analytic_mib": analytic / MIB,
        "comm_ratio": sent / analytic if analytic else float("nan"),
        "tokens_per_s": ranks[0]["tokens_per_s"],
        "parameters": ranks[0]["parameters"],
        "calls": ranks[0]["calls"],
        "sent_mib_by_kind": {k: v / MIB for k, v in ranks[0]["sent_by_kind"].items()},
    }


# --------------------------------------------------------------------------------------- report
def checks(rows: dict) -> list[tuple[str, bool]]:
    out = []
    if "tp2" in rows and "ddp2" in rows:
        ratio = rows["tp2"]["state_mib"] / rows["ddp2"]["state_mib"]
        out.append((f"TP 2 state per rank / DDP 2's = {ratio:.3f} (<= {STATE_GOAL})", ratio <= STATE_GOAL))
    for name, row in rows.items():
        ok = abs(row["comm_ratio"] - 1) <= COMM_TOLERANCE
        out.append((f"{name}: bytes sent / analytic = {row['comm_ratio']:.4f} (within {COMM_TOLERANCE:.0%})", ok))
    base = rows.get("ddp2") or next(iter(rows.values()))
    for name, row in rows.items():
        diff = abs(row["loss"] - base["loss"]) / abs(base["loss"])
        text = f"{name}: loss {row['loss']:.6f}, relative difference {diff:.1e} (<= {LOSS_RTOL})"
        out.append((text, diff <= LOSS_RTOL))
    return out


COLUMNS = (
    "layout", "processes", "loss", "param_mib", "optimizer_mib", "state_mib", "peak_mib", "comm_mib",
    "analytic_mib", "comm_ratio", "tokens_per_s",
)  # fmt: skip


def write_outputs(out: Path, rows: dict, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "table.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows.values())
    head = "| layout | procs | loss | state MiB/rank | peak MiB | sent MiB/step | analytic MiB | ratio | tokens/s |"
    lines = [head, "|" + "---|" * 9]
    for r in rows.values():
        lines.append(
            f"| {r['layout']} | {r['processes']} | {r['loss']:.4f} | {r['state_mib']:.1f} | {r['peak_mib']:.0f} | "
            f"{r['comm_mib']:.2f} | {r['analytic_mib']:.2f} | {r['comm_ratio']:.4f} | {r['tokens_per_s']:,.0f} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "figures.json").write_text(json.dumps({"meta": meta, "layouts": rows}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    x = range(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    params = [rows[n]["param_mib"] for n in names]
    opt = [rows[n]["optimizer_mib"] for n in names]
    ax.bar(x, params, label="parameters")
    ax.bar(x, params, bottom=params, label="gradients")
    ax.bar(x, opt, bottom=[2 * p for p in params], label="optimizer states")
    ax.set(ylabel="MiB per rank", title="training state per rank")
    ax.legend()
    ax = axes[0][1]
    ax.bar(x, [rows[n]["peak_mib"] for n in names], color="tab:gray")
    ax.set(ylabel="MiB", title="peak memory of the largest rank")
    ax = axes[1][0]
    ax.bar(x, [rows[n]["comm_mib"] for n in names], label="measured")
    ax.plot(x, [rows[n]["analytic_mib"] for n in names], "k_", markersize=18, mew=2, label="analytic")
    ax.set(ylabel="MiB sent per rank per step", title="communication")
    ax.legend()
    ax = axes[1][1]
    ax.bar(x, [rows[n]["tokens_per_s"] for n in names], color="tab:green")
    ax.set(ylabel="tokens/s", title=f"throughput ({meta['device']})")
    for ax in axes.flat:
        ax.set_xticks(list(x), names, rotation=30)
    fig.suptitle(f"{meta['parameters'] / 1e6:.1f}M-parameter Llama, {meta['tokens_per_step']:,} tokens per step")
    fig.tight_layout()
    fig.savefig(out / "parallel.png", dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", default="data/tokenize", help="the tokenize stage's output")
    p.add_argument("--model", choices=sorted(MODELS), default="63m")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out", default="reports/parallel_study")
    p.add_argument(
        "--one-launch",
        action="store_true",
        help="the layouts of one process count in one torchrun, one after another (start-up paid once; "
        "each layout's peak memory restarts from its own start where Linux allows, else it is left out)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child.split(","))
        return 0
    from stages.common import shards

    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)}; valid: {', '.join(LAYOUTS)}")
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the last step is counted, the first is warm-up)")
    try:
        vocab = shards.read_meta(Path(args.input))["vocab_size"]
    except FileNotFoundError:
        message = f"--input: no tokenize output at {args.input}; run `make run` (or dvc repro tokenize)"
        raise SystemExit(message) from None
    if args.one_launch:  # one launch per process count, in the order of --layouts
        launches = list({LAYOUTS[n][0]: [m for m in names if LAYOUTS[m][0] == LAYOUTS[n][0]] for n in names}.values())
    else:
        launches = [[name] for name in names]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for group in launches:
            for name, r in run_layouts(group, args, vocab, Path(tmp)).items():
                rows[name] = r
                print(
                    f"{name:>10}: loss {r['loss']:.4f}  state {r['state_mib']:8.1f} MiB/rank  "
                    f"peak {r['peak_mib']:7.0f} MiB  sent {r['comm_mib']:8.2f} MiB/step "
                    f"(analytic {r['analytic_mib']:8.2f})  "
                    f"{r['tokens_per_s']:8,.0f} tok/s",
                    flush=True,
                )
    rows = {name: rows[name] for name in names}
    import torch

    size = MODELS[args.model]
    meta = {
        "model": args.model,
        "parameters": next(iter(rows.values()))["parameters"],
        "tokens_per_step": BATCH * size["context"],
        "steps": args.steps,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores",
    }
    results = checks(rows)
    meta["checks"] = [{"check": text, "pass": ok} for text, ok in results]
    write_outputs(Path(args.out), rows, meta)
    for text, ok in results:
        print(f"{'pass' if ok else 'FAIL'}  {text}")
    print(f"table, figures and plot in {args.out}")
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
