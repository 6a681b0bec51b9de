"""Entry point of `python -m taco_jax.train`.

The 3-D parallel trainer is not part of this release yet; this entry point says so and
exits with status 2 instead of pretending to train.
"""

import sys


def main() -> int:
    """Report that the trainer is unavailable."""
    print(
        "taco_jax.train: the 3-D parallel trainer is not available in this version.\n"
        "What works today: the codec (taco_jax.compress / decompress) and its benchmarks\n"
        "(make bench-codec). See README.md.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
