"""What a collective is and what it puts on the wire: the `Op` names and the `Collective`
descriptor, the one place that counts a collective's bytes and enters it in the wire
ledger (`record_collective`).

A `Collective` is one traced call: the op, the mesh axis and its size, the per-rank
message (shape and dtype) and the direction. It counts the bytes each rank sends as the
plain collective (in its own dtype and as bf16) and, given the message's `WirePlan`, as
the compressed one, with one formula per op:

| op | plain (n bytes per rank, k ranks) | compressed (the plan's chunk messages) |
|---|---|---|
| all_gather | (k-1) n | the message to k-1 peers |
| reduce_scatter | (k-1) n / k | k-1 blocks (all-to-all) |
| all_reduce | 2 (k-1) n / k (ring) | as its algorithm, one- or two-shot |
| all_reduce_one_shot | 2 (k-1) n / k | the message to k-1 peers |
| all_reduce_two_shot | 2 (k-1) n / k | 2 (k-1) blocks (all-to-all, then all-gather) |
| ppermute | n | the message once |

A block is one rank's share of the message (`Collective.block_groups`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax import accounting

if TYPE_CHECKING:
    from taco_jax.message import WirePlan


class Op(enum.StrEnum):
    """A collective's name, as the route policy, the link probe and the wire ledger
    (`WireRecord.op`) spell it. A `str`: each member equals its value.

    A compressed all-reduce is entered in the ledger under its algorithm
    (`ALL_REDUCE_ONE_SHOT`, `ALL_REDUCE_TWO_SHOT`); `ALL_REDUCE` is the plain one, and
    the op the policy routes.
    """

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_REDUCE_ONE_SHOT = "all_reduce_one_shot"
    ALL_REDUCE_TWO_SHOT = "all_reduce_two_shot"
    PPERMUTE = "ppermute"


# The all-reduce under each algorithm's name (`WirePlan.algorithm`).
_ALL_REDUCE_BY_ALGORITHM = {"one_shot": Op.ALL_REDUCE_ONE_SHOT, "two_shot": Op.ALL_REDUCE_TWO_SHOT}


def group_count(shape: tuple[int, ...], group_size: int) -> int:
    """Rows of G that `message.to_rows` makes of an array of `shape`: its last axis
    padded to whole groups."""
    last = shape[-1] if shape else 1
    return math.prod(shape[:-1]) * -(-last // group_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective as traced, and the bytes each rank sends in it.

    Attributes:
      op: the `Op` (a plain string is read as one).
      axis_name: the mesh axis it runs over.
      ranks: the axis size.
      shape: the per-rank message's shape.
      dtype: the message's dtype.
      direction: "forward" or "backward".
      site: the call-site name; None names it after the op (`name`).
      scatter_dimension: a reduce-scatter's dimension, which the wire layout moves to
        the front and cuts into one block per rank.
      tiled: a reduce-scatter keeps that dimension (size / ranks); else removes it.
      bucket: the sizes of the arrays the message packs, each flattened and padded to
        whole groups (the data-parallel gradient bucket); None: the message is laid out
        in rows of its last axis.

    Raises:
      ValueError: `op` names no `Op`.
    """

    op: Op
    axis_name: str
    ranks: int
    shape: tuple[int, ...]
    dtype: np.dtype
    direction: str
    site: str | None = None
    scatter_dimension: int = 0
    tiled: bool = True
    bucket: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", Op(self.op))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @classmethod
    def traced(cls, x: jax.Array | jax.ShapeDtypeStruct, op: Op | str, axis_name: str, **fields: Any) -> Collective:
        """The collective `op` of `x` over `axis_name`, inside the shard_map (or named
        vmap) that gives the axis its size; `fields` are the other attributes."""
        return cls(
            op=Op(op), axis_name=axis_name, ranks=lax.axis_size(axis_name), shape=x.shape, dtype=x.dtype, **fields
        )

    @property
    def abstract(self) -> jax.ShapeDtypeStruct:
        """The per-rank message's shape and dtype."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the per-rank message."""
        return math.prod(self.shape) * self.dtype.itemsize

    def routed(self, plan: WirePlan | None) -> Collective:
        """The collective as `plan` sends it: a compressed all-reduce under its algorithm's
        name; any other as it is."""
        if plan is None or self.op != Op.ALL_REDUCE:
            return self
        return dataclasses.replace(self, op=_ALL_REDUCE_BY_ALGORITHM[plan.algorithm])

    def name(self, plan: WirePlan | None = None) -> str:
        """The name the ledger enters it under: the site, else the op `plan` sends."""
        return self.site or self.routed(plan).op.value

    @property
    def plain_bytes(self) -> int:
        """Bytes each rank sends in the plain collective, in the message's dtype (ring or
        direct algorithms, as `hlo.HloCollective.sent_bytes` counts a compiled one)."""
        k, n = self.ranks, self.nbytes
        if self.op == Op.ALL_GATHER:
            return (k - 1) * n
        if self.op == Op.REDUCE_SCATTER:
            return (k - 1) * n // k
        if self.op == Op.PPERMUTE:
            return n
        return 2 * (k - 1) * n // k  # every all-reduce, as the ring all-reduce

    @property
    def bf16_bytes(self) -> int:
        """`plain_bytes` with 2-byte (bfloat16) elements."""
        return self.plain_bytes * 2 // self.dtype.itemsize

    def groups(self, group_size: int) -> int:
        """Groups of G the whole message is laid out in."""
        if self.bucket is not None:
            return sum(-(-size // group_size) for size in self.bucket)
        return group_count(self.shape, group_size)

    def block_groups(self, group_size: int) -> int:
        """Groups of G of one rank's block: a reduce-scatter's block along
        `scatter_dimension` (moved to the front), a two-shot all-reduce's share of the
        message's groups."""
        if self.op == Op.REDUCE_SCATTER:
            dim = self.scatter_dimension
            rest = (*self.shape[:dim], *self.shape[dim + 1 :])
            block = (self.shape[dim] // self.ranks, *rest) if self.tiled else rest
            return group_count(block, group_size)
        return -(-self.groups(group_size) // self.ranks)

    def sent_bytes(self, plan: WirePlan | None) -> int:
        """Bytes each rank sends: the plain collective's without a plan, else the
        messages of `plan`'s chunks that the op sends (the module's table).

        An all-reduce counts as the algorithm `plan` names (`routed`).
        """
        if plan is None:
            return self.plain_bytes
        op, k, group_size = self.routed(plan).op, self.ranks, plan.spec.group_size
        if op == Op.PPERMUTE:
            return plan.message_bytes(self.groups(group_size))
        if op == Op.REDUCE_SCATTER:
            return (k - 1) * plan.message_bytes(self.block_groups(group_size))
        if op == Op.ALL_REDUCE_TWO_SHOT:
            return 2 * (k - 1) * plan.message_bytes(self.block_groups(group_size))
        return (k - 1) * plan.message_bytes(self.groups(group_size))  # all-gather, one-shot all-reduce


def record_collective(
    collective: Collective, plan: WirePlan | None, *, reason: str | None = None, repeats: int | None = None
) -> None:
    """Enter `collective` in the active wire ledgers (`accounting.record`) as `plan`
    sends it (None: uncompressed, for `reason`), counted `repeats` times (None: as the
    enclosing loops run).

    Raises:
      ValueError: an uncompressed collective without its reason.
    """
    if plan is not None:
        reason = plan.spec.text
    elif reason is None:
        raise ValueError(f"{collective.name()}: an uncompressed collective is recorded with the reason it went so")
    routed = collective.routed(plan)
    accounting.record(
        accounting.WireRecord(
            site=collective.name(plan),
            op=routed.op.value,
            direction=collective.direction,
            shape=collective.shape,
            dtype=collective.dtype.name,
            ranks=collective.ranks,
            compressed=plan is not None,
            sent_bytes=collective.sent_bytes(plan),
            uncompressed_sent_bytes=collective.plain_bytes,
            axis=str(collective.axis_name),
            bf16_sent_bytes=collective.bf16_bytes,
            reason=reason,
        ),
        repeats=repeats,
    )
