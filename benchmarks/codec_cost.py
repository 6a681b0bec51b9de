"""What the codec costs where a user runs it, on one device: the trainer's step, a user's
own nnx + optax step on `models.flax_modules.Transformer` (under `nnx.jit` and Flax's
split pattern), and generation's prefill, each per TACO mode in one run.

On one device the collectives move nothing, so a compressed mode's time over `off` is the
codec's cost with every site compressed (`min_bytes=0`). A mode "PRESET/jnp" runs the
preset's codec on the jnp path (XLA's fusions, inside its command buffers) instead of
the GPU kernels, for the user's step and the prefill. Each timing is the median of
three trials of `--steps` queued calls and one sync. The user's step is checked before
it is timed: its loss is finite, and the split pattern compiles once.

Usage:
  python -m benchmarks.codec_cost [--families gpt2,qwen2] [--d-model 2048] [--layers 16]
      [--seq 2048] [--batch 4] [--modes off,taco,taco+[,taco+/jnp]] [--steps 10]
      [--prompt-len 512 --repeats 20]
      [--out benchmarks/results/codec_cost.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from benchmarks import generation_shapes
from benchmarks import step as step_benchmark
from taco_jax import models, strict_json
from taco_jax.kernels import backends
from taco_jax.models import flax_modules


def taco_config(mode: str) -> tj.TacoConfig:
    """The `TacoConfig` of a mode: a preset, or "PRESET/jnp" (the jnp codec path)."""
    preset, _, path = mode.partition("/")
    return tj.TacoConfig.preset(preset, min_bytes=0, **({"kernel_mode": path} if path else {}))


def _median_ms(run, steps: int) -> float:
    """Median over three trials of `steps` queued calls of `run() -> array`, one sync each."""
    jax.block_until_ready(run())  # compile
    trials = []
    for _ in range(3):
        start = time.perf_counter()
        out = None
        for _ in range(steps):
            out = run()
        jax.block_until_ready(out)
        trials.append(1e3 * (time.perf_counter() - start) / steps)
    return statistics.median(trials)


def _batches(config, mesh, batch: int, seq: int) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    return [
        jax.device_put(
            rng.integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32), NamedSharding(mesh, P("data"))
        )
        for _ in range(2)
    ]


def nnx_step_rows(config, mode: str, args) -> list[dict]:
    """The user's step under `nnx.jit` and under the split pattern."""
    mesh = tj.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    taco = taco_config(mode)
    model = flax_modules.Transformer(config, mesh=mesh, taco=taco, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    optimizer = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)
    batches = _batches(config, mesh, args.batch, args.seq)

    @nnx.jit
    def jitted(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
        optimizer.update(model, grads)
        return loss

    calls = iter(range(10**9))
    jit_ms = _median_ms(lambda: jitted(model, optimizer, batches[next(calls) % 2]), args.steps)
    loss = float(jitted(model, optimizer, batches[0]))
    if not np.isfinite(loss):
        raise RuntimeError(f"the user's nnx.jit step ({mode}) gave loss {loss}")

    graphdef, state = nnx.split((model, optimizer))
    on_mesh = NamedSharding(mesh, P())
    state = jax.tree.map(lambda a: a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, on_mesh), state)
    traces = []

    @functools.partial(jax.jit, donate_argnums=0)
    def split_step(state, tokens):
        traces.append(1)
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    held = [state]

    def split_call():
        loss, held[0] = split_step(held[0], batches[next(calls) % 2])
        return loss

    split_ms = _median_ms(split_call, args.steps)
    if len(traces) != 1:
        raise RuntimeError(f"the split-pattern step ({mode}) was traced {len(traces)} times")
    common = {"family": config.family, "mode": mode}
    return [common | {"path": "nnx_step", "ms": jit_ms}, common | {"path": "nnx_split_step", "ms": split_ms}]


def prefill_row(config, mode: str, args) -> dict:
    """Generation's prefill of `--batch` prompts of `--prompt-len` tokens (the prompts of
    `benchmarks.generate`), the median of `--repeats` calls."""
    mesh = tj.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params = models.init_params(config, jax.random.key(0), mesh)
    prompts = generation_shapes.prompts(args).tolist()
    taco = None if mode == "off" else taco_config(mode)
    run = lambda: models.generate(config, params, prompts, mesh=mesh, taco=taco, max_new_tokens=1, dtype=jnp.bfloat16)
    run()  # compile
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - start))
    return {"path": "prefill", "family": config.family, "mode": mode, "ms": statistics.median(times)}


def table(rows: list[dict]) -> str:
    """Markdown: each path's time per mode and its cost over `off`."""
    lines = ["| path | family | mode | ms | over off |", "|---|---|---|---|---|"]
    off = {(r["path"], r["family"]): r["ms"] for r in rows if r["mode"] == "off"}
    for r in rows:
        base = off.get((r["path"], r["family"]))
        over = f"{100 * (r['ms'] / base - 1):+.1f}%" if base else "-"
        lines.append(f"| {r['path']} | {r['family']} | {r['mode']} | {r['ms']:.2f} | {over} |")
    return "\n".join(lines)


def write(rows: list[dict], out: Path) -> None:
    """The result file: the presets' own rows (off, taco, taco+) under "rows", the
    "PRESET/jnp" rows apart. The command names the sub-byte kernels' switch where they
    were off, since it decides which codec the sub-byte presets ran."""
    sub_byte_flag = [] if backends.SUB_BYTE_KERNELS else ["TACO_JAX_SUB_BYTE_KERNELS=0"]
    result = {
        "card": jax.devices()[0].device_kind,
        "date": datetime.date.today().isoformat(),
        "command": " ".join([*sub_byte_flag, "python -m benchmarks.codec_cost", *sys.argv[1:]]),
        "rows": [r for r in rows if "/" not in r["mode"]],
        "jnp_codec_rows": [r for r in rows if "/" in r["mode"]],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(strict_json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    generation_shapes.add_shape_arguments(parser)  # the model, --batch, the prompts, --repeats
    parser.set_defaults(repeats=20)
    parser.add_argument("--seq", type=int, default=2048, help="the training steps' sequence length")
    parser.add_argument("--modes", default="off,taco,taco+", help='presets, or "PRESET/jnp" for the jnp codec path')
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/codec_cost.json"))
    args = parser.parse_args()
    rows: list[dict] = []
    for family in args.families.split(","):
        config = step_benchmark.custom_model(family, args)
        for mode in args.modes.split(","):
            print(f"{family} {mode}", file=sys.stderr, flush=True)
            if "/" not in mode:  # the trainer's step runs the preset's own kernel mode
                measured = step_benchmark.measure(config, (1, 1, 1), mode, args.batch, args.seq, args.steps, False)
                rows.append({"path": "train_step", "family": family, "mode": mode, "ms": measured["step_ms"]})
            rows += nnx_step_rows(config, mode, args)
            rows.append(prefill_row(config, mode, args))
            write(rows, args.out)  # after each mode: a run cut short keeps what it measured
    print(f"wrote {args.out}")
    print(table(rows))


if __name__ == "__main__":
    main()
