"""Calibrated PVEC: the smallest binomial noise that a rigorous numerical accountant certifies.

**Extension beyond the paper** (spec 000 section 8 "Loose constants"): paper 000 (Cheu, Joseph, Mao, Peng,
ICLR 2022) sets PVEC's noise with the loose constants of Lemma 3.1 / Thm 3.2. Here (g, m, p) are chosen by an
accountant that bounds the privacy of the *exact* analyzer view, so the noise is ~100x smaller in variance;
the privacy claim of ``method="calibrated"`` parameters is this module's, not the paper's.

The analyzer's view of one round (count mode, spec 000 sec 8; equivalent to the shuffled bits, sec 3) is, per
coordinate j, the total C_j = sum_i xhat_ij + Bin(N, p) with N = m n' (n' contributors actually aggregated),
plus n'. Neighbours replace one contributor's vector (the paper's notion, Def 2.1), both of norm <= delta2.

Reduction to integer count shifts (the argument, verified rather than taken on trust)
-------------------------------------------------------------------------------------
1. Randomized rounding of y = (x_j + delta2) g / (2 delta2) in [0, g] (Alg 1 lines 1-3) has the law of
   floor(y + U) with U ~ Unif[0, 1) independent of the data: P(floor(y + U) = floor(y) + 1) = frac(y).
   Privacy is a property of the laws of the two views only, so the analysis may couple the two neighbouring
   executions: the changed user uses the same U_j for x and x', every other user the same rounding and all
   users the same binomial draws. Conditioned on (U, the other users' roundings) the two views are product
   distributions over j of (b_j + Bin(N, p)) and (b'_j + Bin(N, p)), with integer gaps a_j = b_j - b'_j.
2. For t = y - y' >= 0, floor(y + U) - floor(y' + U) lies in {floor(t), ceil(t)}, so |a_j| <= ceil(|t_j|),
   and |a_j| <= g because xhat is in {0..g}. ||x - x'||_2 <= 2 delta2 gives ||t||_2 <= g. Hence a_j >= 2
   needs |t_j| > a_j - 1: the gap vectors are exactly (a relaxation of) the integer vectors with
   0 <= |a_j| <= g and sum_j (|a_j| - 1)_+^2 <= g^2 (a_j = 1 is free: any tiny t_j can flip a rounding).
   By the triangle inequality this set lies inside the spec's {sum_j a_j^2 <= (g + sqrt d)^2}.
3. The hockey-stick divergence is jointly convex and Renyi divergences are jointly quasi-convex, so the view
   (a mixture over the coupled randomness) is no less private than the worst conditional pair: it suffices to
   bound the product pair for the worst gap vector.

Per-coordinate bound (exact binomial RDP, approximate in the mixture sense)
---------------------------------------------------------------------------
Bin(N, p) and a + Bin(N, p) have different supports, so their Renyi divergence is infinite. We use the
mixture form of approximate RDP (Bun & Steinke 2016, Sec. 8, "approximate zCDP"): P = (1 - t) P' + t P'',
Q = (1 - t) Q' + t Q'' with P' = P | [a, N], Q' = Q | [a, N], t = max(P(eta > N - a), P(eta < a)) (~ 2^-N),
and D_alpha(P' || Q') bounded numerically (both directions). The mixture form is closed under products (t's
add), post-processing (apply the kernel to each component) and adaptive composition (the product over rounds
of the (1 - t_r) components is a component of the joint law); converting: P(S) <= (1-t)(e^eps Q'(S) + d') + t
<= e^eps Q(S) + d' + t. So a total slack t_tot is simply added to delta.

* Shift splitting: a + Bin(N, p) vs Bin(N, p) is the sum (post-processing) of a independent pairs
  (1 + Bin(N_i, p), Bin(N_i, p)) with N_i >= floor(N / a); adding independent Bin(N_i - M, p) noise is
  post-processing too, so D(a) <= a * r(floor(N / a)) with r(M) the shift-1 bound for Bin(M, p). For large N
  (Gaussian regime) this is tight; it turns every evaluation into a shift-1 evaluation.
* Shift-1 RDP of order alpha: log S / (alpha - 1) with S = sum_k B(k - 1)^alpha B(k)^(1 - alpha) =
  E_B[exp(alpha L(k))], L(k) = log(k q / ((M - k + 1) p)). We bound S - 1 <= sum_k B(k) phi(k) with
  phi = expm1(alpha L) over [mu - H s, mu + alpha + H s] (terms left of it have phi < 0 and are dropped). The
  function exp(alpha L) is convex in k (product of positive increasing convex factors), so on a block of
  consecutive k it lies below its chord: sum_blk B phi <= mass phi(k1) + slope * sum_blk (k - k1) B(k),
  where sum_{k<=x} (k - Mp) B_M(k) = -M p q B_{M-1}(x) gives the partial first moments exactly. Blocks have
  ~s/64 points (exact pointwise sums when s < 64); relative looseness ~1e-4. Beyond the window the terms are
  bounded by Chernoff tail masses times the largest exp(alpha L) of doubling blocks.
* Computation: expm1/log1p formulation (S - 1 is tiny), double precision, and a relative safety factor
  1 + 1e-9 on every RDP value.

Worst gap vector (the knapsack)
-------------------------------
For each order the composed RDP is sum_j u(a_j) with u(a) = a r(floor(N/a)) (u(1) = r(N)); its maximum over
the feasible set of step 2 is bounded by its LP relaxation, d * h(g^2 / d), where h is the least concave
majorant of the points ((a-1)_+^2, u(a)) (Lagrangian duality; exact for the relaxation). u is evaluated
exactly on an adaptively refined grid of a; between grid points u(a) <= a r(floor(N / a_next)) (r is
non-increasing in M by post-processing), which keeps every step a rigorous upper bound.

RDP -> (eps, delta): the conversion of Canonne, Kamath & Steinke 2020 (Prop. 12) / Asoodeh et al. 2021,
as in dp_accounting, via ``shuffledp.accountants.rdp.rdp_to_dp``; RDP adds over rounds (Mironov 2017, Prop. 1).
It is minimised over DEFAULT_ORDERS extended at either edge while the optimum sits there
(``rdp.extended_rdp_to_dp``, spec 001 section 8): up to ORDER_CAP (the paper's huge-m parameters have their
optimum at orders of several thousand) and down to MIN_ORDER (only for very large eps).

Parameter choice: p = 1/2 (minimises m for a given noise variance N p (1-p)); g = max(4, ceil(64 sqrt(d)),
ceil(sqrt(n))) makes the (g + sqrt d)/g sensitivity inflation <= 1.6% and the rounding variance small; m is
the smallest integer (to a relative 1e-3) whose bound meets the target.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

import numpy as np
import scipy  # scipy.stats / scipy.optimize load on first use: a client node's check never needs them (start-up)
from scipy.special import logsumexp

from shuffledp.accountants.rdp import extended_rdp_to_dp, rdp_to_dp
from shuffledp.lazy import OnFirstUse
from shuffledp.mechanisms.pvec import MAX_M, PvecParams

gaussian_acc = OnFirstUse("shuffledp.accountants.gaussian")  # dp_accounting: only when calibrating

__all__ = [
    "DEFAULT_ORDERS",
    "ORDER_CAP",
    "MIN_ORDER",
    "G_PER_SQRT_D",
    "shift_rdp",
    "worst_round_rdp",
    "pvec_round_rdp",
    "pvec_round_delta0",
    "pvec_round_epsilon",
    "composed_epsilon",
    "NoiseKey",
    "round_noise_key",
    "epsilon_of_rounds",
    "calibrate_pvec",
    "default_g",
    "gaussian_variance",
    "noise_variance",
]

# Renyi orders (any set gives a valid bound; this one covers eps from ~0.05 to ~20).
DEFAULT_ORDERS: tuple[float, ...] = (
    1.1, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 12.0, 14.0,
    16.0, 18.0, 20.0, 24.0, 28.0, 32.0, 40.0, 48.0, 56.0, 64.0, 80.0, 96.0, 128.0, 160.0, 192.0, 256.0, 320.0,
    384.0, 512.0, 768.0, 1024.0,
)  # fmt: skip
# Grid extension at the edges (rdp.extended_rdp_to_dp): 8 orders per doubling (eps loses < 0.1% to the spacing),
# in pieces spanning a factor 8 (a piece costs about as much as one order: the cost is per shift evaluation).
ORDER_CAP = float(1 << 20)
MIN_ORDER = 1.01
_ORDER_GROWTH = 2.0**0.125
_ORDER_SPAN = 8.0
G_PER_SQRT_D = 64  # default g >= 64 sqrt(d): (1 + sqrt(d)/g)^2 <= 1.032
_H = 9.0  # window half-width in standard deviations (only tightness depends on it)
_R = 64  # blocks per standard deviation (chord looseness ~ alpha / (4 (alpha-1) R^2))
_S_CDF = 20000.0  # above this std, block masses come from CDFs instead of summed pmfs
_SAFETY = 1.0 + 1e-9  # relative safety factor on every RDP value (float rounding)
_TAIL_FINE = 4000  # fine tail blocks before switching to doubling blocks
_LOGPMF_MARGIN = 1e-6  # relative inflation of gammaln-based log pmf values (cancellation for large M)


# ---------------------------------------------------------------------------------------------- validation
def _check_pos_int(name: str, v: object, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or int(v) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _check_p(p: float) -> float:
    p = float(p)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    return p


def _check_orders(orders: Sequence[float] | None) -> tuple[float, ...]:
    if orders is None:
        return DEFAULT_ORDERS
    o = tuple(float(a) for a in np.asarray(orders, dtype=np.float64).ravel())
    if not o or any(not math.isfinite(a) or a <= 1.0 for a in o):
        raise ValueError(f"orders must be a non-empty sequence of finite numbers > 1, got {orders!r}")
    return o


def _check_delta(delta: float) -> float:
    d = float(delta)
    if not 0.0 < d < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    return d


# ------------------------------------------------------------------------------- binomial tail bounds
def _kl(x: float, p: float) -> float:
    """KL(Bern(x) || Bern(p))."""
    out = 0.0
    if x > 0.0:
        out += x * math.log(x / p)
    if x < 1.0:
        out += (1.0 - x) * math.log((1.0 - x) / (1.0 - p))
    return out


def _log_sf_bound(k: float, M: int, p: float) -> float:
    """Upper bound on log P(Bin(M, p) >= k) (Chernoff: -M KL(k/M || p) for k >= Mp; 0 otherwise)."""
    if k > M:
        return -math.inf
    if k <= M * p:
        return 0.0
    return -M * _kl(k / M, p)


def _log_tau(M: int, p: float, a: int) -> float:
    """log of the mixture slack t = max(P(eta > M - a), P(eta < a)), eta ~ Bin(M, p) (Chernoff bounds)."""
    return max(_log_sf_bound(M - a + 1, M, p), _log_sf_bound(M - a + 1, M, 1.0 - p))


# ------------------------------------------------------------------------------------ shift RDP (one way)
def _log_ratio(k: np.ndarray, M: int, p: float, a: int) -> np.ndarray:
    """L_a(k) = log B(k - a) - log B(k) = sum_{i<a} log((k - i) q / ((M - k + i + 1) p)), k in [a, M]."""
    k = np.asarray(k, dtype=np.float64)
    out = np.full(k.shape, a * math.log((1.0 - p) / p))
    for i in range(a):
        out += np.log((k - i) / (M - k + i + 1.0))
    return out


def _block_masses(starts: np.ndarray, ends: np.ndarray, M: int, p: float, s: float) -> np.ndarray:
    """P(start <= eta <= end) for consecutive blocks of a window, eta ~ Bin(M, p)."""
    lo, hi = int(starts[0]), int(ends[-1])
    if s <= _S_CDF or hi - lo < 4 * len(starts):
        pmf = scipy.stats.binom.pmf(np.arange(lo, hi + 1, dtype=np.float64), M, p)
        return np.add.reduceat(pmf, (starts - lo).astype(np.int64))
    # Boundary CDFs; left of the mean differences of cdf, right of it of sf (no cancellation near 0).
    b = np.append(starts - 1, hi).astype(np.float64)
    cdf = scipy.stats.binom.cdf(b, M, p)
    sf = scipy.stats.binom.sf(b, M, p)
    left = ends < M * p
    m = np.where(left, cdf[1:] - cdf[:-1], sf[:-1] - sf[1:])
    return np.maximum(m, 0.0)


def _directed_rdp(M: int, p: float, a: int, orders: np.ndarray) -> np.ndarray:
    """Upper bound on D_alpha(P' || Q'), P' = (a + Bin(M,p)) | [a, M], Q' = Bin(M,p) | [a, M], per order."""
    q = 1.0 - p
    mu = M * p
    s = math.sqrt(M * p * q)
    amax = float(np.max(orders))
    lo = max(a, math.floor(mu - _H * s))
    # the chord window stops at 30 s (pmf >= ~1e-200, no underflow); beyond, the log-space tail bound applies
    hi = min(M, math.ceil(mu + amax * a + _H * s), max(lo, math.floor(mu + 30.0 * s)))
    # Terms left of lo are dropped: they have L < 0, i.e. phi < 0 (checked; else start at a).
    if lo > a and _log_ratio(np.array([lo - 1.0]), M, p, a)[0] > 0.0:
        lo = a
    b = max(1, int(s // _R))
    starts = np.arange(lo, hi + 1, b, dtype=np.int64)
    ends = np.append(starts[1:] - 1, hi)
    mass = _block_masses(starts, ends, M, p, s)
    width = (ends - starts).astype(np.float64)
    if b > 1:
        # sum_blk (k - start) B(k) = sum_blk (k - mu) B(k) + (mu - start) mass, with the exact identity
        # sum_{k <= x} (k - Mp) B_M(k) = -M p q B_{M-1}(x).
        pm = scipy.stats.binom.pmf(np.append(starts - 1, hi).astype(np.float64), M - 1, p)
        centred = -M * p * q * (pm[1:] - pm[:-1]) + (mu - starts) * mass
        centred = np.clip(centred, 0.0, width * mass)
    else:
        centred = np.zeros_like(mass)
    Ls = _log_ratio(starts, M, p, a)
    Le = _log_ratio(ends, M, p, a)
    # Right tail beyond hi (past the mode: B decreasing, L increasing), bounded per block by
    # (block length) * max B * max exp(alpha L) = len * B(k1) * exp(alpha L(k2)), in log space:
    # fine blocks of ~s/4 points first (log B from gammaln, inflated by a margin), then doubling blocks with a
    # Chernoff bound on the mass once far (>= 5000 s) from the mean.
    tail_logm = np.empty(0)
    tail_L = np.empty(0)
    if hi < M:
        bt = max(1, int(s // 4))
        k_fine_end = min(M, hi + _TAIL_FINE * bt)
        fs = np.arange(hi + 1, k_fine_end + 1, bt, dtype=np.float64)
        fe = np.minimum(fs + bt - 1, k_fine_end)
        logm = np.log(fe - fs + 1.0) + scipy.stats.binom.logpmf(fs, M, p)
        logm = logm + _LOGPMF_MARGIN * (1.0 + np.abs(logm))
        ts, te = [], []
        k1, step = k_fine_end + 1, max(1, math.ceil(s))
        while k1 <= M:
            k2 = min(M, k1 + step - 1)
            ts.append(k1)
            te.append(k2)
            k1, step = k2 + 1, 2 * step
        tail_logm = np.concatenate([logm, [_log_sf_bound(k, M, p) for k in ts]])
        tail_L = _log_ratio(np.concatenate([fe, np.array(te, dtype=np.float64)]), M, p, a)
    log_tau_p = _log_sf_bound(M - a + 1, M, p)  # P(eta > M - a): mass of P outside [a, M]
    al = orders[:, None]
    if tail_L.size:
        T = tail_logm[None, :] + al * tail_L[None, :]
        tmax = T.max(axis=1)
        with np.errstate(invalid="ignore"):
            log_tail = tmax + np.log(np.sum(np.exp(T - np.where(np.isfinite(tmax), tmax, 0.0)[:, None]), axis=1))
        log_tail = np.where(np.isfinite(tmax), log_tail, -np.inf)
    else:
        log_tail = np.full(len(orders), -np.inf)
    c = (al * Le[None, :]).max(axis=1)
    big = c > 600.0
    inv_w = np.where(width > 0, 1.0 / np.where(width > 0, width, 1.0), 0.0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        # moderate orders: S - 1 <= x = sum_blocks chord bound of B * expm1(alpha L)
        ps, pe = np.expm1(al * Ls[None, :]), np.expm1(al * Le[None, :])
        x = np.sum(ps * mass + (pe - ps) * (inv_w * centred), axis=1)
        log_s_mod = np.logaddexp(np.log1p(np.where(x > -1.0, x, np.nan)), log_tail)
        # huge orders: the same chord bound scaled by e^-c
        with np.errstate(divide="ignore"):
            lm = np.log(mass)[None, :]
        c2 = np.max(np.maximum(al * Le[None, :], al * Ls[None, :]) + lm, axis=1)
        cc = np.where(big, c2, 0.0)[:, None]
        ec = np.exp(-cc)
        qs, qe = np.exp(al * Ls[None, :] - cc) - ec, np.exp(al * Le[None, :] - cc) - ec
        xs = np.sum(qs * mass + (qe - qs) * (inv_w * centred), axis=1) + ec[:, 0]
        log_s_big = np.logaddexp(cc[:, 0] + np.log(np.where(xs > 0.0, xs, np.nan)), log_tail)
        log_s = np.where(big, log_s_big, log_s_mod)
    # D_alpha(P'||Q') = [log S - alpha log(1 - tau_P) + (alpha - 1) log(1 - tau_Q)] / (alpha - 1); last <= 0
    corr = -orders * math.log1p(-math.exp(log_tau_p)) if log_tau_p > -700.0 else 0.0
    r = (log_s + corr) / (orders - 1.0)
    r = np.where(np.isfinite(r), np.maximum(r, 0.0) * _SAFETY, np.inf)  # NaN (numerical failure) -> inf
    return r


def shift_rdp(M: int, p: float, a: int, orders: Sequence[float] | None = None) -> tuple[np.ndarray, float]:
    """Approximate-RDP bound for Bin(M, p) vs a + Bin(M, p), both directions: (rdp per order, log slack t).

    Direct evaluation (no splitting) of the block/chord bound described in the module docstring.
    """
    M = _check_pos_int("M", M)
    a = _check_pos_int("a", a)
    p = _check_p(p)
    if a > M:
        raise ValueError(f"shift a must be <= M (else the supports are disjoint), got a={a}, M={M}")
    o = np.asarray(_check_orders(orders))
    r = _directed_rdp(M, p, a, o)
    if p != 0.5:  # D(Bin || a + Bin) under p is D(a + Bin || Bin) under 1 - p (mirror k -> M + a - k)
        r = np.maximum(r, _directed_rdp(M, 1.0 - p, a, o))
    return r, _log_tau(M, p, a)


@lru_cache(maxsize=65536)
def _unit_rdp(M: int, p: float, orders: tuple[float, ...]) -> np.ndarray:
    r, _ = shift_rdp(M, p, 1, orders)
    r.flags.writeable = False
    return r


# ------------------------------------------------------------------------------ worst gap vector (knapsack)
def _hull_value(U: np.ndarray, cost: np.ndarray, w: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least concave majorant of the points (cost[a], U[:, a]) evaluated at w, per row; and the maximising pair.

    h(w) = max over i with cost_i <= w, j with cost_j >= w of the chord value at w (i = j allowed).
    An infinite bound (inf RDP at an order) makes chords with it inf - inf or 0 * inf = NaN; NaN is read as +inf,
    the safe direction (an upper bound that cannot be evaluated is no bound), before any comparison or argmax.
    """
    U = np.where(np.isnan(U), np.inf, U)
    left = np.nonzero(cost <= w)[0]
    right = np.nonzero(cost >= w)[0]
    best_left = U[:, left]  # points left of w alone (h is non-decreasing)
    vals = [best_left.max(axis=1)]
    il = left[np.argmax(best_left, axis=1)]
    ir = il.copy()
    if right.size:
        ci, cj = cost[left], cost[right]
        den = cj[None, :] - ci[:, None]
        lam = np.where(den > 0, (w - ci)[:, None] / np.where(den > 0, den, 1.0), 0.0)  # in [0, 1]
        # value = U_i + lam (U_j - U_i), shape (orders, |left|, |right|)
        Ui = U[:, left][:, :, None]
        Uj = U[:, right][:, None, :]
        with np.errstate(invalid="ignore"):  # inf - inf, 0 * inf: NaN, read as +inf just below
            V = Ui + lam[None] * (Uj - Ui)
        V = np.where(np.isnan(V), np.inf, V)
        flat = V.reshape(U.shape[0], -1)
        k = np.argmax(flat, axis=1)
        v = flat[np.arange(U.shape[0]), k]
        better = v > vals[0]
        vals[0] = np.where(better, v, vals[0])
        il = np.where(better, left[k // right.size], il)
        ir = np.where(better, right[k % right.size], ir)
    return vals[0], il, ir


def _initial_grid(g: int, d: int) -> set[int]:
    grid = {1, 2, 3, g}
    grid.update(int(x) for x in np.unique(np.round(np.geomspace(1, g, 1 + math.ceil(math.log(g) / math.log(1.15))))))
    spread = 1.0 + g / math.sqrt(d)  # even spread of the l2 budget: the Gaussian-like worst case
    for f in (0.95, 1.0, 1.05):
        grid.add(int(min(g, max(1, round(spread * f)))))
    return {a for a in grid if 1 <= a <= g}


def _interpolate(exact: dict[int, np.ndarray], N: int, g: int, n_orders: int) -> tuple[np.ndarray, np.ndarray]:
    """Upper bounds U[:, a] on u(a) for a = 0..g from the exact values at grid points, and the grid points.

    Below the smallest grid point a_0: u(a) = a r(N // a) <= a r(N // a_0), as N // a >= N // a_0 and r is
    non-increasing in M (post-processing).

    For a_p < a < a_n (adjacent grid points, M_p = N // a_p >= M_n = N // a_n) split the shift a into k
    unit pieces of >= M_p trials and a - k of >= M_n trials, k M_p + (a - k) M_n <= N (post-processing and
    monotonicity of r in M): u(a) <= k r(M_p) + (a - k) r(M_n). With r ~ c/M this overshoots c a^2 by only
    c (a_n - a)(a - a_p).
    """
    pts = np.array(sorted(exact))
    R = np.stack([exact[int(b)] / b for b in pts], axis=1)  # r(N // b) per order
    U = np.zeros((n_orders, g + 1))
    a = np.arange(1, g + 1)
    i = np.searchsorted(pts, a)  # pts[i] >= a
    on = pts[np.minimum(i, len(pts) - 1)] == a
    U[:, a[on]] = R[:, i[on]] * a[on]
    below = a < pts[0]
    U[:, a[below]] = R[:, :1] * a[below]
    off = ~on & ~below
    if off.any():
        aa = a[off]
        ip, inn = i[off] - 1, i[off]
        ap, an = pts[ip], pts[inn]
        Mp, Mn = N // ap, N // an
        den = np.maximum(Mp - Mn, 1)
        k = np.clip((N - aa * Mn) // den, 0, aa)
        k = np.where(Mp > Mn, k, 0)
        U[:, aa] = k[None, :] * R[:, ip] + (aa - k)[None, :] * R[:, inn]
    return U, pts


def _refine(grid: set[int], pts: np.ndarray, active: set[int]) -> None:
    """Add grid points in the interval around each inexact active vertex (below the grid: between 0 and a_0)."""
    for v in active:
        j = int(np.searchsorted(pts, v))
        ap, an = (int(pts[j - 1]) if j else 0), int(pts[j])
        if an - ap <= 12:
            grid.update(range(ap + 1, an))
        else:
            grid.update(int(x) for x in np.linspace(ap, an, 8)[1:-1].round())
            grid.add(v)


@lru_cache(maxsize=4096)
def _worst_round(N: int, p: float, g: int, d: int, orders: tuple[float, ...]) -> tuple[np.ndarray, float]:
    o = np.asarray(orders)
    cost = np.maximum(np.arange(0, g + 1) - 1, 0).astype(np.float64) ** 2
    w = g * g / d
    grid = _initial_grid(g, d)
    exact: dict[int, np.ndarray] = {}
    while True:
        for a in sorted(grid - exact.keys()):
            exact[a] = a * _unit_rdp(N // a, p, orders)
        U, pts = _interpolate(exact, N, g, len(o))
        vals, il, ir = _hull_value(U, cost, w)
        active = ({int(x) for x in il} | {int(x) for x in ir}) - exact.keys() - {0}
        if not active:  # every maximising vertex is an exactly evaluated point
            break
        _refine(grid, pts, active)
    rdp = d * vals * _SAFETY
    # slack: every coordinate splits into <= g shift-1 pieces of >= floor(N/g) trials each
    log_t = math.log(d * g) + _log_tau(max(1, N // g), p, 1)
    return rdp, log_t


def worst_round_rdp(
    N: int, p: float, g: int, d: int, orders: Sequence[float] | None = None
) -> tuple[np.ndarray, float]:
    """(RDP per order, log slack) of one PVEC round with total noise Bin(N, p) per coordinate, worst neighbours.

    Rigorous upper bound over all gap vectors of the module docstring (replace-one neighbours, ||x|| <= delta2).
    """
    N = _check_pos_int("N", N)
    g = _check_pos_int("g", g)
    d = _check_pos_int("d", d)
    p = _check_p(p)
    if N < g:
        raise ValueError(f"N = m n' must be >= g (each shift piece needs a trial), got N={N}, g={g}")
    r, t = _worst_round(N, p, g, d, _check_orders(orders))
    return r.copy(), t


# ------------------------------------------------------------------------------------------- public API
def _n_contrib(params: PvecParams, n_contrib: int) -> int:
    k = _check_pos_int("n_contrib", n_contrib)
    if k > params.n:
        raise ValueError(f"n_contrib must lie in [1, n={params.n}], got {k}")
    return k


def pvec_round_rdp(params: PvecParams, n_contrib: int, orders: Sequence[float] | None = None) -> np.ndarray:
    """Per-order RDP bound of one PVEC round with n' = n_contrib contributors (noise Bin(m n', p)).

    Approximate RDP: valid together with the slack ``pvec_round_delta0`` (which is added to delta; it is
    ~2^(-m n'/g), i.e. 0.0 in double precision for realistic parameters). Applies to any (g, m, p), paper or
    calibrated. Fewer contributors => less noise => larger RDP.
    """
    k = _n_contrib(params, n_contrib)
    return worst_round_rdp(params.m * k, params.p, params.g, params.d, orders)[0]


def pvec_round_delta0(params: PvecParams, n_contrib: int) -> float:
    """Mixture slack of one round (support mismatch of the shifted binomials), to be added to delta."""
    k = _n_contrib(params, n_contrib)
    return math.exp(worst_round_rdp(params.m * k, params.p, params.g, params.d)[1])


Curve = tuple[int, float, int, int, int]  # (N, p, g, d, rounds): `rounds` rounds with noise Bin(N, p)


@lru_cache(maxsize=4096)
def _composed(curves: tuple[Curve, ...], delta: float) -> tuple[float, float]:
    """(eps, optimal order) at ``delta`` of adaptively composed rounds; (inf, nan) if the slacks exceed delta."""
    log_t = [math.log(c) + _worst_round(N, p, g, d, DEFAULT_ORDERS)[1] for N, p, g, d, c in curves]
    slack = math.exp(float(logsumexp(log_t))) * (1.0 + 1e-12)  # mixture slacks add to delta (module docstring)
    if slack >= delta:
        return math.inf, math.nan

    def rdp(orders: np.ndarray) -> np.ndarray:
        o = tuple(float(a) for a in orders)
        # RDP adds over adaptive rounds (Mironov 2017, Prop. 1)
        return sum(c * _worst_round(N, p, g, d, o)[0] for N, p, g, d, c in curves)

    return extended_rdp_to_dp(
        rdp,
        DEFAULT_ORDERS,
        delta - slack,
        order_cap=ORDER_CAP,
        min_order=MIN_ORDER,
        growth=_ORDER_GROWTH,
        span=_ORDER_SPAN,
    )


def composed_epsilon(
    rounds: Sequence[tuple[PvecParams, int] | tuple[PvecParams, int, int]], delta: float, return_order: bool = False
) -> float | tuple[float, float]:
    """eps at ``delta`` of fully interactive PVEC rounds [(params, n_contrib), ...] (RDP sum, then convert).

    An item (params, n_contrib, count) stands for ``count`` identical rounds; identical rounds are grouped either
    way, so 10^4 rounds cost one per-round evaluation (cached). ``return_order=True`` returns (eps, optimal
    Renyi order) (order nan when eps is inf, 0.0 for no rounds).
    """
    delta = _check_delta(delta)
    counts: Counter[NoiseKey] = Counter()
    for item in rounds:
        if not isinstance(item, tuple) or len(item) not in (2, 3) or not isinstance(item[0], PvecParams):
            raise ValueError(f"each round must be a (PvecParams, n_contrib[, count]) tuple, got {item!r}")
        c = _check_pos_int("count", item[2], 0) if len(item) == 3 else 1
        if c:
            counts[round_noise_key(item[0], item[1])] += c
    res = _composed_counts(counts, delta)
    return res if return_order else res[0]


NoiseKey = tuple[int, float, int, int]  # (N, p, g, d): one round's privacy is that of noise Bin(N, p) at g, d


def round_noise_key(params: PvecParams, n_contrib: int) -> NoiseKey:
    """What one PVEC round's RDP depends on: (N = m n', p, g, d). Rounds with equal keys have equal RDP curves, so
    a history of rounds is a Counter of keys (e.g. a user's own record of the rounds it joined)."""
    return (params.m * _n_contrib(params, n_contrib), float(params.p), int(params.g), int(params.d))


def epsilon_of_rounds(counts: Mapping[NoiseKey, int], delta: float) -> float:
    """eps at ``delta`` of the rounds counted in ``counts`` (round_noise_key -> number of rounds), composed by RDP
    exactly as composed_epsilon (the ledger's accountant)."""
    return _composed_counts(counts, _check_delta(delta))[0]


def _composed_counts(counts: Mapping[NoiseKey, int], delta: float) -> tuple[float, float]:
    key = tuple(sorted((*k, int(c)) for k, c in counts.items() if c))
    return _composed(key, delta) if key else (0.0, 0.0)


def pvec_round_epsilon(params: PvecParams, n_contrib: int, delta: float) -> float:
    """Tight (rigorous) eps at ``delta`` of one PVEC round with n' = n_contrib contributors."""
    return composed_epsilon([(params, n_contrib)], delta)


# ------------------------------------------------------------------------------------------ calibration
def default_g(d: int, n: int) -> int:
    """g = max(4, ceil(64 sqrt(d)), ceil(sqrt(n))): sensitivity inflation (1 + sqrt(d)/g)^2 <= 1.032 and
    worst-case rounding variance n/(4 g^2) count units <= 1/4 (spec 000 sec 2 uses g >= sqrt(n) likewise)."""
    return max(4, math.ceil(G_PER_SQRT_D * math.sqrt(d)), math.isqrt(n - 1) + 1)


def _eps_for(N: int, g: int, d: int, rounds: int, delta: float) -> float:
    return _composed(((N, 0.5, g, d, rounds),), delta)[0]


@lru_cache(maxsize=1024)
def _calibrate_cached(eps: float, delta: float, n: int, d: int, delta2: float, g: int, rounds: int) -> PvecParams:
    # Start from the Gaussian RDP guess: noise std s = (g + sqrt d) sqrt(rounds) / rho, rho = rho_for_epsilon.
    rho = gaussian_acc.rho_for_epsilon(eps, delta, method="rdp", orders=DEFAULT_ORDERS)
    s2 = rounds * (g + math.sqrt(d)) ** 2 / rho**2
    m = max(1, math.ceil(4.0 * s2 / n), math.ceil(g / n))

    def ok(mm: int) -> bool:
        return _eps_for(mm * n, g, d, rounds, delta) <= eps

    # The RDP bound scales almost exactly like 1/N: rescale the curve at the guess to hit eps (cheap, no new
    # evaluation; a guess, so the fixed grid will do), then confirm with the rigorous bound (``ok``) and bisect to
    # a relative 1e-3 (or to one trial).
    r0, t0 = _worst_round(m * n, 0.5, g, d, DEFAULT_ORDERS)
    slack = rounds * math.exp(t0) * (1.0 + 1e-12)
    if slack < delta:

        def excess(kappa: float) -> float:
            return rdp_to_dp(DEFAULT_ORDERS, rounds * r0 / kappa, delta - slack)[0] - eps

        k_lo, k_hi = 1e-3, 1e3
        if excess(k_lo) > 0 > excess(k_hi):
            kappa = scipy.optimize.brentq(excess, k_lo, k_hi, xtol=1e-9, rtol=1e-10)
            m = max(1, math.ceil(m / kappa * (1.0 + 5e-4)), math.ceil(g / n))
    hi = smallest_feasible_m(ok, m, n, g, f"eps={eps}, delta={delta} with g={g}, d={d}, n={n}")
    return PvecParams(d=d, n=n, delta2=delta2, g=g, m=hi, p=0.5, eps=eps, delta=delta, method="calibrated")


def smallest_feasible_m(ok: Callable[[int], bool], m: int, n: int, g: int, what: str) -> int:
    """Bracket from the guess m and bisect to a relative 1e-3 (or one trial) for the smallest m with ok(m); the
    answer is always an m that was checked to be feasible (never on the unsafe side)."""
    tol = lambda h: max(1, int(1e-3 * h))  # noqa: E731
    lo, hi = None, None
    if ok(m):
        hi, step = m, tol(m)
        while lo is None:
            cand = max(0, hi - step)
            if cand == 0 or cand * n < g:
                lo = cand
            elif ok(cand):
                hi, step = cand, 2 * step
            else:
                lo = cand
    else:
        lo, step = m, tol(m)
        while hi is None:
            cand = lo + step
            if cand > MAX_M:
                raise ValueError(f"no m <= 2^53 meets {what}")
            if ok(cand):
                hi = cand
            else:
                lo, step = cand, 2 * step
    while hi - lo > tol(hi):
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return int(hi)


def calibrate_pvec(
    eps: float, delta: float, n: int, d: int, delta2: float, g: int | None = None, rounds: int = 1
) -> PvecParams:
    """PvecParams(method="calibrated") with (near-)minimal noise n m p (1-p) meeting (eps, delta) rigorously.

    p = 1/2; m is the smallest integer (to a relative 1e-3) for which the accountant of this module certifies
    (eps, delta) for ``rounds`` fully interactive rounds of all n users (rounds = 1: one round; sequential
    protocols with disjoint cohorts also need only rounds = 1). The returned eps/delta fields are this target
    (the total over ``rounds``). g defaults to ``default_g(d, n)``. Beyond the paper (spec 000 sec 8).
    """
    eps = float(eps)
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    delta = _check_delta(delta)
    n = _check_pos_int("n", n)
    d = _check_pos_int("d", d)
    delta2 = float(delta2)
    if not (math.isfinite(delta2) and delta2 > 0.0):
        raise ValueError(f"delta2 must be a finite number > 0, got {delta2!r}")
    g = default_g(d, n) if g is None else _check_pos_int("g", g)
    rounds = _check_pos_int("rounds", rounds)
    return _calibrate_cached(eps, delta, n, d, delta2, g, rounds)


# ------------------------------------------------------------------------------------------ comparisons
def noise_variance(params: PvecParams, n_contrib: int | None = None) -> float:
    """Per-coordinate privacy-noise variance in data units: (2 delta2 / g)^2 m n' p (1 - p)."""
    k = params.n if n_contrib is None else _n_contrib(params, n_contrib)
    return (2.0 * params.delta2 / params.g) ** 2 * params.m * k * params.p * (1.0 - params.p)


def gaussian_variance(eps: float, delta: float, delta2: float, rounds: int = 1, method: str = "exact") -> float:
    """Per-coordinate variance of the Gaussian mechanism with l2 sensitivity 2 delta2 meeting (eps, delta)
    over ``rounds`` compositions: method "exact" = analytic Gaussian (Balle & Wang 2018; composition of
    Gaussians is Gaussian), "rdp" = same RDP conversion as this module."""
    rho = gaussian_acc.rho_for_epsilon(eps, delta, method=method)
    return rounds * (2.0 * delta2 / rho) ** 2
