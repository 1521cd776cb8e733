"""PLD-tight calibrated PVEC (issue 16 item 2): one round's worst case as a privacy-loss distribution (PLD).

**Extension beyond the paper** (spec 000 section 8 "Loose constants"), like ``calibrated_pvec``: same mechanism
(count-mode PVEC, noise Bin(N, p) per coordinate, N = m n'), same reduction to integer gap vectors, but the
composition over the d coordinates and the T rounds is done on privacy-loss distributions (Dwork-Rothblum 2016,
Sommer et al. 2019, Koskela et al. 2020; dp_accounting's ``pld`` package) instead of RDP, which removes the
RDP -> (eps, delta) conversion loss (~13-15% of the noise variance at delta = 1e-6).

The argument
------------
1. Gap vectors (``calibrated_pvec`` module docstring, steps 1-3): the analyzer's view is a mixture over coupled
   randomness of product pairs (prod_j a_j + Bin(N, p), prod_j Bin(N, p)) with integer gaps a in
   A = {|a_j| <= g, sum_j (|a_j| - 1)_+^2 <= g^2}; the hockey-stick divergence is jointly convex, so it is
   enough to dominate every such product pair.
2. Symmetry (p = 1/2 only; other p fall back to RDP): k -> N + a_j - k maps a_j + Bin(N, 1/2) to Bin(N, 1/2) and
   back, so gap -a_j is gap a_j and the reversed pair (Q, P) is the mirror image of (P, Q): one PLD (dp_accounting
   "symmetric") covers both directions, and only sorted gap vectors with a_j >= 0 matter.
3. Monotonicity in each gap: Bin(N, 1/2) has a log-concave pmf, so (a + X, X) has a monotone likelihood ratio and
   its tradeoff curve is the piecewise-linear interpolation of the vertices (Q(X >= c), P(a + X < c)). The
   alpha-nodes do not depend on a and every beta-node decreases in a: shift a + 1 is Blackwell-more informative
   than shift a, and so is any product with one gap increased. Only *maximal* gap vectors (no coordinate can be
   raised within A) need to be dominated.
4. Rounds: one PLD that dominates every neighbouring pair of a round, whatever gap vector the adaptive protocol
   induces, is a dominating pair of the round; the T-fold product of dominating pairs dominates the adaptive
   composition (Zhu, Dong & Wang, AISTATS 2022, "Optimal accounting of differential privacy via characteristic
   function", Thm 10). So eps(T rounds) = eps of the T-fold self-composition of the round's dominating PLD.

Route "exhaustive" (small N, d, g: the brief's "verified against exhaustive exact computation"): for every maximal
sorted gap vector, each coordinate's PLD is built from the explicit binomial pmfs: the exact hockey-stick curve
delta(eps) of (a + Bin(N, 1/2), Bin(N, 1/2)) at every grid point eps_i = i * VALUE_DISCRETIZATION_INTERVAL is
turned into a PLD by dp_accounting's pessimistic Connect-the-Dots (Doroshenko et al., PETS 2022, Alg. 1:
``pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap``; dominates the exact pair at every eps and keeps the mean
of the loss, so the discretisation error does not grow like T d times the grid step). Tails: P-mass above the last
grid point (and the support mismatch k > N, Q = 0) is infinity mass; P-mass below the first grid point is moved up
onto it (both pessimistic). The coordinates are composed with dp_accounting (tail truncation pessimistic). When
several maximal vectors exist, the pointwise maximum of their delta(eps) curves is a valid privacy curve (convex in
e^eps; Zhu et al. 2022, Sec. 3) and Connect-the-Dots on it gives one PLD dominating all of them.

Route "gaussian" (realistic sizes; the worst vector among ~10^100 cannot be enumerated): a provably worse
dominating pair, the Gaussian G_mu (mu-GDP, Dong, Roth & Su, JRSS-B 2022):
  * splitting (as ``calibrated_pvec``): gap a at N trials is post-processing of a unit-shift pairs
    U_M = (1 + Bin(M, 1/2), Bin(M, 1/2)) with M = floor(N / a);
  * mixture slack: U_M = (1 - t) U_M|W + t (rest) with the window W = [lo, M + 1 - lo] (symmetric, so P and Q lose
    the same mass t <= TAU, Hoeffding). The slacks of all pieces and rounds add to delta (``calibrated_pvec``
    docstring, "mixture form");
  * U_M|W is mu_M-GDP with mu_M = max over the tradeoff vertices c of isf(alpha_c) + isf(beta_c) (a piecewise-linear
    curve lies above the convex G_mu iff its vertices do), computed exactly from the explicit binomial pmfs;
  * GDP composes exactly: G_mu1 x G_mu2 = G_sqrt(mu1^2 + mu2^2) (Dong et al. Cor. 3.3), so a gap vector is
    dominated by G_mu with mu^2 = sum_j a_j mu_{floor(N/a_j)}^2, and the worst over A is bounded by the same LP
    relaxation (concave majorant, adaptive grid, monotone interpolation) as ``calibrated_pvec._worst_round`` with
    mu^2 in place of the RDP value. A round is then G_mu plus slack (d + g sqrt d) TAU (sum_j a_j <= d + g sqrt d by
    Cauchy-Schwarz), T rounds G_{mu sqrt T} plus T times the slack, and eps(delta) is the exact Gaussian curve
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Balle & Wang 2018, Thm 8) -- the PLD of G_mu
    self-composed T times, in closed form.
  The loss against the exact binomial is mu_M^2 M / 4 - 1: ~4% at M = 1e3, 4e-4 at 1e5, 3e-6 at 1e7 (worst
  vertices near the windows' 9.7 sd edges).

Route "rdp": ``calibrated_pvec`` (p != 1/2, N / g < GAUSS_MIN_M, or a unit window beyond GAUSS_MAX_WINDOW points).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import scipy  # scipy.stats loads on first use (the exhaustive route)
from scipy.special import log_ndtr, ndtri

from shuffledp.accountants import calibrated_pvec as cal
from shuffledp.accountants.rdp import round_up
from shuffledp.lazy import OnFirstUse
from shuffledp.mechanisms.pvec import PvecParams

# the exhaustive route's PLDs only: the gaussian route (the default run's) needs no dp_accounting (start-up time)
pld_pmf = OnFirstUse("dp_accounting.pld.pld_pmf")
dpa_pld_dist = OnFirstUse("dp_accounting.pld.privacy_loss_distribution")

if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

__all__ = [
    "VALUE_DISCRETIZATION_INTERVAL",
    "TAU",
    "ROUTES",
    "pld_route",
    "maximal_gap_vectors",
    "round_pld",
    "unit_gdp_mu2",
    "round_gdp",
    "pld_epsilon",
    "calibrate_pvec_pld",
    "PLAN_MAX_N",
    "smallest_plannable_eps",
    "epsilon_of_rounds",
    "composed_epsilon",
    "pvec_round_epsilon",
]

VALUE_DISCRETIZATION_INTERVAL = 1e-4  # PLD grid step (dp_accounting's default; loss values are multiples of it)
TAU = 1e-20  # tail mass per coordinate (exhaustive: to infinity mass) or per unit piece (gaussian: mixture slack)
_TRUNC = 1e-15  # dp_accounting tail_mass_truncation in compositions (pessimistic: right tail to infinity mass)
EXHAUSTIVE_MAX_N = 20000  # exhaustive route only for N <= this, d <= 4, g <= 32 and <= 64 maximal gap vectors
EXHAUSTIVE_MAX_D = 4
EXHAUSTIVE_MAX_G = 32
EXHAUSTIVE_MAX_VECTORS = 64
GAUSS_MIN_M = 1000  # gaussian route needs N // g >= this (unit pieces of >= 1000 trials: mu^2 M / 4 - 1 <= ~4%)
GAUSS_MAX_WINDOW = 3 * 10**7  # largest unit window (points, ~9.7 sqrt(N) at a = 1) evaluated
# Calibration refuses noise above this many binomial trials per coordinate (m n): the gaussian route's window grows
# like sqrt(N) and certifying 10^11 takes seconds, 6 * 10^12 (eps = 0.01 at the default size) minutes.
PLAN_MAX_N = 10**11
_GUESS_N = 10**9  # calibration: largest N at which the gaussian route's guess is rescaled from the exact mu^2
_SAFETY = 1.0 + 1e-9  # relative safety factor on mu^2 (float rounding), as calibrated_pvec._SAFETY
ROUTES = ("exhaustive", "gaussian", "rdp")


# ------------------------------------------------------------------------------------------ gap vectors
def maximal_gap_vectors(g: int, d: int, limit: int = EXHAUSTIVE_MAX_VECTORS) -> list[tuple[int, ...]] | None:
    """Sorted maximal gap vectors of A = {0 <= a_j <= g, sum (a_j - 1)_+^2 <= g^2} (step 3); None if > limit."""
    out: list[tuple[int, ...]] = []
    budget = g * g

    def rec(prefix: list[int], lo: int, cost: int) -> None:
        if len(out) > limit:
            return
        if len(prefix) == d:
            below = [a for a in prefix if a < g]  # raising a_j by one costs a_j^2 - (a_j - 1)^2 = 2 a_j - 1
            if not below or cost + 2 * min(below) - 1 > budget:
                out.append(tuple(prefix))
            return
        for a in range(lo, g + 1):  # a_j = 0 is never maximal (0 -> 1 is free)
            c = cost + (a - 1) ** 2
            if c + (d - len(prefix) - 1) * (a - 1) ** 2 > budget:  # later coordinates are >= a
                break
            rec([*prefix, a], a, c)

    rec([], 1, 0)
    return None if len(out) > limit else out


# ------------------------------------------------------------------------------------ exhaustive route
@lru_cache(maxsize=512)
def _coord_pld(N: int, a: int, vdi: float) -> tuple[PrivacyLossDistribution, int, int]:
    """Connect-the-Dots PLD of P = a + Bin(N, 1/2) vs Q = Bin(N, 1/2) from the explicit pmfs; (pld, i_lo, i_hi)."""
    k = np.arange(a, N + 1, dtype=np.float64)  # common support; P(k > N) has Q = 0 (infinite loss)
    log_p = scipy.stats.binom.logpmf(k - a, N, 0.5)
    log_q = scipy.stats.binom.logpmf(k, N, 0.5)
    loss = log_p - log_q  # increasing in k (log-concave pmf)
    pm, qm = np.exp(log_p), np.exp(log_q)
    inf_mass = float(scipy.stats.binom.sf(N - a, N, 0.5))
    sp = np.append(np.cumsum(pm[::-1])[::-1], 0.0)  # sp[c] = P(k >= k_c)
    sq = np.append(np.cumsum(qm[::-1])[::-1], 0.0)
    below = np.cumsum(pm)
    # grid range: P-mass <= TAU above the top point (-> infinity mass) and below the bottom one (moved up onto it)
    top = int(np.searchsorted(-sp[:-1], -TAU, side="left"))  # first c with sp[c] <= TAU
    bot = max(0, int(np.searchsorted(below, TAU, side="right")) - 1)
    i_hi = math.ceil(loss[min(top, len(loss) - 1)] / vdi)
    i_lo = min(math.floor(loss[bot] / vdi), i_hi)
    eps = np.arange(i_lo, i_hi + 1) * vdi
    c = np.searchsorted(loss, eps, side="right")  # first k with loss > eps
    # exact hockey-stick: delta(eps) = P(inf) + sum_{loss > eps} (P - e^eps Q) (dp_accounting PLDPmf docstring)
    deltas = np.clip(inf_mass + sp[c] - np.exp(eps) * sq[c], 0.0, 1.0)
    pmf = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(vdi, i_lo, i_hi, deltas)
    return dpa_pld_dist.PrivacyLossDistribution(pmf), i_lo, i_hi


def _vector_pld(N: int, gaps: tuple[int, ...], vdi: float) -> tuple[PrivacyLossDistribution, int, int]:
    pld, lo, hi = None, 0, 0
    for a in gaps:
        c, l_, h = _coord_pld(N, a, vdi)
        pld = c if pld is None else pld.compose(c, tail_mass_truncation=_TRUNC)
        lo, hi = lo + l_, hi + h
    return pld, lo, hi


def _delta_on_grid(pld: PrivacyLossDistribution, k0: int, k1: int) -> np.ndarray:
    """delta(i * vdi) for i = k0..k1 of a symmetric grid PLD (vectorised form of PLDPmf.get_delta_for_epsilon:
    delta(eps) = inf_mass + sum_{loss > eps} w (1 - e^(eps - loss))). Reads the dense pmf's arrays (private
    attributes of dp_accounting's DensePLDPmf: the public method loops in Python, ~4 s per 10^5 points)."""
    pmf = pld._pmf_remove.to_dense_pmf()
    vdi, lower, w, inf_mass = pmf._discretization, pmf._lower_loss, pmf._probs, pmf._infinity_mass
    idx = np.arange(k0, k1 + 1)
    loss = (lower + np.arange(len(w))) * vdi
    tail_w = np.append(np.cumsum(w[::-1])[::-1], 0.0)
    tail_s = np.append(np.cumsum((w * np.exp(-loss))[::-1])[::-1], 0.0)
    j = np.clip(idx - lower + 1, 0, len(w))  # first pmf index with loss > idx * vdi
    return inf_mass + tail_w[j] - np.exp(idx * vdi) * tail_s[j]


