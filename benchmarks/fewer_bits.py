"""Codec error and wire bytes of the formats below 8 bits against the 8-bit presets.

On the synthetic TP tensors of `benchmarks/tp_tensors.py` (as `benchmarks.codec_error`),
for each quantizer spec: relative RMSE after one round trip and through a simulated
two-shot all-reduce, and wire bytes against bf16. The error budget of the `taco+mixed`
preset (`taco_jax.FewerBits`) is a multiple of the E4M3 codec's error.

Beside the codec's specs, 4-bit forms it does not have, emulated in float64 numpy:
two-level scales as NVFP4 sends them ("e4m3x2": one float32 scale per message and one
E4M3 scale per group, rounded up so that no value clips; 4.5 bits per element at G=16),
and a random-sign Hadamard ("+rs": a fixed +-1 per channel from a seed, the same on every
rank, applied before the transform; measured through the codec on the signed tensor,
whose errors are those of the tensor itself, the signs undone).

Beside each spec, what no code of its bits a value can beat on a Gaussian source (the
messages after the transform quantize as Gaussian ones do): the rate-distortion bound
2**-R of any code, and the error of the best fixed-rate scalar code (a Lloyd-Max
quantizer of floor(2**R) levels, fitted to the Gaussian itself: a message buffer of
fixed size takes no entropy coding).

Usage:
  python -m benchmarks.fewer_bits [--tokens 1024] [--channels 4096] [--out FILE.json]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time

import numpy as np

import taco_jax as tj
from benchmarks import tp_tensors
from benchmarks.codec_error import _metrics, measure, run_meta, tensor_arguments
from taco_jax import strict_json
from taco_jax.kernels.wire import hadamard_matrix

SPECS = (
    "e4m3:128:H:dual",  # taco
    "int8:128:H:bf16",  # taco+
    "e2m3:128:H:bf16",
    "e2m3:32:H:e8m0",
    "e3m2:128:H:bf16",
    # 5 bits: an activation's error near E2M3's at groups of 32.
    "int5:32:H:bf16",
    "int5:128:H:bf16",
    "int4:128:H:bf16",
    "int4:32:H:bf16",
    "e2m1:32:H:e8m0",
    "e2m1:16:H:e8m0",
    "e2m1:32:H:bf16",
    # 4 bits forward: groups of 16 (NVFP4's), and the random-sign Hadamard.
    "int4:16:H:bf16",
    "int4:16:H:e8m0",
    "e2m1:16:H:bf16",
    "int4:32:H:bf16+rs",
    "int4:16:H:bf16+rs",
    # Emulated (`TwoLevel`): NVFP4 as published (no transform), and with the transform.
    "e2m1:16:-:e4m3x2",
    "e2m1:16:H:e4m3x2",
    "int4:16:-:e4m3x2",
    "int4:16:H:e4m3x2",
    "int4:16:H:e4m3x2+rs",
)
RANDOM_SIGNS = "+rs"
SIGN_SEED = 0
# Magnitudes of the 4-bit grids: E2M1's eight, INT4's symmetric [-7, 7].
GRIDS = {"e2m1": np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]), "int4": np.arange(8.0)}
E4M3_MAX, E4M3_MIN_EXPONENT, E4M3_MANTISSA_BITS = 448.0, -6, 3


def round_up(values: np.ndarray, mantissa_bits: int, min_exponent: int) -> np.ndarray:
    """Positive float64 values rounded up onto a float grid with `mantissa_bits` and
    smallest normal exponent `min_exponent` (subnormals below it); 0 stays 0."""
    exponent = np.maximum(np.floor(np.log2(np.where(values > 0, values, 1.0))), min_exponent)
    step = np.exp2(exponent - mantissa_bits)
    return np.ceil(values / step) * step


@dataclasses.dataclass(frozen=True)
class TwoLevel:
    """A 4-bit form with two-level scales: per message one float32 scale S (the largest
    group scale over E4M3's largest value), per group an E4M3 code of its scale over S,
    rounded up; an all-zero group's code is 0.

    Attributes:
      fmt: "e2m1" or "int4".
      group_size: G.
      hadamard: the normalized Walsh-Hadamard transform per group first.
    """

    fmt: str
    group_size: int
    hadamard: bool

    @classmethod
    def parse(cls, text: str) -> TwoLevel:
        """A form from "fmt:G:H|-:e4m3x2"."""
        fmt, group, transform, scales = text.split(":")
        if fmt not in GRIDS or scales != "e4m3x2":
            raise ValueError(f"not a two-level form: {text!r}")
        return cls(fmt, int(group), transform == "H")

    @property
    def bits_per_element(self) -> float:
        """Payload and group-scale bits per element (the message's 4 bytes aside)."""
        return 4 + 8 / self.group_size

    def wire_ratio(self, size: int) -> float:
        """Wire bytes of one message of `size` elements against bf16's."""
        return (size / 2 + size / self.group_size + 4) / (2 * size)

    def transform(self, x: np.ndarray) -> np.ndarray:
        """(..., C) -> (..., C / G, G), transformed per group where `hadamard` (its own inverse)."""
        groups = x.reshape(*x.shape[:-1], -1, self.group_size)
        if not self.hadamard:
            return groups
        return groups @ (hadamard_matrix(self.group_size).astype(np.float64) / np.sqrt(self.group_size))

    def quantize(self, groups: np.ndarray) -> np.ndarray:
        """One message (..., N, G) through the wire and back (in the transformed domain)."""
        grid = GRIDS[self.fmt]
        scale = np.abs(groups).max(axis=-1, keepdims=True) / grid[-1]
        message_scale = max(float(scale.max()) / E4M3_MAX, np.finfo(np.float32).tiny)
        decoded = round_up(scale / message_scale, E4M3_MANTISSA_BITS, E4M3_MIN_EXPONENT) * message_scale
        steps = np.abs(groups) / np.where(decoded > 0, decoded, 1.0)
        nearest = grid[np.searchsorted((grid[1:] + grid[:-1]) / 2, np.minimum(steps, grid[-1]))]
        return np.sign(groups) * nearest * decoded

    def measure(self, x: np.ndarray, parts: np.ndarray) -> dict[str, float]:
        """As `benchmarks.codec_error.measure`: one round trip, and the two-shot
        all-reduce of `parts` (each rank's message quantized, summed in the transformed
        domain, the sum quantized again as one message, transformed back)."""
        x64, parts64 = x.astype(np.float64), parts.astype(np.float64)
        back = lambda groups: self.transform(groups.reshape(x.shape)).reshape(x.shape)
        round_trip = back(self.quantize(self.transform(x64)))
        summed = sum(self.quantize(self.transform(part)) for part in parts64)
        exact = parts64.sum(axis=0)
        two_shot = back(self.quantize(summed))
        return {
            **_metrics(x, round_trip),
            "two_shot_rel_rmse": float(np.linalg.norm(two_shot - exact) / np.linalg.norm(exact)),
            "wire_ratio": self.wire_ratio(x.size),
        }


_erf = np.vectorize(math.erf)


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))


