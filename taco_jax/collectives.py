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

Each message is planned once, before it moves: `plan_message` asks `taco_jax.policy` how
it travels (compressed or not, the all-reduce algorithm, pipelined chunks), reports it to
an active calibration collector, and applies the site's calibration (transform decision,
channel permutation), giving a `WirePlan`, or None for the plain collective. The data
path is then plan -> compress -> move -> decode. A message is laid out as rows of G
elements of its last axis (zero-padded to a multiple of G), so any shape the lax
collective accepts works and the groups are the codec's groups.

`Call` holds one call's fixed arguments (axis, config, site, calibration). The `run_*`
functions are one direction of a collective as traced, without a gradient rule (the
tensor-parallel mappings in `taco_jax.tp` compose them); the public `all_gather`,
`reduce_scatter`, `all_reduce` and `ppermute` add the straight-through rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import accounting, policy
from taco_jax import calibration as calibration_lib
from taco_jax.calibration import Calibration
from taco_jax.codec import decode, encode, message_layout, requantize
from taco_jax.kernels.jax_compat import checks_vma, transposing_whole_shard_map
from taco_jax.policy import ALGORITHMS
from taco_jax.spec import QuantSpec, TacoConfig
from taco_jax.tracing import TraceScope

# Chunks of a pipelined message start at multiples of this many groups, so the kernels
# split every chunk (the last one aside) into whole row blocks without padding.
CHUNK_ALIGN = 64


# ----------------------------------------------------------------------------- varying manual axes
# `checks_vma` (public API) lives in `taco_jax.kernels.jax_compat`, beside the detection
# of a gradient taken outside a shard_map, which has no public form.


def refuse_gradient_outside(mapping: str, axis_name: str) -> None:
    """In a gradient rule: raise if a check_vma=False shard_map is being differentiated
    from outside (JAX's transpose would scale the gradients of `mapping`'s inputs)."""
    if not checks_vma(axis_name) and transposing_whole_shard_map():
        raise ValueError(
            f"taco_jax.tp.{mapping} inside jax.shard_map(check_vma=False) is differentiated from outside the "
            "shard_map: JAX would scale the weight gradients by 1/axis size. Take the gradient inside the "
            "shard_map body (Megatron's convention), or use check_vma=True (JAX's default), which is correct "
            "either way."
        )


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes `x` varies over (empty under `check_vma=False`)."""
    return frozenset(jax.typeof(x).mat.varying)


def vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
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


# ----------------------------------------------------------------------------- one call, one plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
    """One collective call's fixed arguments (hashable: a static argument of the
    collectives' gradient rules).

    Attributes:
      axis_name: the mesh axis the collective runs over.
      config: the `TacoConfig` (forward messages use `config.forward`, backward ones
        `config.backward`).
      site: call-site name for wire-byte accounting and calibration; None names the
        site after the op ("all_gather", ...).
      calibration: per-site channel permutations and transform decisions; None = the
        identity and the config's transform.

    Raises:
      ValueError: `config` is not a `TacoConfig`, or `calibration` not a `Calibration`.
    """

    axis_name: str
    config: TacoConfig
    site: str | None = None
    calibration: Calibration | None = None

    def __post_init__(self) -> None:
        check_config(self.config, self.calibration)

    def site_of(self, op: str) -> str:
        """The name `op`'s messages are recorded and calibrated under."""
        return self.site or op

    def spec(self, direction: str) -> QuantSpec:
        """The quantizer of `direction`'s messages ("forward" or "backward")."""
        return self.config.forward if direction == "forward" else self.config.backward


def check_config(config: TacoConfig, calibration: Calibration | None = None) -> None:
    """Raise ValueError unless `config` is a `TacoConfig` and `calibration` None or a
    `Calibration`."""
    if not isinstance(config, TacoConfig):
        raise ValueError(f"config must be a TacoConfig, got {type(config).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a taco_jax.calibration.Calibration, got {type(calibration).__name__}")


