"""The Gluon codec kernels (`row_kernels`: compress and one-shard decode with a group per
GPU thread; the split kernels' sums and requantize) against the jnp reference, compiled
on a GPU, and that the codec dispatches to them by default there, with no Pallas Triton
kernel on the default path. Off GPU their compilation for sm_90 and their batching
under vmap are checked (where Triton with Gluon is installed)."""

import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax import message
from taco_jax.kernels import (
    backends,
    formats,
    gluon_codec,
    jax_compat,
    row_kernels,
    split_kernels,
    triton_launch,
    wire,
)
from taco_jax.kernels import compress as kc
from taco_jax.kernels import decompress as kd
from taco_jax.kernels.launch import KernelConfig
from taco_jax.policy import QuantSpec
from tests import reference as ref
from tests.test_kernels import (
    FMTS,
    SCALES,
    _assert_only_poisoned_groups_nan,
    _assert_payload_close,
    _assert_scales_close,
    _check_nan_propagates_to_the_group,
    _compress_case,
    _groups,
    _poisoned_groups,
)

ROWS = row_kernels.RowConfig()
SPLIT = split_kernels.SplitConfig()
# Every split layout the config allows at G = 128, and one capped by a smaller group.
SPLIT_LAYOUTS = [
    split_kernels.SplitConfig(values_per_thread=4, rows_per_thread=2, num_warps=1),
    split_kernels.SplitConfig(values_per_thread=8, rows_per_thread=4, num_warps=8),
    split_kernels.SplitConfig(values_per_thread=32, rows_per_thread=1, num_warps=2),
    split_kernels.SPLIT_ONE_SHARD,
]


