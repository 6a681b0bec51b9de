"""The wire message and the math that writes it: the one uint8 buffer a compressed
collective moves, the plain-jnp definition of TACO's per-group quantization (ASHT + DSQ)
that fills it, and the Walsh-Hadamard transform.

**The message** carries N groups of G elements. It is a (rows, W) uint8 array,
W = G * bits / 8 bytes per payload row:

    rows [0, N)              payload: group i's codes in row i, packed by the format
                             (`formats.WireFormat.pack`: 8-bit codes as they are; fewer
                             bits in words of lcm(bits, 8) bits, the earliest code in the
                             lowest bits: 4-bit codes two per byte, 6-bit codes four per
                             three bytes)
    rows [N, N + scale_rows) scales: the N * S scale bytes, group after group (S bytes per
                             group, `formats.ScaleFormat.bytes_per_group`), zero-padded to
                             whole rows

Leading axes (the ranks of a gather, the destinations of an all-to-all, the chunks of a
pipelined collective) are free. The Pallas kernels write the payload rows straight into
the buffer (the scale rows, 1-6% of it, are placed after them in place) and read the
payload rows straight from a received buffer, so nothing is copied between the kernels
and the collective. The jnp path builds and reads the same bytes with `pack` and
`payload_of` / `scales_of`.

**Per-group quantization.** For each group g of G contiguous values along the last axis (all arithmetic in float32):

  e = binade of absmax(g)               g_n = g * 2**-e has absmax in [0.5, 1) (e stops
                                        at 126): its square cannot overflow or underflow
  a = fmt_max / rms(g)                  adaptive pre-scale, = (fmt_max / rms(g_n)) * 2**-e,
                                        clamped to [2**-100, 2**100] so it stays finite
                                        for all-zero and subnormal groups
  y = H(a * g) = H(g_n) * (a * 2**e)    normalized Walsh-Hadamard transform (optional);
                                        transforming g_n keeps every intermediate in range
  s = max(absmax(y) / fmt_max, 2**-126) quantization scale
  q = cast(clip(y / s))                 payload on the wire format's grid, to nearest even

and the receiver computes g = H(q) * (s / a). Unlike the authors' clamps of a to
[1e-3, 1e3] and s to [1e-12, 1e6], nothing saturates or flushes for any float32 value
from about 1e-35 up to the float32 maximum. A NaN or Inf in a group makes that group's
pre-scale, hence its scale, NaN, so the whole group decodes to NaN: bad values propagate,
they are never zeroed or turned into finite numbers.

Scale encodings (`formats.ScaleFormat`, by name in `formats.SCALE_ENCODINGS`): "dual"
sends (a, s); "single" sends s / a; "bf16" sends s / a rounded up to bfloat16 and "e8m0"
rounded up to a power of two; for those two the payload is computed against the rounded
scale.

The per-step functions below work on any (..., G) block, whole or split into pieces, so
the Pallas kernels call them on their tiles and replace only the transform.

**The transform** H, over groups of the last axis, comes as the jnp path (used off GPU
and wherever the kernels are not chosen), the ±1 matrix of the kernels' "matmul" method,
and the kernels' tile-free transforms ("lanes", "pairs"), written in jnp ops that the
Pallas Triton lowering turns into register and warp-shuffle code.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import formats, jax_compat

# ----------------------------------------------------------------------------- the transform

VECTOR = 8  # bf16 values in one 16-byte load: what one GPU thread reads of a row at a time


def _check_power_of_two(size: int) -> None:
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")


@functools.cache
def hadamard_matrix(size: int) -> np.ndarray:
    """The unnormalized Sylvester Hadamard matrix of +-1 entries.

    Args:
      size: a power of two.

    Returns:
      A (size, size) float32 numpy array H with H @ H.T == size * I. It is symmetric, so
      the normalized transform H / sqrt(size) is its own inverse.

    Raises:
      ValueError: size is not a power of two.
    """
    _check_power_of_two(size)
    matrix = np.ones((1, 1), np.float32)
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    matrix.setflags(write=False)
    return matrix


def hadamard_transform(groups: jax.Array) -> jax.Array:
    """Normalized Walsh-Hadamard transform of the last axis (its own inverse).

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      H @ g / sqrt(G) for every group g, float32, same shape.
    """
    size = groups.shape[-1]
    matrix = jnp.asarray(hadamard_matrix(size))
    # The +-1 matrix is exact; HIGHEST keeps the f32 dot out of TF32/bf16 passes.
    transformed = jnp.einsum("...g,gh->...h", groups, matrix, precision=jax.lax.Precision.HIGHEST)
    return transformed * np.float32(1.0 / np.sqrt(size))


def hadamard_butterfly(groups: jax.Array) -> jax.Array:
    """groups @ H (unnormalized, Sylvester order) over the last axis, as log2(G) stages of
    sums and differences: each stage pairs the first half of the axis with the second and
    interleaves the sums with the differences (the constant-geometry fast transform).

    Only reshape, split and stack, which the Pallas Triton lowering supports; every stage
    is exact up to float32 rounding of the sums. On a whole tile each stage is a layout
    conversion through shared memory, so the kernels use it only within a thread's
    vector (`hadamard_lanes`).

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      float32 array of the same shape.
    """
    *lead, size = groups.shape
    _check_power_of_two(size)
    half = size // 2
    for _ in range(size.bit_length() - 1):
        low, high = (part.reshape(*lead, half) for part in jnp.split(groups.reshape(*lead, 2, half), 2, axis=-2))
        groups = jnp.stack([low + high, low - high], axis=-1).reshape(*lead, size)
    return groups


def _pair_stages(values: jax.Array, axes: range) -> jax.Array:
    """Sylvester stages along size-2 `axes`: (low, high) -> (low + high, low - high).

    Each element gets its partner from a sum over the pair of the float32 bits as int32
    (exact, wrapping): on a GPU, an axis spread over a warp's lanes is one warp shuffle,
    with no trip through shared memory. Then partner + sign * value, sign = +1 for low
    and -1 for high: exactly low + high and low - high."""
    for axis in axes:
        bits = lax.bitcast_convert_type(values, jnp.int32)
        partner = lax.bitcast_convert_type(jnp.sum(bits, axis=axis, keepdims=True) - bits, jnp.float32)
        sign = (1 - 2 * lax.broadcasted_iota(jnp.int32, values.shape, axis)).astype(jnp.float32)
        values = values * sign + partner
    return values


def hadamard_lanes(groups: jax.Array) -> jax.Array:
    """groups @ H (unnormalized, Sylvester order) over the last axis, laid out for a GPU
    thread holding one 16-byte vector (`VECTOR` values) of a row and consecutive threads
    the next ones: `hadamard_butterfly` within each vector, then one `_pair_stages` stage
    per remaining bit of the column index (H_G = H_{G/8} x H_8, a Kronecker product).

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      float32 array of the same shape.
    """
    *lead, size = groups.shape
    _check_power_of_two(size)
    inner = min(size, VECTOR)
    pairs = (size // inner).bit_length() - 1
    within = hadamard_butterfly(groups.reshape(*lead, size // inner, inner))
    stacked = within.reshape(*lead, *(2,) * pairs, inner)
    return _pair_stages(stacked, range(len(lead), len(lead) + pairs)).reshape(*lead, size)


def hadamard_pairs(groups: jax.Array) -> jax.Array:
    """groups @ H (unnormalized, Sylvester order) over the last axis: the axis seen as
    log2 G axes of size 2, one `_pair_stages` stage each (no reshape between stages).

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      float32 array of the same shape.
    """
    *lead, size = groups.shape
    _check_power_of_two(size)
    bits = size.bit_length() - 1
    stacked = groups.reshape(*lead, *(2,) * bits)
    return _pair_stages(stacked, range(len(lead), len(lead) + bits)).reshape(*lead, size)


def hadamard_across(pieces: list[jax.Array]) -> list[jax.Array]:
    """The Sylvester stages over the high bits of the column index, for groups split along
    the last axis into p pieces each already transformed over its own columns (H_G =
    H_p x H_{G/p}): sums and differences of whole pieces, in a GPU thread's registers.

    Args:
      pieces: p float32 arrays of one shape, p a power of two.

    Returns:
      The p pieces of the transformed groups.
    """
    _check_power_of_two(len(pieces))
    pieces, stride = list(pieces), 1
    while stride < len(pieces):
        for low in (i for i in range(len(pieces)) if not i & stride):
            pieces[low], pieces[low + stride] = pieces[low] + pieces[low + stride], pieces[low] - pieces[low + stride]
        stride *= 2
    return pieces


# ----------------------------------------------------------------------------- stochastic rounding


def dither(keys: jnp.ndarray) -> jnp.ndarray:
    """float32 in [0, 1) per element: a hash of the element's bits in `keys` (float32),
    its position, and the indices of the slice and device the call runs on.

    No key is needed: the same tensor gets the same dither, so a rerun reproduces it bit
    for bit (and a jitted call an eager one, where `keys` are computed alike), and a new
    step's tensor a new one. Each slice of a `jax.vmap` (named or not, as the simulated
    meshes are) and each device of a `jax.shard_map` over which `keys` vary draws its
    own (`_device_salt`), so identical data on two ranks rounds independently.
    """
    return _hashed_uniform(jax.lax.bitcast_convert_type(keys, jnp.uint32), _device_salt(keys))


def _device_salt(keys: jnp.ndarray) -> jnp.ndarray:
    """uint32 mix of this device's index along each manual `shard_map` axis that `keys`
    may vary over: all of them under `check_vma=False`; under `check_vma=True` those
    JAX marks them varying over (an invariant value keeps an invariant rounding). 0
    outside shard_map."""
    salt = jnp.uint32(0)
    for axis in jax.sharding.get_abstract_mesh().manual_axes:
        if jax_compat.checks_vma(axis) and axis not in jax.typeof(keys).mat.varying:
            continue
        salt = _mix32(salt ^ ((jax.lax.axis_index(axis).astype(jnp.uint32) + np.uint32(1)) * np.uint32(0x85EBCA6B)))
    return salt


def _mix32(bits: jnp.ndarray) -> jnp.ndarray:
    """A 32-bit integer finalizer: every input bit flips each output bit about half the time."""
    bits = (bits ^ (bits >> 16)) * np.uint32(0x7FEB352D)
    bits = (bits ^ (bits >> 15)) * np.uint32(0x846CA68B)
    return bits ^ (bits >> 16)


@jax.custom_batching.custom_vmap
def _hashed_uniform(bits: jnp.ndarray, salt: jnp.ndarray) -> jnp.ndarray:
    """float32 in [0, 1) from uint32 `bits`, each element's position in them, and
    `salt` (broadcast against them)."""
    position = jax.lax.iota(jnp.uint32, bits.size).reshape(bits.shape)
    mixed = _mix32(bits ^ (position * np.uint32(0x9E3779B9)) ^ salt)
    return (mixed >> 8).astype(jnp.float32) * np.float32(2.0**-24)


@_hashed_uniform.def_vmap
def _hashed_uniform_batched(axis_size: int, in_batched: list[bool], bits: jnp.ndarray, salt: jnp.ndarray):
    """Under `jax.vmap` the position counts over the whole batch, so every slice draws its
    own dither (a per-slice counter would give identical slices identical draws)."""
    bits_batched, salt_batched = in_batched
    if not bits_batched:
        bits = jnp.broadcast_to(bits, (axis_size, *bits.shape))
    if salt_batched:
        salt = salt.reshape(axis_size, *[1] * (bits.ndim - 1)) if salt.ndim == 1 else salt
    return _hashed_uniform(bits, salt), True


# ----------------------------------------------------------------------------- per-group quantization


def scale_headroom(fmt: formats.WireFormat, group_size: int, transform: bool) -> int:
    """K >= 0 such that a group's decode multiplier s / a, sent as (s / a) * 2**-K, stays
    at most `formats.MAX_SCALE` for every finite float32 group, so that it fits every scale
    encoding; the decode multiplies by 2**K after the (linear) transform.

    s / a = max|y| / max_value, and the normalized transform can raise a group's absmax
    by up to sqrt(G) (all of a constant group lands on one coefficient): at float32's
    largest value the multiplier passes float32's range for the small grids (E2M3,
    E3M2, E2M1, INT4) with the transform. K is 0 for every 8-bit format at G <= 1024
    (the ceiling `QuantSpec` allows), so what the kernels send is unchanged.
    """
    growth = np.sqrt(group_size) if transform else 1.0
    largest_multiplier = growth * float(np.finfo(np.float32).max) / fmt.max_value
    return max(0, int(np.ceil(np.log2(largest_multiplier))) - int(np.log2(formats.MAX_SCALE)))


def cast_to_wire(
    values: jnp.ndarray, fmt: formats.WireFormat, in_kernel: bool = False, draws: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Round float32 values (already divided by their scale) onto the format's grid, in
    its payload dtype.

    Round to nearest, ties to even, after clipping to +-max_value; with `draws` (float32
    in [0, 1), one per value: `dither`), stochastically (`formats.WireFormat.round_stochastically`).
    NaN stays NaN in the float formats; the integers have no NaN, so callers carry NaN
    through the group's scale. `in_kernel`: what suits a Pallas kernel
    (`formats.WireFormat.kernel_cast`).
    """
    if in_kernel:
        return fmt.kernel_cast(values)
    clipped = jnp.clip(values, -fmt.max_value, fmt.max_value)
    rounded = fmt.round_to_nearest(clipped) if draws is None else fmt.round_stochastically(clipped, draws)
    return rounded.astype(fmt.dtype)


