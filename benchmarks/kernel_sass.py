"""What the codec kernels compile to, without a GPU: registers, spills, shared memory and
SASS instructions per element, from Triton's own compiler and ptxas.

The kernels are limited by arithmetic once their transform needs no shared memory
(Nsight Compute on an H200: SM throughput 81%, DRAM 50% for compress), so the number of
instructions per element predicts their speed, and this loop runs in seconds on any
machine. Each op is lowered with its default launch (`kernels.SWEEP_OPS`) for CUDA,
its Triton IR (taken from jax's Pallas Triton lowering, a private function, so the
tool follows jax's versions) compiled for sm_90 by the `triton` package (Triton 3.6; it
brings ptxas and cuobjdump), and the SASS counted. XLA builds its kernels with its own
Triton, so registers and counts there differ a little (80 registers against 64 for
compress).

The Gluon kernels on packed sub-byte codes (`--packed`) compile through
`pallas_kernels.triton_launch.compile_kernel` and are counted per value of a group they
take (their code runs once per thread).

Usage:  pip install triton==3.6.0
        python -m benchmarks.kernel_sass [--ops compress/taco+,decompress_sum/taco+] [--out FILE]
        python -m benchmarks.kernel_sass --packed [--packed-launches 32:2:2,32:1:2:half]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering

from benchmarks.kernels import (
    GROUP,
    PACKED_SPECS,
    PRESETS,
    SHARDS,
    SWEEP_OPS,
    config_label,
    launch_applies,
    launch_label,
    packed_launch,
)
from taco_jax import strict_json
from taco_jax.kernels import compress as kc
from taco_jax.kernels import decompress as kd
from taco_jax.kernels import formats, row_kernels, split_kernels, triton_launch
from taco_jax.kernels import gluon_codec as gc

ROWS = 1 << 20  # (ROWS, G) groups; the kernels' code does not depend on it
SASS_LINE = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def triton_ir(fn, *args) -> str:
    """The Triton IR of the one Pallas kernel `fn` launches, lowered for CUDA here."""
    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = original(*a, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return captured[-1]


def op_kernel(name: str):
    """(fn, abstract args, rows x G of a block, launch config) of one `SWEEP_OPS` op
    under its default launch."""
    preset, shards, requantize = SWEEP_OPS[name]
    fmt, scale_format, transform = PRESETS[preset]
    if not shards:
        config = kc.default_config(GROUP, transform)
        x = jax.ShapeDtypeStruct((ROWS, GROUP), jnp.bfloat16)
        return (
            lambda v: kc.compress_groups(v, fmt=fmt, scale_format=scale_format, transform=transform, config=config),
            (x,),
            config.block_rows * GROUP,
            config,
        )
    config = kd.default_config(GROUP, transform, shards, requantize=requantize)
    codes = jax.ShapeDtypeStruct((shards, ROWS // shards, GROUP), formats.wire_format(fmt).dtype)
    multipliers = jax.ShapeDtypeStruct((shards, ROWS // shards), jnp.float32)
    decode = dict(requantize_to=(fmt, scale_format)) if requantize else dict(out_dtype=jnp.bfloat16)
    return (
        lambda p, m: kd.decompress_groups(p, m, transform=transform, config=config, **decode),
        (codes, multipliers),
        config.block_rows * GROUP,
        config,
    )


def compile_sass(ir: str, num_warps: int, num_stages: int) -> dict:
    """Registers, spill bytes, shared memory and SASS opcode counts of Triton IR for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ttir"
        source.write_text(ir)
        kernel = triton.compile(
            str(source), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
        )
    return ptx_sass(kernel.asm["ptx"]) | dict(shared_bytes=kernel.metadata.shared)