def _multiplier(scales, scale_format, shards):
    return wire.dequantize_scale(scales, scale_format).reshape(shards, -1)


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
@pytest.mark.parametrize("group_size", [16, 128, 512])
@pytest.mark.parametrize("config", SPLIT_LAYOUTS, ids=str)
def test_every_split_layout_compresses(config, group_size):
    """The split compress (a group over G / V lanes) against the reference in every
    layout, through the transform's in-thread and cross-lane stages, at a partial last
    program, for each kind of scale and code."""
    x = _groups(333, group_size, jnp.bfloat16, seed=5)
    for fmt, scale_format in (("e4m3", "dual"), ("int8", "bf16"), ("e5m2", "e8m0")):
        _compress_case(x, fmt, scale_format, True, interpret=False, config=config)


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
    """Groups of zeros, near the bottom of the codec's range (`wire`: about 1e-35),
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
@pytest.mark.parametrize("group_size", [256, 512])
def test_large_groups_compress_and_decode_on_the_split_kernels(group_size):
    """Groups past the row kernel's 128 values: compress and the decodes run the split
    kernels by default (no `pallas_call`), against the reference."""
    x = _groups(77, group_size, jnp.bfloat16, seed=group_size)
    kw = dict(fmt="int8", scale_format="bf16", transform=True)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda v: kc.compress_groups(v, **kw))(x))
    payload, scales = _compress_case(x, "int8", "bf16", True, interpret=False)
    shards = (payload[:76].reshape(2, 38, group_size), _multiplier(scales, "bf16", 1)[:, :76].reshape(2, 38))
    for pair in ((payload[None], _multiplier(scales, "bf16", 1)), shards):
        got = kd.decompress_groups(*pair, transform=True)
        want = kd.decompress_reference(*pair, transform=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))


# Sub-byte formats as the presets send them, both FP8 carriers (E2M3 through E4M3, E3M2
# through E5M2), a G = 16 E2M1 and a split-kernel G = 256.
SUB_BYTE = [
    ("int4", 32, "bf16"),
    ("e2m3", 128, "bf16"),
    ("e3m2", 64, "e8m0"),
    ("int5", 32, "bf16"),
    ("e2m1", 16, "e8m0"),
    ("e2m3", 256, "dual"),
    ("e2m1", 32, "single"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, group_size, scale_format", SUB_BYTE)
def test_sub_byte_codes_pack_and_decode_as_the_reference(fmt, group_size, scale_format):
    """Packed codes: the Gluon compress writes the reference's codes and scales (a few
    codes a step apart on ties), its message holds `wire.pack`'s bytes for them, and the
    decodes (one shard through the transform, a sum of four, the requantized sum of two)
    match the reference's decode of the same messages, within the codec's error of the
    input and not equal to it."""
    x = _groups(4 * 45, group_size, jnp.bfloat16, seed=group_size).reshape(4, 45, group_size)
    spec = QuantSpec.parse(f"{fmt}:{group_size}:H:{scale_format}")
    layout = message.message_layout(45, spec)
    config = row_kernels.compress_config(group_size)
    _compress_case(x.reshape(-1, group_size), fmt, scale_format, True, interpret=False, config=config)
    kw = dict(fmt=fmt, scale_format=scale_format, transform=True)
    messages = kc.compress_message(x, config=config, **kw)
    payload, scales = kc.compress_groups(x.reshape(-1, group_size), config=config, **kw)
    packed = wire.pack(payload.reshape(4, 45, group_size), scales.reshape(4, 45, *scales.shape[1:]), layout)
    np.testing.assert_array_equal(np.asarray(messages), np.asarray(packed))
    exact = ref.as_float64(x)
    for shards in (1, 4):
        batches = messages.reshape(4 // shards, shards, *layout.shape)
        got = kd.decompress_message(
            batches, layout, transform=True, config=split_kernels.decode_config(shards, False, fmt=fmt)
        )
        want = message.decode(batches, 45, spec, jnp.float32, codec="jnp")
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6 * scale)
        target = exact.reshape(4 // shards, shards, 45, group_size).sum(axis=1)
        error = np.linalg.norm(np.asarray(got, np.float64) - target) / np.linalg.norm(target)
        assert 0 < error < 0.25
    requantize = split_kernels.decode_config(2, requantize=True, fmt=fmt)
    summed = kd.decompress_message(messages[None, :2], layout, transform=True, requantize=True, config=requantize)
    reference = message.requantize(messages[:2], 45, spec, codec="jnp")
    decode = lambda m: np.asarray(message.decode(m[None, None], 45, spec, jnp.float32, codec="jnp"), np.float64)
    np.testing.assert_allclose(decode(summed), decode(reference), rtol=0, atol=0.02 * np.abs(decode(reference)).max())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, group_size", [("int4", 32), ("e2m3", 128)])
@pytest.mark.parametrize("launch", ["16:2:2", "32:1:4", "32:2:2"])
def test_packed_sums_match_the_reference_at_other_launches(fmt, group_size, launch):
    """A packed four-shard sum and requantized sum at a launch other than the default
    (more codes or rows a thread) decode as the jnp path decodes the same messages."""
    values, rows, warps = (int(n) for n in launch.split(":"))
    config = split_kernels.SplitConfig(values_per_thread=values, rows_per_thread=rows, num_warps=warps)
    x = _groups(4 * 45, group_size, jnp.bfloat16, seed=7).reshape(4, 45, group_size)
    spec = QuantSpec.parse(f"{fmt}:{group_size}:H:bf16")
    layout = message.message_layout(45, spec)
    compress = row_kernels.compress_config(group_size)
    messages = kc.compress_message(x, fmt=fmt, scale_format="bf16", transform=True, config=compress)
    got = kd.decompress_message(messages[None], layout, transform=True, config=config)
    want = message.decode(messages[None], 45, spec, jnp.float32, codec="jnp")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))
    target = ref.as_float64(x).sum(axis=0)
    error = np.linalg.norm(np.asarray(got, np.float64).reshape(target.shape) - target) / np.linalg.norm(target)
    assert 0 < error < 0.25
    summed = kd.decompress_message(messages[None], layout, transform=True, requantize=True, config=config)
    reference = message.requantize(messages, 45, spec, codec="jnp")
    decode = lambda m: np.asarray(message.decode(m[None, None], 45, spec, jnp.float32, codec="jnp"), np.float64)
    np.testing.assert_allclose(decode(summed), decode(reference), rtol=0, atol=0.02 * np.abs(decode(reference)).max())


def test_sub_byte_formats_take_the_gluon_kernels_unless_turned_off():
    """The Gluon kernels take the sub-byte formats unless TACO_JAX_SUB_BYTE_KERNELS=0, at
    group sizes whose codes fill whole 32-bit words; the Pallas kernels refuse them by
    name."""
    work = lambda fmt, group_size: backends.CodecWork(fmt, group_size, jnp.dtype(jnp.bfloat16))
    turned_off = os.environ.get("TACO_JAX_SUB_BYTE_KERNELS") == "0"
    assert backends.GLUON.takes(work("int4", 32)) is not turned_off
    assert not backends.PALLAS.takes(work("e2m3", 128))
    gluon = backends._kernels("gluon", backends._EIGHT_BIT + backends._SUB_BYTE, lambda _: True)
    assert gluon.takes(work("int4", 32)) and gluon.takes(work("e2m3", 16)) and gluon.takes(work("int5", 32))
    assert not gluon.takes(work("int5", 16))  # 80 bits: not whole words
    eight_bit = backends._kernels("gluon", backends._EIGHT_BIT, lambda _: True)
    assert eight_bit.takes(work("int8", 32)) and not eight_bit.takes(work("int4", 32))
    x = _groups(8, 32, jnp.float32)
    with pytest.raises(ValueError, match="Pallas kernels take the 8-bit formats .* got 'int4'"):
        kc.compress_groups(x, fmt="int4", scale_format="bf16", transform=True, interpret=True)


def test_gluon_kernels_need_an_ampere_or_newer_gpu(monkeypatch):
    """The row compress stages its tile with cp.async (sm_80): on an older GPU the Gluon
    kernels are not offered, so the Pallas kernels run."""
    pytest.importorskip("triton.experimental.gluon")
    monkeypatch.setattr(triton_launch, "gpu_triton", object())
    try:
        for capability, expected in (("7.5", False), ("8.0", True), ("9.0", True)):
            device = types.SimpleNamespace(compute_capability=capability)
            monkeypatch.setattr(jax_compat, "cuda_devices", lambda device=device: (device,))
            triton_launch.available.cache_clear()
            assert triton_launch.available() is expected, capability
    finally:
        triton_launch.available.cache_clear()


def test_gluon_kernels_take_groups_up_to_512():
    """The table's Gluon entry takes groups of 16 to 512, and not G = 1024, three shards,
    stochastic rounding or sub-byte codes that do not fill whole words; off GPU it does
    not run."""

    def take(group_size, dtype, fmt, shards=1, stochastic=False):
        return backends.GLUON.takes(backends.CodecWork(fmt, group_size, jnp.dtype(dtype), shards, stochastic))

    assert take(16, jnp.bfloat16, "e4m3") and take(512, jnp.float16, "int8", shards=8)
    assert not take(1024, jnp.bfloat16, "int8") and not take(16, jnp.bfloat16, "int5")
    assert not take(128, jnp.bfloat16, "int8", shards=3) and not take(128, jnp.bfloat16, "int8", stochastic=True)
    assert backends.GLUON.runs(False) is triton_launch.available()


def _compile_for_sm90(kernel, pointer_types, constexprs, num_warps):
    return triton_launch.compile_kernel(
        kernel, tuple(zip(kernel.arg_names, pointer_types)), tuple(sorted(constexprs.items())), num_warps, 90
    )


@pytest.mark.parametrize("kernel", ["row", "split"])
@pytest.mark.parametrize(
    "fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16"), ("int4", "bf16"), ("e2m3", "bf16"), ("int5", "e8m0")]
)
def test_compress_kernels_compile_for_sm90(fmt, scale_format, kernel):
    """Triton builds the compress kernels for an H100/H200 (no GPU needed): the row
    kernel with its layout conversions through shared memory, the split kernel (G = 512,
    16 lanes a group) with none for 8-bit codes; sub-byte codes packed into words, by the
    row kernel in the thread that holds the group where a packing unit is a power of two
    of words (INT4), else over lanes through shared memory (E2M3's units of 3 words,
    INT5's of 5, whose scalar stores from one thread a group would lie a group's bytes
    apart across a warp)."""
    pytest.importorskip("triton.experimental.gluon")
    scale_pointer = gluon_codec.POINTER_TYPES[gluon_codec.scale_dtype(scale_format)]
    types = ["*bf16", gluon_codec.code_pointer(fmt), scale_pointer, "i32", "i64"]
    group_size = 128 if kernel == "row" else 512
    config = row_kernels.compress_config(group_size)
    function, constexprs = row_kernels.compress_kernel(fmt, scale_format, True, group_size, config, jnp.bfloat16)
    compiled = _compile_for_sm90(function, types, constexprs, config.num_warps)
    assert f".entry {compiled.metadata.name}" in compiled.asm["ptx"]
    packed = formats.wire_format(fmt).bits < 8
    assert (compiled.metadata.shared > 0) == (kernel == "row") or packed
    # Packed codes are stored as 32-bit words (vectors of them where a thread's are adjacent).
    assert re.search(r"st\.global(\.v[24])?\.b32", compiled.asm["ptx"]) or not packed
    if packed and kernel == "row":
        regrouped = "st.shared" in compiled.asm["ptx"]
        assert regrouped == (fmt in ("e2m3", "int5")), (fmt, regrouped)


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
    without a GPU (the compile is `test_compress_kernels_compile_for_sm90`'s)."""
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
    payload, scales = row_kernels.gluon_compress(
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


# ----------------------------------------------------------------------------- decode


def _shards(fmt, scale_format, transform, shards, rows, group_size, seed=0):
    """k shards of `rows` groups compressed by the jnp reference: (payload, multiplier)."""
    compressed = [
        kc.compress_reference(
            _groups(rows, group_size, jnp.float32, seed=seed + s),
            fmt=fmt,
            scale_format=scale_format,
            transform=transform,
        )
        for s in range(shards)
    ]
    payload = jnp.stack([p for p, _ in compressed])
    return payload, jnp.stack([_multiplier(s, scale_format, 1)[0] for _, s in compressed])


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [16, 128])
@pytest.mark.parametrize("shards", [1, 2, 8])
@pytest.mark.parametrize("transform", [True, False], ids=["hadamard", "plain"])
@pytest.mark.parametrize("fmt", FMTS)
def test_decode_matches_reference(fmt, transform, shards, group_size):
    """Every output dtype at an odd row count (a partial last program), against the jnp
    reference to its rounding, and within the codec's error of the exact sum."""
    payload, multiplier = _shards(fmt, "single", transform, shards, 1001, group_size)
    kw = dict(transform=transform, config=split_kernels.decode_config(shards, requantize=False))
    for out_dtype, tolerance in ((jnp.float32, 1e-6), (jnp.bfloat16, 2.0**-8), (jnp.float16, 2.0**-10)):
        got = kd.decompress_groups(payload, multiplier, out_dtype=out_dtype, **kw)
        want = kd.decompress_reference(payload, multiplier, out_dtype=out_dtype, transform=transform)
        assert got.dtype == out_dtype and got.shape == (1001, group_size)
        np.testing.assert_allclose(
            ref.as_float64(got), ref.as_float64(want), rtol=tolerance, atol=tolerance * float(jnp.abs(want).max())
        )
    exact = sum(np.asarray(_groups(1001, group_size, jnp.float32, seed=s), np.float64) for s in range(shards))
    decoded = ref.as_float64(kd.decompress_groups(payload, multiplier, **kw))
    assert 0 < np.linalg.norm(decoded - exact) / np.linalg.norm(exact) < 0.07


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [16, 128, 512])
@pytest.mark.parametrize("config", SPLIT_LAYOUTS, ids=str)
def test_every_split_layout_decodes_and_requantizes(config, group_size):
    """Each split layout (values per thread, rows per thread, warps) against the reference,
    through the transform's in-thread and cross-lane stages, at a partial last program:
    one shard decoded (transformed, then scaled, as the reference), four summed, and
    four requantized."""
    payload, multiplier = _shards("e4m3", "dual", True, 4, 333, group_size)
    for shards in (1, 4):
        got = kd.decompress_groups(payload[:shards], multiplier[:shards], transform=True, config=config)
        want = kd.decompress_reference(payload[:shards], multiplier[:shards], transform=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))
    kw = dict(transform=True, requantize_to=("e4m3", "dual"))
    got_payload, got_scales = kd.decompress_groups(payload, multiplier, config=config, **kw)
    want_payload, want_scales = kd.decompress_reference(payload, multiplier, **kw)
    same_scale = _assert_scales_close(got_scales, want_scales, "dual")
    _assert_payload_close(got_payload, want_payload, "e4m3", 0.01, same_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [16, 64, 128])
