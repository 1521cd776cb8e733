"""Generic Renyi-DP helpers: order grids, RDP -> (eps, delta) conversion, grid extension, envelopes.

Nothing here is specific to one mechanism; an accountant supplies its RDP curve as a function of the order.

- ``rdp_to_dp``: the optimal-in-practice conversion of Canonne-Kamath-Steinke 2020 (Prop. 12 of
  arXiv:2004.00010) / Balle et al. AISTATS 2020 (Thm 21), the paper's Lemma 1 / eq. (7) of seed 001 (spec 001
  section 4):  eps = min_lam [ rdp(lam) + log((lam-1)/lam) - (log delta + log lam)/(lam-1) ].
  It is the same bound as ``dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon`` (including its
  KL/Bretagnolle-Huber shortcut eps = 0 when delta >= sqrt(1 - exp(-rdp))), vectorised with numpy so that
  accountants can call it many times (inverse searches) on grids of thousands of orders.
- ``rdp_to_dp_mironov``: Mironov 2017 Prop. 3, eps = rdp + log(1/delta)/(lam-1) (looser; an option only).
- ``minimise_over_orders`` / ``extended_rdp_to_dp``: the conversion minimised over a grid that is extended
  whenever the optimum sits at an edge of it (spec 001 section 8): upwards by doubling the top order, and for
  real-order grids downwards towards 1. Any set of orders gives a valid bound, so extending only tightens.
- ``optimal_epsilon``: composes T identical rounds (RDP adds, Mironov 2017 Prop. 1) and converts over the
  integer grid 2..512, extended as above.
- ``monotone_envelope``: the Renyi divergence is non-decreasing in the order (van Erven & Harremoes 2014,
  Thm 3), so an upper bound U may be replaced by lam -> min_{lam' >= lam} U(lam') (spec 001 section 7.3 [ext]).
- ``round_up``: the upward margin every eps or delta computed in floating point (dp_accounting, a scipy root, a
  closed form here) receives before it is reported or compared with a budget (issue 43 item 7).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# The float margin (round_up): far above the float error of the figures it covers (dp_accounting's exact Gaussian
# eps comes from a brentq with xtol = 1e-12 and sat 9e-14 below the exact value at sigma = 1, delta = 1e-5, issue 43
# item 7; closed forms and RDP series are accurate to ~1e-14 relative), far below any digit a report shows. A delta
# gets the relative part alone: deltas of 1e-140 are reported, and the float error of a tail difference such as
# Phi(a) - e^eps Phi(b) is relative to its terms, at most ~1e-16 times the cancellation factor (eps / mu^2 for the
# Gaussian; 1e-9 covers factors up to 1e6).
_MARGIN_REL, _MARGIN_ABS = 1e-9, 1e-10
DEFAULT_MAX_ORDER = 512  # spec 001 section 6: integer orders 2..512
DEFAULT_ORDER_CAP = 1 << 14  # largest order the grid extension may reach (16384: covers orders up to 1e4)
_GEOMETRIC_RATIO = 1.02  # spacing of the (integer) orders above DEFAULT_MAX_ORDER


def round_up(x: float, probability: bool = False) -> float:
    """A privacy figure computed in floating point, raised by the float margin (relative 1e-9 plus absolute 1e-10;
    relative alone for a delta: ``probability``) so that it is never below the exact value; 0 (an exact figure, or
    one clipped at 0) and inf are kept. A delta raised above 1 is the caller's to cap."""
    x = float(x)
    if not 0.0 < x < math.inf:
        return x
    return math.nextafter(x * (1.0 + _MARGIN_REL) + (0.0 if probability else _MARGIN_ABS), math.inf)


def check_delta(delta: float, name: str = "delta") -> float:
    """delta must lie in the open interval (0, 1)."""
    d = float(delta)
    if not (0.0 < d < 1.0):
        raise ValueError(f"{name} must be in the open interval (0, 1), got {delta!r}")
    return d


