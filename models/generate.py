"""Generation with a KV cache over the same tensor-parallel model (`models.transformer`).

A batch of prompts of different lengths is padded to one length bucket and prefilled in
one pass (its messages through the run's `TacoConfig`), which returns every layer's keys
and values in a cache sized for the prompts and their new tokens, a buffer per layer
sharded over "tensor" by (kv) heads. The layers run unrolled over weights placed once per
call in a buffer per layer, so every GEMM reads its weights where they lie. Then the
decode step feeds each sequence's last token at its own position, writes its keys and
values and attends over the cache; its messages are a few rows per layer (latency-bound)
and go uncompressed unless `decode_taco` says otherwise. The steps run on the device,
`DECODE_CHUNK` tokens per call of one compiled loop (the host only reads each chunk's
tokens and stops once every sequence has met its EOS), so a token costs no dispatch.
Greedy at temperature 0, else sampled (temperature, top-k, top-p) from a seeded key.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.mesh import DATA_AXIS, TENSOR_AXIS

from . import layers
from .api import _mesh_or_default
from .config import ModelConfig, check_tensor_parallel
from .params import partition_specs, shard_params
from .transformer import Parallelism, _block, _embed, final_norm, logits_from_hidden, taco_config

# Prompt lengths are padded up to a power of two at least this long, so prompts of
# similar lengths share one compiled prefill.
MIN_BUCKET = 16
# Decode steps per device call: the host checks for EOS between chunks, so a sequence
# runs at most DECODE_CHUNK - 1 steps past the last EOS (their tokens are dropped).
DECODE_CHUNK = 16


def _bucket(length: int, limit: int) -> int:
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), limit)


def _cache_spec(batch_axis: str | None) -> P:
    """One layer's keys or values (B, length, kv heads, head dim)."""
    return P(batch_axis, None, TENSOR_AXIS, None)


def _layer_specs(config: ModelConfig) -> dict:
    """`partition_specs` with "layers" as one dict per layer (the layer axis dropped)."""
    specs = partition_specs(config)
    layer = jax.tree.map(lambda spec: P(*spec[1:]), specs["layers"])
    return specs | {"layers": (layer,) * config.n_layers}


@functools.lru_cache(maxsize=8)
def _per_layer_placer(config: ModelConfig, mesh: Mesh, dtype: jnp.dtype):
    """Placed parameters -> the same in `dtype` with each layer's weights in buffers of
    their own, so that each step's GEMMs read them where they lie: a GEMM on a slice of
    the stacked weights (a scan over layers) has it copied out first, at every decode
    step (2.3x slower decode at 0.91B on an H200)."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), _layer_specs(config))

    def per_layer(params: dict) -> dict:
        cast = jax.tree.map(lambda w: w.astype(dtype), params)
        return cast | {"layers": tuple(jax.tree.map(lambda w: w[i], cast["layers"]) for i in range(config.n_layers))}

    return jax.jit(per_layer, out_shardings=shardings)


def _place(params: dict, config: ModelConfig, mesh: Mesh, dtype: jnp.dtype) -> dict:
    """`params` on `mesh` in `dtype` (cast once: every decode step reads all the
    weights), each layer's in buffers of its own."""
    return _per_layer_placer(config, mesh, dtype)(shard_params(params, config, mesh))


def _full_logits(config: ModelConfig, params: dict, hidden: jax.Array, par: Parallelism) -> jax.Array:
    """float32 logits (B, vocab_size) of hidden states (B, 1, D) on every rank."""
    local = logits_from_hidden(config, params, hidden, par)[:, 0].astype(jnp.float32)
    return lax.all_gather(local, TENSOR_AXIS, axis=1, tiled=True)[:, : config.vocab_size]


@dataclasses.dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_k: int
    top_p: float


def row_keys(key: jax.Array, rows: int) -> jax.Array:
    """The sampling keys (rows,) of this rank's rows, inside the shard_map: each row's is
    `key` folded with the row's index in the whole batch (its prompt's index), so that a
    prompt's draws depend on the seed, the step and its index, never on the mesh."""
    first = lax.axis_index(DATA_AXIS) * rows
    return jax.vmap(lambda row: jax.random.fold_in(key, row))(first + jnp.arange(rows))


