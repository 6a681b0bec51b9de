"""Collective matmuls: the sequence-parallel all-gather and reduce-scatter, and the
all-reduce without sequence parallelism, decomposed into one point-to-point message per peer, so that the matmul of a chunk already present
can run while the next chunk is on the wire (the decomposition of Wang et al., ASPLOS'23;
JAX's collective-matmul guide; PyTorch's async TP).

Over k ranks, rank r's chunk reaches rank r + s (mod k) by the collective-permute of
shift s, s = 1 .. k-1. The k-1 permutes depend on nothing but the sender's chunk, so
the compiler is free to run each beside the matmuls of the chunks already received.
Compressed, every chunk is one 8-bit wire message (the codec's, `taco_jax.collectives`
plans it as it plans the collective it replaces): the message is encoded once, moved
by the permutes, and decoded where it arrives; a reduce-scatter sums the k messages of
a chunk in float32 and transforms back once, as the all-to-all form does. The wire
bytes equal the collective's, and so does the ledger entry.

| function | forward | backward |
|---|---|---|
| `all_gather_matmul` | all-gather along the sequence, then x @ w for each weight | `matmul_reduce_scatter` of the cotangents (and the weight gradients from the gathered input, kept 8-bit) |
| `matmul_reduce_scatter` | x @ w, reduce-scattered along the sequence | `all_gather_matmul` of the cotangent |
| `matmul_all_reduce` | x @ w summed over the ranks (no sequence parallelism): the two-shot all-reduce whose reduce-scatter runs by shifts beside the matmuls of the row blocks | local matmuls |
| `copy_matmul` | x @ w for a replicated x | the input gradient's `matmul_all_reduce` |
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import accounting
from taco_jax.accounting import Op
from taco_jax.collectives import (
    Call,
    check_axis,
    forward_recording,
    gather_invariant,
    per_rank,
    refuse_gradient_outside,
    second_shot,
    vary,
)
from taco_jax.message import Gathered, Transfer, WirePlan, in_rank_order


def shift_pairs(ranks: int, shift: int) -> tuple[tuple[int, int], ...]:
    """The (source, destination) pairs of the collective-permute that moves every
    rank's message `shift` ranks on."""
    return tuple((rank, (rank + shift) % ranks) for rank in range(ranks))


def _shift(transfer: Transfer, shift: int) -> Callable[[jax.Array], jax.Array]:
    """The collective-permute by `shift` ranks, as a step of `transfer`."""
    axis_name = transfer.collective.axis_name
    pairs = shift_pairs(lax.axis_size(axis_name), shift)
    return transfer.move(Op.PPERMUTE, lambda message: lax.ppermute(per_rank(message, axis_name), axis_name, pairs))


# ----------------------------------------------------------------------------- all-gather


def gather_by_shifts(x: jax.Array, call: Call, *, direction: str, axis: int) -> Gathered:
    """Every rank's `x`, moved by the k-1 shift permutes (compressed where the plan of
    the all-gather it replaces says so), recorded as that all-gather; gathered along
    `axis` where `Gathered.value` joins them."""
    with call.transfer(x, Op.ALL_GATHER, direction) as transfer:
        plan, ranks = transfer.plan, transfer.collective.ranks
        shifts = [_shift(transfer, s) for s in range(1, ranks)]
        parts: tuple[Any, ...]
        if plan is None:
            parts = (x, *(shift(x) for shift in shifts))
        else:
            own = plan.encode(plan.rows(x), x.dtype)
            parts = (own, *(own.moved(shift) for shift in shifts))
    return Gathered(parts, plan, tuple(x.shape), axis, True, call.axis_name, by_shifts=True)


# ----------------------------------------------------------------------------- reduce-scatter


def _sent_by_shifts(partial_for: Callable[[jax.Array], jax.Array], transfer: Transfer, site: str) -> list[jax.Array]:
    """This rank's block of a sum, as received: element s is rank r - s's contribution
    `partial_for(r)` (s = 0 this rank's own), sent s ranks on by its shift permute, a
    wire buffer where the transfer's plan compresses it (each reported to an active
    calibration collector under `site`). Each contribution is computed just before its
    send, so its matmul can run beside the previous one's transfer."""
    plan, direction = transfer.plan, transfer.collective.direction
    ranks, me = transfer.collective.ranks, lax.axis_index(transfer.collective.axis_name)
    received = []
    for shift in range(ranks):
        partial = partial_for((me + shift) % ranks)
        if plan is not None:
            accounting.observe(partial, site, direction)
            partial = plan.encode(plan.rows(partial), partial.dtype).buffer
        received.append(_shift(transfer, shift)(partial) if shift else partial)
    return received