@lru_cache(maxsize=64)
def _exhaustive_round(N: int, g: int, d: int, vdi: float) -> PrivacyLossDistribution:
    vecs = maximal_gap_vectors(g, d)
    if vecs is None:
        raise ValueError(f"more than {EXHAUSTIVE_MAX_VECTORS} maximal gap vectors (g={g}, d={d})")
    plds = [_vector_pld(N, v, vdi) for v in vecs]
    if len(plds) == 1:
        return plds[0][0]
    # envelope of the delta curves on the common grid, then Connect-the-Dots (module docstring)
    k0, k1 = min(p[1] for p in plds), max(p[2] for p in plds)
    env = np.max([_delta_on_grid(p[0], k0, k1) for p in plds], axis=0)
    pmf = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(vdi, k0, k1, np.clip(env, 0.0, 1.0))
    return dpa_pld_dist.PrivacyLossDistribution(pmf)


# -------------------------------------------------------------------------------------- gaussian route
def _window_lo(M: int) -> int:
    # Hoeffding: P(X <= M/2 - s) <= exp(-2 s^2 / M) = TAU / 2, X ~ Bin(M, 1/2)
    s = math.sqrt(M * math.log(2.0 / TAU) / 2.0)
    return max(1, math.floor(M / 2.0 - s))


