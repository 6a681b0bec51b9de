"""Train-step throughput of a GPT: tokens/s and step time per TACO mode on the devices
present, through the trainer's own step function.

On one device (mesh 1,1,1) the collectives move nothing, so the difference between a
compressed mode and `off` is the codec's own cost with every site compressed: the
overhead bound. On several GPUs the same script gives the end-to-end speed-up (run it
with NCCL_P2P_DISABLE=1 for the slow-link proxy).

Usage:
  python benchmarks/step.py [--mesh 1,1,1] [--model PRESET | --d-model 2048] [--layers 16] [--seq 2048]
      [--batch 4] [--modes off,taco,taco+,default] [--steps 10] [--profile] [--out benchmarks/results/step.json]

Mode "default" is the trainer's default: its preset with taco_policy=auto (on GPUs a
start-up probe of the link decides which messages are compressed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import models  # noqa: E402
import taco_jax as tj  # noqa: E402
from benchmarks import profiling  # noqa: E402
from train import trainer  # noqa: E402
from train.config import TrainConfig  # noqa: E402


def measure(config, mesh_shape, mode: str, batch: int, seq: int, steps: int, sequence_parallel: bool,
            profile: bool = False) -> dict:
    # "default": the trainer's defaults (preset and taco_policy, which probes the link);
    # a preset name: that preset with every message compressed.
    preset = {} if mode == "default" else {"taco": mode, "taco_policy": "always"}
    cfg = TrainConfig(model="custom", mesh=mesh_shape, taco_min_bytes=0, batch_size=batch, seq_len=seq,
                      compute_dtype="bfloat16", sequence_parallel=sequence_parallel, steps=1000, warmup_steps=1,
                      out=tempfile.mkdtemp(prefix="step_"), **preset)
    mesh = tj.make_mesh(*mesh_shape)
    tx, _ = trainer.make_optimizer(cfg, config)
    params, opt_state = trainer.init_state(config, 0, mesh, tx)
    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32),
                              NamedSharding(mesh, P("data"))) for _ in range(2)]
    cfg = trainer.resolve_taco_policy(cfg, config, mesh, params, batches[0], Path(cfg.out))
    train_step, _ = trainer.make_step_functions(cfg, config, mesh, tx, shardings)
    start = time.perf_counter()
    params, opt_state, metrics = train_step(params, opt_state, batches[0], jnp.bool_(False))
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    sync_each = jax.default_backend() == "cpu"
    times = []
    for trial in range(3):
        start = time.perf_counter()
        for i in range(steps):
            params, opt_state, metrics = train_step(params, opt_state, batches[i % 2], jnp.bool_(False))
            if sync_each:
                jax.block_until_ready(metrics)
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - start) / steps)
    step_s = statistics.median(times)
    row = {"mode": mode, "taco": cfg.taco, "taco_policy": cfg.taco_policy, "mesh": list(mesh_shape),
           "step_ms": 1e3 * step_s, "tokens_per_s": batch * seq / step_s,
           "compile_s": compile_s, "loss": float(np.asarray(metrics["loss"].addressable_shards[0].data))}
    if cfg.taco_policy.endswith(".json"):
        row["policy_decisions"] = json.loads(Path(cfg.taco_policy).read_text())["decisions"]
    if profile:
        state = [params, opt_state]

        def one_step():
            state[0], state[1], out = train_step(state[0], state[1], batches[0], jnp.bool_(False))
            return out

        row["profile"] = profiling.gpu_timeline(one_step, calls=3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="1,1,1")
    parser.add_argument("--model", help="a models preset (e.g. qwen2-7b, gpt2-xl) instead of the custom GPT below")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--modes", default="off,taco,taco+,default",
                        help="presets (every message compressed) and 'default' (the trainer's default policy)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--profile", action="store_true", help="add a GPU timeline summary (benchmarks/profiling.py)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step.json"))
    args = parser.parse_args()
    mesh_shape = tuple(int(d) for d in args.mesh.split(","))
    if args.model:
        config = models.preset(args.model)
    else:
        config = models.GPT2Config(vocab_size=args.vocab, max_positions=args.seq, d_model=args.d_model,
                                   n_layers=args.layers, n_heads=args.heads, d_ff=4 * args.d_model)
    n_params = sum(int(np.prod(leaf[0])) for leaf in jax.tree.leaves(
        models.layout(config), is_leaf=models.params.is_layout_leaf))
    print(f"{config.family} {n_params / 1e9:.2f}B params, seq {args.seq}, batch {args.batch}, mesh {mesh_shape}, "
          f"{jax.devices()[0].device_kind} x {jax.device_count()}", file=sys.stderr, flush=True)
    rows = []
    for mode in args.modes.split(","):
        row = measure(config, mesh_shape, mode, args.batch, args.seq, args.steps, args.sequence_parallel, args.profile)
        rows.append(row)
        print(f"  {mode:6s} {row['step_ms']:9.1f} ms/step {row['tokens_per_s']:10.0f} tok/s (compile {row['compile_s']:.0f} s, "
              f"loss {row['loss']:.3f})", file=sys.stderr, flush=True)
    meta = {"params": n_params, "seq": args.seq, "batch": args.batch, "mesh": list(mesh_shape),
            "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "jax": jax.__version__,
            "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE", ""), "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base = rows[0]["step_ms"]
    print(f"| mode | step ms | tokens/s | vs {rows[0]['mode']} |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {100 * (r['step_ms'] / base - 1):+.1f}% |")


if __name__ == "__main__":
    main()
