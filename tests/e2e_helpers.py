"""Helpers the end-to-end test modules share: a started local cluster, threads, polling."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

from cluster.local_cluster import LocalCluster


@contextlib.contextmanager
def started(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The cluster started, and stopped however the block ends (a module fixture yields inside it)."""
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def in_threads(fns: list[Callable[[], Any]]) -> tuple[list[threading.Thread], dict[int, Any]]:
    """Run each function in its own daemon thread; ``out[i]`` gets its result or its exception."""
    out: dict[int, Any] = {}

    def run(i, f):
        try:
            out[i] = f()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[i] = e

    ts = [threading.Thread(target=run, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    return ts, out


def run_all(fns: list[Callable[[], Any]], timeout_s: float = 300) -> dict[int, Any]:
    """:func:`in_threads`, waited for."""
    ts, out = in_threads(fns)
    for t in ts:
        t.join(timeout_s)
    return out


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str = "condition", interval_s: float = 0.25) -> float:
    """Poll ``pred`` until it returns True; the seconds it took. An exception counts as not yet (a
    replica restarting); the last value or exception is in the assertion message."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout_s:
        try:
            last = pred()
        except Exception as e:  # noqa: BLE001
            last = e
        if last is True:
            return time.monotonic() - t0
        time.sleep(interval_s)
    raise AssertionError(f"{what} not reached in {timeout_s}s (last: {last!r})")
