"""Time the compressed collectives against plain (bf16) ones and against their own parts.

For every op (all_gather, reduce_scatter, all_reduce) and per-rank message size, rows of
four kinds (`part`), all measured in the same run:

  plain     the lax collective in bf16 (preset "off (bf16)")
  bytes     moving the compressed messages alone: the same collectives on uint8 buffers
            of the wire size, no codec (per all-reduce algorithm)
  codec     the codec kernels alone: compress and decode (and requantize, two-shot) of
            the same messages, no communication
  library   taco_jax's collective, per preset and route (algorithm, pipelined chunks)

Every row has `speedup` = the bf16 collective's ms / the row's ms. Each library row
carries `parts_ms` (its bytes + codec rows) and `vs_parts` = ms / parts_ms: what the
library costs beyond its parts (< 1 where the parts overlap or, at small sizes, where
timing the two codec programs separately counts a launch latency twice).

Usage:
  python -m benchmarks.collectives [--sizes-mib 4,16,64,256] [--presets taco,taco+]
      [--chunks 1,4] [--trials 15] [--out benchmarks/results/collectives.json]

On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before running to get N
simulated devices (the numbers then only check the plumbing). For a slow-interconnect
proxy on GPUs, run with NCCL_P2P_DISABLE=1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import message, strict_json
from taco_jax.accounting import Op
from taco_jax.message import chunk_bounds
from taco_jax.probe import median_ms

HIDDEN = 8192
AXIS = "tensor"
PLAIN = {
    Op.ALL_GATHER: lambda v: lax.all_gather(v, AXIS, tiled=True),
    Op.REDUCE_SCATTER: lambda v: lax.psum_scatter(v, AXIS, tiled=True),
    Op.ALL_REDUCE: lambda v: lax.psum(v, AXIS),
}
# The library's routes per op: (all-reduce algorithm or None, label of the byte/codec parts).
ROUTES = {Op.ALL_GATHER: (None,), Op.REDUCE_SCATTER: (None,), Op.ALL_REDUCE: ("one_shot", "two_shot")}


def _sharded(mesh, fn, out_spec=P(AXIS)):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=out_spec, check_vma=False))


def _library(op: str, config: tj.TacoConfig, algorithm: str | None):
    if op == Op.ALL_GATHER:
        return lambda v: tj.all_gather(v, AXIS, config)
    if op == Op.REDUCE_SCATTER:
        return lambda v: tj.reduce_scatter(v, AXIS, config)
    return lambda v: tj.all_reduce(v, AXIS, config, algorithm=algorithm)


def _message_groups(op: str, algorithm: str | None, groups: int, ranks: int) -> tuple[int, int]:
    """(groups per message, messages each rank sends) of an op's first exchange."""
    if op == Op.REDUCE_SCATTER or algorithm == "two_shot":
        return groups // ranks, ranks
    return groups, 1


def _bytes_alone(op: str, algorithm: str | None, layout, ranks: int):
    """The op's collectives on uint8 messages of the wire size (no codec): a function of
    a (ranks * messages, rows, W) uint8 array sharded over the axis."""

    def move(buffers):
        if op == Op.ALL_GATHER or algorithm == "one_shot":
            return lax.all_gather(buffers[0], AXIS, axis=0, tiled=False)
        received = lax.all_to_all(buffers, AXIS, 0, 0, tiled=True)
        if op == Op.REDUCE_SCATTER:
            return received
        # Two-shot: the reduced block (the size of one message) goes out again once
        # the first exchange has arrived.
        return lax.all_gather(received[0] ^ received[-1], AXIS, axis=0, tiled=False)

    return move


def _codec_alone(op: str, algorithm: str | None, spec: tj.QuantSpec, groups: int, ranks: int, dtype):
    """(compress fn of the rows, decode-side fn of received messages): the codec kernels
    of the op without communication, each a function of a per-rank array."""
    per_message, messages = _message_groups(op, algorithm, groups, ranks)

    def compress(rows):
        shaped = rows.reshape(messages, per_message, spec.group_size) if messages > 1 else rows
        return message.encode(shaped, spec)

    def receive(received):  # (ranks, rows, W): what the first exchange delivers
        if op == Op.ALL_GATHER:
            return message.decode(received[:, None], per_message, spec, dtype)
        if algorithm != "two_shot":
            return message.decode(received[None], per_message, spec, dtype)
        reduced = message.requantize(received, per_message, spec)
        return message.decode(jnp.broadcast_to(reduced, received.shape)[:, None], per_message, spec, dtype)

    return compress, receive


def _error(out, reference) -> float:
    out, reference = np.asarray(out, np.float32), np.asarray(reference, np.float32)
    return float(np.linalg.norm(out - reference) / np.linalg.norm(reference))


