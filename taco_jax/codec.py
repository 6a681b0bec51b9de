"""The TACO codec of one tensor: permute -> adaptive pre-scale -> Hadamard -> scale ->
8-bit cast (`compress`), and back (`decompress`).

The math lives in `pallas_kernels` (the jnp reference in `wire`, and the fused kernels);
this module validates, handles permutations and shapes, and runs each call on the codec
path that `pallas_kernels.backends`' one table chooses (`message.codec_choice`, from the
`kernel_mode` argument; "auto" lets the platform a program is lowered for choose). A
collective's messages take the same path through `taco_jax.message`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from taco_jax.kernels import compress as compress_kernel
from taco_jax.kernels import decompress as decompress_kernel
from taco_jax.kernels import wire
from taco_jax.message import codec_choice, quantize_rows, scale_headroom_of
from taco_jax.policy import QuantSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Compressed:
    """A tensor compressed by `compress`: 8-bit payload, per-group scales, static metadata.

    Attributes:
      payload: (..., C) array in the spec's element dtype (float8_e4m3fn, float8_e5m2
        or int8; int4 codes as int8, packed on the wire), in the permuted and (if
        `spec.hadamard`) transformed domain.
      scales: per-group scales, layout given by `spec.scales`: float32 (..., C/G, 2) for
        "dual", float32 (..., C/G) for "single", bfloat16 for "bf16", uint8 for "e8m0".
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
        return int(self.payload.size * self.spec.element_bits // 8 + self.scales.size * self.scales.dtype.itemsize)

    def dequantize(self, perm: ArrayLike | None = None) -> jax.Array:
        """Same as `decompress(self, perm)`."""
        return decompress(self, perm)


# ----------------------------------------------------------------------------- validation


def check_groupable(shape: Sequence[int], spec: QuantSpec) -> None:
    """Raise ValueError unless the last axis of `shape` splits into groups of `spec.group_size`."""
    if len(shape) == 0:
        raise ValueError("compress needs an array with at least one axis, got a scalar")
    if shape[-1] % spec.group_size:
        raise ValueError(
            f"last axis of shape {tuple(shape)} has {shape[-1]} elements, not divisible by group_size {spec.group_size}"
        )


def check_permutation(perm: ArrayLike, channels: int) -> jax.Array:
    """Return `perm` as an array; raise ValueError unless it permutes range(channels).

    The values are checked when `perm` is concrete; under tracing only its shape and dtype.
    """
    if not isinstance(perm, jax.core.Tracer):
        perm = jnp.asarray(perm)
    if perm.ndim != 1 or perm.shape[0] != channels:
        raise ValueError(f"permutation has shape {perm.shape}, expected ({channels},) for the last axis")
    if not jnp.issubdtype(perm.dtype, jnp.integer):
        raise ValueError(f"permutation must have an integer dtype, got {perm.dtype}")
    if not isinstance(perm, jax.core.Tracer) and not np.array_equal(np.sort(np.asarray(perm)), np.arange(channels)):
        raise ValueError(f"perm is not a permutation of range({channels})")
    return perm


# ----------------------------------------------------------------------------- dispatch


def _quantize(values: jax.Array, spec: QuantSpec, kernel_mode: str) -> tuple[jax.Array, jax.Array]:
    """Payload and wire scales of `values` (..., C), kernel or jnp."""
    groups = (*values.shape[:-1], values.shape[-1] // spec.group_size)

    def kernel(values, interpret):
        payload, scales = compress_kernel.compress_groups(
            values.reshape(-1, spec.group_size),
            fmt=spec.fmt,
            scale_format=spec.scales,
            transform=spec.hadamard,
            interpret=interpret,
        )
        return payload.reshape(values.shape), scales.reshape(*groups, *scales.shape[2:])

    choice = codec_choice(spec, values.dtype, kernel_mode, size=values.size)
    return choice.run(kernel, lambda v: quantize_rows(v, spec), values)


def _dequantize_sum(shards: Compressed, kernel_mode: str, *, requantize: bool, dtype: jnp.dtype = jnp.float32):
    """Sum of the shards along axis 0, decoded to `dtype` or requantized; kernel or jnp."""
    spec = shards.spec
    count, group = shards.payload.shape[0], spec.group_size
    payload = shards.payload.reshape(count, -1, group)
    multiplier = wire.dequantize_scale(shards.scales, spec.scales).reshape(count, -1)
    requantize_to = (spec.fmt, spec.scales) if requantize else None

    def kernel(payload, multiplier, interpret):
        return decompress_kernel.decompress_groups(
            payload,
            multiplier,
            transform=spec.hadamard,
            out_dtype=dtype,
            requantize_to=requantize_to,
            interpret=interpret,
        )

    def reference(payload, multiplier):
        return wire.dequantize_groups(
            payload,
            multiplier,
            transform=spec.hadamard,
            out_dtype=dtype,
            requantize_to=requantize_to,
            stochastic=spec.stochastic,
            headroom=scale_headroom_of(spec),
        )

    choice = codec_choice(spec, dtype, kernel_mode, shards=count, size=payload.size)
    return choice.run(kernel, reference, payload, multiplier)


# ----------------------------------------------------------------------------- wire messages


# ----------------------------------------------------------------------------- public API


def _underivable(name: str, fn):
    """`fn` (arrays -> arrays) with a derivative rule that raises: the quantizer's own
    derivative is zero or undefined, and a silent zero gradient is a wrong result."""

    @jax.custom_jvp
    def op(*args):
        return fn(*args)

    @op.defjvp
    def refuse(primals, tangents):
        raise ValueError(
            f"taco_jax.{name} is not differentiable: the quantizer's derivative is zero almost everywhere. "
            "Differentiate through taco_jax.all_gather / reduce_scatter / all_reduce / ppermute or taco_jax.tp, "
            "whose gradients are straight-through (an explicit compressed transpose collective)."
        )

    return op


def _decoded_sum(name: str, shards: Compressed, kernel_mode: str) -> jax.Array:
    """The decoded sum of `shards` along axis 0 in their dtype (public `name`'s work)."""
    return _underivable(
        name,
        lambda payload, scales: _dequantize_sum(
            dataclasses.replace(shards, payload=payload, scales=scales),
            kernel_mode,
            requantize=False,
            dtype=shards.dtype,
        ),
    )(shards.payload, shards.scales)


def compress(x: jax.Array, spec: QuantSpec, perm: ArrayLike | None = None, *, kernel_mode: str = "auto") -> Compressed:
    """Compress a tensor to an 8-bit payload with per-group scales.

    Args:
      x: float array (f32, bf16, f16, ...) whose last axis is divisible by
        `spec.group_size`.
      spec: the `QuantSpec`.
      perm: optional channel permutation of the last axis, applied before grouping
        (`x[..., perm]`), e.g. from calibration.
      kernel_mode: where the codec runs, one of `KERNEL_MODES` ("auto": the GPU kernels on
        GPU, jnp elsewhere).

    Returns:
      A `Compressed` pytree. NaN or Inf in a group make that group decode to NaN.

    Raises:
      ValueError: non-float input, last axis not divisible by the group size, or a
        permutation of the wrong length / not a permutation.

    Examples:
      >>> import jax, taco_jax as tj
      >>> x = jax.random.normal(jax.random.key(0), (256, 1024), "bfloat16")
      >>> c = tj.compress(x, tj.QuantSpec.parse("int8:128:H:bf16"))
      >>> c.payload.dtype, c.nbytes / x.nbytes
      (dtype('int8'), 0.5078125)
      >>> error = jax.numpy.linalg.norm((tj.decompress(c) - x).astype("float32")) / jax.numpy.linalg.norm(x.astype("float32"))
      >>> bool(0.001 < error < 0.01)
      True
    """
    if not isinstance(spec, QuantSpec):
        raise ValueError(f"spec must be a QuantSpec, got {type(spec).__name__}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"compress needs a floating-point input, got dtype {x.dtype}")
    check_groupable(x.shape, spec)
    if perm is not None:
        x = jnp.take(x, check_permutation(perm, x.shape[-1]), axis=-1)
    payload, scales = _underivable("compress", lambda values: _quantize(values, spec, kernel_mode))(x)
    return Compressed(payload, scales, tuple(x.shape), np.dtype(x.dtype), spec)


def decompress(c: Compressed, perm: ArrayLike | None = None, *, kernel_mode: str = "auto") -> jax.Array:
    """Reconstruct the tensor from a `Compressed`.

    Args:
      c: the output of `compress`.
      perm: the permutation given to `compress` (None if none was).
      kernel_mode: kernel mode (see `compress`).

    Returns:
      Array of `c.shape` and `c.dtype`.

    Raises:
      ValueError: `c` is not a `Compressed`, or a bad permutation.
    """
    if not isinstance(c, Compressed):
        raise ValueError(f"decompress needs a Compressed, got {type(c).__name__}")
    single = jax.tree_util.tree_map(lambda leaf: leaf[None], c)
    values = _decoded_sum("decompress", single, kernel_mode).reshape(c.payload.shape)
    if perm is not None:
        values = jnp.take(values, jnp.argsort(check_permutation(perm, c.shape[-1])), axis=-1)
    return values


def decompress_sum(shards: Compressed, *, kernel_mode: str = "auto") -> jax.Array:
    """Dequantize k shards (stacked on axis 0) and return their sum.

    The sum is taken in float32 in the transformed domain and transformed back once (one
    fused kernel on GPU), so k shards cost one inverse transform, not k.

    Args:
      shards: a `Compressed` whose arrays have a leading shard axis (e.g. what an
        all-to-all of compressed chunks delivers).
      kernel_mode: kernel mode (see `compress`).

    Returns:
      The sum, shape `shards.payload.shape[1:]`, dtype `shards.dtype`.
    """
    return _decoded_sum("decompress_sum", shards, kernel_mode).reshape(shards.payload.shape[1:])


def requantize_sum(shards: Compressed, *, kernel_mode: str = "auto") -> Compressed:
    """Sum k shards (stacked on axis 0) in float32 in the transformed domain and
    quantize the sum again with the same spec, without leaving the transformed domain
    (the middle step of the two-shot all-reduce). `decompress` of the result decodes it.

    Args:
      shards: a `Compressed` with a leading shard axis.
      kernel_mode: kernel mode (see `compress`).

    Returns:
      A `Compressed` of shape `shards.payload.shape[1:]`.
    """
    shape = shards.payload.shape[1:]
    payload, scales = _underivable(
        "requantize_sum",
        lambda payload, scales: _dequantize_sum(
            dataclasses.replace(shards, payload=payload, scales=scales), kernel_mode, requantize=True
        ),
    )(shards.payload, shards.scales)
    groups = (*shape[:-1], shape[-1] // shards.spec.group_size)
    return Compressed(
        payload.reshape(shape), scales.reshape(*groups, *scales.shape[2:]), tuple(shape), shards.dtype, shards.spec
    )


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

    Examples:
      >>> import taco_jax as tj
      >>> tj.wire_bytes((8192, 2048), "bfloat16", None)
      33554432
      >>> tj.wire_bytes((8192, 2048), "bfloat16", tj.QuantSpec.parse("e4m3:128:H:dual"))
      17825792
    """
    size = math.prod(shape)
    if spec is None:
        return size * np.dtype(dtype).itemsize
    check_groupable(shape, spec)
    return size * spec.element_bits // 8 + (size // spec.group_size) * spec.scale_bytes
