"""The fused codec kernels against the jnp path and a device copy.

The kernels: each op by the Gluon kernels (`row_kernels`: every op by default on a CUDA
GPU; compress on the row kernel, the decodes on the split kernels, as
`row_kernels.compress_config` and `decode_config` pick) and by the Pallas kernel's
default launch (JAX's deprecated Triton lowering, an opt-in). `--split-sweep-only` times
the split kernels over `SPLIT_LAUNCHES` instead (`--group-size` for groups other than 128).

On a GPU: sweeps launch configurations (`KernelConfig`: block rows, blocks per program,
warps, pipelining stages, the transform method (`KernelConfig.transform_method`), the pieces a
group is loaded in (`KernelConfig.pieces`), each timed both ways below;
`--sweep-only` writes them alone to kernels_sweep.json, with the copy), checks
the kernels against the jnp reference, then times
each op twice: wall clock (`ms`: median of trials, launches queued with one sync per
trial, each timed call covering several distinct inputs so L2 hits stay out of the
numbers) and GPU kernel time (`device_ms`: the kernels' busy time in a `jax.profiler`
trace). The percentages of copy use GPU time on both sides, as the copy
is timed with CUDA events: on the H200 the wall clock added 14-36 us per kernel (launch
gaps and dispatch between queued calls), 10-25% of a kernel at these sizes.

  copy            x + 1 in bf16 under XLA and a torch device copy timed with CUDA events
                  (reads and writes 2 bytes per element): the ceiling, the faster of the
                  two in GPU time
  compress        bf16 -> 8-bit payload + scales (fused kernel vs jnp under XLA)
  decompress      one shard -> bf16 (the receiving end of an all-gather)
  decompress_sum  k=4 shards -> their bf16 sum (reduce-scatter / one-shot receive)
  requantize_sum  k=4 shards -> sum requantized (two-shot all-reduce middle step)

Effective bandwidth counts the bytes each op must read and write once.

Usage:  python -m benchmarks.kernels [--quick | --no-sweep | --sweep-only] [--sweep-hadamard matmul,lanes]
                                      [--sweep-pieces 1,4] [--sweep-ops compress/taco+,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import profiling
from taco_jax import strict_json
from taco_jax.kernels import backends, row_kernels, split_kernels, wire
from taco_jax.kernels import compress as kc
from taco_jax.kernels import decompress as kd
from taco_jax.kernels.formats import SCALE_FORMATS
from taco_jax.kernels.launch import TRANSFORM_METHODS, KernelConfig

PRESETS = {  # name: (fmt, scale_format, transform)
    "taco": ("e4m3", "dual", True),
    "taco+": ("int8", "bf16", True),
    "fp8": ("e4m3", "single", False),
}
GROUP = 128
SHARDS = 4
SHAPES = [(4096, 4096, 16), (16384, 8192, 4), (32768, 16384, 2)]  # tokens, channels, distinct inputs timed
SWEEP_SHAPE = (16384, 8192)  # tokens x channels the launch sweep runs at


def time_ms(fn, inputs, trials: int = 7, calls: int = 5) -> float:
    """Median over trials of (time per call / number of inputs per call)."""
    jax.block_until_ready(fn(*inputs))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*inputs)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    per_input = len(inputs[0]) if isinstance(inputs[0], (list, tuple)) else 1
    return statistics.median(times) * 1e3 / per_input


def _over_list(op):
    return jax.jit(lambda xs: [op(x) for x in xs])


def _scales_bytes(rows: int, scale_format: str) -> int:
    return rows * SCALE_FORMATS[scale_format]


def _agreement(payload, scales, ref_payload, ref_scales) -> dict:
    """The share of codes that differ from the reference's and the scales' largest
    relative difference."""
    codes, ref_codes, entries, ref_entries = (
        np.asarray(a.astype(jnp.float32)) for a in (payload, ref_payload, scales, ref_scales)
    )
    return dict(
        payload_mismatch=float(np.mean(codes != ref_codes)),
        scale_rel_diff=float(np.max(np.abs(entries - ref_entries) / np.abs(ref_entries))),
    )


def check_correctness(key) -> list[dict]:
    """Kernel vs jnp reference on the GPU for every preset-like combination."""
    rows = []
    x32 = jax.random.normal(key, (8191, GROUP), jnp.float32) * jnp.exp(2 * jax.random.normal(key, (8191, 1)))
    for dtype in (jnp.bfloat16, jnp.float32):
        x = x32.astype(dtype)
        for fmt in ("e4m3", "e5m2", "int8"):
            for scale_format in SCALE_FORMATS:
                for transform in (True, False):
                    kw = dict(fmt=fmt, scale_format=scale_format, transform=transform)
                    payload, scales = kc.compress_groups(x, **kw)
                    ref_payload, ref_scales = jax.jit(lambda v, kw=kw: kc.compress_reference(v, **kw))(x)
                    multiplier = wire.dequantize_scale(scales, scale_format).reshape(1, -1)
                    out = kd.decompress_groups(payload[None], multiplier, transform=transform, out_dtype=jnp.float32)
                    ref_out = kd.decompress_reference(payload[None], multiplier, transform=transform)
                    decode_diff = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out))
                    error = float(jnp.linalg.norm(out - x.astype(jnp.float32)) / jnp.linalg.norm(x.astype(jnp.float32)))
                    rows.append(
                        dict(
                            dtype=jnp.dtype(dtype).name,
                            fmt=fmt,
                            scales=scale_format,
                            transform=transform,
                            **_agreement(payload, scales, ref_payload, ref_scales),
                            decode_rel_diff=decode_diff,
                            round_trip_rel_error=error,
                        )
                    )
    return rows


def check_requantize(key) -> list[dict]:
    """The requantized sum of k shards (kernel default launch) vs the jnp reference, per
    preset: `_agreement`, the share of groups whose scales agree, and in those groups the
    largest code difference over max(|reference code|, 1)."""
    rows = []
    rows_n = SHARDS * 8192
    x = jax.random.normal(key, (rows_n, GROUP), jnp.float32) * jnp.exp(jax.random.normal(key, (rows_n, 1)))
    for preset, (fmt, scale_format, transform) in PRESETS.items():
        (payloads,), (multipliers,) = _as_shards(
            [kc.compress_groups(x, fmt=fmt, scale_format=scale_format, transform=transform)], scale_format, SHARDS
        )
        kw = dict(transform=transform, requantize_to=(fmt, scale_format))
        got = kd.decompress_groups(payloads, multipliers, **kw)
        want = jax.jit(lambda p, m: kd.decompress_reference(p, m, **kw))(payloads, multipliers)
        got_scales, want_scales = (np.asarray(s.astype(jnp.float32)).reshape(s.shape[0], -1) for s in (got[1], want[1]))
        same_scale = (got_scales == want_scales).all(axis=1)
        codes = [np.asarray(c.astype(jnp.float32)) for c in (got[0], want[0])]
        steps = np.abs(codes[0] - codes[1])[same_scale] / np.maximum(np.abs(codes[1][same_scale]), 1.0)
        rows.append(
            dict(
                preset=preset,
                **_agreement(*got, *want),
                max_step_same_scale=float(steps.max(initial=0.0)),
                groups_same_scale=float(same_scale.mean()),
            )
        )
    return rows


def check_rounding_under_jit(key) -> dict:
    """Does XLA keep the FP8 rounding of a jitted round trip? Plain astype pairs may be
    removed (excess precision); the codec's jnp path must keep it."""
    import taco_jax as tj

    x = jax.random.normal(key, (1024, GROUP), jnp.float32)
    plain = jax.jit(lambda v: v.astype(jnp.float8_e4m3fn).astype(jnp.float32))
    plain_on_grid = np.array_equal(np.asarray(plain(x)), np.asarray(x).astype(jnp.float8_e4m3fn).astype(np.float32))
    spec = tj.QuantSpec(fmt="e4m3", hadamard=False, scales="single")
    round_trip = lambda v: tj.decompress(tj.compress(v, spec, kernel_mode="jnp"), kernel_mode="jnp")
    jitted = np.asarray(jax.jit(round_trip)(x))
    eager = np.asarray(round_trip(x))
    return {
        "plain_astype_pair_rounds": bool(plain_on_grid),
        "plain_astype_pair_in_hlo": "f8e4m3fn" in plain.lower(x).compile().as_text(),
        "codec_jnp_jitted_equals_eager": bool(np.allclose(jitted, eager, rtol=1e-6)),
        "codec_jnp_round_trip_error": float(np.linalg.norm(jitted - np.asarray(x)) / np.linalg.norm(np.asarray(x))),
    }


