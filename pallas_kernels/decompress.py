"""Fused decompress kernel: dequantize k shards, sum in float32, then either inverse
Walsh-Hadamard transform to the output dtype or requantize the sum.

One pass over memory: each program takes `blocks_per_program` (k, block_rows, G) payload
tiles in turn with their per-group multipliers, sums the dequantized shards in the transformed domain, and
  - decode: transforms once (the tile-free method `KernelConfig.transform_method` names, or a
    tensor-core matmul with the +-1 Hadamard matrix: a single 8-bit shard is exact in
    bf16, a float32 sum is split in two or three bf16 parts) and writes
    the output dtype — the receiving end of an all-gather (k=1 per shard),
    reduce-scatter or one-shot all-reduce;
  - requantize: quantizes the sum again without a transform (it is already in the
    transformed domain) — the middle step of the two-shot all-reduce.

`decompress_reference` beside the kernel is the plain-jnp definition it is tested against.
On a CUDA GPU with Triton, `decompress_groups` and `decompress_message` run the Gluon
split kernels (`split_kernels`) where `backends.GLUON` takes the groups, unless a
`KernelConfig` asks for this one. This kernel (JAX's Pallas Triton lowering, which JAX
has deprecated) is then an opt-in, and what the Pallas interpreter runs off GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import backends, formats, split_kernels, wire
from .launch import (
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


def default_config(group_size: int, transform: bool, shards: int = 1, requantize: bool = False) -> KernelConfig:
    """Decoding through the transform: about 4K codes read per block over all `shards`
    (at least 16 rows), each group loaded in two pieces, the transform as "pairs"
    (`wire.hadamard_pairs`, no tile); otherwise about 8K elements per block. Set from
    the H200 sweep of benchmarks/kernels.py, where they beat one piece and the matmul
    (figures in benchmarks/RESULTS.md).

    Requantizing the sum (which applies no transform): about 2K codes per shard per block
    in two pieces, with two warps: closer to a device copy than 8K-element blocks in one
    piece on the H200 (benchmarks/RESULTS.md).

    Args:
      group_size: G, the elements of a group.
      transform: whether the decode applies the inverse transform.
      shards: k, the shards summed.
      requantize: whether the sum is requantized (then `transform` does not matter).

    Returns:
      The launch configuration the kernel runs with when none is given.
    """
    if requantize:
        return KernelConfig(block_rows=max(16, 2048 // group_size), num_warps=2, pieces=2)
    if transform:
        return KernelConfig(
            block_rows=max(16, 4096 // (group_size * shards)), num_warps=4, transform_method="pairs", pieces=2
        )
    return KernelConfig(block_rows=max(16, 8192 // group_size), num_warps=4)


def _codes(payload_ref, shard: int, rows, fmt: str | None) -> wire.Pieces:
    """One shard's codes as float32 pieces; a uint8 message buffer holds their bytes."""
    pieces = load_pieces(payload_ref, shard, rows)
    if fmt is not None:
        pieces = tuple(jax.lax.bitcast_convert_type(piece, formats.wire_format(fmt).dtype) for piece in pieces)
    return tuple(piece.astype(jnp.float32) for piece in pieces)


def _scaled(pieces: wire.Pieces, multiplier: jax.Array) -> wire.Pieces:
    """Each piece times its rows' multipliers (R,)."""
    return tuple(piece * multiplier[:, None] for piece in pieces)


