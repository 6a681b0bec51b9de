"""Measure a `LinkProfile`: the plain and compressed collectives timed on the mesh itself.

A short start-up probe (seconds): for each message shape a model sends, the plain lax
collective and each candidate compressed route (all-reduce algorithm x pipelined chunk
count) are compiled and timed on the mesh axis. The profile then decides every
message's route (`taco_jax.policy`). With several processes, process 0's timings are
used everywhere, so every process compiles the same program.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax import collectives
from taco_jax.accounting import Op
from taco_jax.policy import LinkProfile, Route, TacoConfig, Timing, default_algorithm

# The plain lax collective of each op a route is chosen for (`policy.OPS`).
_PLAIN = {
    Op.ALL_GATHER: lambda v, axis: lax.all_gather(v, axis, tiled=True),
    Op.REDUCE_SCATTER: lambda v, axis: lax.psum_scatter(v, axis, tiled=True),
    Op.ALL_REDUCE: lambda v, axis: lax.psum(v, axis),
}


@dataclasses.dataclass(frozen=True)
class Message:
    """One message shape a model sends: `op` (an `Op` or its name) of a per-rank array
    of `shape` and `dtype`."""

    op: str
    shape: tuple[int, ...]
    dtype: str


def candidate_routes(op: str, ranks: int, nbytes: int, chunk_counts: Sequence[int]) -> list[Route]:
    """The plain route and the compressed ones worth timing for a message."""
    algorithms: tuple[str, ...]
    if op != Op.ALL_REDUCE:
        algorithms = ("one_shot",)  # the algorithm only names how an all-reduce travels
    else:
        algorithms = ("one_shot", "two_shot") if ranks > 2 else (default_algorithm(ranks, nbytes),)
    return [Route(False)] + [Route(True, a, c) for a in algorithms for c in chunk_counts]


def _collective(op: str, route: Route, config: TacoConfig, axis_name: str) -> Callable:
    if not route.compressed:
        return lambda v: _PLAIN[Op(op)](v, axis_name)
    routed = dataclasses.replace(config, min_bytes=0, chunks=route.chunks, link=None)
    if op == Op.ALL_GATHER:
        return lambda v: collectives.all_gather(v, axis_name, routed)
    if op == Op.REDUCE_SCATTER:
        return lambda v: collectives.reduce_scatter(v, axis_name, routed)
    return lambda v: collectives.all_reduce(v, axis_name, routed, algorithm=route.algorithm)


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


def probe_link(
    mesh: Mesh,
    messages: Iterable[Message],
    config: TacoConfig,
    *,
    axis_name: str = "tensor",
    chunk_counts: Sequence[int] = (1,),
    trials: int = 5,
    calls: int = 5,
    margin: float = 0.05,
    log: Callable[[str], None] | None = None,
) -> LinkProfile:
    """Time the plain and compressed routes of `messages` on `mesh`'s `axis_name`.

    Args:
      mesh: the device mesh (every device takes part).
      messages: the message shapes to time; duplicates are timed once.
      config: compression settings (formats, transform) of the compressed routes.
      axis_name: the mesh axis the collectives run over.
      chunk_counts: pipelined chunk counts to try for the compressed routes.
      trials: the time is the median over this many trials...
      calls: ...of the mean of this many queued calls each.
      margin: the profile's decision margin (`LinkProfile.margin`).
      log: called with one line per message (progress), e.g. `print`.

    Returns:
      The `LinkProfile`.

    Raises:
      ValueError: an op name that is not a collective, or a reduce-scatter message whose
        leading axis does not divide by the axis size.
    """
    ranks = mesh.shape[axis_name]
    other_axes = tuple(a for a in mesh.axis_names if a != axis_name)
    spec = P((*other_axes, axis_name))  # every device holds one per-rank message
    timings, keys = [], []
    for message in dict.fromkeys(messages):
        if message.op not in _PLAIN:
            raise ValueError(f"unknown collective {message.op!r}; expected one of {sorted(op.value for op in _PLAIN)}")
        if message.op == Op.REDUCE_SCATTER and message.shape[0] % ranks:
            raise ValueError(f"reduce_scatter message {message.shape} does not split over {ranks} ranks on axis 0")
        global_shape = (mesh.size * message.shape[0], *message.shape[1:])
        x = jax.device_put(jax.random.normal(jax.random.key(0), global_shape, message.dtype), NamedSharding(mesh, spec))
        nbytes = int(np.prod(message.shape)) * jnp.dtype(message.dtype).itemsize
        for route in candidate_routes(message.op, ranks, nbytes, chunk_counts):
            body = _collective(message.op, route, config, axis_name)
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
            timings.append(median_ms(lambda: fn(x), trials, calls))
            keys.append((message.op, nbytes, route))
        if log is not None:
            start = len(timings) - len(candidate_routes(message.op, ranks, nbytes, chunk_counts))
            log(
                f"probe {message.op} {message.shape} {message.dtype}: "
                + ", ".join(f"{k[2].name} {t:.3f} ms" for k, t in zip(keys[start:], timings[start:]))
            )
    if jax.process_count() > 1:
        timings = multihost_utils.broadcast_one_to_all(np.asarray(timings, np.float64)).tolist()
    device = mesh.devices.flat[0].device_kind
    return LinkProfile(
        tuple(Timing(op, ranks, nbytes, route, float(ms)) for (op, nbytes, route), ms in zip(keys, timings)),
        margin=margin,
        description=f"{ranks} x {device} over mesh axis {axis_name!r}",
    )
