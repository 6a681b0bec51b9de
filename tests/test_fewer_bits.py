"""The Gaussian limits `benchmarks.fewer_bits` states beside each spec, against theory."""

import math

import pytest

from benchmarks import fewer_bits


def test_the_best_scalar_quantizer_of_a_gaussian_matches_theory():
    """One level (the mean) leaves the whole variance; two levels at +-sqrt(2/pi) leave
    1 - 2/pi; four and eight levels leave Max's (1960) 0.1175 and 0.03455."""
    assert fewer_bits.lloyd_max_rel_rmse(1) == pytest.approx(1.0, abs=1e-12)
    assert fewer_bits.lloyd_max_rel_rmse(2) == pytest.approx(math.sqrt(1 - 2 / math.pi), rel=1e-9)
    assert fewer_bits.lloyd_max_rel_rmse(4) ** 2 == pytest.approx(0.1175, rel=1e-3)
    assert fewer_bits.lloyd_max_rel_rmse(8) ** 2 == pytest.approx(0.03455, rel=1e-3)
    with pytest.raises(ValueError, match="at least one level"):
        fewer_bits.lloyd_max_rel_rmse(0)


def test_a_fixed_rate_scalar_code_sits_above_the_rate_distortion_bound():
    """At high rate the best scalar code's error tends to sqrt(pi sqrt(3) / 2) = 1.65
    times the bound 2**-R (Panter and Dite); it is never below it."""
    for bits in (2.0, 4.5, 5.6, 8.5):
        limits = fewer_bits.gaussian_limits(bits)
        assert limits["any_code_rel_rmse"] == pytest.approx(2.0**-bits, rel=1e-12)
        assert limits["scalar_code_rel_rmse"] > limits["any_code_rel_rmse"]
    high_rate = fewer_bits.gaussian_limits(7.0)
    ratio = high_rate["scalar_code_rel_rmse"] / high_rate["any_code_rel_rmse"]
    assert ratio == pytest.approx(math.sqrt(math.pi * math.sqrt(3) / 2), rel=0.02)
