"""Edges where a silent wrong result would hide: float16 extremes, empty arrays, the
derivative of the public codec, the platform a program is lowered for, and JAX internals
behind `jax_compat` (8 CPU devices)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.kernels import jax_compat

PRESETS = ("fp8", "taco", "taco+")
KERNELS = ("jnp", "interpret")
RING = [(0, 1), (1, 2), (2, 3), (3, 0)]  # jax's vmap rule for ppermute takes whole permutations


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_float16_near_its_largest_value_never_decodes_to_inf(preset, kernels):
    """Values up to 65504 carry codec error past float16's range; the decode saturates
    there (the plain cast gave Inf for thousands of them), and NaN stays NaN."""
    rng = np.random.default_rng(0)
    x = rng.uniform(6.0e4, 65504, (64, 256)) * rng.choice([-1.0, 1.0], (64, 256))
    x[3, 5] = np.nan
    x = x.astype(np.float16)
    spec = tj.TacoConfig.preset(preset).forward
    y = np.asarray(tj.decompress(tj.compress(x, spec, kernel_mode=kernels), kernel_mode=kernels), np.float64)
    assert not np.isinf(y).any()
    nan_group = np.zeros_like(y, bool)
    nan_group[3, : spec.group_size] = True  # NaN poisons its group, nothing else
    assert np.isnan(y[nan_group]).all() and not np.isnan(y[~nan_group]).any()
    error = np.abs(y[~nan_group] - x.astype(np.float64)[~nan_group]).max() / 65504
    assert 0 < error < 0.2


@pytest.mark.parametrize("kernels", KERNELS)
def test_float16_sum_near_its_largest_value_saturates(kernels):
    """decompress_sum of shards whose sum stays within float16 stays finite."""
    x = np.full((2, 4, 128), 32000.0, np.float16)
    spec = tj.TacoConfig.preset("taco+").forward
    shards = tj.compress(x, spec, kernel_mode=kernels)
    total = np.asarray(tj.decompress_sum(shards, kernel_mode=kernels), np.float64)
    assert np.isfinite(total).all() and np.allclose(total, 64000.0, rtol=0.03)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("shape", [(0, 128), (3, 0, 256)])
def test_compress_round_trips_empty_arrays(shape, kernels):
    spec = tj.TacoConfig.preset("taco+").forward
    c = tj.compress(jnp.zeros(shape, jnp.bfloat16), spec, kernel_mode=kernels)
    y = tj.decompress(c, kernel_mode=kernels)
    assert y.shape == shape and y.dtype == jnp.bfloat16 and c.nbytes == 0


def _collectives(config):
    return {
        "all_gather": (lambda v: tj.all_gather(v, "tensor", config), lambda v: lax.all_gather(v, "tensor", tiled=True)),
        "reduce_scatter": (
            lambda v: tj.reduce_scatter(v, "tensor", config, scatter_dimension=1),
            lambda v: lax.psum_scatter(v, "tensor", scatter_dimension=1, tiled=True),
        ),
        "all_reduce": (lambda v: tj.all_reduce(v, "tensor", config), lambda v: lax.psum(v, "tensor")),
        "ppermute": (lambda v: tj.ppermute(v, "tensor", config, perm=RING), lambda v: lax.ppermute(v, "tensor", RING)),
    }


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "ppermute"])
def test_collectives_of_empty_arrays_have_lax_shapes_and_gradients(op, check_vma):
    """An empty message (reachable with min_bytes=0) takes the plain path: the shapes of
    lax's result and of the gradient, under both conventions."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    compressed, _ = _collectives(tj.TacoConfig.preset("taco+", min_bytes=0, kernel_mode="interpret"))[op]
    fn = jax.jit(jax.shard_map(compressed, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=check_vma))
    x = jnp.zeros((0, 4, 256), jnp.float32)
    expected = (0, 1, 256) if op == "reduce_scatter" else x.shape
    assert jax.block_until_ready(fn(x)).shape == expected
    assert jax.block_until_ready(jax.jit(jax.grad(lambda v: fn(v).sum()))(x)).shape == x.shape


