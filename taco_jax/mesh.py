"""The (data, pipe, tensor) device mesh, real or simulated on one device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from taco_jax.accounting import TraceScope

MESH_AXES = ("data", "pipe", "tensor")
DATA_AXIS, PIPE_AXIS, TENSOR_AXIS = MESH_AXES
_SIMULATING = TraceScope("simulated mesh", False)


def simulating() -> bool:
    """Whether the code being traced runs inside `simulated_shard_map` (its mesh axes
    are vmaps: ops whose batching rules take only a leading batch axis, such as cuDNN
    attention's backward pass, must choose another implementation)."""
    return _SIMULATING.get()


def make_mesh(data: int = 1, pipe: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes ('data', 'pipe', 'tensor').

    Args:
      data: data-parallel degree.
      pipe: pipeline-parallel degree.
      tensor: tensor-parallel degree. Neighbouring devices (the fastest links) go to
        `tensor`, then `pipe`, then `data`.
      devices: devices to use; all of `jax.devices()` by default.

    Returns:
      The mesh, with Auto axis types (shard_map and jit sharding both work on it).

    Raises:
      ValueError: a degree below 1, or data * pipe * tensor != the number of devices.

    Examples:
      On 8 devices (on a CPU: `XLA_FLAGS=--xla_force_host_platform_device_count=8`):

      >>> import taco_jax as tj
      >>> dict(tj.make_mesh(data=2, tensor=4).shape)
      {'data': 2, 'pipe': 1, 'tensor': 4}
    """
    shape = (data, pipe, tensor)
    for name, size in zip(MESH_AXES, shape):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh degree {name}={size!r} must be a positive integer")
    devices = list(jax.devices() if devices is None else devices)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh data={data} x pipe={pipe} x tensor={tensor} = {int(np.prod(shape))} devices, "
            f"but {len(devices)} devices are available"
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def data_axis(mesh: Mesh, batch: int) -> str | None:
    """ "data" when a batch of `batch` examples splits over the mesh's data axis, else
    None (the batch is replicated)."""
    return "data" if "data" in mesh.axis_names and batch % mesh.shape["data"] == 0 else None


def _sharded_dim(spec: P, axis: str) -> int | None:
    """The array dimension `spec` splits over mesh axis `axis`, or None."""
    for dim, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis in names:
            if len(names) > 1:
                raise ValueError(f"simulated meshes split a dimension over one axis only, got {spec}")
            return dim
    return None


def _split(x: jax.Array, spec: P, axis: str, size: int) -> jax.Array:
    dim = _sharded_dim(spec, axis)
    if dim is None:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {x.shape} is not divisible by mesh axis {axis}={size}")
    x = x.reshape(*x.shape[:dim], size, x.shape[dim] // size, *x.shape[dim + 1 :])
    return jnp.moveaxis(x, dim, 0)


def _merge(y: jax.Array, spec: P, axis: str) -> jax.Array:
    dim = _sharded_dim(spec, axis)
    if dim is None:
        return y[0]  # replicated over `axis`: every simulated rank holds the same value
    y = jnp.moveaxis(y, 0, dim)
    return y.reshape(*y.shape[:dim], -1, *y.shape[dim + 2 :])


def simulated_shard_map(fn: Callable, axes: dict[str, int], in_specs: tuple, out_specs: Any) -> Callable:
    """`jax.shard_map(fn, ...)` on one device: each mesh axis becomes a named `jax.vmap`.

    The per-shard code (collectives over the axis names, `lax.axis_index`, custom VJPs)
    runs unchanged, so a TP=4 run's arithmetic can be reproduced on a single GPU. Inputs
    are split and outputs reassembled by their `PartitionSpec`s; outputs replicated over
    an axis are taken from rank 0 of it.

    Args:
      fn: the per-shard function.
      axes: mesh axis names and sizes, outermost first, e.g. {"data": 2, "pipe": 1, "tensor": 4}.
      in_specs: one PartitionSpec (or a pytree prefix of them) per positional argument.
      out_specs: PartitionSpec pytree prefix of the outputs.

    Returns:
      A function of the global arrays.

    Raises:
      ValueError: a dimension not divisible by its axis size, or split over two axes.

    Examples:
      A 4-way tensor-parallel sum on whatever one device there is:

      >>> import jax, jax.numpy as jnp, taco_jax as tj
      >>> from jax.sharding import PartitionSpec as P
      >>> summed = tj.simulated_shard_map(lambda x: jax.lax.psum(x, "tensor"), {"tensor": 4}, (P("tensor"),), P())
      >>> summed(jnp.arange(8.0).reshape(4, 2))
      Array([[12., 16.]], dtype=float32)
    """
    if not axes:
        return fn
    (axis, size), rest = next(iter(axes.items())), dict(list(axes.items())[1:])
    inner = simulated_shard_map(fn, rest, in_specs, out_specs)
    is_spec = lambda s: isinstance(s, P)

    def outer(*args):
        per_spec = lambda f: jax.tree.map(
            lambda spec, tree: jax.tree.map(lambda x: f(x, spec), tree), tuple(in_specs), args, is_leaf=is_spec
        )
        split = per_spec(lambda x, spec: _split(x, spec, axis, size))
        in_axes = per_spec(lambda x, spec: None if _sharded_dim(spec, axis) is None else 0)
        with _SIMULATING.set(True):
            out = jax.vmap(inner, in_axes=in_axes, axis_name=axis, axis_size=size)(*split)
        return jax.tree.map(
            lambda spec, tree: jax.tree.map(lambda y: _merge(y, spec, axis), tree), out_specs, out, is_leaf=is_spec
        )

    return outer