def sample(logits: jax.Array, keys: jax.Array, *, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next tokens (B,) from float32 logits (B, V): argmax at temperature 0, else a draw
    from the softmax of logits / temperature restricted to the top_k tokens (0: all) and
    to the smallest set whose probability reaches top_p, row b drawn with keys[b]."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # Keep a token while the probability before it is under top_p (the first always).
        kept = jnp.cumsum(probs, axis=-1) - probs < top_p
        threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def _run_layers(config, params, x, positions, par, attend):
    """The layers, unrolled over the per-layer weights of `_place`, with
    `attend(layer_index, q, k, v) -> (out, k_cache, v_cache)`: (hidden, cache)."""
    written = []
    for index, layer in enumerate(params["layers"]):

        def attention(q, k, v, index=index):
            out, *kv = attend(index, q, k, v)
            written.append(tuple(kv))
            return out

        x = _block(config, par, x, layer, positions, attention)
    return x, tuple(written)


def _prefill_logits(config, par, cache_length, params, tokens, lengths):
    """Prompts (B, S) right-padded, their lengths (B,) -> (a cache of `cache_length`
    positions with [0, S) written, float32 next-token logits (B, vocab_size) at each
    prompt's end). The cache is born here, in buffers the decode steps then update."""

    def attend(index, q, k, v):
        pad = ((0, 0), (0, cache_length - k.shape[1]), (0, 0), (0, 0))
        return layers.causal_attention(q, k, v), jnp.pad(k, pad), jnp.pad(v, pad)

    x = _embed(config, params, tokens, par)
    hidden, cache = _run_layers(config, params, x, jnp.arange(tokens.shape[1]), par, attend)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
    return cache, _full_logits(config, params, final_norm(config, params, last), par)


def _prefill(config, par, sampling, cache_length, params, tokens, lengths, key):
    """`_prefill_logits`, then each prompt's first new token."""
    cache, logits = _prefill_logits(config, par, cache_length, params, tokens, lengths)
    return cache, sample(logits, row_keys(key, logits.shape[0]), **dataclasses.asdict(sampling))


def _decode(config, par, sampling, params, tokens, positions, cache, key):
    """Each sequence's last token (B,) at its position (B,) -> (cache with that position
    written, the next tokens)."""
    cached = jnp.arange(cache[0][0].shape[1])
    valid = (cached[None, :] <= positions[:, None])[:, None, :]
    write = jax.vmap(lambda c, new, at: lax.dynamic_update_slice_in_dim(c, new, at, axis=0))

    def attend(index, q, k, v):
        k_cache, v_cache = (write(c, new, positions) for c, new in zip(cache[index], (k, v), strict=True))
        return layers.cached_attention(q, k_cache, v_cache, valid), k_cache, v_cache

    x = _embed(config, params, tokens[:, None], par, positions[:, None])
    hidden, cache = _run_layers(config, params, x, positions[:, None], par, attend)
    logits = _full_logits(config, params, final_norm(config, params, hidden), par)
    return cache, sample(logits, row_keys(key, logits.shape[0]), **dataclasses.asdict(sampling))


def _decode_chunk(config, par, sampling, steps, params, tokens, positions, cache, key, first_step):
    """`steps` decode steps in one device loop from each sequence's last token (B,) at
    its position (B,): (cache, the tokens drawn (B, steps)). Step i samples with
    fold_in(key, first_step + i), as one call per step would."""

    def step(i, carry):
        cache, tokens, drawn = carry
        cache, tokens = _decode(
            config, par, sampling, params, tokens, positions + i, cache, jax.random.fold_in(key, first_step + i)
        )
        return cache, tokens, drawn.at[:, i].set(tokens)

    drawn = jnp.zeros((tokens.shape[0], steps), jnp.int32)
    cache, _, drawn = lax.fori_loop(0, steps, step, (cache, tokens, drawn))
    return cache, drawn


def _check(config: ModelConfig, prompts, max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token id lists")
    for index, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt {index} is empty or not a flat list of token ids")
        if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= config.vocab_size:
            raise ValueError(f"prompt {index} has token ids outside [0, {config.vocab_size})")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_positions:
        raise ValueError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
            f"max_positions {config.max_positions} (the cache length)"
        )
    _check_sampling(temperature, top_k, top_p)


def _check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_seed(seed: int) -> None:
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def _check_dtype(dtype) -> None:
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"dtype must be a floating-point dtype (the compute dtype), got {dtype!r}")


