"""The codec and the compressed collectives at the edges of the input range: every finite
value of each input dtype, up to its largest, stays finite and within codec error
(float64 numpy as the reference), through a decode, a sum of shards and every collective;
and scalars take the plain collective, as `lax` does (8 CPU devices)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from tests.test_codec import _group_bound

PRESETS = ("fp8", "taco", "taco+")
# Below 8 bits (the jnp path in every kernel mode): the 4-bit preset and the 6-bit E2M3.
FEWER_BITS = ("taco4", "e2m3")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KERNELS = ("jnp", "interpret")
SHAPE = (4, 256)
RANKS = 4
RING = tuple((i, (i + 1) % RANKS) for i in range(RANKS))
# Relative error of a group (its norm) that every 8-bit preset, and E2M3, stays within;
# INT4 in groups of 32 within three times that.
GROUP_BOUND = 0.1
BOUND = {"taco4": 3 * GROUP_BOUND}


def _config(name: str, **overrides) -> tj.TacoConfig:
    """A preset, or "e2m3": taco+ with E2M3 (groups of 128, bfloat16 scales) both ways."""
    if name == "e2m3":
        spec = tj.QuantSpec.parse("e2m3:128:H:bf16")
        return tj.TacoConfig.preset("taco+", forward=spec, backward=spec, **overrides)
    return tj.TacoConfig.preset(name, **overrides)


def _values(dtype, binade: int, seed: int, shape=SHAPE, headroom: float = 1.0) -> np.ndarray:
    """float64 values of magnitude up to 2**binade (capped at the dtype's largest finite
    value / headroom), spread over four binades, random signs."""
    rng = np.random.default_rng(seed)
    largest = float(jnp.finfo(dtype).max) / headroom
    magnitude = np.minimum(2.0**binade * rng.uniform(1 / 16, 1, shape), largest)
    return np.asarray(magnitude * rng.choice([-1.0, 1.0], shape), dtype).astype(np.float64)


def _group_errors(got: np.ndarray, want: np.ndarray, group_size: int = 128) -> np.ndarray:
    got, want = got.reshape(-1, group_size), want.reshape(-1, group_size)
    return np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)


def _binades(dtype):
    """Every binade of the dtype's normal range, up to one past its largest (capped)."""
    info = jnp.finfo(dtype)
    return st.integers(int(np.log2(float(info.tiny))) + 24, int(np.log2(float(info.max))) + 1)


@functools.cache
def _round_trip(preset: str, kernels: str):
    spec = _config(preset).forward
    return jax.jit(lambda x: tj.decompress(tj.compress(x, spec, kernel_mode=kernels), kernel_mode=kernels))


@functools.cache
def _sum_of_shards(preset: str, kernels: str):
    spec = tj.TacoConfig.preset(preset).forward
    return jax.jit(lambda x: tj.decompress_sum(tj.compress(x, spec, kernel_mode=kernels), kernel_mode=kernels))