@pytest.mark.parametrize("kernels", KERNELS)
def test_the_public_codec_refuses_derivatives(kernels):
    """The quantizer's derivative is zero almost everywhere: a clear error, not a zero
    gradient (the collectives are the differentiable API)."""
    spec = tj.TacoConfig.preset("taco+").forward
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 128)), jnp.float32)
    with pytest.raises(ValueError, match="compress is not differentiable"):
        jax.grad(lambda v: tj.decompress(tj.compress(v, spec, kernel_mode=kernels), kernel_mode=kernels).sum())(x)
    c = tj.compress(x, spec, kernel_mode=kernels)
    with pytest.raises(ValueError, match="decompress is not differentiable"):
        jax.grad(
            lambda s: tj.decompress(tj.Compressed(c.payload, s, c.shape, c.dtype, c.spec), kernel_mode=kernels).sum()
        )(c.scales)
    stacked = jax.tree_util.tree_map(lambda leaf: jnp.stack([leaf, leaf]), c)
    with pytest.raises(ValueError, match="decompress_sum is not differentiable"):
        jax.grad(
            lambda s: tj.decompress_sum(
                tj.Compressed(stacked.payload, s, stacked.shape, stacked.dtype, stacked.spec), kernel_mode=kernels
            ).sum()
        )(stacked.scales)
    # Vmapping the codec is fine, and close to the input.
    y = jax.vmap(lambda v: tj.decompress(tj.compress(v, spec, kernel_mode=kernels), kernel_mode=kernels))(x[None])
    assert 0 < float(jnp.abs(y[0] - x).max()) < 0.1


def test_auto_kernels_follow_the_platform_the_program_is_lowered_for(monkeypatch):
    """With a CUDA backend in the process, "auto" stages the kernel and the jnp path side
    by side and the lowering platform picks one: lowered for the CPU, the jnp path runs
    (bit for bit), though the kernel was traced."""
    spec = tj.TacoConfig.preset("taco+").forward
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, 128)), jnp.float32)
    reference = tj.compress(x, spec, kernel_mode="jnp")
    monkeypatch.setattr(jax_compat, "has_cuda", lambda: True)
    jaxpr = jax.make_jaxpr(lambda v: tj.compress(v, spec).payload)(x)
    assert "platform_index" in str(jaxpr) and "pallas_call" in str(jaxpr)
    staged = jax.jit(lambda v: tj.compress(v, spec))(x)
    np.testing.assert_array_equal(np.asarray(staged.payload, np.float32), np.asarray(reference.payload, np.float32))
    np.testing.assert_array_equal(np.asarray(staged.scales), np.asarray(reference.scales))
    monkeypatch.setattr(jax_compat, "has_cuda", lambda: False)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda v: tj.compress(v, spec).payload)(x))


def test_export_for_the_cpu_from_a_host_with_a_gpu(monkeypatch):
    """`jax.export` for the CPU from a host with a CUDA backend lowers the jnp path (the
    kernels are staged, not lowered)."""
    spec = tj.TacoConfig.preset("taco+").forward
    x = jnp.asarray(np.random.default_rng(6).standard_normal((64, 256)), jnp.float32)
    want = jax.jit(lambda v: tj.decompress(tj.compress(v, spec, kernel_mode="jnp"), kernel_mode="jnp"))(x)
    monkeypatch.setattr(jax_compat, "has_cuda", lambda: True)
    exported = jax.export.export(jax.jit(lambda v: tj.decompress(tj.compress(v, spec))), platforms=("cpu",))(x)
    np.testing.assert_array_equal(np.asarray(exported.call(x)), np.asarray(want))


def test_check_vma_is_read_from_public_api():
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    seen = {}

    def body(x, check_vma):
        seen[check_vma] = (jax_compat.checks_vma("tensor"), jax_compat.checks_vma("data"))
        return x

    for check_vma in (True, False):
        jax.shard_map(
            lambda x, c=check_vma: body(x, c),
            mesh=mesh,
            in_specs=P("tensor"),
            out_specs=P("tensor"),
            check_vma=check_vma,
        )(jnp.zeros(4))
    jax.vmap(lambda x: body(x, "vmap"), axis_name="tensor")(jnp.zeros(4))
    assert seen == {True: (True, True), False: (False, False), "vmap": (False, False)}


def test_gradient_outside_detection_raises_where_jax_lacks_the_rule(monkeypatch):
    """A check that cannot run raises; it never quietly reports "not transposing"."""
    jax_compat._shard_map_transpose_code.cache_clear()
    monkeypatch.setattr(jax_compat, "_shard_map_transpose_rules", lambda: [])
    try:
        with pytest.raises(jax_compat.UnsupportedJaxError, match="tested on jax"):
            jax_compat.transposing_whole_shard_map()
    finally:
        jax_compat._shard_map_transpose_code.cache_clear()


