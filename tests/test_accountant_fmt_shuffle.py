"""Tests of seed 001's baseline accountant: FMT20 shuffle bound, subsampling, KOV15, and the PLD option."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from _rr_reference import rr_count_pmf
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as dpa_pld
from scipy.stats import binom

from shuffledp.accountants.fmt_shuffle import (
    baseline_epsilon,
    fmt_closed_form,
    fmt_condition_holds,
    fmt_delta,
    fmt_epsilon,
    kov15_epsilon,
    subsample_dp,
    subsampled_fmt_pair,
    subsampled_fmt_pld,
    tight_pld_epsilon,
)
from shuffledp.accountants.subsampled_shuffle import subsampled_shuffle_epsilon


def printed_match(value: float, printed: str) -> bool:
    """value rounds to the printed digits of the spec (|err| <= half a unit of the last printed digit)."""
    mant = printed.split("e")[0]
    decimals = len(mant.split(".")[1]) if "." in mant else 0
    exp = int(printed.split("e")[1]) if "e" in printed else 0
    return abs(value - float(printed)) <= 0.5 * 10.0 ** (exp - decimals) * (1 + 1e-9)


# ---------------------------------------------------------------------------------- spec 001 section 6 values
def test_fmt_reference_values():
    # FMT20 eps_s at k = 1000, eps0 = 1, ds = 1e-6: closed form 0.56620, exact numeric 0.18241
    assert printed_match(fmt_epsilon(1.0, 1000, 1e-6, method="closed"), "0.56620")
    assert printed_match(fmt_epsilon(1.0, 1000, 1e-6, method="numerical"), "0.18241")
    # the numeric clone bound is valid for every eps0: k = 1000, eps0 = 3, ds = 1e-8 gives 1.68
    assert printed_match(fmt_epsilon(3.0, 1000, 1e-8), "1.68")


@pytest.mark.parametrize(
    "n,k,eps0,T,delta,ref",
    [
        (60_000, 10_000, 1.0, 600, 1e-5, "1.282"),
        (100_000, 1_000, 3.0, 10_000, 1e-5, "23.93"),
        (1_000_000, 1_000, 1.0, 100_000, 1e-6, "0.419"),
    ],
)
def test_baseline_reference_values(n, k, eps0, T, delta, ref):
    assert printed_match(baseline_epsilon(eps0, n, k, T, delta), ref)


def test_closed_form_by_hand_and_condition():
    # k = 1000, eps0 = 1, ds = 1e-6: tanh(1/2) * (8 sqrt(e log(4e6)/1000) + 8e/1000), then log1p
    by_hand = math.log1p(math.tanh(0.5) * (8 * math.sqrt(math.e * math.log(4e6) / 1000) + 8 * math.e / 1000))
    assert fmt_closed_form(1.0, 1000, 1e-6) == pytest.approx(by_hand, rel=1e-12)
    # condition (8): eps0 <= log(k / (16 log(2/ds))); k = 1000, ds = 1e-6 -> log(1000/(16*14.5087)) = 1.4577
    assert fmt_condition_holds(1.45, 1000, 1e-6) and not fmt_condition_holds(1.47, 1000, 1e-6)
    assert fmt_epsilon(3.0, 1000, 1e-8, method="closed") == 3.0  # fails (8): (eps0, 0) as the paper
    assert fmt_epsilon(3.0, 1000, 1e-8, method="numerical", paper_conditions=True) == 3.0
    assert fmt_epsilon(3.0, 1000, 1e-8, method="numerical") < 3.0


# ------------------------------------------------------------------------------ numeric clone bound: exactness
def _fmt_pq_bruteforce(eps0: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FMT20 (P, Q) enumerated over (c, j), O(k^2): C ~ Bin(k-1, e^-eps0), A|C ~ Bin(C, 1/2), j = first-type
    count; P = alpha (A+1) + (1-alpha) A, Q = alpha A + (1-alpha)(A+1)."""
    alpha = math.exp(eps0) / (1 + math.exp(eps0))
    ps, qs = [], []
    for c in range(k):
        pc = binom.pmf(c, k - 1, math.exp(-eps0))
        b = binom.pmf(np.arange(c + 1), c, 0.5)
        b_shift = np.concatenate([[0.0], b])  # Pr[A + 1 = j]
        b_same = np.concatenate([b, [0.0]])  # Pr[A = j]
        ps.append(pc * (alpha * b_shift + (1 - alpha) * b_same))
        qs.append(pc * (alpha * b_same + (1 - alpha) * b_shift))
    return np.concatenate(ps), np.concatenate(qs)


