"""What the codec kernels share: their launch parameters, the rows a program takes and the
loop over them, the tile helpers of the Pallas kernels and how a kernel output is typed
(what each kernel takes is `backends.BACKENDS`; where a program is lowered,
`jax_compat.on_cuda`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import wire
from .wire import hadamard_across, hadamard_lanes, hadamard_pairs

TRANSFORM_METHODS = ("matmul", "lanes", "pairs")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the Pallas codec kernels (`backend` "pallas").

    Attributes:
      block_rows: groups (rows of G elements) a program works on at a time; a power of
        two >= 16.
      blocks_per_program: blocks of `block_rows` each program takes in turn (a loop in
        the kernel, so the Hadamard tile is loaded once per program and the next
        block's loads can be issued while one is computed); a power of two.
      num_warps: warps per program.
      num_stages: software pipelining stages of that loop.
      min_programs: fewer blocks per program where the grid would otherwise have fewer
        programs than this, so that small messages still spread over every
        multiprocessor (132 on an H200) several times.
      transform_method: how a kernel applies the Walsh-Hadamard transform: "matmul" (tensor-core
        matmuls against the +-1 tile, loaded into shared memory), or log2 G add/subtract
        stages without the tile: "lanes" (`wire.hadamard_lanes`: a butterfly within
        each 16-byte vector, then one exact pair exchange per further column bit, a warp
        shuffle where the pair spans lanes) or "pairs" (`wire.hadamard_pairs`: the
        pair exchange for every column bit). `compress.default_config` and
        `decompress.default_config` choose the fastest measured.
      pieces: p, how many slices of G / p contiguous columns a kernel loads each group
        in, one load each. A GPU thread holds the same columns of every slice, so p > 1
        puts more of a group in each thread: the per-group math is repeated by fewer
        lanes, and log2 p stages of the transform and of each reduction are register
        adds instead of warp shuffles (`wire.Pieces`).
    """

    block_rows: int = 64
    blocks_per_program: int = 1
    num_warps: int = 4
    num_stages: int = 1
    min_programs: int = 1024
    transform_method: str = "matmul"
    pieces: int = 1
    backend: ClassVar[str] = "pallas"

    def __post_init__(self):
        if self.transform_method not in TRANSFORM_METHODS:
            raise ValueError(
                f"KernelConfig.transform_method must be one of {TRANSFORM_METHODS}, got {self.transform_method!r}"
            )
        if self.pieces < 1 or self.pieces & (self.pieces - 1):
            raise ValueError(f"KernelConfig.pieces must be a power of two, got {self.pieces}")


def block_rows_for(rows: int, preferred: int) -> int:
    """The largest power-of-two block of at most `preferred` rows (and at least 16)
    that divides `rows`, so no padding copy is needed; `preferred` if none does."""
    block = preferred
    while block > 16 and rows % block:
        block //= 2
    return block if rows % block == 0 else preferred


def program_rows(rows: int, config: KernelConfig, batch: int = 1) -> tuple[int, int]:
    """(rows per program, rows per block of its loop) for `batch` launches of `rows`
    rows: powers of two that divide `rows` where one does, with fewer blocks per program
    than the config asks for where the grid would otherwise fall under `min_programs`."""
    blocks = config.blocks_per_program
    while blocks > 1 and batch * rows < config.min_programs * config.block_rows * blocks:
        blocks //= 2
    per_program = block_rows_for(rows, config.block_rows * blocks)
    return per_program, min(config.block_rows, per_program)


