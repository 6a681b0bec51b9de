"""The wire message (pallas_kernels/wire.py): its layout round-trips every format, and the
kernels that write and read it directly produce exactly what packing their typed
outputs would (interpret mode on CPU, compiled on GPU)."""

import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax.kernels import compress as kc
from taco_jax.kernels import decompress as kd
from taco_jax.kernels import formats, wire

FORMATS = ["e4m3", "e5m2", "int8", "int4", "e2m3", "e3m2", "e2m1"]
SCALES = ["dual", "single", "bf16", "e8m0"]
KERNEL_CASES = [("e4m3", "dual"), ("int8", "bf16"), ("e5m2", "e8m0"), ("e4m3", "single")]


def _rows(batch, groups, group_size=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, groups, group_size)) * np.exp(2 * rng.standard_normal((batch, groups, 1)))
    return jnp.asarray(x, jnp.bfloat16)


def _typed(x, fmt, scale_format):
    return wire.quantize_groups(x, fmt=fmt, group_size=x.shape[-1], scale_format=scale_format, transform=True)


@pytest.mark.cover
@pytest.mark.parametrize("groups", [1, 37, 64])
@pytest.mark.parametrize("scale_format", SCALES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_message_round_trips_payload_and_scales(fmt, scale_format, groups):
    x = _rows(2, groups, seed=groups)
    payload, scales = _typed(x, fmt, scale_format)
    layout = wire.MessageLayout(groups, 128, fmt, scale_format)
    message = wire.pack(payload, scales, layout)
    assert message.dtype == jnp.uint8 and message.shape == (2, *layout.shape)
    exact = groups * (128 * formats.wire_format(fmt).bits // 8 + formats.SCALE_FORMATS[scale_format])
    assert exact <= layout.nbytes < exact + layout.row_bytes  # the scale rows pad under one row
    np.testing.assert_array_equal(np.asarray(wire.payload_of(message, layout)), np.asarray(payload))
    np.testing.assert_array_equal(
        np.asarray(wire.scales_of(message, layout)).view(np.uint8),
        np.asarray(scales.reshape(wire.scales_of(message, layout).shape)).view(np.uint8),
    )
    multiplier = wire.dequantize_scale(scales, scale_format).reshape(2, groups)
    np.testing.assert_array_equal(np.asarray(wire.multiplier(message, layout)), np.asarray(multiplier))


def test_layout_rejects_bad_names():
    with pytest.raises(ValueError, match="scale format"):
        wire.MessageLayout(4, 128, "e4m3", "fp16")
    with pytest.raises(ValueError, match="wire format"):
        wire.MessageLayout(4, 128, "e3m4", "dual")


def _compress_message_case(fmt, scale_format, groups, interpret):
    x = _rows(2, groups, seed=groups)
    layout = wire.MessageLayout(groups, 128, fmt, scale_format)
    message = kc.compress_message(x, fmt=fmt, scale_format=scale_format, transform=True, interpret=interpret)
    for b in range(2):  # the same kernel with typed outputs, packed: byte for byte
        payload, scales = kc.compress_groups(
            x[b], fmt=fmt, scale_format=scale_format, transform=True, interpret=interpret
        )
        np.testing.assert_array_equal(np.asarray(message[b]), np.asarray(wire.pack(payload, scales, layout)))
    return message, layout


def _decompress_message_case(fmt, scale_format, groups, interpret):
    message, layout = _compress_message_case(fmt, scale_format, groups, interpret)
    payload, multiplier = wire.payload_of(message, layout), wire.multiplier(message, layout)
    # B = 2 batches of one message each (the receive side of an all-gather).
    decoded = kd.decompress_message(
        message[:, None], layout, transform=True, out_dtype=jnp.bfloat16, interpret=interpret
    )
    for b in range(2):
        want = kd.decompress_groups(
            payload[b : b + 1], multiplier[b : b + 1], transform=True, out_dtype=jnp.bfloat16, interpret=interpret
        )
        np.testing.assert_array_equal(np.asarray(decoded[b], np.float32), np.asarray(want, np.float32))
    # One batch of k = 2 messages summed (reduce-scatter, one-shot all-reduce) and requantized (two-shot).
    summed = kd.decompress_message(message[None], layout, transform=True, interpret=interpret)
    np.testing.assert_array_equal(
        np.asarray(summed[0]),
        np.asarray(kd.decompress_groups(payload, multiplier, transform=True, interpret=interpret)),
    )
    requantized = kd.decompress_message(message[None], layout, transform=True, requantize=True, interpret=interpret)
    codes, scales = kd.decompress_groups(
        payload, multiplier, transform=True, requantize_to=(fmt, scale_format), interpret=interpret
    )
    np.testing.assert_array_equal(np.asarray(requantized), np.asarray(wire.pack(codes, scales, layout)))


@pytest.mark.cover
@pytest.mark.production_compiler
@pytest.mark.parametrize("groups", [64, 45], ids=["aligned", "odd"])
@pytest.mark.parametrize("fmt,scale_format", KERNEL_CASES)
def test_message_kernels_interpret(fmt, scale_format, groups):
    _decompress_message_case(fmt, scale_format, groups, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [8192, 45], ids=["aligned", "odd"])
@pytest.mark.parametrize("fmt,scale_format", KERNEL_CASES)
def test_message_kernels_gpu(fmt, scale_format, groups):
    _decompress_message_case(fmt, scale_format, groups, interpret=False)


@pytest.mark.gpu
def test_gpu_collectives_move_only_messages_and_match_lax():
    import jax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import taco_jax as tj

    ranks = len(jax.devices())
    if ranks < 2:
        pytest.skip("needs two GPUs")
    mesh = tj.make_mesh(1, 1, ranks)
    x = jax.device_put(_rows(1, ranks * 512, seed=3).reshape(ranks * 64, 1024), NamedSharding(mesh, P("tensor")))
    config = tj.TacoConfig.preset("taco+", min_bytes=0)
    cases = [
        (lambda v: tj.all_gather(v, "tensor", config), lambda v: lax.all_gather(v, "tensor", tiled=True)),
        (lambda v: tj.reduce_scatter(v, "tensor", config), lambda v: lax.psum_scatter(v, "tensor", tiled=True)),
        (lambda v: tj.all_reduce(v, "tensor", config), lambda v: lax.psum(v, "tensor")),
    ]
    for ours, theirs in cases:
        compiled = [
            jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))
            for f in (ours, theirs)
        ]
        hlo = compiled[0].lower(x).compile().as_text()
        assert {c.dtype for c in tj.collectives_in_hlo(hlo)} == {"u8"}
        got, want = (np.asarray(fn(x), np.float64) for fn in compiled)
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 1e-3 < error < 0.02  # INT8 after the transform: compressed, within codec error


