"""The split kernels in Gluon: a group spread over G / V lanes of a warp, V consecutive
values a thread (`SplitConfig`). They run every decode (one shard, a sum of k shards, to
a float dtype or requantized into a new message) and the compress of groups larger than
the row kernel holds. A group's statistics are reductions over its lanes, and the
Walsh-Hadamard stages across lanes are warp shuffles. Packed codes are summed in the
layout they unpack in. Decoding whole messages, every kernel reads its multipliers from
the scale entries there (`gluon_codec.load_multiplier`); groups decoded apart from a
message take them from a float32 array.

The math is `gluon_codec`'s; `decompress.decompress_reference` (and, for the compress of
larger groups, `compress.compress_reference`) is what they are tested against.
`decompress` dispatches here by default where `gluon_codec.supports` holds
(`decode_config` picks the launch). There is no interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from . import formats, triton_launch, wire
from .gluon_codec import (
    POINTER_TYPES,
    SCALE_FORMAT_IDS,
    code_pointer,
    element_codes,
    grid,
    inverse_sqrt,
    quantization,
    scale_dtype,
    scales_struct,
)
from .gluon_packing import codes_per_unit
from .launch import output_struct

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # no Triton with Gluon: `supports` is False and nothing below is traced
    gluon = gl = async_copy = None


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Launch parameters of the split kernels: every decode (one shard, a sum of k, the
    requantized sum), and compress of groups the row kernel does not hold. A group's
    values are spread over G / V lanes of a warp, V consecutive values per thread.

    The defaults are the sum's (`SPLIT_ONE_SHARD`, `SPLIT_REQUANTIZE` and
    `SPLIT_COMPRESS` below for the other work), the fastest of
    `benchmarks.kernels.SPLIT_LAUNCHES` on the H200 (benchmarks/RESULTS.md).

    Attributes:
      values_per_thread: V: 4, 8, 16 or 32; at most G, and at least G / 32 (a group
        spans at most one warp).
      rows_per_thread: groups each thread holds a slice of: 1, 2 or 4.
      num_warps: warps per program: 1, 2, 4 or 8.
      half_sums: a requantized sum of INT4 codes summed in float16 pairs
        (`gluon_codec.int4_half_sum`): half the instructions of the float32 sum, for
        about 2**-11 of the sum's error, which moves a requantized code one step for
        about 0.1% of the values. Off by default until timed on a GPU.
    """

    values_per_thread: int = 8
    rows_per_thread: int = 1
    num_warps: int = 4
    half_sums: bool = False
    backend: ClassVar[str] = "gluon"

    def __post_init__(self):
        for name, allowed in (("values_per_thread", (4, 8, 16, 32)), ("rows_per_thread", (1, 2, 4))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"SplitConfig.{name} must be one of {allowed}, got {getattr(self, name)}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"SplitConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")

    def values(self, group_size: int) -> int:
        """V for groups of `group_size`: `values_per_thread`, within [G / 32, G]."""
        return min(max(self.values_per_thread, group_size // 32), group_size)

    def rows_per_program(self, group_size: int) -> int:
        """Groups one program takes: 32 / (G / V) per warp, times `rows_per_thread`."""
        return 32 // (group_size // self.values(group_size)) * self.num_warps * self.rows_per_thread


# The requantized sum computes a group's statistics across its lanes: fewer lanes per
# group (more values per thread) were faster on the H200 (benchmarks/RESULTS.md).
SPLIT_REQUANTIZE = SplitConfig(values_per_thread=32, num_warps=2)


# One shard decoded has little work per value: two groups per thread were faster on the
# H200 (92-98% of copy against 84-95% with one, and 91-93% for a group per thread).
SPLIT_ONE_SHARD = SplitConfig(rows_per_thread=2, num_warps=2)


# Packed codes (fewer than 8 bits), from the H100 sweep of `benchmarks.kernels
# --packed-launches` (benchmarks/RESULTS.md): a sum of shards was fastest at 32 values a
# thread for every format (INT4 G128 85% of a copy against 76% at 8); one shard decoded
# keeps two rows a thread at no more than 16 values, since INT5's unit of 32 codes there
# ran at half the speed of 16 (53% of a copy against 84%).
PACKED_SUM_VALUES = 32
PACKED_ONE_SHARD_VALUES = 16

# A requantized sum of packed sub-byte floats takes two groups a thread: its minifloat
# decode and encode cost more instructions a value than the integers', and the second
# group halves each value's share of the thread's fixed work (E2M3 G128 89% of a copy
# against 83% on the H100; the integer formats gained at most a point, and INT5 lost two:
# `kernels_packed.json`).
PACKED_FLOAT_REQUANTIZE_ROWS = 2


# Compress of groups larger than the row kernel holds.
SPLIT_COMPRESS = SplitConfig(values_per_thread=32, num_warps=2)


def split_constexprs(group_size: int, config: SplitConfig) -> dict[str, int]:
    """The split kernels' layout constexprs: V values per thread and the rows a program
    takes."""
    return dict(
        VALUES=config.values(group_size),
        ROWS=config.rows_per_program(group_size),
        NUM_WARPS=config.num_warps,
    )


def gluon_decompress(
    payload: jax.Array,
    multiplier: jax.Array,
    *,
    groups: int,
    fmt: str,
    transform: bool,
    out_dtype=jnp.float32,
    requantize_to: str | None = None,
    payload_rows: int = 0,
    config: SplitConfig | None = None,
    message_scales: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """For each of B batches, the sum of its k dequantized shards, decoded or requantized,
    as `decompress.decompress_reference`.

    Under `jax.vmap` the mapped axes fold into the batch dimension B, so a vmapped call
    is one launch.

    Args:
      payload: (B, k, rows >= N, G) codes in `fmt`, or uint8 message buffers holding
        their bytes (`wire`): (B, k, rows, G * bits / 8) for packed sub-byte codes.
      multiplier: (B, k, N) float32 per-group dequantization multipliers.
      groups: N.
      fmt: the codes' format: "e4m3", "e5m2", "int8", or a sub-byte format (packed).
      transform: apply the inverse Walsh-Hadamard transform to the sum (decode only).
      out_dtype: float32, bfloat16 or float16: the decoded dtype.
      requantize_to: a scale format to quantize the sum into (in `fmt`, with no
        transform: it is already in the transformed domain) instead of decoding it.
      payload_rows: with `requantize_to`, rows of each batch's output payload block, at
        least N; rows past N are left unwritten (a message's scale rows).
      config: the split kernel's launch; the default of the work if None
        (`decode_config`).
      message_scales: the scale format of `payload`'s own entries, where it holds whole
        messages: the kernel decodes the multipliers from them, and `multiplier` goes
        unused.

    Returns:
      decoded (B, N, G) in `out_dtype`, or with `requantize_to` (payload (B, payload_rows,
      G) in the dtype of `payload`, scales (B, N, 2) for "dual", else (B, N)).
    """
    launch = functools.partial(
        _launch_decompress,
        message_scales=message_scales,
        groups=groups,
        fmt=fmt,
        transform=transform,
        out_dtype=jnp.dtype(out_dtype),
        requantize_to=requantize_to,
        payload_rows=max(payload_rows, groups),
        config=config,
    )
    batched = jax.custom_batching.custom_vmap(launch)

    @batched.def_vmap
    def fold_batch(axis_size, in_batched, payload, multiplier):
        payload, multiplier = (
            value if mapped else jnp.broadcast_to(value, (axis_size, *value.shape))
            for value, mapped in zip((payload, multiplier), in_batched)
        )
        outputs = batched(
            payload.reshape(axis_size * payload.shape[1], *payload.shape[2:]),
            multiplier.reshape(axis_size * multiplier.shape[1], *multiplier.shape[2:]),
        )
        if requantize_to is None:
            return outputs.reshape(axis_size, -1, *outputs.shape[1:]), True
        return tuple(out.reshape(axis_size, -1, *out.shape[1:]) for out in outputs), (True, True)

    return batched(payload, multiplier if message_scales is None else payload)


def decode_config(shards: int, requantize: bool, config: SplitConfig | None = None, fmt: str = "int8") -> SplitConfig:
    """The split kernel's launch for a decode.

    Args:
      shards: k, the shards summed.
      requantize: whether the sum is requantized.
      config: the launch asked for, or None for the default of the work.
      fmt: the codes' format: packed codes take `PACKED_SUM_VALUES` a thread in a sum,
        and in one shard their packing unit (`gluon_packing.codes_per_unit`, so that no
        unit is unpacked twice) up to `PACKED_ONE_SHARD_VALUES`; a requantized sum of
        packed floats takes `PACKED_FLOAT_REQUANTIZE_ROWS` groups a thread.

    Returns:
      `config`, or the default launch of the work: `SPLIT_REQUANTIZE` for a requantized
      sum, `SPLIT_ONE_SHARD` for one shard decoded, `SplitConfig()` for a sum, with the
      values a thread of packed codes above.

    Raises:
      ValueError: `config` is not a `SplitConfig`.
    """
    if config is None:
        default = SPLIT_REQUANTIZE if requantize else SPLIT_ONE_SHARD if shards == 1 else SplitConfig()
        element = formats.wire_format(fmt)
        bits = element.bits
        if requantize and bits < 8 and not element.is_integer:
            return dataclasses.replace(default, rows_per_thread=PACKED_FLOAT_REQUANTIZE_ROWS)
        if bits == 8 or requantize:
            return default
        if shards > 1:
            return dataclasses.replace(default, values_per_thread=PACKED_SUM_VALUES)
        values = min(codes_per_unit(bits), PACKED_ONE_SHARD_VALUES)
        return dataclasses.replace(default, values_per_thread=max(default.values_per_thread, values))
    if not isinstance(config, SplitConfig):
        raise ValueError(f"the Gluon decode kernels are the split kernels: pass a SplitConfig, got {config!r}")
    return config


def decode_kernel(
    fmt: str,
    group_size: int,
    shards: int,
    transform: bool,
    requantize_to: str | None,
    config: SplitConfig,
    message_scales: str | None = None,
) -> tuple:
    """(the Gluon split kernel, its constexprs) of a decode of `shards` shards, or of
    their sum requantized into the scale format `requantize_to`; the multipliers read
    from a float32 array, or from the messages' entries in `message_scales`."""
    if config.half_sums and (requantize_to is None or fmt != "int4"):
        work = "a decode" if requantize_to is None else f"a requantized sum of {fmt}"
        raise ValueError(f"SplitConfig.half_sums sums INT4 codes that are requantized, not {work}")
    source = -1 if message_scales is None else SCALE_FORMAT_IDS[message_scales]
    constexprs = dict(G=group_size, SHARDS=shards, MESSAGE_SCALES=source, **split_constexprs(group_size, config))
    if requantize_to is not None:
        return taco_split_requantize, constexprs | quantization(fmt, requantize_to) | dict(HALF_SUMS=config.half_sums)
    headroom = wire.scale_headroom(formats.wire_format(fmt), group_size, transform)
    transform_constexprs = dict(TRANSFORM=transform, INV_SQRT=inverse_sqrt(group_size), HEADROOM=headroom)
    return taco_split_decode, constexprs | element_codes(fmt) | transform_constexprs


def _launch_decompress(
    payload, source, *, groups, fmt, transform, out_dtype, requantize_to, payload_rows, config, message_scales
):
    """One launch of a decode kernel; arguments as `gluon_decompress`, the multipliers'
    source being the float32 multipliers, or with `message_scales` the messages."""
    batch, shards, in_rows, width = payload.shape
    # Packed codes come as uint8 message buffers, G * bits / 8 bytes a group.
    group_size = width * 8 // formats.wire_format(fmt).bits
    config = decode_config(shards, requantize_to is not None, config, fmt)
    codes = code_pointer(fmt)
    scalars = [("n_rows", "i32", groups), ("in_rows", "i64", in_rows)]
    kernel, constexprs = decode_kernel(fmt, group_size, shards, transform, requantize_to, config, message_scales)
    # A float32 multiplier array reads as "single" scales do.
    sources = [codes, POINTER_TYPES[scale_dtype(message_scales or "single")]]
    common = dict(
        grid=grid(groups, batch, config.rows_per_program(group_size)),
        num_warps=config.num_warps,
        constexprs=constexprs,
    )
    if requantize_to is None:
        return triton_launch.gluon_call(
            kernel,
            [payload, source],
            [output_struct((batch, groups, group_size), out_dtype, payload)],
            pointer_types=[*sources, POINTER_TYPES[out_dtype]],
            scalars=scalars,
            **common,
        )[0]
    return tuple(
        triton_launch.gluon_call(
            kernel,
            [payload, source],
            [
                output_struct((batch, payload_rows, width), payload.dtype, payload),
                scales_struct(batch, groups, requantize_to, payload),
            ],
            pointer_types=[*sources, codes, POINTER_TYPES[scale_dtype(requantize_to)]],
            scalars=[*scalars, ("payload_rows", "i64", payload_rows)],
            **common,
        )
    )


if gluon is not None:
    from .gluon_codec import (
        hadamard_across_lanes,
        int4_half_sum,
        load_multiplier,
        multiplier_source,
        normalize,
        normalize_half_sum,
        packed_sum,
        pow2,
        power_of_two,
        saturating_cast,
        scaled_codes,
        sum_shift,
        times_pow2,
        with_headroom,
    )
    from .gluon_packing import group_values, row_elements, store_packed

    @gluon.constexpr_function
    def _split_layout(G, VALUES, NUM_WARPS):
        """VALUES consecutive values of a group per thread, G / VALUES lanes per group."""
        return gl.BlockedLayout([1, VALUES], [32 // (G // VALUES), G // VALUES], [NUM_WARPS, 1], [1, 0])

    @gluon.jit
    def _split_tile(start, n_rows, ROWS: gl.constexpr, G: gl.constexpr, layout: gl.constexpr):
        """(element offsets, row indices, rows in range) of rows [start, start + ROWS) of
        an array of G-wide rows, in the split `layout`."""
        rows = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, G, layout=gl.SliceLayout(0, layout))
        return rows.to(gl.int64)[:, None] * G + cols[None, :], rows, rows < n_rows

    @gluon.jit
    def _program_tile(n_rows, G: gl.constexpr, VALUES: gl.constexpr, ROWS: gl.constexpr, NUM_WARPS: gl.constexpr):
        """This program's rows of its batch in the split layout: (element offsets within
        the batch, row indices, rows in range, batch index)."""
        layout: gl.constexpr = _split_layout(G, VALUES, NUM_WARPS)
        offsets, rows, in_range = _split_tile(gl.program_id(0) * ROWS, n_rows, ROWS, G, layout)
        return offsets, rows, in_range, gl.program_id(1).to(gl.int64)

    @gluon.jit
    def _shard_values(
        shard_ptr,
        offsets,
        in_range,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
        INTEGER: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
    ):
        """One shard's code values as float32 on the tile `_split_tile` gives (its rows
        from `start`; `shard_ptr` at the shard's first row): 8-bit codes converted,
        packed codes unpacked and decoded (rows out of range are not read)."""
        if BITS == 8:
            values = gl.load(shard_ptr + offsets, mask=in_range[:, None]).to(gl.float32)
        else:
            values = group_values(
                shard_ptr, start, n_rows, ROWS, G, NUM_WARPS, VALUES, INTEGER, BITS, EXPONENT_BITS, MANTISSA_BITS
            )
            values = gl.convert_layout(values, offsets.type.layout)
        return values

    @gluon.jit
    def _split_sum(
        payload_ptr,
        source_ptr,
        offsets,
        rows,
        in_range,
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
        """The float32 sum over the shards of codes times their groups' multipliers scaled
        by 2**-shift, and shift per row (`wire.sum_shift`), on the tile
        `_split_tile` gives (rows out of range are not read; their values are undefined
        and never stored); the pointers are at the batch's first shard, the multipliers'
        source as `multiplier_source`."""
        if BITS == 8:
            stride, first = multiplier_source(n_rows, in_rows, G, MESSAGE_SCALES)
            shift = sum_shift(source_ptr, stride, first, rows, in_range, SHARDS, MESSAGE_SCALES)
            summed = gl.zeros_like(offsets, dtype=gl.float32)
            for shard in gl.static_range(SHARDS):
                codes = gl.load(payload_ptr + shard * in_rows * G + offsets, mask=in_range[:, None]).to(gl.float32)
                multiplier = load_multiplier(source_ptr + shard * stride, rows, in_range, first, MESSAGE_SCALES)
                summed = summed + codes * times_pow2(multiplier, -shift)[:, None]
        else:
            # Summed in the layout the codes unpack in: one layout conversion for the
            # sum, not one a shard.
            summed, shift = packed_sum(
                payload_ptr,
                source_ptr,
                start,
                n_rows,
                in_rows,
                MESSAGE_SCALES,
                SHARDS,
                ROWS,
                G,
                NUM_WARPS,
                VALUES,
                INTEGER,
                BITS,
                EXPONENT_BITS,
                MANTISSA_BITS,
            )
            summed, shift = gl.convert_layout(summed, offsets.type.layout), gl.convert_layout(shift, rows.type.layout)
        return summed, shift

    @gluon.jit
    def _store_codes(
        base,
        codes,
        offsets,
        in_range,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
        BITS: gl.constexpr,
    ):
        """Store a split tile's codes at `base` (the batch's first row): 8-bit codes as
        they are, sub-byte ones packed (rows out of range are not stored)."""
        if BITS == 8:
            gl.store(base + offsets, codes, mask=in_range[:, None])
        else:
            store_packed(base, codes, start, n_rows, ROWS, G, BITS, NUM_WARPS, VALUES)

    @gluon.jit
    def taco_split_compress(
        x_ptr,
        payload_ptr,
        scales_ptr,
        n_rows,
        payload_rows,
        G: gl.constexpr,
        VALUES: gl.constexpr,
        ROWS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        TRANSFORM: gl.constexpr,
        INV_SQRT: gl.constexpr,
        HEADROOM: gl.constexpr,
        FMT_MAX: gl.constexpr,
        SCALES: gl.constexpr,
        INTEGER: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
    ):
        """`taco_row_compress` in the split layout: the group statistics are reductions
        over a group's lanes, and nothing goes through shared memory (but the packing of
        sub-byte codes)."""
        offsets, rows, in_range, batch = _program_tile(n_rows, G, VALUES, ROWS, NUM_WARPS)
        groups = gl.load(x_ptr + batch * n_rows * G + offsets, mask=in_range[:, None]).to(gl.float32)
        values, factor, prescale, absmax = normalize(groups, FMT_MAX, G)
        if TRANSFORM:  # the unnormalized transform: 1/sqrt(G) goes into the factor
            values = hadamard_across_lanes(values, ROWS, G, VALUES)
            factor = factor * INV_SQRT
            absmax = gl.max(gl.abs(values), axis=1)
        codes = scaled_codes(
            values,
            absmax,
            factor,
            with_headroom(prescale, HEADROOM),
            payload_ptr.dtype.element_ty,
            scales_ptr + batch * n_rows * (2 if SCALES == 0 else 1),
            rows,
            in_range,
            FMT_MAX,
            INTEGER,
            SCALES,
            BITS,
            EXPONENT_BITS,
            MANTISSA_BITS,
        )
        _store_codes(
            payload_ptr + batch * payload_rows * row_elements(G, BITS),
            codes,
            offsets,
            in_range,
            gl.program_id(0) * ROWS,
            n_rows,
            ROWS,
            G,
            NUM_WARPS,
            VALUES,
            BITS,
        )

    @gluon.jit
    def taco_split_decode(
        payload_ptr,
        source_ptr,
        out_ptr,
        n_rows,
        in_rows,
        G: gl.constexpr,
        VALUES: gl.constexpr,
        ROWS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        SHARDS: gl.constexpr,
        MESSAGE_SCALES: gl.constexpr,
        TRANSFORM: gl.constexpr,
        INV_SQRT: gl.constexpr,
        HEADROOM: gl.constexpr,
        INTEGER: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
    ):
        """The sum of k dequantized shards, inverse-transformed or not, in the output
        dtype, times 2**HEADROOM (`wire.scale_headroom`)."""
        offsets, rows, in_range, batch = _program_tile(n_rows, G, VALUES, ROWS, NUM_WARPS)
        start = gl.program_id(0) * ROWS
        payload_ptr = payload_ptr + batch * SHARDS * in_rows * row_elements(G, BITS)
        stride, first = multiplier_source(n_rows, in_rows, G * BITS // 8, MESSAGE_SCALES)
        source_ptr = source_ptr + batch * SHARDS * stride
        if TRANSFORM and SHARDS == 1:
            # One shard's codes are transformed first, then scaled (as the reference),
            # so no intermediate overflows near float32's largest.
            codes = _shard_values(
                payload_ptr,
                offsets,
                in_range,
                start,
                n_rows,
                ROWS,
                G,
                NUM_WARPS,
                VALUES,
                INTEGER,
                BITS,
                EXPONENT_BITS,
                MANTISSA_BITS,
            )
            multiplier = load_multiplier(source_ptr, rows, in_range, first, MESSAGE_SCALES)
            values = hadamard_across_lanes(codes, ROWS, G, VALUES) * (multiplier * INV_SQRT)[:, None]
            if HEADROOM > 0:
                values = values * power_of_two(HEADROOM)
        else:
            values, shift = _split_sum(
                payload_ptr,
                source_ptr,
                offsets,
                rows,
                in_range,
                start,
                n_rows,
                in_rows,
                MESSAGE_SCALES,
                SHARDS,
                ROWS,
                G,
                NUM_WARPS,
                VALUES,
                INTEGER,
                BITS,
                EXPONENT_BITS,
                MANTISSA_BITS,
            )
            # One multiply an element undoes the shift and the headroom (and normalizes
            # the transform): 2**shift / sqrt(G) is a finite float32 for every finite
            # multiplier.
            shift = shift + HEADROOM
            half = shift >> 1
            if TRANSFORM:
                values = hadamard_across_lanes(values, ROWS, G, VALUES)
                undo = pow2(half) * INV_SQRT * pow2(shift - half)
            else:
                undo = pow2(half) * pow2(shift - half)
            values = values * undo[:, None]
        out = saturating_cast(values, out_ptr.dtype.element_ty)
        gl.store(out_ptr + batch * n_rows * G + offsets, out, mask=in_range[:, None])

    @gluon.jit
    def taco_split_requantize(
        payload_ptr,
        source_ptr,
        out_ptr,
        scales_ptr,
        n_rows,
        in_rows,
        payload_rows,
        G: gl.constexpr,
        VALUES: gl.constexpr,
        ROWS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        SHARDS: gl.constexpr,
        MESSAGE_SCALES: gl.constexpr,
        FMT_MAX: gl.constexpr,
        SCALES: gl.constexpr,
        INTEGER: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
        HALF_SUMS: gl.constexpr,
    ):
        """The sum of k dequantized shards quantized again (in the transformed domain;
        the multipliers' units, which carry any headroom, stay); INT4 codes summed in
        float16 pairs with HALF_SUMS (`SplitConfig.half_sums`)."""
        offsets, rows, in_range, batch = _program_tile(n_rows, G, VALUES, ROWS, NUM_WARPS)
        start = gl.program_id(0) * ROWS
        stride = multiplier_source(n_rows, in_rows, G * BITS // 8, MESSAGE_SCALES)[0]
        payload_ptr = payload_ptr + batch * SHARDS * in_rows * row_elements(G, BITS)
        source_ptr = source_ptr + batch * SHARDS * stride
        if HALF_SUMS:
            summed, shift, exponent = int4_half_sum(
                payload_ptr, source_ptr, start, n_rows, in_rows, MESSAGE_SCALES, SHARDS, ROWS, G, NUM_WARPS, VALUES
            )
            summed = gl.convert_layout(summed, offsets.type.layout)
            shift, exponent = gl.convert_layout(shift, rows.type.layout), gl.convert_layout(exponent, rows.type.layout)
            values, factor, prescale, absmax = normalize_half_sum(summed, exponent, FMT_MAX, G)
        else:
            summed, shift = _split_sum(
                payload_ptr,
                source_ptr,
                offsets,
                rows,
                in_range,
                start,
                n_rows,
                in_rows,
                MESSAGE_SCALES,
                SHARDS,
                ROWS,
                G,
                NUM_WARPS,
                VALUES,
                INTEGER,
                BITS,
                EXPONENT_BITS,
                MANTISSA_BITS,
            )
            values, factor, prescale, absmax = normalize(summed, FMT_MAX, G)
        # No transform (the sum is already in the transformed domain); the pre-scale is
        # the unscaled sum's.
        codes = scaled_codes(
            values,
            absmax,
            factor,
            times_pow2(prescale, -shift),
            out_ptr.dtype.element_ty,
            scales_ptr + batch * n_rows * (2 if SCALES == 0 else 1),
            rows,
            in_range,
            FMT_MAX,
            INTEGER,
            SCALES,
            BITS,
            EXPONENT_BITS,
            MANTISSA_BITS,
        )
        _store_codes(
            out_ptr + batch * payload_rows * row_elements(G, BITS),
            codes,
            offsets,
            in_range,
            start,
            n_rows,
            ROWS,
            G,
            NUM_WARPS,
            VALUES,
            BITS,
        )
