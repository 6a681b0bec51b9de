"""The collectives and Megatron mappings under both shard_map conventions: JAX's default
`check_vma=True` (gradient inside or outside the shard_map) and `check_vma=False`
(gradient inside), against a dense single-device reference (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax as tj

CONVENTIONS = ["vma_grad_outside", "vma_grad_inside", "no_vma_grad_inside"]
# Relative gradient error bounds with compression (one quantization each way; codec
# error of taco+ is ~0.7%, of taco ~2.6%) and the floor proving the codec ran.
COMPRESSED_MAX, COMPRESSED_MIN = 0.1, 1e-4


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _mlp_inputs(tp, seed=0):
    """(x, scale, w1, w2, target): scale is a replicated parameter applied before the
    column-parallel layer (on sequence shards with sequence parallelism)."""
    rng = np.random.default_rng(seed)
    seq, d_model, d_ff = 8 * tp, 256, 32 * tp
    x = rng.standard_normal((seq, d_model))
    scale = 1 + 0.1 * rng.standard_normal(d_model)
    w1 = rng.standard_normal((d_model, d_ff)) / np.sqrt(d_model)
    w2 = rng.standard_normal((d_ff, d_model)) / np.sqrt(d_ff)
    target = rng.standard_normal((seq, d_model))
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, scale, w1, w2, target))


def _dense_loss(x, scale, w1, w2, target):
    return jnp.sum(jnp.tanh(jax.nn.gelu((x * scale) @ w1) @ w2) * target)


def _tp_loss(config, sequence_parallel):
    """Per-rank MLP loss: column-parallel w1, row-parallel w2 through taco_jax.tp."""

    def loss(x, scale, w1, w2, target):
        x = x * scale
        enter = (
            tj.tp.gather_from_sp(x, "tensor", config) if sequence_parallel else tj.tp.copy_to_tp(x, "tensor", config)
        )
        partial = jax.nn.gelu(enter @ w1) @ w2
        out = (
            tj.tp.reduce_scatter_to_sp(partial, "tensor", config)
            if sequence_parallel
            else tj.tp.reduce_from_tp(partial, "tensor", config)
        )
        return jnp.sum(jnp.tanh(out) * target)

    return loss


def _tp_grads(mesh, convention, config, sequence_parallel, inputs):
    """Gradients of the summed loss w.r.t. (x, scale, w1, w2), taken as `convention`
    says. Rows of x are split over "data" (and over "tensor" with sequence parallelism)."""
    loss = _tp_loss(config, sequence_parallel)
    rows = P(("data", "tensor")) if sequence_parallel else P("data")
    param_specs = (P(), P(None, "tensor"), P("tensor", None))
    in_specs = (rows, *param_specs, rows)
    argnums = (0, 1, 2, 3)
    if convention == "vma_grad_outside":
        summed_axes = ("data", "tensor") if sequence_parallel else ("data",)
        total = jax.shard_map(
            lambda *a: lax.psum(loss(*a), summed_axes), mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=True
        )
        return jax.jit(jax.grad(total, argnums=argnums))(*inputs)
    check_vma = convention == "vma_grad_inside"

    def body(*args):
        dx, *param_grads = jax.grad(loss, argnums=argnums)(*args)
        if not check_vma:  # each rank's parameter gradients cover its own rows only
            param_grads = [lax.psum(g, "data") for g in param_grads]
            param_grads = (
                tj.tp.sum_sequence_parallel_grads(param_grads, list(param_specs), "tensor")
                if sequence_parallel
                else param_grads
            )
        return dx, *param_grads

    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(rows, *param_specs), check_vma=check_vma)
    return jax.jit(fn)(*inputs)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("mode", ["off", "taco+"])
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_mlp_gradients_match_dense_under_every_convention(convention, mode, sequence_parallel):
    mesh = tj.make_mesh(2, 1, 4)
    config = tj.TacoConfig.preset(mode, min_bytes=0)
    inputs = _mlp_inputs(4)
    grads = jax.block_until_ready(_tp_grads(mesh, convention, config, sequence_parallel, inputs))
    expected = jax.grad(_dense_loss, argnums=(0, 1, 2, 3))(*inputs)
    for name, got, want in zip(("dx", "dscale", "dw1", "dw2"), grads, expected):
        if mode == "off":
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5, err_msg=name)
        else:
            assert COMPRESSED_MIN < _rel(got, want) < COMPRESSED_MAX, f"{name}: relative error {_rel(got, want)}"


@pytest.mark.parametrize("mapping", ["copy_to_tp", "reduce_from_tp"])
def test_gradient_outside_a_check_vma_false_shard_map_raises(mapping):
    mesh = tj.make_mesh(2, 1, 4)
    config = tj.TacoConfig.preset("off")
    x, _, w1, w2, target = _mlp_inputs(4)

    def loss(x, w1, w2, target):
        hidden = tj.tp.copy_to_tp(x, "tensor", config) if mapping == "copy_to_tp" else x
        out = hidden @ w1 @ w2
        out = tj.tp.reduce_from_tp(out, "tensor", config) if mapping == "reduce_from_tp" else out
        return lax.psum(jnp.sum(out * target), "data")

    in_specs = (P("data"), P(None, "tensor"), P("tensor", None), P("data"))
    total = jax.shard_map(loss, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
    assert np.isfinite(float(jax.jit(total)(x, w1, w2, target)))  # the forward pass is fine
    with pytest.raises(ValueError, match=f"{mapping} inside jax.shard_map\\(check_vma=False\\) is differentiated"):
        jax.grad(total, argnums=(0, 1))(x, w1, w2, target)


def test_mappings_reject_inputs_of_the_wrong_type_under_check_vma():
    mesh = tj.make_mesh(1, 1, 8)
    config = tj.TacoConfig.preset("off")
    x = jnp.ones((8, 16))

    def run(body, spec):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P("tensor"), check_vma=True))(x)

    with pytest.raises(ValueError, match="copy_to_tp needs x replicated over 'tensor'"):
        run(lambda v: tj.tp.copy_to_tp(v, "tensor", config), P("tensor"))
    with pytest.raises(ValueError, match="reduce_from_tp sums per-rank partial results"):
        run(lambda v: tj.tp.reduce_from_tp(v, "tensor", config)[None], P())


@pytest.mark.parametrize("mode", ["off", "taco"])
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_collective_gradients_match_lax_under_every_convention(convention, mode):
    """Each collective, differentiated the same way as its lax counterpart."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    config = tj.TacoConfig.preset(mode, min_bytes=0)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    ours = (
        lambda u: tj.all_gather(u, "tensor", config),
        lambda u: tj.reduce_scatter(u, "tensor", config),
        lambda u: tj.all_reduce(u, "tensor", config, algorithm="two_shot"),
        lambda u: tj.all_reduce(u, "tensor", config, algorithm="one_shot"),
    )
    theirs = (
        lambda u: lax.all_gather(u, "tensor", tiled=True),
        lambda u: lax.psum_scatter(u, "tensor", tiled=True),
        lambda u: lax.psum(u, "tensor"),
        lambda u: lax.psum(u, "tensor"),
    )

    def per_rank_losses(ops, v, w):
        return (
            jnp.sum(ops[0](v) * jnp.tile(w, (4, 1))),
            jnp.sum(ops[1](v) * w[:1]),
            jnp.sum(ops[2](v) * w),
            jnp.sum(ops[3](v) * w),
        )

    def grads(ops):
        if convention == "vma_grad_outside":
            total = jax.shard_map(
                lambda v, w: sum(per_rank_losses(ops, v, w))[None],
                mesh=mesh,
                in_specs=(P("tensor"), P("tensor")),
                out_specs=P("tensor"),
                check_vma=True,
            )
            return jax.jit(jax.grad(lambda v, w: total(v, w).sum()))(x, weights)
        body = lambda v, w: jax.grad(lambda u: sum(per_rank_losses(ops, u, w)))(v)
        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("tensor"), P("tensor")),
                out_specs=P("tensor"),
                check_vma=convention == "vma_grad_inside",
            )
        )(x, weights)

    got, want = grads(ours), grads(theirs)
    if mode == "off":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        assert COMPRESSED_MIN < _rel(got, want) < COMPRESSED_MAX


def test_all_reduce_result_is_invariant_under_check_vma():
    """out_specs=P() (replicated) is accepted only for a result JAX knows is invariant."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4 * 8, 256)), jnp.float32)
    for algorithm in ("one_shot", "two_shot"):
        config = tj.TacoConfig.preset("taco", min_bytes=0)
        fn = jax.shard_map(
            lambda v: tj.all_reduce(v, "tensor", config, algorithm=algorithm),
            mesh=mesh,
            in_specs=P("tensor"),
            out_specs=P(),
            check_vma=True,
        )
        want = x.reshape(4, 8, 256).sum(0)
        assert COMPRESSED_MIN < _rel(jax.jit(fn)(x), want) < COMPRESSED_MAX
