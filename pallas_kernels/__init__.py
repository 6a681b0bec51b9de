"""Pallas GPU kernels for TACO's fused compress / decompress, each beside its jnp reference.

Installed as `taco_jax.kernels`. This package depends only on jax and numpy (nothing else
in `taco_jax`), and on Triton where it is installed (the `gpu` extra). `formats` holds the
wire formats and scale encodings, a class each (built from `elementwise`'s bit
arithmetic); `launch` holds what both kernels share about launching; `group_codec` is
the plain-jnp definition of
the math, written so the kernels reuse it on their tiles; `compress` and `decompress` hold
the fused Pallas kernels, each beside its jnp reference; `row_kernels` (the Gluon
compress with a group per thread) and `split_kernels` (every Gluon decode and the compress
of larger groups, a group over a few lanes), built on `gluon_codec`'s shared math and
launched by `triton_launch`, run by default on a CUDA GPU. Which one runs is one table,
`backends.BACKENDS`, read with the caller's kernel mode (`taco_jax.TacoConfig.kernel_mode`:
the kernels on GPU by default, the jnp path elsewhere and where no kernel takes the work,
e.g. groups over 512 or formats below 8 bits).
"""

from .formats import SCALE_ENCODINGS, SCALE_FORMATS, WIRE_FORMATS, ScaleFormat, WireFormat
from .group_codec import quantize_groups
from .hadamard import hadamard_matrix, hadamard_transform

__all__ = [
    "SCALE_ENCODINGS",
    "SCALE_FORMATS",
    "WIRE_FORMATS",
    "ScaleFormat",
    "WireFormat",
    "hadamard_matrix",
    "hadamard_transform",
    "quantize_groups",
]