PRESCALE_MIN = np.float32(2.0**-100)
PRESCALE_MAX = np.float32(2.0**100)
SCALE_MIN = np.float32(2.0**-126)

# A block of groups, split along the last axis into pieces of equal width: the kernels
# load a group's pieces separately so that each GPU thread holds more of one group
# (`launch.KernelConfig.pieces`); the plain definition passes one piece, the groups.
Pieces = tuple[jax.Array, ...]


def check_scale_format(scale_format: str) -> None:
    """Raise ValueError for an unknown scale format name."""
    formats.scale_format(scale_format)


def normalize_groups(pieces: Pieces, fmt_max: float) -> tuple[Pieces, jax.Array, jax.Array]:
    """Binade-normalize each group and compute its pre-scale.

    Args:
      pieces: the groups as float32 (..., G) arrays, or split along the last axis into
        pieces (..., G / p) whose concatenation is the groups (`row_max_abs`).
      fmt_max: the element format's largest value.

    Returns:
      (normalized, factor, prescale): normalized = the pieces * 2**-shift, whose absmax
      is in [0.5, 1) (up to 8 for groups beyond 2**126, where shift stops so that
      2**-shift stays a normal float32); factor float32 (..., 1) = prescale * 2**shift,
      what takes the normalized values to the pre-scaled groups (`quantize_scaled`);
      prescale float32 (..., 1), NaN (and so factor) for a group holding NaN or Inf.
    """
    absmax = row_max_abs(pieces)
    shift = binade_shift(absmax)
    inverse = formats.pow2(-shift)
    normalized = tuple(piece * inverse for piece in pieces)
    mean_square = row_sum(tuple(piece * piece for piece in normalized)) / np.float32(group_width(pieces))
    prescale = prescale_of(absmax, shift, mean_square, fmt_max)
    return normalized, formats.times_pow2(prescale, shift), prescale


