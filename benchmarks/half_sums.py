"""What summing INT4 (and INT5) shards in float16 pairs costs a requantized sum, in numpy.

`SplitConfig(half_sums=True)` sums the codes of k shards times their multipliers in
float16 (`gluon_codec.int4_half_sum`): the multipliers scaled by the binade of the row's
largest, each product added with one rounding to float16, the sum then requantized in
float32. This models that arithmetic beside the float32 sum on shards of groups with
log-normal scales, compressed without the transform (the sum is taken on the codes either
way), and reports each sum's error of the exact sum, the requantized codes that differ
and the requantized sums' errors.

Usage:  python -m benchmarks.half_sums [--groups 20000] [--out benchmarks/results/half_sums_model.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from taco_jax import strict_json

SHARDS = 4
GROUP = 32


def _requantize(sums: np.ndarray, largest_code: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of sums requantized with absmax scales."""
    scales = np.abs(sums).max(axis=-1, keepdims=True) / largest_code
    return np.rint(sums / scales), scales


def model(bits: int, groups: int, seed: int = 0) -> dict:
    """The float32 and float16 sums of SHARDS shards of INT`bits` codes, requantized."""
    rng = np.random.default_rng(seed)
    largest_code = 2 ** (bits - 1) - 1
    x = rng.normal(size=(SHARDS, groups, GROUP)) * rng.lognormal(0, 1, size=(SHARDS, groups, 1))
    multipliers = (np.abs(x).max(axis=-1, keepdims=True) / largest_code).astype(np.float32)
    codes = np.clip(np.rint(x / multipliers), -largest_code - 1, largest_code)
    exact = (codes * multipliers).sum(axis=0)
    single = np.zeros((groups, GROUP), np.float32)
    for shard in range(SHARDS):  # a fused multiply-add: one rounding to float32
        single = (single + codes[shard] * multipliers[shard].astype(np.float64)).astype(np.float32)
    binade = np.floor(np.log2(multipliers.max(axis=0))) + 1
    ratios = (multipliers / 2.0**binade).astype(np.float16)
    half = np.zeros((groups, GROUP), np.float16)
    for shard in range(SHARDS):  # one rounding to float16
        half = (half + codes[shard] * ratios[shard].astype(np.float64)).astype(np.float16)
    half_sum = half.astype(np.float64) * 2.0**binade
    norm = np.linalg.norm(exact)
    single_codes, single_scales = _requantize(single.astype(np.float64), largest_code)
    half_codes, half_scales = _requantize(half_sum, largest_code)
    return {
        "bits": bits,
        "groups": groups,
        "float32_sum_error": float(np.linalg.norm(single - exact) / norm),
        "float16_sum_error": float(np.linalg.norm(half_sum - exact) / norm),
        "codes_differing": float(np.mean(single_codes != half_codes)),
        "float32_requantized_error": float(np.linalg.norm(single_codes * single_scales - exact) / norm),
        "float16_requantized_error": float(np.linalg.norm(half_codes * half_scales - exact) / norm),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/half_sums_model.json"))
    args = parser.parse_args()
    rows = [model(bits, args.groups) for bits in (4, 5)]
    args.out.write_text(strict_json.dumps({"shards": SHARDS, "group_size": GROUP, "rows": rows}, indent=1))
    print("| format | sum error f32 | sum error f16 | codes moved | requantized error f32 | f16 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| INT{r['bits']} G{GROUP} | {r['float32_sum_error']:.1e} | {r['float16_sum_error']:.1e} | "
            f"{r['codes_differing']:.2%} | {r['float32_requantized_error']:.4%} | {r['float16_requantized_error']:.4%} |"
        )


if __name__ == "__main__":
    main()
