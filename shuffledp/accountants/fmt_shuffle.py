"""Seed 001's baseline: Feldman-McMillan-Talwar (FMT20) amplification by shuffling + subsampling + composition.

Spec 001 section 5 (paper Sec. 4, Figs 2-5):
- ``fmt_epsilon(method="closed")``: FMT20 Thm 3.1 closed form for k shuffled eps0-LDP reports,
  eps_s = log(1 + (e^eps0-1)/(e^eps0+1) (8 sqrt(e^eps0 log(4/ds))/sqrt(k) + 8 e^eps0/k)),
  valid only if eps0 <= log(k/(16 log(2/ds))) (paper's condition (8)); otherwise (eps0, 0) as the paper does.
- ``fmt_epsilon(method="numerical")``: the exact "hiding among the clones" bound the paper used: with
  C ~ Bin(k-1, e^-eps0), A|C ~ Bin(C, 1/2), alpha = e^eps0/(e^eps0+1),
  P = alpha (A+1) + (1-alpha) A, Q = alpha A + (1-alpha)(A+1) (counts of the first clone type given C), and
  ds(eps) = sum_c Pr[C=c] sum_j (P_c(j) - e^eps Q_c(j))_+ ; eps is found by Brent's method and reported from
  the safe side. P_c(j)/Q_c(j) is increasing in j, so each inner sum is a difference of two binomial tails:
  O(1) per c (O(k) overall instead of O(k^2)). The sum over c is restricted to a window whose exact outside
  mass is ADDED to ds (each inner sum is <= 1), so truncation only makes ds larger (safe). P and Q are mirror
  images (j <-> c+1-j), so D_{e^eps}(P||Q) = D_{e^eps}(Q||P) and one direction suffices.
- ``subsample_dp``: amplification by subsampling k of n without replacement (Ullman 2017; Balle-Barthe-Gaboardi
  2018 Thm 9, replace-one): (log(1 + gamma (e^eps - 1)), gamma delta).
- ``kov15_epsilon``: Kairouz-Oh-Viswanath 2015 composition bound (closed form, Thm 3.4) as quoted in spec 001
  section 5. The exact optimal composition (KOV15 Thm 3.3) is ``composition.kov_epsilon``, a different bound.
- ``baseline_epsilon``: numeric FMT + subsampling + KOV15, delta split d' = delta/2, gamma ds = delta/(2T)
  (spec 001 section 5 [ext], ambiguity A5).
- ``tight_pld_epsilon``: composes a dominating pair of the SUBSAMPLED FMT round as a privacy loss distribution
  with dp_accounting (pessimistic discretisation). The pair (derivation in ``subsampled_fmt_pair``) is an exact
  post-processing reduction, so it is valid at every order of the hockey-stick divergence and composes.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

import numpy as np
import scipy.optimize
from dp_accounting.pld import privacy_loss_distribution as dpa_pld
from scipy.stats import binom

from shuffledp.accountants.rdp import check_delta, check_int, check_nk, round_up

__all__ = [
    "fmt_condition_holds",
    "fmt_closed_form",
    "fmt_delta",
    "fmt_epsilon",
    "subsample_dp",
    "kov15_epsilon",
    "baseline_epsilon",
    "subsampled_fmt_pair",
    "subsampled_fmt_pld",
    "tight_pld_epsilon",
]

Method = Literal["closed", "numerical"]
_EPS_TOL = 1e-10  # root-finding tolerance on eps (the result is moved to the safe side)


# ----------------------------------------------------------------------------------------------- validation
def _check_eps0(eps0: float) -> float:
    e = float(eps0)
    if not (math.isfinite(e) and e > 0.0):
        raise ValueError(f"eps0 (the LDP parameter) must be a finite number > 0, got {eps0!r}")
    if e > 700.0:
        raise ValueError(f"eps0 (the LDP parameter) must be <= 700 (e^eps0 overflows), got {eps0!r}")
    return e


# -------------------------------------------------------------------------------------- FMT20, one shuffle
def fmt_condition_holds(eps0: float, n: int, delta: float) -> bool:
    """The paper's condition (8) (FMT20 Thm 3.1): eps0 <= log(n / (16 log(2/delta)))."""
    return float(eps0) <= math.log(n / (16.0 * math.log(2.0 / delta)))


