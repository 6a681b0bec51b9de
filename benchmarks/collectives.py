"""Time plain (bf16) lax collectives against the compressed ones on the devices present.

For every op (all_gather, reduce_scatter, all_reduce), preset and per-rank message size:
median time, effective bus bandwidth of the plain op, speed-up over the plain op, and
the relative error of the compressed result against the plain one.

Usage:
  python benchmarks/collectives.py [--sizes-mib 4,16,64,256] [--presets fp8,taco,taco+]
      [--trials 15] [--out benchmarks/results/collectives.json]

On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before running to get N
simulated devices (the numbers then only check the plumbing). For a slow-interconnect
proxy on GPUs, run with NCCL_P2P_DISABLE=1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import taco_jax as tj  # noqa: E402

HIDDEN = 8192
OPS = {
    "all_gather": (lambda v, c: tj.all_gather(v, "tensor", c), lambda v: lax.all_gather(v, "tensor", tiled=True)),
    "reduce_scatter": (lambda v, c: tj.reduce_scatter(v, "tensor", c), lambda v: lax.psum_scatter(v, "tensor", tiled=True)),
    "all_reduce": (lambda v, c: tj.all_reduce(v, "tensor", c), lambda v: lax.psum(v, "tensor")),
}


def _compile(mesh, body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))


def _median_ms(fn, x, trials: int, calls: int) -> float:
    """Median over trials of the mean time per call. On GPU the calls of a trial are
    queued with one sync at the end; on CPU each call is synced (overlapping collective
    programs can deadlock there)."""
    sync_each = jax.default_backend() == "cpu"
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(x)
            if sync_each:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def run(sizes_mib: list[float], presets: list[str], trials: int, calls: int) -> list[dict]:
    devices = jax.devices()
    ranks = len(devices)
    mesh = tj.make_mesh(1, 1, ranks)
    rows_per_mib = (1 << 20) // (HIDDEN * 2)
    rows = []
    for size in sizes_mib:
        local_rows = max(ranks, int(round(size * rows_per_mib)) // ranks * ranks)
        shape = (ranks * local_rows, HIDDEN)
        x = jax.device_put(
            jax.random.normal(jax.random.key(0), shape, jnp.bfloat16), NamedSharding(mesh, P("tensor"))
        )
        per_rank_bytes = local_rows * HIDDEN * 2
        for op, (ours, plain) in OPS.items():
            plain_fn = _compile(mesh, plain)
            plain_out = np.asarray(plain_fn(x), np.float32)
            plain_ms = _median_ms(plain_fn, x, trials, calls)
            row = {"op": op, "ranks": ranks, "mib_per_rank": per_rank_bytes / 2**20, "preset": "off (bf16)",
                   "ms": plain_ms, "speedup": 1.0, "rel_error": 0.0}
            rows.append(row)
            print(f"  {op:15s} {per_rank_bytes / 2**20:7.1f} MiB  bf16 {plain_ms:8.3f} ms", file=sys.stderr, flush=True)
            for preset in presets:
                config = tj.TacoConfig.preset(preset, min_bytes=0)
                fn = _compile(mesh, lambda v, c=config, f=ours: f(v, c))
                out = np.asarray(fn(x), np.float32)
                error = float(np.linalg.norm(out - plain_out) / np.linalg.norm(plain_out))
                ms = _median_ms(fn, x, trials, calls)
                rows.append({"op": op, "ranks": ranks, "mib_per_rank": per_rank_bytes / 2**20, "preset": preset,
                             "ms": ms, "speedup": plain_ms / ms, "rel_error": error})
                print(f"  {op:15s} {per_rank_bytes / 2**20:7.1f} MiB  {preset:5s} {ms:8.3f} ms  "
                      f"x{plain_ms / ms:5.2f}  err {100 * error:.2f}%", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = jax.default_backend() == "gpu"
    parser.add_argument("--sizes-mib", default="4,16,64,256" if gpu else "1,4")
    parser.add_argument("--presets", default="fp8,taco,taco+")
    parser.add_argument("--trials", type=int, default=15 if gpu else 3)
    parser.add_argument("--calls", type=int, default=10 if gpu else 2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/collectives.json"))
    args = parser.parse_args()
    if len(jax.devices()) < 2:
        sys.exit("collectives.py needs at least 2 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    presets = [p for p in args.presets.split(",") if p]
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}, NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', '')}",
          file=sys.stderr)
    rows = run(sizes, presets, args.trials, args.calls)
    meta = {"devices": len(jax.devices()), "device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE", ""),
            "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    print("| op | MiB/rank | preset | ms | speed-up vs bf16 | rel. error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['mib_per_rank']:.0f} | {r['preset']} | {r['ms']:.3f} | {r['speedup']:.2f}x | {100 * r['rel_error']:.2f}% |")


if __name__ == "__main__":
    main()
