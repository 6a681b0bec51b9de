"""Wire-byte accounting per call site, recorded from shapes while a function is traced."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Iterator

from taco_jax.tracing import TraceScope


@dataclasses.dataclass(frozen=True)
class WireRecord:
    """One collective call as traced.

    Attributes:
      site: call-site name given by the caller (e.g. "layer3.mlp.out"), or the op name.
      op: the `taco_jax.collective_op.Op` value: "all_gather", "reduce_scatter",
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
    block: it carries the forward call's count (`message.Call.repeats`)."""
    ledgers = _LEDGERS.get()
    if not ledgers or _PAUSED.get():
        return
    entry = dataclasses.replace(entry, repeats=entry.repeats * (_REPEATS.get() if repeats is None else repeats))
    for ledger in ledgers:
        ledger.records.append(entry)
