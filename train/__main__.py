"""Entry point of `python -m taco_jax.train` (and the `taco-jax-train` command): the
trainer's command line, once its extra dependencies are installed."""

import sys

from taco_jax.extras import run_with_trainer_packages


def main() -> int:
    """Run the trainer's command line.

    Returns:
      The process exit status.
    """
    return run_with_trainer_packages("the trainer", "taco_jax.train.cli")


if __name__ == "__main__":
    sys.exit(main())