@lru_cache(maxsize=65536)
def unit_gdp_mu2(M: int) -> float:
    """mu^2 of the tightest Gaussian G_mu dominating U_M|W (module docstring), W = [lo, M + 1 - lo].

    The mass outside W, t <= TAU for P and Q alike, is the piece's mixture slack.
    """
    lo = _window_lo(M)
    if lo == 1 and M * math.log(2.0) < math.log(2.0 / TAU):  # 2^-M (X = 0) must be <= TAU / 2 too
        raise ValueError(f"M={M} trials is too few for the window slack TAU={TAU}")
    hi = M + 1 - lo
    # relative log pmf of Q = Bin(M, 1/2) on [lo, hi] from log B(k+1)/B(k) = log((M - k)/(k + 1)), summed in
    # extended precision (no gammaln cancellation for large M)
    k = np.arange(lo, hi, dtype=np.float64)
    r = np.concatenate(([0.0], np.cumsum(np.log1p((M - 2.0 * k - 1.0) / (k + 1.0)), dtype=np.longdouble)))
    q = np.exp((r - r.max()).astype(np.float64)).astype(np.longdouble)
    # thresholds c = lo+1..hi: the test "k >= c" has alpha_c = Q'(k >= c) (conditioned on W); the mirror
    # k -> M + 1 - k maps Q' to P' (step 2), so beta_c = P'(k < c) = alpha_{M+2-c}: the reversed alpha array
    below = np.cumsum(q)[:-1]  # sums over k < c
    above = np.cumsum(q[::-1])[::-1][1:]  # sums over k >= c (own sums: no cancellation in small tails)
    total = below + above
    alpha, alpha_c = (above / total).astype(np.float64), (below / total).astype(np.float64)
    # isf(alpha) = Phi^{-1}(1 - alpha) from whichever of alpha, 1 - alpha is small
    small = alpha < 0.5  # each z from one ndtri call (half the work of evaluating both branches everywhere)
    z_a = np.empty_like(alpha)
    z_a[small] = -ndtri(alpha[small])
    z_a[~small] = ndtri(np.maximum(alpha_c[~small], 0.0))
    z_b = z_a[::-1]
    # T(Q', P') >= G_mu iff beta_c >= Phi(isf(alpha_c) - mu) at every vertex (Dong, Roth & Su 2022, Def. 2.7)
    mu = max(0.0, float(np.max(z_a + z_b)))
    mu = mu * (1.0 + 1e-9) + 1e-11  # float margin: the z's are accurate to ~1e-13 absolute
    return mu * mu


