"""What a refactoring must leave unchanged: the StableHLO and the wire ledger of the
collectives' programs and of the trainer's step, as hashes to compare across checkouts.

Lowers, on 8 simulated CPU devices (or the first 8 devices):
- every tensor-parallel mapping and collective (copy_to_tp, reduce_from_tp two-shot with a
  calibrated permutation, gather_matmul and its overlapped form, reduce_scatter_to_sp,
  one-shot all_reduce, ppermute, mean_gradients), value_and_grad, mesh 2x1x4, chunks=2,
  for the presets off, fp8, taco, taco+;
- the trainer's gradients (`trainer.make_grads_fn`: the whole step's communication),
  gpt2-tiny: mesh 2x1x4 taco+ with sequence parallelism, and mesh 2x2x2 with 2
  microbatches and every axis compressed;
- where Triton is installed, the PTX of the Gluon kernels built for sm_90.

Usage:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python -m benchmarks.program_identity --out program_identity.json
Run it in two checkouts and compare the files (`--compare A.json B.json`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# A ledger record's fields as the first redesign step wrote them; later fields (e.g. the
# loop trip counts) are reported beside the hash.
RECORD_FIELDS = (
    "site",
    "op",
    "direction",
    "shape",
    "dtype",
    "ranks",
    "compressed",
    "sent_bytes",
    "uncompressed_sent_bytes",
    "axis",
    "bf16_sent_bytes",
)
_LOCATION = re.compile(r"\s*loc\([^\n]*?\)(?=\n|$)|#loc[0-9]* = loc\([^\n]*\)\n?")


_PTX_DEBUG = re.compile(r"\.section\s+\.debug_\w+\s*\{.*?\n\t\}", re.S)


def _without_locations(ptx: str) -> str:
    """PTX without its source locations (`.loc`, `.file`, comments, debug sections),
    which move with the kernel's file and line, not with its code."""
    lines = _PTX_DEBUG.sub("", ptx).splitlines()
    kept = (re.sub(r"\s*//.*$", "", line) for line in lines if not line.strip().startswith((".loc", ".file")))
    return "\n".join(kept)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def lowered(fn: Callable, *args) -> dict:
    """StableHLO (source locations stripped) and ledger of `jax.jit(fn)` lowered on `args`."""
    import taco_jax as tj

    with tj.record_wire() as ledger:
        text = jax.jit(fn).lower(*args).as_text()
    text = _LOCATION.sub("", text)
    records = [tuple(str(getattr(r, f)) for f in RECORD_FIELDS) for r in ledger.records]
    return {
        "stablehlo": _digest(text),
        "stablehlo_bytes": len(text),
        "ledger": _digest(json.dumps(records)),
        "records": len(records),
        "repeats": [getattr(r, "repeats", 1) for r in ledger.records],
    }