def group_width(pieces: Pieces) -> int:
    """G: the elements of a group over its pieces."""
    return sum(piece.shape[-1] for piece in pieces)


def row_max_abs(pieces: Pieces) -> jax.Array:
    """Each group's absmax (..., 1) over its pieces: elementwise over the pieces first, so a
    GPU thread holding one element of each reduces them in registers, then along the row."""
    return jnp.max(functools.reduce(jnp.maximum, [jnp.abs(piece) for piece in pieces]), axis=-1, keepdims=True)


def row_sum(pieces: Pieces) -> jax.Array:
    """Each group's sum (..., 1) over its pieces, reduced as `row_max_abs`."""
    return jnp.sum(functools.reduce(jnp.add, pieces), axis=-1, keepdims=True)


def binade_shift(absmax: jax.Array) -> jax.Array:
    """int32 e with absmax * 2**-e in [0.5, 1), stopped at 126 (`normalize_groups`)."""
    return jnp.minimum(formats.binade_exponent(absmax), 126)


def prescale_of(absmax: jax.Array, shift: jax.Array, mean_square: jax.Array, fmt_max: float) -> jax.Array:
    """The pre-scale a = fmt_max / rms(g) from a group's absmax, its `binade_shift` and the
    mean square of the normalized group g * 2**-shift; NaN for a group holding NaN or Inf.

    The mean square decides that too: inside a Triton kernel max() ignores NaN (maxnumf),
    so the absmax of a group holding NaN is finite, while the sum of squares of the
    normalized values (each below 8 in magnitude, so it cannot overflow) is NaN or Inf.
    """
    prescale = jnp.clip(
        formats.times_pow2(np.float32(fmt_max) / jnp.sqrt(mean_square), -shift), PRESCALE_MIN, PRESCALE_MAX
    )
    return jnp.where(jnp.isfinite(absmax) & jnp.isfinite(mean_square), prescale, np.float32(np.nan))