def check_algorithm(algorithm: str) -> None:
    """Raise ValueError unless `algorithm` is one of `ALGORITHMS`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {list(ALGORITHMS)}")


@dataclasses.dataclass(frozen=True)
class WirePlan:
    """How one compressed message travels, decided before it moves (`plan_message`).

    Attributes:
      spec: the quantizer, with the site's calibrated transform decision.
      chunks: pieces the message is pipelined in.
      algorithm: "one_shot" or "two_shot" (all-reduce only).
      permutation: the site's channel permutation; None for the identity.
    """

    spec: QuantSpec
    chunks: int = 1
    algorithm: str = "one_shot"
    permutation: calibration_lib.ChannelPlan | None = None

    def to_wire_order(self, x: jax.Array) -> jax.Array:
        """`x` with its channels (last axis) in the order they are grouped on the wire."""
        return x if self.permutation is None else jnp.take(x, self.permutation.indices, axis=-1)

    def from_wire_order(self, x: jax.Array) -> jax.Array:
        """Invert `to_wire_order`."""
        return x if self.permutation is None else jnp.take(x, self.permutation.inverse, axis=-1)

    def chunk_bounds(self, groups: int) -> list[tuple[int, int]]:
        """The group ranges of the pipelined chunks of a message of `groups` groups."""
        return chunk_bounds(groups, self.chunks)

    def message_bytes(self, groups: int) -> int:
        """Bytes of the chunk messages carrying `groups` groups."""
        return sum(message_layout(b - a, self.spec).nbytes for a, b in self.chunk_bounds(groups))


def planned_spec(
    spec: QuantSpec, calibration: Calibration | None, site: str, direction: str, channels: int
) -> tuple[QuantSpec, calibration_lib.ChannelPlan | None]:
    """`spec` with the site's calibrated transform decision, and the site's permutation
    plan (None when it has none or it is the identity).

    Raises:
      ValueError: the plan permutes another number of channels than `channels`.
    """
    plan = calibration.plan(site, direction) if calibration is not None else None
    if plan is None:
        return spec, None
    if len(plan.perm) != channels:
        raise ValueError(
            f"calibration of site {site!r} permutes {len(plan.perm)} channels, but the message has {channels}"
        )
    return plan.spec(spec), None if plan.is_identity else plan


def compressible(x: jax.Array | jax.ShapeDtypeStruct, config: TacoConfig) -> bool:
    """Whether `config` compresses `x`: a non-empty float array with at least one axis
    of at least `min_bytes` (an empty one has nothing to send and a scalar no channels
    to group, so they take the plain collective)."""
    return (
        x.ndim > 0
        and x.size > 0
        and jnp.issubdtype(x.dtype, jnp.floating)
        and config.compresses(x.size * x.dtype.itemsize)
    )


def plan_message(
    x: jax.Array | jax.ShapeDtypeStruct,
    call: Call,
    *,
    op: str,
    direction: str,
    algorithm: str = "auto",
    moves_channels: bool = False,
    report: bool = True,
) -> WirePlan | None:
    """How `x` travels in `op` (`taco_jax.policy`): None for the plain collective, else
    its `WirePlan`. A compressed message is reported to an active calibration collector.

    Args:
      x: the message, channels on its last axis.
      call: the call it belongs to.
      op: "all_gather", "reduce_scatter" or "all_reduce".
      direction: "forward" or "backward".
      algorithm: the caller's all-reduce algorithm ("auto": the policy's choice).
      moves_channels: the op gathers or scatters along the channel axis.
      report: report `x` to an active calibration collector (False: the caller reports
        the pieces it compresses; `x` may then be a ShapeDtypeStruct).

    Raises:
      ValueError: a channel permutation on a site whose op moves the channel axis, or
        one of the wrong length.
    """
    route = policy.route_for(
        op,
        lax.axis_size(call.axis_name),
        x.size * x.dtype.itemsize,
        link=call.config.link,
        chunks=call.config.chunks,
        algorithm=algorithm,
        compresses=compressible(x, call.config),
    )
    if not route.compressed:
        return None
    site = call.site_of(op)
    if report:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise ValueError("plan_message reports the message's values: pass the array, or report=False")
        calibration_lib.observe(x, site, direction)
    spec, permutation = planned_spec(call.spec(direction), call.calibration, site, direction, x.shape[-1])
    if permutation is not None and moves_channels:
        raise ValueError(
            f"site {site!r} has a channel permutation, so it cannot gather or scatter along "
            f"the last (channel) axis of shape {x.shape}"
        )
    return WirePlan(spec, route.chunks, route.algorithm, permutation)


# ----------------------------------------------------------------------------- layout


def to_rows(x: jax.Array, group_size: int, lead: int) -> jax.Array:
    """(*lead_dims, *chunk) -> (*lead_dims, n, G), padding the chunk's last axis with zeros."""
    lead_shape, chunk = x.shape[:lead], x.shape[lead:]
    last = chunk[-1] if chunk else 1
    x = x.reshape(*lead_shape, math.prod(chunk[:-1]), last)
    pad = -last % group_size
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*lead_shape, -1, group_size)