def ptx_sass(ptx: str) -> dict:
    """Registers, spill bytes and SASS opcode counts of PTX, assembled for sm_90a by the
    `triton` package's ptxas."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kernel.ptx").write_text(ptx)
        ptxas = subprocess.run(
            [str(tools / "ptxas"), "-arch=sm_90a", "-v", f"{tmp}/kernel.ptx", "-o", f"{tmp}/kernel.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [str(tools / "cuobjdump"), "-sass", f"{tmp}/kernel.cubin"], capture_output=True, text=True, check=True
        ).stdout
    opcodes = collections.Counter(m.group(1) for m in map(SASS_LINE.match, sass.splitlines()) if m)
    return dict(
        registers=int(re.search(r"Used (\d+) registers", ptxas).group(1)),
        spill_bytes=int(re.search(r"(\d+) bytes spill stores", ptxas).group(1)),
        sass=sum(opcodes.values()),
        opcodes=dict(opcodes.most_common()),
    )


def packed_kernels(
    fmt: str, group_size: int, scale_format: str, launch: split_kernels.SplitConfig | None = None
) -> list[tuple[str, split_kernels.SplitConfig | row_kernels.RowConfig, object, int]]:
    """(op, its launch, compiled Gluon kernel, values of a group one thread takes) of each
    op `benchmarks.kernels.time_packed` times (the transform on; the requantized sum's
    scales in `scale_format`), at its default launch or at `launch` where that applies
    (`benchmarks.kernels.launch_applies`)."""

    def compiled(kernel, types, constexprs, num_warps):
        signature = tuple(zip(kernel.arg_names, types))
        return triton_launch.compile_kernel(kernel, signature, tuple(constexprs.items()), num_warps, 90)

    x, codes, scales = "*bf16", gc.code_pointer(fmt), gc.POINTER_TYPES[gc.scale_dtype(scale_format)]
    out = []
    if launch_applies(launch, "compress", fmt):
        config = row_kernels.compress_config(group_size)
        kernel, constexprs = row_kernels.compress_kernel(fmt, scale_format, True, group_size, config, jnp.bfloat16)
        per_thread = group_size if isinstance(config, row_kernels.RowConfig) else config.values(group_size)
        types = [x, codes, scales, "i32", "i64"]
        out.append(("compress", config, compiled(kernel, types, constexprs, config.num_warps), per_thread))
    for op, shards, requantize in (
        ("decompress", 1, False),
        ("decompress_sum", SHARDS, False),
        ("requantize_sum", SHARDS, True),
    ):
        if not launch_applies(launch, op, fmt):
            continue
        config = split_kernels.decode_config(shards, requantize, launch, fmt=fmt)
        # As `decompress.decompress_message` launches them: the scales read from the message.
        kernel, constexprs = split_kernels.decode_kernel(
            fmt, group_size, shards, True, scale_format if requantize else None, config, scale_format
        )
        types = [codes, scales, codes, scales, "i32", "i64", "i64"] if requantize else [codes, scales, x, "i32", "i64"]
        per_thread = config.values(group_size) * config.rows_per_thread
        out.append((op, config, compiled(kernel, types, constexprs, config.num_warps), per_thread))
    return out


def packed_rows(launches: list[split_kernels.SplitConfig | None]) -> list[dict]:
    """SASS of the packed-code Gluon kernels on `benchmarks.kernels.PACKED_SPECS` at each
    of `launches` (None: the defaults), per value of a group (a kernel's code runs once
    per thread on the values it takes)."""
    rows = []
    for launch in launches:
        for fmt, group_size, scale_format in PACKED_SPECS:
            for op, config, compiled, values in packed_kernels(fmt, group_size, scale_format, launch):
                row = dict(op=op, fmt=fmt, group_size=group_size, scales=scale_format, values_per_thread=values)
                row |= dict(launch=launch_label(launch), config=config_label(config))
                row |= ptx_sass(compiled.asm["ptx"])
                row["per_value"] = row["sass"] / values
                rows.append(row)
                print(
                    f"| {op} | {fmt}:{group_size} | {row['config']} | {row['registers']} | {row['sass']} | "
                    f"{row['per_value']:.1f} |",
                    flush=True,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(SWEEP_OPS), help="ops to compile, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernel_sass.json"))
    parser.add_argument(
        "--packed",
        action="store_true",
        help="the Gluon kernels on packed sub-byte codes instead, to kernel_sass_packed.json",
    )
    parser.add_argument(
        "--packed-launches",
        default="",
        help="with --packed, also the decodes at these launches, as `benchmarks.kernels --packed-launches`",
    )
    args = parser.parse_args()
    if args.packed:
        print("| op | spec | launch | registers | SASS | per value |\n|---|---|---|---|---|---|")
        launches = [packed_launch(text) for text in args.packed_launches.split(",") if text]
        rows = packed_rows([None, *launches])
        out = args.out.with_name("kernel_sass_packed.json")
        out.write_text(strict_json.dumps({"shards": SHARDS, "rows": rows}, indent=1))
        return
    ops = args.ops.split(",")
    unknown = sorted(set(ops) - set(SWEEP_OPS))
    if unknown:
        parser.error(f"unknown --ops {unknown}; choose from {list(SWEEP_OPS)}")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/kernel_sass.py compiles with the triton package: pip install triton==3.6.0")
    rows = []
    print("| op | transform | pieces | block | warps | registers | shared B | SASS | per element read | top opcodes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ops:
        fn, inputs, elements, config = op_kernel(name)
        preset, shards, requantize = SWEEP_OPS[name]
        transform = config.transform_method if PRESETS[preset][2] and not requantize else "none"
        row = dict(
            op=name,
            hadamard=transform,
            pieces=config.pieces,
            block_rows=config.block_rows,
            num_warps=config.num_warps,
            **compile_sass(triton_ir(fn, *inputs), config.num_warps, config.num_stages),
        )
        row["per_element"] = row["sass"] * 32 * config.num_warps / elements / max(1, shards)
        rows.append(row)
        top = ", ".join(f"{op} {n}" for op, n in list(row["opcodes"].items())[:6])
        print(
            f"| {name} | {row['hadamard']} | {row['pieces']} | {row['block_rows']} | {row['num_warps']} | "
            f"{row['registers']} | {row['shared_bytes']} | {row['sass']} | {row['per_element']:.1f} | {top} |",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json.dumps({"jax": jax.__version__, "shards": SHARDS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
