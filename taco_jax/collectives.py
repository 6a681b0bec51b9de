"""Compressed tensor-parallel collectives for use inside `jax.shard_map`: each call's
plan, and the collectives built on it.

Each collective has the result of its `jax.lax` counterpart within codec error, and the
same gradient under both shard_map conventions: with `check_vma=True` (JAX's default)
the result types follow lax's (all_reduce's result is invariant over the axis, its
transpose a `pcast` to varying, no communication); with `check_vma=False` all_reduce
transposes to an all-reduce, as `lax.psum` does there.

Every collective, compressed or plain, is one `Call`: `plan_message` decides how its
message travels (`taco_jax.policy`: compressed or not, the all-reduce algorithm,
pipelined chunks), reports it to an active calibration observer and applies the site's
calibration (transform decision, channel permutation), giving a `message.WirePlan`, or
None for the plain collective. The `message.Transfer` it yields compresses, moves and
counts (`taco_jax.message`: compress kernel -> wire buffer -> collective -> decode
kernel); a collective here only decides how the buffer moves: gathered, exchanged
block by block, permuted.

The `run_*` functions are one direction of a collective as traced, without a gradient
rule (the tensor-parallel mappings in `taco_jax.tp` compose them); the public
`all_gather`, `reduce_scatter`, `all_reduce` and `ppermute` add the straight-through rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import accounting, policy
from taco_jax import calibration as calibration_lib
from taco_jax.accounting import Collective, Op, TraceScope, record_collective
from taco_jax.calibration import Calibration
from taco_jax.kernels.jax_compat import checks_vma, transposing_whole_shard_map
from taco_jax.message import (
    Gathered,
    Message,
    Transfer,
    WirePlan,
    codec_choice,
    concatenated,
    rank_blocks,
    to_rows,
)
from taco_jax.policy import QuantSpec, TacoConfig

# ----------------------------------------------------------------------------- one call, one plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
    """One collective call's fixed arguments (hashable: a static argument of the
    collectives' gradient rules).

    Attributes:
      axis_name: the mesh axis the collective runs over.
      config: the `TacoConfig` (forward messages use `config.forward`, backward ones
        `config.backward`).
      site: call-site name for wire-byte accounting and calibration; None names the
        site after the op ("all_gather", ...).
      calibration: per-site channel permutations and transform decisions; None = the
        identity and the config's transform.
      repeats: times the call runs per call of the traced function: the trip counts of
        the loops around it where it is made (`accounting.repeated`), which its
        backward messages keep when JAX traces them later, outside those loops.

    Raises:
      ValueError: `config` is not a `TacoConfig`, or `calibration` not a `Calibration`.
    """

    axis_name: str
    config: TacoConfig
    site: str | None = None
    calibration: Calibration | None = None
    repeats: int = dataclasses.field(default_factory=accounting.current_repeats)

    def __post_init__(self) -> None:
        check_config(self.config, self.calibration)

    def site_of(self, op: Op | str) -> str:
        """The name `op`'s messages are calibrated under (the ledger's: `Collective.name`)."""
        return self.site or Op(op).value

    def spec(self, direction: str) -> QuantSpec:
        """The quantizer of `direction`'s messages ("forward" or "backward")."""
        return self.config.spec(direction)

    @contextlib.contextmanager
    def transfer(
        self,
        x: jax.Array | jax.ShapeDtypeStruct,
        op: Op,
        direction: str,
        *,
        algorithm: str = "auto",
        moves_channels: bool = False,
        report: bool = True,
        pipelined: bool = True,
    ) -> Iterator[Transfer]:
        """The call's collective `op` of the per-rank message `x`, planned
        (`plan_message`, which takes the keywords) and run inside the block: the block
        moves the message through `Transfer.move` and `Transfer.send`, and on leaving
        it the collective is entered in the wire ledger with the bytes those moves sent
        (not when the block raises).

        `op` is the op entered in the ledger; an all-reduce is planned as `Op.ALL_REDUCE`
        (`Op.routed`), and a planned one is entered under its algorithm's name.

        Yields:
          The `Transfer`.
        """
        plan = plan_message(
            x,
            self,
            op=op.routed,
            direction=direction,
            algorithm=algorithm,
            moves_channels=moves_channels,
            report=report,
            pipelined=pipelined,
        )
        collective = Collective.traced(x, op, self.axis_name, direction=direction, site=self.site)
        transfer = Transfer(
            collective if plan is None else collective.under(plan.algorithm),
            plan,
            plan.spec.text if plan is not None else policy.plain_reason(x, self.config),
        )
        yield transfer
        record_collective(
            transfer.collective,
            reason=transfer.reason,
            compressed=plan is not None,
            sent_bytes=transfer.sent_bytes,
            repeats=self.repeats,
        )