def _normal_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * np.square(x)) / math.sqrt(2.0 * math.pi)


def lloyd_max_rel_rmse(levels: int, iterations: int = 2000) -> float:
    """RMS error of the best scalar quantizer with `levels` levels on a unit Gaussian
    (Lloyd-Max: each level the mean of its cell, each threshold halfway between two
    levels, iterated to the fixed point)."""
    if levels < 1:
        raise ValueError(f"a quantizer needs at least one level, got {levels}")
    # The outer cells end at +-40 standard deviations, where the density is 0 in float64.
    tail = np.array([40.0])

    def cells(points):
        edges = np.concatenate([-tail, (points[1:] + points[:-1]) / 2, tail])
        low, high = edges[:-1], edges[1:]
        # Each cell's probability and integral of x.
        return low, high, _normal_cdf(high) - _normal_cdf(low), _normal_pdf(low) - _normal_pdf(high)

    points = np.linspace(-3.0, 3.0, levels) if levels > 1 else np.zeros(1)
    for _ in range(iterations):
        _, _, mass, first = cells(points)
        points = first / mass
    low, high, mass, first = cells(points)
    # The integral of (x - level)^2 over each cell.
    error = mass - (high * _normal_pdf(high) - low * _normal_pdf(low)) - 2 * points * first + np.square(points) * mass
    return float(np.sqrt(np.sum(error)))


