"""Pallas GPU kernels for TACO's fused compress / decompress, each beside its jnp reference.

Installed as `taco_jax.kernels`. This package depends only on jax and numpy (nothing else
in `taco_jax`), and on Triton where it is installed (the `gpu` extra). `formats` holds the
wire formats and scale encodings, a class each, and the bit arithmetic they are built
from; `wire` holds the wire message's layout and the plain-jnp definition of the math
(the group codec, the dither, the Walsh-Hadamard transform), written so the kernels reuse
it on their tiles; `launch` holds what the Pallas kernels share about launching, and
`jax_compat` what the package asks of JAX (the platform, the shard_map it is traced in,
the internals without a public form); `compress` and `decompress` hold the fused Pallas
kernels, each beside its jnp reference; `row_kernels` (the Gluon compress with a group
per thread) and `split_kernels` (every Gluon decode and the compress of larger groups, a
group over a few lanes), built on `gluon_codec`'s shared math and `gluon_packing`'s
word packing of sub-byte codes, and launched by
`triton_launch`, run by default on a CUDA GPU. Which one runs is one table,
`backends.BACKENDS`, read with the caller's kernel mode (`taco_jax.TacoConfig.kernel_mode`:
the kernels on GPU by default, the jnp path elsewhere and where no kernel takes the work,
e.g. groups over 512 or stochastic rounding).
"""

from .formats import SCALE_ENCODINGS, SCALE_FORMATS, WIRE_FORMATS, ScaleFormat, WireFormat
from .wire import hadamard_matrix, hadamard_transform, quantize_groups

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
