"""A compressed message, from its plan to its decode: the one data path every collective
follows, and its executor.

`Call.transfer` runs one collective: `plan_message` decides how the message travels
(`taco_jax.policy`: compressed or not, the all-reduce algorithm, pipelined chunks),
reports it to an active calibration collector and applies the site's calibration
(transform decision, channel permutation), giving a `WirePlan`, or None for the plain
collective. The `Transfer` it yields is the executor: `Transfer.send` compresses rows of
the message into a `Message` (one uint8 wire buffer, `pallas_kernels.wire`, written by
the compress kernel, and the static layout that reads it) and moves the buffer;
`Transfer.move` runs each collective step and counts the bytes it sends, so the wire
ledger holds what the program moves (`taco_jax.accounting`). A collective only decides
how the buffer moves: gathered, exchanged block by block, permuted. The message then
decodes what arrived (`decode`: each received buffer alone; `sum`: the received buffers
summed in float32 in the transformed domain, one inverse transform; `requantize`: their
sum as one new message), and the plan turns rows back into the array (`WirePlan.array`).

The plan lays a message out as rows of G elements of its last axis (`WirePlan.rows`,
zero-padded to a multiple of G: any shape the lax collective accepts works, and the
groups are the codec's). `Gathered` is what a gather keeps for its backward pass: the
8-bit buffers, decoded again when needed.

compress kernel -> wire buffer -> collective -> decode kernel: nothing is copied between
the stages, and every backend moves one byte per element.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from taco_jax import accounting, policy
from taco_jax import calibration as calibration_lib
from taco_jax.accounting import Collective, Op, record_collective
from taco_jax.calibration import Calibration
from taco_jax.codec import Codec, codec_choice, decode, encode, message_layout, requantize
from taco_jax.policy import ALGORITHMS
from taco_jax.spec import QuantSpec, TacoConfig

# Chunks of a pipelined message start at multiples of this many groups, so the kernels
# split every chunk (the last one aside) into whole row blocks without padding.
CHUNK_ALIGN = 64


# ----------------------------------------------------------------------------- one call, one plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
    """One collective call's fixed arguments (hashable: a static argument of the
    collectives' gradient rules).

    Attributes:
      axis_name: the mesh axis the collective runs over.
      config: the `TacoConfig` (forward messages use `config.forward`, backward ones
        `config.backward`).
      site: call-site name for wire-byte accounting and calibration; None names the
        site after the op ("all_gather", ...).
      calibration: per-site channel permutations and transform decisions; None = the
        identity and the config's transform.
      repeats: times the call runs per call of the traced function: the trip counts of
        the loops around it where it is made (`accounting.repeated`), which its
        backward messages keep when JAX traces them later, outside those loops.

    Raises:
      ValueError: `config` is not a `TacoConfig`, or `calibration` not a `Calibration`.
    """

    axis_name: str
    config: TacoConfig
    site: str | None = None
    calibration: Calibration | None = None
    repeats: int = dataclasses.field(default_factory=accounting.current_repeats)

    def __post_init__(self) -> None:
        check_config(self.config, self.calibration)

    def site_of(self, op: Op | str) -> str:
        """The name `op`'s messages are calibrated under (the ledger's: `Collective.name`)."""
        return self.site or Op(op).value

    def spec(self, direction: str) -> QuantSpec:
        """The quantizer of `direction`'s messages ("forward" or "backward")."""
        return self.config.spec(direction)

    @contextlib.contextmanager
    def transfer(
        self,
        x: jax.Array | jax.ShapeDtypeStruct,
        op: Op,
        direction: str,
        *,
        algorithm: str = "auto",
        moves_channels: bool = False,
        report: bool = True,
        pipelined: bool = True,
    ) -> Iterator[Transfer]:
        """The call's collective `op` of the per-rank message `x`, planned
        (`plan_message`, which takes the keywords) and run inside the block: the block
        moves the message through `Transfer.move` and `Transfer.send`, and on leaving
        it the collective is entered in the wire ledger with the bytes those moves sent
        (not when the block raises).

        `op` is the op entered in the ledger; an all-reduce is planned as `Op.ALL_REDUCE`
        (`Op.routed`), and a planned one is entered under its algorithm's name.

        Yields:
          The `Transfer`.
        """
        plan = plan_message(
            x,
            self,
            op=op.routed,
            direction=direction,
            algorithm=algorithm,
            moves_channels=moves_channels,
            report=report,
            pipelined=pipelined,
        )
        collective = Collective.traced(x, op, self.axis_name, direction=direction, site=self.site)
        transfer = Transfer(
            collective if plan is None else collective.under(plan.algorithm),
            plan,
            plan.spec.text if plan is not None else plain_reason(x, self.config),
        )
        yield transfer
        record_collective(
            transfer.collective,
            reason=transfer.reason,
            compressed=plan is not None,
            sent_bytes=transfer.sent_bytes,
            repeats=self.repeats,
        )


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


def check_config(config: TacoConfig, calibration: Calibration | None = None) -> None:
    """Raise ValueError unless `config` is a `TacoConfig` and `calibration` None or a
    `Calibration`."""
    if not isinstance(config, TacoConfig):
        raise ValueError(f"config must be a TacoConfig, got {type(config).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a taco_jax.calibration.Calibration, got {type(calibration).__name__}")


