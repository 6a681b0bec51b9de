"""Wire element formats (8-bit; 4-bit integers; 6- and 4-bit floats as in the OCP MX
formats, packed) and per-group scale encodings."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import jax_compat


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """One element format of the compressed payload.

    Attributes:
      name: a key of `WIRE_FORMATS`.
      dtype: the JAX dtype of the payload in a `Compressed`: int4 codes are held as
        int8, and the sub-byte floats' values (all exactly representable) as
        float8_e4m3fn; on the wire both are packed.
      max_value: largest finite magnitude; values are clipped to it before the cast
        because JAX's FP8 casts are not saturating (out of range becomes NaN).
      is_integer: symmetric integer grid (round half to even) instead of a float grid.
      bits: bits per element on the wire.
      exponent_bits: for a sub-byte float (E2M1, E2M3, E3M2: no Inf or NaN codes,
        subnormals): its exponent field's width; 0 otherwise.
      mantissa_bits: a sub-byte float's mantissa field width.
    """

    name: str
    dtype: np.dtype
    max_value: float
    is_integer: bool
    bits: int = 8
    exponent_bits: int = 0
    mantissa_bits: int = 0

    @property
    def is_minifloat(self) -> bool:
        """A sub-byte float, rounded and coded by this module's arithmetic."""
        return self.exponent_bits > 0

    @property
    def min_exponent(self) -> int:
        """A sub-byte float's smallest normal exponent, 1 - bias."""
        return 2 - 2 ** (self.exponent_bits - 1)


