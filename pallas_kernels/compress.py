"""Fused compress kernel: pre-scale -> Walsh-Hadamard -> scale -> 8-bit cast.

One pass over memory: each program takes `blocks_per_program` tiles of (block_rows, G)
groups in turn; for each it computes the group statistics, transforms the tile, and
stores the 8-bit payload and the per-group scales (1/sqrt(G) folded into the scale).
The transform is `KernelConfig.transform_method`: by default log2 G exact add/subtract
stages in float32 registers (`launch.TILE_FREE_TRANSFORMS`, a warp shuffle where a pair
spans lanes), or a tensor-core matmul against the +-1 Hadamard matrix loaded once per
program (exact in bf16, FP32 accumulation; float32 inputs split into three bf16 parts).

`compress_reference` beside the kernel is the plain-jnp definition it is tested against.
On a CUDA GPU with Triton, `compress_groups` and `compress_message` run the Gluon kernels
(`row_kernels`: a group per thread up to G = 128, a group over a few lanes above; faster
on an H200, benchmarks/RESULTS.md) where `backends.GLUON` takes the groups, unless
a `KernelConfig` asks for this one. This kernel (JAX's Pallas Triton lowering, which JAX
has deprecated) is then an opt-in, and what the Pallas interpreter runs off GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import backends, formats, row_kernels, split_kernels, wire
from .launch import (
    BF16_SPLITS,
    KernelConfig,
    apply_hadamard,
    load_hadamard,
    load_pieces,
    output_struct,
    program_rows,
    row_loop,
    split_groups,
    store_pieces,
    triton_params,
)
from .wire import hadamard_matrix


def default_config(group_size: int, transform: bool = True) -> KernelConfig:
    """About 8K elements per block, one block per program; with the transform, each group
    loaded in two pieces and transformed as "lanes" (`wire.hadamard_lanes`, no tile):
    the fastest in the H200 sweep of benchmarks/kernels.py, ahead of one piece and of the
    matmul (figures in benchmarks/RESULTS.md)."""
    if transform:
        return KernelConfig(block_rows=max(16, 8192 // group_size), num_warps=4, transform_method="lanes", pieces=2)
    return KernelConfig(block_rows=max(16, 8192 // group_size), num_warps=4)


def _compress_kernel(
    x_ref, hadamard_ref, payload_ref, *scale_refs, fmt, scale_format, transform, splits, block, config
):
    inv_sqrt = np.float32(1.0 / np.sqrt(x_ref.shape[-2] * x_ref.shape[-1]))
    hadamard = load_hadamard(hadamard_ref, config) if transform else None

    def compress_block(rows):
        groups = tuple(piece.astype(jnp.float32) for piece in load_pieces(x_ref, rows))
        normalized, factor, prescale = wire.normalize_groups(groups, formats.wire_format(fmt).max_value)
        values = normalized
        if transform:  # the unnormalized transform: 1/sqrt(G) goes into the factor
            values, factor = apply_hadamard(normalized, hadamard, splits, config.transform_method), factor * inv_sqrt
        payload, entries = wire.quantize_scaled(values, factor, prescale, fmt, scale_format, in_kernel=True)
        store_pieces(payload_ref, rows, payload)
        for ref, entry in zip(scale_refs, entries):
            ref[rows] = entry.reshape(entry.shape[0])

    row_loop(x_ref.shape[0], block, compress_block)


def _launch(x, fmt, scale_format, transform, config, interpret, payload_dtype, payload_rows):
    """Run the kernel over B batches of (N, G) rows, x (B, N, G). Each batch's payload
    goes to rows [0, N) of a (payload_rows, G) block of `payload_dtype` (rows past N are
    left to the caller).

    Returns:
      (payload (B, >= payload_rows, G), scale entries as (B, N, 1, 1) arrays).
    """
    wire.check_scale_format(scale_format)
    batch, rows, group_size = x.shape
    config = config or default_config(group_size, transform)
    per_program, block = program_rows(rows, config, batch)
    padded = rows + (-rows % per_program)
    if padded != rows:
        x = jnp.pad(x, ((0, 0), (0, padded - rows), (0, 0)))
    entry_dtypes = formats.SCALE_ENTRY_DTYPES[scale_format]
    kernel = functools.partial(
        _compress_kernel,
        fmt=fmt,
        scale_format=scale_format,
        transform=transform,
        splits=BF16_SPLITS[jnp.dtype(x.dtype)],
        block=block,
        config=config,
    )
    width = group_size // config.pieces
    tile = pl.BlockSpec((None, per_program, config.pieces, width), lambda b, i: (b, i, 0, 0))
    payload, *entries = pl.pallas_call(
        kernel,
        grid=(batch, padded // per_program),
        in_specs=[tile, pl.BlockSpec((width, width), lambda b, i: (0, 0))],
        out_specs=[tile] + [pl.BlockSpec((None, per_program), lambda b, i: (b, i))] * len(entry_dtypes),
        out_shape=[output_struct((batch, max(padded, payload_rows), config.pieces, width), payload_dtype, x)]
        + [output_struct((batch, padded), dtype, x) for dtype in entry_dtypes],
        compiler_params=triton_params(config),
        interpret=interpret,
        name="taco_compress",
    )(split_groups(x, config.pieces), jnp.asarray(hadamard_matrix(width), jnp.bfloat16))
    return payload.reshape(*payload.shape[:2], group_size), [e[:, :rows, None, None] for e in entries]


def _encode(x, fmt, scale_format, transform, config, interpret, payload_dtype, payload_rows):
    """x (B, N, G) quantized by the kernel `config` names (its `backend`): a Gluon kernel
    (`row_kernels.RowConfig` or `SplitConfig`), or the Pallas kernel (`KernelConfig`);
    without a config, the first kernel of `backends.BACKENDS` that takes the work.
    Arguments as `_launch`.

    Returns:
      (payload (B, >= payload_rows, G), scales (B, N, 1, 2) for "dual", else (B, N, 1)).
    """
    if backends.launched_by(config, backends.CodecWork(fmt, x.shape[-1], x.dtype), interpret) is backends.GLUON:
        payload, scales = row_kernels.gluon_compress(
            x,
            fmt=fmt,
            scale_format=scale_format,
            transform=transform,
            payload_dtype=payload_dtype,
            payload_rows=payload_rows,
            config=config,
        )
        return payload, scales[:, :, None]
    backends.check_pallas_takes(fmt)
    payload, entries = _launch(x, fmt, scale_format, transform, config, interpret, payload_dtype, payload_rows)
    return payload, wire.pack_scale_entries(tuple(entries), scale_format)


@functools.partial(jax.jit, static_argnames=("fmt", "scale_format", "transform", "config", "interpret"))
def compress_groups(
    x: jax.Array,
    *,
    fmt: str,
    scale_format: str,
    transform: bool,
    config: KernelConfig | row_kernels.RowConfig | split_kernels.SplitConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Quantize rows of G elements with the fused kernel.

    Args:
      x: (N, G) float32, bfloat16 or float16; G a power of two >= 16.
      fmt: "e4m3", "e5m2" or "int8"; a sub-byte format (`backends.GLUON`) on a Gluon
        kernel only.
      scale_format: "dual", "single", "bf16" or "e8m0".
      transform: apply the Walsh-Hadamard transform.
      config: which kernel and its launch parameters: a `KernelConfig` for the Pallas
        kernel, a `row_kernels.RowConfig` (G <= 128) or `SplitConfig` for a Gluon
        kernel; if None, the Gluon kernel of the group size
        (`row_kernels.compress_config`) where `backends.GLUON` takes the work and runs
        (not in interpret mode), else the Pallas kernel's `default_config`.
      interpret: run the Pallas kernel in the Pallas interpreter (CPU tests).

    Returns:
      (payload (N, G), scales) in the layout of `wire.quantize_groups` for (N, G).
    """
    rows, element = x.shape[0], formats.wire_format(fmt)
    packed = element.bits < 8
    payload_dtype = jnp.uint8 if packed else element.dtype
    payload, scales = _encode(x[None], fmt, scale_format, transform, config, interpret, payload_dtype, rows)
    payload = payload[0, :rows]
    # Sub-byte codes come packed (the Gluon kernels): typed, as the reference returns them.
    return (element.unpack(payload) if packed else payload), scales[0]


