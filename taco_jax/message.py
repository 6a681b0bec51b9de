"""A compressed message, from its encode to its decode: the one data path every
collective follows (`taco_jax.collectives` plans each call and moves its buffers).

compress kernel -> wire buffer -> collective -> decode kernel: `WirePlan.encode`
compresses rows of a message into a `Message` (one uint8 wire buffer,
`pallas_kernels.wire`, written by the compress kernel, and the static layout that reads
it); the `Transfer`, the executor of a collective's plan, moves the buffer
(`Transfer.move` runs each collective step and counts the bytes it sends, so the wire
ledger holds what the program moves: `taco_jax.accounting`). The message then decodes
what arrived (`decode`: each received buffer alone; `sum`: the received buffers summed
in float32 in the transformed domain, one inverse transform; `requantize`: their sum as
one new message), and the plan turns rows back into the array (`WirePlan.array`).
Nothing is copied between the stages, and every backend moves one byte per element.

Every encode and decode runs on the codec path `pallas_kernels.backends`' one table
chooses (`codec_choice`: once per plan, from `TacoConfig.kernel_mode`; "auto" lets the
platform a program is lowered for choose).

The plan lays a message out as rows of G elements of its last axis (`WirePlan.rows`,
zero-padded to a multiple of G: any shape the lax collective accepts works, and the
groups are the codec's). `Gathered` is what a gather keeps for its backward pass: the
8-bit buffers, decoded again when needed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from taco_jax.accounting import Collective, Op
from taco_jax.kernels import backends, formats, wire
from taco_jax.kernels import compress as compress_kernel
from taco_jax.kernels import decompress as decompress_kernel
from taco_jax.policy import QuantSpec, check_kernel_mode

if TYPE_CHECKING:
    from taco_jax.calibration import ChannelPlan

# How a codec call runs: a kernel mode (`KERNEL_MODES`), chosen per call, or a choice
# already made for the call's plan (`WirePlan.codec`).
Codec = str | backends.CodecChoice


def codec_choice(
    spec: QuantSpec, dtype: jnp.dtype, kernel_mode: str, *, shards: int = 1, size: int = 1
) -> backends.CodecChoice:
    """The codec path of work with `spec` on `dtype` (a compress's input, a decode's
    output) summing `shards` messages, under `kernel_mode` (`KERNEL_MODES`): the one
    table, `backends.choose`. Empty arrays (`size` 0) run the jnp path.

    Raises:
      ValueError: unknown kernel mode.
    """
    check_kernel_mode(kernel_mode)
    if size == 0:
        return backends.JNP_PATH
    work = backends.CodecWork(spec.fmt, spec.group_size, jnp.dtype(dtype), shards, spec.stochastic, spec.scales)
    return backends.choose(work, kernel_mode)


def _resolved(codec: Codec, spec: QuantSpec, dtype: jnp.dtype, shards: int, size: int) -> backends.CodecChoice:
    """`codec` itself when already chosen (a `WirePlan`'s), else its kernel mode's choice."""
    if isinstance(codec, backends.CodecChoice):
        return codec
    return codec_choice(spec, dtype, codec, shards=shards, size=size)


def quantize_rows(values: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array]:
    """`wire.quantize_groups` of `values` with the spec's settings (the jnp path)."""
    return wire.quantize_groups(
        values,
        fmt=spec.fmt,
        group_size=spec.group_size,
        scale_format=spec.scales,
        transform=spec.hadamard,
        stochastic=spec.stochastic,
    )


def scale_headroom_of(spec: QuantSpec) -> int:
    """The power of two the spec's wire scales are sent below the decode multiplier
    (`wire.scale_headroom`), which a decode multiplies back."""
    return wire.scale_headroom(formats.wire_format(spec.fmt), spec.group_size, spec.hadamard)


def message_layout(groups: int, spec: QuantSpec) -> wire.MessageLayout:
    """The wire layout of a message of `groups` groups compressed with `spec`."""
    return wire.MessageLayout(groups, spec.group_size, spec.fmt, spec.scales)


def encode(rows: jax.Array, spec: QuantSpec, codec: Codec = "auto") -> jax.Array:
    """Compress rows straight into wire messages (`pallas_kernels.wire`), one per
    leading index.

    Args:
      rows: float (..., N, G), G = spec.group_size, in wire channel order.
      spec: the `QuantSpec` (its `hadamard` decides the transform).
      codec: a kernel mode (`KERNEL_MODES`) or the plan's `CodecChoice`.

    Returns:
      uint8 (..., *message_layout(N, spec).shape).
    """
    lead, (groups, group_size) = rows.shape[:-2], rows.shape[-2:]

    def kernel(rows, interpret):
        messages = compress_kernel.compress_message(
            rows.reshape(-1, groups, group_size),
            fmt=spec.fmt,
            scale_format=spec.scales,
            transform=spec.hadamard,
            interpret=interpret,
        )
        return messages.reshape(*lead, *messages.shape[1:])

    def reference(rows):
        return wire.pack(*quantize_rows(rows, spec), message_layout(groups, spec))

    return _resolved(codec, spec, rows.dtype, 1, rows.size).run(kernel, reference, rows)


def decode(messages: jax.Array, groups: int, spec: QuantSpec, dtype: jnp.dtype, codec: Codec = "auto") -> jax.Array:
    """Decode messages: for each of B batches the sum of its k messages, in float32 in
    the transformed domain, transformed back once.

    Args:
      messages: uint8 (B, k, rows, W) messages of `groups` groups each.
      groups: N.
      spec: the `QuantSpec` they were compressed with.
      dtype: output dtype.
      codec: a kernel mode (`KERNEL_MODES`) or the plan's `CodecChoice`.

    Returns:
      (B, N, G) in `dtype`.
    """
    layout = message_layout(groups, spec)

    def kernel(messages, interpret):
        return decompress_kernel.decompress_message(
            messages, layout, transform=spec.hadamard, out_dtype=dtype, interpret=interpret
        )

    def reference(messages):
        batch, shards = messages.shape[:2]
        # The batches side by side as one (k, B * N, G) sum.
        payload = jnp.swapaxes(wire.payload_of(messages, layout), 0, 1).reshape(shards, batch * groups, spec.group_size)
        multiplier = jnp.swapaxes(wire.multiplier(messages, layout), 0, 1).reshape(shards, batch * groups)
        decoded = wire.dequantize_groups(
            payload, multiplier, transform=spec.hadamard, out_dtype=dtype, headroom=scale_headroom_of(spec)
        )
        return decoded.reshape(batch, groups, spec.group_size)

    choice = _resolved(codec, spec, dtype, messages.shape[1], groups * messages.shape[0])
    return choice.run(kernel, reference, messages)


def requantize(messages: jax.Array, groups: int, spec: QuantSpec, codec: Codec = "auto") -> jax.Array:
    """Sum k messages (k, rows, W) in float32 and quantize the sum into one message with
    the same spec, staying in the transformed domain (the two-shot all-reduce's middle);
    `codec` as `decode`'s.

    Returns:
      uint8 message of `message_layout(groups, spec).shape`.
    """
    layout = message_layout(groups, spec)

    def kernel(messages, interpret):
        return decompress_kernel.decompress_message(
            messages[None], layout, transform=spec.hadamard, requantize=True, interpret=interpret
        )

    def reference(messages):
        payload, scales = wire.dequantize_groups(
            wire.payload_of(messages, layout),
            wire.multiplier(messages, layout),
            transform=spec.hadamard,
            requantize_to=(spec.fmt, spec.scales),
            stochastic=spec.stochastic,
        )
        return wire.pack(payload, scales, layout)

    return _resolved(codec, spec, jnp.float32, messages.shape[0], groups).run(kernel, reference, messages)


# ----------------------------------------------------------------------------- rows

# Chunks of a pipelined message start at multiples of this many groups, so the kernels
# split every chunk (the last one aside) into whole row blocks without padding.
CHUNK_ALIGN = 64


def to_rows(x: jax.Array, group_size: int, lead: int) -> jax.Array:
    """(*lead_dims, *chunk) -> (*lead_dims, n, G), padding the chunk's last axis with zeros."""
    lead_shape, chunk = x.shape[:lead], x.shape[lead:]
    last = chunk[-1] if chunk else 1
    x = x.reshape(*lead_shape, math.prod(chunk[:-1]), last)
    pad = -last % group_size
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*lead_shape, -1, group_size)


