"""Per-shard forward pass of GPT-2 and Qwen2 with Megatron tensor parallelism.

Runs inside `jax.shard_map(..., check_vma=False)` over a mesh with a "tensor" axis (see
`models.api` for the wrappers). Every tensor-parallel collective goes through
`taco_jax.tp` with the model's `TacoConfig` and a site name; the layers are scanned, so a
site named "layers.*" stands for that call in every layer.

Without sequence parallelism activations are replicated over "tensor"; with it, norms
and residuals run on sequence shards (axis 1) and the blocks gather / reduce-scatter
around their column- and row-parallel matmuls.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
from jax import lax

import taco_jax as tj
from taco_jax import accounting
from taco_jax.collectives import record_plain_all_reduce
from taco_jax.mesh import TENSOR_AXIS
from taco_jax.message import remat_policy

from . import layers
from .config import ModelConfig, Qwen2Config, padded_vocab

_UNCOMPRESSED = tj.TacoConfig.preset("off")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How a forward pass is split.

    Attributes:
      taco: compression of the tensor-parallel collectives.
      sequence_parallel: norms and residuals on sequence shards.
      compute_dtype: dtype of matmul inputs and activations (parameters stay float32).
      compressed_residuals: with sequence parallelism and compression on, keep the
        gathered input of column-parallel layers for the backward pass in its 8-bit
        wire form (`taco_jax.tp.gather_matmul`) instead of decoded.
      calibration: per-site channel permutations and transform decisions
        (`taco_jax.calibration`); empty = identity before calibration.
      overlap: True (every site of `layers.OVERLAP_SITES`) or a set of those sites: run
        their tensor-parallel matmuls as collective matmuls
        (`taco_jax.collective_matmul`: one message per peer, each chunk's matmul beside
        the other chunks' transfers): with sequence parallelism the all-gather -> column
        matmul and the row matmul -> reduce-scatter, without it the row matmul ->
        all-reduce and the column matmul's backward all-reduce.
      remat: activation checkpointing of each layer: "none" (keep what autodiff
        needs), "dots" (keep the matmul outputs, recompute the rest) or "block"
        (keep only each layer's input, recompute the layer in the backward pass); both
        keep what the layer's collectives received (`message.remat_policy`).
      scan_layers: run the stacked layers as one `lax.scan` loop instead of unrolled.
        Unrolled (the default) compiles each layer separately, so compile time grows
        with depth, but the step is faster: a scan stacks what each layer keeps for the
        backward pass into zero-filled (layers, ...) buffers and copies each layer's
        slice back out, about 12% of a one-H200 step of a 16-layer model
        (`benchmarks/RESULTS.md`).
    """

    taco: tj.TacoConfig = tj.TacoConfig.preset("off")
    sequence_parallel: bool = False
    compute_dtype: jnp.dtype = jnp.float32
    compressed_residuals: bool = True
    calibration: tj.calibration.Calibration = tj.calibration.Calibration()
    remat: str = "none"
    overlap: bool | frozenset[str] = False
    scan_layers: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "overlap", layers.check_overlap(self.overlap))
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat policy {self.remat!r}; expected one of {list(REMAT_POLICIES)}")


def taco_config(value: tj.TacoConfig | str | None, argument: str = "taco") -> tj.TacoConfig:
    """The `TacoConfig` an entry point's `argument` names: a `TacoConfig` as it is, a
    preset name as `TacoConfig.preset(name)` (the trainer's `--taco` names, with their
    default `min_bytes`), None as mode "off" (uncompressed).

    Raises:
      TypeError: any other type (naming `argument`).
      ValueError: an unknown preset name (naming `argument`).
    """
    if value is None:
        return tj.TacoConfig.preset("off")
    if isinstance(value, tj.TacoConfig):
        return value
    if isinstance(value, str):
        try:
            return tj.TacoConfig.preset(value)
        except ValueError as error:
            raise ValueError(f"{argument}: {error}") from None
    raise TypeError(
        f"{argument} must be a taco_jax.TacoConfig, a preset name ({', '.join(tj.PRESETS)}) or None, "
        f"got {type(value).__name__}"
    )


