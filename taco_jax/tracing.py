"""Trace-time recording: values that code traced inside a `with` block sees.

The wire ledger (`accounting.record_wire`), the calibration collector
(`calibration.observing`), the collectives' own bookkeeping and the simulated mesh
(`mesh.simulated_shard_map`) all work while a function is traced, not while it runs: a
`with` block makes a value visible to everything traced inside it. They share this one mechanism, a context variable set for the block
(per thread, as tracing is).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Generic, TypeVar

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