@pytest.mark.parametrize("eps0,k", [(1.0, 60), (3.0, 200), (0.3, 30)])
def test_numeric_hockey_stick_matches_bruteforce(eps0, k):
    p, q = _fmt_pq_bruteforce(eps0, k)
    for eps in (0.0, 0.05, 0.2, 0.5, eps0 * 0.9):
        exact = np.maximum(p - math.exp(eps) * q, 0).sum()
        assert fmt_delta(eps, eps0, k) == pytest.approx(exact, rel=1e-9, abs=1e-15)
        assert np.maximum(q - math.exp(eps) * p, 0).sum() == pytest.approx(exact, rel=1e-9, abs=1e-15)  # symmetric
    assert fmt_delta(eps0, eps0, k) <= 1e-16  # ratio never exceeds e^eps0: only the (safe) window tail remains


def test_numeric_epsilon_is_tight_and_safe():
    for eps0, k, ds in [(1.0, 1000, 1e-6), (2.0, 10_000, 1e-9), (0.5, 100, 1e-3)]:
        e = fmt_epsilon(eps0, k, ds)
        assert fmt_delta(e, eps0, k) <= ds < fmt_delta(max(0.0, e - 1e-7), eps0, k)
        assert e <= fmt_epsilon(eps0, k, ds, method="closed")  # the numeric bound is tighter
        assert 0.0 <= e <= eps0


def test_fmt_monotone():
    es = [fmt_epsilon(x, 1000, 1e-6) for x in (0.25, 0.5, 1.0, 2.0, 4.0)]
    assert all(b > a for a, b in zip(es, es[1:], strict=False))
    ks = [fmt_epsilon(1.0, k, 1e-6) for k in (100, 1000, 10_000, 100_000)]
    assert all(b < a for a, b in zip(ks, ks[1:], strict=False))
    ds = [fmt_epsilon(1.0, 1000, d) for d in (1e-10, 1e-8, 1e-6, 1e-4)]
    assert all(b < a for a, b in zip(ds, ds[1:], strict=False))


def test_pld_of_fmt_pair_brackets_exact_hockey_stick():
    # dp_accounting's privacy-buckets PLD of the explicit (P, Q) pmfs: optimistic <= exact <= pessimistic
    eps0, k = 1.0, 80
    p, q = _fmt_pq_bruteforce(eps0, k)
    lp = {i: math.log(v) for i, v in enumerate(p) if v > 0}
    lq = {i: math.log(v) for i, v in enumerate(q) if v > 0}
    pess = dpa_pld.from_two_probability_mass_functions(lq, lp, pessimistic_estimate=True)
    opt = dpa_pld.from_two_probability_mass_functions(lq, lp, pessimistic_estimate=False)
    for eps in (0.05, 0.2, 0.5):
        mine = fmt_delta(eps, eps0, k)
        assert opt.get_delta_for_epsilon(eps) <= mine * (1 + 1e-9) + 1e-15
        assert mine <= pess.get_delta_for_epsilon(eps) * (1 + 1e-9) + 1e-15


# ------------------------------------------------------------------------------- subsampling and composition
def test_subsampling_and_kov15_by_hand():
    assert subsample_dp(1.0, 1e-6, 0.1) == pytest.approx((math.log(1 + 0.1 * (math.e - 1)), 1e-7), rel=1e-12)
    # eps = 0.1, T = 100, d' = 1e-5: third term 100*0.1*tanh(0.05) + 0.1*sqrt(200*log(1e5)) = 5.29814...
    t3 = 10 * math.tanh(0.05) + 0.1 * math.sqrt(200 * math.log(1e5))
    t2 = 10 * math.tanh(0.05) + 0.1 * math.sqrt(200 * math.log(math.e + 1.0 / 1e-5))
    assert kov15_epsilon(0.1, 100, 1e-5) == pytest.approx(min(10.0, t2, t3), rel=1e-12)
    assert 5.29 < kov15_epsilon(0.1, 100, 1e-5) < 5.31
    assert kov15_epsilon(0.5, 1, 1e-5) == 0.5  # one round: T eps wins


