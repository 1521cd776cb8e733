"""PGD: projected full-batch gradient descent, fully interactive (paper 000 Alg 5), optax-style.

Every round all n users send grad l(theta_t, x_i) through PVEC with per-round (eps_r, delta_r); the analyzer
decodes, divides by the contributors n', and sets theta_{t+1} = Proj_Theta(theta_t - eta g_t); the output is
mean(theta_0..theta_{T-1}) (spec 000 sec 4; loop indices and the descent sign rebuilt there, sec 10(e)).

Per-round privacy (spec 000 sec 4), paper calibration: eps_r = eps / (2 sqrt(2 T ln(1/delta))),
delta_r = delta / (T + 1), composed by advanced composition. Calibrated: the analyzer asks
calibrate_pvec(..., rounds=T) instead (RDP composition). Those parameters are planned by the analyzer; this module
only provides the update and the step size.

Step size (Lemma B.6): eta = D / (L sqrt(T)). With noisy gradients the analysis of Lemma 4.2 replaces L by
L_G = sqrt(L^2 + E||noise||^2 / n^2); we use L_G (it reduces to the lemma's L when the noise is negligible and
keeps the step safe when it is not).
"""

from __future__ import annotations

import math

import numpy as np

from shuffledp.optimizers.base import Optimizer
from shuffledp.optimizers.psgd import averaging_optimizer
from shuffledp.optimizers.psgd import theory_learning_rate as _lr_from_noise

__all__ = ["pgd", "pgd_round_privacy", "theory_learning_rate"]


def pgd(learning_rate: float, radius: float) -> Optimizer:
    """Projected gradient descent with iterate averaging (paper 000 Alg 5): the same update as PSGD, over all users."""
    return averaging_optimizer(learning_rate, radius)


def theory_learning_rate(diameter: float, lipschitz: float, rounds: int, noise_sq: float, n: int) -> float:
    """eta = D / (L_G sqrt(T)) with L_G^2 = L^2 + noise_sq / n^2 (Lemma B.6 with the noise of Lemma 4.2)."""
    return _lr_from_noise(diameter, lipschitz, rounds, noise_sq, n)


def pgd_round_privacy(eps: float, delta: float, rounds: int) -> tuple[float, float]:
    """Paper's per-round budget for PGD (spec 000 sec 4, Alg 5): eps_r = eps/(2 sqrt(2T ln(1/delta))),
    delta_r = delta/(T+1). eps_r is rounded down a few ulps (never round privacy in the unsafe direction)."""
    if not (eps > 0 and 0 < delta < 1 and rounds >= 1):
        raise ValueError(f"need eps > 0, 0 < delta < 1, rounds >= 1; got eps={eps}, delta={delta}, rounds={rounds}")
    eps_r = eps / (2.0 * math.sqrt(2.0 * rounds * math.log(1.0 / delta))) * (1.0 - 4.0 * np.finfo(float).eps)
    return eps_r, delta / (rounds + 1)
