"""Collective matmuls (`overlap=True`) against the collective-then-matmul path (8 CPU devices)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import message

# One quantization of INT8 after the transform per message, twice along the block
# (gather in, reduce-scatter out), and gradients through both directions.
COMPRESSED_BOUND = 0.05


def _config(mode):
    # Groups of 32: the block's messages have 96 channels.
    return tj.TacoConfig.preset(mode, min_bytes=0).with_group_size(32)


def _block(config, overlap, sequence_parallel=True):
    """An MLP: gather -> column matmul -> tanh -> row matmul -> reduce-scatter with
    sequence parallelism, else copy -> column matmul -> tanh -> row matmul -> all-reduce."""

    def block(x, w_in, w_out):
        if not sequence_parallel and overlap:
            (h,) = tj.tp.copy_matmul(x, (w_in,), "tensor", config, site="in", overlap=True)
            return tj.tp.matmul_all_reduce(jnp.tanh(h), w_out, "tensor", config, site="out", overlap=True)
        if not sequence_parallel:  # the algorithm the overlapped all-reduce decomposes
            h = tj.tp.copy_to_tp(x, "tensor", config, site="in", algorithm="two_shot") @ w_in
            return tj.tp.reduce_from_tp(jnp.tanh(h) @ w_out, "tensor", config, site="out", algorithm="two_shot")
        (h,) = tj.tp.gather_matmul(x, (w_in,), "tensor", config, axis=1, site="in", overlap=overlap)
        return tj.tp.matmul_reduce_scatter(jnp.tanh(h), w_out, "tensor", config, axis=1, site="out", overlap=overlap)

    return block


def _inputs(mesh_shape, seq_shard=5, d=96, ff=24):
    rng = np.random.default_rng(3)
    data, _, tensor = mesh_shape
    x = rng.standard_normal((2 * data, seq_shard * tensor, d))
    w_in = rng.standard_normal((d, ff * tensor)) / np.sqrt(d)
    w_out = rng.standard_normal((ff * tensor, d)) / np.sqrt(ff * tensor)
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, w_in, w_out))


SPECS = (P("data", "tensor"), P(None, "tensor"), P("tensor", None))
# Without sequence parallelism the activation is replicated over the tensor axis.
SPECS_REPLICATED = (P("data"), P(None, "tensor"), P("tensor", None))


def _specs(sequence_parallel):
    return SPECS if sequence_parallel else SPECS_REPLICATED


def _grads_inside(mesh, config, overlap, args, sequence_parallel=True):
    """Values and gradients with the gradient taken inside a check_vma=False shard_map."""
    block, specs = _block(config, overlap, sequence_parallel), _specs(sequence_parallel)

    def body(x, w_in, w_out):
        loss = lambda *a: jnp.sum(jnp.sin(block(*a)))
        grads = jax.grad(loss, argnums=(0, 1, 2))(x, w_in, w_out)
        return block(x, w_in, w_out), *grads

    out_specs = (specs[0], *specs)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False))
    return [np.asarray(a, np.float64) for a in jax.block_until_ready(fn(*args))]


def _grads_outside(mesh, config, overlap, args, sequence_parallel=True):
    """Values and gradients with jax.grad outside a check_vma=True shard_map."""
    specs = _specs(sequence_parallel)
    block = jax.shard_map(_block(config, overlap, sequence_parallel), mesh=mesh, in_specs=specs, out_specs=specs[0])
    loss = lambda *a: jnp.sum(jnp.sin(block(*a)))
    fn = jax.jit(lambda *a: (block(*a), *jax.grad(loss, argnums=(0, 1, 2))(*a)))
    return [np.asarray(a, np.float64) for a in jax.block_until_ready(fn(*args))]


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize(
    ("mesh_shape", "sequence_parallel"),
    [((2, 1, 4), True), ((1, 1, 8), True), ((4, 1, 2), True), ((2, 1, 4), False), ((1, 1, 8), False)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else ("sp" if v else "no_sp"),
)
@pytest.mark.parametrize("convention", ["inside", "outside"])
def test_overlapped_block_matches_the_collective_path(mesh_shape, sequence_parallel, convention):
    """Uncompressed, the collective matmuls give the values and gradients of the
    collective-then-matmul path to float rounding; compressed (taco+), close to both
    paths and not equal to the uncompressed result, under both shard_map conventions.
    Without sequence parallelism the 10 rows per rank pad to a multiple of 4 and 8."""
    mesh = tj.make_mesh(*mesh_shape)
    run = _grads_inside if convention == "inside" else _grads_outside
    run = functools.partial(run, sequence_parallel=sequence_parallel)
    args = _inputs(mesh_shape)
    reference = run(mesh, _config("off"), False, args)
    plain = run(mesh, _config("off"), True, args)
    for got, want in zip(plain, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    compressed = run(mesh, _config("taco+"), True, args)
    unoverlapped = run(mesh, _config("taco+"), False, args)
    for got, same_codec, exact in zip(compressed, unoverlapped, reference, strict=True):
        assert _rel(got, same_codec) < 3e-4  # the same messages, summed in another order
        assert 0 < _rel(got, exact) < COMPRESSED_BOUND


def _hlo(mesh, fn, *args):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=SPECS, out_specs=SPECS, check_vma=False)).lower(*args)


def test_compiled_collective_matmul_sends_uint8_permutes_of_the_chunk_sizes():
    """Forward and backward of an overlapped compressed block move only 8-bit
    collective-permutes of one chunk message each: no all-gather, all-to-all or
    reduce-scatter is left, and the bytes equal the ledger's (= the collectives')."""
    mesh_shape = (1, 1, 4)
    mesh = tj.make_mesh(*mesh_shape, devices=jax.devices()[:4])
    config = _config("taco+")
    block = _block(config, True)
    args = _inputs(mesh_shape, seq_shard=16, d=256, ff=64)

    def grads(*a):
        return jax.grad(lambda *b: jnp.sum(jnp.sin(block(*b))), argnums=(0, 1, 2))(*a)

    with tj.record_wire() as ledger:
        compiled = _hlo(mesh, grads, *args).compile().as_text()
    found = tj.collectives_in_hlo(compiled)
    permutes = [c for c in found if c.op == "collective-permute"]
    assert {c.op for c in found} == {"collective-permute"} and {c.dtype for c in permutes} == {"u8"}
    # Forward: gather (3 shifts) and scatter (3); backward: scatter of the input
    # gradient and gather of the output gradient (3 each).
    assert len(permutes) == 4 * 3
    sent = sum(r.sent_bytes for r in ledger.records)
    assert sum(c.operand_bytes for c in permutes) == sent
    gather = tj.wire_bytes((2, 16, 256), jnp.float32, config.forward)
    assert {c.operand_bytes for c in permutes} == {gather}


def test_compiled_all_reduce_form_sends_uint8_permutes_and_gathers_only_blocks():
    """Without sequence parallelism, forward (row matmul) and backward (the column
    matmul's input gradient) each reduce-scatter 8-bit row blocks by shifts and
    all-gather the 8-bit summed block: no all-reduce is left, and the bytes equal the
    ledger's (= the two-shot all-reduce's)."""
    mesh_shape = (1, 1, 4)
    mesh = tj.make_mesh(*mesh_shape, devices=jax.devices()[:4])
    config = _config("taco+")
    block = _block(config, True, sequence_parallel=False)
    args = _inputs(mesh_shape, seq_shard=4, d=256, ff=64)  # 2 x 16 rows: blocks of 8 rows

    def grads(*a):
        return jax.grad(lambda *b: jnp.sum(jnp.sin(block(*b))), argnums=(0, 1, 2))(*a)

    fn = jax.shard_map(grads, mesh=mesh, in_specs=SPECS_REPLICATED, out_specs=SPECS_REPLICATED, check_vma=False)
    with tj.record_wire() as ledger:
        compiled = jax.jit(fn).lower(*args).compile().as_text()
    found = tj.collectives_in_hlo(compiled)
    assert {c.op for c in found} == {"collective-permute", "all-gather"} and {c.dtype for c in found} == {"u8"}
    groups = 8 * 256 // config.forward.group_size
    block_message = message.message_layout(groups, config.forward).nbytes
    assert {c.operand_bytes for c in found} == {block_message}
    assert sum(c.op == "collective-permute" for c in found) == 2 * 3
    assert sum(c.op == "all-gather" for c in found) == 2
    assert {r.op for r in ledger.records} == {"all_reduce_two_shot"}
    # A permute sends its operand to one peer, an all-gather to the other three.
    peers = {"collective-permute": 1, "all-gather": 3}
    assert sum(r.sent_bytes for r in ledger.records) == sum(peers[c.op] * c.operand_bytes for c in found)


def test_all_reduce_form_refuses_a_check_vma_false_gradient_outside():
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    block = jax.shard_map(
        _block(_config("taco+"), True, sequence_parallel=False),
        mesh=mesh,
        in_specs=SPECS_REPLICATED,
        out_specs=P("data"),
        check_vma=False,
    )
    args = _inputs((1, 1, 4))
    with pytest.raises(ValueError, match="differentiated from outside"):  # raised while tracing
        jax.eval_shape(jax.grad(lambda *a: jnp.sum(block(*a)), argnums=(1, 2)), *args)


def test_overlap_refuses_the_feature_axis_and_an_undivided_sequence():
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    x = jnp.ones((2, 6, 128))
    w = jnp.ones((128, 128))
    config = _config("taco+")

    def run(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))(x, w)

    with pytest.raises(ValueError, match="feature axis"):
        run(lambda a, b: tj.tp.gather_matmul(a, (b,), "tensor", config, axis=2, overlap=True)[0])
    with pytest.raises(ValueError, match="not divisible by 4 ranks"):
        run(lambda a, b: tj.tp.matmul_reduce_scatter(a, b, "tensor", config, axis=1, overlap=True))


def test_collective_matmul_on_a_simulated_mesh_equals_the_device_mesh():
    """The shift permutes work under `simulated_shard_map` (named vmaps, as the quality
    runs use): the same values as on the device mesh."""
    mesh_shape = (2, 1, 4)
    args = _inputs(mesh_shape)
    block = _block(_config("taco+"), True)
    want = jax.jit(jax.shard_map(block, mesh=tj.make_mesh(*mesh_shape), in_specs=SPECS, out_specs=P("data", "tensor")))
    simulated = tj.simulated_shard_map(block, dict(zip(tj.MESH_AXES, mesh_shape)), SPECS, P("data", "tensor"))
    np.testing.assert_allclose(np.asarray(jax.jit(simulated)(*args)), np.asarray(want(*args)), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_collective_matmul_on_the_gpu_takes_the_kernels_and_matches_the_jnp_path():
    """On one GPU with a simulated 1x1x4 mesh the overlapped block runs the codec
    kernels: its values and gradients agree with the jnp path and with the collective
    path, within a rounding step of the codec."""
    mesh_shape = (1, 1, 4)
    args = _inputs(mesh_shape, seq_shard=16, d=256, ff=64)
    axes = dict(zip(tj.MESH_AXES, mesh_shape))

    def run(kernel_mode, overlap):
        # The gradient inside the simulated mesh, as the trainer takes it (outside a
        # vmap JAX cannot transpose the collectives: docs/limitations.md).
        block = _block(dataclasses.replace(_config("taco+"), kernel_mode=kernel_mode), overlap)

        def body(*a):
            grads = jax.grad(lambda *b: jnp.sum(jnp.sin(block(*b))), argnums=(0, 1, 2))(*a)
            return block(*a), *grads

        fn = jax.jit(tj.simulated_shard_map(body, axes, SPECS, (P("data", "tensor"), *SPECS)))
        return [np.asarray(a, np.float64) for a in fn(*args)]

    gpu, reference, collective = run("auto", True), run("jnp", True), run("auto", False)
    for got, want, same in zip(gpu, reference, collective, strict=True):
        assert _rel(got, want) < 0.01 and _rel(got, same) < 0.01
