"""Per-group quantization: the plain-jnp definition of TACO's ASHT + DSQ math.

For each group g of G contiguous values along the last axis (all arithmetic in float32):

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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import elementwise, formats
from .hadamard import hadamard_transform

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
    inverse = elementwise.pow2(-shift)
    normalized = tuple(piece * inverse for piece in pieces)
    mean_square = row_sum(tuple(piece * piece for piece in normalized)) / np.float32(group_width(pieces))
    prescale = prescale_of(absmax, shift, mean_square, fmt_max)
    return normalized, elementwise.times_pow2(prescale, shift), prescale


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
    return jnp.minimum(elementwise.binade_exponent(absmax), 126)


def prescale_of(absmax: jax.Array, shift: jax.Array, mean_square: jax.Array, fmt_max: float) -> jax.Array:
    """The pre-scale a = fmt_max / rms(g) from a group's absmax, its `binade_shift` and the
    mean square of the normalized group g * 2**-shift; NaN for a group holding NaN or Inf.

    The mean square decides that too: inside a Triton kernel max() ignores NaN (maxnumf),
    so the absmax of a group holding NaN is finite, while the sum of squares of the
    normalized values (each below 8 in magnitude, so it cannot overflow) is NaN or Inf.
    """
    prescale = jnp.clip(
        elementwise.times_pow2(np.float32(fmt_max) / jnp.sqrt(mean_square), -shift), PRESCALE_MIN, PRESCALE_MAX
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
    return jnp.maximum(elementwise.binade_exponent(largest), 0)


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
      in_kernel: traced inside a Pallas kernel (`formats.cast_to_wire`).
      stochastic: round stochastically (`formats.WireFormat.round_stochastically`)
        instead of to nearest.
      headroom: K of `formats.scale_headroom`: the scales are sent as s / a * 2**-K.
      dither_keys: what stochastic rounding's dither hashes, pieces like `values` (None:
        `values`). Their bits must come out the same jitted and eager.

    Returns:
      (payload, scale_entries): payload pieces in the format's dtype; scale_entries a
      tuple of (..., 1) arrays: (a, s) for "dual", (s / a,) for "single", (bf16 s / a,)
      for "bf16", (uint8 code,) for "e8m0".
    """
    wire = formats.wire_format(fmt)
    absmax = row_max_abs(values) * factor
    divisor, entries = scale_entries(absmax, prescale, fmt, scale_format, headroom)
    multiplier = factor / divisor  # one division per group, then a multiply per element
    # The dither hashes the values before the multiply: their bits are the same jitted
    # and eager, where XLA may compute the pre-scale (hence the product) an ulp apart.
    keys = values if dither_keys is None else dither_keys
    payload = tuple(
        formats.cast_to_wire(piece * multiplier, wire, in_kernel, elementwise.dither(key) if stochastic else None)
        for piece, key in zip(values, keys, strict=True)
    )
    return payload, entries


def scale_entries(
    absmax: jax.Array, prescale: jax.Array, fmt: str, scale_format: str, headroom: int = 0
) -> tuple[jax.Array, tuple]:
    """(divisor, entries) of groups whose pre-scaled values have absmax `absmax`: the
    payload is cast from y / divisor; entries as `quantize_scaled` returns them, for the
    decode multiplier s / a * 2**-headroom (`formats.scale_headroom`).

    A multiplier beyond `formats.MAX_SCALE` (only a requantized sum whose exact value
    passes float32's range reaches one) is held at it: the payload then clips at the
    format's largest value and the group decodes finite, never to Inf or NaN."""
    encoding = formats.scale_format(scale_format)
    if headroom:
        prescale = elementwise.times_pow2(prescale, jnp.int32(headroom))
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
    wire = formats.wire_format(fmt)
    groups = _as_groups(values.astype(jnp.float32), group_size)
    (normalized,), factor, prescale = normalize_groups((groups,), wire.max_value)
    transformed = hadamard_transform(normalized) if transform else normalized
    headroom = formats.scale_headroom(wire, group_size, transform)
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
    format's values (`wire.payload_of`), multiplier (k, N) their scales
    (`dequantize_scale`); the sum runs in float32 in the transformed domain, then one
    inverse transform. With `requantize_to` (fmt, scale format) the sum is quantized again
    instead, as (codes, packed scale entries), and `stochastic` rounds it stochastically.
    A decode multiplies by 2**headroom (`formats.scale_headroom`) last; a requantized sum
    stays in the multipliers' units, which already carry it."""
    if payload.shape[0] == 1 and transform and requantize_to is None:
        # Transform the small payload values first, then scale: no overflow near f32 max.
        decoded = hadamard_transform(payload[0].astype(jnp.float32)) * multiplier[0][:, None]
        return elementwise.saturating_cast(
            elementwise.times_pow2(decoded, jnp.int32(headroom)) if headroom else decoded, out_dtype
        )
    shift = sum_shift(tuple(multiplier))[..., None]  # (N, 1)
    summed = jnp.sum(payload.astype(jnp.float32) * elementwise.times_pow2(multiplier[..., None], -shift), axis=0)
    if requantize_to is not None:
        fmt, scale_format = requantize_to
        groups = summed[:, None, :]  # one group a row, as `quantize_groups` lays them out
        (normalized,), factor, prescale = normalize_groups((groups,), formats.wire_format(fmt).max_value)
        (codes,), entries = quantize_scaled(
            (normalized,),
            factor,
            elementwise.times_pow2(prescale, -shift[:, None]),
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
    return elementwise.saturating_cast(elementwise.times_pow2(summed, shift + headroom), out_dtype)
