"""What a run reports: the wire bytes one step sends per mesh axis, metrics.jsonl (one row
per step), the samples at each evaluation, the run's summary and the loss plot."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import taco_jax as tj
from taco_jax import models, strict_json
from taco_jax.mesh import TENSOR_AXIS

from . import data as data_lib
from .calibrate import calibration_summary, recorded_choices
from .compression import taco_config
from .pipeline import bubble_fraction
from .run_state import SAMPLE_PROMPT_TOKENS, RunState


@dataclasses.dataclass(frozen=True)
class WireBytes:
    """Bytes each rank sends per optimizer step on every mesh axis ({"tensor": ..,
    "pipe": .., "data": ..}).

    Attributes:
      sent: as sent (compressed where the run compresses).
      uncompressed: what the same collectives send uncompressed, in their own dtypes.
      bf16: the same traffic as plain bfloat16.
    """

    sent: dict[str, int]
    uncompressed: dict[str, int]
    bf16: dict[str, int]


def wire_bytes_per_step(train_step: jax.stages.Wrapped, state: tuple, tokens: jax.Array) -> WireBytes:
    """The `WireBytes` of one optimizer step of `train_step` as it is compiled: the
    collectives of one trace of its function, each counted as often as the loops around
    it run (the layers' scan, the accumulation steps). A layer recomputed under `remat`
    sends nothing again (`taco_jax.message.remat_policy`).

    The step is traced here, before its first call, and the call reuses this trace (jit
    caches it), so the counted trace is the one compiled and the step is traced once.
    A step traced before (a cache hit: nothing is recorded) is traced anew under a
    wrapper of its own, on the same function and shapes.

    Args:
      train_step: from `trainer.make_step_functions`.
      state: (params, opt_state, feedback) as train_step takes them.
      tokens: a global batch.
    """
    args = (*state, tokens, jnp.bool_(False))
    with tj.record_wire() as ledger:
        train_step.trace(*args)
    if not ledger.records:
        step = inspect.unwrap(train_step)
        with tj.record_wire() as ledger:
            jax.jit(lambda *args: step(*args)).trace(*args)
    return WireBytes(
        ledger.by_axis(tj.MESH_AXES), ledger.uncompressed_by_axis(tj.MESH_AXES), ledger.by_axis(tj.MESH_AXES, bf16=True)
    )


class MetricsLog:
    """metrics.jsonl in the run directory (process 0 only), one row per step: on resume,
    lines past the restored step are dropped so the log matches the restored state, and
    so is a line a crash cut short; of a step logged twice, the later row is kept. The
    file is rewritten atomically."""

    def __init__(self, path: Path, resume_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        lines = path.read_text().splitlines() if (resume_step and path.exists()) else []
        rows = [_parsed_row(line) for line in lines]
        if None in rows:
            print(f"{path}: {rows.count(None)} unreadable line(s) dropped (a write cut short)", file=sys.stderr)
        by_step = {
            row["step"]: line for line, row in zip(lines, rows) if row is not None and row["step"] <= resume_step
        }
        strict_json.replace_text(path, "".join(by_step[step] + "\n" for step in sorted(by_step)))

    def write(self, row: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(strict_json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []


def _parsed_row(line: str) -> dict | None:
    """A metrics.jsonl row, or None for a line that is not one."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def plot_losses(rows: list[dict], path: Path, title: str) -> None:
    """Training (and validation) loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fractions(part: dict, whole: dict) -> dict:
    return {axis: round(part[axis] / whole[axis], 4) for axis in part if whole[axis]}


def summary(run: RunState, rows: list[dict], wire: WireBytes, stopped_by: str | None, seconds: float) -> dict:
    """The run's summary (summary.json).

    Args:
      run: the run after its last step.
      rows: metrics.jsonl's rows ([] off the main process).
      wire: the bytes one step sends per mesh axis.
      stopped_by: the signal that stopped the run, or None.
      seconds: the loop's wall-clock time.
    """
    cfg = run.cfg
    return {
        "model": cfg.model,
        "mesh": list(cfg.mesh),
        "taco": cfg.compression.tensor.preset,
        "taco_policy": cfg.taco_policy,
        "tp_overlap": cfg.tp_overlap,
        "steps": run.step,
        "stopped_by": stopped_by,
        "final_loss": rows[-1]["loss"] if rows else None,
        "final_val_loss": next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None),
        "skipped_steps": run.bad_total,
        "seconds": round(seconds, 1),
        "taco_pipe": cfg.compression.pipe.preset,
        "taco_data": cfg.compression.data.preset,
        "wire_bytes_per_step": wire.sent[TENSOR_AXIS],
        "wire_bytes_per_step_bf16": wire.bf16[TENSOR_AXIS],
        "wire_bytes_by_axis": wire.sent,
        "wire_bytes_bf16_by_axis": wire.bf16,
        # What each axis sends as a share of the same traffic in bf16 (float32 traffic: 2),
        # and of what the same collectives send uncompressed (1: not compressed).
        "wire_fraction_by_axis": _fractions(wire.sent, wire.bf16),
        "wire_fraction_of_uncompressed_by_axis": _fractions(wire.sent, wire.uncompressed),
        "pipeline_bubble": bubble_fraction(cfg.mesh.pipe, cfg.microbatches),
        # What each site and direction sends, with its measured error, from the report of
        # the calibration the run holds (its own, or the calibration_file it loaded).
        **calibration_summary(
            run.calibration,
            recorded_choices(run.calibration, run.out / "calibration.json", run.cfg.calibration_file or None),
        ),
    }


def sample_text(run: RunState) -> str:
    """The validation split's first `SAMPLE_PROMPT_TOKENS` tokens and their greedy
    continuation by `sample_tokens` tokens, as text (token ids where the run's data has
    no text codec). A pipelined run samples on one device."""
    prompt = [int(t) for t in run.corpus.val[:SAMPLE_PROMPT_TOKENS]]
    new = models.generate(
        run.model_config,
        run.params,
        [prompt],
        mesh=run.mesh if run.cfg.mesh.pipe == 1 else None,
        taco=taco_config(run.cfg),
        max_new_tokens=run.cfg.sample_tokens,
        dtype=jnp.dtype(run.cfg.compute_dtype),
    )[0]
    try:
        decode = data_lib.text_codec(run.cfg.data, run.cfg.tokenizer).decode
    except ValueError:
        return " ".join(map(str, prompt + new))
    return decode(prompt) + decode(new)
