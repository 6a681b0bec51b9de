"""taco_jax: 8-bit compression of tensor-parallel communication for JAX/Flax (TACO).

Public API: `QuantSpec`, `TacoConfig`, `compress` / `decompress` (`Compressed`),
`wire_bytes`, the collectives `all_gather`, `reduce_scatter`, `all_reduce`, `ppermute`,
`data_parallel.mean_gradients` (the data-parallel reduction with error feedback), the Megatron
mappings in `taco_jax.tp`, per-site calibration in `taco_jax.calibration`, `make_mesh`,
`simulated_shard_map` (a mesh as named vmaps on one device), `record_wire` (wire-byte accounting) and
`collectives_in_hlo` (what a compiled function sends); `policy` (where compression pays:
routes from a measured `LinkProfile`) and `probe` (measure one on the mesh).
"""

from taco_jax import calibration, data_parallel, policy, probe, tp
from taco_jax.accounting import WireLedger, WireRecord, record_wire
from taco_jax.codec import Compressed, compress, decompress, decompress_sum, requantize_sum, wire_bytes
from taco_jax.collectives import all_gather, all_reduce, ppermute, reduce_scatter
from taco_jax.hlo import HloCollective, collectives_in_hlo
from taco_jax.mesh import MESH_AXES, make_mesh, simulated_shard_map
from taco_jax.policy import KERNEL_MODES, PRESETS, FewerBits, QuantSpec, TacoConfig

__all__ = [
    "KERNEL_MODES",
    "MESH_AXES",
    "PRESETS",
    "Compressed",
    "HloCollective",
    "FewerBits",
    "QuantSpec",
    "TacoConfig",
    "WireLedger",
    "WireRecord",
    "calibration",
    "data_parallel",
    "all_gather",
    "all_reduce",
    "collectives_in_hlo",
    "compress",
    "decompress",
    "decompress_sum",
    "make_mesh",
    "policy",
    "ppermute",
    "probe",
    "record_wire",
    "reduce_scatter",
    "requantize_sum",
    "simulated_shard_map",
    "tp",
    "wire_bytes",
]
