"""PLD-tight calibrated PVEC (shuffledp.accountants.pvec_pld; issue 16 item 2, beyond paper 000, spec 000 sec 8).

Every exact reference here enumerates outputs independently of the module: the hockey-stick divergence of the
product of shifted Bin(N, 1/2) over *all* feasible sorted gap vectors (as tests/test_calibrated_pvec.py), both
directions. "Never below exact" is checked as exact_delta(eps_pld) <= delta (eps_pld >= the exact eps), "tight" as
exact_delta(eps_pld * (1 - slack)) > delta (the exact eps exceeds eps_pld (1 - slack)).
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import binom

from shuffledp.accountants import calibrated_pvec as cal
from shuffledp.accountants import pvec_pld as pp
from shuffledp.accountants.pvec import binomial_hockey_stick
from shuffledp.mechanisms.pvec import PvecParams


# ----------------------------------------------------------------------- independent exact references
def _params(d: int, n: int, g: int, m: int, p: float = 0.5) -> PvecParams:
    return PvecParams(d=d, n=n, delta2=1.0, g=g, m=m, p=p, eps=1.0, delta=1e-3, method="calibrated")


def _feasible(g: int, d: int) -> list[tuple[int, ...]]:
    """All sorted non-negative gap vectors of the accountant's set A (not only the maximal ones)."""
    return [
        v
        for v in itertools.combinations_with_replacement(range(g + 1), d)
        if max(v) > 0 and sum(max(a - 1, 0) ** 2 for a in v) <= g * g
    ]


def _product_delta(N: int, gaps: tuple[int, ...], eps: float) -> float:
    """Exact hockey-stick of prod_j (a_j + Bin(N, 1/2)) vs prod_j Bin(N, 1/2), both directions, by enumeration."""
    k = np.arange(0, N + max(gaps) + 1)
    q1 = binom.pmf(k, N, 0.5)
    ps = [binom.pmf(k - a, N, 0.5) for a in gaps]
    out = 0.0
    for A, B in ((ps, [q1] * len(gaps)), ([q1] * len(gaps), ps)):
        pa, qb = A[0], B[0]
        for j in range(1, len(gaps)):
            pa, qb = np.multiply.outer(pa, A[j]), np.multiply.outer(qb, B[j])
        out = max(out, float(np.sum(np.maximum(pa - math.exp(eps) * qb, 0.0))))
    return out


def _maximal(g: int, d: int) -> set[tuple[int, ...]]:
    """Feasible vectors none of whose coordinates can be raised by one within A (brute force)."""
    feas = set(_feasible(g, d))
    return {
        v
        for v in feas
        if all(v[j] == g or tuple(sorted(v[:j] + (v[j] + 1,) + v[j + 1 :])) not in feas for j in range(d))
    }


def _worst_delta(N: int, g: int, d: int, eps: float, rounds: int = 1) -> float:
    """Worst exact delta over all feasible gap vectors (rounds = 1), or over every sequence of maximal ones in
    ``rounds`` rounds (non-adaptive: a lower bound on the adaptive truth, so the accountant must be above it;
    maximal suffices by the monotonicity of step 3 of the module docstring, to keep the enumeration small)."""
    vecs = _feasible(g, d) if rounds == 1 else sorted(_maximal(g, d))
    return max(_product_delta(N, sum(seq, ()), eps) for seq in itertools.combinations_with_replacement(vecs, rounds))


# ------------------------------------------------------------------------------------------ gap vectors
@pytest.mark.parametrize("g,d", [(4, 1), (3, 2), (6, 2), (4, 3), (5, 3), (3, 4)])
def test_maximal_gap_vectors_match_brute_force(g, d):
    assert set(pp.maximal_gap_vectors(g, d)) == _maximal(g, d)
    assert pp.maximal_gap_vectors(g, d, limit=0) is None


