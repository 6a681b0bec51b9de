"""Compressed collectives inside shard_map against the lax collectives (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import message
from taco_jax.collectives import Call, plan_message

MESHES = [
    pytest.param((2, 1, 4), id="dp2_pp1_tp4"),
    pytest.param((1, 2, 4), id="dp1_pp2_tp4"),
    pytest.param((1, 1, 8), id="dp1_pp1_tp8"),
    pytest.param((2, 2, 2), id="dp2_pp2_tp2"),
]
ALL_AXES = ("data", "pipe", "tensor")
# Relative error bounds: one quantization of E4M3 (2^-4 worst case per group, ~2.6% seen)
# and two (the two-shot all-reduce requantizes the reduced block).
ONE_QUANT, TWO_QUANT = 0.07, 0.12


def _config(mode, **overrides):
    return tj.TacoConfig.preset(mode, min_bytes=0, **overrides)


def _shard_run(mesh, body, *args, in_specs=None, out_specs=P(ALL_AXES)):
    """jit(shard_map(body)) over every device, one block per device; blocks on the result
    (the CPU backend can deadlock when collective programs overlap)."""
    in_specs = in_specs or tuple(P(ALL_AXES) for _ in args)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))
    return jax.block_until_ready(fn(*args))


def _rank_coded(mesh_shape, block):
    """Global array whose per-device block encodes the device's rank (and position)."""
    devices = int(np.prod(mesh_shape))
    rng = np.random.default_rng(0)
    blocks = [(r + 1) * (1 + rng.standard_normal(block)) for r in range(devices)]
    return jnp.asarray(np.concatenate(blocks, axis=0), jnp.float32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _ops(config):
    """Every collective variant, side by side with its lax counterpart."""
    return {
        "gather_rows": (
            lambda v: tj.all_gather(v, "tensor", config, axis=0),
            lambda v: lax.all_gather(v, "tensor", axis=0, tiled=True),
            ONE_QUANT,
        ),
        "gather_last_untiled": (
            lambda v: tj.all_gather(v, "tensor", config, axis=2, tiled=False),
            lambda v: lax.all_gather(v, "tensor", axis=2, tiled=False),
            ONE_QUANT,
        ),
        "scatter_rows": (
            lambda v: tj.reduce_scatter(v, "tensor", config),
            lambda v: lax.psum_scatter(v, "tensor", tiled=True),
            ONE_QUANT,
        ),
        "scatter_last": (
            lambda v: tj.reduce_scatter(v, "tensor", config, scatter_dimension=1),
            lambda v: lax.psum_scatter(v, "tensor", scatter_dimension=1, tiled=True),
            ONE_QUANT,
        ),
        "reduce_one_shot": (
            lambda v: tj.all_reduce(v, "tensor", config, algorithm="one_shot"),
            lambda v: lax.psum(v, "tensor"),
            ONE_QUANT,
        ),
        "reduce_two_shot": (
            lambda v: tj.all_reduce(v, "tensor", config, algorithm="two_shot"),
            lambda v: lax.psum(v, "tensor"),
            TWO_QUANT,
        ),
    }


@pytest.mark.parametrize("mode", ["off", "fp8", "taco"])
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_collectives_match_lax(mesh_shape, mode):
    tp = mesh_shape[2]
    mesh = tj.make_mesh(*mesh_shape)
    # 200 channels: not a multiple of the group size (padding path); rows divide by tp.
    x = _rank_coded(mesh_shape, (tp * 3, 200))
    ops = _ops(_config(mode))
    names = list(ops)

    def ours(v):
        return tuple(
            ops[n][0](v.reshape(tp * 3, 1, 200)).reshape(1, -1) if n == "gather_last_untiled" else ops[n][0](v)
            for n in names
        )

    def theirs(v):
        return tuple(
            ops[n][1](v.reshape(tp * 3, 1, 200)).reshape(1, -1) if n == "gather_last_untiled" else ops[n][1](v)
            for n in names
        )

    got = _shard_run(mesh, ours, x)
    want = _shard_run(mesh, theirs, x)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if mode == "off":
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
        else:
            err = _rel(g, w)
            assert 1e-4 < err < ops[name][2], f"{name}: relative error {err}"


@pytest.mark.parametrize(
    "shape, dtype",
    [((24,), jnp.float32), ((3, 5, 40), jnp.bfloat16), ((4, 300), jnp.float16), ((1, 4, 129), jnp.float32)],
    ids=["vector", "odd_bf16", "odd_f16", "one_row"],
)
def test_odd_shapes_and_dtypes(shape, dtype):
    """Channel counts that are not a multiple of the (smallest) group: rows padded."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    config = _config("taco").with_group_size(16)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4 * shape[0], *shape[1:])), dtype)

    def pairs(v):
        stacked = jnp.concatenate([v * (i + 1) for i in range(4)], axis=0)
        return (
            tj.all_reduce(v, "tensor", config, algorithm="two_shot"),
            lax.psum(v, "tensor"),
            tj.all_reduce(v, "tensor", config, algorithm="one_shot"),
            lax.psum(v, "tensor"),
            tj.all_gather(v, "tensor", config, axis=v.ndim - 1),
            lax.all_gather(v, "tensor", axis=v.ndim - 1, tiled=True),
            tj.reduce_scatter(stacked, "tensor", config, scatter_dimension=0),
            lax.psum_scatter(stacked, "tensor", scatter_dimension=0, tiled=True),
        )

    spec = P("tensor")
    out = _shard_run(mesh, pairs, x, in_specs=(spec,), out_specs=(P(None),) * 8)
    for ours, theirs in zip(out[::2], out[1::2]):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert _rel(ours, theirs) < TWO_QUANT + float(jnp.finfo(dtype).eps)


def test_untiled_reduce_scatter_drops_the_scattered_axis():
    mesh = tj.make_mesh(1, 1, 8)
    x = jnp.arange(8 * 8 * 16.0).reshape(8, 8, 16) + 1
    body = lambda v: (
        tj.reduce_scatter(v[0], "tensor", _config("taco").with_group_size(16), tiled=False)[None],
        lax.psum_scatter(v[0], "tensor", tiled=False)[None],
    )
    ours, theirs = _shard_run(mesh, body, x, in_specs=(P("tensor"),), out_specs=(P("tensor"), P("tensor")))
    assert ours.shape == theirs.shape == (8, 16)
    assert 0 < _rel(ours, theirs) < ONE_QUANT


def test_a_group_wider_than_the_message_is_one_error_naming_the_site():
    """G = 128 on 40 channels would pad every row to three times its size: refused
    where the spec meets the message, naming the site and the fix."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    body = lambda v: tj.all_reduce(v, "tensor", _config("taco+"), site="mlp.out")
    with pytest.raises(ValueError, match=r"site 'mlp.out': group size 128 .* 40 channels .*group_size <= 32"):
        jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P()), jnp.zeros((12, 40)))


