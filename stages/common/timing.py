"""Where a stage process's wall time goes, by phase, for the time budget `make run` prints
(pipelines.timebudget).

A process's wall time runs from its creation to its exit. Before the stage's body (stage.launch) it is
start-up: the interpreter, imports, the command line, the input checks, the process group; after the
body, the exit. Inside the body, time spent in a phase is charged to it:

    data         reading and batching the inputs (a training loop's windows)
    evaluation   validation during training, and an evaluation stage's scoring
    checkpoint   saving, resuming and publishing checkpoints (the training thread's share)
    tracking     MLflow: opening and ending the run, records, artifacts, registered models
    outputs      writing the stage's output folder
    compute      the rest of the body: the work the stage exists for

Phases nest (a batch read during validation is data); time goes to the innermost one. Only the main
thread is timed: what runs beside it in other threads (a checkpoint written in the background, the
tracking sender) costs the wall time it holds the main thread up, no more. Each rank keeps its own
clock; under pipelines.launch (contract.TIME_FILE set) a rank that ends well writes it to
`<TIME_FILE>.rank<RANK>.json` for the launcher, which keeps rank 0's. Only the standard library: the
launcher and the table read these records without torch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from pathlib import Path

from stages.common import contract

PHASES = ("data", "evaluation", "checkpoint", "tracking", "outputs")
_spent = dict.fromkeys(PHASES, 0.0)
_stack: list[list] = []  # [phase, started (perf_counter)] of the phases entered, innermost last
_body: list[float] = []  # wall clock at the body's start, then at its end


def process_created(pid: int | None = None) -> float:
    """When process `pid` (this one by default) was created, as time.time(), from /proc (10 ms
    resolution); now where /proc does not say."""
    ticks = contract.process_start(os.getpid() if pid is None else pid)
    try:
        stat = Path("/proc/stat").read_text().splitlines()
        boot = next(float(line.split()[1]) for line in stat if line.startswith("btime "))
        return boot + float(ticks) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, TypeError, ValueError):
        return time.time()


def _timed_here() -> bool:
    return threading.current_thread() is threading.main_thread()


class phase:
    """`with timing.phase("evaluation"):` charges the block's wall time to `name` (nested phases: to the
    innermost); `@timing.phase("data")` does so for every call of a function."""

    def __init__(self, name: str):
        if name not in PHASES:
            raise ValueError(f"phase {name!r}: one of {PHASES}")
        self.name = name

    def __enter__(self):
        if _timed_here():
            now = time.perf_counter()
            if _stack:
                outer = _stack[-1]
                _spent[outer[0]] += now - outer[1]
            _stack.append([self.name, now])
        return self

    def __exit__(self, *exc):
        if _timed_here() and _stack:
            now = time.perf_counter()
            name, started = _stack.pop()
            _spent[name] += now - started
            if _stack:
                _stack[-1][1] = now  # the outer phase's clock runs again from here
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with phase(self.name):
                return fn(*args, **kwargs)

        return timed


def body_started() -> None:
    _body[:] = [time.time()]
    for name in PHASES:
        _spent[name] = 0.0


def body_ended() -> None:
    if len(_body) == 1:
        _body.append(time.time())


def record() -> dict | None:
    """This process's times so far (the body ended), or None when no body ran."""
    if len(_body) != 2:
        return None
    phases = {name: round(_spent[name], 3) for name in PHASES}
    return {
        "created": round(process_created(), 3),
        "body": [round(t, 3) for t in _body],
        "ended": round(time.time(), 3),
        "phases": phases,
        "compute": round(max(0.0, _body[1] - _body[0] - sum(phases.values())), 3),
    }


def write_record() -> None:
    """At a good exit under the launcher: this rank's record where the launcher reads it."""
    where = os.environ.get(contract.TIME_FILE)
    times = record()
    if where and times is not None:
        path = Path(f"{where}.rank{os.environ.get('RANK', '0')}.json")
        try:
            path.write_text(json.dumps(times))
        except OSError:  # (a measurement: the stage's result stands without it)
            pass


@contextlib.contextmanager
def entered_in(name: str, manager):
    """`manager` entered and exited within phase `name`; the block between them is not."""
    with phase(name):
        value = manager.__enter__()
    try:
        yield value
    except BaseException as error:
        with phase(name):
            if not manager.__exit__(type(error), error, error.__traceback__):
                raise
    else:
        with phase(name):
            manager.__exit__(None, None, None)