def from_rows(rows: jax.Array, chunk: tuple[int, ...], lead: int) -> jax.Array:
    """Invert `to_rows` for a chunk shape (the padded tail of the last axis is dropped)."""
    lead_shape = rows.shape[:lead]
    last = chunk[-1] if chunk else 1
    rows = rows.reshape(*lead_shape, math.prod(chunk[:-1]), -1)[..., :last]
    return rows.reshape(*lead_shape, *chunk)


def chunk_bounds(groups: int, chunks: int) -> list[tuple[int, int]]:
    """Split `groups` rows into at most `chunks` pieces starting at multiples of
    `CHUNK_ALIGN` (fewer pieces when there are too few rows)."""
    per_chunk = -(-groups // chunks)
    step = -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN
    edges = list(range(0, groups, step)) + [groups]
    return list(zip(edges[:-1], edges[1:], strict=True))


def rank_blocks(rows: jax.Array, ranks: int) -> jax.Array:
    """(n, G) rows as (ranks, ceil(n / ranks), G) blocks, zero rows padding the last:
    block i is what rank i reduces in a two-shot all-reduce."""
    per_rank = -(-rows.shape[0] // ranks)
    return jnp.pad(rows, [(0, ranks * per_rank - rows.shape[0]), (0, 0)]).reshape(ranks, per_rank, rows.shape[1])


def concatenated(pieces: list[jax.Array], axis: int) -> jax.Array:
    """The pieces (of a pipelined message) joined along `axis`; one piece as it is."""
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)


# ----------------------------------------------------------------------------- the plan and its message


@dataclasses.dataclass(frozen=True)
class WirePlan:
    """How one compressed message travels, decided before it moves (`plan_message`).

    Attributes:
      spec: the quantizer, with the site's calibrated transform decision.
      chunks: pieces the message is pipelined in.
      algorithm: "one_shot" or "two_shot" (all-reduce only).
      permutation: the site's channel permutation; None for the identity.
      codec: the codec path of every encode and decode of the plan's messages, chosen
        once by `plan_message` from the backend table (`codec.codec_choice`); a kernel
        mode (`KERNEL_MODES`) is chosen per call instead.
    """

    spec: QuantSpec
    chunks: int = 1
    algorithm: str = "one_shot"
    permutation: ChannelPlan | None = None
    codec: Codec = "auto"

    def rows(self, x: jax.Array, lead: int = 0) -> jax.Array:
        """`x` as wire rows: channels in wire order, (*x.shape[:lead], n, G)."""
        return to_rows(self.to_wire_order(x), self.spec.group_size, lead)

    def array(self, rows: jax.Array, shape: tuple[int, ...], lead: int = 0) -> jax.Array:
        """Invert `rows` for arrays of `shape` after `lead` leading axes."""
        return self.from_wire_order(from_rows(rows, shape, lead))

    def encode(self, rows: jax.Array, dtype: Any) -> Message:
        """Compress rows (*lead, n, G) into a `Message` of n groups per leading index
        that decodes to `dtype`."""
        buffer = encode(rows, self.spec, self.codec)
        return Message(buffer, self.spec, rows.shape[-2], jnp.dtype(dtype), self.codec)

    def stacked(self, buffers: list[jax.Array], groups: int, dtype: Any) -> Message:
        """Received buffers of this plan's messages (one per sender, `groups` groups
        each) as one `Message` of k messages, decoding to `dtype`."""
        return Message(jnp.stack(buffers), self.spec, groups, jnp.dtype(dtype), self.codec)

    def to_wire_order(self, x: jax.Array) -> jax.Array:
        """`x` with its channels (last axis) in the order they are grouped on the wire."""
        return x if self.permutation is None else jnp.take(x, self.permutation.indices, axis=-1)

    def from_wire_order(self, x: jax.Array) -> jax.Array:
        """Invert `to_wire_order`."""
        return x if self.permutation is None else jnp.take(x, self.permutation.inverse, axis=-1)

    def chunk_bounds(self, groups: int) -> list[tuple[int, int]]:
        """The group ranges of the pipelined chunks of a message of `groups` groups."""
        return chunk_bounds(groups, self.chunks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Message:
    """A compressed message: its uint8 wire buffer and the static layout that reads it.

    Attributes:
      buffer: (*lead, R, W) bytes, one (R, W) message (`pallas_kernels.wire`) per
        leading index; a collective moves it (`moved`), which may add or consume a
        leading axis (one index per rank).
      spec: the quantizer.
      groups: groups of G per message.
      dtype: what `decode` and `sum` give.
      codec: the codec path (`WirePlan.codec`).
    """

    buffer: jax.Array
    spec: QuantSpec = dataclasses.field(metadata=dict(static=True))
    groups: int = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))
    codec: Codec = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        """Bytes of one message (one leading index)."""
        return message_layout(self.groups, self.spec).nbytes

    def moved(self, move: Callable[[jax.Array], jax.Array]) -> Message:
        """The message with its buffer moved by `move` (a step of a `Transfer`)."""
        return dataclasses.replace(self, buffer=move(self.buffer))

    def decode(self) -> jax.Array:
        """Each message decoded alone: buffer (R, W) -> rows (n, G), or (k, R, W) ->
        (k, n, G)."""
        if self.buffer.ndim == 2:
            return decode(self.buffer[None, None], self.groups, self.spec, self.dtype, self.codec)[0]
        return decode(self.buffer[:, None], self.groups, self.spec, self.dtype, self.codec)

    def sum(self) -> jax.Array:
        """The messages of the leading axis summed (float32, in the transformed domain):
        buffer (k, R, W) -> rows (n, G)."""
        return decode(self.buffer[None], self.groups, self.spec, self.dtype, self.codec)[0]

    def requantize(self) -> Message:
        """The messages of the leading axis summed and compressed again as one message:
        buffer (k, R, W) -> (R, W)."""
        return dataclasses.replace(self, buffer=requantize(self.buffer, self.groups, self.spec, self.codec))


