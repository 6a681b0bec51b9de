"""The codec kernels in Gluon (Triton with explicit layouts): compress with one group per
GPU thread (the row kernel), and every decode (one shard, a sum of k shards, to a float
dtype or requantized) and the compress of larger groups with a group spread over a few
lanes (the split kernels).

The row kernel's program copies 32 * num_warps groups into shared memory (cp.async,
coalesced 16-byte vectors, each row's vectors swizzled so the reads below spread over
the banks), and every thread reads a whole group from there into its registers. The
group statistics, the log2 G add/subtract stages of the Walsh-Hadamard transform and the
quantization then run in registers with no warp shuffle; a layout conversion stores the
results coalesced. It holds groups of at most `ROW_MAX_GROUP`. With its per-group
scalar math (IEEE divisions and a square root) done once per group it takes 18.6
instructions per value, where the split compress took 20-27, and ran at 91-92% of copy
against 80-84%; staging through registers instead (a load, then a layout conversion)
took 19.5 and ran at 86-88%, and taking 2-8 tiles per program with the next one's copy
in flight ran at 77-82% (benchmarks/RESULTS.md).

The split kernels keep the coalesced layout of the codes instead (`SplitConfig`: V
consecutive values per thread, G / V lanes per group), so nothing goes through shared
memory: the group statistics are reductions over those lanes, and the transform runs
log2 V stages in registers, then one stage per lane bit with a warp shuffle (H_G =
H_{G/V} x H_V). Summing k shards, a whole group per thread held too much (194-255
registers, 58-67% of copy); the split kernels take 24-80 and decode at 91-103% of copy
on the H200 (benchmarks/RESULTS.md).

The math is `group_codec`'s, step for step (IEEE division and square root for the
per-group scalars); `compress.compress_reference` and `decompress.decompress_reference`
are what these kernels are tested against. `compress` and `decompress` dispatch here by
default where `supports` holds (`compress_config` and `decode_config` pick the launch).
There is no interpret mode (off GPU the Pallas kernels run in the Pallas interpreter).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import formats, group_codec, triton_launch
from .launch import GLUON_KERNELS, output_struct

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # no Triton with Gluon: `supports` is False and nothing below is traced
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


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Launch parameters of the row kernel: compress with a whole group per thread, for
    groups of at most `ROW_MAX_GROUP` values.

    Attributes:
      num_warps: warps per program; a program takes 32 groups per warp, one per thread.
        One warp was fastest on the H200 (benchmarks/RESULTS.md).
    """

    num_warps: int = 1

    def __post_init__(self):
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"RowConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")

    def rows_per_program(self, group_size: int) -> int:
        """Groups one program takes: one per thread."""
        del group_size  # a whole group per thread, whatever its size
        return 32 * self.num_warps


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
    """

    values_per_thread: int = 8
    rows_per_thread: int = 1
    num_warps: int = 4

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
# Compress of groups larger than the row kernel holds.
SPLIT_COMPRESS = SplitConfig(values_per_thread=32, num_warps=2)
# A whole group per thread holds its float32 values in registers (128 of a thread's 255).
ROW_MAX_GROUP = 128


def compress_config(group_size: int, config: RowConfig | SplitConfig | None = None) -> RowConfig | SplitConfig:
    """The kernel a compress runs on and its launch: the row kernel for groups of at most
    `ROW_MAX_GROUP`, the split kernel for larger ones.

    Args:
      group_size: G.
      config: the launch asked for, or None for the default of the group size.

    Returns:
      `config`, or `RowConfig()` (G <= `ROW_MAX_GROUP`) or `SPLIT_COMPRESS`.

    Raises:
      ValueError: a `RowConfig` for groups larger than `ROW_MAX_GROUP`.
    """
    if config is None:
        return RowConfig() if group_size <= ROW_MAX_GROUP else SPLIT_COMPRESS
    if isinstance(config, RowConfig) and group_size > ROW_MAX_GROUP:
        raise ValueError(
            f"the row kernel holds groups of at most {ROW_MAX_GROUP} values, got {group_size}: pass a SplitConfig"
        )
    return config


def supports(group_size: int, dtype, fmt: str, shards: int = 1) -> bool:
    """Whether the Gluon kernels run groups of `group_size` values of `dtype` (the input of
    a compress, the output of a decode) in `fmt`, summing `shards` shards, here: Gluon on a
    CUDA GPU (`triton_launch.available`) and work `launch.GLUON_KERNELS` takes."""
    return GLUON_KERNELS.takes(group_size, dtype, fmt, shards) and triton_launch.available()


def _vectors(group_size: int, in_dtype, out_dtype) -> dict[str, int]:
    """The coalesced layouts of the kernel's input and output tiles, as constexprs: a
    16-byte vector (or the whole group) per thread, and the lanes that span a group."""
    widths = {
        "IN": min(group_size, 16 // jnp.dtype(in_dtype).itemsize),
        "OUT": min(group_size, 16 // jnp.dtype(out_dtype).itemsize),
    }
    return {
        f"{side}_{key}": value
        for side, width in widths.items()
        for key, value in (("VECTOR", width), ("LANES", group_size // width))
    }


def _inverse_sqrt(group_size: int) -> float:
    """1/sqrt(G) rounded to float32, as the Pallas kernels fold it into the factor."""
    return float(np.float32(1.0 / np.sqrt(group_size)))


def _quantization(fmt: str, scale_format: str) -> dict:
    wire = formats.wire_format(fmt)
    return dict(FMT_MAX=float(wire.max_value), INTEGER=wire.is_integer, SCALES=SCALE_FORMAT_IDS[scale_format])


def scale_dtype(scale_format: str) -> jnp.dtype:
    """The dtype of the kernel's packed scales (every entry of a format has the same one)."""
    return jnp.dtype(formats.SCALE_ENTRY_DTYPES[scale_format][0])


