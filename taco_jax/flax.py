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
| `ParallelDotGeneral` | the same matmuls as a `dot_general` for `flax.linen.Dense` / `DenseGeneral` / `nnx.Linear`, N-D kernels included (the Transformer Engine / MaxText pattern) |

With `sequence_parallel=True` activations outside the pair are split over "tensor" along
the sequence axis (the one before the features): the column layer gathers it, the row
layer reduce-scatters into it. `ParallelDotGeneral(layout="feature")` splits them on the
feature axis instead: the column gathers the feature shards, the row reduce-scatters
back onto them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax import collectives, tp
from taco_jax.accounting import WireRecord, record_wire
from taco_jax.calibration import Calibration
from taco_jax.mesh import data_axis
from taco_jax.spec import TacoConfig

try:
    from flax import nnx
except ModuleNotFoundError as error:  # flax is an optional dependency of the library
    raise ModuleNotFoundError("taco_jax.flax needs flax: pip install 'taco_jax[flax]'", name=error.name) from error

KINDS = ("column", "row")
LAYOUTS = ("replicated", "feature", "sequence")


def _spec(ndim: int, axes: dict[int, Any]) -> P:
    """PartitionSpec of rank `ndim` naming mesh axes at the given positions."""
    return P(*(axes.get(position) for position in range(ndim)))


