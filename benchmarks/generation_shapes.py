"""The shapes and prompts `benchmarks/generate.py` and its HF reference
(`benchmarks/hf_generate.py`) share, so both time the same work (no jax or torch here)."""

from __future__ import annotations

import argparse

import numpy as np


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape (the 0.91B GPT / Qwen2 of `benchmarks/step.py`) and the prompts."""
    parser.add_argument("--families", default="gpt2,qwen2")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--qwen2-d-ff", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=65)
    parser.add_argument("--repeats", type=int, default=3)


def prompts(args: argparse.Namespace) -> np.ndarray:
    """(batch, prompt_len) token ids, the same on every run (seed 0)."""
    rng = np.random.default_rng(0)
    return np.stack([rng.integers(0, args.vocab, args.prompt_len) for _ in range(args.batch)])