@lru_cache(maxsize=4096)
def _gauss_round(N: int, g: int, d: int) -> tuple[float, float]:
    cost = np.maximum(np.arange(0, g + 1) - 1, 0).astype(np.float64) ** 2
    w = g * g / d
    # Small gaps are the costly evaluations (window ~ sqrt(N / a) points) and lie far from the maximiser (the
    # even spread s = 1 + g / sqrt(d)): start the grid at sqrt(s); below it u(a) <= a u(a_lo) / a_lo
    # (calibrated_pvec._interpolate), which stays under the hull's tangent at s (u ~ a^2: a sqrt(s) - (a - 1)^2
    # <= s), and is refined like any other inexact point should it become active.
    spread = 1.0 + g / math.sqrt(d)
    a_lo = max(1, math.isqrt(math.floor(spread)))
    # Near the maximiser u(a) ~ a^2 lies x^2 / (s - 1) below the hull's tangent at distance x from s, and the
    # interpolation between grid points h apart overshoots by ~(h / 2)^2: spacing h = 0.2 x around s leaves
    # (almost) nothing to refine (a grid geometric in a refined ~100 points one by one at the default size).
    xs = np.unique(np.round(np.geomspace(1.0, g, 2 + math.ceil(math.log(g) / math.log(1.2)))))
    grid = {a_lo, g} | {min(g, max(a_lo, round(spread + sgn * x))) for x in xs for sgn in (-1.0, 1.0)}
    exact: dict[int, np.ndarray] = {}
    # same LP relaxation and adaptive refinement as calibrated_pvec._worst_round, with u(a) = a mu^2(N // a)
    while True:
        for a in sorted(grid - exact.keys()):
            exact[a] = np.array([a * unit_gdp_mu2(N // a)])
        U, pts = cal._interpolate(exact, N, g, 1)
        vals, il, ir = cal._hull_value(U, cost, w)
        active = ({int(x) for x in il} | {int(x) for x in ir}) - exact.keys() - {0}
        if not active:
            break
        cal._refine(grid, pts, active)
    pieces = min(d * g, d + g * math.sqrt(d))  # sum_j a_j over A
    return d * float(vals[0]) * _SAFETY, pieces * TAU


def round_gdp(params: PvecParams, n_contrib: int) -> tuple[float, float]:
    """(mu, slack): one PVEC round (noise Bin(m n', 1/2)) is dominated by G_mu up to mixture slack (gaussian route)."""
    N = params.m * cal._n_contrib(params, n_contrib)
    if params.p != 0.5 or N // params.g < GAUSS_MIN_M:
        raise ValueError("the gaussian route needs p = 1/2 and m n' / g >= GAUSS_MIN_M")
    mu2, slack = _gauss_round(N, params.g, params.d)
    return math.sqrt(mu2), slack


def _gauss_delta(eps: float, mu: float) -> float:
    # Balle & Wang 2018, Thm 8: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), in log space
    la = float(log_ndtr(-eps / mu + mu / 2.0))
    lb = eps + float(log_ndtr(-eps / mu - mu / 2.0))
    return 0.0 if lb >= la else -math.exp(la) * math.expm1(lb - la)


def _gauss_eps(mu: float, delta: float) -> float:
    """Smallest eps >= 0 with delta_G(eps) <= delta, rounded up: the bisection keeps the end feasible in floating
    point, and the float margin (rdp.round_up) covers delta_G's own float error."""
    if mu == 0.0 or _gauss_delta(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, max(1.0, mu * mu)
    while _gauss_delta(hi, mu) > delta:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-13 * hi:
        mid = 0.5 * (lo + hi)
        if _gauss_delta(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return round_up(hi)


# ------------------------------------------------------------------------------------------- public API
def pld_route(params: PvecParams, n_contrib: int) -> str:
    """Which route ``pld_epsilon`` takes: "exhaustive", "gaussian" or "rdp" (module docstring)."""
    return _key_route(cal.round_noise_key(params, n_contrib))


def _key_route(key: cal.NoiseKey) -> str:
    N, p, g, d = key
    if p != 0.5 or N < g:
        return "rdp"
    if (
        N <= EXHAUSTIVE_MAX_N
        and d <= EXHAUSTIVE_MAX_D
        and g <= EXHAUSTIVE_MAX_G
        and maximal_gap_vectors(g, d) is not None
    ):
        return "exhaustive"
    if N // g >= GAUSS_MIN_M and 9.7 * math.sqrt(N) <= GAUSS_MAX_WINDOW:
        return "gaussian"
    return "rdp"


def round_pld(
    params: PvecParams, n_contrib: int, value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL
) -> PrivacyLossDistribution:
    """Dominating PLD of one PVEC round with n' = n_contrib contributors (exhaustive route; symmetric).

    Built from the explicit binomial pmfs of every maximal gap vector (module docstring); raises ValueError
    outside the exhaustive route's limits (see ``round_gdp`` for the gaussian route's dominating pair).
    """
    N = params.m * cal._n_contrib(params, n_contrib)
    ok = params.p == 0.5 and params.g <= N <= EXHAUSTIVE_MAX_N
    if not (ok and params.d <= EXHAUSTIVE_MAX_D and params.g <= EXHAUSTIVE_MAX_G):
        raise ValueError(
            "round_pld needs p = 1/2, g <= m n' <= EXHAUSTIVE_MAX_N, d <= EXHAUSTIVE_MAX_D, g <= EXHAUSTIVE_MAX_G"
        )
    return _exhaustive_round(N, params.g, params.d, float(value_discretization_interval))


def pld_epsilon(
    params: PvecParams,
    n_contrib: int,
    rounds: int,
    delta: float,
    route: str | None = None,
    value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    """eps at ``delta`` of ``rounds`` fully interactive PVEC rounds with n' = n_contrib (rigorous upper bound).

    ``route`` None picks ``pld_route``; "rdp" is ``calibrated_pvec.composed_epsilon``.
    """
    delta = cal._check_delta(delta)
    rounds = cal._check_pos_int("rounds", rounds)
    route = pld_route(params, n_contrib) if route is None else route
    if route == "rdp":
        return float(cal.composed_epsilon([(params, n_contrib, rounds)], delta))
    if route == "exhaustive":
        pld = round_pld(params, n_contrib, value_discretization_interval)
        if rounds > 1:
            pld = pld.self_compose(rounds, tail_mass_truncation=_TRUNC)
        return round_up(pld.get_epsilon_for_delta(delta))  # dp_accounting's float figure
    if route == "gaussian":
        mu, slack = round_gdp(params, n_contrib)
        budget = delta - rounds * slack * (1.0 + 1e-12)  # mixture slacks add to delta
        return math.inf if budget <= 0.0 else _gauss_eps(mu * math.sqrt(rounds), budget)
    raise ValueError(f"route must be one of {ROUTES} or None, got {route!r}")


def _covered(counts: tuple[tuple[int, float, int, int, int], ...]) -> bool:
    """Whether one PLD route covers every round: all "gaussian" or all "exhaustive"."""
    return len({_key_route(k[:4]) for k in counts} - {"rdp"}) == 1 and all(_key_route(k[:4]) != "rdp" for k in counts)


def _keys_epsilon(counts: tuple[tuple[int, float, int, int, int], ...], delta: float) -> float:
    """eps at delta of the rounds (N, p, g, d, count) by the PLD routes: every round "gaussian" -> GDP (mu^2 and
    slacks add, Dong et al. Cor. 3.3), every round "exhaustive" -> PLDs composed (Zhu et al. 2022, Thm 10);
    any other mix -> inf (no PLD bound)."""
    routes = {_key_route(k[:4]) for k in counts}
    if routes == {"gaussian"}:
        mu2 = slack = 0.0
        for N, _, g, d, c in counts:
            m2, s = _gauss_round(N, g, d)
            mu2, slack = mu2 + c * m2, slack + c * s
        budget = delta - slack * (1.0 + 1e-12)
        return math.inf if budget <= 0.0 else _gauss_eps(math.sqrt(mu2), budget)
    if routes == {"exhaustive"}:
        pld = None
        for N, _, g, d, c in counts:
            one = _exhaustive_round(N, g, d, VALUE_DISCRETIZATION_INTERVAL)
            one = one.self_compose(c, tail_mass_truncation=_TRUNC) if c > 1 else one
            pld = one if pld is None else pld.compose(one, tail_mass_truncation=_TRUNC)
        return round_up(pld.get_epsilon_for_delta(delta))  # dp_accounting's float figure
    return math.inf


@lru_cache(maxsize=4096)
def _tight(counts: tuple[tuple[int, float, int, int, int], ...], delta: float) -> tuple[float, float | None]:
    # the PLD bound where it covers every round (about 10x faster than the RDP one, and tighter: the RDP -> DP
    # conversion loses ~13-15 % of the variance, the gaussian route <= 4 %), else the RDP bound
    return (_keys_epsilon(counts, delta), None) if _covered(counts) else cal._composed(counts, delta)


def epsilon_of_rounds(counts: Mapping[cal.NoiseKey, int], delta: float, return_order: bool = False):
    """eps at ``delta`` of the rounds in ``counts`` (round_noise_key -> number of rounds): the PLD bound when one
    PLD route covers every round (``pld_route``), else the RDP bound (``calibrated_pvec.epsilon_of_rounds``); both
    are rigorous upper bounds. This is the ledger's, the clients' and the calibration's accountant for calibrated
    PVEC (issue 16 item 2). ``return_order``: (eps, optimal Renyi order, or None for the PLD bound)."""
    delta = cal._check_delta(delta)
    key = tuple(sorted((*k, int(c)) for k, c in counts.items() if c))
    res = _tight(key, delta) if key else (0.0, 0.0)
    return res if return_order else res[0]


def composed_epsilon(
    rounds: Sequence[tuple[PvecParams, int] | tuple[PvecParams, int, int]], delta: float, return_order: bool = False
):
    """As ``calibrated_pvec.composed_epsilon`` (same items), by ``epsilon_of_rounds`` (PLD where it covers)."""
    counts: Counter[cal.NoiseKey] = Counter()
    for item in rounds:
        if not isinstance(item, tuple) or len(item) not in (2, 3) or not isinstance(item[0], PvecParams):
            raise ValueError(f"each round must be a (PvecParams, n_contrib[, count]) tuple, got {item!r}")
        c = cal._check_pos_int("count", item[2], 0) if len(item) == 3 else 1
        if c:
            counts[cal.round_noise_key(item[0], item[1])] += c
    return epsilon_of_rounds(counts, delta, return_order)


def pvec_round_epsilon(params: PvecParams, n_contrib: int, delta: float) -> float:
    """eps at ``delta`` of one PVEC round with n' = n_contrib contributors (``epsilon_of_rounds``)."""
    return composed_epsilon([(params, n_contrib)], delta)


def smallest_plannable_eps(delta: float, n: int, d: int, g: int, rounds: int) -> float:
    """The smallest eps (two significant digits, rounded up) whose Gaussian guess stays within PLAN_MAX_N trials
    per coordinate (1% margin): mu^2 = 4 rounds (g + sqrt d)^2 / N (module docstring), eps from the exact
    Gaussian curve."""
    mu = math.sqrt(4.0 * rounds * (g + math.sqrt(d)) ** 2 / (0.99 * PLAN_MAX_N))
    e = _gauss_eps(mu, delta)
    if e <= 0.0:
        return 0.0
    scale = 10.0 ** (math.floor(math.log10(e)) - 1)
    return math.ceil(e / scale) * scale


@lru_cache(maxsize=1024)
def _calibrate_cached(eps: float, delta: float, n: int, d: int, delta2: float, g: int, rounds: int) -> PvecParams:
    def params(m: int) -> PvecParams:
        return PvecParams(d=d, n=n, delta2=delta2, g=g, m=m, p=0.5, eps=eps, delta=delta, method="calibrated")

    def ok(m: int) -> bool:  # the ledger's accountant (epsilon_of_rounds)
        return _tight(((m * n, 0.5, g, d, rounds),), delta)[0] <= eps

    # Gaussian guess: a round is ~ G_mu with mu^2 = 4 (g + sqrt d)^2 / N (module docstring), T rounds mu sqrt(T).
    lo_mu, hi_mu = 0.0, 1.0
    while _gauss_eps(hi_mu, delta) <= eps:
        lo_mu, hi_mu = hi_mu, 2.0 * hi_mu
    for _ in range(60):
        mid = 0.5 * (lo_mu + hi_mu)
        lo_mu, hi_mu = (mid, hi_mu) if _gauss_eps(mid, delta) <= eps else (lo_mu, mid)
    mu_t = lo_mu
    m = max(1, math.ceil(4.0 * rounds * (g + math.sqrt(d)) ** 2 / (mu_t**2 * n)), math.ceil(g / n))
    if m * n > PLAN_MAX_N:  # refuse in milliseconds rather than certify for minutes (issue 24 B8)
        raise ValueError(
            f"eps={eps} needs ~{m * n:.3g} binomial trials of noise per coordinate (n={n}, d={d}, rounds={rounds}, "
            f"delta={delta:.3g}), more than the {PLAN_MAX_N:.0e} the accountant certifies in seconds; the smallest "
            f"eps that can work at this size is {smallest_plannable_eps(delta, n, d, g, rounds):.2g}"
        )
    route = pld_route(params(m), n)
    if route == "rdp":  # fallback: no PLD at this size; its m is checked with the ledger's accountant below
        m = cal.calibrate_pvec(eps, delta, n, d, delta2, g=g, rounds=rounds).m
        if ok(m):  # the RDP answer, unless a PLD route covers it and does not certify it (then search up from it)
            return params(m)
    if route == "gaussian":  # mu^2 scales like 1/N: rescale the guess by the exact round's mu^2 (no rigour needed)
        # N mu^2 varies by < 1e-5 above N = 1e9 (module docstring), so a large N is rescaled from mu^2 at a
        # smaller one: a window of ~sqrt(N) points less to evaluate; the rigorous checks below use the real N
        n_guess = min(m * n, max(_GUESS_N, GAUSS_MIN_M * g))
        mu2, _ = _gauss_round(n_guess, g, d)
        m = max(1, math.ceil(m * rounds * mu2 * n_guess / (m * n) / mu_t**2 * (1.0 + 2e-4)), math.ceil(g / n))
    hi = cal.smallest_feasible_m(ok, m, n, g, f"eps={eps}, delta={delta} with g={g}, d={d}, n={n}")
    return params(hi)


def calibrate_pvec_pld(
    eps: float, delta: float, n: int, d: int, delta2: float, g: int | None = None, rounds: int = 1
) -> PvecParams:
    """As ``calibrated_pvec.calibrate_pvec`` (same arguments, PvecParams(method="calibrated"), p = 1/2, m minimal
    to a relative 1e-3), certified by ``pld_epsilon`` instead of the RDP accountant; falls back to
    ``calibrate_pvec`` when ``pld_route`` is "rdp" at the Gaussian-guess m. Beyond the paper (spec 000 sec 8)."""
    eps = float(eps)
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    delta = cal._check_delta(delta)
    n = cal._check_pos_int("n", n)
    d = cal._check_pos_int("d", d)
    delta2 = float(delta2)
    if not (math.isfinite(delta2) and delta2 > 0.0):
        raise ValueError(f"delta2 must be a finite number > 0, got {delta2!r}")
    g = cal.default_g(d, n) if g is None else cal._check_pos_int("g", g)
    rounds = cal._check_pos_int("rounds", rounds)
    return _calibrate_cached(eps, delta, n, d, delta2, g, rounds)