def _scales_struct(batch: int, groups: int, scale_format: str, like: jax.Array) -> jax.ShapeDtypeStruct:
    """The packed scales (`group_codec.pack_scale_entries`) of `batch` x `groups` groups."""
    shape = (batch, groups, 2) if scale_format == "dual" else (batch, groups)
    return output_struct(shape, scale_dtype(scale_format), like)


def _grid(groups: int, batch: int, rows_per_program: int) -> tuple[int, int]:
    return (-(-groups // rows_per_program), batch)


def gluon_compress(
    x: jax.Array,
    *,
    fmt: str,
    scale_format: str,
    transform: bool,
    payload_dtype,
    payload_rows: int,
    config: RowConfig | SplitConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Quantize B batches of N groups, x (B, N, G), as `group_codec.quantize_groups`.

    Under `jax.vmap` the mapped axes fold into the batch dimension B (the kernel's
    second grid axis), so a vmapped call is one launch.

    Args:
      x: (B, N, G) bfloat16, float16 or float32 (`supports`).
      fmt: "e4m3", "e5m2" or "int8".
      scale_format: "dual", "single", "bf16" or "e8m0".
      transform: apply the Walsh-Hadamard transform.
      payload_dtype: dtype of the payload array (the format's, or uint8 for messages).
      payload_rows: rows of each batch's payload block, at least N; rows past N are left
        unwritten (a message's scale rows).
      config: the kernel and its launch (`compress_config`): a `RowConfig` for the row
        kernel, a `SplitConfig` for the split kernel; that of the group size if None.

    Returns:
      (payload (B, payload_rows, G), scales (B, N, 2) for "dual", else (B, N)).
    """
    launch = functools.partial(
        _launch,
        fmt=fmt,
        scale_format=scale_format,
        transform=transform,
        payload_dtype=payload_dtype,
        payload_rows=payload_rows,
        config=compress_config(x.shape[-1], config),
    )
    batched = jax.custom_batching.custom_vmap(launch)

    @batched.def_vmap
    def fold_batch(axis_size, in_batched, x):
        del in_batched  # one argument, batched (custom_vmap calls the rule only then)
        outputs = batched(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
        return [out.reshape(axis_size, -1, *out.shape[1:]) for out in outputs], [True, True]

    return tuple(batched(x))


def _launch(x: jax.Array, *, fmt, scale_format, transform, payload_dtype, payload_rows, config):
    """One launch of the kernel over x (B, N, G); arguments as `compress`."""
    batch, groups, group_size = x.shape
    payload_type = output_struct((batch, payload_rows, group_size), payload_dtype, x)
    constexprs = dict(
        G=group_size, TRANSFORM=transform, INV_SQRT=_inverse_sqrt(group_size), **_quantization(fmt, scale_format)
    )
    if isinstance(config, SplitConfig):
        kernel = taco_split_compress
        constexprs |= _split_constexprs(group_size, config)
    else:
        kernel = taco_row_compress
        constexprs |= _row_constexprs(group_size, config, x.dtype, jnp.int8)
    return triton_launch.gluon_call(
        kernel,
        [x],
        [payload_type, _scales_struct(batch, groups, scale_format, x)],
        pointer_types=[
            POINTER_TYPES[jnp.dtype(x.dtype)],
            POINTER_TYPES[formats.wire_format(fmt).dtype],
            POINTER_TYPES[scale_dtype(scale_format)],
        ],
        scalars=[("n_rows", "i32", groups), ("payload_rows", "i64", payload_rows)],
        grid=_grid(groups, batch, config.rows_per_program(group_size)),
        num_warps=config.num_warps,
        constexprs=constexprs,
    )


def _row_constexprs(group_size: int, config: RowConfig, in_dtype, out_dtype) -> dict[str, int]:
    """The row kernel's layout constexprs: warps, log2 G, and the coalesced vectors of the
    input and output tiles."""
    return dict(
        NUM_WARPS=config.num_warps,
        LOG_G=group_size.bit_length() - 1,
        **_vectors(group_size, in_dtype, out_dtype),
    )


def _split_constexprs(group_size: int, config: SplitConfig) -> dict[str, int]:
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
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """For each of B batches, the sum of its k dequantized shards, decoded or requantized,
    as `decompress.decompress_reference`.

    Under `jax.vmap` the mapped axes fold into the batch dimension B, so a vmapped call
    is one launch.

    Args:
      payload: (B, k, rows >= N, G) codes in `fmt`, or uint8 message buffers holding
        their bytes (`wire`).
      multiplier: (B, k, N) float32 per-group dequantization multipliers.
      groups: N.
      fmt: the codes' format: "e4m3", "e5m2" or "int8".
      transform: apply the inverse Walsh-Hadamard transform to the sum (decode only).
      out_dtype: float32, bfloat16 or float16: the decoded dtype.
      requantize_to: a scale format to quantize the sum into (in `fmt`, with no
        transform: it is already in the transformed domain) instead of decoding it.
      payload_rows: with `requantize_to`, rows of each batch's output payload block, at
        least N; rows past N are left unwritten (a message's scale rows).
      config: the split kernel's launch; the default of the work if None
        (`decode_config`).

    Returns:
      decoded (B, N, G) in `out_dtype`, or with `requantize_to` (payload (B, payload_rows,
      G) in the dtype of `payload`, scales (B, N, 2) for "dual", else (B, N)).
    """
    launch = functools.partial(
        _launch_decompress,
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

    return batched(payload, multiplier)


def decode_config(shards: int, requantize: bool, config: SplitConfig | None = None) -> SplitConfig:
    """The split kernel's launch for a decode.

    Args:
      shards: k, the shards summed.
      requantize: whether the sum is requantized.
      config: the launch asked for, or None for the default of the work.

    Returns:
      `config`, or the default launch of the work: `SPLIT_REQUANTIZE` for a requantized
      sum, `SPLIT_ONE_SHARD` for one shard decoded, `SplitConfig()` for a sum.

    Raises:
      ValueError: `config` is not a `SplitConfig`.
    """
    if config is None:
        if requantize:
            return SPLIT_REQUANTIZE
        return SPLIT_ONE_SHARD if shards == 1 else SplitConfig()
    if not isinstance(config, SplitConfig):
        raise ValueError(f"the Gluon decode kernels are the split kernels: pass a SplitConfig, got {config!r}")
    return config


def _launch_decompress(payload, multiplier, *, groups, fmt, transform, out_dtype, requantize_to, payload_rows, config):
    """One launch of a decode kernel; arguments as `gluon_decompress`."""
    batch, shards, in_rows, group_size = payload.shape
    config = decode_config(shards, requantize_to is not None, config)
    code_pointer = POINTER_TYPES[formats.wire_format(fmt).dtype]
    scalars = [("n_rows", "i32", groups), ("in_rows", "i64", in_rows)]
    constexprs = dict(G=group_size, SHARDS=shards, **_split_constexprs(group_size, config))
    common = dict(grid=_grid(groups, batch, config.rows_per_program(group_size)), num_warps=config.num_warps)
    if requantize_to is None:
        return triton_launch.gluon_call(
            taco_split_decode,
            [payload, multiplier],
            [output_struct((batch, groups, group_size), out_dtype, payload)],
            pointer_types=[code_pointer, "*fp32", POINTER_TYPES[out_dtype]],
            scalars=scalars,
            constexprs=constexprs | dict(TRANSFORM=transform, INV_SQRT=_inverse_sqrt(group_size)),
            **common,
        )[0]
    return tuple(
        triton_launch.gluon_call(
            taco_split_requantize,
            [payload, multiplier],
            [
                output_struct((batch, payload_rows, group_size), payload.dtype, payload),
                _scales_struct(batch, groups, requantize_to, payload),
            ],
            pointer_types=[code_pointer, "*fp32", code_pointer, POINTER_TYPES[scale_dtype(requantize_to)]],
            scalars=[*scalars, ("payload_rows", "i64", payload_rows)],
            constexprs=constexprs | _quantization(fmt, requantize_to),
            **common,
        )
    )


if gluon is not None:
    PRESCALE_MIN = gl.constexpr(float(group_codec.PRESCALE_MIN))
    FLOAT32_MAX = gl.constexpr(float(np.finfo(np.float32).max))
    PRESCALE_MAX = gl.constexpr(float(group_codec.PRESCALE_MAX))
    SCALE_MIN = gl.constexpr(float(group_codec.SCALE_MIN))
    ROUNDING_BIAS = gl.constexpr(float(formats.ROUNDING_BIAS))
    ROUNDING_BIAS_BITS = gl.constexpr(formats.ROUNDING_BIAS_BITS)

    @gluon.constexpr_function
    def _row_layout(G, NUM_WARPS):
        """A whole group per thread, 32 consecutive groups per warp."""
        return gl.BlockedLayout([1, G], [32, 1], [NUM_WARPS, 1], [1, 0])

    @gluon.constexpr_function
    def _tile_layout(NUM_WARPS, VECTOR, LANES):
        """A (32 * NUM_WARPS, G) tile read or written coalesced: a VECTOR-wide (16-byte)
        vector per thread, LANES lanes per group."""
        return gl.BlockedLayout([1, VECTOR], [32 // LANES, LANES], [NUM_WARPS, 1], [1, 0])

    @gluon.jit
    def _rows(start, ROWS: gl.constexpr, layout: gl.constexpr):
        """The row indices of a program's tile, laid out along `layout`'s rows."""
        return start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))

    @gluon.jit
    def _tile_offsets(G: gl.constexpr, NUM_WARPS: gl.constexpr, layout: gl.constexpr):
        """(element offsets, row indices) of a (32 * NUM_WARPS, G) tile in `layout`."""
        rows = gl.arange(0, 32 * NUM_WARPS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, G, layout=gl.SliceLayout(0, layout))
        return rows[:, None] * G + cols[None, :], rows

    @gluon.constexpr_function
    def _staging_layout(G, VECTOR):
        """Shared memory for (rows, G) tiles of the input: each row's VECTOR-wide chunks
        XOR-swizzled by the row index, so a warp reading one chunk of 32 rows (a group per
        thread) spreads over the banks instead of hitting one."""
        return gl.SwizzledSharedLayout(VECTOR, 1, min(G // VECTOR, 8), [1, 0])

    @gluon.jit
    def _stage_tile(
        buffer,
        base,
        start,
        n_rows,
        G: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VECTOR: gl.constexpr,
        LANES: gl.constexpr,
    ):
        """Start copying rows [start, start + 32 * NUM_WARPS) of an array of G-wide rows at
        `base` into the shared `buffer` (cp.async, coalesced VECTOR-wide vectors) and
        commit them as one group. Rows past n_rows are not read: their values are
        undefined, and as every row is computed on its own and they are never stored,
        nothing depends on them."""
        offsets, rows = _tile_offsets(G, NUM_WARPS, _tile_layout(NUM_WARPS, VECTOR, LANES))
        async_copy.async_copy_global_to_shared(
            buffer, base + start.to(gl.int64) * G + offsets, mask=(start + rows)[:, None] < n_rows
        )
        async_copy.commit_group()

    @gluon.jit
    def _store_groups(
        base, values, start, n_rows, G: gl.constexpr, NUM_WARPS: gl.constexpr, VECTOR: gl.constexpr, LANES: gl.constexpr
    ):
        """Store a tile of groups (a group per thread, already in the output dtype)
        coalesced into rows [start, ...) of an array of G-wide rows at `base`."""
        layout: gl.constexpr = _tile_layout(NUM_WARPS, VECTOR, LANES)
        offsets, rows = _tile_offsets(G, NUM_WARPS, layout)
        gl.store(
            base + start.to(gl.int64) * G + offsets,
            gl.convert_layout(values, layout),
            mask=(start + rows)[:, None] < n_rows,
        )

    @gluon.jit
    def _pow2(exponent):
        """2.0**exponent for int32 exponents in [-126, 127] (`formats.pow2`)."""
        return ((exponent + 127) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _times_pow2(values, exponent):
        """values * 2**exponent in two normal-range steps (`formats.times_pow2`)."""
        half = exponent >> 1
        return values * _pow2(half) * _pow2(exponent - half)

    @gluon.jit
    def _hadamard(values, G: gl.constexpr, LOG_G: gl.constexpr, NUM_WARPS: gl.constexpr):
        """values @ H (unnormalized, Sylvester order) along each thread's group: the stages
        of `hadamard.hadamard_butterfly`, all in registers."""
        for _ in gl.static_range(LOG_G):
            low, high = gl.split(gl.permute(values.reshape([32 * NUM_WARPS, 2, G // 2]), [0, 2, 1]))
            values = gl.join(low + high, low - high).reshape([32 * NUM_WARPS, G])
        return gl.convert_layout(values, _row_layout(G, NUM_WARPS))

    @gluon.jit
    def _normalize(groups, FMT_MAX: gl.constexpr, G: gl.constexpr):
        """`group_codec.normalize_groups`: (normalized, factor, prescale)."""
        absmax = gl.max(gl.abs(groups), axis=1)
        shift = gl.minimum(((absmax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 126, 126)
        normalized = groups * _pow2(-shift)[:, None]
        mean_square = gl.sum(normalized * normalized, axis=1) * (1.0 / G)
        prescale = _times_pow2(gl.div_rn(gl.full_like(mean_square, FMT_MAX), gl.sqrt_rn(mean_square)), -shift)
        prescale = gl.minimum(gl.maximum(prescale, PRESCALE_MIN), PRESCALE_MAX)
        # max() skips NaN in a kernel; the mean square does not (`group_codec.prescale_of`).
        finite = (absmax < float("inf")) & (gl.abs(mean_square) < float("inf"))
        prescale = gl.where(finite, prescale, float("nan"))
        return normalized, _times_pow2(prescale, shift), prescale

    @gluon.jit
    def _round_up_to_bf16(ratio):
        """`formats.round_up_to_bf16`, as the float32 value of the bfloat16 result."""
        ratio = gl.where(ratio < SCALE_MIN, SCALE_MIN, ratio)
        bits = ratio.to(gl.uint32, bitcast=True)
        rounded = gl.where(gl.abs(ratio) < float("inf"), (bits + 0xFFFF) & 0xFFFF0000, bits)
        return rounded.to(gl.float32, bitcast=True)

    @gluon.jit
    def _encode_e8m0(ratio):
        """`formats.encode_e8m0`, as int32 codes."""
        bits = ratio.to(gl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 126
        code = gl.where((bits & 0x7FFFFF) == 0, exponent - 1, exponent) + 127
        code = gl.minimum(gl.maximum(code, 1), 254)
        return gl.where(gl.abs(ratio) < float("inf"), code, 255)

    @gluon.jit
    def _scaled_codes(
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
        """`group_codec.quantize_scaled` of a tile of groups y = values * factor: stores
        the packed scales of its `rows` (along the tile's rows; `in_range` masks them) at
        `scales_ptr` and returns the codes in `codes_dtype`, in the layout of `values`."""
        scale = gl.div_rn(gl.max(gl.abs(values), axis=1) * factor, gl.full_like(factor, FMT_MAX))
        scale = gl.where(scale < SCALE_MIN, SCALE_MIN, scale)  # NaN stays NaN
        divisor = scale
        if SCALES == 0:
            gl.store(scales_ptr + 2 * rows, prescale, mask=in_range)
            gl.store(scales_ptr + 2 * rows + 1, scale, mask=in_range)
        elif SCALES == 1:
            gl.store(scales_ptr + rows, gl.div_rn(scale, prescale), mask=in_range)
        elif SCALES == 2:
            rounded = _round_up_to_bf16(gl.div_rn(scale, prescale))
            divisor = prescale * rounded
            gl.store(scales_ptr + rows, rounded.to(gl.bfloat16), mask=in_range)
        else:
            code = _encode_e8m0(gl.div_rn(scale, prescale))
            divisor = prescale * gl.where(code == 255, float("nan"), _pow2(code - 127))
            gl.store(scales_ptr + rows, code.to(gl.uint8), mask=in_range)
        scaled = values * gl.div_rn(factor, divisor)[:, None]
        if INTEGER:
            return ((scaled + ROUNDING_BIAS).to(gl.int32, bitcast=True) - ROUNDING_BIAS_BITS).to(gl.int8)
        return scaled.to(codes_dtype)

    @gluon.jit
    def taco_row_compress(
        x_ptr,
        payload_ptr,
        scales_ptr,
        n_rows,
        payload_rows,
        G: gl.constexpr,
        LOG_G: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        IN_VECTOR: gl.constexpr,
        IN_LANES: gl.constexpr,
        OUT_VECTOR: gl.constexpr,
        OUT_LANES: gl.constexpr,
        TRANSFORM: gl.constexpr,
        INV_SQRT: gl.constexpr,
        FMT_MAX: gl.constexpr,
        INTEGER: gl.constexpr,
        SCALES: gl.constexpr,
    ):
        """A tile of 32 * NUM_WARPS groups copied into shared memory, then quantized a
        group per thread and stored coalesced."""
        ROWS: gl.constexpr = 32 * NUM_WARPS
        start = gl.program_id(0) * ROWS
        batch = gl.program_id(1).to(gl.int64)
        staging = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [ROWS, G], _staging_layout(G, IN_VECTOR))
        _stage_tile(staging, x_ptr + batch * n_rows * G, start, n_rows, G, NUM_WARPS, IN_VECTOR, IN_LANES)
        async_copy.wait_group(0)
        gl.thread_barrier()  # every thread's copies have landed
        groups = staging.load(_row_layout(G, NUM_WARPS)).to(gl.float32)
        values, factor, prescale = _normalize(groups, FMT_MAX, G)
        if TRANSFORM:  # the unnormalized transform: 1/sqrt(G) goes into the factor
            values = _hadamard(values, G, LOG_G, NUM_WARPS)
            factor = factor * INV_SQRT
        rows = _rows(start, ROWS, _row_layout(G, NUM_WARPS))
        codes = _scaled_codes(
            values,
            factor,
            prescale,
            payload_ptr.dtype.element_ty,
            scales_ptr + batch * n_rows * (2 if SCALES == 0 else 1),
            rows,
            rows < n_rows,
            FMT_MAX,
            INTEGER,
            SCALES,
        )
        _store_groups(payload_ptr + batch * payload_rows * G, codes, start, n_rows, G, NUM_WARPS, OUT_VECTOR, OUT_LANES)

    @gluon.constexpr_function
    def _pair_conversion(dtype):
        """PTX rounding two float32 to a packed pair of `dtype` (bfloat16 or float16) to
        nearest, values past its largest finite clamped to it and NaN kept (`.satfinite`)."""
        pair = "bf16x2" if dtype == gl.bfloat16 else "f16x2"
        return f"cvt.rn.satfinite.{pair}.f32 $0, $2, $1;"

    @gluon.jit
    def _saturating_cast(values, dtype: gl.constexpr):
        """`formats.saturating_cast`: float32 to `dtype`, values past its largest finite
        clamped to it, NaN kept: one conversion instruction per pair of values (a compare
        and two selects per value otherwise). For float32, a decode that overflowed (a
        value near its largest plus codec error) is clamped back."""
        if dtype == gl.float32:
            overflowed = gl.abs(values) == float("inf")  # False for NaN, which stays NaN
            return gl.where(overflowed, gl.where(values > 0, FLOAT32_MAX, -FLOAT32_MAX), values)
        return gl.inline_asm_elementwise(
            _pair_conversion(dtype), "=r,r,r", [values], dtype=dtype.value, is_pure=True, pack=2
        )

    @gluon.constexpr_function
    def _split_layout(G, VALUES, NUM_WARPS):
        """VALUES consecutive values of a group per thread, G / VALUES lanes per group."""
        return gl.BlockedLayout([1, VALUES], [32 // (G // VALUES), G // VALUES], [NUM_WARPS, 1], [1, 0])

    @gluon.constexpr_function
    def _butterfly_shuffle(lane_mask):
        """PTX of a warp shuffle taking the value of lane (this lane xor `lane_mask`)."""
        return f"shfl.sync.bfly.b32 $0, $1, {lane_mask}, 0x1f, 0xffffffff;"

    @gluon.jit
    def _split_tile(start, n_rows, ROWS: gl.constexpr, G: gl.constexpr, layout: gl.constexpr):
        """(element offsets, row indices, rows in range) of rows [start, start + ROWS) of
        an array of G-wide rows, in the split `layout`."""
        rows = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, G, layout=gl.SliceLayout(0, layout))
        return rows.to(gl.int64)[:, None] * G + cols[None, :], rows, rows < n_rows

    @gluon.constexpr_function
    def _log2(n):
        """log2 of a power of two."""
        return n.bit_length() - 1

    @gluon.jit
    def _program_tile(n_rows, G: gl.constexpr, VALUES: gl.constexpr, ROWS: gl.constexpr, NUM_WARPS: gl.constexpr):
        """This program's rows of its batch in the split layout: (element offsets within
        the batch, row indices, rows in range, batch index)."""
        layout: gl.constexpr = _split_layout(G, VALUES, NUM_WARPS)
        offsets, rows, in_range = _split_tile(gl.program_id(0) * ROWS, n_rows, ROWS, G, layout)
        return offsets, rows, in_range, gl.program_id(1).to(gl.int64)

    @gluon.jit
    def _split_sum(
        payload_ptr, multiplier_ptr, offsets, rows, in_range, n_rows, in_rows, SHARDS: gl.constexpr, G: gl.constexpr
    ):
        """The float32 sum over the shards of codes times their groups' multipliers scaled
        by 2**-shift, and shift per row (`group_codec.sum_shift`), on the tile
        `_split_tile` gives (rows out of range are not read; their values are undefined
        and never stored); the pointers are at the batch's first shard."""
        largest = gl.load(multiplier_ptr + rows, mask=in_range)
        for shard in gl.static_range(1, SHARDS):
            largest = gl.maximum(largest, gl.load(multiplier_ptr + shard * n_rows + rows, mask=in_range))
        shift = gl.maximum(((largest.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 126, 0)
        summed = gl.zeros_like(offsets, dtype=gl.float32)
        for shard in gl.static_range(SHARDS):
            codes = gl.load(payload_ptr + shard * in_rows * G + offsets, mask=in_range[:, None])
            multiplier = _times_pow2(gl.load(multiplier_ptr + shard * n_rows + rows, mask=in_range), -shift)
            summed = summed + codes.to(gl.float32) * multiplier[:, None]
        return summed, shift

    @gluon.jit
    def _split_hadamard(values, ROWS: gl.constexpr, G: gl.constexpr, VALUES: gl.constexpr):
        """values @ H (unnormalized, Sylvester order) along each group of a split tile. H_G =
        H_{G/V} x H_V: the log2 V stages within a thread's V values run in registers
        (as `_hadamard`), then one stage per lane bit exchanges values with the lane
        holding the partner slice by a warp shuffle."""
        layout: gl.constexpr = values.type.layout
        LANES: gl.constexpr = G // VALUES
        if VALUES > 1:
            slices = values.reshape([ROWS, LANES, VALUES])
            for _ in gl.static_range(_log2(VALUES)):
                low, high = gl.split(gl.permute(slices.reshape([ROWS, LANES, 2, VALUES // 2]), [0, 1, 3, 2]))
                slices = gl.join(low + high, low - high).reshape([ROWS, LANES, VALUES])
            values = gl.convert_layout(slices.reshape([ROWS, G]), layout)
        lane = gl.arange(0, G, layout=gl.SliceLayout(0, layout)) // VALUES
        for stage in gl.static_range(_log2(LANES)):
            partner = gl.inline_asm_elementwise(
                _butterfly_shuffle(1 << stage), "=r,r", [values], dtype=gl.float32, is_pure=True, pack=1
            )
            # +1 on the low slice of a pair, -1 on the high one: low + high and low - high,
            # each one exact rounding.
            sign = (1 - 2 * ((lane >> stage) & 1)).to(gl.float32)[None, :]
            values = values * sign + partner
        return values

    @gluon.jit
    def _quantize_split(
        groups,
        payload_ptr,
        scales_ptr,
        offsets,
        rows,
        in_range,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        VALUES: gl.constexpr,
        TRANSFORM: gl.constexpr,
        INV_SQRT: gl.constexpr,
        FMT_MAX: gl.constexpr,
        INTEGER: gl.constexpr,
        SCALES: gl.constexpr,
    ):
        """`group_codec.quantize_groups` of a split tile of float32 groups: the codes
        stored at `payload_ptr` + `offsets`, the packed scales of `rows` at `scales_ptr`
        (the pointers at the batch's first row; rows out of range are not stored)."""
        values, factor, prescale = _normalize(groups, FMT_MAX, G)
        if TRANSFORM:  # the unnormalized transform: 1/sqrt(G) goes into the factor
            values = _split_hadamard(values, ROWS, G, VALUES)
            factor = factor * INV_SQRT
        codes = _scaled_codes(
            values, factor, prescale, payload_ptr.dtype.element_ty, scales_ptr, rows, in_range, FMT_MAX, INTEGER, SCALES
        )
        gl.store(payload_ptr + offsets, codes, mask=in_range[:, None])

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
        FMT_MAX: gl.constexpr,
        INTEGER: gl.constexpr,
        SCALES: gl.constexpr,
    ):
        """`taco_row_compress` in the split layout: the group statistics are reductions
        over a group's lanes, and nothing goes through shared memory."""
        offsets, rows, in_range, batch = _program_tile(n_rows, G, VALUES, ROWS, NUM_WARPS)
        groups = gl.load(x_ptr + batch * n_rows * G + offsets, mask=in_range[:, None]).to(gl.float32)
        _quantize_split(
            groups,
            payload_ptr + batch * payload_rows * G,
            scales_ptr + batch * n_rows * (2 if SCALES == 0 else 1),
            offsets,
            rows,
            in_range,
            ROWS,
            G,
            VALUES,
            TRANSFORM,
            INV_SQRT,
            FMT_MAX,
            INTEGER,
            SCALES,
        )

    @gluon.jit
    def taco_split_decode(
        payload_ptr,
        multiplier_ptr,
        out_ptr,
        n_rows,
        in_rows,
        G: gl.constexpr,
        VALUES: gl.constexpr,
        ROWS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        SHARDS: gl.constexpr,
        TRANSFORM: gl.constexpr,
        INV_SQRT: gl.constexpr,
    ):
        """The sum of k dequantized shards, inverse-transformed or not, in the output dtype."""
        offsets, rows, in_range, batch = _program_tile(n_rows, G, VALUES, ROWS, NUM_WARPS)
        payload_ptr = payload_ptr + batch * SHARDS * in_rows * G
        multiplier_ptr = multiplier_ptr + batch * SHARDS * n_rows
        if TRANSFORM and SHARDS == 1:
            # One shard's codes are transformed first, then scaled (as the reference),
            # so no intermediate overflows near float32's largest.
            codes = gl.load(payload_ptr + offsets, mask=in_range[:, None]).to(gl.float32)
            multiplier = gl.load(multiplier_ptr + rows, mask=in_range)
            values = _split_hadamard(codes, ROWS, G, VALUES) * (multiplier * INV_SQRT)[:, None]
        else:
            values, shift = _split_sum(payload_ptr, multiplier_ptr, offsets, rows, in_range, n_rows, in_rows, SHARDS, G)
            # One multiply an element undoes the shift (and normalizes the transform):
            # 2**shift / sqrt(G) is a finite float32 for every finite multiplier.
            half = shift >> 1
            if TRANSFORM:
                values = _split_hadamard(values, ROWS, G, VALUES)
                undo = _pow2(half) * INV_SQRT * _pow2(shift - half)
            else:
                undo = _pow2(half) * _pow2(shift - half)
            values = values * undo[:, None]
        out = _saturating_cast(values, out_ptr.dtype.element_ty)
        gl.store(out_ptr + batch * n_rows * G + offsets, out, mask=in_range[:, None])

    @gluon.jit
    def taco_split_requantize(
        payload_ptr,
        multiplier_ptr,
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
        FMT_MAX: gl.constexpr,
        INTEGER: gl.constexpr,
        SCALES: gl.constexpr,
    ):
        """The sum of k dequantized shards quantized again (in the transformed domain)."""
        offsets, rows, in_range, batch = _program_tile(n_rows, G, VALUES, ROWS, NUM_WARPS)
        summed, shift = _split_sum(
            payload_ptr + batch * SHARDS * in_rows * G,
            multiplier_ptr + batch * SHARDS * n_rows,
            offsets,
            rows,
            in_range,
            n_rows,
            in_rows,
            SHARDS,
            G,
        )
        # No transform (the sum is already in the transformed domain); the pre-scale is
        # the unscaled sum's.
        values, factor, prescale = _normalize(summed, FMT_MAX, G)
        out_ptr = out_ptr + batch * payload_rows * G
        codes = _scaled_codes(
            values,
            factor,
            _times_pow2(prescale, -shift),
            out_ptr.dtype.element_ty,
            scales_ptr + batch * n_rows * (2 if SCALES == 0 else 1),
            rows,
            in_range,
            FMT_MAX,
            INTEGER,
            SCALES,
        )
        gl.store(out_ptr + offsets, codes, mask=in_range[:, None])
