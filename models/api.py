"""Model entry points: logits and per-rank loss/gradients on a (data, pipe, tensor) mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.mesh import DATA_AXIS, PIPE_AXIS, TENSOR_AXIS

from .config import ModelConfig, check_tensor_parallel, check_token_ids
from .params import partition_specs, shard_params
from .transformer import Parallelism, cross_entropy, local_logits, taco_config


def _mesh_or_default(mesh: Mesh | None) -> Mesh:
    mesh = mesh if mesh is not None else tj.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    if mesh.shape[PIPE_AXIS] != 1:
        raise ValueError(
            f"models.logits / loss_and_grads run without a pipeline (pipe=1), got pipe={mesh.shape['pipe']}; "
            "the trainer (train.pipeline) runs pipelined meshes"
        )
    return mesh


def _prepare(
    config: ModelConfig, mesh: Mesh | None, taco, sequence_parallel: bool, calibration
) -> tuple[Mesh, Parallelism]:
    mesh = _mesh_or_default(mesh)
    check_tensor_parallel(config, mesh.shape[TENSOR_AXIS])
    calibration = calibration if calibration is not None else tj.calibration.Calibration()
    return mesh, Parallelism(taco_config(taco), sequence_parallel, calibration=calibration)


def logits(
    config: ModelConfig,
    params: dict,
    tokens: jax.Array,
    *,
    mesh: Mesh | None = None,
    taco: tj.TacoConfig | str | None = None,
    sequence_parallel: bool = False,
    calibration: tj.calibration.Calibration | None = None,
) -> jax.Array:
    """Next-token logits for evaluation.

    Args:
      config: model configuration.
      params: parameters (host or device; placed on `mesh` with their partition specs).
      tokens: (B, S) int token ids.
      mesh: (data, pipe, tensor) mesh; one device if None.
      taco: compression of the tensor-parallel collectives: a `TacoConfig` or a preset
        name (`TacoConfig.preset(name)`); uncompressed if None.
      sequence_parallel: run norms and residuals on sequence shards.
      calibration: per-site channel permutations / transform decisions (None: identity).

    Returns:
      float32 (B, S, vocab_size), sharded over the vocabulary on `mesh`.

    Raises:
      ValueError: token ids outside [0, vocab_size); the tensor axis does not divide
        the heads, kv heads, MLP width or vocabulary (or the sequence, with sequence
        parallelism); an unknown preset name.
      TypeError: `taco` neither a `TacoConfig`, a preset name nor None.
    """
    check_token_ids(tokens, config)
    mesh, par = _prepare(config, mesh, taco, sequence_parallel, calibration)
    batch = P(tj.mesh.data_axis(mesh, tokens.shape[0]))
    fn = jax.shard_map(
        lambda p, t: local_logits(config, p, t, par),
        mesh=mesh,
        in_specs=(partition_specs(config), batch),
        out_specs=P(*batch, None, TENSOR_AXIS),
        check_vma=False,
    )
    out = jax.jit(fn)(shard_params(params, config, mesh), jnp.asarray(tokens))
    return out[..., : config.vocab_size]


def shard_loss_and_grads(
    config: ModelConfig, params: dict, tokens: jax.Array, par: Parallelism
) -> tuple[jax.Array, dict]:
    """Loss and gradients of this rank's batch, inside `shard_map(check_vma=False)`.

    Each rank differentiates its own copy of the loss; the Megatron mappings carry the
    cotangents across the tensor axis. With sequence parallelism, parameters replicated
    over "tensor" but applied to sequence shards (norms, biases after a reduce-scatter,
    positions) get their gradient summed over "tensor".

    Returns:
      (loss, grads) for the local batch; no averaging over "data".
    """
    loss, grads = jax.value_and_grad(lambda p: cross_entropy(config, p, tokens, par))(params)
    return loss, sequence_parallel_grads(config, grads, par)


def sequence_parallel_grads(config: ModelConfig, grads: dict, par: Parallelism) -> dict:
    """`taco_jax.tp.sum_sequence_parallel_grads` of the model's gradients with sequence
    parallelism; identity without."""
    if not par.sequence_parallel:
        return grads
    return tj.tp.sum_sequence_parallel_grads(grads, partition_specs(config), TENSOR_AXIS)


def loss_and_grads(
    config: ModelConfig,
    params: dict,
    tokens: jax.Array,
    *,
    mesh: Mesh | None = None,
    taco: tj.TacoConfig | str | None = None,
    sequence_parallel: bool = False,
    calibration: tj.calibration.Calibration | None = None,
) -> tuple[jax.Array, dict]:
    """Mean next-token loss and its gradients, averaged over the data axis.

    Args:
      config: model configuration.
      params: parameters (placed on `mesh` with their partition specs).
      tokens: (B, S + 1) int token ids, B divisible by the data axis.
      mesh: (data, pipe, tensor) mesh; one device if None.
      taco: compression of the tensor-parallel collectives: a `TacoConfig` or a preset
        name (`TacoConfig.preset(name)`); uncompressed if None.
      sequence_parallel: run norms and residuals on sequence shards.
      calibration: per-site channel permutations / transform decisions (None: identity).

    Returns:
      (loss, grads), grads sharded like the parameters.

    Raises:
      ValueError, TypeError: as `logits`.
    """
    check_token_ids(tokens, config)
    mesh, par = _prepare(config, mesh, taco, sequence_parallel, calibration)
    specs = partition_specs(config)

    def body(p, t):
        loss, grads = shard_loss_and_grads(config, p, t, par)
        return lax.pmean(loss, DATA_AXIS), jax.tree.map(lambda g: lax.pmean(g, DATA_AXIS), grads)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DATA_AXIS)), out_specs=(P(), specs), check_vma=False)
    return jax.block_until_ready(jax.jit(fn)(shard_params(params, config, mesh), jnp.asarray(tokens)))