def torch_copy_tb_per_s(elements: int) -> float | None:
    """Device-to-device copy bandwidth through torch's clone (bytes read + written), the
    ceiling the kernels are held against; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    src = torch.empty(elements, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 10)
    del src, dst
    torch.cuda.empty_cache()
    return 4 * elements / statistics.median(times) / 1e9


SWEEP_OPS = {  # op name: (preset, k shards, requantize)
    "compress/taco": ("taco", 0, False),
    "compress/taco+": ("taco+", 0, False),
    "compress/fp8": ("fp8", 0, False),
    "decompress/taco": ("taco", 1, False),
    "decompress/taco+": ("taco+", 1, False),
    "decompress/fp8": ("fp8", 1, False),
    "decompress_sum/taco": ("taco", SHARDS, False),
    "decompress_sum/taco+": ("taco+", SHARDS, False),
    "requantize_sum/taco": ("taco", SHARDS, True),
    "requantize_sum/taco+": ("taco+", SHARDS, True),
}


def _as_shards(compressed: list, scale_format: str, shards: int) -> tuple[list, list]:
    """Payloads and multipliers of compressed (N, G) tensors as k shards of N / k rows each:
    what a reduce-scatter receives (k = 1: one all-gathered shard)."""
    return (
        [p.reshape(shards, -1, p.shape[-1]) for p, _ in compressed],
        [wire.dequantize_scale(s, scale_format).reshape(shards, -1) for _, s in compressed],
    )


def _compress_bytes(rows: int, scale_format: str, group_size: int = GROUP) -> int:
    """bf16 in, 8-bit payload and scales out."""
    return 3 * rows * group_size + _scales_bytes(rows, scale_format)


def _decode_bytes(rows: int, shards: int, scale_format: str, requantize: bool, group_size: int = GROUP) -> int:
    """k shards of rows / k payload rows and their multipliers in; their sum out, in bf16
    or requantized."""
    out_rows = rows // shards
    out = out_rows * group_size + _scales_bytes(out_rows, scale_format) if requantize else 2 * out_rows * group_size
    return rows * group_size + 4 * rows + out


def _sweep_op(name: str, xs: list, config: KernelConfig):
    """(jitted fn, its inputs, bytes moved) for one swept op under `config`."""
    preset, shards, requantize = SWEEP_OPS[name]
    fmt, scale_format, transform = PRESETS[preset]
    kw = dict(fmt=fmt, scale_format=scale_format, transform=transform)
    rows_n, group_size = xs[0].shape
    if not shards:
        fn = jax.jit(lambda vs: [kc.compress_groups(v, config=config, **kw) for v in vs])
        return fn, (xs,), _compress_bytes(rows_n, scale_format, group_size)
    payloads, multipliers = _as_shards([kc.compress_groups(v, **kw) for v in xs], scale_format, shards)
    decode = dict(requantize_to=(fmt, scale_format)) if requantize else dict(out_dtype=jnp.bfloat16)
    fn = jax.jit(
        lambda ps, ms: [
            kd.decompress_groups(p, m, transform=transform, config=config, **decode) for p, m in zip(ps, ms)
        ]
    )
    return fn, (payloads, multipliers), _decode_bytes(rows_n, shards, scale_format, requantize, group_size)


# (block rows, blocks per program, warps, stages) swept for the methods other than "matmul",
# whole groups and groups loaded in pieces
TILE_FREE_LAUNCHES = (
    (16, 1, 2, 1),
    (16, 1, 4, 1),
    (32, 1, 4, 1),
    (64, 1, 4, 1),
    (64, 1, 8, 1),
    (128, 1, 8, 1),
    (64, 4, 4, 3),
)
PIECES_LAUNCHES = ((16, 1, 2, 1), (16, 1, 4, 1), (32, 1, 4, 1), (64, 1, 4, 1), (128, 1, 4, 1), (128, 1, 8, 1))


def _sweep_launches(
    methods: list[str], pieces: list[int], default: KernelConfig, transformed: bool
) -> list[KernelConfig]:
    """The op's `default` configuration (the baseline, timed in the same run), then the
    launch configurations swept for each transform method. The methods other than
    "matmul" need no tensor-core tile, so they also try blocks below wgmma's 64 rows, and
    groups loaded in `pieces`; an op without the transform tries those launches once."""
    configs = [default]
    if "matmul" in methods:
        configs += [
            KernelConfig(block_rows=r, blocks_per_program=b, num_warps=w, num_stages=st)
            for r in (64, 128)
            for b in (1, 4, 16)
            for w in (4, 8)
            for st in (1, 3)
            if not (b == 1 and st > 1)
        ]
    # Without the transform the method field is unused: those launches are swept once.
    swept = [m for m in ("lanes", "pairs") if m in methods] if transformed else [default.transform_method]
    for method in swept:
        for count in pieces:
            configs += [
                KernelConfig(
                    block_rows=r,
                    blocks_per_program=b,
                    num_warps=w,
                    num_stages=st,
                    transform_method=method,
                    pieces=count,
                )
                for r, b, w, st in (TILE_FREE_LAUNCHES if count == 1 else PIECES_LAUNCHES)
            ]
    return list(dict.fromkeys(configs))


def sweep_configs(
    key, tokens: int, channels: int, budget_s: float, methods: list[str], pieces: list[int], ops: list[str]
) -> list[dict]:
    """Time each of `ops` over launch configurations: block rows, blocks per program (the
    kernel's loop), warps, pipelining stages, the transform method (`methods`;
    methods other than "matmul" only for the ops that apply the transform) and the
    pieces a group is loaded in (`pieces`)."""
    rows_n = tokens * channels // GROUP
    xs = [jax.random.normal(jax.random.fold_in(key, i), (rows_n, GROUP), jnp.bfloat16) for i in range(4)]
    start, results = time.perf_counter(), []
    for name in ops:
        preset, shards, requantize = SWEEP_OPS[name]
        transformed = PRESETS[preset][2] and not requantize
        default = (
            kd.default_config(GROUP, transformed, shards, requantize=requantize)
            if shards
            else kc.default_config(GROUP, transformed)
        )
        for config in _sweep_launches(methods, pieces, default, transformed):
            if time.perf_counter() - start > budget_s:
                return results
            fn, inputs, nbytes = _sweep_op(name, xs, config)
            ms, gpu_ms = time_ms(fn, inputs, trials=5, calls=3), device_ms(fn, inputs)
            results.append(
                dict(
                    op=name,
                    **dataclasses.asdict(config),
                    default=config == default,
                    ms=ms,
                    tb_per_s=nbytes / ms / 1e9,
                    device_ms=gpu_ms,
                    device_tb_per_s=nbytes / gpu_ms / 1e9,
                )
            )
            print(
                f"  {name:22s} {config.transform_method:9s} p{config.pieces} {config.block_rows:4d} "
                f"x{config.blocks_per_program:<3d} w{config.num_warps} s{config.num_stages} {ms:7.3f} ms "
                f"{nbytes / ms / 1e9:5.2f} TB/s (GPU {gpu_ms:7.3f} ms {nbytes / gpu_ms / 1e9:5.2f} TB/s)",
                file=sys.stderr,
                flush=True,
            )
    return results


def _compress_kernels(fmt: str, pallas_default: KernelConfig) -> list[tuple[str, object]]:
    """(name, config) of the kernels compress is timed with: the Gluon kernel ("gluon",
    `row_kernels.compress_config`'s, what runs by default where `backends.GLUON` takes
    the work) and the Pallas kernel's default."""
    gluon = [("gluon", row_kernels.compress_config(GROUP))] if _gluon_runs(fmt) else []
    return gluon + [("pallas", pallas_default)]


