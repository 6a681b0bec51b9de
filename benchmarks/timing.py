"""Timing of device work: the median over trials of the mean time per call."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax


def median_ms(call: Callable[[], object], trials: int, calls: int) -> float:
    """Median over `trials` of the mean milliseconds per `call()`.

    On GPU the calls of a trial are queued with one sync at the end (a sync per call
    would add its latency to sub-millisecond ops); on CPU each call is synced, since
    overlapping collective programs can deadlock there. One untimed call first keeps
    compilation out.
    """
    sync_each = jax.default_backend() == "cpu"
    jax.block_until_ready(call())
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = call()
            if sync_each:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)
