"""Synthetic tensors shaped like what tensor-parallel layers exchange.

Each generator returns float32 numpy arrays (tokens, channels). For the all-reduce case,
`partial_sums` splits a tensor into k rank contributions that sum to it, as a
row-parallel matmul's partial outputs do.

Kinds:
  gaussian      N(0, 1): the easy case.
  activation    dense near-zero values with heavy (Student-t, 4 dof) tails, log-normal
                channel scales and ~0.5% outlier channels at 50-100x the median channel
                RMS, as in LLM residual-stream activations.
  gradient      activation-gradient-like: magnitude ~1e-6, heavier tails (3 dof), a
                log-normal per-token scale (a few tokens carry most of the gradient).
  lognormal     N(0, 1) times log-normal channel scales (sigma 2): channels of very
                different magnitude sharing groups, where a transform mixes them.
"""

from __future__ import annotations

import numpy as np

KINDS = ("gaussian", "activation", "gradient", "lognormal")


def _outlier_channels(rng: np.random.Generator, channels: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    count = max(1, int(round(channels * fraction)))
    return rng.choice(channels, count, replace=False), rng.uniform(50, 100, count)


def generate(kind: str, tokens: int, channels: int, seed: int = 0) -> np.ndarray:
    """One synthetic TP tensor.

    Args:
      kind: one of `KINDS`.
      tokens: rows.
      channels: columns (the axis the codec groups).
      seed: RNG seed.

    Returns:
      float32 array (tokens, channels).

    Raises:
      ValueError: unknown kind.
    """
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        x = rng.standard_normal((tokens, channels))
    elif kind == "activation":
        channel_scale = rng.lognormal(0.0, 0.5, channels)
        where, factor = _outlier_channels(rng, channels, 0.005)
        channel_scale[where] = np.median(channel_scale) * factor
        x = 0.05 * rng.standard_t(4, (tokens, channels)) * channel_scale
    elif kind == "gradient":
        token_scale = rng.lognormal(0.0, 1.0, (tokens, 1))
        channel_scale = rng.lognormal(0.0, 0.5, channels)
        where, factor = _outlier_channels(rng, channels, 0.005)
        channel_scale[where] *= factor / 10
        x = 1e-6 * rng.standard_t(3, (tokens, channels)) * token_scale * channel_scale
    elif kind == "lognormal":
        x = rng.standard_normal((tokens, channels)) * rng.lognormal(0.0, 2.0, channels)
    else:
        raise ValueError(f"unknown tensor kind {kind!r}; expected one of {KINDS}")
    return x.astype(np.float32)


def partial_sums(total: np.ndarray, ranks: int, seed: int = 0) -> np.ndarray:
    """Split `total` into `ranks` float32 contributions whose sum is `total`.

    Each contribution is the total's share plus zero-sum noise of the same magnitude, as
    the partial products of a row-parallel layer are individually as large as their sum.

    Returns:
      float32 array (ranks, *total.shape).
    """
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((ranks, *total.shape)) * np.abs(total).mean(axis=0, keepdims=True)
    noise -= noise.mean(axis=0, keepdims=True)
    parts = total[None] / ranks + noise
    parts[-1] = total - parts[:-1].sum(axis=0)
    return parts.astype(np.float32)
