"""The model math of the per-shard transformer (`models.transformer`, which the trainer,
generation and the NNX module `models.flax_modules.Transformer` run): norms, rotary
embedding, causal attention, the MLP activations and the vocabulary-parallel lookup.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax.kernels import jax_compat
from taco_jax.mesh import simulating

from .config import ModelConfig

# The compressed call sites: calibration plans and the wire ledger are keyed by them. A "layers.*" site stands for its call in every
# (scanned) layer.
SITE_EMBED = "embed"
SITE_ATTN_IN = "layers.attn.in"
SITE_ATTN_OUT = "layers.attn.out"
SITE_MLP_IN = "layers.mlp.in"
SITE_MLP_OUT = "layers.mlp.out"
SITE_HEAD_IN = "head.in"
# The loss's per-token statistics, summed exact over the vocabulary shards (not compressed).
SITE_LOSS_PEAK = "loss.peak"
SITE_LOSS_SUM_EXP = "loss.sum_exp"
SITE_LOSS_TARGET = "loss.target_logit"
# The sites whose matmul and collective can run as a collective matmul (`overlap`).
OVERLAP_SITES = (SITE_ATTN_IN, SITE_ATTN_OUT, SITE_MLP_IN, SITE_MLP_OUT, SITE_HEAD_IN)


def check_overlap(overlap: bool | frozenset[str]) -> bool | frozenset[str]:
    """`overlap` as the models take it: True / False for every site, or a set of
    `OVERLAP_SITES` (those sites only).

    Raises:
      ValueError: anything else, or a name that is not an overlap site.
    """
    if isinstance(overlap, bool):
        return overlap
    if not isinstance(overlap, frozenset | set | tuple | list) or not all(isinstance(s, str) for s in overlap):
        raise ValueError(f"overlap must be a bool or a set of site names, got {overlap!r}")
    unknown = sorted(set(overlap) - set(OVERLAP_SITES))
    if unknown:
        raise ValueError(f"overlap names unknown sites {unknown}; the sites are {list(OVERLAP_SITES)}")
    return frozenset(overlap)


def overlaps(overlap: bool | frozenset[str], site: str) -> bool:
    """Whether `site` runs as a collective matmul under `overlap` (`check_overlap`'s)."""
    return overlap if isinstance(overlap, bool) else site in overlap


# The norms and the MLP activations are recomputed in the backward pass from their
# inputs (`jax.checkpoint`), which is all the backward keeps of them, instead of saving
# their float32 and elementwise intermediates: on an H200 the step ran faster and with
# GiBs less of temporaries (`benchmarks/RESULTS.md`).


@functools.partial(jax.checkpoint, static_argnums=3)
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, statistics in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


@functools.partial(jax.checkpoint, static_argnums=2)
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * scale).astype(x.dtype)


def norm(config: ModelConfig, x: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
    """The family's norm: LayerNorm for GPT-2, RMSNorm (no bias) for Qwen2."""
    if config.family == "gpt2":
        return layer_norm(x, scale, bias, config.norm_eps)
    return rms_norm(x, scale, config.norm_eps)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in HF's rotate-half layout. x: (B, S, heads, hd), positions: (S,)
    or (B, S) (each sequence at its own positions, as in cached decoding)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, half, dtype=np.float32) / half))
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    lead = (None,) if positions.ndim == 1 else ()
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[(*lead, ..., None, slice(None))]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[(*lead, ..., None, slice(None))]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


_FLASH_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def flash_eligible(q: jax.Array) -> bool:
    """Whether cuDNN flash attention takes these queries: 16-bit, a head size it takes,
    and not on a simulated mesh (cuDNN's backward pass cannot be batched over the
    vmapped mesh axes)."""
    return jnp.dtype(q.dtype) in _FLASH_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128 and not simulating()


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention (B, S, heads, hd) with `jax.nn.dot_product_attention`; k/v may
    have fewer heads (grouped queries: query head i reads kv head i // (heads / kv heads)).
    cuDNN flash attention where the program is lowered for a CUDA GPU and
    `flash_eligible` (no (B, heads, S, S) scores in memory), XLA's attention elsewhere."""

    def attention(implementation):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    if not flash_eligible(q):
        return attention("xla")(q, k, v)
    return jax_compat.on_cuda(attention("cudnn"), attention("xla"), q, k, v)


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, valid: jax.Array) -> jax.Array:
    """Attention of queries (B, S, heads, hd) over a KV cache (B, T, kv heads, hd),
    reading the cache entries where `valid` (B, S, T) holds (grouped queries as in
    `causal_attention`)."""
    return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=valid[:, None], implementation="xla")


@jax.checkpoint
def gpt2_mlp_activation(hidden: jax.Array) -> jax.Array:
    """GPT-2's tanh-approximated GELU."""
    return jax.nn.gelu(hidden, approximate=True)


@jax.checkpoint
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Qwen2's gated MLP activation."""
    return jax.nn.silu(gate) * up


def vocab_rows(table: jax.Array, tokens: jax.Array, start: jax.Array | int) -> jax.Array:
    """Embedding rows of `tokens` from a vocabulary shard starting at `start`; tokens of
    other shards get zero rows (summing the shards' results gives the full lookup)."""
    offset = tokens - start
    mine = (offset >= 0) & (offset < table.shape[0])
    rows = jnp.take(table, jnp.where(mine, offset, 0), axis=0)
    return jnp.where(mine[..., None], rows, 0.0)
