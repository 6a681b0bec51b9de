"""What the Gluon codec kernels share (Gluon: Triton with explicit layouts): their launch
helpers, and the per-group math in registers, step for
step `wire`'s (IEEE division and square root for the per-group scalars): the
binade normalization, the Walsh-Hadamard stages within a thread, the scales and the
codes. The row kernel (`row_kernels`) and the split kernels (`split_kernels`) build on it.
"""

from __future__ import annotations

import math

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


def codes_per_unit(bits: int) -> int:
    """U: the codes of the shortest run that fills whole 32-bit words (the kernels pack
    and unpack a unit in one thread); 4 for 8-bit codes."""
    return 32 // math.gcd(bits, 32)


def reads_message_scales(fmt: str) -> bool:
    """Whether a decode of whole messages in `fmt` reads each group's multiplier from the
    message's scale entries in the kernel (`load_multiplier`): packed codes, whose small
    groups made a separate multiplier array cost the most; 8-bit codes read the array
    until that is measured for them."""
    return formats.wire_format(fmt).bits < 8


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

    @gluon.jit
    def normalize(groups, FMT_MAX: gl.constexpr, G: gl.constexpr):
        """`wire.normalize_groups`: (normalized, factor, prescale)."""
        absmax = gl.max(gl.abs(groups), axis=1)
        shift = gl.minimum(((absmax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 126, 126)
        normalized = groups * pow2(-shift)[:, None]
        mean_square = gl.sum(normalized * normalized, axis=1) * (1.0 / G)
        prescale = times_pow2(gl.div_rn(gl.full_like(mean_square, FMT_MAX), gl.sqrt_rn(mean_square)), -shift)
        prescale = gl.minimum(gl.maximum(prescale, PRESCALE_MIN), PRESCALE_MAX)
        # max() skips NaN in a kernel; the mean square does not (`wire.prescale_of`).
        finite = (absmax < float("inf")) & (gl.abs(mean_square) < float("inf"))
        prescale = gl.where(finite, prescale, float("nan"))
        return normalized, times_pow2(prescale, shift), prescale

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

    @gluon.constexpr_function
    def fp8_carrier(EXPONENT_BITS, MANTISSA_BITS):
        """(the PTX name of a pair of the FP8 type, its exponent bias) whose conversion
        rounds a sub-byte float's values exactly as the format does, once they are
        scaled by `carrier_scale`: the type with as many mantissa bits (Hopper converts
        float32 pairs to FP8 in one instruction). None for E2M1 and the integers."""
        return {(2, 3): ("e4m3x2", 7), (3, 2): ("e5m2x2", 15)}.get((EXPONENT_BITS, MANTISSA_BITS))

    @gluon.constexpr_function
    def carrier_scale(EXPONENT_BITS, MANTISSA_BITS):
        """The power of two that maps a sub-byte float's smallest normal onto its FP8
        carrier's (2**-6: E2M3's 1 to E4M3's 2**-6; 2**-12: E3M2's 2**-2 to E5M2's
        2**-14): the two grids then coincide over the format's range, and the carrier's
        exponent field is the format's. 1.0 for formats without a carrier."""
        if fp8_carrier(EXPONENT_BITS, MANTISSA_BITS) is None:
            return 1.0
        return float(2.0 ** ((2 ** (EXPONENT_BITS - 1) - 1) - fp8_carrier(EXPONENT_BITS, MANTISSA_BITS)[1]))

    @gluon.constexpr_function
    def carrier_field(EXPONENT_BITS, MANTISSA_BITS):
        """Codes a kernel converts and packs at once: the four of a 24-bit field for a
        float with an FP8 carrier (`carrier_packing`), else one."""
        return 1 if fp8_carrier(EXPONENT_BITS, MANTISSA_BITS) is None else 4

    @gluon.constexpr_function
    def bit_moves(shift, steps):
        """PTX moving bit fields of the register w: for each (n, moved, kept), the bits
        `moved` of w shifted by n (`shift`: "shl" or "shr") joined to the bits `kept`."""
        return "\n".join(
            f"{shift}.b32 t, w, {n}; and.b32 t, t, {moved:#010x}; and.b32 w, w, {kept:#010x}; or.b32 w, w, t;"
            for n, moved, kept in steps
        )

    @gluon.constexpr_function
    def carrier_packing(EXPONENT_BITS, MANTISSA_BITS):
        """PTX of four values ($4..$7, times `carrier_scale`) to their 6-bit codes packed
        into a 24-bit field ($0, the first code lowest; $1..$3 zero): two conversions to
        the FP8 carrier (a byte each, its exponent field's top bits zero), each byte's
        sign moved down next to its 5 fields, then the 6-bit codes closed up, byte pairs
        into 12 bits, then the two halves into 24. Nine logic operations for four codes,
        where packing them one by one takes about twenty."""
        pair = fp8_carrier(EXPONENT_BITS, MANTISSA_BITS)[0]
        return f"""{{
        .reg .b16 low, high;
        .reg .b32 w, t;
        cvt.rn.satfinite.{pair}.f32 low, $5, $4;
        cvt.rn.satfinite.{pair}.f32 high, $7, $6;
        mov.b32 w, {{low, high}};
        {bit_moves("shr", ((2, 0x20202020, 0x1F1F1F1F), (2, 0x0FC00FC0, 0x003F003F), (4, 0x00FFF000, 0x00000FFF)))}
        mov.b32 $0, w;
        mov.b32 $1, 0;
        mov.b32 $2, 0;
        mov.b32 $3, 0;
        }}"""

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
    def half_exponent_scale(EXPONENT_BITS):
        """2**(15 - bias): a sub-byte float's sign, exponent and mantissa bits placed in a
        float16's (its exponent field at the bottom of float16's) read as float16 times
        this are its value, subnormals included (float16's own subnormals)."""
        return float(2.0 ** (15 - (2 ** (EXPONENT_BITS - 1) - 1)))

    @gluon.jit
    def code_values(
        codes, INTEGER: gl.constexpr, BITS: gl.constexpr, EXPONENT_BITS: gl.constexpr, MANTISSA_BITS: gl.constexpr
    ):
        """float32 values of int32 sub-byte codes (`formats.WireFormat.from_codes`) over
        `code_unit`: integers sign-extended; sub-byte floats through a float16
        (`half_exponent_scale`), a few instructions where decoding the fields takes a
        dozen."""
        if INTEGER:
            sign = 1 << (BITS - 1)
            values = ((codes ^ sign) - sign).to(gl.float32)
        else:
            FIELDS: gl.constexpr = EXPONENT_BITS + MANTISSA_BITS
            half = (((codes >> FIELDS) & 1) << 15) | ((codes & ((1 << FIELDS) - 1)) << (10 - MANTISSA_BITS))
            values = half.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        return values

    @gluon.constexpr_function
    def code_unit(INTEGER, EXPONENT_BITS, MANTISSA_BITS):
        """The power of two the decoded codes (`code_values`, `carrier_values`) are in
        units of, which a multiplier takes on: 1 for integers, `half_exponent_scale` for
        floats decoded through float16, 1 / `carrier_scale` through an FP8 carrier."""
        if INTEGER:
            return 1.0
        if fp8_carrier(EXPONENT_BITS, MANTISSA_BITS) is not None:
            return 1.0 / carrier_scale(EXPONENT_BITS, MANTISSA_BITS)
        return half_exponent_scale(EXPONENT_BITS)

    @gluon.constexpr_function
    def carrier_unpacking(EXPONENT_BITS, MANTISSA_BITS):
        """PTX of a 24-bit field of four 6-bit codes ($4, `carrier_packing`'s) to their
        values as float32 times `carrier_scale` ($0..$3, the first code first): the
        packing's steps undone (halves, bytes, the sign back to bit 7), then two pair
        conversions from the FP8 carrier to float16, exact, and on to float32."""
        pair = fp8_carrier(EXPONENT_BITS, MANTISSA_BITS)[0]
        return f"""{{
        .reg .b16 low, high, h0, h1, h2, h3;
        .reg .b32 w, t, p, q;
        mov.b32 w, $4;
        {bit_moves("shl", ((4, 0x0FFF0000, 0x00000FFF), (2, 0x3F003F00, 0x003F003F), (2, 0x80808080, 0x1F1F1F1F)))}
        mov.b32 {{low, high}}, w;
        cvt.rn.f16x2.{pair} p, low;
        cvt.rn.f16x2.{pair} q, high;
        mov.b32 {{h0, h1}}, p;
        mov.b32 {{h2, h3}}, q;
        cvt.f32.f16 $0, h0;
        cvt.f32.f16 $1, h1;
        cvt.f32.f16 $2, h2;
        cvt.f32.f16 $3, h3;
        }}"""

    @gluon.jit
    def carrier_values(fields, EXPONENT_BITS: gl.constexpr, MANTISSA_BITS: gl.constexpr):
        """The four codes of each 24-bit field as float32 times `carrier_scale`: four
        tensors in the fields' layout, the first codes first (`carrier_unpacking`)."""
        return gl.inline_asm_elementwise(
            carrier_unpacking(EXPONENT_BITS, MANTISSA_BITS),
            "=r,=r,=r,=r,r",
            [fields],
            [gl.float32, gl.float32, gl.float32, gl.float32],
            True,
            1,
        )

    @gluon.jit
    def interleave_four(first, second, third, fourth):
        """(a, b, 4 n) of four (a, b, n) tensors: element i of each at 4 i, 4 i + 1, ..."""
        joined = gl.join(gl.join(first, third), gl.join(second, fourth))
        return joined.reshape([first.shape[0], first.shape[1], first.shape[2] * 4])

    @gluon.constexpr_function
    def unit_codes(BITS):
        """`codes_per_unit` at compile time (a constexpr function calls no plain Python
        function)."""
        return 32 // math.gcd(BITS, 32)

    @gluon.constexpr_function
    def unit_words(BITS):
        """The 32-bit words U codes fill."""
        return BITS // math.gcd(BITS, 32)

    @gluon.constexpr_function
    def padded_words(BITS):
        """`unit_words` rounded up to a power of two (a tensor's extent)."""
        return 1 << (unit_words(BITS) - 1).bit_length()

    @gluon.constexpr_function
    def packing_layout(G, BITS, NUM_WARPS, VALUES):
        """(rows, units, padded words, codes) of packed groups: whole units in one thread,
        VALUES consecutive codes of a group if that is a whole number of them (as the
        split layout of V = VALUES holds them, so that no values move between the two),
        at least one, and at most 32 lanes a group."""
        U = unit_codes(BITS)
        values = max(VALUES, U, G // 32)
        return gl.BlockedLayout(
            [1, values // U, padded_words(BITS), U],
            [32 // (G // values), G // values, 1, 1],
            [NUM_WARPS, 1, 1, 1],
            [3, 2, 1, 0],
        )

    @gluon.constexpr_function
    def row_elements(G, BITS):
        """Elements of the payload pointer's type a group takes: G codes, or its packed
        codes' G * BITS / 32 words."""
        return G if BITS == 8 else G * BITS // 32

    @gluon.jit
    def _field_offsets(G: gl.constexpr, BITS: gl.constexpr, NUM_WARPS: gl.constexpr, VALUES: gl.constexpr):
        """(1, 1, WP, U): where code i of a unit starts in its word k, BITS * i - 32 * k
        (negative: it started in the word before). Past the unit's words every code
        lies wholly before the word."""
        layout: gl.constexpr = packing_layout(G, BITS, NUM_WARPS, VALUES)
        # Each expanded axis by axis, left to right, as its layout is sliced.
        words = gl.arange(0, padded_words(BITS), layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
        codes = gl.arange(0, unit_codes(BITS), layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
        return BITS * codes[None, None, None, :] - 32 * words[None, None, :, None]

    @gluon.jit
    def packed_offsets(
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        BITS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
    ):
        """(word offsets, mask) of rows [start, start + ROWS) of packed groups (G * BITS
        / 32 words a row), as (rows, units, padded words) in `packing_layout`; the mask
        drops rows past n_rows and the padding words."""
        layout: gl.constexpr = gl.SliceLayout(3, packing_layout(G, BITS, NUM_WARPS, VALUES))
        U: gl.constexpr = unit_codes(BITS)
        rows = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        units = gl.arange(0, G // U, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        words = gl.arange(0, padded_words(BITS), layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        offsets = (
            rows.to(gl.int64)[:, None, None] * row_elements(G, BITS)
            + (units * unit_words(BITS))[None, :, None]
            + words[None, None, :]
        )
        return offsets, (rows < n_rows)[:, None, None] & (words < unit_words(BITS))[None, None, :]

    @gluon.jit
    def store_packed(
        base,
        codes,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        BITS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
    ):
        """Store int32 codes (ROWS, G) (their low BITS bits) packed as `formats.pack_codes`
        packs them (32-bit words, little-endian) into rows [start, ...) at `base` (a
        uint32 pointer); rows past n_rows are not stored. `codes` may also be (ROWS, G /
        F) fields of F consecutive codes each (`sub_byte_codes`), packed alike."""
        # Fields: FIELDS of FIELD_BITS bits a row, packed as codes are.
        FIELDS: gl.constexpr = codes.shape[1]
        FIELD_BITS: gl.constexpr = G * BITS // FIELDS
        VALUE_FIELDS: gl.constexpr = VALUES * FIELDS // G
        U: gl.constexpr = unit_codes(FIELD_BITS)
        layout: gl.constexpr = packing_layout(FIELDS, FIELD_BITS, NUM_WARPS, VALUE_FIELDS)
        units = gl.convert_layout(codes.reshape([ROWS, FIELDS // U, U]), gl.SliceLayout(2, layout))
        offset = _field_offsets(FIELDS, FIELD_BITS, NUM_WARPS, VALUE_FIELDS)
        fields = units.to(gl.uint32, bitcast=True)[:, :, None, :]
        placed = gl.where(
            offset >= 0, fields << gl.maximum(offset, 0).to(gl.uint32), fields >> gl.maximum(-offset, 0).to(gl.uint32)
        )
        # The fields of a word are disjoint: their sum is their bitwise or.
        words = gl.sum(gl.where((offset > -FIELD_BITS) & (offset < 32), placed, 0), axis=3)
        offsets, mask = packed_offsets(start, n_rows, ROWS, FIELDS, FIELD_BITS, NUM_WARPS, VALUE_FIELDS)
        gl.store(base + offsets, words, mask=mask)

    @gluon.jit
    def load_packed(
        base,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        BITS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
    ):
        """int32 codes (ROWS, G / U, U) of rows [start, ...) of packed groups at `base` (a
        uint32 pointer), in `packing_layout` sliced at its words: `store_packed`'s
        inverse; rows past n_rows are not read (their codes are undefined)."""
        offsets, mask = packed_offsets(start, n_rows, ROWS, G, BITS, NUM_WARPS, VALUES)
        words = gl.load(base + offsets, mask=mask)[:, :, :, None]
        offset = _field_offsets(G, BITS, NUM_WARPS, VALUES)
        fields = gl.where(
            offset >= 0, words >> gl.maximum(offset, 0).to(gl.uint32), words << gl.maximum(-offset, 0).to(gl.uint32)
        )
        fields = gl.where((offset > -BITS) & (offset < 32), fields & ((1 << BITS) - 1), 0)
        return gl.sum(fields, axis=2).to(gl.int32, bitcast=True)

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
    def sum_shift(source_ptr, stride, first, rows, in_range, SHARDS: gl.constexpr, MESSAGE_SCALES: gl.constexpr):
        """shift per row (`wire.sum_shift`): the binade of the shards' largest multiplier
        above 1, which the sum is scaled down by, in the layout of `rows`."""
        largest = load_multiplier(source_ptr, rows, in_range, first, MESSAGE_SCALES)
        for shard in gl.static_range(1, SHARDS):
            largest = gl.maximum(
                largest, load_multiplier(source_ptr + shard * stride, rows, in_range, first, MESSAGE_SCALES)
            )
        return gl.maximum(((largest.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 126, 0)

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
            codes = load_packed(
                payload_ptr + shard * in_rows * row_elements(G, BITS),
                start,
                n_rows,
                ROWS,
                G // F,
                BITS * F,
                NUM_WARPS,
                VALUES // F,
            )
            # The codes' constant unit goes into the multiplier (exact: it is at most 2
            # after the shift).
            multiplier = load_multiplier(source_ptr + shard * stride, rows, in_range, first, MESSAGE_SCALES)
            multiplier = (times_pow2(multiplier, -shift) * code_unit(INTEGER, EXPONENT_BITS, MANTISSA_BITS))[
                :, None, None
            ]
            if F == 1:
                summed = summed + code_values(codes, INTEGER, BITS, EXPONENT_BITS, MANTISSA_BITS) * multiplier
            else:
                values = carrier_values(codes, EXPONENT_BITS, MANTISSA_BITS)
                summed = summed + values[0] * multiplier
                second = second + values[1] * multiplier
                third = third + values[2] * multiplier
                fourth = fourth + values[3] * multiplier
        if F > 1:
            summed = interleave_four(summed, second, third, fourth)
        return summed.reshape([ROWS, G]), shift

    @gluon.jit
    def scaled_codes(
        values,
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
        """`wire.quantize_scaled` of a tile of groups y = values * factor: stores
        the packed scales of its `rows` (along the tile's rows; `in_range` masks them) at
        `scales_ptr` and returns the codes in the layout of `values`: 8-bit codes in
        `codes_dtype`, sub-byte codes as int32 (`sub_byte_codes`)."""
        scale = gl.div_rn(gl.max(gl.abs(values), axis=1) * factor, gl.full_like(factor, FMT_MAX))
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
