"""What collectives put on the wire, the ledger of it, and what else tracing records.

A `Collective` describes one traced call: the `Op`, the mesh axis and its size, the
per-rank message (shape and dtype) and the direction. It counts the bytes each rank sends
in the plain collective (`plain_bytes`, in the message's dtype; `bf16_bytes`), with one
formula per op:

| op | bytes each rank sends (n bytes per rank, k ranks) |
|---|---|
| all_gather | (k-1) n |
| reduce_scatter, all_to_all | (k-1) n / k |
| all_reduce, all_reduce_one_shot, all_reduce_two_shot | 2 (k-1) n / k (ring) |
| ppermute | n |

A compressed collective is a sequence of such steps on wire buffers, and counts what
they send: the executor (`taco_jax.message.Transfer`) enters every step's `plain_bytes`
as it moves a buffer, so the ledger holds the bytes of the collectives the program runs.
`record` is the one place a `WireRecord` enters the active ledgers (`record_wire`).

The ledger, the calibration observer (`observe`), the collectives' own bookkeeping and
the simulated mesh (`mesh.simulated_shard_map`) all work while a function is traced, not
while it runs: a `with` block makes a value visible to everything traced inside it. They
share one mechanism, `TraceScope`, a context variable set for the block (per thread, as
tracing is).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

T = TypeVar("T")


class TraceScope(Generic[T]):
    """A value set for the code traced inside `with scope.set(value):`, `default` elsewhere."""

    def __init__(self, name: str, default: T):
        self._var: contextvars.ContextVar[T] = contextvars.ContextVar(name, default=default)

    def get(self) -> T:
        """The value of the innermost enclosing `set` block (or the default)."""
        return self._var.get()

    @contextlib.contextmanager
    def set(self, value: T) -> Iterator[T]:
        """Make `value` the scope's value inside the block (restored after it).

        Yields:
          `value`.
        """
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)


class Op(enum.StrEnum):
    """A collective's name, as the route policy, the link probe and the wire ledger
    (`WireRecord.op`) spell it. A `str`: each member equals its value.

    A compressed all-reduce is entered in the ledger under its algorithm
    (`ALL_REDUCE_ONE_SHOT`, `ALL_REDUCE_TWO_SHOT`); `ALL_REDUCE` is the plain one, and
    the op the policy routes. `ALL_TO_ALL` is a step of the compressed reductions (each
    rank's blocks exchanged), never a call of its own.
    """

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_REDUCE_ONE_SHOT = "all_reduce_one_shot"
    ALL_REDUCE_TWO_SHOT = "all_reduce_two_shot"
    PPERMUTE = "ppermute"
    ALL_TO_ALL = "all_to_all"

    @property
    def routed(self) -> Op:
        """The op the route policy decides for: an all-reduce under any algorithm is
        `ALL_REDUCE`; any other op itself."""
        return Op.ALL_REDUCE if self in _ALL_REDUCE_BY_ALGORITHM.values() else self


# The all-reduce under each algorithm's name (`WirePlan.algorithm`).
_ALL_REDUCE_BY_ALGORITHM = {"one_shot": Op.ALL_REDUCE_ONE_SHOT, "two_shot": Op.ALL_REDUCE_TWO_SHOT}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective as traced, and the bytes each rank sends in it plain.

    Attributes:
      op: the `Op` (a plain string is read as one).
      axis_name: the mesh axis it runs over.
      ranks: the axis size.
      shape: the per-rank message's shape.
      dtype: the message's dtype.
      direction: "forward" or "backward".
      site: the call-site name; None names it after the op (`name`).

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
    def nbytes(self) -> int:
        """Bytes of the per-rank message."""
        return math.prod(self.shape) * self.dtype.itemsize

    def under(self, algorithm: str) -> Collective:
        """The collective as an all-reduce `algorithm` ("one_shot", "two_shot") sends it:
        a plain all-reduce under that algorithm's name; any other op as it is."""
        if self.op != Op.ALL_REDUCE:
            return self
        return dataclasses.replace(self, op=_ALL_REDUCE_BY_ALGORITHM[algorithm])

    @property
    def name(self) -> str:
        """The name the ledger enters it under: the site, else the op."""
        return self.site or self.op.value

    @property
    def plain_bytes(self) -> int:
        """Bytes each rank sends in the plain collective, in the message's dtype (ring or
        direct algorithms, as `hlo.HloCollective.sent_bytes` counts a compiled one)."""
        k, n = self.ranks, self.nbytes
        if self.op == Op.ALL_GATHER:
            return (k - 1) * n
        if self.op in (Op.REDUCE_SCATTER, Op.ALL_TO_ALL):
            return (k - 1) * n // k
        if self.op == Op.PPERMUTE:
            return n
        return 2 * (k - 1) * n // k  # every all-reduce, as the ring all-reduce

    @property
    def bf16_bytes(self) -> int:
        """`plain_bytes` with 2-byte (bfloat16) elements."""
        return self.plain_bytes * 2 // self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class WireRecord:
    """One collective call as traced.

    Attributes:
      site: call-site name given by the caller (e.g. "layer3.mlp.out"), or the op name.
      op: the `Op` value: "all_gather", "reduce_scatter",
        "all_reduce_one_shot", "all_reduce_two_shot", "all_reduce" (uncompressed psum)
        or "ppermute".
      direction: "forward" or "backward".
      shape: per-rank input shape.
      dtype: input dtype name.
      ranks: size of the mesh axis.
      compressed: whether the message went compressed.
      sent_bytes: bytes each rank sends over its links (direct/ring algorithms: an
        all-gather sends its shard to k-1 peers; an all-to-all keeps 1/k at home).
      uncompressed_sent_bytes: the same for the plain collective in the input dtype.
      axis: the mesh axis the collective runs over ("tensor", "pipe", "data", ...).
      bf16_sent_bytes: the same for the plain collective with 2-byte (bfloat16) elements.
      repeats: times the traced call runs per call of the traced function: the trip
        counts of the loops around it (`repeated`), as a loop body is traced once. The
        byte counts above are per run; the ledger's sums multiply them by `repeats`.
      reason: why it went as it did: the quantizer's spec text where compressed, else
        what kept it plain ("mode off", "under min_bytes (...)", "the link profile
        measured plain faster", ...).
    """

    site: str
    op: str
    direction: str
    shape: tuple[int, ...]
    dtype: str
    ranks: int
    compressed: bool
    sent_bytes: int
    uncompressed_sent_bytes: int
    axis: str
    bf16_sent_bytes: int
    repeats: int = 1
    reason: str = ""


@dataclasses.dataclass
class WireLedger:
    """Collects `WireRecord`s of the collectives traced inside `record_wire()`."""

    records: list[WireRecord] = dataclasses.field(default_factory=list)

    def total(self, direction: str | None = None) -> int:
        """Bytes sent per rank over all records (optionally one direction)."""
        return sum(r.repeats * r.sent_bytes for r in self.records if direction in (None, r.direction))

    def uncompressed_total(self, direction: str | None = None) -> int:
        """What `total` would be with every collective uncompressed."""
        return sum(r.repeats * r.uncompressed_sent_bytes for r in self.records if direction in (None, r.direction))

    def by_site(self) -> dict[str, int]:
        """Bytes sent per rank, summed per call site."""
        sums: dict[str, int] = defaultdict(int)
        for r in self.records:
            sums[r.site] += r.repeats * r.sent_bytes
        return dict(sums)

    def by_axis(self, axes: tuple[str, ...], *, bf16: bool = False) -> dict[str, int]:
        """Bytes sent per rank on each of `axes` (as plain bfloat16 with `bf16`)."""
        return {
            axis: sum(r.repeats * (r.bf16_sent_bytes if bf16 else r.sent_bytes) for r in self.records if r.axis == axis)
            for axis in axes
        }

    def report(self) -> str:
        """A table of the recorded collectives, one line each: the site, op and direction,
        the per-rank message, the bytes each rank sends (loops counted), their share of the
        uncompressed collective's and why the message went compressed or plain.

        Returns:
          The table as text (a header and no rows when nothing was recorded).
        """
        rows = [("site", "op", "direction", "message per rank", "sent", "of plain", "why")]
        for r in self.records:
            share = f"{100 * r.sent_bytes / r.uncompressed_sent_bytes:.1f}%" if r.uncompressed_sent_bytes else "-"
            message = f"{r.dtype}{list(r.shape)}"
            rows.append((r.site, r.op, r.direction, message, f"{r.repeats * r.sent_bytes:,} B", share, r.reason))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)

    def uncompressed_by_axis(self, axes: tuple[str, ...]) -> dict[str, int]:
        """What `by_axis` would be with every collective uncompressed (in its own dtype)."""
        return {
            axis: sum(r.repeats * r.uncompressed_sent_bytes for r in self.records if r.axis == axis) for axis in axes
        }


