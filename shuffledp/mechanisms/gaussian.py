"""Gaussian mechanism: noise sampler, sensitivities, classical and analytic calibration (seeds 002-004).

- classical: sigma = Delta sqrt(2 ln(1.25/delta)) / eps, valid for 0 < eps < 1 (Dwork & Roth 2014, Thm A.1).
- analytic: the smallest sigma with  Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D) <= delta, which is
  the exact (eps, delta) curve of the Gaussian mechanism (Balle & Wang 2018, Thm 8; their Alg 1 solves it,
  here by bisection with sigma rounded UP). The same function is the hockey-stick divergence
  theta_{e^eps}(D/sigma) used by seed 004 (spec 004 sec 3).

Composition / RDP arithmetic is not here: accountants use dp_accounting for it.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr

from shuffledp.mechanisms.pvec import clip_rows

__all__ = [
    "RELATIONS",
    "sensitivity_from_clip",
    "l2_sensitivity",
    "clip_rows",
    "classical_gaussian_sigma",
    "gaussian_delta",
    "analytic_gaussian_sigma",
    "gaussian_noise",
    "add_gaussian_noise",
]

# Neighbouring relations: add/remove one user's record, or replace one user's record by another.
RELATIONS = ("add_remove", "replace_one")


def positive_real(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0.0 or (v == 0.0 and not allow_zero):
        rng = "[0, inf)" if allow_zero else "(0, inf)"
        raise ValueError(f"{name} must lie in {rng}, got {value!r}")
    return v


def _delta(value: object) -> float:
    v = positive_real("delta", value)
    if not v < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {value!r}")
    return v


def sensitivity_from_clip(clip_norm: float, relation: str = "add_remove") -> float:
    """Sensitivity of a SUM of per-user contributions each clipped to norm <= clip_norm (any fixed norm).

    add/remove one user: ||v|| <= C;  replace one user: ||v - v'|| <= ||v|| + ||v'|| <= 2C (triangle inequality).
    """
    c = positive_real("clip_norm", clip_norm)
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    return c if relation == "add_remove" else 2.0 * c


def l2_sensitivity(clip_norm: float, relation: str = "add_remove") -> float:
    """l2 sensitivity of a sum of contributions l2-clipped to clip_norm (see sensitivity_from_clip)."""
    return sensitivity_from_clip(clip_norm, relation)


def classical_gaussian_sigma(eps: float, delta: float, sensitivity: float) -> float:
    """sigma = Delta sqrt(2 ln(1.25/delta)) / eps (Dwork & Roth 2014, Thm A.1), which needs 0 < eps < 1.

    Rounded up a few ulps (the theorem asks c^2 > 2 ln(1.25/delta), strictly). For eps >= 1 use
    analytic_gaussian_sigma, which is valid (and smaller) for every eps.
    """
    e = positive_real("eps", eps)
    if not e < 1.0:
        raise ValueError(f"eps must lie in (0, 1) for the classical Gaussian mechanism (Dwork-Roth Thm A.1), got {e}")
    dl = _delta(delta)
    s = positive_real("sensitivity", sensitivity)
    return s * math.sqrt(2.0 * math.log(1.25 / dl)) / e * (1.0 + 8.0 * np.finfo(float).eps)


def gaussian_delta(eps: float, sigma: float, sensitivity: float = 1.0) -> float:
    """Exact delta(eps) of the Gaussian mechanism N(f, sigma^2) with l2 sensitivity D (Balle & Wang 2018, Thm 8):

    delta = Phi(D/(2 sigma) - eps sigma/D) - e^eps Phi(-D/(2 sigma) - eps sigma/D).

    Evaluated in log space (log_ndtr) so that tiny deltas (1e-20 and below) keep full relative precision.
    """
    e = positive_real("eps", eps, allow_zero=True)
    sg = positive_real("sigma", sigma)
    D = positive_real("sensitivity", sensitivity)
    r = D / sg
    a = r / 2.0 - e / r
    b = -r / 2.0 - e / r
    log_pa = float(log_ndtr(a))
    log_ratio = e + float(log_ndtr(b)) - log_pa  # log(e^eps Phi(b) / Phi(a)) < 0 mathematically
    if log_ratio >= 0.0:
        # cancellation below float resolution: report a safe upper bound instead of 0 (never round delta down)
        return min(1.0, math.exp(log_pa) * 4.0 * np.finfo(float).eps)
    return min(1.0, math.exp(log_pa + math.log1p(-math.exp(log_ratio))))


def analytic_gaussian_sigma(eps: float, delta: float, sensitivity: float, rtol: float = 1e-12) -> float:
    """Smallest sigma (to relative tolerance rtol, rounded UP) with gaussian_delta(eps, sigma, D) <= delta.

    Balle & Wang 2018, Thm 8 / Alg 1 (analytic Gaussian mechanism); delta(sigma) is decreasing, so bisection
    keeps an upper end that is always feasible and returns it.
    """
    e = positive_real("eps", eps, allow_zero=True)
    dl = _delta(delta)
    D = positive_real("sensitivity", sensitivity)
    rtol = positive_real("rtol", rtol)
    hi = D
    while gaussian_delta(e, hi, D) > dl:
        hi *= 2.0
    lo = hi / 2.0
    while gaussian_delta(e, lo, D) <= dl:
        hi, lo = lo, lo / 2.0
    # invariant: delta(lo) > target >= delta(hi)
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if gaussian_delta(e, mid, D) <= dl:
            hi = mid
        else:
            lo = mid
    return hi


def gaussian_noise(shape: int | tuple[int, ...], sigma: float, rng: np.random.Generator) -> np.ndarray:
    """iid N(0, sigma^2) noise of the given shape from the injected (CSPRNG) generator; sigma = 0 gives zeros."""
    sg = positive_real("sigma", sigma, allow_zero=True)
    return rng.normal(0.0, sg, size=shape) if sg > 0.0 else np.zeros(shape)


def add_gaussian_noise(x: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """x + N(0, sigma^2 I), vectorized over any shape."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("x must contain only finite values")
    return x + gaussian_noise(x.shape, sigma, rng)
