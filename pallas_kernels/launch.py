"""What the compress and decompress kernels share about launching: their launch
parameters, the block of rows a program takes, and how a kernel output is typed."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of a codec kernel.

    Attributes:
      block_rows: groups (rows of G elements) per program; a power of two >= 16.
      num_warps: warps per program.
      num_stages: software pipelining stages.
    """

    block_rows: int = 64
    num_warps: int = 4
    num_stages: int = 1


def block_rows_for(rows: int, preferred: int) -> int:
    """The largest power-of-two block of at most `preferred` rows (and at least 16)
    that divides `rows`, so no padding copy is needed; `preferred` if none does."""
    block = preferred
    while block > 16 and rows % block:
        block //= 2
    return block if rows % block == 0 else preferred


def output_struct(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel output's shape and dtype, varying over the manual mesh axes `like` varies
    over (a pallas_call inside `shard_map(check_vma=True)` must state its outputs' type)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)
