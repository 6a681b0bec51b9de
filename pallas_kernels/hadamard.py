"""Walsh-Hadamard transform over groups of the last axis: the jnp path (used off GPU and
wherever the kernels are not chosen), the ±1 matrix of the kernels' "matmul" method, and
the kernels' tile-free transforms ("lanes", "pairs"), written in jnp ops that the Pallas
Triton lowering turns into register and warp-shuffle code."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

VECTOR = 8  # bf16 values in one 16-byte load: what one GPU thread reads of a row at a time


def _check_power_of_two(size: int) -> None:
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")


@functools.cache
def hadamard_matrix(size: int) -> np.ndarray:
    """The unnormalized Sylvester Hadamard matrix of +-1 entries.

    Args:
      size: a power of two.

    Returns:
      A (size, size) float32 numpy array H with H @ H.T == size * I. It is symmetric, so
      the normalized transform H / sqrt(size) is its own inverse.

    Raises:
      ValueError: size is not a power of two.
    """
    _check_power_of_two(size)
    matrix = np.ones((1, 1), np.float32)
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    matrix.setflags(write=False)
    return matrix


def hadamard_transform(groups: jax.Array) -> jax.Array:
    """Normalized Walsh-Hadamard transform of the last axis (its own inverse).

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      H @ g / sqrt(G) for every group g, float32, same shape.
    """
    size = groups.shape[-1]
    matrix = jnp.asarray(hadamard_matrix(size))
    # The +-1 matrix is exact; HIGHEST keeps the f32 dot out of TF32/bf16 passes.
    transformed = jnp.einsum("...g,gh->...h", groups, matrix, precision=jax.lax.Precision.HIGHEST)
    return transformed * np.float32(1.0 / np.sqrt(size))


def hadamard_butterfly(groups: jax.Array) -> jax.Array:
    """groups @ H (unnormalized, Sylvester order) over the last axis, as log2(G) stages of
    sums and differences: each stage pairs the first half of the axis with the second and
    interleaves the sums with the differences (the constant-geometry fast transform).

    Only reshape, split and stack, which the Pallas Triton lowering supports; every stage
    is exact up to float32 rounding of the sums. On a whole tile each stage is a layout
    conversion through shared memory, so the kernels use it only within a thread's
    vector (`hadamard_lanes`).

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      float32 array of the same shape.
    """
    *lead, size = groups.shape
    _check_power_of_two(size)
    half = size // 2
    for _ in range(size.bit_length() - 1):
        low, high = (part.reshape(*lead, half) for part in jnp.split(groups.reshape(*lead, 2, half), 2, axis=-2))
        groups = jnp.stack([low + high, low - high], axis=-1).reshape(*lead, size)
    return groups


def _pair_stages(values: jax.Array, axes: range) -> jax.Array:
    """Sylvester stages along size-2 `axes`: (low, high) -> (low + high, low - high).

    Each element gets its partner from a sum over the pair of the float32 bits as int32
    (exact, wrapping): on a GPU, an axis spread over a warp's lanes is one warp shuffle,
    with no trip through shared memory. Then partner + sign * value, sign = +1 for low
    and -1 for high: exactly low + high and low - high."""
    for axis in axes:
        bits = lax.bitcast_convert_type(values, jnp.int32)
        partner = lax.bitcast_convert_type(jnp.sum(bits, axis=axis, keepdims=True) - bits, jnp.float32)
        sign = (1 - 2 * lax.broadcasted_iota(jnp.int32, values.shape, axis)).astype(jnp.float32)
        values = values * sign + partner
    return values


def hadamard_lanes(groups: jax.Array) -> jax.Array:
    """groups @ H (unnormalized, Sylvester order) over the last axis, laid out for a GPU
    thread holding one 16-byte vector (`VECTOR` values) of a row and consecutive threads
    the next ones: `hadamard_butterfly` within each vector, then one `_pair_stages` stage
    per remaining bit of the column index (H_G = H_{G/8} x H_8, a Kronecker product).

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      float32 array of the same shape.
    """
    *lead, size = groups.shape
    _check_power_of_two(size)
    inner = min(size, VECTOR)
    pairs = (size // inner).bit_length() - 1
    within = hadamard_butterfly(groups.reshape(*lead, size // inner, inner))
    stacked = within.reshape(*lead, *(2,) * pairs, inner)
    return _pair_stages(stacked, range(len(lead), len(lead) + pairs)).reshape(*lead, size)


def hadamard_pairs(groups: jax.Array) -> jax.Array:
    """groups @ H (unnormalized, Sylvester order) over the last axis: the axis seen as
    log2 G axes of size 2, one `_pair_stages` stage each (no reshape between stages).

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      float32 array of the same shape.
    """
    *lead, size = groups.shape
    _check_power_of_two(size)
    bits = size.bit_length() - 1
    stacked = groups.reshape(*lead, *(2,) * bits)
    return _pair_stages(stacked, range(len(lead), len(lead) + bits)).reshape(*lead, size)


def hadamard_across(pieces: list[jax.Array]) -> list[jax.Array]:
    """The Sylvester stages over the high bits of the column index, for groups split along
    the last axis into p pieces each already transformed over its own columns (H_G =
    H_p x H_{G/p}): sums and differences of whole pieces, in a GPU thread's registers.

    Args:
      pieces: p float32 arrays of one shape, p a power of two.

    Returns:
      The p pieces of the transformed groups.
    """
    _check_power_of_two(len(pieces))
    pieces, stride = list(pieces), 1
    while stride < len(pieces):
        for low in (i for i in range(len(pieces)) if not i & stride):
            pieces[low], pieces[low + stride] = pieces[low] + pieces[low + stride], pieces[low] - pieces[low + stride]
        stride *= 2
    return pieces