def check_int(name: str, value: int, minimum: int) -> int:
    """An integer parameter >= minimum (bool is rejected)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_nk(n: int, k: int) -> tuple[int, int]:
    """n clients and k clients sampled per round, 1 <= k <= n."""
    n = check_int("n (number of clients)", n, 1)
    k = check_int("k (clients sampled per round)", k, 1)
    if k > n:
        raise ValueError(f"k (clients sampled per round) must satisfy 1 <= k <= n = {n}, got {k}")
    return n, k


def integer_orders(max_order: int = DEFAULT_MAX_ORDER, dense_upto: int = DEFAULT_MAX_ORDER) -> np.ndarray:
    """Integer Renyi orders: every integer 2..min(max_order, dense_upto), then a geometric tail of integers.

    The conversion is valid on any set of orders, so a sparser tail only costs a little tightness.
    """
    max_order = int(max_order)
    if max_order < 2:
        raise ValueError(f"max_order must be >= 2, got {max_order}")
    dense = np.arange(2, min(max_order, int(dense_upto)) + 1, dtype=np.int64)
    if max_order <= dense_upto:
        return dense
    n_tail = int(np.ceil(np.log(max_order / dense_upto) / np.log(_GEOMETRIC_RATIO))) + 1
    tail = np.ceil(dense_upto * _GEOMETRIC_RATIO ** np.arange(1, n_tail + 1)).astype(np.int64)
    tail = np.unique(np.minimum(tail, max_order))
    return np.concatenate([dense, tail[tail > dense[-1]]])


def _as_curve(orders: Sequence[float] | np.ndarray, rdp: Sequence[float] | np.ndarray) -> tuple[np.ndarray, ...]:
    a = np.asarray(orders, dtype=np.float64).ravel()
    r = np.asarray(rdp, dtype=np.float64).ravel()
    if a.shape != r.shape or a.size == 0:
        raise ValueError(f"orders and rdp must be non-empty and of equal length, got {a.size} and {r.size}")
    if np.any(~np.isfinite(a)) or np.any(a <= 1.0):
        raise ValueError("every Renyi order must be a finite number > 1")
    if np.any(np.isnan(r)) or np.any(r < 0.0):
        raise ValueError("RDP values must be >= 0 and not NaN (+inf is allowed)")
    return a, r


def rdp_to_dp(
    orders: Sequence[float] | np.ndarray, rdp: Sequence[float] | np.ndarray, delta: float
) -> tuple[float, float]:
    """(eps, optimal order) such that a mechanism with this RDP curve is (eps, delta)-DP.

    CKS20 Prop. 12 / BBG+20 Thm 21 (paper's Lemma 1, spec 001 section 4), minimised over the given orders.
    eps is clipped at 0 from below (eps = 0 is then still a valid, larger, guarantee), then raised by round_up.
    """
    d = check_delta(delta)
    a, r = _as_curve(orders, rdp)
    with np.errstate(over="ignore", invalid="ignore"):
        eps = r + np.log1p(-1.0 / a) - (np.log(d) + np.log(a)) / (a - 1.0)
        # Bretagnolle-Huber: TV <= sqrt(1 - exp(-KL)) and KL <= D_lam for lam >= 1, so delta >= that gives eps = 0
        # (the same shortcut as dp_accounting.compute_epsilon).
        eps = np.where(d * d + np.expm1(-r) > 0.0, 0.0, eps)
    eps = np.where(np.isnan(eps), np.inf, eps)
    i = int(np.argmin(eps))
    return round_up(max(0.0, float(eps[i]))), float(a[i])


def rdp_to_dp_mironov(
    orders: Sequence[float] | np.ndarray, rdp: Sequence[float] | np.ndarray, delta: float
) -> tuple[float, float]:
    """Mironov 2017 Prop. 3: eps = min_lam rdp(lam) + log(1/delta)/(lam - 1). Looser than ``rdp_to_dp``."""
    d = check_delta(delta)
    a, r = _as_curve(orders, rdp)
    eps = r - np.log(d) / (a - 1.0)
    i = int(np.argmin(eps))
    return round_up(max(0.0, float(eps[i]))), float(a[i])


def monotone_envelope(rdp: Sequence[float] | np.ndarray) -> np.ndarray:
    """lam -> min over grid orders lam' >= lam of rdp(lam'); ``rdp`` must be sorted by increasing order.

    Valid for an upper bound of a Renyi-DP curve because D_lam is non-decreasing in lam (van Erven & Harremoes
    2014, Thm 3).
    """
    r = np.asarray(rdp, dtype=np.float64)
    return np.minimum.accumulate(r[::-1])[::-1]


_CONVERSIONS: dict[str, Callable[..., tuple[float, float]]] = {"optimal": rdp_to_dp, "mironov": rdp_to_dp_mironov}


def _up_piece(top: float, cap: float, span: float, growth: float, integer: bool) -> np.ndarray:
    """Orders in (top, min(span top, cap)], geometric with ratio ~growth (integers if ``integer``)."""
    end = min(span * top, cap)
    k = max(1, math.ceil(math.log(end / top) / math.log(growth)))
    piece = np.geomspace(top, end, k + 1)[1:]
    if integer:
        piece = np.unique(np.ceil(piece)).astype(np.int64)
    return piece[piece > top]


def _down_piece(bottom: float, floor: float, span: float, growth: float) -> np.ndarray:
    """Real orders in [max(1 + (bottom - 1)/span, floor), bottom), lam - 1 geometric with ratio ~growth."""
    end = max(1.0 + (bottom - 1.0) / span, floor)
    k = max(1, math.ceil(math.log((bottom - 1.0) / (end - 1.0)) / math.log(growth)))
    piece = 1.0 + np.geomspace(end - 1.0, bottom - 1.0, k + 1)[:-1]
    return piece[piece < bottom]


def minimise_over_orders(
    best_on: Callable[[np.ndarray], tuple[float, float]],
    orders: Sequence[float] | np.ndarray,
    order_cap: float = DEFAULT_ORDER_CAP,
    min_order: float | None = None,
    integer: bool = False,
    growth: float = _GEOMETRIC_RATIO,
    span: float = 2.0,
) -> tuple[float, float]:
    """(value, lam*) = the minimum of a conversion over ``orders``, extending the grid while lam* is at an edge.

    ``best_on(o)`` returns (min over o of the conversion, its order) for any array of orders; the minimum over a
    union of grids is the least of the pieces' minima, so only the added orders are ever evaluated (``best_on``
    must give a valid bound at each order on its own). While lam* is the top order (below ``order_cap``) the
    orders up to ``span`` times the top are added (spec 001 section 8: doubling); while lam* is the bottom order
    and ``min_order`` is given, real orders down to 1 + (bottom - 1)/span (not below ``min_order``). A value of
    0 or inf stops the search (nothing to gain). Pieces are geometric with ratio ``growth``; ``integer`` rounds
    the pieces above the grid up to integers (curves computed, or only valid, at integer orders). A larger
    ``span`` means fewer, larger pieces (for curves whose evaluation cost is mostly per call).
    """
    grid = np.asarray(orders).ravel()
    if grid.size == 0:
        raise ValueError("orders must be non-empty")
    if grid.dtype.kind not in "iu":  # integer grids are passed on as integers
        grid = grid.astype(np.float64)
    if not (growth > 1.0 and span > 1.0):
        raise ValueError(f"growth and span must be > 1, got {growth!r}, {span!r}")
    value, lam = best_on(grid)
    lo, hi = float(grid.min()), float(grid.max())
    while 0.0 < value < math.inf:
        if lam >= hi and hi < order_cap:
            piece = _up_piece(hi, float(order_cap), span, growth, integer)
        elif lam <= lo and min_order is not None and lo > min_order:
            piece = _down_piece(lo, float(min_order), span, growth)
        else:
            break
        if piece.size == 0:
            break
        lo, hi = min(lo, float(piece.min())), max(hi, float(piece.max()))
        v, a = best_on(piece)
        if v < value:
            value, lam = v, a
    return value, float(lam)


def extended_rdp_to_dp(
    rdp_fn: Callable[[np.ndarray], np.ndarray],
    orders: Sequence[float] | np.ndarray,
    delta: float,
    conversion: str = "optimal",
    **extension: Any,
) -> tuple[float, float]:
    """(eps, lam*) of ``rdp_to_dp`` (or ``rdp_to_dp_mironov``) for the curve ``rdp_fn``, starting from ``orders``
    and extended at the edges by ``minimise_over_orders`` (``extension``: its keyword arguments order_cap,
    min_order, integer, growth, span)."""
    d = check_delta(delta)
    convert = _CONVERSIONS.get(conversion)
    if convert is None:
        raise ValueError(f"conversion must be one of {tuple(_CONVERSIONS)}, got {conversion!r}")

    def best_on(o: np.ndarray) -> tuple[float, float]:
        return convert(o, np.asarray(rdp_fn(o), dtype=np.float64), d)

    return minimise_over_orders(best_on, orders, **extension)


def optimal_epsilon(
    rdp_fn: Callable[[np.ndarray], np.ndarray],
    rounds: float,
    delta: float,
    max_order: int = DEFAULT_MAX_ORDER,
    order_cap: int = DEFAULT_ORDER_CAP,
    conversion: str = "optimal",
) -> tuple[float, float]:
    """(eps, lam*) of ``rounds`` identical adaptive rounds with per-round RDP ``rdp_fn(orders)`` (integer orders).

    RDP composes additively (Mironov 2017 Prop. 1). The grid starts at ``integer_orders(max_order)`` and is
    doubled while the optimum sits at its top order (spec 001 section 8), up to ``order_cap``.
    """
    t = float(rounds)
    return extended_rdp_to_dp(
        lambda o: t * np.asarray(rdp_fn(o), dtype=np.float64),
        integer_orders(max_order),
        delta,
        conversion=conversion,
        order_cap=order_cap,
        integer=True,
    )


def subsampled_wor_rdp(
    base_rdp: Callable[[np.ndarray], np.ndarray], q: float, orders: Sequence[int] | np.ndarray
) -> np.ndarray:
    """RDP at integer orders >= 2 of ANY mechanism with RDP curve ``base_rdp`` (an upper bound, at integer orders)
    run on a uniform subset of a fraction q = m/n of the records drawn without replacement, replace-one
    neighbours: Wang, Balle & Kasiviswanathan 2019, Thm 9 with eps(inf) = inf (the min{2, .} factors are 2):

        (alpha - 1) eps'(alpha) <= log(1 + q^2 C(alpha,2) min{4 (e^eps(2) - 1), 2 e^eps(2)}
                                       + sum_{j=3}^alpha 2 q^j C(alpha,j) e^{(j-1) eps(j)})

    Every term grows with eps(j), so an upper bound on the base curve gives an upper bound here (unlike their
    Thm 27 / dp_accounting's forward differences, which need the Gaussian's exact moments). Summed in log space."""
    from scipy.special import gammaln, logsumexp  # at first use: keeps this module's import light

    o = np.asarray(orders)
    if o.size == 0 or np.any(o < 2) or np.any(o != np.floor(o)):
        raise ValueError("subsampled_wor_rdp needs integer orders >= 2")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"the sampling fraction q must lie in [0, 1], got {q!r}")
    top = int(o.max())
    js = np.arange(2, top + 1)
    eps_j = np.asarray(base_rdp(js.astype(np.float64)), dtype=np.float64)
    if q == 0.0:
        return np.zeros(o.shape)
    log_q = math.log(q)
    e2 = float(eps_j[0])
    # log min{4 (e^e2 - 1), 2 e^e2}; log(4 (e^e2 - 1)) = log 4 + e2 + log1p(-e^-e2)
    log_t2 = min(math.log(4.0) + e2 + math.log1p(-math.exp(-e2)) if e2 > 0 else -math.inf, math.log(2.0) + e2)
    # term_j without the binomial: j = 2 as above, j >= 3: log 2 + (j - 1) eps(j); both times q^j
    log_terms = np.where(js == 2, log_t2, math.log(2.0) + (js - 1) * eps_j) + js * log_q
    out = np.empty(o.shape, dtype=np.float64)
    for i, a in enumerate(o.ravel().tolist()):
        a = int(a)
        j = js[: a - 1]
        log_binom = gammaln(a + 1) - gammaln(j + 1) - gammaln(a - j + 1)
        s = np.concatenate(([0.0], log_binom + log_terms[: a - 1]))  # the leading 1 = e^0
        out.flat[i] = float(logsumexp(s)) / (a - 1)
    return out
