"""Pallas GPU kernels for TACO's fused compress / decompress, each beside its jnp reference.

Installed as `taco_jax.kernels`. This package depends only on jax and numpy (nothing else
in `taco_jax`), and on Triton where it is installed (the `gpu` extra). `launch` holds what
both kernels share about launching; `group_codec` is the plain-jnp definition of
the math, written so the kernels reuse it on their tiles; `compress` and `decompress` hold
the fused Pallas kernels, each beside its jnp reference; `row_kernels` (the Gluon
compress with a group per thread) and `split_kernels` (every Gluon decode and the compress
of larger groups, a group over a few lanes), built on `gluon_codec`'s shared math and
launched by `triton_launch`, run by default on a CUDA GPU. Which one runs is the caller's
choice (`taco_jax.TacoConfig.kernel_mode`: the kernels on GPU by default, the jnp path
elsewhere and where no kernel applies, e.g. group sizes under 16 or 4-bit formats).
"""

from .formats import SCALE_FORMATS, WIRE_FORMATS, WireFormat
from .group_codec import quantize_groups
from .hadamard import hadamard_matrix, hadamard_transform

__all__ = [
    "SCALE_FORMATS",
    "WIRE_FORMATS",
    "WireFormat",
    "hadamard_matrix",
    "hadamard_transform",
    "quantize_groups",
]
