"""The (data, pipe, tensor) device mesh."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "pipe", "tensor")


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
