"""The wire message: the one uint8 buffer a compressed collective moves.

A message carries N groups of G elements. It is a (rows, W) uint8 array, W = G * bits / 8
bytes per payload row:

    rows [0, N)              payload: group i's codes in row i, packed by the format
                             (`formats.WireFormat.pack`: 8-bit codes as they are; fewer
                             bits in words of lcm(bits, 8) bits, the earliest code in the
                             lowest bits: 4-bit codes two per byte, 6-bit codes four per
                             three bytes)
    rows [N, N + scale_rows) scales: the N * S scale bytes, group after group (S bytes per
                             group, `formats.ScaleFormat.bytes_per_group`), zero-padded to
                             whole rows

Leading axes (the ranks of a gather, the destinations of an all-to-all, the chunks of a
pipelined collective) are free. The Pallas kernels write the payload rows straight into
the buffer (the scale rows, 1-6% of it, are placed after them in place) and read the
payload rows straight from a received buffer, so nothing is copied between the kernels
and the collective. The jnp path builds and reads the same bytes with `pack` and
`payload_of` / `scales_of`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from . import formats, group_codec


@dataclasses.dataclass(frozen=True)
class MessageLayout:
    """Where everything sits in the message of `groups` groups.

    Attributes:
      groups: N, groups (rows of G elements) in the message.
      group_size: G.
      fmt: element format name (`formats.WIRE_FORMATS`).
      scale_format: scale encoding name (`formats.SCALE_ENCODINGS`).
    """

    groups: int
    group_size: int
    fmt: str
    scale_format: str

    def __post_init__(self) -> None:
        group_codec.check_scale_format(self.scale_format)
        if self.group_size * self.wire_format.bits % 8:
            raise ValueError(f"group size {self.group_size} does not fill whole bytes in format {self.fmt!r}")

    @property
    def wire_format(self) -> formats.WireFormat:
        """The element format."""
        return formats.wire_format(self.fmt)

    @property
    def row_bytes(self) -> int:
        """W: bytes of one group's payload (the buffer's last axis)."""
        return self.wire_format.payload_bytes(self.group_size)

    @property
    def scale_bytes(self) -> int:
        """S: scale bytes per group."""
        return formats.scale_format(self.scale_format).bytes_per_group

    @property
    def scale_rows(self) -> int:
        """Rows holding the scales."""
        return -(-self.groups * self.scale_bytes // self.row_bytes)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, W) of one message."""
        return (self.groups + self.scale_rows, self.row_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of one message on the wire (payload, scales and the scale rows' padding,
        under one row)."""
        return math.prod(self.shape)


def scale_block(scales: jax.Array, layout: MessageLayout, lead_ndim: int) -> jax.Array:
    """The scale rows of messages: typed scales -> uint8 (..., scale_rows, W).

    Args:
      scales: per-group scales of messages with `lead_ndim` leading axes, in the layout
        of `group_codec.quantize_groups` (any trailing axes after those hold one
        message's N groups in order).
      layout: the message layout.
      lead_ndim: number of leading (message) axes.

    Returns:
      The uint8 scale rows, zero-padded.
    """
    lead = scales.shape[:lead_ndim]
    flat = scales if scales.dtype == jnp.uint8 else lax.bitcast_convert_type(scales, jnp.uint8)
    flat = flat.reshape(*lead, -1)
    pad = layout.scale_rows * layout.row_bytes - flat.shape[-1]
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    return flat.reshape(*lead, layout.scale_rows, layout.row_bytes)


def payload_rows(payload: jax.Array, layout: MessageLayout) -> jax.Array:
    """Typed payload (..., N, G) -> its uint8 rows (..., N, W)."""
    return layout.wire_format.pack(payload)


def pack(payload: jax.Array, scales: jax.Array, layout: MessageLayout) -> jax.Array:
    """A message from a typed payload (..., N, G) and scales (the jnp path; the kernels
    write the buffer directly).

    Returns:
      uint8 (..., rows, W).
    """
    return jnp.concatenate([payload_rows(payload, layout), scale_block(scales, layout, payload.ndim - 2)], axis=-2)


def place_scales(buffer: jax.Array, scales: jax.Array, layout: MessageLayout) -> jax.Array:
    """Write the scale rows into (..., rows, W) buffers whose payload rows a kernel
    wrote. In place under jit: only the scale bytes are written."""
    start = (0,) * (buffer.ndim - 2) + (layout.groups, 0)
    return lax.dynamic_update_slice(buffer, scale_block(scales, layout, buffer.ndim - 2), start)


def payload_of(message: jax.Array, layout: MessageLayout) -> jax.Array:
    """The typed payload (..., N, G) of messages (..., rows, W)."""
    return layout.wire_format.unpack(message[..., : layout.groups, :])


def scales_of(message: jax.Array, layout: MessageLayout) -> jax.Array:
    """The typed scales of messages (..., rows, W), as `group_codec.quantize_groups` lays them out."""
    lead = message.shape[:-2]
    entry_dtypes = formats.scale_format(layout.scale_format).entry_dtypes
    entries, dtype = len(entry_dtypes), entry_dtypes[0]
    itemsize = jnp.dtype(dtype).itemsize
    flat = message[..., layout.groups :, :].reshape(*lead, -1)[..., : layout.groups * layout.scale_bytes]
    if itemsize == 1:
        return flat.reshape(*lead, layout.groups)
    typed = lax.bitcast_convert_type(flat.reshape(*lead, layout.groups * entries, itemsize), dtype)
    return typed.reshape(*lead, layout.groups, entries) if entries > 1 else typed


def multiplier(message: jax.Array, layout: MessageLayout) -> jax.Array:
    """float32 (..., N) per-group dequantization multipliers of messages (..., rows, W)."""
    return group_codec.dequantize_scale(scales_of(message, layout), layout.scale_format)[..., 0]
