"""The run directory: created and checked before anything is compiled, and locked so that
it has one writer."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = ".lock"


class RunLock:
    """An exclusive lock on a run directory, held while a trainer writes it.

    The lock is an `fcntl.flock` on `OUT/.lock`, which the operating system releases when
    the process ends, however it ends (a killed trainer leaves no stale lock). The file
    holds the holder's process id, for the error a second trainer gets.
    """

    def __init__(self, out: Path):
        self.path = out / LOCK_FILE
        try:
            self.file = self.path.open("a+")
        except OSError as error:
            raise ValueError(f"out: cannot write to the run directory {out} ({error.strerror})") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "unknown"
            self.file.close()
            raise ValueError(
                f"out: the run directory {out} is in use by another trainer (process {holder}); "
                "wait for it to finish or choose another --out"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(str(os.getpid()))
        self.file.flush()

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def prepare(out: str, *, lock: bool) -> tuple[Path, RunLock | None]:
    """Create the run directory `out` (and its parents) and, with `lock`, lock it.

    Args:
      out: the run directory.
      lock: take the writer's lock (the process that writes the directory).

    Returns:
      (the directory, its lock or None).

    Raises:
      ValueError: `out` is empty, is a file, cannot be created or written, or another
        trainer holds it (one line naming the key and the directory).
    """
    if not out.strip():
        raise ValueError("out: the run directory must be a non-empty path")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"out: {path} is a file, not a run directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"out: cannot create the run directory {path} ({error.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"out: cannot write to the run directory {path} (permission denied)")
    return path, RunLock(path) if lock else None
