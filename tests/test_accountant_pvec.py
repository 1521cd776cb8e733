"""Paper accountants of seed 000 (P1D / PVEC) and the generic composition theorems (spec 000 sec 2, 3, 5, 7)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dpa_pld
from dp_accounting.pld.common import DifferentialPrivacyParameters
from scipy.stats import binom

from shuffledp.accountants import composition as comp
from shuffledp.accountants import pvec as acc
from shuffledp.mechanisms.pvec import p1d_params, pvec_params
from shuffledp.security.rng import make_rng


# ------------------------------------------------------------------------------------------ P1D (sec 7.3)
@pytest.fixture(scope="module")
def p1d():
    return p1d_params(1.0, 1e-3, 100)  # spec 000 sec 7.2: g=10, m=1369, p=0.49969


def test_p1d_exact_delta_at_claimed_eps(p1d):
    # spec 000 sec 7.3: exact delta at eps_claim = eps (2/g + 1) = 1.2 is "about 1e-111"
    assert p1d.g == 10 and p1d.m == 1369
    d = acc.p1d_exact_delta(p1d)
    assert 0.0 < d <= p1d.delta
    assert -112.0 < math.log10(d) < -110.0


def test_p1d_tight_epsilon(p1d):
    # spec 000 sec 7.3: tight eps at delta = 1e-3 is "about 0.093" against the claimed 1.2
    e = acc.p1d_tight_epsilon(p1d, 1e-3)
    assert abs(e - 0.093) < 0.0015
    assert acc.p1d_exact_delta(p1d, e) <= 1e-3 < acc.p1d_exact_delta(p1d, e * 0.99)


def test_hockey_stick_matches_direct_summation(p1d):
    # Independent check: sum_k (P(k) - e^eps Q(k))_+ over the whole support with scipy's pmf, both directions.
    M, p, t = p1d.m * p1d.n, p1d.p, p1d.g
    k = np.arange(0, M + t + 1)
    P = binom.pmf(k, M, p)
    Q = binom.pmf(k - t, M, p)
    for eps in (0.02, 0.05, 0.09):
        direct = max(np.sum(np.maximum(P - math.exp(eps) * Q, 0)), np.sum(np.maximum(Q - math.exp(eps) * P, 0)))
        assert acc.binomial_hockey_stick(M, p, t, eps) == pytest.approx(direct, rel=1e-6)


def test_hockey_stick_asymmetric_p_and_monotone():
    M, t = 400, 3
    k = np.arange(0, M + t + 1)
    P, Q = binom.pmf(k, M, 0.2), binom.pmf(k - t, M, 0.2)
    for eps in (0.1, 0.4):
        direct = max(np.sum(np.maximum(P - math.exp(eps) * Q, 0)), np.sum(np.maximum(Q - math.exp(eps) * P, 0)))
        assert acc.binomial_hockey_stick(M, 0.2, t, eps) == pytest.approx(direct, rel=1e-6)
    # more noise (larger M p) => smaller delta; larger shift => larger delta
    ds = [acc.binomial_hockey_stick(M, 0.5, 5, 0.3) for M in (100, 400, 1600)]
    assert ds[0] > ds[1] > ds[2] >= 0.0
    assert acc.binomial_hockey_stick(400, 0.5, 2, 0.3) < acc.binomial_hockey_stick(400, 0.5, 6, 0.3)


def test_hockey_stick_huge_counts_no_nan():
    # m up to 1e12 and n up to 1e7 (spec: numpy handles m ~ 1e12): no NaN / overflow
    for M in (10**12, 10**12 * 10**7):
        d = acc.binomial_hockey_stick(M, 0.5, 1000, 1e-3)
        assert 0.0 <= d <= 1.0 and math.isfinite(d)


def test_lemma31_instance_epsilon():
    assert acc.p1d_instance_epsilon(1.0, 10, 0.2, 0.7) == pytest.approx(1.0 * (0.2 + 0.5), rel=1e-12)
    assert acc.p1d_instance_epsilon(2.0, 4, 3.0, 1.0, Delta=4.0) == pytest.approx(2.0 * (0.5 + 0.5), rel=1e-12)
    with pytest.raises(ValueError, match="x_prime"):
        acc.p1d_instance_epsilon(1.0, 10, 0.2, 1.5)


def test_lemma_a1_binomial_mechanism():
    e, d = acc.binomial_mechanism(3, 10000, 0.5, 0.1, t=5)
    assert e == pytest.approx(3 * math.log(1.1 / 0.9), rel=1e-12)
    assert d == pytest.approx(2 * math.exp(-0.01 * 5000 / 10), rel=1e-12)
    # condition alpha M p >= 2t fails -> no guarantee
    assert acc.binomial_mechanism(3, 100, 0.5, 0.01, t=5) == (math.inf, 1.0)
    with pytest.raises(ValueError, match="p must"):
        acc.binomial_mechanism(1, 100, 0.7, 0.1)


def test_lemma33_formula():
    e = np.array([0.1, 0.2, 0.05])
    dl = np.array([1e-7, 2e-7, 0.0])
    eps, delta = acc.lemma33(e, dl, 1e-6)
    want = float(np.sum(e * (np.exp(e) - 1))) + 2 * math.sqrt(math.log(1e6) * float(np.sum(e**2)))
    assert eps == pytest.approx(want, rel=1e-12)
    assert delta == pytest.approx(3e-7 + 1e-6, rel=1e-12)


# -------------------------------------------------------------------------------------------- PVEC (sec 7.4)
@pytest.fixture(scope="module")
def pv():
    return pvec_params(1.0, 1e-6, 1000, 100, 1.0)


def test_pvec_random_neighbours_sum_of_squares_and_lemma33(pv):
    rng = make_rng(1234)
    for _ in range(50):
        x = rng.normal(size=pv.d)
        xp = rng.normal(size=pv.d) * rng.uniform(0.0, 3.0)
        x *= rng.uniform() / np.linalg.norm(x)
        xp *= min(1.0, 1.0 / np.linalg.norm(xp))
        ej = acc.pvec_coordinate_epsilons(pv, x, xp)
        assert float(np.sum(ej**2)) <= 9.0 * pv.eps_hat**2
        eps, delta = acc.lemma33(ej, np.full(pv.d, pv.delta_hat), pv.delta_hat)
        assert eps <= pv.eps and delta == pytest.approx(pv.delta, rel=1e-12)


def test_pvec_paper_round_at_nominal_n(pv):
    b = acc.pvec_paper_round(pv)
    assert b.alpha == pytest.approx(pv.eps_hat / (3 * pv.g), rel=1e-6)  # the proof's alpha at n' = n
    assert 0.0 < b.eps <= pv.eps
    assert b.eps_paper_chain <= pv.eps
    assert b.delta == pytest.approx(pv.delta, rel=1e-9)


def test_pvec_paper_round_fewer_contributors_cost_more(pv):
    eps = [acc.pvec_paper_round(pv, k).eps for k in (1000, 900, 500, 100)]
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False))
    # sqrt rule: eps_tilde scales like sqrt(n/n') (alpha small)
    b1, b4 = acc.pvec_paper_round(pv, 1000), acc.pvec_paper_round(pv, 250)
    assert b4.eps_tilde / b1.eps_tilde == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(ValueError, match="n_contrib"):
        acc.pvec_paper_round(pv, 1001)


def test_pvec_robust_claim_a8(pv):
    nominal, delta, b = acc.pvec_robust_round(pv, 0.5)
    assert nominal == pytest.approx(2.0 * pv.eps) and delta == pv.delta
    assert b.alpha == pytest.approx(pv.eps_hat / (3 * 0.5 * pv.g), rel=1e-9)
    assert b.delta <= pv.delta and 0 < b.eps <= nominal
    with pytest.raises(ValueError, match="honest fraction"):
        acc.pvec_robust_round(pv, 0.2)


def test_pvec_large_n_no_nan():
    pv = pvec_params(1.0, 1e-6, 10**7, 100, 1.0)
    b = acc.pvec_paper_round(pv)
    assert math.isfinite(b.eps) and 0 < b.eps <= 1.0 and 0 < b.delta <= 1e-6 * (1 + 1e-9)


# ---------------------------------------------------------------------------------------------- composition
def test_pgd_total_reference():
    # spec 000 sec 5: eps=1, T=15, delta=1e-6 gives 0.557 (3 digits printed)
    e, d = comp.pgd_total(1.0, 1e-6, 15)
    assert abs(e - 0.557) < 5e-4
    assert d == pytest.approx(1e-6, rel=1e-12)
    er, dr = comp.pgd_round_budget(1.0, 1e-6, 15)
    assert er == pytest.approx(1.0 / (2 * math.sqrt(30 * math.log(1e6))), rel=1e-12)
    assert dr == pytest.approx(1e-6 / 16, rel=1e-12)
    # spec 000 sec 5's leading term eps/2 sqrt(ln((T+1)/delta)/ln(1/delta)) (its second term is approximate)
    assert e == pytest.approx(0.5 * math.sqrt(math.log(16e6) / math.log(1e6)), rel=2e-2)


def test_advanced_composition_formula():
    e, d = comp.advanced_composition(0.1, 1e-7, 50, 1e-6)
    assert e == pytest.approx(0.1 * math.sqrt(100 * math.log(1e6)) + 50 * 0.1 * math.expm1(0.1), rel=1e-12)
    assert d == pytest.approx(50e-7 + 1e-6, rel=1e-12)


def test_kov_matches_dp_accounting_pld_and_beats_advanced():
    eps, delta, k = 0.1, 1e-6, 100
    pld = dpa_pld.from_privacy_parameters(DifferentialPrivacyParameters(eps, delta)).self_compose(k)
    for eg in (0.5, 1.0, 1.5):
        exact = comp.kov_delta(eps, delta, k, eg)
        # dp_accounting's PLD is a pessimistic discretisation of the same dominating pair
        assert exact <= pld.get_delta_for_epsilon(eg) * (1 + 1e-9)
        assert exact == pytest.approx(pld.get_delta_for_epsilon(eg), rel=1e-6)
    e_kov = comp.kov_epsilon(eps, delta, k, 1e-3)
    e_adv, _ = comp.advanced_composition(eps, delta, k, 1e-3 - k * delta)
    assert e_kov < e_adv
    assert comp.kov_delta(eps, delta, k, e_kov) <= 1e-3
    # k = 1 is the (eps, delta) guarantee itself, plus the float margin (issue 43 item 7: never below it)
    assert 0.3 <= comp.kov_epsilon(0.3, 1e-5, 1, 1e-5) == pytest.approx(0.3, rel=3e-9)
    # large k stays finite (log space)
    assert math.isfinite(comp.kov_epsilon(0.01, 0.0, 100000, 1e-6))


def test_parallel_composition_is_max():
    assert comp.parallel_composition([(0.5, 1e-7), (1.0, 1e-8), (0.2, 1e-6)]) == (1.0, 1e-6)
    assert comp.parallel_composition([]) == (0.0, 0.0)


def test_max_rounds_inverse_queries():
    er, dr = comp.pgd_round_budget(1.0, 1e-6, 15)
    T = comp.max_rounds_advanced(er, dr, 1.0, 1e-6)
    assert T >= 15
    assert comp.advanced_composition(er, dr, T, 1e-6 - T * dr)[0] <= 1.0
    dp_next = 1e-6 - (T + 1) * dr
    assert dp_next <= 0 or comp.advanced_composition(er, dr, T + 1, dp_next)[0] > 1.0
    Tk = comp.max_rounds_kov(0.05, 0.0, 1.0, 1e-6)
    assert comp.kov_delta(0.05, 0.0, Tk, 1.0) <= 1e-6 < comp.kov_delta(0.05, 0.0, Tk + 1, 1.0)
    orders = np.arange(2, 200, dtype=float)
    Tr = comp.max_rounds_rdp(orders, orders / (2 * 50.0**2), 1.0, 1e-6)  # Gaussian sigma = 50
    assert Tr > 1


def test_bisect_boundary_returns_the_fitting_end():
    # the inverse queries' shared search: fits(x) <=> x >= sqrt(2) (least noise) or x <= sqrt(2) (largest eps0)
    b = math.sqrt(2.0)
    least = comp.bisect_boundary(lambda x: x >= b, 4.0, 0.5, rel_tol=1e-9, geometric=True)
    assert b <= least <= b * (1 + 1e-9)  # rounded up: never less noise than fits
    largest = comp.bisect_boundary(lambda x: x <= b, 0.0, 4.0, rel_tol=1e-6, abs_tol=1e-12)
    assert b * (1 - 1e-6) <= largest <= b  # rounded down
    assert comp.bisect_boundary(lambda x: x >= b, 4.0, 0.5, abs_tol=1e-3) - b <= 1e-3
    # the bracket cannot shrink below float resolution: stops there, still on the fitting side
    nxt = math.nextafter(b, math.inf)
    assert comp.bisect_boundary(lambda x: x >= nxt, nxt, b, rel_tol=0.0, geometric=True) == nxt


def test_composition_bad_input():
    with pytest.raises(ValueError, match="delta_prime"):
        comp.advanced_composition(0.1, 1e-7, 10, 0.0)
    with pytest.raises(ValueError, match="eps"):
        comp.kov_delta(-1.0, 0.0, 3, 1.0)
    with pytest.raises(ValueError, match="T must"):
        comp.pgd_round_budget(1.0, 1e-6, 0)