def test_baseline_monotone_and_nonnegative():
    b = lambda **kw: baseline_epsilon(**{**dict(eps0=1.0, n=60_000, k=10_000, T=600, delta=1e-5), **kw})  # noqa: E731
    ts = [b(T=t) for t in (1, 10, 100, 1000, 10_000)]
    assert all(y > x for x, y in zip(ts, ts[1:], strict=False)) and ts[0] >= 0
    es = [b(eps0=x) for x in (0.5, 1.0, 2.0, 4.0)]
    assert all(y > x for x, y in zip(es, es[1:], strict=False))
    ns = [b(n=x) for x in (20_000, 60_000, 600_000)]
    assert all(y < x for x, y in zip(ns, ns[1:], strict=False))
    # closed-form FMT / paper fallback never beats the numerical baseline
    assert b(method="closed") >= b()
    assert b(eps0=3.0, k=1000, n=100_000, paper_conditions=True) >= b(eps0=3.0, k=1000, n=100_000)


# ------------------------------------------------------------------------------------- tight PLD option


def _pair_arrays(eps0: float, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = subsampled_fmt_pair(eps0, n, k)
    keys = list(x)
    return np.array([x[o] for o in keys]), np.array([y[o] for o in keys])


@pytest.mark.parametrize("n,k,eps0", [(20, 5, 1.0), (30, 10, 2.0), (12, 12, 0.5), (40, 8, 3.0), (25, 20, 1.5)])
def test_subsampled_pair_dominates_exact_2rr(n, k, eps0):
    # post-processing dominance => H_E(M(D)||M(D')) <= H_E(X||Y) for every E >= 0 and both orders of (D, D')
    xx, yy = _pair_arrays(eps0, n, k)
    assert xx.sum() == pytest.approx(1.0, abs=1e-12) and yy.sum() == pytest.approx(1.0, abs=1e-12)
    pmfs = [rr_count_pmf(n, t, k, eps0) for t in range(n + 1)]
    for big_e in (0.3, 0.7, 1.0, math.exp(0.05), math.exp(0.3), math.exp(1.0)):
        bound = np.maximum(xx - big_e * yy, 0).sum()
        for t in range(n):
            for a, b in ((pmfs[t], pmfs[t + 1]), (pmfs[t + 1], pmfs[t])):
                assert np.maximum(a - big_e * b, 0).sum() <= bound + 1e-13


def test_subsampled_pair_reduces_to_fmt_when_gamma_is_one():
    p, q = _fmt_pq_bruteforce(1.0, 40)
    xx, yy = _pair_arrays(1.0, 40, 40)
    for eps in (0.0, 0.1, 0.4):
        e = math.exp(eps)
        assert np.maximum(xx - e * yy, 0).sum() == pytest.approx(np.maximum(p - e * q, 0).sum(), rel=1e-10)


def test_pld_matches_dp_accounting_connect_the_dots():
    # dp_accounting's own connect-the-dots PMF built from the exact hockey-stick curve on the grid must equal our
    # atom-splitting PLD (both preserve the hockey-stick divergence at the grid points), also after composition.
    n, k, eps0, h = 30, 10, 2.0, 1e-3
    xx, yy = _pair_arrays(eps0, n, k)
    loss = np.log(xx) - np.log(yy)
    lo, hi = math.floor(loss.min() / h), math.ceil(loss.max() / h)
    grid = np.arange(lo, hi + 1) * h
    deltas = np.array([np.maximum(xx - math.exp(e) * yy, 0).sum() for e in grid])
    ref = dpa_pld.PrivacyLossDistribution(pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(h, lo, hi, deltas))
    mine = subsampled_fmt_pld(eps0, n, k, h)
    probe = [0.0, 0.01, 0.05, 0.1, 0.2]
    for e, d in zip(grid[grid >= 0][:50:7], deltas[grid >= 0][:50:7], strict=True):
        assert mine.get_delta_for_epsilon(float(e)) == pytest.approx(d, rel=1e-6, abs=1e-14)
    for T in (1, 5):
        a = np.asarray(mine.self_compose(T).get_delta_for_epsilon(probe))
        b = np.asarray(ref.self_compose(T).get_delta_for_epsilon(probe))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-14)