@functools.cache
def gaussian_limits(bits_per_element: float) -> dict[str, float]:
    """The least relative RMS error on a Gaussian source at `bits_per_element`: of any
    code (the rate-distortion bound), and of a fixed-rate scalar code."""
    return {
        "any_code_rel_rmse": 2.0**-bits_per_element,
        "scalar_code_rel_rmse": lloyd_max_rel_rmse(math.floor(2.0**bits_per_element)),
    }


def random_signs(channels: int, seed: int = SIGN_SEED) -> np.ndarray:
    """The fixed +-1 per channel that every rank applies before the transform."""
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), channels)


def measure_form(text: str, x: np.ndarray, parts: np.ndarray) -> dict:
    """One row's measurements: a codec spec or a `TwoLevel` form, "+rs" on the tensor
    with random signs (each channel's sign flipped or not: norms, per-channel norms and
    sums keep their errors, so these are the tensor's own)."""
    base = text.removesuffix(RANDOM_SIGNS)
    if base != text:
        signs = random_signs(x.shape[-1])
        x, parts = x * signs, parts * signs
    if base.endswith(":e4m3x2"):
        form = TwoLevel.parse(base)
        bits, emulated, errors = form.bits_per_element, True, form.measure(x, parts)
    else:
        spec = tj.QuantSpec.parse(base)
        bits, emulated, errors = spec.bits_per_element, False, measure(x, parts, spec)
    return {"emulated": emulated, "bits_per_element": bits, **errors, **gaussian_limits(bits)}


def run(tokens: int, channels: int, ranks: int) -> list[dict]:
    """One row per tensor kind and spec."""
    rows = []
    for kind in tp_tensors.KINDS:
        x = tp_tensors.generate(kind, tokens, channels, seed=1)
        parts = tp_tensors.partial_sums(x, ranks, seed=2)
        for text in SPECS:
            rows.append({"tensor": kind, "spec": text} | measure_form(text, x, parts))
        print(f"  {kind}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: relative RMSE single-shot / two-shot per tensor kind, each spec's
    worst single-shot error as a multiple of E4M3's on the same tensor, and the least
    error of any code / of a fixed-rate scalar code at its bits on a Gaussian."""
    kinds = tp_tensors.KINDS
    lines = [
        "| spec | wire / bf16 | " + " | ".join(kinds) + " | worst x E4M3 | least on a Gaussian: any / scalar code |",
        "|" + "---|" * (4 + len(kinds)),
    ]
    error = {(r["spec"], r["tensor"]): r for r in rows}
    pct = lambda value: f"{100 * value:.2f}%"
    for text in dict.fromkeys(r["spec"] for r in rows):
        cells = [f"{pct(error[text, k]['rel_rmse'])} / {pct(error[text, k]['two_shot_rel_rmse'])}" for k in kinds]
        worst = max(error[text, k]["rel_rmse"] / error[SPECS[0], k]["rel_rmse"] for k in kinds)
        first = error[text, kinds[0]]
        limits = f"{pct(first['any_code_rel_rmse'])} / {pct(first['scalar_code_rel_rmse'])}"
        lines.append(f"| {text} | {first['wire_ratio']:.3f} | " + " | ".join(cells) + f" | {worst:.2f} | {limits} |")
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
