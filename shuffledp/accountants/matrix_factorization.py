"""The accountant of matrix-factorization DP-FTRL (issue 27); the mechanism: mechanisms.matrix_factorization.

The whole run (T rounds of C x + Z, Z ~ N(0, z^2 L^2) per entry, contributions clipped to L, each user within the
participation limits) is ONE Gaussian mechanism with sensitivity Delta L, where Delta is the strategy's worst case
over the allowed participation patterns (mechanisms.matrix_factorization.sensitivity), also for adaptively chosen
inputs (Denisov et al. 2022 Thm 2.1; Choquette-Choo et al. 2023, arXiv:2211.06530 Thm 2.1). So it is mu-GDP with
mu = Delta / z (zero-out neighbours, as the tree, spec 003 A2), and its (eps, delta) is the exact Gaussian curve
(Balle-Wang 2018) via dp_accounting (accountants.gaussian, method "exact"). The noise is the continuous Gaussian,
for which that curve is proven (accountants.gaussian module docstring).
"""

from __future__ import annotations

from dp_accounting import dp_event as dpe

from shuffledp.accountants.gaussian import _check_positive, delta_for_rho, epsilon_for_rho, rho_for_epsilon

__all__ = ["epsilon", "min_noise_multiplier", "dp_event"]


def epsilon(noise_multiplier: float, sens: float, delta: float) -> float:
    """eps of the whole run: the Gaussian mechanism with sensitivity/std ratio mu = Delta / z, exact curve
    (Balle-Wang 2018 via dp_accounting.get_epsilon_gaussian; accountants.gaussian, method "exact")."""
    z = _check_positive("noise_multiplier", noise_multiplier)
    d = _check_positive("sensitivity", sens)
    return epsilon_for_rho(d / z, delta, "exact")


def min_noise_multiplier(sens: float, eps: float, delta: float) -> float:
    """Least z (Z std per unit clip norm) whose run fits (eps, delta): z = Delta / mu_max, mu_max the largest
    Gaussian ratio within the budget (rounded down by rho_for_epsilon), then z stepped up (by 1e-13 relative)
    until both eps(z) <= eps (dp_accounting's root search, what a ledger reports) and the exact delta at eps,
    Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Balle-Wang 2018 Thm 8, no root search), is <= delta."""
    d = _check_positive("sensitivity", sens)
    z = d / rho_for_epsilon(eps, delta, "exact")
    while epsilon(z, d, delta) > eps or delta_for_rho(d / z, eps, "exact") > delta:
        z *= 1.0 + 1e-13
    return z


def dp_event(noise_multiplier: float, sens: float) -> dpe.GaussianDpEvent:
    """dp_accounting's description of the run: GaussianDpEvent with noise multiplier z / Delta."""
    z = _check_positive("noise_multiplier", noise_multiplier)
    return dpe.GaussianDpEvent(z / _check_positive("sensitivity", sens))
