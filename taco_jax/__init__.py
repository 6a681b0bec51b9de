"""taco_jax: 8-bit compression of tensor-parallel communication for JAX/Flax (TACO).

Public API: `QuantSpec`, `TacoConfig`, `compress`, `decompress`, `Compressed`,
`wire_bytes`.
"""

from taco_jax.codec import Compressed, compress, decompress, from_transformed, to_transformed, wire_bytes
from taco_jax.spec import PRESETS, QuantSpec, TacoConfig

__all__ = [
    "PRESETS",
    "Compressed",
    "QuantSpec",
    "TacoConfig",
    "compress",
    "decompress",
    "from_transformed",
    "to_transformed",
    "wire_bytes",
]