def _mlp_params(d_model, d_ff, seed=0):
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((d_model, d_ff)) / np.sqrt(d_model)
    w2 = rng.standard_normal((d_ff, d_model)) / np.sqrt(d_ff)
    return jnp.asarray(w1, jnp.float32), jnp.asarray(w2, jnp.float32)


def _dense_loss(x, w1, w2, target):
    return jnp.sum(jax.nn.gelu(x @ w1) @ w2 * target)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("mode", ["off", "fp8", "taco"])
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_tp_mlp_gradients_match_single_device(mesh_shape, mode, sequence_parallel):
    """Column-parallel -> row-parallel MLP through the Megatron mappings, `jax.grad`
    inside the shard_map body (each rank differentiates its own share of the loss)."""
    tp = mesh_shape[2]
    mesh = tj.make_mesh(*mesh_shape)
    config = _config(mode)
    seq, d_model, d_ff = 4 * tp, 256, 64 * tp
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((seq, d_model)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((seq, d_model)), jnp.float32)
    w1, w2 = _mlp_params(d_model, d_ff)

    def local_loss(x_local, w1_local, w2_local, target_local):
        if sequence_parallel:
            hidden = tj.tp.gather_from_sp(x_local, "tensor", config, axis=0)
        else:
            hidden = tj.tp.copy_to_tp(x_local, "tensor", config)
        partial = jax.nn.gelu(hidden @ w1_local) @ w2_local
        if sequence_parallel:
            out = tj.tp.reduce_scatter_to_sp(partial, "tensor", config, axis=0)
        else:
            out = tj.tp.reduce_from_tp(partial, "tensor", config)
        return jnp.sum(out * target_local)

    def body(x_local, w1_local, w2_local, target_local):
        return jax.grad(local_loss, argnums=(0, 1, 2))(x_local, w1_local, w2_local, target_local)

    seq_spec = P("tensor") if sequence_parallel else P()
    grads = _shard_run(
        mesh,
        body,
        x,
        w1,
        w2,
        target,
        in_specs=(seq_spec, P(None, "tensor"), P("tensor", None), seq_spec),
        out_specs=(seq_spec, P(None, "tensor"), P("tensor", None)),
    )
    expected = jax.grad(_dense_loss, argnums=(0, 1, 2))(x, w1, w2, target)
    # Compression touches dx (backward all-reduce / reduce-scatter) always, the weight
    # gradients only with sequence parallelism (gathered input, gathered cotangent);
    # without it they see no quantized value and stay exact.
    for name, got, want in zip(("dx", "dw1", "dw2"), grads, expected):
        if mode == "off" or (name != "dx" and not sequence_parallel):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=name)
        else:
            assert 1e-4 < _rel(got, want) < 0.1, f"{name}: relative error {_rel(got, want)}"


