"""Checkpoint stall: how long the training loop waits for a checkpoint, synchronous vs asynchronous.

    python bench/checkpoint_stall.py [--steps 7] [--every 2] [--repeats 2] [--batch 4] [--context 256] [--dir DIR]

The training loop (stages.common.loop.train, one process on all cores, fp32 AdamW) on the 63M-parameter
Llama of the memory-63m preset (memory_study.model there: 8 layers x 768, MLP 2,048, vocabulary 4,096;
by default memory_study's batch and shortest context: 4 x 256), random tokens, a checkpoint every
`--every` steps into a temporary folder (in `--dir`), with `async_checkpoint: false` and `true`; the two
runs alternate, `--repeats` times, and each figure keeps its best. Printed per mode:
  stall per save        the time the loop spent in the checkpointer per save: the whole save for a
                        synchronous one; for an asynchronous one, the copy of the state to host memory
                        where it starts plus its publishing (extra.pt, manifest, rename) a step or more
                        later, and any wait for a write still running; as a fraction of a step (the median
                        of the steps that ran while no checkpoint was written, both modes' runs)
  save time per GB      a save from its start until its files are complete, per GB of the published
                        checkpoint folder (synchronous: the stall; asynchronous: behind the steps)
  run time              of the whole run, and its difference from the synchronous run's per save, over
                        the median step: what the asynchronous mode saves in all
  overlapped steps      asynchronous: the median step that ran while a checkpoint was written, over the
                        median step: what the writing thread (DCP's torch.save of every tensor) takes from
                        training when it shares the cores; nothing on a GPU, where the host cores are free
Both modes train the same losses (checked). Goal: asynchronous stall <= 0.10 of a step.
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

from pipelines import preset  # noqa: E402
from stages import pretrain  # noqa: E402
from stages.common import checkpointer, config, loop, runtime, train_config  # noqa: E402
from stages.common.tracking.tracker import NullTracker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def study_params() -> dict:
    """memory_study of params.yaml with the memory-63m preset over it."""
    params = config.merge(config.read_yaml(ROOT / "params.yaml"), config.read_yaml(preset.preset_path("memory-63m")))
    return params["memory_study"]


def model_config() -> pretrain.ModelConfig:
    return pretrain.ModelConfig(**study_params()["model"])


def make_model(vocab: int):
    torch.manual_seed(0)
    return pretrain.build_model(
        model_config(), {"vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    )


class Clock:
    """Times the checkpointer's calls from the loop (the outermost only: a save publishes the one before
    it, and a synchronous save publishes itself), each save from its start until its files are written,
    and each step: the time from one step's checkpointer call to the next, and whether a write ran then."""

    def __init__(self):
        self.blocked, self.writes, self.bytes, self.depth = 0.0, [], [], 0
        self.steps: list[tuple[float, bool]] = []  # (seconds, a checkpoint was being written)
        self.last: tuple[float, bool] | None = None  # (when the previous step's checkpointer call returned, writing)

    def install(self):
        real = {name: getattr(checkpointer.Checkpointer, name) for name in ("step_done", "finish", "save")}

        def outermost(name):
            def call(saver, *args, **kwargs):
                self.depth += 1
                t0 = time.perf_counter()
                try:
                    return real[name](saver, *args, **kwargs)
                finally:
                    self.depth -= 1
                    if self.depth == 0:
                        self.blocked += time.perf_counter() - t0

            return call

        def step_done(saver, *args, **kwargs):
            if self.last is not None:
                self.steps.append((time.perf_counter() - self.last[0], self.last[1]))
            try:
                return outermost("step_done")(saver, *args, **kwargs)
            finally:
                self.last = (time.perf_counter(), saver.writing())

        def save(saver, *args, **kwargs):
            t0 = time.perf_counter()
            final = real["save"](saver, *args, **kwargs)
            if saver.pending is None:  # synchronous: written and published
                self.writes.append(time.perf_counter() - t0)
            else:
                saver.pending.write.add_done_callback(lambda _: self.writes.append(time.perf_counter() - t0))
            return final

        def finish(saver, *args, **kwargs):
            published = outermost("finish")(saver, *args, **kwargs)
            if published is not None:
                self.bytes.append(sum(f.stat().st_size for f in published.rglob("*") if f.is_file()))
            return published

        checkpointer.Checkpointer.step_done, checkpointer.Checkpointer.finish, checkpointer.Checkpointer.save = (
            step_done,
            finish,
            save,
        )
        return lambda: [setattr(checkpointer.Checkpointer, name, fn) for name, fn in real.items()]


