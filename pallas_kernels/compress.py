"""Fused compress kernel: pre-scale -> Walsh-Hadamard -> scale -> clip -> 8-bit cast.

One pass over memory: each program loads a (block_rows, G) tile of groups, computes the
group statistics, transforms the tile with one tensor-core matmul against the +-1
Hadamard matrix (exact in bf16, FP32 accumulation; 1/sqrt(G) folded into the scale),
and stores the 8-bit payload and the per-group scales. float32 inputs are split into
three bf16 parts (three matmuls) so the transform keeps float32 accuracy.

`compress_reference` beside the kernel is the plain-jnp definition it is tested against.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import formats, group_codec
from pallas_kernels.hadamard import hadamard_matrix

# Scale entry dtypes per scale format, one output array each (see quantize_scaled).
SCALE_ENTRY_DTYPES = {
    "dual": (jnp.float32, jnp.float32),
    "single": (jnp.float32,),
    "bf16": (jnp.bfloat16,),
    "e8m0": (jnp.uint8,),
}
BF16_SPLITS = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2, jnp.dtype(jnp.float32): 3}


@dataclasses.dataclass(frozen=True)
class CompressConfig:
    """Launch parameters of the compress kernel.

    Attributes:
      block_rows: groups (rows of G elements) per program; a power of two >= 16.
      num_warps: warps per program.
      num_stages: software pipelining stages.
    """

    block_rows: int = 64
    num_warps: int = 4
    num_stages: int = 1


def default_config(group_size: int) -> CompressConfig:
    """Block sizes by group size: about 8K elements per program (set from H200 sweeps,
    benchmarks/kernels.py)."""
    return CompressConfig(block_rows=max(16, 8192 // group_size), num_warps=4)


def hadamard_dot(normalized: jax.Array, hadamard: jax.Array, splits: int) -> jax.Array:
    """normalized @ H with bf16 tensor-core matmuls and float32 accumulation.

    The value is split into `splits` bf16 parts (hi, mid, lo); each part times the +-1
    matrix is exact, so three parts reproduce a float32 product.
    """
    result, rest = None, normalized
    for _ in range(splits):
        part = rest.astype(jnp.bfloat16)
        term = jnp.dot(part, hadamard, preferred_element_type=jnp.float32)
        result = term if result is None else result + term
        rest = rest - part.astype(jnp.float32)
    return result


def _compress_kernel(x_ref, hadamard_ref, payload_ref, *scale_refs, fmt, scale_format, transform, splits):
    groups = x_ref[...].astype(jnp.float32)
    group_size = groups.shape[-1]
    normalized, shift, prescale = group_codec.normalize_groups(groups, formats.wire_format(fmt).max_value)
    if transform:
        row_factor = formats.times_pow2(prescale, shift) * np.float32(1.0 / np.sqrt(group_size))
        scaled = hadamard_dot(normalized, hadamard_ref[...], splits) * row_factor
    else:
        scaled = groups * prescale
    payload, entries = group_codec.quantize_scaled(scaled, prescale, fmt, scale_format)
    payload_ref[...] = payload
    for ref, entry in zip(scale_refs, entries):
        ref[...] = entry.reshape(ref.shape)


@functools.partial(jax.jit, static_argnames=("fmt", "scale_format", "transform", "config", "interpret"))
def compress(
    x: jax.Array,
    *,
    fmt: str,
    scale_format: str,
    transform: bool,
    config: CompressConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Quantize rows of G elements with the fused kernel.

    Args:
      x: (N, G) float32, bfloat16 or float16; G a power of two >= 16.
      fmt: "e4m3", "e5m2" or "int8".
      scale_format: "dual", "single", "bf16" or "e8m0".
      transform: apply the Walsh-Hadamard transform.
      config: launch parameters; `default_config` if None.
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      (payload (N, G), scales) in the layout of `group_codec.quantize_groups` for (N, G).
    """
    group_codec.check_scale_format(scale_format)
    rows, group_size = x.shape
    config = config or default_config(group_size)
    block = config.block_rows
    padded = rows + (-rows % block)
    if padded != rows:
        x = jnp.pad(x, ((0, padded - rows), (0, 0)))
    wire = formats.wire_format(fmt)
    entry_dtypes = SCALE_ENTRY_DTYPES[scale_format]
    kernel = functools.partial(
        _compress_kernel, fmt=fmt, scale_format=scale_format, transform=transform,
        splits=BF16_SPLITS[jnp.dtype(x.dtype)],
    )
    payload, *entries = pl.pallas_call(
        kernel,
        grid=(padded // block,),
        in_specs=[pl.BlockSpec((block, group_size), lambda i: (i, 0)), pl.BlockSpec((group_size, group_size), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((block, group_size), lambda i: (i, 0))] + [pl.BlockSpec((block,), lambda i: (i,))] * len(entry_dtypes),
        out_shape=[jax.ShapeDtypeStruct((padded, group_size), wire.dtype)]
        + [jax.ShapeDtypeStruct((padded,), dtype) for dtype in entry_dtypes],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="taco_compress",
    )(x, jnp.asarray(hadamard_matrix(group_size), jnp.bfloat16))
    entries = [e[:rows, None, None] for e in entries]  # (N, groups=1, 1)
    return payload[:rows], group_codec.pack_scale_entries(tuple(entries), scale_format)


def compress_reference(x: jax.Array, *, fmt: str, scale_format: str, transform: bool) -> tuple[jax.Array, jax.Array]:
    """The same computation in plain jnp (what the kernel is tested against)."""
    return group_codec.quantize_groups(x, fmt=fmt, group_size=x.shape[-1], scale_format=scale_format, transform=transform)
