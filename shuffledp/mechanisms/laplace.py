"""Laplace mechanism: scale calibration, sensitivities, exact delta(eps) and the noise sampler (seed 004).

- scale b = Delta_1 / eps gives eps-DP (Dwork & Roth 2014, Thm 3.6).
- exact hockey-stick divergence of Lap(0, b) vs Lap(Delta, b): delta(eps) = max(0, 1 - exp((eps - Delta/b)/2))
  (spec 004 sec 3 [derived, checked numerically]; matches dp_accounting's LaplacePrivacyLoss).
"""

from __future__ import annotations

import math

import numpy as np

from shuffledp.mechanisms.gaussian import positive_real, sensitivity_from_clip

__all__ = [
    "l1_sensitivity",
    "l1_sensitivity_from_l2_clip",
    "laplace_scale",
    "laplace_delta",
    "laplace_noise",
    "add_laplace_noise",
    "laplace_variance",
]


def l1_sensitivity(l1_clip: float, relation: str = "add_remove") -> float:
    """l1 sensitivity of a sum of contributions with ||v||_1 <= l1_clip: C (add/remove) or 2C (replace one)."""
    return sensitivity_from_clip(l1_clip, relation)


def l1_sensitivity_from_l2_clip(l2_clip: float, d: int, relation: str = "add_remove") -> float:
    """l1 sensitivity when contributions in R^d are only l2-clipped: ||v||_1 <= sqrt(d) ||v||_2 (Cauchy-Schwarz)."""
    if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1:
        raise ValueError(f"d must be an integer >= 1, got {d!r}")
    return math.sqrt(int(d)) * sensitivity_from_clip(l2_clip, relation)


def laplace_scale(eps: float, sensitivity: float) -> float:
    """b = Delta_1 / eps (Dwork & Roth 2014, Thm 3.6), rounded up a few ulps (never round noise down)."""
    e = positive_real("eps", eps)
    s = positive_real("sensitivity", sensitivity)
    return s / e * (1.0 + 4.0 * np.finfo(float).eps)


def laplace_delta(eps: float, b: float, sensitivity: float = 1.0) -> float:
    """Exact delta(eps) of the Laplace mechanism with scale b and l1 sensitivity Delta (1-D worst case):
    max(0, 1 - exp((eps - Delta/b)/2)); zero once eps >= Delta/b (spec 004 sec 3)."""
    e = positive_real("eps", eps, allow_zero=True)
    bb = positive_real("b", b)
    D = positive_real("sensitivity", sensitivity)
    return max(0.0, -math.expm1((e - D / bb) / 2.0))


def laplace_variance(b: float) -> float:
    """Variance of Lap(0, b): 2 b^2."""
    return 2.0 * positive_real("b", b) ** 2


def laplace_noise(shape: int | tuple[int, ...], b: float, rng: np.random.Generator) -> np.ndarray:
    """iid Lap(0, b) noise of the given shape from the injected (CSPRNG) generator; b = 0 gives zeros."""
    bb = positive_real("b", b, allow_zero=True)
    return rng.laplace(0.0, bb, size=shape) if bb > 0.0 else np.zeros(shape)


def add_laplace_noise(x: np.ndarray, b: float, rng: np.random.Generator) -> np.ndarray:
    """x + Lap(0, b) per coordinate, vectorized over any shape."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("x must contain only finite values")
    return x + laplace_noise(x.shape, b, rng)