def test_pld_bracketed_by_dp_accounting_privacy_buckets():
    # PLD composition cross-check: dp_accounting's from_two_probability_mass_functions on the explicit pmfs,
    # optimistic <= ours <= pessimistic (fine grid) after 20 compositions
    n, k, eps0 = 30, 10, 2.0
    x, y = subsampled_fmt_pair(eps0, n, k)
    lx = {o: math.log(v) for o, v in x.items() if v > 0}
    ly = {o: math.log(v) for o, v in y.items() if v > 0}
    kw = dict(value_discretization_interval=1e-4)
    pess = dpa_pld.from_two_probability_mass_functions(ly, lx, pessimistic_estimate=True, **kw).self_compose(20)
    opt = dpa_pld.from_two_probability_mass_functions(ly, lx, pessimistic_estimate=False, **kw).self_compose(20)
    mine = subsampled_fmt_pld(eps0, n, k, 1e-4).self_compose(20)
    for eps in (0.5, 1.0, 2.0):
        d = mine.get_delta_for_epsilon(eps)
        assert opt.get_delta_for_epsilon(eps) <= d * (1 + 1e-9) and d <= pess.get_delta_for_epsilon(eps) * (1 + 1e-9)


def test_tight_equals_fmt_numeric_for_one_unsampled_round():
    # gamma = 1, T = 1: the pair is FMT's (P, Q); pessimistic PLD eps lies within one grid step above the exact
    for eps0, k, ds in [(1.0, 1000, 1e-6), (3.0, 1000, 1e-8)]:
        exact = fmt_epsilon(eps0, k, ds)
        h = 1e-4
        t = tight_pld_epsilon(eps0, k, k, 1, ds, value_discretization_interval=h)
        assert exact - 1e-9 <= t <= exact + h


def test_tight_reference_rows_and_monotone():
    rows = [
        (60_000, 10_000, 1.0, 600, 1e-5),
        (100_000, 1_000, 3.0, 10_000, 1e-5),
        (1_000_000, 1_000, 1.0, 100_000, 1e-6),
    ]
    for n, k, eps0, T, delta in rows:
        t = tight_pld_epsilon(eps0, n, k, T, delta)
        assert 0 < t < baseline_epsilon(eps0, n, k, T, delta)
        assert t < subsampled_shuffle_epsilon(eps0, n, k, T, delta)  # Thm 1 is loose (spec 001 s6)
    ts = [tight_pld_epsilon(1.0, 100_000, 1_000, t, 1e-6) for t in (1, 10, 100, 1_000)]
    assert all(b > a for a, b in zip(ts, ts[1:], strict=False))
    es = [tight_pld_epsilon(e, 100_000, 1_000, 100, 1e-6) for e in (0.5, 1.0, 2.0)]
    assert all(b > a for a, b in zip(es, es[1:], strict=False))


def test_extremes_no_overflow():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            for eps0, k, ds in [(1.0, 10**6, 1e-10), (10.0, 1000, 1e-6), (1e-3, 100, 1e-6), (1.0, 1, 1e-6)]:
                e = fmt_epsilon(eps0, k, ds)
                assert math.isfinite(e) and 0.0 <= e <= eps0
            b = baseline_epsilon(1.0, 10**7, 10**4, 10**6, 1e-6)
            assert math.isfinite(b) and b > 0
            # T = 1e6 rounds at n = 1e7 (a coarser grid than the default keeps this test under a second)
            t = tight_pld_epsilon(1.0, 10**7, 100, 10**6, 1e-6, value_discretization_interval=2e-7)
            assert math.isfinite(t) and t > 0


def test_bad_inputs_raise_value_error():
    good = dict(eps0=1.0, n=1_000, k=100, T=10, delta=1e-5)
    for fn in (baseline_epsilon, tight_pld_epsilon):
        for b in (
            dict(eps0=0.0),
            dict(eps0=-1.0),
            dict(k=1_001),
            dict(k=0),
            dict(delta=0.0),
            dict(delta=1.0),
            dict(delta=-1.0),
            dict(T=0),
        ):
            with pytest.raises(ValueError):
                fn(**{**good, **b})
    with pytest.raises(ValueError, match="method"):
        fmt_epsilon(1.0, 100, 1e-6, method="magic")
    with pytest.raises(ValueError, match="delta"):
        fmt_epsilon(1.0, 100, 1.5)
    with pytest.raises(ValueError, match="eps0"):
        fmt_epsilon(0.0, 100, 1e-6)
    with pytest.raises(ValueError, match="gamma"):
        subsample_dp(1.0, 1e-6, 0.0)
    with pytest.raises(ValueError, match="T"):
        kov15_epsilon(1.0, 0, 1e-6)
