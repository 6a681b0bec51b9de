"""What a calibrated channel permutation costs at run time, against the codec and the
matmul next to it.

A permutation is applied with a gather on the sending side (`x[..., perm]` before the
compress kernel) and its inverse on the receiving side (after the decode). Timed here on
one GPU, per message of `tokens x channels` bf16:

  matmul            the row-parallel GEMM producing the message ((tokens, channels) @ (channels, channels))
  compress          the fused compress kernel, without / with the gather in front
  decompress        the fused decode kernel, without / with the inverse gather behind

Folding instead: the sending-side gather can be folded into the columns of the adjacent
weight once (the GEMM then writes the permuted channels), but the receiving side feeds the
residual stream, which every other layer reads in the original order, so the inverse
gather stays unless one permutation is shared by the whole residual stream (then it
folds into every weight and norm). The table shows what is left to save.

Usage (GPU):  python -m benchmarks.permutation_cost [--out benchmarks/results/permutation_cost.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import taco_jax as tj
from benchmarks.kernels import time_ms
from taco_jax import strict_json

SHAPES = [(8192, 4096), (16384, 8192)]


def measure(tokens: int, channels: int, preset: str) -> dict:
    spec = tj.TacoConfig.preset(preset).forward
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (tokens, channels), jnp.bfloat16)
    weight = jax.random.normal(key_w, (channels, channels), jnp.bfloat16) / np.sqrt(channels)
    perm = jnp.asarray(np.random.default_rng(0).permutation(channels).astype(np.int32))
    compressed = tj.compress(x, spec)
    row = {"tokens": tokens, "channels": channels, "preset": preset}
    row["matmul_ms"] = time_ms(jax.jit(lambda a, w: a @ w), (x, weight))
    row["compress_ms"] = time_ms(jax.jit(lambda a: tj.compress(a, spec)), (x,))
    row["compress_perm_ms"] = time_ms(jax.jit(lambda a, p: tj.compress(a, spec, perm=p)), (x, perm))
    row["decompress_ms"] = time_ms(jax.jit(tj.decompress), (compressed,))
    row["decompress_perm_ms"] = time_ms(jax.jit(tj.decompress), (compressed, perm))
    row["gather_overhead_pct_of_codec"] = (
        100 * (row["compress_perm_ms"] + row["decompress_perm_ms"]) / (row["compress_ms"] + row["decompress_ms"]) - 100
    )
    row["gather_overhead_pct_of_matmul"] = (
        100
        * (row["compress_perm_ms"] - row["compress_ms"] + row["decompress_perm_ms"] - row["decompress_ms"])
        / row["matmul_ms"]
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/permutation_cost.json"))
    args = parser.parse_args()
    rows = [measure(t, c, preset) for t, c in SHAPES for preset in ("taco", "taco+")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    print(
        f"{'shape':>12} {'preset':6} {'matmul':>8} {'compress':>9} {'+gather':>8} {'decomp':>8} {'+gather':>8} "
        f"{'codec +%':>9} {'vs GEMM %':>9}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>6}x{r['channels']:<5} {r['preset']:6} {r['matmul_ms']:8.3f} {r['compress_ms']:9.3f} "
            f"{r['compress_perm_ms']:8.3f} {r['decompress_ms']:8.3f} {r['decompress_perm_ms']:8.3f} "
            f"{r['gather_overhead_pct_of_codec']:9.1f} {r['gather_overhead_pct_of_matmul']:9.1f}"
        )


if __name__ == "__main__":
    main()
