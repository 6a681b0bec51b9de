"""Stopping on SIGTERM/SIGINT at a step every process agrees on."""

from __future__ import annotations

import dataclasses
import signal

import jax
import numpy as np


@dataclasses.dataclass
class StopFlag:
    """The signal that asks the run to stop, as every process agrees on it: a signal one
    host receives (a preemption) stops all of them at the same step, so none is left
    waiting in a collective or saves a checkpoint the others do not."""

    def __init__(self):
        self.received: str | None = None
        self.signal_name: str | None = None

    def __call__(self, signum, frame):
        self.received = signal.Signals(signum).name

    def agree(self) -> str | None:
        """Update `signal_name` from every process's flag (a host collective when there
        are several) and return it."""
        if jax.process_count() == 1:
            self.signal_name = self.received
        elif self.signal_name is None:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.int32(self.received is not None))
            if np.any(flags):
                self.signal_name = self.received or "a signal to another process"
        return self.signal_name
