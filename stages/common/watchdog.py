"""The hang watchdog: a training or evaluation run whose steps stop making progress ends in seconds, not at
a timeout.

A rank that stops making progress (a peer stuck in I/O, a deadlocked collective, a lost GPU) leaves the
others blocked in their next collective until the process group's timeout (`train.collective_timeout_s`,
1800 s by default). Every rank of a training run keeps a `Watchdog`: the loop calls `beat()` after each
train step, each validation batch and each checkpoint save (eval_perplexity: after each batch, with its
own `hang_timeout_s`). When no beat came for

    max(train.hang_timeout_s, HANG_STEP_MULTIPLE x the median train step of this run)

seconds (before the first step: FIRST_STEP_FACTOR x train.hang_timeout_s, for loading and compiling),
its thread reports this rank through the process group's key-value store (its Python stacks, its host,
the steps it finished, and whether it waits inside a collective). Rank 0 collects every rank's report,
prints them into the stage log in rank order, names the stalled rank(s) and host(s): the ranks that do
not wait in a collective, and the ranks that sent no report at all (a process frozen whole, or one its
host lost), by where they were last seen: every rank's watchdog thread keeps its host and place in the
store as the run goes. When every rank reports and waits in a collective, the collectives themselves do
not match, and all are named. It then marks the stage's MLflow run FAILED with the cause tagged
(`failure`: hang) and ends the stage with one line and exit code HANG_EXIT; the checkpoints already
written stay, so a re-run resumes from the last intact one. A rank whose reports cannot reach rank 0
prints its own and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback

from stages.common import contract, runtime

HANG_EXIT = contract.HANG_EXIT  # the stage ended because a rank made no progress
HANG_STEP_MULTIPLE = 10  # a step that takes this many median steps is a hang ...
FIRST_STEP_FACTOR = 3  # ... and before the first step: this many times the floor (loading, compiling)
COLLECT_S = 15.0  # how long rank 0 waits for the other ranks' reports

# Frames that mean "this rank waits for the others": the collectives' Python side, and the autograd
# engine, inside which DDP's gradient all-reduce runs.
WAITING_FILES = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")


def hang_limit(floor_s: float, steps_s: list[float]) -> float:
    """Seconds without a beat that end the run: the floor, or HANG_STEP_MULTIPLE median steps when that is
    longer; before any step, FIRST_STEP_FACTOR times the floor."""
    if not steps_s:
        return FIRST_STEP_FACTOR * floor_s
    return max(floor_s, HANG_STEP_MULTIPLE * statistics.median(steps_s))


def waits_in_collective(frames: list[traceback.FrameSummary]) -> bool:
    return any(any(part in f.filename.replace(os.sep, "/") for part in WAITING_FILES) for f in frames)


def stack_report(main_ident: int) -> tuple[str, bool]:
    """Every thread's Python stack of this process (the main thread first), and whether the main thread
    waits inside a collective."""
    frames = sys._current_frames()
    threads = {t.ident: t.name for t in threading.enumerate()}
    lines, waiting = [], False
    for ident in sorted(frames, key=lambda i: i != main_ident):
        if ident == threading.get_ident():
            continue  # the watchdog's own thread
        summary = traceback.extract_stack(frames[ident])
        if ident == main_ident:
            waiting = waits_in_collective(summary)
        lines.append(f"  thread {threads.get(ident, ident)} (most recent call last):")
        lines.extend("    " + line for line in "".join(traceback.format_list(summary)).rstrip().splitlines())
    return "\n".join(lines), waiting


def default_store():
    """The process group's key-value store (what torchrun's rendezvous made), or None."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: each rank reports alone
        pass
    return None


@contextlib.contextmanager
def watching(rt: runtime.Runtime, floor_s: float, on_hang=None):
    """A Watchdog of this rank (the process group's store shared) while the block runs."""
    watch = Watchdog(rt.rank, rt.world_size, floor_s, on_hang, default_store())
    try:
        yield watch
    finally:
        watch.close()


