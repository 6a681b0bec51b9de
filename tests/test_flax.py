"""taco_jax.flax: parallel layers on global arrays under plain jit (8 CPU devices), against
dense `nnx.Linear` / `linen.Dense` with the same weights."""

import collections
import dataclasses
import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import dot_general
from taco_jax.flax import ColumnParallelLinear, ParallelDotGeneral, RowParallelLinear

MESHES = [pytest.param((2, 1, 4), id="dp2_tp4"), pytest.param((1, 1, 8), id="tp8")]
D_MODEL, D_FF = 256, 512
COMPRESSED_MAX, COMPRESSED_MIN = 0.1, 1e-4


class MLP(nnx.Module):
    """col -> gelu -> row, or the same with dense nnx.Linear layers (mesh None)."""

    def __init__(self, *, rngs, mesh=None, config=None, sequence_parallel=False, overlap=False):
        if mesh is None:
            self.up, self.down = nnx.Linear(D_MODEL, D_FF, rngs=rngs), nnx.Linear(D_FF, D_MODEL, rngs=rngs)
        else:
            kw = dict(mesh=mesh, config=config, rngs=rngs, sequence_parallel=sequence_parallel, overlap=overlap)
            self.up = ColumnParallelLinear(D_MODEL, D_FF, site="mlp.in", **kw)
            self.down = RowParallelLinear(D_FF, D_MODEL, site="mlp.out", **kw)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _loss(model, x, target):
    return jnp.mean(jnp.tanh(model(x)) * target)


def _inputs(seed=1):
    keys = jax.random.split(jax.random.key(seed), 3)
    bias = 0.1 * jax.random.normal(keys[2], (D_MODEL,))
    return jax.random.normal(keys[0], (4, 16, D_MODEL)) + bias, jax.random.normal(keys[1], (4, 16, D_MODEL))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _place(mesh, x, sequence_parallel):
    return jax.device_put(x, NamedSharding(mesh, P("data", "tensor" if sequence_parallel else None)))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("mode", ["off", "taco", "taco+"])
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_parallel_mlp_matches_nnx_linear(mesh_shape, mode, sequence_parallel):
    mesh = tj.make_mesh(*mesh_shape)
    model = MLP(
        rngs=nnx.Rngs(0), mesh=mesh, config=tj.TacoConfig.preset(mode, min_bytes=0), sequence_parallel=sequence_parallel
    )
    assert model.up.kernel.shape == (D_MODEL, D_FF) and model.up.bias.shape == (D_FF,)
    assert nnx.get_partition_spec(nnx.state(model))["up"]["kernel"].get_value() == P(None, "tensor")
    assert model.down.kernel[...].sharding.spec == P("tensor", None)
    _check_against_dense(model, mesh, mode, sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("mode", ["off", "taco+"])
def test_overlapped_parallel_mlp_matches_nnx_linear(mode, sequence_parallel):
    """`overlap=True`: the collective matmuls (the all-reduce forms, or the sequence-
    parallel gather and reduce-scatter) give the dense layers' values and gradients."""
    mesh = tj.make_mesh(2, 1, 4)
    config = tj.TacoConfig.preset(mode, min_bytes=0)
    model = MLP(rngs=nnx.Rngs(0), mesh=mesh, config=config, sequence_parallel=sequence_parallel, overlap=True)
    _check_against_dense(model, mesh, mode, sequence_parallel)


def _check_against_dense(model, mesh, mode, sequence_parallel):
    """Output and gradients of `model` against the dense MLP of the same weights: equal
    to float rounding uncompressed, close but not equal compressed."""
    dense = MLP(rngs=nnx.Rngs(0))
    x, target = _inputs()
    out = nnx.jit(lambda m, v: m(v))(model, _place(mesh, x, sequence_parallel))
    grads = nnx.jit(nnx.grad(_loss))(model, _place(mesh, x, sequence_parallel), target)
    want_out = dense(x)
    want_grads = nnx.grad(_loss)(dense, x, target)
    pairs = [("out", out, want_out)] + [
        (jax.tree_util.keystr(path), g, w)
        for (path, g), w in zip(
            jax.tree_util.tree_leaves_with_path(nnx.state(grads)), jax.tree.leaves(nnx.state(want_grads))
        )
    ]
    for name, got, want in pairs:
        assert got.shape == want.shape, name
        if mode == "off":
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6, err_msg=name)
        else:
            assert COMPRESSED_MIN < _rel(got, want) < COMPRESSED_MAX, f"{name}: relative error {_rel(got, want)}"


