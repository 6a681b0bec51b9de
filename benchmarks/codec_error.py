"""Codec error and wire bytes for every mode x scale format x group size x element format.

On the synthetic TP tensors of `benchmarks/tp_tensors.py`, for each configuration:
  rel_rmse            ||x_hat - x|| / ||x|| after one compress/decompress
  channel_median      median over channels of the per-channel relative error
  underflow           fraction of nonzero inputs decoded as exactly 0
  two_shot_rel_rmse   relative error of a simulated TP two-shot all-reduce over
                      `--ranks` partial sums (quantize each, sum in float32 in the
                      transformed domain, requantize once, decode)
  wire_ratio          wire bytes / bf16 bytes

Usage:
  python -m benchmarks.codec_error [--tokens 1024] [--channels 4096] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import taco_jax as tj
from benchmarks import tp_tensors
from taco_jax import strict_json

FMTS = ("e4m3", "e5m2", "int8")
SCALES = ("dual", "single", "bf16", "e8m0")
GROUPS = (32, 64, 128, 256)
MODES = {"fp8": False, "taco": True}  # mode -> Hadamard transform on


@jax.jit(static_argnames="spec")
def _round_trip(x: jax.Array, spec: tj.QuantSpec) -> jax.Array:
    return tj.decompress(tj.compress(x, spec)).astype(jnp.float32)


@jax.jit(static_argnames="spec")
def _two_shot(parts: jax.Array, spec: tj.QuantSpec) -> jax.Array:
    return tj.decompress(tj.requantize_sum(tj.compress(parts, spec)))


def _metrics(x: np.ndarray, x_hat: np.ndarray) -> dict[str, float]:
    x64, err = x.astype(np.float64), x_hat.astype(np.float64) - x.astype(np.float64)
    channel_norm = np.linalg.norm(x64, axis=0)
    nonzero = x64 != 0
    return {
        "rel_rmse": float(np.linalg.norm(err) / np.linalg.norm(x64)),
        "channel_median": float(
            np.median(np.linalg.norm(err, axis=0)[channel_norm > 0] / channel_norm[channel_norm > 0])
        ),
        "underflow": float(np.mean(x_hat[nonzero] == 0)),
    }


def measure(x: np.ndarray, parts: np.ndarray, spec: tj.QuantSpec) -> dict[str, float]:
    """`spec`'s metrics on tensor `x` and its partial sums `parts` (ranks, ...): one round
    trip's (`_metrics`), the two-shot all-reduce's relative RMSE and the wire ratio."""
    exact_sum = parts.astype(np.float64).sum(axis=0)
    two_shot = np.asarray(_two_shot(jnp.asarray(parts), spec), np.float64)
    return {
        **_metrics(x, np.asarray(_round_trip(jnp.asarray(x), spec))),
        "two_shot_rel_rmse": float(np.linalg.norm(two_shot - exact_sum) / np.linalg.norm(exact_sum)),
        "wire_ratio": tj.wire_bytes(x.shape, jnp.float32, spec) / (2 * x.size),
    }


def run(tokens: int, channels: int, ranks: int) -> list[dict]:
    rows = []
    for kind in tp_tensors.KINDS:
        x = tp_tensors.generate(kind, tokens, channels, seed=1)
        parts = tp_tensors.partial_sums(x, ranks, seed=2)
        for (mode, hadamard), fmt, scales, group in itertools.product(MODES.items(), FMTS, SCALES, GROUPS):
            spec = tj.QuantSpec(fmt=fmt, group_size=group, hadamard=hadamard, scales=scales)
            row = {"tensor": kind, "mode": mode, "fmt": fmt, "scales": scales, "group_size": group}
            rows.append(row | measure(x, parts, spec))
        print(f"  {kind}: {len(rows)} configurations done", file=sys.stderr, flush=True)
    return rows


def _select(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def tables(rows: list[dict], group_size: int = 128) -> str:
    """Markdown: (1) relative RMSE single-shot / two-shot and (2) median per-channel error
    and underflow, per tensor kind at one group size; (3) the group-size sweep."""
    kinds = tp_tensors.KINDS
    head = "| mode | fmt | scales | wire/bf16 | " + " | ".join(kinds) + " |"
    rule = "|" + "---|" * (4 + len(kinds))
    error_lines, channel_lines = [head, rule], [head.replace(" |", " |", 1), rule]
    for mode, fmt, scales in itertools.product(MODES, FMTS, SCALES):
        by_kind = {r["tensor"]: r for r in _select(rows, mode=mode, fmt=fmt, scales=scales, group_size=group_size)}
        prefix = f"| {mode} | {fmt} | {scales} | {by_kind[kinds[0]]['wire_ratio']:.3f} | "
        error_lines.append(
            prefix
            + " | ".join(
                f"{100 * by_kind[k]['rel_rmse']:.2f}% / {100 * by_kind[k]['two_shot_rel_rmse']:.2f}%" for k in kinds
            )
            + " |"
        )
        channel_lines.append(
            prefix
            + " | ".join(
                f"{100 * by_kind[k]['channel_median']:.2f}% ({100 * by_kind[k]['underflow']:.2f}%)" for k in kinds
            )
            + " |"
        )
    sweep = ["| mode | fmt | scales | " + " | ".join(f"G={g}" for g in GROUPS) + " |", "|" + "---|" * (3 + len(GROUPS))]
    for mode, fmt, scales in [
        ("fp8", "e4m3", "single"),
        ("taco", "e4m3", "dual"),
        ("taco", "int8", "single"),
        ("taco", "int8", "bf16"),
    ]:
        cells = []
        for g in GROUPS:
            (row,) = _select(rows, mode=mode, fmt=fmt, scales=scales, group_size=g, tensor="activation")
            cells.append(f"{100 * row['two_shot_rel_rmse']:.2f}% ({row['wire_ratio']:.3f})")
        sweep.append(f"| {mode} | {fmt} | {scales} | " + " | ".join(cells) + " |")
    return "\n".join(
        [
            f"Relative RMSE, single-shot / two-shot all-reduce, G={group_size}:",
            *error_lines,
            "",
            f"Median per-channel relative error (fraction flushed to zero), single-shot, G={group_size}:",
            *channel_lines,
            "",
            "Group-size sweep, two-shot relative RMSE on `activation` (wire bytes / bf16):",
            *sweep,
        ]
    )


def tensor_arguments(doc: str, out: str) -> argparse.ArgumentParser:
    """The command line of a codec-error benchmark: tensor size, TP degree, output file."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--channels", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=4, help="TP degree of the simulated two-shot all-reduce")
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser


def run_meta(args: argparse.Namespace, start: float) -> dict:
    """What a codec-error result was measured on, and in how long."""
    return {
        "tokens": args.tokens,
        "channels": args.channels,
        "ranks": args.ranks,
        "backend": jax.default_backend(),
        "host": platform.machine(),
        "jax": jax.__version__,
        "seconds": round(time.time() - start, 1),
    }


def main() -> None:
    args = tensor_arguments(__doc__, "benchmarks/results/codec_error.json").parse_args()
    start = time.time()
    print(f"codec error on {args.tokens}x{args.channels} tensors ({jax.default_backend()})", file=sys.stderr)
    rows = run(args.tokens, args.channels, args.ranks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = run_meta(args, start)
    args.out.write_text(strict_json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out} (two-shot all-reduce over TP={args.ranks} partial sums)")
    print(tables(rows))


if __name__ == "__main__":
    main()
