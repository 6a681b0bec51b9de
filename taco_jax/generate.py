"""Entry point of `python -m taco_jax.generate` (and the `taco-jax-generate` command).

It checks the trainer's extra dependencies (a run's checkpoints are read with them)
before importing its command line, so a missing one is one line naming the extra."""

import sys

from taco_jax.extras import run_with_trainer_packages


def main() -> int:
    """Run the generation command line.

    Returns:
      The process exit status.
    """
    return run_with_trainer_packages("generation", "taco_jax.train.sample")


if __name__ == "__main__":
    sys.exit(main())
