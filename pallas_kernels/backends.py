"""The codec backends and the one table that chooses among them.

A backend says what work it takes (`CodecBackend.takes`: element formats, group sizes,
dtypes, shard counts, rounding) and where it runs. `choose` walks `BACKENDS` in order
and takes the first that takes the work and can run: the Gluon kernels on a CUDA GPU
with Triton, else the Pallas kernels (on a GPU, or in the Pallas interpreter), else the
jnp path, which takes everything. Every choice of a codec path reads this table: the
codec once per wire plan (`taco_jax.message.codec_choice`, `WirePlan.codec`) and the
kernels' own default when called without a launch config (`compress`, `decompress`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax.numpy as jnp

from . import formats, jax_compat, triton_launch

# The float dtypes a kernel reads (a compress's input) or writes (a decode's output).
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class CodecWork:
    """One piece of codec work, as a backend judges it.

    Attributes:
      fmt: the element format's name.
      group_size: G.
      dtype: the compress's input dtype, or the decode's output dtype.
      shards: messages a decode sums (1 for a compress or a lone decode).
      stochastic: values are rounded stochastically.
      scales: the scale format's name; None where the caller has settled it (a kernel
        entry point, which takes the scale formats its backend does).
    """

    fmt: str
    group_size: int
    dtype: jnp.dtype
    shards: int = 1
    stochastic: bool = False
    scales: str | None = None


@dataclasses.dataclass(frozen=True)
class CodecBackend:
    """A codec implementation and the work it takes.

    Attributes:
      name: "gluon", "pallas" or "jnp".
      formats: the element formats it encodes and decodes; None: every format.
      scale_formats: the scale formats it writes and reads; None: every format.
      max_group: the largest group size (a power of two from 16 up).
      dtypes: the float dtypes it reads and writes; None: any.
      any_shards: whether it sums any number of shards (else a power of two).
      stochastic: whether it rounds stochastically.
      runs: whether it can run here, given that the Pallas interpreter is asked for.
    """

    name: str
    formats: tuple[str, ...] | None
    scale_formats: tuple[str, ...] | None
    max_group: int
    dtypes: tuple[jnp.dtype, ...] | None
    any_shards: bool
    stochastic: bool
    runs: Callable[[bool], bool]

    @property
    def is_kernel(self) -> bool:
        """A GPU kernel (Gluon or Pallas), not the jnp path."""
        return self is not JNP

    def takes(self, work: CodecWork) -> bool:
        """Whether this backend takes `work` (wherever it runs)."""
        return (
            (self.formats is None or (work.fmt in self.formats and _fills_words(work)))
            and (self.scale_formats is None or work.scales is None or work.scales in self.scale_formats)
            and 16 <= work.group_size <= self.max_group
            and _power_of_two(work.group_size)
            and (self.dtypes is None or jnp.dtype(work.dtype) in self.dtypes)
            and (self.any_shards or _power_of_two(work.shards))
            and (self.stochastic or not work.stochastic)
        )


def _fills_words(work: CodecWork) -> bool:
    """Whether a group's codes fill whole 32-bit words (as the kernels pack sub-byte codes)."""
    return work.group_size * formats.wire_format(work.fmt).bits % 32 == 0


_EIGHT_BIT = ("e4m3", "e5m2", "int8")
# The sub-byte formats, whose codes the Gluon kernels pack into 32-bit words
# (`gluon_packing.store_packed`): checked against the jnp path by the GPU suite, and
# faster in the step than it (`benchmarks.codec_cost`). TACO_JAX_SUB_BYTE_KERNELS=0 turns
# them off, and the jnp path encodes them.
_SUB_BYTE = ("int5", "int4", "e2m3", "e3m2", "e2m1")
SUB_BYTE_KERNELS = os.environ.get("TACO_JAX_SUB_BYTE_KERNELS", "1") != "0"
# The scale encodings the kernels write (`gluon_codec.SCALE_FORMAT_IDS`, `wire`).
_KERNEL_SCALES = ("dual", "single", "bf16", "e8m0")


def _kernels(name: str, element_formats: tuple[str, ...], runs: Callable[[bool], bool]) -> CodecBackend:
    """A kernel backend: its element formats, the kernels' scale encodings, groups up to
    512 (the Gluon split kernels spread a group over at most a warp's 32 lanes, 16 values
    per thread; the Pallas kernels keep the same limit), the three float dtypes, a
    power-of-two number of shards, rounding to nearest."""
    return CodecBackend(
        name, element_formats, _KERNEL_SCALES, 512, KERNEL_DTYPES, any_shards=False, stochastic=False, runs=runs
    )


