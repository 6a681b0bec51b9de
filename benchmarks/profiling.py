"""Where the GPU time of a jitted call goes: a device timeline from `jax.profiler`.

`gpu_timeline(call, calls)` traces `calls` queued calls of `call()`, reads the device
plane of the first GPU (`jax.profiler.ProfileData`, no TensorBoard needed) and sums its
kernels by kind:

  comm     NCCL kernels (the collectives)
  codec    the taco_jax Pallas kernels (names start with "taco_")
  gemm     cuBLAS / CUTLASS matrix products
  attn     cuDNN attention
  other    everything else (XLA fusions, copies, reductions)

Per call it reports each kind's busy time, the span of the call, and how much of the
communication ran while no computation did ("exposed"): the part of the collectives a
faster link or compression can take off the step.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import jax

KINDS = {
    "comm": re.compile(r"nccl", re.I),
    "codec": re.compile(r"taco_", re.I),
    "gemm": re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul", re.I),
    "attn": re.compile(r"cudnn|flash|fmha|sdpa", re.I),
}


def kind_of(kernel: str) -> str:
    """The kind of a kernel name (see the module docstring)."""
    for kind, pattern in KINDS.items():
        if pattern.search(kernel):
            return kind
    return "other"


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in intervals)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length of the intersection of two unions of disjoint sorted intervals."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _device_events(trace_dir: Path) -> list[tuple[str, int, int]]:
    """(name, start_ns, end_ns) of the kernels on the first GPU's streams."""
    path = next(trace_dir.glob("**/*.xplane.pb"))
    data = jax.profiler.ProfileData.from_serialized_xspace(path.read_bytes())
    planes = sorted((p for p in data.planes if p.name.startswith("/device:GPU:")), key=lambda p: p.name)
    if not planes:
        return []
    events = []
    for line in planes[0].lines:
        if "stream" not in line.name.lower():
            continue
        for event in line.events:
            events.append((event.name, int(event.start_ns), int(event.start_ns + event.duration_ns)))
    return events


def summarize(events: list[tuple[str, int, int]], calls: int, top: int = 12) -> dict:
    """Per-call busy time by kind, exposed communication and the longest kernels (ms)."""
    by_kind: dict[str, list[tuple[int, int]]] = {}
    by_name: dict[str, int] = {}
    for name, start, end in events:
        by_kind.setdefault(kind_of(name), []).append((start, end))
        by_name[name] = by_name.get(name, 0) + end - start
    comm = _union(by_kind.get("comm", []))
    compute = _union([iv for kind, ivs in by_kind.items() if kind != "comm" for iv in ivs])
    span = (max(e for _, _, e in events) - min(s for _, s, _ in events)) if events else 0
    per_call = 1e-6 / calls
    return {
        "calls": calls,
        "span_ms": span * per_call,
        "busy_ms": {kind: _length(_union(ivs)) * per_call for kind, ivs in sorted(by_kind.items())},
        "comm_ms": _length(comm) * per_call,
        "comm_exposed_ms": (_length(comm) - _overlap(comm, compute)) * per_call,
        "compute_ms": _length(compute) * per_call,
        "idle_ms": (span - _length(_union(comm + compute))) * per_call,
        "top_kernels": [
            {"name": name[:120], "kind": kind_of(name), "ms": ns * per_call}
            for name, ns in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
        ],
    }


def gpu_timeline(call, calls: int = 5, top: int = 12) -> dict | None:
    """Profile `calls` queued calls of `call()`.

    Args:
      call: runs one call of an (already compiled) function and returns its output,
        e.g. `lambda: fn(x)` or a training step that carries its state.
      calls: calls to trace (one sync at the end).
      top: how many of the longest kernels to list.

    Returns:
      `summarize` of the first GPU's kernels, or None off GPU.
    """
    if jax.default_backend() != "gpu":
        return None
    jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            out = None
            for _ in range(calls):
                out = call()
            jax.block_until_ready(out)
        return summarize(_device_events(Path(trace_dir)), calls, top)
