"""Training quality per TACO mode: the same model, data order and steps, several seeds.

For each model and mode, trains `--seeds` runs (init seeds 0..n-1, one data order) with
the trainer on a (1, 1, tensor) mesh and reports final train loss (mean of the last 10
steps) and validation loss as mean ± spread (max - min) over seeds, the gap to `off`, and
the seed-to-seed spread of `off` itself: a gap inside that spread is no evidence either
way. Writes JSON, a markdown table and a PNG of the loss curves.

Usage (8 simulated CPU devices are plenty for the tiny presets):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/quality.py \\
      [--models gpt2-tiny,qwen2-tiny] [--modes off,fp8,taco,taco+] [--seeds 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train.config import TrainConfig  # noqa: E402
from train.trainer import train  # noqa: E402


def run(model: str, mode: str, seed: int, steps: int, tensor: int, root: Path) -> dict:
    out = root / f"{model}_{mode}_seed{seed}"
    cfg = TrainConfig(model=model, mesh=(1, 1, tensor), taco=mode, taco_min_bytes=0, steps=steps, seed=seed, data_seed=0,
                      batch_size=16, seq_len=128, eval_every=steps, eval_batches=8, checkpoint_every=steps, out=str(out))
    summary = train(cfg, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"model": model, "mode": mode, "seed": seed, "train_loss": float(np.mean([r["loss"] for r in rows[-10:]])),
            "val_loss": summary["final_val_loss"], "curve": [r["loss"] for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2-tiny,qwen2-tiny")
    parser.add_argument("--modes", default="off,fp8,taco,taco+")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tensor", type=int, default=4)
    parser.add_argument("--runs", type=Path, default=Path("runs/quality"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    results = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            for seed in range(args.seeds):
                results.append(run(model, mode, seed, args.steps, args.tensor, args.runs))
                r = results[-1]
                print(f"  {model} {mode:6s} seed {seed}: train {r['train_loss']:.4f} val {r['val_loss']:.4f}",
                      file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results}))
    lines = ["| model | mode | train loss | val loss | val gap vs off |", "|---|---|---|---|---|"]
    for model in args.models.split(","):
        base = [r["val_loss"] for r in results if r["model"] == model and r["mode"] == "off"]
        for mode in args.modes.split(","):
            train_l = [r["train_loss"] for r in results if r["model"] == model and r["mode"] == mode]
            val_l = [r["val_loss"] for r in results if r["model"] == model and r["mode"] == mode]
            gap = 100 * (np.mean(val_l) / np.mean(base) - 1) if base else float("nan")
            lines.append(f"| {model} | {mode} | {np.mean(train_l):.4f} ± {np.ptp(train_l):.4f} | "
                         f"{np.mean(val_l):.4f} ± {np.ptp(val_l):.4f} | {gap:+.2f}% |")
        if base:
            lines.append(f"| {model} | off seed spread | | {100 * np.ptp(base) / np.mean(base):.2f}% of the mean | |")
    table = "\n".join(lines)
    (args.out / "quality.md").write_text(table + "\n")
    _plot(results, args.out / "quality.png")
    print(table)


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4))
    for ax, model in zip(np.atleast_1d(axes), models):
        for mode in dict.fromkeys(r["mode"] for r in results):
            curves = np.array([r["curve"] for r in results if r["model"] == model and r["mode"] == mode])
            smooth = np.convolve(curves.mean(0), np.ones(10) / 10, mode="valid")
            ax.plot(np.arange(len(smooth)) + 10, smooth, label=mode)
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (mean over seeds, 10-step average)")
        ax.set_ylim(top=3.2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
