"""memory_study: what each low-memory training technique buys and what it costs, measured.

Trains one model (pretrain's Llama architecture, `model` in params) from the same seed for `train.steps`
steps at each length in `contexts`, once per entry of `techniques` (overrides of the `train` section:
the optimizer, activation checkpointing, precision, ... alone and combined), each run in a process of
its own so that its peak memory is its own (forked from a server that imported the libraries once). Per run:

    peak_mb             the process's peak resident memory (VmHWM; on a GPU the allocator's peak)
    activation_mb       the part of the peak that is activations: peak minus the memory held before
                        training (model, data, runtime) minus gradients and optimizer states
    optimizer_state_mb  the optimizer's states (8-bit optimizers: quantized moments, block scales, code tables)
    tokens_per_s        training throughput, from the median step time (the first step left out)
    tokens_per_cpu_s    the same per second of the process's CPU time (its threads sleep while they wait):
                        on a CPU, the compute a step costs, which other jobs on the machine hardly move
    final_loss          mean training loss of the last steps, and its ratio to the baseline's

The rows checked in the report: the 8-bit optimizers' state against AdamW's (<= 0.30) and their loss
(within 2%), full activation checkpointing's saving at the longest context (>= 40% of the baseline's
activation memory), and selective checkpointing between none and full on memory. Speed (tokens per CPU
second on a CPU, tokens/s on a GPU) is a figure of the measured file, not a checked row: one timing per
technique has no spread to judge it by.

The stage's purpose is a measurement, and a measurement differs from run to run: what is computed (the
optimizers' state sizes and losses, and the rows about them) is its output, whose bytes depend only on
the inputs, params and code; what is measured (memory, speed, and the rows about them) goes to
--measured (measured/memory_study.json, and its plot measured/memory_study.png), outside the output.

Run:
    python -m stages.memory_study --input data/tokenize --output data/memory_study [key=value ...]
    snakemake --cores all memory_study        # or: dvc repro memory_study

Output (data/memory_study/):
    table.csv          one row per technique and context: optimizer-state MiB, final loss and its ratio
                       to the baseline's
    figures.json       the same per technique at the longest context
    metrics.json       optimizer-state MiB per technique at the longest context (DVC metrics)
    results.json       the report rows about the optimizers
    meta.json          the CPU, the code's hash and the package versions
Measured (--measured, measured/memory_study.json):
    techniques         per technique at the longest context: peak and activation MiB, tokens/s, tokens per CPU s
    table              the same per technique and context
    rows               the report rows about activation checkpointing
and its plot (measured/memory_study.png): peak memory and its activation part per technique and context.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import dataclasses
import importlib.util
import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from stages import pretrain
from stages.common import atomic, config, contract, loop, runtime, shards, stage, train_config
from stages.common.tracking.tracker import NullTracker

STAGE = "memory_study"
BASELINE = "baseline"
LOSS_STEPS = 3  # final_loss: the mean over the last this many steps
# Freed buffers above this size go back to the OS at once, so that resident memory tracks the live
# tensors (glibc otherwise raises its threshold as large blocks are freed and keeps them).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
# Threads that wait sleep instead of spinning, so a process's CPU time is its compute.
THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class Config:
    model: pretrain.ModelConfig
    contexts: tuple[int, ...]
    train: train_config.TrainConfig
    techniques: dict

    def __post_init__(self):
        if not self.contexts or min(self.contexts) < 2 or max(self.contexts) > self.model.max_position_embeddings:
            raise ValueError(
                f"contexts must be lengths between 2 and model.max_position_embeddings "
                f"({self.model.max_position_embeddings}), got {list(self.contexts)}"
            )
        if self.train.steps <= LOSS_STEPS:
            raise ValueError(f"train.steps must be > {LOSS_STEPS} (the final loss averages the last {LOSS_STEPS})")
        if BASELINE not in self.techniques:
            raise ValueError(f"techniques: add a '{BASELINE}' entry ({{}}: the train section as it is)")
        for name, overrides in self.techniques.items():
            technique_config(self.train, name, overrides)


def technique_config(train: train_config.TrainConfig, name: str, overrides) -> train_config.TrainConfig:
    """The train section with a technique's overrides, checked like the section itself (a ConfigError
    naming memory_study.techniques.<name>.<key>)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"techniques.{name} must be a mapping of train keys, got {overrides!r}")
    return train_config.with_keys(train, f"{STAGE}.techniques.{name}", overrides)