def test_gradient_outside_detection_sees_the_transpose():
    """The detection finds this jax's transpose rule on the stack exactly when a whole
    shard_map is differentiated from outside."""
    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    seen = []

    @jax.custom_vjp
    def probe(x):
        return x

    def backward(_, ct):
        seen.append(jax_compat.transposing_whole_shard_map())
        return (ct,)

    probe.defvjp(lambda x: (x, None), backward)
    fn = jax.shard_map(
        lambda x: probe(x) * 2.0, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False
    )
    jax.grad(lambda x: fn(x).sum())(jnp.ones(4))
    jax.shard_map(
        lambda x: jax.grad(lambda v: probe(v).sum())(x),
        mesh=mesh,
        in_specs=P("tensor"),
        out_specs=P("tensor"),
        check_vma=False,
    )(jnp.ones(4))
    assert seen == [True, False]


def test_gluon_kernels_are_built_for_the_local_gpus(monkeypatch):
    """The compute capability comes from this process's CUDA devices, not device 0 of
    whatever backend; GPUs that differ are refused rather than given the wrong PTX."""
    import types

    from taco_jax.kernels import triton_launch

    def devices(*capabilities):
        triton_launch.local_capability.cache_clear()
        fakes = [types.SimpleNamespace(compute_capability=c) for c in capabilities]
        monkeypatch.setattr(jax_compat, "cuda_devices", lambda: fakes)

    try:
        devices("9.0", "9.0")
        assert triton_launch.local_capability() == 90
        devices("9.0", "10.0")
        with pytest.raises(NotImplementedError, match=r"\[90, 100\]"):
            triton_launch.local_capability()
    finally:
        triton_launch.local_capability.cache_clear()


def test_supported_releases_are_bounded_above():
    """What jax_compat reads may move in an untested release: every such dependency has
    an upper bound, and the oldest-release pins match the lower bounds."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    for name in ("jax", "jaxlib", "flax", "orbax-checkpoint", "triton", "jax[cuda13]"):
        specs = [r.split(";")[0] for r in requirements if r.split(">")[0].split("=")[0].strip() == name]
        assert specs and all("<" in spec for spec in specs), (name, specs)
    pins = dict(
        line.split("==")
        for line in (root / ".ci/oldest.txt").read_text().split("\n")
        if "==" in line and not line.startswith("#")
    )
    for requirement in requirements:
        name, _, rest = requirement.partition(">=")
        if name in pins:
            assert rest.split(",")[0] == pins[name], requirement


def test_importing_taco_jax_leaves_the_deprecated_pallas_triton_module_alone():
    code = "import sys, taco_jax, taco_jax.flax; print('jax.experimental.pallas.triton' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert out.stdout.strip() == "False"


def test_hlo_reader_takes_replica_groups_named_by_mesh_axes():
    """jax 0.12 prints replica groups as mesh axes; the reader gives the device groups."""
    line = (
        "%all-gather.1 = u8[2,64,128]{2,1,0} all-gather(u8[1,64,128]{2,1,0} %p), channel_id=1, "
        "replica_groups=mesh['data'=2,'pipe'=2,'tensor'=2] {'data','tensor'}, dimensions={0}"
    )
    (gather,) = tj.collectives_in_hlo(line)
    assert gather.groups == ((0, 1, 4, 5), (2, 3, 6, 7)) and gather.group_size == 4
    assert gather.operand_bytes == 2 * 64 * 128 // 4


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "ppermute"])
def test_gradients_inside_a_vmap_axis_match_the_uncompressed_collective(op):
    """Per-rank gradients under `jax.vmap(axis_name=...)` (a simulated mesh): the
    backward all_to_all / ppermute of a cotangent equal on every rank (an all-gather's)
    once came back with a broadcast shape."""
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 64, 256)), jnp.float32)

    def grads(config):
        compressed = _collectives(config)[op][0]
        return np.asarray(jax.jit(jax.vmap(jax.grad(lambda v: jnp.sum(compressed(v) ** 2)), axis_name="tensor"))(x))

    got, want = (
        # Groups of 64: the reduce-scatter's gradient gathers 64 channels.
        grads(tj.TacoConfig.preset("taco+", min_bytes=0, kernel_mode="interpret").with_group_size(64)),
        grads(tj.TacoConfig.preset("off")),
    )
    assert got.shape == want.shape == x.shape
    assert 0 < np.abs(got - want).max() <= 0.05 * np.abs(want).max()


# ----------------------------------------------------------------------------- GPU: the same as the CPU


def _vmapped_collectives(kernels):
    """Every compressed collective, its lax counterpart and the gradient of the compressed
    one's sum of squares, each over a 4-rank `vmap` axis (a simulated mesh; the gradient
    taken inside the vmap, per rank, as the trainer takes it)."""
    config = tj.TacoConfig.preset("taco+", min_bytes=0, kernel_mode=kernels)
    ops = dict(_collectives(config))
    ops["all_reduce_two_shot"] = (
        lambda v: tj.all_reduce(v, "tensor", config, algorithm="two_shot"),
        ops["all_reduce"][1],
    )
    with_grad = {name: (op, plain, jax.grad(lambda v, op=op: jnp.sum(op(v) ** 2))) for name, (op, plain) in ops.items()}
    return {name: tuple(jax.jit(jax.vmap(f, axis_name="tensor")) for f in fns) for name, fns in with_grad.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "all_reduce_two_shot", "ppermute"])
def test_vmapped_collectives_on_the_gpu_match_the_jnp_path(op):
    """A collective under `jax.vmap` (what a simulated mesh runs) takes the GPU kernels,
    Gluon compress included, and agrees with the jnp path and, within codec error, with
    lax; its gradient too."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8, 64, 256)), jnp.float32)
    (gpu, plain, gpu_grad), (reference, _, reference_grad) = (_vmapped_collectives(k)[op] for k in ("auto", "jnp"))
    got, want, exact = (np.asarray(f(x)) for f in (gpu, reference, plain))
    scale = np.abs(exact).max()
    # The kernels are the jnp path's math; a requantized sum may round a code the other
    # way (one int8 step: 0.8% of a group's largest value).
    assert np.abs(got - want).max() <= 0.02 * scale
    assert 0 < np.abs(got - exact).max() <= 0.2 * scale
    g_gpu, g_ref = np.asarray(gpu_grad(x)), np.asarray(reference_grad(x))
    assert np.abs(g_gpu - g_ref).max() <= 0.02 * np.abs(g_ref).max()