def sum_shift(multipliers: Pieces) -> jax.Array:
    """int32 e >= 0 per group (the shape of one multiplier): the binade of the largest of
    its shards' decode multipliers, or 0 below 1.

    Decoding a sum of shards as sum(codes * multiplier * 2**-e), transformed, then times
    2**e keeps every intermediate in float32's range: the products are then at most the
    codes' magnitude, where multipliers near float32's largest (groups near it, and the
    transform spreads them further) overflowed to Inf and Inf - Inf made NaN. Powers of
    two scale exactly, so groups whose multipliers are below 1 (e = 0) and the rest,
    away from float32's limits, decode bit for bit as they would unscaled.
    """
    largest = functools.reduce(jnp.maximum, multipliers)
    return jnp.maximum(formats.binade_exponent(largest), 0)


def quantize_scaled(
    values: Pieces,
    factor: jax.Array,
    prescale: jax.Array,
    fmt: str,
    scale_format: str,
    in_kernel: bool = False,
    stochastic: bool = False,
    headroom: int = 0,
    dither_keys: Pieces | None = None,
) -> tuple[Pieces, tuple]:
    """Quantize pre-scaled (and transformed) groups y = values * factor.

    max|y| is max|values| * factor (exact: rounding is monotonic and factor > 0), and
    the payload is values * (factor / divisor): one multiply per element. `values` are
    binade-normalized groups (`normalize_groups`), or their transform, so that product
    stays near fmt_max / max|values| and finite for every input.

    Args:
      values: the normalized (and transformed) group values, float32 pieces as
        `normalize_groups` takes them.
      factor: float32 (..., 1) > 0 (or NaN), what takes them to y: the pre-scale with
        the binade shift undone (and the transform's normalization).
      prescale: float32 (..., 1), the groups' pre-scale a.
      fmt: wire format name.
      scale_format: scale encoding.
      in_kernel: traced inside a Pallas kernel (`cast_to_wire`).
      stochastic: round stochastically (`formats.WireFormat.round_stochastically`)
        instead of to nearest.
      headroom: K of `scale_headroom`: the scales are sent as s / a * 2**-K.
      dither_keys: what stochastic rounding's dither hashes, pieces like `values` (None:
        `values`). Their bits must come out the same jitted and eager.

    Returns:
      (payload, scale_entries): payload pieces in the format's dtype; scale_entries a
      tuple of (..., 1) arrays: (a, s) for "dual", (s / a,) for "single", (bf16 s / a,)
      for "bf16", (uint8 code,) for "e8m0".
    """
    element = formats.wire_format(fmt)
    absmax = row_max_abs(values) * factor
    divisor, entries = scale_entries(absmax, prescale, fmt, scale_format, headroom)
    multiplier = factor / divisor  # one division per group, then a multiply per element
    # The dither hashes the values before the multiply: their bits are the same jitted
    # and eager, where XLA may compute the pre-scale (hence the product) an ulp apart.
    keys = values if dither_keys is None else dither_keys
    payload = tuple(
        cast_to_wire(piece * multiplier, element, in_kernel, dither(key) if stochastic else None)
        for piece, key in zip(values, keys, strict=True)
    )
    return payload, entries


