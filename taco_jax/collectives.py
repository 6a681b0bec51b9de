"""Compressed tensor-parallel collectives for use inside `jax.shard_map(check_vma=False)`.

Each collective has the result of its `jax.lax` counterpart within codec error. What
crosses the wire is one uint8 buffer per message holding the 8-bit payload and the
per-group scales (bitcast, so every backend moves one byte per element). Reductions
dequantize to float32 and sum in the transformed domain; the inverse transform runs once.

Layout: a message is viewed as rows of G elements of its last axis (the last axis is
zero-padded to a multiple of G), so any shape the lax collective accepts works and the
groups are the codec's groups.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import formats
from taco_jax import accounting
from taco_jax import calibration as calibration_lib
from taco_jax.calibration import Calibration
from taco_jax.codec import Compressed, compress, decompress, decompress_sum, requantize_sum
from taco_jax.spec import QuantSpec, TacoConfig

ALGORITHMS = ("one_shot", "two_shot", "auto")
# Under this size (input bytes per rank) "auto" picks the one-shot all-reduce: a single
# all-gather step costs less latency than the two steps of the two-shot algorithm.
ONE_SHOT_MAX_BYTES = 1 << 20


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


def _as_bytes(a: jax.Array, lead: int) -> jax.Array:
    return lax.bitcast_convert_type(a, jnp.uint8).reshape(*a.shape[:lead], -1)


def _pack(c: Compressed, lead: int) -> jax.Array:
    """Payload and scales as one uint8 buffer per leading index: (*lead_dims, nbytes)."""
    payload = formats.pack_nibbles(c.payload) if c.spec.element_bits == 4 else c.payload
    return jnp.concatenate([_as_bytes(payload, lead), _as_bytes(c.scales, lead)], axis=-1)


def _from_bytes(buf: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    itemsize = jnp.dtype(dtype).itemsize
    buf = buf.reshape(*shape, itemsize) if itemsize > 1 else buf.reshape(shape)
    return lax.bitcast_convert_type(buf, dtype)


def _unpack(buf: jax.Array, template: Compressed) -> Compressed:
    """Invert `_pack`; `template` has the per-message (unbatched) shapes."""
    lead_shape = buf.shape[:-1]
    payload_bytes = template.payload.size * template.spec.element_bits // 8
    if template.spec.element_bits == 4:
        packed = buf[..., :payload_bytes].reshape(*lead_shape, *template.payload.shape[:-1], -1)
        payload = formats.unpack_nibbles(packed)
    else:
        payload = _from_bytes(buf[..., :payload_bytes], (*lead_shape, *template.payload.shape), template.payload.dtype)
    scales = _from_bytes(buf[..., payload_bytes:], (*lead_shape, *template.scales.shape), template.scales.dtype)
    return Compressed(payload, scales, (*lead_shape, *template.shape), template.dtype, template.spec)


def _template(rows_shape: tuple[int, ...], dtype: jnp.dtype, spec: QuantSpec) -> Compressed:
    return jax.eval_shape(lambda r: compress(r, spec), jax.ShapeDtypeStruct(rows_shape, dtype))


# ----------------------------------------------------------------------------- policy


def _spec_for(x: jax.Array, config: TacoConfig, direction: str) -> QuantSpec | None:
    """The spec to compress `x` with, or None to send it uncompressed."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or not config.compresses(x.size * x.dtype.itemsize):
        return None
    return config.forward if direction == "forward" else config.backward


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
        raise ValueError(f"calibration of site {site!r} permutes {len(plan.perm)} channels, "
                         f"but the message has {channels}")
    return plan.spec(spec), None if plan.is_identity else plan


def _wire_view(x, config, direction, op, site, calibration, channel_axis_used=False):
    """(x in wire channel order, spec, inverse permutation or None); spec None = send
    `x` uncompressed. Reports `x` to an active calibration collector."""
    spec = _spec_for(x, config, direction)
    if spec is None:
        return x, None, None
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


def _record(site, op, direction, x, ranks, spec, sent, plain_sent) -> None:
    accounting.record(
        accounting.WireRecord(
            site=site or op, op=op, direction=direction, shape=tuple(x.shape), dtype=jnp.dtype(x.dtype).name,
            ranks=ranks, compressed=spec is not None, sent_bytes=int(sent), uncompressed_sent_bytes=int(plain_sent),
        )
    )


def _check_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"{what}={axis} is out of range for an array of rank {ndim}")
    return axis % max(ndim, 1)


# ----------------------------------------------------------------------------- implementations


