"""The trainer's optimizer: AdamW (weight decay on matrices only) with warmup + cosine
after global-norm clipping, and its state laid out like the parameters."""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax import models

from .config import TrainConfig


def _decay_mask(model_config: models.ModelConfig) -> dict:
    """Weight decay on matrices only, not on norm scales or biases (the stacked "layers"
    axis does not count as a dimension)."""
    return jax.tree.map(
        lambda leaf: sum(axis != "layers" for axis in leaf[1]) >= 2,
        models.layout(model_config),
        is_leaf=models.params.is_layout_leaf,
    )


def make_optimizer(
    cfg: TrainConfig, model_config: models.ModelConfig
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (decay on matrices only) with warmup + cosine, after global-norm clipping."""
    decay_steps = cfg.decay_steps or cfg.steps
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.lr,
        min(cfg.warmup_steps, decay_steps),
        max(decay_steps, cfg.warmup_steps + 1),
        cfg.lr * cfg.min_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=_decay_mask(model_config)
        ),
    )
    return tx, schedule


def optimizer_shardings(tx: optax.GradientTransformation, params: dict, mesh) -> dict:
    """Shardings of the optimizer state: every per-parameter tree (Adam moments) sharded
    like the parameters, scalars (step counts) replicated. Left to propagation, moments
    born from `zeros_like` come out replicated, and every step then all-gathers the
    full float32 parameters and moments over "tensor"."""
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, params),
        jax.tree.map(lambda p: p.sharding, params),
        transform_non_params=lambda _: replicated,
    )


def init_state(
    model_config: models.ModelConfig, seed: int, mesh, tx: optax.GradientTransformation
) -> tuple[dict, dict]:
    """Parameters (born sharded) and optimizer state on `mesh`: moments sharded like the
    parameters, scalars replicated."""
    params = models.init_params(model_config, jax.random.key(seed), mesh)
    return params, jax.jit(tx.init, out_shardings=optimizer_shardings(tx, params, mesh))(params)


def abstract_opt_state(tx: optax.GradientTransformation, params: dict, mesh) -> dict:
    """Shapes, dtypes and shardings of the optimizer state for `params` (what a
    checkpoint holds), without allocating it."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        jax.eval_shape(tx.init, params),
        optimizer_shardings(tx, params, mesh),
    )