def scale_entries(
    absmax: jax.Array, prescale: jax.Array, fmt: str, scale_format: str, headroom: int = 0
) -> tuple[jax.Array, tuple]:
    """(divisor, entries) of groups whose pre-scaled values have absmax `absmax`: the
    payload is cast from y / divisor; entries as `quantize_scaled` returns them, for the
    decode multiplier s / a * 2**-headroom (`scale_headroom`).

    A multiplier beyond `formats.MAX_SCALE` (only a requantized sum whose exact value
    passes float32's range reaches one) is held at it: the payload then clips at the
    format's largest value and the group decodes finite, never to Inf or NaN."""
    encoding = formats.scale_format(scale_format)
    if headroom:
        prescale = formats.times_pow2(prescale, jnp.int32(headroom))
    scale = jnp.maximum(absmax / np.float32(formats.wire_format(fmt).max_value), SCALE_MIN)
    scale = jnp.where(scale / prescale > formats.MAX_SCALE, prescale * formats.MAX_SCALE, scale)
    return encoding.encode(prescale, scale)


def pack_scale_entries(entries: tuple, scale_format: str) -> jax.Array:
    """Scale entries (each (..., n, 1)) in the wire layout: (..., n, 2) for "dual",
    (..., n) otherwise (`formats.ScaleFormat.layout`)."""
    return formats.scale_format(scale_format).layout(entries)