@pytest.mark.parametrize("scale_format", SCALES)
@pytest.mark.parametrize("fmt", FMTS)
def test_requantize_matches_reference(fmt, scale_format, group_size):
    """The requantized sum of 4 shards: scales to float32 rounding (rounded-up scales one
    step apart on a tie), codes one grid step apart on a tie."""
    payload, multiplier = _shards(fmt, scale_format, True, 4, 1001, group_size)
    kw = dict(transform=True, requantize_to=(fmt, scale_format))
    got_payload, got_scales = kd.decompress_groups(payload, multiplier, config=SPLIT, **kw)
    want_payload, want_scales = kd.decompress_reference(payload, multiplier, **kw)
    assert got_payload.shape == want_payload.shape and got_scales.shape == want_scales.shape
    same_scale = _assert_scales_close(got_scales, want_scales, scale_format)
    _assert_payload_close(got_payload, want_payload, fmt, 0.01, same_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16"), ("int8", "e8m0")])
def test_decode_and_requantize_keep_nan_in_its_group(fmt, scale_format):
    """Through the default dispatch, which on a GPU runs the Gluon kernels."""
    _check_nan_propagates_to_the_group(fmt, scale_format, None, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shards", [1, 2])
def test_float16_decode_saturates_instead_of_overflowing(shards):
    """A decoded group (one shard or a sum) past float16's largest finite value clamps to
    it (the conversion's `.satfinite`); NaN stays NaN."""
    payload, multiplier = _shards("int8", "single", True, shards, 45, 128)
    multiplier = multiplier.at[:, 3].mul(1e6).at[0, 5].set(jnp.nan)
    config = split_kernels.decode_config(shards, requantize=False)
    got = np.asarray(kd.decompress_groups(payload, multiplier, transform=True, out_dtype=jnp.float16, config=config))
    assert np.isnan(got[5]).all() and np.isfinite(np.delete(got, 5, axis=0)).all()
    assert np.abs(got[3]).max() == np.finfo(np.float16).max


@pytest.mark.gpu
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_float32_decode_near_its_largest_value_matches_the_reference(shards):
    """Groups scaled (by a power of two) so that the exact sum of the shards nears a
    quarter of float32's largest value, where the transformed shards alone overflowed:
    the Gluon decode (and, for sums, the requantize) is finite and equals the jnp
    reference."""
    payload, multiplier = _shards("int8", "bf16", True, shards, 45, 128)
    unscaled = np.abs(np.asarray(kd.decompress_reference(payload, multiplier, transform=True))).max()
    multiplier = multiplier * 2.0 ** np.floor(np.log2(np.finfo(np.float32).max / 4 / unscaled))
    config = split_kernels.decode_config(shards, requantize=False)
    got = kd.decompress_groups(payload, multiplier, transform=True, out_dtype=jnp.float32, config=config)
    want = kd.decompress_reference(payload, multiplier, transform=True, out_dtype=jnp.float32)
    assert np.isfinite(np.asarray(got)).all() and np.abs(np.asarray(want)).max() > 1e37
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * np.abs(want).max())
    if shards == 1:
        return  # one shard requantized sits on its own bf16 scale grid: rounding ties, not overflow
    codes, scales = kd.decompress_groups(payload, multiplier, transform=True, requantize_to=("int8", "bf16"))
    want_codes, want_scales = kd.decompress_reference(
        payload, multiplier, transform=True, requantize_to=("int8", "bf16")
    )
    assert np.isfinite(np.asarray(scales, np.float32)).all()
    same_scale = _assert_scales_close(scales, want_scales, "bf16")
    _assert_payload_close(codes, want_codes, "int8", 0.01, same_scale)


@pytest.mark.gpu
def test_message_decode_and_requantize_match_the_pallas_kernel():
    """Two batches of 4 messages of 45 groups, decoded; one batch requantized into a
    message (payload rows, then the scale rows)."""
    layout = wire.MessageLayout(45, 128, "int8", "bf16")
    x = _groups(8 * 45, 128, jnp.bfloat16, seed=6).reshape(8, 45, 128)
    messages = kc.compress_message(x, fmt="int8", scale_format="bf16", transform=True).reshape(2, 4, *layout.shape)
    pallas = KernelConfig()
    decoded = kd.decompress_message(messages, layout, transform=True, out_dtype=jnp.bfloat16, config=SPLIT)
    want = kd.decompress_message(messages, layout, transform=True, out_dtype=jnp.bfloat16, config=pallas)
    assert decoded.shape == (2, 45, 128)
    np.testing.assert_allclose(ref.as_float64(decoded), ref.as_float64(want), rtol=2.0**-7, atol=1e-2)
    requantized = kd.decompress_message(messages[:1], layout, transform=True, requantize=True, config=SPLIT)
    want = kd.decompress_message(messages[:1], layout, transform=True, requantize=True, config=pallas)
    assert requantized.shape == want.shape == layout.shape and requantized.dtype == jnp.uint8
    assert np.mean(np.asarray(requantized) != np.asarray(want)) < 0.01


@pytest.mark.gpu
def test_vmapped_decode_equals_a_loop_over_the_batch():
    """A simulated mesh's vmap over the decode: the payload mapped, the multipliers not."""
    payload, multiplier = _shards("e4m3", "dual", True, 4, 45, 128)
    stacked = jnp.stack([payload, payload[::-1]])
    decode = lambda p: kd.decompress_groups(p, multiplier, transform=True, out_dtype=jnp.bfloat16, config=SPLIT)
    got = jax.vmap(decode)(stacked)
    for index in range(2):
        np.testing.assert_array_equal(np.asarray(got[index]), np.asarray(decode(stacked[index])))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["taco", "taco+", "fp8"])
