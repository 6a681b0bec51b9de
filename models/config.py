"""Model configurations: one dataclass per family, with named presets."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

VOCAB_MULTIPLE = 128  # padded vocabulary divides by any power-of-two tensor degree <= 128


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2: learned positions, LayerNorm, GELU (tanh) MLP, tied embeddings.

    Attributes:
      vocab_size: tokens in the vocabulary.
      max_positions: length of the learned position table.
      d_model: hidden size.
      n_layers: transformer blocks.
      n_heads: attention heads.
      d_ff: MLP hidden size (4 * d_model in GPT-2).
      norm_eps: LayerNorm epsilon.
    """

    vocab_size: int = 256
    max_positions: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    norm_eps: float = 1e-5
    family: str = dataclasses.field(default="gpt2", init=False)

    @property
    def n_kv_heads(self) -> int:
        """GPT-2 has no grouped queries: one key/value head per query head."""
        return self.n_heads

    @property
    def tie_embeddings(self) -> bool:
        """GPT-2's output head is the transposed token embedding."""
        return True


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Qwen2: RMSNorm, rotary positions, grouped-query attention with q/k/v bias, SwiGLU.

    Attributes:
      vocab_size: tokens in the vocabulary.
      max_positions: longest sequence the rotary table is built for.
      d_model: hidden size.
      n_layers: transformer blocks.
      n_heads: query heads.
      n_kv_heads: key/value heads (divides n_heads).
      d_ff: MLP hidden size.
      norm_eps: RMSNorm epsilon.
      rope_theta: rotary base.
      tie_embeddings: share the embedding with the output head.
    """

    vocab_size: int = 256
    max_positions: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 256
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    family: str = dataclasses.field(default="qwen2", init=False)


ModelConfig = GPT2Config | Qwen2Config

PRESETS: dict[str, ModelConfig] = {
    "gpt2-tiny": GPT2Config(),
    # Byte-level models for quality studies: big enough for structure in the activations,
    # small enough to train many seeds.
    "gpt2-mini": GPT2Config(256, 512, 384, 6, 8, 1536),
    # Over four times the mini presets' parameters (46M vs 11M; 48M vs 10M), with a
    # 4096-token vocabulary that covers bytes and the quality experiment's BPE corpus.
    "gpt2-40m": GPT2Config(4096, 512, 768, 6, 12, 3072),
    "gpt2-small": GPT2Config(50257, 1024, 768, 12, 12, 3072),
    "gpt2-medium": GPT2Config(50257, 1024, 1024, 24, 16, 4096),
    "gpt2-large": GPT2Config(50257, 1024, 1280, 36, 20, 5120),
    "gpt2-xl": GPT2Config(50257, 1024, 1600, 48, 25, 6400),
    "qwen2-tiny": Qwen2Config(),
    "qwen2-mini": Qwen2Config(256, 512, 384, 6, 8, 4, 1024),
    "qwen2-40m": Qwen2Config(4096, 512, 768, 6, 12, 4, 2304),
    "qwen2-0.5b": Qwen2Config(151936, 32768, 896, 24, 14, 2, 4864, 1e-6, 1e6, True),
    "qwen2-1.5b": Qwen2Config(151936, 32768, 1536, 28, 12, 2, 8960, 1e-6, 1e6, True),
    "qwen2-7b": Qwen2Config(152064, 32768, 3584, 28, 28, 4, 18944, 1e-6, 1e6, False),
}


def preset(name: str) -> ModelConfig:
    """A named model configuration.

    Raises:
      ValueError: unknown preset.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}") from None


def head_dim(config: ModelConfig) -> int:
    return config.d_model // config.n_heads


def padded_vocab(config: ModelConfig) -> int:
    """Vocabulary rounded up to a multiple of 128 (extra rows are never predicted)."""
    return -(-config.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def check_tensor_parallel(config: ModelConfig, tensor: int) -> None:
    """Raise ValueError naming what the tensor-parallel degree does not divide."""
    if config.d_model % config.n_heads:
        raise ValueError(f"d_model {config.d_model} is not divisible by n_heads {config.n_heads}")
    for name in ("n_heads", "n_kv_heads", "d_ff"):
        value = getattr(config, name)
        if value % tensor:
            raise ValueError(f"{name}={value} is not divisible by the tensor axis size {tensor}")
    if padded_vocab(config) % tensor:
        raise ValueError(f"padded vocabulary {padded_vocab(config)} is not divisible by the tensor axis size {tensor}")


def check_token_ids(tokens: jax.typing.ArrayLike, config: ModelConfig, what: str = "tokens") -> None:
    """Raise ValueError unless `tokens` are integer ids in [0, vocab_size).

    Concrete arrays are checked in full; under tracing (inside jit) only the dtype, as
    the values are not known: an id out of range would read a padded or clamped
    embedding row without an error.

    Args:
      tokens: token ids, any shape.
      config: the model configuration.
      what: how the message names them.
    """
    dtype = np.dtype(getattr(tokens, "dtype", None) or np.asarray(tokens).dtype)
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{what} must be integer token ids, got dtype {dtype}")
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
        raise ValueError(
            f"{what} hold ids from {int(ids.min())} to {int(ids.max())}, outside the vocabulary [0, {config.vocab_size})"
        )
