"""Paper accounting for P1D / PVEC (Cheu, Joseph, Mao, Peng, ICLR 2022; spec 000 sections 2, 3, 5, 7).

* ``p1d_instance_epsilon``: Lemma 3.1, D_delta(view || view') <= eps (2/g + |x - x'|/Delta).
* ``binomial_mechanism``: Lemma A.1 (shift t, M' trials, alpha): eps = |shift| ln((1+alpha)/(1-alpha)),
  delta = 2 exp(-alpha^2 M' p / 10), valid for p <= 1/2, alpha in (0, 1) and alpha M' p >= 2t.
* ``lemma33``: Lemma 3.3 (heterogeneous advanced composition, instance-specific).
* ``pvec_paper_round``: the per-round (eps, delta) of PVEC from these bounds for the *actual* number of
  contributors n'. How n' enters: the noise is Bin(M', p) with M' = m n' (Lemma A.2's proof with n -> n').
  Default rule ("sqrt"): alpha = sqrt(10 ln(2/delta_hat) / (M' p)), which keeps every coordinate's delta at
  delta_hat (at n' = n it is exactly the paper's alpha = eps_hat/(3g)); fewer contributors give a larger
  alpha, i.e. eps grows like sqrt(n/n'). Rule "claim_a8" (App. A.3, robust): n' = h n, alpha =
  eps_hat/(3 h g), eps grows like 1/h. Both use ln((1+a)/(1-a)) exactly (not the proof's <= 3a step), the
  proof's discretization |xhat - xhat'| <= g |x - x'|/Delta + 2, and the worst neighbour pair: with
  Delta = 2 delta2 and ||x - x'|| <= 2 delta2, sum_j (2/g + a_j/Delta)^2 <= (1 + 2 sqrt(d)/g)^2 (the paper
  bounds it by 9 using g >= d), and sum_j e_j (e^e_j - 1) <= S (e^emax - 1)/emax.
* ``pvec_robust_round``: Claim A.8 / Cor A.9 with honest fraction h (eps/h nominal, computed explicitly).
* Exact P1D check (spec 000 sec 7 item 3): ``binomial_hockey_stick`` is the exact hockey-stick divergence
  between Bin(M, p) and t + Bin(M, p) (both directions), computed from binomial CDFs in log space
  (monotone likelihood ratio => the optimal set is a half-line); ``binomial_tight_epsilon`` inverts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import scipy.optimize
from scipy.stats import binom

from shuffledp.accountants.rdp import check_int, round_up
from shuffledp.mechanisms.pvec import P1dParams, PvecParams

__all__ = [
    "p1d_instance_epsilon",
    "binomial_mechanism",
    "lemma33",
    "pvec_coordinate_epsilons",
    "PaperRoundBound",
    "pvec_paper_round",
    "pvec_robust_round",
    "binomial_hockey_stick",
    "binomial_tight_epsilon",
    "p1d_exact_delta",
    "p1d_tight_epsilon",
]


def _pos(name: str, v: float) -> float:
    v = float(v)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return v


def _unit(name: str, v: float, closed_low: bool = False) -> float:
    v = float(v)
    ok = (0.0 <= v < 1.0) if closed_low else (0.0 < v < 1.0)
    if not ok:
        raise ValueError(f"{name} must lie in {'[0, 1)' if closed_low else '(0, 1)'}, got {v!r}")
    return v


# ------------------------------------------------------------------------------------ paper lemmas
def p1d_instance_epsilon(eps: float, g: int, x: float, x_prime: float, Delta: float = 1.0) -> float:
    """Lemma 3.1 (paper 000): eps (2/g + |x - x'|/Delta) for neighbours differing in one user's x in [0, Delta]."""
    eps = _pos("eps", eps)
    g = check_int("g", g, 1)
    Delta = _pos("Delta", Delta)
    for name, v in (("x", x), ("x_prime", x_prime)):
        if not 0.0 <= float(v) <= Delta:
            raise ValueError(f"{name} must lie in [0, Delta={Delta}], got {v!r}")
    return eps * (2.0 / g + abs(float(x) - float(x_prime)) / Delta)


def binomial_mechanism(shift: int, M: int, p: float, alpha: float, t: int | None = None) -> tuple[float, float]:
    """Lemma A.1 (paper 000): f + Bin(M, p) with |f - f'| = shift <= t is (eps, delta) with
    eps = shift ln((1+alpha)/(1-alpha)), delta = 2 exp(-alpha^2 M p / 10); needs p in (0, 1/2], alpha in
    (0, 1), alpha M p >= 2t. Returns (inf, 1) when the conditions fail (the lemma then says nothing)."""
    shift = check_int("shift", shift, 0)
    M = check_int("M", M, 1)
    p = float(p)
    if not 0.0 < p <= 0.5:
        raise ValueError(f"p must lie in (0, 1/2] (Lemma A.1), got {p!r}")
    alpha = _unit("alpha", alpha)
    t = shift if t is None else check_int("t", t, 0)
    if shift > t:
        raise ValueError(f"shift must be <= t, got shift={shift}, t={t}")
    if alpha * M * p < 2 * t:
        return math.inf, 1.0
    eps = shift * (math.log1p(alpha) - math.log1p(-alpha))
    delta = min(1.0, 2.0 * math.exp(-alpha * alpha * M * p / 10.0))
    return eps, delta


def lemma33(eps_j: np.ndarray, delta_j: np.ndarray, gamma: float) -> tuple[float, float]:
    """Lemma 3.3 (paper 000): eps' = sum e_j (e^e_j - 1) + 2 sqrt(ln(1/gamma) sum e_j^2), delta' = sum d_j + gamma."""
    e = np.asarray(eps_j, dtype=np.float64)
    dl = np.asarray(delta_j, dtype=np.float64)
    if e.shape != dl.shape or np.any(~np.isfinite(e)) or np.any(e < 0):
        raise ValueError("eps_j must be finite, >= 0 and of the same shape as delta_j")
    if np.any(dl < 0) or np.any(dl > 1):
        raise ValueError("delta_j must lie in [0, 1]")
    gamma = _unit("gamma", gamma)
    eps = float(np.sum(e * np.expm1(e)) + 2.0 * math.sqrt(math.log(1.0 / gamma) * float(np.sum(e * e))))
    return eps, min(1.0, float(np.sum(dl)) + gamma)


def pvec_coordinate_epsilons(params: PvecParams, x: np.ndarray, x_prime: np.ndarray) -> np.ndarray:
    """Per-coordinate eps_j = eps_hat (2/g + |x_j - x'_j| / (2 delta2)) of the proof of Thm 3.2 (paper 000)."""
    x = np.asarray(x, dtype=np.float64)
    xp = np.asarray(x_prime, dtype=np.float64)
    if x.shape != (params.d,) or xp.shape != (params.d,):
        raise ValueError(f"x and x_prime must have shape ({params.d},), got {x.shape} and {xp.shape}")
    lim = params.delta2 * (1.0 + 1e-12)
    if np.linalg.norm(x) > lim or np.linalg.norm(xp) > lim:
        raise ValueError(f"x and x_prime must have l2 norm <= delta2={params.delta2} (clip first)")
    return params.eps_hat * (2.0 / params.g + np.abs(x - xp) / (2.0 * params.delta2))


@dataclass(frozen=True)
class PaperRoundBound:
    """Paper-bound privacy of one PVEC round: (eps, delta) and the ingredients."""

    eps: float
    delta: float
    n_contrib: int
    alpha: float
    eps_tilde: float  # per-coordinate scale: e_j <= eps_tilde (2/g + a_j/(2 delta2))
    sum_sq: float  # worst sum_j e_j^2
    eps_paper_chain: float  # the proof of Thm 3.2 verbatim: 18 e^2 + 6 e sqrt(ln(1/gamma)), e = 3 g alpha


def _paper_round(params: PvecParams, k: int, alpha: float, delta_coord: float) -> PaperRoundBound:
    g, d = params.g, params.d
    Mp = params.m * k
    inf = PaperRoundBound(math.inf, 1.0, k, alpha, math.inf, math.inf, math.inf)
    # Lemma A.1 with t = g (xhat in {0..g}); p <= 1/2 required
    if not (0.0 < alpha < 1.0) or params.p > 0.5 or alpha * Mp * params.p < 2 * g:
        return inf
    eps_tilde = g * (math.log1p(alpha) - math.log1p(-alpha))  # e_j <= (2 + g a_j/Delta) ln((1+a)/(1-a))
    sum_sq = eps_tilde**2 * (1.0 + 2.0 * math.sqrt(d) / g) ** 2
    emax = eps_tilde * (2.0 / g + 1.0)
    gamma = params.delta / (d + 1)  # composition slack of the proof of Thm 3.2
    drift = sum_sq * math.expm1(emax) / emax  # sum e_j (e^e_j - 1) <= sum e_j^2 (e^emax - 1)/emax
    eps = drift + 2.0 * math.sqrt(math.log(1.0 / gamma) * sum_sq)
    delta = min(1.0, d * delta_coord + gamma)
    # verbatim chain (needs alpha <= 0.8586 for ln((1+a)/(1-a)) <= 3a and g >= d for sum e_j^2 <= 9 e^2)
    e3 = 3.0 * g * alpha
    chain = 18.0 * e3 * e3 + 6.0 * e3 * math.sqrt(math.log(1.0 / gamma)) if alpha <= 0.8586 and g >= d else math.inf
    return PaperRoundBound(eps, delta, k, alpha, eps_tilde, sum_sq, chain)


def pvec_paper_round(
    params: PvecParams, n_contrib: int | None = None, rule: Literal["sqrt", "claim_a8"] = "sqrt"
) -> PaperRoundBound:
    """Per-round (eps, delta) of PVEC from the paper's Lemmas A.1 and 3.3 with n' = n_contrib contributors.

    See the module docstring for how n' enters. At n' = n (rule "sqrt") eps <= params.eps (Thm 3.2), delta =
    params.delta. Returns eps = inf when Lemma A.1's conditions fail (e.g. far too few contributors).
    """
    k = params.n if n_contrib is None else check_int("n_contrib", n_contrib, 1)
    if k > params.n:
        raise ValueError(f"n_contrib must lie in [1, n={params.n}], got {k}")
    dh = params.delta_hat
    if rule == "sqrt":
        alpha = math.sqrt(10.0 * math.log(2.0 / dh) / (params.m * k * params.p))
        return _paper_round(params, k, alpha, dh)
    if rule == "claim_a8":
        h = k / params.n
        alpha = params.eps_hat / (3.0 * h * params.g)
        delta_coord = min(1.0, 2.0 * math.exp(-alpha * alpha * params.m * k * params.p / 10.0))
        return _paper_round(params, k, alpha, delta_coord)
    raise ValueError(f"rule must be 'sqrt' or 'claim_a8', got {rule!r}")


def pvec_robust_round(params: PvecParams, h: float) -> tuple[float, float, PaperRoundBound]:
    """Claim A.8 / Cor A.9 (paper 000): with an honest fraction h in [1/3, 1] (n' = ceil(h n) honest users),
    returns (nominal eps/h of Cor A.9, delta, the explicitly computed bound with alpha = eps_hat/(3 h g))."""
    h = float(h)
    if not 1.0 / 3.0 <= h <= 1.0:
        raise ValueError(f"h (honest fraction) must lie in [1/3, 1] (Claim A.8), got {h!r}")
    k = max(1, math.ceil(h * params.n - 1e-9))
    b = pvec_paper_round(params, k, rule="claim_a8")
    return params.eps / h, params.delta, b


# ------------------------------------------------------------------------------- exact binomial privacy
def _log_lr(k: int, M: int, p: float, t: int) -> float:
    """log B(k) / B(k - t) = sum_{i<t} log((M - k + i + 1) p / ((k - i) q)); decreasing in k."""
    i = np.arange(t, dtype=np.float64)
    return float(np.sum(np.log((M - k + i + 1.0) / (k - i)))) + t * math.log(p / (1.0 - p))


def _log_cdf_upper(x: int, M: int, p: float) -> float:
    """log P(Bin(M,p) <= x), from scipy; if it underflows, the Chernoff upper bound."""
    if x < 0:
        return -math.inf
    v = float(binom.logcdf(x, M, p))
    if v == -math.inf:
        r = x / M
        if r < p:
            kl = (r * math.log(r / p) if r > 0 else 0.0) + (1 - r) * math.log((1 - r) / (1 - p))
            return -M * kl
        return 0.0
    return v


def _hockey_one(M: int, p: float, t: int, eps: float) -> float:
    """sum_k (P(k) - e^eps Q(k))_+ with P = Bin(M, p), Q = t + Bin(M, p); A = {k <= k*} by MLR."""
    if _log_lr(t, M, p, t) <= eps:  # even at k = t the ratio is <= e^eps: A = {0..t-1} (Q = 0 there)
        kstar = t - 1
    else:
        lo, hi = t, M + 1  # ratio > e^eps at lo; find the last such k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _log_lr(mid, M, p, t) > eps:
                lo = mid
            else:
                hi = mid
        kstar = lo
    la = _log_cdf_upper(kstar, M, p)
    lb = float(binom.logcdf(kstar - t, M, p)) if kstar >= t else -math.inf
    if la == -math.inf:
        return 0.0
    diff = eps + lb - la
    if diff >= 0.0:
        return 0.0
    return min(1.0, math.exp(la) * -math.expm1(diff))


def binomial_hockey_stick(M: int, p: float, shift: int, eps: float) -> float:
    """Exact delta(eps) between Bin(M, p) and shift + Bin(M, p), max over both directions (spec 000 sec 7.3).

    The view of P1D for neighbours whose rounded values differ by ``shift`` (M = m n'). Uses the monotone
    likelihood ratio: the optimal event is a half-line, so delta = F_P(k*) - e^eps F_Q(k*) from log CDFs
    (the other direction is the mirror image with p -> 1 - p).
    """
    M = check_int("M", M, 1)
    shift = check_int("shift", shift, 0)
    p = _unit("p", p)
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if shift == 0:
        return 0.0
    return max(_hockey_one(M, p, shift, eps), _hockey_one(M, 1.0 - p, shift, eps))


def binomial_tight_epsilon(M: int, p: float, shift: int, delta: float) -> float:
    """Smallest eps with binomial_hockey_stick(M, p, shift, eps) <= delta (bisection, rounded up)."""
    delta = _unit("delta", delta)
    if binomial_hockey_stick(M, p, shift, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while binomial_hockey_stick(M, p, shift, hi) > delta:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    e = scipy.optimize.brentq(lambda x: binomial_hockey_stick(M, p, shift, x) - delta, 0.0, hi, xtol=1e-12)
    while binomial_hockey_stick(M, p, shift, e) > delta:  # never round eps down
        e = math.nextafter(e, math.inf) + 1e-12
    return round_up(e)  # feasible in floating point; the margin covers the hockey stick's float error


def p1d_exact_delta(params: P1dParams, eps: float | None = None, n_contrib: int | None = None) -> float:
    """Exact delta of P1D's view for the worst neighbours (rounded gap g) at eps (default: Lemma 3.1's
    eps_claim = eps (2/g + 1)). Spec 000 sec 7.3: for (n=100, eps=1, delta=1e-3) it is ~1e-111."""
    k = params.n if n_contrib is None else check_int("n_contrib", n_contrib, 1)
    e = params.eps * (2.0 / params.g + 1.0) if eps is None else float(eps)
    return binomial_hockey_stick(params.m * k, params.p, params.g, e)


def p1d_tight_epsilon(params: P1dParams, delta: float, n_contrib: int | None = None) -> float:
    """Tight eps of P1D at delta for the worst neighbours (spec 000 sec 7.3: ~0.093 at 1e-3 vs claimed 1.2)."""
    k = params.n if n_contrib is None else check_int("n_contrib", n_contrib, 1)
    return binomial_tight_epsilon(params.m * k, params.p, params.g, delta)
