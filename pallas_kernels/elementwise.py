"""Element-wise float and bit arithmetic the wire formats are built from: rounding onto a
grid (to nearest, stochastically from a hashed dither), sub-byte float codes, powers of
two, the E8M0 and bfloat16 scale encodings, saturating casts and the packing of sub-byte
codes. Written with element-wise jnp and bit operations only, so the same functions run
in the jnp reference and inside the Pallas (Triton) kernels.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from . import jax_compat

if TYPE_CHECKING:
    from .formats import Minifloat

E8M0_BIAS = 127
E8M0_NAN = 255
# Codes 1..254: 2**-126 .. 2**127. Code 0 (2**-127) is a float32 subnormal, which
# flush-to-zero backends would turn into a zero scale, so it is never produced.
E8M0_MIN_CODE = 1
E8M0_MAX_CODE = 254

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


def minifloat_exponent(magnitude: jnp.ndarray, fmt: Minifloat) -> jnp.ndarray:
    """int32 floor(log2 |v|), raised to the format's smallest normal exponent."""
    return jnp.maximum(binade_exponent(magnitude) - 1, fmt.min_exponent)


def round_to_minifloat(values: jnp.ndarray, fmt: Minifloat) -> jnp.ndarray:
    """float32 values with |v| <= fmt.max_value rounded onto the sub-byte float grid,
    to nearest, ties to even (the grid spacing in v's binade is a power of two, so the
    scaling is exact). NaN stays NaN; the result is float32."""
    step_exponent = minifloat_exponent(jnp.abs(values), fmt) - fmt.mantissa_bits
    return round_half_even(values * pow2(-step_exponent)) * pow2(step_exponent)


def minifloat_codes(values: jnp.ndarray, fmt: Minifloat) -> jnp.ndarray:
    """uint8 codes (sign, exponent field, mantissa field; `bits` wide) of float32 values
    on the sub-byte float grid. A subnormal and the normal above it share one formula:
    code = (exponent - min_exponent) * 2**m + v / 2**(exponent - m)."""
    magnitude = jnp.abs(values)
    exponent = minifloat_exponent(magnitude, fmt)
    steps = (magnitude * pow2(fmt.mantissa_bits - exponent)).astype(jnp.int32)
    field_bits = fmt.exponent_bits + fmt.mantissa_bits
    code = ((exponent - fmt.min_exponent) << fmt.mantissa_bits) + steps
    sign = (jax.lax.bitcast_convert_type(values, jnp.uint32) >> 31).astype(jnp.int32)
    return ((sign << field_bits) | (code & ((1 << field_bits) - 1))).astype(jnp.uint8)


def minifloat_values(codes: jnp.ndarray, fmt: Minifloat) -> jnp.ndarray:
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


def _word(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the packing word: lcm(bits, 8) bits."""
    word_bits = math.lcm(bits, 8)
    return word_bits // bits, word_bits // 8


def _shift(values: jnp.ndarray, left: int) -> jnp.ndarray:
    """values << left, or >> -left for a negative `left`."""
    return values << left if left >= 0 else values >> -left


def _overlapping(size: int, index: int, other_size: int, count: int) -> list[int]:
    """The fields of `other_size` bits (of `count` in a word) that share a bit with
    field `index` of `size` bits."""
    start = size * index
    return [j for j in range(count) if other_size * j < start + size and start < other_size * (j + 1)]


def pack_codes(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Codes of `bits` bits, 1 to 8 (their low bits, any integer dtype) -> uint8 bytes
    along the last axis: each word of lcm(bits, 8) bits holds consecutive codes, the
    earlier one in the lower bits, and is sent lowest byte first (4-bit codes two to a
    byte, 6-bit codes four to three bytes, 5-bit codes eight to five). The last axis
    must be a whole number of words; 8-bit codes are their bytes."""
    if bits == 8:
        return codes.astype(jnp.uint8)
    per_word, word_bytes = _word(bits)
    words = codes.reshape(*codes.shape[:-1], -1, per_word).astype(jnp.uint32) & ((1 << bits) - 1)
    packed = [
        functools.reduce(
            jnp.bitwise_or, [_shift(words[..., i], bits * i - 8 * j) for i in _overlapping(8, j, bits, per_word)]
        )
        & 0xFF
        for j in range(word_bytes)
    ]
    return jnp.stack(packed, axis=-1).astype(jnp.uint8).reshape(*codes.shape[:-1], -1)


def unpack_codes(packed: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Invert `pack_codes`: uint8 (..., n) -> uint8 codes (..., n * 8 / bits)."""
    if bits == 8:
        return packed.astype(jnp.uint8)
    per_word, word_bytes = _word(bits)
    words = packed.reshape(*packed.shape[:-1], -1, word_bytes).astype(jnp.uint32)
    codes = [
        functools.reduce(
            jnp.bitwise_or, [_shift(words[..., j], 8 * j - bits * i) for j in _overlapping(bits, i, 8, word_bytes)]
        )
        & ((1 << bits) - 1)
        for i in range(per_word)
    ]
    return jnp.stack(codes, axis=-1).astype(jnp.uint8).reshape(*packed.shape[:-1], -1)