def gather_and_received(
    x, axis_name, config, direction, axis, tiled, site, calibration=None
) -> tuple[jax.Array, jax.Array]:
    """The all-gather result and what crossed the wire: the (ranks, nbytes) uint8
    buffers when compressed (decode again with `decode_gathered`), else the result."""
    ranks = lax.axis_size(axis_name)
    axis = _check_axis(axis, x.ndim if tiled else x.ndim + 1, "axis")
    plain_sent = (ranks - 1) * x.size * x.dtype.itemsize
    wire, spec, inverse = _wire_view(x, config, direction, "all_gather", site, calibration)
    if spec is None:
        _record(site, "all_gather", direction, x, ranks, None, plain_sent, plain_sent)
        gathered = lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
        return gathered, gathered
    received = gather_packed(wire, axis_name, spec)
    _record(site, "all_gather", direction, x, ranks, spec, (ranks - 1) * received.shape[1], plain_sent)
    return decode_gathered(received, x.shape, x.dtype, spec, axis, tiled, inverse), received


def _gather(x, axis_name, config, direction, axis, tiled, site, calibration=None):
    return gather_and_received(x, axis_name, config, direction, axis, tiled, site, calibration)[0]


def gather_packed(x: jax.Array, axis_name: str, spec: QuantSpec) -> jax.Array:
    """Compress `x` and all-gather it: the (ranks, nbytes) uint8 buffers as received."""
    return lax.all_gather(_pack(compress(_to_rows(x, spec.group_size, 0), spec), 0), axis_name, axis=0, tiled=False)