def fmt_closed_form(eps0: float, n: int, delta: float) -> float:
    """FMT20 Thm 3.1 closed form (spec 001 section 5), without checking condition (8)."""
    e = _check_eps0(eps0)
    n = check_int("n (number of shuffled reports)", n, 1)
    d = check_delta(delta)
    ee = math.exp(e)
    return math.log1p(math.tanh(e / 2.0) * (8.0 * math.sqrt(ee * math.log(4.0 / d) / n) + 8.0 * ee / n))


def _c_window(k: int, eps0: float, tail_target: float) -> tuple[np.ndarray, np.ndarray, float]:
    """c values of C ~ Bin(k-1, e^-eps0) in a window around the mean, their pmf, and the exact outside mass."""
    q0 = math.exp(-eps0)
    m = k - 1
    mean, sd = m * q0, math.sqrt(m * q0 * (1.0 - q0))
    half = (math.sqrt(2.0 * math.log(2.0 / tail_target)) + 1.0) * sd + 12.0  # ~normal tail; checked below
    while True:
        lo, hi = int(max(0.0, math.floor(mean - half))), int(min(float(m), math.ceil(mean + half)))
        outside = (float(binom.cdf(lo - 1, m, q0)) if lo > 0 else 0.0) + float(binom.sf(hi, m, q0))
        if outside <= tail_target or (lo == 0 and hi == m):
            c = np.arange(lo, hi + 1, dtype=np.int64)
            return c, binom.pmf(c, m, q0), outside
        half *= 1.5


def _fmt_delta_core(eps: float, eps0: float, k: int, c: np.ndarray, w: np.ndarray, outside: float) -> float:
    alpha = 1.0 / (1.0 + math.exp(-eps0))  # e^eps0/(e^eps0+1)
    big_e = math.exp(eps)
    a_coef = alpha - big_e * (1.0 - alpha)  # coefficient of S(t-1) in sum_{j>=t} (P_c(j) - E Q_c(j))
    if a_coef <= 0.0:  # E >= e^eps0 = max_j P_c(j)/Q_c(j): the hockey-stick divergence is 0
        return min(1.0, outside) if outside > 0 else 0.0
    b_coef = (1.0 - alpha) - big_e * alpha
    # P_c(j)/Q_c(j) = (alpha x + 1-alpha)/(alpha + (1-alpha) x), x = j/(c-j+1), increasing in j; it is >= E
    # iff x >= x0, i.e. j >= x0 (c+1)/(1+x0). Take the best of three candidate thresholds (robust to rounding).
    x0 = (big_e * alpha - (1.0 - alpha)) / a_coef
    t0 = np.ceil(x0 * (c + 1.0) / (1.0 + x0)).astype(np.int64)
    # S(t) = P(A >= t) at t = t0-2 .. t0+1 (one binom.sf per point)
    surv = [binom.sf(t0 + dt - 1, c, 0.5) for dt in (-2, -1, 0, 1)]
    best = np.zeros(c.shape, dtype=np.float64)
    for i in range(3):  # thresholds t0-1, t0, t0+1: h(t) = a S(t-1) + b S(t)
        best = np.maximum(best, a_coef * surv[i] + b_coef * surv[i + 1])
    return min(1.0, float(np.dot(w, best)) + outside)


def fmt_delta(eps: float, eps0: float, n: int) -> float:
    """Exact FMT20 clone-reduction hockey-stick divergence ds(eps) for n shuffled eps0-LDP reports (safe side)."""
    e0 = _check_eps0(eps0)
    n = check_int("n (number of shuffled reports)", n, 1)
    if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    c, w, outside = _c_window(n, e0, 1e-18)
    return _fmt_delta_core(float(eps), e0, n, c, w, outside)


@lru_cache(maxsize=1024)
def _fmt_numerical(eps0: float, n: int, delta: float) -> float:
    c, w, outside = _c_window(n, eps0, 1e-6 * delta)
    if _fmt_delta_core(0.0, eps0, n, c, w, outside) <= delta:
        return 0.0

    # ds(eps0) = outside <= 1e-6 delta, ds(0) > delta, ds decreasing: Brent's method, then step to the safe side
    def excess(e: float) -> float:
        return _fmt_delta_core(e, eps0, n, c, w, outside) - delta

    x = float(scipy.optimize.brentq(excess, 0.0, eps0, xtol=_EPS_TOL, rtol=4 * np.finfo(float).eps))
    x = min(eps0, x + _EPS_TOL)
    while x < eps0 and excess(x) > 0.0:
        x = min(eps0, x + 10 * _EPS_TOL)
    return min(eps0, round_up(x))  # feasible in floating point; the margin covers ds's float error (eps0: exact)


