"""Compressed tensor-parallel collectives for use inside `jax.shard_map`.

Each collective has the result of its `jax.lax` counterpart within codec error, and the
same gradient under both shard_map conventions: with `check_vma=True` (JAX's default)
the result types follow lax's (all_reduce's result is invariant over the axis, its
transpose a `pcast` to varying, no communication); with `check_vma=False` all_reduce
transposes to an all-reduce, as `lax.psum` does there. Every
compressed message follows one line: compress kernel -> wire message (one uint8 buffer,
`pallas_kernels.wire`, written by the kernel) -> lax collective -> decode kernel (reads
the received buffer), so every backend moves one byte per element and nothing is copied
between the stages. Reductions dequantize to float32 and sum in the transformed domain;
the inverse transform runs once.

Layout: a message is viewed as rows of G elements of its last axis (the last axis is
zero-padded to a multiple of G), so any shape the lax collective accepts works and the
groups are the codec's groups. How each message travels (compressed or not, the
all-reduce algorithm, pipelined chunks) is `taco_jax.policy`'s decision.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax import accounting
from taco_jax import calibration as calibration_lib
from taco_jax import policy
from taco_jax.calibration import Calibration
from taco_jax.codec import decode, encode, message_layout, requantize
from taco_jax.kernels.jax_compat import checks_vma
from taco_jax.policy import ALGORITHMS
from taco_jax.spec import QuantSpec, TacoConfig

# Chunks of a pipelined message start at multiples of this many groups, so the kernels
# split every chunk (the last one aside) into whole row blocks without padding.
CHUNK_ALIGN = 64


# ----------------------------------------------------------------------------- varying manual axes
# `checks_vma` (public API) lives in `taco_jax.kernels.jax_compat`, beside the detection
# of a gradient taken outside a shard_map, which has no public form.


def varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes `x` varies over (empty under `check_vma=False`)."""
    return frozenset(jax.typeof(x).mat.varying)


def vary(x: jax.Array, axes) -> jax.Array:
    """`x` marked as varying over `axes` where `check_vma` tracks it (`lax.pcast`; its
    transpose sums over the axes the mark added, as JAX's implicit casts do)."""
    missing = tuple(a for a in axes if checks_vma(a) and a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def gather_stacked(x: jax.Array, axis_name: str) -> jax.Array:
    """`lax.all_gather(x, axis_name, axis=0, tiled=False)`; over one rank its own x, since
    XLA:GPU runs a one-participant collective as a copy of the buffer."""
    return x[None] if lax.axis_size(axis_name) == 1 else lax.all_gather(x, axis_name, axis=0, tiled=False)


def gather_invariant(x: jax.Array, axis_name: str) -> jax.Array:
    """Stacked all-gather whose result is invariant over `axis_name` (every rank holds
    the same), as the last step of an all-reduce must be under `check_vma=True` (there
    only the collective makes x invariant, even over one rank)."""
    if checks_vma(axis_name):
        return lax.all_gather(x, axis_name, axis=0, tiled=False, to="invarying")
    return gather_stacked(x, axis_name)


def exchange_blocks(x: jax.Array, axis_name: str) -> jax.Array:
    """`lax.all_to_all` of x's leading blocks (tiled): rank r receives block r of every
    rank; over one rank x itself (no copy, as `gather_stacked`)."""
    if lax.axis_size(axis_name) == 1:
        return x
    return lax.all_to_all(per_rank(x, axis_name), axis_name, 0, 0, tiled=True)


def per_rank(x: jax.Array, axis_name: str) -> jax.Array:
    """`x` as a value held per rank of a `vmap` axis (a simulated mesh). A value equal on
    every rank, such as the cotangent of an all-gather's result, is unbatched there, and
    jax's all_to_all and ppermute batching rules mangle an unbatched operand (seen: an
    all_to_all of (4, 17, 128) giving (4, 17, 128, 4, 17, 128)). Inside shard_map every
    value is per device already: x itself."""
    if axis_name in jax.sharding.get_abstract_mesh().manual_axes:
        return x
    return x + (lax.axis_index(axis_name) * 0).astype(x.dtype)


# ----------------------------------------------------------------------------- layout


def _to_rows(x: jax.Array, group_size: int, lead: int) -> jax.Array:
    """(*lead_dims, *chunk) -> (*lead_dims, n, G), padding the chunk's last axis with zeros."""
    lead_shape, chunk = x.shape[:lead], x.shape[lead:]
    last = chunk[-1] if chunk else 1
    x = x.reshape(*lead_shape, math.prod(chunk[:-1]), last)
    pad = -last % group_size
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*lead_shape, -1, group_size)


