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
      op: "all_gather", "reduce_scatter", "all_reduce_one_shot", "all_reduce_two_shot",
        "all_reduce" (uncompressed psum) or "ppermute".
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


@dataclasses.dataclass
class WireLedger:
    """Collects `WireRecord`s of the collectives traced inside `record_wire()`."""

    records: list[WireRecord] = dataclasses.field(default_factory=list)

    def total(self, direction: str | None = None) -> int:
        """Bytes sent per rank over all records (optionally one direction)."""
        return sum(r.sent_bytes for r in self.records if direction in (None, r.direction))

    def uncompressed_total(self, direction: str | None = None) -> int:
        """What `total` would be with every collective uncompressed."""
        return sum(r.uncompressed_sent_bytes for r in self.records if direction in (None, r.direction))

    def by_site(self) -> dict[str, int]:
        """Bytes sent per rank, summed per call site."""
        sums: dict[str, int] = defaultdict(int)
        for r in self.records:
            sums[r.site] += r.sent_bytes
        return dict(sums)


# The ledgers of the enclosing `record_wire` blocks; whether `paused` is in effect.
_LEDGERS: TraceScope[tuple[WireLedger, ...]] = TraceScope("wire ledgers", ())
_PAUSED = TraceScope("wire recording paused", False)


@contextlib.contextmanager
def record_wire() -> Iterator[WireLedger]:
    """Record the wire bytes of every collective traced inside the block.

    Tracing happens once per compilation, so trace (e.g. `jax.jit(f).lower(...)` or the
    first call) inside the block. Backward-pass collectives are recorded when the
    gradient is traced.

    Yields:
      The `WireLedger` being filled.
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


def record(entry: WireRecord) -> None:
    """Add a record to every active ledger (none while `paused`)."""
    if _PAUSED.get():
        return
    for ledger in _LEDGERS.get():
        ledger.records.append(entry)