@pytest.mark.parametrize("mode", ["off", "taco"])
def test_collective_gradients_match_lax(mode):
    """Each collective's VJP is the compressed transpose collective: compare with the
    gradients lax gives for the same per-rank loss."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    config = _config(mode)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)

    def losses(gather, scatter, reduce):
        def body(v, w):
            gathered = lambda u: jnp.sum(gather(u) * jnp.tile(w, (4, 1)))
            scattered = lambda u: jnp.sum(scatter(u) * w[:1])
            reduced = lambda u: jnp.sum(reduce(u) * w)
            return tuple(jax.grad(f)(v) for f in (gathered, scattered, reduced))

        return body

    ours = losses(
        lambda u: tj.all_gather(u, "tensor", config),
        lambda u: tj.reduce_scatter(u, "tensor", config),
        lambda u: tj.all_reduce(u, "tensor", config, algorithm="two_shot"),
    )
    theirs = losses(
        lambda u: lax.all_gather(u, "tensor", tiled=True),
        lambda u: lax.psum_scatter(u, "tensor", tiled=True),
        lambda u: lax.psum(u, "tensor"),
    )
    specs = dict(in_specs=(P("tensor"), P("tensor")), out_specs=(P("tensor"),) * 3)
    got, want = _shard_run(mesh, ours, x, weights, **specs), _shard_run(mesh, theirs, x, weights, **specs)
    for g, w in zip(got, want):
        if mode == "off":
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            assert _rel(g, w) < TWO_QUANT


def _hlo(mesh, body, x):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))
    return fn.lower(x).compile().as_text()


def test_compiled_hlo_sends_one_byte_per_element():
    mesh = tj.make_mesh(1, 1, 8)
    x = jnp.ones((8 * 64, 1024), jnp.bfloat16)
    for name, config in [("taco", _config("taco")), ("fp8", _config("fp8")), ("taco+", _config("taco+"))]:
        plain = tj.collectives_in_hlo(_hlo(mesh, lambda v: lax.all_gather(v, "tensor", tiled=True), x))
        packed = tj.collectives_in_hlo(_hlo(mesh, lambda v: tj.all_gather(v, "tensor", config), x))
        # XLA:CPU upcasts a bf16 all-gather to f32; the compressed one stays u8.
        assert [c.dtype for c in plain] in (["bf16"], ["f32"]) and [c.dtype for c in packed] == ["u8"], name
        bf16_bytes = 64 * 1024 * 2
        assert plain[0].operand_bytes >= bf16_bytes
        ratio = packed[0].operand_bytes / bf16_bytes
        spec = config.forward
        assert ratio == pytest.approx(tj.wire_bytes((64, 1024), jnp.bfloat16, spec) / bf16_bytes), name
        assert ratio < 0.54

        scatter = tj.collectives_in_hlo(_hlo(mesh, lambda v: tj.reduce_scatter(v, "tensor", config), x))
        assert [(c.op, c.dtype) for c in scatter] == [("all-to-all", "u8")]
        assert scatter[0].operand_bytes == tj.wire_bytes((64, 1024), jnp.bfloat16, spec)

        reduce = tj.collectives_in_hlo(
            _hlo(mesh, lambda v: tj.all_reduce(v, "tensor", config, algorithm="two_shot"), x)
        )
        assert [(c.op, c.dtype) for c in reduce] == [("all-to-all", "u8"), ("all-gather", "u8")]
        assert sum(c.operand_bytes for c in reduce) == pytest.approx(
            1.125 * tj.wire_bytes((64, 1024), jnp.bfloat16, spec)
        )


def test_below_threshold_and_off_use_the_plain_collective():
    mesh = tj.make_mesh(1, 1, 8)
    x = jnp.ones((8 * 8, 256), jnp.bfloat16)  # 4 KiB per rank
    for config in (tj.TacoConfig.preset("taco", min_bytes=1 << 20), tj.TacoConfig.preset("off", min_bytes=0)):
        ops = {
            c.op: c.dtype for c in tj.collectives_in_hlo(_hlo(mesh, lambda v: tj.all_reduce(v, "tensor", config), x))
        }
        assert "all-to-all" not in ops and set(ops.values()) <= {"bf16", "f32"}


def test_wire_ledger_matches_hlo_and_backward_spec():
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    forward = tj.QuantSpec(fmt="e4m3", hadamard=True, scales="e8m0")
    backward = tj.QuantSpec(fmt="int8", hadamard=True, scales="dual")
    config = tj.TacoConfig(forward, backward, min_bytes=0, mode="taco")
    x = jnp.ones((4 * 32, 512), jnp.float32)

    def body(v):
        return jax.grad(lambda u: jnp.sum(tj.tp.gather_from_sp(u, "tensor", config, site="mlp.in") ** 2))(v)

    with tj.record_wire() as ledger:
        hlo = _hlo(mesh, body, x)
    fwd, bwd = ledger.records
    assert (fwd.site, fwd.op, fwd.direction) == ("mlp.in", "all_gather", "forward")
    assert (bwd.op, bwd.direction) == ("reduce_scatter", "backward")
    assert fwd.sent_bytes == 3 * tj.wire_bytes((32, 512), jnp.float32, forward)
    assert bwd.sent_bytes == 3 * tj.wire_bytes((32, 512), jnp.float32, backward)
    assert fwd.uncompressed_sent_bytes == 3 * 32 * 512 * 4
    assert ledger.by_site() == {"mlp.in": fwd.sent_bytes + bwd.sent_bytes}
    gather, to_all = tj.collectives_in_hlo(hlo)
    assert gather.operand_bytes * 3 == fwd.sent_bytes
    assert to_all.operand_bytes * 3 // 4 == bwd.sent_bytes


def test_ledger_counts_each_message_of_a_differentiated_scan_once():
    """Differentiating a scan traces its body's forward rules twice; the compiled step
    sends each message once, and so does the ledger (against the HLO's collectives)."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    config = _config("taco+")
    x = jnp.ones((4 * 16, 256), jnp.float32)
    weights = jnp.ones((3, 256), jnp.float32)

    def body(v):
        def layer(h, w):
            return tj.tp.reduce_from_tp(
                tj.tp.copy_to_tp(h, "tensor", config, site="in") * w, "tensor", config, site="out"
            ), None

        return jax.grad(lambda u: jnp.sum(jax.lax.scan(layer, u, weights)[0] ** 2))(v)

    with tj.record_wire() as ledger:
        hlo = _hlo(mesh, body, x)
    assert sorted((r.site, r.direction) for r in ledger.records) == [("in", "backward"), ("out", "forward")]
    compiled = [c for c in tj.collectives_in_hlo(hlo) if c.dtype == "u8"]
    # One two-shot all-reduce per message (the scan's loop runs each of them 3 times); on
    # CPU, with no link to measure, "auto" takes two-shot: it sends fewer bytes at 4 ranks.
    assert sorted(c.op for c in compiled) == ["all-gather", "all-gather", "all-to-all", "all-to-all"]
    assert sum(c.sent_bytes for c in compiled) == ledger.total()


def test_works_under_vmap_with_axis_name():
    """Per-shard code also runs under vmap(axis_name=...), e.g. to simulate TP on one device."""
    config = _config("taco")
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 8, 256)), jnp.float32)
    ours = jax.vmap(lambda v: tj.all_reduce(v, "tensor", config), axis_name="tensor")(x)
    assert _rel(ours, jnp.broadcast_to(x.sum(0), x.shape)) < TWO_QUANT


