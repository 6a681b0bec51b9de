"""Pallas kernels (interpret mode on CPU, compiled on GPU) against their jnp references.

Kernel and reference share the per-group math; they differ in the transform (bf16
tensor-core matmuls with float32 accumulation vs a float32 matmul) and in reduction
order, so float32 scales agree to a few ulps and a payload code can differ by one step
where the value sits on a rounding tie (frequent for bf16 inputs, whose values often
land exactly on a coarser grid's midpoints). Both are then valid round-to-nearest-even
results of float32 arithmetic.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taco_jax as tj
from taco_jax.kernels import compress as kc
from taco_jax.kernels import decompress as kd
from taco_jax.kernels import formats, wire
from taco_jax.kernels.launch import KernelConfig, program_rows
from taco_jax.kernels.wire import hadamard_butterfly, hadamard_lanes, hadamard_pairs
from tests import reference as ref

FMTS = ["e4m3", "e5m2", "int8"]
SCALES = ["dual", "single", "bf16", "e8m0"]


def _groups(rows, group_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, group_size)) * np.exp(2 * rng.standard_normal((rows, 1)))
    return jnp.asarray(x, dtype)


def _assert_payload_close(got, want, fmt, max_mismatch, same_scale=None):
    """At most `max_mismatch` of the codes differ, each by one grid step; groups whose
    power-of-two/bf16 scale fell on the other side of a tie (`same_scale` False) are
    compared through their decoded values instead."""
    got, want = ref.as_float64(got), ref.as_float64(want)
    if same_scale is not None:
        got, want = got[same_scale], want[same_scale]
    mismatch = got != want
    assert mismatch.mean() <= max_mismatch
    step = np.maximum(np.abs(want), 1.0) * (1.0 if formats.wire_format(fmt).is_integer else 2.0**-2)
    assert np.all(np.abs(got - want)[mismatch] <= step[mismatch])


def _assert_scales_close(got, want, scale_format):
    """Scales agree to float32 rounding; rounded-up (bf16, e8m0) scales may land one
    step apart on a tie, in a few groups. Returns the mask of groups with equal scales."""
    got, want = ref.as_float64(got), ref.as_float64(want)
    if scale_format in ("e8m0", "bf16"):
        same = got == want
        assert same.mean() >= 0.9
        np.testing.assert_allclose(got, want, rtol=1.0 if scale_format == "e8m0" else 2.0**-7)
        return same.reshape(same.shape[0], -1).all(axis=1)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    return None


def _compress_case(x, fmt, scale_format, transform, interpret, config=None):
    kw = dict(fmt=fmt, scale_format=scale_format, transform=transform)
    payload, scales = kc.compress_groups(x, interpret=interpret, config=config, **kw)
    ref_payload, ref_scales = kc.compress_reference(x, **kw)
    assert payload.shape == ref_payload.shape and payload.dtype == ref_payload.dtype
    assert scales.shape == ref_scales.shape and scales.dtype == ref_scales.dtype
    same_scale = _assert_scales_close(scales, ref_scales, scale_format)
    _assert_payload_close(payload, ref_payload, fmt, 0.03 if x.dtype == jnp.bfloat16 else 2e-3, same_scale)
    return payload, scales


@pytest.mark.cover
@pytest.mark.parametrize("transform", [True, False], ids=["hadamard", "plain"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scale_format", SCALES)
@pytest.mark.parametrize("fmt", FMTS)
def test_compress_kernel_interpret(fmt, scale_format, dtype, transform):
    _compress_case(_groups(37, 128, dtype), fmt, scale_format, transform, interpret=True)


@pytest.mark.cover
@pytest.mark.parametrize("group_size", [16, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 45, 130])
def test_compress_kernel_group_sizes_and_odd_rows(group_size, rows):
    """The default launch (groups in two pieces with the transform) down to G = 16,
    pieces of 8 columns."""
    _compress_case(_groups(rows, group_size, jnp.float32, seed=rows), "e4m3", "dual", True, interpret=True)


def _extreme_groups() -> jax.Array:
    """Groups of 128 at the edges of float32: near its maximum, tiny, subnormal, zero,
    one spike among tiny values, and ordinary."""
    rng = np.random.default_rng(11)
    signs = np.sign(rng.standard_normal((2, 128)))
    rows = [
        3.4e38 * rng.uniform(0.99, 1.0, 128) * signs[0],
        3e38 * rng.uniform(0.0, 1.0, 128) * signs[1],
        1e-35 * rng.standard_normal(128),
        1e-40 * rng.standard_normal(128),
        np.zeros(128),
        np.r_[1e30, 1e-30 * rng.standard_normal(127)],
        rng.standard_normal(128),
    ]
    return jnp.asarray(np.stack(rows), jnp.float32)


@pytest.mark.cover
@pytest.mark.parametrize("transform", [True, False], ids=["hadamard", "plain"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scale_format", ["dual", "bf16", "e8m0"])
def test_kernels_stay_on_the_grid_without_a_clip(scale_format, fmt, transform):
    """The kernels cast without clipping to the format's range: at the edges of float32
    their codes stay finite, inside +-max_value and as the clipping reference's, and the
    groups near the float32 maximum use the top of the grid."""
    x = _extreme_groups()
    payload, _ = _compress_case(x, fmt, scale_format, transform, interpret=True)
    codes = ref.as_float64(payload)
    max_value = formats.wire_format(fmt).max_value
    assert np.isfinite(codes).all() and np.abs(codes).max() <= max_value
    assert np.abs(codes[:2]).max(axis=1).min() >= max_value / 2  # e8m0 scales round up by up to 2x


@pytest.mark.cover
# Compiled without XLA's optimizations, the interpreted kernel's default transform (pairs,
# two pieces) decodes up to 4e-4 off; the same jnp operations outside the kernel do not.
@pytest.mark.production_compiler
@pytest.mark.parametrize(
    "shards, group_size",
    [*[(shards, group_size) for group_size in (64, 256) for shards in (1, 2, 4, 8)], (1, 16), (4, 16)],
)
@pytest.mark.parametrize("transform", [True, False], ids=["hadamard", "plain"])
def test_decompress_kernel_sums_shards(shards, group_size, transform):
    """The kernel and the jnp reference both decode the float64 sum of the shards, each
    within float32's bound for a sum of `group_size + shards` terms (XLA may order the
    sums differently), then the output dtype's rounding."""
    rows = 29
    parts = [_groups(rows, group_size, jnp.float32, seed=s) for s in range(shards)]
    compressed = [kc.compress_reference(p, fmt="e4m3", scale_format="single", transform=transform) for p in parts]
    payload = jnp.stack([p for p, _ in compressed])
    multiplier = jnp.stack([s.reshape(-1) for _, s in compressed])
    codes, scale = ref.as_float64(payload), ref.as_float64(multiplier)[..., None]
    rotation = ref.hadamard(group_size) if transform else np.eye(group_size)
    exact = ((codes @ rotation) * scale).sum(0)
    float32_bound = (group_size + shards) * 2.0**-24 * ((np.abs(codes) @ np.abs(rotation)) * scale).sum(0)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        got = kd.decompress_groups(payload, multiplier, transform=transform, out_dtype=out_dtype, interpret=True)
        want = kd.decompress_reference(payload, multiplier, transform=transform, out_dtype=out_dtype)
        assert got.dtype == out_dtype and got.shape == (rows, group_size)
        rounding = 0.0 if out_dtype == jnp.float32 else 2.0**-8  # bfloat16's unit roundoff
        bound = float32_bound + rounding * (np.abs(exact) + float32_bound)
        for decoded in (got, want):
            error = np.abs(ref.as_float64(decoded) - exact)
            assert np.all(error <= bound), float(np.max(error - bound))
    exact = sum(np.asarray(p, np.float64) for p in parts)
    decoded = ref.as_float64(kd.decompress_groups(payload, multiplier, transform=transform, interpret=True))
    assert np.linalg.norm(decoded - exact) / np.linalg.norm(exact) < 0.07