def _gluon_runs(fmt: str, shards: int = 1) -> bool:
    """Whether the Gluon kernels take bf16 groups of `GROUP` in `fmt` and run here."""
    return backends.kernel_backend(backends.CodecWork(fmt, GROUP, jnp.dtype(jnp.bfloat16), shards), False) is (
        backends.GLUON
    )


def _decode_kernels(fmt: str, shards: int, requantize: bool, pallas_default: KernelConfig) -> list[tuple[str, object]]:
    """(name, decode function) of the kernels a decode is timed with: the split kernel's
    launch the work runs on by default where `backends.GLUON` takes it ("gluon":
    `split_kernels.decode_config`'s default) and the Pallas kernel's default launch."""
    pallas = [("pallas", functools.partial(kd.decompress_groups, config=pallas_default))]
    if not _gluon_runs(fmt, shards):
        return pallas
    gluon = split_kernels.decode_config(shards, requantize)
    return [("gluon", functools.partial(kd.decompress_groups, config=gluon)), *pallas]


def device_ms(fn, inputs) -> float:
    """Milliseconds of GPU kernel time per input of fn(*inputs): the union of the kernels'
    intervals in a `jax.profiler` trace of queued calls (benchmarks/profiling.py), so
    host dispatch and launch gaps stay out, as they do from the CUDA-event-timed copy."""
    return device_profile(fn, inputs)[0]


