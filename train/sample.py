"""Command line of `python -m taco_jax.generate`: continue prompts with a trainer run's
latest checkpoint, or with a HuggingFace checkpoint folder (`models.load_hf`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .errors import EXPECTED_FAILURES


def build_parser() -> argparse.ArgumentParser:
    from .cli import OneLineParser

    parser = OneLineParser(
        prog="python -m taco_jax.generate",
        description="Generate text with a model trained by `python -m taco_jax.train` (its newest checkpoint, "
        "model and tokenizer) or an HF checkpoint folder, on a (data, 1, tensor) mesh, prefill messages "
        "compressed as --taco says.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a trainer run directory (config.json, checkpoints/)")
    source.add_argument("--hf", help="an HF checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompt-file", help="a file of prompts, one per line")
    parser.add_argument("--tokenizer", help="a tokenizer folder (tokenizer.json), replacing the run's")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mesh", default="1,1,1", help="DATA,1,TENSOR degrees over the first devices (no pipeline)")
    parser.add_argument(
        "--taco",
        default="off",
        help="compression preset of the prefill: off | fp8 | taco | taco+ | taco+mixed | taco6-4 | taco4",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eos-id", type=int, help="stop a sequence after this token id")
    return parser


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            text = Path(args.prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--prompt-file {args.prompt_file} cannot be read ({error})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    return prompts


def _model(args: argparse.Namespace):
    """(model config, params, text codec, a description) of --run or --hf."""
    from taco_jax import models

    from . import data as data_lib

    if args.hf:
        config, params = models.load_hf(args.hf)
        codec = data_lib.text_codec("", args.tokenizer or args.hf)
        return config, params, codec, f"{args.hf} ({config.family})"
    from .run_state import restore_params

    cfg, config, params, step = restore_params(args.run)
    codec = data_lib.text_codec(cfg.data, args.tokenizer or cfg.tokenizer)
    return config, params, codec, f"{args.run} ({cfg.model}, step {step})"


def _mesh(text: str) -> list[int]:
    """--mesh as its three degrees.

    Raises:
      ValueError: not three positive integers (naming the flag).
    """
    try:
        degrees = [int(d) for d in text.split(",")]
    except ValueError:
        degrees = []
    if len(degrees) != 3 or min(degrees) < 1:
        raise ValueError(f"--mesh must be three positive integers DATA,1,TENSOR, got {text!r}")
    return degrees


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status."""
    args = build_parser().parse_args(argv)
    try:
        degrees = _mesh(args.mesh)
        from .cli import _simulated_cpu_devices

        _simulated_cpu_devices(tuple(degrees))
        import taco_jax as tj
        from taco_jax import models

        prompts = _prompts(args)
        config, params, codec, description = _model(args)
        import jax

        data, pipe, tensor = degrees
        mesh = tj.make_mesh(data, pipe, tensor, devices=jax.devices()[: data * pipe * tensor])
        taco = tj.TacoConfig.preset(args.taco)
        ids = [codec.encode(prompt) for prompt in prompts]
        start = time.perf_counter()
        new = models.generate(
            config,
            params,
            ids,
            mesh=mesh,
            taco=taco,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eos_id=args.eos_id,
        )
        seconds = time.perf_counter() - start
    except EXPECTED_FAILURES as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for prompt, tokens in zip(prompts, new, strict=True):
        print(prompt + codec.decode(tokens))
        print("-" * 40)
    count = sum(len(tokens) for tokens in new)
    print(f"{description}: {count} tokens in {seconds:.2f} s ({count / seconds:.1f} tokens/s)", file=sys.stderr)
    return 0
