"""GPT-2 and Qwen2 as a Flax NNX module on global arrays: the model the trainer and
`models.generate` run, with its parameters as `nnx.Param`s.

`Transformer` runs `models.transformer` (unrolled layers, the trainer's kernels and
collectives, the vocabulary-parallel loss) inside one `jax.shard_map` with JAX's
`check_vma=True`, so gradients taken outside it (`nnx.grad`, `jax.grad`) are exact. Use
it under plain `jax.jit` / `nnx.jit` with the batch sharded over "data", and train it in
your own nnx + optax loop: `model.loss(tokens)` is the trainer's loss.

Its parameter state (`nnx.state(model, nnx.Param).to_pure_dict()`) is the functional
layout (`models.layout`): `from_params` loads `models.init_params`, `models.load_hf` and
trainer checkpoints, and `functional_params` gives them back. `params_from_blocks`
converts the per-block state of the earlier NNX modules (see the changelog).
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.mesh import DATA_AXIS, PIPE_AXIS, TENSOR_AXIS

from . import transformer
from .config import ModelConfig, check_tensor_parallel, check_token_ids, head_dim, padded_vocab
from .generate import generate as functional_generate
from .params import check_arrays, check_params, init_params, partition_specs

_GROUPS = ("embed", "layers", "final")


def _as_params(group: dict) -> dict:
    return nnx.data({name: nnx.Param(value) for name, value in group.items()})


def _placed(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """`params` with the shardings a jitted step gives back for them: mesh axes of size 1
    and trailing unsplit dimensions left out of each spec. Placed by `partition_specs`
    as they are, a step that returns the module's state (Flax's split pattern) would get
    equivalent but differently spelled shardings back and trace a second time."""

    def sharding(spec: P) -> NamedSharding:
        axes = [axis if axis is not None and mesh.shape[axis] > 1 else None for axis in spec]
        while axes and axes[-1] is None:
            axes.pop()
        return NamedSharding(mesh, P(*axes))

    return jax.tree.map(lambda value, spec: jax.device_put(value, sharding(spec)), params, partition_specs(config))


# Whether `_warn_uncalibrated` has warned in this process.
_WARNED_UNCALIBRATED = False


def _warn_uncalibrated(taco: tj.TacoConfig, calibration: tj.calibration.Calibration | None) -> None:
    """Warn, once a process, that a config whose `fewer_bits` only calibration can choose
    (taco+mixed) runs without one: every message then goes in the config's own formats."""
    global _WARNED_UNCALIBRATED
    calibrated = isinstance(calibration, tj.calibration.Calibration) and bool(calibration.plans)
    if taco.fewer_bits is None or calibrated or _WARNED_UNCALIBRATED:
        return
    _WARNED_UNCALIBRATED = True
    warnings.warn(
        f"Transformer: taco has fewer_bits (as taco+mixed), which calibration chooses, but no calibration was "
        f"given, so every message goes as {taco.forward.text} forward and {taco.backward.text} backward (as "
        "taco+), none in fewer bits. To calibrate: trace and run model.loss inside "
        "`with taco_jax.calibration.observing(collector):`, then `calibration, report = "
        "taco_jax.calibration.calibrate(collector, taco)` and build the model again with "
        "`from_params(config, functional_params(model), mesh=mesh, taco=taco, calibration=calibration)` "
        "(docs/guides/calibration.md). This warning is shown once.",
        stacklevel=_user_stacklevel(),
    )


def _user_stacklevel() -> int:
    """The `warnings.warn` stacklevel, from its caller, of the first frame outside this
    module, Flax and JAX: the user's line that built the module."""
    internal = (__file__, *(os.path.dirname(module.__file__ or "") for module in (flax, jax)))
    frames = [frame.filename for frame in inspect.stack()[2:]]
    return 2 + next((i for i, name in enumerate(frames) if not name.startswith(internal)), 0)