def run(tokens: np.ndarray, vocab: int, args, asynchronous: bool) -> dict:
    cfg = train_config.build(
        steps=args.steps,
        batch_size=args.batch,
        micro_batch_size=args.batch,
        lr=1e-3,
        min_lr=1e-4,
        eval_batches=0,
        log_every=10**9,
        checkpoint_every=args.every,
        async_checkpoint=asynchronous,
    )
    rt = runtime.Runtime(0, 1, 0, 1, torch.device("cpu"))
    clock = Clock()
    uninstall = clock.install()
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            model = make_model(vocab)
            t0 = time.perf_counter()
            out = loop.train(model, tokens, tokens, cfg, args.context, rt, Path(tmp), NullTracker(), runtime.StopFlag())
            wall = time.perf_counter() - t0
    finally:
        uninstall()
    saves = len(clock.bytes)
    return {
        "wall": wall,
        "saves": saves,
        "stall": clock.blocked / max(saves, 1),
        "per_gb": sum(clock.writes) / max(sum(clock.bytes) / 1e9, 1e-9),
        "gb": sum(clock.bytes) / max(saves, 1) / 1e9,
        "clean": [s for s, writing in clock.steps if not writing],
        "overlapped": [s for s, writing in clock.steps if writing],
        "loss": out.history["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--every", type=int, default=2, help="a checkpoint every N steps (before the last)")
    parser.add_argument("--repeats", type=int, default=2)
    study = study_params()
    parser.add_argument("--batch", type=int, default=study["train"]["batch_size"], help="sequences per step")
    parser.add_argument("--context", type=int, default=min(study["contexts"]))
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    vocab = config.read_yaml(ROOT / "params.yaml")["tokenize"]["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, size=2_000_000).astype(np.uint16)
    runs = {"synchronous": [], "asynchronous": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(run(tokens, vocab, args, asynchronous=name == "asynchronous"))
    clean = [s for rs in runs.values() for r in rs for s in r["clean"]]
    step = float(np.median(clean))
    first = runs["synchronous"][0]
    params = sum(p.numel() for p in make_model(vocab).parameters())
    print(
        f"model: {params / 1e6:.1f}M parameters (memory-63m), batch {args.batch}x{args.context}, {args.steps} steps, "
        f"a checkpoint every {args.every} ({first['saves']} saves of {first['gb']:.2f} GB), best of {args.repeats}, "
        f"{threads} threads, fp32 AdamW; checkpoints in {args.dir or tempfile.gettempdir()}"
    )
    print(f"median step while no checkpoint was written: {step:.2f} s ({len(clean)} steps)")
    stall = {}
    for name, rs in runs.items():
        stall[name] = min(r["stall"] for r in rs)
        per_gb = min(r["per_gb"] for r in rs)
        fraction = stall[name] / step
        print(f"{name:<13} stall per save {stall[name]:.3f} s = {fraction:.3f} of a step; save {per_gb:.2f} s/GB")
    wall = {name: min(r["wall"] for r in rs) for name, rs in runs.items()}
    saved = (wall["synchronous"] - wall["asynchronous"]) / max(first["saves"], 1)
    print(
        f"run time: synchronous {wall['synchronous']:.1f} s, asynchronous {wall['asynchronous']:.1f} s: "
        f"{saved:.2f} s = {saved / step:.2f} of a step less per save"
    )
    overlapped = [s for r in runs["asynchronous"] for s in r["overlapped"]]
    if overlapped:
        print(
            f"asynchronous: steps that ran beside a write: median {np.median(overlapped):.2f} s = "
            f"{np.median(overlapped) / step:.2f}x the median step ({len(overlapped)} steps)"
        )
    print(f"asynchronous stall / synchronous stall: {stall['asynchronous'] / max(stall['synchronous'], 1e-9):.3f}")
    print(f"asynchronous stall per save / median step: {stall['asynchronous'] / step:.3f}  (goal <= 0.10)")
    losses = [r["loss"] for rs in runs.values() for r in rs]
    same = all(loss == losses[0] for loss in losses)
    print(f"losses of every run: {'identical' if same else 'DIFFER'}")
    if not same:
        raise SystemExit("the synchronous and asynchronous runs trained other losses")


if __name__ == "__main__":
    main()
