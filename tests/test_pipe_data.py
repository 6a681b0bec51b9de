"""Compression beyond the tensor axis: `taco_jax.ppermute` (pipeline sends) against
`lax.ppermute`, and `taco_jax.data_parallel.mean_gradients` (the data-parallel
reduction with error feedback) against `lax.pmean` and float64 numpy (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import taco_jax as tj

RANKS = 4
CYCLE = [(i, (i + 1) % RANKS) for i in range(RANKS)]


def _mesh(name):
    return Mesh(np.array(jax.devices()[:RANKS]), (name,))


def _rank_coded(shape, seed=0):
    """(RANKS * shape[0], ...) float32: rank r's block is (r + 1) * (1 + noise)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.concatenate([(r + 1) * (1 + rng.standard_normal(shape)) for r in range(RANKS)]), jnp.float32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _config(preset, **overrides):
    return tj.TacoConfig.preset(preset, min_bytes=0, kernel_mode="jnp", **overrides)


def _permute_run(config, x, perm=CYCLE, check_vma=False):
    def body(v):
        return tj.ppermute(v, "pipe", config, perm=perm, site="pipe.activations")

    fn = jax.shard_map(body, mesh=_mesh("pipe"), in_specs=P("pipe"), out_specs=P("pipe"), check_vma=check_vma)
    return jax.block_until_ready(jax.jit(fn)(x))


def _lax_permute(x, perm=CYCLE):
    fn = jax.shard_map(
        lambda v: lax.ppermute(v, "pipe", perm),
        mesh=_mesh("pipe"),
        in_specs=P("pipe"),
        out_specs=P("pipe"),
        check_vma=False,
    )
    return jax.block_until_ready(jax.jit(fn)(x))


@pytest.mark.parametrize("shape", [(3, 5, 256), (2, 7, 100)], ids=["whole_groups", "padded_last_axis"])
def test_ppermute_delivers_each_rank_its_source(shape):
    x = _rank_coded(shape)
    reference = _lax_permute(x)
    np.testing.assert_array_equal(_permute_run(_config("off"), x), reference)
    for preset, bound in [("taco", 0.07), ("taco+", 0.02)]:
        config = _config(preset)
        if shape[-1] < config.forward.group_size:  # 100 channels: groups of 64, the last row padded
            config = config.with_group_size(64)
        got = _permute_run(config, x)
        assert got.shape == x.shape and got.dtype == x.dtype
        for r in range(RANKS):  # each block came from its source rank, within one quantization
            block = slice(r * shape[0], (r + 1) * shape[0])
            assert 1e-4 < _rel(got[block], reference[block]) < bound, (preset, r)


def test_ppermute_leaves_ranks_without_a_source_at_zero():
    x = _rank_coded((2, 128))
    chain = [(0, 1), (1, 2)]
    got = _permute_run(_config("taco+"), x, perm=chain)
    reference = _lax_permute(x, perm=chain)
    np.testing.assert_array_equal(got[:2], 0.0)
    np.testing.assert_array_equal(got[6:], 0.0)
    assert 1e-4 < _rel(got[2:6], reference[2:6]) < 0.02


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
def test_ppermute_gradient_goes_back_along_the_reversed_pairs(check_vma):
    x, weights = _rank_coded((2, 256)), _rank_coded((2, 256), seed=1)
    mesh = _mesh("pipe")

    def grads(permute):
        def local(v, w):
            loss = jnp.sum(w * permute(v) ** 2)
            # check_vma=True: the gradient taken outside; False: inside (Megatron convention).
            return loss if check_vma else jax.grad(lambda u: jnp.sum(w * permute(u) ** 2))(v)

        if check_vma:
            fn = jax.shard_map(
                lambda v, w: lax.psum(local(v, w), "pipe"),
                mesh=mesh,
                in_specs=(P("pipe"), P("pipe")),
                out_specs=P(),
                check_vma=True,
            )
            return jax.block_until_ready(jax.jit(jax.grad(fn))(x, weights))
        fn = jax.shard_map(local, mesh=mesh, in_specs=(P("pipe"), P("pipe")), out_specs=P("pipe"), check_vma=False)
        return jax.block_until_ready(jax.jit(fn)(x, weights))

    reference = grads(lambda v: lax.ppermute(v, "pipe", CYCLE))
    np.testing.assert_array_equal(grads(lambda v: tj.ppermute(v, "pipe", _config("off"), perm=CYCLE)), reference)
    compressed = grads(lambda v: tj.ppermute(v, "pipe", _config("taco+"), perm=CYCLE))
    assert 1e-4 < _rel(compressed, reference) < 0.05


def test_ppermute_sends_one_byte_per_element_and_records_it():
    x = jnp.ones((RANKS * 16, 512), jnp.bfloat16)
    config = _config("taco+")
    fn = jax.jit(
        jax.shard_map(
            lambda v: tj.ppermute(v, "pipe", config, perm=CYCLE),
            mesh=_mesh("pipe"),
            in_specs=P("pipe"),
            out_specs=P("pipe"),
            check_vma=False,
        )
    )
    with tj.record_wire() as ledger:
        hlo = fn.lower(x).compile().as_text()
    (sent,) = [c for c in tj.collectives_in_hlo(hlo) if c.op == "collective-permute"]
    (record,) = ledger.records
    wire = tj.wire_bytes((16, 512), jnp.bfloat16, config.forward)
    assert sent.dtype == "u8" and sent.sent_bytes == wire == record.sent_bytes
    assert record.axis == "pipe" and record.bf16_sent_bytes == record.uncompressed_sent_bytes == 16 * 512 * 2
    assert sent.mesh_axes(_mesh("pipe")) == ("pipe",)


