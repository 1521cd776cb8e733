"""Gaussian and Laplace mechanisms: calibration against dp_accounting, sensitivities, Monte Carlo, errors.

Tolerances: analytic Gaussian sigma and delta agree with dp_accounting to 1e-6 relative (the brief's bar);
Monte Carlo means within 4 standard errors; Gaussian sample variance inside the two-sided chi-square band of
level 1e-4; Laplace sample variance within 4 asymptotic standard deviations sqrt((mu4 - var^2)/N) = b^2
sqrt(20/N) (the chi-square band does not apply to non-normal samples).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_mechanism as plm
from scipy import stats

from shuffledp.mechanisms.gaussian import (
    add_gaussian_noise,
    analytic_gaussian_sigma,
    classical_gaussian_sigma,
    clip_rows,
    gaussian_delta,
    gaussian_noise,
    l2_sensitivity,
    sensitivity_from_clip,
)
from shuffledp.mechanisms.laplace import (
    add_laplace_noise,
    l1_sensitivity,
    l1_sensitivity_from_l2_clip,
    laplace_delta,
    laplace_noise,
    laplace_scale,
    laplace_variance,
)
from shuffledp.security.rng import make_rng

GRID = [(0.05, 1e-5, 1.0), (0.5, 1e-3, 2.0), (1.0, 1e-5, 1.0), (3.0, 1e-8, 0.3), (8.0, 1e-12, 5.0)]


# ----------------------------------------------------------------------------------------------------------
# Gaussian calibration
# ----------------------------------------------------------------------------------------------------------
def test_classical_sigma_formula() -> None:
    s = classical_gaussian_sigma(0.5, 1e-5, 2.0)
    ref = 2.0 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.5  # Dwork-Roth Thm A.1
    assert s == pytest.approx(ref, rel=1e-14) and s >= ref


@pytest.mark.parametrize(("eps", "delta", "sens"), GRID)
def test_gaussian_delta_matches_dp_accounting(eps: float, delta: float, sens: float) -> None:
    for sigma in (0.3 * sens, sens, 4.0 * sens, 30.0 * sens):
        ref = plm.GaussianPrivacyLoss(sigma, sensitivity=sens).get_delta_for_epsilon(eps)
        ours = gaussian_delta(eps, sigma, sens)
        if ref > 1e-300:
            assert ours == pytest.approx(ref, rel=1e-6), sigma
        else:
            assert ours <= 1e-290


@pytest.mark.parametrize(("eps", "delta", "sens"), GRID)
def test_analytic_sigma_matches_dp_accounting_and_is_minimal(eps: float, delta: float, sens: float) -> None:
    s = analytic_gaussian_sigma(eps, delta, sens)
    # independent implementation: dp_accounting's own calibration of the Gaussian mechanism
    ref = plm.GaussianPrivacyLoss.from_privacy_guarantee(
        pld_common.DifferentialPrivacyParameters(eps, delta), sensitivity=sens
    ).standard_deviation
    assert s == pytest.approx(ref, rel=1e-6)
    # feasible (by dp_accounting's exact delta too) and minimal
    assert gaussian_delta(eps, s, sens) <= delta
    assert plm.GaussianPrivacyLoss(s, sensitivity=sens).get_delta_for_epsilon(eps) <= delta * (1 + 1e-9)
    assert gaussian_delta(eps, s * (1 - 1e-9), sens) > delta
    if eps < 1:
        assert s < classical_gaussian_sigma(eps, delta, sens)  # the analytic mechanism is never worse


def test_analytic_sigma_scales_with_sensitivity() -> None:
    assert analytic_gaussian_sigma(1.0, 1e-6, 3.0) == pytest.approx(3 * analytic_gaussian_sigma(1.0, 1e-6, 1.0))


def test_gaussian_delta_tiny_values_keep_precision() -> None:
    # spec 004 uses theta_{e^eps}(2L/sigma) down to ~1e-23; check against dp_accounting in that range
    for sigma in (20.0, 24.0):
        ref = plm.GaussianPrivacyLoss(sigma, sensitivity=2.0).get_delta_for_epsilon(1.0)
        assert 1e-80 < ref < 1e-20
        assert gaussian_delta(1.0, sigma, 2.0) == pytest.approx(ref, rel=1e-6)


def test_sensitivities() -> None:
    assert sensitivity_from_clip(1.5, "add_remove") == 1.5
    assert l2_sensitivity(1.5, "replace_one") == 3.0
    assert l1_sensitivity(0.5, "replace_one") == 1.0
    assert l1_sensitivity_from_l2_clip(2.0, 9) == pytest.approx(6.0)
    # the bounds hold empirically: clipped contributions differ by <= 2C (replace) and have norm <= C
    rng = make_rng(21)
    A = clip_rows(rng.normal(size=(5000, 9)) * 3, 2.0)
    B = clip_rows(rng.normal(size=(5000, 9)) * 3, 2.0)
    assert np.all(np.linalg.norm(A - B, axis=1) <= l2_sensitivity(2.0, "replace_one"))
    assert np.all(np.abs(A).sum(axis=1) <= l1_sensitivity_from_l2_clip(2.0, 9) * (1 + 1e-12))


# ----------------------------------------------------------------------------------------------------------
# Laplace calibration
# ----------------------------------------------------------------------------------------------------------
def test_laplace_scale_and_exact_delta() -> None:
    b = laplace_scale(0.5, 2.0)
    assert b == pytest.approx(4.0, rel=1e-14) and b >= 4.0  # b = Delta_1/eps (Dwork-Roth Thm 3.6)
    assert laplace_delta(0.5, b, 2.0) == 0.0  # pure eps-DP at eps = Delta/b
    for eps, scale, sens in [(0.5, 1.0, 1.0), (0.1, 2.0, 3.0), (1.0, 1.0, 1.0), (2.0, 0.5, 2.0)]:
        ref = plm.LaplacePrivacyLoss(scale, sensitivity=sens).get_delta_for_epsilon(eps)
        assert laplace_delta(eps, scale, sens) == pytest.approx(ref, rel=1e-9, abs=1e-15)
    # spec 004 TV4: A = 1 - exp((eps - 2L/v)/2) = 0.3934693 for eps=1, L=1, v=1
    assert laplace_delta(1.0, 1.0, 2.0) == pytest.approx(0.3934693, abs=1e-7)
    assert laplace_variance(3.0) == 18.0


# ----------------------------------------------------------------------------------------------------------
# Monte Carlo
# ----------------------------------------------------------------------------------------------------------
def test_gaussian_noise_mean_and_variance() -> None:
    rng = make_rng(22)
    sigma, N = 2.5, 200_000
    z = gaussian_noise((N,), sigma, rng)
    assert abs(z.mean()) <= 4 * sigma / math.sqrt(N)
    stat = (N - 1) * z.var(ddof=1) / sigma**2
    assert stats.chi2.ppf(5e-5, N - 1) <= stat <= stats.chi2.ppf(1 - 5e-5, N - 1)
    # vectorized over a matrix, unbiased around x
    x = np.linspace(-3, 3, 50)
    y = add_gaussian_noise(np.tile(x, (4000, 1)), sigma, rng)
    assert np.all(np.abs(y.mean(axis=0) - x) <= 4 * sigma / math.sqrt(4000))
    assert np.array_equal(gaussian_noise(3, 0.0, rng), np.zeros(3))


def test_laplace_noise_mean_and_variance() -> None:
    rng = make_rng(23)
    b, N = 1.7, 200_000
    z = laplace_noise(N, b, rng)
    assert abs(z.mean()) <= 4 * math.sqrt(2 * b * b / N)
    assert abs(z.var(ddof=1) - 2 * b * b) <= 4 * b * b * math.sqrt(20 / N)  # mu4 = 24 b^4, var^2 = 4 b^4
    x = np.linspace(-3, 3, 50)
    y = add_laplace_noise(np.tile(x, (4000, 1)), b, rng)
    assert np.all(np.abs(y.mean(axis=0) - x) <= 4 * math.sqrt(2 * b * b / 4000))
    # distribution shape: KS test against Laplace(0, b) at alpha = 1e-3
    assert stats.kstest(z[:20_000], stats.laplace(scale=b).cdf).pvalue > 1e-3


# ----------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fn", "args", "match"),
    [
        (classical_gaussian_sigma, (1.0, 1e-5, 1.0), "eps"),
        (classical_gaussian_sigma, (0.0, 1e-5, 1.0), "eps"),
        (classical_gaussian_sigma, (0.5, 0.0, 1.0), "delta"),
        (classical_gaussian_sigma, (0.5, 1.0, 1.0), "delta"),
        (classical_gaussian_sigma, (0.5, 1e-5, 0.0), "sensitivity"),
        (analytic_gaussian_sigma, (-1.0, 1e-5, 1.0), "eps"),
        (analytic_gaussian_sigma, (1.0, 1.5, 1.0), "delta"),
        (analytic_gaussian_sigma, (1.0, 1e-5, -2.0), "sensitivity"),
        (analytic_gaussian_sigma, (float("nan"), 1e-5, 1.0), "eps"),
        (gaussian_delta, (1.0, 0.0, 1.0), "sigma"),
        (gaussian_noise, ((3,), -1.0, None), "sigma"),
        (sensitivity_from_clip, (1.0, "swap"), "relation"),
        (sensitivity_from_clip, (0.0, "add_remove"), "clip_norm"),
        (laplace_scale, (0.0, 1.0), "eps"),
        (laplace_scale, (1.0, float("inf")), "sensitivity"),
        (laplace_delta, (1.0, 0.0, 1.0), "b"),
        (laplace_noise, (3, -1.0, None), "b"),
        (l1_sensitivity_from_l2_clip, (1.0, 0), "d"),
        (add_gaussian_noise, (np.array([np.nan]), 1.0, None), "finite"),
        (add_laplace_noise, (np.array([np.inf]), 1.0, None), "finite"),
    ],
)
def test_errors(fn, args, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn(*args)