def test_make_mesh_and_bad_inputs():
    mesh = tj.make_mesh(2, 2, 2)
    assert dict(mesh.shape) == {"data": 2, "pipe": 2, "tensor": 2}
    with pytest.raises(ValueError, match="= 6 devices, but 8"):
        tj.make_mesh(1, 2, 3)
    with pytest.raises(ValueError, match="positive integer"):
        tj.make_mesh(0, 1, 8)
    mesh = tj.make_mesh(1, 1, 8)
    x = jnp.ones((8 * 6, 128))
    with pytest.raises(ValueError, match="must be divisible by 8"):
        _shard_run(
            mesh,
            lambda v: tj.reduce_scatter(v, "tensor", _config("taco")),
            x,
            in_specs=(P("tensor"),),
            out_specs=P("tensor"),
        )
    with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
        _shard_run(
            mesh,
            lambda v: tj.all_reduce(v, "tensor", _config("taco"), algorithm="ring"),
            x,
            in_specs=(P("tensor"),),
            out_specs=P("tensor"),
        )
    with pytest.raises(ValueError, match="must be a TacoConfig"):
        _shard_run(
            mesh, lambda v: tj.all_gather(v, "tensor", "taco"), x, in_specs=(P("tensor"),), out_specs=P("tensor")
        )