class _Batch:
    """Prompts padded to a length bucket (and the batch to a multiple of the data axis),
    the cache they need, and the shard_map every phase runs under."""

    def __init__(self, config: ModelConfig, mesh: Mesh, prompts, max_new_tokens: int):
        check_tensor_parallel(config, mesh.shape[TENSOR_AXIS])
        self.mesh, data = mesh, mesh.shape[DATA_AXIS]
        rows = -(-len(prompts) // data) * data
        lengths = np.array([len(p) for p in prompts] + [1] * (rows - len(prompts)), np.int32)
        tokens = np.zeros((rows, _bucket(int(lengths.max()), config.max_positions)), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        self.tokens, self.lengths = jnp.asarray(tokens), jnp.asarray(lengths)
        # The cache holds every prompt and its new tokens: (B, cache_length, kv heads, head dim).
        self.cache_length = _bucket(int(lengths.max()) + max_new_tokens, config.max_positions)
        self.batch_axis = DATA_AXIS if data > 1 else None

    def compiled(self, phase, config: ModelConfig, par: Parallelism, *static):
        """`phase(config, par, *static, params, rows, rows[, cache], scalars...)` as
        jit(shard_map), built once per configuration (later calls reuse its compilations)."""
        return _compiled(phase, config, par, static, self.mesh, self.batch_axis)


# Per phase: whether it takes the cache (then donated: updated in place), and how many
# replicated scalars follow (the key, the first step).
_ARGUMENTS = {_prefill_logits: (False, 0), _prefill: (False, 1), _decode_chunk: (True, 2)}


@functools.lru_cache(maxsize=32)
def _compiled(phase, config: ModelConfig, par: Parallelism, static: tuple, mesh: Mesh, batch_axis: str | None):
    takes_cache, scalars = _ARGUMENTS[phase]
    rows, cache = P(batch_axis), ((_cache_spec(batch_axis),) * 2,) * config.n_layers
    in_specs = (_layer_specs(config), rows, rows, *((cache,) if takes_cache else ()), *((P(),) * scalars))
    body = functools.partial(phase, config, par, *static)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(cache, rows), check_vma=False)
    return jax.jit(mapped, donate_argnums=(3,) if takes_cache else ())


def prompt_logits(
    config: ModelConfig,
    params: dict,
    prompts: list[list[int]],
    *,
    mesh: Mesh | None = None,
    taco: tj.TacoConfig | str | None = None,
    dtype: jax.typing.DTypeLike = jnp.float32,
) -> np.ndarray:
    """The next-token logits at the end of each prompt, through generation's prefill
    (what its first token is drawn from).

    Args:
      config: as `generate`.
      params: as `generate`.
      prompts: as `generate`.
      mesh: as `generate`.
      taco: as `generate`.
      dtype: as `generate`.

    Returns:
      float32 (len(prompts), vocab_size).

    Raises:
      ValueError, TypeError: as `generate`.
    """
    _check(config, prompts, 1, 0.0, 0, 1.0)
    _check_dtype(dtype)
    par = Parallelism(taco_config(taco), compute_dtype=jnp.dtype(dtype))
    batch = _Batch(config, _mesh_or_default(mesh), prompts, 1)
    prefill = batch.compiled(_prefill_logits, config, par, batch.cache_length)
    placed = _place(params, config, batch.mesh, par.compute_dtype)
    _, logits = prefill(placed, batch.tokens, batch.lengths)
    return np.asarray(logits)[: len(prompts)]


def generate(
    config: ModelConfig,
    params: dict,
    prompts: list[list[int]],
    *,
    mesh: Mesh | None = None,
    taco: tj.TacoConfig | str | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    decode_taco: tj.TacoConfig | str | None = None,
    dtype: jax.typing.DTypeLike = jnp.float32,
) -> list[list[int]]:
    """Continue each prompt with the model, through a KV cache.

    Args:
      config: model configuration (as `models.load_hf` or the trainer gives it).
      params: parameters in the global layout (host or device arrays).
      prompts: token id lists, of any lengths.
      mesh: (data, 1, tensor) mesh from `taco_jax.make_mesh`; one device if None.
      taco: compression of the prefill's tensor-parallel collectives: a `TacoConfig` or
        a preset name (`TacoConfig.preset(name)`, e.g. "taco+"); None: uncompressed.
      max_new_tokens: tokens generated at most per prompt.
      temperature: 0 is greedy; above, the softmax temperature of sampling.
      top_k: sample among the k most likely tokens (0: all).
      top_p: sample among the most likely tokens whose probability reaches top_p.
      seed: seed of the sampling key, in [0, 2**32). Prompt i's draw at new token t
        uses the key folded with t and then i, so the samples depend on the prompts,
        the seed and the sampling settings, never on the mesh or the batch padding.
      eos_id: stop a sequence after this token (included).
      decode_taco: compression of the decode steps' collectives, as `taco` (None:
        uncompressed, as their few rows per layer are latency-bound).
      dtype: compute dtype of the weights (cast once), activations and KV cache;
        bfloat16 on GPUs.

    Returns:
      One list of new token ids per prompt (the prompt not included).

    Raises:
      ValueError: empty prompts, token ids outside the vocabulary, a prompt plus
        max_new_tokens longer than the model's positions, bad sampling arguments (a
        temperature that is not finite, a top_k that is not an integer), a seed outside
        [0, 2**32), a dtype that is not floating-point, a pipelined mesh, a tensor
        axis that does not divide the (kv) heads, or an unknown preset name.
      TypeError: `taco` or `decode_taco` neither a `TacoConfig`, a preset name nor
        None (naming it).
    """
    _check(config, prompts, max_new_tokens, temperature, top_k, top_p)
    _check_seed(seed)
    _check_dtype(dtype)
    compute = jnp.dtype(dtype)
    prefill_par = Parallelism(taco_config(taco), compute_dtype=compute)
    decode_par = Parallelism(taco_config(decode_taco, "decode_taco"), compute_dtype=compute)
    sampling = _Sampling(float(temperature), int(top_k), float(top_p))
    batch = _Batch(config, _mesh_or_default(mesh), prompts, max_new_tokens)
    chunk = min(DECODE_CHUNK, max_new_tokens - 1)
    prefill = batch.compiled(_prefill, config, prefill_par, sampling, batch.cache_length)
    decode = batch.compiled(_decode_chunk, config, decode_par, sampling, chunk)
    placed = _place(params, config, batch.mesh, compute)
    key = jax.random.key(seed)
    cache, drawn = prefill(placed, batch.tokens, batch.lengths, jax.random.fold_in(key, 0))
    tokens = np.asarray(drawn)[:, None]  # (rows, tokens so far)
    while tokens.shape[1] < max_new_tokens and not _all_stopped(tokens[: len(prompts)], eos_id):
        step = tokens.shape[1]
        cache, drawn = decode(placed, jnp.asarray(tokens[:, -1]), batch.lengths + step - 1, cache, key, step)
        tokens = np.concatenate([tokens, np.asarray(drawn)], axis=1)
    return [_until_eos(row, max_new_tokens, eos_id) for row in tokens[: len(prompts)]]


def _all_stopped(tokens: np.ndarray, eos_id: int | None) -> bool:
    return eos_id is not None and bool(np.all(np.any(tokens == eos_id, axis=1)))


def _until_eos(row: np.ndarray, limit: int, eos_id: int | None) -> list[int]:
    """The first `limit` tokens of a row, cut after its first `eos_id` (included)."""
    ids = [int(t) for t in row[:limit]]
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else ids