# ------------------------------------------------------------------------- exhaustive route vs exact
@pytest.mark.parametrize(
    "d,g,N,delta",
    [(1, 4, 100, 1e-3), (2, 3, 100, 1e-3), (2, 6, 60, 1e-3), (3, 2, 120, 1e-4), (3, 4, 60, 1e-3)],
)
def test_exhaustive_route_never_below_exact_and_tight(d, g, N, delta):
    pr = _params(d, 10, g, N // 10)
    assert pp.pld_route(pr, 10) == "exhaustive"
    e = pp.pld_epsilon(pr, 10, 1, delta)
    assert _worst_delta(N, g, d, e) <= delta * (1 + 1e-9)  # never below the exact eps
    assert _worst_delta(N, g, d, e * (1 - 1e-3)) > delta  # within 0.1% of it (grid 1e-4, Connect-the-Dots)


@pytest.mark.parametrize("d,g,N,rounds", [(1, 4, 100, 2), (1, 4, 100, 3), (2, 6, 30, 2)])
def test_exhaustive_route_rounds_never_below_exact(d, g, N, rounds):
    # (2, 6): two maximal vectors (4, 6) and (5, 5), so the round's PLD is the Connect-the-Dots envelope
    pr = _params(d, 10, g, N // 10)
    e = pp.pld_epsilon(pr, 10, rounds, 1e-3)
    assert _worst_delta(N, g, d, e, rounds) <= 1e-3 * (1 + 1e-9)
    assert _worst_delta(N, g, d, e * (1 - 2e-3), rounds) > 1e-3


# --------------------------------------------------------------------------- gaussian route vs exact
def test_unit_gdp_is_tight_for_large_trials():
    # mu_M^2 M / 4 -> 1 (the Gaussian limit 2/sqrt(M)); >= the exact conditioned pair's value, checked by the
    # route tests below; here tightness
    assert 1.0 < pp.unit_gdp_mu2(1000) * 1000 / 4 < 1.06
    assert 1.0 < pp.unit_gdp_mu2(10**5) * 10**5 / 4 < 1.001
    assert 1.0 < pp.unit_gdp_mu2(10**8) * 10**8 / 4 < 1.0001
    with pytest.raises(ValueError, match="too few"):
        pp.unit_gdp_mu2(40)


@pytest.mark.parametrize("g,N,delta", [(8, 30000, 1e-6), (16, 20000, 1e-6), (4, 8000, 1e-5)])
def test_gaussian_route_never_below_exact_d1(g, N, delta):
    # d = 1: the worst gap is a = g (step 3), whose exact hockey-stick is binomial_hockey_stick (both directions)
    pr = _params(1, 10, g, N // 10)
    e = pp.pld_epsilon(pr, 10, 1, delta, route="gaussian")
    assert binomial_hockey_stick(N, 0.5, g, e) <= delta
    assert binomial_hockey_stick(N, 0.5, g, e * (1 - 0.03)) > delta  # within 3% (windows' edges, small M)
    assert e < cal.composed_epsilon([(pr, 10)], delta)  # tighter than the RDP route


def test_gaussian_route_never_below_exact_d2():
    N, g, d, delta = 2100, 2, 2, 1e-5  # N / g >= GAUSS_MIN_M
    pr = _params(d, 10, g, N // 10)
    e = pp.pld_epsilon(pr, 10, 1, delta, route="gaussian")
    assert _worst_delta(N, g, d, e) <= delta
    assert _worst_delta(N, g, d, e * (1 - 0.03)) > delta


# --------------------------------------------------------------------------------------- PLD vs RDP
@pytest.mark.parametrize(
    "d,n,g,m,rounds,route",
    [
        (1, 10, 4, 10, 1, "exhaustive"),
        (3, 10, 4, 15, 2, "exhaustive"),
        (2, 40, 91, 3500, 1, "gaussian"),
        (2, 40, 91, 350000, 100, "gaussian"),
        (100, 1000, 640, 35000, 1, "gaussian"),
    ],
)
def test_pld_tighter_than_rdp(d, n, g, m, rounds, route):
    pr = _params(d, n, g, m)
    assert pp.pld_route(pr, n) == route
    e_pld = pp.pld_epsilon(pr, n, rounds, 1e-5)
    e_rdp = cal.composed_epsilon([(pr, n, rounds)], 1e-5)
    assert 0.0 < e_pld < e_rdp


# ------------------------------------------------------------------------------------------ calibration
@pytest.mark.parametrize(
    "eps,delta,n,d,g,rounds",
    [(2.0, 1e-5, 40, 2, None, 1), (2.0, 1e-5, 40, 2, None, 100), (4.0, 1e-3, 10, 1, 4, 1), (3.0, 1e-3, 10, 2, 3, 1)],
)
def test_calibrated_meets_target_with_no_more_noise_than_rdp(eps, delta, n, d, g, rounds):
    pr = pp.calibrate_pvec_pld(eps, delta, n, d, 1.0, g=g, rounds=rounds)
    rdp = cal.calibrate_pvec(eps, delta, n, d, 1.0, g=g, rounds=rounds)
    assert pr.method == "calibrated" and pr.p == 0.5 and pr.g == rdp.g and (pr.eps, pr.delta) == (eps, delta)
    assert pp.pld_route(pr, n) != "rdp"
    assert pp.pld_epsilon(pr, n, rounds, delta) <= eps
    assert pr.m < rdp.m
    # minimal to a relative 1e-3 (or one trial): a clearly smaller m fails the target
    smaller = max(1, min(pr.m - 1, int(pr.m * (1 - 2e-3))))
    if smaller * n >= pr.g:
        assert pp.pld_epsilon(_params(d, n, pr.g, smaller), n, rounds, delta) > eps


@pytest.mark.parametrize("eps,delta,n,d,g", [(4.0, 1e-3, 10, 1, 4), (3.0, 1e-3, 10, 2, 3)])
def test_calibrated_verified_by_exhaustive_exact_computation(eps, delta, n, d, g):
    pr = pp.calibrate_pvec_pld(eps, delta, n, d, 1.0, g=g)
    assert _worst_delta(pr.m * n, g, d, eps) <= delta


def test_calibrated_gaussian_ratio():
    # acceptance (issue 16 item 2): within 1.05x the variance of the exactly calibrated Gaussian mechanism
    pr = pp.calibrate_pvec_pld(1.0, 1e-6, 1000, 100, 1.0)
    assert pp.pld_route(pr, 1000) == "gaussian"
    ratio = cal.noise_variance(pr) / cal.gaussian_variance(1.0, 1e-6, 1.0, method="exact")
    assert 1.0 < ratio <= 1.05


# --------------------------------------------------------------------------------------------- fallback
def test_fallback_to_rdp():
    pr = _params(2, 40, 91, 3500, p=0.3)  # p != 1/2: no mirror symmetry
    assert pp.pld_route(pr, 40) == "rdp"
    assert pp.pld_epsilon(pr, 40, 3, 1e-5) == cal.composed_epsilon([(pr, 40, 3)], 1e-5)
    # d = 5 > EXHAUSTIVE_MAX_D and m n / g < GAUSS_MIN_M at the Gaussian guess: calibrate_pvec's answer
    fb = pp.calibrate_pvec_pld(8.0, 1e-3, 10, 5, 1.0, g=8)
    assert pp.pld_route(fb, 10) == "rdp"
    assert fb == cal.calibrate_pvec(8.0, 1e-3, 10, 5, 1.0, g=8)


def test_bad_input():
    pr = _params(2, 40, 91, 3500)
    with pytest.raises(ValueError, match="route"):
        pp.pld_epsilon(pr, 40, 1, 1e-5, route="bogus")
    with pytest.raises(ValueError, match="round_pld"):
        pp.round_pld(pr, 40)  # g = 91 > EXHAUSTIVE_MAX_G
    with pytest.raises(ValueError, match="gaussian route"):
        pp.round_gdp(_params(1, 10, 4, 10), 10)  # N / g = 25 < GAUSS_MIN_M
    with pytest.raises(ValueError, match="n_contrib"):
        pp.pld_epsilon(pr, 41, 1, 1e-5)
    with pytest.raises(ValueError, match="eps"):
        pp.calibrate_pvec_pld(0.0, 1e-5, 10, 2, 1.0)
    with pytest.raises(ValueError, match="delta"):
        pp.pld_epsilon(pr, 40, 1, 1.5)


# ------------------------------------------- the ledger's accountant: PLD where a route covers every round
def _hetero_delta(rounds: list[tuple[int, tuple[int, ...]]], eps: float) -> float:
    """Exact hockey-stick, both directions, of rounds with their own trials N and gaps (d = 1 per round)."""
    dists = []
    for N, (a,) in rounds:
        k = np.arange(0, N + a + 1)
        dists.append((binom.pmf(k - a, N, 0.5), binom.pmf(k, N, 0.5)))
    out = 0.0
    for flip in (False, True):
        pa, qb = np.ones(1), np.ones(1)
        for p_, q_ in dists:
            p_, q_ = (q_, p_) if flip else (p_, q_)
            pa, qb = np.multiply.outer(pa, p_).ravel(), np.multiply.outer(qb, q_).ravel()
        out = max(out, float(np.sum(np.maximum(pa - math.exp(eps) * qb, 0.0))))
    return out


def test_heterogeneous_rounds_exhaustive_never_below_exact():
    # rounds with different contributors (different N = m n'), composed as the ledger does: d = 1, g = 4
    k1, k2 = (100, 0.5, 4, 1), (60, 0.5, 4, 1)
    e = pp.epsilon_of_rounds({k1: 1, k2: 2}, 1e-3)
    assert e < cal.epsilon_of_rounds({k1: 1, k2: 2}, 1e-3)  # the PLD bound, tighter than the RDP one
    exact = [(100, (4,)), (60, (4,)), (60, (4,))]
    assert _hetero_delta(exact, e) <= 1e-3 * (1 + 1e-9)
    assert _hetero_delta(exact, e * (1 - 2e-3)) > 1e-3


def test_heterogeneous_rounds_gaussian_is_gdp_sum_else_rdp():
    k1, k2 = (2 * 10**5, 0.5, 91, 2), (3 * 10**5, 0.5, 91, 2)
    got = pp.epsilon_of_rounds({k1: 2, k2: 3}, 1e-5)
    m1, s1 = pp._gauss_round(*k1[:1], 91, 2)
    m2, s2 = pp._gauss_round(*k2[:1], 91, 2)
    assert got == pp._gauss_eps(math.sqrt(2 * m1 + 3 * m2), 1e-5 - (2 * s1 + 3 * s2) * (1 + 1e-12))
    assert got < cal.epsilon_of_rounds({k1: 2, k2: 3}, 1e-5)
    # a round no PLD route covers (p != 1/2) makes the whole history the RDP bound
    mixed = {k1: 2, (2 * 10**5, 0.3, 91, 2): 1}
    assert pp.epsilon_of_rounds(mixed, 1e-5) == cal.epsilon_of_rounds(mixed, 1e-5)
    assert pp.epsilon_of_rounds({}, 1e-5) == 0.0
    pr = _params(2, 40, 91, 5000)
    assert pp.composed_epsilon([(pr, 40, 3)], 1e-5) == pp.pld_epsilon(pr, 40, 3, 1e-5)
    assert pp.composed_epsilon([(pr, 40, 3)], 1e-5, return_order=True)[1] is None  # no Renyi order: PLD


def test_exact_check_fails_on_an_optimistic_discretisation(monkeypatch):
    """The exhaustive verification above can fail: a Connect-the-Dots fed each grid point the hockey-stick of a
    point 50 steps further right (an optimistic discretisation: delta under-stated) yields an eps below the exact
    one, and the exact enumeration catches it."""
    from dp_accounting.pld import pld_pmf

    d, g, N, delta = 1, 4, 100, 1e-3
    pr = _params(d, 10, g, N // 10)
    honest = pp.pld_epsilon(pr, 10, 1, delta)
    original = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap

    def optimistic(vdi, lo, hi, deltas, *args, **kwargs):
        shifted = np.concatenate([np.asarray(deltas)[50:], np.zeros(50)])
        return original(vdi, lo, hi, shifted, *args, **kwargs)

    monkeypatch.setattr(pld_pmf, "create_pmf_pessimistic_connect_dots_fixed_gap", optimistic)
    pp._coord_pld.cache_clear()
    pp._exhaustive_round.cache_clear()
    try:
        cheat = pp.pld_epsilon(pr, 10, 1, delta)
    finally:
        pp._coord_pld.cache_clear()
        pp._exhaustive_round.cache_clear()
    assert cheat < honest
    assert _worst_delta(N, g, d, honest) <= delta * (1 + 1e-9)
    assert _worst_delta(N, g, d, cheat) > delta  # the exact check rejects the optimistic accountant


# ------------------------------------------------------------------------ planning speed (issue 24 B8)
@pytest.mark.parametrize("N, g, d", [(10**7, 91, 2), (10**8, 100, 4), (3 * 10**6, 120, 9)])
def test_gauss_round_grid_bounds_the_lp_over_every_gap(N, g, d):
    """The gaussian route's sparse grid (from sqrt of the spread up, dense around it) still bounds the LP
    relaxation computed from the exact u(a) = a mu^2(N // a) at every gap a = 1..g, and is tight to 1e-9."""
    pp._gauss_round.cache_clear()
    mu2, _ = pp._gauss_round(N, g, d)
    exact = {a: np.array([a * pp.unit_gdp_mu2(N // a)]) for a in range(1, g + 1)}
    U, _ = cal._interpolate(exact, N, g, 1)
    cost = np.maximum(np.arange(0, g + 1) - 1, 0).astype(np.float64) ** 2
    full = d * float(cal._hull_value(U, cost, g * g / d)[0][0])
    assert full <= mu2 <= full * (1.0 + 2e-9)


def test_interpolation_below_the_grid_is_an_upper_bound():
    """Gaps below the smallest grid point are bounded by a r(N // a_0) (r non-increasing in M): never below the
    exact a mu^2(N // a)."""
    N, a0 = 10**7, 8
    exact = {a0: np.array([a0 * pp.unit_gdp_mu2(N // a0)]), 20: np.array([20 * pp.unit_gdp_mu2(N // 20)])}
    U, _ = cal._interpolate(exact, N, 20, 1)
    for a in range(1, a0):
        assert U[0, a] >= a * pp.unit_gdp_mu2(N // a)


def test_calibration_refuses_noise_it_cannot_certify_quickly_and_names_the_smallest_eps(monkeypatch):
    """Below the smallest plannable eps the calibration refuses at once, naming it; at that eps it calibrates.
    (PLAN_MAX_N lowered so the accepted case is quick; the default size is checked over a real process below.)"""
    monkeypatch.setattr(pp, "PLAN_MAX_N", 10**8)
    n, d, rounds, delta = 1000, 10, 4, 1e-5
    g = cal.default_g(d, n)
    e_min = pp.smallest_plannable_eps(delta, n, d, g, rounds)
    with pytest.raises(ValueError, match=f"smallest eps that can work at this size is {e_min:.2g}$"):
        pp.calibrate_pvec_pld(e_min * 0.9, delta, n, d, 1.0, rounds=rounds)
    params = pp.calibrate_pvec_pld(e_min, delta, n, d, 1.0, rounds=rounds)
    assert params.m * n <= 10**8
    assert pp.composed_epsilon([(params, n, rounds)], delta) <= e_min


def test_planner_refuses_eps_001_at_the_default_size_within_seconds():
    """Issue 24 B8: eps = 0.01 in the embedded default run planned for over 2 minutes; now the plan is refused at
    once with the smallest eps that can work (the 20 s timeout includes the interpreter's imports)."""
    code = (
        "from shuffledp.config import DEFAULT_TOML, parse_config\n"
        "from shuffledp.data import load_dataset\n"
        "from shuffledp.models import make_model\n"
        "from shuffledp.planning import PlanError, plan_run\n"
        "cfg = parse_config(DEFAULT_TOML.replace('eps = 8.0', 'eps = 0.01'))\n"
        "ds = load_dataset(cfg.data, cfg.model.task)\n"
        "model = make_model('logreg', ds.num_features, ds.num_classes)\n"
        "try:\n"
        "    plan_run(cfg, 1348, 1348, model, ds.feature_norm_bound)\n"
        "except PlanError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert "eps=0.01" in proc.stdout
    e_min = float(proc.stdout.rsplit("smallest eps that can work at this size is ", 1)[1])
    assert 0.01 < e_min < 0.1  # eps = 0.1 plans at this size (benchmarks/bench_pvec_planning.py times it)