class Transformer(nnx.Module):
    """GPT-2 or Qwen2 (by `config.family`) with compressed tensor parallelism.

    Call it on global (B, S) int tokens (batch sharded over "data" or replicated) to get
    float32 logits (B, S, vocab_size), sharded over "tensor" on the vocabulary; or take
    `loss` of (B, S + 1) tokens.

    Attributes:
      config: the model configuration.
      mesh: the (data, pipe, tensor) mesh the parameters live on.
      parallelism: how the forward pass is split and compressed (`models.Parallelism`).
      embed, layers, final: the parameters, as `models.layout` names them.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        mesh: Mesh,
        taco: tj.TacoConfig | str,
        rngs: nnx.Rngs,
        sequence_parallel: bool = False,
        dtype: Any = jnp.float32,
        calibration: tj.calibration.Calibration | None = None,
        overlap: bool | frozenset[str] = False,
        remat: str = "none",
    ):
        """
        Args:
          config: `models.GPT2Config` or `models.Qwen2Config`.
          mesh: (data, pipe, tensor) mesh from `taco_jax.make_mesh`, pipe = 1; the
            parameters are born on it.
          taco: compression of the tensor-parallel collectives: a `TacoConfig`, or a
            preset name as the trainer's `--taco` takes it (`TacoConfig.preset(name)`,
            e.g. "taco+").
          rngs: `nnx.Rngs` for initialization (`models.init_params` with its params key).
          sequence_parallel: norms and residuals on sequence shards over "tensor".
          dtype: compute dtype of the matmuls (parameters stay float32).
          calibration: per-site channel permutations / transform decisions (and, with
            `taco.fewer_bits`, formats) from `taco_jax.calibration.calibrate`. A `taco`
            with `fewer_bits` (taco+mixed) and no calibration warns once a process and
            runs as its own formats (taco+): it does not raise, because that
            uncalibrated model is the one calibration observes.
          overlap: True (every site of `models.layers.OVERLAP_SITES`) or a set of those
            sites: their tensor-parallel matmuls and collectives as collective matmuls.
          remat: activation checkpointing of each layer ("none", "dots", "block").

        Raises:
          ValueError: a pipelined mesh; the tensor axis does not divide the heads, kv
            heads, MLP width or padded vocabulary; an overlap that is not a bool or a set
            of overlap sites; an unknown remat policy; an unknown preset name.
          TypeError: `taco` neither a `TacoConfig` nor a preset name.
        """
        if mesh.shape[PIPE_AXIS] != 1:
            raise ValueError(
                f"the NNX Transformer runs without a pipeline (pipe=1), got pipe={mesh.shape[PIPE_AXIS]}; "
                "the trainer (train.pipeline) runs pipelined meshes"
            )
        check_tensor_parallel(config, mesh.shape[TENSOR_AXIS])
        taco = transformer.taco_config(taco)
        _warn_uncalibrated(taco, calibration)
        self.config, self.mesh = config, mesh
        self.parallelism = transformer.Parallelism(
            taco=taco,
            sequence_parallel=sequence_parallel,
            compute_dtype=dtype,
            calibration=calibration if calibration is not None else tj.calibration.Calibration(),
            overlap=overlap,
            remat=remat,
        )
        params = _placed(init_params(config, rngs.params(), mesh), config, mesh)
        self.embed, self.layers, self.final = (_as_params(params[group]) for group in _GROUPS)

    @property
    def taco(self) -> tj.TacoConfig:
        """The `TacoConfig` of the tensor-parallel collectives."""
        return self.parallelism.taco

    def _params(self) -> dict:
        return {group: {name: p[...] for name, p in getattr(self, group).items()} for group in _GROUPS}

    def _run(self, local, tokens: jax.Array, out_specs: P) -> jax.Array:
        """`local(params, tokens)` per shard: the parameters by their partition specs,
        the batch over "data" where it splits."""
        batch = P(tj.mesh.data_axis(self.mesh, tokens.shape[0]))
        # The stacked layers' split over "pipe" is no split here (pipe = 1); naming it
        # would mark them varying over "pipe" under check_vma.
        unpiped = lambda spec: P(*(None if axis == PIPE_AXIS else axis for axis in spec))
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(jax.tree.map(unpiped, partition_specs(self.config)), batch),
            out_specs=out_specs if out_specs == P() else P(*batch, *out_specs[1:]),
            check_vma=True,
        )(self._params(), tokens)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits of the next token.

        Args:
          tokens: (B, S) int token ids, S ≤ max_positions (and divisible by the tensor axis
            with sequence parallelism).

        Returns:
          float32 (B, S, vocab_size).

        Raises:
          ValueError: ids that are not integers (or, when concrete, outside the
            vocabulary); a sequence too long, or not divisible with sequence parallelism.
        """
        check_token_ids(tokens, self.config)
        config, par = self.config, self.parallelism
        logits = self._run(lambda p, t: transformer.local_logits(config, p, t, par), tokens, P(None, None, TENSOR_AXIS))
        return logits[..., : config.vocab_size]

    def loss(self, tokens: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy, as the trainer computes it: vocabulary-parallel
        (no rank holds full-vocabulary logits), averaged over the batch.

        Args:
          tokens: (B, S + 1) int token ids; predicts tokens[:, 1:] from tokens[:, :-1].

        Returns:
          Scalar float32 loss.

        Raises:
          ValueError: as `__call__`.
        """
        check_token_ids(tokens, self.config)
        config, par = self.config, self.parallelism

        def local(params, ids):
            return lax.pmean(transformer.cross_entropy(config, params, ids, par), DATA_AXIS)

        return self._run(local, tokens, P())


def functional_params(model: Transformer) -> dict:
    """The module's parameters as `models.init_params` gives them (the same arrays), for
    `models.generate`, the trainer's checkpoints and the other functional entry points."""
    return nnx.state(model, nnx.Param).to_pure_dict()


def _check_layout(config: ModelConfig, params: Any) -> None:
    if isinstance(params, Mapping) and "blocks" in params:
        raise ValueError(
            "these parameters are the per-block state of the earlier NNX modules; convert them with "
            "models.flax_modules.params_from_blocks(config, state) and pass the result"
        )
    check_params(config, params)


def from_params(
    config: ModelConfig, params: dict, *, mesh: Mesh, taco: tj.TacoConfig | str, **kwargs: Any
) -> Transformer:
    """A `Transformer` holding `params` (from `models.init_params`, `models.load_hf` or a
    trainer checkpoint).

    Args:
      config: the model configuration.
      params: functional parameters (host or device).
      mesh: as `Transformer`.
      taco: as `Transformer`.
      **kwargs: as `Transformer` (sequence_parallel, dtype, calibration, overlap, remat).

    Returns:
      The module, its parameters float32 and placed on `mesh` with their partitioning.

    Raises:
      ValueError: parameters of another layout, shape or dtype (one error naming each
        parameter, its shape and the layout's; the earlier per-block state names its
        conversion), and as `Transformer`.
    """
    _check_layout(config, params)
    # Shapes and shardings only: no random initialization to throw away.
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: Transformer(config, mesh=mesh, taco=taco, rngs=nnx.Rngs(0), **kwargs))
    )
    as_float32 = jax.tree.map(lambda value: jnp.asarray(value, jnp.float32), params)
    nnx.replace_by_pure_dict(state, _placed(as_float32, config, mesh))
    return nnx.merge(graphdef, state)


