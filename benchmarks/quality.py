"""Training quality per compression variant: same model, data order and steps, several seeds.

Each run trains with the trainer, on one of the corpora of `benchmarks/corpora.py`
(--corpora: Shakespeare, Python documentation, Python code with a BPE tokenizer), on a
(data, pipe, tensor) mesh (--mesh, default 1,1,4;
simulated as named vmaps on one device with --simulate, which reproduces the mesh's
arithmetic on a single GPU) and
reports the final train loss (mean of the last 20 steps) and validation loss as
mean ± spread (max - min) over seeds, the gap to `off`, the seed-to-seed spread of `off`
itself, and the paired gap: per seed (same init and data order) the relative gap to
that seed's `off` run, mean ± standard error. Seeds pair up, so the paired gap is the
sharper test; a gap inside its error is no evidence either way. Runs go to worker
processes (--jobs) and are appended to the JSON as they finish, so a cut-short
experiment keeps what it measured (--report-only rebuilds the table from it).

Stable regime (--lr-sweep): the quality table must resolve the differences it reports,
and where training is chaotic any perturbation, the device's own run-to-run
non-determinism included, moves the result by as much as a codec does. Before the
panels, each model trains `off` and `off-control` (off again with the same seed) at
every candidate learning rate (--lr-sweep) for the run's steps on the first corpus; the
largest at which every seed's rerun lands within --max-floor percent of its first run
(validation loss) is that model's learning rate for every panel (the sweep, with the
seed-to-seed spread beside it, and the choice are kept in the JSON; its runs are the
panel's). Each panel reports its resolution: the largest standard error of a paired
validation-loss gap among its variants.

Variants:
  off            plain collectives (the reference)
  off-control    off again, same seed (the run-to-run floor)
  fp8            per-group absmax E4M3, no transform (the naive baseline)
  taco           E4M3 + Hadamard + dual scales, calibrated (the authors' method)
  taco+          INT8 + Hadamard + bf16 scales, calibrated
  taco-noreshape taco without calibration (identity permutation, transform everywhere)
  taco-e5m2bwd   taco with E5M2 activation gradients
  int4           INT4 absmax, no transform (4-bit control: can the experiment see a codec?)
  int4+H         INT4 + Hadamard + bf16 scales, calibrated
  int4+H-G32     the same with groups of 32 (more scales: does it recover the loss?)
  int4fwd-int8bwd / int8fwd-int4bwd
                 4 bits in one direction only (taco+ in the other): which direction
                 can afford them
Beyond the tensor axis (tensor traffic plain; use a mesh with pipe and data > 1):
  pipe-taco / pipe-taco+   pipeline-stage sends compressed
  data-taco / data-taco+   data-parallel gradient reduction compressed, error feedback
  data-int4+H              4-bit gradients (INT4 + Hadamard, bf16 scales), error feedback
  all-taco+                taco+ on every axis
Below 8 bits (calibrated like taco+):
  e2m3 / e3m2    the 6-bit OCP MX floats, groups of 128, bf16 scales (38.3% of bf16's bytes)
  e2m1           the 4-bit OCP MX float, groups of 32, E8M0 scales (MXFP4, 26.6%)
  taco4          the 4-bit preset: INT4, groups of 32, bf16 scales (28.1%)
  taco4-sr       taco4 with stochastic rounding of the gradient messages
  taco+mixed     per site and direction the fewest bits within 1.5x E4M3's error
Per direction (activations forward, activation gradients backward):
  taco6-4              the preset: E2M3 G128 forward, INT4 G32 backward (33.2% of bf16's bytes)
  e2m3fwd-int4bwd      the same written as specs
  e2m3fwd-int4g16bwd   E2M3 G128 forward, INT4 G16 backward (34.8%)
  int4g16fwd-int4bwd   INT4 G16 forward, INT4 G32 backward (29.7%)
Five bits:
  int5                 INT5 G32 both ways, bf16 scales (34.4%)

Usage (GPU, one device):
  python -m benchmarks.quality --simulate --models gpt2-mini,qwen2-mini --seeds 3 --jobs 4
  python -m benchmarks.quality --simulate --mesh 2,2,2 --microbatches 2 --tag pipe_data \
      --variants off,pipe-taco,pipe-taco+,data-taco,data-taco+,data-int4+H,all-taco+ --seeds 5 --jobs 10
  python -m benchmarks.quality --simulate --tag corpora --corpora python-code,python-docs,shakespeare \
      --models gpt2-40m,qwen2-40m --variants off,fp8,taco,taco+,int4+H --seeds 4 --steps 400 --jobs 12
  python -m benchmarks.quality --simulate --tag stable --corpora shakespeare,python-docs,python-code \
      --models gpt2-40m,qwen2-40m --variants off,off-control,fp8,taco,taco+,int4+H --seeds 3 \
      --steps 1600 --batch-size 8 --seq-len 128 --lr-sweep 1e-3,6e-4,3e-4 --jobs 12
  python -m benchmarks.quality --simulate --tag bits --corpora shakespeare,python-docs,python-code \
      --models gpt2-40m,qwen2-40m --variants off,taco+,taco+mixed,taco6-4,taco4,int4g16fwd-int4bwd --seeds 3 \
      --steps 1600 --batch-size 8 --seq-len 128 --lr 1.5e-4 --jobs 18
CPU: XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.quality \\
      --models gpt2-tiny --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import BinaryIO

import numpy as np

from benchmarks import corpora
from taco_jax import strict_json

ROOT = Path(__file__).resolve().parent.parent

VARIANTS: dict[str, dict] = {
    "off": {"taco": "off"},
    "off-control": {"taco": "off"},
    "fp8": {"taco": "fp8"},
    "taco": {"taco": "taco"},
    "taco+": {"taco": "taco+"},
    "taco-noreshape": {"taco": "taco", "calibration_steps": 0},
    "taco-e5m2bwd": {"taco": "taco", "taco_backward": "e5m2:128:H:dual"},
    "int4": {"taco": "fp8", "taco_forward": "int4:128:-:single", "taco_backward": "int4:128:-:single"},
    "int4+H": {"taco": "taco+", "taco_forward": "int4:128:H:bf16", "taco_backward": "int4:128:H:bf16"},
    "int4+H-G32": {"taco": "taco+", "taco_forward": "int4:32:H:bf16", "taco_backward": "int4:32:H:bf16"},
    "int4fwd-int8bwd": {"taco": "taco+", "taco_forward": "int4:128:H:bf16"},
    "int8fwd-int4bwd": {"taco": "taco+", "taco_backward": "int4:128:H:bf16"},
    "pipe-taco": {"taco": "off", "taco_pipe": "taco"},
    "pipe-taco+": {"taco": "off", "taco_pipe": "taco+"},
    "data-taco": {"taco": "off", "taco_data": "taco"},
    "data-taco+": {"taco": "off", "taco_data": "taco+"},
    "data-int4+H": {"taco": "off", "taco_data": "taco+", "taco_data_backward": "int4:128:H:bf16"},
    "all-taco+": {"taco": "taco+", "taco_pipe": "taco+", "taco_data": "taco+"},
    "e2m3": {"taco": "taco+", "taco_forward": "e2m3:128:H:bf16", "taco_backward": "e2m3:128:H:bf16"},
    "e3m2": {"taco": "taco+", "taco_forward": "e3m2:128:H:bf16", "taco_backward": "e3m2:128:H:bf16"},
    "e2m1": {"taco": "taco+", "taco_forward": "e2m1:32:H:e8m0", "taco_backward": "e2m1:32:H:e8m0"},
    "taco4": {"taco": "taco4"},
    "taco4-sr": {"taco": "taco4", "taco_backward": "int4:32:H:bf16:sr"},
    "taco+mixed": {"taco": "taco+mixed"},
    "taco6-4": {"taco": "taco6-4"},
    # Per direction: 6-bit activations, 4-bit activation gradients, and 4-bit forward forms.
    "e2m3fwd-int4bwd": {"taco": "taco+", "taco_forward": "e2m3:128:H:bf16", "taco_backward": "int4:32:H:bf16"},
    "e2m3fwd-int4g16bwd": {"taco": "taco+", "taco_forward": "e2m3:128:H:bf16", "taco_backward": "int4:16:H:bf16"},
    "int4g16fwd-int4bwd": {"taco": "taco+", "taco_forward": "int4:16:H:bf16", "taco_backward": "int4:32:H:bf16"},
    # 5 bits: INT5 G32 both ways (34.4% of bf16's bytes).
    "int5": {"taco": "taco+", "taco_forward": "int5:32:H:bf16", "taco_backward": "int5:32:H:bf16"},
}


def train_one(args: argparse.Namespace, corpus: str, model: str, variant: str, seed: int, lr: float) -> dict:
    """One run in this process; returns its result row."""
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.trainer import train

    out = args.runs / f"{corpus}_{model}_{variant}_seed{seed}_lr{lr:g}"
    # The results JSON is the record of finished runs: a directory without a row there
    # is a run that failed (out of memory, say) and is trained again from the start.
    shutil.rmtree(out, ignore_errors=True)
    data = corpora.build(corpus, args.runs / "corpora")
    settings = dict(
        model=model,
        data=str(data),
        val_fraction=corpora.VAL_FRACTION,
        mesh=args.mesh,
        microbatches=args.microbatches,
        simulate_mesh=args.simulate,
        taco_min_bytes=0,
        steps=args.steps,
        seed=seed,
        data_seed=0,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=lr,
        warmup_steps=args.steps // 10,
        eval_every=args.steps,
        eval_batches=args.eval_batches,
        checkpoint_every=args.steps,
        keep_checkpoints=1,
        calibration_steps=args.calibration_steps,
        compute_dtype=args.compute_dtype,
        out=str(out),
    )
    cfg = TrainConfig.from_keys(**{**settings, **VARIANTS[variant]})
    summary = train(cfg, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {
        "corpus": corpus,
        "model": model,
        "variant": variant,
        "seed": seed,
        "lr": lr,
        "train_loss": float(np.mean([r["loss"] for r in rows[-20:]])),
        "val_loss": summary["final_val_loss"],
        "curve": [r["loss"] for r in rows],
        "seconds": summary["seconds"],
        "wire_bytes_by_axis": summary["wire_bytes_by_axis"],
        "wire_bytes_bf16_by_axis": summary["wire_bytes_bf16_by_axis"],
    }
    calibration = out / "calibration.json"
    if calibration.exists():
        result["calibration_report"] = json.loads(calibration.read_text())["report"]
    return result


def _check_budget(args: argparse.Namespace, corpus: str) -> dict:
    """Build the corpus; its description, with the epochs a run takes of its train split.

    Raises:
      ValueError: a run would see more than one epoch.
    """
    tokens = np.load(corpora.build(corpus, args.runs / "corpora"), mmap_mode="r")
    train_tokens = int(len(tokens) * (1 - corpora.VAL_FRACTION))
    epochs = args.steps * args.batch_size * args.seq_len / train_tokens
    if epochs > 1:
        raise ValueError(
            f"{args.steps} steps x {args.batch_size} x {args.seq_len} tokens are {epochs:.2f} epochs of "
            f"{corpus} ({train_tokens} train tokens): take fewer steps"
        )
    return corpora.describe(corpus, tokens) | {"steps": args.steps, "epochs_per_run": round(epochs, 3)}


def _spawn(args: argparse.Namespace, corpus: str, model: str, variant: str, seed: int, lr: float) -> dict:
    env = dict(os.environ)
    if args.jobs > 1:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / args.jobs:.2f}")
    forwarded = [a for a in sys.argv[1:] if a != "--report-only"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.quality", *forwarded, "--one", corpus, model, variant, str(seed), repr(lr)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"{corpus} {model} {variant} seed {seed} lr {lr:g} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _corpus(run: dict) -> str:
    return run.get("corpus", "shakespeare")  # runs measured before the corpora were named


def report(results: list[dict], models: list[str], variants: list[str], out: Path, name: str, mesh: str) -> str:
    """Markdown table per corpus x model x variant; writes NAME.md and NAME.png next to
    the JSON."""
    text, panels = table(results, models, variants)
    (out / f"{name}.md").write_text(text + "\n")
    plot(results, panels, variants, out / f"{name}.png", mesh)
    return text


def chosen_runs(record: dict) -> list[dict]:
    """The runs of a results file at each model's chosen learning rate (all runs where
    no learning rate was swept; runs measured before runs named theirs take the file's)."""
    settings = record["settings"]
    runs = [{"lr": float(settings["lr"]), **r} for r in record["runs"]]
    if not settings.get("lr_sweep"):
        return runs
    models = settings["models"].split(",")
    lrs = _learning_rates(settings["lr_sweep"], models, float(settings["lr"]))
    return [r for r in runs if r["model"] in lrs and r["lr"] == lrs[r["model"]]]