def device_profile(fn, inputs) -> tuple[float, list[dict]]:
    """`device_ms`, and the kernels it is made of (name, milliseconds per input), the
    longest first: which of an op's launches (the codec kernel, XLA's fusions around it)
    takes the time."""
    per_input = len(inputs[0]) if isinstance(inputs[0], (list, tuple)) else 1
    timeline = profiling.gpu_timeline(lambda: fn(*inputs), calls=3)
    kernels = [dict(name=k["name"], ms=k["ms"] / per_input) for k in timeline["top_kernels"]]
    return timeline["compute_ms"] / per_input, kernels


def time_shape(key, tokens: int, channels: int, repeats: int) -> list[dict]:
    """Every op at one activation shape; returns one row per (op, preset, implementation)
    with its wall-clock time (`ms`, `tb_per_s`) and, for the XLA copy and the kernels,
    its GPU kernel time (`device_ms`, `device_tb_per_s`)."""
    rows_n = tokens * channels // GROUP
    elements = rows_n * GROUP
    xs = [jax.random.normal(jax.random.fold_in(key, i), (rows_n, GROUP), jnp.bfloat16) for i in range(repeats)]
    results = []

    def add(op, preset, impl, fn, inputs, nbytes):
        ms = time_ms(fn, inputs)
        row = dict(
            tokens=tokens,
            channels=channels,
            op=op,
            preset=preset,
            impl=impl,
            ms=ms,
            bytes=nbytes,
            tb_per_s=nbytes / ms / 1e9,
        )
        if impl != "jnp":
            row["device_ms"] = device_ms(fn, inputs)
            row["device_tb_per_s"] = nbytes / row["device_ms"] / 1e9
        results.append(row)

    add("copy", "-", "xla", _over_list(lambda v: v + jnp.bfloat16(1)), (xs,), 4 * elements)
    copy_bw = torch_copy_tb_per_s(elements)
    if copy_bw is not None:
        torch_ms = 4 * elements / copy_bw / 1e9  # CUDA events: already GPU time
        results.append(
            dict(
                tokens=tokens,
                channels=channels,
                op="copy",
                preset="-",
                impl="torch",
                ms=torch_ms,
                bytes=4 * elements,
                tb_per_s=copy_bw,
                device_ms=torch_ms,
                device_tb_per_s=copy_bw,
            )
        )
    for preset, (fmt, scale_format, transform) in PRESETS.items():
        kw = dict(fmt=fmt, scale_format=scale_format, transform=transform)
        compress_bytes = _compress_bytes(rows_n, scale_format)
        for impl, config in _compress_kernels(fmt, kc.default_config(GROUP, transform)):
            add(
                "compress",
                preset,
                impl,
                _over_list(lambda v, config=config: kc.compress_groups(v, config=config, **kw)),
                (xs,),
                compress_bytes,
            )
        add("compress", preset, "jnp", _over_list(lambda v: kc.compress_reference(v, **kw)), (xs,), compress_bytes)
        compressed = [kc.compress_groups(v, **kw) for v in xs]
        one_shard, k_shards = _as_shards(compressed, scale_format, 1), _as_shards(compressed, scale_format, SHARDS)
        for op, shards, requantize in (
            ("decompress", 1, False),
            ("decompress_sum", SHARDS, False),
            ("requantize_sum", SHARDS, True),
        ):
            extra = dict(requantize_to=(fmt, scale_format)) if requantize else dict(out_dtype=jnp.bfloat16)
            default = kd.default_config(GROUP, transform and not requantize, shards, requantize=requantize)
            for impl, fn in (
                *_decode_kernels(fmt, shards, requantize, default),
                ("jnp", kd.decompress_reference),
            ):
                run = jax.jit(lambda ps, ms, fn=fn: [fn(p, m, transform=transform, **extra) for p, m in zip(ps, ms)])
                add(
                    op,
                    preset,
                    impl,
                    run,
                    one_shard if shards == 1 else k_shards,
                    _decode_bytes(rows_n, shards, scale_format, requantize),
                )
    for r in results:
        device = f" (GPU {r['device_tb_per_s']:5.2f} TB/s)" if "device_ms" in r else ""
        print(
            f"  {tokens}x{channels} {r['op']:15s} {r['preset']:6s} {r['impl']:6s} {r['ms']:8.3f} ms "
            f"{r['tb_per_s']:5.2f} TB/s{device}",
            file=sys.stderr,
            flush=True,
        )
    return results