def test_train_step_sends_uint8_at_wire_size():
    """The compiled nnx + optax train step of two MLPs moves the compressed messages as
    uint8: the forward all-reduces of both row layers and the backward one of the second
    column layer (the first one's input gradient is not needed)."""
    mesh = tj.make_mesh(2, 1, 4)
    config = tj.TacoConfig.preset("taco+", min_bytes=0)
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(*(MLP(rngs=rngs, mesh=mesh, config=config) for _ in range(2)))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    x, target = _inputs()
    x = _place(mesh, x, False)

    @nnx.jit
    def step(model, optimizer, x, target):
        loss, grads = nnx.value_and_grad(_loss)(model, x, target)
        optimizer.update(model, grads)
        return loss

    hlo = step.lower(model, optimizer, x, target).compile().as_text()
    compressed = [c for c in tj.collectives_in_hlo(hlo) if c.dtype == "u8"]
    # With no link to measure (CPU), the all-reduces at 4 ranks are two-shot (fewer bytes
    # than one-shot): a u8 all-to-all of this rank's (batch / data, 16, D_MODEL) float32
    # message (its rows padded to a multiple of the ranks), then a u8 all-gather of the
    # reduced quarter.
    message = tj.wire_bytes((2 * 16, D_MODEL), jnp.float32, config.forward)
    to_all = [c for c in compressed if c.op == "all-to-all"]
    gathers = [c for c in compressed if c.op == "all-gather"]
    assert len(to_all) == len(gathers) == 3 == len(compressed) / 2
    for whole, quarter in zip(to_all, gathers):
        assert whole.group_size == quarter.group_size == 4
        assert message <= whole.operand_bytes < 1.1 * message and quarter.operand_bytes * 4 == whole.operand_bytes
    losses = [float(step(model, optimizer, x, target)) for _ in range(3)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("mode", ["off", "taco+"])
def test_linen_dense_with_parallel_dot_general(mode):
    mesh = tj.make_mesh(2, 1, 4)
    config = tj.TacoConfig.preset(mode, min_bytes=0)
    init = nn.initializers.lecun_normal()

    class LinenMLP(nn.Module):
        parallel: bool

        @nn.compact
        def __call__(self, x):
            col = (
                dict(
                    dot_general=ParallelDotGeneral(mesh, config, "column", site="mlp.in"),
                    kernel_init=nn.with_partitioning(init, (None, "tensor")),
                )
                if self.parallel
                else {}
            )
            row = (
                dict(
                    dot_general=ParallelDotGeneral(mesh, config, "row", site="mlp.out"),
                    kernel_init=nn.with_partitioning(init, ("tensor", None)),
                )
                if self.parallel
                else {}
            )
            return nn.Dense(D_MODEL, **row)(jax.nn.gelu(nn.Dense(D_FF, **col)(x)))

    x, target = _inputs()
    dense_params = LinenMLP(False).init(jax.random.key(0), x)
    boxed = jax.jit(LinenMLP(True).init)(jax.random.key(0), x)  # traced: eagerly, every op compiles alone
    shardings = nn.get_sharding(boxed, mesh)
    params = jax.device_put(nn.unbox(boxed), shardings)
    loss = lambda module, p, v: jnp.mean(jnp.tanh(module.apply(p, v)) * target)
    got = jax.jit(jax.value_and_grad(lambda p, v: loss(LinenMLP(True), p, v)))(params, _place(mesh, x, False))
    want = jax.value_and_grad(lambda p, v: loss(LinenMLP(False), p, v))(dense_params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if mode == "off":
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
        else:
            assert COMPRESSED_MIN < _rel(g, w) < COMPRESSED_MAX


def test_bad_layers_are_clear_errors():
    mesh = tj.make_mesh(1, 1, 8)
    config = tj.TacoConfig.preset("taco")
    with pytest.raises(ValueError, match="column-parallel out_features=12 is not divisible"):
        ColumnParallelLinear(16, 12, mesh=mesh, config=config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="row-parallel in_features=12 is not divisible"):
        RowParallelLinear(12, 16, mesh=mesh, config=config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="config must be a TacoConfig"):
        ColumnParallelLinear(16, 16, mesh=mesh, config="taco", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kind must be one of"):
        ParallelDotGeneral(mesh, config, "diagonal")
    with pytest.raises(ValueError, match="with a 'tensor' axis"):
        ParallelDotGeneral(jax.make_mesh((8,), ("model",)), config, "column")


# Attention-shaped N-D kernels: (embed, heads, head_dim) column, (heads, head_dim, embed) row.
# Every message has at least 16 channels (the smallest group), the feature layout's
# tokens per shard included.
BATCH, SEQ, EMBED, HEADS, HEAD_DIM = 4, 16, 32, 2, 8
GROUP = 16
COLUMN_DIMS, ROW_DIMS = (((2,), (0,)), ((), ())), (((2, 3), (0, 1)), ((), ()))
BATCH_AXES = ("data", "fsdp")
# Where each layout puts the activation outside the pair (batch over data x fsdp).
ACTIVATION_SPECS = {
    "replicated": P(BATCH_AXES),
    "sequence": P(BATCH_AXES, "tensor"),
    "feature": P(BATCH_AXES, None, "tensor"),
}


@pytest.fixture(scope="module")
def fsdp_mesh():
    """(data 2, fsdp 2, tensor 2): a mesh `tj.make_mesh` does not make (MaxText's axes)."""
    return Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


def _attention_pair_loss(params, x, target, column, row):
    """A column matmul into heads and a row matmul out of them, as `column` and `row`
    dot_generals."""
    query_kernel, out_kernel = params
    heads = jnp.tanh(column(x, query_kernel, COLUMN_DIMS))
    return jnp.mean(jnp.tanh(row(heads, out_kernel, ROW_DIMS)) * target)


# The kernels split over tensor only, or over fsdp too on the embedding (MaxText's
# default; their partitioning is then passed as `kernel_spec`).
TENSOR_KERNELS = (P(None, "tensor"), P("tensor"))
FSDP_KERNELS = (P("fsdp", "tensor", None), P("tensor", None, "fsdp"))


def _attention_pair_inputs(mesh, layout, kernel_specs):
    """(kernels, x, target) placed as the layout has them outside the pair."""
    keys = jax.random.split(jax.random.key(7), 4)
    kernels = tuple(
        jax.device_put(jax.random.normal(key, shape) / 3, NamedSharding(mesh, spec))
        for key, shape, spec in zip(
            keys[:2], [(EMBED, HEADS, HEAD_DIM), (HEADS, HEAD_DIM, EMBED)], kernel_specs, strict=True
        )
    )
    activation = NamedSharding(mesh, ACTIVATION_SPECS[layout])
    x, target = (jax.device_put(jax.random.normal(k, (BATCH, SEQ, EMBED)), activation) for k in keys[2:])
    return kernels, x, target


def _pair(mesh, mode, layout, kernel_specs):
    preset = tj.TacoConfig.preset(mode, min_bytes=0)
    config = dataclasses.replace(
        preset,
        forward=dataclasses.replace(preset.forward, group_size=GROUP),
        backward=dataclasses.replace(preset.backward, group_size=GROUP),
    )
    return tuple(
        ParallelDotGeneral(
            mesh,
            config,
            kind,
            site=f"attention.{kind}",
            layout=layout,
            batch_axes=BATCH_AXES,
            kernel_spec=None if kernel_specs is TENSOR_KERNELS else tuple(spec),
        )
        for kind, spec in zip(("column", "row"), kernel_specs, strict=True)
    )


@pytest.mark.parametrize("layout", ["replicated", "sequence", "feature"])
def test_nd_dot_general_matches_lax_dot_general(fsdp_mesh, layout):
    """3-D kernels, column and row, batch over data x fsdp: the loss and its gradients
    (kernels and input) equal lax.dot_general's on one device with mode off, and are
    close but not equal with taco+ (both modes in one compiled program). The feature
    layout's kernels are split over fsdp too (`kernel_spec`)."""
    value_and_grad = jax.value_and_grad(_attention_pair_loss, argnums=(0, 1))
    kernels = FSDP_KERNELS if layout == "feature" else TENSOR_KERNELS
    inputs = _attention_pair_inputs(fsdp_mesh, layout, kernels)
    pairs = {mode: _pair(fsdp_mesh, mode, layout, kernels) for mode in ("off", "taco+")}
    results = jax.jit(lambda *args: {mode: value_and_grad(*args, *pair) for mode, pair in pairs.items()})(*inputs)
    on_one_device = jax.tree.map(np.asarray, inputs)
    want = jax.tree.leaves(
        jax.jit(value_and_grad, static_argnums=(3, 4))(*on_one_device, lax.dot_general, lax.dot_general)
    )
    for mode in ("off", "taco+"):
        for index, (got, exact) in enumerate(zip(jax.tree.leaves(results[mode]), want, strict=True)):
            assert got.shape == exact.shape, (mode, index)
            if mode == "off":
                np.testing.assert_allclose(np.asarray(got), np.asarray(exact), rtol=1e-5, atol=1e-7, err_msg=index)
            else:
                assert COMPRESSED_MIN < _rel(got, exact) < COMPRESSED_MAX, (index, _rel(got, exact))


def test_feature_layout_sends_uint8_and_nothing_more_on_the_batch_axes(fsdp_mesh):
    """The feature-sharded pair's compiled train step: the activation gather and
    reduce-scatter go u8 on the tensor axis, with no plain re-sharding collective beside
    them (only the scalar loss sum), and the batch axes carry no more bytes than plain
    GSPMD's program (the islands split the batch over data x fsdp)."""
    kernels, x, target = _attention_pair_inputs(fsdp_mesh, "feature", TENSOR_KERNELS)
    batch_axes_bytes, tensor_collectives = {}, {}
    taco_pair = _pair(fsdp_mesh, "taco+", "feature", TENSOR_KERNELS)
    for name, pair in (("plain", (lax.dot_general,) * 2), ("taco+", taco_pair)):
        step = jax.jit(jax.value_and_grad(lambda p, v, t: _attention_pair_loss(p, v, t, *pair), argnums=(0, 1)))
        batch_axes_bytes[name] = collections.Counter()
        for collective in tj.collectives_in_hlo(step.lower(kernels, x, target).compile().as_text()):
            axes = collective.mesh_axes(fsdp_mesh)
            if set(axes) & set(BATCH_AXES):
                batch_axes_bytes[name][axes, collective.op] += collective.sent_bytes
            elif axes == ("tensor",):
                tensor_collectives.setdefault(name, []).append(collective)
    # The kernels' gradients summed over data x fsdp, as plain; nothing gathers the batch.
    assert batch_axes_bytes["taco+"] and batch_axes_bytes["taco+"] <= batch_axes_bytes["plain"], batch_axes_bytes
    compressed = [c for c in tensor_collectives["taco+"] if c.dtype == "u8"]
    plain = [c for c in tensor_collectives["taco+"] if c.dtype != "u8"]
    assert {c.op for c in compressed} == {"all-gather", "all-to-all"}, compressed
    assert all(c.shape == () for c in plain), plain
    assert any(c.dtype == "f32" and c.shape != () for c in tensor_collectives["plain"])


WIDE_EMBED = 128  # 64 features a shard on 2 tensor ranks, under taco+'s groups of 128


@pytest.mark.parametrize(
    ("sharing", "layout"), [("column_many", "feature"), ("gather_input", "feature"), ("column_many", "replicated")]
)
def test_column_kernels_share_one_gather_of_64_wide_feature_shards(fsdp_mesh, sharing, layout):
    """Two column kernels reading one input, then a row kernel. Feature layout (64
    features a rank, groups of 128: the messages go as rows of the group size): one
    gather and one reduce-scatter each way; replicated with `message_rows`: one
    all-reduce each way, as rows. Values and gradients equal lax.dot_general's with mode
    off, close but not equal with taco+."""
    keys = jax.random.split(jax.random.key(3), 5)
    activation = NamedSharding(fsdp_mesh, ACTIVATION_SPECS[layout])
    x, target = (jax.device_put(jax.random.normal(k, (BATCH, SEQ, WIDE_EMBED)), activation) for k in keys[:2])
    column, row = (NamedSharding(fsdp_mesh, spec) for spec in TENSOR_KERNELS)
    kernels = tuple(
        jax.device_put(jax.random.normal(k, shape) / 8, sharding)
        for k, shape, sharding in zip(
            keys[2:],
            [(WIDE_EMBED, HEADS, HEAD_DIM)] * 2 + [(HEADS, HEAD_DIM, WIDE_EMBED)],
            [column, column, row],
            strict=True,
        )
    )

    def loss(params, x, target, mode):
        key_kernel, value_kernel, out_kernel = params
        if mode is None:
            keys_, values = (lax.dot_general(x, w, COLUMN_DIMS) for w in (key_kernel, value_kernel))
            out = lax.dot_general(jnp.tanh(keys_) * values, out_kernel, ROW_DIMS)
            return jnp.mean(jnp.tanh(out) * target)
        config = tj.TacoConfig.preset(mode, min_bytes=0)
        dots = [
            ParallelDotGeneral(
                fsdp_mesh, config, kind, site=kind, layout=layout, batch_axes=BATCH_AXES, message_rows=True
            )
            for kind in ("column", "row")
        ]
        if sharing == "column_many":
            keys_, values = dots[0].column_many(x, (key_kernel, value_kernel), COLUMN_DIMS)
        else:
            gathered = dots[0].gather_input(x)
            keys_, values = (dots[0](gathered, w, COLUMN_DIMS) for w in (key_kernel, value_kernel))
        return jnp.mean(jnp.tanh(dots[1](jnp.tanh(keys_) * values, out_kernel, ROW_DIMS)) * target)

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1))
    with tj.record_wire() as ledger:
        results = jax.jit(lambda *a: {m: value_and_grad(*a, m) for m in ("off", "taco+")})(kernels, x, target)
    taco_plus = [(r.op[:10], r.site, r.direction, r.shape) for r in ledger.records if r.compressed]
    if layout == "feature":
        shard_rows = (BATCH * SEQ * WIDE_EMBED // 8 // 128, 128)  # one rank's 1 x 16 x 64 block, in rows of 128
        assert sorted(taco_plus) == [
            ("all_gather", "column", "forward", shard_rows),
            ("all_gather", "row", "backward", shard_rows),
            ("reduce_sca", "column", "backward", (2 * shard_rows[0], 128)),
            ("reduce_sca", "row", "forward", (2 * shard_rows[0], 128)),
        ]
    else:
        whole_rows = (BATCH * SEQ * WIDE_EMBED // 4 // 128, 128)  # one rank's 1 x 16 x 128 block
        assert sorted(taco_plus) == [
            ("all_reduce", "column", "backward", whole_rows),
            ("all_reduce", "row", "forward", whole_rows),
        ]
    want = jax.tree.leaves(
        jax.jit(value_and_grad, static_argnums=3)(*jax.tree.map(np.asarray, (kernels, x, target)), None)
    )
    for mode in ("off", "taco+"):
        for index, (got, exact) in enumerate(zip(jax.tree.leaves(results[mode]), want, strict=True)):
            if mode == "off":
                np.testing.assert_allclose(np.asarray(got), np.asarray(exact), rtol=1e-5, atol=1e-7, err_msg=index)
            else:
                assert COMPRESSED_MIN < _rel(got, exact) < COMPRESSED_MAX, (index, _rel(got, exact))


def test_bad_dot_generals_are_clear_errors(fsdp_mesh):
    """Raised before anything compiles, naming the value."""
    config = tj.TacoConfig.preset("taco")
    with pytest.raises(ValueError, match="layout must be one of"):
        ParallelDotGeneral(fsdp_mesh, config, "column", layout="diagonal")
    with pytest.raises(ValueError, match="block of 192 elements .* does not cut into them"):
        ParallelDotGeneral(fsdp_mesh, tj.TacoConfig.preset("taco+"), "column", layout="feature").check_shapes(
            (BATCH, SEQ, 12), (12, HEADS, HEAD_DIM), COLUMN_DIMS
        )
    with pytest.raises(ValueError, match="gather_input gathers a column layer's input"):
        ParallelDotGeneral(fsdp_mesh, config, "row").gather_input(jnp.ones((BATCH, SEQ, EMBED)))
    with pytest.raises(ValueError, match="not 'feature' or message_rows"):
        ParallelDotGeneral(fsdp_mesh, config, "row", message_rows=True, overlap=True)
    with pytest.raises(ValueError, match="cannot be combined with layout='feature'"):
        ParallelDotGeneral(fsdp_mesh, config, "column", sequence_parallel=True, layout="feature")
    with pytest.raises(ValueError, match="overlap=True runs with layout"):
        ParallelDotGeneral(fsdp_mesh, config, "row", layout="feature", overlap=True)
    with pytest.raises(ValueError, match="name the tensor-parallel axis 'tensor'"):
        ParallelDotGeneral(fsdp_mesh, config, "row", batch_axes=("data", "tensor"))
    with pytest.raises(ValueError, match="with a 'model' axis"):
        ParallelDotGeneral(fsdp_mesh, config, "column", axis_name="model")
    for kernel_spec in [("fsdp", "model"), (None, ("fsdp", "tensor")), (None, None)]:
        with pytest.raises(ValueError, match=r"kernel_spec .* and 'tensor' once, as the first axis of its entry"):
            ParallelDotGeneral(fsdp_mesh, config, "column", kernel_spec=kernel_spec)
    column = ParallelDotGeneral(fsdp_mesh, config, "column", batch_axes=BATCH_AXES)
    x, kernel = jnp.ones((4, 2, 8)), jnp.ones((8, 2, 4))
    bad_dimension_numbers = [
        (((1,), (0,)), ((), ())),  # not the last input axis
        (((2,), (1,)), ((), ())),  # not the first kernel axis
        (((2,), (0,)), ((0,), (0,))),  # batch dimensions
        (((), ()), ((), ())),  # nothing contracted
        (((1, 2), (0, 1)), ((), ())),  # unequal sizes
        (((2,), (0, 1)), ((), ())),  # unequal counts
        (((5,), (0,)), ((), ())),  # out of range
    ]
    for dimension_numbers in bad_dimension_numbers:
        with pytest.raises(ValueError, match="contracts the last k axes") as raised:
            column(x, kernel, dimension_numbers)
        assert f"{dimension_numbers} for shapes (4, 2, 8) x (8, 2, 4)" in str(raised.value)
    with pytest.raises(ValueError, match=r"sharded_dim=0 of a column-parallel kernel .* output axes \[1, 2\]"):
        dataclasses.replace(column, sharded_dim=0)(x, kernel, COLUMN_DIMS)
    with pytest.raises(ValueError, match=r"axis 0 of the input of shape \(3, 2, 8\) .* \('data', 'fsdp'\) of 4"):
        column(jnp.ones((3, 2, 8)), kernel, COLUMN_DIMS)
    with pytest.raises(ValueError, match="has none before its sequence and contracted axes"):
        dataclasses.replace(column, layout="sequence")(x[0], kernel, (((1,), (0,)), ((), ())))


@pytest.mark.gpu
def test_parallel_layers_run_the_gpu_kernels_on_gpus():
    """Every GPU as the tensor axis: the codec kernels (Gluon, or Pallas where they do not
    take the work) under check_vma=True agree with the jnp path, and the gradients stay
    within codec error of dense."""
    mesh = tj.make_mesh(1, 1, len(jax.devices()))
    x, target = _inputs()
    dense = MLP(rngs=nnx.Rngs(0))
    want = jax.tree.leaves(nnx.state(nnx.grad(_loss)(dense, x, target)))
    results = {}
    for kernels in ("gpu", "jnp"):
        model = MLP(rngs=nnx.Rngs(0), mesh=mesh, config=tj.TacoConfig.preset("taco+", min_bytes=0, kernel_mode=kernels))
        grads = nnx.jit(nnx.grad(_loss))(model, _place(mesh, x, False), target)
        results[kernels] = jax.tree.leaves(nnx.state(grads))
        hlo = nnx.jit(nnx.grad(_loss)).lower(model, _place(mesh, x, False), target).compile().as_text()
        # A Gluon kernel is jaxlib's Triton custom call; a Pallas one XLA's Triton call.
        kernels_in_hlo = "triton_kernel_call" in hlo or "__gpu$xla.gpu.triton" in hlo
        assert kernels_in_hlo == (kernels == "gpu")
    for ours, reference, exact in zip(results["gpu"], results["jnp"], want):
        assert _rel(ours, reference) < 0.01
        assert COMPRESSED_MIN < _rel(ours, exact) < COMPRESSED_MAX


def test_any_leading_shape_and_a_mesh_with_pipe():
    """Batches that do not split over data (replicated), 2-D and 1-D inputs, and a
    (data 2, pipe 2, tensor 2) mesh (pipe replicated inside the islands)."""
    dense = MLP(rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(5), 3)
    inputs = [jax.random.normal(k, shape) for k, shape in zip(keys, [(3, 5, D_MODEL), (7, D_MODEL), (D_MODEL,)])]
    compressed = MLP(rngs=nnx.Rngs(0), mesh=tj.make_mesh(2, 1, 4), config=tj.TacoConfig.preset("taco+", min_bytes=0))
    for x in inputs:
        got = nnx.jit(lambda m, v: m(v))(compressed, x)
        assert got.shape == x.shape and COMPRESSED_MIN < _rel(got, dense(x)) < COMPRESSED_MAX, x.shape
    for sequence_parallel in (False, True):
        model = MLP(
            rngs=nnx.Rngs(0),
            mesh=tj.make_mesh(2, 2, 2),
            config=tj.TacoConfig.preset("off"),
            sequence_parallel=sequence_parallel,
        )
        x = inputs[0][:2, :4]
        np.testing.assert_allclose(
            np.asarray(nnx.jit(lambda m, v: m(v))(model, x)), np.asarray(dense(x)), rtol=1e-4, atol=1e-5
        )


def test_under_min_bytes_is_reported_and_warned_once(monkeypatch):
    """A message under `min_bytes` stays plain: the ledger says so with the sizes, and the
    layers warn once a process (not for a message that is compressed, nor twice)."""
    mesh = tj.make_mesh(2, 1, 4)
    x = _place(mesh, _inputs()[0], False)
    monkeypatch.setattr(dot_general, "_WARNED_UNDER_MIN_BYTES", False)
    compressed = MLP(rngs=nnx.Rngs(0), mesh=mesh, config=tj.TacoConfig.preset("taco+", min_bytes=0))
    with warnings.catch_warnings(record=True) as caught, tj.record_wire() as ledger:
        warnings.simplefilter("always")
        nnx.jit(lambda m, x: m(x))(compressed, x)
    assert not caught and ledger.records[0].reason == "int8:128:H:bf16"
    plain = MLP(rngs=nnx.Rngs(0), mesh=mesh, config=tj.TacoConfig.preset("taco+"))
    with pytest.warns(UserWarning, match="under min_bytes") as caught, tj.record_wire() as ledger:
        nnx.jit(lambda m, x: m(x))(plain, x)
        nnx.jit(lambda m, x: m(x) + 1)(plain, x)  # traced again: no second warning
    assert len(caught) == 1
    record = ledger.records[0]
    nbytes = math.prod(record.shape) * 4
    assert record.reason == f"under min_bytes ({nbytes:,} < {8 << 20:,} B)" and not record.compressed
    line = ledger.report().splitlines()[1]
    assert line.startswith(record.site) and line.endswith(record.reason) and "100.0%" in line
