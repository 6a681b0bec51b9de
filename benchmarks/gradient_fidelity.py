"""Gradient fidelity: how far each preset's full gradient is from `off`'s on the same
parameters and batch, beside the minibatch noise SGD lives with. It needs no long run
per preset: one `off` training run supplies the parameters (its checkpoints along the
way), and each preset only computes gradients at them.

At each checkpoint step, per parameter and over all parameters:
  rel_error  |g_preset(b1) - g_off(b1)| / |g_off(b1)|   (same parameters, same batch)
  cosine     cos(g_preset(b1), g_off(b1))
  noise      |g_off(b2) - g_off(b1)| / |g_off(b1)|      (two batches of the run's size)
  floor      |g_off(b1) - g_off(b1)'| / |g_off(b1)|     (the same gradient twice: the
             device's run-to-run non-determinism)
`noise_over_error` = noise / rel_error says how many times larger the minibatch noise is
than what compression adds. Calibrated presets (taco, taco+, int4+H) calibrate on the
checkpoint's parameters first, from the run's calibration_steps batches, as the trainer
does at the start of a run.

Usage (GPU, one device, TP=4 simulated):
  python -m benchmarks.gradient_fidelity --simulate --model gpt2-40m --corpus shakespeare \\
      --steps 1600 --checkpoints 0,400,1600 --lr 3e-4
CPU: XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.gradient_fidelity \\
      --model gpt2-tiny --steps 20 --checkpoints 0,20 --batch-size 8 --seq-len 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

from benchmarks import corpora
from benchmarks.quality import VARIANTS
from taco_jax import strict_json

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("fp8", "taco", "taco+", "int4+H")


def _off_run(args: argparse.Namespace) -> dict:
    """The flat keys of the `off` run whose checkpoints give the parameters."""
    return dict(
        model=args.model,
        data=str(corpora.build(args.corpus, args.runs / "corpora")),
        val_fraction=corpora.VAL_FRACTION,
        mesh=args.mesh,
        simulate_mesh=args.simulate,
        taco="off",
        taco_min_bytes=0,
        steps=args.steps,
        seed=args.seed,
        data_seed=0,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.steps // 10,
        eval_every=args.steps,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.steps // args.checkpoint_every + 1,
        compute_dtype=args.compute_dtype,
        out=str(args.runs / f"fidelity_{args.corpus}_{args.model}_seed{args.seed}_lr{args.lr:g}"),
    )


def gradient_at(cfg, model_config, mesh, params, calibration_batches):
    """batch -> the run's full gradient (a pytree of float64 numpy arrays) with `cfg`'s
    compression, calibrated on `calibration_batches` where the preset calibrates."""
    from taco_jax.calibration import Calibration
    from taco_jax.train import calibrate, compression, trainer

    calibration = Calibration()
    if compression.taco_config(cfg).mode == "taco" and cfg.calibration_steps > 0:
        collector = trainer.observe_batches(cfg, model_config, mesh, params, calibration_batches)
        calibration = calibrate.calibrate_run(cfg, collector, None)
    grads = jax.jit(trainer.make_grads_fn(cfg, model_config, mesh, calibration))
    feedback = compression.init_error_feedback(cfg, model_config, params, mesh)
    return lambda tokens: jax.tree.map(lambda g: np.asarray(g, np.float64), grads(params, tokens, feedback)[1])


def _flat(tree: dict) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): leaf.ravel() for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def compare(got: dict, want: dict) -> dict[str, dict]:
    """Per parameter and "all": relative error of `got` against `want` and their cosine."""
    got, want = _flat(got), _flat(want)
    got["all"], want["all"] = np.concatenate(list(got.values())), np.concatenate(list(want.values()))
    return {
        name: {
            "rel_error": float(np.linalg.norm(got[name] - want[name]) / np.linalg.norm(want[name])),
            "cosine": float(got[name] @ want[name] / (np.linalg.norm(got[name]) * np.linalg.norm(want[name]))),
        }
        for name in want
        if np.linalg.norm(want[name]) > 0
    }


def measure_step(args, off_cfg, model_config, mesh, params, batch_of, train_tokens) -> dict:
    """Every preset's gradient error at one checkpoint, beside the noise and the floor."""
    batches = [batch_of(train_tokens, position, off_cfg.batch_size) for position in range(args.calibration_steps + 2)]
    b1, b2, calibration_batches = batches[0], batches[1], batches[2:]
    off = gradient_at(off_cfg, model_config, mesh, params, calibration_batches)
    reference = off(b1)
    row = {"noise": compare(off(b2), reference), "floor": compare(off(b1), reference), "presets": {}}
    for preset in args.presets:
        cfg = off_cfg.with_keys(**VARIANTS[preset], taco_policy="always", calibration_steps=args.calibration_steps)
        row["presets"][preset] = compare(
            gradient_at(cfg, model_config, mesh, params, calibration_batches)(b1), reference
        )
    return row


