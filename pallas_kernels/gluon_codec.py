"""What the Gluon codec kernels share (Gluon: Triton with explicit layouts): their launch
helpers, and the per-group math in registers, step for step `wire`'s (IEEE division and
square root for the per-group scalars): the binade normalization, the Walsh-Hadamard
stages within a thread and across a group's lanes, the scales and the codes, and INT4's
sum in float16 pairs. The row kernel (`row_kernels`) and the split kernels
(`split_kernels`) build on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import formats, wire
from .launch import output_struct

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # no Triton with Gluon: `backends.GLUON` does not run and nothing below is traced
    gluon = gl = async_copy = None

SCALE_FORMAT_IDS = {"dual": 0, "single": 1, "bf16": 2, "e8m0": 3}


POINTER_TYPES = {
    jnp.dtype(jnp.bfloat16): "*bf16",
    jnp.dtype(jnp.float16): "*fp16",
    jnp.dtype(jnp.float32): "*fp32",
    jnp.dtype(jnp.float8_e4m3fn): "*fp8e4nv",
    jnp.dtype(jnp.float8_e5m2): "*fp8e5",
    jnp.dtype(jnp.int8): "*i8",
    jnp.dtype(jnp.uint8): "*u8",
    jnp.dtype(jnp.uint32): "*u32",
}


def inverse_sqrt(group_size: int) -> float:
    """1/sqrt(G) rounded to float32, as the Pallas kernels fold it into the factor."""
    return float(np.float32(1.0 / np.sqrt(group_size)))


def element_codes(fmt: str) -> dict:
    """The constexprs of the format's codes: whether it is an integer format, its bits
    (8: the payload dtype's own bytes; fewer: codes packed into 32-bit words,
    `formats.pack_codes`), and a sub-byte float's field widths (0 otherwise)."""
    element = formats.wire_format(fmt)
    return dict(
        INTEGER=element.is_integer,
        BITS=element.bits,
        EXPONENT_BITS=element.exponent_bits,
        MANTISSA_BITS=element.mantissa_bits,
    )


def quantization(fmt: str, scale_format: str) -> dict:
    """The quantizing kernels' constexprs: the format's largest value and codes
    (`element_codes`), and the scale encoding's id."""
    element = formats.wire_format(fmt)
    return dict(FMT_MAX=float(element.max_value), SCALES=SCALE_FORMAT_IDS[scale_format], **element_codes(fmt))


def code_pointer(fmt: str) -> str:
    """The Triton pointer type a kernel reads or writes the format's payload as: its
    dtype's for 8-bit codes, 32-bit words for packed codes."""
    element = formats.wire_format(fmt)
    return POINTER_TYPES[jnp.dtype(element.dtype if element.bits == 8 else jnp.uint32)]


def row_bytes(fmt: str, group_size: int) -> int:
    """Bytes of one group's payload: G for 8-bit codes, G * bits / 8 packed."""
    return formats.wire_format(fmt).payload_bytes(group_size)


def scale_dtype(scale_format: str) -> jnp.dtype:
    """The dtype of the kernel's packed scales (every entry of a format has the same one)."""
    return jnp.dtype(formats.SCALE_ENTRY_DTYPES[scale_format][0])


def scales_struct(batch: int, groups: int, scale_format: str, like: jax.Array) -> jax.ShapeDtypeStruct:
    """The packed scales (`wire.pack_scale_entries`) of `batch` x `groups` groups."""
    shape = (batch, groups, 2) if scale_format == "dual" else (batch, groups)
    return output_struct(shape, scale_dtype(scale_format), like)


