"""Launching a Gluon kernel (Triton's explicit-layout language) from JAX.

Triton compiles the kernel to PTX for the local GPUs' compute capability; jaxlib's Triton
custom call (`jax_compat.gpu_triton`, the one jax-triton and the Pallas Triton backend
drive) loads and launches it inside the XLA program, on XLA's stream. jax-triton's `triton_call`
cannot take these kernels: it builds every kernel from Triton IR without layouts,
whereas a Gluon kernel states its layouts and is built straight to Triton GPU IR.

Needs `triton` with Gluon (the `gpu` extra); `available()` says whether this process
has it and a CUDA GPU.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from . import jax_compat

gpu_triton = jax_compat.gpu_triton()

# Every buffer XLA hands a custom call is aligned to at least 16 bytes; telling Triton
# lets it vectorize the loads and stores.
POINTER_ATTRS = [["tt.divisibility", 16]]


@functools.cache
def local_capability() -> int:
    """The compute capability (90 for sm_90) of this process's CUDA GPUs, which a
    kernel is compiled for.

    Raises:
      NotImplementedError: the GPUs differ (one PTX build would not fit them all).
    """
    capabilities = {int(device.compute_capability.replace(".", "")) for device in jax_compat.cuda_devices()}
    if len(capabilities) != 1:
        raise NotImplementedError(
            f"the Gluon kernels are built for one compute capability, but this process's "
            f"CUDA GPUs have {sorted(capabilities) or 'none'}"
        )
    return capabilities.pop()


# The row compress stages its tile with cp.async, which Ampere (sm_80) introduced.
MIN_CAPABILITY = 80


@functools.cache
def available() -> bool:
    """Whether Gluon kernels can run here: CUDA GPUs of compute capability
    `MIN_CAPABILITY` or newer, jaxlib's Triton custom call, and a Triton with Gluon (3.6
    or newer)."""
    if gpu_triton is None or not jax_compat.has_cuda():
        return False  # no CUDA GPU, or a jaxlib without the Triton custom call
    if min(int(device.compute_capability.replace(".", "")) for device in jax_compat.cuda_devices()) < MIN_CAPABILITY:
        return False  # an older GPU: the Pallas kernels run
    try:
        from triton.experimental import gluon  # noqa: F401  (the import is the check)
    except ImportError:
        return False
    return True


def compile_kernel(kernel, signature: tuple, constexprs: tuple, num_warps: int, capability: int):
    """Compile a Gluon kernel for a CUDA compute capability (no GPU needed).

    Args:
      kernel: the `gluon.jit` function.
      signature: (argument name, Triton type) of its runtime arguments, in order.
      constexprs: (name, value) of its compile-time arguments.
      num_warps: warps per program.
      capability: compute capability as an int (90 for sm_90).

    Returns:
      Triton's compiled kernel (`asm["ptx"]`, `metadata`).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    types = dict(signature)
    attrs = {(index,): POINTER_ATTRS for index, kind in enumerate(types.values()) if kind.startswith("*")}
    types.update({name: "constexpr" for name, _ in constexprs})
    source = jax_compat.gluon_source(kernel, types, dict(constexprs), attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=num_warps))
    if compiled.metadata.global_scratch_size or compiled.metadata.profile_scratch_size:
        raise NotImplementedError(f"{compiled.metadata.name} needs Triton scratch memory, which this launch lacks")
    return compiled


@functools.cache
def _loaded(kernel, signature: tuple, constexprs: tuple, num_warps: int, capability: int):
    """jaxlib's handle on the compiled kernel (cached per specialization)."""
    compiled = compile_kernel(kernel, signature, constexprs, num_warps, capability)
    return gpu_triton.TritonKernel(
        compiled.metadata.name, num_warps, 1, compiled.metadata.shared, compiled.asm["ptx"], "", capability
    )


def gluon_call(
    kernel,
    inputs: Sequence[jax.Array],
    out_types: Sequence[jax.ShapeDtypeStruct],
    *,
    pointer_types: Sequence[str],
    scalars: Sequence[tuple[str, str, int]],
    grid: tuple[int, int],
    num_warps: int,
    constexprs: dict[str, Any],
) -> list[jax.Array]:
    """Run a Gluon kernel on device arrays inside the XLA program.

    The kernel's arguments are, in order: a pointer per input, a pointer per output, then
    the scalars; then its constexprs.

    Args:
      kernel: the `gluon.jit` function.
      inputs: device arrays, passed as pointers.
      out_types: shapes and dtypes of the outputs XLA allocates (uninitialized).
      pointer_types: the Triton pointer type of every input then output ("*bf16",
        "*i8", ...): what the kernel reads the bytes as, whatever their JAX dtype.
      scalars: (name, Triton type, value) of each integer scalar argument ("i32", "i64"),
        named as in the kernel.
      grid: programs along the two grid axes.
      num_warps: warps per program.
      constexprs: the kernel's compile-time arguments.

    Returns:
      The outputs.
    """
    pointers = len(inputs) + len(out_types)
    if len(pointer_types) != pointers:
        raise ValueError(f"{len(pointer_types)} pointer types for {pointers} inputs and outputs")
    runtime_args = kernel.arg_names[: pointers + len(scalars)]
    if [name for name, _, _ in scalars] != runtime_args[pointers:]:
        raise ValueError(
            f"scalars {[name for name, _, _ in scalars]} do not follow the pointers of "
            f"{kernel.fn.__name__}{tuple(kernel.arg_names)}"
        )
    signature = tuple(zip(runtime_args, [*pointer_types, *(kind for _, kind, _ in scalars)]))
    loaded = _loaded(kernel, signature, tuple(sorted(constexprs.items())), num_warps, local_capability())
    params = [gpu_triton.create_array_parameter(0, 16) for _ in range(pointers)]
    params += [gpu_triton.create_scalar_parameter(int(value), kind) for _, kind, value in scalars]
    call = gpu_triton.TritonKernelCall(loaded, grid[0], grid[1], 1, params)
    backend_config = zlib.compress(call.to_proto(kernel.fn.__name__, b""))
    mesh = jax.typeof(inputs[0]).sharding.mesh
    # The Triton custom call takes its (compressed proto) backend config as bytes, where
    # jax's annotation says str.
    return jax.ffi.ffi_call(  # type: ignore[call-overload]
        "triton_kernel_call",
        [_on_mesh(out_type, mesh) for out_type in out_types],
        custom_call_api_version=2,
        legacy_backend_config=backend_config,
    )(*inputs)


def _on_mesh(out_type: jax.ShapeDtypeStruct, mesh) -> jax.ShapeDtypeStruct:
    """`out_type` placed on the (abstract) mesh the inputs live on: `ffi_call` takes the
    manual axes an output varies over (`launch.output_struct`) only with a mesh that has
    them, inside `shard_map`."""
    return jax.ShapeDtypeStruct(
        out_type.shape,
        out_type.dtype,
        sharding=NamedSharding(mesh, PartitionSpec()),
        manual_axis_type=out_type.manual_axis_type,
    )
