"""Per-group 8-bit quantization: the plain-jnp definition of TACO's ASHT + DSQ math.

For each group g of G contiguous values along the last axis (all arithmetic in float32):

  a = fp8_max / rms(g)                  adaptive pre-scale (rms computed without squaring
                                        overflow; clamped to [2**-100, 2**100] so it stays
                                        finite for all-zero and subnormal groups)
  y = H(a * g)                          normalized Walsh-Hadamard transform (optional)
  s = max(absmax(y) / fmt_max, 2**-126) quantization scale
  q = cast(clip(y / s))                 8-bit payload, round to nearest even

and the receiver computes g = H(q) * (s / a). Because the pre-scale normalizes every group
to rms fmt_max before the transform, no intermediate overflows for any finite float32
input, and unlike the authors' clamps of a to [1e-3, 1e3] and s to [1e-12, 1e6] nothing
saturates or flushes for values between 1e-30 and 1e30. A NaN or Inf in a group makes
that group's scale NaN, so the whole group decodes to NaN: bad values propagate, they are
never zeroed or turned into finite numbers.

Scale encodings (see `formats.SCALE_FORMATS`): "dual" sends (a, s); "single" sends s / a;
"bf16" sends s / a rounded up to bfloat16 and "e8m0" rounded up to a power of two; for
those two the payload is computed against the rounded scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import formats
from pallas_kernels.hadamard import hadamard_transform

_PRESCALE_MIN = np.float32(2.0**-100)
_PRESCALE_MAX = np.float32(2.0**100)
_SCALE_MIN = np.float32(2.0**-126)


def _as_groups(values: jax.Array, group_size: int) -> jax.Array:
    return values.reshape(*values.shape[:-1], values.shape[-1] // group_size, group_size)


def _times_pow2(values: jax.Array, exponent: jax.Array) -> jax.Array:
    """values * 2**exponent in two normal-range steps (a single 2**-128 factor is
    subnormal and flush-to-zero backends turn it into 0)."""
    half = exponent // 2
    one = np.float32(1.0)
    return values * jnp.ldexp(one, half) * jnp.ldexp(one, exponent - half)


def _prescale(groups: jax.Array, fmt_max: float) -> jax.Array:
    """fmt_max / rms per group, shape (..., n, 1). NaN if the group holds NaN or Inf."""
    absmax = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
    # Normalize by the absmax's binade before squaring: no overflow for huge values, no
    # underflow for tiny ones, and no division by a huge number (CPU XLA multiplies by a
    # reciprocal, which would flush to zero).
    _, exponent = jnp.frexp(absmax)
    normalized_rms = jnp.sqrt(jnp.mean(jnp.square(_times_pow2(groups, -exponent)), axis=-1, keepdims=True))
    prescale = _times_pow2(np.float32(fmt_max) / normalized_rms, -exponent)
    return jnp.clip(prescale, _PRESCALE_MIN, _PRESCALE_MAX)


def quantize_groups(
    values: jax.Array, *, fmt: str, group_size: int, scale_format: str, transform: bool
) -> tuple[jax.Array, jax.Array]:
    """Quantize groups of the last axis to an 8-bit payload plus per-group scales.

    Args:
      values: float array (..., C), C divisible by group_size.
      fmt: wire format name ("e4m3", "e5m2", "int8").
      group_size: G, a power of two when transform is True.
      scale_format: "dual", "single", "bf16" or "e8m0".
      transform: apply the Walsh-Hadamard transform after the pre-scale. False for plain
        per-group absmax quantization, or for values already in the transformed domain.

    Returns:
      (payload, scales): payload (..., C) in the format's dtype; scales float32
      (..., C/G, 2) holding (a, s) for "dual", float32 (..., C/G) holding s / a for
      "single", bfloat16 (..., C/G) for "bf16", uint8 (..., C/G) exponent codes for "e8m0".
    """
    wire = formats.wire_format(fmt)
    groups = _as_groups(values.astype(jnp.float32), group_size)
    prescale = _prescale(groups, wire.max_value)
    scaled = prescale * groups
    if transform:
        scaled = hadamard_transform(scaled)
    scale = jnp.maximum(jnp.max(jnp.abs(scaled), axis=-1, keepdims=True) / wire.max_value, _SCALE_MIN)
    if scale_format == "dual":
        divisor, scales = scale, jnp.concatenate([prescale, scale], axis=-1)
    elif scale_format == "single":
        divisor, scales = scale, (scale / prescale)[..., 0]
    elif scale_format == "bf16":
        rounded = formats.round_up_to_bf16(scale / prescale)
        divisor, scales = prescale * rounded.astype(jnp.float32), rounded[..., 0]
    elif scale_format == "e8m0":
        codes = formats.encode_e8m0(scale / prescale)
        divisor, scales = prescale * formats.decode_e8m0(codes), codes[..., 0]
    else:
        raise ValueError(f"unknown scale format {scale_format!r}; expected one of {sorted(formats.SCALE_FORMATS)}")
    payload = formats.cast_to_wire(scaled / divisor, wire)
    return payload.reshape(values.shape), scales


def dequantize_scale(scales: jax.Array, scale_format: str) -> jax.Array:
    """Per-group float32 dequantization multiplier (..., n, 1) from the wire scales."""
    if scale_format == "dual":
        return scales[..., 1:2] / scales[..., 0:1]
    if scale_format in ("single", "bf16"):
        return scales[..., None].astype(jnp.float32)
    if scale_format == "e8m0":
        return formats.decode_e8m0(scales)[..., None]
    raise ValueError(f"unknown scale format {scale_format!r}; expected one of {sorted(formats.SCALE_FORMATS)}")


def dequantize_groups(
    payload: jax.Array, scales: jax.Array, *, group_size: int, scale_format: str, transform: bool
) -> jax.Array:
    """Invert `quantize_groups` to float32 values (..., C).

    Args:
      payload: (..., C) 8-bit payload.
      scales: the scales `quantize_groups` returned.
      group_size: G.
      scale_format: "dual", "single", "bf16" or "e8m0".
      transform: apply the inverse transform. False returns values in the transformed
        domain (for summing shards there before one inverse transform).

    Returns:
      float32 array (..., C).
    """
    groups = _as_groups(payload.astype(jnp.float32), group_size)
    if transform:
        # Transform the small payload values first, then scale: no overflow near f32 max.
        groups = hadamard_transform(groups)
    return (groups * dequantize_scale(scales, scale_format)).reshape(payload.shape)