def test_bytes_inside_a_scan_count_once_per_trip():
    """`hlo.bytes_by_axis` on a compiled `lax.scan` of 3 steps, each summing over
    "tensor" and gathering over "data": each loop collective counts 3 times, the one
    after the loop once; the same collectives the parser lists without counts."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from taco_jax import hlo

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    trips = 3

    def body(carry, w):
        summed = lax.psum(carry * w, "tensor")
        return summed + lax.all_gather(summed, "data", tiled=True)[: summed.shape[0]], None

    def program(x, ws):
        out, _ = lax.scan(body, x, ws)
        return lax.psum(out, "data")

    step = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    text = step.lower(jnp.ones((8, 32)), jnp.ones((trips, 8, 32))).compile().as_text()
    counted = hlo.collectives_with_counts(text)
    assert sorted(map(repr, (c.collective for c in counted))) == sorted(map(repr, hlo.collectives_in_hlo(text)))
    assert sorted(c.times for c in counted) == [1, trips, trips]
    message = 8 * 32 * 4  # one f32 (8, 32) block
    all_reduce_tensor, gather_data, all_reduce_data = message * 2 * 3 // 4, message, message * 2 // 2
    table = hlo.bytes_by_axis(text, mesh)
    assert table == {
        "tensor": {"f32": trips * all_reduce_tensor},
        "data": {"f32": trips * gather_data + all_reduce_data},
    }
    assert hlo.bytes_by_axis(text, mesh, recomputed=True) == {}
    assert hlo.f32_as_bf16(table["tensor"]) == trips * all_reduce_tensor // 2