SPLIT_LAUNCHES = tuple(
    split_kernels.SplitConfig(values_per_thread=v, rows_per_thread=r, num_warps=w)
    for v in (8, 16, 32)
    for r in (1, 2)
    for w in (2, 4)
)
# The decodes, which the split kernels run by default (`split_kernels.decode_config`).
SPLIT_OPS = (
    "decompress/taco",
    "decompress/taco+",
    "decompress/fp8",
    "decompress_sum/taco",
    "decompress_sum/taco+",
    "requantize_sum/taco",
    "requantize_sum/taco+",
)


def _baselines(name: str, group_size: int) -> list:
    """The launches a split sweep of op `name` starts from: the Pallas kernel's default,
    and for compress the Gluon kernel's default (`row_kernels.compress_config`)."""
    preset, shards, requantize = SWEEP_OPS[name]
    transformed = PRESETS[preset][2] and not requantize
    if shards:
        return [kd.default_config(group_size, transformed, shards, requantize=requantize)]
    return [kc.default_config(group_size, transformed), row_kernels.compress_config(group_size)]


def _sweep_label(config) -> str:
    """A split sweep's launch as its rows name it: "pallas default", the row kernel's
    warps, or a split kernel's V, rows and warps."""
    if isinstance(config, KernelConfig):
        return "pallas default"
    if isinstance(config, row_kernels.RowConfig):
        return f"row w{config.num_warps}"
    return "v{values_per_thread} r{rows_per_thread} w{num_warps}".format(**dataclasses.asdict(config))