def _table(results: dict) -> str:
    lines = [
        "| step | preset | rel. error (all) | cosine (all) | minibatch noise | noise / error | floor | worst parameter |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for step, row in results.items():
        noise, floor = row["noise"]["all"]["rel_error"], row["floor"]["all"]["rel_error"]
        for preset, per in row["presets"].items():
            worst = max((name for name in per if name != "all"), key=lambda n: per[n]["rel_error"])
            error = per["all"]["rel_error"]
            lines.append(
                f"| {step} | {preset} | {error:.2e} | {per['all']['cosine']:.6f} | {noise:.3f} | "
                f"{noise / error:.0f}x | {floor:.1e} | {worst} {per[worst]['rel_error']:.2e} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-40m")
    parser.add_argument("--corpus", default="shakespeare", choices=list(corpora.CORPORA))
    parser.add_argument("--presets", type=lambda s: s.split(","), default=list(PRESETS))
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--checkpoints", type=lambda s: [int(v) for v in s.split(",")], default=[0, 400, 1600])
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--calibration-steps", type=int, default=50)
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument(
        "--mesh", type=lambda s: tuple(int(d) for d in s.split(",")), default=(1, 1, 4), help="DATA,PIPE,TENSOR"
    )
    parser.add_argument("--simulate", action="store_true", help="simulate the mesh on one device (named vmaps)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs/quality")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gradient_fidelity.json")
    args = parser.parse_args()
    unknown = sorted(set(args.presets) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown presets {unknown}; choose from {list(VARIANTS)}")
    args.checkpoint_every = int(np.gcd.reduce([s for s in args.checkpoints if s] or [args.steps]))
    if max(args.checkpoints) > args.steps or min(args.checkpoints) < 0:
        parser.error(f"--checkpoints must lie in 0..{args.steps}, got {args.checkpoints}")

    from taco_jax import models
    from taco_jax.train import data as data_lib
    from taco_jax.train import run_state, trainer
    from taco_jax.train.config import TrainConfig

    off_cfg = TrainConfig.from_keys(**_off_run(args))
    print(f"training off to step {args.steps} ({off_cfg.out})", file=sys.stderr, flush=True)
    trainer.train(off_cfg, resume=any(Path(off_cfg.out, "checkpoints").glob("*")), progress=True)
    mesh = run_state.device_mesh(off_cfg)
    batch_of = data_lib.batch_maker(off_cfg, mesh)
    corpus = data_lib.load(off_cfg.data, val_fraction=off_cfg.val_fraction, tokenizer=off_cfg.tokenizer)
    model_config = models.preset(off_cfg.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items()}
    results = {}
    for step in args.checkpoints:
        if step:
            params = models.shard_params(run_state.restore_params(off_cfg.out, step=step)[2], model_config, mesh)
        else:  # the run's initialization (the trainer keeps no step-0 checkpoint)
            params = models.init_params(model_config, jax.random.key(off_cfg.seed), mesh)
        results[step] = measure_step(args, off_cfg, model_config, mesh, params, batch_of, corpus.train)
        # Written after every checkpoint, so a run cut short keeps what it measured.
        args.out.write_text(
            strict_json.dumps({"settings": settings, "device": jax.devices()[0].device_kind, "steps": results})
        )
        print(f"step {step} measured", file=sys.stderr, flush=True)
    print(_table(results))


if __name__ == "__main__":
    main()
