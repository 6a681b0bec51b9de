"""GPT-2 and Qwen2 as Flax NNX modules on global arrays, built from `taco_jax.flax`'s
parallel layers: use them under plain `jax.jit` / `nnx.jit` with the batch sharded over
"data", and train them in your own nnx + optax loop.

The model math (norms, rotary, attention, activations, vocabulary lookup) is
`models.layers`, shared with the per-shard transformer the trainer runs; the two differ
only in where the collectives sit. Fused projections keep their columns head-major
(GPT-2 qkv as (heads, 3, hd); Qwen2 as (kv heads, queries per kv head + k + v, hd); Qwen2
gate/up as (d_ff, 2)), so one column-parallel layer (one compressed collective) serves
each and the split over "tensor" gives every rank whole heads for any degree dividing
the heads. `from_params` loads `models.init_params` / `models.load_hf` parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.flax import ColumnParallelLinear, ParallelDotGeneral, RowParallelLinear
from taco_jax.mesh import TENSOR_AXIS

from . import layers
from .config import ModelConfig, Qwen2Config, check_tensor_parallel, head_dim, padded_vocab
from .generate import generate as functional_generate

_INIT_STD = 0.02


def _param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    axes: tuple,
    mesh: Mesh,
    fill: float | None = None,
    std: float = _INIT_STD,
) -> nnx.Param:
    """A float32 parameter partitioned by `axes` on `mesh`: constant `fill`, or normal."""
    if fill is not None:
        value = jnp.full(shape, fill, jnp.float32)
    elif rngs is None:
        raise ValueError("a randomly initialized parameter needs rngs")
    else:
        value = std * jax.random.normal(rngs.params(), shape)
    return nnx.Param(value, out_sharding=axes, mesh=mesh)


class Norm(nnx.Module):
    """The family's norm (LayerNorm for GPT-2, RMSNorm for Qwen2), replicated."""

    def __init__(self, config: ModelConfig, mesh: Mesh):
        self.config = config
        self.scale = _param(None, (config.d_model,), (None,), mesh, fill=1.0)
        self.bias = _param(None, (config.d_model,), (None,), mesh, fill=0.0) if config.family == "gpt2" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return layers.norm(self.config, x, self.scale[...], None if self.bias is None else self.bias[...])