def test_default_dispatch_runs_no_pallas_kernel(preset):
    """Under the default kernel mode on a GPU, the codec's compress, decode and sum, and an
    all-gather, reduce-scatter and all-reduce on a simulated mesh, are Gluon kernels
    (jaxlib's Triton custom call) with no `pallas_call` (the deprecated lowering)."""
    import taco_jax as tj

    x = _groups(64, 256, jnp.bfloat16)
    spec = tj.TacoConfig.preset(preset).forward
    config = tj.TacoConfig.preset(preset, min_bytes=0)
    on_mesh = lambda collective: jax.vmap(lambda v: collective(v, "tensor", config), axis_name="tensor")
    pairs = jnp.stack([x, x])
    for fn, operand in (
        (lambda v: tj.decompress(tj.compress(v, spec)), x),
        (lambda v: tj.decompress_sum(tj.compress(jnp.stack([v, v]), spec)), x),
        (on_mesh(tj.all_gather), pairs),
        (on_mesh(tj.reduce_scatter), pairs),
        (on_mesh(tj.all_reduce), pairs),
    ):
        jaxpr = str(jax.make_jaxpr(fn)(operand))
        assert "pallas_call" not in jaxpr and "triton_kernel_call" in jaxpr


def _one_shard_decode(payload, multiplier):
    return split_kernels.gluon_decompress(
        payload, multiplier, groups=multiplier.shape[-1], fmt="int8", transform=True, out_dtype=jnp.bfloat16
    )


