"""Atomic, keep-last-N checkpoints with orbax: training state plus JSON metadata."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp


class Checkpointer:
    """Saves and restores {params, opt_state} and a metadata dict per step.

    orbax writes each step to a temporary folder and renames it when complete, so a crash
    mid-save leaves the previous checkpoints intact.
    """

    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The saved steps, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def save(self, step: int, state: dict, meta: dict) -> None:
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )
        self.manager.wait_until_finished()

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
                f"checkpoint at step {step} in {self.directory} cannot be restored: {type(error).__name__}: {error}"
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
                f"checkpoint at step {step} in {self.directory} has no readable metadata: "
                f"{type(error).__name__}: {error}"
            ) from error
        if not isinstance(meta, dict) or "step" not in meta:
            raise ValueError(f"checkpoint at step {step} in {self.directory} has malformed metadata: {meta!r:.200}")
        return meta

    def close(self) -> None:
        self.manager.close()
