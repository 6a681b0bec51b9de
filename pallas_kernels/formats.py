"""Wire element formats and per-group scale encodings, one class each.

Defining a class that names itself (`name = ...`) registers its one instance: an element
format in `WIRE_FORMATS`, a scale encoding in `SCALE_ENCODINGS`, where `QuantSpec`, the
codec and the wire message find it by name. A new format is one class:

    class Int6(SymmetricInteger):
        name = "int6"
        bits = 6

The element format families:
  Float8            8-bit floats the dtype's cast rounds (E4M3, E5M2);
  SymmetricInteger  integers in [-(2**(bits-1) - 1), 2**(bits-1) - 1], held as int8
                    (INT8, INT4);
  Minifloat         sub-byte floats as the OCP MX element formats (no Inf or NaN codes,
                    subnormals), held as float8_e4m3fn (E2M3, E3M2 in 6 bits, E2M1 in 4).
Codes below 8 bits travel packed (`pack_codes`).

Each class's arithmetic is written with the element-wise float and bit functions at the
top of this module: rounding onto a grid (to nearest, or stochastically from draws), sub-byte float codes, powers of two, the E8M0 and bfloat16 scale encodings,
saturating casts and the packing of sub-byte codes. They use element-wise jnp and bit
operations only, so the same functions run in the jnp reference and inside the Pallas
(Triton) kernels.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------- element-wise arithmetic

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


def minifloat_exponent(magnitude: jnp.ndarray, fmt: Minifloat) -> jnp.ndarray:
    """int32 floor(log2 |v|), raised to the format's smallest normal exponent."""
    return jnp.maximum(binade_exponent(magnitude) - 1, fmt.min_exponent)


def round_to_minifloat(values: jnp.ndarray, fmt: Minifloat) -> jnp.ndarray:
    """float32 values with |v| <= fmt.max_value rounded onto the sub-byte float grid,
    to nearest, ties to even (the grid spacing in v's binade is a power of two, so the
    scaling is exact). A value that rounds to zero keeps its sign, as IEEE rounding and
    the hardware FP8 casts do. NaN stays NaN; the result is float32."""
    step_exponent = minifloat_exponent(jnp.abs(values), fmt) - fmt.mantissa_bits
    return jnp.copysign(round_half_even(values * pow2(-step_exponent)) * pow2(step_exponent), values)


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


# ----------------------------------------------------------------------------- the formats

WIRE_FORMATS: dict[str, WireFormat] = {}
SCALE_ENCODINGS: dict[str, ScaleFormat] = {}


class Registered:
    """A class that sets `name` adds its one instance to its family's `registry` when it
    is defined; classes without their own `name` are families (abstract)."""

    name: ClassVar[str]
    registry: ClassVar[dict[str, Any]]
    kind: ClassVar[str]  # what the registry holds, for messages

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in vars(cls):
            return
        if not isinstance(cls.name, str) or not cls.name or ":" in cls.name:
            raise ValueError(f"{cls.kind} name must be a non-empty string without ':', got {cls.name!r}")
        # Checked here: the class is not yet marked abstract while it is being created.
        unset = sorted(key for key in dir(cls) if getattr(getattr(cls, key, None), "__isabstractmethod__", False))
        if unset:
            raise TypeError(f"{cls.kind} {cls.name!r} ({cls.__name__}) must set {', '.join(unset)}")
        if cls.name in cls.registry:
            raise ValueError(
                f"{cls.kind} {cls.name!r} is already defined ({type(cls.registry[cls.name]).__name__}); "
                "remove it from the registry before defining it again"
            )
        instance = cls()
        instance.check()
        cls.registry[cls.name] = instance

    def check(self) -> None:
        """Raise ValueError unless the class's settings make a usable format."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # Stateless: every instance of a class is the same format (a static jit argument).
    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


class RegistryView(Mapping[str, Any]):
    """A read-only view of a registry: each entry's `attribute`, by name, always current."""

    def __init__(self, registry: dict[str, Any], attribute: str):
        self._registry, self._attribute = registry, attribute

    def __getitem__(self, name: str) -> Any:
        return getattr(self._registry[name], self._attribute)

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry)

    def __len__(self) -> int:
        return len(self._registry)

    def __repr__(self) -> str:
        return repr(dict(self))


# ----------------------------------------------------------------------------- element formats


