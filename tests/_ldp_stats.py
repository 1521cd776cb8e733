"""Statistical assertions shared by the LDP randomizer tests (test_rr, test_r_inf, test_r_one, test_privunit).

Tolerances (stated once, used everywhere):
* means: every coordinate within 4 standard errors, SE = sqrt(closed-form variance / N);
* variances: the sample variance of each coordinate inside a two-sided chi-square band of total tail mass 6.3e-5
  (the 4-sigma level). Randomizer outputs are far from Gaussian (two- or three-point laws), so the chi-square
  degrees of freedom are the effective ones, nu = 2 / (2/(N-1) + kappa/N) with kappa the sample excess kurtosis
  (for Gaussian data kappa = 0 and nu = N - 1, the textbook band);
* mean squared error: the average of ||y - x||^2 within 4 standard errors of the closed form.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

N_SE = 4.0
BAND_TAIL = 6.3e-5  # two-sided tail mass of a 4-sigma normal band


def assert_unbiased(Y: np.ndarray, x: np.ndarray, var: np.ndarray) -> None:
    """Each coordinate of mean(Y) within N_SE * sqrt(var/N) of x."""
    n = Y.shape[0]
    se = np.sqrt(np.asarray(var) / n)
    err = np.abs(Y.mean(axis=0) - x)
    assert np.all(err <= N_SE * se), f"bias beyond {N_SE} SE: err={err}, se={se}"


def assert_variance_in_band(Y: np.ndarray, var: np.ndarray) -> None:
    """Each coordinate's sample variance inside the kurtosis-adjusted chi-square band around var."""
    n = Y.shape[0]
    s2 = Y.var(axis=0, ddof=1)
    kappa = stats.kurtosis(Y, axis=0, fisher=True, bias=False)
    nu = 2.0 / (2.0 / (n - 1) + np.maximum(kappa, -2.0 + 1e-9) / n)
    lo = stats.chi2.ppf(BAND_TAIL / 2, nu) / nu
    hi = stats.chi2.ppf(1 - BAND_TAIL / 2, nu) / nu
    ratio = s2 / np.asarray(var)
    assert np.all((ratio >= lo) & (ratio <= hi)), f"variance ratio {ratio} outside band [{lo}, {hi}]"


def assert_mse_close(Y: np.ndarray, x: np.ndarray, lower: float, upper: float | None = None) -> None:
    """mean ||y - x||^2 within N_SE standard errors of [lower, upper] (upper defaults to lower)."""
    upper = lower if upper is None else upper
    e = ((Y - x) ** 2).sum(axis=1)
    se = e.std(ddof=1) / np.sqrt(e.size) + 1e-9 * abs(upper)  # plus rounding slack when ||y - x|| is constant
    assert lower - N_SE * se <= e.mean() <= upper + N_SE * se, f"mse {e.mean()} (se {se}) vs [{lower}, {upper}]"


def assert_max_ratio_is_eps0(probs: np.ndarray, eps0: float, rtol: float = 1e-12) -> None:
    """probs: (inputs, outputs) exact pmfs. max over outputs and input pairs of P[s|x]/P[s|x'] equals e^eps0."""
    assert np.allclose(probs.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert probs.min() > 0.0
    ratio = float((probs.max(axis=0) / probs.min(axis=0)).max())
    bound = np.exp(eps0)
    assert ratio <= bound * (1 + rtol), f"max ratio {ratio} > e^eps0 = {bound}"
    assert ratio >= bound * (1 - rtol), f"max ratio {ratio} does not attain e^eps0 = {bound}"


def assert_matches_pmf(symbols: np.ndarray, pmf: np.ndarray, min_pvalue: float = 1e-4) -> None:
    """Chi-square goodness of fit of sampled symbols to the exact pmf (fixed seed; rejects at p < 1e-4)."""
    counts = np.bincount(symbols.astype(np.int64), minlength=pmf.size)
    assert counts.size == pmf.size, "symbol outside the alphabet"
    res = stats.chisquare(counts, pmf * symbols.size)
    assert res.pvalue >= min_pvalue, f"sampler does not follow the exact pmf: p = {res.pvalue}"


class CountingRng:
    """Delegates to a real numpy Generator and counts method calls (a per-user loop would scale the count with k)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self.calls = 0

    def __getattr__(self, name: str):
        attr = getattr(self._rng, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted
