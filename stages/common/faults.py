"""Faults that tests inject into a stage, behind one switch: the checkpoint and loop code ask here and
read nothing from the environment themselves.

A test switches a fault on in a stage it starts as a process through the environment variable of that
point (read once, when this module is imported), or in its own process with `switch_on`:

    PIPELINE_FAULT_IN_CHECKPOINT=<step>    SIGKILL while the checkpoint of <step> is written, before it
                                           is published (checkpointer.Checkpointer.finish)
    PIPELINE_FAULT_SAVE_IN_FLIGHT=<step>   SIGKILL at the first step after <step> whose asynchronous
                                           checkpoint is still unpublished (checkpointer.Checkpointer.step_done)
    PIPELINE_FAULT_STALL=<rank>:<step>[:frozen]
                                           that rank stops for good before that step (0-based; an
                                           evaluation's batch in eval_perplexity), `frozen`: the whole
                                           process, its watchdog thread too (`injected_stall`)
"""

from __future__ import annotations

import os
import signal
import time

VARIABLES = {
    "in_checkpoint": "PIPELINE_FAULT_IN_CHECKPOINT",
    "save_in_flight": "PIPELINE_FAULT_SAVE_IN_FLIGHT",
    "stall": "PIPELINE_FAULT_STALL",
}
# (the only state here: which points are on, and at what)
_ON: dict[str, str] = {point: os.environ[name] for point, name in VARIABLES.items() if os.environ.get(name)}
FREEZE_AFTER_S = 2.0  # injected_stall's wait before it freezes: longer than a watchdog tick (at most 1 s)


def switch_on(point: str, at: str | int) -> None:
    """Switch a fault on in this process (a test's own)."""
    if point not in VARIABLES:
        raise KeyError(f"no fault point {point!r}; the points are {', '.join(VARIABLES)}")
    _ON[point] = str(at)


def switch_off(point: str) -> None:
    _ON.pop(point, None)


def due(point: str, at: int) -> bool:
    """Whether the fault at `point` is switched on for `at` (a step)."""
    return _ON.get(point) == str(at)


def kill_if_due(point: str, at: int) -> None:
    """SIGKILL this process when the fault at `point` is switched on for `at`: no handler runs, nothing is
    cleaned up, as when a machine is lost."""
    if due(point, at):
        os.kill(os.getpid(), signal.SIGKILL)


def injected_stall(rank: int, index: int) -> None:
    """The `stall` fault: stop this rank before step `index`, for good, its watchdog still running; with
    `frozen`, freeze the whole process there instead, as native code that never returns and holds the
    interpreter: its watchdog thread can no longer report, and rank 0 names it by where it was last seen
    (it freezes FREEZE_AFTER_S after stopping, past a tick of its watchdog, so that place is this step).
    A signal (torchrun's, at the end) ends it."""
    fault = _ON.get("stall", "").split(":")
    if fault[:2] != [str(rank), str(index)]:
        return
    if fault[2:] == ["frozen"]:
        import ctypes

        time.sleep(FREEZE_AFTER_S)
        ctypes.PyDLL(None).pause()  # (a PyDLL call keeps the interpreter's lock: no other thread runs)
        os._exit(143)
    while True:
        time.sleep(3600)