def sweep_split(key, tokens: int, channels: int, ops: list[str], group_size: int = GROUP) -> list[dict]:
    """Time `ops` on the split kernels over `SPLIT_LAUNCHES` (values and rows per thread,
    warps; V is raised to G / 32 where a group would span more than a warp) in GPU time,
    after the baselines `_baselines` names."""
    rows_n = tokens * channels // group_size
    xs = [jax.random.normal(jax.random.fold_in(key, i), (rows_n, group_size), jnp.bfloat16) for i in range(4)]
    launches = [dataclasses.replace(c, values_per_thread=c.values(group_size)) for c in SPLIT_LAUNCHES]
    results = []
    for name in ops:
        # Each launch once: raising V merges launches, and a default may be one of them.
        for config in dict.fromkeys([*_baselines(name, group_size), *launches]):
            fn, inputs, nbytes = _sweep_op(name, xs, config)
            gpu_ms = device_ms(fn, inputs)
            label = _sweep_label(config)
            results.append(
                dict(
                    op=name,
                    group_size=group_size,
                    launch=label,
                    device_ms=gpu_ms,
                    device_tb_per_s=nbytes / gpu_ms / 1e9,
                )
            )
            print(f"  {name:22s} {label:15s} GPU {gpu_ms:7.3f} ms {nbytes / gpu_ms / 1e9:5.2f} TB/s", file=sys.stderr)
    return results


# The sub-byte specs of the presets (taco6-4's two directions, int5), INT4 at taco+'s
# group size, and taco+'s 8-bit spec beside them: (fmt, G, scale format), all with the
# transform.
PACKED_SPECS = [
    ("int8", 128, "bf16"),
    ("e2m3", 128, "bf16"),
    ("int4", 32, "bf16"),
    ("int4", 128, "bf16"),
    ("int5", 32, "bf16"),
]


def launch_label(launch: split_kernels.SplitConfig | None) -> str:
    """A decode launch as the packed rows name it: "default", or V, rows and warps."""
    if launch is None:
        return "default"
    return config_label(launch)


def launch_applies(launch: split_kernels.SplitConfig | None, op: str, fmt: str) -> bool:
    """Whether a packed op runs at `launch` (None: its default): a launch other than the
    default takes the decodes, and one with `half_sums` only INT4's requantized sum."""
    if launch is None:
        return True
    return op != "compress" and (not launch.half_sums or (op, fmt) == ("requantize_sum", "int4"))


def packed_launch(text: str) -> split_kernels.SplitConfig:
    """A `--packed-launches` entry, V:ROWS:WARPS with an optional ":half"."""
    fields = text.split(":")
    if len(fields) not in (3, 4) or fields[3:] not in ([], ["half"]):
        raise SystemExit(f"--packed-launches takes V:ROWS:WARPS or V:ROWS:WARPS:half, got {text!r}")
    values, rows, warps = (int(n) for n in fields[:3])
    return split_kernels.SplitConfig(values, rows, warps, half_sums=fields[3:] == ["half"])


def config_label(config: split_kernels.SplitConfig | row_kernels.RowConfig) -> str:
    """The launch an op ran at: a split kernel's V, rows and warps, or the row kernel's
    warps (a packed row's `config`, which names its default as it was when it ran)."""
    if isinstance(config, split_kernels.SplitConfig):
        half = " half sums" if config.half_sums else ""
        return f"V{config.values_per_thread} R{config.rows_per_thread} W{config.num_warps}{half}"
    return f"row W{config.num_warps}"