@functools.partial(jax.jit, static_argnames=("fmt", "scale_format", "transform", "config", "interpret"))
def compress_message(
    x: jax.Array,
    *,
    fmt: str,
    scale_format: str,
    transform: bool,
    config: KernelConfig | row_kernels.RowConfig | split_kernels.SplitConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Quantize rows of G elements straight into wire messages (`wire.MessageLayout`).

    The kernel writes the payload rows of each buffer; the scale rows are then written
    in place. Arguments as `compress_groups`, except

    Args:
      x: (B, N, G): B messages of N groups each.

    Returns:
      uint8 (B, rows, G): the messages, byte for byte what `wire.pack` makes of `compress_groups`.
    """
    layout = wire.MessageLayout(x.shape[1], x.shape[2], fmt, scale_format)
    payload, scales = _encode(x, fmt, scale_format, transform, config, interpret, jnp.uint8, layout.shape[0])
    buffer = payload[:, : layout.shape[0]]  # a copy only when padding made the kernel write past the message
    return wire.place_scales(buffer, scales, layout)


def compress_reference(x: jax.Array, *, fmt: str, scale_format: str, transform: bool) -> tuple[jax.Array, jax.Array]:
    """The same computation in plain jnp (what the kernel is tested against)."""
    return wire.quantize_groups(x, fmt=fmt, group_size=x.shape[-1], scale_format=scale_format, transform=transform)
