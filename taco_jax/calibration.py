"""Per-site calibration: channel permutations and the transform decision, from measured
codec error on a site's own tensors.

A permutation reorders the channels (last axis) before grouping, so that each group of G
channels is well conditioned for the codec; `compress(x, spec, perm)` /
`decompress(c, perm)` apply it. Strategies, from per-channel RMS:

  identity    no reordering (the state before calibration)
  cluster     channels sorted by RMS: each group holds channels of similar magnitude
  interleave  sorted channels dealt round-robin over the groups: each group gets a mix of
              high- and low-energy channels

Measured on synthetic TP tensors (`benchmarks/permutation_error.py`), clustering is what
the Hadamard path needs (median per-channel error of INT8 + H 9.3% -> 0.7% where channel
scales spread widely); interleaving makes it worse.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.codec import compress, decompress
from taco_jax.spec import QuantSpec

STRATEGIES = ("identity", "cluster", "interleave")
METRICS = ("channel_median", "rel_rmse")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SiteCalibration:
    """What calibration decided for one call site (a pytree, for checkpoints).

    Attributes:
      perm: int32 (C,) channel permutation applied before grouping.
      hadamard: bool scalar array: whether the site uses the Walsh-Hadamard transform.
    """

    perm: jax.Array
    hadamard: jax.Array

    @classmethod
    def identity(cls, channels: int, hadamard: bool = True) -> SiteCalibration:
        """The state before calibration: no permutation."""
        return cls(jnp.arange(channels, dtype=jnp.int32), jnp.asarray(hadamard))


def channel_rms(x: jax.Array) -> np.ndarray:
    """float64 RMS of each channel (last axis) over all other axes."""
    values = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    return np.sqrt(np.mean(np.square(values), axis=0))


def permutation(rms: np.ndarray, group_size: int, strategy: str) -> np.ndarray:
    """A channel permutation from per-channel RMS.

    Args:
      rms: (C,) per-channel RMS.
      group_size: G; C must be divisible by it.
      strategy: "identity", "cluster" or "interleave".

    Returns:
      int32 (C,) permutation.

    Raises:
      ValueError: unknown strategy, or C not divisible by G.
    """
    channels = len(rms)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown permutation strategy {strategy!r}; expected one of {list(STRATEGIES)}")
    if channels % group_size:
        raise ValueError(f"{channels} channels are not divisible by group_size {group_size}")
    order = np.argsort(rms, kind="stable").astype(np.int32)
    if strategy == "identity":
        return np.arange(channels, dtype=np.int32)
    if strategy == "cluster":
        return order
    return order.reshape(group_size, channels // group_size).T.reshape(-1)


def codec_error(x: jax.Array, spec: QuantSpec, perm: np.ndarray) -> dict[str, float]:
    """Relative RMSE and median per-channel relative error of one round trip."""
    x64 = np.asarray(x, np.float64)
    y = np.asarray(decompress(compress(jnp.asarray(x), spec, perm=perm), perm=perm), np.float64)
    err = (y - x64).reshape(-1, x64.shape[-1])
    norms = np.linalg.norm(x64.reshape(-1, x64.shape[-1]), axis=0)
    live = norms > 0
    return {"rel_rmse": float(np.linalg.norm(err) / max(np.linalg.norm(x64), 1e-300)),
            "channel_median": float(np.median(np.linalg.norm(err, axis=0)[live] / norms[live])) if live.any() else 0.0}


def calibrate_site(
    samples: jax.Array, spec: QuantSpec, *, strategies: tuple[str, ...] = STRATEGIES, metric: str = "channel_median"
) -> tuple[SiteCalibration, list[dict]]:
    """Choose a site's permutation and transform by measured codec error on its tensors.

    Every strategy is tried with the transform on and off; the lowest `metric` wins (the
    other metric breaks ties).

    Args:
      samples: the site's tensors (..., C) as they would be sent.
      spec: the site's `QuantSpec` (its `hadamard` field is what is being decided).
      strategies: permutation strategies to try.
      metric: "channel_median" or "rel_rmse".

    Returns:
      (the chosen `SiteCalibration`, one report row per candidate).

    Raises:
      ValueError: unknown metric or strategy, or channels not divisible by the group size.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown calibration metric {metric!r}; expected one of {list(METRICS)}")
    rms = channel_rms(samples)
    other = METRICS[1 - METRICS.index(metric)]
    report = []
    for strategy in strategies:
        perm = permutation(rms, spec.group_size, strategy)
        for hadamard in (False, True):
            error = codec_error(samples, dataclasses.replace(spec, hadamard=hadamard), perm)
            report.append({"strategy": strategy, "hadamard": hadamard, **error, "perm": perm})
    best = min(report, key=lambda row: (row[metric], row[other]))
    chosen = SiteCalibration(jnp.asarray(best["perm"]), jnp.asarray(best["hadamard"]))
    return chosen, [{k: v for k, v in row.items() if k != "perm"} for row in report]