def attention_width(config: ModelConfig) -> int:
    """Output features of the fused column-parallel attention input projection."""
    if config.family == "gpt2":
        return 3 * config.n_heads * head_dim(config)
    return config.n_kv_heads * (config.n_heads // config.n_kv_heads + 2) * head_dim(config)


class Block(nnx.Module):
    """Pre-norm transformer block: attention and MLP, each a column-parallel input
    projection and a row-parallel output projection (sites as in the trainer)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        mesh: Mesh,
        taco: tj.TacoConfig,
        rngs: nnx.Rngs,
        sequence_parallel: bool,
        dtype: Any,
        calibration: tj.calibration.Calibration | None,
        overlap: bool | frozenset[str] = False,
    ):
        self.config = config
        gpt2 = config.family == "gpt2"
        common = dict(
            mesh=mesh,
            config=taco,
            rngs=rngs,
            sequence_parallel=sequence_parallel,
            dtype=dtype,
            calibration=calibration,
            kernel_init=jax.nn.initializers.normal(_INIT_STD),
        )
        residual = dict(common, kernel_init=jax.nn.initializers.normal(_INIT_STD / np.sqrt(2 * config.n_layers)))
        heads_width, d = config.n_heads * head_dim(config), config.d_model
        at = lambda site: dict(site=site, overlap=layers.overlaps(overlap, site))
        self.norm1, self.norm2 = Norm(config, mesh), Norm(config, mesh)
        self.attn_in = ColumnParallelLinear(d, attention_width(config), **at(layers.SITE_ATTN_IN), **common)
        self.attn_out = RowParallelLinear(heads_width, d, use_bias=gpt2, **at(layers.SITE_ATTN_OUT), **residual)
        mlp_width = config.d_ff if gpt2 else 2 * config.d_ff
        self.mlp_in = ColumnParallelLinear(d, mlp_width, use_bias=gpt2, **at(layers.SITE_MLP_IN), **common)
        self.mlp_out = RowParallelLinear(config.d_ff, d, use_bias=gpt2, **at(layers.SITE_MLP_OUT), **residual)

    def _heads(self, fused: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Split the fused projection (B, S, width) into q (B, S, H, hd), k and v."""
        config, hd = self.config, head_dim(self.config)
        if config.family == "gpt2":
            qkv = fused.reshape(*fused.shape[:2], config.n_heads, 3, hd)
            return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        per_kv = config.n_heads // config.n_kv_heads
        grouped = fused.reshape(*fused.shape[:2], config.n_kv_heads, per_kv + 2, hd)
        q = grouped[..., :per_kv, :].reshape(*fused.shape[:2], config.n_heads, hd)
        return q, grouped[..., per_kv, :], grouped[..., per_kv + 1, :]

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        q, k, v = self._heads(self.attn_in(self.norm1(x)))
        if isinstance(self.config, Qwen2Config):
            theta = self.config.rope_theta
            q, k = layers.rotary(q, positions, theta), layers.rotary(k, positions, theta)
        attended = layers.causal_attention(q, k, v)
        x = x + self.attn_out(attended.reshape(*attended.shape[:2], -1))
        hidden = self.mlp_in(self.norm2(x))
        if self.config.family == "gpt2":
            activated = layers.gpt2_mlp_activation(hidden)
        else:
            pairs = hidden.reshape(*hidden.shape[:-1], self.config.d_ff, 2)
            activated = layers.swiglu(pairs[..., 0], pairs[..., 1])
        return x + self.mlp_out(activated)


class Transformer(nnx.Module):
    """GPT-2 or Qwen2 (by `config.family`) with compressed tensor parallelism.

    Call it on global (B, S) int tokens (batch sharded over "data" or replicated) to get
    float32 logits (B, S, vocab_size), sharded over "tensor" on the vocabulary.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        mesh: Mesh,
        taco: tj.TacoConfig,
        rngs: nnx.Rngs,
        sequence_parallel: bool = False,
        dtype: Any = jnp.float32,
        calibration: tj.calibration.Calibration | None = None,
        overlap: bool | frozenset[str] = False,
    ):
        """
        Args:
          config: `models.GPT2Config` or `models.Qwen2Config`.
          mesh: (data, pipe, tensor) mesh from `taco_jax.make_mesh`; parameters are born on it.
          taco: `TacoConfig` of the tensor-parallel collectives.
          rngs: `nnx.Rngs` for initialization.
          sequence_parallel: norms and residuals on sequence shards over "tensor".
          dtype: compute dtype of the matmuls (parameters stay float32).
          calibration: per-site channel permutations / transform decisions.
          overlap: True (every site of `layers.OVERLAP_SITES`) or a set of those sites:
            their tensor-parallel matmuls and collectives as collective matmuls
            (`taco_jax.flax.ParallelDotGeneral`).

        Raises:
          ValueError: the tensor axis does not divide the heads, kv heads, MLP width or
            padded vocabulary; an overlap that is not a bool or a set of overlap sites.
        """
        check_tensor_parallel(config, mesh.shape[TENSOR_AXIS])
        self.config, self.mesh, self.taco = config, mesh, taco
        self.sequence_parallel, self.dtype, self.calibration = sequence_parallel, dtype, calibration
        self.overlap = layers.check_overlap(overlap)
        self.embed = _param(rngs, (padded_vocab(config), config.d_model), (TENSOR_AXIS, None), mesh)
        if config.family == "gpt2":
            self.positions = _param(rngs, (config.max_positions, config.d_model), (None, None), mesh)
        self.blocks = nnx.List(
            [
                Block(
                    config,
                    mesh=mesh,
                    taco=taco,
                    rngs=rngs,
                    sequence_parallel=sequence_parallel,
                    dtype=dtype,
                    calibration=calibration,
                    overlap=self.overlap,
                )
                for _ in range(config.n_layers)
            ]
        )
        self.final_norm = Norm(config, mesh)
        if not config.tie_embeddings:
            self.head = _param(rngs, (padded_vocab(config), config.d_model), (TENSOR_AXIS, None), mesh)

    def _lookup(self, tokens: jax.Array) -> jax.Array:
        """Vocabulary-parallel embedding: each rank looks up its rows, the partial sums
        are all-reduced (reduce-scattered over the sequence with sequence parallelism)."""
        batch = tj.mesh.data_axis(self.mesh, tokens.shape[0])
        out_spec = P(batch, TENSOR_AXIS if self.sequence_parallel else None, None)

        def island(table, ids):
            rows = layers.vocab_rows(table, ids, lax.axis_index(TENSOR_AXIS) * table.shape[0]).astype(self.dtype)
            site, calibration = layers.SITE_EMBED, self.calibration
            if self.sequence_parallel:
                return tj.tp.reduce_scatter_to_sp(
                    rows, TENSOR_AXIS, self.taco, axis=1, site=site, calibration=calibration
                )
            return tj.tp.reduce_from_tp(rows, TENSOR_AXIS, self.taco, site=site, calibration=calibration)

        return jax.shard_map(
            island, mesh=self.mesh, in_specs=(P(TENSOR_AXIS, None), P(batch, None)), out_specs=out_spec, check_vma=True
        )(self.embed[...], tokens)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits of the next token.

        Args:
          tokens: (B, S) int token ids, S ≤ max_positions (and divisible by the tensor axis
            with sequence parallelism).

        Returns:
          float32 (B, S, vocab_size).

        Raises:
          ValueError: a sequence too long, or not divisible with sequence parallelism.
        """
        length, tensor = tokens.shape[1], self.mesh.shape[TENSOR_AXIS]
        if length > self.config.max_positions:
            raise ValueError(f"sequence length {length} exceeds max_positions {self.config.max_positions}")
        if self.sequence_parallel and length % tensor:
            raise ValueError(f"sequence length {length} is not divisible by the tensor axis size {tensor}")
        x = self._lookup(tokens)
        if self.config.family == "gpt2":
            x = x + self.positions[:length].astype(self.dtype)
        positions = jnp.arange(length)
        for block in self.blocks:
            x = block(x, positions)
        x = self.final_norm(x)
        table = self.embed if self.config.tie_embeddings else self.head
        head = ParallelDotGeneral(
            self.mesh,
            self.taco,
            "column",
            layers.SITE_HEAD_IN,
            self.sequence_parallel,
            calibration=self.calibration,
            overlap=layers.overlaps(self.overlap, layers.SITE_HEAD_IN),
        )
        kernel = table[...].T.astype(self.dtype)
        logits = head(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return logits.astype(jnp.float32)[..., : self.config.vocab_size]


def nnx_params(config: ModelConfig, params: dict) -> dict:
    """Functional parameters (`models.layout`: stacked layers, heads as an axis) in the
    NNX modules' layout: a pure-state dict for `nnx.update`.

    Args:
      config: the model configuration.
      params: `models.init_params` / `models.load_hf` parameters (host or device).

    Returns:
      Nested dict of arrays matching `nnx.state(Transformer(...), nnx.Param)`.
    """
    L, d = config.n_layers, config.d_model
    stacked = params["layers"]
    flat = lambda a, *lead: jnp.reshape(a, (L, *lead, -1))
    if config.family == "gpt2":
        attn_kernel = flat(jnp.transpose(stacked["qkv_kernel"], (0, 1, 3, 2, 4)), d)
        attn_bias = flat(jnp.transpose(stacked["qkv_bias"], (0, 2, 1, 3)))
        mlp_in = dict(kernel=stacked["fc_kernel"], bias=stacked["fc_bias"])
        attn_out = dict(kernel=flat(stacked["out_kernel"], config.n_heads * head_dim(config)), bias=stacked["out_bias"])
        mlp_out = dict(kernel=stacked["proj_kernel"], bias=stacked["proj_bias"])
    else:
        hd, kv = head_dim(config), config.n_kv_heads
        grouped = lambda a, lead: jnp.reshape(a, (L, *lead, kv, -1, hd))
        attn_kernel = flat(
            jnp.concatenate(
                [
                    grouped(stacked["q_kernel"], (d,)),
                    grouped(stacked["k_kernel"], (d,)),
                    grouped(stacked["v_kernel"], (d,)),
                ],
                axis=-2,
            ),
            d,
        )
        attn_bias = flat(
            jnp.concatenate(
                [grouped(stacked["q_bias"], ()), grouped(stacked["k_bias"], ()), grouped(stacked["v_bias"], ())],
                axis=-2,
            )
        )
        mlp_in = dict(kernel=flat(jnp.stack([stacked["gate_kernel"], stacked["up_kernel"]], -1), d))
        attn_out = dict(kernel=flat(stacked["out_kernel"], config.n_heads * hd))
        mlp_out = dict(kernel=stacked["down_kernel"])
    per_layer = dict(
        attn_in=dict(kernel=attn_kernel, bias=attn_bias),
        attn_out=attn_out,
        mlp_in=mlp_in,
        mlp_out=mlp_out,
        norm1=_norm_params(stacked, "norm1"),
        norm2=_norm_params(stacked, "norm2"),
    )
    state = dict(
        embed=params["embed"]["tokens"],
        final_norm=_norm_params(params["final"], "norm"),
        blocks={i: jax.tree.map(lambda a: a[i], per_layer) for i in range(L)},
    )
    if config.family == "gpt2":
        state["positions"] = params["embed"]["positions"]
    if not config.tie_embeddings:
        state["head"] = params["final"]["head"]
    return state


def functional_params(model: Transformer) -> dict:
    """The module's parameters in the functional layout (`models.layout`): the inverse
    of `nnx_params`, for `models.generate` and the other functional entry points.

    Args:
      model: a `Transformer`.

    Returns:
      Nested dict of arrays as `models.init_params` gives them.
    """
    config, state = model.config, nnx.state(model, nnx.Param).to_pure_dict()
    L, d, hd = config.n_layers, config.d_model, head_dim(config)
    per_layer = jax.tree.map(lambda *a: jnp.stack(a), *[state["blocks"][i] for i in range(L)])
    attn_in, mlp_in = per_layer["attn_in"], per_layer["mlp_in"]
    stacked = {
        **_functional_norm(per_layer["norm1"], "norm1"),
        **_functional_norm(per_layer["norm2"], "norm2"),
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
    params = {
        "embed": {"tokens": state["embed"]},
        "layers": stacked,
        "final": _functional_norm(state["final_norm"], "norm"),
    }
    if config.family == "gpt2":
        params["embed"]["positions"] = state["positions"]
    if not config.tie_embeddings:
        params["final"]["head"] = state["head"]
    return params


def _functional_norm(norm: dict, name: str) -> dict:
    return {f"{name}_{key}": value for key, value in norm.items()}


def generate(model: Transformer, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    """`models.generate` with the module's parameters, mesh and compression (one
    implementation of the math: the functional model's KV-cache generation).

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


def _norm_params(group: dict, name: str) -> dict:
    return {"scale": group[f"{name}_scale"], **({"bias": group[f"{name}_bias"]} if f"{name}_bias" in group else {})}


def from_params(config: ModelConfig, params: dict, *, mesh: Mesh, taco: tj.TacoConfig, **kwargs: Any) -> Transformer:
    """A `Transformer` holding `params` (from `models.init_params` or `models.load_hf`).

    Args:
      config: the model configuration.
      params: functional parameters (host or device).
      mesh: as `Transformer`.
      taco: as `Transformer`.
      **kwargs: as `Transformer` (sequence_parallel, dtype, calibration, overlap).

    Returns:
      The module, its parameters placed on `mesh` with their partitioning.
    """
    # Shapes and shardings only: no random initialization to throw away.
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: Transformer(config, mesh=mesh, taco=taco, rngs=nnx.Rngs(0), **kwargs))
    )
    placed = jax.tree.map(
        lambda value, target: jax.device_put(jnp.asarray(value, jnp.float32), target.sharding),
        nnx_params(config, params),
        state.to_pure_dict(),
    )
    nnx.replace_by_pure_dict(state, placed)
    return nnx.merge(graphdef, state)