@pytest.mark.parametrize(
    ("preset", "kernels"), [*((p, k) for p in PRESETS for k in KERNELS), *((p, "jnp") for p in FEWER_BITS)]
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_every_finite_value_decodes_finite_and_close(preset, kernels, data, seed):
    """A decode never overflows: values near the dtype's largest decode within codec
    error (the decode saturates at the largest finite value), at every magnitude."""
    dtype = data.draw(st.sampled_from(DTYPES))
    x = _values(dtype, data.draw(_binades(dtype)), seed)
    got = np.asarray(_round_trip(preset, kernels)(jnp.asarray(x, dtype)), np.float64)
    assert np.isfinite(got).all()
    errors = _group_errors(got, x)
    assert (errors < BOUND.get(preset, GROUP_BOUND)).all() and errors.max() > 0


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("preset", PRESETS)
@settings(max_examples=10, deadline=None)
@given(shards=st.sampled_from([2, 4]), binade=st.integers(-100, 128), seed=st.integers(0, 2**16))
def test_float32_sums_of_shards_stay_finite_and_close(preset, kernels, shards, binade, seed):
    """A sum of k float32 shards whose exact sum is finite decodes finite and within codec
    error, also where the transformed shards alone would pass float32's largest value
    (the decode scales the sum down by a power of two first)."""
    x = _values(jnp.float32, binade, seed, (shards, *SHAPE), headroom=2 * shards)
    got = np.asarray(_sum_of_shards(preset, kernels)(jnp.asarray(x, jnp.float32)), np.float64)
    want = x.sum(axis=0)
    assert np.isfinite(got).all()
    assert (_group_errors(got, want) < GROUP_BOUND * shards).all()


def _collective(op: str, config: tj.TacoConfig):
    """(compressed, lax) per-rank functions of `op` on the tensor axis."""
    return {
        "all_reduce_two_shot": (
            lambda v: tj.all_reduce(v, "tensor", config, algorithm="two_shot"),
            lambda v: lax.psum(v, "tensor"),
        ),
        "all_reduce_one_shot": (
            lambda v: tj.all_reduce(v, "tensor", config, algorithm="one_shot"),
            lambda v: lax.psum(v, "tensor"),
        ),
        "reduce_scatter": (
            lambda v: tj.reduce_scatter(v, "tensor", config),
            lambda v: lax.psum_scatter(v, "tensor", tiled=True),
        ),
        "all_gather": (lambda v: tj.all_gather(v, "tensor", config), lambda v: lax.all_gather(v, "tensor", tiled=True)),
        "all_gather_stacked": (
            lambda v: tj.all_gather(v, "tensor", config, tiled=False),
            lambda v: lax.all_gather(v, "tensor", tiled=False),
        ),
        "ppermute": (lambda v: tj.ppermute(v, "tensor", config, perm=RING), lambda v: lax.ppermute(v, "tensor", RING)),
    }[op]


@functools.cache
def _on_mesh(op: str, preset: str, scalar: bool):
    """jit(shard_map) of `op` over 4 devices: (compressed, lax), each taking the ranks'
    inputs stacked on axis 0 and returning the ranks' results stacked on axis 0."""
    mesh = tj.make_mesh(1, 1, RANKS, devices=jax.devices()[:RANKS])
    config = _config(preset, min_bytes=0, kernel_mode="jnp")
    run = lambda fn: jax.jit(
        jax.shard_map(
            lambda v: fn(v[0][0] if scalar else v[0])[None],
            mesh=mesh,
            in_specs=P("tensor"),
            out_specs=P("tensor"),
            check_vma=False,
        )
    )
    return tuple(run(fn) for fn in _collective(op, config))


SCALAR_OPS = ("all_reduce_two_shot", "all_reduce_one_shot", "all_gather_stacked", "ppermute")
OPS = (*SCALAR_OPS, "reduce_scatter", "all_gather")


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("op", SCALAR_OPS)
def test_scalars_take_the_plain_collective(op, preset):
    """A scalar has no channels to group: every compressed collective that lax defines
    for scalars sends it plain and gives lax's result (a tiled gather or scatter of a
    scalar is an error in both)."""
    compressed, plain = _on_mesh(op, preset, scalar=True)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((RANKS, 1)), jnp.float32)
    with tj.record_wire() as ledger:
        got = np.asarray(compressed.trace(x).lower().compile()(x))
    assert ledger.records and not any(record.compressed for record in ledger.records)
    np.testing.assert_allclose(got, np.asarray(plain(x)), rtol=1e-6)


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_tiled_scalars_are_refused_as_lax_refuses_them(op):
    mesh = tj.make_mesh(1, 1, RANKS, devices=jax.devices()[:RANKS])
    compressed, plain = _collective(op, tj.TacoConfig.preset("taco+", min_bytes=0))
    trace = lambda fn: jax.jit(
        jax.shard_map(lambda v: fn(v[0][0])[None], mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"))
    ).trace(jnp.zeros((RANKS, 1), jnp.float32))
    with pytest.raises((ValueError, IndexError)):  # lax's psum_scatter raises IndexError
        trace(plain)
    with pytest.raises(ValueError, match="out of range for an array of rank 0"):
        trace(compressed)


@pytest.mark.parametrize("preset", ["taco", "taco+", *FEWER_BITS])
@pytest.mark.parametrize("op", OPS)
def test_float32_near_its_largest_value_through_every_collective(op, preset):
    """Each rank's values up to float32's largest / (2 x ranks), so that every exact sum
    is finite: the compressed collective is finite and within codec error of lax's."""
    compressed, plain = _on_mesh(op, preset, scalar=False)
    x = _values(jnp.float32, 128, seed=7, shape=(RANKS, 8, 256), headroom=2 * RANKS).astype(np.float32)
    got, want = np.asarray(compressed(x), np.float64), np.asarray(plain(x), np.float64)
    assert np.isfinite(want).all() and np.isfinite(got).all()
    errors = _group_errors(got, want)
    assert (errors < 2 * BOUND.get(preset, GROUP_BOUND)).all() and errors.max() > 0


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", ["all_reduce_two_shot", "all_reduce_one_shot", "ppermute"])
def test_scalar_gradients_equal_lax_under_both_conventions(op, check_vma):
    """The plain path a scalar takes keeps the compressed op's gradient rule: the
    gradient (taken outside the shard_map) equals lax's, with JAX's varying-axes checks
    on and off. (A stacked gather of scalars sends a vector back, which compresses.)"""
    mesh = tj.make_mesh(1, 1, RANKS, devices=jax.devices()[:RANKS])
    compressed, plain = _collective(op, tj.TacoConfig.preset("taco+", min_bytes=0, kernel_mode="jnp"))

    def gradient(fn):
        body = jax.shard_map(
            lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=check_vma
        )
        weights = jnp.arange(1.0, 1.0 + RANKS)
        return jax.jit(jax.grad(lambda v: jnp.sum(body(v).reshape(RANKS, -1) * weights[:, None])))

    x = jnp.asarray(np.random.default_rng(3).standard_normal(RANKS), jnp.float32)
    np.testing.assert_allclose(np.asarray(gradient(compressed)(x)), np.asarray(gradient(plain)(x)), rtol=1e-6)


# ----------------------------------------------------------------------------- every format, full range

FORMATS = ("e4m3", "e5m2", "int8", "e2m3", "e3m2", "e2m1", "int4")
SCALES = ("dual", "single", "bf16", "e8m0")
# One shape for every case below (eager calls reuse what an earlier case compiled): k = 4
# shards of two groups of 64, where the transform takes a group's absmax up to 8x, past
# float32's range in E2M3, E2M1 and INT4 units.
GROUP = 64
SHARDS = 4


def _norms(x: np.ndarray) -> np.ndarray:
    """Each group's (last axis) norm."""
    return np.linalg.norm(x, axis=-1)


def _check_through_the_codec(values: np.ndarray, spec: tj.QuantSpec, dtype) -> None:
    """`values` (k, n, G) float64, exact in `dtype`, round-trip; values / k, as k shards
    (whose exact sum is finite), sum through `decompress_sum` and `requantize_sum`. Each
    is finite and within the spec's group bound of the float64 reference (a sum: the
    bound times each shard's group norm; a requantized sum: that, plus the bound of a
    second rounding of the sum)."""
    bound = _group_bound(spec, dtype)
    got = np.asarray(tj.decompress(tj.compress(jnp.asarray(values, dtype), spec)), np.float64)
    assert np.isfinite(got).all()
    errors = _norms(got - values) / _norms(values)
    assert 0 < errors.max() and (errors <= bound).all(), (errors.max(), bound)

    shards = values / len(values)
    compressed = tj.compress(jnp.asarray(shards, dtype), spec)
    exact = shards.sum(axis=0)
    summed = bound * _norms(shards).sum(axis=0)
    requantized = summed + bound * (_norms(exact) + summed)
    for name, got, allowed in [
        ("decompress_sum", tj.decompress_sum(compressed), summed),
        ("requantize_sum", tj.decompress(tj.requantize_sum(compressed)), requantized),
    ]:
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), name
        assert (_norms(got - exact) <= allowed).all(), (name, (_norms(got - exact) / allowed).max())