def fmt_epsilon(
    eps0: float, n: int, delta: float, method: Method = "numerical", paper_conditions: bool = False
) -> float:
    """eps_s such that shuffling n eps0-LDP reports is (eps_s, delta)-DP (FMT20; spec 001 section 5).

    method="closed": Thm 3.1 closed form; if condition (8) fails it returns eps0 (valid with delta = 0), as the
    paper does. method="numerical": the exact clone bound, valid for every eps0; ``paper_conditions=True``
    applies the paper's fallback to eps0 when (8) fails (reproduces the paper, never tighter).
    The result never exceeds eps0 (the shuffle of eps0-LDP reports is eps0-DP).
    """
    e = _check_eps0(eps0)
    n = check_int("n (number of shuffled reports)", n, 1)
    d = check_delta(delta)
    if method not in ("closed", "numerical"):
        raise ValueError(f"method must be 'closed' or 'numerical', got {method!r}")
    if method == "closed":
        return min(e, fmt_closed_form(e, n, d)) if fmt_condition_holds(e, n, d) else e
    if paper_conditions and not fmt_condition_holds(e, n, d):
        return e
    return min(e, _fmt_numerical(e, n, d))


# ------------------------------------------------------------------------------- subsampling, composition
def subsample_dp(eps: float, delta: float, gamma: float) -> tuple[float, float]:
    """(eps, delta)-DP mechanism on a uniform fraction gamma sampled without replacement (replace-one):
    (log(1 + gamma (e^eps - 1)), gamma delta)  [Ull17; Balle-Barthe-Gaboardi 2018 Thm 9]."""
    if not (0.0 < gamma <= 1.0):
        raise ValueError(f"gamma (sampling rate) must be in (0, 1], got {gamma!r}")
    if eps < 0 or not (0.0 <= delta <= 1.0):
        raise ValueError(f"need eps >= 0 and delta in [0, 1], got eps={eps!r}, delta={delta!r}")
    return math.log1p(gamma * math.expm1(eps)), gamma * delta


def kov15_epsilon(eps: float, T: int, delta_prime: float) -> float:
    """KOV15 (as spec 001 section 5): T-fold adaptive composition of (eps, d)-DP is
    (eps_tot, 1 - (1-d)^T (1-delta_prime))-DP with eps_tot = min{T eps,
      T eps tanh(eps/2) + eps sqrt(2T log(e + sqrt(T eps^2)/delta_prime)),
      T eps tanh(eps/2) + eps sqrt(2T log(1/delta_prime))}; (e^eps-1)/(e^eps+1) = tanh(eps/2)."""
    T = check_int("T (number of rounds)", T, 1)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    d = check_delta(delta_prime, "delta_prime")
    if eps == 0.0:
        return 0.0
    drift = T * eps * math.tanh(eps / 2.0)
    return min(
        T * eps,
        drift + eps * math.sqrt(2.0 * T * math.log(math.e + math.sqrt(T * eps * eps) / d)),
        drift + eps * math.sqrt(2.0 * T * math.log(1.0 / d)),
    )


def baseline_epsilon(
    eps0: float,
    n: int,
    k: int,
    T: int,
    delta: float,
    method: Method = "numerical",
    paper_conditions: bool = False,
    delta_split: float = 0.5,
) -> float:
    """The paper's baseline: FMT20 shuffle of k reports -> subsampling k of n -> KOV15 over T rounds.

    delta is split as d' = delta_split * delta for KOV15 and gamma * ds = (1 - delta_split) delta / T per round
    (spec 001 section 5 [ext], default 1/2); then 1 - (1 - gamma ds)^T (1 - d') <= delta.
    """
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    T = check_int("T (number of rounds)", T, 1)
    d = check_delta(delta)
    if not (0.0 < delta_split < 1.0):
        raise ValueError(f"delta_split must be in (0, 1), got {delta_split!r}")
    g = k / n
    ds = (1.0 - delta_split) * d / (T * g)
    if ds >= 1.0:  # any delta_s >= 1 makes the round (0, 1)-DP: trivially fits the per-round share
        eps_s = 0.0
    else:
        eps_s = fmt_epsilon(e, k, ds, method=method, paper_conditions=paper_conditions)
    eps_round, _ = subsample_dp(eps_s, min(ds, 1.0), g)
    return kov15_epsilon(eps_round, T, delta_split * d)