# ----------------------------------------------------------------------------- the executor


@dataclasses.dataclass
class Transfer:
    """One collective as it runs, the executor of its plan: it compresses (`send`), moves
    (`move`) and counts what each move sends; decoding is the received `Message`'s.

    Attributes:
      collective: the collective entered in the ledger.
      plan: its `WirePlan`; None sends it plain.
      reason: why it goes as it does (the spec's text, else what keeps it plain).
      sent_bytes: what its moves have sent so far, per rank.
    """

    collective: Collective
    plan: WirePlan | None
    reason: str
    sent_bytes: int = 0

    def move(self, op: Op, run: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
        """`run`, the collective `op` of a buffer (or plain array) over the call's axis, as
        a step of this transfer: what it sends is counted (`Collective.plain_bytes` of
        the step), and what it delivers is named `RECEIVED`."""

        def counted(buffer: jax.Array) -> jax.Array:
            step = Collective.traced(buffer, op, self.collective.axis_name, direction=self.collective.direction)
            self.sent_bytes += step.plain_bytes
            return received(run(buffer))

        return counted

    def send(self, rows: jax.Array, dtype: Any, op: Op, run: Callable[[jax.Array], jax.Array]) -> Message:
        """Rows compressed by the plan into a `Message` of `dtype` and moved by `run`
        (`move`): compress kernel -> wire buffer -> collective."""
        if self.plan is None:
            raise ValueError(f"{self.collective.name}: a plain transfer sends no compressed message")
        return self.plan.encode(rows, dtype).moved(self.move(op, run))


# ----------------------------------------------------------------------------- what a gather keeps


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gathered:
    """Every rank's array as a gather received it, kept for a backward pass: the 8-bit
    messages when the gather was compressed (about half the bytes of bf16, as Transformer
    Engine keeps FP8 residuals), else the arrays. `value()` is the all-gather's result,
    decoded again from the messages where compressed.

    Attributes:
      parts: the received `Message`s, or arrays where uncompressed: with `by_shifts`, one
        per shift s = 0 .. k-1 (part s from rank r - s, each one rank's array); else the
        pipelined chunks of the all-gathered message, each (ranks, R, W) (uncompressed: the
        all-gather's result).
      plan: the messages' plan (None: uncompressed).
      shape: one rank's array's shape.
      axis: where the gathered axis goes in the result.
      tiled: the result concatenates the ranks' arrays along `axis` (else stacks them).
      axis_name: the mesh axis gathered over.
      by_shifts: the parts came by shift permutes (`taco_jax.collective_matmul`).
    """

    parts: tuple[Any, ...]
    plan: WirePlan | None = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    tiled: bool = dataclasses.field(metadata=dict(static=True))
    axis_name: str = dataclasses.field(metadata=dict(static=True))
    by_shifts: bool = dataclasses.field(metadata=dict(static=True))

    def arrays(self) -> list[jax.Array]:
        """The arrays received by shifts, in shift order (decoded where compressed)."""
        if not self.by_shifts:
            raise ValueError("arrays() is for a gather by shifts; value() gives the all-gather's result")
        return list(self.parts) if self.plan is None else [self.plan.array(p.decode(), self.shape) for p in self.parts]

    def value(self) -> jax.Array:
        """The all-gather's result, in `lax.all_gather`'s layout."""
        if self.by_shifts:
            return in_rank_order(self.arrays(), self.axis_name, self.axis)
        if self.plan is None:
            return self.parts[0]
        rows = concatenated([part.decode() for part in self.parts], axis=1)
        out = jnp.moveaxis(self.plan.array(rows, self.shape, 1), 0, self.axis)
        if self.tiled:
            ranks, shape = self.parts[0].buffer.shape[0], self.shape
            out = out.reshape(*shape[: self.axis], ranks * shape[self.axis], *shape[self.axis + 1 :])
        return out


def in_rank_order(pieces: list[jax.Array], axis_name: str, axis: int) -> jax.Array:
    """Pieces in shift order (piece s from rank r - s) concatenated along `axis` in rank
    order, as `lax.all_gather(tiled=True)` lays them out."""
    ranks, me = len(pieces), lax.axis_index(axis_name)
    stacked = jnp.stack(pieces)
    ordered = jnp.take(stacked, (me - jnp.arange(ranks)) % ranks, axis=0)
    ordered = jnp.moveaxis(ordered, 0, axis)
    shape = ordered.shape
    return ordered.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2 :])


# ----------------------------------------------------------------------------- rematerialization

# The name of every message a collective delivers (`received`), for `jax.checkpoint`
# policies: `REMAT_KEEPS_MESSAGES` saves them, so recomputing a layer for its backward
# pass recomputes its arithmetic but sends nothing again.
RECEIVED = "taco_jax.received"


def received(x: jax.Array) -> jax.Array:
    """`x`, what a collective delivered, named `RECEIVED` for rematerialization policies."""
    return checkpoint_name(x, RECEIVED)


REMAT_KEEPS_MESSAGES = jax.checkpoint_policies.save_only_these_names(RECEIVED)


def remat_policy(policy: Callable[..., bool] | None) -> Callable[..., bool]:
    """`policy` (a `jax.checkpoint` policy; None: save nothing) that also saves every
    received message (`RECEIVED`): a rematerialized layer recomputes, it does not send its
    forward messages again (the compressed ones are kept as their 8-bit buffers), so the
    wire ledger's forward messages are all the program sends."""
    if policy is None:
        return REMAT_KEEPS_MESSAGES
    return jax.checkpoint_policies.save_from_both_policies(policy, REMAT_KEEPS_MESSAGES)
