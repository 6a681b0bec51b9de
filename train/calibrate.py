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


def calibration_summary(calibration: Calibration, choices: list[dict] | None = None) -> dict:
    """The calibration's size for a summary: site directions calibrated, those with the
    transform, and how many take each format below the config's (`taco+mixed`), as
    sent (with the site's transform decision), in all and per direction; with the
    report's `choices` (`tj.calibration.choices`), what each site and direction sends
    and its measured error, relative to the reference's where the config has fewer bits."""
    by_direction: dict[str, dict[str, int]] = {direction: {} for direction in tj.calibration.DIRECTIONS}
    for _, direction, plan in calibration.plans:
        if plan.quant is not None:
            formats = by_direction[direction]
            formats[plan.quant.text] = formats.get(plan.quant.text, 0) + 1
    total: dict[str, int] = {}
    for formats in by_direction.values():
        for text, count in formats.items():
            total[text] = total.get(text, 0) + count
    summary = {
        "calibrated_sites": len(calibration.plans),
        "sites_with_transform": sum(plan.hadamard for _, _, plan in calibration.plans),
        "sites_with_fewer_bits": dict(sorted(total.items())),
        "sites_with_fewer_bits_by_direction": {d: dict(sorted(f.items())) for d, f in by_direction.items()},
    }
    if choices:
        summary["calibration_choices"] = {
            f"{row['site']}/{row['direction']}": {k: v for k, v in row.items() if k not in ("site", "direction")}
            for row in choices
        }
    return summary


def choice_text(row: dict) -> str:
    """One site direction's choice as the calibration message prints it, e.g.
    "mlp.out/b: int4:32:H:bf16 (1.9x e4m3:128:H:dual's error, tolerance 3x)"."""
    measured = f"relative RMSE {row['rel_rmse']:.3g}"
    if row.get("error_ratio") is not None:
        measured = f"{row['error_ratio']:.2f}x {row['reference']}'s error, tolerance {row['tolerance']:g}x"
    return f"{row['site']}/{row['direction'][0]}: {row['sent']} ({measured})"


def recorded_choices(calibration: Calibration, *files: Path | str | None) -> list[dict]:
    """The choices of the first of `files` (calibration.json files) that holds
    `calibration` (its measured errors), or none where none does."""
    for file in files:
        try:
            data = json.loads(Path(file).read_text()) if file is not None else None
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and data.get("calibration") == calibration.to_json():
            return list(data.get("choices", []))
    return []


def refuse_overwrite(target: Path, force: bool) -> None:
    """Raise ValueError if `target` (a run's calibration.json) exists and `force` is not
    given: --calibrate-only never replaces a calibration unasked."""
    if target.exists() and not force:
        raise ValueError(
            f"--calibrate-only: {target} already holds a calibration; pass --force to overwrite it or choose another --out"
        )


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
    choices = tj.calibration.choices(report)
    if out is not None:
        strict_json.write(
            out / "calibration.json", {"calibration": calibration.to_json(), "choices": choices, "report": report}
        )
    config = taco_config(cfg)
    measured = {(row["site"], row["direction"], row["sent"]): choice_text(row) for row in choices}
    sent = [(site, direction, plan.spec(config.spec(direction)).text) for site, direction, plan in calibration.plans]
    # Another process's report may differ from process 0's calibration, which all hold.
    chosen = ", ".join(measured.get(key, f"{key[0]}/{key[1][0]}: {key[2]}") for key in sent)
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