def check_config(config: TacoConfig, calibration: Calibration | None = None) -> None:
    """Raise ValueError unless `config` is a `TacoConfig` and `calibration` None or a
    `Calibration`."""
    if not isinstance(config, TacoConfig):
        raise ValueError(f"config must be a TacoConfig, got {type(config).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a taco_jax.calibration.Calibration, got {type(calibration).__name__}")


def planned_spec(
    config: TacoConfig, direction: str, calibration: Calibration | None, site: str, channels: int
) -> tuple[QuantSpec, calibration_lib.ChannelPlan | None]:
    """The quantizer of `direction`'s messages at `site` and the site's permutation plan
    (None when it has none or it is the identity).

    The mode and the config decide what a message may be sent as; a calibration only
    refines within that: in mode "taco" it sets the site's permutation and transform,
    and its format only where `config.fewer_bits` lists it. Other modes take no
    calibration ("fp8" is the no-transform, no-reshaping baseline).

    Raises:
      ValueError: the plan permutes another number of channels than `channels`, or
        gives the site a format the config does not allow.
    """
    spec = config.spec(direction)
    plan = calibration.plan(site, direction) if calibration is not None and config.mode == "taco" else None
    if plan is None:
        return spec, None
    if len(plan.perm) != channels:
        raise ValueError(
            f"calibration of site {site!r} permutes {len(plan.perm)} channels, but the message has {channels}"
        )
    conflict = calibration_lib.format_conflict(plan, config)
    if conflict is not None:
        raise ValueError(f"calibration of site {site!r} ({direction}) gives {conflict}")
    return plan.spec(spec), None if plan.is_identity else plan


def plan_message(
    x: jax.Array | jax.ShapeDtypeStruct,
    call: Call,
    *,
    op: Op | str,
    direction: str,
    algorithm: str = "auto",
    moves_channels: bool = False,
    report: bool = True,
    pipelined: bool = True,
) -> WirePlan | None:
    """How `x` travels in `op` (`taco_jax.policy`): None for the plain collective, else
    its `WirePlan`. A compressed message is reported to an active calibration collector.

    Args:
      x: the message, channels on its last axis.
      call: the call it belongs to.
      op: the `Op` the policy routes: all-gather, reduce-scatter, all-reduce or ppermute.
      direction: "forward" or "backward".
      algorithm: the caller's all-reduce algorithm ("auto": the policy's choice).
      moves_channels: the op gathers or scatters along the channel axis.
      report: report `x` to an active calibration collector (False: the caller reports
        the pieces it compresses, or none are calibrated; `x` may then be a
        ShapeDtypeStruct).
      pipelined: the message may go in chunks (False: one message, as point-to-point
        sends and the gradient bucket go).

    Raises:
      ValueError: a channel permutation on a site whose op moves the channel axis, or
        one of the wrong length.
    """
    route = policy.route_for(
        op,
        lax.axis_size(call.axis_name),
        x.size * x.dtype.itemsize,
        link=call.config.link,
        chunks=call.config.chunks,
        algorithm=algorithm,
        compresses=policy.compressible(x, call.config),
    )
    if not route.compressed:
        return None
    site = call.site_of(op)
    if report:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise ValueError("plan_message reports the message's values: pass the array, or report=False")
        accounting.observe(x, site, direction)
    spec, permutation = planned_spec(call.config, direction, call.calibration, site, x.shape[-1])
    spec.check_channels(x.shape[-1], site)
    if permutation is not None and moves_channels:
        raise ValueError(
            f"site {site!r} has a channel permutation, so it cannot gather or scatter along "
            f"the last (channel) axis of shape {x.shape}"
        )
    codec = codec_choice(spec, x.dtype, call.config.kernel_mode, shards=lax.axis_size(call.axis_name))
    return WirePlan(spec, route.chunks if pipelined else 1, route.algorithm, permutation, codec)