def _near_the_largest(dtype, seed: int, largest: float | None = None) -> np.ndarray:
    """(k, 2, G) float64 values exact in `dtype`: per row two groups, one all at `largest`
    (default: the dtype's largest finite value; the transform puts the whole group on
    one coefficient), one of random magnitudes in [largest / 16, largest] and signs,
    holding -largest."""
    largest = float(jnp.finfo(dtype).max) if largest is None else largest
    rng = np.random.default_rng(seed)
    random = rng.uniform(1 / 16, 1, (SHARDS, GROUP)) * rng.choice([-1.0, 1.0], (SHARDS, GROUP))
    random[:, 0] = -1.0
    unit = np.stack([np.ones((SHARDS, GROUP)), random], axis=1)
    return np.asarray(largest * unit, dtype).astype(np.float64)


@pytest.mark.cover
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("hadamard", [True, False], ids=["H", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_format_holds_the_largest_values(fmt, scales, hadamard, dtype):
    """Each dtype's largest finite values stay finite and within codec error through
    compress, decompress, decompress_sum and requantize_sum, for every format, scale
    encoding and transform."""
    spec = tj.QuantSpec(fmt, GROUP, hadamard, scales)
    _check_through_the_codec(_near_the_largest(dtype, seed=FORMATS.index(fmt)), spec, dtype)


@pytest.mark.parametrize(("text", "value"), [("e2m3:64:H:bf16", 3.3e38), ("e2m1:64:H:e8m0", 3e38)])
def test_sub_byte_scales_hold_float32_largest_values(text, value):
    """With the transform, a group's decode multiplier reaches sqrt(G) x value / 7.5
    for E2M3: beyond bfloat16's and float32's range (was NaN; in groups of 128 from
    2.3e38 on), or beyond E8M0's 2**127 (E2M1 turned 3e38 into 1.8e38); and the sum of
    4 shards of a quarter of that (as 4 x 6e37 in groups of 128) was NaN in
    requantize_sum."""
    _check_through_the_codec(
        _near_the_largest(jnp.float32, seed=1, largest=value), tj.QuantSpec.parse(text), jnp.float32
    )


def test_a_sum_beyond_float32_stays_finite():
    """Shards whose exact sum passes float32's largest value (where lax.psum gives Inf):
    decompress_sum saturates at the largest finite value and requantize_sum decodes
    finite, never Inf or NaN; a NaN in a shard still makes its group NaN."""
    shards = np.full((SHARDS, 2, GROUP), 2e38, np.float32)
    shards[1, 1, 3] = np.nan
    compressed = tj.compress(jnp.asarray(shards), tj.QuantSpec.parse("e2m3:64:H:bf16"))
    for got in (tj.decompress_sum(compressed), tj.decompress(tj.requantize_sum(compressed))):
        got = np.asarray(got)
        assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()
        np.testing.assert_allclose(got[0], np.finfo(np.float32).max, rtol=0.3)


@settings(max_examples=10, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    scales=st.sampled_from(SCALES),
    hadamard=st.booleans(),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_property_full_range_of_every_format(fmt, scales, hadamard, data, seed):
    """Random groups of any binade of the dtype's normal range, up to its largest value,
    through every codec function: finite and within the format's bound."""
    dtype = data.draw(st.sampled_from(DTYPES))
    values = _values(dtype, data.draw(_binades(dtype)), seed, shape=(SHARDS, 2, GROUP))
    _check_through_the_codec(values, tj.QuantSpec(fmt, GROUP, hadamard, scales), dtype)