# ------------------------------------------------------------------------------------ tight: PLD (option)
def _slot_probabilities(eps0: float, gamma: float) -> tuple[float, float]:
    """(p1, p2): probabilities that the 'slot' report is a clone of type 1 / type 2 under D (swapped under D')."""
    alpha = 1.0 / (1.0 + math.exp(-eps0))
    q0 = math.exp(-eps0)
    return gamma * alpha + (1.0 - gamma) * q0 / 2.0, gamma * (1.0 - alpha) + (1.0 - gamma) * q0 / 2.0


def subsampled_fmt_pair(eps0: float, n: int, k: int) -> tuple[dict, dict]:
    """Explicit pmfs (outcome -> probability) of a dominating pair (X, Y) for one subsampled-shuffle round.

    Derivation (mine; FMT20's clone decomposition applied to the sampled batch). Write R(x1) = alpha Q1 +
    (1-alpha) Q1', R(x1') = (1-alpha) Q1 + alpha Q1', and every other report as e^-eps0/2 (Q1 + Q1') +
    (1 - e^-eps0) LO_j (FMT20 Lemma 3.3). Call 'slot' user 1 when it is sampled (prob gamma), otherwise a
    uniformly chosen member of the sample. In both cases the other k-1 members are a uniform (k-1)-subset of
    the users other than 1, and each of them is a clone independently with prob e^-eps0. So the shuffled
    output is one common post-processing of (slot type, C, A) with C ~ Bin(k-1, e^-eps0), A | C ~ Bin(C, 1/2):
      slot = Q1 w.p. p1 = gamma alpha + (1-gamma) e^-eps0/2, Q1' w.p. p2 = gamma (1-alpha) + (1-gamma) e^-eps0/2,
      LO otherwise (then identical under D and D': outcome 'bot'); under D' p1 and p2 swap.
    Sufficient statistic (c, j = #Q1 among the c+1 clones):
      X(c, j) = Pr[C=c] Bin(c+1, 1/2)(j) * 2 (p1 j + p2 (c+1-j)) / (c+1), Y with p1 <-> p2.
    gamma = 1 gives exactly FMT20's (P, Q). Returns (X, Y) as dicts over (c, j) plus 'bot'; small k only.
    """
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    p1, p2 = _slot_probabilities(e, k / n)
    q0 = math.exp(-e)
    x: dict = {"bot": 1.0 - p1 - p2}
    y: dict = {"bot": 1.0 - p1 - p2}
    for c in range(k):
        pc = float(binom.pmf(c, k - 1, q0))
        j = np.arange(c + 2)
        b = binom.pmf(j, c + 1, 0.5) * 2.0 / (c + 1)
        for jj, bj in zip(j.tolist(), b.tolist(), strict=True):
            x[(c, jj)] = pc * bj * (p1 * jj + p2 * (c + 1 - jj))
            y[(c, jj)] = pc * bj * (p2 * jj + p1 * (c + 1 - jj))
    return x, y