# ------------------------------------------------------------------------------------------ one run
def status_mb(key: str) -> float:
    """A VmRSS/VmHWM line of /proc/self/status, MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(spec: dict) -> dict:
    """Train one technique at one context in this process and measure it (see the module docstring)."""
    inp, context = Path(spec["input"]), spec["context"]
    train = train_config.TrainConfig(**spec["train"])
    cuda = torch.cuda.is_available()
    rt = runtime.Runtime(0, 1, 0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    if importlib.util.find_spec("bitsandbytes"):
        import bitsandbytes  # noqa: F401  loaded in every run, so its code is not counted as one technique's memory
    runtime.seed_everything(train.seed)
    model = pretrain.build_model(pretrain.ModelConfig(**spec["model"]), shards.read_meta(inp)).to(rt.device)
    tokens = shards.load_split(inp, "train")
    ctypes.CDLL(None).malloc_trim(0)
    if cuda:  # the weights are on the device before the baseline is read; paged states are not counted
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() / 2**20 if cuda else status_mb("VmRSS")
    with tempfile.TemporaryDirectory() as folder:
        result = loop.train(model, tokens, tokens, train, context, rt, Path(folder), NullTracker(), runtime.StopFlag())
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else status_mb("VmHWM")
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    state = result.optimizer_state_bytes / 2**20
    losses = result.history["loss"]
    return {
        "peak_mb": peak,
        "activation_mb": max(0.0, peak - before - grads - state),
        "optimizer_state_mb": state,
        "tokens_per_s": result.tokens_per_s,
        "tokens_per_cpu_s": result.tokens_per_cpu_s,
        "final_loss": sum(losses[-LOSS_STEPS:]) / LOSS_STEPS,
    }


def measure_quietly(spec: dict) -> dict:
    """measure(), its training loop's lines and progress bar kept out of the stage's log (the study prints
    one line per run)."""
    contract.die_with_parent()  # a killed study leaves no run behind
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return measure(spec)


@contextlib.contextmanager
def fresh_processes():
    """A pool whose every task runs in a process of its own, forked from a server process that imported
    this module and its libraries once (multiprocessing's forkserver): a run's peak memory is its own, as
    in a new interpreter (the fork's high-water mark starts at the server's resident size, which a new
    interpreter reaches with the same imports), without paying the imports for each run. The server
    starts with MALLOC_ENV and THREAD_ENV in its environment, as each run's process must. (Not this module
    itself: each process runs the stage's main module afresh, as multiprocessing does.)"""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "bitsandbytes", "stages.pretrain", "stages.common.loop"])
    saved = {k: os.environ.get(k) for k in (*MALLOC_ENV, *THREAD_ENV)}
    os.environ.update({**MALLOC_ENV, **THREAD_ENV})
    try:
        pool = ctx.Pool(1, maxtasksperchild=1)  # (starts the server, with this environment)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join()


def run_fresh(pool, spec: dict) -> dict:
    """measure() in a process of its own (see fresh_processes)."""
    from stages import memory_study  # (by its module name: run as __main__, this module is another object)

    try:
        return pool.apply(memory_study.measure_quietly, (spec,))
    except Exception as e:
        raise RuntimeError(f"memory_study: the run {spec['name']} at {spec['context']} failed: {e!r}") from e


# -------------------------------------------------------------------------------------- the rows
def only(cfg: Config, **train_keys) -> str | None:
    """The technique that changes exactly these train keys, if the study has one."""
    return next((n for n, o in cfg.techniques.items() if o == train_keys), None)


def result_rows(cfg: Config, table: dict) -> list[dict]:
    longest = max(cfg.contexts)
    base = table[BASELINE, longest]
    rows = []
    for optimizer in ("adamw8bit", "paged_adamw8bit"):
        name = only(cfg, optimizer=optimizer)
        if name:
            run = table[name, longest]
            rows += [
                {
                    "result": f"{name}: optimizer state / AdamW's",
                    "paper": "Dettmers et al. 2022 (8-bit optimizers): 2 bytes per parameter, not 8",
                    "relation": "<=",
                    "published": 0.30,
                    "ours": round(run["optimizer_state_mb"] / base["optimizer_state_mb"], 4),
                    "tolerance": 0.0,
                },
                {
                    "result": f"{name}: loss after {cfg.train.steps} steps / AdamW's",
                    "paper": "Dettmers et al. 2022: 8-bit optimizers match 32-bit training",
                    "published": 1.0,
                    "ours": round(run["final_loss"] / base["final_loss"], 4),
                    "tolerance": 0.02,
                },
            ]
    full = only(cfg, activation_checkpointing="full")
    if full:
        rows.append(
            {
                "result": f"full activation checkpointing: peak saved / activation memory at context {longest}",
                "paper": "Chen et al. 2016 (training with sublinear memory): activations recomputed, not kept",
                "relation": ">=",
                "published": 0.40,
                "ours": round(
                    (base["peak_mb"] - table[full, longest]["peak_mb"]) / max(base["activation_mb"], 1e-9), 4
                ),
                "tolerance": 0.0,
            }
        )
    selective = only(cfg, activation_checkpointing="selective")
    if full and selective:
        # On memory only: speed is one timing per technique, with no spread to judge it by on cores that other
        # work shares (measured/memory_study.json keeps it, as a figure, not as a reproduced result).
        none, lo, mid = base["peak_mb"], table[full, longest]["peak_mb"], table[selective, longest]["peak_mb"]
        rows.append(
            {
                "result": "selective activation checkpointing: peak memory between none (0) and full (1)",
                "paper": "Korthikanti et al. 2022 (selective recomputation)",
                "published": 0.5,
                "ours": round((none - mid) / (none - lo), 4) if none != lo else None,
                "tolerance": 0.5,
            }
        )
    return rows


# ------------------------------------------------------------------------------------------ outputs
def plot(cfg: Config, table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(cfg.techniques)
    fig, axes = plt.subplots(1, len(cfg.contexts), figsize=(5 * len(cfg.contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], cfg.contexts, strict=True):
        peaks = [table[n, context]["peak_mb"] for n in names]
        acts = [table[n, context]["activation_mb"] for n in names]
        ax.bar(names, peaks, label="peak")
        ax.bar(names, acts, label="of which activations")
        ax.set(title=f"context {context}", ylabel="MiB")
        ax.tick_params(axis="x", rotation=45)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


COMPUTED = ("optimizer_state_mb", "final_loss")  # functions of the inputs, params and code
MEASURED = ("peak_mb", "activation_mb", "tokens_per_s", "tokens_per_cpu_s")  # of this run on this machine


def write_outputs(tmp: Path, cfg: Config, table: dict) -> dict:
    """The computed part of the study (the output folder); returns figures.json's techniques."""
    base = {c: table[BASELINE, c] for c in cfg.contexts}
    with open(tmp / "table.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(("technique", "context", *COMPUTED, "loss_vs_baseline"))
        for (name, context), run in table.items():
            ratio = run["final_loss"] / base[context]["final_loss"]
            writer.writerow((name, context, *(round(run[f], 4) for f in COMPUTED), round(ratio, 4)))
    longest = max(cfg.contexts)
    metrics = {
        name: {
            "optimizer_state_mb": round(table[name, longest]["optimizer_state_mb"], 3),
            "final_loss": round(table[name, longest]["final_loss"], 4),
            "loss_vs_baseline": round(table[name, longest]["final_loss"] / base[longest]["final_loss"], 4),
        }
        for name in cfg.techniques
    }
    headline = {"optimizer_state_mb": {n: m["optimizer_state_mb"] for n, m in metrics.items()}}
    stage.write_metrics(tmp, {"context": longest, "techniques": metrics}, headline)
    computed, _ = split_rows(cfg, table)
    atomic.write_json(tmp / "results.json", computed)
    atomic.write_json(tmp / "meta.json", {"cpu": runtime.cpu_info(), **stage.code_record(STAGE)})
    return metrics


def split_rows(cfg: Config, table: dict) -> tuple[list[dict], list[dict]]:
    """The report rows: (those about the optimizers, computed; those about memory and speed, measured)."""
    rows = result_rows(cfg, table)
    computed = [r for r in rows if "activation checkpointing" not in r["result"]]
    return computed, [r for r in rows if r not in computed]


def write_measured(path: Path, output: Path, cfg: Config, table: dict) -> dict:
    """The measured part of the study: figures, rows and the plot (beside `path`, .png)."""
    longest = max(cfg.contexts)
    rounding = {"peak_mb": 1, "activation_mb": 1, "tokens_per_s": 1, "tokens_per_cpu_s": 1}
    techniques = {n: {k: round(table[n, longest][k], rounding[k]) for k in MEASURED} for n in cfg.techniques}
    rows = [{"technique": n, "context": c, **{k: round(run[k], 4) for k in MEASURED}} for (n, c), run in table.items()]
    _, measured_rows = split_rows(cfg, table)
    figures = {"context": longest, "techniques": techniques, "table": rows, "rows": measured_rows}
    stage.write_measured(path, output, figures)
    plot(cfg, table, path.with_suffix(".png"))
    return figures


def run(cfg: Config, inp: Path, output: Path, measured: Path, rt: runtime.Runtime) -> dict:
    table = {}
    with stage.tracked(STAGE, cfg, [inp], rt) as (tracker, _), fresh_processes() as pool:
        for context in cfg.contexts:
            for name, overrides in cfg.techniques.items():
                train = technique_config(cfg.train, name, overrides)
                spec = {"name": name, "input": str(inp), "context": context, "model": dataclasses.asdict(cfg.model)}
                table[name, context] = run_fresh(pool, {**spec, "train": dataclasses.asdict(train)})
                figures = ", ".join(f"{k} {v:,.2f}" for k, v in table[name, context].items())
                print(f"memory_study: {name} at context {context}: {figures}", flush=True)
                tracker.log_metrics({f"{name}.{k}": v for k, v in table[name, context].items()}, step=context)
        metrics = stage.publish(output, rt, lambda tmp: write_outputs(tmp, cfg, table))
        figures = write_measured(measured, output, cfg, table)
        tracker.log_artifact(output / "table.csv")
        tracker.log_artifact(measured)
        tracker.log_artifact(measured.with_suffix(".png"), "plots")
    return {"table": table, "metrics": metrics, "measured": figures}


def main(argv=None) -> dict:
    args, cfg = stage.setup(__doc__, STAGE, Config, {"input": "data/tokenize", "output": "data/memory_study"}, argv)
    inp, output = Path(args.input), Path(args.output)
    try:
        meta = shards.read_meta(inp)
        shards.check_split(inp, "train")
    except (FileNotFoundError, config.UserError) as e:
        raise config.UserError(f"{STAGE}: {e}") from None
    n = meta["splits"]["train"]["tokens"]
    if n < max(cfg.contexts) + 2:
        raise config.UserError(
            f"{STAGE}: the train split of {inp} has {n} tokens, fewer than one window of {max(cfg.contexts) + 1}; "
            f"lower {STAGE}.contexts"
        )

    def body(rt, stop):
        if rt.distributed:
            raise config.UserError(
                f"{STAGE}: measures one process at a time; run it with one process (PIPELINE_NPROC_PER_NODE=1)"
            )
        for name, overrides in cfg.techniques.items():  # as each run will see them
            technique_config(cfg.train, name, overrides).check_layout(f"{STAGE}.techniques.{name}", rt)
        return run(cfg, inp, output, Path(args.measured), rt)

    return stage.launch(STAGE, body)


if __name__ == "__main__":
    stage.entry(main)