def _check_requantized_sum(fmt, scale_format, group_size, rows, interpret):
    """The requantized sum of 4 shards under the default launch against the jnp reference."""
    shards = 4
    parts = [_groups(rows, group_size, jnp.float32, seed=s) for s in range(shards)]
    compressed = [kc.compress_reference(p, fmt=fmt, scale_format=scale_format, transform=True) for p in parts]
    payload = jnp.stack([p for p, _ in compressed])
    multiplier = jnp.stack([wire.dequantize_scale(s, scale_format).reshape(-1) for _, s in compressed])
    kw = dict(transform=True, requantize_to=(fmt, scale_format))
    got_payload, got_scales = kd.decompress_groups(payload, multiplier, interpret=interpret, **kw)
    want_payload, want_scales = kd.decompress_reference(payload, multiplier, **kw)
    same_scale = _assert_scales_close(got_scales, want_scales, scale_format)
    # Sums of power-of-two-scaled codes sit on coarse grids: ties are common there.
    _assert_payload_close(got_payload, want_payload, fmt, 0.01, same_scale)


@pytest.mark.cover
@pytest.mark.parametrize("scale_format", SCALES)
@pytest.mark.parametrize("fmt", FMTS)
def test_decompress_kernel_requantizes(fmt, scale_format):
    _check_requantized_sum(fmt, scale_format, 128, 50, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [16, 64, 128, 256])
