"""Tree-aggregation accountant of seed 003 (DP-FTRL, Kairouz et al. ICML 2021).

The released object is the vector of all noisy tree nodes (each node = sum of its leaves + N(0, z^2 L^2)).
With leaf sensitivity L (zero-out adjacency, spec 003 A2) it is a Gaussian mechanism whose squared sensitivity
is zeta L^2, where

    zeta = max over neighbours of sum_{released nodes} (# occurrences of the record in the node)^2

(spec 003 section 3, "general rule"), so the whole run is (alpha, alpha zeta / (2 z^2))-RDP (Thm 3.1 is the
single-participation case zeta = depth). Everything here computes zeta for one participation pattern; the
(eps, delta) conversion is the Gaussian curve with rho^2 = zeta / z^2 from :mod:`shuffledp.accountants.gaussian`
(default: dp_accounting's optimal RDP -> DP conversion; ``orders=PAPER_ORDERS`` reproduces the paper's code).

Conventions (spec 003 section 0 and A1): ``depth(T) = floor(log2 T) + 1 = T.bit_length()``, the number of
complete dyadic nodes over [1..T] containing a given leaf. ``min_separation`` xi is the number of leaves strictly
between two participations (TF-Privacy's convention: steps x < y have y - x - 1 >= xi).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from dp_accounting import dp_event

from shuffledp.accountants.gaussian import (
    DEFAULT_ORDERS,
    PAPER_ORDERS,
    Method,
    _check_delta,
    _check_epsilon,
    _check_int,
    _check_positive,
    delta_for_rho,
    epsilon_for_rho,
    rho_for_epsilon,
)

__all__ = [
    "DEFAULT_ORDERS",
    "PAPER_ORDERS",
    "tree_depth",
    "zeta_single_tree",
    "zeta_restarts",
    "zeta_one_pass_across_trees",
    "zeta_multi_participation",
    "zeta_fixed_order",
    "zeta_fixed_order_restarts",
    "zeta_brute_force",
    "rdp",
    "epsilon",
    "delta",
    "min_noise_multiplier",
    "max_steps_single_tree",
    "theorem31_noise_multiplier",
    "dp_event_restarts",
]

# The dynamic program costs O(log T * E^2 * (xi+1)^3) operations; refuse configurations that would hang.
_MAX_DP_WORK = 2.0e10
_BLOCK_ELEMENTS = 4_000_000


def tree_depth(steps: int) -> int:
    """Number of complete dyadic nodes of [1..T] that contain a leaf: floor(log2 T) + 1 (spec 003 A1)."""
    return _check_int("steps (T)", steps, 1).bit_length()


def _next_pow2(steps: int) -> int:
    return 1 << (steps - 1).bit_length()


def zeta_single_tree(steps: int) -> int:
    """One participation in one tree of T leaves: zeta = depth(T) (Thm 3.1 with floor+1, spec 003 section 3)."""
    return tree_depth(steps)


def zeta_restarts(step_counts: Sequence[int], completion: bool = False) -> int:
    """Tree restarts, each record at most once per tree: zeta = sum_k depth(T_k) (spec 003 section 3).

    With tree completion every tree but the last is padded with virtual leaves to the next power of two, and
    the padded tree is what gets released, so it costs depth(next_pow2(T_k)) (spec 003 section 2/3).
    """
    counts = [_check_int("step_counts[k]", int(c) if isinstance(c, np.integer) else c, 1) for c in step_counts]
    if not counts:
        raise ValueError("step_counts must list at least one tree, got an empty sequence")
    total = 0
    for k, t in enumerate(counts):
        padded = _next_pow2(t) if completion and k < len(counts) - 1 else t
        total += tree_depth(padded)
    return total


def zeta_one_pass_across_trees(step_counts: Sequence[int]) -> int:
    """One pass split over several trees, each record at most once across ALL trees: zeta = max_k depth(T_k).

    The record touches one tree only (App. D; dp_accounting's SingleEpochTreeAggregationDpEvent).
    """
    counts = [_check_int("step_counts[k]", int(c) if isinstance(c, np.integer) else c, 1) for c in step_counts]
    if not counts:
        raise ValueError("step_counts must list at least one tree, got an empty sequence")
    return max(tree_depth(t) for t in counts)


# ------------------------------------------------------------------------------------ multi participation
def _segment_table(size: int, parts: int, sep: int) -> np.ndarray:
    """Worst-case sum of squared node counts inside one segment of the tree (spec 003 section 3, App. D.2).

    Returns V with V[k, s, e] = max over placements of k participations in ``size`` leaves of the sum over the
    complete dyadic nodes inside the segment of (count in node)^2, where the first participation lies at
    offset >= s (s leaves still blocked by an earlier participation) and the last one's trailing separation may
    extend at most e leaves past the segment: s + (sep+1) k <= size + e. Infeasible entries are -inf.
    """
    return _segment_table_cached(size, parts, sep)


@lru_cache(maxsize=4096)
def _segment_table_cached(size: int, parts: int, sep: int) -> np.ndarray:
    width = sep + 1
    k = np.arange(parts + 1)[:, None, None]
    s = np.arange(width)[None, :, None]
    e = np.arange(width)[None, None, :]
    feasible = s + width * k <= size + e
    if size == 1:
        # A single leaf is a node: it holds 0 or 1 participation (two would violate the separation).
        table = np.where(feasible & (k <= 1), k.astype(np.float64) ** 2, -np.inf)
    else:
        # Complete dyadic nodes over [1..size]: if size is a power of two the whole segment is a node and its two
        # halves are the children; otherwise [1..P] (P = largest power of two < size) and the rest are
        # independent, and the rest has the same node structure as a tree of size - P leaves.
        is_node = size & (size - 1) == 0
        left_size = size // 2 if is_node else 1 << (size.bit_length() - 1)
        left = _segment_table_cached(left_size, parts, sep)
        right = _segment_table_cached(size - left_size, parts, sep)
        table = np.full((parts + 1, width, width), -np.inf)
        # Block over the hand-over j so the broadcast temporary stays below ~32 MB for any separation.
        block = max(1, _BLOCK_ELEMENTS // (width * width))
        for total in range(parts + 1):
            for in_right in range(total + 1):
                # (max,+) product over the hand-over j: left ends with allowance j, right starts blocked by j.
                a, b = left[total - in_right], right[in_right]
                for j0 in range(0, width, block):
                    cand = (a[:, j0 : j0 + block, None] + b[None, j0 : j0 + block, :]).max(axis=1)
                    np.maximum(table[total], cand, out=table[total])
        if is_node:
            table = table + (np.arange(parts + 1, dtype=np.float64) ** 2)[:, None, None]
        table = np.where(feasible, table, -np.inf)
    table.setflags(write=False)
    return table


@lru_cache(maxsize=4096)
def _zeta_multi_cached(steps: int, parts: int, sep: int) -> int:
    if parts == 1:
        return tree_depth(steps)
    width = sep + 1
    work = max(1, steps.bit_length()) * 2 * (parts + 1) ** 2 * width**3
    if work > _MAX_DP_WORK:
        raise ValueError(
            f"min_separation={sep} with max_participations={parts} needs ~{work:.1e} operations in the dynamic "
            "program; use a smaller separation bound (a smaller xi is conservative) or restarts"
        )
    table = _segment_table(steps, parts, sep)
    # Top level: nothing blocked at the start; the last participation's separation may run past the end.
    best = float(np.max(table[1:, 0, sep]))
    return int(round(best))


def zeta_multi_participation(steps: int, max_participations: int, min_separation: int) -> int:
    """One tree, each record at most E times with >= xi leaves between appearances (spec 003 section 3).

    Exact worst case over participation patterns c (||c||_0 <= E, gaps >= xi) of sum over complete nodes of
    (sum of c in node)^2, by the dynamic program of App. D.2 (TF-Privacy's tree_aggregation_accountant
    computes the same quantity). Cached per (T, E, xi).
    """
    t = _check_int("steps (T)", steps, 1)
    e = _check_int("max_participations (E)", max_participations, 1)
    xi = _check_int("min_separation (xi)", min_separation, 0)
    # At most ceil(T / (xi+1)) participations fit; more cannot change the worst case.
    e = min(e, -(-t // (xi + 1)))
    return _zeta_multi_cached(t, e, xi)


def zeta_brute_force(steps: int, max_participations: int, min_separation: int) -> int:
    """Exhaustive reference for :func:`zeta_multi_participation` (small T only; used by the tests)."""
    t = _check_int("steps (T)", steps, 1)
    e = _check_int("max_participations (E)", max_participations, 1)
    xi = _check_int("min_separation (xi)", min_separation, 0)
    if t > 24:
        raise ValueError(f"brute force is exponential in T; steps must be <= 24, got {t}")
    nodes = [(lo, lo + (1 << h)) for h in range(t.bit_length()) for lo in range(0, t - (1 << h) + 1, 1 << h)]
    best = 0

    def rec(start: int, chosen: list[int]) -> None:
        nonlocal best
        if chosen:
            val = 0
            for lo, hi in nodes:
                c = sum(1 for p in chosen if lo <= p < hi)
                val += c * c
            best = max(best, val)
        if len(chosen) == e:
            return
        for p in range(start, t):
            chosen.append(p)
            rec(p + xi + 1, chosen)
            chosen.pop()

    rec(0, [])
    return best


# ---------------------------------------------------------------------------------------------- fixed order
@lru_cache(maxsize=1024)
def _fixed_order_per_batch(steps_per_epoch: int, epochs: int, extra_steps: int) -> np.ndarray:
    p = steps_per_epoch
    real = p * epochs
    total = real + extra_steps
    acc = np.zeros(p, dtype=np.float64)
    for h in range(total.bit_length()):
        size = 1 << h
        lo = np.arange(0, total - size + 1, size, dtype=np.int64)
        hi = np.minimum(lo + size, real)
        length = np.maximum(hi - lo, 0)
        lo = lo[length > 0]
        length = length[length > 0]
        # A node covering `length` consecutive real leaves holds batch b either q or q+1 times (q = length // P):
        # q+1 for the r = length % P batches starting at lo mod P (cyclically), q for the others.
        q = length // p
        r = length % p
        acc += float(np.sum(q.astype(np.float64) ** 2))
        start = lo % p
        bump = (2 * q + 1).astype(np.float64)  # (q+1)^2 - q^2
        diff = np.zeros(2 * p + 1, dtype=np.float64)
        np.add.at(diff, start, bump)
        np.add.at(diff, start + r, -bump)
        window = np.cumsum(diff)[: 2 * p]
        acc += window[:p] + window[p:]
    return acc


def zeta_fixed_order(steps_per_epoch: int, epochs: int, extra_steps: int = 0) -> int:
    """One tree over E epochs in the same batch order (+ virtual leaves): exact sum of count^2 (spec 003 sec. 3).

    Nodes longer than an epoch hold a record several times and cost count^2, so this exceeds E * depth.
    The worst batch position is returned. Virtual (completion) leaves hold no records but their nodes are
    released, so nodes mixing real and virtual leaves count.
    """
    p = _check_int("steps_per_epoch", steps_per_epoch, 1)
    e = _check_int("epochs", epochs, 1)
    x = _check_int("extra_steps", extra_steps, 0)
    return int(round(float(np.max(_fixed_order_per_batch(p, e, x)))))


def zeta_fixed_order_restarts(steps_per_epoch: int, epochs_between_restarts: Sequence[int], completion: bool) -> int:
    """Restart every few epochs; fixed order inside a tree, reshuffled at each restart (spec 003 section 6).

    The record's batch position may change at a restart, so the worst case per tree is added (sum of maxima).
    With completion each tree except the last is padded to the next power of two.
    """
    p = _check_int("steps_per_epoch", steps_per_epoch, 1)
    epochs = [_check_int("epochs_between_restarts[k]", int(k), 0) for k in epochs_between_restarts]
    if not any(epochs):
        raise ValueError(f"epochs_between_restarts must contain a positive entry, got {list(epochs_between_restarts)}")
    total = 0
    for k, e in enumerate(epochs):
        if e == 0:
            continue
        extra = _next_pow2(p * e) - p * e if completion and k < len(epochs) - 1 else 0
        total += zeta_fixed_order(p, e, extra)
    return total


# ------------------------------------------------------------------------------------------ conversions
def _rho(zeta: float, noise_multiplier: float) -> float:
    zeta = _check_positive("zeta", zeta)
    return math.sqrt(zeta) / _check_positive("noise_multiplier (z)", noise_multiplier)


def rdp(zeta: float, noise_multiplier: float, orders: Sequence[float] | None = None) -> np.ndarray:
    """RDP(alpha) = alpha zeta / (2 z^2) (spec 003 section 3, general rule; Thm 3.1 for zeta = depth)."""
    rho = _rho(zeta, noise_multiplier)
    return np.asarray(DEFAULT_ORDERS if orders is None else orders, dtype=np.float64) * rho * rho / 2.0


def epsilon(
    zeta: float,
    noise_multiplier: float,
    delta: float,
    method: Method = "rdp",
    orders: Sequence[float] | None = None,
) -> float:
    """eps for squared sensitivity zeta and node noise z*L. method="rdp" is the paper's conversion."""
    return epsilon_for_rho(_rho(zeta, noise_multiplier), delta, method, orders)


def delta(
    zeta: float,
    noise_multiplier: float,
    eps: float,
    method: Method = "rdp",
    orders: Sequence[float] | None = None,
) -> float:
    """delta for squared sensitivity zeta, node noise z*L and a target eps."""
    return delta_for_rho(_rho(zeta, noise_multiplier), eps, method, orders)


def min_noise_multiplier(
    zeta: float, eps: float, delta: float, method: Method = "rdp", orders: Sequence[float] | None = None
) -> float:
    """Smallest z with eps(zeta, z) <= eps: z = sqrt(zeta) / rho(eps, delta), rounded up."""
    zeta = _check_positive("zeta", zeta)
    z = math.sqrt(zeta) / rho_for_epsilon(eps, delta, method, orders)
    while epsilon_for_rho(math.sqrt(zeta) / z, delta, method, orders) > eps:
        z = math.nextafter(z, math.inf)
    return z


def max_steps_single_tree(
    noise_multiplier: float, eps: float, delta: float, method: Method = "rdp", orders: Sequence[float] | None = None
) -> int:
    """Largest T such that one participation in one tree of T leaves fits (eps, delta); 0 if none does.

    zeta = depth(T) is a step function, so the answer is 2^d - 1 for the largest affordable depth d.
    """
    z = _check_positive("noise_multiplier (z)", noise_multiplier)
    rho_max = rho_for_epsilon(eps, delta, method, orders)
    d = int(math.floor((rho_max * z) ** 2))
    while d > 0 and epsilon_for_rho(math.sqrt(d) / z, delta, method, orders) > eps:
        d -= 1
    while epsilon_for_rho(math.sqrt(d + 1) / z, delta, method, orders) <= eps:
        d += 1
    if d >= 1023:
        raise ValueError(f"noise_multiplier={z} affords depth {d}: more steps than any stream; no finite maximum")
    return (1 << d) - 1


def theorem31_noise_multiplier(steps: int, eps: float, delta: float, depth: int | None = None) -> float:
    """The paper's closed form z = sqrt(2 ceil(lg n) ln(1/delta)) / eps (Thm 3.1).

    Reproduces the paper only: it is NOT a valid calibration for large eps (spec 003 section 3 and A8). ``depth``
    overrides ceil(lg n) (e.g. tree_depth(n), the conservative choice of A1).
    """
    n = _check_int("steps (n)", steps, 2)
    e = _check_epsilon(eps)
    d = _check_delta(delta)
    lg = math.ceil(math.log2(n)) if depth is None else _check_int("depth", depth, 1)
    return math.sqrt(2.0 * lg * math.log(1.0 / d)) / e


def dp_event_restarts(noise_multiplier: float, steps_per_tree: int, trees: int) -> dp_event.DpEvent:
    """dp_accounting description of restarts (one participation per tree): SelfComposed(SingleEpochTree, k).

    dp_accounting 0.6.0 interprets it under NeighboringRelation.REPLACE_SPECIAL (zero-out), as spec 003 A2.
    """
    z = _check_positive("noise_multiplier (z)", noise_multiplier)
    t = _check_int("steps_per_tree", steps_per_tree, 1)
    k = _check_int("trees", trees, 1)
    return dp_event.SelfComposedDpEvent(dp_event.SingleEpochTreeAggregationDpEvent(z, t), k)
