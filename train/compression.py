"""The run's compression per mesh axis (its `TacoConfig` for "tensor", "pipe" and "data"
traffic) and the error-feedback residuals of the compressed data-parallel reduction."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import models
from taco_jax.mesh import DATA_AXIS, TENSOR_AXIS

from . import link_policy
from .config import TrainConfig


def taco_config(cfg: TrainConfig, axis: str = TENSOR_AXIS) -> tj.TacoConfig:
    """The run's TACO configuration for one mesh axis's traffic (its compression group's
    preset and quantizers, the min_bytes override; for "tensor" also the measured link
    profile of taco_policy)."""
    group = cfg.compression.of(axis)
    overrides: dict[str, Any] = {"link": link_policy.link_for(cfg)} if axis == TENSOR_AXIS else {}
    if cfg.taco_min_bytes >= 0:
        overrides["min_bytes"] = cfg.taco_min_bytes
    if group.forward:
        overrides["forward"] = tj.QuantSpec.parse(group.forward)
    if group.backward:
        overrides["backward"] = tj.QuantSpec.parse(group.backward)
    return tj.TacoConfig.preset(group.preset, **overrides)


def uses_error_feedback(cfg: TrainConfig) -> bool:
    """Whether the run compresses its data-parallel reduction (and keeps residuals)."""
    return taco_config(cfg, DATA_AXIS).enabled and cfg.mesh.data > 1


def _residual_specs(model_config: models.ModelConfig) -> dict:
    """(data, *parameter shape) split over "data" and then like the parameter."""
    return jax.tree.map(
        lambda spec: P(DATA_AXIS, *spec), models.partition_specs(model_config), is_leaf=lambda s: isinstance(s, P)
    )


def feedback_specs(cfg: TrainConfig, model_config: models.ModelConfig) -> dict:
    """PartitionSpecs of the error-feedback residuals, one per parameter and data rank;
    {} when the run keeps none."""
    return _residual_specs(model_config) if uses_error_feedback(cfg) else {}


def feedback_layout(cfg: TrainConfig, model_config: models.ModelConfig, params: dict, mesh) -> dict:
    """Shapes and shardings of residuals for `params` (what a checkpoint holds)."""
    return jax.tree.map(
        lambda p, spec: jax.ShapeDtypeStruct(
            (cfg.mesh.data, *p.shape), jnp.float32, sharding=NamedSharding(mesh, spec)
        ),
        params,
        _residual_specs(model_config),
        is_leaf=lambda x: isinstance(x, jax.Array),
    )


def init_error_feedback(cfg: TrainConfig, model_config: models.ModelConfig, params: dict, mesh) -> dict:
    """Zero residuals (float32, laid out by `feedback_specs`); {} when the run keeps none."""
    if not uses_error_feedback(cfg):
        return {}
    layout = feedback_layout(cfg, model_config, params, mesh)
    zeros = lambda: jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), layout)
    return jax.jit(zeros, out_shardings=jax.tree.map(lambda leaf: leaf.sharding, layout))()