def run(sizes_mib: list[float], presets: list[str], chunk_counts: list[int], trials: int, calls: int) -> list[dict]:
    ranks = len(jax.devices())
    mesh = tj.make_mesh(1, 1, ranks)
    rows_per_mib = (1 << 20) // (HIDDEN * 2)
    rows = []

    def add(row, **fields):
        rows.append({**row, **fields})
        r = rows[-1]
        extra = f"  x{r['speedup']:5.2f}" if "speedup" in r else ""
        extra += f"  vs parts {r['vs_parts']:.2f}" if "vs_parts" in r else ""
        extra += f"  err {100 * r['rel_error']:.2f}%" if "rel_error" in r else ""
        print(
            f"  {r['op']:15s} {r['mib_per_rank']:6.1f} MiB {r['part']:8s} {r['preset']:10s} {r.get('route', ''):11s}"
            f" {r['ms']:8.3f} ms{extra}",
            file=sys.stderr,
            flush=True,
        )

    for size in sizes_mib:
        local_rows = max(ranks, int(round(size * rows_per_mib)) // ranks * ranks)
        shape = (ranks * local_rows, HIDDEN)
        x = jax.device_put(jax.random.normal(jax.random.key(0), shape, jnp.bfloat16), NamedSharding(mesh, P(AXIS)))
        groups = local_rows * HIDDEN // 128
        base = {"ranks": ranks, "mib_per_rank": local_rows * HIDDEN * 2 / 2**20}
        for op, algorithms in ROUTES.items():
            plain_fn = _sharded(mesh, PLAIN[op])
            reference = plain_fn(x)
            plain_ms = median_ms(lambda: plain_fn(x), trials, calls)
            add(base, op=op, part="plain", preset="off (bf16)", ms=plain_ms, speedup=1.0)
            for preset in presets:
                config = tj.TacoConfig.preset(preset, min_bytes=0)
                spec = config.forward
                for algorithm in algorithms:
                    per_message, messages = _message_groups(op, algorithm, groups, ranks)
                    layout = message.message_layout(per_message, spec)
                    buffers = jax.device_put(
                        jnp.zeros((ranks * messages, *layout.shape), jnp.uint8), NamedSharding(mesh, P(AXIS))
                    )
                    move = _sharded(mesh, _bytes_alone(op, algorithm, layout, ranks))
                    bytes_ms = median_ms(lambda: move(buffers), trials, calls)
                    route = algorithm or "-"
                    add(
                        base,
                        op=op,
                        part="bytes",
                        preset=preset,
                        route=route,
                        ms=bytes_ms,
                        speedup=plain_ms / bytes_ms,
                        wire_bytes=messages * layout.nbytes,
                    )
                    compress, receive = _codec_alone(op, algorithm, spec, groups, ranks, jnp.bfloat16)
                    flat = lambda v: v.reshape(-1, spec.group_size)
                    compress_fn = _sharded(mesh, lambda v: compress(flat(v)))
                    sent = compress_fn(x)
                    if messages == 1:  # an all-gather delivers every rank's message: stand in with copies
                        sent = _sharded(mesh, lambda s: jnp.broadcast_to(s[None], (ranks, *s.shape)))(sent)
                    receive_fn = _sharded(mesh, receive)
                    codec_ms = median_ms(lambda: compress_fn(x), trials, calls) + median_ms(
                        lambda: receive_fn(sent), trials, calls
                    )
                    add(base, op=op, part="codec", preset=preset, route=route, ms=codec_ms, speedup=plain_ms / codec_ms)
                    for chunks in chunk_counts:
                        routed = dataclasses.replace(config, chunks=chunks)
                        fn = _sharded(mesh, _library(op, routed, algorithm))
                        error = _error(fn(x), reference)
                        ms = median_ms(lambda: fn(x), trials, calls)
                        label = f"{route}/{len(chunk_bounds(per_message, chunks))}"
                        add(
                            base,
                            op=op,
                            part="library",
                            preset=preset,
                            route=label,
                            chunks=chunks,
                            ms=ms,
                            speedup=plain_ms / ms,
                            parts_ms=bytes_ms + codec_ms,
                            vs_parts=ms / (bytes_ms + codec_ms),
                            rel_error=error,
                        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = jax.default_backend() == "gpu"
    parser.add_argument("--sizes-mib", default="4,16,64,256" if gpu else "1")
    parser.add_argument("--presets", default="taco,taco+")
    parser.add_argument("--chunks", default="1,4", help="pipelined chunk counts of the library rows")
    parser.add_argument("--trials", type=int, default=15 if gpu else 3)
    parser.add_argument("--calls", type=int, default=10 if gpu else 2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/collectives.json"))
    args = parser.parse_args()
    if len(jax.devices()) < 2:
        sys.exit("collectives.py needs at least 2 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    presets = [p for p in args.presets.split(",") if p]
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    print(
        f"{len(jax.devices())} x {jax.devices()[0].device_kind}, NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', '')}",
        file=sys.stderr,
    )
    rows = run(sizes, presets, chunk_counts, args.trials, args.calls)
    meta = {
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE", ""),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    print(
        "| op | MiB/rank | preset | route | library ms | bytes + codec ms | vs parts | speed-up vs bf16 | rel. error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["part"] == "library":
            print(
                f"| {r['op']} | {r['mib_per_rank']:.0f} | {r['preset']} | {r['route']} | {r['ms']:.3f} | "
                f"{r['parts_ms']:.3f} | {r['vs_parts']:.2f} | {r['speedup']:.2f}x | {100 * r['rel_error']:.2f}% |"
            )


if __name__ == "__main__":
    main()