# ----------------------------------------------------------------------------- rematerialization


# ----------------------------------------------------------------------------- layout


def check_axis(axis: int, ndim: int, what: str) -> int:
    """`axis` normalized for an array of rank `ndim`; ValueError naming `what` if out of
    range (always for a scalar, which has no axis)."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis} is out of range for an array of rank {ndim}")
    return axis % ndim


# ----------------------------------------------------------------------------- ledger


def record_plain_all_reduce(
    x: jax.Array, axis_name: str, *, site: str, direction: str = "forward", reason: str = "a plain lax reduction"
) -> None:
    """Record an uncompressed all-reduce (psum, pmean, pmax) of `x` over `axis_name` done
    with `jax.lax` directly, with the `reason` it goes uncompressed."""
    collective = Collective.traced(x, Op.ALL_REDUCE, axis_name, direction=direction, site=site)
    record_collective(collective, reason=reason)


# ----------------------------------------------------------------------------- varying manual axes
# `checks_vma` (public API) lives in `taco_jax.kernels.jax_compat`, beside the detection
# of a gradient taken outside a shard_map, which has no public form.


def refuse_gradient_outside(mapping: str, axis_name: str) -> None:
    """In a gradient rule: raise if a check_vma=False shard_map is being differentiated
    from outside (JAX's transpose would scale the gradients of `mapping`'s inputs)."""
    if not checks_vma(axis_name) and transposing_whole_shard_map():
        raise ValueError(
            f"taco_jax.tp.{mapping} inside jax.shard_map(check_vma=False) is differentiated from outside the "
            "shard_map: JAX would scale the weight gradients by 1/axis size. Take the gradient inside the "
            "shard_map body (Megatron's convention), or use check_vma=True (JAX's default), which is correct "
            "either way."
        )


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes `x` varies over (empty under `check_vma=False`)."""
    return frozenset(jax.typeof(x).mat.varying)


def vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` marked as varying over `axes` where `check_vma` tracks it (`lax.pcast`; its
    transpose sums over the axes the mark added, as JAX's implicit casts do)."""
    missing = tuple(a for a in axes if checks_vma(a) and a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def gather_stacked(x: jax.Array, axis_name: str) -> jax.Array:
    """`lax.all_gather(x, axis_name, axis=0, tiled=False)`; over one rank its own x, since
    XLA:GPU runs a one-participant collective as a copy of the buffer."""
    return x[None] if lax.axis_size(axis_name) == 1 else lax.all_gather(x, axis_name, axis=0, tiled=False)


def gather_invariant(x: jax.Array, axis_name: str) -> jax.Array:
    """Stacked all-gather whose result is invariant over `axis_name` (every rank holds
    the same), as the last step of an all-reduce must be under `check_vma=True` (there
    only the collective makes x invariant, even over one rank)."""
    if checks_vma(axis_name):
        return lax.all_gather(x, axis_name, axis=0, tiled=False, to="invarying")
    return gather_stacked(x, axis_name)


def exchange_blocks(x: jax.Array, axis_name: str) -> jax.Array:
    """`lax.all_to_all` of x's leading blocks (tiled): rank r receives block r of every
    rank; over one rank x itself (no copy, as `gather_stacked`)."""
    if lax.axis_size(axis_name) == 1:
        return x
    return lax.all_to_all(per_rank(x, axis_name), axis_name, 0, 0, tiled=True)


def per_rank(x: jax.Array, axis_name: str) -> jax.Array:
    """`x` as a value held per rank of a `vmap` axis (a simulated mesh). A value equal on
    every rank, such as the cotangent of an all-gather's result, is unbatched there, and
    jax's all_to_all and ppermute batching rules mangle an unbatched operand (seen: an
    all_to_all of (4, 17, 128) giving (4, 17, 128, 4, 17, 128)). Inside shard_map every
    value is per device already: x itself."""
    if axis_name in jax.sharding.get_abstract_mesh().manual_axes:
        return x
    return x + (lax.axis_index(axis_name) * 0).astype(x.dtype)


# ----------------------------------------------------------------------------- all-gather


def run_all_gather(
    x: jax.Array, call: Call, *, direction: str, axis: int = 0, tiled: bool = True
) -> tuple[jax.Array, Gathered]:
    """One direction of `all_gather` (no gradient rule): the gathered array and what a
    backward pass keeps of it.

    Raises:
      ValueError: `axis` out of range.
    """
    axis = check_axis(axis, x.ndim if tiled else x.ndim + 1, "axis")
    with call.transfer(x, Op.ALL_GATHER, direction) as transfer:
        plan = transfer.plan
        if plan is None:
            gather = functools.partial(lax.all_gather, axis_name=call.axis_name, axis=axis, tiled=tiled)
            parts: tuple[Any, ...] = (_plain(transfer, x, gather, _gathered_shape(x, call.axis_name, axis, tiled)),)
        else:
            rows, gather = plan.rows(x), functools.partial(gather_stacked, axis_name=call.axis_name)
            parts = tuple(
                transfer.send(rows[a:b], x.dtype, Op.ALL_GATHER, gather) for a, b in plan.chunk_bounds(rows.shape[0])
            )
    residual = Gathered(parts, plan, tuple(x.shape), axis, tiled, call.axis_name, by_shifts=False)
    return residual.value(), residual


def _gathered_shape(x: jax.Array, axis_name: str, axis: int, tiled: bool) -> tuple[int, ...]:
    shape = list(x.shape)
    if tiled:
        shape[axis] *= lax.axis_size(axis_name)
    else:
        shape.insert(axis, lax.axis_size(axis_name))
    return tuple(shape)


def _plain(transfer: Transfer, x: jax.Array, run: Callable[[jax.Array], jax.Array], shape: tuple[int, ...]):
    """The plain collective `run` of `x` as a step of `transfer`; for an empty `x`, which
    XLA refuses to lower a collective of, an empty array of the result's `shape`, varying
    as lax's result."""
    if x.size:
        return transfer.move(transfer.collective.op, run)(x)
    axis_name = transfer.collective.axis_name
    return vary(jnp.zeros(shape, x.dtype), (axis_name, *varying_axes(x)))


# ----------------------------------------------------------------------------- reduce-scatter


def run_reduce_scatter(
    x: jax.Array, call: Call, *, direction: str, dimension: int = 0, tiled: bool = True
) -> jax.Array:
    """One direction of `reduce_scatter` over `dimension` (no gradient rule).

    Raises:
      ValueError: the dimension does not divide by (or equal) the axis size, or a
        channel permutation on a site that scatters along the channel axis.
    """
    ranks = lax.axis_size(call.axis_name)
    dim = check_axis(dimension, x.ndim, "scatter_dimension")
    size = x.shape[dim]
    if (tiled and size % ranks) or (not tiled and size != ranks):
        need = f"divisible by {ranks}" if tiled else f"equal to {ranks}"
        raise ValueError(f"scatter_dimension {dim} of shape {x.shape} has size {size}, must be {need} (axis size)")
    block_shape = (*x.shape[:dim], *((size // ranks,) if tiled else ()), *x.shape[dim + 1 :])
    with call.transfer(x, Op.REDUCE_SCATTER, direction, moves_channels=dim == x.ndim - 1) as transfer:
        plan = transfer.plan
        if plan is None:
            scatter = functools.partial(lax.psum_scatter, axis_name=call.axis_name, scatter_dimension=dim, tiled=tiled)
            return _plain(transfer, x, scatter, block_shape)
        moved = jnp.moveaxis(plan.to_wire_order(x), dim, 0)
        chunk_shape = (size // ranks, *moved.shape[1:]) if tiled else moved.shape[1:]
        rows = to_rows(moved.reshape(ranks, *chunk_shape), plan.spec.group_size, 1)
        exchange = functools.partial(exchange_blocks, axis_name=call.axis_name)
        pieces = [
            transfer.send(rows[:, a:b], x.dtype, Op.ALL_TO_ALL, exchange).sum()
            for a, b in plan.chunk_bounds(rows.shape[1])
        ]
    out = plan.array(concatenated(pieces, axis=0), chunk_shape)
    return jnp.moveaxis(out, 0, dim) if tiled else out


# ----------------------------------------------------------------------------- all-reduce


def run_all_reduce(x: jax.Array, call: Call, *, direction: str, algorithm: str = "auto") -> jax.Array:
    """One direction of `all_reduce` (no gradient rule)."""
    with call.transfer(x, Op.ALL_REDUCE, direction, algorithm=algorithm) as transfer:
        plan = transfer.plan
        if plan is None:
            return transfer.move(Op.ALL_REDUCE, functools.partial(lax.psum, axis_name=call.axis_name))(x)
        exchange = _one_shot if plan.algorithm == "one_shot" else _two_shot
        return plan.array(exchange(plan.rows(x), transfer, plan, x.dtype), x.shape)


def _one_shot(rows: jax.Array, transfer: Transfer, plan: WirePlan, dtype: Any) -> jax.Array:
    """All-gather every rank's messages, decode their sum: (n, G)."""
    gather = functools.partial(gather_invariant, axis_name=transfer.collective.axis_name)
    pieces = [transfer.send(rows[a:b], dtype, Op.ALL_GATHER, gather).sum() for a, b in plan.chunk_bounds(rows.shape[0])]
    return concatenated(pieces, axis=0)


def _two_shot(rows: jax.Array, transfer: Transfer, plan: WirePlan, dtype: Any) -> jax.Array:
    """Reduce-scatter, requantize the reduced block, all-gather it: the (n, G) sum."""
    axis_name = transfer.collective.axis_name
    blocks = rank_blocks(rows, lax.axis_size(axis_name))
    exchange = functools.partial(exchange_blocks, axis_name=axis_name)
    pieces = [
        second_shot(transfer.send(blocks[:, a:b], dtype, Op.ALL_TO_ALL, exchange), transfer)
        for a, b in plan.chunk_bounds(blocks.shape[1])
    ]
    out = concatenated(pieces, axis=1)
    return out.reshape(-1, plan.spec.group_size)[: rows.shape[0]]


def second_shot(received: Message, transfer: Transfer) -> jax.Array:
    """The second half of a two-shot all-reduce: the messages of this rank's block that
    every rank sent it (k, R, W), summed and requantized once, all-gathered invariant over
    the axis (a step of `transfer`) and decoded: every rank's reduced block, (k, n, G)."""
    gather = functools.partial(gather_invariant, axis_name=transfer.collective.axis_name)
    return received.requantize().moved(transfer.move(Op.ALL_GATHER, gather)).decode()


# ----------------------------------------------------------------------------- ppermute


def run_ppermute(x: jax.Array, call: Call, *, direction: str, pairs: tuple[tuple[int, int], ...]) -> jax.Array:
    """One direction of `ppermute` (no gradient rule), compressed where the plan says so
    (one message: point-to-point sends are not pipelined, and not calibrated)."""
    permute = lambda v: lax.ppermute(per_rank(v, call.axis_name), call.axis_name, pairs)
    with call.transfer(x, Op.PPERMUTE, direction, report=False, pipelined=False) as transfer:
        if transfer.plan is None:
            return transfer.move(Op.PPERMUTE, permute)(x)
        arrived = transfer.send(transfer.plan.rows(x), x.dtype, Op.PPERMUTE, permute)
    return transfer.plan.array(arrived.decode(), x.shape)


# ----------------------------------------------------------------------------- differentiable API


# True while a differentiable op is being called (not re-traced by JAX later).
_CALLING = TraceScope("differentiable op called", False)


@contextlib.contextmanager
def forward_recording() -> Iterator[None]:
    """Around the forward body of a `custom_vjp` op: its messages are recorded in the
    wire ledger only while the op is being called (`called`). JAX may trace the
    forward rule once more later (differentiating a scan traces its body's primal and
    then its forward rule), and that second trace sends nothing more."""
    with contextlib.nullcontext() if _CALLING.get() else accounting.paused():
        yield


def called(op: Callable[..., Any], *args: Any) -> Any:
    """`op(*args)`, a `custom_vjp` op whose forward body is in `forward_recording`."""
    with _CALLING.set(True):
        return op(*args)


def straight_through(forward: Callable[..., jax.Array], backward: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A differentiable op `op(x, call, **options)` = `forward(x, call, **options)` whose
    cotangent is `backward(cotangent, call, **options)`: an explicit rule, so autodiff
    never differentiates the quantizer. `options` are hashable non-array keywords. The
    forward messages are recorded once (`forward_recording`)."""

    def counted_forward(x, call, options):
        with forward_recording():
            return forward(x, call, **dict(options))

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def op(x, call, options):
        return counted_forward(x, call, options)

    op.defvjp(
        lambda x, call, options: (counted_forward(x, call, options), None),
        lambda call, options, _, ct: (backward(ct, call, **dict(options)),),
    )

    def apply(x: jax.Array, call: Call, **options: Any) -> jax.Array:
        return called(op, x, call, tuple(sorted(options.items())))

    return apply


def _all_reduce_transpose(cotangent: jax.Array, call: Call, *, algorithm: str) -> jax.Array:
    if checks_vma(call.axis_name):  # the transpose of an invariant sum is a broadcast (lax.psum's too)
        return vary(cotangent, (call.axis_name,))
    return run_all_reduce(cotangent, call, direction="backward", algorithm=algorithm)


_all_gather = straight_through(
    lambda x, call, axis, tiled: run_all_gather(x, call, direction="forward", axis=axis, tiled=tiled)[0],
    lambda ct, call, axis, tiled: run_reduce_scatter(ct, call, direction="backward", dimension=axis, tiled=tiled),
)
_reduce_scatter = straight_through(
    lambda x, call, dimension, tiled: run_reduce_scatter(
        x, call, direction="forward", dimension=dimension, tiled=tiled
    ),
    lambda ct, call, dimension, tiled: run_all_gather(ct, call, direction="backward", axis=dimension, tiled=tiled)[0],
)
_all_reduce = straight_through(
    lambda x, call, algorithm: run_all_reduce(x, call, direction="forward", algorithm=algorithm),
    _all_reduce_transpose,
)
_ppermute = straight_through(
    lambda x, call, pairs: run_ppermute(x, call, direction="forward", pairs=pairs),
    lambda ct, call, pairs: run_ppermute(ct, call, direction="backward", pairs=tuple((dst, src) for src, dst in pairs)),
)


def all_gather(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    axis: int = 0,
    tiled: bool = True,
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
    """Compressed `lax.all_gather` over `axis_name` (inside `shard_map`).

    Args:
      x: this rank's shard, any shape and float dtype.
      axis_name: the mesh axis, e.g. "tensor".
      config: `TacoConfig`; `config.forward` compresses the gather, and the backward pass
        is a compressed reduce-scatter with `config.backward`. Mode "off" or a message
        under `config.min_bytes` uses the plain collective.
      axis: where the gathered axis goes (as in `lax.all_gather`).
      tiled: concatenate along `axis` instead of stacking a new axis.
      site: call-site name for wire-byte accounting (`taco_jax.record_wire`) and
        calibration.
      calibration: per-site channel permutations and transform decisions
        (`taco_jax.calibration`); None = identity and the config's transform.

    Returns:
      The gathered array, shape and dtype as `lax.all_gather` gives.

    Raises:
      ValueError: bad axis, config or calibration (a permutation of the wrong length).
    """
    call = Call(axis_name=axis_name, config=config, site=site, calibration=calibration)
    return _all_gather(vary(x, (axis_name,)), call, axis=axis, tiled=tiled)


def reduce_scatter(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    scatter_dimension: int = 0,
    tiled: bool = True,
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
    """Compressed `lax.psum_scatter`: sum over `axis_name`, each rank keeps its block.

    Chunks are compressed, exchanged with one all-to-all, dequantized and summed in
    float32. The backward pass is a compressed all-gather with `config.backward`.

    Args:
      x: this rank's full-size contribution.
      axis_name: the mesh axis.
      config: `TacoConfig` (see `all_gather`).
      scatter_dimension: the dimension split over the ranks.
      tiled: keep the dimension (size / ranks) instead of removing it (size == ranks).
      site: call-site name for wire-byte accounting and calibration.
      calibration: see `all_gather`.

    Returns:
      This rank's block of the sum, shape and dtype as `lax.psum_scatter` gives.

    Raises:
      ValueError: the scattered dimension does not divide by (or equal) the axis size,
        or a channel permutation on a site that scatters along the channel axis.
    """
    call = Call(axis_name=axis_name, config=config, site=site, calibration=calibration)
    return _reduce_scatter(vary(x, (axis_name,)), call, dimension=scatter_dimension, tiled=tiled)


def all_reduce(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    algorithm: str = "auto",
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
    """Compressed `lax.psum` over `axis_name`.

    "two_shot": compressed reduce-scatter (sum in float32 in the transformed domain),
    requantize the reduced block once, compressed all-gather, one inverse transform.
    "one_shot": compressed all-gather of everything, dequantize-and-sum (small messages).
    "auto": the config's link profile decides (`TacoConfig.link`); without one,
    `policy.default_algorithm` (one-shot at two ranks; beyond, on GPUs one-shot under
    `policy.ONE_SHOT_MAX_BYTES` per rank, elsewhere two-shot, which sends fewer bytes). An explicit algorithm is used wherever the message is compressed. Gradient
    as `lax.psum`'s: under `check_vma=True` the result is invariant over the axis and
    the cotangent goes back to every rank unchanged; under `check_vma=False` the
    backward pass all-reduces the cotangent the same way with `config.backward`.

    Args:
      x: this rank's contribution, any shape.
      axis_name: the mesh axis.
      config: `TacoConfig` (see `all_gather`).
      algorithm: "auto", "one_shot" or "two_shot".
      site: call-site name for wire-byte accounting and calibration.
      calibration: see `all_gather`.

    Returns:
      The sum, same shape and dtype as `x`.

    Raises:
      ValueError: unknown algorithm, bad config or calibration.

    Examples:
      Inside `jax.shard_map` (or a named `jax.vmap`) over the axis:

      >>> import jax, numpy as np, taco_jax as tj
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh, config = tj.make_mesh(data=2, tensor=4), tj.TacoConfig.preset("taco+", min_bytes=0)
      >>> summed = jax.jit(jax.shard_map(
      ...     lambda x: tj.all_reduce(x, "tensor", config), mesh=mesh, in_specs=P("tensor"), out_specs=P()))
      >>> x = jax.random.normal(jax.random.key(0), (4, 64, 256))
      >>> error = np.linalg.norm(summed(x)[0] - x.sum(0)) / np.linalg.norm(x.sum(0))
      >>> bool(0.001 < error < 0.02)
      True
    """
    call = Call(axis_name=axis_name, config=config, site=site, calibration=calibration)
    policy.check_algorithm(algorithm)
    return _all_reduce(vary(x, (axis_name,)), call, algorithm=algorithm)


def ppermute(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    perm: Any,
    site: str | None = None,
) -> jax.Array:
    """Compressed `lax.ppermute`: each (source, destination) pair of `perm` sends the
    source's `x` to the destination; ranks that receive nothing get zeros.

    The message is compressed with `config.forward` (and the cotangent, sent back along
    the reversed pairs, with `config.backward`) where `config` compresses a message of
    its size; e.g. the activations a pipeline stage hands to the next one.

    Args:
      x: this rank's array, any shape and float dtype.
      axis_name: the mesh axis, e.g. "pipe".
      config: `TacoConfig`.
      perm: (source, destination) index pairs along the axis, each source and each
        destination at most once.
      site: name for wire-byte accounting (`taco_jax.record_wire`).

    Returns:
      What this rank received, shape and dtype of `x`.

    Raises:
      ValueError: bad config, or a rank appearing twice as source or destination.
    """
    call = Call(axis_name=axis_name, config=config, site=site)
    pairs = tuple((int(src), int(dst)) for src, dst in perm)
    for position, name in ((0, "source"), (1, "destination")):
        ranks = [pair[position] for pair in pairs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ppermute: a rank appears twice as a {name} in perm {pairs}")
    return _ppermute(vary(x, (axis_name,)), call, pairs=pairs)