def decode_gathered(
    received: jax.Array,
    shape: tuple[int, ...],
    dtype: jnp.dtype,
    spec: QuantSpec,
    axis: int,
    tiled: bool,
    inverse_perm: np.ndarray | None = None,
) -> jax.Array:
    """Decode `gather_packed` buffers of per-rank arrays of `shape` into the all-gather
    result (`lax.all_gather` layout), undoing a channel permutation if given."""
    ranks = received.shape[0]
    last = shape[-1] if shape else 1
    rows = (math.prod(shape[:-1]) * -(-last // spec.group_size), spec.group_size)
    pieces = _unpermute(_from_rows(decompress(_unpack(received, _template(rows, dtype, spec))), shape, 1), inverse_perm)
    out = jnp.moveaxis(pieces, 0, axis)
    if tiled:
        out = out.reshape(*shape[:axis], ranks * shape[axis], *shape[axis + 1 :])
    return out


def _exchange(chunks: jax.Array, axis_name: str, spec: QuantSpec) -> tuple[Compressed, int]:
    """Compress k chunks (leading axis) and all-to-all them. Returns (the k compressed
    chunks this rank received, bytes sent per rank)."""
    ranks = chunks.shape[0]
    received = lax.all_to_all(_pack(compress(chunks, spec), 1), axis_name, 0, 0, tiled=True)
    template = _template(chunks.shape[1:], chunks.dtype, spec)
    return _unpack(received, template), (ranks - 1) * template.nbytes


def _scatter(x, axis_name, config, direction, scatter_dimension, tiled, site, calibration=None):
    ranks = lax.axis_size(axis_name)
    dim = _check_axis(scatter_dimension, x.ndim, "scatter_dimension")
    size = x.shape[dim]
    if (tiled and size % ranks) or (not tiled and size != ranks):
        need = f"divisible by {ranks}" if tiled else f"equal to {ranks}"
        raise ValueError(f"scatter_dimension {dim} of shape {x.shape} has size {size}, must be {need} (axis size)")
    plain_sent = (ranks - 1) * x.size * x.dtype.itemsize // ranks
    wire, spec, inverse = _wire_view(x, config, direction, "reduce_scatter", site, calibration, dim == x.ndim - 1)
    if spec is None:
        _record(site, "reduce_scatter", direction, x, ranks, None, plain_sent, plain_sent)
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)
    moved = jnp.moveaxis(wire, dim, 0)
    chunk_shape = (size // ranks, *moved.shape[1:]) if tiled else moved.shape[1:]
    chunks = _to_rows(moved.reshape(ranks, *chunk_shape), spec.group_size, 1)
    shards, sent = _exchange(chunks, axis_name, spec)
    _record(site, "reduce_scatter", direction, x, ranks, spec, sent, plain_sent)
    out = _unpermute(_from_rows(decompress_sum(shards), chunk_shape, 0), inverse)
    return jnp.moveaxis(out, 0, dim) if tiled else out


def _reduce(x, axis_name, config, direction, algorithm, site, calibration=None):
    ranks = lax.axis_size(axis_name)
    nbytes = x.size * x.dtype.itemsize
    plain_sent = 2 * (ranks - 1) * nbytes // ranks
    wire, spec, inverse = _wire_view(x, config, direction, "all_reduce", site, calibration)
    if spec is None:
        _record(site, "all_reduce", direction, x, ranks, None, plain_sent, plain_sent)
        return lax.psum(x, axis_name)
    return _unpermute(_reduce_compressed(wire, axis_name, spec, direction, algorithm, site, ranks, plain_sent), inverse)


def _reduce_compressed(x, axis_name, spec, direction, algorithm, site, ranks, plain_sent):
    nbytes = x.size * x.dtype.itemsize
    if algorithm == "auto":
        algorithm = "one_shot" if nbytes < ONE_SHOT_MAX_BYTES else "two_shot"
    rows = _to_rows(x, spec.group_size, 0)
    if algorithm == "one_shot":
        c = compress(rows, spec)
        _record(site, "all_reduce_one_shot", direction, x, ranks, spec, (ranks - 1) * c.nbytes, plain_sent)
        received = lax.all_gather(_pack(c, 0), axis_name, axis=0, tiled=False)
        return _from_rows(decompress_sum(_unpack(received, c)), x.shape, 0)
    count = rows.shape[0]
    per_rank = -(-count // ranks)
    rows = jnp.pad(rows, [(0, ranks * per_rank - count), (0, 0)])
    shards, sent = _exchange(rows.reshape(ranks, per_rank, spec.group_size), axis_name, spec)
    reduced = requantize_sum(shards)
    _record(site, "all_reduce_two_shot", direction, x, ranks, spec, sent + (ranks - 1) * reduced.nbytes, plain_sent)
    gathered = lax.all_gather(_pack(reduced, 0), axis_name, axis=0, tiled=False)
    out = decompress(_unpack(gathered, reduced)).reshape(-1, spec.group_size)[:count]
    return _from_rows(out, x.shape, 0)


# ----------------------------------------------------------------------------- differentiable API


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _all_gather(x, axis_name, config, axis, tiled, site, calibration):
    return _gather(x, axis_name, config, "forward", axis, tiled, site, calibration)


def _all_gather_fwd(x, axis_name, config, axis, tiled, site, calibration):
    return _all_gather(x, axis_name, config, axis, tiled, site, calibration), None


def _all_gather_bwd(axis_name, config, axis, tiled, site, calibration, _, cotangent):
    return (_scatter(cotangent, axis_name, config, "backward", axis, tiled, site, calibration),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _reduce_scatter(x, axis_name, config, scatter_dimension, tiled, site, calibration):
    return _scatter(x, axis_name, config, "forward", scatter_dimension, tiled, site, calibration)


def _reduce_scatter_fwd(x, axis_name, config, scatter_dimension, tiled, site, calibration):
    return _reduce_scatter(x, axis_name, config, scatter_dimension, tiled, site, calibration), None


def _reduce_scatter_bwd(axis_name, config, scatter_dimension, tiled, site, calibration, _, cotangent):
    return (_gather(cotangent, axis_name, config, "backward", scatter_dimension, tiled, site, calibration),)


_reduce_scatter.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _all_reduce(x, axis_name, config, algorithm, site, calibration):
    return _reduce(x, axis_name, config, "forward", algorithm, site, calibration)


def _all_reduce_fwd(x, axis_name, config, algorithm, site, calibration):
    return _all_reduce(x, axis_name, config, algorithm, site, calibration), None


def _all_reduce_bwd(axis_name, config, algorithm, site, calibration, _, cotangent):
    return (_reduce(cotangent, axis_name, config, "backward", algorithm, site, calibration),)


_all_reduce.defvjp(_all_reduce_fwd, _all_reduce_bwd)


def check_arguments(config: TacoConfig, calibration: Calibration | None, algorithm: str = "auto") -> None:
    """Raise ValueError unless `config` is a `TacoConfig`, `calibration` None or a
    `Calibration`, and `algorithm` one of `ALGORITHMS`."""
    if not isinstance(config, TacoConfig):
        raise ValueError(f"config must be a TacoConfig, got {type(config).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a taco_jax.calibration.Calibration, got {type(calibration).__name__}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {list(ALGORITHMS)}")


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
    check_arguments(config, calibration)
    return _all_gather(x, axis_name, config, axis, tiled, site, calibration)


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
    check_arguments(config, calibration)
    return _reduce_scatter(x, axis_name, config, scatter_dimension, tiled, site, calibration)


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
    "auto": one-shot under `ONE_SHOT_MAX_BYTES` per rank, else two-shot. The backward
    pass all-reduces the cotangent the same way with `config.backward` (the transpose of
    psum, as `lax.psum` differentiates under `check_vma=False`).

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
    return _all_reduce(x, axis_name, config, algorithm, site, calibration)
