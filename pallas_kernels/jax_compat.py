"""What taco_jax asks of JAX (and Triton) about where it runs, in one place: the platform
(`cuda_devices`, `on_cuda`), the shard_map it is traced in (`checks_vma`,
`transposing_whole_shard_map`) and what has no public form.

Everything else uses public API. Each helper that reads a private object names it and
the JAX versions it was checked on (`TESTED_JAX`, the range `pyproject.toml` declares);
where the object is missing it raises `UnsupportedJaxError` instead of guessing, so a
check that cannot run never quietly passes.
"""

from __future__ import annotations

import functools
import sys
import types

import jax
from jax import lax

# The jax releases these helpers were checked on; pyproject.toml bounds jax to them.
TESTED_JAX = ("0.10.2", "0.12")


class UnsupportedJaxError(RuntimeError):
    """This jax lacks an internal that taco_jax relies on (outside `TESTED_JAX`)."""


def _unsupported(what: str) -> UnsupportedJaxError:
    return UnsupportedJaxError(
        f"taco_jax cannot {what} on jax {jax.__version__}: the internal it reads is gone. taco_jax is tested on "
        f"jax {TESTED_JAX[0]} to {TESTED_JAX[1]}.x; install a jax in that range."
    )


@functools.cache
def cuda_devices() -> tuple:
    """This process's CUDA devices (none without a CUDA backend)."""
    try:
        return tuple(jax.local_devices(backend="cuda"))
    except RuntimeError:
        return ()


def has_cuda() -> bool:
    """Whether this process has a CUDA backend, so a program may be lowered for one."""
    return bool(cuda_devices())


def on_cuda(cuda_fn, default_fn, *args):
    """`cuda_fn(*args)` where the program is lowered for a CUDA GPU, `default_fn(*args)`
    elsewhere: the lowering platform chooses (`lax.platform_dependent`), not the default
    backend, so a jit onto CPU devices or a multi-platform export never meets GPU code.
    Both are traced only where a CUDA backend exists (`has_cuda`)."""
    if not has_cuda():
        return default_fn(*args)
    return lax.platform_dependent(*args, cuda=cuda_fn, default=default_fn)


def checks_vma(axis_name: str) -> bool:
    """Whether `axis_name` is a manual axis of an enclosing `jax.shard_map` that tracks
    varying axes (`check_vma=True`); False under `check_vma=False` and for a `vmap` axis.

    Public API only: `lax.pcast` to varying marks a value only where varying axes are
    tracked (the probe is a constant, which XLA removes)."""
    if axis_name not in jax.sharding.get_abstract_mesh().manual_axes:
        return False
    probe = lax.pcast(jax.numpy.zeros((), jax.numpy.int8), (axis_name,), to="varying")
    return axis_name in jax.typeof(probe).mat.varying


def _shard_map_transpose_rules() -> list:
    """The transpose rules JAX has registered for `shard_map` (private: `jax._src`; a
    plain transpose rule up to jax 0.11, a "fancy" one in 0.12); empty where none is
    found."""
    try:
        from jax._src import shard_map as shard_map_internals
        from jax._src.interpreters import ad
    except ImportError:
        return []
    primitive = getattr(shard_map_internals, "shard_map_p", None)
    tables = (getattr(ad, table, {}) for table in ("primitive_transposes", "fancy_transposes"))
    return [table[primitive] for table in tables if primitive in table]


@functools.cache
def _shard_map_transpose_code():
    """The code object of the rule JAX transposes a whole `shard_map` with."""
    for rule in _shard_map_transpose_rules():
        if hasattr(rule, "__code__"):
            return rule.__code__
    raise _unsupported("tell whether a shard_map is differentiated from outside")


def transposing_whole_shard_map() -> bool:
    """True while JAX transposes a whole shard_map, i.e. the gradient was taken outside
    it: the Python stack holds shard_map's transpose rule.

    Raises:
      UnsupportedJaxError: this jax has no transpose rule where taco_jax looks for it.
    """
    code = _shard_map_transpose_code()
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def gpu_triton():
    """jaxlib's Triton custom call (`jax._src.lib.gpu_triton`: what jax-triton and the
    Pallas Triton backend launch kernels with), or None on a jaxlib without one."""
    try:
        from jax._src.lib import gpu_triton as module
    except ImportError:
        return None
    return module if hasattr(module, "TritonKernelCall") else None


def gluon_source(kernel, signature: dict, constexprs: dict, attrs: dict):
    """Triton's compile source for a Gluon kernel (`triton.experimental.gluon._runtime.
    GluonASTSource`, private to Triton; checked on triton 3.6).

    Raises:
      UnsupportedJaxError: this Triton has no such class.
    """
    try:
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError as error:
        import triton

        raise UnsupportedJaxError(
            f"taco_jax cannot build Gluon kernels with triton {triton.__version__}: "
            "GluonASTSource is gone; taco_jax is tested on triton 3.6"
        ) from error
    return GluonASTSource(kernel, signature, constexprs, attrs)
