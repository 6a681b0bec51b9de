"""The reference for `benchmarks/generate.py`: HF transformers' `generate` on the same
shapes, prompts and card (random weights, bf16, SDPA attention, greedy).

Per family it times two ways users run it:

  dynamic          the default: eager forward, the growing DynamicCache
  static+compile   `cache_implementation="static"` and the forward compiled with
                   `torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs),
                   as the transformers docs recommend for fast decoding

Timing as in `benchmarks/generate.py`: a run of one new token is the prefill, a run of N
adds N - 1 decode steps, decode ms/token = (t_N - t_1) / (N - 1); each the median of
--repeats after two warm-up runs (compilation, graph capture). A way that fails on the
installed versions is recorded with its error instead of a time.

Usage:
  python -m benchmarks.hf_generate [--families gpt2,qwen2] [--ways dynamic,static+compile]
      [--out benchmarks/results/generate_hf.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from benchmarks.generation_shapes import add_shape_arguments
from benchmarks.generation_shapes import prompts as shape_prompts
from taco_jax import strict_json

WAYS = ("dynamic", "static+compile")


def hf_model(family: str, args: argparse.Namespace) -> torch.nn.Module:
    """The GPT-2 or Qwen2 model of `benchmarks.step.custom_model`'s shape, random weights."""
    seq = args.prompt_len + args.new_tokens
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=args.vocab,
            n_positions=seq,
            n_embd=args.d_model,
            n_layer=args.layers,
            n_head=args.heads,
            n_inner=4 * args.d_model,
        )
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.Qwen2Config(
            vocab_size=args.vocab,
            max_position_embeddings=seq,
            hidden_size=args.d_model,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            intermediate_size=args.qwen2_d_ff,
            tie_word_embeddings=False,
        )
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.to(args.device).eval()


def _timed(fn, repeats: int) -> float:
    for _ in range(2):  # compile, then capture the CUDA graphs
        fn()
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(family: str, way: str, prompts: torch.Tensor, args: argparse.Namespace) -> dict:
    """Prefill and decode times of one way of running `generate` (see the module docstring)."""
    model = hf_model(family, args)
    if way == "static+compile":
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    @torch.inference_mode()
    def run(n: int):
        return model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    prefill_s = _timed(lambda: run(1), args.repeats)
    total_s = _timed(lambda: run(args.new_tokens), args.repeats)
    tokens = prompts.numel()
    return {
        "family": family,
        "impl": f"transformers {transformers.__version__} ({way})",
        "way": way,
        "batch": prompts.shape[0],
        "prompt_len": prompts.shape[1],
        "prefill_ms": 1e3 * prefill_s,
        "prefill_tokens_per_s": tokens / prefill_s,
        "decode_ms_per_token": 1e3 * (total_s - prefill_s) / (args.new_tokens - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, from {list(WAYS)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generate_hf.json"))
    args = parser.parse_args()
    unknown = sorted(set(args.ways.split(",")) - set(WAYS))
    if unknown:
        parser.error(f"unknown ways {unknown}; choose from {list(WAYS)}")
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = torch.tensor(shape_prompts(args)).to(args.device)
    rows = []
    for family in args.families.split(","):
        for way in args.ways.split(","):
            try:
                row = measure(family, way, prompts, args)
            except Exception as error:  # a way the installed versions do not run: record why, go on
                row = {"family": family, "way": way, "error": f"{type(error).__name__}: {str(error)[:500]}"}
            rows.append(row)
            print(strict_json.dumps(row), file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"| family | way | prefill ms | prefill tok/s | decode ms/token |  ({device})")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['family']} | {r['way']} | failed: {r['error'][:80]} | | |")
        else:
            print(
                f"| {r['family']} | {r['way']} | {r['prefill_ms']:.1f} | {r['prefill_tokens_per_s']:.0f} | "
                f"{r['decode_ms_per_token']:.2f} |"
            )


if __name__ == "__main__":
    main()
