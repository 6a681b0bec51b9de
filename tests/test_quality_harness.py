"""The quality harness's report of a panel run in pieces (`benchmarks.quality`)."""

import json
import sys

import numpy as np

from benchmarks import quality


def _run(variant: str, seed: int, val_loss: float) -> dict:
    curve = list(np.linspace(3.0, val_loss, 40))
    return {
        "corpus": "shakespeare",
        "model": "gpt2-40m",
        "variant": variant,
        "seed": seed,
        "lr": 1.5e-4,
        "train_loss": val_loss - 0.05,
        "val_loss": val_loss,
        "curve": curve,
        "seconds": 1.0,
        "wire_bytes_by_axis": {"tensor": 28.0},
        "wire_bytes_bf16_by_axis": {"tensor": 100.0},
    }


def test_a_report_shows_every_piece_not_only_the_invocation(tmp_path, monkeypatch):
    """A piece run with `--variants off,taco+` wrote a report of off and taco+ alone,
    hiding the file's other variants; the report now lists every piece's, each with its
    paired gap (taco4: +1.00% and +3.00% at the two seeds, +2.00 on average)."""
    runs = [_run("off", s, 2.0) for s in (0, 1)] + [_run("taco4", 0, 2.02), _run("taco4", 1, 2.06)]
    settings = {"models": "gpt2-40m", "variants": "off,taco4", "lr": "0.00015", "lr_sweep": {}}
    (tmp_path / "quality_pieces.json").write_text(json.dumps({"settings": settings, "runs": runs}))
    argv = ["quality", "--tag", "pieces", "--out", str(tmp_path), "--report-only", "--lr", "1.5e-4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--models", "gpt2-40m", "--variants", "off,taco+"])
    quality.main()
    lines = (tmp_path / "quality_pieces.md").read_text().splitlines()
    taco4 = [line for line in lines if "| taco4 |" in line]
    assert len(taco4) == 1 and "+2.00 ± 1.00%" in taco4[0] and "tensor 28%" in taco4[0]
    assert not [line for line in lines if "| taco+ |" in line]  # no taco+ runs in the file
    assert (tmp_path / "quality_pieces.png").stat().st_size > 0