def test_nan_propagates_through_collectives():
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    x = np.ones((16, 256), np.float32)
    x[5, 3] = np.nan  # rank 1, its block's row 1
    out = _shard_run(
        mesh,
        lambda v: tj.all_reduce(v, "tensor", _config("taco"), algorithm="two_shot"),
        jnp.asarray(x),
        in_specs=(P("tensor"),),
        out_specs=P(None),
    )
    out = np.asarray(out)
    assert np.isnan(out[1, :128]).all() and np.isfinite(out[0]).all() and np.isfinite(out[1, 128:]).all()


@pytest.mark.parametrize("mode", ["off", "taco"])
def test_gather_matmul_equals_gather_then_matmul(mode):
    """The fused op keeps the gathered input in 8-bit form for the backward pass; values
    and gradients are those of gather_from_sp followed by the matmuls."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    config = _config(mode)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 32, 256)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)

    def fused(x, w1, w2):
        outputs = tj.tp.gather_matmul(x, (w1, w2), "tensor", config, axis=1)
        return sum(jnp.sum(jnp.sin(o)) for o in outputs)

    def unfused(x, w1, w2):
        h = tj.tp.gather_from_sp(x, "tensor", config, axis=1)
        return jnp.sum(jnp.sin(h @ w1)) + jnp.sum(jnp.sin(h @ w2))

    spec = P(None, "tensor")
    grads = [
        _shard_run(
            mesh,
            lambda *a, f=f: jax.grad(f, argnums=(0, 1, 2))(*a),
            x,
            w1,
            w2,
            in_specs=(spec, spec, spec),
            out_specs=(spec, spec, spec),
        )
        for f in (fused, unfused)
    ]
    for got, want in zip(*grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# Sub-byte formats: (spec, packed bytes of a (64, 1024) shard, all-reduce error range).
# The error of eight Gaussian shards summed: int4 ~8x INT8's; E2M3 about E4M3's.
SUB_BYTE = {
    "int4": ("int4:128:H:bf16", 64 * 512 + 64 * 8 * 2, (0.05, 0.25)),
    "e2m3": ("e2m3:128:H:bf16", 64 * 768 + 64 * 8 * 2, (0.01, 0.06)),
    "e3m2": ("e3m2:128:H:bf16", 64 * 768 + 64 * 8 * 2, (0.02, 0.1)),
    "e2m1": ("e2m1:32:H:e8m0", 64 * 512 + 64 * 32, (0.05, 0.3)),
}


@pytest.mark.parametrize("fmt", list(SUB_BYTE))
def test_sub_byte_formats_cross_the_wire_packed_and_decode_within_their_bound(fmt):
    mesh = tj.make_mesh(1, 1, 8)
    text, packed_bytes, (low, high) = SUB_BYTE[fmt]
    spec = tj.QuantSpec.parse(text)
    config = tj.TacoConfig(spec, spec, min_bytes=0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8 * 64, 1024)), jnp.float32)
    ops = tj.collectives_in_hlo(_hlo(mesh, lambda v: tj.all_gather(v, "tensor", config), x))
    assert [(c.op, c.dtype) for c in ops] == [("all-gather", "u8")]
    assert tj.wire_bytes((64, 1024), jnp.float32, spec) == packed_bytes
    # The message: payload rows, then the scales padded to a whole row.
    assert (
        ops[0].operand_bytes
        == message.message_layout(64 * 1024 // spec.group_size, spec).nbytes
        < packed_bytes + spec.group_size
    )
    fn = jax.jit(
        jax.shard_map(
            lambda v: tj.all_reduce(v, "tensor", config),
            mesh=mesh,
            in_specs=P("tensor"),
            out_specs=P("tensor"),
            check_vma=False,
        )
    )
    out = np.asarray(jax.block_until_ready(fn(x)), np.float64)
    exact = np.asarray(x, np.float64).reshape(8, 64, 1024).sum(0)
    error = np.linalg.norm(out[:64] - exact) / np.linalg.norm(exact)
    assert low < error < high, error


def test_hlo_reader_names_an_unknown_element_type():
    line = "  %all-reduce.1 = c64[4,8]{1,0} all-reduce(c64[4,8]{1,0} %p), replica_groups={{0,1}}, to_apply=%add"
    with pytest.raises(ValueError, match="element type 'c64'"):
        tj.collectives_in_hlo(line)
    assert tj.collectives_in_hlo(line.replace("c64", "bf16"))[0].operand_bytes == 4 * 8 * 2


@pytest.mark.parametrize("check_vma", [False, True])
def test_one_rank_tensor_axis_compresses_without_a_collective(check_vma):
    """Over a tensor axis of one rank the messages are decoded where they were encoded:
    no collective in the compiled program (XLA:GPU would copy the buffer), except the
    all-gather that makes the all-reduce's result invariant under check_vma=True. Every
    collective still goes through the codec: close to the input, not equal to it."""
    mesh = tj.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    config = _config("taco+")
    x = jnp.asarray(np.random.default_rng(9).standard_normal((64, 512)), jnp.bfloat16)
    ops = {
        "gather": lambda v: tj.all_gather(v, "tensor", config),
        "scatter": lambda v: tj.reduce_scatter(v, "tensor", config),
        "reduce_one_shot": lambda v: tj.all_reduce(v, "tensor", config, algorithm="one_shot"),
        "reduce_two_shot": lambda v: tj.all_reduce(v, "tensor", config, algorithm="two_shot"),
    }
    for name, op in ops.items():
        fn = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=check_vma))
        invariant = check_vma and name.startswith("reduce")
        assert [c.op for c in tj.collectives_in_hlo(fn.lower(x).compile().as_text())] == (
            ["all-gather"] if invariant else []
        ), name
        out = fn(x)
        assert out.shape == x.shape and out.dtype == x.dtype, name
        assert 1e-4 < _rel(out.astype(jnp.float32), x.astype(jnp.float32)) < TWO_QUANT, name


def test_plan_message_decides_the_route_spec_and_permutation_once():
    """`plan_message` is None where the plain collective runs, else the WirePlan the
    message travels by: the direction's spec, the config's chunks, the site's
    calibrated permutation (refused where the op moves the channel axis)."""
    from taco_jax.calibration import Calibration, ChannelPlan

    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    perm = tuple(np.random.default_rng(0).permutation(128).tolist())
    calibration = Calibration((("site", "backward", ChannelPlan(perm, False)),))
    plans = {}

    def body(x):
        for name, config in (("off", _config("off")), ("taco+", _config("taco+", chunks=2))):
            call = Call(axis_name="tensor", config=config, site="site", calibration=calibration)
            plans[name] = plan_message(x, call, op="all_gather", direction="forward")
            plans[name + "/backward"] = plan_message(x, call, op="reduce_scatter", direction="backward")
        with pytest.raises(ValueError, match="channel permutation"):
            plan_message(x, call, op="reduce_scatter", direction="backward", moves_channels=True)
        return x

    _shard_run(mesh, body, jnp.zeros((4 * 8, 128), jnp.float32), in_specs=(P("tensor"),), out_specs=P("tensor"))
    assert plans["off"] is None and plans["off/backward"] is None
    forward, backward = plans["taco+"], plans["taco+/backward"]
    assert forward.spec == _config("taco+").forward and forward.chunks == 2 and forward.permutation is None
    # The calibration's plan turns the transform off for the backward direction only.
    assert backward.permutation is not None and backward.permutation.perm == perm and not backward.spec.hadamard
    x = jnp.arange(256.0).reshape(2, 128)
    np.testing.assert_array_equal(backward.from_wire_order(backward.to_wire_order(x)), x)
    np.testing.assert_array_equal(backward.to_wire_order(x), np.asarray(x)[:, list(perm)])


def test_gather_residual_decodes_what_the_gather_returned():
    """`run_all_gather`'s residual keeps the 8-bit messages when compressed (and decodes
    them to exactly the returned result), the result itself when plain."""
    from taco_jax import collectives

    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    x = _rank_coded((1, 1, 4), (8, 256))
    kept = {}

    def body(v):
        outs = []
        for name in ("off", "taco+"):
            call = Call(axis_name="tensor", config=_config(name))
            gathered, residual = collectives.run_all_gather(v, call, direction="forward", axis=0)
            kept[name] = [a.dtype for a in jax.tree.leaves(residual.parts)]
            outs.append(jnp.abs(residual.value() - gathered).max()[None])
            outs.append(gathered[None])
        return jnp.concatenate([o.reshape(1, -1) for o in outs], axis=1)

    out = np.asarray(_shard_run(mesh, body, x, in_specs=(P("tensor"),), out_specs=P("tensor")))
    width = 4 * 8 * 256
    plain_gap, plain, taco_gap, taco = out[:, 0], out[:, 1 : 1 + width], out[:, 1 + width], out[:, 2 + width :]
    assert kept["off"] == [jnp.float32] and kept["taco+"] == [jnp.uint8]
    assert not plain_gap.any() and not taco_gap.any()
    np.testing.assert_array_equal(plain[0], np.asarray(x).ravel())
    assert 0 < _rel(taco[0], np.asarray(x).ravel()) < ONE_QUANT


def test_nested_wire_ledgers_each_record_the_collectives_traced_inside():
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    body = lambda v: tj.all_gather(v, "tensor", _config("taco+"), site="inner")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P(), check_vma=False))
    with tj.record_wire() as outer:
        with tj.record_wire() as inner:
            fn.lower(jnp.zeros((4 * 8, 128), jnp.float32))
        fn.lower(jnp.zeros((4 * 16, 128), jnp.float32))
    assert [r.shape for r in inner.records] == [(8, 128)]
    assert [r.shape for r in outer.records] == [(8, 128), (16, 128)]


@pytest.mark.parametrize("overlap", [False, True], ids=["gather_matmul", "collective_matmul"])
def test_ledger_counts_each_matmul_message_of_a_differentiated_scan_once(overlap):
    """The sequence-parallel matmul ops (custom_vjp rules of their own) record each
    forward message once in a differentiated scan, as the collectives do."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    config = _config("taco+")
    x = jnp.ones((2, 4 * 8, 128), jnp.float32)
    weights = jnp.ones((2, 128, 128), jnp.float32)

    def body(v):
        def layer(h, w):
            (g,) = tj.tp.gather_matmul(h, (w,), "tensor", config, axis=1, site="in", overlap=overlap)
            return tj.tp.matmul_reduce_scatter(g, w, "tensor", config, axis=1, site="out", overlap=overlap), None

        return jax.grad(lambda u: jnp.sum(jax.lax.scan(layer, u, weights)[0] ** 2))(v)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(None, "tensor"), out_specs=P(None, "tensor"), check_vma=False)
    )
    with tj.record_wire() as ledger:
        fn.lower(x)
    assert sorted((r.site, r.op, r.direction) for r in ledger.records) == [
        ("in", "all_gather", "forward"),
        ("in", "reduce_scatter", "backward"),
        ("out", "all_gather", "backward"),
        ("out", "reduce_scatter", "forward"),
    ]


def test_ledger_counts_each_all_reduce_matmul_message_of_a_differentiated_scan_once():
    """Without sequence parallelism the collective matmuls record the row matmul's
    forward all-reduce and the column matmul's backward one once each in a
    differentiated scan."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    config = _config("taco+")
    weights = jnp.ones((2, 128, 128), jnp.float32)

    def body(v):
        def layer(h, w):
            (g,) = tj.tp.copy_matmul(h, (w,), "tensor", config, site="in", overlap=True)
            return tj.tp.matmul_all_reduce(g, w, "tensor", config, site="out", overlap=True), None

        return jax.grad(lambda u: jnp.sum(jax.lax.scan(layer, u, weights)[0] ** 2))(v)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    with tj.record_wire() as ledger:
        fn.lower(jnp.ones((2, 8, 128), jnp.float32))
    assert sorted((r.site, r.op, r.direction) for r in ledger.records) == [
        ("in", "all_reduce_two_shot", "backward"),
        ("out", "all_reduce_two_shot", "forward"),
    ]