def from_rows(rows: jax.Array, chunk: tuple[int, ...], lead: int) -> jax.Array:
    """Invert `to_rows` for a chunk shape (the padded tail of the last axis is dropped)."""
    lead_shape = rows.shape[:lead]
    last = chunk[-1] if chunk else 1
    rows = rows.reshape(*lead_shape, math.prod(chunk[:-1]), -1)[..., :last]
    return rows.reshape(*lead_shape, *chunk)


def group_count(shape: tuple[int, ...], group_size: int) -> int:
    """Rows of G that `to_rows` makes of an array of `shape`."""
    last = shape[-1] if shape else 1
    return math.prod(shape[:-1]) * -(-last // group_size)


def chunk_bounds(groups: int, chunks: int) -> list[tuple[int, int]]:
    """Split `groups` rows into at most `chunks` pieces starting at multiples of
    `CHUNK_ALIGN` (fewer pieces when there are too few rows)."""
    per_chunk = -(-groups // chunks)
    step = -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN
    edges = list(range(0, groups, step)) + [groups]
    return list(zip(edges[:-1], edges[1:], strict=True))


def rank_blocks(rows: jax.Array, ranks: int) -> jax.Array:
    """(n, G) rows as (ranks, ceil(n / ranks), G) blocks, zero rows padding the last:
    block i is what rank i reduces in a two-shot all-reduce."""
    per_rank = -(-rows.shape[0] // ranks)
    return jnp.pad(rows, [(0, ranks * per_rank - rows.shape[0]), (0, 0)]).reshape(ranks, per_rank, rows.shape[1])


def _concatenated(pieces: list[jax.Array], axis: int) -> jax.Array:
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)


def check_axis(axis: int, ndim: int, what: str) -> int:
    """`axis` normalized for an array of rank `ndim`; ValueError naming `what` if out of
    range (always for a scalar, which has no axis)."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis} is out of range for an array of rank {ndim}")
    return axis % ndim


# ----------------------------------------------------------------------------- ledger


def record_collective(
    x: jax.Array | jax.ShapeDtypeStruct,
    *,
    site: str,
    op: str,
    direction: str,
    axis_name: str,
    spec: QuantSpec | None,
    sent: int,
    plain_sent: int,
) -> None:
    """Record a collective's wire bytes per rank: `sent` as it travels (`spec` None:
    uncompressed), `plain_sent` as the uncompressed collective in x's dtype; scaled to
    2-byte elements that is the bf16 figure."""
    itemsize = jnp.dtype(x.dtype).itemsize
    accounting.record(
        accounting.WireRecord(
            site=site,
            op=op,
            direction=direction,
            shape=tuple(x.shape),
            dtype=jnp.dtype(x.dtype).name,
            ranks=lax.axis_size(axis_name),
            compressed=spec is not None,
            sent_bytes=int(sent),
            uncompressed_sent_bytes=int(plain_sent),
            axis=str(axis_name),
            bf16_sent_bytes=int(plain_sent) * 2 // itemsize,
        )
    )


def ring_all_reduce_bytes(nbytes: int, ranks: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `nbytes`: 2 (k-1)/k of them."""
    return 2 * (ranks - 1) * nbytes // ranks


def record_plain_all_reduce(x: jax.Array, axis_name: str, *, site: str, direction: str = "forward") -> None:
    """Record an uncompressed all-reduce (psum, pmean, pmax) of `x` over `axis_name` done
    with `jax.lax` directly."""
    plain = ring_all_reduce_bytes(x.size * jnp.dtype(x.dtype).itemsize, lax.axis_size(axis_name))
    record_collective(
        x, site=site, op="all_reduce", direction=direction, axis_name=axis_name, spec=None, sent=plain, plain_sent=plain
    )


def _empty_result(x: jax.Array, shape: tuple[int, ...], axis_name: str) -> jax.Array:
    """What a collective over `axis_name` returns for an empty `x` (XLA refuses to lower
    one of zero-size operands): an empty array of `shape`, varying as lax's result."""
    return vary(jnp.zeros(shape, x.dtype), (axis_name, *varying_axes(x)))


# ----------------------------------------------------------------------------- all-gather


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatherResidual:
    """An all-gather's result as a backward pass keeps it: the received 8-bit wire
    messages when the gather was compressed (about half the bytes of bf16, as
    Transformer Engine keeps FP8 residuals), else the result itself. `value()` gives
    the result either way.

    Attributes:
      arrays: the (ranks, rows, W) uint8 chunk messages, or the one result array.
      decoder: what decodes the messages (None: `arrays` holds the result).
    """

    arrays: tuple[jax.Array, ...]
    decoder: _GatherDecoder | None = dataclasses.field(metadata=dict(static=True))

    def value(self) -> jax.Array:
        """The all-gather result (decoded again from the messages where compressed)."""
        return self.arrays[0] if self.decoder is None else self.decoder(self.arrays)


@dataclasses.dataclass(frozen=True)
class _GatherDecoder:
    """Decodes all-gathered chunk messages of per-rank arrays of `shape` into the
    all-gather result (`lax.all_gather` layout)."""

    plan: WirePlan
    shape: tuple[int, ...]
    dtype: Any
    axis: int
    tiled: bool
    kernel_mode: str

    def __call__(self, received: tuple[jax.Array, ...]) -> jax.Array:
        spec, shape, axis = self.plan.spec, self.shape, self.axis
        bounds = chunk_bounds(group_count(shape, spec.group_size), len(received))
        rows = _concatenated(
            [
                decode(r[:, None], b - a, spec, self.dtype, self.kernel_mode)
                for r, (a, b) in zip(received, bounds, strict=True)
            ],
            axis=1,
        )
        out = jnp.moveaxis(self.plan.from_wire_order(from_rows(rows, shape, 1)), 0, axis)
        if self.tiled:
            out = out.reshape(*shape[:axis], received[0].shape[0] * shape[axis], *shape[axis + 1 :])
        return out


def run_all_gather(
    x: jax.Array, call: Call, *, direction: str, axis: int = 0, tiled: bool = True
) -> tuple[jax.Array, GatherResidual]:
    """One direction of `all_gather` (no gradient rule): the gathered array and what a
    backward pass keeps of it.

    Raises:
      ValueError: `axis` out of range.
    """
    ranks = lax.axis_size(call.axis_name)
    axis = check_axis(axis, x.ndim if tiled else x.ndim + 1, "axis")
    plain_sent = (ranks - 1) * x.size * x.dtype.itemsize
    plan = plan_message(x, call, op="all_gather", direction=direction)
    record = functools.partial(
        record_collective,
        x,
        site=call.site_of("all_gather"),
        op="all_gather",
        direction=direction,
        axis_name=call.axis_name,
        plain_sent=plain_sent,
    )
    if plan is None:
        record(spec=None, sent=plain_sent)
        gathered = _plain_all_gather(x, call.axis_name, axis, tiled)
        return gathered, GatherResidual((gathered,), None)
    rows = to_rows(plan.to_wire_order(x), plan.spec.group_size, 0)
    kernel_mode = call.config.kernel_mode
    received = tuple(
        gather_stacked(encode(rows[a:b], plan.spec, kernel_mode), call.axis_name)
        for a, b in plan.chunk_bounds(rows.shape[0])
    )
    record(spec=plan.spec, sent=(ranks - 1) * plan.message_bytes(rows.shape[0]))
    residual = GatherResidual(received, _GatherDecoder(plan, tuple(x.shape), x.dtype, axis, tiled, kernel_mode))
    return residual.value(), residual


def _plain_all_gather(x: jax.Array, axis_name: str, axis: int, tiled: bool) -> jax.Array:
    if x.size:
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    shape = list(x.shape)
    if tiled:
        shape[axis] *= lax.axis_size(axis_name)
    else:
        shape.insert(axis, lax.axis_size(axis_name))
    return _empty_result(x, tuple(shape), axis_name)


# ----------------------------------------------------------------------------- reduce-scatter


def run_reduce_scatter(
    x: jax.Array, call: Call, *, direction: str, dimension: int = 0, tiled: bool = True
) -> jax.Array:
    """One direction of `reduce_scatter` over `dimension` (no gradient rule).

    Raises:
      ValueError: the dimension does not divide by (or equal) the axis size, or a
        channel permutation on a site that scatters along the channel axis.
    """
    ranks = lax.axis_size(call.axis_name)
    dim = check_axis(dimension, x.ndim, "scatter_dimension")
    size = x.shape[dim]
    if (tiled and size % ranks) or (not tiled and size != ranks):
        need = f"divisible by {ranks}" if tiled else f"equal to {ranks}"
        raise ValueError(f"scatter_dimension {dim} of shape {x.shape} has size {size}, must be {need} (axis size)")
    plain_sent = (ranks - 1) * x.size * x.dtype.itemsize // ranks
    plan = plan_message(x, call, op="reduce_scatter", direction=direction, moves_channels=dim == x.ndim - 1)
    record = functools.partial(
        record_collective,
        x,
        site=call.site_of("reduce_scatter"),
        op="reduce_scatter",
        direction=direction,
        axis_name=call.axis_name,
        plain_sent=plain_sent,
    )
    block_shape = (*x.shape[:dim], *((size // ranks,) if tiled else ()), *x.shape[dim + 1 :])
    if plan is None:
        record(spec=None, sent=plain_sent)
        if not x.size:
            return _empty_result(x, block_shape, call.axis_name)
        return lax.psum_scatter(x, call.axis_name, scatter_dimension=dim, tiled=tiled)
    moved = jnp.moveaxis(plan.to_wire_order(x), dim, 0)
    chunk_shape = (size // ranks, *moved.shape[1:]) if tiled else moved.shape[1:]
    rows = to_rows(moved.reshape(ranks, *chunk_shape), plan.spec.group_size, 1)
    pieces = [_reduce_scatter_rows(rows[:, a:b], call, plan.spec, x.dtype) for a, b in plan.chunk_bounds(rows.shape[1])]
    record(spec=plan.spec, sent=(ranks - 1) * plan.message_bytes(rows.shape[1]))
    out = plan.from_wire_order(from_rows(_concatenated(pieces, axis=0), chunk_shape, 0))
    return jnp.moveaxis(out, 0, dim) if tiled else out


def _reduce_scatter_rows(rows: jax.Array, call: Call, spec: QuantSpec, dtype: Any) -> jax.Array:
    """(ranks, n, G) rows, one block per destination -> this rank's (n, G) block of the sum."""
    kernel_mode = call.config.kernel_mode
    received = exchange_blocks(encode(rows, spec, kernel_mode), call.axis_name)
    return decode(received[None], rows.shape[1], spec, dtype, kernel_mode)[0]


# ----------------------------------------------------------------------------- all-reduce


def run_all_reduce(x: jax.Array, call: Call, *, direction: str, algorithm: str = "auto") -> jax.Array:
    """One direction of `all_reduce` (no gradient rule)."""
    ranks = lax.axis_size(call.axis_name)
    plain_sent = ring_all_reduce_bytes(x.size * x.dtype.itemsize, ranks)
    plan = plan_message(x, call, op="all_reduce", direction=direction, algorithm=algorithm)
    if plan is None:
        record_collective(
            x,
            site=call.site_of("all_reduce"),
            op="all_reduce",
            direction=direction,
            axis_name=call.axis_name,
            spec=None,
            sent=plain_sent,
            plain_sent=plain_sent,
        )
        return lax.psum(x, call.axis_name)
    rows = to_rows(plan.to_wire_order(x), plan.spec.group_size, 0)
    exchange = _one_shot if plan.algorithm == "one_shot" else _two_shot
    out, sent = exchange(rows, call, plan, x.dtype)
    op = f"all_reduce_{plan.algorithm}"  # the ledger names the algorithm
    record_collective(
        x,
        site=call.site_of(op),
        op=op,
        direction=direction,
        axis_name=call.axis_name,
        spec=plan.spec,
        sent=(ranks - 1) * sent,
        plain_sent=plain_sent,
    )
    return plan.from_wire_order(from_rows(out, x.shape, 0))


def _one_shot(rows: jax.Array, call: Call, plan: WirePlan, dtype: Any) -> tuple[jax.Array, int]:
    """All-gather every rank's messages, decode their sum: (n, G) sum, bytes per peer."""
    spec, kernel_mode = plan.spec, call.config.kernel_mode
    pieces = []
    for a, b in plan.chunk_bounds(rows.shape[0]):
        received = gather_invariant(encode(rows[a:b], spec, kernel_mode), call.axis_name)
        pieces.append(decode(received[None], b - a, spec, dtype, kernel_mode)[0])
    return _concatenated(pieces, axis=0), plan.message_bytes(rows.shape[0])


def _two_shot(rows: jax.Array, call: Call, plan: WirePlan, dtype: Any) -> tuple[jax.Array, int]:
    """Reduce-scatter, requantize the reduced block, all-gather it: (n, G) sum, bytes
    per peer."""
    spec, kernel_mode = plan.spec, call.config.kernel_mode
    blocks = rank_blocks(rows, lax.axis_size(call.axis_name))
    per_rank = blocks.shape[1]
    pieces = []
    for a, b in plan.chunk_bounds(per_rank):
        received = exchange_blocks(encode(blocks[:, a:b], spec, kernel_mode), call.axis_name)
        gathered = gather_invariant(requantize(received, b - a, spec, kernel_mode), call.axis_name)
        pieces.append(decode(gathered[:, None], b - a, spec, dtype, kernel_mode))
    out = _concatenated(pieces, axis=1)
    return out.reshape(-1, spec.group_size)[: rows.shape[0]], 2 * plan.message_bytes(per_rank)


# ----------------------------------------------------------------------------- ppermute


def run_ppermute(x: jax.Array, call: Call, *, direction: str, pairs: tuple[tuple[int, int], ...]) -> jax.Array:
    """One direction of `ppermute` (no gradient rule), compressed with the direction's
    spec where the config compresses a message of its size (no calibration plans:
    point-to-point sends)."""
    nbytes = x.size * x.dtype.itemsize
    spec = call.spec(direction)
    compressed = compressible(x, call.config)
    rows = to_rows(x, spec.group_size, 0) if compressed else x
    record_collective(
        x,
        site=call.site_of("ppermute"),
        op="ppermute",
        direction=direction,
        axis_name=call.axis_name,
        spec=spec if compressed else None,
        plain_sent=nbytes,
        sent=message_layout(rows.shape[0], spec).nbytes if compressed else nbytes,
    )
    if not compressed:
        return lax.ppermute(per_rank(x, call.axis_name), call.axis_name, pairs)
    kernel_mode = call.config.kernel_mode
    message = per_rank(encode(rows, spec, kernel_mode), call.axis_name)
    received = lax.ppermute(message, call.axis_name, pairs)
    return from_rows(decode(received[None, None], rows.shape[0], spec, x.dtype, kernel_mode)[0], x.shape, 0)


# ----------------------------------------------------------------------------- differentiable API


# True while a differentiable op is being called (not re-traced by JAX later).
_CALLING = TraceScope("differentiable op called", False)


@contextlib.contextmanager
def forward_recording() -> Iterator[None]:
    """Around the forward body of a `custom_vjp` op: its messages are recorded in the
    wire ledger only while the op is being called (`called`). JAX may trace the
    forward rule once more later (differentiating a scan traces its body's primal and
    then its forward rule), and that second trace sends nothing more."""
    with contextlib.nullcontext() if _CALLING.get() else accounting.paused():
        yield


def called(op: Callable[..., Any], *args: Any) -> Any:
    """`op(*args)`, a `custom_vjp` op whose forward body is in `forward_recording`."""
    with _CALLING.set(True):
        return op(*args)


def straight_through(forward: Callable[..., jax.Array], backward: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A differentiable op `op(x, call, **options)` = `forward(x, call, **options)` whose
    cotangent is `backward(cotangent, call, **options)`: an explicit rule, so autodiff
    never differentiates the quantizer. `options` are hashable non-array keywords. The
    forward messages are recorded once (`forward_recording`)."""

    def counted_forward(x, call, options):
        with forward_recording():
            return forward(x, call, **dict(options))

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def op(x, call, options):
        return counted_forward(x, call, options)

    op.defvjp(
        lambda x, call, options: (counted_forward(x, call, options), None),
        lambda call, options, _, ct: (backward(ct, call, **dict(options)),),
    )

    def apply(x: jax.Array, call: Call, **options: Any) -> jax.Array:
        return called(op, x, call, tuple(sorted(options.items())))

    return apply


def _all_reduce_transpose(cotangent: jax.Array, call: Call, *, algorithm: str) -> jax.Array:
    if checks_vma(call.axis_name):  # the transpose of an invariant sum is a broadcast (lax.psum's too)
        return vary(cotangent, (call.axis_name,))
    return run_all_reduce(cotangent, call, direction="backward", algorithm=algorithm)


_all_gather = straight_through(
    lambda x, call, axis, tiled: run_all_gather(x, call, direction="forward", axis=axis, tiled=tiled)[0],
    lambda ct, call, axis, tiled: run_reduce_scatter(ct, call, direction="backward", dimension=axis, tiled=tiled),
)
_reduce_scatter = straight_through(
    lambda x, call, dimension, tiled: run_reduce_scatter(
        x, call, direction="forward", dimension=dimension, tiled=tiled
    ),
    lambda ct, call, dimension, tiled: run_all_gather(ct, call, direction="backward", axis=dimension, tiled=tiled)[0],
)
_all_reduce = straight_through(
    lambda x, call, algorithm: run_all_reduce(x, call, direction="forward", algorithm=algorithm),
    _all_reduce_transpose,
)
_ppermute = straight_through(
    lambda x, call, pairs: run_ppermute(x, call, direction="forward", pairs=pairs),
    lambda ct, call, pairs: run_ppermute(ct, call, direction="backward", pairs=tuple((dst, src) for src, dst in pairs)),
)


def all_gather(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    axis: int = 0,
    tiled: bool = True,
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
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
    call = Call(axis_name=axis_name, config=config, site=site, calibration=calibration)
    return _all_gather(vary(x, (axis_name,)), call, axis=axis, tiled=tiled)


def reduce_scatter(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    scatter_dimension: int = 0,
    tiled: bool = True,
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
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
    call = Call(axis_name=axis_name, config=config, site=site, calibration=calibration)
    return _reduce_scatter(vary(x, (axis_name,)), call, dimension=scatter_dimension, tiled=tiled)


def all_reduce(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    algorithm: str = "auto",
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
    """Compressed `lax.psum` over `axis_name`.

    "two_shot": compressed reduce-scatter (sum in float32 in the transformed domain),
    requantize the reduced block once, compressed all-gather, one inverse transform.
    "one_shot": compressed all-gather of everything, dequantize-and-sum (small messages).
    "auto": the config's link profile decides (`TacoConfig.link`); without one,
    `policy.default_algorithm` (one-shot at two ranks; beyond, on GPUs one-shot under
    `policy.ONE_SHOT_MAX_BYTES` per rank, elsewhere two-shot, which sends fewer bytes). An explicit algorithm is used wherever the message is compressed. Gradient
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
    call = Call(axis_name=axis_name, config=config, site=site, calibration=calibration)
    check_algorithm(algorithm)
    return _all_reduce(vary(x, (axis_name,)), call, algorithm=algorithm)


def ppermute(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    perm: Any,
    site: str | None = None,
) -> jax.Array:
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
    call = Call(axis_name=axis_name, config=config, site=site)
    pairs = tuple((int(src), int(dst)) for src, dst in perm)
    for position, name in ((0, "source"), (1, "destination")):
        ranks = [pair[position] for pair in pairs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ppermute: a rank appears twice as a {name} in perm {pairs}")
    return _ppermute(vary(x, (axis_name,)), call, pairs=pairs)