def _tp_program(preset: str):
    import taco_jax as tj
    from taco_jax.calibration import Calibration, ChannelPlan

    mesh = tj.make_mesh(2, 1, 4, devices=jax.devices()[:8])
    config = tj.TacoConfig.preset(preset, min_bytes=0, chunks=2)
    perm = tuple(int(i) for i in np.random.default_rng(0).permutation(256))
    calibration = Calibration((("out", "forward", ChannelPlan(perm, True)),))
    tp = tj.tp

    def body(x, w_in, w_out, g):
        h = tp.copy_to_tp(x, "tensor", config, site="in")
        h = jnp.tanh(h @ w_in)
        y = tp.reduce_from_tp(h @ w_out, "tensor", config, algorithm="two_shot", site="out", calibration=calibration)
        (sp,) = tp.gather_matmul(y[:, :4], (w_in,), "tensor", config, axis=1, site="sp.in")
        (overlapped,) = tp.gather_matmul(y[:, :4], (w_in,), "tensor", config, axis=1, site="sp.ov", overlap=True)
        rs = tp.reduce_scatter_to_sp(jnp.tanh(sp + overlapped) @ w_out, "tensor", config, axis=1, site="sp.out")
        one = tj.all_reduce(rs, "tensor", config, algorithm="one_shot", site="one")
        sent = tj.ppermute(one, "tensor", config, perm=[(i, (i + 1) % 4) for i in range(4)], site="pipe.like")
        loss = jnp.sum(sent**2) + jnp.sum(y**2)
        grads, _ = tj.data_parallel.mean_gradients({"g": g * loss}, "data", config)
        return loss, grads["g"]

    def step(x, w_in, w_out, g):
        mapped = jax.shard_map(
            jax.value_and_grad(lambda *a: body(*a)[0], argnums=(1, 2)),
            mesh=mesh,
            in_specs=(P("data"), P(None, "tensor"), P("tensor", None), P()),
            out_specs=(P(), (P(None, "tensor"), P("tensor", None))),
            check_vma=False,
        )
        return mapped(x, w_in, w_out, g)

    rng = np.random.default_rng(1)
    args = (
        jnp.asarray(rng.standard_normal((4, 16, 256)), jnp.float32),
        jnp.asarray(rng.standard_normal((256, 512)) / 16, jnp.float32),
        jnp.asarray(rng.standard_normal((512, 256)) / 16, jnp.float32),
        jnp.asarray(rng.standard_normal((64, 128)), jnp.float32),
    )
    return step, args


def _trainer_program(mesh: tuple[int, int, int], **keys):
    from taco_jax import models
    from taco_jax.train import trainer
    from taco_jax.train.config import TrainConfig

    cfg = TrainConfig.from_keys(model="gpt2-tiny", mesh=mesh, batch_size=8, seq_len=32, steps=10, out="/tmp/x", **keys)
    config = models.preset(cfg.model)
    mesh_ = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(mesh), ("data", "pipe", "tensor"))
    grads = trainer.make_grads_fn(cfg, config, mesh_)
    params = models.abstract_params(config, mesh_)
    tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
    try:
        from taco_jax.train.compression import feedback_layout, uses_error_feedback
    except ImportError:  # a checkout with the trainer in one module
        feedback_layout, uses_error_feedback = trainer._feedback_layout, trainer.uses_error_feedback
    feedback = feedback_layout(cfg, config, params, mesh_) if uses_error_feedback(cfg) else {}
    return grads, (params, tokens, feedback)


