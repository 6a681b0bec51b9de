"""GPipe pipeline schedule over the "pipe" mesh axis, inside shard_map.

Each pipe rank holds a contiguous block of layers (the stacked layer axis is split over
"pipe"). The global batch of a rank is cut into M microbatches; at tick t stage s runs
microbatch t - s, and `ppermute` hands activations to the next stage:

    tick:     0    1    2    3    4          (M = 3 microbatches, 3 stages)
    stage 0:  m0   m1   m2   .    .
    stage 1:  .    m0   m1   m2   .
    stage 2:  .    .    m0   m1   m2         loss of m_k on the last stage

M + stages - 1 ticks; the bubble (idle fraction) is (stages - 1) / (M + stages - 1). Every
stage executes every tick (SPMD); idle slots run on inputs they already hold (stage 0,
after the last microbatch, on the last one again) and their results are masked out.
Nothing is sent after the last tick. The backward pass is the autodiff of
this schedule: `ppermute` transposes to the reverse permutation, so gradients flow from
the last stage back to the first (all forward ticks, then all backward ticks, as in
GPipe). The sends go through `taco_jax.ppermute` with the run's pipe config: plain in
mode "off", compressed otherwise (activations forward, their gradients backward).
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
from jax import lax

import taco_jax as tj
from taco_jax.mesh import PIPE_AXIS
from taco_jax.models.config import ModelConfig
from taco_jax.models.transformer import Parallelism, embed, final_norm, loss_from_hidden, run_layers


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of the GPipe schedule."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_loss(
    model_config: ModelConfig,
    params: dict,
    tokens,
    par: Parallelism,
    microbatches: int,
    pipe: tj.TacoConfig = tj.TacoConfig.preset("off"),
):
    """Mean next-token loss of this rank's batch through the pipeline.

    Args:
      model_config: model configuration.
      params: this rank's parameters (its stage's layers).
      tokens: (B, S + 1) token ids, B divisible by `microbatches`.
      par: tensor-parallel settings.
      microbatches: M.
      pipe: compression of the stage-to-stage sends.

    Returns:
      This rank's share of the loss: the loss on the last stage, 0 elsewhere (their sum
      over "pipe" is the loss).
    """
    stages, stage = lax.axis_size(PIPE_AXIS), lax.axis_index(PIPE_AXIS)
    inputs = tokens[:, :-1].reshape(microbatches, -1, tokens.shape[1] - 1)
    targets = tokens[:, 1:].reshape(microbatches, -1, tokens.shape[1] - 1)
    carry, total, ticks = None, jnp.float32(0.0), microbatches + stages - 1
    for tick in range(ticks):
        # After the last microbatch stage 0 reruns it (masked); the compiler computes the
        # repeat once, so its messages are not counted again.
        with tj.accounting.paused() if tick >= microbatches else contextlib.nullcontext():
            first = embed(model_config, params, inputs[min(tick, microbatches - 1)], par)
        x = first if carry is None else jnp.where(stage == 0, first, carry)
        y = run_layers(model_config, params["layers"], x, par)
        out = tick - (stages - 1)
        if 0 <= out < microbatches:
            loss = loss_from_hidden(model_config, params, final_norm(model_config, params, y), targets[out], par)
            total = total + jnp.where(stage == stages - 1, loss, 0.0)
        if stages > 1 and tick < ticks - 1:
            carry = tj.ppermute(
                y, PIPE_AXIS, pipe, perm=[(i, (i + 1) % stages) for i in range(stages)], site="pipe.activations"
            )
    return total / microbatches
