"""Entry point of `python -m taco_jax.train`; the trainer itself lives in the `train`
package (imported here only when run, so the library never depends on it)."""

import sys


def main() -> int:
    """Run the trainer's command line."""
    from train.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
