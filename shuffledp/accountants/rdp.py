"""Generic Renyi-DP helpers: order grids, RDP -> (eps, delta) conversion, grid extension, envelopes.

Nothing here is specific to one mechanism; an accountant supplies its RDP curve as a function of the order.

- ``rdp_to_dp``: the optimal-in-practice conversion of Canonne-Kamath-Steinke 2020 (Prop. 12 of
  arXiv:2004.00010) / Balle et al. AISTATS 2020 (Thm 21), the paper's Lemma 1 / eq. (7) of seed 001 (spec 001
  section 4):  eps = min_lam [ rdp(lam) + log((lam-1)/lam) - (log delta + log lam)/(lam-1) ].
  It is the same bound as ``dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon`` (including its
  KL/Bretagnolle-Huber shortcut eps = 0 when delta >= sqrt(1 - exp(-rdp))), vectorised with numpy so that
  accountants can call it many times (inverse searches) on grids of thousands of orders.
- ``rdp_to_dp_mironov``: Mironov 2017 Prop. 3, eps = rdp + log(1/delta)/(lam-1) (looser; an option only).
- ``optimal_epsilon``: composes T identical rounds (RDP adds, Mironov 2017 Prop. 1) and converts, extending the
  order grid whenever the optimum sits at its upper edge (spec 001 section 8).
- ``monotone_envelope``: the Renyi divergence is non-decreasing in the order (van Erven & Harremoes 2014,
  Thm 3), so an upper bound U may be replaced by lam -> min_{lam' >= lam} U(lam') (spec 001 section 7.3 [ext]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

DEFAULT_MAX_ORDER = 512  # spec 001 section 6: integer orders 2..512
DEFAULT_ORDER_CAP = 1 << 14  # largest order the grid extension may reach (16384: covers orders up to 1e4)
_GEOMETRIC_RATIO = 1.02  # spacing of the (integer) orders above DEFAULT_MAX_ORDER


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
    eps is clipped at 0 from below (eps = 0 is then still a valid, larger, guarantee).
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
    return max(0.0, float(eps[i])), float(a[i])


def rdp_to_dp_mironov(
    orders: Sequence[float] | np.ndarray, rdp: Sequence[float] | np.ndarray, delta: float
) -> tuple[float, float]:
    """Mironov 2017 Prop. 3: eps = min_lam rdp(lam) + log(1/delta)/(lam - 1). Looser than ``rdp_to_dp``."""
    d = check_delta(delta)
    a, r = _as_curve(orders, rdp)
    eps = r - np.log(d) / (a - 1.0)
    i = int(np.argmin(eps))
    return max(0.0, float(eps[i])), float(a[i])


def monotone_envelope(rdp: Sequence[float] | np.ndarray) -> np.ndarray:
    """lam -> min over grid orders lam' >= lam of rdp(lam'); ``rdp`` must be sorted by increasing order.

    Valid for an upper bound of a Renyi-DP curve because D_lam is non-decreasing in lam (van Erven & Harremoes
    2014, Thm 3).
    """
    r = np.asarray(rdp, dtype=np.float64)
    return np.minimum.accumulate(r[::-1])[::-1]


def optimal_epsilon(
    rdp_fn: Callable[[np.ndarray], np.ndarray],
    rounds: float,
    delta: float,
    max_order: int = DEFAULT_MAX_ORDER,
    order_cap: int = DEFAULT_ORDER_CAP,
    conversion: str = "optimal",
) -> tuple[float, float]:
    """(eps, lam*) of ``rounds`` identical adaptive rounds with per-round RDP ``rdp_fn(orders)``.

    RDP composes additively (Mironov 2017 Prop. 1). The grid starts at ``integer_orders(max_order)`` and is
    doubled while the optimum sits at its top order (spec 001 section 8), up to ``order_cap``.
    """
    d = check_delta(delta)
    convert = {"optimal": rdp_to_dp, "mironov": rdp_to_dp_mironov}.get(conversion)
    if convert is None:
        raise ValueError(f"conversion must be 'optimal' or 'mironov', got {conversion!r}")
    top = int(max_order)
    while True:
        orders = integer_orders(top)
        eps, lam = convert(orders, float(rounds) * np.asarray(rdp_fn(orders), dtype=np.float64), d)
        if lam < orders[-1] or top >= order_cap:
            return eps, lam
        top = min(2 * top, int(order_cap))
