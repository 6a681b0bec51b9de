"""The run's calibration: decided from what the observed steps sent, written to
OUT/calibration.json, and loaded from such a file (`calibration_file=`)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import jax

import taco_jax as tj
from taco_jax import strict_json
from taco_jax.calibration import Calibration

from .compression import taco_config
from .config import TrainConfig


def calibration_summary(calibration: Calibration) -> dict:
    """The calibration's size for a summary: site directions calibrated, those with the
    transform, and how many take each format below the config's (`taco+mixed`), as
    sent (with the site's transform decision)."""
    formats: dict[str, int] = {}
    for _, _, plan in calibration.plans:
        if plan.quant is not None:
            formats[plan.quant.text] = formats.get(plan.quant.text, 0) + 1
    return {
        "calibrated_sites": len(calibration.plans),
        "sites_with_transform": sum(plan.hadamard for _, _, plan in calibration.plans),
        "sites_with_fewer_bits": dict(sorted(formats.items())),
    }


def calibration_digest(calibration: Calibration) -> str:
    """A fingerprint of what `calibration` decides (its JSON, keys sorted): checkpoints
    keep the one of their calibration_file, which a resume checks the file against."""
    return hashlib.sha256(json.dumps(calibration.to_json(), sort_keys=True).encode()).hexdigest()


def calibrate_run(cfg: TrainConfig, collector: tj.calibration.Collector, out: Path | None, bar=None) -> Calibration:
    """Decide the run's calibration from what `collector` observed; write the per-site
    report (every candidate's codec error) to `out`/calibration.json."""
    jax.effects_barrier()  # every host callback of the observed steps has run
    strategies = tj.calibration.STRATEGIES if cfg.calibration_strategy == "auto" else (cfg.calibration_strategy,)
    calibration, report = tj.calibration.calibrate(
        collector, taco_config(cfg), strategies=strategies, min_gain=cfg.calibration_min_gain
    )
    if out is not None:
        strict_json.write(out / "calibration.json", {"calibration": calibration.to_json(), "report": report})
    config = taco_config(cfg)
    chosen = ", ".join(
        f"{site}/{direction[0]}: {plan.spec(config.forward if direction == 'forward' else config.backward).text}"
        for site, direction, plan in calibration.plans
    )
    message = f"calibrated {len(calibration.plans)} site directions ({chosen})"
    (bar.write if bar is not None else lambda m: print(m, file=sys.stderr))(message)
    return calibration


def load_calibration(path: str | Path) -> Calibration:
    """A `Calibration` from a calibration.json (of a run or `--calibrate-only`).

    Raises:
      ValueError: missing or malformed file (naming it).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"calibration_file {path} cannot be read: {error}") from None
    try:
        return Calibration.from_json(data.get("calibration", data) if isinstance(data, dict) else data)
    except ValueError as error:
        raise ValueError(f"calibration_file {path}: {error}") from None


def file_calibration(cfg: TrainConfig) -> Calibration:
    """The calibration of `cfg.calibration_file`, checked against the run's tensor
    compression: a file refines the preset (permutations, transforms, and formats only
    where the preset allows fewer bits); it does not override it.

    Raises:
      ValueError: the file cannot be read, is malformed, or chooses what the preset does
        not allow (naming calibration_file and taco).
    """
    calibration = load_calibration(cfg.calibration_file)
    conflicts = calibration.conflicts(taco_config(cfg))
    if conflicts:
        raise ValueError(
            f"calibration_file {cfg.calibration_file} does not fit taco={cfg.compression.tensor.preset}: "
            f"{'; '.join(conflicts)}"
        )
    return calibration
