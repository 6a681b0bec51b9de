"""Generation speed: prefill tokens/s and decode ms/token of `models.generate` per TACO
mode on the devices present (bf16 compute, random weights, greedy).

On one device the collectives move nothing, so the difference between a compressed
mode and `off` is the codec's own cost on the prefill (the decode steps stay plain).
A run of one new token times the prefill; a run of N new tokens adds N - 1 decode
steps, so decode ms/token = (t_N - t_1) / (N - 1). Each is the median of `--repeats`
after a warm-up run that compiles. With --profile, each row also holds the GPU timeline of
one call of N new tokens (`benchmarks.profiling`: busy time by kernel kind, idle time,
the longest kernels), per call and per new token.

Usage:
  python -m benchmarks.generate [--mesh 1,1,1] [--families gpt2,qwen2] [--prompt-len 512] [--batch 4]
      [--new-tokens 65] [--modes off,taco+] [--profile] [--out benchmarks/results/generate.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import taco_jax as tj
from benchmarks.generation_shapes import add_shape_arguments
from benchmarks.generation_shapes import prompts as shape_prompts
from benchmarks.profiling import gpu_timeline
from benchmarks.step import custom_model
from taco_jax import models, strict_json


def _timed(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    config, mesh, mode: str, prompts: list[list[int]], new_tokens: int, repeats: int, profile: bool = False
) -> dict:
    taco = tj.TacoConfig.preset(mode, min_bytes=0) if mode != "off" else None
    params = models.init_params(config, jax.random.key(0), mesh)
    run = lambda n: models.generate(config, params, prompts, mesh=mesh, taco=taco, max_new_tokens=n, dtype=jnp.bfloat16)
    prefill_s = _timed(lambda: run(1), repeats)
    total_s = _timed(lambda: run(new_tokens), repeats)
    tokens = sum(len(p) for p in prompts)
    row = {
        "family": config.family,
        "mode": mode,
        "batch": len(prompts),
        "prompt_len": len(prompts[0]),
        "prefill_ms": 1e3 * prefill_s,
        "prefill_tokens_per_s": tokens / prefill_s,
        "decode_ms_per_token": 1e3 * (total_s - prefill_s) / (new_tokens - 1),
    }
    timeline = gpu_timeline(lambda: run(new_tokens), calls=1) if profile else None
    if timeline:
        row["timeline"] = timeline | {"per_new_token_busy_ms": sum(timeline["busy_ms"].values()) / new_tokens}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="1,1,1")
    add_shape_arguments(parser)
    parser.add_argument("--modes", default="off,taco+")
    parser.add_argument("--profile", action="store_true", help="add the GPU timeline of one call per row")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generate.json"))
    args = parser.parse_args()
    args.seq = args.prompt_len + args.new_tokens
    data, pipe, tensor = (int(d) for d in args.mesh.split(","))
    mesh = tj.make_mesh(data, pipe, tensor, devices=jax.devices()[: data * pipe * tensor])
    prompts = shape_prompts(args).tolist()
    rows = []
    for family in args.families.split(","):
        config = custom_model(family, args)
        for mode in args.modes.split(","):
            row = measure(config, mesh, mode, prompts, args.new_tokens, args.repeats, args.profile)
            rows.append(row)
            print(strict_json.dumps(row), file=sys.stderr, flush=True)
    device = f"{jax.devices()[0].device_kind} x {jax.device_count()}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps({"device": device, "mesh": args.mesh, "rows": rows}, indent=1))
    print(f"| family | mode | prefill ms | prefill tok/s | decode ms/token |  ({device}, mesh {args.mesh})")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['family']} | {r['mode']} | {r['prefill_ms']:.1f} | {r['prefill_tokens_per_s']:.0f} | "
            f"{r['decode_ms_per_token']:.2f} |"
        )


if __name__ == "__main__":
    main()
