"""Walsh-Hadamard transform over groups of the last axis: the jnp path (used off GPU and
wherever the kernels are not chosen) and the ±1 matrix the fused kernels multiply by."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=None)
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
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
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
    transformed = jnp.einsum(
        "...g,gh->...h", groups, matrix, precision=jax.lax.Precision.HIGHEST
    )
    return transformed * np.float32(1.0 / np.sqrt(size))


def hadamard_butterfly(groups: jax.Array) -> jax.Array:
    """groups @ H (unnormalized, Sylvester order) over the last axis, as log2(G) stages of
    sums and differences: each stage pairs the first half of the axis with the second and
    interleaves the sums with the differences (the constant-geometry fast transform).

    Only reshape, split and stack, which the Pallas Triton lowering supports, so inside a
    kernel the transform needs neither the G x G tile nor the tensor cores; every stage is
    exact up to float32 rounding of the sums.

    Args:
      groups: float32 array (..., G), G a power of two.

    Returns:
      float32 array of the same shape.
    """
    *lead, size = groups.shape
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    half = size // 2
    for _ in range(size.bit_length() - 1):
        low, high = (part.reshape(*lead, half) for part in jnp.split(groups.reshape(*lead, 2, half), 2, axis=-2))
        groups = jnp.stack([low + high, low - high], axis=-1).reshape(*lead, size)
    return groups
