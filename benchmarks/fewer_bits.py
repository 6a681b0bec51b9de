"""Codec error and wire bytes of the formats below 8 bits against the 8-bit presets.

On the synthetic TP tensors of `benchmarks/tp_tensors.py` (as `benchmarks.codec_error`),
for each quantizer spec: relative RMSE after one round trip and through a simulated
two-shot all-reduce, and wire bytes against bf16. The error budget of the `taco+mixed`
preset (`taco_jax.FewerBits`) is a multiple of the E4M3 codec's error.

Usage:
  python -m benchmarks.fewer_bits [--tokens 1024] [--channels 4096] [--out FILE.json]
"""

from __future__ import annotations

import sys
import time

import taco_jax as tj
from benchmarks import tp_tensors
from benchmarks.codec_error import measure, run_meta, tensor_arguments
from taco_jax import strict_json

SPECS = (
    "e4m3:128:H:dual",  # taco
    "int8:128:H:bf16",  # taco+
    "e2m3:128:H:bf16",
    "e2m3:32:H:e8m0",
    "e3m2:128:H:bf16",
    "int4:128:H:bf16",
    "int4:32:H:bf16",
    "e2m1:32:H:e8m0",
    "e2m1:16:H:e8m0",
    "e2m1:32:H:bf16",
)


def run(tokens: int, channels: int, ranks: int) -> list[dict]:
    """One row per tensor kind and spec."""
    rows = []
    for kind in tp_tensors.KINDS:
        x = tp_tensors.generate(kind, tokens, channels, seed=1)
        parts = tp_tensors.partial_sums(x, ranks, seed=2)
        for text in SPECS:
            spec = tj.QuantSpec.parse(text)
            rows.append(
                {"tensor": kind, "spec": text, "bits_per_element": spec.bits_per_element} | measure(x, parts, spec)
            )
        print(f"  {kind}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: relative RMSE single-shot / two-shot per tensor kind, and each spec's
    worst single-shot error as a multiple of E4M3's on the same tensor."""
    kinds = tp_tensors.KINDS
    lines = [
        "| spec | wire/bf16 | " + " | ".join(kinds) + " | worst x E4M3 |",
        "|" + "---|" * (3 + len(kinds)),
    ]
    error = {(r["spec"], r["tensor"]): r for r in rows}
    for text in SPECS:
        cells = [
            f"{100 * error[text, k]['rel_rmse']:.2f}% / {100 * error[text, k]['two_shot_rel_rmse']:.2f}%" for k in kinds
        ]
        worst = max(error[text, k]["rel_rmse"] / error[SPECS[0], k]["rel_rmse"] for k in kinds)
        lines.append(
            f"| {text} | {error[text, kinds[0]]['wire_ratio']:.3f} | " + " | ".join(cells) + f" | {worst:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = tensor_arguments(__doc__, "benchmarks/results/fewer_bits_error.json").parse_args()
    start = time.time()
    rows = run(args.tokens, args.channels, args.ranks)
    meta = {"command": "python -m benchmarks.fewer_bits", **run_meta(args, start)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    print(table(rows))


if __name__ == "__main__":
    main()
