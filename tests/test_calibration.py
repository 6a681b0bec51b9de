"""Calibration: permutation strategies and the per-site choice by measured codec error."""

import jax
import numpy as np
import pytest

import taco_jax as tj
from benchmarks import tp_tensors
from taco_jax import calibration


def test_strategies_are_permutations_with_the_intended_groups():
    rng = np.random.default_rng(0)
    rms = rng.lognormal(0, 2, 512)
    for strategy in calibration.STRATEGIES:
        perm = calibration.permutation(rms, 128, strategy)
        assert perm.dtype == np.int32 and sorted(perm) == list(range(512))
    clustered = rms[calibration.permutation(rms, 128, "cluster")].reshape(4, 128)
    assert np.all(clustered[:-1].max(axis=1) <= clustered[1:].min(axis=1))  # groups ordered by magnitude
    interleaved = rms[calibration.permutation(rms, 128, "interleave")].reshape(4, 128)
    assert np.all(interleaved.max(axis=1) >= np.quantile(rms, 0.99))  # each group gets a top channel
    np.testing.assert_array_equal(calibration.permutation(rms, 128, "identity"), np.arange(512))


def test_calibration_picks_clustering_for_spread_channel_scales():
    x = tp_tensors.generate("lognormal", 256, 1024, seed=3)
    spec = tj.QuantSpec("int8", 128, True, "bf16")
    chosen, report = calibration.calibrate_site(x, spec)
    best = min(report, key=lambda r: r["channel_median"])
    assert (best["strategy"], best["hadamard"]) == ("cluster", True)
    identity_h = next(r for r in report if (r["strategy"], r["hadamard"]) == ("identity", True))
    assert best["channel_median"] < 0.25 * identity_h["channel_median"]
    np.testing.assert_array_equal(np.asarray(chosen.perm), calibration.permutation(calibration.channel_rms(x), 128, "cluster"))
    assert bool(chosen.hadamard)
    # The state is a pytree that survives jit (and so checkpoints).
    same = jax.jit(lambda c: c)(chosen)
    np.testing.assert_array_equal(np.asarray(same.perm), np.asarray(chosen.perm))


def test_identity_state_and_errors():
    state = calibration.SiteCalibration.identity(256)
    np.testing.assert_array_equal(np.asarray(state.perm), np.arange(256))
    with pytest.raises(ValueError, match="unknown permutation strategy"):
        calibration.permutation(np.ones(256), 128, "shuffle")
    with pytest.raises(ValueError, match="not divisible by group_size 128"):
        calibration.permutation(np.ones(200), 128, "cluster")
    with pytest.raises(ValueError, match="unknown calibration metric"):
        calibration.calibrate_site(np.ones((4, 256), np.float32), tj.QuantSpec(), metric="mse")
