"""What compressing the tensor-parallel messages does to inference: per preset, the
perplexity of held-out text through the compressed forward (prefill) and the agreement
of greedy continuations with the uncompressed model's, on a trained model.

For each preset, against `off` on the same parameters and mesh:
  ppl_change     perplexity / off's perplexity - 1, over --windows held-out windows of
                 --window tokens (every position scored; `models.logits`)
  agreement      the share of continuation positions where the greedy token equals
                 off's (`models.generate`, prefill compressed, decode plain as by default)
  first_split    mean number of tokens until a continuation first differs from off's
Prompts are --prompts held-out windows of --prompt-len tokens, continued by --new-tokens.
Compressed without calibration (identity channel order, the preset's transform).

Usage (a trainer run; held-out text from its validation split):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.generation_quality \\
      --run runs/default --mesh 1,1,4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

import taco_jax as tj
from benchmarks.quality import VARIANTS
from taco_jax import models, strict_json

PRESETS = ("off", "fp8", "taco", "taco+", "int4+H")


def perplexity(config, params, windows: np.ndarray, mesh, taco) -> float:
    """exp of the mean next-token cross-entropy over every position of `windows`."""
    logits = np.asarray(models.logits(config, params, windows[:, :-1], mesh=mesh, taco=taco), np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(log_probs, windows[:, 1:, None], axis=-1)
    return float(np.exp(-picked.mean()))


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, float]:
    """(share of positions with equal tokens, mean tokens until the first difference)."""
    equal = [np.asarray(g) == np.asarray(w) for g, w in zip(got, want, strict=True)]
    first = [int(np.argmin(e)) if not e.all() else len(e) for e in equal]
    return float(np.mean(np.concatenate(equal))), float(np.mean(first))


def held_out(tokens: np.ndarray, count: int, length: int, seed: int = 0) -> np.ndarray:
    """`count` windows of `length` tokens at seeded offsets of the validation split."""
    offsets = np.random.default_rng(seed).integers(0, len(tokens) - length, count)
    return np.stack([np.asarray(tokens[o : o + length], np.int32) for o in offsets])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="trainer run directory (its newest checkpoint)")
    parser.add_argument("--mesh", default="1,1,4")
    parser.add_argument("--presets", type=lambda s: s.split(","), default=list(PRESETS))
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generation_quality.json"))
    args = parser.parse_args()
    if args.presets[0] != "off" or not set(args.presets) <= set(VARIANTS):
        parser.error(f"--presets must start with off and come from {list(VARIANTS)}")

    from taco_jax.train import compression, run_state
    from taco_jax.train import data as data_lib

    cfg, config, params, step = run_state.restore_params(args.run)
    corpus = data_lib.load(cfg.data, val_fraction=cfg.val_fraction, tokenizer=cfg.tokenizer, dtype=cfg.data_dtype)
    data, pipe, tensor = (int(d) for d in args.mesh.split(","))
    mesh = tj.make_mesh(data, pipe, tensor, devices=jax.devices()[: data * pipe * tensor])
    windows = held_out(corpus.val, args.windows, args.window + 1)
    prompts = held_out(corpus.val, args.prompts, args.prompt_len, seed=1).tolist()
    rows, reference = [], {}
    for preset in args.presets:
        # The run's tensor compression under the variant's keys, every message compressed
        # (no calibration: identity permutations, the transform where the preset has it).
        taco = compression.taco_config(cfg.with_keys(**VARIANTS[preset], taco_min_bytes=0))
        ppl = perplexity(config, params, windows, mesh, taco)
        continued = models.generate(config, params, prompts, mesh=mesh, taco=taco, max_new_tokens=args.new_tokens)
        reference = reference or {"ppl": ppl, "continued": continued}
        share, first = agreement(continued, reference["continued"])
        rows.append(
            {
                "preset": preset,
                "perplexity": ppl,
                "ppl_change": ppl / reference["ppl"] - 1,
                "agreement": share,
                "first_split": first,
            }
        )
        print(strict_json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items()}
    device = f"{jax.devices()[0].device_kind} x {jax.device_count()}"
    meta = {"run": str(args.run), "model": cfg.model, "step": step, "device": device, "settings": settings}
    args.out.write_text(strict_json.dumps({**meta, "rows": rows}, indent=1))
    print(
        f"| preset | perplexity | change vs off | greedy agreement | tokens to first split |  ({cfg.model}, step {step})"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['perplexity']:.4f} | {100 * r['ppl_change']:+.3f}% | {100 * r['agreement']:.1f}% | "
            f"{r['first_split']:.1f} |"
        )


if __name__ == "__main__":
    main()