def row_loop(tile_rows: int, block: int, body) -> None:
    """Inside a kernel: call body(rows) for each block of `block` rows of the program's
    `tile_rows` rows (`rows` indexes the refs: a `pl.ds`, or all rows in one block)."""
    if tile_rows == block:
        body(slice(None))
        return

    def step(index, carry):
        body(pl.ds(pl.multiple_of(index * block, block), block))
        return carry

    lax.fori_loop(0, tile_rows // block, step, 0)


def triton_params(config: KernelConfig):
    """The Pallas Triton compiler parameters of a launch. The Triton backend module is
    imported here, where a kernel is built, so importing taco_jax never depends on it
    (JAX has deprecated it)."""
    from jax.experimental.pallas import triton as pallas_triton

    return pallas_triton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def output_struct(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel output's shape and dtype, varying over the manual mesh axes `like` varies
    over (a pallas_call inside `shard_map(check_vma=True)` must state its outputs' type)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def split_groups(array: jax.Array, pieces: int) -> jax.Array:
    """(..., G) as (..., p, G / p), a free reshape: the view a kernel with `KernelConfig.pieces`
    reads and writes."""
    if array.shape[-1] % pieces:
        raise ValueError(f"KernelConfig.pieces={pieces} must divide the group size {array.shape[-1]}")
    return array.reshape(*array.shape[:-1], pieces, array.shape[-1] // pieces)


# ----------------------------------------------------------------------------- tile helpers
# Shared by the Pallas compress and decompress kernels.

# bf16 parts a value of each dtype is split into for an exact tensor-core transform.
BF16_SPLITS = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2, jnp.dtype(jnp.float32): 3}
TILE_FREE_TRANSFORMS = {"lanes": hadamard_lanes, "pairs": hadamard_pairs}


def hadamard_dot(normalized: jax.Array, hadamard: jax.Array, splits: int) -> jax.Array:
    """normalized @ H with bf16 tensor-core matmuls and float32 accumulation.

    The value is split into `splits` bf16 parts (hi, mid, lo); each part times the +-1
    matrix is exact, so three parts reproduce a float32 product.
    """
    terms, rest = [], normalized
    for _ in range(splits):
        part = rest.astype(jnp.bfloat16)
        terms.append(jnp.dot(part, hadamard, preferred_element_type=jnp.float32))
        rest = rest - part.astype(jnp.float32)
    return sum(terms[1:], start=terms[0])


def load_hadamard(hadamard_ref, config: KernelConfig) -> jax.Array | None:
    """The +-1 tile for a "matmul" transform (loaded once per program, for every block);
    None for the other methods, which need no tile."""
    return hadamard_ref[...] if config.transform_method == "matmul" else None


def apply_hadamard(pieces: wire.Pieces, hadamard: jax.Array | None, splits: int, method: str) -> wire.Pieces:
    """The groups' pieces times H in float32: each piece by `method` (`KernelConfig.transform_method`),
    against the loaded tile (`hadamard_dot`) or with one of the `TILE_FREE_TRANSFORMS`,
    then across the pieces (`wire.hadamard_across`)."""
    if method == "matmul":
        if hadamard is None:
            raise ValueError("the matmul transform needs the loaded Hadamard tile (`load_hadamard`)")
        within = [hadamard_dot(piece, hadamard, splits) for piece in pieces]
    else:
        within = [TILE_FREE_TRANSFORMS[method](piece) for piece in pieces]
    return tuple(hadamard_across(within))


def load_pieces(ref, *index) -> wire.Pieces:
    """A block of groups from a (..., rows, p, G / p) ref at `index` (leading indices, then
    the rows): one load per piece (`KernelConfig.pieces`)."""
    return tuple(ref[(*index, piece, slice(None))] for piece in range(ref.shape[-2]))


def store_pieces(ref, rows, pieces: wire.Pieces) -> None:
    """Store a block of groups' pieces into a (rows, p, G / p) ref, as its dtype holds them."""
    for index, piece in enumerate(pieces):
        ref[rows, index, :] = as_stored(piece, ref.dtype)


def as_stored(payload: jax.Array, dtype) -> jax.Array:
    """Codes as the output buffer holds them: a message buffer is uint8, holding their bytes."""
    return payload if payload.dtype == dtype else jax.lax.bitcast_convert_type(payload, dtype)
