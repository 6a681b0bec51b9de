"""Compressed tensor parallelism for Flax models sharded the JAX way (`jax.jit` + shardings).

Each layer holds its own `jax.shard_map` island over the whole mesh, its input's leading
(batch) axis split over "data" where it divides (`ParallelDotGeneral.batch_axes`: over any
mesh axes, e.g. data x fsdp), with JAX's default `check_vma=True`: the
gradient is taken outside, by `jax.grad` / `nnx.grad`, and is exact (mode "off") or within
codec error. (An island manual over "tensor" alone lets the compiler re-shard the 8-bit
messages over "data" in between, adding collectives; hence the whole mesh.)

| layer | what it does |
|---|---|
| `ColumnParallelLinear` | `flax.nnx`: x replicated over "tensor" -> (..., out) sharded over it |
| `RowParallelLinear` | `flax.nnx`: (..., in) sharded over "tensor" -> compressed all-reduce |
| `ParallelDotGeneral` | the same matmuls as a `dot_general` for `flax.linen.Dense` / `DenseGeneral` / `nnx.Linear`, N-D kernels included (the Transformer Engine / MaxText pattern; `taco_jax.dot_general`, re-exported here) |

With `sequence_parallel=True` activations outside the pair are split over "tensor" along
the sequence axis (the one before the features): the column layer gathers it, the row
layer reduce-scatters into it. `ParallelDotGeneral(layout="feature")` splits them on the
feature axis instead: the column gathers the feature shards, the row reduce-scatters
back onto them.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from taco_jax.calibration import Calibration
from taco_jax.dot_general import KINDS, LAYOUTS, GatheredInput, ParallelDotGeneral, message_row_length
from taco_jax.policy import TacoConfig

try:
    from flax import nnx
except ModuleNotFoundError as error:  # flax is an optional dependency of the library
    raise ModuleNotFoundError("taco_jax.flax needs flax: pip install 'taco_jax[flax]'", name=error.name) from error


def _parallel_linear(
    kind: str,
    in_features: int,
    out_features: int,
    mesh: Mesh,
    dot_general: ParallelDotGeneral,
    use_bias: bool,
    rngs: nnx.Rngs,
    linear_kwargs: dict,
) -> dict:
    """nnx.Linear arguments of a parallel layer: the dot_general and the parameters'
    partitioning (kernel split over the tensor axis on its output or input axis; the
    bias split with the output of a column layer, replicated after a row layer)."""
    kernel_axes, bias_axes = (
        ((None, dot_general.axis_name), (dot_general.axis_name,))
        if kind == "column"
        else ((dot_general.axis_name, None), (None,))
    )
    for name, size in (("in_features", in_features), ("out_features", out_features)):
        split = (kind == "column") == (name == "out_features")
        if split and size % mesh.shape[dot_general.axis_name]:
            raise ValueError(
                f"{kind}-parallel {name}={size} is not divisible by the "
                f"{dot_general.axis_name!r} axis size {mesh.shape[dot_general.axis_name]}"
            )
    return dict(
        in_features=in_features,
        out_features=out_features,
        use_bias=use_bias,
        rngs=rngs,
        dot_general=dot_general,
        kernel_metadata=dict(out_sharding=kernel_axes, mesh=mesh),
        bias_metadata=dict(out_sharding=bias_axes, mesh=mesh),
        **linear_kwargs,
    )


class ColumnParallelLinear(nnx.Linear):
    """`nnx.Linear` whose output features are split over the tensor axis.

    `kernel` is the global (in_features, out_features) `nnx.Param`, partitioned
    (None, "tensor"); `bias` the global (out_features,), partitioned ("tensor",).
    Input (..., in_features) replicated over "tensor" (its batch may be sharded over
    "data"); output (..., out_features) sharded over "tensor" on the last axis. The
    backward pass all-reduces the input gradient, compressed with `config.backward`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: Mesh,
        config: TacoConfig,
        site: str | None = None,
        use_bias: bool = True,
        rngs: nnx.Rngs,
        sequence_parallel: bool = False,
        calibration: Calibration | None = None,
        overlap: bool = False,
        **linear_kwargs: Any,
    ) -> None:
        """
        Args:
          in_features, out_features: global sizes; out_features divisible by the tensor axis.
          mesh: the mesh (`taco_jax.make_mesh`); the parameters are created on it.
          config: `TacoConfig` of the collectives.
          site: call-site name for wire-byte accounting and calibration.
          use_bias: add a bias.
          rngs: `nnx.Rngs` for the initializers.
          sequence_parallel: the input is split over "tensor" along its sequence axis
            (second to last) and gathered here (compressed, the backward a reduce-scatter).
          calibration: per-site channel permutations / transform decisions.
          overlap: the matmul and its collective as one collective matmul
            (`ParallelDotGeneral.overlap`).
          **linear_kwargs: further `nnx.Linear` arguments (dtype, param_dtype,
            kernel_init, bias_init, precision, ...).

        Raises:
          ValueError: out_features not divisible by the tensor axis, a mesh without it, or
            a config that is not a `TacoConfig`.
        """
        super().__init__(
            **_parallel_linear(
                "column",
                in_features,
                out_features,
                mesh,
                ParallelDotGeneral(
                    mesh, config, "column", site, sequence_parallel, calibration=calibration, overlap=overlap
                ),
                use_bias,
                rngs,
                linear_kwargs,
            )
        )


class RowParallelLinear(nnx.Linear):
    """`nnx.Linear` whose input features are split over the tensor axis; the partial
    products are summed by a compressed all-reduce (`config.forward`).

    `kernel` is the global (in_features, out_features) `nnx.Param`, partitioned
    ("tensor", None); `bias` the global (out_features,), replicated (added after the sum).
    Input (..., in_features) sharded over "tensor" on the last axis (a
    `ColumnParallelLinear`'s output); output (..., out_features) replicated over "tensor".
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: Mesh,
        config: TacoConfig,
        site: str | None = None,
        use_bias: bool = True,
        rngs: nnx.Rngs,
        sequence_parallel: bool = False,
        calibration: Calibration | None = None,
        overlap: bool = False,
        **linear_kwargs: Any,
    ) -> None:
        """
        Args:
          in_features, out_features: global sizes; in_features divisible by the tensor axis.
          mesh, config, site, use_bias, rngs, calibration: as `ColumnParallelLinear`.
          sequence_parallel: reduce-scatter the sum along the sequence axis (second to
            last) instead of all-reducing it; the output is split over "tensor" there.
          overlap: the matmul and its collective as one collective matmul
            (`ParallelDotGeneral.overlap`).
          **linear_kwargs: further `nnx.Linear` arguments.

        Raises:
          ValueError: in_features not divisible by the tensor axis, a mesh without it, or
            a config that is not a `TacoConfig`.
        """
        super().__init__(
            **_parallel_linear(
                "row",
                in_features,
                out_features,
                mesh,
                ParallelDotGeneral(
                    mesh, config, "row", site, sequence_parallel, calibration=calibration, overlap=overlap
                ),
                use_bias,
                rngs,
                linear_kwargs,
            )
        )


__all__ = [
    "KINDS",
    "LAYOUTS",
    "ColumnParallelLinear",
    "GatheredInput",
    "ParallelDotGeneral",
    "RowParallelLinear",
    "message_row_length",
]
