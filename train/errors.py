"""The trainer's failures that its command lines report as one `error:` line (no jax
import here: the command lines read this before jax starts)."""


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. too many consecutive non-finite steps)."""


class CheckpointError(RuntimeError):
    """A checkpoint was not written, or what was written cannot be read back."""


# Bad input (ValueError), a run that cannot continue, a checkpoint not written, and
# files that cannot be read or written.
EXPECTED_FAILURES = (ValueError, TrainingError, CheckpointError, OSError)