def test_vmapped_decode_is_one_launch_over_the_folded_batch(monkeypatch):
    """Nested vmaps over the payload, with the multipliers mapped by the outer one only:
    one custom call over 2 * 3 batches, the unmapped operand broadcast to them."""
    pytest.importorskip("triton.experimental.gluon")
    _stub_launch(monkeypatch)
    payload = jnp.zeros((2, 3, 1, 4, 32, 128), jnp.int8)
    multiplier = jnp.zeros((2, 1, 4, 32), jnp.float32)
    traced = jax.jit(jax.vmap(jax.vmap(_one_shard_decode, in_axes=(0, None)))).trace(payload, multiplier)
    (call,) = _ffi_calls(traced.jaxpr.jaxpr)
    assert [v.aval.shape for v in call.invars] == [(6, 4, 32, 128), (6, 4, 32)]
    assert [v.aval.shape for v in call.outvars] == [(6, 32, 128)]
    assert traced.out_info.shape == (2, 3, 1, 32, 128)


def test_vmapped_requantize_is_one_launch_over_the_folded_batch(monkeypatch):
    """A simulated mesh's two-shot all-reduce requantizes under vmap: one custom call over
    the folded batch, its (payload, scales) pair unfolded to the vmapped shape."""
    pytest.importorskip("triton.experimental.gluon")
    _stub_launch(monkeypatch)

    def requantize(payload, multiplier):
        return split_kernels.gluon_decompress(
            payload, multiplier, groups=32, fmt="int8", transform=True, requantize_to="bf16", payload_rows=34
        )

    traced = jax.jit(jax.vmap(requantize)).trace(jnp.zeros((3, 1, 4, 34, 128), jnp.int8), jnp.zeros((3, 1, 4, 32)))
    (call,) = _ffi_calls(traced.jaxpr.jaxpr)
    assert [v.aval.shape for v in call.outvars] == [(3, 34, 128), (3, 32)]
    assert [info.shape for info in traced.out_info] == [(3, 1, 34, 128), (3, 1, 32)]


