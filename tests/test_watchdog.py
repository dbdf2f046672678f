"""The hang watchdog's account of a hang, over a key-value store in memory (runs that hang for real, under
torchrun: tests/test_pretrain.py and tests/test_eval_perplexity.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import time

from torch.distributed import HashStore

from stages.common import watchdog


def kept_place(store, rank: int) -> str:
    key = f"watchdog/seen/{rank}"
    return json.loads(store.get(key))["where"] if store.check([key]) else ""


def report(rank: int, waiting: bool) -> dict:
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "done": 4,
        "where": "in step 5",
        "idle_s": 9.0,
        "waiting": waiting,
        "stacks": "  thread MainThread (most recent call last):",
    }


def test_a_rank_that_sends_no_report_is_named_last_with_its_host_and_place(monkeypatch):
    """Rank 1 of 2 froze whole after its watchdog kept its place: no report of it comes. The last line
    rank 0 prints names rank 1, its host and where it was last seen, not rank 0 waiting in its collective;
    with every rank reporting, the ranks that do not wait are named, and when all wait, all are."""
    monkeypatch.setattr(watchdog, "COLLECT_S", 0.5)
    store = HashStore()
    frozen = watchdog.Watchdog(1, 2, floor_s=2, store=store)  # (it keeps its place every 0.2 s)
    frozen.beat(4, "in step 5, after checkpoint step-4")
    deadline = time.monotonic() + 30
    while kept_place(store, 1) != "in step 5, after checkpoint step-4" and time.monotonic() < deadline:
        time.sleep(0.05)
    frozen.close()  # (before its limit, 6 s: it would end this process)
    waiting = watchdog.Watchdog(0, 2, floor_s=8, store=store)
    waiting.close()
    store.set("watchdog/0", json.dumps(report(0, waiting=True)))  # (as rank 0 keeps its own, then collects)
    host = re.escape(socket.gethostname())

    out, message = waiting.account(store, report(0, waiting=True), idle=9.0, limit=8.0)
    last = out.splitlines()[-1]
    assert last == f"error: {message}" and "(no report from rank(s) 1 within" in out, out
    named = rf"error: hang: rank 1 on {host} \(last seen in step 5, after checkpoint step-4; it sent no report\)"
    assert re.match(rf"{named} made no progress for 8 s \(train.hang_timeout_s 8 s", last), last

    store.set("watchdog/1", json.dumps(report(1, waiting=False)))
    last = waiting.account(store, report(0, waiting=True), idle=9.0, limit=8.0)[0].splitlines()[-1]
    assert re.match(rf"error: hang: rank 1 on {host} \(in step 5\) made no progress for 8 s", last), last
    store.set("watchdog/1", json.dumps(report(1, waiting=True)))
    last = waiting.account(store, report(0, waiting=True), idle=9.0, limit=8.0)[0].splitlines()[-1]
    assert f"rank 0 on {socket.gethostname()}, rank 1 on" in last and "they do not match" in last, last
