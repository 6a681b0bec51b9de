"""Codec error on tensors captured from trained models: every format, transform, scale
format and group size, on what the tensor-parallel sites really send.

Trains each model with plain collectives (or reuses the run in --runs), then observes
--batches forward/backward passes with a compressing config (`train.trainer.observe_batches`):
per site and direction a sample of the rows each rank would send (partial sums and
sequence shards forward, activation gradients backward). Each spec's single round-trip
error is measured on every sample; the table gives the median over the sites of the
relative RMSE and of the median per-channel relative error, forward and backward.
"calibrated" rows choose the permutation and transform per site as calibration does
(without the gain bar).

Usage (GPU):  python -m benchmarks.captured_error --simulate [--models gpt2-mini,qwen2-mini]
              python -m benchmarks.captured_error --simulate --models gpt2-40m,qwen2-40m \
                  --corpus python-code --steps 400 --tag python-code
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
import taco_jax as tj
from benchmarks import corpora
from taco_jax import calibration, strict_json
from taco_jax.train import data as data_lib
from taco_jax.train import run_state, trainer
from taco_jax.train.config import TrainConfig

SPECS = {
    "e4m3 (fp8)": "e4m3:128:-:single",
    "e4m3 + H (taco)": "e4m3:128:H:dual",
    "e5m2": "e5m2:128:-:single",
    "e5m2 + H": "e5m2:128:H:dual",
    "int8": "int8:128:-:bf16",
    "int8 + H (taco+)": "int8:128:H:bf16",
    "int4": "int4:128:-:single",
    "int4 + H": "int4:128:H:bf16",
    "e4m3, dual scales": "e4m3:128:-:dual",
    "e4m3, bf16 scales": "e4m3:128:-:bf16",
    "e4m3, e8m0 scales": "e4m3:128:-:e8m0",
    "int8 + H, dual scales": "int8:128:H:dual",
    "int8 + H, single scales": "int8:128:H:single",
    "int8 + H, e8m0 scales": "int8:128:H:e8m0",
    "e4m3, G=64": "e4m3:64:-:single",
    "e4m3, G=256": "e4m3:256:-:single",
    "int8 + H, G=64": "int8:64:H:bf16",
    "int8 + H, G=256": "int8:256:H:bf16",
}
CALIBRATED = {
    "e4m3 calibrated": "e4m3:128:H:dual",
    "int8 calibrated": "int8:128:H:bf16",
    "int4 calibrated": "int4:128:H:bf16",
}


def capture(args: argparse.Namespace, model: str) -> tj.calibration.Collector:
    """Train `model` uncompressed on the corpus (unless its run exists), then observe it
    compressing."""
    run_dir = args.runs / f"{args.corpus}_{model}_off"
    data = corpora.build(args.corpus, args.runs / "corpora")
    common = dict(
        model=model,
        data=str(data),
        val_fraction=corpora.VAL_FRACTION,
        mesh=(1, 1, args.tensor),
        simulate_mesh=args.simulate,
        taco_min_bytes=0,
        steps=args.steps,
        seed=0,
        batch_size=16,
        seq_len=256,
        lr=1e-3,
        warmup_steps=args.steps // 10,
        eval_every=args.steps,
        checkpoint_every=args.steps,
        keep_checkpoints=1,
        compute_dtype="bfloat16",
        out=str(run_dir),
    )
    trained = TrainConfig.from_keys(**common, taco="off")
    if not (run_dir / "summary.json").exists():
        trainer.train(trained, progress=False)
    observing = trained.with_keys(taco="taco", calibration_steps=args.batches)
    run = run_state.start_run(observing, resume=True)
    batch_of = data_lib.batch_maker(observing, run.mesh)
    batches = [batch_of(run.corpus.val, 10**6 + i, observing.batch_size) for i in range(args.batches)]
    collector = trainer.observe_batches(observing, run.model_config, run.mesh, run.params, batches)
    run.checkpoints.close()
    return collector


def errors(collector: tj.calibration.Collector) -> list[dict]:
    rows = []
    for site, direction in collector.keys():
        sample = collector.sample((site, direction))
        for label, text in SPECS.items():
            spec = tj.QuantSpec.parse(text)
            if sample.shape[-1] % spec.group_size:
                continue
            error = calibration.codec_error(sample, spec, np.arange(sample.shape[-1]))
            rows.append({"site": site, "direction": direction, "spec": label, **error})
        for label, text in CALIBRATED.items():
            plan, report = calibration.calibrate_site(
                sample, tj.QuantSpec.parse(text), rms=collector.rms((site, direction)), min_gain=0.0
            )
            best = min(report, key=lambda r: (r["channel_median"], r["rel_rmse"]))
            rows.append(
                {
                    "site": site,
                    "direction": direction,
                    "spec": label,
                    "rel_rmse": best["rel_rmse"],
                    "channel_median": best["channel_median"],
                    "choice": f"{best['strategy']}{'+H' if best['hadamard'] else ''}",
                }
            )
    return rows


def table(results: dict[str, list[dict]]) -> str:
    labels = [*SPECS, *CALIBRATED]
    head = "| spec | " + " | ".join(f"{m} fwd | {m} bwd" for m in results) + " |"
    lines = [head, "|---|" + "---|" * (2 * len(results))]
    for label in labels:
        cells = []
        for rows in results.values():
            for direction in ("forward", "backward"):
                picked = [r for r in rows if r["spec"] == label and r["direction"] == direction]
                if not picked:
                    cells.append("n/a")
                    continue
                rel = 100 * np.median([r["rel_rmse"] for r in picked])
                chan = 100 * np.median([r["channel_median"] for r in picked])
                cells.append(f"{rel:.2f}% / {chan:.2f}%")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2-mini,qwen2-mini")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--tensor", type=int, default=4)
    parser.add_argument("--simulate", action="store_true", help="simulate the mesh on one device (named vmaps)")
    parser.add_argument("--corpus", default="shakespeare", help=f"one of {list(corpora.CORPORA)}")
    parser.add_argument("--tag", default="", help="write captured_error_TAG.{json,md}")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs/captured")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = parser.parse_args()
    results = {}
    for model in args.models.split(","):
        results[model] = errors(capture(args, model))
        print(f"  {model}: {len(results[model])} measurements", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    name = f"captured_error_{args.tag}" if args.tag else "captured_error"
    (args.out / f"{name}.json").write_text(strict_json.dumps(results))
    (args.out / f"{name}.md").write_text(
        f"Corpus {args.corpus}. Relative RMSE / median per-channel relative error, "
        "median over sites (one round trip)\n\n" + text + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