@pytest.mark.parametrize(
    "kernel, fmt, out, shards, transform",
    [
        ("split", "e4m3", "*bf16", 1, True),
        ("split", "int8", "*fp32", 4, False),
        ("split", "e5m2", "*fp16", 8, True),
        ("split", "e4m3", "*bf16", 1, False),
        ("split", "int4", "*bf16", 1, True),
        ("split", "e2m3", "*bf16", 4, True),
        ("split", "int5", "*fp32", 2, False),
        ("requantize", "int8", "bf16", 4, None),
        ("requantize", "e4m3", "dual", 2, None),
        ("requantize", "e2m3", "bf16", 2, None),
        ("requantize", "int4", "bf16", 4, None),
    ],
)
def test_decode_kernels_compile_for_sm90(kernel, fmt, out, shards, transform):
    """Triton builds the decode and requantize kernels for an H100/H200 (no GPU needed),
    the split kernels with no shared memory for 8-bit codes (the transform's cross-lane
    stages are warp shuffles); unpacking sub-byte codes may convert layouts."""
    pytest.importorskip("triton.experimental.gluon")
    codes = gluon_codec.code_pointer(fmt)
    config = split_kernels.decode_config(shards, requantize=kernel == "requantize", fmt=fmt)
    if kernel == "split":
        function, constexprs = split_kernels.decode_kernel(fmt, 128, shards, transform, None, config)
        types = [codes, "*fp32", out, "i32", "i64"]
    else:
        function, constexprs = split_kernels.decode_kernel(fmt, 128, shards, True, out, config)
        types = [codes, "*fp32", codes, gluon_codec.POINTER_TYPES[gluon_codec.scale_dtype(out)], "i32", "i64", "i64"]
    compiled = _compile_for_sm90(function, types, constexprs, config.num_warps)
    assert f".entry {compiled.metadata.name}" in compiled.asm["ptx"]
    assert compiled.metadata.shared == 0 or formats.wire_format(fmt).bits < 8


