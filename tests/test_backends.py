"""The codec backend table (`pallas_kernels.backends`): which path each kernel mode and
piece of work gets, from the one table the codec and the kernels read."""

import dataclasses
import subprocess
import sys

import jax.numpy as jnp
import pytest

import taco_jax as tj
from taco_jax import message
from taco_jax.kernels import backends, jax_compat, launch, triton_launch
from tests.conftest import cpu_env

INT8 = tj.QuantSpec.parse("int8:128:H:bf16")


@pytest.mark.parametrize(
    "spec, dtype, shards, interpret_path",
    [
        (INT8, jnp.bfloat16, 4, "pallas"),
        (tj.QuantSpec.parse("e4m3:512:H:dual"), jnp.float32, 1, "pallas"),
        (tj.QuantSpec.parse("int4:32:H:bf16"), jnp.bfloat16, 1, "jnp"),  # no 4-bit Pallas kernel
        (tj.QuantSpec.parse("int8:1024:H:bf16"), jnp.bfloat16, 1, "jnp"),  # past the kernels' groups
        (tj.QuantSpec.parse("int8:128:H:bf16:sr"), jnp.bfloat16, 1, "jnp"),  # stochastic rounding
        (INT8, jnp.bfloat16, 3, "jnp"),  # a sum of three shards
        (INT8, jnp.int32, 1, "jnp"),  # not a kernel dtype
    ],
)
def test_each_kernel_mode_takes_the_first_backend_that_takes_the_work(spec, dtype, shards, interpret_path, monkeypatch):
    """Off GPU: "auto" and "jnp" run the jnp path; "interpret" the Pallas kernel where it
    takes the work; "gpu" the Pallas kernel too (Gluon runs only on a CUDA GPU)."""
    monkeypatch.setattr(jax_compat, "has_cuda", lambda: False)
    monkeypatch.setattr(triton_launch, "available", lambda: False)
    choose = lambda mode: message.codec_choice(spec, dtype, mode, shards=shards)
    assert choose("jnp") == backends.JNP_PATH and choose("auto") == backends.JNP_PATH
    interpreted = choose("interpret")
    assert interpreted.name == interpret_path and interpreted.interpret == (interpret_path == "pallas")
    assert choose("gpu").name == interpret_path and not choose("gpu").interpret


def test_auto_stages_the_gpu_choice_where_cuda_exists(monkeypatch):
    """With a CUDA backend "auto" stages the GPU's choice beside the jnp path, and the
    lowering platform picks; Gluon where it runs, else Pallas."""
    monkeypatch.setattr(jax_compat, "has_cuda", lambda: True)
    choice = message.codec_choice(INT8, jnp.bfloat16, "auto", shards=2)
    expected = "gluon" if triton_launch.available() else "pallas"
    assert choice.platform_dependent and not choice.interpret and choice.name == expected
    assert message.codec_choice(INT8, jnp.bfloat16, "auto", size=0) == backends.JNP_PATH


def test_an_unknown_kernel_mode_is_named():
    with pytest.raises(ValueError, match="unknown kernel mode 'pallas'.*now \"gpu\""):
        message.codec_choice(INT8, jnp.bfloat16, "pallas")


def test_kernel_configs_name_their_backend():
    """A launch config names the kernel it launches; without one the table decides."""
    from taco_jax.kernels import row_kernels, split_kernels

    work = backends.CodecWork("int8", 128, jnp.dtype(jnp.bfloat16))
    assert backends.launched_by(row_kernels.RowConfig(), work, False) is backends.GLUON
    assert backends.launched_by(split_kernels.SplitConfig(), work, False) is backends.GLUON
    assert backends.launched_by(launch.KernelConfig(), work, False) is backends.PALLAS
    assert backends.launched_by(None, work, True) is backends.PALLAS


def test_a_scale_format_no_kernel_writes_runs_the_jnp_path():
    """A scale format added by a user (no kernel writes it) takes the jnp path, as an
    element format does."""
    work = backends.CodecWork("int8", 128, jnp.dtype(jnp.bfloat16), scales="toy-scales")
    assert backends.choose(work, "interpret") == backends.JNP_PATH
    assert backends.choose(dataclasses.replace(work, scales="e8m0"), "interpret").name == "pallas"


@pytest.mark.parametrize("switch, sub_byte", [(None, True), ("0", False)], ids=["default", "turned-off"])
def test_the_sub_byte_kernels_are_on_unless_turned_off(switch, sub_byte):
    """The Gluon entry of the table takes the sub-byte formats by default;
    TACO_JAX_SUB_BYTE_KERNELS=0 (read at import) leaves them to the jnp path, and the
    8-bit formats stay on the kernels either way."""
    env = {key: value for key, value in cpu_env(1).items() if key != "TACO_JAX_SUB_BYTE_KERNELS"}
    if switch is not None:
        env["TACO_JAX_SUB_BYTE_KERNELS"] = switch
    code = "from taco_jax.kernels import backends; print(*backends.GLUON.formats)"
    taken = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert {fmt: fmt in taken.split() for fmt in ("int4", "int5", "e2m3", "int8", "e4m3")} == {
        "int4": sub_byte,
        "int5": sub_byte,
        "e2m3": sub_byte,
        "int8": True,
        "e4m3": True,
    }
