"""INT4's requantized sum in float16 pairs (`SplitConfig.half_sums`): the kernel it
builds (CPU) and its codes and scales against the float32 sum of the jnp path (GPU)."""

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kernels as kernel_benchmarks
from taco_jax import message
from taco_jax.kernels import compress as kc
from taco_jax.kernels import decompress as kd
from taco_jax.kernels import gluon_codec, row_kernels, split_kernels, triton_launch, wire
from taco_jax.policy import QuantSpec
from tests import reference as ref
from tests.test_kernels import _groups

HALF = split_kernels.SplitConfig(values_per_thread=32, num_warps=2, half_sums=True)


def _requantize_ptx(config: split_kernels.SplitConfig) -> str:
    function, constexprs = split_kernels.decode_kernel("int4", 32, 4, True, "bf16", config, "bf16")
    codes, scales = gluon_codec.code_pointer("int4"), gluon_codec.POINTER_TYPES[jnp.dtype(jnp.bfloat16)]
    signature = tuple(zip(function.arg_names, [codes, scales, codes, scales, "i32", "i64", "i64"]))
    compiled = triton_launch.compile_kernel(function, signature, tuple(sorted(constexprs.items())), 2, 90)
    return compiled.asm["ptx"]


def test_half_sums_build_a_float16_pair_sum_for_sm90():
    """The flag reaches the kernel: its PTX sums in float16 pairs, the default's does not."""
    pytest.importorskip("triton.experimental.gluon")
    assert "fma.rn.f16x2" in _requantize_ptx(HALF)
    assert "fma.rn.f16x2" not in _requantize_ptx(split_kernels.decode_config(4, True, fmt="int4"))


@pytest.mark.parametrize(
    "fmt, requantize_to, work", [("int4", None, "a decode"), ("int5", "bf16", "int5"), ("e2m3", "bf16", "e2m3")]
)
def test_half_sums_refuse_other_work(fmt, requantize_to, work):
    with pytest.raises(ValueError, match=f"half_sums sums INT4 codes that are requantized, not .*{work}"):
        split_kernels.decode_kernel(fmt, 32, 4, True, requantize_to, HALF, "bf16")


def _messages(group_size, scale_format, magnitude, poison=False):
    x = np.asarray(_groups(4 * 45, group_size, jnp.float32, seed=group_size), np.float64) * magnitude
    if poison:
        x[2 * 45 + 7, 3] = np.nan  # shard 2, group 7
    x = jnp.asarray(x.reshape(4, 45, group_size), jnp.bfloat16)
    spec = QuantSpec.parse(f"int4:{group_size}:H:{scale_format}")
    config = row_kernels.compress_config(group_size)
    messages = kc.compress_message(x, fmt="int4", scale_format=scale_format, transform=True, config=config)
    return x, spec, message.message_layout(45, spec), messages


@pytest.mark.gpu
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30])
@pytest.mark.parametrize("scale_format", ["bf16", "dual", "e8m0"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_half_sums_requantize_as_the_float32_sum_does(group_size, scale_format, magnitude):
    """Against the jnp path's float32 sum, requantized: scales to float16's rounding of
    the sum (rounded-up scales one step apart in a few groups), codes equal but for at
    most 2% (those near a tie), each one step apart; and the decoded sum within 1% of the float32 path's
    error of the exact sum, which is not zero. Magnitudes far from 1 take the multipliers'
    power of two both ways."""
    x, spec, layout, messages = _messages(group_size, scale_format, magnitude)
    got = kd.decompress_message(messages[None], layout, transform=True, requantize=True, config=HALF)[0]
    want = message.requantize(messages, 45, spec, codec="jnp")
    got_scale, want_scale = (np.asarray(wire.multiplier(m, layout), np.float64) for m in (got, want))
    # A rounded-up scale on the other side of a tie is a step up: 2**-7 for bf16, 2 for e8m0.
    np.testing.assert_allclose(
        got_scale, want_scale, rtol={"dual": 2.0**-8, "bf16": 2.0**-7, "e8m0": 1.0}[scale_format]
    )
    same = got_scale == want_scale
    if scale_format == "dual":
        same[:] = True  # no rounded scale: a code moves only where it sat near a tie
    assert same.mean() >= 0.9
    got_codes, want_codes = (ref.as_float64(wire.payload_of(m, layout)) for m in (got, want))
    moved = got_codes[same] != want_codes[same]
    assert moved.mean() <= 0.02 and np.all(np.abs(got_codes[same] - want_codes[same]) <= 1)
    exact = ref.as_float64(x).sum(axis=0)
    decode = lambda m: np.asarray(message.decode(m[None, None], 45, spec, jnp.float32, codec="jnp"), np.float64)
    error = lambda m: np.linalg.norm(decode(m).reshape(exact.shape) - exact) / np.linalg.norm(exact)
    assert 0 < error(got) < 0.25 and abs(error(got) / error(want) - 1) < 0.01


@pytest.mark.gpu
def test_half_sums_keep_nan_in_its_group():
    """A NaN in one shard's group makes that group of the sum NaN (its multiplier in
    float16 is NaN), every other group finite."""
    _, spec, layout, messages = _messages(32, "bf16", 1.0, poison=True)
    got = kd.decompress_message(messages[None], layout, transform=True, requantize=True, config=HALF)[0]
    decoded = np.asarray(message.decode(got[None, None], 45, spec, jnp.float32, codec="jnp")).reshape(45, 32)
    assert np.isnan(decoded[7]).all()
    assert np.isfinite(np.delete(decoded, 7, axis=0)).all()


def test_packed_launches_name_half_sums():
    """`benchmarks.kernels --packed-launches` reads V:ROWS:WARPS with an optional ":half"."""
    assert kernel_benchmarks.packed_launch("32:1:2:half") == HALF
    assert kernel_benchmarks.packed_launch("32:2:2") == split_kernels.SplitConfig(32, 2, 2)
    assert kernel_benchmarks.config_label(HALF) == "V32 R1 W2 half sums"
    with pytest.raises(SystemExit, match="V:ROWS:WARPS:half"):
        kernel_benchmarks.packed_launch("32:1:2:float16")
