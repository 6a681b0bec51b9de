"""The row compress kernel (Gluon, a group per GPU thread) against the jnp reference,
compiled on a GPU, and that compress dispatches to it by default there. Off GPU only its
compilation for sm_90 is checked (where Triton with Gluon is installed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax.kernels import compress as kc
from taco_jax.kernels import decompress as kd
from taco_jax.kernels import formats, group_codec, row_kernels, triton_launch, wire
from taco_jax.kernels.launch import KernelConfig
from tests import reference as ref
from tests.test_kernels import FMTS, SCALES, _assert_only_poisoned_groups_nan, _compress_case, _groups, _poisoned_groups

ROWS = row_kernels.RowConfig()


def _multiplier(scales, scale_format, shards):
    return group_codec.dequantize_scale(scales, scale_format).reshape(shards, -1)


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [16, 64, 128])
@pytest.mark.parametrize("transform", [True, False], ids=["hadamard", "plain"])
@pytest.mark.parametrize("scale_format", SCALES)
@pytest.mark.parametrize("fmt", FMTS)
def test_compress_matches_reference(fmt, scale_format, transform, group_size):
    """Odd row counts (a partial last program), bf16 and float32 inputs."""
    for dtype, rows in ((jnp.bfloat16, 1001), (jnp.float32, 45)):
        _compress_case(
            _groups(rows, group_size, dtype, seed=rows), fmt, scale_format, transform, interpret=False, config=ROWS
        )


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16"), ("int8", "e8m0")])
def test_nan_and_inf_make_their_group_nan(fmt, scale_format):
    """Triton's max() ignores NaN; the group's mean square does not."""
    payload, scales = kc.compress_groups(
        _poisoned_groups(), fmt=fmt, scale_format=scale_format, transform=True, config=ROWS
    )
    _assert_only_poisoned_groups_nan(
        kd.decompress_groups(payload[None], _multiplier(scales, scale_format, 1), transform=True)
    )


@pytest.mark.gpu
def test_messages_match_the_pallas_kernel():
    """Two batches of 45 groups into wire messages (payload rows, then the scale rows)."""
    x = _groups(90, 128, jnp.bfloat16, seed=4).reshape(2, 45, 128)
    for fmt, scale_format in (("e4m3", "dual"), ("int8", "bf16")):
        kw = dict(fmt=fmt, scale_format=scale_format, transform=True)
        layout = wire.MessageLayout(45, 128, fmt, scale_format)
        rows, pallas = kc.compress_message(x, config=ROWS, **kw), kc.compress_message(x, config=KernelConfig(), **kw)
        assert rows.shape == pallas.shape == (2, *layout.shape)
        assert np.mean(np.asarray(wire.payload_of(rows, layout)) != np.asarray(wire.payload_of(pallas, layout))) < 1e-3
        np.testing.assert_allclose(
            np.asarray(wire.multiplier(rows, layout)),
            np.asarray(wire.multiplier(pallas, layout)),
            rtol=2e-6 if scale_format == "dual" else 2.0**-7,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16")])
def test_extreme_magnitudes_round_trip(fmt, scale_format):
    """Groups of zeros, near the bottom of the codec's range (`group_codec`: about 1e-35),
    near the float32 maximum and of mixed binades decode finite and within the codec's
    error of the input, not equal to it."""
    base = np.asarray(_groups(8, 128, jnp.float32, seed=3)) / 8.0
    x = np.concatenate(
        [np.zeros((1, 128)), base[:2] * 1e-30, base[2:4] * 3e37, base[4:] * 10.0 ** np.arange(4)[:, None]]
    )
    payload, scales = kc.compress_groups(
        jnp.asarray(x, jnp.float32), fmt=fmt, scale_format=scale_format, transform=True, config=ROWS
    )
    out = np.asarray(
        kd.decompress_groups(payload[None], _multiplier(scales, scale_format, 1), transform=True), np.float64
    )
    assert np.isfinite(out).all() and not np.array_equal(out, x)
    error = np.linalg.norm(out - x, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-300)
    assert out[0].tolist() == [0.0] * 128 and error[1:].max() < (0.08 if fmt == "e4m3" else 0.02)


@pytest.mark.gpu
def test_compress_dispatches_to_the_row_kernel_by_default():
    """On a GPU the default launch is the row kernel (jaxlib's Triton custom call); a
    `KernelConfig` asks for the Pallas kernel."""
    x = _groups(256, 128, jnp.bfloat16)
    lowered = lambda config: (
        jax.jit(lambda v: kc.compress_groups(v, fmt="int8", scale_format="bf16", transform=True, config=config))
        .lower(x)
        .as_text()
    )
    assert "triton_kernel_call" in lowered(None) and "triton_kernel_call" not in lowered(KernelConfig())


@pytest.mark.gpu
def test_unsupported_groups_fall_back_to_pallas():
    assert not row_kernels.supports(256, jnp.bfloat16, "int8") and not row_kernels.supports(128, jnp.bfloat16, "int4")
    x = _groups(64, 256, jnp.bfloat16)
    payload, _ = kc.compress_groups(x, fmt="int8", scale_format="bf16", transform=True)
    want, _ = kc.compress_reference(x, fmt="int8", scale_format="bf16", transform=True)
    assert np.mean(ref.as_float64(payload) != ref.as_float64(want)) < 0.03


@pytest.mark.parametrize("fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16")])
def test_row_kernel_compiles_for_sm90(fmt, scale_format):
    """Triton builds the kernel for an H100/H200 (no GPU needed), its layout conversions
    through shared memory."""
    pytest.importorskip("triton.experimental.gluon")
    dtype = formats.wire_format(fmt).dtype
    scale_pointer = row_kernels.POINTER_TYPES[row_kernels.scale_dtype(scale_format)]
    types = ["*bf16", row_kernels.POINTER_TYPES[dtype], scale_pointer, "i32", "i64"]
    constexprs = dict(
        G=128,
        LOG_G=7,
        NUM_WARPS=1,
        TRANSFORM=True,
        INV_SQRT=row_kernels._inverse_sqrt(128),
        **row_kernels._vectors(128, jnp.bfloat16, jnp.int8),
        **row_kernels._quantization(fmt, scale_format),
    )
    kernel = row_kernels.taco_row_compress
    compiled = triton_launch.compile_kernel(
        kernel, tuple(zip(kernel.arg_names, types)), tuple(sorted(constexprs.items())), 1, 90
    )
    assert f".entry {compiled.metadata.name}" in compiled.asm["ptx"] and compiled.metadata.shared > 0


def test_gluon_call_rejects_scalars_out_of_place():
    """Scalars are matched to the kernel's arguments by name, after the pointers."""
    pytest.importorskip("triton.experimental.gluon")
    x = jnp.zeros((1, 4, 128), jnp.float32)
    with pytest.raises(ValueError, match="do not follow the pointers"):
        triton_launch.gluon_call(
            row_kernels.taco_row_compress,
            [x],
            [jax.ShapeDtypeStruct((1, 4, 128), jnp.int8)] * 2,
            pointer_types=["*fp32", "*i8", "*fp32"],
            scalars=[("payload_rows", "i64", 4)],
            grid=(1, 1),
            num_warps=1,
            constexprs={},
        )
    with pytest.raises(ValueError, match="2 pointer types for 3"):
        triton_launch.gluon_call(
            row_kernels.taco_row_compress,
            [x],
            [jax.ShapeDtypeStruct((1, 4, 128), jnp.int8)] * 2,
            pointer_types=["*fp32", "*i8"],
            scalars=[],
            grid=(1, 1),
            num_warps=1,
            constexprs={},
        )


def _stub_launch(monkeypatch):
    """jaxlib's Triton handles stubbed, so the kernel's custom call traces and lowers
    without a GPU (the compile is `test_row_kernel_compiles_for_sm90`'s)."""
    import types

    call = type("Call", (), {"to_proto": lambda self, name, metadata: b""})
    monkeypatch.setattr(triton_launch, "_loaded", lambda *args: None)
    monkeypatch.setattr(triton_launch, "local_capability", lambda: 90)
    monkeypatch.setattr(
        triton_launch,
        "gpu_triton",
        types.SimpleNamespace(
            create_array_parameter=lambda *a: None,
            create_scalar_parameter=lambda *a: None,
            TritonKernelCall=lambda *a: call(),
        ),
    )


def _row_compress(x):
    payload, scales = row_kernels.row_compress(
        x, fmt="int8", scale_format="bf16", transform=True, payload_dtype=jnp.int8, payload_rows=x.shape[1]
    )
    return payload.astype(jnp.float32) * scales[..., None]


def _ffi_calls(jaxpr):
    """The kernel's custom calls in a jaxpr, also inside nested jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ffi_call":
            found.append(eqn)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found += _ffi_calls(inner)
    return found


@pytest.mark.parametrize("check_vma", [True, False])
def test_row_kernel_outputs_are_typed_inside_shard_map(monkeypatch, check_vma):
    """The kernel's custom call traces under both shard_map conventions, its outputs
    varying over the tensor axis like its input."""
    pytest.importorskip("triton.experimental.gluon")
    from jax.sharding import PartitionSpec as P

    import taco_jax as tj

    _stub_launch(monkeypatch)
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])

    def body(x):
        return _row_compress(x[None])[0] + x

    traced = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=check_vma)
    ).trace(jnp.zeros((4 * 32, 128), jnp.float32))
    (call,) = _ffi_calls(traced.jaxpr.jaxpr)
    assert [v.aval.shape for v in call.outvars] == [(1, 32, 128), (1, 32)]
    assert all(("tensor" in v.aval.mat.varying) == check_vma for v in call.outvars)
    assert traced.lower().as_text().count("triton_kernel_call") == 1


def test_vmapped_row_kernel_is_one_launch_over_the_folded_batch(monkeypatch):
    """Under nested `jax.vmap` (a simulated mesh) the mapped axes fold into the kernel's
    batch: one custom call over 2 * 3 * 5 batches, outputs unfolded to the vmapped shape."""
    pytest.importorskip("triton.experimental.gluon")
    _stub_launch(monkeypatch)
    x = jnp.zeros((2, 3, 5, 32, 128), jnp.float32)
    traced = jax.jit(jax.vmap(jax.vmap(_row_compress))).trace(x)
    (call,) = _ffi_calls(traced.jaxpr.jaxpr)
    assert call.invars[0].aval.shape == (30, 32, 128)
    assert [v.aval.shape for v in call.outvars] == [(30, 32, 128), (30, 32)]
    assert traced.out_info.shape == x.shape
