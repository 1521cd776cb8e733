"""RDP of the subsampled shuffle model: the accountant of seed 001 (Girgis, Data, Diggavi; NeurIPS'21).

Mechanism (spec 001 section 1): each round a secret uniform k-subset of the n clients (without replacement,
gamma = k/n) applies an eps0-LDP randomizer with a discrete range; the server sees only the shuffled multiset.
Neighbours are replace-one. T rounds compose adaptively (RDP adds).

- ``rdp_upper``: Theorem 1 (upper bound, any eps0-LDP randomizer with discrete range, integer order >= 2), as
  reconstructed in spec 001 section 4, with the conservative Upsilon (a = 2 sinh eps0; ambiguity A1) by default
  and ``ups="third_party"`` (a/2) as an option.
- ``rdp_lower``: Theorem 2 (lower bound; binary randomized response on D = (0,..,0) vs D' = (1,0,..,0)):
  (1/(lam-1)) log E[(1 + gamma z)^lam], z = (m - k p)(e^{2 eps0} - 1)/(k e^eps0), m ~ Bin(k, p), p = 1/(e^eps0+1).
- ``subsampled_shuffle_epsilon``: T-fold composition + the optimal RDP -> DP conversion (paper's Lemma 1, eq. (7))
  over integer orders 2..512, extended while the optimum sits at the grid edge (spec 001 section 8).
- ``max_rounds`` / ``max_eps0``: inverses (largest T, largest eps0 that fit an (eps, delta) budget).
- ``rdp_gdd21a_wbk19``: the paper's second baseline (Appendix A): the RDP of the k-client shuffle of GDD+21a
  fed into the subsampling-without-replacement bound of Wang-Balle-Kasiviswanathan 2019 (Thm 9).

Numerics (spec 001 section 8): every sum is a log-sum-exp of log-terms built from gammaln. The Theorem 1 sum
over j = 2..lam is evaluated in full (O(lam) per order; no truncation is needed: it never depends on n). The
Theorem 2 expectation over m ~ Bin(k, p) is exact over the whole support for k <= 4000; above, it is restricted to
the window where the (log-concave) summand is within e^-60 of its maximum (neglected relative mass < (k+1) e^-60,
far below floating-point rounding). The small-value regime is summed as E[expm1(lam log1p(gz)) - lam gz] so
that values ~1e-9 keep full precision (see ``_log_mean_power``). RDP curves are cached per configuration
(lru_cache), so any number of rounds is answered from the cached vector.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

import numpy as np
from scipy.special import gammaln, logsumexp
from scipy.stats import binom

from shuffledp.accountants import composition
from shuffledp.accountants.rdp import (
    DEFAULT_MAX_ORDER,
    DEFAULT_ORDER_CAP,
    check_delta,
    check_int,
    check_nk,
    integer_orders,
    monotone_envelope,
    optimal_epsilon,
    rdp_to_dp,
)

__all__ = [
    "rdp_upper",
    "rdp_lower",
    "rdp_gdd21a_wbk19",
    "rdp_to_dp",
    "subsampled_shuffle_rdp",
    "subsampled_shuffle_epsilon",
    "max_rounds",
    "max_eps0",
]

Bound = Literal["upper", "lower", "gdd21a_wbk19"]
Ups = Literal["conservative", "third_party"]
_BOUNDS = ("upper", "lower", "gdd21a_wbk19")
_UPS = ("conservative", "third_party")
_LOG_WINDOW = 60.0  # Thm 2: keep summands within e^-60 of the largest (relative loss < (k+1) e^-60)


# ----------------------------------------------------------------------------------------------- validation
def _check_eps0(eps0: float) -> float:
    e = float(eps0)
    if not (math.isfinite(e) and e > 0.0):
        raise ValueError(f"eps0 (the LDP parameter) must be a finite number > 0, got {eps0!r}")
    return e


def _check_rounds(T: int) -> int:
    return check_int("T (number of rounds)", T, 1)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _integer_orders_from(alpha: int | np.ndarray) -> np.ndarray:
    a = np.atleast_1d(np.asarray(alpha))
    if a.size == 0 or not np.all(np.isfinite(a.astype(np.float64))):
        raise ValueError(f"alpha (Renyi order) must be finite, got {alpha!r}")
    ai = np.round(a.astype(np.float64)).astype(np.int64)
    if np.any(ai != a) or np.any(ai < 2):
        raise ValueError(f"alpha (Renyi order) must be an integer >= 2 for Theorem 1, got {alpha!r}")
    return ai


def _real_orders_from(alpha: float | np.ndarray) -> np.ndarray:
    a = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
    if a.size == 0 or np.any(~np.isfinite(a)) or np.any(a <= 1.0):
        raise ValueError(f"alpha (Renyi order) must be a finite number > 1, got {alpha!r}")
    return a


def _scalar_or_array(alpha: object, values: np.ndarray) -> float | np.ndarray:
    return float(values[0]) if np.ndim(alpha) == 0 else values


# -------------------------------------------------------------------------------------- stable primitives
def _log_expm1(x: float) -> float:
    """log(e^x - 1) for x > 0 without overflow."""
    return math.log(math.expm1(x)) if x < 30.0 else x + math.log1p(-math.exp(-x))


def _log_sinh(x: float) -> float:
    """log sinh(x) for x > 0 without overflow."""
    return x + math.log1p(-math.exp(-2.0 * x)) - math.log(2.0) if x > 1e-8 else math.log(x)


def _kbar(eps0: float, k: int) -> int:
    """kbar = floor((k-1)/(2 e^eps0)) + 1 (spec 001 section 4, Thm 1; GDD+21a's nbar)."""
    return int(math.floor((k - 1) * math.exp(-eps0) / 2.0)) + 1


def _log_binom_row(lgam: np.ndarray, lam: int, j: np.ndarray) -> np.ndarray:
    """log C(lam, j) from a table lgam[i] = log Gamma(i)."""
    return lgam[lam + 1] - lgam[j + 1] - lgam[lam - j + 1]


# ---------------------------------------------------------------------------------------------- Theorem 1
def _thm1(orders: np.ndarray, eps0: float, n: int, k: int, ups: str) -> np.ndarray:
    """Theorem 1 of seed 001 (spec 001 section 4), evaluated in log space for integer orders.

    eps(lam) = log(1 + sum_{j=2}^{lam} T_j + Ups)/(lam - 1) with
      T_2 = 4 C(lam,2) g^2 (e^eps0 - 1)^2/(kbar e^eps0)
      T_j = C(lam,j) g^j j Gamma(j/2) (2 (e^{2 eps0}-1)^2/(kbar e^{2 eps0}))^{j/2}      (j >= 3)
      Ups = sum_{j>=2} C(lam,j) (g a)^j exp(-(k-1)/(8 e^eps0)) = ((1+ga)^lam - 1 - lam g a) e^{-(k-1)/(8e^eps0)}.
    Note 2 (e^{2e}-1)^2/e^{2e} = 8 sinh^2 e and (e^e-1)^2/e^e = 4 sinh^2(e/2). Ups is summed term by term
    (spec 001 section 8: avoids the cancellation in (1+x)^lam - 1 - lam x).
    """
    g_log = math.log(k) - math.log(n)
    log_kbar = math.log(_kbar(eps0, k))
    log_t2_const = math.log(16.0) + 2.0 * _log_sinh(eps0 / 2.0) - log_kbar + 2.0 * g_log
    log_tj_rate = 0.5 * (math.log(8.0) + 2.0 * _log_sinh(eps0) - log_kbar)  # per unit of j
    # a = (e^{2eps0}-1)/e^eps0 = 2 sinh eps0 (conservative, A1); the third-party script uses a/2 = sinh eps0
    log_a = _log_sinh(eps0) + (math.log(2.0) if ups == "conservative" else 0.0)
    log_ups_factor = -(k - 1) * math.exp(-eps0) / 8.0
    top = int(orders.max())
    lgam = gammaln(np.arange(top + 2, dtype=np.float64))
    out = np.empty(orders.shape, dtype=np.float64)
    for i, lam in enumerate(orders.tolist()):
        j = np.arange(2, lam + 1, dtype=np.int64)
        log_c = _log_binom_row(lgam, lam, j)
        jf = j.astype(np.float64)
        main = log_c + jf * g_log + np.log(jf) + gammaln(jf / 2.0) + jf * log_tj_rate
        main[0] = log_c[0] + log_t2_const  # j = 2 has its own constant
        upsilon = log_c + jf * (g_log + log_a) + log_ups_factor
        log_sum = logsumexp(np.concatenate([main, upsilon]))
        out[i] = np.logaddexp(0.0, log_sum) / (lam - 1)  # log(1 + S) with log1p accuracy for tiny S
    return out


@lru_cache(maxsize=512)
def _thm1_cached(orders: tuple[int, ...], eps0: float, n: int, k: int, ups: str) -> np.ndarray:
    v = _thm1(np.asarray(orders, dtype=np.int64), eps0, n, k, ups)
    v.flags.writeable = False
    return v


def rdp_upper(alpha: int | np.ndarray, eps0: float, n: int, k: int, ups: Ups = "conservative") -> float | np.ndarray:
    """Theorem 1: upper bound on the order-alpha RDP of one subsampled-shuffle round (integer alpha >= 2)."""
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    _check_choice("ups", ups, _UPS)
    orders = _integer_orders_from(alpha)
    return _scalar_or_array(alpha, _thm1(orders, e, n, k, ups))


# ---------------------------------------------------------------------------------------------- Theorem 2
def _log_mean_power(log_w: np.ndarray, gz: np.ndarray, lam: float) -> float:
    """log E_w[(1 + gz)^lam] for weights w = exp(log_w) (normalised here), given that E[gz] = 0 exactly.

    The weights are normalised so that binom.logpmf's rounding does not leak into the result. When the value is
    small, E[(1+gz)^lam] - 1 = E[expm1(lam log1p(gz)) - lam gz] is summed directly: the exactly-zero first
    moment is removed, so the ~1e-11 relative error of logpmf at large k cannot bias it, and no sum of masses
    to 1 + 1e-9 (which keeps only ~6 digits) is ever formed.
    """
    lw = log_w - logsumexp(log_w)
    x = lam * np.log1p(gz)
    val = float(logsumexp(lw + x))
    if val < 0.5 and float(x.max()) < 700.0:
        val = math.log1p(float(np.sum(np.exp(lw) * (np.expm1(x) - lam * gz))))
    return max(val, 0.0)  # E[(1+gz)^lam] >= (1 + E gz)^lam = 1 by Jensen


def _thm2(orders: np.ndarray, eps0: float, n: int, k: int) -> np.ndarray:
    """Theorem 2 of seed 001 (spec 001 section 4): log E[(1 + g z)^lam]/(lam-1), m ~ Bin(k, p).

    1 + g z = P'(m)/P(m) is the likelihood ratio of the count of ones under D' vs D (spec 001 s4, re-derived),
    and 1 + g z >= 1 - g (1 - e^-eps0) > 0. The summand log pmf(m) + lam log(1 + g z(m)) is concave in m,
    so it is summed on the window where it is within e^-60 of its maximum.
    """
    g = k / n
    p = 1.0 / (math.exp(eps0) + 1.0)
    slope = g * 2.0 * math.sinh(eps0) / k if eps0 < 700 else math.inf  # d(g z)/dm
    if not math.isfinite(slope):
        raise ValueError(f"eps0 too large for Theorem 2 evaluation: {eps0}")
    lam = orders.astype(np.float64)
    if k <= 4000:  # whole support
        m = np.arange(k + 1, dtype=np.float64)
        base = binom.logpmf(m, k, p)
        gz = slope * (m - k * p)
        return np.array([_log_mean_power(base, gz, a) for a in lam.tolist()]) / (lam - 1.0)
    # coarse grid to locate each order's maximiser (concavity: the true argmax is within one coarse step)
    mc = np.unique(np.round(np.linspace(0.0, k, 4001)))
    step = float(np.max(np.diff(mc)))
    fc = binom.logpmf(mc, k, p)[None, :] + lam[:, None] * np.log1p(slope * (mc - k * p))[None, :]
    centers = mc[np.argmax(fc, axis=1)]
    half = 14.0 * math.sqrt(k * p * (1.0 - p)) + step + 2.0
    out = np.empty(lam.shape, dtype=np.float64)
    while True:
        lo = int(max(0.0, centers.min() - half))
        hi = int(min(float(k), centers.max() + half))
        m = np.arange(lo, hi + 1, dtype=np.float64)
        base = binom.logpmf(m, k, p)
        gz = slope * (m - k * p)
        logr = np.log1p(gz)
        ok = True
        for i in range(lam.size):
            a = max(lo, int(centers[i] - half)) - lo
            b = min(hi, int(centers[i] + half)) - lo
            f = base[a : b + 1] + lam[i] * logr[a : b + 1]
            fmax = f.max()
            if (a + lo > 0 and f[0] > fmax - _LOG_WINDOW) or (b + lo < k and f[-1] > fmax - _LOG_WINDOW):
                ok = False
                break
            out[i] = _log_mean_power(base[a : b + 1], gz[a : b + 1], lam[i]) / (lam[i] - 1.0)
        if ok:
            return out
        half *= 2.0


@lru_cache(maxsize=128)
def _thm2_cached(orders: tuple[float, ...], eps0: float, n: int, k: int) -> np.ndarray:
    v = _thm2(np.asarray(orders, dtype=np.float64), eps0, n, k)
    v.flags.writeable = False
    return v


def rdp_lower(alpha: float | np.ndarray, eps0: float, n: int, k: int) -> float | np.ndarray:
    """Theorem 2: lower bound on the worst-case order-alpha RDP of one round (any real alpha > 1)."""
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    orders = _real_orders_from(alpha)
    return _scalar_or_array(alpha, _thm2(orders, e, n, k))


# ------------------------------------------------------------------------------ baseline: GDD+21a + WBK19
def _gdd21a_shuffle(orders: np.ndarray, eps0: float, k: int) -> np.ndarray:
    """RDP of the k-client shuffle (no subsampling), GDD+21a Thm 1 as quoted in spec 001 section 5 [recon]:

    eps(lam) <= log(1 + C(lam,2)(e^eps0-1)^2/(nbar e^eps0)
                    + sum_{j=3}^{lam} C(lam,j) j Gamma(j/2) ((e^{2eps0}-1)^2/(2 nbar e^{2eps0}))^{j/2}
                    + e^{eps0 lam - (k-1)/(8 e^eps0)}) / (lam-1),       nbar = floor((k-1)/(2e^eps0)) + 1,
    capped at eps0 (the shuffle of eps0-LDP reports is eps0-DP).
    """
    log_nbar = math.log(_kbar(eps0, k))
    log_t2 = 2.0 * math.log(2.0) + 2.0 * _log_sinh(eps0 / 2.0) - log_nbar  # (e^e-1)^2/e^e = 4 sinh^2(e/2)
    rate = 0.5 * (math.log(2.0) + 2.0 * _log_sinh(eps0) - log_nbar)  # (e^{2e}-1)^2/(2 e^{2e}) = 2 sinh^2 e
    tail = -(k - 1) * math.exp(-eps0) / 8.0
    top = int(orders.max())
    lgam = gammaln(np.arange(top + 2, dtype=np.float64))
    out = np.empty(orders.shape, dtype=np.float64)
    for i, lam in enumerate(orders.tolist()):
        j = np.arange(2, lam + 1, dtype=np.int64)
        jf = j.astype(np.float64)
        log_c = _log_binom_row(lgam, lam, j)
        terms = log_c + np.log(jf) + gammaln(jf / 2.0) + jf * rate
        terms[0] = log_c[0] + log_t2
        s = logsumexp(np.append(terms, eps0 * lam + tail))
        out[i] = min(float(np.logaddexp(0.0, s)) / (lam - 1), eps0)
    return out


def _wbk19_wor(orders: np.ndarray, base: np.ndarray, eps_inf: float, gamma: float) -> np.ndarray:
    """WBK19 Thm 9 (subsampling without replacement), for integer orders; ``base[i]`` = eps(i + 2), i.e. ``base``
    must hold the base curve at every integer 2..max(orders).

    eps'(lam) <= log(1 + g^2 C(lam,2) min{4(e^{eps(2)}-1), e^{eps(2)} min{2,(e^{eps_inf}-1)^2}}
                     + sum_{j=3}^{lam} g^j C(lam,j) e^{(j-1) eps(j)} min{2, (e^{eps_inf}-1)^j}) / (lam-1).
    """
    top = int(orders.max())
    lgam = gammaln(np.arange(top + 2, dtype=np.float64))
    lg = math.log(gamma)
    e2 = float(base[0])
    log_em1_inf = _log_expm1(eps_inf)
    t2 = min(math.log(4.0) + _log_expm1(e2) if e2 > 0 else -math.inf, e2 + min(math.log(2.0), 2.0 * log_em1_inf))
    out = np.empty(orders.shape, dtype=np.float64)
    for i, lam in enumerate(orders.tolist()):
        j = np.arange(3, lam + 1, dtype=np.int64)
        jf = j.astype(np.float64)
        terms = (
            jf * lg
            + _log_binom_row(lgam, lam, j)
            + (jf - 1.0) * base[j - 2]
            + np.minimum(math.log(2.0), jf * log_em1_inf)
        )
        first = 2.0 * lg + _log_binom_row(lgam, lam, np.array([2]))[0] + t2
        s = logsumexp(np.append(terms, first))
        out[i] = float(np.logaddexp(0.0, s)) / (lam - 1)
    return out


@lru_cache(maxsize=64)
def _gdd_wbk_cached(orders: tuple[int, ...], eps0: float, n: int, k: int) -> np.ndarray:
    o = np.asarray(orders, dtype=np.int64)
    full = np.arange(2, int(o.max()) + 1, dtype=np.int64)
    v = _wbk19_wor(o, _gdd21a_shuffle(full, eps0, k), eps0, k / n)
    v.flags.writeable = False
    return v


def rdp_gdd21a_wbk19(alpha: int | np.ndarray, eps0: float, n: int, k: int) -> float | np.ndarray:
    """Baseline of the paper's Appendix A: GDD+21a shuffle RDP + WBK19 Thm 9 subsampling (integer alpha >= 2)."""
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    orders = _integer_orders_from(alpha)
    return _scalar_or_array(alpha, np.array(_gdd_wbk_cached(tuple(orders.tolist()), e, n, k)))


# ------------------------------------------------------------------------------------ curves, composition
def _pure_dp_cap(eps0: float, n: int, k: int) -> float:
    """One round is eps0-DP before sampling, so log(1 + gamma (e^eps0 - 1))-DP after sampling k of n without
    replacement under replace-one (Balle-Barthe-Gaboardi 2018, Thm 9); RDP <= pure DP at every order."""
    return math.log1p((k / n) * math.expm1(eps0)) if eps0 < 700 else eps0 + math.log(k / n)


def _curve(orders: tuple[int, ...], eps0: float, n: int, k: int, bound: str, ups: str, tighten: bool) -> np.ndarray:
    if bound == "upper":
        v = np.array(_thm1_cached(orders, eps0, n, k, ups))
        if tighten:  # spec 001 section 7.3 [ext]: monotone envelope and pure-DP cap (both valid upper bounds)
            v = np.minimum(monotone_envelope(v), _pure_dp_cap(eps0, n, k))
        return v
    if bound == "lower":
        return np.array(_thm2_cached(tuple(float(o) for o in orders), eps0, n, k))
    return np.array(_gdd_wbk_cached(orders, eps0, n, k))


def subsampled_shuffle_rdp(
    eps0: float,
    n: int,
    k: int,
    orders: np.ndarray | None = None,
    bound: Bound = "upper",
    ups: Ups = "conservative",
    tighten: bool = False,
) -> np.ndarray:
    """Per-round RDP curve on integer ``orders`` (default 2..512).

    bound: "upper" (Thm 1), "lower" (Thm 2) or "gdd21a_wbk19" (Appendix A baseline). ``tighten`` (upper only)
    applies the monotone envelope and the pure-DP cap of spec 001 section 7.3; off by default (reproduces the
    paper and the spec's reference values).
    """
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    _check_choice("bound", bound, _BOUNDS)
    _check_choice("ups", ups, _UPS)
    o = integer_orders() if orders is None else _integer_orders_from(orders)
    return _curve(tuple(o.tolist()), e, n, k, bound, ups, bool(tighten))


@lru_cache(maxsize=4096)
def _epsilon_cached(
    eps0: float,
    n: int,
    k: int,
    T: int,
    delta: float,
    bound: str,
    ups: str,
    tighten: bool,
    conversion: str,
    max_order: int,
    order_cap: int,
) -> tuple[float, float]:
    def fn(orders: np.ndarray) -> np.ndarray:
        return _curve(tuple(orders.tolist()), eps0, n, k, bound, ups, tighten)

    return optimal_epsilon(fn, T, delta, max_order=max_order, order_cap=order_cap, conversion=conversion)


def subsampled_shuffle_epsilon(
    eps0: float,
    n: int,
    k: int,
    T: int,
    delta: float,
    bound: Bound = "upper",
    ups: Ups = "conservative",
    tighten: bool = False,
    conversion: str = "optimal",
    max_order: int = DEFAULT_MAX_ORDER,
    order_cap: int = DEFAULT_ORDER_CAP,
    return_order: bool = False,
) -> float | tuple[float, float]:
    """eps such that T adaptive subsampled-shuffle rounds are (eps, delta)-DP (Thm 3 eq. (7) of seed 001).

    bound="upper" is the guarantee (Thm 1). bound="lower" converts the Thm 2 curve: it is NOT a guarantee, it is
    the best any analysis through the RDP of one round followed by this conversion could report.
    With ``return_order=True`` returns (eps, optimal order).
    """
    e = _check_eps0(eps0)
    n, k = check_nk(n, k)
    T = _check_rounds(T)
    d = check_delta(delta)
    _check_choice("bound", bound, _BOUNDS)
    _check_choice("ups", ups, _UPS)
    res = _epsilon_cached(e, n, k, T, d, bound, ups, bool(tighten), conversion, int(max_order), int(order_cap))
    return res if return_order else res[0]


def max_rounds(eps0: float, n: int, k: int, eps: float, delta: float, t_max: int = 10**15, **kwargs: object) -> int:
    """Largest T with subsampled_shuffle_epsilon(eps0, n, k, T, delta) <= eps (0 if not even one round fits).

    Binary search over T (spec 001 section 7.7); eps_T is non-decreasing in T since every RDP value is >= 0.
    """
    if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise ValueError(f"eps (the target) must be a finite number >= 0, got {eps!r}")

    def fits(T: int) -> bool:
        return subsampled_shuffle_epsilon(eps0, n, k, T, delta, **kwargs) <= eps

    return composition.max_rounds(fits, t_max)


def max_eps0(
    n: int,
    k: int,
    T: int,
    eps: float,
    delta: float,
    eps0_max: float = 30.0,
    rel_tol: float = 1e-6,
    **kwargs: object,
) -> float:
    """Largest LDP eps0 (found by bisection, within rel_tol) whose T rounds fit (eps, delta); 0.0 if none does.

    The returned value is always one that was checked to fit (the lower end of the bracket), so it is safe even
    where the bound is not monotone in eps0.
    """
    n, k = check_nk(n, k)
    T = _check_rounds(T)
    check_delta(delta)
    if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise ValueError(f"eps (the target) must be a finite number >= 0, got {eps!r}")

    def fits(e0: float) -> bool:
        return subsampled_shuffle_epsilon(e0, n, k, T, delta, **kwargs) <= eps

    if fits(eps0_max):
        return float(eps0_max)
    lo, hi = 0.0, min(1.0, float(eps0_max))  # bracket by doubling (not fits(hi)), then bisect
    while fits(hi):
        lo, hi = hi, min(2.0 * hi, float(eps0_max))
    return composition.bisect_boundary(fits, lo, hi, rel_tol=rel_tol, abs_tol=rel_tol * 1e-6)
