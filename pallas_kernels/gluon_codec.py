"""What the Gluon codec kernels share (Gluon: Triton with explicit layouts): their launch
helpers, and the per-group math in registers, step for
step `wire`'s (IEEE division and square root for the per-group scalars): the
binade normalization, the Walsh-Hadamard stages within a thread, the scales and the
codes. The row kernel (`row_kernels`) and the split kernels (`split_kernels`) build on it.
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
}


def inverse_sqrt(group_size: int) -> float:
    """1/sqrt(G) rounded to float32, as the Pallas kernels fold it into the factor."""
    return float(np.float32(1.0 / np.sqrt(group_size)))


def quantization(fmt: str, scale_format: str) -> dict:
    """The quantizing kernels' constexprs: the format's largest value, whether it is an
    integer format, and the scale encoding's id."""
    element = formats.wire_format(fmt)
    return dict(FMT_MAX=float(element.max_value), INTEGER=element.is_integer, SCALES=SCALE_FORMAT_IDS[scale_format])


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
    ):
        """`wire.quantize_scaled` of a tile of groups y = values * factor: stores
        the packed scales of its `rows` (along the tile's rows; `in_range` masks them) at
        `scales_ptr` and returns the codes in `codes_dtype`, in the layout of `values`."""
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
        scaled = values * gl.div_rn(factor, divisor)[:, None]
        if INTEGER:
            return ((scaled + ROUNDING_BIAS).to(gl.int32, bitcast=True) - ROUNDING_BIAS_BITS).to(gl.int8)
        return scaled.to(codes_dtype)