@pytest.mark.parametrize(
    "fmt, group_size, scale_format, shards, requantize, load",
    [
        ("int4", 32, "bf16", 4, False, r"ld\.global\.b16"),
        ("e2m3", 128, "dual", 1, False, r"div\.\w+\.f32"),
        ("int5", 32, "e8m0", 2, False, r"ld\.global\.b8"),
        ("int4", 128, "bf16", 4, True, r"ld\.global\.b16"),
        ("e3m2", 64, "e8m0", 2, True, r"ld\.global\.b8"),
        ("int8", 128, "bf16", 4, True, r"ld\.global\.b16"),
        ("e4m3", 128, "dual", 2, False, r"div\.\w+\.f32"),
    ],
)
def test_decodes_read_their_messages_scale_entries(fmt, group_size, scale_format, shards, requantize, load):
    """Decoding whole messages, the kernels take the messages a second
    time as the scale entries' dtype and decode each group's multiplier where it follows
    the payload: a 16-bit load of a bfloat16, a byte of E8M0, s / a of "dual" (no float32
    multiplier array), for packed and 8-bit codes alike."""
    pytest.importorskip("triton.experimental.gluon")
    codes, entries = gluon_codec.code_pointer(fmt), gluon_codec.POINTER_TYPES[gluon_codec.scale_dtype(scale_format)]
    config = split_kernels.decode_config(shards, requantize, fmt=fmt)
    function, constexprs = split_kernels.decode_kernel(
        fmt, group_size, shards, True, scale_format if requantize else None, config, scale_format
    )
    types = (
        [codes, entries, codes, entries, "i32", "i64", "i64"] if requantize else [codes, entries, "*bf16", "i32", "i64"]
    )
    ptx = _compile_for_sm90(function, types, constexprs, config.num_warps).asm["ptx"]
    assert constexprs["MESSAGE_SCALES"] == gluon_codec.SCALE_FORMAT_IDS[scale_format]
    assert re.search(load, ptx)


@pytest.mark.parametrize("fmt, shards, requantize", [("int4", 4, False), ("int5", 1, False), ("int4", 2, True)])
def test_packed_integers_decode_in_place(fmt, shards, requantize):
    """Packed integer codes decode in a float32's mantissa (`gluon_packing.integer_values`):
    a three-input logic operation a code and no integer-to-float conversion."""
    pytest.importorskip("triton.experimental.gluon")
    codes = gluon_codec.code_pointer(fmt)
    config = split_kernels.decode_config(shards, requantize, fmt=fmt)
    # No transform: its stages across lanes convert a sign from the lane index.
    function, constexprs = split_kernels.decode_kernel(fmt, 32, shards, False, "bf16" if requantize else None, config)
    bf16 = gluon_codec.POINTER_TYPES[jnp.dtype(jnp.bfloat16)]
    types = [codes, "*fp32", codes, bf16, "i32", "i64", "i64"] if requantize else [codes, "*fp32", bf16, "i32", "i64"]
    ptx = _compile_for_sm90(function, types, constexprs, config.num_warps).asm["ptx"]
    assert re.search(r"lop3\.b32 \S+, \S+, \S+, \S+, 0x6A;", ptx)
    assert not re.search(r"cvt\.rn\.f32\.[su]32", ptx)


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_an_integer_code_decodes_at_every_place_in_a_mantissa(bits):
    """The in-place decode's arithmetic: code c (two's complement) at bit p <= 23 - bits,
    masked, its sign bit flipped and the exponent 150 - p set above it, is the float32
    2**(23 - p) + c + 2**(bits - 1); less the same at c = 0 it is c, exact."""
    codes = np.arange(1 << bits, dtype=np.int64)
    want = np.where(codes >= 1 << (bits - 1), codes - (1 << bits), codes).astype(np.float64)
    for place in range(24 - bits):
        neighbours = np.int64(0x7FFFFFFF) & ~(((1 << bits) - 1) << place)  # other codes' bits
        words = (codes << place) | neighbours
        magic = ((150 - place) << 23) | (1 << (bits - 1) << place)
        biased = (words & (((1 << bits) - 1) << place)) ^ magic
        got = biased.astype(np.uint32).view(np.float32) - np.array([magic], np.uint32).view(np.float32)
        np.testing.assert_array_equal(got.astype(np.float64), want)