# What a layer keeps for its backward pass (jax.checkpoint policies); None = no remat.
# Both keep what the collectives received (`message.remat_policy`): recomputing a layer
# sends nothing again.
REMAT_POLICIES = {
    "none": None,
    "dots": remat_policy(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    "block": remat_policy(None),
}


def _column_parallel(x, kernels: tuple, par: Parallelism, site: str) -> tuple:
    """`x @ kernel` for kernels (D, ...) sharded on their output axes, entering the
    tensor-parallel region (Megatron f / the sequence-parallel all-gather)."""
    flat = tuple(k.reshape(k.shape[0], -1).astype(par.compute_dtype) for k in kernels)
    overlap = layers.overlaps(par.overlap, site)
    options: dict[str, typing.Any] = dict(site=site, calibration=par.calibration)
    if not par.sequence_parallel:
        outputs = tj.tp.copy_matmul(x, flat, TENSOR_AXIS, par.taco, overlap=overlap, **options)
    elif par.compressed_residuals or overlap:
        outputs = tj.tp.gather_matmul(x, flat, TENSOR_AXIS, par.taco, axis=1, overlap=overlap, **options)
    else:
        h = tj.tp.gather_from_sp(x, TENSOR_AXIS, par.taco, axis=1, **options)
        outputs = tuple(h @ k for k in flat)
    return tuple(o.reshape(*o.shape[:-1], *k.shape[1:]) for o, k in zip(outputs, kernels))


def _leave(x, par: Parallelism, site: str):
    """Sum of row-parallel partial outputs (Megatron g / SP reduce-scatter)."""
    if par.sequence_parallel:
        return tj.tp.reduce_scatter_to_sp(x, TENSOR_AXIS, par.taco, axis=1, site=site, calibration=par.calibration)
    return tj.tp.reduce_from_tp(x, TENSOR_AXIS, par.taco, site=site, calibration=par.calibration)


def _row_parallel(x, kernel, par: Parallelism, site: str, contract: str | None = None):
    """`_leave` of the row-parallel matmul `x @ kernel` (or `einsum(contract, x,
    kernel)`); with `overlap`, one collective matmul over x and the kernel flattened to
    (F, D)."""
    if layers.overlaps(par.overlap, site):
        flat_x, flat_kernel = x.reshape(*x.shape[:2], -1), kernel.reshape(-1, kernel.shape[-1])
        options: dict[str, typing.Any] = dict(site=site, calibration=par.calibration, overlap=True)
        if par.sequence_parallel:
            return tj.tp.matmul_reduce_scatter(flat_x, flat_kernel, TENSOR_AXIS, par.taco, axis=1, **options)
        return tj.tp.matmul_all_reduce(flat_x, flat_kernel, TENSOR_AXIS, par.taco, **options)
    return _leave(x @ kernel if contract is None else jnp.einsum(contract, x, kernel), par, site)


def _norm(config: ModelConfig, x, layer: dict, name: str):
    return layers.norm(config, x, layer[f"{name}_scale"], layer.get(f"{name}_bias"))


def _qkv(config: ModelConfig, layer: dict, x, positions, par: Parallelism):
    """This rank's query, key and value heads (B, S, heads, hd), rotary applied (Qwen2)
    at `positions` ((S,), or (B, S) per sequence)."""
    c = lambda w: w.astype(par.compute_dtype)
    if not isinstance(config, Qwen2Config):
        (qkv,) = _column_parallel(x, (layer["qkv_kernel"],), par, layers.SITE_ATTN_IN)
        qkv = qkv + c(layer["qkv_bias"])
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        kernels = (layer["q_kernel"], layer["k_kernel"], layer["v_kernel"])
        q, k, v = (
            out + c(layer[f"{n}_bias"]) for out, n in zip(_column_parallel(x, kernels, par, layers.SITE_ATTN_IN), "qkv")
        )
        q, k = layers.rotary(q, positions, config.rope_theta), layers.rotary(k, positions, config.rope_theta)
    return q, k, v


def _mlp_block(config: ModelConfig, layer: dict, x, par: Parallelism):
    c = lambda w: w.astype(par.compute_dtype)
    if config.family == "gpt2":
        (hidden,) = _column_parallel(x, (layer["fc_kernel"],), par, layers.SITE_MLP_IN)
        return layers.gpt2_mlp_activation(hidden + c(layer["fc_bias"])), c(layer["proj_kernel"])
    gate, up = _column_parallel(x, (layer["gate_kernel"], layer["up_kernel"]), par, layers.SITE_MLP_IN)
    return layers.swiglu(gate, up), c(layer["down_kernel"])


def _block(config: ModelConfig, par: Parallelism, x, layer: dict, positions, attention=layers.causal_attention):
    """One transformer layer; `attention(q, k, v)` attends (causally over the sequence
    by default; generation passes one that also reads and writes a KV cache)."""
    dtype = par.compute_dtype
    attended = attention(*_qkv(config, layer, _norm(config, x, layer, "norm1"), positions, par))
    out = _row_parallel(attended, layer["out_kernel"].astype(dtype), par, layers.SITE_ATTN_OUT, "bshe,hed->bsd")
    if config.family == "gpt2":
        out = out + layer["out_bias"].astype(dtype)
    x = x + out
    activation, kernel = _mlp_block(config, layer, _norm(config, x, layer, "norm2"), par)
    out = _row_parallel(activation, kernel, par, layers.SITE_MLP_OUT)
    if config.family == "gpt2":
        out = out + layer["proj_bias"].astype(dtype)
    return x + out


def _vocab_range(config: ModelConfig) -> tuple[jax.Array, int]:
    local = padded_vocab(config) // lax.axis_size(TENSOR_AXIS)
    return lax.axis_index(TENSOR_AXIS) * local, local


def _embed(config: ModelConfig, params: dict, tokens, par: Parallelism, positions=None):
    """Vocabulary-parallel embedding: each rank looks up its rows, the partial sums are
    reduced (the sequence-parallel variant leaves each rank its sequence shard). GPT-2
    adds its position rows: `positions` ((B, S) per sequence), or the sequence's own."""
    start, _ = _vocab_range(config)
    rows = layers.vocab_rows(params["embed"]["tokens"], tokens, start)
    x = _leave(rows.astype(par.compute_dtype), par, layers.SITE_EMBED)
    if config.family == "gpt2":
        positions = _local_positions(tokens.shape[1], par) if positions is None else positions
        x = x + jnp.take(params["embed"]["positions"], positions, axis=0).astype(par.compute_dtype)
    return x


def _local_positions(length: int, par: Parallelism):
    if not par.sequence_parallel:
        return jnp.arange(length)
    shard = length // lax.axis_size(TENSOR_AXIS)
    return lax.axis_index(TENSOR_AXIS) * shard + jnp.arange(shard)


def check_sequence(config: ModelConfig, length: int, par: Parallelism) -> None:
    """Raise ValueError unless a sequence of `length` fits the model and the mesh."""
    if par.sequence_parallel and length % lax.axis_size(TENSOR_AXIS):
        raise ValueError(
            f"sequence length {length} is not divisible by the tensor axis size {lax.axis_size(TENSOR_AXIS)}"
        )
    if length > config.max_positions:
        raise ValueError(f"sequence length {length} exceeds max_positions {config.max_positions}")


def embed(config: ModelConfig, params: dict, tokens, par: Parallelism):
    """Input activations (B, S, D), or (B, S / tp, D) with sequence parallelism."""
    check_sequence(config, tokens.shape[1], par)
    return _embed(config, params, tokens, par)


def run_layers(config: ModelConfig, layers: dict, x, par: Parallelism):
    """Apply the stacked `layers` (leading axis = layers) in order: a `lax.scan`, fully
    unrolled unless `par.scan_layers`."""
    positions = jnp.arange(x.shape[1] * (lax.axis_size(TENSOR_AXIS) if par.sequence_parallel else 1))

    def step(carry, layer):
        return _block(config, par, carry, layer, positions), None

    policy = REMAT_POLICIES[par.remat]
    if policy is not None:
        step = jax.checkpoint(step, policy=policy)
    with accounting.repeated(jax.tree.leaves(layers)[0].shape[0]):
        return lax.scan(step, x, layers, unroll=not par.scan_layers)[0]


def final_norm(config: ModelConfig, params: dict, x):
    final = params["final"]
    return layers.norm(config, x, final["norm_scale"], final.get("norm_bias"))


def hidden_states(config: ModelConfig, params: dict, tokens, par: Parallelism):
    """Final normalized hidden states (B, S, D), or (B, S / tp, D) with sequence parallelism.

    Raises:
      ValueError: the sequence does not split over the tensor axis (sequence parallel),
        or is longer than the position table.
    """
    x = run_layers(config, params["layers"], embed(config, params, tokens, par), par)
    return final_norm(config, params, x)


def logits_from_hidden(config: ModelConfig, params: dict, hidden, par: Parallelism):
    """This rank's vocabulary slice of the logits in the compute dtype (B, S, V_padded /
    tp); padded vocabulary entries are the dtype's lowest value."""
    head = params["embed"]["tokens"] if config.tie_embeddings else params["final"]["head"]
    (logits,) = _column_parallel(hidden, (head.T,), par, layers.SITE_HEAD_IN)
    start, local = _vocab_range(config)
    valid = start + jnp.arange(local) < config.vocab_size
    return jnp.where(valid, logits, jnp.finfo(logits.dtype).min)


def local_logits(config: ModelConfig, params: dict, tokens, par: Parallelism):
    """`logits_from_hidden` of `hidden_states`, float32."""
    return logits_from_hidden(config, params, hidden_states(config, params, tokens, par), par).astype(jnp.float32)


def loss_from_hidden(config: ModelConfig, params: dict, hidden, targets, par: Parallelism):
    """Mean cross-entropy of `targets` (B, S) from final hidden states, with
    vocabulary-parallel logits: no rank ever holds the full-vocabulary logits, and the
    logits stay in the compute dtype (the float32 statistics are reductions XLA fuses
    with the upcast, so no float32 copy of the logits is stored).

    Returns:
      Scalar float32 loss, identical on every tensor rank.
    """
    logits = logits_from_hidden(config, params, hidden, par)
    peak = lax.stop_gradient(logits.max(-1)).astype(jnp.float32)
    _record_loss_statistic(peak, layers.SITE_LOSS_PEAK)
    peak = lax.pmax(peak, TENSOR_AXIS)
    sum_exp = _sum_loss_statistic(
        jnp.exp(logits.astype(jnp.float32) - peak[..., None]).sum(-1), layers.SITE_LOSS_SUM_EXP
    )
    start, local = _vocab_range(config)
    offset = targets - start
    mine = (offset >= 0) & (offset < local)
    picked = jnp.take_along_axis(logits, jnp.where(mine, offset, 0)[..., None], axis=-1)[..., 0].astype(jnp.float32)
    target_logit = _sum_loss_statistic(jnp.where(mine, picked, 0.0), layers.SITE_LOSS_TARGET)
    return jnp.mean(jnp.log(sum_exp) + peak - target_logit)


# Why the loss's statistics go uncompressed whatever the config: one float32 per token
# (a d_model-th of an activation message), and any codec error would be the loss's own.
LOSS_STATISTIC_REASON = "a per-token loss statistic: small, kept exact"


def _record_loss_statistic(x: jax.Array, site: str) -> None:
    """Enter the exact all-reduce of `x` over the tensor axis in the wire ledger, with
    `LOSS_STATISTIC_REASON`."""
    record_plain_all_reduce(x, TENSOR_AXIS, site=site, reason=LOSS_STATISTIC_REASON)


def _sum_loss_statistic(x: jax.Array, site: str) -> jax.Array:
    """`x` summed exact over the vocabulary shards (the tensor axis); identity backward
    (each rank differentiates its own copy of the loss)."""
    _record_loss_statistic(x, site)
    with accounting.paused():  # recorded above, with its reason
        return tj.tp.reduce_from_tp(x, TENSOR_AXIS, _UNCOMPRESSED)


def cross_entropy(config: ModelConfig, params: dict, tokens, par: Parallelism):
    """Mean next-token cross-entropy of this rank's batch.

    Args:
      tokens: (B, S + 1) int token ids; predicts tokens[:, 1:] from tokens[:, :-1].

    Returns:
      Scalar float32 loss, identical on every tensor rank.
    """
    hidden = hidden_states(config, params, tokens[:, :-1], par)
    return loss_from_hidden(config, params, hidden, tokens[:, 1:], par)
