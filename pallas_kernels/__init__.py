"""Pallas GPU kernels for TACO's fused compress / decompress, each beside its jnp reference.

This package depends only on jax and numpy. The group codec in `group_codec` is the
plain-jnp definition of the math; kernels are checked against it and it is the path used
where no kernel applies (CPU, odd shapes).
"""

from pallas_kernels.formats import SCALE_FORMATS, WIRE_FORMATS, WireFormat
from pallas_kernels.group_codec import dequantize_groups, quantize_groups
from pallas_kernels.hadamard import hadamard_matrix, hadamard_transform

__all__ = [
    "SCALE_FORMATS",
    "WIRE_FORMATS",
    "WireFormat",
    "dequantize_groups",
    "hadamard_matrix",
    "hadamard_transform",
    "quantize_groups",
]
