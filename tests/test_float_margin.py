"""Reported privacy figures are never below the exact value (issue 43 item 7; docs: eps is never rounded down).

The exact continuous Gaussian's (eps, delta) curve (Balle & Wang 2018, Thm 8: delta(eps) = Phi(mu/2 - eps/mu) -
e^eps Phi(-mu/2 - eps/mu) for sensitivity / std = mu) is computed here independently with mpmath at 50 digits and
compared with what the accountants report. On the code before issue 43 dp_accounting's brentq root was reported as
it was: at sigma = 1, delta = 1e-5 a node recorded 4.377178095681137 where the exact eps is 4.3771780956812246...
"""

from __future__ import annotations

import math

import mpmath
import pytest

from shuffledp.accountants import gaussian, ledger_accounting
from shuffledp.accountants.events import GaussianRound as GaussianEvent
from shuffledp.accountants.pvec_pld import _gauss_eps
from shuffledp.accountants.rdp import round_up
from shuffledp.protocols.gaussian_round import unamplified_epsilon

DIGITS = 50  # every mpmath computation here runs at this precision (workdps: a global setting is another test's too)
SIGMAS = (0.25, 0.5, 1.0, 2.0, 5.0, 20.0, 100.0)
DELTAS = (1e-3, 1e-5, 1e-7, 1e-10)


def _exact_delta(mu: mpmath.mpf, eps: mpmath.mpf) -> mpmath.mpf:
    """Balle & Wang 2018, Thm 8, at DIGITS digits."""
    with mpmath.workdps(DIGITS):
        return mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)


def _exact_eps(sigma: float, delta: float) -> mpmath.mpf:
    """The eps with exact delta(eps) = delta (delta is decreasing in eps): 120 bisection steps at DIGITS digits
    (a width below 1e-30 for every eps here; a step count, not a width, so the loop ends at any precision)."""
    with mpmath.workdps(DIGITS):
        mu, target = 1 / mpmath.mpf(sigma), mpmath.mpf(delta)
        if _exact_delta(mu, mpmath.mpf(0)) <= target:
            return mpmath.mpf(0)
        lo, hi = mpmath.mpf(0), mpmath.mpf(1)
        while _exact_delta(mu, hi) > target:
            lo, hi = hi, 2 * hi
        for _ in range(120):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _exact_delta(mu, mid) > target else (lo, mid)
        assert hi - lo < mpmath.mpf("1e-30")
        return hi


@pytest.mark.parametrize("delta", DELTAS)
@pytest.mark.parametrize("sigma", SIGMAS)
def test_the_exact_gaussian_eps_is_never_reported_below_the_exact_value(sigma, delta):
    """Every route to the exact Gaussian curve: accountants.gaussian ("exact", the ledger's unsampled Gaussian and
    the node's unamplified DP-SGD figure) and pvec_pld's own root. Tolerance: the margin is at most 1e-9 relative
    plus 1e-10 absolute above the float figure, itself within 1e-11 of the exact value."""
    exact = _exact_eps(sigma, delta)
    figures = {
        "gaussian.epsilon_for_rho": gaussian.epsilon_for_rho(1.0 / sigma, delta, "exact"),
        "pvec_pld._gauss_eps": _gauss_eps(1.0 / sigma, delta),
    }
    if sigma == 1.0:  # a Poisson DP-SGD user's unamplified figure after one round at z = 1 (the probe's case)
        figures["unamplified_epsilon"] = unamplified_epsilon(1.0, 1, delta, True)
        event = GaussianEvent(1.0, 1.0, "central")
        figures["ledger"] = ledger_accounting.account([(event, 1)], delta, "tight").eps
    for name, eps in figures.items():
        assert mpmath.mpf(eps) >= exact, (name, eps, exact)
        assert eps <= float(exact) * (1 + 2e-9) + 2e-10, (name, eps, exact)


def test_the_probe_case_is_reported_above_the_exact_value():
    exact = _exact_eps(1.0, 1e-5)
    assert mpmath.nstr(exact, 16) == "4.377178095681225" and mpmath.mpf(4.377178095681137) < exact  # the old figure
    assert mpmath.mpf(unamplified_epsilon(1.0, 1, 1e-5, True)) >= exact


@pytest.mark.parametrize("sigma", (0.5, 1.0, 5.0))
@pytest.mark.parametrize("eps", (0.1, 1.0, 4.0))
def test_the_exact_gaussian_delta_is_never_reported_below_the_exact_value(sigma, eps):
    exact = _exact_delta(1 / mpmath.mpf(sigma), mpmath.mpf(eps))
    reported = gaussian.delta_for_rho(1.0 / sigma, eps, "exact")
    assert mpmath.mpf(reported) >= exact and reported <= float(exact) * (1 + 2e-9)


def test_round_up_keeps_exact_zero_and_infinity_and_raises_the_rest():
    assert round_up(0.0) == 0.0 and round_up(math.inf) == math.inf
    assert round_up(1.0) == pytest.approx(1.0 + 1e-9 + 1e-10, rel=1e-15) and round_up(1.0) > 1.0 + 1e-9
    # a delta: relative alone (deltas of 1e-140 are reported)
    assert round_up(1e-140, probability=True) == pytest.approx(1e-140 * (1 + 1e-9), rel=1e-15)