def test_an_e8m0_code_decodes_from_its_bits():
    """The kernels' E8M0 decode, the code as a float32's exponent field (code 0 as 1, the
    NaN code as a quiet NaN), is `formats.decode_e8m0` for every code."""
    code = np.arange(256, dtype=np.int32)
    bits = np.where(code == 255, 0x7FC00000, np.maximum(code, 1) << 23).astype(np.int32)
    want = np.asarray(formats.decode_e8m0(jnp.asarray(code, jnp.uint8)))
    np.testing.assert_array_equal(bits.view(np.float32), want)


def test_launch_configs_name_the_kernel_the_work_needs():
    """Compress: the row kernel up to G = 128, the split kernel above; a `RowConfig` for
    larger groups is refused. Decode: the split kernel's launch for the work; a
    `RowConfig` is refused by name. Bad split layouts are refused; V keeps a group
    within a warp."""
    assert row_kernels.compress_config(128) == ROWS
    assert row_kernels.compress_config(256) == split_kernels.SPLIT_COMPRESS
    with pytest.raises(ValueError, match="at most 128 values, got 512: pass a SplitConfig"):
        row_kernels.compress_config(512, ROWS)
    assert split_kernels.decode_config(4, requantize=False) == SPLIT
    assert split_kernels.decode_config(1, requantize=False) == split_kernels.SPLIT_ONE_SHARD
    assert split_kernels.decode_config(2, requantize=True) == split_kernels.SPLIT_REQUANTIZE
    assert split_kernels.decode_config(1, requantize=False, config=SPLIT) == SPLIT
    # Packed codes: 32 a thread in a sum; in one shard a packing unit (8, 16 and 32 codes
    # at 4, 6 and 5 bits) up to 16.
    values = lambda shards, fmt: split_kernels.decode_config(shards, False, fmt=fmt).values_per_thread
    assert [values(4, fmt) for fmt in ("int4", "e2m3", "int5")] == [32, 32, 32]
    assert [values(1, fmt) for fmt in ("int4", "e2m3", "int5", "int8")] == [8, 16, 16, 8]
    # A requantized sum: two groups a thread for packed floats, one for integers.
    rows = lambda fmt: split_kernels.decode_config(4, True, fmt=fmt).rows_per_thread
    assert [rows(fmt) for fmt in ("e2m3", "e3m2", "e2m1", "int4", "int5", "int8", "e4m3")] == [2, 2, 2, 1, 1, 1, 1]
    assert split_kernels.decode_config(4, True, fmt="int4") == split_kernels.SPLIT_REQUANTIZE
    with pytest.raises(ValueError, match="are the split kernels: pass a SplitConfig"):
        split_kernels.decode_config(1, requantize=False, config=ROWS)
    with pytest.raises(ValueError, match="values_per_thread must be one of"):
        split_kernels.SplitConfig(values_per_thread=64)
    assert split_kernels.SplitConfig(values_per_thread=32).rows_per_program(16) == 4 * 32
    assert SPLIT.values(512) == 16 and SPLIT.rows_per_program(512) == 4


def test_gluon_decode_refuses_codes_that_are_not_8_bit():
    """Asked for by a Gluon config, the decode names the payload dtype it cannot read."""
    payload = jnp.zeros((1, 4, 128), jnp.float32)
    for config in (ROWS, SPLIT):
        with pytest.raises(ValueError, match="Gluon kernels decode 8-bit codes .* got float32"):
            kd.decompress_groups(payload, jnp.ones((1, 4), jnp.float32), transform=True, config=config)