def check_algorithm(algorithm: str) -> None:
    """Raise ValueError unless `algorithm` is one of `ALGORITHMS`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {list(ALGORITHMS)}")


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
    permutation: calibration_lib.ChannelPlan | None = None
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


def planned_spec(
    config: TacoConfig, direction: str, calibration: Calibration | None, site: str, channels: int
) -> tuple[QuantSpec, calibration_lib.ChannelPlan | None]:
    """The quantizer of `direction`'s messages at `site` and the site's permutation plan
    (None when it has none or it is the identity).

    The mode and the config decide what a message may be sent as; a calibration only
    refines within that: in mode "taco" it sets the site's permutation and transform,
    and its format only where `config.fewer_bits` lists it. Other modes take no
    calibration ("fp8" is the no-transform, no-reshaping baseline).

    Raises:
      ValueError: the plan permutes another number of channels than `channels`, or
        gives the site a format the config does not allow.
    """
    spec = config.spec(direction)
    plan = calibration.plan(site, direction) if calibration is not None and config.mode == "taco" else None
    if plan is None:
        return spec, None
    if len(plan.perm) != channels:
        raise ValueError(
            f"calibration of site {site!r} permutes {len(plan.perm)} channels, but the message has {channels}"
        )
    conflict = calibration_lib.format_conflict(plan, config)
    if conflict is not None:
        raise ValueError(f"calibration of site {site!r} ({direction}) gives {conflict}")
    return plan.spec(spec), None if plan.is_identity else plan


def size_or_kind_rules_out(x: jax.Array | jax.ShapeDtypeStruct, config: TacoConfig) -> str | None:
    """What keeps `x` off the codec under `config` whatever the link, or None: the mode,
    a dtype that is not floating-point, a scalar or an empty array (no channels to group,
    nothing to send) or a size under `min_bytes`."""
    nbytes = x.size * x.dtype.itemsize
    if not config.enabled:
        return "mode off"
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return f"{jnp.dtype(x.dtype).name} is not floating-point"
    if x.ndim == 0 or x.size == 0:
        return "scalar or empty: no channels to group"
    if not config.compresses(nbytes):
        return f"under min_bytes ({nbytes:,} < {config.min_bytes:,} B)"
    return None


def plain_reason(x: jax.Array | jax.ShapeDtypeStruct, config: TacoConfig) -> str:
    """Why `config` sends `x` uncompressed (`plan_message` gave no plan): what rules it
    out (`size_or_kind_rules_out`), else the link profile, which measured the plain
    collective faster."""
    return size_or_kind_rules_out(x, config) or "the link profile measured plain faster"


def compressible(x: jax.Array | jax.ShapeDtypeStruct, config: TacoConfig) -> bool:
    """Whether `config` compresses `x` where the link does not decide: a non-empty float
    array with at least one axis, of at least `min_bytes`."""
    return size_or_kind_rules_out(x, config) is None


def plan_message(
    x: jax.Array | jax.ShapeDtypeStruct,
    call: Call,
    *,
    op: Op | str,
    direction: str,
    algorithm: str = "auto",
    moves_channels: bool = False,
    report: bool = True,
    pipelined: bool = True,
) -> WirePlan | None:
    """How `x` travels in `op` (`taco_jax.policy`): None for the plain collective, else
    its `WirePlan`. A compressed message is reported to an active calibration collector.

    Args:
      x: the message, channels on its last axis.
      call: the call it belongs to.
      op: the `Op` the policy routes: all-gather, reduce-scatter, all-reduce or ppermute.
      direction: "forward" or "backward".
      algorithm: the caller's all-reduce algorithm ("auto": the policy's choice).
      moves_channels: the op gathers or scatters along the channel axis.
      report: report `x` to an active calibration collector (False: the caller reports
        the pieces it compresses, or none are calibrated; `x` may then be a
        ShapeDtypeStruct).
      pipelined: the message may go in chunks (False: one message, as point-to-point
        sends and the gradient bucket go).

    Raises:
      ValueError: a channel permutation on a site whose op moves the channel axis, or
        one of the wrong length.
    """
    route = policy.route_for(
        op,
        lax.axis_size(call.axis_name),
        x.size * x.dtype.itemsize,
        link=call.config.link,
        chunks=call.config.chunks,
        algorithm=algorithm,
        compresses=compressible(x, call.config),
    )
    if not route.compressed:
        return None
    site = call.site_of(op)
    if report:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise ValueError("plan_message reports the message's values: pass the array, or report=False")
        calibration_lib.observe(x, site, direction)
    spec, permutation = planned_spec(call.config, direction, call.calibration, site, x.shape[-1])
    spec.check_channels(x.shape[-1], site)
    if permutation is not None and moves_channels:
        raise ValueError(
            f"site {site!r} has a channel permutation, so it cannot gather or scatter along "
            f"the last (channel) axis of shape {x.shape}"
        )
    codec = codec_choice(spec, x.dtype, call.config.kernel_mode, shards=lax.axis_size(call.axis_name))
    return WirePlan(spec, route.chunks if pipelined else 1, route.algorithm, permutation, codec)


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


# ----------------------------------------------------------------------------- layout


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


def check_axis(axis: int, ndim: int, what: str) -> int:
    """`axis` normalized for an array of rank `ndim`; ValueError naming `what` if out of
    range (always for a scalar, which has no axis)."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis} is out of range for an array of rank {ndim}")
    return axis % ndim


# ----------------------------------------------------------------------------- ledger


def record_plain_all_reduce(
    x: jax.Array, axis_name: str, *, site: str, direction: str = "forward", reason: str = "a plain lax reduction"
) -> None:
    """Record an uncompressed all-reduce (psum, pmean, pmax) of `x` over `axis_name` done
    with `jax.lax` directly, with the `reason` it goes uncompressed."""
    collective = Collective.traced(x, Op.ALL_REDUCE, axis_name, direction=direction, site=site)
    record_collective(collective, reason=reason)
