"""Compressed tensor parallelism for Flax models sharded the JAX way (`jax.jit` + shardings).

Each layer holds its own `jax.shard_map` island over the whole mesh, its input's leading
(batch) axis split over "data" where it divides, with JAX's default `check_vma=True`: the
gradient is taken outside, by `jax.grad` / `nnx.grad`, and is exact (mode "off") or within
codec error. (An island manual over "tensor" alone lets the compiler re-shard the 8-bit
messages over "data" in between, adding collectives; hence the whole mesh.)

| layer | what it does |
|---|---|
| `ColumnParallelLinear` | `flax.nnx`: x replicated over "tensor" -> (..., out) sharded over it |
| `RowParallelLinear` | `flax.nnx`: (..., in) sharded over "tensor" -> compressed all-reduce |
| `ParallelDotGeneral` | the same matmuls as a `dot_general` for `flax.linen.Dense` / `nnx.Linear` (the Transformer Engine / MaxText pattern) |

With `sequence_parallel=True` activations outside the pair are split over "tensor" along
the sequence axis (the one before the features): the column layer gathers it, the row
layer reduce-scatters into it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax import tp
from taco_jax.accounting import WireRecord, record_wire
from taco_jax.calibration import Calibration
from taco_jax.mesh import data_axis
from taco_jax.spec import TacoConfig

try:
    from flax import nnx
except ModuleNotFoundError as error:  # flax is an optional dependency of the library
    raise ModuleNotFoundError("taco_jax.flax needs flax: pip install 'taco_jax[flax]'", name=error.name) from error

KINDS = ("column", "row")


def _spec(ndim: int, axes: dict[int, str]) -> P:
    """PartitionSpec of rank `ndim` naming mesh axes at the given positions."""
    return P(*(axes.get(position) for position in range(ndim)))


@dataclasses.dataclass(frozen=True)
class ParallelDotGeneral:
    """A `lax.dot_general` replacement doing a Megatron column- or row-parallel matmul
    with compressed communication, on global arrays.

    Pass it as `dot_general=` to `flax.linen.Dense` or `nnx.Linear`, with the kernel
    partitioned as (None, axis_name) for "column" and (axis_name, None) for "row".

    Attributes:
      mesh: the mesh (`taco_jax.make_mesh`).
      config: `TacoConfig` of the collectives (including the kernel mode).
      kind: "column" (input replicated over the axis, output sharded on its last axis) or
        "row" (input sharded on its last axis, output summed over the axis).
      site: call-site name for wire-byte accounting and calibration.
      sequence_parallel: the activation outside the pair is split along the sequence
        axis (second to last) over the tensor axis.
      axis_name: the tensor-parallel mesh axis.
      calibration: per-site channel permutations / transform decisions (None: identity).
      overlap: the matmul and its collective as one collective matmul
        (`taco_jax.collective_matmul`), each chunk's matmul beside the other chunks'
        transfers: with sequence parallelism the gather and matmul (column) or the matmul
        and reduce-scatter (row); without it the matmul and all-reduce (row) or the
        backward all-reduce of the input gradient (column). Its matmuls use the default
        precision.
    """

    mesh: Mesh
    config: TacoConfig
    kind: str
    site: str | None = None
    sequence_parallel: bool = False
    axis_name: str = "tensor"
    calibration: Calibration | None = None
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.mesh, Mesh) or self.axis_name not in self.mesh.axis_names:
            raise ValueError(f"mesh must be a jax.sharding.Mesh with a {self.axis_name!r} axis, got {self.mesh!r}")
        if not isinstance(self.config, TacoConfig):
            raise ValueError(f"config must be a TacoConfig, got {type(self.config).__name__}")

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """`lhs @ rhs` over the last axis of `lhs` and the first of the 2-D `rhs`.

        Raises:
          ValueError: other dimension numbers, a kernel that is not 2-D, shapes that do not
            split over the tensor axis, or an input too short for sequence parallelism.
        """
        if (
            jnp.ndim(rhs) != 2
            or tuple(map(tuple, dimension_numbers[0])) != ((jnp.ndim(lhs) - 1,), (0,))
            or any(dimension_numbers[1])
        ):
            raise ValueError(
                "ParallelDotGeneral contracts the last axis of the input with the first axis of a 2-D "
                f"kernel (as Dense does); got dimension numbers {dimension_numbers} for shapes "
                f"{jnp.shape(lhs)} x {jnp.shape(rhs)}"
            )
        ndim, axis = jnp.ndim(lhs), self.axis_name
        if self.sequence_parallel and ndim < 2:
            raise ValueError(f"sequence parallelism needs (..., sequence, features) inputs, got shape {jnp.shape(lhs)}")
        batch = self._batch_axes(jnp.shape(lhs))
        outside = {**batch, ndim - 2: axis} if self.sequence_parallel else batch
        inside = {**batch, ndim - 1: axis}
        if self.kind == "column":
            in_specs, out_spec = (_spec(ndim, outside), P(None, axis)), _spec(ndim, inside)
        else:
            in_specs, out_spec = (_spec(ndim, inside), P(axis, None)), _spec(ndim, outside)
        matmul = lambda x, k: lax.dot_general(
            x, k, (((x.ndim - 1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred_element_type
        )
        body = self._column if self.kind == "column" else self._row
        island = jax.shard_map(
            lambda x, k: body(x, k, matmul), mesh=self.mesh, in_specs=in_specs, out_specs=out_spec, check_vma=True
        )
        with record_wire() as ledger:
            out = island(lhs, rhs)
        small = [r for r in ledger.records if r.reason.startswith("under min_bytes")]
        if small:
            _warn_under_min_bytes(small[0])
        return out

    def _batch_axes(self, shape: tuple[int, ...]) -> dict[int, str]:
        """{0: "data"} when the leading axis is a batch axis that splits over "data"."""
        batch_dims = len(shape) - 1 - self.sequence_parallel
        axis = data_axis(self.mesh, shape[0]) if batch_dims > 0 else None
        return {} if axis is None else {0: axis}

    def _column(self, x: jax.Array, kernel: jax.Array, matmul) -> jax.Array:
        axis_name, config, site, calibration = self.axis_name, self.config, self.site, self.calibration
        if self.sequence_parallel:
            (out,) = tp.gather_matmul(
                x,
                (kernel,),
                axis_name,
                config,
                axis=x.ndim - 2,
                site=site,
                calibration=calibration,
                overlap=self.overlap,
            )
            return out
        if self.overlap:
            return tp.copy_matmul(x, (kernel,), axis_name, config, site=site, calibration=calibration, overlap=True)[0]
        return matmul(tp.copy_to_tp(x, axis_name, config, site=site, calibration=calibration), kernel)

    def _row(self, x: jax.Array, kernel: jax.Array, matmul) -> jax.Array:
        axis_name, config, site, calibration = self.axis_name, self.config, self.site, self.calibration
        if self.overlap and self.sequence_parallel:
            return tp.matmul_reduce_scatter(
                x, kernel, axis_name, config, axis=x.ndim - 2, site=site, calibration=calibration, overlap=True
            )
        if self.overlap:
            return tp.matmul_all_reduce(x, kernel, axis_name, config, site=site, calibration=calibration, overlap=True)
        partial = matmul(x, kernel)
        if self.sequence_parallel:
            return tp.reduce_scatter_to_sp(
                partial, axis_name, config, axis=x.ndim - 2, site=site, calibration=calibration
            )
        return tp.reduce_from_tp(partial, axis_name, config, site=site, calibration=calibration)


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


# Whether `_warn_under_min_bytes` has warned in this process.
_WARNED_UNDER_MIN_BYTES = False


def _warn_under_min_bytes(record: WireRecord) -> None:
    """Warn, once a process, that a layer of a compressing config sent a message plain
    because of its size: the first thing to know when nothing seems compressed."""
    global _WARNED_UNDER_MIN_BYTES
    if _WARNED_UNDER_MIN_BYTES:
        return
    _WARNED_UNDER_MIN_BYTES = True
    warnings.warn(
        f"taco_jax.flax: the {record.op} of site {record.site!r} sends its {record.dtype}{list(record.shape)} "
        f"message uncompressed, {record.reason}. Smaller messages cost more to compress than they save; "
        "TacoConfig.preset(..., min_bytes=0) compresses every size, and `with taco_jax.record_wire() as ledger:` "
        "around the first call, then `print(ledger.report())`, shows every message and why (this warning is "
        "shown once).",
        stacklevel=4,
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