def dequantize_scale(scales: jax.Array, scale_format: str) -> jax.Array:
    """Per-group float32 dequantization multiplier (..., n, 1) from the wire scales."""
    return formats.scale_format(scale_format).decode(scales)


def _as_groups(values: jax.Array, group_size: int) -> jax.Array:
    return values.reshape(*values.shape[:-1], values.shape[-1] // group_size, group_size)


def quantize_groups(
    values: jax.Array, *, fmt: str, group_size: int, scale_format: str, transform: bool, stochastic: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Quantize groups of the last axis to a payload in the wire format plus per-group scales.

    Args:
      values: float array (..., C), C divisible by group_size.
      fmt: wire format name (a key of `formats.WIRE_FORMATS`).
      group_size: G, a power of two when transform is True.
      scale_format: "dual", "single", "bf16" or "e8m0".
      transform: apply the Walsh-Hadamard transform after the pre-scale. False for plain
        per-group absmax quantization, or for values already in the transformed domain.
      stochastic: round stochastically instead of to nearest (the formats whose
        `stochastic_rounding` is set).

    Returns:
      (payload, scales): payload (..., C) in the format's dtype; scales float32
      (..., C/G, 2) holding (a, s) for "dual", float32 (..., C/G) holding s / a for
      "single", bfloat16 (..., C/G) for "bf16", uint8 (..., C/G) exponent codes for "e8m0".
    """
    check_scale_format(scale_format)
    element = formats.wire_format(fmt)
    groups = _as_groups(values.astype(jnp.float32), group_size)
    (normalized,), factor, prescale = normalize_groups((groups,), element.max_value)
    transformed = hadamard_transform(normalized) if transform else normalized
    headroom = scale_headroom(element, group_size, transform)
    (payload,), entries = quantize_scaled(
        (transformed,), factor, prescale, fmt, scale_format, stochastic=stochastic, headroom=headroom
    )
    # XLA:GPU removes an f32 -> f8 -> f32 convert pair (excess precision) when the
    # payload is decoded in the same program; the barrier keeps the rounding.
    payload = jax.lax.optimization_barrier(payload)
    return payload.reshape(values.shape), pack_scale_entries(entries, scale_format)


def dequantize_groups(
    payload: jax.Array,
    multiplier: jax.Array,
    *,
    transform: bool,
    out_dtype: jnp.dtype = jnp.float32,
    requantize_to: tuple[str, str] | None = None,
    stochastic: bool = False,
    headroom: int = 0,
):
    """Decode k received messages' groups and sum them: payload (k, N, G) the wire
    format's values (`payload_of`), multiplier (k, N) their scales
    (`dequantize_scale`); the sum runs in float32 in the transformed domain, then one
    inverse transform. With `requantize_to` (fmt, scale format) the sum is quantized again
    instead, as (codes, packed scale entries), and `stochastic` rounds it stochastically.
    A decode multiplies by 2**headroom (`scale_headroom`) last; a requantized sum
    stays in the multipliers' units, which already carry it."""
    if payload.shape[0] == 1 and transform and requantize_to is None:
        # Transform the small payload values first, then scale: no overflow near f32 max.
        decoded = hadamard_transform(payload[0].astype(jnp.float32)) * multiplier[0][:, None]
        return formats.saturating_cast(
            formats.times_pow2(decoded, jnp.int32(headroom)) if headroom else decoded, out_dtype
        )
    shift = sum_shift(tuple(multiplier))[..., None]  # (N, 1)
    summed = jnp.sum(payload.astype(jnp.float32) * formats.times_pow2(multiplier[..., None], -shift), axis=0)
    if requantize_to is not None:
        fmt, scale_format = requantize_to
        groups = summed[:, None, :]  # one group a row, as `quantize_groups` lays them out
        (normalized,), factor, prescale = normalize_groups((groups,), formats.wire_format(fmt).max_value)
        (codes,), entries = quantize_scaled(
            (normalized,),
            factor,
            formats.times_pow2(prescale, -shift[:, None]),
            fmt,
            scale_format,
            stochastic=stochastic,
            # The codes' sum is exact (small integers or short floats in float32), the
            # same jitted and eager, where XLA may fuse the products into the sum.
            dither_keys=(jnp.sum(payload.astype(jnp.float32), axis=0)[:, None, :],) if stochastic else None,
        )
        codes = jax.lax.optimization_barrier(codes).reshape(summed.shape)
        return codes, pack_scale_entries(entries, scale_format)
    if transform:
        summed = hadamard_transform(summed)
    return formats.saturating_cast(formats.times_pow2(summed, shift + headroom), out_dtype)


# ----------------------------------------------------------------------------- the message


@dataclasses.dataclass(frozen=True)
class MessageLayout:
    """Where everything sits in the message of `groups` groups.

    Attributes:
      groups: N, groups (rows of G elements) in the message.
      group_size: G.
      fmt: element format name (`formats.WIRE_FORMATS`).
      scale_format: scale encoding name (`formats.SCALE_ENCODINGS`).
    """

    groups: int
    group_size: int
    fmt: str
    scale_format: str

    def __post_init__(self) -> None:
        check_scale_format(self.scale_format)
        if self.group_size * self.wire_format.bits % 8:
            raise ValueError(f"group size {self.group_size} does not fill whole bytes in format {self.fmt!r}")

    @property
    def wire_format(self) -> formats.WireFormat:
        """The element format."""
        return formats.wire_format(self.fmt)

    @property
    def row_bytes(self) -> int:
        """W: bytes of one group's payload (the buffer's last axis)."""
        return self.wire_format.payload_bytes(self.group_size)

    @property
    def scale_bytes(self) -> int:
        """S: scale bytes per group."""
        return formats.scale_format(self.scale_format).bytes_per_group

    @property
    def scale_rows(self) -> int:
        """Rows holding the scales."""
        return -(-self.groups * self.scale_bytes // self.row_bytes)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, W) of one message."""
        return (self.groups + self.scale_rows, self.row_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of one message on the wire (payload, scales and the scale rows' padding,
        under one row)."""
        return math.prod(self.shape)


def scale_block(scales: jax.Array, layout: MessageLayout, lead_ndim: int) -> jax.Array:
    """The scale rows of messages: typed scales -> uint8 (..., scale_rows, W).

    Args:
      scales: per-group scales of messages with `lead_ndim` leading axes, in the layout
        of `quantize_groups` (any trailing axes after those hold one
        message's N groups in order).
      layout: the message layout.
      lead_ndim: number of leading (message) axes.

    Returns:
      The uint8 scale rows, zero-padded.
    """
    lead = scales.shape[:lead_ndim]
    flat = scales if scales.dtype == jnp.uint8 else lax.bitcast_convert_type(scales, jnp.uint8)
    flat = flat.reshape(*lead, -1)
    pad = layout.scale_rows * layout.row_bytes - flat.shape[-1]
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    return flat.reshape(*lead, layout.scale_rows, layout.row_bytes)


def payload_rows(payload: jax.Array, layout: MessageLayout) -> jax.Array:
    """Typed payload (..., N, G) -> its uint8 rows (..., N, W)."""
    return layout.wire_format.pack(payload)


def pack(payload: jax.Array, scales: jax.Array, layout: MessageLayout) -> jax.Array:
    """A message from a typed payload (..., N, G) and scales (the jnp path; the kernels
    write the buffer directly).

    Returns:
      uint8 (..., rows, W).
    """
    return jnp.concatenate([payload_rows(payload, layout), scale_block(scales, layout, payload.ndim - 2)], axis=-2)


def place_scales(buffer: jax.Array, scales: jax.Array, layout: MessageLayout) -> jax.Array:
    """Write the scale rows into (..., rows, W) buffers whose payload rows a kernel
    wrote. In place under jit: only the scale bytes are written."""
    start = (0,) * (buffer.ndim - 2) + (layout.groups, 0)
    return lax.dynamic_update_slice(buffer, scale_block(scales, layout, buffer.ndim - 2), start)


def payload_of(message: jax.Array, layout: MessageLayout) -> jax.Array:
    """The typed payload (..., N, G) of messages (..., rows, W)."""
    return layout.wire_format.unpack(message[..., : layout.groups, :])


def scales_of(message: jax.Array, layout: MessageLayout) -> jax.Array:
    """The typed scales of messages (..., rows, W), as `quantize_groups` lays them out."""
    lead = message.shape[:-2]
    entry_dtypes = formats.scale_format(layout.scale_format).entry_dtypes
    entries, dtype = len(entry_dtypes), entry_dtypes[0]
    itemsize = jnp.dtype(dtype).itemsize
    flat = message[..., layout.groups :, :].reshape(*lead, -1)[..., : layout.groups * layout.scale_bytes]
    if itemsize == 1:
        return flat.reshape(*lead, layout.groups)
    typed = lax.bitcast_convert_type(flat.reshape(*lead, layout.groups * entries, itemsize), dtype)
    return typed.reshape(*lead, layout.groups, entries) if entries > 1 else typed


def multiplier(message: jax.Array, layout: MessageLayout) -> jax.Array:
    """float32 (..., N) per-group dequantization multipliers of messages (..., rows, W)."""
    return dequantize_scale(scales_of(message, layout), layout.scale_format)[..., 0]