def test_ppermute_rejects_a_rank_sent_to_twice():
    with pytest.raises(ValueError, match="twice as a destination"):
        _permute_run(_config("taco"), _rank_coded((1, 128)), perm=[(0, 1), (2, 1)])


# ----------------------------------------------------------------------------- data parallel

GRADS_SHAPES = {"w": (RANKS, 40, 24), "b": (RANKS, 100), "scale": (RANKS, 1)}


def _grads(seed):
    """Per-rank gradients of three very different sizes and magnitudes."""
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(rng.standard_normal(shape) * 10.0 ** -(i * 3), jnp.float32)
        for i, (name, shape) in enumerate(GRADS_SHAPES.items())
    }


def _mean_run(config, grads, residual, check_vma=False):
    """One call per rank; the leading axis of every leaf is the data rank."""
    spec = {name: P("data") for name in GRADS_SHAPES}

    def body(g, r):
        g, r = jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], r)
        mean, new = tj.data_parallel.mean_gradients(g, "data", config, r)
        return jax.tree.map(lambda x: x[None], mean), jax.tree.map(lambda x: x[None], new)

    fn = jax.shard_map(body, mesh=_mesh("data"), in_specs=(spec, spec), out_specs=(spec, spec), check_vma=check_vma)
    return jax.block_until_ready(jax.jit(fn)(grads, residual))


def test_mean_gradients_off_is_pmean_exactly():
    grads = _grads(0)
    zeros = jax.tree.map(jnp.zeros_like, grads)
    mean, residual = _mean_run(_config("off"), grads, zeros)
    for name, g in grads.items():
        np.testing.assert_array_equal(mean[name], jnp.broadcast_to(g.mean(0), g.shape))
        np.testing.assert_array_equal(residual[name], 0.0)


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("preset,bound", [("taco", 0.12), ("taco+", 0.03)])
def test_mean_gradients_compressed_with_error_feedback(preset, bound, check_vma):
    grads = _grads(0)
    exact = {n: np.asarray(g, np.float64).mean(0) for n, g in grads.items()}
    residual = jax.tree.map(jnp.zeros_like, grads)
    total = {n: 0.0 for n in grads}
    steps = 4
    for step in range(steps):
        mean, residual = _mean_run(_config(preset), grads, residual, check_vma)
        for name in grads:
            got = np.asarray(mean[name], np.float64)
            np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))  # the same on every rank
            # Every parameter's gradient within codec error, however small its values (a
            # one-element group is exact: its scale maps it onto the grid's end).
            assert (1e-4 if exact[name].size > 1 else 0) <= _rel(got[0], exact[name]) < bound, (step, name)
            total[name] = total[name] + got[0]
    for name in grads:
        # Nothing is lost, only delayed: the results plus what the ranks still hold equal
        # the exact sums, and the running mean converges on the exact one.
        held = np.asarray(residual[name], np.float64).mean(0)
        np.testing.assert_allclose(
            total[name] + held, steps * exact[name], rtol=0, atol=1e-5 * np.abs(exact[name]).max()
        )
        assert _rel(total[name] / steps, exact[name]) < bound / 2


def test_mean_gradients_four_bits_with_error_feedback():
    grads = _grads(3)
    config = _config("taco+", backward=tj.QuantSpec.parse("int4:128:H:bf16"))
    residual = jax.tree.map(jnp.zeros_like, grads)
    exact, total = np.asarray(grads["w"], np.float64).mean(0), 0.0
    errors = []
    for step in range(8):
        mean, residual = _mean_run(config, grads, residual)
        total = total + np.asarray(mean["w"][0], np.float64)
        errors.append(_rel(total / (step + 1), exact))
    assert 0.05 < errors[0] < 0.4  # one 4-bit step is coarse
    assert errors[-1] < errors[0] / 4  # error feedback: the running mean converges


def test_mean_gradients_records_the_wire_and_sends_bytes():
    grads, config = _grads(0), _config("taco+")
    spec = {name: P("data") for name in GRADS_SHAPES}
    fn = jax.jit(
        jax.shard_map(
            lambda g: tj.data_parallel.mean_gradients(jax.tree.map(lambda x: x[0], g), "data", config)[0],
            mesh=_mesh("data"),
            in_specs=(spec,),
            out_specs=P(),
            check_vma=False,
        )
    )
    with tj.record_wire() as ledger:
        hlo = fn.lower(grads).compile().as_text()
    sent = [c for c in tj.collectives_in_hlo(hlo) if c.dtype == "u8"]
    assert sorted(c.op for c in sent) == ["all-gather", "all-to-all"]
    (record,) = ledger.records
    assert record.axis == "data" and record.sent_bytes == sum(c.sent_bytes for c in sent)
    elements = sum(int(np.prod(s[1:])) for s in GRADS_SHAPES.values())
    assert record.uncompressed_sent_bytes == 2 * (RANKS - 1) * elements * 4 // RANKS
    assert record.bf16_sent_bytes == record.uncompressed_sent_bytes // 2


def test_mean_gradients_keeps_nan_and_rejects_bad_input():
    grads = _grads(0)
    poisoned = dict(grads, b=grads["b"].at[1, 3].set(jnp.nan))
    zeros = jax.tree.map(jnp.zeros_like, grads)
    mean, _ = _mean_run(_config("taco+"), poisoned, zeros)
    assert np.isnan(np.asarray(mean["b"])).any()
    with pytest.raises(ValueError, match="structure and shapes"):
        _mean_run(_config("taco+"), grads, dict(zeros, b=jnp.zeros((RANKS, 99))))
    with pytest.raises(ValueError, match="float"):
        _mean_run(_config("taco+"), dict(grads, b=jnp.ones((RANKS, 100), jnp.int32)), zeros)