def _contracted_count(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dimension_numbers: Any) -> int:
    """k, where the last k axes of the input contract with the first k of the kernel
    (flax `DenseGeneral`'s dimension numbers) and the kernel has an output axis.

    Raises:
      ValueError: any other dimension numbers, or contracted axes of unequal sizes.
    """
    try:
        (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
        lhs_dims = tuple(int(d) + len(lhs_shape) * (int(d) < 0) for d in lhs_contracting)
        rhs_dims = tuple(int(d) + len(rhs_shape) * (int(d) < 0) for d in rhs_contracting)
        batched = bool(len(lhs_batch) or len(rhs_batch))
    except (TypeError, ValueError):
        lhs_dims, rhs_dims, batched = (), (), True
    k = len(lhs_dims)
    if (
        k == 0
        or batched
        or len(rhs_shape) <= k
        or lhs_dims != tuple(range(len(lhs_shape) - k, len(lhs_shape)))
        or rhs_dims != tuple(range(k))
        or lhs_shape[len(lhs_shape) - k :] != rhs_shape[:k]
    ):
        raise ValueError(
            "ParallelDotGeneral contracts the last k axes of the input with the first k axes of the kernel "
            "(k >= 1, equal sizes, no batch dimensions, at least one output axis; as flax DenseGeneral does); "
            f"got dimension numbers {dimension_numbers} for shapes {lhs_shape} x {rhs_shape}"
        )
    return k


@dataclasses.dataclass(frozen=True)
class ParallelDotGeneral:
    """A `lax.dot_general` replacement doing a Megatron column- or row-parallel matmul
    with compressed communication, on global arrays.

    Pass it as `dot_general=` to `flax.linen.Dense` / `DenseGeneral` or `nnx.Linear`,
    with the kernel partitioned over `axis_name` on `sharded_dim`, e.g. (None, "tensor")
    for a "column" Dense and ("tensor", None) for a "row" one. The kernel may have several
    contracting and output axes, e.g. (embed, heads, head_dim) column and
    (heads, head_dim, embed) row, heads split: the contracting axes are flattened inside
    the island.

    Attributes:
      mesh: the mesh (`taco_jax.make_mesh`, or any `jax.sharding.Mesh` with `axis_name`).
      config: `TacoConfig` of the collectives (including the kernel mode).
      kind: "column" (the output split over the axis on the kernel's sharded output axis)
        or "row" (the input split on the kernel's sharded contracting axis, the output
        summed over the axis).
      site: call-site name for wire-byte accounting and calibration.
      sequence_parallel: the same as `layout="sequence"` (either sets both).
      axis_name: the tensor-parallel mesh axis.
      calibration: per-site channel permutations / transform decisions (None: identity;
        a channel permutation does not apply to the feature layout's messages).
      overlap: the matmul and its collective as one collective matmul
        (`taco_jax.collective_matmul`), each chunk's matmul beside the other chunks'
        transfers: with the sequence layout the gather and matmul (column) or the matmul
        and reduce-scatter (row); with the replicated one the matmul and all-reduce (row)
        or the backward all-reduce of the input gradient (column). Its matmuls use the
        default precision. Not with the feature layout.
      layout: the activation outside the pair. "replicated": the column input and the
        row output replicated over the axis (the row output all-reduced). "sequence":
        split over the axis along the sequence (the axis before the contracted ones): the
        column gathers it, the row reduce-scatters into it. "feature": split over the axis
        on the last (feature) axis: the column gathers the feature shards, the row
        reduce-scatters back onto them. Every collective is compressed.
      batch_axes: mesh axes splitting the leading (batch) axis inside the island, e.g.
        ("data", "fsdp"); those of size 1 or not in the mesh are dropped. None: "data"
        where the batch divides over it, else replicated. Other mesh axes are replicated.
      sharded_dim: the kernel axis split over `axis_name` (negative counts from the end).
        None: the first output axis (column) or the first contracting axis (row), or the
        one `kernel_spec` splits over it.
      kernel_spec: the kernel's partitioning outside, one entry per kernel axis (a mesh
        axis, a tuple of them, or None), e.g. ("fsdp", "tensor", None): the island takes
        the kernel so and all-gathers the axes other than `axis_name` inside (plain, as
        GSPMD gathers fsdp shards), so the kernel gradient leaves reduce-scattered over
        them instead of all-reduced. `axis_name` must be the first axis of its entry.
        None: the kernel enters split over `axis_name` on `sharded_dim` only.
    """

    mesh: Mesh
    config: TacoConfig
    kind: str
    site: str | None = None
    sequence_parallel: bool = False
    axis_name: str = "tensor"
    calibration: Calibration | None = None
    overlap: bool = False
    layout: str = "replicated"
    batch_axes: tuple[str, ...] | None = None
    sharded_dim: int | None = None
    kernel_spec: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.mesh, Mesh) or self.axis_name not in self.mesh.axis_names:
            raise ValueError(f"mesh must be a jax.sharding.Mesh with a {self.axis_name!r} axis, got {self.mesh!r}")
        if not isinstance(self.config, TacoConfig):
            raise ValueError(f"config must be a TacoConfig, got {type(self.config).__name__}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        if self.sequence_parallel and self.layout == "feature":
            raise ValueError("sequence_parallel=True is layout='sequence'; it cannot be combined with layout='feature'")
        if self.overlap and self.layout == "feature":
            raise ValueError("overlap=True runs with layout 'replicated' or 'sequence', not 'feature'")
        sequence = self.sequence_parallel or self.layout == "sequence"
        object.__setattr__(self, "sequence_parallel", sequence)
        object.__setattr__(self, "layout", "sequence" if sequence else self.layout)
        if self.batch_axes is not None:
            axes = (self.batch_axes,) if isinstance(self.batch_axes, str) else tuple(self.batch_axes)
            if self.axis_name in axes:
                raise ValueError(f"batch_axes {axes} name the tensor-parallel axis {self.axis_name!r}")
            object.__setattr__(self, "batch_axes", axes)
        if self.sharded_dim is not None and not isinstance(self.sharded_dim, int):
            raise ValueError(f"sharded_dim must be an int or None, got {self.sharded_dim!r}")
        if self.kernel_spec is not None:
            self._take_kernel_spec(self.kernel_spec)

    def _take_kernel_spec(self, kernel_spec: Any) -> None:
        """Normalise `kernel_spec` to a tuple of axis-name tuples, and `sharded_dim` to
        the axis it splits over `axis_name`."""
        entries = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in kernel_spec)
        unknown = sorted({a for e in entries for a in e} - set(self.mesh.axis_names))
        tensor_dims = [dim for dim, entry in enumerate(entries) if self.axis_name in entry]
        if unknown or len(tensor_dims) != 1 or entries[tensor_dims[0]][0] != self.axis_name:
            raise ValueError(
                f"kernel_spec {kernel_spec} must name axes of the mesh {self.mesh.axis_names} (unknown: {unknown}) "
                f"and {self.axis_name!r} once, as the first axis of its entry"
            )
        (dim,) = tensor_dims
        if self.sharded_dim is not None and self.sharded_dim % len(entries) != dim:
            raise ValueError(f"sharded_dim={self.sharded_dim}, but kernel_spec {kernel_spec} splits axis {dim}")
        object.__setattr__(self, "kernel_spec", entries)
        object.__setattr__(self, "sharded_dim", dim)

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """The contraction of the last k axes of `lhs` with the first k of `rhs`.

        Raises:
          ValueError: other dimension numbers; a `sharded_dim` that is not an output
            (column) or contracting (row) axis of the kernel; an input without the
            sequence axis the layout needs, or without a batch axis for `batch_axes`;
            an axis that does not split over the mesh axes named for it.
        """
        lhs_shape, rhs_shape = tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs))
        k = _contracted_count(lhs_shape, rhs_shape, dimension_numbers)
        lead = len(lhs_shape) - k
        out_shape = lhs_shape[:lead] + rhs_shape[k:]
        sharded = self._kernel_dim(rhs_shape, k)
        if self.layout == "sequence" and lead < 1:
            raise ValueError(
                f"layout 'sequence' needs an input (..., sequence, *contracted), got shape {lhs_shape} "
                f"contracting {k} axes"
            )
        batch = self._batch_spec(lhs_shape, lead)
        axis = self.axis_name
        sequence = {lead - 1: axis} if self.layout == "sequence" else {}
        if self.kind == "column":
            feature = {len(lhs_shape) - 1: axis} if self.layout == "feature" else {}
            lhs_spec = _spec(len(lhs_shape), {**batch, **sequence, **feature})
            out_spec = _spec(len(out_shape), {**batch, lead + sharded - k: axis})
        else:
            feature = {len(out_shape) - 1: axis} if self.layout == "feature" else {}
            lhs_spec = _spec(len(lhs_shape), {**batch, lead + sharded: axis})
            out_spec = _spec(len(out_shape), {**batch, **sequence, **feature})
        rhs_spec = (
            _spec(len(rhs_shape), {sharded: axis})
            if self.kernel_spec is None
            else P(*(e or None for e in self.kernel_spec))
        )
        for name, shape, spec in (("input", lhs_shape, lhs_spec), ("kernel", rhs_shape, rhs_spec)):
            self._check_splits(name, shape, spec)
        self._check_splits("output", out_shape, out_spec)
        matmul = lambda x, w: lax.dot_general(
            x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred_element_type
        )
        body = self._column if self.kind == "column" else self._row
        island = jax.shard_map(
            lambda x, w: body(x, self._whole_kernel(w, collectives.varying_axes(x)), k, matmul),
            mesh=self.mesh,
            in_specs=(lhs_spec, rhs_spec),
            out_specs=out_spec,
            check_vma=True,
        )
        with record_wire() as ledger:
            out = island(lhs, rhs)
        small = [r for r in ledger.records if r.reason.startswith("under min_bytes")]
        if small:
            _warn_under_min_bytes(small[0])
        return out

    def _kernel_dim(self, rhs_shape: tuple[int, ...], k: int) -> int:
        """The kernel axis split over the tensor axis: an output axis (column) or a
        contracting one (row)."""
        if self.kernel_spec is not None and len(self.kernel_spec) != len(rhs_shape):
            raise ValueError(
                f"kernel_spec {self.kernel_spec} has {len(self.kernel_spec)} entries, the kernel shape {rhs_shape}"
            )
        allowed = range(k, len(rhs_shape)) if self.kind == "column" else range(k)
        if self.sharded_dim is None:
            return allowed[0]
        dim = self.sharded_dim + len(rhs_shape) if self.sharded_dim < 0 else self.sharded_dim
        if dim not in allowed:
            which = "output" if self.kind == "column" else "contracting"
            raise ValueError(
                f"sharded_dim={self.sharded_dim} of a {self.kind}-parallel kernel of shape {rhs_shape} "
                f"contracting {k} axes must be one of its {which} axes {list(allowed)}"
            )
        return dim

    def _batch_spec(self, lhs_shape: tuple[int, ...], lead: int) -> dict[int, Any]:
        """{0: the batch mesh axes} when the input has a leading batch axis that splits
        over them, else {} (replicated)."""
        has_batch = lead - (self.layout == "sequence") > 0
        if self.batch_axes is None:
            axis = data_axis(self.mesh, lhs_shape[0]) if has_batch else None
            return {} if axis is None else {0: axis}
        axes = tuple(a for a in self.batch_axes if self.mesh.shape.get(a, 1) > 1)
        if not axes:
            return {}
        if not has_batch:
            raise ValueError(
                f"batch_axes {self.batch_axes} split the leading (batch) axis, but the input of shape {lhs_shape} "
                f"has none before its {'sequence and ' if self.layout == 'sequence' else ''}contracted axes"
            )
        return {0: axes if len(axes) > 1 else axes[0]}

    def _whole_kernel(self, kernel: jax.Array, batch_axes: frozenset[str]) -> jax.Array:
        """This rank's kernel block with `kernel_spec`'s other axes gathered (their
        transpose reduce-scatters the gradient). It is marked varying over the input's
        batch axes before the gathers, so the gradient is reduce-scattered before it is
        summed over the batch axes, on the smaller block."""
        if not self.kernel_spec:
            return kernel
        kernel = collectives.vary(kernel, tuple(sorted(batch_axes - {self.axis_name})))
        for dim, entry in enumerate(self.kernel_spec):
            others = tuple(a for a in entry if a != self.axis_name)
            if others:
                kernel = lax.all_gather(kernel, others, axis=dim, tiled=True)
        return kernel

    def _check_splits(self, name: str, shape: tuple[int, ...], spec: P) -> None:
        for dim, (size, entry) in enumerate(zip(shape, spec)):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            ranks = math.prod(self.mesh.shape[a] for a in axes)
            if size % ranks:
                raise ValueError(
                    f"ParallelDotGeneral ({self.kind}, layout {self.layout!r}): axis {dim} of the {name} of shape "
                    f"{shape} has size {size}, not divisible by mesh axes {axes} of {ranks} devices"
                )

    def _column(self, x: jax.Array, kernel: jax.Array, k: int, matmul) -> jax.Array:
        """The column-parallel matmul on this rank's blocks: the contracted axes flattened."""
        weight = kernel.reshape(math.prod(kernel.shape[:k]), -1)
        if self.layout == "feature":
            x = self._gather_features(x)
        lead_shape = x.shape[: x.ndim - k]
        flat = x.reshape(*lead_shape, weight.shape[0])
        out = self._column_2d(flat, weight, matmul)
        return out.reshape(*out.shape[:-1], *kernel.shape[k:])

    def _column_2d(self, x: jax.Array, weight: jax.Array, matmul) -> jax.Array:
        axis_name, config, site, calibration = self.axis_name, self.config, self.site, self.calibration
        if self.layout == "feature":
            return matmul(x, weight)
        if self.layout == "sequence":
            (out,) = tp.gather_matmul(
                x,
                (weight,),
                axis_name,
                config,
                axis=x.ndim - 2,
                site=site,
                calibration=calibration,
                overlap=self.overlap,
            )
            return out
        if self.overlap:
            return tp.copy_matmul(x, (weight,), axis_name, config, site=site, calibration=calibration, overlap=True)[0]
        return matmul(tp.copy_to_tp(x, axis_name, config, site=site, calibration=calibration), weight)

    def _gather_features(self, x: jax.Array) -> jax.Array:
        """All-gather the feature shards (the last axis). The message moves the features
        first, so its codec groups run along the tokens of one feature, as the row
        layer's reduce-scatter onto the features does: a shard narrower than the codec's
        group is not padded."""
        gathered = tp.gather_from_sp(
            jnp.moveaxis(x, -1, 0), self.axis_name, self.config, axis=0, site=self.site, calibration=self.calibration
        )
        return jnp.moveaxis(gathered, 0, -1)

    def _row(self, x: jax.Array, kernel: jax.Array, k: int, matmul) -> jax.Array:
        """The row-parallel matmul on this rank's blocks: the contracted axes flattened."""
        lead_shape = x.shape[: x.ndim - k]
        flat = x.reshape(*lead_shape, -1)
        weight = kernel.reshape(flat.shape[-1], -1)
        out_dims = kernel.shape[k:]
        if self.layout == "feature":
            partial = matmul(flat, weight).reshape(*lead_shape, *out_dims)
            return tp.reduce_scatter_to_sp(
                partial,
                self.axis_name,
                self.config,
                axis=partial.ndim - 1,
                site=self.site,
                calibration=self.calibration,
            )
        out = self._row_2d(flat, weight, matmul)
        return out.reshape(*out.shape[:-1], *out_dims)

    def _row_2d(self, x: jax.Array, weight: jax.Array, matmul) -> jax.Array:
        axis_name, config, site, calibration = self.axis_name, self.config, self.site, self.calibration
        sequence = self.layout == "sequence"
        if self.overlap and sequence:
            return tp.matmul_reduce_scatter(
                x, weight, axis_name, config, axis=x.ndim - 2, site=site, calibration=calibration, overlap=True
            )
        if self.overlap:
            return tp.matmul_all_reduce(x, weight, axis_name, config, site=site, calibration=calibration, overlap=True)
        partial = matmul(x, weight)
        if sequence:
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