# The Gluon kernels (`row_kernels`, `split_kernels`): on a CUDA GPU with Triton's Gluon.
GLUON = _kernels(
    "gluon",
    _EIGHT_BIT + (_SUB_BYTE if SUB_BYTE_KERNELS else ()),
    lambda interpret: not interpret and triton_launch.available(),
)
# The Pallas compress and decompress kernels: on a GPU, or in the Pallas interpreter.
PALLAS = _kernels("pallas", _EIGHT_BIT, lambda _: True)
# The plain jnp path (`wire.quantize_groups`, `wire.pack`): every format, size and rounding.
JNP = CodecBackend(
    "jnp", None, None, max_group=1 << 30, dtypes=None, any_shards=True, stochastic=True, runs=lambda _: True
)


def check_pallas_takes(fmt: str) -> None:
    """Raise ValueError unless the Pallas kernels encode `fmt` (8-bit codes)."""
    if fmt not in _EIGHT_BIT:
        raise ValueError(
            f"the Pallas kernels take the 8-bit formats {list(_EIGHT_BIT)}, got {fmt!r}: packed codes are "
            "the Gluon kernels' (a CUDA GPU) or the jnp path's"
        )


# In order of preference.
BACKENDS = (GLUON, PALLAS, JNP)


@dataclasses.dataclass(frozen=True)
class CodecChoice:
    """The codec path of a piece of work, chosen once (`choose`).

    Attributes:
      backend: the `CodecBackend` that runs it where the program is lowered for a CUDA GPU
        (with `lowered_anywhere` False: wherever it is lowered).
      interpret: the Pallas kernel runs in the Pallas interpreter.
      platform_dependent: the program stages `backend` and the jnp path and the
        platform it is lowered for picks (`jax_compat.on_cuda`): kernel mode "auto".
    """

    backend: CodecBackend
    interpret: bool = False
    platform_dependent: bool = False

    @property
    def name(self) -> str:
        """The backend's name, e.g. "gluon" (what reports and benchmarks show)."""
        return self.backend.name

    def run(self, kernel_fn: Callable, reference_fn: Callable, *args):
        """`kernel_fn(*args, interpret=...)` or `reference_fn(*args)` as chosen: the one
        place a codec call goes to a kernel or to the jnp path."""
        if not self.backend.is_kernel:
            return reference_fn(*args)
        if self.platform_dependent:
            return jax_compat.on_cuda(lambda *a: kernel_fn(*a, interpret=False), reference_fn, *args)
        return kernel_fn(*args, interpret=self.interpret)


JNP_PATH = CodecChoice(JNP)


def kernel_backend(work: CodecWork, interpret: bool) -> CodecBackend | None:
    """The first kernel of `BACKENDS` that takes `work` and runs here (`interpret`: in
    the Pallas interpreter), or None."""
    return next((b for b in BACKENDS if b.is_kernel and b.takes(work) and b.runs(interpret)), None)


def launched_by(config, work: CodecWork, interpret: bool) -> CodecBackend:
    """The kernel a kernel entry point launches: the one its launch `config` names (its
    `backend`: a `launch.KernelConfig` for Pallas, a Gluon `RowConfig` or `SplitConfig`),
    else the first kernel that takes `work` and runs here, else the Pallas kernel."""
    if config is not None:
        return GLUON if config.backend == "gluon" else PALLAS
    return kernel_backend(work, interpret) or PALLAS


def choose(work: CodecWork, kernel_mode: str) -> CodecChoice:
    """The codec path of `work` under `kernel_mode` ("jnp", "interpret", "gpu" or "auto";
    validated by the caller): the jnp path for "jnp", on a host without CUDA under
    "auto", and wherever no kernel takes the work; else the first kernel that takes it.

    Under "auto" the choice is made for a CUDA GPU and the platform the program is
    lowered for decides between it and the jnp path; "gpu" prefers the Gluon kernels
    where they run; "interpret" runs the Pallas kernels in the interpreter.
    """
    if kernel_mode == "jnp" or (kernel_mode == "auto" and not jax_compat.has_cuda()):
        return JNP_PATH
    interpret = kernel_mode == "interpret"
    backend = kernel_backend(work, interpret)
    if backend is None:
        return JNP_PATH
    return CodecChoice(backend, interpret=interpret, platform_dependent=kernel_mode == "auto")
