"""Atomic, keep-last-N checkpoints with orbax: training state plus JSON metadata.

A checkpoint is only claimed once it is on disk and readable: every save is checked
(orbax declines a step that already exists and says so only by returning False) and
read back (its metadata and the shapes and dtypes of its arrays). A step that cannot be
restored is set aside before a resume trains over it, so the step is written anew.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from taco_jax import strict_json

from .errors import CheckpointError

# Where unrestorable steps are moved, beside the checkpoints folder.
SET_ASIDE_FOLDER = "unrestorable_checkpoints"


class Checkpointer:
    """Saves and restores {params, opt_state} and a metadata dict per step.

    orbax writes each step to a temporary folder and renames it when complete, so a crash
    mid-save leaves the previous checkpoints intact; temporary folders a crash left are
    removed when the next run opens the folder.
    """

    def __init__(self, directory: str | Path, keep: int, *, writer: bool = True):
        """Open (with `writer`, create) the checkpoints folder `directory`, keeping the
        newest `keep` steps. Only the writer removes what a crash left: a reader beside
        a running trainer must not delete its save in progress."""
        self.directory = Path(directory).resolve()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=writer, cleanup_tmp_directories=writer, read_only=not writer
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The saved steps, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Write `state` and `meta` as checkpoint `step`, then read it back.

        Raises:
          CheckpointError: orbax did not write the step, or it cannot be read back.
        """
        saved = self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(strict_json.finite(meta))
            ),
        )
        self.manager.wait_until_finished()
        if not saved:
            raise CheckpointError(
                f"checkpoint at step {step} was not written to {self.directory} (orbax declined the save; "
                f"it holds steps {sorted(self.steps())})"
            )
        self.verify(step, state)

    def verify(self, step: int, state: dict) -> None:
        """Check that checkpoint `step` reads back: its metadata names the step, and it
        holds arrays of the shapes and dtypes of `state`.

        Raises:
          CheckpointError: it does not.
        """
        try:
            meta = self.meta(step)
            stored = self.manager.item_metadata(step)["state"]
        except Exception as error:  # orbax raises many types; all mean "not readable"
            raise CheckpointError(
                f"checkpoint at step {step} in {self.directory} cannot be read back: {_first_line(error)}"
            ) from error
        if meta["step"] != step or _array_signature(stored) != _array_signature(state):
            raise CheckpointError(
                f"checkpoint at step {step} in {self.directory} does not hold what was saved (metadata step "
                f"{meta['step']}; arrays {_array_signature(stored)} != {_array_signature(state)})"
            )

    def set_aside(self, step: int) -> Path:
        """Move checkpoint `step` out of the checkpoints folder (into
        `SET_ASIDE_FOLDER` beside it), so that the step can be saved again.

        Returns:
          Where it now is.
        """
        folder = self.directory.parent / SET_ASIDE_FOLDER
        folder.mkdir(exist_ok=True)
        target = folder / f"step_{step}_{time.strftime('%Y%m%d-%H%M%S')}"
        (self.directory / str(step)).rename(target)
        self.manager.reload()
        return target

    def restore(self, step: int, target: dict) -> tuple[dict, dict]:
        """Restore `step` onto the shapes and shardings of `target`.

        Raises:
          ValueError: the checkpoint is missing, corrupt or does not match the model
            (the message names the step and the folder).
        """
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
            )
        except Exception as error:  # orbax raises many types; all mean "cannot resume"
            raise ValueError(
                f"checkpoint at step {step} in {self.directory} cannot be restored: {_first_line(error)}"
            ) from error
        return restored["state"], restored["meta"]

    def meta(self, step: int) -> dict:
        """The metadata saved with `step`.

        Raises:
          ValueError: it is missing or unreadable (the message names the step and folder).
        """
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as error:  # orbax raises many types; all mean "no usable metadata"
            raise ValueError(
                f"checkpoint at step {step} in {self.directory} has no readable metadata: {_first_line(error)}"
            ) from error
        if not isinstance(meta, dict) or "step" not in meta:
            raise ValueError(f"checkpoint at step {step} in {self.directory} has malformed metadata: {meta!r:.200}")
        return meta

    def close(self) -> None:
        self.manager.close()


def _array_signature(tree) -> collections.Counter:
    """How many arrays of each (shape, dtype) a state (or orbax's metadata of one) holds:
    the structure check of `Checkpointer.verify`, independent of how orbax stores the
    containers (tuples come back as lists)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda leaf: hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
    return collections.Counter((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


def _first_line(error: Exception) -> str:
    """An exception as one short line: TensorStore errors carry pages of detail."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"