def _block_groups(block: tuple[int, ...], plan: WirePlan) -> int:
    """Groups of G of one rank's block of the message, laid out in rows of its last axis."""
    return math.prod(block[:-1]) * -(-block[-1] // plan.spec.group_size)


def reduce_scatter_by_shifts(
    partial_for: Callable[[jax.Array], jax.Array],
    message: jax.ShapeDtypeStruct,
    call: Call,
    *,
    direction: str,
    axis: int,
) -> jax.Array:
    """This rank's block of the sum over ranks of `partial_for(j)`, the rank's
    contribution to rank j's block (j a traced rank index), each block sent by the
    shift permute that reaches its owner; compressed, and recorded, as the
    reduce-scatter of `message` it replaces.

    Args:
      partial_for: j -> this rank's contribution to block j: `message` cut along `axis`.
      message: the whole contribution the reduce-scatter would send (shape, dtype).
      call: the call.
      direction: "forward" or "backward".
      axis: the axis `message` is scattered along, one block per rank (not its last,
        which the wire layout groups).
    """
    with call.transfer(message, Op.REDUCE_SCATTER, direction, report=False) as transfer:
        received = _sent_by_shifts(partial_for, transfer, call.site_of(Op.REDUCE_SCATTER))
    plan, ranks = transfer.plan, transfer.collective.ranks
    if plan is None:
        return functools.reduce(jnp.add, received)
    block = (*message.shape[:axis], message.shape[axis] // ranks, *message.shape[axis + 1 :])
    return plan.array(plan.stacked(received, _block_groups(block, plan), message.dtype).sum(), block)


def all_reduce_by_shifts(
    partial_for: Callable[[jax.Array], jax.Array],
    message: jax.ShapeDtypeStruct,
    call: Call,
    *,
    direction: str,
) -> jax.Array:
    """The sum over ranks of a (rows, D) `message` whose row blocks `partial_for(j)`
    computes (rows divisible by the ranks): the two-shot all-reduce, its reduce-scatter
    by shifts (each block's matmul beside the previous block's transfer) and its
    all-gather of the reduced blocks (the result invariant over the axis, as `lax.psum`'s);
    compressed, and recorded, as the two-shot all-reduce of `message` it replaces.

    Args:
      partial_for: j -> this rank's contribution to row block j (a traced rank index).
      message: the whole contribution (rows, D) the all-reduce would sum.
      call: the call.
      direction: "forward" or "backward".
    """
    # So named even where plain: the plain one runs as two shots too.
    with call.transfer(message, Op.ALL_REDUCE_TWO_SHOT, direction, algorithm="two_shot", report=False) as transfer:
        plan = transfer.plan
        block = (message.shape[0] // transfer.collective.ranks, *message.shape[1:])
        received = _sent_by_shifts(partial_for, transfer, call.site_of(Op.ALL_REDUCE))
        if plan is None:
            gather = functools.partial(gather_invariant, axis_name=call.axis_name)
            blocks = transfer.move(Op.ALL_GATHER, gather)(functools.reduce(jnp.add, received))
        else:
            summed = plan.stacked(received, _block_groups(block, plan), message.dtype)
            blocks = plan.array(second_shot(summed, transfer), block, 1)
    return blocks.reshape(message.shape)


# ----------------------------------------------------------------------------- the matmuls


def _chunk(x: jax.Array, index: jax.Array, size: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _weight_grad(x: jax.Array, cotangent: jax.Array, weight: jax.Array) -> jax.Array:
    return (x.reshape(-1, x.shape[-1]).T @ cotangent.reshape(-1, cotangent.shape[-1])).astype(weight.dtype)


def _gather_matmul_forward(x, weights, call, axis, direction):
    with forward_recording() if direction == "forward" else contextlib.nullcontext():
        gathered = gather_by_shifts(x, call, direction=direction, axis=axis)
    values = gathered.arrays()
    outputs = tuple(in_rank_order([value @ w for value in values], call.axis_name, axis) for w in weights)
    return outputs, gathered


def _matmul_scatter(xs, weights, call, axis, direction):
    """sum_i xs[i] @ weights[i], reduce-scattered along `axis` by shifts."""
    ranks = lax.axis_size(call.axis_name)
    size = xs[0].shape[axis] // ranks
    out_shape = (*xs[0].shape[:-1], weights[0].shape[-1])

    def partial_for(j):
        return sum(_chunk(x, j, size, axis) @ w for x, w in zip(xs, weights, strict=True)).astype(xs[0].dtype)

    message = jax.ShapeDtypeStruct(out_shape, xs[0].dtype)
    with forward_recording() if direction == "forward" else contextlib.nullcontext():
        return reduce_scatter_by_shifts(partial_for, message, call, direction=direction, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def all_gather_matmul(x, weights, call: Call, axis: int):
    """`all_gather(x, tiled) @ w` for each weight, by shifts (see the module doc)."""
    return _gather_matmul_forward(x, weights, call, axis, "forward")[0]


def _all_gather_matmul_fwd(x, weights, call, axis):
    outputs, gathered = _gather_matmul_forward(x, weights, call, axis, "forward")
    return outputs, (gathered, weights)


def _all_gather_matmul_bwd(call, axis, residuals, cotangents):
    received, weights = residuals
    gathered = received.value()
    weight_grads = tuple(_weight_grad(gathered, ct, w) for w, ct in zip(weights, cotangents, strict=True))
    cts = tuple(ct.astype(w.dtype) for ct, w in zip(cotangents, weights, strict=True))
    input_grad = _matmul_scatter(cts, tuple(w.T for w in weights), call, axis, "backward")
    return input_grad.astype(weights[0].dtype), weight_grads


all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul_reduce_scatter(x, weight, call: Call, axis: int):
    """`reduce_scatter(x @ weight)` along `axis`, by shifts (see the module doc)."""
    return _matmul_scatter((x,), (weight,), call, axis, "forward")


def _matmul_reduce_scatter_fwd(x, weight, call, axis):
    return _matmul_scatter((x,), (weight,), call, axis, "forward"), (x, weight)


def _matmul_reduce_scatter_bwd(call, axis, residuals, cotangent):
    x, weight = residuals
    (input_grad,), gathered = _gather_matmul_forward(cotangent, (weight.T,), call, axis, "backward")
    return input_grad.astype(x.dtype), _weight_grad(x, gathered.value(), weight)


matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


def _matmul_all_reduce(xs, weights, call, direction):
    """sum_i xs[i] @ weights[i] summed over ranks by `all_reduce_by_shifts`, over the
    rows (every axis but the last, flattened; zero rows pad them to a multiple of the
    ranks)."""
    ranks, lead = lax.axis_size(call.axis_name), xs[0].shape[:-1]
    rows = math.prod(lead)
    size = -(-rows // ranks)
    flats = [x.reshape(rows, x.shape[-1]) for x in xs]
    if size * ranks != rows:
        flats = [jnp.pad(flat, ((0, size * ranks - rows), (0, 0))) for flat in flats]

    def partial_for(j):
        return sum(_chunk(x, j, size, 0) @ w for x, w in zip(flats, weights, strict=True)).astype(xs[0].dtype)

    message = jax.ShapeDtypeStruct((size * ranks, weights[0].shape[-1]), xs[0].dtype)
    with forward_recording() if direction == "forward" else contextlib.nullcontext():
        summed = all_reduce_by_shifts(partial_for, message, call, direction=direction)
    return summed[:rows].reshape(*lead, weights[0].shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul_all_reduce(x, weight, call: Call):
    """`psum(x @ weight)` over the axis, by shifts (see the module doc); its backward
    pass sends nothing (the result is replicated, as Megatron's g)."""
    return _matmul_all_reduce((x,), (weight,), call, "forward")


def _matmul_all_reduce_fwd(x, weight, call):
    return _matmul_all_reduce((x,), (weight,), call, "forward"), (x, weight)


def _matmul_all_reduce_bwd(call, residuals, cotangent):
    refuse_gradient_outside("matmul_all_reduce", call.axis_name)
    x, weight = residuals
    cotangent = vary(cotangent, (call.axis_name,)).astype(x.dtype)
    return (cotangent @ weight.T).astype(x.dtype), _weight_grad(x, cotangent, weight)


matmul_all_reduce.defvjp(_matmul_all_reduce_fwd, _matmul_all_reduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def copy_matmul(x, weights, call: Call):
    """`x @ w` for each weight with `x` replicated over the axis (Megatron's f): the
    backward pass sums the input gradient over the ranks by `matmul_all_reduce`'s shifts."""
    varying = vary(x, (call.axis_name,))
    return tuple(varying @ w for w in weights)


def _copy_matmul_fwd(x, weights, call):
    return copy_matmul(x, weights, call), (x, weights)


def _copy_matmul_bwd(call, residuals, cotangents):
    refuse_gradient_outside("copy_matmul", call.axis_name)
    x, weights = residuals
    weight_grads = tuple(_weight_grad(x, ct, w) for w, ct in zip(weights, cotangents, strict=True))
    cts = tuple(ct.astype(w.dtype) for ct, w in zip(cotangents, weights, strict=True))
    input_grad = _matmul_all_reduce(cts, tuple(w.T for w in weights), call, "backward")
    return input_grad.astype(x.dtype), weight_grads


copy_matmul.defvjp(_copy_matmul_fwd, _copy_matmul_bwd)


def check_sequence_axis(shape: tuple[int, ...], axis: int, ranks: int, *, scattered: bool) -> int:
    """The sequence axis normalized; ValueError unless it is a middle axis (not the
    feature axis) whose size divides by the ranks where it is scattered."""
    axis = check_axis(axis, len(shape), "axis")
    if axis == len(shape) - 1:
        raise ValueError(
            f"axis {axis} of shape {shape} is the feature axis the matmul contracts; pass the sequence axis"
        )
    if scattered and shape[axis] % ranks:
        raise ValueError(
            f"sequence axis {axis} of shape {shape} has size {shape[axis]}, not divisible by {ranks} ranks"
        )
    return axis