@pytest.mark.gpu
def test_simulated_mesh_trains_with_compression_on_the_gpu(tmp_path):
    """`TrainConfig.from_keys(simulate_mesh=True, taco="taco+")` (benchmarks.quality --simulate)
    trains on one GPU, within codec error of the uncompressed run, on a corpus the test
    writes (no optional corpus package needed)."""
    from taco_jax.train import trainer
    from taco_jax.train.config import TrainConfig
    from tests.test_train import SMALL

    corpus = tmp_path / "corpus.npy"
    np.save(corpus, (np.arange(20_000) * 7 + np.random.default_rng(0).integers(0, 3, 20_000)) % 256)
    losses = {}
    for taco in ("off", "taco+"):
        cfg = TrainConfig.from_keys(
            **{
                **SMALL,
                "out": str(tmp_path / taco),
                "mesh": (2, 1, 2),
                "taco": taco,
                "steps": 4,
                "simulate_mesh": True,
                "taco_min_bytes": 0,
                "calibration_steps": 1,
                "data": str(corpus),
            }
        )
        trainer.train(cfg, progress=False)
        losses[taco] = [
            json.loads(line)["loss"] for line in (tmp_path / taco / "metrics.jsonl").read_text().splitlines()
        ]
    assert len(losses["taco+"]) == 4 and np.isfinite(losses["taco+"]).all()
    np.testing.assert_allclose(losses["taco+"], losses["off"], rtol=0.02)
    assert losses["taco+"] != losses["off"]


def test_attention_follows_the_lowering_platform(monkeypatch):
    """bfloat16 attention stages cuDNN flash attention beside XLA's where a CUDA backend
    exists; lowered for the CPU, XLA's runs (cuDNN, which needs a GPU to trace, is
    stood in for by a result that differs)."""
    from taco_jax.models import layers

    xla_attention = jax.nn.dot_product_attention

    def attention(q, k, v, *, is_causal, implementation):
        out = xla_attention(q, k, v, is_causal=is_causal, implementation="xla")
        return out + 1 if implementation == "cudnn" else out

    q = jnp.asarray(np.random.default_rng(5).standard_normal((2, 16, 4, 32)), jnp.bfloat16)
    want = xla_attention(q, q, q, is_causal=True, implementation="xla")
    monkeypatch.setattr(jax.nn, "dot_product_attention", attention)
    monkeypatch.setattr(jax_compat, "has_cuda", lambda: True)
    assert "platform_index" in str(jax.make_jaxpr(layers.causal_attention)(q, q, q))
    got = jax.jit(layers.causal_attention)(q, q, q)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