def time_packed(
    key, tokens: int, channels: int, repeats: int = 4, launch: split_kernels.SplitConfig | None = None
) -> list[dict]:
    """The Gluon kernels on wire messages of `PACKED_SPECS` (sub-byte codes packed into
    words): compress, one shard decoded, four summed, four requantized; GPU time, its
    bandwidth over the bytes each op reads and writes once, the launch it ran at, and the
    kernels it is made of. With `launch`, only the decodes, at that launch instead of
    their default (with `half_sums`, only INT4's requantized sums)."""
    results = []
    for fmt, group_size, scale_format in PACKED_SPECS:
        rows_n = tokens * channels // group_size
        layout = wire.MessageLayout(rows_n, group_size, fmt, scale_format)
        kw = dict(fmt=fmt, scale_format=scale_format, transform=True)
        xs = [
            jax.random.normal(jax.random.fold_in(key, i), (1, rows_n, group_size), jnp.bfloat16) for i in range(repeats)
        ]
        compress = row_kernels.compress_config(group_size)
        messages = [kc.compress_message(x, config=compress, **kw) for x in xs]
        shards = [jnp.stack([messages[i], *messages[:3]][:SHARDS], axis=1) for i in range(repeats)]
        decode_configs = {
            (shard_count, requantize): split_kernels.decode_config(shard_count, requantize, launch, fmt=fmt)
            for shard_count, requantize in ((1, False), (SHARDS, False), (SHARDS, True))
        }
        decode = lambda shard_count, requantize: _over_list(
            lambda m: kd.decompress_message(
                m,
                layout,
                transform=True,
                out_dtype=jnp.bfloat16,
                requantize=requantize,
                config=decode_configs[shard_count, requantize],
            )
        )
        elements, message_bytes = rows_n * group_size, layout.nbytes
        # Each op's bytes: the messages it reads or writes, and the bf16 side (none for
        # a requantized sum).
        for op, fn, inputs, messages_moved, bf16_side, config in (
            ("compress", _over_list(lambda v: kc.compress_message(v, config=compress, **kw)), xs, 1, True, compress),
            ("decompress", decode(1, False), [m[:, None] for m in messages], 1, True, decode_configs[1, False]),
            ("decompress_sum", decode(SHARDS, False), shards, SHARDS, True, decode_configs[SHARDS, False]),
            ("requantize_sum", decode(SHARDS, True), shards, SHARDS + 1, False, decode_configs[SHARDS, True]),
        ):
            if not launch_applies(launch, op, fmt):
                continue
            moved = message_bytes * messages_moved + 2 * elements * bf16_side
            ms, kernels = device_profile(fn, (inputs,))
            results.append(
                dict(op=op, fmt=fmt, group_size=group_size, scales=scale_format, tokens=tokens, channels=channels)
                | dict(launch=launch_label(launch), config=config_label(config))
                | dict(device_ms=ms, bytes=moved, device_tb_per_s=moved / ms / 1e9)
                | dict(kernels=kernels)
            )
            print(f"  {op:15s} {fmt}:{group_size}: {ms:.3f} ms GPU", file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, no launch sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    parser.add_argument(
        "--shapes", default=",".join(f"{s[0]}x{s[1]}" for s in SHAPES), help="the shapes timed, TOKENSxCHANNELS"
    )
    parser.add_argument("--sweep-only", action="store_true", help="only the launch-configuration sweep")
    parser.add_argument(
        "--split-sweep-only",
        action="store_true",
        help="only the split kernels' launch sweep (`SPLIT_LAUNCHES`), to kernels_split_sweep[_gG].json",
    )
    parser.add_argument("--group-size", type=int, default=GROUP, help="G for --split-sweep-only")
    parser.add_argument("--sweep-budget", type=float, default=600.0, help="seconds the sweep may take")
    parser.add_argument(
        "--sweep-hadamard",
        default=",".join(TRANSFORM_METHODS),
        help="transform methods the sweep tries (KernelConfig.transform_method), comma-separated",
    )
    parser.add_argument(
        "--sweep-pieces",
        default="1,2,4,8",
        help="pieces a group is loaded in (KernelConfig.pieces) for the sweep, comma-separated",
    )
    parser.add_argument(
        "--sweep-ops",
        default=",".join(SWEEP_OPS),
        help="ops the sweep times, comma-separated (with --split-sweep-only: `SPLIT_OPS` unless given)",
    )
    parser.add_argument(
        "--packed-only",
        action="store_true",
        help="only the Gluon kernels on messages of `PACKED_SPECS` (sub-byte codes), to kernels_packed.json",
    )
    parser.add_argument(
        "--packed-launches",
        default="",
        help="with --packed-only, also the decodes at these split launches, V:ROWS:WARPS comma-separated "
        "(V:ROWS:WARPS:half for INT4's requantized sums in float16 pairs, `SplitConfig.half_sums`)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    methods, ops = args.sweep_hadamard.split(","), args.sweep_ops.split(",")
    pieces = [int(count) for count in args.sweep_pieces.split(",")]
    for flag, given, known in (("--sweep-hadamard", methods, TRANSFORM_METHODS), ("--sweep-ops", ops, SWEEP_OPS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown {flag} {unknown}; choose from {list(known)}")
    if jax.default_backend() != "gpu":
        sys.exit("benchmarks/kernels.py times the Pallas GPU kernels: run it on a GPU")
    key = jax.random.key(0)
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}", file=sys.stderr)
    if args.packed_only:
        args.out.mkdir(parents=True, exist_ok=True)
        packed = time_packed(key, *SWEEP_SHAPE)
        for launch in args.packed_launches.split(",") if args.packed_launches else ():
            packed += time_packed(key, *SWEEP_SHAPE, launch=packed_launch(launch))
        copy_bw = torch_copy_tb_per_s(SWEEP_SHAPE[0] * SWEEP_SHAPE[1])
        (args.out / "kernels_packed.json").write_text(
            strict_json.dumps(
                {"device": device, "date": time.strftime("%Y-%m-%d"), "copy_tb_per_s": copy_bw, "packed": packed}
            )
        )
        print(
            f"| op | spec | launch | GPU ms | % of copy ({copy_bw:.2f} TB/s) | kernels: the longest's share |\n"
            "|---|---|---|---|---|---|"
        )
        for r in packed:
            longest = r["kernels"][0]
            print(
                f"| {r['op']} | {r['fmt']}:{r['group_size']}:H:{r['scales']} | {r['launch']} | {r['device_ms']:.3f} "
                f"| {100 * r['device_tb_per_s'] / copy_bw:.0f}% | {len(r['kernels'])}: "
                f"{100 * longest['ms'] / r['device_ms']:.0f}% {longest['name'][:40]} |"
            )
        return
    if args.split_sweep_only:
        args.out.mkdir(parents=True, exist_ok=True)
        split_ops = ops if args.sweep_ops != parser.get_default("sweep_ops") else list(SPLIT_OPS)
        split = sweep_split(key, *SWEEP_SHAPE, split_ops, args.group_size)
        copy_bw = torch_copy_tb_per_s(SWEEP_SHAPE[0] * SWEEP_SHAPE[1])
        name = (
            "kernels_split_sweep.json" if args.group_size == GROUP else f"kernels_split_sweep_g{args.group_size}.json"
        )
        (args.out / name).write_text(
            strict_json.dumps(
                {"device": device, "date": time.strftime("%Y-%m-%d"), "copy_tb_per_s": copy_bw, "sweep": split}
            )
        )
        print(f"| op | launch | GPU ms | % of copy ({copy_bw:.2f} TB/s) |\n|---|---|---|---|")
        for r in split:
            print(f"| {r['op']} | {r['launch']} | {r['device_ms']:.3f} | {100 * r['device_tb_per_s'] / copy_bw:.0f}% |")
        return
    sweep = (
        [] if args.quick or args.no_sweep else sweep_configs(key, *SWEEP_SHAPE, args.sweep_budget, methods, pieces, ops)
    )
    if args.sweep_only:
        args.out.mkdir(parents=True, exist_ok=True)
        copy_bw = torch_copy_tb_per_s(SWEEP_SHAPE[0] * SWEEP_SHAPE[1])
        (args.out / "kernels_sweep.json").write_text(
            strict_json.dumps(
                {"device": device, "date": time.strftime("%Y-%m-%d"), "copy_tb_per_s": copy_bw, "sweep": sweep},
                indent=1,
            )
        )
        return
    correctness = check_correctness(key)
    rounding = check_rounding_under_jit(key)
    requantized = check_requantize(key)
    worst = max(r["scale_rel_diff"] for r in correctness)
    print(
        f"correctness: worst payload mismatch {max(r['payload_mismatch'] for r in correctness):.2e}, "
        f"worst scale diff {worst:.2e}, rounding {rounding}",
        file=sys.stderr,
        flush=True,
    )
    print(f"requantized sums against the reference: {requantized}", file=sys.stderr, flush=True)
    shapes = [SHAPES[1]] if args.quick else [s for s in SHAPES if f"{s[0]}x{s[1]}" in args.shapes.split(",")]
    timings = []
    for tokens, channels, repeats in shapes:
        timings += time_shape(key, tokens, channels, repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": device,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "default_kernel": "gluon" if _gluon_runs("int8") else "pallas",
        "compress_gluon_default": dataclasses.asdict(row_kernels.compress_config(GROUP)),
        "split_default": dataclasses.asdict(split_kernels.SplitConfig()),
        "compress_default": dataclasses.asdict(kc.default_config(GROUP)),
        "decompress_default": dataclasses.asdict(kd.default_config(GROUP, True)),
        "decompress_sum_default": dataclasses.asdict(kd.default_config(GROUP, True, SHARDS)),
        "requantize_sum_default": dataclasses.asdict(kd.default_config(GROUP, True, SHARDS, requantize=True)),
    }
    (args.out / "kernels.json").write_text(
        strict_json.dumps(
            {
                "meta": meta,
                "correctness": correctness,
                "requantize_correctness": requantized,
                "rounding": rounding,
                "block_sweep": sweep,
                "timings": timings,
            },
            indent=1,
        )
    )
    copy = {}
    for r in timings:  # the ceiling: the faster device copy, torch's or XLA's, in GPU time
        if r["op"] == "copy":
            shape = (r["tokens"], r["channels"])
            copy[shape] = max(copy.get(shape, 0.0), r["device_tb_per_s"])
    print("| shape | op | preset | kernel | wall ms | GPU ms | GPU TB/s | % of copy | jnp ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in timings:
        if r["impl"] in ("jnp", "torch", "xla"):
            continue
        shape = (r["tokens"], r["channels"])
        jnp_row = next(
            (
                j
                for j in timings
                if j["impl"] == "jnp" and all(j[k] == r[k] for k in ("tokens", "channels", "op", "preset"))
            ),
            None,
        )
        speedup = f"{jnp_row['ms'] / r['ms']:.1f}x" if jnp_row else "-"
        print(
            f"| {shape[0]}x{shape[1]} | {r['op']} | {r['preset']} | {r['impl']} | {r['ms']:.3f} | "
            f"{r['device_ms']:.3f} | {r['device_tb_per_s']:.2f} | {100 * r['device_tb_per_s'] / copy[shape]:.0f}% | "
            f"{jnp_row['ms'] if jnp_row else float('nan'):.3f} | {speedup} |"
        )
    for shape, bw in copy.items():
        print(f"copy {shape[0]}x{shape[1]}: {bw:.2f} TB/s")


if __name__ == "__main__":
    main()
