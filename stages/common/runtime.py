"""Distributed runtime: one set of plain functions for world size 1 and for torchrun.

Under torchrun (RANK/WORLD_SIZE in the environment) `init()` joins the process group: nccl when
CUDA is available, gloo otherwise. Without torchrun it is a single process with no group, and every
collective below is a no-op, so a stage runs the same code either way.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import random
import signal
import socket
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from stages.common import contract
from stages.common.precision import check_precision


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # The collectives of the modules that must not import torch themselves (stages.common.atomic): they
    # receive the runtime and call these.
    def broadcast(self, obj, src: int = 0):
        return broadcast_object(obj, src)

    def any(self, flag: bool) -> bool:
        return any_rank(flag)

    def barrier(self) -> None:
        barrier()


COLLECTIVE_TIMEOUT_S = 1800  # the process group's timeout when a stage sets none (train.collective_timeout_s)


def cores() -> int:
    """The cores this process may run on."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1


def init(timeout_s: float = COLLECTIVE_TIMEOUT_S, cpu_collectives: bool = False) -> Runtime:
    """Join the process group when launched by torchrun; pick the device; share the cores. With
    `cpu_collectives` on GPUs, collectives on CPU tensors get gloo beside nccl (FSDP2's CPU offload
    reduces and clips gradients that live on the host)."""
    if "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get(contract.LAUNCHED):
        contract.die_with_parent()  # torchrun's workers run in sessions of their own; they go when it goes
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Processes on one node share its cores; oversubscription slows every rank down.
        if "OMP_NUM_THREADS" not in os.environ or local_world_size > 1:
            torch.set_num_threads(max(1, cores() // local_world_size))
    if world_size > 1 and not dist.is_initialized():
        backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Runtime(rank, world_size, local_rank, local_world_size, device)


def share_cores(rt: Runtime, busy: int) -> None:
    """On CPUs, when only ranks 0..busy-1 have work (fewer items than processes), the node's cores go to
    its busy ranks: the others only wait."""
    if rt.device.type != "cpu" or busy >= rt.world_size:
        return
    first = rt.rank - rt.local_rank  # this node's first rank
    busy_here = max(0, min(busy, first + rt.local_world_size) - first)
    if rt.rank < busy and busy_here:
        torch.set_num_threads(max(1, cores() // busy_here))


def preflight(rt: Runtime, timeout_s: float | None = None) -> None:
    """Before a stage reads any data: the world is the size its launcher started (PIPELINE_WORLD_SIZE:
    processes per node x nodes), and every process joins one all-reduce within `timeout_s` seconds
    (PIPELINE_PREFLIGHT_TIMEOUT, default 120). A process still waiting then prints why and exits
    (contract.PREFLIGHT_EXIT): a stage never hangs on a peer that is missing or cannot be reached."""
    import threading

    from stages.common import config

    expected = os.environ.get(contract.WORLD_SIZE)
    if expected and int(expected) != rt.world_size:
        raise config.UserError(
            f"preflight: {rt.world_size} processes joined, the stage's resources start {expected} (nproc_per_node x "
            f"nodes in pipelines/stages.yaml, or PIPELINE_NPROC_PER_NODE); run it through python -m pipelines.launch, "
            f"or start as many processes as they say"
        )
    if not rt.distributed:
        return
    timeout_s = float(os.environ.get(contract.PREFLIGHT_TIMEOUT, 120)) if timeout_s is None else timeout_s
    joined = threading.Event()

    def give_up():
        if not joined.is_set():
            print(
                f"preflight: rank {rt.rank} of {rt.world_size} waited {timeout_s:.0f} s for the others to join one "
                f"all-reduce: a process or node is missing, or cannot reach this one (the rendezvous host, a "
                f"firewall, the interface: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); raise PIPELINE_PREFLIGHT_TIMEOUT "
                f"if start-up is slow",
                file=sys.stderr,
                flush=True,
            )
            os._exit(contract.PREFLIGHT_EXIT)  # (the all-reduce blocks this thread's peer: no clean way out)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        ones = torch.ones(1, device=rt.device)
        dist.all_reduce(ones)
        counted = int(ones.item())  # (waits for the result: nccl's all_reduce returns once queued)
        joined.set()
    finally:
        timer.cancel()
    if counted != rt.world_size:
        raise config.UserError(f"preflight: the all-reduce counted {counted} processes of {rt.world_size}")
    hosts: dict[str, list[int]] = {}
    for rank, host in enumerate(gather_objects(socket.gethostname())):
        hosts.setdefault(host, []).append(rank)
    where = ", ".join(f"{host} (ranks {','.join(map(str, ranks))})" for host, ranks in hosts.items())
    print0(f"preflight: {rt.world_size} processes joined on {len(hosts)} host(s): {where}", rt=rt)


def teardown() -> None:
    """Leave the process group. Drop wrapped (DDP/FSDP) models first: one that outlives its group can
    deadlock gloo's shutdown."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Same seed on every rank; data order and dropout masks differ by rank through the data, not the seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# CPU flags that change which kernels torch, oneDNN and bitsandbytes pick (and so the last bits of results).
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def compute_dtype(device: torch.device, precision: str = "auto") -> torch.dtype:
    """The dtype a stage computes in (bf16 or fp16: under autocast, fp32 master weights where it trains).
    auto: bf16 on GPUs that support it, fp32 on CPUs, so that results recorded on one CPU hold on
    another (bf16 is also ~20x slower than fp32 on CPUs without AVX512-BF16/AMX). fp32, bf16 and fp16
    force one on any device: bf16 on a CPU with AVX512-BF16 or AMX runs ~1.5-2.5x faster than fp32."""
    check_precision(precision)
    if precision == "fp32":
        return torch.float32
    if precision == "fp16":  # for GPUs without bf16 (before Ampere); training adds a gradient scaler
        return torch.float16
    if precision == "bf16" or (device.type == "cuda" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float32


@functools.cache
def _cpuinfo() -> tuple[str, frozenset]:
    """(model name, feature flags) of the first CPU in /proc/cpuinfo; ("unknown", {}) elsewhere."""
    model, flags = "unknown", frozenset()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return model, flags


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpuinfo()[1])


def cpu_info() -> dict:
    """The CPU a run's kernels were chosen for: torch's vector capability (DEFAULT, AVX2, AVX512, ...),
    the model name and the flags in KERNEL_FLAGS it has. Recorded with results that depend on kernels."""
    model, flags = _cpuinfo()
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": model,
        "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
    }


def warn_if_emulated_bf16(device: torch.device, dtype: torch.dtype, rt: Runtime | None = None) -> None:
    """bf16 on a CPU without bf16 instructions is emulated: correct, but ~20x slower than fp32."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        print0(
            "warning: precision bf16 on a CPU without AVX512-BF16 or AMX: bf16 is emulated there, about 20x "
            "slower than fp32; set precision: auto (fp32 on CPUs)",
            rt=rt,
        )


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from `src` to every rank; returns it on all ranks."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's object, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def print0(*args, rt: Runtime | None = None, **kwargs) -> None:
    if rt is None or rt.is_main:
        print(*args, **kwargs, flush=True)


def progress(iterable=None, rt: Runtime | None = None, **kwargs):
    """A tqdm bar on rank 0 only (on stderr, refreshed at most every 2 s); silent on other ranks."""
    from tqdm.auto import tqdm

    disable = rt is not None and not rt.is_main
    return tqdm(iterable, disable=disable, mininterval=2.0, file=sys.stderr, dynamic_ncols=True, **kwargs)


class Stopped(Exception):
    """A stop signal ended a run early, after saving what resuming needs; its process exits with 143."""


class StopFlag:
    """Set by SIGTERM (preemption, SLURM time limits) or SIGINT (Ctrl-C); long loops poll it, save a
    checkpoint and exit."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: str | None = None  # the name of the signal that set it

    def __bool__(self) -> bool:
        return self.requested


def handle_signals() -> StopFlag:
    """SIGTERM and SIGINT set the returned flag instead of killing the process. Ctrl-C signals the
    terminal's foreground process group; torchrun passes the signal it got on to its workers, so a
    training stage hears Ctrl-C as SIGINT and must save like on SIGTERM."""
    flag = StopFlag()

    def _on_signal(signum, frame):
        flag.requested = True
        flag.signal = signal.Signals(signum).name
        print(
            f"[rank {os.environ.get('RANK', 0)}] {flag.signal} received: finishing the step, then saving",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return flag


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on some rank (so all ranks stop at the same step)."""
    return any_ranks(flag)[0]


def any_ranks(*flags: bool) -> tuple[bool, ...]:
    """`any_rank` of several flags in one all-reduce (the training loop's stop signal and its checkpoint
    writes in flight, asked once per step)."""
    if not dist.is_initialized():
        return tuple(bool(f) for f in flags)
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())
