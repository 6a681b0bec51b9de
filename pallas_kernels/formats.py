"""Wire element formats (8-bit, and 4-bit integers packed two per byte) and per-group
scale encodings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """One element format of the compressed payload.

    Attributes:
      name: "e4m3", "e5m2", "int8" or "int4".
      dtype: the JAX dtype of the payload in a `Compressed` (int4 codes are held as
        int8 and packed two per byte on the wire).
      max_value: largest finite magnitude; values are clipped to it before the cast
        because JAX's FP8 casts are not saturating (out of range becomes NaN).
      is_integer: symmetric integer grid (round half to even) instead of a float grid.
      bits: bits per element on the wire.
    """

    name: str
    dtype: np.dtype
    max_value: float
    is_integer: bool
    bits: int = 8


WIRE_FORMATS: dict[str, WireFormat] = {
    "e4m3": WireFormat("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, False),
    "e5m2": WireFormat("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, False),
    "int8": WireFormat("int8", jnp.dtype(jnp.int8), 127.0, True),
    # Symmetric [-7, 7]: the 4-bit control of the quality experiment (half the bytes again).
    "int4": WireFormat("int4", jnp.dtype(jnp.int8), 7.0, True, bits=4),
}

# Bytes per group on the wire for each scale encoding:
#   dual   the authors' format: pre-scale a and quantization scale s, both float32;
#   single one float32 dequantization scale s / a (enough: the transform is linear);
#   bf16   s / a rounded up to bfloat16 (8 significant bits, float32's exponent range);
#   e8m0   one byte holding a power-of-two dequantization scale (OCP MX style).
SCALE_FORMATS: dict[str, int] = {"dual": 8, "single": 4, "bf16": 2, "e8m0": 1}
# The dtypes of each group's scale entries, per scale format (what `SCALE_FORMATS` counts
# in bytes): the kernels write one output array per entry, the wire message their bytes.
SCALE_ENTRY_DTYPES = {
    "dual": (jnp.float32, jnp.float32),
    "single": (jnp.float32,),
    "bf16": (jnp.bfloat16,),
    "e8m0": (jnp.uint8,),
}

E8M0_BIAS = 127
E8M0_NAN = 255
# Codes 1..254: 2**-126 .. 2**127. Code 0 (2**-127) is a float32 subnormal, which
# flush-to-zero backends would turn into a zero scale, so it is never produced.
E8M0_MIN_CODE = 1
E8M0_MAX_CODE = 254


def wire_format(name: str) -> WireFormat:
    """Look up a wire format by name.

    Args:
      name: "e4m3", "e5m2", "int8" or "int4".

    Returns:
      The `WireFormat`.

    Raises:
      ValueError: unknown format name.
    """
    try:
        return WIRE_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown wire format {name!r}; expected one of {sorted(WIRE_FORMATS)}") from None


# Everything below is written with element-wise jnp and bit operations only, so the same
# functions run in the jnp reference and inside the Pallas (Triton) kernels.

# Adding 1.5 * 2**23 to a float32 |v| < 2**22 leaves round(v) (ties to even, the FPU's
# rounding) in the low mantissa bits: the sum's bits minus the bias's bits are round(v).
ROUNDING_BIAS = np.float32(1.5 * 2**23)
ROUNDING_BIAS_BITS = 0x4B400000


def round_to_int(values: jnp.ndarray) -> jnp.ndarray:
    """int32 round(v), ties to even, for float32 |v| < 2**22: one add and one integer
    subtract. For the Pallas kernels only (Triton has no round primitive, and they are
    limited by arithmetic): XLA on GPU does not keep the sum's bits (jitted int8 payloads
    came out wrong on an H200), so the jnp path uses `round_half_even`."""
    return jax.lax.bitcast_convert_type(values + ROUNDING_BIAS, jnp.int32) - ROUNDING_BIAS_BITS


def round_half_even(values: jnp.ndarray) -> jnp.ndarray:
    """Round float32 values with |v| < 2**23 to the nearest integer, ties to even.

    Built from floor and exact subtractions, which XLA keeps as written (it folds the
    usual add-and-subtract 1.5 * 2**23 trick away).
    """
    floor = jnp.floor(values)
    fraction = values - floor
    odd = (floor - 2.0 * jnp.floor(floor * 0.5)) == 1.0
    return jnp.where((fraction > 0.5) | ((fraction == 0.5) & odd), floor + 1.0, floor)


def cast_to_wire(values: jnp.ndarray, fmt: WireFormat, in_kernel: bool = False) -> jnp.ndarray:
    """Round float32 values (already divided by their scale) onto the 8-bit grid.

    Round to nearest, ties to even, after clipping to +-max_value. NaN stays NaN in the
    float formats; int8 has no NaN, so callers carry NaN through the group's scale.
    `in_kernel` picks what suits a Pallas kernel, which is limited by arithmetic: the
    integer rounding `round_to_int` (both round the same), and no clip, since the
    kernels' values come from `group_codec.quantize_scaled`, whose divisor bounds them by
    max_value to within a few float32 ulps, and those round onto the grid.
    """
    if in_kernel:
        return round_to_int(values).astype(fmt.dtype) if fmt.is_integer else values.astype(fmt.dtype)
    clipped = jnp.clip(values, -fmt.max_value, fmt.max_value)
    if fmt.is_integer:
        return round_half_even(clipped).astype(fmt.dtype)
    return clipped.astype(fmt.dtype)


def saturating_cast(values: jnp.ndarray, dtype) -> jnp.ndarray:
    """float32 `values` cast to a float `dtype`, values beyond its largest finite value
    clamped to it (a decode's codec error may carry a value near float16's 65504 past it:
    the plain cast would make it Inf; for float32 output, the decode's own arithmetic
    overflowed to Inf near float32's largest). NaN stays NaN; usable inside kernels.
    A decode never sees Inf from its input (a group holding Inf decodes to NaN), so
    every Inf here is an overflow."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return values.astype(dtype)
    limit = np.float32(jnp.finfo(dtype).max)
    return jnp.where(jnp.abs(values) > limit, jnp.where(values > 0, limit, -limit), values).astype(dtype)


def pow2(exponent: jnp.ndarray) -> jnp.ndarray:
    """2.0**exponent as float32 for int32 exponents in [-126, 127], built from bits."""
    return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def times_pow2(values: jnp.ndarray, exponent: jnp.ndarray) -> jnp.ndarray:
    """values * 2**exponent for exponents in [-252, 254], in two normal-range steps (a
    single subnormal factor such as 2**-128 would flush to zero on many backends)."""
    half = exponent >> 1
    return values * pow2(half) * pow2(exponent - half)


def binade_exponent(values: jnp.ndarray) -> jnp.ndarray:
    """int32 e with |v| in [2**(e-1), 2**e) for normal float32 v; -126 for zero and
    subnormals; 129 for Inf and NaN."""
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    return ((bits >> 23) & 0xFF) - 126


def encode_e8m0(scale: jnp.ndarray) -> jnp.ndarray:
    """Encode positive float32 scales as uint8 power-of-two exponents, rounding up.

    Rounding the scale up (never down) keeps every value of the group inside the
    element format's range. NaN or Inf scales encode as the NaN code.
    """
    bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
    exponent = binade_exponent(scale)
    ceil_log2 = jnp.where((bits & 0x7FFFFF) == 0, exponent - 1, exponent)
    code = jnp.clip(ceil_log2 + E8M0_BIAS, E8M0_MIN_CODE, E8M0_MAX_CODE)
    return jnp.where(jnp.isfinite(scale), code, E8M0_NAN).astype(jnp.uint8)


def decode_e8m0(code: jnp.ndarray) -> jnp.ndarray:
    """Decode uint8 exponent codes to float32 scales (the NaN code gives NaN)."""
    exponent = code.astype(jnp.int32) - E8M0_BIAS
    return jnp.where(code == E8M0_NAN, np.float32(np.nan), pow2(jnp.clip(exponent, -126, 127)))


def round_up_to_bf16(scale: jnp.ndarray) -> jnp.ndarray:
    """Round positive float32 scales up (toward +inf) to bfloat16; NaN and Inf stay.

    Rounding up keeps every value of the group inside the element format's range. Scales
    under the smallest normal number (all-zero groups) become it, so no divisor is 0.
    """
    # A comparison, not max(): inside a Triton kernel max() would turn NaN into the floor.
    scale = jnp.where(scale < np.float32(2.0**-126), np.float32(2.0**-126), scale)
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    # Adding 0xFFFF carries into the kept bits unless the dropped ones are all zero.
    ceil_bits = (bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)
    ceil_bits = jnp.where(jnp.isfinite(scale), ceil_bits, bits)
    return jax.lax.bitcast_convert_type(ceil_bits, jnp.float32).astype(jnp.bfloat16)


def pack_nibbles(codes: jnp.ndarray) -> jnp.ndarray:
    """int8 codes in [-8, 7], last axis even, -> uint8 with two codes per byte (the
    even-indexed code in the low nibble)."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2).astype(jnp.uint8) & 0xF
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: jnp.ndarray) -> jnp.ndarray:
    """Invert `pack_nibbles`: uint8 (..., n) -> int8 codes (..., 2n)."""
    nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).astype(jnp.int8)
    signed = jnp.where(nibbles > 7, nibbles - 16, nibbles).astype(jnp.int8)
    return signed.reshape(*packed.shape[:-1], -1)