WIRE_FORMATS: dict[str, WireFormat] = {
    "e4m3": WireFormat("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, False),
    "e5m2": WireFormat("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, False),
    "int8": WireFormat("int8", jnp.dtype(jnp.int8), 127.0, True),
    # Symmetric [-7, 7]: the 4-bit control of the quality experiment (half the bytes again).
    "int4": WireFormat("int4", jnp.dtype(jnp.int8), 7.0, True, bits=4),
    # The OCP MX element formats below 8 bits (FP6 E2M3 / E3M2, FP4 E2M1): 6-bit codes
    # packed four to three bytes, 4-bit codes two to a byte.
    "e2m3": WireFormat("e2m3", jnp.dtype(jnp.float8_e4m3fn), 7.5, False, 6, 2, 3),
    "e3m2": WireFormat("e3m2", jnp.dtype(jnp.float8_e4m3fn), 28.0, False, 6, 3, 2),
    "e2m1": WireFormat("e2m1", jnp.dtype(jnp.float8_e4m3fn), 6.0, False, 4, 2, 1),
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

# The largest decode multiplier every scale encoding holds: e8m0's largest code, exact
# in bfloat16 and float32.
MAX_SCALE = np.float32(2.0**127)

E8M0_BIAS = 127
E8M0_NAN = 255
# Codes 1..254: 2**-126 .. 2**127. Code 0 (2**-127) is a float32 subnormal, which
# flush-to-zero backends would turn into a zero scale, so it is never produced.
E8M0_MIN_CODE = 1
E8M0_MAX_CODE = 254


def wire_format(name: str) -> WireFormat:
    """Look up a wire format by name.

    Args:
      name: a key of `WIRE_FORMATS`.

    Returns:
      The `WireFormat`.

    Raises:
      ValueError: unknown format name.
    """
    try:
        return WIRE_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown wire format {name!r}; expected one of {sorted(WIRE_FORMATS)}") from None


def scale_headroom(fmt: WireFormat, group_size: int, transform: bool) -> int:
    """K >= 0 such that a group's decode multiplier s / a, sent as (s / a) * 2**-K, stays
    at most `MAX_SCALE` for every finite float32 group, so that it fits every scale
    encoding; the decode multiplies by 2**K after the (linear) transform.

    s / a = max|y| / max_value, and the normalized transform can raise a group's absmax
    by up to sqrt(G) (all of a constant group lands on one coefficient): at float32's
    largest value the multiplier passes float32's range for the small grids (E2M3,
    E3M2, E2M1, INT4) with the transform. K is 0 for every 8-bit format at G <= 1024
    (the ceiling `QuantSpec` allows), so what the kernels send is unchanged.
    """
    growth = np.sqrt(group_size) if transform else 1.0
    largest_multiplier = growth * float(np.finfo(np.float32).max) / fmt.max_value
    return max(0, int(np.ceil(np.log2(largest_multiplier))) - int(np.log2(MAX_SCALE)))


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


def cast_to_wire(
    values: jnp.ndarray, fmt: WireFormat, in_kernel: bool = False, draws: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Round float32 values (already divided by their scale) onto the 8-bit grid.

    Round to nearest, ties to even, after clipping to +-max_value; with `draws` (float32
    in [0, 1), one per value: `dither`), stochastically (`round_stochastically`). NaN
    stays NaN in the float formats; int8 has no NaN, so callers carry NaN through the
    group's scale.
    `in_kernel` picks what suits a Pallas kernel, which is limited by arithmetic: the
    integer rounding `round_to_int` (both round the same), and no clip, since the
    kernels' values come from `group_codec.quantize_scaled`, whose divisor bounds them by
    max_value to within a few float32 ulps, and those round onto the grid.
    """
    if in_kernel:
        return round_to_int(values).astype(fmt.dtype) if fmt.is_integer else values.astype(fmt.dtype)
    clipped = jnp.clip(values, -fmt.max_value, fmt.max_value)
    if draws is not None:
        return round_stochastically(clipped, fmt, draws).astype(fmt.dtype)
    if fmt.is_integer:
        return round_half_even(clipped).astype(fmt.dtype)
    if fmt.is_minifloat:
        return round_to_minifloat(clipped, fmt).astype(fmt.dtype)
    return clipped.astype(fmt.dtype)


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


def round_stochastically(values: jnp.ndarray, fmt: WireFormat, draws: jnp.ndarray) -> jnp.ndarray:
    """float32 values with |v| <= fmt.max_value rounded to one of the two grid points
    around them, up with probability equal to the distance from the lower one in steps
    (unbiased: the expected result is v), from `draws` uniform in [0, 1) (`dither`). For
    the integer grids and the sub-byte floats (whose grid steps are powers of two); the
    result is float32."""
    if fmt.is_integer:
        return jnp.floor(values + draws)
    step_exponent = _minifloat_exponent(jnp.abs(values), fmt) - fmt.mantissa_bits
    return jnp.floor(values * pow2(-step_exponent) + draws) * pow2(step_exponent)


def _minifloat_exponent(magnitude: jnp.ndarray, fmt: WireFormat) -> jnp.ndarray:
    """int32 floor(log2 |v|), raised to the format's smallest normal exponent."""
    return jnp.maximum(binade_exponent(magnitude) - 1, fmt.min_exponent)


def round_to_minifloat(values: jnp.ndarray, fmt: WireFormat) -> jnp.ndarray:
    """float32 values with |v| <= fmt.max_value rounded onto the sub-byte float grid,
    to nearest, ties to even (the grid spacing in v's binade is a power of two, so the
    scaling is exact). NaN stays NaN; the result is float32."""
    step_exponent = _minifloat_exponent(jnp.abs(values), fmt) - fmt.mantissa_bits
    return round_half_even(values * pow2(-step_exponent)) * pow2(step_exponent)


def minifloat_codes(values: jnp.ndarray, fmt: WireFormat) -> jnp.ndarray:
    """uint8 codes (sign, exponent field, mantissa field; `bits` wide) of float32 values
    on the sub-byte float grid. A subnormal and the normal above it share one formula:
    code = (exponent - min_exponent) * 2**m + v / 2**(exponent - m)."""
    magnitude = jnp.abs(values)
    exponent = _minifloat_exponent(magnitude, fmt)
    steps = (magnitude * pow2(fmt.mantissa_bits - exponent)).astype(jnp.int32)
    field_bits = fmt.exponent_bits + fmt.mantissa_bits
    code = ((exponent - fmt.min_exponent) << fmt.mantissa_bits) + steps
    sign = (jax.lax.bitcast_convert_type(values, jnp.uint32) >> 31).astype(jnp.int32)
    return ((sign << field_bits) | (code & ((1 << field_bits) - 1))).astype(jnp.uint8)


def minifloat_values(codes: jnp.ndarray, fmt: WireFormat) -> jnp.ndarray:
    """float32 values of sub-byte float codes (`minifloat_codes`'s inverse)."""
    codes = codes.astype(jnp.int32)
    field_bits, m = fmt.exponent_bits + fmt.mantissa_bits, fmt.mantissa_bits
    field = (codes >> m) & ((1 << fmt.exponent_bits) - 1)
    mantissa = (codes & ((1 << m) - 1)) + jnp.where(field > 0, 1 << m, 0)
    exponent = jnp.maximum(field, 1) - 1 + fmt.min_exponent - m
    magnitude = mantissa.astype(jnp.float32) * pow2(exponent)
    return jnp.where((codes >> field_bits) & 1 == 1, -magnitude, magnitude)


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


def pack_codes(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Sub-byte codes (their low `bits` bits, any integer dtype) -> packed uint8 bytes
    along the last axis, the earlier code in the lower bits: 4-bit codes two to a byte
    (last axis even), 6-bit codes four to three bytes (last axis a multiple of 4)."""
    per_word = 2 if bits == 4 else 4
    words = codes.reshape(*codes.shape[:-1], -1, per_word).astype(jnp.uint32) & ((1 << bits) - 1)
    word = functools.reduce(jnp.bitwise_or, [words[..., i] << (bits * i) for i in range(per_word)])
    packed = jnp.stack([(word >> (8 * i)) & 0xFF for i in range(bits * per_word // 8)], axis=-1)
    return packed.astype(jnp.uint8).reshape(*codes.shape[:-1], -1)


def unpack_codes(packed: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Invert `pack_codes`: uint8 (..., n) -> uint8 codes (..., n * 8 / bits)."""
    word_bytes = 1 if bits == 4 else 3
    groups = packed.reshape(*packed.shape[:-1], -1, word_bytes).astype(jnp.uint32)
    word = functools.reduce(jnp.bitwise_or, [groups[..., i] << (8 * i) for i in range(word_bytes)])
    codes = jnp.stack([(word >> (bits * i)) & ((1 << bits) - 1) for i in range(8 * word_bytes // bits)], axis=-1)
    return codes.astype(jnp.uint8).reshape(*packed.shape[:-1], -1)


def payload_codes(payload: jnp.ndarray, fmt: WireFormat) -> jnp.ndarray:
    """The wire codes of a sub-byte payload: int4's two's-complement nibbles, or a
    sub-byte float's sign-exponent-mantissa codes."""
    if fmt.is_minifloat:
        return minifloat_codes(payload.astype(jnp.float32), fmt)
    return payload.astype(jnp.uint8) & 0xF


def payload_from_codes(codes: jnp.ndarray, fmt: WireFormat) -> jnp.ndarray:
    """Invert `payload_codes`: the payload in the format's dtype."""
    if fmt.is_minifloat:
        return minifloat_values(codes, fmt).astype(fmt.dtype)
    signed = codes.astype(jnp.int8)
    return jnp.where(signed > 7, signed - 16, signed).astype(jnp.int8)