class Watchdog:
    """Watches one rank's progress (see the module's doc). `on_hang(cause)` runs on rank 0 before the
    process exits (the stage marks its MLflow run there); the last line and exit code are left for the
    launcher (contract.leave_last_line)."""

    def __init__(self, rank: int, world_size: int, floor_s: float, on_hang=None, store=None):
        self.rank, self.world_size, self.floor_s = rank, world_size, float(floor_s)
        self.on_hang, self.store = on_hang, store
        self.steps_s: list[float] = []
        self.done, self.where = 0, "before the first step"
        self.last = time.monotonic()
        self.main_ident = threading.get_ident()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self.thread.start()

    def beat(self, done: int | None = None, where: str = "", step_s: float | None = None) -> None:
        """Progress: `done` train steps finished (`step_s`: the step just finished took this long)."""
        if step_s is not None:
            self.steps_s.append(step_s)
        if done is not None:
            self.done = done
        self.where = where or f"after step {self.done}"
        self.last = time.monotonic()

    def limit(self) -> float:
        return hang_limit(self.floor_s, self.steps_s[1:] or self.steps_s)

    def close(self) -> None:
        self.closed.set()

    def _watch(self) -> None:
        seen = self._publish(None)
        while not self.closed.wait(min(1.0, self.floor_s / 10)):
            seen = self._publish(seen)
            idle, limit = time.monotonic() - self.last, self.limit()
            if idle > limit:
                self._fire(idle, limit)
                return

    def _publish(self, seen: tuple | None) -> tuple | None:
        """Keep this rank's host and place in the store when they changed since `seen` (what was kept last),
        from this thread, off the training loop: should the whole process freeze, its report never comes,
        and rank 0 names it by what is kept. Returns what is kept now (None: nothing, or the store failed)."""
        now = (self.done, self.where)
        if self.store is None or now == seen:
            return seen
        state = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "done": now[0], "where": now[1]}
        try:
            self.store.set(f"watchdog/seen/{self.rank}", json.dumps(state))
        except Exception:  # noqa: BLE001 - the store is gone: this rank reports alone when it fires
            return None
        return now

    def _fire(self, idle: float, limit: float) -> None:
        stacks, waiting = stack_report(self.main_ident)
        report = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "done": self.done,
            "where": self.where,
            "idle_s": round(idle, 1),
            "waiting": waiting,
            "stacks": stacks,
        }
        store = self.store
        try:
            if store is not None:
                store.set(f"watchdog/{self.rank}", json.dumps(report))
        except Exception:  # noqa: BLE001 - the store is gone: report alone
            store = None
        if self.rank != 0 and store is not None and self._wait_for_rank0(store):
            os._exit(HANG_EXIT)  # rank 0 printed this rank's report with the others'
        out, message = self.account(store, report, idle, limit)
        sys.stderr.write(out + "\n")
        sys.stderr.flush()
        if self.on_hang is not None and self.rank == 0:
            try:
                self.on_hang(message)
            except Exception as e:  # noqa: BLE001 - tracking must not keep a hung stage alive
                print(f"hang watchdog: could not mark the MLflow run: {e}", file=sys.stderr, flush=True)
        contract.leave_last_line(HANG_EXIT, f"error: {message}")
        if self.rank == 0 and store is not None:
            try:
                store.set("watchdog/reported", "1")
            except Exception:  # noqa: BLE001 - the others then report alone
                pass
        os._exit(HANG_EXIT)  # the main thread is stuck: no clean way out

    def account(self, store, report: dict, idle: float, limit: float) -> tuple[str, str]:
        """(what this rank prints: every report collected, in rank order, and last the error line; the
        line's message). Rank 0 collects the others' reports from `store`; the ranks whose report does not
        come are named by where they were last seen."""
        reports = self._collect(store) if self.rank == 0 else {}
        reports.setdefault(self.rank, report)
        missing = sorted(set(range(self.world_size)) - set(reports)) if self.rank == 0 else []
        message = self.message(reports, limit, self._last_seen(store, missing))
        out = [f"\nhang watchdog: rank {self.rank} made no progress for {idle:.0f} s (limit {limit:.0f} s)"]
        for rank in sorted(reports):
            r = reports[rank]
            state = "waits in a collective" if r["waiting"] else "does not wait in a collective"
            out.append(f"[rank {rank}] {r['host']} pid {r['pid']}, {r['where']}, {state}; Python stacks:")
            out.append(r["stacks"])
        if missing:
            out.append(f"(no report from rank(s) {', '.join(map(str, missing))} within {COLLECT_S:.0f} s)")
        out.append(f"error: {message}")
        return "\n".join(out), message

    @staticmethod
    def _wait_for_rank0(store) -> bool:
        """Whether rank 0 printed the reports (within twice its collection time)."""
        deadline = time.monotonic() + 2 * COLLECT_S
        while time.monotonic() < deadline:
            try:
                if store.check(["watchdog/reported"]):
                    return True
            except Exception:  # noqa: BLE001 - the store went with rank 0
                return False
            time.sleep(0.2)
        return False

    def _collect(self, store) -> dict:
        reports = {}
        if store is None:
            return reports
        deadline = time.monotonic() + COLLECT_S
        while len(reports) < self.world_size and time.monotonic() < deadline:
            for rank in range(self.world_size):
                if rank in reports:
                    continue
                try:
                    if store.check([f"watchdog/{rank}"]):
                        reports[rank] = json.loads(store.get(f"watchdog/{rank}"))
                except Exception:  # noqa: BLE001 - a store that stopped answering: report what came
                    return reports
            time.sleep(0.2)
        return reports

    @staticmethod
    def _last_seen(store, ranks: list[int]) -> dict:
        """{rank: its host and place as its watchdog last kept them ({} when it kept none)} of `ranks`."""
        seen = {}
        for rank in ranks:
            seen[rank] = {}
            try:
                if store is not None and store.check([f"watchdog/seen/{rank}"]):
                    seen[rank] = json.loads(store.get(f"watchdog/seen/{rank}"))
            except Exception:  # noqa: BLE001 - a store that stopped answering: name the rank alone
                pass
        return seen

    def message(self, reports: dict, limit: float, silent: dict | None = None) -> str:
        """One line: who stalled, where, and what is kept. The stalled: the ranks that report but do not
        wait in a collective, and the `silent` ones ({rank: where it was last seen}), which sent no report."""
        stalled = [
            f"rank {r['rank']} on {r['host']} ({r['where']})" for _, r in sorted(reports.items()) if not r["waiting"]
        ]
        for rank, seen in sorted((silent or {}).items()):
            if seen:
                stalled.append(f"rank {rank} on {seen['host']} (last seen {seen['where']}; it sent no report)")
            else:
                stalled.append(f"rank {rank} (it sent no report, and kept no place)")
        if stalled:
            cause = f"{'; '.join(stalled)} made no progress for {limit:.0f} s"
        else:
            who = ", ".join(f"rank {r['rank']} on {r['host']}" for _, r in sorted(reports.items()))
            cause = f"every rank reporting ({who}) waits in a collective for {limit:.0f} s: they do not match"
        return (
            f"hang: {cause} (train.hang_timeout_s {self.floor_s:g} s, or {HANG_STEP_MULTIPLE} median steps); "
            f"the stacks of {'the ranks that reported' if silent else 'every rank'} are above; a re-run resumes "
            "from the last intact checkpoint"
        )