def table(results: list[dict], models: list[str], variants: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The Markdown table per corpus x model x variant (paired val-loss gaps above +0.3%
    in bold), and the (corpus, model) panels it holds."""
    lines = [
        "| corpus | model | variant | seeds | train loss | val loss | val gap vs off | paired val gap | "
        "paired train gap | bytes vs bf16 per axis |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    panels = []
    for corpus in dict.fromkeys(_corpus(r) for r in results):
        for model in models:
            mine = [r for r in results if _corpus(r) == corpus and r["model"] == model]
            base = {r["seed"]: r for r in mine if r["variant"] == "off"}
            if mine:
                panels.append((corpus, model))
            for variant in variants:
                runs = [r for r in mine if r["variant"] == variant]
                if not runs:
                    continue
                train_l, val_l = [r["train_loss"] for r in runs], [r["val_loss"] for r in runs]
                gap = (
                    f"{100 * (np.mean(val_l) / np.mean([r['val_loss'] for r in base.values()]) - 1):+.2f}%"
                    if base
                    else "n/a"
                )
                lines.append(
                    f"| {corpus} | {model} | {variant} | {len(runs)} | {np.mean(train_l):.4f} ± {np.ptp(train_l):.4f} | "
                    f"{np.mean(val_l):.4f} ± {np.ptp(val_l):.4f} | {gap} | {_paired(runs, base, 'val_loss', flag=0.3)} | "
                    f"{_paired(runs, base, 'train_loss')} | {_bytes(runs[0])} |"
                )
            if len(base) > 1:
                spread = np.ptp([r["val_loss"] for r in base.values()]) / np.mean(
                    [r["val_loss"] for r in base.values()]
                )
                lr = next(iter(base.values()))["lr"]
                lines.append(
                    f"| {corpus} | {model} | off seed spread (max - min), lr {lr:g} | | | "
                    f"{100 * spread:.2f}% of the mean | | | | |"
                )
                lines.append(f"| {corpus} | {model} | {_resolution(mine, base)} | | | | | | | |")
    return "\n".join(lines), panels


def _resolution(runs: list[dict], base: dict, target: float = 0.1) -> str:
    """The panel's resolution: the largest standard error of a paired validation-loss gap
    among its compressed variants, against `target` percent."""
    errors = {}
    for variant in dict.fromkeys(r["variant"] for r in runs if r["variant"] != "off"):
        gaps = _paired_gaps([r for r in runs if r["variant"] == variant], base, "val_loss")
        if len(gaps) > 1:
            errors[variant] = _standard_error(gaps)
    if not errors:
        return "resolution n/a (fewer than 2 paired seeds)"
    worst = max(errors, key=errors.__getitem__)
    verdict = "resolves" if errors[worst] <= target else "does not resolve"
    return f"resolution {errors[worst]:.3f}% (s.e., {worst}): {verdict} {target}%"


def _bytes(run: dict) -> str:
    """Bytes sent per axis as a share of the same traffic in bf16, e.g. "tensor 51%"."""
    if "wire_fraction" in run:  # runs measured before the per-axis counts: tensor traffic only
        return f"tensor {100 * run['wire_fraction']:.0f}%"
    sent, bf16 = run["wire_bytes_by_axis"], run["wire_bytes_bf16_by_axis"]
    return ", ".join(f"{axis} {100 * sent[axis] / bf16[axis]:.0f}%" for axis in sent if bf16[axis])


def _paired_gaps(runs: list[dict], base: dict, key: str) -> list[float]:
    """Per seed, the relative gap (percent) of `key` to that seed's `off` run."""
    return [100 * (r[key] / base[r["seed"]][key] - 1) for r in runs if r["seed"] in base]


def _standard_error(gaps: list[float]) -> float:
    return float(np.std(gaps, ddof=1) / np.sqrt(len(gaps)))


def _paired(runs: list[dict], base: dict, key: str, flag: float | None = None) -> str:
    """Mean ± standard error of the per-seed relative gap to `off` (same init and data),
    in bold where the mean exceeds `flag` percent."""
    gaps = _paired_gaps(runs, base, key)
    if len(gaps) < 2:
        return "n/a"
    text = f"{np.mean(gaps):+.2f} ± {_standard_error(gaps):.2f}%"
    return f"**{text}**" if flag is not None and np.mean(gaps) > flag else text


def plot(
    results: list[dict], panels: list[tuple[str, str]], variants: list[str], path: Path | BinaryIO, title: str
) -> None:
    """Per (corpus, model): loss curves (top) and the paired gap to `off` along training
    (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    smooth = lambda y: np.convolve(y, np.ones(20) / 20, mode="valid")
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 8), squeeze=False)
    for column, (corpus, model) in enumerate(panels):
        mine = [r for r in results if _corpus(r) == corpus and r["model"] == model]
        base = {r["seed"]: np.asarray(r["curve"]) for r in mine if r["variant"] == "off"}
        tops = []
        for index, variant in enumerate(variants):
            runs = [r for r in mine if r["variant"] == variant]
            if not runs:
                continue
            style = dict(
                label=variant, lw=1, color=plt.get_cmap("tab20")(index % 20), ls="--" if "int4" in variant else "-"
            )
            curve = smooth(np.mean([r["curve"] for r in runs], axis=0))
            steps = np.arange(len(curve)) + 20
            axes[0, column].plot(steps, curve, **style)
            tops.append(curve[len(curve) // 6])
            paired = [100 * (np.asarray(r["curve"]) / base[r["seed"]] - 1) for r in runs if r["seed"] in base]
            if paired:
                axes[1, column].plot(steps, smooth(np.mean(paired, axis=0)), **style)
        axes[0, column].set_title(f"{corpus}, {model}, mesh {title}")
        axes[0, column].set_ylabel("train loss (mean over seeds, 20-step average)")
        if tops:
            axes[0, column].set_ylim(top=max(tops))
        axes[1, column].set_ylabel("paired train-loss gap to off, % (20-step average)")
        axes[1, column].axhline(0, color="black", lw=0.5)
        for ax in axes[:, column]:
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", default="shakespeare", help=f"comma-separated, from {list(corpora.CORPORA)}")
    parser.add_argument("--models", default="gpt2-mini,qwen2-mini")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--calibration-steps", type=int, default=50)
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument(
        "--mesh", type=lambda s: tuple(int(d) for d in s.split(",")), default=(1, 1, 4), help="DATA,PIPE,TENSOR"
    )
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--tag", default="", help="write quality_TAG.{json,md,png}")
    parser.add_argument("--simulate", action="store_true", help="simulate the mesh on one device (named vmaps)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs in parallel (worker processes, each given 0.9/jobs of the GPU memory: on one H200, 18 runs of "
        "the 40M models fit, 24 ran out of memory while autotuning)",
    )
    parser.add_argument("--runs", type=Path, default=ROOT / "runs/quality")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the JSON")
    parser.add_argument(
        "--lr-sweep",
        type=lambda s: sorted((float(v) for v in s.split(",")), reverse=True),
        default=None,
        help="candidate learning rates: each model takes the largest whose off-control is within --max-floor of off",
    )
    parser.add_argument("--sweep-seeds", type=int, default=0, help="seeds per swept lr (0: --seeds)")
    parser.add_argument(
        "--max-floor", type=float, default=0.1, help="percent: largest |off-control / off - 1| a swept lr may show"
    )
    parser.add_argument("--one", nargs=5, metavar=("CORPUS", "MODEL", "VARIANT", "SEED", "LR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(strict_json.dumps(train_one(args, *args.one[:3], int(args.one[3]), float(args.one[4]))))
        return
    names, models, variants = args.corpora.split(","), args.models.split(","), args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"quality_{args.tag}" if args.tag else "quality"
    path = args.out / f"{name}.json"
    earlier = json.loads(path.read_text()) if path.exists() else {"settings": {}, "runs": []}
    results = earlier["runs"]
    for run in results:  # runs measured before the learning rate was recorded per run
        run.setdefault("lr", float(earlier["settings"].get("lr", args.lr)))
    sweep = earlier["settings"].get("lr_sweep", {})
    if not args.report_only:
        try:
            described = {c: _check_budget(args, c) for c in names}
        except ValueError as error:
            parser.error(str(error))
        # Corpora measured by earlier invocations keep their own description (steps, epochs).
        described = earlier["settings"].get("corpora", {}) | described
        settings = {k: str(v) for k, v in vars(args).items() if k not in ("one", "report_only")} | {
            "corpora": described
        }
        settings["lr_sweep"] = sweep
        settings |= {key: ",".join(listed) for key, listed in _pieces(earlier["settings"], args).items()}
        run = lambda todo: _run_all(args, todo, results, path, settings)
        if args.lr_sweep:
            controls = ("off", "off-control")
            run(
                [
                    (names[0], m, v, s, lr)
                    for m in models
                    for lr in args.lr_sweep
                    for s in range(args.sweep_seeds or args.seeds)
                    for v in controls
                ]
            )
            sweep |= {m: sweep_learning_rate(results, names[0], m, args, sweep.get(m, {})) for m in models}
        lrs = _learning_rates(sweep, models, args.lr)
        run([(c, m, v, s, lrs[m]) for c in names for s in range(args.seeds) for m in models for v in variants])
    shown = _pieces(earlier["settings"], args)
    lrs = _learning_rates(sweep, shown["models"], args.lr)
    chosen = [r for r in results if r["model"] in lrs and r["lr"] == lrs[r["model"]]]
    print(report(chosen, shown["models"], shown["variants"], args.out, name, ",".join(map(str, args.mesh))))


def _pieces(earlier: dict, args: argparse.Namespace) -> dict[str, list[str]]:
    """The models and variants of a panel run in pieces: every earlier piece's (in the
    file's settings) and this invocation's, in first-seen order. The report shows them
    all, so that a piece's invocation does not hide the runs of the others."""
    return {
        key: list(dict.fromkeys(n for n in [*earlier.get(key, "").split(","), *getattr(args, key).split(",")] if n))
        for key in ("models", "variants")
    }


def _run_all(args: argparse.Namespace, todo: list[tuple], results: list[dict], path: Path, settings: dict) -> None:
    """Train the runs of `todo` not in `results` yet, in --jobs worker processes,
    appending each to `results` and to the JSON as it finishes."""
    done = {(_corpus(r), r["model"], r["variant"], r["seed"], r["lr"]) for r in results}
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_spawn, args, *key) for key in dict.fromkeys(todo) if key not in done]
        for future in as_completed(futures):
            try:
                result = future.result()
            except RuntimeError as error:  # keep the other runs going; the table shows what finished
                print(error, file=sys.stderr, flush=True)
                continue
            results.append(result)
            path.write_text(strict_json.dumps({"settings": settings, "runs": results}))
            print(
                f"  {result['corpus']} {result['model']} {result['variant']:15s} seed {result['seed']} "
                f"lr {result['lr']:g}: train {result['train_loss']:.4f} val {result['val_loss']:.4f} "
                f"({result['seconds']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    path.write_text(strict_json.dumps({"settings": settings, "runs": results}))


def sweep_learning_rate(results: list[dict], corpus: str, model: str, args: argparse.Namespace, earlier: dict) -> dict:
    """The largest candidate learning rate at which every seed's `off-control` validation
    loss is within --max-floor percent of its `off` run (the smallest if none is), with
    each candidate's floor (the largest such gap) and seed-to-seed spread of `off`.

    The candidates are --lr-sweep and those of the `earlier` sweep record of this model,
    so that a sweep continued at new rates keeps the rates measured before."""
    measured = earlier.get("floor_percent", {}) | earlier.get("spread_percent", {})
    candidates = sorted(set(args.lr_sweep) | {float(lr) for lr in measured}, reverse=True)
    floors, spreads = {}, {}
    for lr in candidates:
        mine = [
            r
            for r in results
            if (_corpus(r), r["model"], r["lr"]) == (corpus, model, lr) and r["seed"] < (args.sweep_seeds or args.seeds)
        ]
        base = {r["seed"]: r for r in mine if r["variant"] == "off"}
        gaps = _paired_gaps([r for r in mine if r["variant"] == "off-control"], base, "val_loss")
        floors[lr] = float(np.max(np.abs(gaps))) if len(gaps) == (args.sweep_seeds or args.seeds) else float("nan")
        losses = [r["val_loss"] for r in base.values()]
        spreads[lr] = 100 * float(np.ptp(losses) / np.mean(losses)) if len(losses) > 1 else float("nan")
    stable = [lr for lr in candidates if floors[lr] <= args.max_floor]
    chosen = max(stable) if stable else min(candidates)
    print(
        f"lr sweep {model} on {corpus}: "
        + ", ".join(f"{lr:g} floor {floors[lr]:.2f}% spread {spreads[lr]:.2f}%" for lr in candidates)
        + f" -> {chosen:g}"
        + ("" if stable else f" (none within {args.max_floor}%)"),
        file=sys.stderr,
        flush=True,
    )
    return {
        "corpus": corpus,
        "floor_percent": {f"{lr:g}": v for lr, v in floors.items()},
        "spread_percent": {f"{lr:g}": v for lr, v in spreads.items()},
        "chosen": chosen,
        "stable": bool(stable),
    }


def _learning_rates(sweep: dict, models: list[str], default: float) -> dict[str, float]:
    return {m: float(sweep[m]["chosen"]) if m in sweep else default for m in models}


if __name__ == "__main__":
    main()