def grid(groups: int, batch: int, rows_per_program: int) -> tuple[int, int]:
    """The launch grid: programs over the groups, then one per batch."""
    return (-(-groups // rows_per_program), batch)


if gluon is not None:
    from .gluon_packing import (
        accumulate_int4_pairs,
        carrier_field,
        carrier_packing,
        carrier_scale,
        carrier_values,
        code_unit,
        half_pairs,
        int4_pair_values,
        interleave_four,
        load_packed,
        packed_offsets,
        packed_values,
        packing_layout,
        row_elements,
        unit_codes,
    )

    PRESCALE_MIN = gl.constexpr(float(wire.PRESCALE_MIN))

    FLOAT32_MAX = gl.constexpr(float(np.finfo(np.float32).max))

    PRESCALE_MAX = gl.constexpr(float(wire.PRESCALE_MAX))

    SCALE_MIN = gl.constexpr(float(wire.SCALE_MIN))

    MAX_SCALE = gl.constexpr(float(formats.MAX_SCALE))

    ROUNDING_BIAS = gl.constexpr(float(formats.ROUNDING_BIAS))

    ROUNDING_BIAS_BITS = gl.constexpr(formats.ROUNDING_BIAS_BITS)

    @gluon.constexpr_function
    def row_layout(G, NUM_WARPS):
        """A whole group per thread, 32 consecutive groups per warp."""
        return gl.BlockedLayout([1, G], [32, 1], [NUM_WARPS, 1], [1, 0])

    @gluon.jit
    def pow2(exponent):
        """2.0**exponent for int32 exponents in [-126, 127] (`formats.pow2`)."""
        return ((exponent + 127) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def times_pow2(values, exponent):
        """values * 2**exponent in two normal-range steps (`formats.times_pow2`)."""
        half = exponent >> 1
        return values * pow2(half) * pow2(exponent - half)

    @gluon.jit
    def hadamard_in_registers(values, G: gl.constexpr, LOG_G: gl.constexpr, NUM_WARPS: gl.constexpr):
        """values @ H (unnormalized, Sylvester order) along each thread's group: the stages
        of `wire.hadamard_butterfly`, all in registers."""
        for _ in gl.static_range(LOG_G):
            low, high = gl.split(gl.permute(values.reshape([32 * NUM_WARPS, 2, G // 2]), [0, 2, 1]))
            values = gl.join(low + high, low - high).reshape([32 * NUM_WARPS, G])
        return gl.convert_layout(values, row_layout(G, NUM_WARPS))

    @gluon.constexpr_function
    def butterfly_shuffle(lane_mask):
        """PTX of a warp shuffle taking the value of lane (this lane xor `lane_mask`)."""
        return f"shfl.sync.bfly.b32 $0, $1, {lane_mask}, 0x1f, 0xffffffff;"

    @gluon.constexpr_function
    def log2_of(n):
        """log2 of a power of two."""
        return n.bit_length() - 1

    @gluon.jit
    def hadamard_across_lanes(values, ROWS: gl.constexpr, G: gl.constexpr, VALUES: gl.constexpr):
        """values @ H (unnormalized, Sylvester order) along each group of a tile spreading a
        group over G / VALUES lanes (`split_kernels`'). H_G =
        H_{G/V} x H_V: the log2 V stages within a thread's V values run in registers
        (as `hadamard_in_registers`), then one stage per lane bit exchanges values with the lane
        holding the partner slice by a warp shuffle."""
        layout: gl.constexpr = values.type.layout
        LANES: gl.constexpr = G // VALUES
        if VALUES > 1:
            slices = values.reshape([ROWS, LANES, VALUES])
            for _ in gl.static_range(log2_of(VALUES)):
                low, high = gl.split(gl.permute(slices.reshape([ROWS, LANES, 2, VALUES // 2]), [0, 1, 3, 2]))
                slices = gl.join(low + high, low - high).reshape([ROWS, LANES, VALUES])
            values = gl.convert_layout(slices.reshape([ROWS, G]), layout)
        lane = gl.arange(0, G, layout=gl.SliceLayout(0, layout)) // VALUES
        for stage in gl.static_range(log2_of(LANES)):
            partner = gl.inline_asm_elementwise(
                butterfly_shuffle(1 << stage), "=r,r", [values], dtype=gl.float32, is_pure=True, pack=1
            )
            # +1 on the low slice of a pair, -1 on the high one: low + high and low - high,
            # each one exact rounding.
            sign = (1 - 2 * ((lane >> stage) & 1)).to(gl.float32)[None, :]
            values = values * sign + partner
        return values

    @gluon.jit
    def normalize(groups, FMT_MAX: gl.constexpr, G: gl.constexpr):
        """`wire.normalize_groups`: (normalized, factor, prescale, the normalized groups'
        absmax: their absmax times the same power of two, exact)."""
        absmax = gl.max(gl.abs(groups), axis=1)
        shift = gl.minimum(((absmax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 126, 126)
        normalized = groups * pow2(-shift)[:, None]
        mean_square = gl.sum(normalized * normalized, axis=1) * (1.0 / G)
        prescale = prescale_of(absmax, mean_square, -shift, FMT_MAX)
        return normalized, times_pow2(prescale, shift), prescale, absmax * pow2(-shift)

    @gluon.jit
    def prescale_of(absmax, mean_square, exponent, FMT_MAX: gl.constexpr):
        """`wire.prescale_of`: FMT_MAX / sqrt(mean_square) * 2**exponent, clamped, NaN for
        a group holding NaN or Inf."""
        prescale = times_pow2(gl.div_rn(gl.full_like(mean_square, FMT_MAX), gl.sqrt_rn(mean_square)), exponent)
        prescale = gl.minimum(gl.maximum(prescale, PRESCALE_MIN), PRESCALE_MAX)
        # max() skips NaN in a kernel; the mean square does not (`wire.prescale_of`).
        finite = (absmax < float("inf")) & (gl.abs(mean_square) < float("inf"))
        return gl.where(finite, prescale, float("nan"))

    @gluon.jit
    def normalize_half_sum(sums, exponent, FMT_MAX: gl.constexpr, G: gl.constexpr):
        """`normalize` of sums * 2**exponent, for a float16 sum (`int4_half_sum`), whose
        squares add up within float32's normal range: the sums stand for the normalized
        values and the powers of two go into the factor (exact), so the codes and scales
        are those `normalize` leads to, with no multiply a value."""
        absmax = gl.max(gl.abs(sums), axis=1)
        mean_square = gl.sum(sums * sums, axis=1) * (1.0 / G)
        prescale = prescale_of(absmax, mean_square, -exponent, FMT_MAX)
        return sums, times_pow2(prescale, exponent), prescale, absmax

    @gluon.jit
    def round_up_to_bf16(ratio):
        """`formats.round_up_to_bf16`, as the float32 value of the bfloat16 result."""
        ratio = gl.where(ratio < SCALE_MIN, SCALE_MIN, ratio)
        bits = ratio.to(gl.uint32, bitcast=True)
        rounded = gl.where(gl.abs(ratio) < float("inf"), (bits + 0xFFFF) & 0xFFFF0000, bits)
        return rounded.to(gl.float32, bitcast=True)

    @gluon.jit
    def encode_e8m0(ratio):
        """`formats.encode_e8m0`, as int32 codes."""
        bits = ratio.to(gl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 126
        code = gl.where((bits & 0x7FFFFF) == 0, exponent - 1, exponent) + 127
        code = gl.minimum(gl.maximum(code, 1), 254)
        return gl.where(gl.abs(ratio) < float("inf"), code, 255)

    @gluon.constexpr_function
    def power_of_two(exponent):
        """2.0**exponent as a compile-time float."""
        return float(2.0**exponent)

    @gluon.jit
    def with_headroom(prescale, HEADROOM: gl.constexpr):
        """The pre-scale the scales are sent with: times 2**HEADROOM, so that they carry
        2**-HEADROOM (`wire.scale_headroom`; exact, the pre-scale is at most 2**100)."""
        if HEADROOM > 0:
            prescale = prescale * power_of_two(HEADROOM)
        return prescale

    @gluon.constexpr_function
    def pair_conversion(dtype):
        """PTX rounding two float32 to a packed pair of `dtype` (bfloat16 or float16) to
        nearest, values past its largest finite clamped to it and NaN kept (`.satfinite`)."""
        pair = "bf16x2" if dtype == gl.bfloat16 else "f16x2"
        return f"cvt.rn.satfinite.{pair}.f32 $0, $2, $1;"

    @gluon.jit
    def saturating_cast(values, dtype: gl.constexpr):
        """`formats.saturating_cast`: float32 to `dtype`, values past its largest finite
        clamped to it, NaN kept: one conversion instruction per pair of values (a compare
        and two selects per value otherwise). For float32, a decode that overflowed (a
        value near its largest plus codec error) is clamped back."""
        if dtype == gl.float32:
            overflowed = gl.abs(values) == float("inf")  # False for NaN, which stays NaN
            return gl.where(overflowed, gl.where(values > 0, FLOAT32_MAX, -FLOAT32_MAX), values)
        return gl.inline_asm_elementwise(
            pair_conversion(dtype), "=r,r,r", [values], dtype=dtype.value, is_pure=True, pack=2
        )

    @gluon.jit
    def round_to_int(values):
        """int32 round(v), ties to even, for |v| < 2**22 (`formats.round_to_int`)."""
        return (values + ROUNDING_BIAS).to(gl.int32, bitcast=True) - ROUNDING_BIAS_BITS

    @gluon.jit
    def sub_byte_codes(
        scaled, INTEGER: gl.constexpr, BITS: gl.constexpr, EXPONENT_BITS: gl.constexpr, MANTISSA_BITS: gl.constexpr
    ):
        """int32 codes (their low BITS bits, `formats.WireFormat.codes`) of values on the
        format's scale (|v| at most its largest value, to within a few ulps; times
        `carrier_scale` for a float with an FP8 carrier): integers rounded to nearest
        even, in two's complement; sub-byte floats rounded to nearest even onto their
        grid (`formats.round_to_minifloat`, `formats.minifloat_codes`). A float with a
        carrier comes as (rows, G / 4) fields of four codes (`carrier_packing`), which
        `store_packed` takes as they are."""
        # Each constexpr branch assigns and one return follows: Triton traces what
        # follows a branch that returns.
        FIELDS: gl.constexpr = EXPONENT_BITS + MANTISSA_BITS
        if INTEGER:
            codes = round_to_int(scaled) & ((1 << BITS) - 1)
        elif carrier_field(EXPONENT_BITS, MANTISSA_BITS) > 1:
            # Four codes a 24-bit field (in the first of four outputs; the zeros fold away).
            fields = gl.inline_asm_elementwise(
                carrier_packing(EXPONENT_BITS, MANTISSA_BITS), "=r,=r,=r,=r,r,r,r,r", [scaled], gl.int32, True, 4
            )
            F: gl.constexpr = carrier_field(EXPONENT_BITS, MANTISSA_BITS)
            codes = gl.sum(fields.reshape([scaled.shape[0], scaled.shape[1] // F, F]), axis=2)
        else:
            # The binade of v, raised to the smallest normal one (float32 exponent bits):
            # the grid's step there is 2**(exponent - MANTISSA_BITS), subnormals and
            # normals alike. Adding C = 1.5 * 2**(exponent + 23 - MANTISSA_BITS) rounds v
            # to that step (to nearest even) and keeps the sum in C's binade, so the
            # sum's bits minus C's are the signed steps.
            MIN_BITS: gl.constexpr = (2 - (1 << (EXPONENT_BITS - 1)) + 127) << 23
            bits = scaled.to(gl.int32, bitcast=True)
            binade = gl.maximum(bits & 0x7F800000, MIN_BITS)
            magic = binade + (((23 - MANTISSA_BITS) << 23) | 0x400000)
            steps = (scaled + magic.to(gl.float32, bitcast=True)).to(gl.int32, bitcast=True) - magic
            # A value rounded up into the next binade (|steps| = 2**(m+1)) lands on that
            # binade's first code: the same sum. The sign is v's, zeros included.
            magnitude = ((binade - MIN_BITS) >> (23 - MANTISSA_BITS)) + gl.abs(steps)
            codes = magnitude | ((bits >> (31 - FIELDS)) & (1 << FIELDS))
        return codes

    @gluon.constexpr_function
    def entry_itemsize(MESSAGE_SCALES):
        """Bytes of the element a message's scale entries are read as, by scale format
        (`SCALE_FORMAT_IDS`): float32 for "dual" and "single", bfloat16, uint8 for "e8m0"."""
        return (4, 4, 2, 1)[MESSAGE_SCALES]

    @gluon.jit
    def multiplier_source(n_rows, in_rows, ROW_BYTES: gl.constexpr, MESSAGE_SCALES: gl.constexpr):
        """(elements between two shards' multipliers, the element a shard's first is at)
        in the decode's multiplier source: a float32 multiplier array (MESSAGE_SCALES < 0),
        or the messages themselves read as their scale entries' dtype, whose entries
        follow the N payload rows of ROW_BYTES each (`wire.scales_of`)."""
        if MESSAGE_SCALES < 0:
            stride, first = n_rows, 0
        else:
            PER_ROW: gl.constexpr = ROW_BYTES // entry_itemsize(MESSAGE_SCALES)
            stride, first = in_rows * PER_ROW, n_rows * PER_ROW
        return stride, first

    @gluon.jit
    def load_multiplier(source_ptr, rows, in_range, first, MESSAGE_SCALES: gl.constexpr):
        """float32 multipliers of `rows` of the shard `source_ptr` points at
        (`multiplier_source`), decoded from a message's entries as
        `formats.ScaleFormat.decode` does: s / a for "dual", a bfloat16 widened, an
        E8M0 code's power of two (its NaN code NaN, code 0 as 1 the smallest normal)."""
        entries = source_ptr + first
        if MESSAGE_SCALES == 0:
            prescale = gl.load(entries + 2 * rows, mask=in_range, other=1.0)
            multiplier = gl.load(entries + 2 * rows + 1, mask=in_range) / prescale
        elif MESSAGE_SCALES == 3:
            code = gl.load(entries + rows, mask=in_range).to(gl.int32)
            bits = gl.where(code == 255, 0x7FC00000, gl.maximum(code, 1) << 23)
            multiplier = bits.to(gl.float32, bitcast=True)
        else:
            multiplier = gl.load(entries + rows, mask=in_range).to(gl.float32)
        return multiplier

    @gluon.jit
    def multiplier_binade(
        source_ptr, stride, first, rows, in_range, SHARDS: gl.constexpr, MESSAGE_SCALES: gl.constexpr
    ):
        """The binade of the shards' largest multiplier per row, in the layout of `rows`:
        2**-binade takes it into [0.5, 1)."""
        largest = load_multiplier(source_ptr, rows, in_range, first, MESSAGE_SCALES)
        for shard in gl.static_range(1, SHARDS):
            largest = gl.maximum(
                largest, load_multiplier(source_ptr + shard * stride, rows, in_range, first, MESSAGE_SCALES)
            )
        return ((largest.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 126

    @gluon.jit
    def sum_shift(source_ptr, stride, first, rows, in_range, SHARDS: gl.constexpr, MESSAGE_SCALES: gl.constexpr):
        """shift per row (`wire.sum_shift`): the binade of the shards' largest multiplier
        above 1, which the sum is scaled down by, in the layout of `rows`."""
        return gl.maximum(multiplier_binade(source_ptr, stride, first, rows, in_range, SHARDS, MESSAGE_SCALES), 0)

    @gluon.jit
    def packed_sum(
        payload_ptr,
        source_ptr,
        start,
        n_rows,
        in_rows,
        MESSAGE_SCALES: gl.constexpr,
        SHARDS: gl.constexpr,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
        INTEGER: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
    ):
        """`split_kernels`' sum of k shards of packed codes times their multipliers
        (`multiplier_source`) scaled by 2**-shift, (ROWS, G) in the layout they unpack
        in, and shift (`sum_shift`) in its rows' layout."""
        # A carrier's codes are loaded as fields of F (`carrier_unpacking`).
        F: gl.constexpr = carrier_field(EXPONENT_BITS, MANTISSA_BITS)
        units: gl.constexpr = gl.SliceLayout(2, packing_layout(G // F, BITS * F, NUM_WARPS, VALUES // F))
        # Expanded at axis 1, then 2.
        rows = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, units)))
        in_range = rows < n_rows
        stride, first = multiplier_source(n_rows, in_rows, G * BITS // 8, MESSAGE_SCALES)
        shift = sum_shift(source_ptr, stride, first, rows, in_range, SHARDS, MESSAGE_SCALES)
        summed = gl.zeros([ROWS, G // unit_codes(BITS), unit_codes(BITS) // F], gl.float32, units)
        second, third, fourth = summed, summed, summed
        for shard in gl.static_range(SHARDS):
            shard_ptr = payload_ptr + shard * in_rows * row_elements(G, BITS)
            # The codes' constant unit goes into the multiplier (exact: it is at most 2
            # after the shift).
            multiplier = load_multiplier(source_ptr + shard * stride, rows, in_range, first, MESSAGE_SCALES)
            multiplier = (times_pow2(multiplier, -shift) * code_unit(INTEGER, EXPONENT_BITS, MANTISSA_BITS))[
                :, None, None
            ]
            if F == 1:
                values = packed_values(
                    shard_ptr, start, n_rows, ROWS, G, NUM_WARPS, VALUES, INTEGER, BITS, EXPONENT_BITS, MANTISSA_BITS
                )
                summed = summed + values * multiplier
            else:
                codes = load_packed(shard_ptr, start, n_rows, ROWS, G // F, BITS * F, NUM_WARPS, VALUES // F)
                values = carrier_values(codes, EXPONENT_BITS, MANTISSA_BITS)
                summed = summed + values[0] * multiplier
                second = second + values[1] * multiplier
                third = third + values[2] * multiplier
                fourth = fourth + values[3] * multiplier
        if F > 1:
            summed = interleave_four(summed, second, third, fourth)
        return summed.reshape([ROWS, G]), shift

    @gluon.jit
    def int4_half_sum(
        payload_ptr,
        source_ptr,
        start,
        n_rows,
        in_rows,
        MESSAGE_SCALES: gl.constexpr,
        SHARDS: gl.constexpr,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
    ):
        """`packed_sum` of INT4 codes in float16 pairs (`accumulate_int4_pairs`), for a
        sum that is requantized: (the sum times 2**-(shift + exponent) as float32 (ROWS,
        G), shift, exponent), with shift as `sum_shift` and exponent <= 0 what takes the
        values to `packed_sum`'s (`normalize_half_sum` applies it).

        Each shard's multipliers are scaled by the binade of the row's largest, so the
        sum is at most SHARDS * 8 and a code times its multiplier rounds to float16's
        11 bits, a shard whose multiplier is 2**-24 of the largest vanishing: error
        about 2**-11 of the sum, against INT4's step of 2**-3 of its absmax, which
        moves a code one step for about 0.1% of the values (NaN multipliers make their
        rows NaN)."""
        layout: gl.constexpr = gl.SliceLayout(3, packing_layout(G, 4, NUM_WARPS, VALUES))
        # Expanded at axis 1, then 2.
        rows = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        in_range = rows < n_rows
        stride, first = multiplier_source(n_rows, in_rows, G // 2, MESSAGE_SCALES)
        binade = multiplier_binade(source_ptr, stride, first, rows, in_range, SHARDS, MESSAGE_SCALES)
        offsets, mask = packed_offsets(start, n_rows, ROWS, G, 4, NUM_WARPS, VALUES)
        zero = gl.zeros(offsets.shape, gl.int32, layout)
        sums = (zero, zero, zero, zero)
        for shard in gl.static_range(SHARDS):
            multiplier = load_multiplier(source_ptr + shard * stride, rows, in_range, first, MESSAGE_SCALES)
            words = gl.load(payload_ptr + shard * in_rows * row_elements(G, 4) + offsets, mask=mask)
            sums = accumulate_int4_pairs(sums, words, half_pairs(times_pow2(multiplier, -binade))[:, None, None])
        return int4_pair_values(sums), gl.maximum(binade, 0), gl.minimum(binade, 0)

    @gluon.jit
    def scaled_codes(
        values,
        absmax,
        factor,
        prescale,
        codes_dtype: gl.constexpr,
        scales_ptr,
        rows,
        in_range,
        FMT_MAX: gl.constexpr,
        INTEGER: gl.constexpr,
        SCALES: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
    ):
        """`wire.quantize_scaled` of a tile of groups y = values * factor (`absmax`: the
        rows' max |values|, which a caller may have at hand): stores
        the packed scales of its `rows` (along the tile's rows; `in_range` masks them) at
        `scales_ptr` and returns the codes in the layout of `values`: 8-bit codes in
        `codes_dtype`, sub-byte codes as int32 (`sub_byte_codes`)."""
        scale = gl.div_rn(absmax * factor, gl.full_like(factor, FMT_MAX))
        scale = gl.where(scale < SCALE_MIN, SCALE_MIN, scale)  # NaN stays NaN
        # A requantized sum beyond float32's range: its multiplier held at MAX_SCALE
        # (`wire.scale_entries`), so the group decodes finite.
        scale = gl.where(gl.div_rn(scale, prescale) > MAX_SCALE, prescale * MAX_SCALE, scale)
        divisor = scale
        if SCALES == 0:
            gl.store(scales_ptr + 2 * rows, prescale, mask=in_range)
            gl.store(scales_ptr + 2 * rows + 1, scale, mask=in_range)
        elif SCALES == 1:
            gl.store(scales_ptr + rows, gl.div_rn(scale, prescale), mask=in_range)
        elif SCALES == 2:
            rounded = round_up_to_bf16(gl.div_rn(scale, prescale))
            divisor = prescale * rounded
            gl.store(scales_ptr + rows, rounded.to(gl.bfloat16), mask=in_range)
        else:
            code = encode_e8m0(gl.div_rn(scale, prescale))
            divisor = prescale * gl.where(code == 255, float("nan"), pow2(code - 127))
            gl.store(scales_ptr + rows, code.to(gl.uint8), mask=in_range)
        if BITS < 8:
            # Exact: a power of two on a scalar far from float32's limits.
            scaled = values * (gl.div_rn(factor, divisor) * carrier_scale(EXPONENT_BITS, MANTISSA_BITS))[:, None]
            codes = sub_byte_codes(scaled, INTEGER, BITS, EXPONENT_BITS, MANTISSA_BITS)
        else:
            scaled = values * gl.div_rn(factor, divisor)[:, None]
            if INTEGER:
                codes = round_to_int(scaled).to(gl.int8)
            else:
                codes = scaled.to(codes_dtype)
        return codes
