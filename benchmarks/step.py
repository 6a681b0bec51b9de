"""Train-step throughput of a GPT: tokens/s and step time per TACO mode on the devices
present, through the trainer's own step function.

On one device (mesh 1,1,1) the collectives move nothing, so the difference between a
compressed mode and `off` is the codec's own cost with every site compressed: the
overhead bound. On several GPUs the same script gives the end-to-end speed-up (run it
with NCCL_P2P_DISABLE=1 for the slow-link proxy).

Usage:
  python -m benchmarks.step [--mesh 1,1,1] [--model PRESET | --families gpt2,qwen2 --d-model 2048] [--layers 16]
      [--seq 2048] [--batch 4] [--modes off,taco,taco+,default] [--remat none] [--scan-layers] [--reference torch] [--steps 10]
      [--profile [--profile-kernels 12]] [--out benchmarks/results/step.json]

Overlap rows: `--modes "off,off+overlap,taco+,taco+ +overlap,default"` (with or without
`--sequence-parallel`) on two GPUs gives `benchmarks/results/step_tp2_overlap_*.json`.

Mode "default" is the trainer's default: its preset with taco_policy=auto (on GPUs a
start-up probe of the link decides which messages are compressed). `--reference torch`
first times the PyTorch step of the same shape on the same GPU
(benchmarks/torch_reference.py, in a subprocess, before JAX takes the GPU's memory) and
adds it as mode "torch". Every row has its MFU: model FLOPs per token (6 x parameters in
matmuls + 12 x layers x d_model x seq for attention, nanoGPT's count) x tokens/s over
the card's dense bf16 peak (`--peak-tflops`, H200/H100 SXM: 989).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from benchmarks import profiling
from taco_jax import models, strict_json
from taco_jax.train import compression, optimizer, trainer
from taco_jax.train.config import TrainConfig


def measure(
    config,
    mesh_shape,
    mode: str,
    batch: int,
    seq: int,
    steps: int,
    sequence_parallel: bool,
    profile_kernels: int = 0,
    remat: str = "none",
    scan_layers: bool = False,
) -> dict:
    # "default": the trainer's defaults (preset and taco_policy, which probes the link);
    # a preset name: that preset with every tensor message compressed; "pipe:PRESET" or
    # "data:PRESET": tensor traffic plain, that axis's traffic with the preset. A
    # "+overlap" suffix runs the tensor-parallel layers as collective matmuls.
    overlap = mode.endswith("+overlap")
    base = mode.removesuffix("+overlap").strip() if overlap else mode
    axis, _, name = base.rpartition(":")
    preset = (
        ({} if base == "default" else {"taco": base, "taco_policy": "always"})
        if not axis
        else {"taco": "off", f"taco_{axis}": name}
    )
    if overlap:
        preset = {**preset, "tp_overlap": "on"}
    cfg = TrainConfig.from_keys(
        model="custom",
        mesh=mesh_shape,
        taco_min_bytes=0,
        batch_size=batch,
        seq_len=seq,
        compute_dtype="bfloat16",
        sequence_parallel=sequence_parallel,
        steps=1000,
        warmup_steps=1,
        remat=remat,
        scan_layers=scan_layers,
        out=tempfile.mkdtemp(prefix="step_"),
        **preset,
    )
    mesh = tj.make_mesh(*mesh_shape)
    tx, _ = optimizer.make_optimizer(cfg, config)
    params, opt_state = optimizer.init_state(config, 0, mesh, tx)
    feedback = compression.init_error_feedback(cfg, config, params, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state, feedback))
    rng = np.random.default_rng(0)
    batches = [
        jax.device_put(
            rng.integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32), NamedSharding(mesh, P("data"))
        )
        for _ in range(2)
    ]
    cfg = trainer.resolve_link_choices(cfg, config, mesh, (params, batches[0], feedback), Path(cfg.out))
    train_step, _ = trainer.make_step_functions(cfg, config, mesh, tx, shardings)
    start = time.perf_counter()
    memory = train_step.lower(params, opt_state, feedback, batches[0], jnp.bool_(False)).compile().memory_analysis()
    params, opt_state, feedback, metrics = train_step(params, opt_state, feedback, batches[0], jnp.bool_(False))
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start  # compile and the first step
    sync_each = jax.default_backend() == "cpu"
    times = []
    for trial in range(3):
        start = time.perf_counter()
        for i in range(steps):
            params, opt_state, feedback, metrics = train_step(
                params, opt_state, feedback, batches[i % 2], jnp.bool_(False)
            )
            if sync_each:
                jax.block_until_ready(metrics)
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - start) / steps)
    step_s = statistics.median(times)
    row = {
        "family": config.family,
        "mode": mode,
        "taco": cfg.compression.tensor.preset,
        "taco_policy": cfg.taco_policy,
        "remat": remat,
        "scan_layers": scan_layers,
        "mesh": list(mesh_shape),
        "step_ms": 1e3 * step_s,
        "tokens_per_s": batch * seq / step_s,
        "compile_s": compile_s,
        "loss": float(np.asarray(metrics["loss"].addressable_shards[0].data)),
        "temp_gib": None if memory is None else memory.temp_size_in_bytes / 2**30,
    }
    if cfg.taco_policy.endswith(".json"):
        row["policy_decisions"] = json.loads(Path(cfg.taco_policy).read_text())["decisions"]
    if profile_kernels:  # 0: no profile; else a timeline listing this many kernels
        state = [params, opt_state, feedback]

        def one_step():
            *state[:], out = train_step(*state, batches[0], jnp.bool_(False))
            return out

        row["profile"] = profiling.gpu_timeline(one_step, calls=3, top=profile_kernels)
    return row


def model_flops_per_token(config, seq: int) -> float:
    """Training FLOPs per token: 6 x parameters in matmuls (the input embedding lookup
    and positions excluded; a tied table counts once, as the head) + attention's
    12 x layers x d_model x seq (nanoGPT's estimate)."""
    sizes = {
        jax.tree_util.keystr(path): int(np.prod(leaf[0]))
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            models.layout(config), is_leaf=models.params.is_layout_leaf
        )[0]
    }
    lookups = sizes.get("['embed']['positions']", 0) + (0 if config.tie_embeddings else sizes["['embed']['tokens']"])
    return 6 * (sum(sizes.values()) - lookups) + 12 * config.n_layers * config.d_model * seq