def gluon_ptx() -> dict:
    """The PTX of the Gluon kernels built for sm_90 (no GPU needed), hashed: the row and
    split compress, the decode of 1 and 4 shards and the requantized sum, in three
    formats and scale encodings."""
    from taco_jax.kernels import formats, triton_launch
    from taco_jax.kernels import row_kernels as rk

    try:
        from taco_jax.kernels import gluon_codec as gc
        from taco_jax.kernels import split_kernels as sk
    except ImportError:  # a checkout with the Gluon kernels in one module, names private
        gc = sk = rk
    named = lambda module, name: getattr(module, name, None) or getattr(module, "_" + name)
    inv, quant, split_cx = named(gc, "inverse_sqrt"), named(gc, "quantization"), named(sk, "split_constexprs")
    ptr, sdt, row_cx, row_fn = gc.POINTER_TYPES, gc.scale_dtype, rk._row_constexprs, rk.taco_row_compress
    split_c, dec, req = sk.taco_split_compress, sk.taco_split_decode, sk.taco_split_requantize
    compress_config, decode_config = rk.compress_config, sk.decode_config

    out = {}

    def ptx(name, fn, types, cx, warps, fmt):
        # The code constexprs and the headroom (0 for 8-bit codes) of the checkouts whose
        # kernels take them.
        codes = dict(INTEGER=formats.wire_format(fmt).is_integer, BITS=8, EXPONENT_BITS=0, MANTISSA_BITS=0)
        cx = {k: v for k, v in (codes | dict(HEADROOM=0) | cx).items() if k in fn.arg_names}
        c = triton_launch.compile_kernel(fn, tuple(zip(fn.arg_names, types)), tuple(sorted(cx.items())), warps, 90)
        out[name] = _digest(_without_locations(c.asm["ptx"]))

    for fmt, scales in [("e4m3", "dual"), ("int8", "bf16"), ("e5m2", "e8m0")]:
        code = ptr[formats.wire_format(fmt).dtype]
        types = ["*bf16", code, ptr[sdt(scales)], "i32", "i64"]
        for g in (128, 512):
            cfg = compress_config(g)
            cx = dict(G=g, TRANSFORM=True, INV_SQRT=inv(g), **quant(fmt, scales))
            if g == 128:
                ptx(
                    f"row_compress_{fmt}_{scales}",
                    row_fn,
                    types,
                    cx | row_cx(g, cfg, jnp.bfloat16, jnp.int8),
                    cfg.num_warps,
                    fmt,
                )
            else:
                ptx(f"split_compress_{fmt}_{scales}_{g}", split_c, types, cx | split_cx(g, cfg), cfg.num_warps, fmt)
        for shards in (1, 4):
            cfg = decode_config(shards, False)
            cx = dict(G=128, SHARDS=shards, TRANSFORM=True, INV_SQRT=inv(128), **split_cx(128, cfg))
            ptx(f"decode_{fmt}_{shards}", dec, [code, "*fp32", "*bf16", "i32", "i64"], cx, cfg.num_warps, fmt)
        cfg = decode_config(2, True)
        cx = dict(G=128, SHARDS=2, **split_cx(128, cfg), **quant(fmt, scales))
        ptx(
            f"requantize_{fmt}_{scales}",
            req,
            [code, "*fp32", code, ptr[sdt(scales)], "i32", "i64", "i64"],
            cx,
            cfg.num_warps,
            fmt,
        )
    return out


PROGRAMS = {
    **{
        f"tp_mappings_{preset}": (lambda preset=preset: _tp_program(preset))
        for preset in ("off", "fp8", "taco", "taco+")
    },
    "trainer_2x1x4_taco+_sp": lambda: _trainer_program((2, 1, 4), taco="taco+", sequence_parallel=True),
    "trainer_2x2x2_all_axes": lambda: _trainer_program(
        (2, 2, 2),
        microbatches=2,
        taco="taco",
        taco_pipe="taco+",
        taco_data="taco+",
        taco_data_backward="int4:128:H:bf16",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file of the hashes")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two such files")
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (json.loads(open(path).read()) for path in args.compare)
        same = lambda name: (
            {k: v for k, v in a[name].items() if k != "repeats"}
            == {k: v for k, v in b.get(name, {}).items() if k != "repeats"}
        )
        differ = [name for name in a if name != "source" and not same(name)]
        for name in a:
            if name == "source":
                print(f"compared: {a[name]['taco_jax']} with {b[name]['taco_jax']}")
                continue
            if name == "gluon_ptx_sm90":
                print(
                    f"{'gluon_ptx_sm90':28s} {'identical' if name not in differ else 'DIFFERENT'} {len(a[name])} kernels"
                )
                continue
            print(
                f"{name:28s} {'identical' if name not in differ else 'DIFFERENT'} {a[name]['stablehlo_bytes']} B, {a[name]['records']} records"
            )
        return 1 if differ else 0
    import taco_jax

    results = {"source": {"taco_jax": str(Path(taco_jax.__file__).parent)}}
    if importlib.util.find_spec("triton") is not None:
        results["gluon_ptx_sm90"] = gluon_ptx()
    for name, build in PROGRAMS.items():
        fn, fn_args = build()
        results[name] = lowered(fn, *fn_args)
        print(name, results[name]["stablehlo"], results[name]["ledger"], file=sys.stderr)
    text = json.dumps(results, indent=1)
    if args.out:
        open(args.out, "w").write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
