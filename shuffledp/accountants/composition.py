"""Generic composition theorems for (eps, delta)-DP (used by the seed-000 accountants; spec 000 section 5).

* ``advanced_composition``: Dwork & Roth 2014, Thm 3.20: k adaptive (eps, delta) mechanisms are
  (eps sqrt(2k ln(1/d')) + k eps (e^eps - 1), k delta + d')-DP.
* ``kov_delta`` / ``kov_epsilon``: the optimal composition of k homogeneous (eps, delta) mechanisms, exactly
  (Kairouz, Oh & Viswanath 2015, Thm 3.3; Murtagh & Vadhan 2016): delta_tot(eps_g) = 1 - (1-delta)^k
  + (1-delta)^k sum_i C(k,i) [e^{(k-i) eps} - e^{eps_g} e^{i eps}]_+ / (1+e^eps)^k, in log space.
  dp_accounting has no closed form for it; its PLD of ``from_privacy_parameters`` self-composed is a
  pessimistic discretisation of the same dominating pair (used as a cross-check in the tests). The closed-form
  KOV Thm 3.4 bound lives in ``shuffledp.accountants.fmt_shuffle.kov15_epsilon`` (not duplicated here).
* ``parallel_composition``: sequential protocols with disjoint cohorts (each user in one round, later rounds
  post-processing of earlier transcripts plus fresh users' data) cost the max over rounds (spec 000 sec 5).
* ``pgd_round_budget`` / ``pgd_total``: PGD's per-round budget eps_r = eps/(2 sqrt(2T ln(1/delta))),
  delta_r = delta/(T+1) (Alg 5 / Lemma B.6 of paper 000) and its total by advanced composition with
  d' = delta/(T+1) (spec 000 sec 5: eps=1, T=15, delta=1e-6 gives 0.557).
* ``max_rounds_*``: the largest number of rounds T whose composition fits (eps, delta).
* ``max_rounds`` / ``bisect_boundary``: the inverse queries' searches (integer / real parameter) for any
  monotone "fits the budget" predicate; both return a value that was checked to fit (the safe side).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import scipy.optimize
from scipy.special import gammaln, logsumexp

from shuffledp.accountants.rdp import check_int, rdp_to_dp, round_up

__all__ = [
    "advanced_composition",
    "kov_delta",
    "kov_epsilon",
    "parallel_composition",
    "pgd_round_budget",
    "pgd_total",
    "max_rounds",
    "bisect_boundary",
    "max_rounds_advanced",
    "max_rounds_kov",
    "max_rounds_rdp",
]


def _eps(name: str, v: float) -> float:
    v = float(v)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return v


def _delta(name: str, v: float, open_low: bool = False) -> float:
    v = float(v)
    if not ((0.0 < v < 1.0) if open_low else (0.0 <= v <= 1.0)):
        raise ValueError(f"{name} must lie in {'(0, 1)' if open_low else '[0, 1]'}, got {v!r}")
    return v


# --------------------------------------------------------------------------------------------------- basic
def advanced_composition(eps: float, delta: float, k: int, delta_prime: float) -> tuple[float, float]:
    """Dwork & Roth 2014, Thm 3.20: (eps sqrt(2k ln(1/d')) + k eps (e^eps - 1), k delta + d')."""
    eps = _eps("eps", eps)
    delta = _delta("delta", delta)
    k = check_int("k", k, 0)
    dp = _delta("delta_prime", delta_prime, open_low=True)
    e = eps * math.sqrt(2.0 * k * math.log(1.0 / dp)) + k * eps * math.expm1(eps)
    return e, min(1.0, k * delta + dp)


def kov_delta(eps: float, delta: float, k: int, eps_total: float) -> float:
    """Exact optimal delta of k-fold composition of (eps, delta)-DP at eps_total (KOV15 Thm 3.3)."""
    eps = _eps("eps", eps)
    delta = _delta("delta", delta)
    k = check_int("k", k, 1)
    eg = _eps("eps_total", eps_total)
    log_keep = k * math.log1p(-delta) if delta < 1.0 else -math.inf
    i = np.arange(0, k + 1, dtype=np.float64)
    loss = (k - 2.0 * i) * eps
    sel = loss > eg
    if eps == 0.0 or not sel.any():
        d_rr = 0.0
    else:
        ii = i[sel]
        log_terms = (
            gammaln(k + 1.0)
            - gammaln(ii + 1.0)
            - gammaln(k - ii + 1.0)
            + (k - ii) * eps
            - k * np.logaddexp(0.0, eps)
            + np.log(-np.expm1(eg - loss[sel]))
        )
        d_rr = float(np.exp(logsumexp(log_terms)))
    # 1 - (1-delta)^k (1 - d_rr)
    out = -math.expm1(log_keep) + math.exp(log_keep) * d_rr
    return min(1.0, max(0.0, out))


def kov_epsilon(eps: float, delta: float, k: int, delta_total: float) -> float:
    """Smallest eps_total with kov_delta(eps, delta, k, eps_total) <= delta_total (inf if impossible)."""
    dt = _delta("delta_total", delta_total, open_low=True)
    if kov_delta(eps, delta, k, 0.0) <= dt:
        return 0.0
    hi = float(k) * float(eps)
    if kov_delta(eps, delta, k, hi) > dt:
        return math.inf  # below 1 - (1-delta)^k no eps suffices
    e = scipy.optimize.brentq(lambda x: kov_delta(eps, delta, k, x) - dt, 0.0, hi, xtol=1e-13, rtol=1e-12)
    while kov_delta(eps, delta, k, e) > dt:  # never round eps down
        e = e * (1.0 + 1e-12) + 1e-15
    return round_up(e)  # feasible in floating point; the margin covers kov_delta's float error


def parallel_composition(guarantees: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Disjoint cohorts (sequential protocols): (max eps, max delta) over the rounds (spec 000 sec 5)."""
    if not guarantees:
        return 0.0, 0.0
    es = [_eps("eps", e) for e, _ in guarantees]
    ds = [_delta("delta", d) for _, d in guarantees]
    return max(es), max(ds)


# -------------------------------------------------------------------------------------------------- PGD
def pgd_round_budget(eps: float, delta: float, T: int) -> tuple[float, float]:
    """PGD per-round budget (Alg 5 of paper 000): eps_r = eps/(2 sqrt(2T ln(1/delta))), delta_r = delta/(T+1)."""
    eps = _eps("eps", eps)
    delta = _delta("delta", delta, open_low=True)
    T = check_int("T", T, 1)
    return eps / (2.0 * math.sqrt(2.0 * T * math.log(1.0 / delta))), delta / (T + 1)


def pgd_total(eps: float, delta: float, T: int) -> tuple[float, float]:
    """Total (eps, delta) of T PGD rounds by Dwork-Roth 3.20 with d' = delta/(T+1) (spec 000 sec 5).

    delta_tot = T delta/(T+1) + delta/(T+1) = delta; eps_tot ~ 0.557 for eps=1, T=15, delta=1e-6.
    """
    eps_r, delta_r = pgd_round_budget(eps, delta, T)
    e, d = advanced_composition(eps_r, delta_r, T, delta / (T + 1))
    return e, min(d, delta) if math.isclose(d, delta, rel_tol=1e-12) else d


# ---------------------------------------------------------------------------------------- inverse queries
def bisect_boundary(
    fits: Callable[[float], bool],
    good: float,
    bad: float,
    rel_tol: float = 0.0,
    abs_tol: float = 0.0,
    geometric: bool = False,
) -> float:
    """Bisect a bracket of a monotone predicate, ``fits(good)`` true and ``fits(bad)`` false (either order).

    Returns the fitting end of the final bracket (``good`` if no midpoint fits): the least noise / the largest
    eps0 / the smallest eps that was checked to fit, so the answer is never on the unsafe side of the boundary.
    Stops when |bad - good| <= max(abs_tol, rel_tol |good|), or with ``geometric`` (positive ends, midpoint
    sqrt(good bad)) when max/min - 1 <= rel_tol; or when the bracket cannot shrink in floating point.
    """
    while True:
        if geometric:
            if max(good, bad) / min(good, bad) - 1.0 <= rel_tol:
                return good
            mid = math.sqrt(good * bad)
        else:
            if abs(bad - good) <= max(abs_tol, rel_tol * abs(good)):
                return good
            mid = 0.5 * (good + bad)
        if mid in (good, bad):
            return good
        good, bad = (mid, bad) if fits(mid) else (good, mid)


def max_rounds(fits: Callable[[int], bool], t_max: int = 10**12) -> int:
    """Largest T in [0, t_max] with fits(T), for a predicate that is monotone (true up to some T)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= t_max and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, t_max + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_rounds_advanced(eps_r: float, delta_r: float, eps: float, delta: float, t_max: int = 10**12) -> int:
    """Largest T with T rounds of (eps_r, delta_r) within (eps, delta) by Dwork-Roth 3.20 (d' = delta - T delta_r)."""
    eps_r = _eps("eps_r", eps_r)
    delta_r = _delta("delta_r", delta_r)
    eps = _eps("eps", eps)
    delta = _delta("delta", delta, open_low=True)

    def fits(T: int) -> bool:
        dp = delta - T * delta_r
        return dp > 0.0 and advanced_composition(eps_r, delta_r, T, dp)[0] <= eps

    return max_rounds(fits, t_max)


def max_rounds_kov(eps_r: float, delta_r: float, eps: float, delta: float, t_max: int = 10**7) -> int:
    """Largest T with T rounds of (eps_r, delta_r) within (eps, delta) by the optimal composition (KOV15)."""
    eps_r = _eps("eps_r", eps_r)
    delta_r = _delta("delta_r", delta_r)
    eps = _eps("eps", eps)
    delta = _delta("delta", delta, open_low=True)
    return max_rounds(lambda T: kov_delta(eps_r, delta_r, T, eps) <= delta, t_max)


def max_rounds_rdp(
    orders: Sequence[float], rdp_round: Sequence[float], eps: float, delta: float, delta0_round: float = 0.0,
    t_max: int = 10**12,
) -> int:  # fmt: skip
    """Largest T such that T rounds with this per-round RDP curve (and mixture slack delta0_round, added to
    delta) are (eps, delta)-DP; RDP adds (Mironov 2017, Prop. 1), conversion as ``rdp.rdp_to_dp``."""
    r = np.asarray(rdp_round, dtype=np.float64)
    eps = _eps("eps", eps)
    delta = _delta("delta", delta, open_low=True)
    d0 = _delta("delta0_round", delta0_round)

    def fits(T: int) -> bool:
        dc = delta - T * d0
        return dc > 0.0 and rdp_to_dp(orders, T * r, dc)[0] <= eps

    return max_rounds(fits, t_max)
