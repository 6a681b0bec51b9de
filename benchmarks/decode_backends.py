"""One decode kernel on each GPU backend JAX keeps, against the Pallas Triton kernel it
replaces: the choice of backend for the codec's kernels, made by measurement.

The kernel: the sum of k = 4 shards of 8-bit codes times their groups' multipliers, to
bfloat16 (the fp8 preset's reduce-scatter receive: E4M3 codes, one float32 multiplier
per group of 128, no transform), at 16384 x 8192 elements. It is timed as

  gluon        the Gluon split kernel (`split_kernels.SplitConfig`, jaxlib's Triton custom
               call), 8 and 16 values per thread
  mosaic       Pallas on the Mosaic GPU backend (`jax.experimental.pallas.mosaic_gpu`):
               a (k, R, 128) code tile and (k, R) multipliers per program, brought into
               shared memory by TMA and pipelined by the grid, summed in registers
               (`MOSAIC_VARIANTS`: the layouts JAX infers, or the WGMMA layouts stated;
               R = 64 or 128 rows)
  pallas       the Pallas kernel on the deprecated Triton lowering (its default launch)

Each is checked against the jnp reference, then timed in GPU time (a `jax.profiler`
trace, as `benchmarks/kernels.py` does) and held against the device copy. A variant
that does not lower records its error instead of a time.

Usage:  python -m benchmarks.decode_backends [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.kernels import _as_shards, device_ms, time_ms, torch_copy_tb_per_s
from taco_jax import strict_json
from taco_jax.kernels import compress as kc
from taco_jax.kernels import decompress as kd
from taco_jax.kernels import split_kernels
from taco_jax.kernels.decompress import default_config

SHAPE = (16384, 8192)
GROUP, SHARDS = 128, 4
MOSAIC_VARIANTS = {  # name: (rows per program, state the WGMMA layouts)
    "mosaic-r64": (64, False),
    "mosaic-r128": (128, False),
    "mosaic-r64-wgmma": (64, True),
    "mosaic-r128-wgmma": (128, True),
}


def mosaic_decode_sum(payload: jax.Array, multiplier: jax.Array, *, rows: int, wgmma: bool) -> jax.Array:
    """The k-shard decode as a Pallas Mosaic GPU kernel.

    Args:
      payload: (k, N, G) 8-bit codes.
      multiplier: (k, N) float32 multipliers.
      rows: groups per program (a multiple of 64: a warpgroup's WGMMA tile).
      wgmma: load the codes in the WGMMA layout and the multipliers in its row layout;
        else leave the layouts to Mosaic GPU's inference.

    Returns:
      (N, G) bfloat16.
    """
    # On jax 0.11.2 `pallas_call` with Mosaic GPU compiler parameters failed the lookup
    # of its lowering rule, which this private module registers; importing it is the
    # likely fix (not yet run), kept to this prototype.
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    from jax.experimental.pallas import mosaic_gpu as plgpu

    shards, groups, group_size = payload.shape

    def kernel(payload_ref, multiplier_ref, out_ref):
        total = None
        for shard in range(shards):
            if wgmma:
                codes = plgpu.load(payload_ref.at[shard], (), layout=plgpu.Layout.WGMMA)
                scale = plgpu.load(multiplier_ref.at[shard], (), layout=plgpu.Layout.WGMMA.reduce(1))
            else:
                codes, scale = payload_ref[shard], multiplier_ref[shard]
            term = codes.astype(jnp.float32) * scale[:, None]
            total = term if total is None else total + term
        out_ref[...] = total.astype(out_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((groups, group_size), jnp.bfloat16),
        grid=(groups // rows,),
        in_specs=[
            pl.BlockSpec((shards, rows, group_size), lambda i: (0, i, 0)),
            pl.BlockSpec((shards, rows), lambda i: (0, i)),
        ],
        out_specs=pl.BlockSpec((rows, group_size), lambda i: (i, 0)),
        compiler_params=plgpu.CompilerParams(max_concurrent_steps=2),
        name="mosaic_decode_sum",
    )(payload, multiplier)


def _variants() -> dict:
    """name: decode function (payload, multiplier) -> (N, G) bfloat16."""
    kw = dict(transform=False, out_dtype=jnp.bfloat16)
    variants = {
        f"gluon-v{values}": functools.partial(
            kd.decompress_groups, config=split_kernels.SplitConfig(values_per_thread=values), **kw
        )
        for values in (8, 16)
    }
    variants |= {
        name: jax.jit(functools.partial(mosaic_decode_sum, rows=rows, wgmma=wgmma))
        for name, (rows, wgmma) in MOSAIC_VARIANTS.items()
    }
    variants["pallas"] = functools.partial(kd.decompress_groups, config=default_config(GROUP, False, SHARDS), **kw)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = SHAPE[0] * SHAPE[1] // GROUP
    key = jax.random.key(0)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (rows, GROUP), jnp.bfloat16) for i in range(4)]
    compressed = [kc.compress_groups(x, fmt="e4m3", scale_format="single", transform=False) for x in xs]
    payloads, multipliers = _as_shards(compressed, "single", SHARDS)
    # Every shard's codes and multipliers read; the sum of k shards of rows / k groups written in bf16.
    nbytes = rows * GROUP + rows * 4 + rows // SHARDS * GROUP * 2
    want = kd.decompress_reference(payloads[0], multipliers[0], transform=False, out_dtype=jnp.bfloat16)
    copy = torch_copy_tb_per_s(rows * GROUP)
    results = []
    for name, fn in _variants().items():
        row = dict(variant=name)
        try:
            got = fn(payloads[0], multipliers[0])
            row["max_abs_error_vs_reference"] = float(
                jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))
            )
            run = jax.jit(lambda ps, ms, fn=fn: [fn(p, m) for p, m in zip(ps, ms)])
            row["ms"] = time_ms(run, (payloads, multipliers))
            row["device_ms"] = device_ms(run, (payloads, multipliers))
            row["device_tb_per_s"] = nbytes / row["device_ms"] / 1e9
            if copy:
                row["percent_of_copy"] = 100 * row["device_tb_per_s"] / copy
        except Exception as error:  # a backend that cannot lower this kernel: recorded, not fatal
            first_line = next(iter(str(error).strip().splitlines()), "")
            row["error"] = f"{type(error).__name__}: {first_line[:400]}"
        results.append(row)
        print(strict_json.dumps(row), flush=True)
    meta = dict(shape=SHAPE, group=GROUP, shards=SHARDS, bytes=nbytes, copy_tb_per_s=copy, jax=jax.__version__)
    meta["device"] = jax.devices()[0].device_kind
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_backends.json").write_text(strict_json.dumps(dict(meta=meta, results=results), indent=1))
    print("| variant | GPU ms | GPU TB/s | % of copy | max abs error |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | - | - | - | {r['error'][:120]} |")
        else:
            print(
                f"| {r['variant']} | {r['device_ms']:.3f} | {r['device_tb_per_s']:.2f} | "
                f"{r.get('percent_of_copy', float('nan')):.0f}% | {r['max_abs_error_vs_reference']:.3g} |"
            )
    print(f"copy: {copy:.2f} TB/s" if copy else "copy: no torch")


if __name__ == "__main__":
    main()
