"""Megatron tensor-parallel mappings with compressed communication.

Use them inside `jax.shard_map`. Where the gradient may be taken:

| `shard_map` | where the gradient may be taken |
|---|---|
| `check_vma=True` (JAX's default) | inside or outside the shard_map. JAX tracks which values vary over which axes; `copy_to_tp` needs `x` replicated over the axis, `reduce_from_tp` partial results varying over it (else ValueError). |
| `check_vma=False` | inside the shard_map only (each rank differentiates its own copy of the loss; Megatron's convention). With the gradient outside, JAX's transpose of the shard_map would scale weight gradients by 1/axis size, so `copy_to_tp` and `reduce_from_tp` raise instead. |

Forward messages use `config.forward`, backward messages `config.backward`; the
quantizer itself is never differentiated (straight-through).

| mapping | what it does |
|---|---|
| `copy_to_tp` | identity forward, all-reduce backward (Megatron's f) |
| `reduce_from_tp` | all-reduce forward, identity backward (Megatron's g) |
| `gather_from_sp` | all-gather forward, reduce-scatter backward |
| `reduce_scatter_to_sp` | reduce-scatter forward, all-gather backward |
| `gather_matmul` | `gather_from_sp` followed by column-parallel matmuls, saving the gathered input for the backward pass in its 8-bit wire form; `overlap=True`: as a collective matmul (`taco_jax.collective_matmul`) |
| `matmul_reduce_scatter` | a row-parallel matmul followed by `reduce_scatter_to_sp`; `overlap=True`: as a collective matmul |
| `copy_matmul` | `copy_to_tp` followed by column-parallel matmuls; `overlap=True`: the backward all-reduce as a collective matmul |
| `matmul_all_reduce` | a row-parallel matmul followed by `reduce_from_tp`; `overlap=True`: as a collective matmul |
| `sum_sequence_parallel_grads` | sum over the axis the gradients of replicated parameters applied to sequence shards (`check_vma=False`; JAX does it itself under `check_vma=True`) |
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from taco_jax import collective_matmul, collectives
from taco_jax.calibration import Calibration
from taco_jax.collectives import Call, record_plain_all_reduce
from taco_jax.policy import TacoConfig, check_algorithm


def _copy_backward(cotangent: jax.Array, call: Call, *, algorithm: str) -> jax.Array:
    collectives.refuse_gradient_outside("copy_to_tp", call.axis_name)
    return collectives.run_all_reduce(cotangent, call, direction="backward", algorithm=algorithm)


def _reduce_backward(cotangent: jax.Array, call: Call, *, algorithm: str) -> jax.Array:
    collectives.refuse_gradient_outside("reduce_from_tp", call.axis_name)
    return collectives.vary(cotangent, (call.axis_name,))


# Megatron's f (identity forward; marked varying under check_vma=True) and g.
_copy = collectives.straight_through(lambda x, call, algorithm: collectives.vary(x, (call.axis_name,)), _copy_backward)
_reduce = collectives.straight_through(
    lambda x, call, algorithm: collectives.run_all_reduce(x, call, direction="forward", algorithm=algorithm),
    _reduce_backward,
)


def _check_replicated(x: jax.Array, axis_name: str, mapping: str) -> None:
    if axis_name in collectives.varying_axes(x):
        raise ValueError(
            f"{mapping} needs x replicated over {axis_name!r}, but it varies over it "
            f"({jax.typeof(x)}); each rank would contribute a different input"
        )


def _call(axis_name: str, config: TacoConfig, site: str | None, calibration: Calibration | None) -> Call:
    return Call(axis_name=axis_name, config=config, site=site, calibration=calibration)


def copy_to_tp(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    algorithm: str = "auto",
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
    """Enter a tensor-parallel region: identity forward, compressed all-reduce of the
    gradient backward (every rank's partial input gradient is summed).

    Args:
      x: activation replicated over `axis_name`.
      axis_name: the tensor-parallel mesh axis.
      config: `TacoConfig`; the backward all-reduce uses `config.backward`.
      algorithm: all-reduce algorithm ("auto", "one_shot", "two_shot").
      site: call-site name for wire-byte accounting and calibration.
      calibration: per-site channel permutations / transform decisions (None: identity).

    Returns:
      `x` (varying over `axis_name` under `check_vma=True`).

    Raises:
      ValueError: `config` is not a `TacoConfig`, an unknown algorithm or a bad
        calibration; under `check_vma=True`, `x` already varies over `axis_name`; the
        gradient of a `check_vma=False` shard_map taken outside it (see the module doc).
    """
    call = _call(axis_name, config, site, calibration)
    check_algorithm(algorithm)
    _check_replicated(x, axis_name, "copy_to_tp")
    return _copy(x, call, algorithm=algorithm)


def reduce_from_tp(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    algorithm: str = "auto",
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
    """Leave a tensor-parallel region: compressed all-reduce of the partial sums forward
    (`config.forward`), identity backward.

    Args:
      x: this rank's partial sum (e.g. a row-parallel matmul's output).
      axis_name: the tensor-parallel mesh axis.
      config: `TacoConfig`.
      algorithm: all-reduce algorithm ("auto", "one_shot", "two_shot").
      site: call-site name for wire-byte accounting and calibration.
      calibration: per-site channel permutations / transform decisions (None: identity).

    Returns:
      The sum over `axis_name`, same shape and dtype as `x` (invariant over `axis_name`
      under `check_vma=True`).

    Raises:
      ValueError: `config` is not a `TacoConfig`, an unknown algorithm or a bad
        calibration; under `check_vma=True`, `x` is replicated over `axis_name` (the sum
        would count it axis-size times); the gradient of a `check_vma=False` shard_map
        taken outside it (see the module doc).
    """
    call = _call(axis_name, config, site, calibration)
    check_algorithm(algorithm)
    if collectives.checks_vma(axis_name) and axis_name not in collectives.varying_axes(x):
        raise ValueError(
            f"reduce_from_tp sums per-rank partial results, but x is replicated over {axis_name!r} "
            f"({jax.typeof(x)}): the sum would count it {lax.axis_size(axis_name)} times"
        )
    return _reduce(x, call, algorithm=algorithm)


def gather_from_sp(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    axis: int = 0,
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
    """Leave a sequence-parallel region: compressed all-gather of the sequence shards
    forward, compressed reduce-scatter of the gradient backward.

    Args:
      x: this rank's sequence shard.
      axis_name: the tensor-parallel mesh axis.
      config: `TacoConfig`.
      axis: the sequence axis.
      site: call-site name for wire-byte accounting and calibration.
      calibration: per-site channel permutations / transform decisions (None: identity).

    Returns:
      The full sequence (shard size x axis size along `axis`).

    Raises:
      ValueError: bad axis, config or calibration.
    """
    return collectives.all_gather(x, axis_name, config, axis=axis, tiled=True, site=site, calibration=calibration)


def reduce_scatter_to_sp(
    x: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    axis: int = 0,
    site: str | None = None,
    calibration: Calibration | None = None,
) -> jax.Array:
    """Enter a sequence-parallel region: compressed reduce-scatter of the partial sums
    along the sequence forward, compressed all-gather of the gradient backward.

    Args:
      x: this rank's full-sequence partial sum.
      axis_name: the tensor-parallel mesh axis.
      config: `TacoConfig`.
      axis: the sequence axis (its size must divide by the axis size).
      site: call-site name for wire-byte accounting and calibration.
      calibration: per-site channel permutations / transform decisions (None: identity).

    Returns:
      This rank's sequence block of the sum.

    Raises:
      ValueError: the sequence axis does not divide by the axis size, or a bad config
        or calibration.
    """
    return collectives.reduce_scatter(
        x, axis_name, config, scatter_dimension=axis, tiled=True, site=site, calibration=calibration
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gather_matmul(x, weights, call, axis):
    return _gather_matmul_fwd(x, weights, call, axis)[0]


def _gather_matmul_fwd(x, weights, call, axis):
    # Keep what was received (the 8-bit buffers when compressed), not the decoded
    # activation: ~half the bytes of bf16 (as Transformer Engine keeps FP8 residuals).
    with collectives.forward_recording():
        gathered, residual = collectives.run_all_gather(x, call, direction="forward", axis=axis)
    return tuple(gathered @ weight for weight in weights), (residual, weights)


def _gather_matmul_bwd(call, axis, residuals, cotangents):
    residual, weights = residuals
    gathered = residual.value()
    flat = gathered.reshape(-1, gathered.shape[-1])
    weight_grads = tuple(
        (flat.T @ cotangent.reshape(-1, cotangent.shape[-1])).astype(weight.dtype)
        for weight, cotangent in zip(weights, cotangents, strict=True)
    )
    input_grad = sum(cotangent @ weight.T for weight, cotangent in zip(weights, cotangents, strict=True))
    scattered = collectives.run_reduce_scatter(
        input_grad.astype(weights[0].dtype), call, direction="backward", dimension=axis
    )
    return scattered, weight_grads


_gather_matmul.defvjp(_gather_matmul_fwd, _gather_matmul_bwd)


def _varying_together(axis_name: str, *arrays: jax.Array) -> list[jax.Array]:
    """The arrays with one varying type (the casts JAX inserts itself around a matmul;
    their transposes sum the weight gradients over e.g. the data axis)."""
    arrays = tuple(jnp.asarray(a) for a in arrays)
    axes = tuple(sorted({axis_name}.union(*map(collectives.varying_axes, arrays))))
    return [collectives.vary(a, axes) for a in arrays]


def gather_matmul(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    axis_name: str,
    config: TacoConfig,
    *,
    axis: int = 1,
    site: str | None = None,
    calibration: Calibration | None = None,
    overlap: bool = False,
) -> tuple[jax.Array, ...]:
    """Sequence-parallel column-parallel matmuls: `gather_from_sp(x) @ w` for each weight.

    Same values and gradients as `gather_from_sp` followed by the matmuls, but when the
    gather is compressed the backward pass re-decodes the gathered input from the 8-bit
    buffers it received instead of keeping the decoded activation alive.

    Args:
      x: this rank's sequence shard (..., D).
      weights: column-parallel weight shards, each (D, N_i), in x's dtype.
      axis_name: the tensor-parallel mesh axis.
      config: `TacoConfig`.
      axis: the sequence axis of `x`.
      site: call-site name for wire-byte accounting and calibration.
      calibration: per-site channel permutations / transform decisions (None: identity).
      overlap: send the gather as one message per peer (`collective_matmul`), so the
        matmul of a chunk that has arrived can run while the others are on the wire;
        the backward pass is then the overlapped `matmul_reduce_scatter`.

    Returns:
      One output (..., N_i) per weight, over the gathered sequence.

    Raises:
      ValueError: `config` is not a `TacoConfig`, a bad calibration, or (with
        `overlap`) an `axis` that is the feature axis.
    """
    call = _call(axis_name, config, site, calibration)
    x, *varying_weights = _varying_together(axis_name, x, *weights)
    if overlap:
        axis = collective_matmul.check_sequence_axis(x.shape, axis, lax.axis_size(axis_name), scattered=False)
        return collectives.called(collective_matmul.all_gather_matmul, x, tuple(varying_weights), call, axis)
    return collectives.called(_gather_matmul, x, tuple(varying_weights), call, axis)


def matmul_reduce_scatter(
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    axis: int = 1,
    site: str | None = None,
    calibration: Calibration | None = None,
    overlap: bool = False,
) -> jax.Array:
    """A row-parallel matmul entering a sequence-parallel region:
    `reduce_scatter_to_sp(x @ weight)`.

    Args:
      x: this rank's input (..., F_shard) over the whole sequence.
      weight: this rank's row-parallel weight shard (F_shard, D), in x's dtype.
      axis_name: the tensor-parallel mesh axis.
      config: `TacoConfig`.
      axis: the sequence axis (its size must divide by the axis size).
      site: call-site name for wire-byte accounting and calibration.
      calibration: per-site channel permutations / transform decisions (None: identity).
      overlap: compute and send the block of each peer in turn (`collective_matmul`),
        so each block's transfer can run beside the next block's matmul; the backward
        pass is then the overlapped `gather_matmul`.

    Returns:
      This rank's sequence block of the sum, (..., D).

    Raises:
      ValueError: the sequence axis does not divide by the axis size, or is the feature
        axis; a bad config or calibration.
    """
    if not overlap:
        return reduce_scatter_to_sp(x @ weight, axis_name, config, axis=axis, site=site, calibration=calibration)
    call = _call(axis_name, config, site, calibration)
    x, weight = _varying_together(axis_name, x, weight)
    axis = collective_matmul.check_sequence_axis(x.shape, axis, lax.axis_size(axis_name), scattered=True)
    return collectives.called(collective_matmul.matmul_reduce_scatter, x, weight, call, axis)


def copy_matmul(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    axis_name: str,
    config: TacoConfig,
    *,
    site: str | None = None,
    calibration: Calibration | None = None,
    overlap: bool = False,
) -> tuple[jax.Array, ...]:
    """Column-parallel matmuls without sequence parallelism: `copy_to_tp(x) @ w` for each
    weight (the backward pass all-reduces the input gradient).

    Args:
      x: activation (..., D) replicated over `axis_name`.
      weights: column-parallel weight shards, each (D, N_i), in x's dtype.
      axis_name: the tensor-parallel mesh axis.
      config: `TacoConfig`; the backward all-reduce uses `config.backward`.
      site: call-site name for wire-byte accounting and calibration.
      calibration: per-site channel permutations / transform decisions (None: identity).
      overlap: all-reduce the input gradient as a collective matmul
        (`collective_matmul.copy_matmul`): each row block's gradient matmul beside the
        previous block's transfer.

    Returns:
      One output (..., N_i) per weight.

    Raises:
      ValueError: `config` is not a `TacoConfig`, a bad calibration; under
        `check_vma=True`, `x` varies over `axis_name`.
    """
    if not overlap:
        h = copy_to_tp(x, axis_name, config, site=site, calibration=calibration)
        return tuple(h @ weight for weight in weights)
    call = _call(axis_name, config, site, calibration)
    _check_replicated(x, axis_name, "copy_matmul")
    axes = tuple(sorted({axis_name}.union(*map(collectives.varying_axes, (x, *weights)))))
    x = collectives.vary(x, tuple(a for a in axes if a != axis_name))
    weights = tuple(collectives.vary(w, axes) for w in weights)
    return collectives.called(collective_matmul.copy_matmul, x, weights, call)


def matmul_all_reduce(
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    config: TacoConfig,
    *,
    site: str | None = None,
    calibration: Calibration | None = None,
    overlap: bool = False,
) -> jax.Array:
    """A row-parallel matmul leaving a tensor-parallel region: `reduce_from_tp(x @ weight)`.

    Args:
      x: this rank's input (..., F_shard).
      weight: this rank's row-parallel weight shard (F_shard, D), in x's dtype.
      axis_name: the tensor-parallel mesh axis.
      config: `TacoConfig`.
      site: call-site name for wire-byte accounting and calibration.
      calibration: per-site channel permutations / transform decisions (None: identity).
      overlap: sum as a collective matmul (`collective_matmul.matmul_all_reduce`): the
        two-shot all-reduce, each row block's matmul beside the previous block's
        transfer, then the all-gather of the summed blocks.

    Returns:
      The sum over `axis_name`, (..., D) (invariant over `axis_name` under
      `check_vma=True`).

    Raises:
      ValueError: `config` is not a `TacoConfig`, a bad calibration.
    """
    if not overlap:
        return reduce_from_tp(x @ weight, axis_name, config, site=site, calibration=calibration)
    call = _call(axis_name, config, site, calibration)
    x, weight = _varying_together(axis_name, x, weight)
    return collectives.called(collective_matmul.matmul_all_reduce, x, weight, call)


# Why the sequence-parallel gradient sums go plain: parameter gradients (norms, biases,
# positions: small) feed the optimizer, where the tensor axis carries no error feedback.
PARAMETER_GRADIENT_REASON = "replicated parameters' gradients: small, kept exact"


def sum_sequence_parallel_grads(grads: Any, specs: Any, axis_name: str) -> Any:
    """Sum over `axis_name` the gradients of parameters that are replicated over it but
    applied to sequence shards (norms, biases after a reduce-scatter, positions) — each
    rank holds only its shard's part. For gradients taken inside a
    `shard_map(check_vma=False)`; under `check_vma=True` JAX has already summed them
    (the implicit cast of a replicated parameter transposes to a sum) and they are
    returned unchanged.

    Args:
      grads: gradient pytree.
      specs: matching pytree of `PartitionSpec`s of the parameters; a parameter whose
        spec names `axis_name` is sharded over it and left alone.
      axis_name: the tensor-parallel mesh axis.

    Returns:
      The gradients, replicated ones summed over `axis_name`.
    """
    if collectives.checks_vma(axis_name):
        return grads

    def named(spec: PartitionSpec) -> bool:
        return any(axis_name in (entry if isinstance(entry, tuple) else (entry,)) for entry in spec)

    def summed(grad: jax.Array) -> jax.Array:
        record_plain_all_reduce(
            grad, axis_name, site="sequence_parallel_grads", direction="backward", reason=PARAMETER_GRADIENT_REASON
        )
        return lax.psum(grad, axis_name)

    return jax.tree.map(lambda g, spec: g if named(spec) else summed(g), grads, specs)