def custom_model(family: str, args) -> models.ModelConfig:
    """The benchmark's GPT or Qwen2 shape (Qwen2: grouped queries, SwiGLU, untied head)."""
    if family == "gpt2":
        return models.GPT2Config(
            vocab_size=args.vocab,
            max_positions=args.seq,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            d_ff=4 * args.d_model,
        )
    return models.Qwen2Config(
        vocab_size=args.vocab,
        max_positions=args.seq,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        d_ff=args.qwen2_d_ff,
        tie_embeddings=False,
    )


def torch_reference(config, args) -> dict:
    """The PyTorch step of the same shape (benchmarks/torch_reference.py) in a subprocess."""
    script = Path(__file__).resolve().parent / "torch_reference.py"
    command = [
        sys.executable,
        str(script),
        "--family",
        config.family,
        "--vocab",
        str(config.vocab_size),
        "--d-model",
        str(config.d_model),
        "--layers",
        str(config.n_layers),
        "--heads",
        str(config.n_heads),
        "--kv-heads",
        str(config.n_kv_heads),
        "--d-ff",
        str(config.d_ff),
        "--seq",
        str(args.seq),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
    ]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    return {"family": config.family, "mode": "torch", **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="1,1,1")
    parser.add_argument("--model", help="a models preset (e.g. qwen2-7b, gpt2-xl) instead of the custom shapes below")
    parser.add_argument("--families", default="gpt2", help="custom shapes to run: gpt2, qwen2 or both")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4, help="Qwen2 key/value heads")
    parser.add_argument("--qwen2-d-ff", type=int, default=5632, help="Qwen2 MLP width (GPT: 4 x d_model)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument(
        "--modes",
        default="off,taco,taco+,default",
        help="presets (every tensor message compressed), 'default' (the trainer's default "
        "policy), and pipe:PRESET / data:PRESET (that axis's traffic compressed); a '+overlap' "
        "suffix (e.g. off+overlap, 'taco+ +overlap') adds tp_overlap=on",
    )
    parser.add_argument("--remat", default="none", help="activation checkpointing (models.transformer.REMAT_POLICIES)")
    parser.add_argument("--scan-layers", action="store_true", help="run the layers as one scan (default: unrolled)")
    parser.add_argument("--reference", choices=("torch",), help="also time the PyTorch reference step")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the card, for MFU")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--profile", action="store_true", help="add a GPU timeline summary (benchmarks/profiling.py)")
    parser.add_argument("--profile-kernels", type=int, default=12, help="the longest kernels the summary lists")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step.json"))
    args = parser.parse_args()
    mesh_shape = tuple(int(d) for d in args.mesh.split(","))
    configs = [models.preset(args.model)] if args.model else [custom_model(f, args) for f in args.families.split(",")]
    # The references first, before JAX allocates the GPU's memory.
    references = {c.family: torch_reference(c, args) for c in configs} if args.reference else {}
    rows = []
    for config in configs:
        n_params = sum(
            int(np.prod(leaf[0]))
            for leaf in jax.tree.leaves(models.layout(config), is_leaf=models.params.is_layout_leaf)
        )
        print(
            f"{config.family} {n_params / 1e9:.2f}B params, seq {args.seq}, batch {args.batch}, mesh {mesh_shape}, "
            f"{jax.devices()[0].device_kind} x {jax.device_count()}",
            file=sys.stderr,
            flush=True,
        )
        family_rows = [references[config.family]] if config.family in references else []
        for mode in args.modes.split(","):
            family_rows.append(
                measure(
                    config,
                    mesh_shape,
                    mode,
                    args.batch,
                    args.seq,
                    args.steps,
                    args.sequence_parallel,
                    args.profile_kernels if args.profile else 0,
                    args.remat,
                    args.scan_layers,
                )
            )
        flops = model_flops_per_token(config, args.seq)
        for row in family_rows:
            row.update(
                params=n_params, mfu=flops * row["tokens_per_s"] / (args.peak_tflops * 1e12 * jax.device_count())
            )
            print(
                f"  {row['mode']:6s} {row['step_ms']:9.1f} ms/step {row['tokens_per_s']:10.0f} tok/s "
                f"MFU {100 * row['mfu']:.1f}% (compile {row['compile_s']:.0f} s, loss {row['loss']:.3f})",
                file=sys.stderr,
                flush=True,
            )
        rows += family_rows
    meta = {
        "seq": args.seq,
        "batch": args.batch,
        "mesh": list(mesh_shape),
        "remat": args.remat,
        "scan_layers": args.scan_layers,
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "peak_tflops": args.peak_tflops,
        "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE", ""),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("| family | mode | step ms | tokens/s | MFU | vs first |\n|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["family"] == r["family"])["step_ms"]
        print(
            f"| {r['family']} | {r['mode']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | "
            f"{r['step_ms'] / base:.3f}x |"
        )


if __name__ == "__main__":
    main()
