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

The math is `gluon_codec`'s; `compress.compress_reference` is what the kernel is tested
against. `compress` dispatches here by default where `gluon_codec.supports` holds
(`compress_config` picks the row or the split kernel and its launch). There is no
interpret mode (off GPU the Pallas kernels run in the Pallas interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from . import formats, split_kernels, triton_launch, wire
from .gluon_codec import (
    POINTER_TYPES,
    code_pointer,
    grid,
    inverse_sqrt,
    quantization,
    row_bytes,
    scale_dtype,
    scales_struct,
)
from .launch import output_struct
from .split_kernels import SPLIT_COMPRESS, SplitConfig, split_constexprs

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # no Triton with Gluon: `supports` is False and nothing below is traced
    gluon = gl = async_copy = None


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Launch parameters of the row kernel: compress with a whole group per thread, for
    groups of at most `ROW_MAX_GROUP` values.

    Attributes:
      num_warps: warps per program; a program takes 32 groups per warp, one per thread.
        One warp was fastest on the H200 (benchmarks/RESULTS.md).
    """

    num_warps: int = 1
    backend: ClassVar[str] = "gluon"

    def __post_init__(self):
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"RowConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")

    def rows_per_program(self, group_size: int) -> int:
        """Groups one program takes: one per thread."""
        del group_size  # a whole group per thread, whatever its size
        return 32 * self.num_warps


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
    """Quantize B batches of N groups, x (B, N, G), as `wire.quantize_groups`.

    Under `jax.vmap` the mapped axes fold into the batch dimension B (the kernel's
    second grid axis), so a vmapped call is one launch.

    Args:
      x: (B, N, G) bfloat16, float16 or float32 (`supports`).
      fmt: "e4m3", "e5m2", "int8", or a sub-byte format whose groups fill whole 32-bit
        words (its codes packed as `formats.pack_codes` packs them).
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
    payload_type = output_struct((batch, payload_rows, row_bytes(fmt, group_size)), payload_dtype, x)
    kernel, constexprs = compress_kernel(fmt, scale_format, transform, group_size, config, x.dtype)
    return triton_launch.gluon_call(
        kernel,
        [x],
        [payload_type, scales_struct(batch, groups, scale_format, x)],
        pointer_types=[
            POINTER_TYPES[jnp.dtype(x.dtype)],
            code_pointer(fmt),
            POINTER_TYPES[scale_dtype(scale_format)],
        ],
        scalars=[("n_rows", "i32", groups), ("payload_rows", "i64", payload_rows)],
        grid=grid(groups, batch, config.rows_per_program(group_size)),
        num_warps=config.num_warps,
        constexprs=constexprs,
    )


def compress_kernel(
    fmt: str, scale_format: str, transform: bool, group_size: int, config: RowConfig | SplitConfig, in_dtype
) -> tuple:
    """(the Gluon kernel, its constexprs) of a compress: the row kernel for a `RowConfig`,
    the split kernel for a `SplitConfig`; `in_dtype` the input's."""
    constexprs = dict(
        G=group_size,
        TRANSFORM=transform,
        INV_SQRT=inverse_sqrt(group_size),
        HEADROOM=wire.scale_headroom(formats.wire_format(fmt), group_size, transform),
        **quantization(fmt, scale_format),
    )
    if isinstance(config, SplitConfig):
        return split_kernels.taco_split_compress, constexprs | split_constexprs(group_size, config)
    return taco_row_compress, constexprs | _row_constexprs(group_size, config, in_dtype, jnp.int8)


def _row_constexprs(group_size: int, config: RowConfig, in_dtype, out_dtype) -> dict[str, int]:
    """The row kernel's layout constexprs: warps, log2 G, and the coalesced vectors of the
    input and output tiles."""
    return dict(
        NUM_WARPS=config.num_warps,
        LOG_G=group_size.bit_length() - 1,
        **_vectors(group_size, in_dtype, out_dtype),
    )


if gluon is not None:
    from .gluon_codec import (
        hadamard_in_registers,
        normalize,
        row_layout,
        scaled_codes,
        with_headroom,
    )
    from .gluon_packing import group_store_values, row_elements, store_packed

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
        HEADROOM: gl.constexpr,
        FMT_MAX: gl.constexpr,
        SCALES: gl.constexpr,
        INTEGER: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
    ):
        """A tile of 32 * NUM_WARPS groups copied into shared memory, then quantized a
        group per thread and stored coalesced (sub-byte codes packed into words)."""
        ROWS: gl.constexpr = 32 * NUM_WARPS
        start = gl.program_id(0) * ROWS
        batch = gl.program_id(1).to(gl.int64)
        staging = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [ROWS, G], _staging_layout(G, IN_VECTOR))
        _stage_tile(staging, x_ptr + batch * n_rows * G, start, n_rows, G, NUM_WARPS, IN_VECTOR, IN_LANES)
        async_copy.wait_group(0)
        gl.thread_barrier()  # every thread's copies have landed
        groups = staging.load(row_layout(G, NUM_WARPS)).to(gl.float32)
        values, factor, prescale, absmax = normalize(groups, FMT_MAX, G)
        if TRANSFORM:  # the unnormalized transform: 1/sqrt(G) goes into the factor
            values = hadamard_in_registers(values, G, LOG_G, NUM_WARPS)
            factor = factor * INV_SQRT
            absmax = gl.max(gl.abs(values), axis=1)
        rows = _rows(start, ROWS, row_layout(G, NUM_WARPS))
        codes = scaled_codes(
            values,
            absmax,
            factor,
            with_headroom(prescale, HEADROOM),
            payload_ptr.dtype.element_ty,
            scales_ptr + batch * n_rows * (2 if SCALES == 0 else 1),
            rows,
            rows < n_rows,
            FMT_MAX,
            INTEGER,
            SCALES,
            BITS,
            EXPONENT_BITS,
            MANTISSA_BITS,
        )
        payload_ptr = payload_ptr + batch * payload_rows * row_elements(G, BITS)
        if BITS == 8:
            _store_groups(payload_ptr, codes, start, n_rows, G, NUM_WARPS, OUT_VECTOR, OUT_LANES)
        else:
            # Packed where they were computed, a group per thread, where its units store
            # as vectors (`group_store_values`): regrouping INT4's codes over lanes first
            # held all of them at once (255 registers at G = 128, 167 without;
            # `benchmarks.kernel_sass --packed`) and ran at 78% of a copy against 97%.
            STORE_VALUES: gl.constexpr = group_store_values(G, BITS, codes.shape[1])
            store_packed(payload_ptr, codes, start, n_rows, ROWS, G, BITS, NUM_WARPS, STORE_VALUES)