# The ledgers of the enclosing `record_wire` blocks; whether `paused` is in effect.
_LEDGERS: TraceScope[tuple[WireLedger, ...]] = TraceScope("wire ledgers", ())
_PAUSED = TraceScope("wire recording paused", False)
_REPEATS = TraceScope("wire record repeats", 1)


# Who sees each message about to be compressed: (x, site, direction).
Observer = Callable[[jax.Array, str, str], None]
_OBSERVER: TraceScope[Observer | None] = TraceScope("message observer", None)


@contextlib.contextmanager
def observed_by(observer: Observer) -> Iterator[None]:
    """Show `observer` every message about to be compressed in code traced inside the
    block (`calibration.observing` collects per-channel statistics so)."""
    with _OBSERVER.set(observer):
        yield


def observe(x: jax.Array, site: str, direction: str) -> None:
    """Show `x` (..., C), about to be compressed at `site`, to the observer of the
    innermost enclosing `observed_by` block (nothing outside one)."""
    observer = _OBSERVER.get()
    if observer is not None:
        observer(x, site, direction)


@contextlib.contextmanager
def record_wire() -> Iterator[WireLedger]:
    """Record the wire bytes of every collective traced inside the block.

    Tracing happens once per compilation, so trace (e.g. `jax.jit(f).lower(...)` or the
    first call) inside the block. Backward-pass collectives are recorded when the
    gradient is traced.

    Yields:
      The `WireLedger` being filled.

    Examples:
      >>> import jax, taco_jax as tj
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh, config = tj.make_mesh(data=2, tensor=4), tj.TacoConfig.preset("taco+", min_bytes=0)
      >>> f = jax.shard_map(
      ...     lambda x: tj.all_reduce(x, "tensor", config, site="out"), mesh=mesh, in_specs=P("tensor"), out_specs=P())
      >>> with tj.record_wire() as ledger:
      ...     _ = jax.jit(f).lower(jax.ShapeDtypeStruct((4, 64, 256), "float32"))
      >>> ledger.by_site(), ledger.uncompressed_total()
      ({'out': 25344}, 98304)
    """
    ledger = WireLedger()
    with _LEDGERS.set((*_LEDGERS.get(), ledger)):
        yield ledger


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Record nothing traced inside the block: for work traced again that the compiler
    performs once (an identical recomputation, merged by common-subexpression
    elimination), so that the ledger counts what the compiled program sends."""
    with _PAUSED.set(True):
        yield


@contextlib.contextmanager
def repeated(times: int) -> Iterator[None]:
    """Count every collective traced inside the block `times` times more: the body of a
    loop (`lax.scan`) is traced once and runs once per trip. Nested blocks multiply."""
    with _REPEATS.set(_REPEATS.get() * times):
        yield


def current_repeats() -> int:
    """The trip counts of the enclosing `repeated` blocks, multiplied (1 outside them)."""
    return _REPEATS.get()


def record(entry: WireRecord, *, repeats: int | None = None) -> None:
    """Add a record to every active ledger (none while `paused`), counted `repeats` times
    (None: the enclosing `repeated` blocks' trip counts). A backward message is traced
    when JAX transposes the loop around its forward call, outside that loop's `repeated`
    block: it carries the forward call's count (`collectives.Call.repeats`)."""
    ledgers = _LEDGERS.get()
    if not ledgers or _PAUSED.get():
        return
    entry = dataclasses.replace(entry, repeats=entry.repeats * (_REPEATS.get() if repeats is None else repeats))
    for ledger in ledgers:
        ledger.records.append(entry)


def record_collective(
    collective: Collective,
    *,
    reason: str,
    compressed: bool = False,
    sent_bytes: int | None = None,
    repeats: int | None = None,
) -> None:
    """Enter `collective` in the active wire ledgers (`record`): sent compressed or plain,
    for `reason`, its steps having sent `sent_bytes` (None: the plain collective's),
    counted `repeats` times (None: as the enclosing loops run).

    Raises:
      ValueError: an empty reason.
    """
    if not reason:
        raise ValueError(f"{collective.name}: a collective is recorded with the reason it went as it did")
    record(
        WireRecord(
            site=collective.name,
            op=collective.op.value,
            direction=collective.direction,
            shape=collective.shape,
            dtype=collective.dtype.name,
            ranks=collective.ranks,
            compressed=compressed,
            sent_bytes=collective.plain_bytes if sent_bytes is None else sent_bytes,
            uncompressed_sent_bytes=collective.plain_bytes,
            axis=str(collective.axis_name),
            bf16_sent_bytes=collective.bf16_bytes,
            reason=reason,
        ),
        repeats=repeats,
    )