def _decompress_kernel(
    payload_ref, multiplier_ref, hadamard_ref, *out_refs, transform, requantize_to, message_fmt, block, config
):
    shards, _, pieces, width = payload_ref.shape
    inv_sqrt = np.float32(1.0 / np.sqrt(pieces * width))
    single = shards == 1 and transform and requantize_to is None
    hadamard = load_hadamard(hadamard_ref, config) if transform and requantize_to is None else None

    def scaled_sum(rows):
        """The shards' sum scaled down by 2**shift (`wire.sum_shift`), and shift."""
        multipliers = tuple(multiplier_ref[shard, rows] for shard in range(shards))
        shift = wire.sum_shift(multipliers)
        scaled = [
            _scaled(_codes(payload_ref, shard, rows, message_fmt), formats.times_pow2(multiplier, -shift))
            for shard, multiplier in enumerate(multipliers)
        ]
        return functools.reduce(lambda a, b: tuple(map(jnp.add, a, b)), scaled), shift[:, None]

    def decode_block(rows):
        if single:
            # One shard's 8-bit codes are exact in bf16: transform them, then scale.
            values = apply_hadamard(_codes(payload_ref, 0, rows, message_fmt), hadamard, 1, config.transform_method)
            decoded = _scaled(values, multiplier_ref[0, rows] * inv_sqrt)
            store_pieces(
                out_refs[0], rows, tuple(formats.saturating_cast(piece, out_refs[0].dtype) for piece in decoded)
            )
            return
        summed, shift = scaled_sum(rows)
        if requantize_to is not None:
            fmt, scale_format = requantize_to
            normalized, factor, prescale = wire.normalize_groups(summed, formats.wire_format(fmt).max_value)
            payload, entries = wire.quantize_scaled(  # the pre-scale of the unscaled sum
                normalized, factor, formats.times_pow2(prescale, -shift), fmt, scale_format, in_kernel=True
            )
            store_pieces(out_refs[0], rows, payload)
            for ref, entry in zip(out_refs[1:], entries):
                ref[rows] = entry.reshape(entry.shape[0])
            return
        if transform:
            # Two bf16 parts keep 16 significant bits, far below a bf16 output's rounding.
            splits = 3 if out_refs[0].dtype == jnp.float32 else 2
            summed = tuple(
                piece * inv_sqrt for piece in apply_hadamard(summed, hadamard, splits, config.transform_method)
            )
        decoded = tuple(formats.times_pow2(piece, shift) for piece in summed)
        store_pieces(out_refs[0], rows, tuple(formats.saturating_cast(piece, out_refs[0].dtype) for piece in decoded))

    row_loop(payload_ref.shape[1], block, decode_block)


# The 8-bit wire formats by their payload dtype: what a typed payload holds.
CODE_FORMATS = {spec.dtype: name for name, spec in formats.WIRE_FORMATS.items() if spec.bits == 8}


def _decode(
    payload,
    multiplier,
    groups,
    *,
    transform,
    out_dtype,
    requantize_to,
    config,
    interpret,
    message_fmt,
    extra_rows=0,
    message_scales=None,
):
    """The decode by the kernel `config` names (`backends.launched_by`): a Gluon split
    kernel (`split_kernels.SplitConfig`; a `RowConfig` is refused by name there), or the
    Pallas kernel (`KernelConfig`); without a config, the first kernel of
    `backends.BACKENDS` that takes the work. Arguments as `_launch`; `message_scales`
    as `split_kernels.gluon_decompress`.

    Returns:
      decoded (B, N, G), or with `requantize_to` (payload (B, rows, G), scales packed as
      `wire.pack_scale_entries` lays them out per batch); the Gluon kernels
      requantize any number of batches.
    """
    fmt = message_fmt or (requantize_to[0] if requantize_to else CODE_FORMATS.get(jnp.dtype(payload.dtype)))
    shards = payload.shape[1]
    # A message's row holds a group's packed codes: G * bits / 8 bytes.
    group_size = payload.shape[-1] * 8 // formats.wire_format(message_fmt).bits if message_fmt else payload.shape[-1]
    work = backends.CodecWork(fmt or "unknown", group_size, out_dtype, shards)
    if backends.launched_by(config, work, interpret) is backends.GLUON:
        if fmt is None:
            codes = sorted(CODE_FORMATS.values())
            raise ValueError(f"the Gluon kernels decode 8-bit codes {codes}, got {payload.dtype}")
        return split_kernels.gluon_decompress(
            payload,
            multiplier.astype(jnp.float32),
            groups=groups,
            fmt=fmt,
            transform=transform,
            out_dtype=out_dtype,
            requantize_to=requantize_to and requantize_to[1],
            payload_rows=groups + extra_rows,
            config=config,
            message_scales=message_scales,
        )
    if message_fmt:
        backends.check_pallas_takes(message_fmt)
    out = _launch(
        payload,
        multiplier,
        groups,
        transform=transform,
        out_dtype=out_dtype,
        requantize_to=requantize_to,
        config=config,
        interpret=interpret,
        message_fmt=message_fmt,
        extra_rows=extra_rows,
    )
    if requantize_to is None:
        return out
    codes, entries = out
    return codes[None], wire.pack_scale_entries(tuple(entries), requantize_to[1])[None, :, 0]


