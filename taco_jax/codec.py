"""The TACO codec: permute -> adaptive pre-scale -> Hadamard -> scale -> 8-bit cast."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import group_codec
from pallas_kernels.hadamard import hadamard_transform
from taco_jax.spec import QuantSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Compressed:
    """A tensor compressed by `compress`: 8-bit payload, per-group scales, static metadata.

    Attributes:
      payload: (..., C) array in the spec's element dtype (float8_e4m3fn, float8_e5m2
        or int8), in the permuted and (if `spec.hadamard`) transformed domain.
      scales: per-group scales, layout given by `spec.scales` (see
        `pallas_kernels.group_codec.quantize_groups`).
      shape: shape of the original tensor.
      dtype: dtype of the original tensor; `decompress` returns it.
      spec: the `QuantSpec` used.
    """

    payload: jax.Array
    scales: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
    spec: QuantSpec = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: payload plus scales."""
        return int(self.payload.size * self.payload.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize)

    def dequantize(self, perm: jax.Array | None = None) -> jax.Array:
        """Same as `decompress(self, perm)`."""
        return decompress(self, perm)


def _check_float(dtype: np.dtype) -> None:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"compress needs a floating-point input, got dtype {dtype}")


def check_groupable(shape: Sequence[int], spec: QuantSpec) -> None:
    """Raise ValueError unless the last axis of `shape` splits into groups of `spec.group_size`."""
    if len(shape) == 0:
        raise ValueError("compress needs an array with at least one axis, got a scalar")
    if shape[-1] % spec.group_size:
        raise ValueError(
            f"last axis of shape {tuple(shape)} has {shape[-1]} elements, "
            f"not divisible by group_size {spec.group_size}"
        )


def check_permutation(perm: jax.Array, channels: int) -> None:
    """Raise ValueError unless `perm` is a permutation of range(channels).

    The values are checked when `perm` is concrete; under tracing only its shape and dtype.
    """
    if perm.ndim != 1 or perm.shape[0] != channels:
        raise ValueError(f"permutation has shape {perm.shape}, expected ({channels},) for the last axis")
    if not jnp.issubdtype(perm.dtype, jnp.integer):
        raise ValueError(f"permutation must have an integer dtype, got {perm.dtype}")
    if isinstance(perm, jax.core.Tracer):
        return
    values = np.asarray(perm)
    if not np.array_equal(np.sort(values), np.arange(channels)):
        raise ValueError(f"perm is not a permutation of range({channels})")


def compress(x: jax.Array, spec: QuantSpec, perm: jax.Array | None = None) -> Compressed:
    """Compress a tensor to an 8-bit payload with per-group scales.

    Args:
      x: float array (f32, bf16, f16, ...) whose last axis is divisible by
        `spec.group_size`.
      spec: the `QuantSpec`.
      perm: optional channel permutation of the last axis, applied before grouping
        (`x[..., perm]`), e.g. from calibration.

    Returns:
      A `Compressed` pytree. NaN or Inf in a group make that group decode to NaN.

    Raises:
      ValueError: non-float input, last axis not divisible by the group size, or a
        permutation of the wrong length / not a permutation.
    """
    if not isinstance(spec, QuantSpec):
        raise ValueError(f"spec must be a QuantSpec, got {type(spec).__name__}")
    x = jnp.asarray(x)
    _check_float(x.dtype)
    check_groupable(x.shape, spec)
    if perm is not None:
        perm = jnp.asarray(perm) if not isinstance(perm, jax.core.Tracer) else perm
        check_permutation(perm, x.shape[-1])
        x = jnp.take(x, perm, axis=-1)
    payload, scales = group_codec.quantize_groups(
        x, fmt=spec.fmt, group_size=spec.group_size, scale_format=spec.scales, transform=spec.hadamard
    )
    return Compressed(payload, scales, tuple(x.shape), np.dtype(x.dtype), spec)


def decompress(c: Compressed, perm: jax.Array | None = None) -> jax.Array:
    """Reconstruct the tensor from a `Compressed`.

    Args:
      c: the output of `compress`.
      perm: the permutation given to `compress` (None if none was).

    Returns:
      Array of `c.shape` and `c.dtype`.

    Raises:
      ValueError: `c` is not a `Compressed`, or a bad permutation.
    """
    if not isinstance(c, Compressed):
        raise ValueError(f"decompress needs a Compressed, got {type(c).__name__}")
    values = group_codec.dequantize_groups(
        c.payload, c.scales, group_size=c.spec.group_size, scale_format=c.spec.scales, transform=c.spec.hadamard
    )
    if perm is not None:
        perm = jnp.asarray(perm) if not isinstance(perm, jax.core.Tracer) else perm
        check_permutation(perm, c.shape[-1])
        values = jnp.take(values, jnp.argsort(perm), axis=-1)
    return values.astype(c.dtype)


def to_transformed(c: Compressed) -> jax.Array:
    """Dequantize into the transformed domain: permuted, Hadamard not undone, float32.

    Shards compressed with one spec can be summed here (the transform is linear), so a
    reduction needs one inverse transform at the end instead of one per shard.

    Args:
      c: a `Compressed`.

    Returns:
      float32 array of `c.shape`.
    """
    return group_codec.dequantize_groups(
        c.payload, c.scales, group_size=c.spec.group_size, scale_format=c.spec.scales, transform=False
    )


def from_transformed(values: jax.Array, spec: QuantSpec, dtype: jnp.dtype) -> Compressed:
    """Quantize values already in `spec`'s transformed domain (e.g. a sum of
    `to_transformed` shards); `decompress` of the result undoes the transform.

    Args:
      values: float32 array, last axis divisible by the group size.
      spec: the `QuantSpec` the values were transformed with.
      dtype: dtype `decompress` should return.

    Returns:
      A `Compressed`.
    """
    check_groupable(values.shape, spec)
    payload, scales = group_codec.quantize_groups(
        values, fmt=spec.fmt, group_size=spec.group_size, scale_format=spec.scales, transform=False
    )
    return Compressed(payload, scales, tuple(values.shape), np.dtype(dtype), spec)


def inverse_transform(values: jax.Array, spec: QuantSpec) -> jax.Array:
    """Undo `spec`'s transform on float32 values (e.g. a sum of `to_transformed` shards)
    without quantizing: the Walsh-Hadamard transform of each group if `spec.hadamard`.

    Args:
      values: float32 array, last axis divisible by the group size.
      spec: the `QuantSpec` the values were transformed with.

    Returns:
      float32 array of the same shape.
    """
    if not spec.hadamard:
        return values
    check_groupable(values.shape, spec)
    groups = values.reshape(*values.shape[:-1], -1, spec.group_size)
    return hadamard_transform(groups).reshape(values.shape)


def wire_bytes(shape: Sequence[int], dtype: jnp.dtype, spec: QuantSpec | None) -> int:
    """Bytes a tensor occupies on the wire, computed from its shape alone.

    Args:
      shape: tensor shape.
      dtype: its dtype (the uncompressed element size).
      spec: the `QuantSpec`, or None for an uncompressed message.

    Returns:
      Payload plus scale bytes for a spec; `size * itemsize` for None.

    Raises:
      ValueError: last axis not divisible by the group size.
    """
    size = math.prod(shape)
    if spec is None:
        return size * np.dtype(dtype).itemsize
    check_groupable(shape, spec)
    return size + (size // spec.group_size) * spec.scale_bytes