def _from_rows(rows: jax.Array, chunk: tuple[int, ...], lead: int) -> jax.Array:
    """Invert `_to_rows` for a chunk shape (the padded tail of the last axis is dropped)."""
    lead_shape = rows.shape[:lead]
    last = chunk[-1] if chunk else 1
    rows = rows.reshape(*lead_shape, math.prod(chunk[:-1]), -1)[..., :last]
    return rows.reshape(*lead_shape, *chunk)


def chunk_bounds(groups: int, chunks: int) -> list[tuple[int, int]]:
    """Split `groups` rows into at most `chunks` pieces starting at multiples of
    `CHUNK_ALIGN` (fewer pieces when there are too few rows)."""
    per_chunk = -(-groups // chunks)
    step = -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN
    edges = list(range(0, groups, step)) + [groups]
    return list(zip(edges[:-1], edges[1:]))


def _message_bytes(groups: int, spec: QuantSpec, chunks: int) -> int:
    """Bytes of the messages carrying `groups` groups in `chunks` pipelined pieces."""
    return sum(message_layout(b - a, spec).nbytes for a, b in chunk_bounds(groups, chunks))


# ----------------------------------------------------------------------------- policy


def _route(x: jax.Array, config: TacoConfig, op: str, axis_name: str, algorithm: str = "auto") -> policy.Route:
    """How `x` travels (`taco_jax.policy`); integer and empty arrays always go plain."""
    nbytes = x.size * x.dtype.itemsize
    return policy.route_for(op, lax.axis_size(axis_name), nbytes, link=config.link, chunks=config.chunks,
                            algorithm=algorithm, compresses=_compressible(x, config))


def _compressible(x: jax.Array, config: TacoConfig) -> bool:
    """Whether `config` compresses `x`: a non-empty float array of at least `min_bytes`
    (an empty one has nothing to send, so it takes the plain collective)."""
    return x.size > 0 and jnp.issubdtype(x.dtype, jnp.floating) and config.compresses(x.size * x.dtype.itemsize)


def planned_spec(spec: QuantSpec, calibration: Calibration | None, site: str, direction: str,
                 channels: int) -> tuple[QuantSpec, calibration_lib.ChannelPlan | None]:
    """`spec` with the site's calibrated transform decision, and the site's permutation
    plan (None when it has none or it is the identity).

    Raises:
      ValueError: the plan permutes another number of channels than `channels`.
    """
    plan = calibration.plan(site, direction) if calibration is not None else None
    if plan is None:
        return spec, None
    if len(plan.perm) != channels:
        raise ValueError(f"calibration of site {site!r} permutes {len(plan.perm)} channels, "
                         f"but the message has {channels}")
    return plan.spec(spec), None if plan.is_identity else plan


def _wire_view(x, config, direction, op, site, calibration, route, channel_axis_used=False):
    """(x in wire channel order, spec, inverse permutation or None); spec None = send
    `x` uncompressed. Reports `x` to an active calibration collector."""
    if not route.compressed:
        return x, None, None
    spec = config.forward if direction == "forward" else config.backward
    calibration_lib.observe(x, site or op, direction)
    spec, plan = planned_spec(spec, calibration, site or op, direction, x.shape[-1])
    if plan is None:
        return x, spec, None
    if channel_axis_used:
        raise ValueError(f"site {site or op!r} has a channel permutation, so it cannot gather or scatter along "
                         f"the last (channel) axis of shape {x.shape}")
    return jnp.take(x, plan.indices, axis=-1), spec, plan.inverse


def _unpermute(x: jax.Array, inverse) -> jax.Array:
    return x if inverse is None else jnp.take(x, inverse, axis=-1)


def record_collective(site, op, direction, x, axis_name, spec, sent, plain_sent) -> None:
    """Record a collective's wire bytes; `plain_sent` is what the uncompressed collective
    sends in x's dtype, and scaled to 2-byte elements it is the bf16 figure."""
    accounting.record(
        accounting.WireRecord(
            site=site or op, op=op, direction=direction, shape=tuple(x.shape), dtype=jnp.dtype(x.dtype).name,
            ranks=lax.axis_size(axis_name), compressed=spec is not None, sent_bytes=int(sent),
            uncompressed_sent_bytes=int(plain_sent), axis=str(axis_name),
            bf16_sent_bytes=int(plain_sent) * 2 // jnp.dtype(x.dtype).itemsize,
        )
    )


def ring_all_reduce_bytes(nbytes: int, ranks: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `nbytes`: 2 (k-1)/k of them."""
    return 2 * (ranks - 1) * nbytes // ranks


def record_plain_all_reduce(x: jax.Array, axis_name: str, site: str, direction: str = "forward") -> None:
    """Record an uncompressed all-reduce (psum, pmean, pmax) of `x` over `axis_name` done
    with `jax.lax` directly."""
    plain = ring_all_reduce_bytes(x.size * jnp.dtype(x.dtype).itemsize, lax.axis_size(axis_name))
    record_collective(site, "all_reduce", direction, x, axis_name, None, plain, plain)


def _check_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"{what}={axis} is out of range for an array of rank {ndim}")
    return axis % max(ndim, 1)


# ----------------------------------------------------------------------------- implementations


def gather_and_received(x, axis_name, config, direction, axis, tiled, site,
                        calibration=None) -> tuple[jax.Array, jax.Array | tuple[jax.Array, ...]]:
    """The all-gather result and what crossed the wire: a tuple of (ranks, rows, W)
    uint8 messages (one per pipelined chunk) when compressed (decode again with
    `decode_gathered`), else the result."""
    ranks = lax.axis_size(axis_name)
    axis = _check_axis(axis, x.ndim if tiled else x.ndim + 1, "axis")
    plain_sent = (ranks - 1) * x.size * x.dtype.itemsize
    route = _route(x, config, "all_gather", axis_name)
    wire, spec, inverse = _wire_view(x, config, direction, "all_gather", site, calibration, route)
    if spec is None:
        record_collective(site, "all_gather", direction, x, axis_name, None, plain_sent, plain_sent)
        if x.size:
            gathered = lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
        else:
            shape = list(x.shape)
            if tiled:
                shape[axis] *= ranks
            else:
                shape.insert(axis, ranks)
            gathered = _empty_result(x, shape, axis_name)
        return gathered, gathered
    rows = _to_rows(wire, spec.group_size, 0)
    received = tuple(gather_stacked(encode(rows[a:b], spec, config.kernels), axis_name)
                     for a, b in chunk_bounds(rows.shape[0], route.chunks))
    record_collective(site, "all_gather", direction, x, axis_name, spec,
            (ranks - 1) * _message_bytes(rows.shape[0], spec, route.chunks), plain_sent)
    return decode_gathered(received, x.shape, x.dtype, spec, axis, tiled, inverse, config.kernels), received


def _empty_result(x: jax.Array, shape, axis_name: str) -> jax.Array:
    """What a collective over `axis_name` returns for an empty `x` (XLA refuses to lower
    one of zero-size operands): an empty array of `shape`, varying as lax's result."""
    return vary(jnp.zeros(shape, x.dtype), (axis_name, *varying_axes(x)))


def _gather(x, axis_name, config, direction, axis, tiled, site, calibration=None):
    return gather_and_received(x, axis_name, config, direction, axis, tiled, site, calibration)[0]


def decode_gathered(received: tuple[jax.Array, ...], shape: tuple[int, ...], dtype: jnp.dtype, spec: QuantSpec,
                    axis: int, tiled: bool, inverse_perm: np.ndarray | None = None, kernels: str = "auto") -> jax.Array:
    """Decode the all-gathered messages of per-rank arrays of `shape` (the chunks of
    `gather_and_received`) into the all-gather result (`lax.all_gather` layout),
    undoing a channel permutation if given; `kernels` is the kernel mode."""
    ranks = received[0].shape[0]
    last = shape[-1] if shape else 1
    groups = math.prod(shape[:-1]) * -(-last // spec.group_size)
    bounds = chunk_bounds(groups, len(received))
    rows = [decode(r[:, None], b - a, spec, dtype, kernels) for r, (a, b) in zip(received, bounds)]
    rows = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)
    out = jnp.moveaxis(_unpermute(_from_rows(rows, shape, 1), inverse_perm), 0, axis)
    if tiled:
        out = out.reshape(*shape[:axis], ranks * shape[axis], *shape[axis + 1 :])
    return out


def _scatter(x, axis_name, config, direction, scatter_dimension, tiled, site, calibration=None):
    ranks = lax.axis_size(axis_name)
    dim = _check_axis(scatter_dimension, x.ndim, "scatter_dimension")
    size = x.shape[dim]
    if (tiled and size % ranks) or (not tiled and size != ranks):
        need = f"divisible by {ranks}" if tiled else f"equal to {ranks}"
        raise ValueError(f"scatter_dimension {dim} of shape {x.shape} has size {size}, must be {need} (axis size)")
    plain_sent = (ranks - 1) * x.size * x.dtype.itemsize // ranks
    route = _route(x, config, "reduce_scatter", axis_name)
    wire, spec, inverse = _wire_view(x, config, direction, "reduce_scatter", site, calibration, route,
                                     dim == x.ndim - 1)
    if spec is None:
        record_collective(site, "reduce_scatter", direction, x, axis_name, None, plain_sent, plain_sent)
        if not x.size:
            return _empty_result(x, (*x.shape[:dim], *((size // ranks,) if tiled else ()), *x.shape[dim + 1:]),
                                 axis_name)
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)
    moved = jnp.moveaxis(wire, dim, 0)
    chunk_shape = (size // ranks, *moved.shape[1:]) if tiled else moved.shape[1:]
    rows = _to_rows(moved.reshape(ranks, *chunk_shape), spec.group_size, 1)
    pieces = [_reduce_scatter_rows(rows[:, a:b], axis_name, spec, x.dtype, config.kernels)
              for a, b in chunk_bounds(rows.shape[1], route.chunks)]
    record_collective(site, "reduce_scatter", direction, x, axis_name, spec,
            (ranks - 1) * _message_bytes(rows.shape[1], spec, route.chunks), plain_sent)
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0)
    out = _unpermute(_from_rows(out, chunk_shape, 0), inverse)
    return jnp.moveaxis(out, 0, dim) if tiled else out


def _reduce_scatter_rows(rows, axis_name: str, spec: QuantSpec, dtype: jnp.dtype, kernels: str) -> jax.Array:
    """(ranks, n, G) rows, one block per destination -> this rank's (n, G) block of the sum."""
    received = exchange_blocks(encode(rows, spec, kernels), axis_name)
    return decode(received[None], rows.shape[1], spec, dtype, kernels)[0]


def _reduce(x, axis_name, config, direction, algorithm, site, calibration=None):
    ranks = lax.axis_size(axis_name)
    nbytes = x.size * x.dtype.itemsize
    plain_sent = ring_all_reduce_bytes(nbytes, ranks)
    route = _route(x, config, "all_reduce", axis_name, algorithm)
    wire, spec, inverse = _wire_view(x, config, direction, "all_reduce", site, calibration, route)
    if spec is None:
        record_collective(site, "all_reduce", direction, x, axis_name, None, plain_sent, plain_sent)
        return lax.psum(x, axis_name)
    rows = _to_rows(wire, spec.group_size, 0)
    exchange = _one_shot if route.algorithm == "one_shot" else _two_shot
    out, sent = exchange(rows, axis_name, spec, route.chunks, x.dtype, config.kernels)
    record_collective(site, f"all_reduce_{route.algorithm}", direction, x, axis_name, spec, (ranks - 1) * sent, plain_sent)
    return _unpermute(_from_rows(out, x.shape, 0), inverse)


def _one_shot(rows, axis_name, spec, chunks, dtype, kernels) -> tuple[jax.Array, int]:
    """All-gather every rank's messages, decode their sum: (n, G) sum, bytes per peer."""
    pieces = []
    for a, b in chunk_bounds(rows.shape[0], chunks):
        received = gather_invariant(encode(rows[a:b], spec, kernels), axis_name)
        pieces.append(decode(received[None], b - a, spec, dtype, kernels)[0])
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0)
    return out, _message_bytes(rows.shape[0], spec, chunks)


def rank_blocks(rows: jax.Array, ranks: int) -> jax.Array:
    """(n, G) rows as (ranks, ceil(n / ranks), G) blocks, zero rows padding the last:
    block i is what rank i reduces in a two-shot all-reduce."""
    per_rank = -(-rows.shape[0] // ranks)
    return jnp.pad(rows, [(0, ranks * per_rank - rows.shape[0]), (0, 0)]).reshape(ranks, per_rank, rows.shape[1])


def _two_shot(rows, axis_name, spec, chunks, dtype, kernels) -> tuple[jax.Array, int]:
    """Reduce-scatter, requantize the reduced block, all-gather it: (n, G) sum, bytes
    per peer."""
    count = rows.shape[0]
    blocks = rank_blocks(rows, lax.axis_size(axis_name))
    per_rank = blocks.shape[1]
    pieces = []
    for a, b in chunk_bounds(per_rank, chunks):
        received = exchange_blocks(encode(blocks[:, a:b], spec, kernels), axis_name)
        reduced = requantize(received, b - a, spec, kernels)
        gathered = gather_invariant(reduced, axis_name)
        pieces.append(decode(gathered[:, None], b - a, spec, dtype, kernels))
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)
    return out.reshape(-1, spec.group_size)[:count], 2 * _message_bytes(per_rank, spec, chunks)


def _permute(x, axis_name, config, direction, perm, site):
    """`lax.ppermute` of `x`, compressed with the direction's spec where `config`
    compresses a message of its size (no calibration plans: point-to-point sends)."""
    nbytes = x.size * x.dtype.itemsize
    spec = config.forward if direction == "forward" else config.backward
    if not _compressible(x, config):
        record_collective(site, "ppermute", direction, x, axis_name, None, nbytes, nbytes)
        return lax.ppermute(per_rank(x, axis_name), axis_name, perm)
    rows = _to_rows(x, spec.group_size, 0)
    received = lax.ppermute(per_rank(encode(rows, spec, config.kernels), axis_name), axis_name, perm)
    record_collective(site, "ppermute", direction, x, axis_name, spec, message_layout(rows.shape[0], spec).nbytes, nbytes)
    return _from_rows(decode(received[None, None], rows.shape[0], spec, x.dtype, config.kernels)[0], x.shape, 0)


def _permute_transpose(cotangent, axis_name, config, perm, site):
    """The cotangent goes back along the reversed pairs, with the backward spec."""
    return _permute(cotangent, axis_name, config, "backward", tuple((dst, src) for src, dst in perm), site)


# ----------------------------------------------------------------------------- differentiable API


_CALLING = contextvars.ContextVar("calling", default=False)


def straight_through(forward, backward):
    """A differentiable op `op(x, *static)` = `forward(x, *static)` whose cotangent is
    `backward(cotangent, *static)`: an explicit rule, so autodiff never differentiates
    the quantizer. `static` are hashable non-array arguments (axis name, config, ...).

    The forward messages are recorded in the wire ledger while the op is called: JAX may
    trace the forward rule once more later (differentiating a scan traces its body's
    primal and then its forward rule), and that second trace sends nothing more."""

    def counted_forward(x, static):
        with contextlib.nullcontext() if _CALLING.get() else accounting.paused():
            return forward(x, *static)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def op(x, static):
        return counted_forward(x, static)

    op.defvjp(lambda x, static: (counted_forward(x, static), None), lambda static, _, ct: (backward(ct, *static),))

    def call(x, *static):
        token = _CALLING.set(True)
        try:
            return op(x, static)
        finally:
            _CALLING.reset(token)

    return call


def _all_reduce_transpose(cotangent, axis_name, config, algorithm, site, calibration):
    if checks_vma(axis_name):  # the transpose of an invariant sum is a broadcast (lax.psum's too)
        return vary(cotangent, (axis_name,))
    return _reduce(cotangent, axis_name, config, "backward", algorithm, site, calibration)


def directed(implementation, direction: str):
    """`implementation(x, axis_name, config, direction, *rest)` as `f(x, axis_name, config,
    *rest)`: one direction of a collective (forward messages use `config.forward`,
    backward ones `config.backward`)."""

    def one_direction(x, axis_name, config, *rest):
        return implementation(x, axis_name, config, direction, *rest)

    return one_direction


_all_gather = straight_through(directed(_gather, "forward"), directed(_scatter, "backward"))
_reduce_scatter = straight_through(directed(_scatter, "forward"), directed(_gather, "backward"))
_all_reduce = straight_through(directed(_reduce, "forward"), _all_reduce_transpose)
_ppermute = straight_through(directed(_permute, "forward"), _permute_transpose)


def check_arguments(config: TacoConfig, calibration: Calibration | None, algorithm: str = "auto") -> None:
    """Raise ValueError unless `config` is a `TacoConfig`, `calibration` None or a
    `Calibration`, and `algorithm` one of `ALGORITHMS`."""
    if not isinstance(config, TacoConfig):
        raise ValueError(f"config must be a TacoConfig, got {type(config).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a taco_jax.calibration.Calibration, got {type(calibration).__name__}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {list(ALGORITHMS)}")


def all_gather(x: jax.Array, axis_name: str, config: TacoConfig, *, axis: int = 0, tiled: bool = True,
               site: str | None = None, calibration: Calibration | None = None) -> jax.Array:
    """Compressed `lax.all_gather` over `axis_name` (inside `shard_map`).

    Args:
      x: this rank's shard, any shape and float dtype.
      axis_name: the mesh axis, e.g. "tensor".
      config: `TacoConfig`; `config.forward` compresses the gather, and the backward pass
        is a compressed reduce-scatter with `config.backward`. Mode "off" or a message
        under `config.min_bytes` uses the plain collective.
      axis: where the gathered axis goes (as in `lax.all_gather`).
      tiled: concatenate along `axis` instead of stacking a new axis.
      site: call-site name for wire-byte accounting (`taco_jax.record_wire`) and
        calibration.
      calibration: per-site channel permutations and transform decisions
        (`taco_jax.calibration`); None = identity and the config's transform.

    Returns:
      The gathered array, shape and dtype as `lax.all_gather` gives.

    Raises:
      ValueError: bad axis, config or calibration (a permutation of the wrong length).
    """
    check_arguments(config, calibration)
    return _all_gather(vary(x, (axis_name,)), axis_name, config, axis, tiled, site, calibration)


def reduce_scatter(x: jax.Array, axis_name: str, config: TacoConfig, *, scatter_dimension: int = 0, tiled: bool = True,
                   site: str | None = None, calibration: Calibration | None = None) -> jax.Array:
    """Compressed `lax.psum_scatter`: sum over `axis_name`, each rank keeps its block.

    Chunks are compressed, exchanged with one all-to-all, dequantized and summed in
    float32. The backward pass is a compressed all-gather with `config.backward`.

    Args:
      x: this rank's full-size contribution.
      axis_name: the mesh axis.
      config: `TacoConfig` (see `all_gather`).
      scatter_dimension: the dimension split over the ranks.
      tiled: keep the dimension (size / ranks) instead of removing it (size == ranks).
      site: call-site name for wire-byte accounting and calibration.
      calibration: see `all_gather`.

    Returns:
      This rank's block of the sum, shape and dtype as `lax.psum_scatter` gives.

    Raises:
      ValueError: the scattered dimension does not divide by (or equal) the axis size,
        or a channel permutation on a site that scatters along the channel axis.
    """
    check_arguments(config, calibration)
    return _reduce_scatter(vary(x, (axis_name,)), axis_name, config, scatter_dimension, tiled, site, calibration)


def all_reduce(x: jax.Array, axis_name: str, config: TacoConfig, *, algorithm: str = "auto", site: str | None = None,
               calibration: Calibration | None = None) -> jax.Array:
    """Compressed `lax.psum` over `axis_name`.

    "two_shot": compressed reduce-scatter (sum in float32 in the transformed domain),
    requantize the reduced block once, compressed all-gather, one inverse transform.
    "one_shot": compressed all-gather of everything, dequantize-and-sum (small messages).
    "auto": the config's link profile decides (`TacoConfig.link`); without one,
    one-shot at two ranks or under `policy.ONE_SHOT_MAX_BYTES` per rank, else
    two-shot. An explicit algorithm is used wherever the message is compressed. Gradient
    as `lax.psum`'s: under `check_vma=True` the result is invariant over the axis and
    the cotangent goes back to every rank unchanged; under `check_vma=False` the
    backward pass all-reduces the cotangent the same way with `config.backward`.

    Args:
      x: this rank's contribution, any shape.
      axis_name: the mesh axis.
      config: `TacoConfig` (see `all_gather`).
      algorithm: "auto", "one_shot" or "two_shot".
      site: call-site name for wire-byte accounting and calibration.
      calibration: see `all_gather`.

    Returns:
      The sum, same shape and dtype as `x`.

    Raises:
      ValueError: unknown algorithm, bad config or calibration.
    """
    check_arguments(config, calibration, algorithm)
    return _all_reduce(vary(x, (axis_name,)), axis_name, config, algorithm, site, calibration)


def ppermute(x: jax.Array, axis_name: str, config: TacoConfig, *, perm, site: str | None = None) -> jax.Array:
    """Compressed `lax.ppermute`: each (source, destination) pair of `perm` sends the
    source's `x` to the destination; ranks that receive nothing get zeros.

    The message is compressed with `config.forward` (and the cotangent, sent back along
    the reversed pairs, with `config.backward`) where `config` compresses a message of
    its size; e.g. the activations a pipeline stage hands to the next one.

    Args:
      x: this rank's array, any shape and float dtype.
      axis_name: the mesh axis, e.g. "pipe".
      config: `TacoConfig`.
      perm: (source, destination) index pairs along the axis, each source and each
        destination at most once.
      site: name for wire-byte accounting (`taco_jax.record_wire`).

    Returns:
      What this rank received, shape and dtype of `x`.

    Raises:
      ValueError: bad config, or a rank appearing twice as source or destination.
    """
    check_arguments(config, None)
    perm = tuple((int(src), int(dst)) for src, dst in perm)
    for position, name in ((0, "source"), (1, "destination")):
        ranks = [pair[position] for pair in perm]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ppermute: a rank appears twice as a {name} in perm {perm}")
    return _ppermute(vary(x, (axis_name,)), axis_name, config, perm, site)