def _launch(
    payload, multiplier, groups, *, transform, out_dtype, requantize_to, config, interpret, message_fmt, extra_rows=0
):
    """Run the kernel on B batches of k shards: payload (B, k, rows >= N, G) (codes, or
    uint8 message buffers with `message_fmt`), multiplier (B, k, N). Requantizing takes
    B = 1; its payload comes out uint8 for messages, in an array of at least N +
    `extra_rows` rows (room for a message's scale rows).

    Returns:
      decoded (B, N, G) in `out_dtype`, or with `requantize_to` (payload array whose first
      N rows hold the codes, scale entries as (N, 1, 1) arrays).
    """
    batch, shards, rows, group_size = payload.shape
    config = config or default_config(group_size, transform, shards, requantize=requantize_to is not None)
    per_program, block = program_rows(groups, config, batch)
    padded = groups + (-groups % per_program)
    if padded > rows:  # odd sizes only: pad so every block reads inside the buffer
        payload = jnp.pad(payload, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    multiplier = jnp.pad(multiplier.astype(jnp.float32), ((0, 0), (0, 0), (0, padded - groups)))
    blocks = padded // per_program
    width = group_size // config.pieces
    payload = split_groups(payload.reshape(batch * shards, -1, group_size), config.pieces)
    multiplier = multiplier.reshape(batch * shards, padded)
    tile = pl.BlockSpec((per_program, config.pieces, width), lambda b, i: (b * blocks + i, 0, 0))
    out_rows = batch * padded
    if requantize_to is None:
        out_specs, out_shape = [tile], [output_struct((out_rows, config.pieces, width), out_dtype, payload)]
    else:
        fmt, scale_format = requantize_to
        wire.check_scale_format(scale_format)
        entry_dtypes = formats.SCALE_ENTRY_DTYPES[scale_format]
        payload_dtype = jnp.uint8 if message_fmt is not None else formats.wire_format(fmt).dtype
        out_specs = [tile] + [pl.BlockSpec((per_program,), lambda b, i: (b * blocks + i,))] * len(entry_dtypes)
        if batch != 1:
            raise ValueError(f"requantizing sums one batch of shards, got {batch}")
        out_shape = [
            output_struct((max(out_rows, groups + extra_rows), config.pieces, width), payload_dtype, payload)
        ] + [output_struct((out_rows,), dtype, payload) for dtype in entry_dtypes]
    outs = pl.pallas_call(
        functools.partial(
            _decompress_kernel,
            transform=transform,
            requantize_to=requantize_to,
            message_fmt=message_fmt,
            block=block,
            config=config,
        ),
        grid=(batch, blocks),
        in_specs=[
            pl.BlockSpec((shards, per_program, config.pieces, width), lambda b, i: (b, i, 0, 0)),
            pl.BlockSpec((shards, per_program), lambda b, i: (b, i)),
            pl.BlockSpec((width, width), lambda b, i: (0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(config),
        interpret=interpret,
        name="taco_decompress",
    )(payload, multiplier, jnp.asarray(hadamard_matrix(width), jnp.bfloat16))
    if requantize_to is None:
        return outs[0].reshape(batch, padded, group_size)[:, :groups]
    return outs[0].reshape(-1, group_size), [e[:groups, None, None] for e in outs[1:]]


@functools.partial(jax.jit, static_argnames=("transform", "out_dtype", "requantize_to", "config", "interpret"))
def decompress_groups(
    payload: jax.Array,
    multiplier: jax.Array,
    *,
    transform: bool,
    out_dtype: jnp.dtype = jnp.float32,
    requantize_to: tuple[str, str] | None = None,
    config: KernelConfig | split_kernels.SplitConfig | None = None,
    interpret: bool = False,
):
    """Dequantize and sum k shards of rows of G elements with the fused kernel.

    Args:
      payload: (k, N, G) 8-bit payloads; k a power of two.
      multiplier: (k, N) float32 per-group dequantization multipliers
        (`wire.dequantize_scale`).
      transform: apply the inverse Walsh-Hadamard transform to the sum (decode only).
      out_dtype: dtype of the decoded output.
      requantize_to: (fmt, scale_format) to quantize the sum into instead of decoding it.
      config: which kernel and its launch parameters: a `KernelConfig` for the Pallas
        kernel, a `split_kernels.SplitConfig` for the Gluon split kernel; if None, the
        split kernel's launch for the work (`split_kernels.decode_config`) where
        `backends.GLUON` takes the work and runs (not in interpret mode), else the
        Pallas kernel's `default_config`.
      interpret: run the Pallas kernel in the Pallas interpreter (CPU tests).

    Returns:
      The decoded (N, G) array in `out_dtype`, or with `requantize_to` a (payload, scales)
      pair in the layout of `wire.quantize_groups`.
    """
    groups = payload.shape[1]
    out = _decode(
        payload[None],
        multiplier[None],
        groups,
        transform=transform,
        out_dtype=out_dtype,
        requantize_to=requantize_to,
        config=config,
        interpret=interpret,
        message_fmt=None,
    )
    if requantize_to is None:
        return out[0]
    codes, scales = out
    return codes[0, :groups], scales[0][:, None]


@functools.partial(jax.jit, static_argnames=("layout", "transform", "out_dtype", "requantize", "config", "interpret"))
def decompress_message(
    messages: jax.Array,
    layout: wire.MessageLayout,
    *,
    transform: bool,
    out_dtype: jnp.dtype = jnp.float32,
    requantize: bool = False,
    config: KernelConfig | split_kernels.SplitConfig | None = None,
    interpret: bool = False,
):
    """Decode wire messages straight from their buffers: for each of B batches, the sum
    of its k messages (k a power of two), decoded or requantized into a new message.

    Args:
      messages: uint8 (B, k, rows, W) message buffers of `layout` (e.g. what an
        all-to-all delivered: B = 1, k = ranks; or an all-gather: B = ranks, k = 1).
      layout: their `wire.MessageLayout`.
      transform: apply the inverse Walsh-Hadamard transform to the sum (decode only).
      out_dtype: dtype of the decoded output.
      requantize: quantize the sum again with the layout's format into one message
        (B = 1), staying in the transformed domain (the two-shot all-reduce).
      config: which kernel and its launch parameters, as `decompress_groups`.
      interpret: run the Pallas kernel in the Pallas interpreter (CPU tests).

    Returns:
      decoded (B, N, G) in `out_dtype`, or with `requantize` a uint8 (rows, W) message.
    """
    multiplier = wire.multiplier(messages, layout)
    spec = (layout.fmt, layout.scale_format) if requantize else None
    out = _decode(
        messages,
        multiplier,
        layout.groups,
        transform=transform,
        out_dtype=out_dtype,
        requantize_to=spec,
        config=config,
        interpret=interpret,
        message_fmt=layout.fmt,
        extra_rows=layout.scale_rows,
        message_scales=layout.scale_format,
    )
    if not requantize:
        return out
    codes, scales = out
    buffer = codes[0, : layout.shape[0]]  # a copy only when padding made the kernel write past the message
    return wire.place_scales(buffer, scales[0], layout)


def decompress_reference(payload: jax.Array, multiplier: jax.Array, **options: Any):
    """The same computation in plain jnp (what the kernel is tested against):
    `wire.dequantize_groups`, whose keywords it takes."""
    return wire.dequantize_groups(payload, multiplier, **options)