def generate(model: Transformer, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    """`models.generate` with the module's parameters, mesh and compression.

    Args:
      model: a `Transformer`.
      prompts: token id lists, of any lengths.
      **kwargs: as `models.generate` (max_new_tokens, temperature, top_k, top_p, seed,
        eos_id, decode_taco, dtype; taco defaults to the module's).

    Returns:
      One list of new token ids per prompt.

    Raises:
      ValueError: as `models.generate`.
    """
    kwargs.setdefault("taco", model.taco)
    return functional_generate(model.config, functional_params(model), prompts, mesh=model.mesh, **kwargs)


def params_from_blocks(config: ModelConfig, state: dict) -> dict:
    """Convert the parameter state of the earlier per-block NNX modules (`blocks` of
    `attn_in`, `attn_out`, `mlp_in`, `mlp_out`, `norm1`, `norm2`; fused, head-major
    projections) to the functional layout that `from_params` takes.

    Args:
      config: the model configuration.
      state: that module's `nnx.state(model, nnx.Param).to_pure_dict()` (block keys as
        ints or strings, as a restored checkpoint gives them).

    Returns:
      Nested dict of arrays as `models.init_params` gives them.

    Raises:
      ValueError: a state of other keys, shapes or dtypes than `config` implies (one
        error naming each parameter, its shape and the expected one).
    """
    L, d, hd = config.n_layers, config.d_model, head_dim(config)
    if isinstance(state, Mapping) and isinstance(state.get("blocks"), Mapping):
        state = {**state, "blocks": {str(i): block for i, block in state["blocks"].items()}}
    check_arrays(_block_shapes(config), state, what="per-block state", against=f"the {config.family} per-block modules")
    per_layer = jax.tree.map(lambda *a: jnp.stack(a), *[state["blocks"][str(i)] for i in range(L)])
    attn_in, mlp_in = per_layer["attn_in"], per_layer["mlp_in"]
    norm = lambda group, name: {f"{name}_{key}": value for key, value in group.items()}
    stacked = {
        **norm(per_layer["norm1"], "norm1"),
        **norm(per_layer["norm2"], "norm2"),
        "out_kernel": per_layer["attn_out"]["kernel"].reshape(L, config.n_heads, hd, d),
    }
    if config.family == "gpt2":
        h = config.n_heads
        stacked |= {
            "qkv_kernel": jnp.transpose(attn_in["kernel"].reshape(L, d, h, 3, hd), (0, 1, 3, 2, 4)),
            "qkv_bias": jnp.transpose(attn_in["bias"].reshape(L, h, 3, hd), (0, 2, 1, 3)),
            "out_bias": per_layer["attn_out"]["bias"],
            "fc_kernel": mlp_in["kernel"],
            "fc_bias": mlp_in["bias"],
            "proj_kernel": per_layer["mlp_out"]["kernel"],
            "proj_bias": per_layer["mlp_out"]["bias"],
        }
    else:
        kv = config.n_kv_heads
        per_kv = config.n_heads // kv
        kernel = attn_in["kernel"].reshape(L, d, kv, per_kv + 2, hd)
        bias = attn_in["bias"].reshape(L, kv, per_kv + 2, hd)
        gate_up = mlp_in["kernel"].reshape(L, d, config.d_ff, 2)
        stacked |= {
            "q_kernel": kernel[..., :per_kv, :].reshape(L, d, config.n_heads, hd),
            "k_kernel": kernel[..., per_kv, :],
            "v_kernel": kernel[..., per_kv + 1, :],
            "q_bias": bias[..., :per_kv, :].reshape(L, config.n_heads, hd),
            "k_bias": bias[..., per_kv, :],
            "v_bias": bias[..., per_kv + 1, :],
            "gate_kernel": gate_up[..., 0],
            "up_kernel": gate_up[..., 1],
            "down_kernel": per_layer["mlp_out"]["kernel"],
        }
    params = {"embed": {"tokens": state["embed"]}, "layers": stacked, "final": norm(state["final_norm"], "norm")}
    if config.family == "gpt2":
        params["embed"]["positions"] = state["positions"]
    if not config.tie_embeddings:
        params["final"]["head"] = state["head"]
    return params


def _block_shapes(config: ModelConfig) -> dict:
    """The shapes of the earlier per-block modules' state (fused q/k/v projection, head-major;
    fused gate/up projection for Qwen2)."""
    d, f, attention = config.d_model, config.d_ff, config.n_heads * head_dim(config)
    gpt2 = config.family == "gpt2"
    vocab = (padded_vocab(config), d)

    def linear(n_in: int, n_out: int, bias: bool) -> dict:
        return {"kernel": (n_in, n_out)} | ({"bias": (n_out,)} if bias else {})

    norm = {"scale": (d,)} | ({"bias": (d,)} if gpt2 else {})
    block = {
        "attn_in": linear(d, attention + 2 * config.n_kv_heads * head_dim(config), bias=True),
        "attn_out": linear(attention, d, bias=gpt2),
        "mlp_in": linear(d, f if gpt2 else 2 * f, bias=gpt2),
        "mlp_out": linear(f, d, bias=gpt2),
        "norm1": norm,
        "norm2": norm,
    }
    state = {"blocks": {str(i): block for i in range(config.n_layers)}, "embed": vocab, "final_norm": norm}
    if gpt2:
        state["positions"] = (config.max_positions, d)
    if not config.tie_embeddings:
        state["head"] = vocab
    return state