class WireFormat(Registered, abc.ABC):
    """One element format of the compressed payload (a registered singleton: subclass a
    family and set its `name`).

    Attributes:
      name: its key in `WIRE_FORMATS` (what `QuantSpec.fmt` names).
      bits: bits per element on the wire, 1 to 8.
      dtype: the JAX dtype of the payload in a `Compressed` (its values exactly); codes
        of fewer than 8 bits are packed on the wire.
      max_value: largest finite magnitude; values are clipped to it before the cast
        (JAX's FP8 casts are not saturating: out of range becomes NaN).
      is_integer: an integer grid (round half to even).
      is_minifloat: a sub-byte float, rounded and coded by this module's arithmetic.
      exponent_bits, mantissa_bits: a sub-byte float's field widths; 0 otherwise.
      stochastic_rounding: whether `round_stochastically` takes the format.
    """

    registry = WIRE_FORMATS
    kind = "wire format"
    dtype: ClassVar[np.dtype]
    is_integer: ClassVar[bool] = False
    is_minifloat: ClassVar[bool] = False
    exponent_bits: ClassVar[int] = 0
    mantissa_bits: ClassVar[int] = 0
    stochastic_rounding: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def bits(self) -> int:
        """Bits per element on the wire."""

    @property
    @abc.abstractmethod
    def max_value(self) -> float:
        """Largest finite magnitude."""

    @abc.abstractmethod
    def round_to_nearest(self, values: jax.Array) -> jax.Array:
        """float32 values with |v| <= max_value rounded to the grid, ties to even (or left
        for the dtype's cast to round so); NaN stays NaN."""

    def round_stochastically(self, values: jax.Array, draws: jax.Array) -> jax.Array:
        """float32 values with |v| <= max_value rounded to one of the two grid points
        around them, up with probability equal to the distance from the lower one in
        steps (unbiased: the expected result is v), from `draws` uniform in [0, 1)
        (`wire.dither`); the result is float32."""
        raise ValueError(f"stochastic rounding does not take {self.name!r} (its cast rounds to nearest)")

    def kernel_cast(self, values: jax.Array) -> jax.Array:
        """`wire.cast_to_wire` inside a Pallas kernel, whose values the divisor already bounds
        by max_value to within a few float32 ulps: no clip."""
        return self.round_to_nearest(values).astype(self.dtype)

    @abc.abstractmethod
    def codes(self, payload: jax.Array) -> jax.Array:
        """uint8 codes (the low `bits` bits) of a payload in `dtype`."""

    @abc.abstractmethod
    def from_codes(self, codes: jax.Array) -> jax.Array:
        """Invert `codes`: the payload in `dtype`."""

    def pack(self, payload: jax.Array) -> jax.Array:
        """The payload (..., n) as uint8 wire bytes (..., n * bits / 8) (`pack_codes`)."""
        return pack_codes(self.codes(payload), self.bits)

    def unpack(self, packed: jax.Array) -> jax.Array:
        """Invert `pack`."""
        return self.from_codes(unpack_codes(packed, self.bits))

    def payload_bytes(self, elements: int) -> int:
        """Wire bytes of `elements` packed codes: ceil(elements * bits / 8)."""
        return -(-elements * self.bits // 8)

    def check(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError(f"wire format {self.name!r}: bits must be 1 to 8, got {self.bits}")


class Float8(WireFormat):
    """An 8-bit float dtype, rounded to nearest even by its cast; the payload's bytes are
    its codes. Set `dtype`."""

    bits = 8

    @property
    def max_value(self) -> float:
        return float(jnp.finfo(self.dtype).max)

    def round_to_nearest(self, values: jax.Array) -> jax.Array:
        return values

    def codes(self, payload: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(payload, jnp.uint8)

    def from_codes(self, codes: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(codes, self.dtype)

    def check(self) -> None:
        super().check()
        if not (jnp.issubdtype(self.dtype, jnp.floating) and self.dtype.itemsize == 1):
            raise ValueError(f"wire format {self.name!r}: dtype must be a 1-byte float, got {self.dtype}")


class SymmetricInteger(WireFormat):
    """Integers in [-M, M], M = 2**(bits-1) - 1, held as int8; codes are two's
    complement in `bits` bits (-2**(bits-1) is never sent). Set `bits` (2 to 8)."""

    dtype = jnp.dtype(jnp.int8)
    is_integer = True
    stochastic_rounding = True

    @property
    def max_value(self) -> float:
        return float(2 ** (self.bits - 1) - 1)

    def round_to_nearest(self, values: jax.Array) -> jax.Array:
        return round_half_even(values)

    def round_stochastically(self, values: jax.Array, draws: jax.Array) -> jax.Array:
        return jnp.floor(values + draws)

    def kernel_cast(self, values: jax.Array) -> jax.Array:
        # Both round alike; the kernels are limited by arithmetic (`round_to_int`).
        return round_to_int(values).astype(self.dtype)

    def codes(self, payload: jax.Array) -> jax.Array:
        whole = jax.lax.bitcast_convert_type(payload, jnp.uint8)
        return whole if self.bits == 8 else whole & np.uint8((1 << self.bits) - 1)

    def from_codes(self, codes: jax.Array) -> jax.Array:
        if self.bits == 8:
            return jax.lax.bitcast_convert_type(codes, jnp.int8)
        signed = codes.astype(jnp.int8)
        return jnp.where(signed > 2 ** (self.bits - 1) - 1, signed - (1 << self.bits), signed).astype(jnp.int8)

    def check(self) -> None:
        super().check()
        if self.bits < 2:
            raise ValueError(f"wire format {self.name!r}: a symmetric integer needs at least 2 bits")


class Minifloat(WireFormat):
    """A sub-byte float as the OCP MX element formats: sign, `exponent_bits` (every field
    value a finite binade: no Inf or NaN codes; field 0 the subnormals) and
    `mantissa_bits`, held as float8_e4m3fn (which holds each value exactly). Set
    `exponent_bits` and `mantissa_bits`."""

    dtype = jnp.dtype(jnp.float8_e4m3fn)
    is_minifloat = True
    stochastic_rounding = True

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def min_exponent(self) -> int:
        """The smallest normal exponent, 1 - bias."""
        return 2 - 2 ** (self.exponent_bits - 1)

    @property
    def max_value(self) -> float:
        largest_exponent = 2**self.exponent_bits - 2 + self.min_exponent
        return float(2.0**largest_exponent * (2 - 2.0**-self.mantissa_bits))

    def round_to_nearest(self, values: jax.Array) -> jax.Array:
        return round_to_minifloat(values, self)

    def round_stochastically(self, values: jax.Array, draws: jax.Array) -> jax.Array:
        step_exponent = minifloat_exponent(jnp.abs(values), self) - self.mantissa_bits
        return jnp.floor(values * pow2(-step_exponent) + draws) * pow2(step_exponent)

    def codes(self, payload: jax.Array) -> jax.Array:
        return minifloat_codes(payload.astype(jnp.float32), self)

    def from_codes(self, codes: jax.Array) -> jax.Array:
        return minifloat_values(codes, self).astype(self.dtype)

    def check(self) -> None:
        if self.exponent_bits < 1 or self.mantissa_bits < 0:
            raise ValueError(f"wire format {self.name!r}: needs exponent_bits >= 1 and mantissa_bits >= 0")
        super().check()
        # Every value k * 2**(e - m) fits where the dtype has the mantissa bits, the range
        # and a subnormal step no coarser than the format's.
        held = jnp.finfo(self.dtype)
        smallest_step = 2.0 ** (self.min_exponent - self.mantissa_bits)
        fits = held.nmant >= self.mantissa_bits and float(held.max) >= self.max_value
        if not fits or smallest_step < float(held.smallest_subnormal):
            raise ValueError(f"wire format {self.name!r}: its values do not all fit {self.dtype} exactly")


class E4M3(Float8):
    """FP8 E4M3 (finite only, largest 448): the authors' format."""

    name = "e4m3"
    dtype = jnp.dtype(jnp.float8_e4m3fn)


class E5M2(Float8):
    """FP8 E5M2 (largest 57344)."""

    name = "e5m2"
    dtype = jnp.dtype(jnp.float8_e5m2)


class Int8(SymmetricInteger):
    """INT8 in [-127, 127]."""

    name = "int8"
    bits = 8


class Int5(SymmetricInteger):
    """INT5 in [-15, 15]: at groups of 32, an activation's error near E2M3's in fewer bits."""

    name = "int5"
    bits = 5


class Int4(SymmetricInteger):
    """INT4 in [-7, 7]: the 4-bit control of the quality experiment (half INT8's bytes)."""

    name = "int4"
    bits = 4


class E2M3(Minifloat):
    """OCP MX FP6 E2M3 (largest 7.5)."""

    name = "e2m3"
    exponent_bits = 2
    mantissa_bits = 3


class E3M2(Minifloat):
    """OCP MX FP6 E3M2 (largest 28)."""

    name = "e3m2"
    exponent_bits = 3
    mantissa_bits = 2


class E2M1(Minifloat):
    """OCP MX FP4 E2M1 (largest 6)."""

    name = "e2m1"
    exponent_bits = 2
    mantissa_bits = 1


# ----------------------------------------------------------------------------- scale encodings


class ScaleFormat(Registered, abc.ABC):
    """One per-group scale encoding (a registered singleton: subclass it and set `name`).

    A group's payload is cast from y / divisor, and the receiver multiplies the decoded
    group by the multiplier s / a (the quantization scale over the pre-scale,
    `wire`) that the entries carry.

    Attributes:
      name: its key in `SCALE_ENCODINGS` (what `QuantSpec.scales` names).
      entry_dtypes: the dtypes of a group's entries: the kernels write one output array
        per entry, the wire message their bytes, group after group.
    """

    registry = SCALE_ENCODINGS
    kind = "scale format"
    entry_dtypes: ClassVar[tuple[np.dtype, ...]]

    @property
    def bytes_per_group(self) -> int:
        """Wire bytes of one group's entries."""
        return sum(dtype.itemsize for dtype in self.entry_dtypes)

    @abc.abstractmethod
    def encode(self, prescale: jax.Array, scale: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(divisor, entries) of groups with pre-scale a and quantization scale s (float32
        (..., 1) each): the payload is cast from y / divisor (s, or an encoding that
        rounds s / a up divides by a times the rounded multiplier); the entries as
        (..., 1) arrays of `entry_dtypes`."""

    @abc.abstractmethod
    def decode(self, scales: jax.Array) -> jax.Array:
        """float32 multipliers (..., n, 1) from the wire scales (`layout`'s)."""

    def layout(self, entries: tuple[jax.Array, ...]) -> jax.Array:
        """The entries (each (..., n, 1)) in the wire layout: (..., n) for one entry."""
        (entry,) = entries
        return entry[..., 0]


class DualScales(ScaleFormat):
    """The authors' format: pre-scale a and quantization scale s, both float32 (8 bytes)."""

    name = "dual"
    entry_dtypes = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))

    def encode(self, prescale: jax.Array, scale: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return scale, (prescale, scale)

    def decode(self, scales: jax.Array) -> jax.Array:
        return scales[..., 1:2] / scales[..., 0:1]

    def layout(self, entries: tuple[jax.Array, ...]) -> jax.Array:
        """(..., n, 2): a, s per group."""
        return jnp.concatenate(entries, axis=-1)


class SingleScale(ScaleFormat):
    """One float32 multiplier s / a (4 bytes; enough: the transform is linear)."""

    name = "single"
    entry_dtypes = (jnp.dtype(jnp.float32),)

    def encode(self, prescale: jax.Array, scale: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return scale, (scale / prescale,)

    def decode(self, scales: jax.Array) -> jax.Array:
        return scales[..., None].astype(jnp.float32)


class BF16Scale(SingleScale):
    """s / a rounded up to bfloat16 (2 bytes: 8 significant bits, float32's exponent
    range); the payload is cast against the rounded scale."""

    name = "bf16"
    entry_dtypes = (jnp.dtype(jnp.bfloat16),)

    def encode(self, prescale: jax.Array, scale: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        rounded = round_up_to_bf16(scale / prescale)
        return prescale * rounded.astype(jnp.float32), (rounded,)


class E8M0Scale(ScaleFormat):
    """One byte holding a power-of-two multiplier, rounded up (OCP MX style); the payload
    is cast against the rounded scale."""

    name = "e8m0"
    entry_dtypes = (jnp.dtype(jnp.uint8),)

    def encode(self, prescale: jax.Array, scale: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        code = encode_e8m0(scale / prescale)
        return prescale * decode_e8m0(code), (code,)

    def decode(self, scales: jax.Array) -> jax.Array:
        return decode_e8m0(scales)[..., None]


# Views of `SCALE_ENCODINGS`: bytes per group, and the entries' dtypes, by name.
SCALE_FORMATS: Mapping[str, int] = RegistryView(SCALE_ENCODINGS, "bytes_per_group")
SCALE_ENTRY_DTYPES: Mapping[str, tuple[np.dtype, ...]] = RegistryView(SCALE_ENCODINGS, "entry_dtypes")

# The largest decode multiplier every scale encoding holds: e8m0's largest code, exact
# in bfloat16 and float32.
MAX_SCALE = np.float32(2.0**127)


def _lookup(registry: dict[str, Any], kind: str, name: str) -> Any:
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {sorted(registry)}") from None


def wire_format(name: str) -> WireFormat:
    """Look up a wire format by name.

    Args:
      name: a key of `WIRE_FORMATS`.

    Returns:
      The `WireFormat`.

    Raises:
      ValueError: unknown format name.
    """
    return _lookup(WIRE_FORMATS, WireFormat.kind, name)


def scale_format(name: str) -> ScaleFormat:
    """Look up a scale encoding by name (a key of `SCALE_ENCODINGS`).

    Raises:
      ValueError: unknown name.
    """
    return _lookup(SCALE_ENCODINGS, ScaleFormat.kind, name)
