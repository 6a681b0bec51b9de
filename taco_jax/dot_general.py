"""`ParallelDotGeneral`: a `lax.dot_general` replacement doing a Megatron column- or
row-parallel matmul with compressed communication, on global arrays (jax.jit +
shardings), N-D kernels included. Pass it as `dot_general=` to `flax.linen.Dense` /
`DenseGeneral` or `nnx.Linear` (`taco_jax.flax` re-exports it and builds its NNX layers
on it), or call it from any framework's matmul hook (`taco_jax.integrations.maxtext`).

Each call is a `jax.shard_map` island over the whole mesh, its input's leading (batch)
axis split over the batch axes, with JAX's default `check_vma=True`: the gradient is
taken outside and is exact (mode "off") or within codec error. Column matmuls reading
one input can share one gather (`ParallelDotGeneral.column_many`, `gather_input`).
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
from taco_jax.policy import TacoConfig

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


def message_row_length(config: TacoConfig) -> int:
    """The row length the feature layout cuts its messages into: the codec's group size
    (the least common multiple of every format's, `fewer_bits` candidates included), so
    that every row is whole groups whatever format calibration picks."""
    specs = [config.forward, config.backward, *(config.fewer_bits.candidates if config.fewer_bits else ())]
    return math.lcm(*(spec.group_size for spec in specs))


def _entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _matmul(precision: Any, preferred_element_type: Any):
    """A 2-D matmul (..., C) x (C, N) with the caller's precision and result type."""
    return lambda x, w: lax.dot_general(
        x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred_element_type
    )


def _flat_matmul(x: jax.Array, kernel: jax.Array, k: int, matmul) -> jax.Array:
    """The last k axes of x contracted with the first k of the kernel, both flattened
    into one contracted axis."""
    lead_shape = x.shape[: x.ndim - k]
    out = matmul(x.reshape(*lead_shape, -1), kernel.reshape(math.prod(kernel.shape[:k]), -1))
    return out.reshape(*lead_shape, *kernel.shape[k:])


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one contraction is split: k contracted axes, the island's specs, and the
    mesh axes of the input's batch axis (None: replicated)."""

    k: int
    lhs_spec: P
    rhs_spec: P
    out_spec: P
    batch: Any


@dataclasses.dataclass(frozen=True)
class GatheredInput:
    """A column layer's input gathered once over the tensor axis (`ParallelDotGeneral.gather_input`),
    for several column matmuls called one by one.

    Attributes:
      stacked: global array (axis size, *input shape): each rank's whole copy, the
        leading axis split over `axis_name`, the next over `batch`.
      axis_name, layout: the layer's that gathered it.
      batch: mesh axes splitting the input's batch axis (None: replicated).
    """

    stacked: jax.Array
    axis_name: str
    layout: str
    batch: Any

    @property
    def shape(self) -> tuple[int, ...]:
        """The input's global shape."""
        return tuple(self.stacked.shape[1:])


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
        with the feature layout or `message_rows` a permutation applies to the
        positions of the messages' rows).
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
      message_rows: send every message as a rank's block cut into rows of the codec's
        group size (`message_row_length`), whatever the features' width; the feature
        layout always does, so that feature shards narrower than a group (64 features
        against groups of 128) make whole groups rather than padded ones. Not with
        `overlap`.
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
    message_rows: bool = False

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
        if self.overlap and (self.layout == "feature" or self.message_rows):
            raise ValueError("overlap=True runs with layout 'replicated' or 'sequence', not 'feature' or message_rows")
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
        lhs: jax.Array | GatheredInput,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """The contraction of the last k axes of `lhs` with the first k of `rhs`.

        `lhs` may be a column layer's `GatheredInput` (`gather_input`): the matmul then
        reads that gather instead of sending its own.

        Raises:
          ValueError: as `check_shapes`.
        """
        if isinstance(lhs, GatheredInput):
            return self._column_of_gathered(lhs, rhs, dimension_numbers, precision, preferred_element_type)
        if self.kind == "column":
            return self.column_many(lhs, (rhs,), dimension_numbers, precision, preferred_element_type)[0]
        plan = self._plan(tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs)), dimension_numbers)
        matmul = _matmul(precision, preferred_element_type)
        body = lambda x, w: self._row(x, self._whole_kernel(w, collectives.varying_axes(x)), plan.k, matmul)
        return self._island(body, (plan.lhs_spec, plan.rhs_spec), plan.out_spec, lhs, rhs)

    def column_many(
        self,
        lhs: jax.Array,
        kernels: tuple[jax.Array, ...],
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> tuple[jax.Array, ...]:
        """Column-parallel matmuls of one input with several kernels (e.g. the key and
        value projections, or a gated MLP's two input projections) sending one gather
        (`tp.gather_matmul` / `tp.copy_matmul`): their input gradients are summed before
        the one compressed reduction back.

        Args:
          lhs: the input, laid out as `layout` says.
          kernels: global kernels of equal contracting shape, each partitioned as this
            layer's `kernel_spec` (or split over `axis_name` on `sharded_dim`).
          dimension_numbers: flax `DenseGeneral`'s (the same for every kernel).
          precision: as `lax.dot_general`'s.
          preferred_element_type: as `lax.dot_general`'s.

        Returns:
          One output per kernel, split over `axis_name` on the kernel's sharded axis.

        Raises:
          ValueError: a row layer, no kernel, or as `check_shapes` for a kernel.
        """
        if self.kind != "column" or not kernels:
            raise ValueError(
                f"column_many runs a column layer's matmuls on one or more kernels, got a {self.kind} "
                f"layer and {len(kernels)} kernels"
            )
        lhs_shape = tuple(jnp.shape(lhs))
        plans = [self._plan(lhs_shape, tuple(jnp.shape(w)), dimension_numbers) for w in kernels]
        matmul = _matmul(precision, preferred_element_type)

        def body(x: jax.Array, *shards: jax.Array) -> tuple[jax.Array, ...]:
            whole = [self._whole_kernel(w, collectives.varying_axes(x)) for w in shards]
            return self._column(x, whole, plans[0].k, matmul)

        in_specs = (plans[0].lhs_spec, *(p.rhs_spec for p in plans))
        return self._island(body, in_specs, tuple(p.out_spec for p in plans), lhs, *kernels)

    def gather_input(self, lhs: jax.Array, contracting: int = 1) -> GatheredInput:
        """A column layer's input gathered once, for several matmuls called one by one
        (a framework that calls its dot_general per kernel, as MaxText does for the key
        and value projections): pass the result as `lhs` to this layer, or to another
        column layer of the same mesh, axis, layout and batch axes. The matmuls' input
        gradients are summed before the one compressed reduction back.

        Args:
          lhs: the input, laid out as `layout` says.
          contracting: how many trailing axes of `lhs` the matmuls contract.

        Raises:
          ValueError: a row layer, or an input the layout cannot split
            (`check_shapes`).
        """
        lhs_shape = tuple(jnp.shape(lhs))
        if self.kind != "column" or not 1 <= contracting <= len(lhs_shape):
            raise ValueError(
                f"gather_input gathers a column layer's input over its {contracting} contracted axes, "
                f"got a {self.kind} layer and an input of shape {lhs_shape}"
            )
        lead = len(lhs_shape) - contracting
        batch = self._batch_spec(lhs_shape, lead)
        lhs_spec = self._input_spec(lhs_shape, lead, batch)
        self._check_splits("input", lhs_shape, lhs_spec)
        self._check_rows(lhs_shape, lhs_spec)
        stacked_spec = _spec(len(lhs_shape) + 1, {0: self.axis_name, **{d + 1: a for d, a in batch.items()}})
        stacked = self._island(lambda x: self._enter(x, lead)[None], (lhs_spec,), stacked_spec, lhs)
        return GatheredInput(stacked, self.axis_name, self.layout, batch.get(0))

    def check_shapes(self, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dimension_numbers: Any) -> None:
        """Check, before anything is traced, that this layer can run the contraction.

        Raises:
          ValueError: other dimension numbers; a `sharded_dim` that is not an output
            (column) or contracting (row) axis of the kernel; an input without the
            sequence axis the layout needs, or without a batch axis for `batch_axes`;
            an axis that does not split over the mesh axes named for it; with the
            feature layout, a shard that does not cut into rows of the codec's group
            size (`message_row_length`).
        """
        self._plan(tuple(lhs_shape), tuple(rhs_shape), dimension_numbers)

    def _plan(self, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dimension_numbers: Any) -> _Plan:
        k = _contracted_count(lhs_shape, rhs_shape, dimension_numbers)
        lead = len(lhs_shape) - k
        out_shape = lhs_shape[:lead] + rhs_shape[k:]
        sharded = self._kernel_dim(rhs_shape, k)
        batch = self._batch_spec(lhs_shape, lead)
        axis = self.axis_name
        if self.kind == "column":
            lhs_spec = self._input_spec(lhs_shape, lead, batch)
            out_spec = _spec(len(out_shape), {**batch, lead + sharded - k: axis})
        else:
            moved = {lead - 1: axis} if self.layout == "sequence" else {}
            moved = {len(out_shape) - 1: axis} if self.layout == "feature" else moved
            lhs_spec = _spec(len(lhs_shape), {**batch, lead + sharded: axis})
            out_spec = _spec(len(out_shape), {**batch, **moved})
        rhs_spec = (
            _spec(len(rhs_shape), {sharded: axis})
            if self.kernel_spec is None
            else P(*(e or None for e in self.kernel_spec))
        )
        for name, shape, spec in (("input", lhs_shape, lhs_spec), ("kernel", rhs_shape, rhs_spec)):
            self._check_splits(name, shape, spec)
        self._check_splits("output", out_shape, out_spec)
        self._check_rows(*((lhs_shape, lhs_spec) if self.kind == "column" else (out_shape, out_spec)))
        return _Plan(k, lhs_spec, rhs_spec, out_spec, batch.get(0))

    def _input_spec(self, lhs_shape: tuple[int, ...], lead: int, batch: dict[int, Any]) -> P:
        """A column layer's input as the layout has it: split on the sequence (the axis
        before the contracted ones) or the last (feature) axis."""
        if self.layout == "sequence" and lead < 1:
            raise ValueError(
                f"layout 'sequence' needs an input (..., sequence, *contracted), got shape {lhs_shape} "
                f"contracting {len(lhs_shape) - lead} axes"
            )
        moved = {"sequence": {lead - 1: self.axis_name}, "feature": {len(lhs_shape) - 1: self.axis_name}}
        return _spec(len(lhs_shape), {**batch, **moved.get(self.layout, {})})

    def _check_rows(self, shape: tuple[int, ...], spec: P) -> None:
        """Messages sent as rows (the feature layout, `message_rows`) are a rank's block
        cut into rows of the codec's group size: the block must cut into whole rows."""
        if not self._sends_rows():
            return
        ways = math.prod(math.prod(self.mesh.shape[a] for a in _entry_axes(e)) for e in spec)
        elements, row = math.prod(shape) // ways, message_row_length(self.config)
        if elements % row:
            raise ValueError(
                f"ParallelDotGeneral ({self.kind}, layout {self.layout!r}) sends each rank's block as rows of the "
                f"codec's group size {row}: the block of {elements} elements of the {shape} activation does not "
                "cut into them"
            )

    def _island(self, body, in_specs: tuple, out_specs: Any, *args: jax.Array) -> Any:
        """`body` on each device's blocks (the whole mesh manual), warning once when a
        message went uncompressed for its size."""
        island = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
        with record_wire() as ledger:
            out = island(*args)
        small = [r for r in ledger.records if r.reason.startswith("under min_bytes")]
        if small:
            _warn_under_min_bytes(small[0])
        return out

    def _column_of_gathered(self, gathered, rhs, dimension_numbers, precision, preferred_element_type) -> jax.Array:
        plan = self._plan(gathered.shape, tuple(jnp.shape(rhs)), dimension_numbers)
        source = (gathered.axis_name, gathered.layout, gathered.batch)
        if self.kind != "column" or source != (self.axis_name, self.layout, plan.batch):
            raise ValueError(
                f"a GatheredInput of axis, layout and batch axes {source} cannot feed a {self.kind} layer of "
                f"{(self.axis_name, self.layout, plan.batch)}"
            )
        matmul = _matmul(precision, preferred_element_type)
        stacked_spec = _spec(len(gathered.shape) + 1, {0: self.axis_name, 1: gathered.batch})

        def body(stacked: jax.Array, w: jax.Array) -> jax.Array:
            kernel = self._whole_kernel(w, collectives.varying_axes(stacked))
            return _flat_matmul(stacked[0], kernel, plan.k, matmul)

        return self._island(body, (stacked_spec, plan.rhs_spec), plan.out_spec, gathered.stacked, rhs)

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

    def _sends_rows(self) -> bool:
        return self.layout == "feature" or self.message_rows

    def _column(self, x: jax.Array, kernels: list[jax.Array], k: int, matmul) -> tuple[jax.Array, ...]:
        """The column-parallel matmuls on this rank's blocks, one gather for all kernels:
        the contracted axes flattened."""
        weights = tuple(w.reshape(math.prod(w.shape[:k]), -1) for w in kernels)
        if self._sends_rows():
            x = self._enter(x, x.ndim - k)
        flat = x.reshape(*x.shape[: x.ndim - k], weights[0].shape[0])
        outs = self._column_2d(flat, weights, matmul)
        return tuple(out.reshape(*out.shape[:-1], *w.shape[k:]) for out, w in zip(outs, kernels, strict=True))

    def _column_2d(self, x: jax.Array, weights: tuple[jax.Array, ...], matmul) -> tuple[jax.Array, ...]:
        axis_name, config, site, calibration = self.axis_name, self.config, self.site, self.calibration
        if self._sends_rows():  # x is whole already
            return tuple(matmul(x, w) for w in weights)
        if self.layout == "sequence":
            return tp.gather_matmul(
                x, weights, axis_name, config, axis=x.ndim - 2, site=site, calibration=calibration, overlap=self.overlap
            )
        if self.overlap:
            return tp.copy_matmul(x, weights, axis_name, config, site=site, calibration=calibration, overlap=True)
        copied = tp.copy_to_tp(x, axis_name, config, site=site, calibration=calibration)
        return tuple(matmul(copied, w) for w in weights)

    def _moved_axis(self, ndim: int, lead: int) -> int | None:
        """The axis the layout splits outside the pair: the last (feature) one, the
        sequence one (before the contracted axes; `lead` axes precede them), or None."""
        return {"feature": ndim - 1, "sequence": lead - 1}.get(self.layout)

    def _enter(self, x: jax.Array, lead: int) -> jax.Array:
        """This rank's input block, whole over the tensor axis."""
        moved = self._moved_axis(x.ndim, lead)
        if self._sends_rows():
            return self._as_rows(x, tp.copy_to_tp) if moved is None else self._gather_rows(x, moved)
        if moved is not None:
            return tp.gather_from_sp(
                x, self.axis_name, self.config, axis=moved, site=self.site, calibration=self.calibration
            )
        return tp.copy_to_tp(x, self.axis_name, self.config, site=self.site, calibration=self.calibration)

    def _as_rows(self, x: jax.Array, collective) -> jax.Array:
        """`collective` (`tp.copy_to_tp` or `tp.reduce_from_tp`) on x cut into rows of the
        codec's group size."""
        rows = x.reshape(-1, message_row_length(self.config))
        return collective(rows, self.axis_name, self.config, site=self.site, calibration=self.calibration).reshape(
            x.shape
        )

    def _gather_rows(self, shard: jax.Array, axis: int) -> jax.Array:
        """Compressed all-gather of the shards along `axis`, each sent as rows of the
        codec's group size (`message_row_length`): a shard narrower than a group (e.g.
        64 features against groups of 128) makes whole groups, not padded ones."""
        rows = shard.reshape(-1, message_row_length(self.config))
        rows = tp.gather_from_sp(
            rows, self.axis_name, self.config, axis=0, site=self.site, calibration=self.calibration
        )
        blocks = jnp.moveaxis(rows.reshape(-1, *shard.shape), 0, axis)
        return blocks.reshape(*shard.shape[:axis], -1, *shard.shape[axis + 1 :])

    def _reduce_scatter_rows(self, partial: jax.Array, axis: int) -> jax.Array:
        """Compressed reduce-scatter of the partial sums along `axis`, each rank's block
        sent as rows of the codec's group size (`_gather_rows`' transpose)."""
        ranks = self.mesh.shape[self.axis_name]
        split = partial.reshape(*partial.shape[:axis], ranks, -1, *partial.shape[axis + 1 :])
        blocks = jnp.moveaxis(split, axis, 0)
        rows = blocks.reshape(-1, message_row_length(self.config))
        rows = tp.reduce_scatter_to_sp(
            rows, self.axis_name, self.config, axis=0, site=self.site, calibration=self.calibration
        )
        return rows.reshape(blocks.shape[1:])

    def _row(self, x: jax.Array, kernel: jax.Array, k: int, matmul) -> jax.Array:
        """The row-parallel matmul on this rank's blocks: the contracted axes flattened."""
        if self._sends_rows():
            partial = _flat_matmul(x, kernel, k, matmul)
            moved = self._moved_axis(partial.ndim, x.ndim - k)
            if moved is None:
                return self._as_rows(partial, tp.reduce_from_tp)
            return self._reduce_scatter_rows(partial, moved)
        lead_shape = x.shape[: x.ndim - k]
        flat = x.reshape(*lead_shape, -1)
        out = self._row_2d(flat, kernel.reshape(flat.shape[-1], -1), matmul)
        return out.reshape(*out.shape[:-1], *kernel.shape[k:])

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


__all__ = ["KINDS", "LAYOUTS", "GatheredInput", "ParallelDotGeneral", "message_row_length"]
