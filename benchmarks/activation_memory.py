"""Activation memory with sequence parallelism: 8-bit saved inputs vs decoded ones.

Compiles (without running) one training step's loss and gradients of a GPT on a
(1, 1, tensor) mesh with sequence parallelism and reads XLA's buffer assignment
(`compiled.memory_analysis().temp_size_in_bytes`: the live intermediates, activations
saved for the backward pass included) for: uncompressed, compressed with decoded saved
inputs, and compressed with the gathered inputs saved in their 8-bit wire form.

Usage:
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.activation_memory
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import models, strict_json


def temp_bytes(config, mesh, tokens_shape, par: models.Parallelism) -> int:
    specs = models.partition_specs(config)
    params = models.abstract_params(config, mesh)
    tokens = jax.ShapeDtypeStruct(tokens_shape, jnp.int32, sharding=NamedSharding(mesh, P("data")))
    fn = jax.shard_map(
        lambda p, t: models.shard_loss_and_grads(config, p, t, par),
        mesh=mesh,
        in_specs=(specs, P("data")),
        out_specs=(P(), specs),
        check_vma=False,
    )
    return jax.jit(fn).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/activation_memory.json"))
    args = parser.parse_args()
    config = models.GPT2Config(vocab_size=256, max_positions=args.seq, d_model=1024, n_layers=4, n_heads=16, d_ff=4096)
    mesh = tj.make_mesh(1, 1, args.tensor, devices=jax.devices()[: args.tensor])
    taco = tj.TacoConfig.preset("taco", min_bytes=0)
    variants = {
        "off (bf16 collectives)": models.Parallelism(tj.TacoConfig.preset("off"), True, jnp.bfloat16),
        "taco, decoded inputs saved": models.Parallelism(taco, True, jnp.bfloat16, compressed_residuals=False),
        "taco, 8-bit inputs saved": models.Parallelism(taco, True, jnp.bfloat16, compressed_residuals=True),
    }
    shape = (args.batch, args.seq + 1)
    rows = [{"variant": name, "temp_bytes": temp_bytes(config, mesh, shape, par)} for name, par in variants.items()]
    meta = {
        "model": "GPT d=1024 L=4 H=16",
        "tensor": args.tensor,
        "batch": args.batch,
        "seq": args.seq,
        "compute_dtype": "bfloat16",
        "backend": jax.default_backend(),
        "jax": jax.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{meta['model']}, batch {args.batch} x seq {args.seq}, TP={args.tensor} with sequence parallelism, bf16")
    print("| variant | temp memory per device (MiB) |")
    print("|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['temp_bytes'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