@pytest.mark.parametrize("fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16"), ("e5m2", "e8m0")])
def test_compiled_requantized_sum_matches_the_reference(fmt, scale_format, group_size):
    """Compiled, with each group loaded in two pieces, at an odd row count."""
    _check_requantized_sum(fmt, scale_format, group_size, 1001, interpret=False)


LOOPED = KernelConfig(block_rows=16, blocks_per_program=4, min_programs=1)
LANES = KernelConfig(block_rows=16, blocks_per_program=4, min_programs=1, transform_method="lanes")
PAIRS = KernelConfig(block_rows=16, blocks_per_program=4, min_programs=1, transform_method="pairs")
IN_PIECES = KernelConfig(block_rows=16, blocks_per_program=4, min_programs=1, transform_method="lanes", pieces=4)
# The compiled kernels' transform methods, whole groups and groups loaded in pieces.
COMPILED_TRANSFORMS = {
    "matmul": dict(transform_method="matmul"),
    "lanes": dict(transform_method="lanes"),
    "pairs": dict(transform_method="pairs"),
    "lanes-4": dict(transform_method="lanes", pieces=4),
    "pairs-8": dict(transform_method="pairs", pieces=8),
}


@pytest.mark.cover
@pytest.mark.parametrize(
    "method, group_size, pieces",
    [("lanes", 16, 1), ("lanes", 512, 1), ("pairs", 32, 1), ("lanes", 128, 8), ("pairs", 64, 4), ("matmul", 64, 2)],
)
def test_transform_methods_match_the_reference(method, group_size, pieces):
    """Compress and decode (1 and 3 shards, f32 and bf16 out) with the transform computed
    without the tile or on groups loaded in pieces, against the jnp references; 45 rows
    (padded)."""
    config = KernelConfig(block_rows=16, transform_method=method, pieces=pieces)
    x = _groups(45, group_size, jnp.float32, seed=group_size)
    payload, scales = _compress_case(x, "int8", "bf16", True, interpret=True, config=config)
    multiplier = wire.dequantize_scale(scales, "bf16").reshape(1, -1)
    parts = [
        (payload[None], multiplier),
        (jnp.stack([payload] * 3), jnp.concatenate([multiplier, 2 * multiplier, -multiplier])),
    ]
    for shard_payload, shard_multiplier in parts:
        for out_dtype in (jnp.float32, jnp.bfloat16):
            kw = dict(transform=True, out_dtype=out_dtype)
            got = kd.decompress_groups(shard_payload, shard_multiplier, config=config, interpret=True, **kw)
            want = kd.decompress_reference(shard_payload, shard_multiplier, **kw)
            tolerance = 1e-6 if out_dtype == jnp.float32 else 2.0**-8
            np.testing.assert_allclose(
                ref.as_float64(got),
                ref.as_float64(want),
                rtol=tolerance,
                atol=tolerance * float(jnp.abs(want.astype(jnp.float32)).max()),
            )


