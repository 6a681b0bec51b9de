"""Codec error under channel permutations: which reshaping strategy helps which mode.

Strategies, from per-channel RMS statistics (as calibration would collect them):
  identity    no permutation
  cluster     channels sorted by RMS: each group holds channels of similar magnitude
  interleave  sorted channels dealt round-robin over the groups: each group gets a mix
              of high- and low-energy channels (spreads outlier channels out)
Reports relative RMSE and the median per-channel relative error on the synthetic TP
tensors of `tp_tensors.py`, G = 128.

Usage:  python -m benchmarks.permutation_error [--out benchmarks/results/permutation_error.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import taco_jax as tj
from benchmarks import tp_tensors
from taco_jax import calibration, strict_json

SPECS = {
    "fp8 (E4M3)": tj.QuantSpec("e4m3", 128, False, "single"),
    "taco (E4M3 + H)": tj.QuantSpec("e4m3", 128, True, "dual"),
    "taco+ (INT8 + H)": tj.QuantSpec("int8", 128, True, "bf16"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/permutation_error.json"))
    args = parser.parse_args()
    rows = []
    for kind in tp_tensors.KINDS:
        x = tp_tensors.generate(kind, 1024, 4096, seed=1)
        rms = calibration.channel_rms(x)
        for strategy in calibration.STRATEGIES:
            perm = calibration.permutation(rms, 128, strategy)
            for mode, spec in SPECS.items():
                rows.append(
                    {"tensor": kind, "strategy": strategy, "mode": mode, **calibration.codec_error(x, spec, perm)}
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps(rows, indent=1))
    print("| tensor | mode | identity | cluster | interleave |")
    print("|---|---|---|---|---|")
    for kind in tp_tensors.KINDS:
        for mode in SPECS:
            cells = []
            for strategy in ("identity", "cluster", "interleave"):
                (r,) = [r for r in rows if (r["tensor"], r["mode"], r["strategy"]) == (kind, mode, strategy)]
                cells.append(f"{100 * r['rel_rmse']:.2f}% / {100 * r['channel_median']:.2f}%")
            print(f"| {kind} | {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