def _pair_losses(eps0: float, n: int, k: int, tail_mass: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Privacy losses log(X/Y) and X-masses of the pair of ``subsampled_fmt_pair`` (vectorised over (c, j)),
    including the loss-0 outcome 'bot', and an upper bound on the X-mass left out of the (c, j) windows."""
    p1, p2 = _slot_probabilities(eps0, k / n)
    c, w, inf_mass = _c_window(k, eps0, tail_mass / 2.0)
    half = int(math.ceil(9.0 * math.sqrt(float(c.max()) + 1.0) / 2.0)) + 3  # +-9 sd of Bin(c+1, 1/2)
    offsets = np.arange(-half, half + 1, dtype=np.int64)
    chunk = max(1, 2_000_000 // offsets.size)
    losses, probs = [np.zeros(1)], [np.array([1.0 - p1 - p2])]  # 'bot'
    for s in range(0, c.size, chunk):
        cc = c[s : s + chunk][:, None]
        wc = w[s : s + chunk][:, None]
        mid = (cc + 1) // 2
        j = mid + offsets[None, :]
        ok = (j >= 0) & (j <= cc + 1)
        j = np.where(ok, j, 0)
        num = p1 * j + p2 * (cc + 1 - j)
        den = p2 * j + p1 * (cc + 1 - j)
        prob = wc * binom.pmf(j, cc + 1, 0.5) * 2.0 / (cc + 1) * num
        losses.append((np.log(num) - np.log(den))[ok])
        probs.append(prob[ok])
        # X-mass of this c outside its j window <= Pr[C=c] * 2 max(p1, p2) * Pr[Bin(c+1, 1/2) outside window]
        out_j = binom.cdf(mid - half - 1, cc + 1, 0.5) + binom.sf(mid + half, cc + 1, 0.5)
        inf_mass += float(np.sum(wc * 2.0 * max(p1, p2) * out_j))
    return np.concatenate(losses), np.concatenate(probs), min(1.0, inf_mass)


@lru_cache(maxsize=64)
def subsampled_fmt_pld(
    eps0: float, n: int, k: int, value_discretization_interval: float | None = None, tail_mass: float = 1e-16
) -> dpa_pld.PrivacyLossDistribution:
    """Pessimistic dp_accounting PLD of one round's dominating pair (see ``subsampled_fmt_pair``).

    Discretisation by splitting (the connect-the-dots idea of Doroshenko et al. 2022, applied atom by atom): an
    outcome with loss L in [h i, h (i+1)] and X-mass x is split into masses at h i and h (i+1) that preserve
    both its X-mass and its Y-mass x e^-L. Merging the two atoms back recovers the pair, so the discretised
    pair dominates the exact one (post-processing), and, unlike rounding every loss up, it adds no drift that
    grows with the number of rounds. X-mass outside the (c, j) windows is put at +infinity. The pair is
    symmetric (X(c, j) = Y(c, c+1-j)), so one PLD serves both neighbouring orders.
    Default interval: min(1e-4, sd/50) with sd the standard deviation of the per-round privacy loss (the
    discretised pair is coarser than the exact one by O(h) per atom; sd/50 keeps the composed eps within ~1e-4
    relative of the h -> 0 limit in the spec's settings, measured in the benchmark).
    """
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    loss, px, inf_mass = _pair_losses(e, n, k, tail_mass)
    if value_discretization_interval is None:
        mean = float(np.dot(px, loss))
        sd = math.sqrt(max(float(np.dot(px, loss * loss)) - mean * mean, 0.0))
        h = min(1e-4, sd / 50.0) if sd > 0 else 1e-4
    else:
        h = float(value_discretization_interval)
        if not (math.isfinite(h) and h > 0):
            raise ValueError(f"value_discretization_interval must be a finite number > 0, got {h!r}")
    lo_idx = np.floor(loss / h)
    frac_hi = np.expm1(lo_idx * h - loss + h) / math.expm1(h)  # share kept at the LOWER point h*lo_idx
    frac_hi = np.clip(frac_hi, 0.0, 1.0)
    lo_idx = lo_idx.astype(np.int64)
    base = int(lo_idx.min())
    size = int(lo_idx.max()) - base + 2
    agg = np.bincount(lo_idx - base, weights=px * frac_hi, minlength=size)
    agg += np.bincount(lo_idx - base + 1, weights=px * (1.0 - frac_hi), minlength=size)
    nz = np.nonzero(agg)[0]
    mass = {base + int(i): float(agg[i]) for i in nz}
    return dpa_pld.PrivacyLossDistribution.create_from_rounded_probability(
        mass, inf_mass, h, pessimistic_estimate=True, symmetric=True
    )


@lru_cache(maxsize=1024)
def _tight_cached(eps0: float, n: int, k: int, T: int, delta: float, h: float | None) -> float:
    pld = subsampled_fmt_pld(eps0, n, k, h)
    return round_up((pld.self_compose(T) if T > 1 else pld).get_epsilon_for_delta(delta))  # dp_accounting's float


def tight_pld_epsilon(
    eps0: float, n: int, k: int, T: int, delta: float, value_discretization_interval: float | None = None
) -> float:
    """eps of T subsampled-shuffle rounds by PLD composition of the subsampled FMT dominating pair (pessimistic).

    A rigorous upper bound (up to dp_accounting's pessimistic discretisation, which only errs upward). Cost grows
    like k^(3/2) per configuration (the (c, j) support), so it is meant for k up to ~1e5.
    """
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    T = check_int("T (number of rounds)", T, 1)
    d = check_delta(delta)
    h = None if value_discretization_interval is None else float(value_discretization_interval)
    return max(0.0, _tight_cached(e, n, k, T, d, h))