@pytest.mark.parametrize("transform", [hadamard_butterfly, hadamard_lanes, hadamard_pairs])
@pytest.mark.parametrize("size", [1, 2, 16, 128, 512])
def test_tile_free_transforms_are_the_sylvester_matrix_product(transform, size):
    x = np.random.default_rng(size).standard_normal((3, 5, size)).astype(np.float32)
    want = x.astype(np.float64) @ ref.hadamard(size) * np.sqrt(size)  # unnormalized
    got = np.asarray(jax.jit(transform)(jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert not np.array_equal(got, x.astype(np.float64)) or size == 1


@pytest.mark.parametrize("transform", [hadamard_lanes, hadamard_pairs])
def test_pair_exchange_keeps_inf_and_nan(transform):
    """The partner comes from integer sums of the float bits: an Inf stays an Inf of the
    right sign in every output, a NaN makes every output NaN."""
    x = np.ones((2, 16), np.float32)
    x[0, 3], x[1, 5] = np.nan, np.inf
    got = np.asarray(transform(jnp.asarray(x)))
    assert np.isnan(got[0]).all()
    np.testing.assert_array_equal(got[1], np.inf * ref.hadamard(16)[5] * 4)


def test_kernel_config_names_an_unknown_transform_method():
    with pytest.raises(ValueError, match="transform_method"):
        KernelConfig(transform_method="fft")


def test_kernel_config_names_pieces_that_do_not_fit():
    with pytest.raises(ValueError, match="pieces"):
        KernelConfig(pieces=3)
    with pytest.raises(ValueError, match="pieces=32 must divide the group size 16"):
        kc.compress_groups(
            jnp.ones((16, 16)),
            fmt="int8",
            scale_format="bf16",
            transform=True,
            config=KernelConfig(pieces=32),
            interpret=True,
        )


def test_program_rows_loops_only_where_the_grid_stays_wide():
    assert program_rows(1 << 20, KernelConfig(block_rows=64, blocks_per_program=4)) == (256, 64)
    # 512 blocks of 64 rows: looping would leave fewer programs than min_programs.
    assert program_rows(32768, KernelConfig(block_rows=64, blocks_per_program=4)) == (64, 64)
    assert program_rows(8192, KernelConfig(block_rows=64, blocks_per_program=4), batch=32) == (256, 64)
    assert program_rows(96, KernelConfig(block_rows=64, blocks_per_program=4, min_programs=1)) == (32, 32)
    assert program_rows(200, LOOPED) == (64, 16)  # padded to whole programs


def _check_looped_launch(fmt, scale_format, rows, looped, interpret):
    """compress, decode of 1 and 2 shards and requantize under `looped` agree with one
    block per program (and decode within the codec's error of the input)."""
    x = _groups(rows, 128, jnp.bfloat16, seed=rows)
    kw = dict(fmt=fmt, scale_format=scale_format, transform=True)
    one_block = KernelConfig(block_rows=64)
    payload, scales = kc.compress_groups(x, config=one_block, interpret=interpret, **kw)
    looped_payload, looped_scales = kc.compress_groups(x, config=looped, interpret=interpret, **kw)
    # Blocks of another height may reduce in another order: ulps in the scales.
    same_scale = _assert_scales_close(looped_scales, scales, scale_format)
    _assert_payload_close(looped_payload, payload, fmt, 0.002, same_scale)
    multiplier = wire.dequantize_scale(scales, scale_format).reshape(1, -1)
    for shards in (1, 2):
        parts = (payload.reshape(shards, rows // shards, 128), multiplier.reshape(shards, -1))
        decoded = kd.decompress_groups(*parts, transform=True, config=one_block, interpret=interpret)
        looped_decoded = kd.decompress_groups(*parts, transform=True, config=looped, interpret=interpret)
        np.testing.assert_allclose(
            ref.as_float64(looped_decoded),
            ref.as_float64(decoded),
            rtol=1e-6,
            atol=1e-6 * float(jnp.max(jnp.abs(decoded))),
        )
        exact = ref.as_float64(x).reshape(shards, rows // shards, 128).sum(axis=0)
        error = np.linalg.norm(ref.as_float64(looped_decoded) - exact) / np.linalg.norm(exact)
        assert 1e-4 < error < 0.07
    halves = (payload.reshape(2, rows // 2, 128), multiplier.reshape(2, -1))
    requantized = kd.decompress_groups(
        *halves, transform=True, requantize_to=(fmt, scale_format), config=looped, interpret=interpret
    )
    want = kd.decompress_reference(*halves, transform=True, requantize_to=(fmt, scale_format))
    same_scale = _assert_scales_close(requantized[1], want[1], scale_format)
    _assert_payload_close(requantized[0], want[0], fmt, 0.01, same_scale)


@pytest.mark.cover
@pytest.mark.parametrize(
    "fmt, scale_format, rows, config",
    [
        *[(fmt, scales, rows, LOOPED) for fmt, scales in [("e4m3", "dual"), ("int8", "bf16")] for rows in (200, 256)],
        ("int8", "bf16", 200, LANES),
        ("e4m3", "dual", 200, PAIRS),
        ("e4m3", "dual", 256, IN_PIECES),
    ],
    ids=["e4m3-200", "e4m3-256", "int8-200", "int8-256", "int8-200-lanes", "e4m3-200-pairs", "e4m3-256-pieces"],
)
def test_looped_kernels_equal_one_block_per_program(fmt, scale_format, rows, config):
    """Several blocks per program, with each transform method and groups loaded in
    pieces, against one block per program with the matmul."""
    _check_looped_launch(fmt, scale_format, rows, config, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("transform", COMPILED_TRANSFORMS)
@pytest.mark.parametrize("rows", [8200, 16384])
@pytest.mark.parametrize("fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16")])
def test_compiled_looped_kernels_equal_one_block_per_program(fmt, scale_format, rows, transform):
    looped = KernelConfig(
        block_rows=64, blocks_per_program=4, num_stages=3, min_programs=1, **COMPILED_TRANSFORMS[transform]
    )
    _check_looped_launch(fmt, scale_format, rows, looped, interpret=False)


POISONED_GROUPS = [7, 20]


def _poisoned_groups():
    """40 groups of 128, a NaN in group 7 and an Inf in group 20."""
    x = np.array(_groups(40, 128, jnp.float32))
    x[7, 3], x[20, 0] = np.nan, np.inf
    return jnp.asarray(x)


def _assert_only_poisoned_groups_nan(out):
    bad = np.isin(np.arange(40), POISONED_GROUPS)
    out = np.asarray(out)
    assert np.isnan(out[bad]).all() and np.isfinite(out[~bad]).all()


def _check_nan_propagates_to_the_group(fmt, scale_format, config, interpret):
    """A NaN or an Inf in the input makes its whole group decode to NaN, through
    compress, decode and the requantized sum; every other group stays finite."""
    kw = dict(config=config, interpret=interpret)
    payload, scales = kc.compress_groups(_poisoned_groups(), fmt=fmt, scale_format=scale_format, transform=True, **kw)
    multiplier = wire.dequantize_scale(scales, scale_format).reshape(1, -1)
    _assert_only_poisoned_groups_nan(kd.decompress_groups(payload[None], multiplier, transform=True, **kw))
    summed, summed_scales = kd.decompress_groups(
        jnp.stack([payload, payload]),
        jnp.concatenate([multiplier, multiplier]),
        transform=True,
        requantize_to=(fmt, scale_format),
        **kw,
    )
    summed_multiplier = wire.dequantize_scale(summed_scales, scale_format).reshape(1, -1)
    _assert_only_poisoned_groups_nan(kd.decompress_groups(summed[None], summed_multiplier, transform=True, **kw))


def test_kernels_propagate_nan_to_the_group():
    _check_nan_propagates_to_the_group("int8", "bf16", None, interpret=True)


@pytest.mark.parametrize(
    "fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16"), ("int8", "single"), ("int8", "e8m0")]
)
def test_nan_propagates_where_max_ignores_nan(monkeypatch, fmt, scale_format):
    """The group math as Triton compiles it, whose max() and min() ignore NaN (maxnumf):
    a NaN or Inf still makes its group decode to NaN."""
    nan_ignoring = types.SimpleNamespace(**{name: getattr(jnp, name) for name in dir(jnp) if not name.startswith("__")})
    nan_ignoring.max = lambda a, axis=None, keepdims=False: jnp.nanmax(a, axis=axis, keepdims=keepdims)
    nan_ignoring.maximum, nan_ignoring.minimum = jnp.fmax, jnp.fmin
    nan_ignoring.clip = lambda x, low, high: jnp.fmin(jnp.fmax(x, low), high)
    for module in (wire, formats):
        monkeypatch.setattr(module, "jnp", nan_ignoring)
    payload, scales = wire.quantize_groups(
        _poisoned_groups(), fmt=fmt, group_size=128, scale_format=scale_format, transform=True
    )
    multiplier = wire.dequantize_scale(scales, scale_format).reshape(1, -1)
    _assert_only_poisoned_groups_nan(
        kd.decompress_reference(payload[None], multiplier, transform=True, out_dtype=jnp.float32)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("transform", COMPILED_TRANSFORMS)
@pytest.mark.parametrize("fmt, scale_format", [("e4m3", "dual"), ("int8", "bf16"), ("int8", "e8m0")])
def test_compiled_kernels_propagate_nan_to_the_group(fmt, scale_format, transform):
    """Compiled, where Triton's max() ignores NaN."""
    _check_nan_propagates_to_the_group(
        fmt, scale_format, KernelConfig(**COMPILED_TRANSFORMS[transform]), interpret=False
    )


def test_codec_dispatch_to_kernels_agrees_with_jnp():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 10, 256)), jnp.bfloat16)
    spec = tj.QuantSpec(fmt="int8", hadamard=True, scales="bf16", group_size=128)
    c_kernel = tj.compress(x, spec, kernel_mode="interpret")
    out_kernel = tj.decompress(c_kernel, kernel_mode="interpret")
    summed_kernel = tj.decompress_sum(
        tj.compress(jnp.stack([x, 2 * x]), spec, kernel_mode="interpret"), kernel_mode="interpret"
    )
    c_jnp = tj.compress(x, spec, kernel_mode="jnp")
    out_jnp = tj.decompress(c_jnp, kernel_mode="jnp")
    assert c_kernel.scales.shape == c_jnp.scales.shape and out_kernel.dtype == jnp.bfloat16
    _assert_payload_close(c_kernel.payload, c_jnp.payload, "int8", 0.02)
    np.testing.assert_allclose(ref.as_float64(out_kernel), ref.as_float64(out_jnp), rtol=0.02, atol=0.02)
    np.testing.assert_allclose(ref.as_float64(summed_kernel), 3 * ref.as_float64(x), rtol=0.1, atol=0.05)
    with pytest.raises(ValueError, match="unknown kernel mode"):
        tj.compress(x, spec, kernel_mode="cuda")
    with pytest.raises(ValueError, match="unknown kernel mode"):
        tj.TacoConfig.preset("taco", kernel_mode="cuda")
    with pytest.raises(ValueError, match='"pallas" is now "gpu"'):
        tj.TacoConfig.preset("taco", kernel_mode="pallas")


def test_collective_with_interpreted_kernels_inside_shard_map():
    from jax.sharding import PartitionSpec as P

    mesh = tj.make_mesh(1, 1, 4, devices=jax.devices()[:4])
    config = tj.TacoConfig.preset("taco", min_bytes=0, kernel_mode="interpret")
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4 * 16, 256)), jnp.float32)
    body = lambda v: (tj.all_reduce(v, "tensor", config, algorithm="two_shot"), jax.lax.psum(v, "tensor"))
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=(P("tensor"), P("tensor")), check_vma=False)
    )
    ours, theirs = jax.block_until_ready(fn(x))
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 0.12


@pytest.mark.gpu
@pytest.mark.parametrize("scale_format", SCALES)
@pytest.mark.parametrize("fmt", FMTS)
def test_compiled_kernels_on_gpu(fmt, scale_format):
    for dtype in (jnp.bfloat16, jnp.float32):
        x = _groups(4099, 128, dtype, seed=9)
        payload, scales = _compress_case(x, fmt, scale_format, True, interpret=False)
        multiplier = wire.dequantize_scale(scales, scale_format).reshape(1, -1)
        got = kd.decompress_groups(payload[None], multiplier, transform=True)
        want = kd.decompress_reference(payload[None], multiplier, transform=True)
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5
