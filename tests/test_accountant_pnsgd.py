"""Seed 004 accountant (shuffledp.accountants.pnsgd): spec 004 sections 3, 4, 6.1-6.3."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_mechanism

from shuffledp.accountants import pnsgd as p

# Appendix G settings (spec 004 section 4)
FIG_L, FIG_ETA, FIG_EPS = 10.0, 0.1, 1.0
ONLINE_L = p.OnlineConfig("laplace", 1.0, 10.0, 0.01, 1.0, 1.5, 100.0, 100.0)
ONLINE_G = ONLINE_L._replace(noise="gaussian")


def rel(digits: int) -> float:
    """Relative tolerance of a value printed with `digits` significant digits: half a unit in the last digit."""
    return 0.5 * 10.0 ** (1 - digits)


# ------------------------------------------------------------------------------------------------ theta
@pytest.mark.parametrize(("r", "eps", "ref"), [(1.0, 1.0, 0.12693674), (2.0, 1.0, 0.50986166), (1.0, 0.5, 0.23842171)])
def test_theta_reference_values(r: float, eps: float, ref: float) -> None:
    assert p.theta(r, eps) == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("r", [0.05, 0.3, 1.0, 2.0, 5.0, 12.0])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0, 3.0])
def test_theta_matches_dp_accounting_gaussian_privacy_loss(r: float, eps: float) -> None:
    # theta_{e^eps}(r) = E_{e^eps}(N(r,1)||N(0,1)) = the Gaussian mechanism's delta (sensitivity r, std 1)
    ref = privacy_loss_mechanism.GaussianPrivacyLoss(1.0, sensitivity=r).get_delta_for_epsilon(eps)
    if ref > 1e-300:
        assert p.theta(r, eps) == pytest.approx(ref, rel=1e-6)
    # and log(1 - theta) is consistent where both are representable
    if ref < 1 - 1e-9:
        assert math.exp(p.log_one_minus_theta(r, eps)) == pytest.approx(1 - ref, rel=1e-6)


@pytest.mark.parametrize("shift", [0.2, 1.0, 2.0, 7.0])
@pytest.mark.parametrize("eps", [0.0, 0.5, 1.0])
def test_laplace_terms_match_dp_accounting_laplace_privacy_loss(shift: float, eps: float) -> None:
    # A = (1 - e^{eps/2 - L/v})_+ = E_{e^eps}(Lap(2L, v)||Lap(0, v)); here v = 1, L = shift/2
    terms = p.laplace_terms(eps, shift / 2, 1.0, 1.0, 1.0)
    ref = privacy_loss_mechanism.LaplacePrivacyLoss(1.0, sensitivity=shift).get_delta_for_epsilon(eps)
    assert terms.a == pytest.approx(ref, rel=1e-9, abs=1e-15)


# ----------------------------------------------------------------------------------- unit test vectors
def test_tv1_gaussian() -> None:
    t = p.gaussian_terms(1.0, 1.0, 4.0, 0.5, 2.0)
    assert t.a == pytest.approx(6.829595e-3, rel=1e-6)
    assert t.b == pytest.approx(0.1269367, rel=1e-6)
    assert p.delta_shuffled("gaussian", 1.0, 1000, 1.0, 4.0, 0.5, 2.0) == pytest.approx(7.822566e-6, rel=1e-6)


def test_tv2_gaussian_no_amplification() -> None:
    t = p.gaussian_terms(1.0, 1.0, 1.0, 0.1, 1.0)
    assert t.b == pytest.approx(0.99999906, rel=1e-8)
    assert p.delta_from_terms(t, 1000) == pytest.approx(0.5096221, rel=1e-6)
    assert p.delta_randomly_stopped(t, 1000) == 1.0  # A/(n(1-B)) = 541.9 is vacuous (capped at 1)
    assert t.a / (1000 * math.exp(t.log_1mb)) == pytest.approx(541.9, rel=rel(4))


def test_tv3_strongly_convex() -> None:
    m = p.contraction_factor(0.2, 4.0, 1.0)
    assert m == pytest.approx(0.8246211, rel=1e-6)
    t = p.gaussian_terms(0.5, 1.0, 10.0, 0.2, 2.0, m)
    assert t.a == pytest.approx(5.125361e-4, rel=1e-6)
    assert t.b == pytest.approx(0.1688692, rel=1e-6)
    assert p.delta_shuffled("gaussian", 0.5, 10**4, 1.0, 10.0, 0.2, 2.0, m) == pytest.approx(6.166732e-8, rel=1e-6)


def test_tv4_laplace() -> None:
    t = p.laplace_terms(1.0, 1.0, 1.0, 0.5, 1.0)
    assert t.a == pytest.approx(0.3934693, rel=1e-6)
    assert t.b == pytest.approx(0.3934693, rel=1e-6)
    assert p.delta_shuffled("laplace", 1.0, 1000, 1.0, 1.0, 0.5, 1.0) == pytest.approx(6.487213e-4, rel=1e-6)


def test_calibration_reference() -> None:
    sigma = p.calibrate_scale("gaussian", 1e-5, 1.0, 10**4, 1.0, 0.1, 1.0)
    assert sigma == pytest.approx(3.28531, rel=rel(6))
    assert p.delta_shuffled("gaussian", 1.0, 10**4, 1.0, sigma, 0.1, 1.0) <= 1e-5
    assert p.delta_shuffled("gaussian", 1.0, 10**4, 1.0, sigma * (1 - 1e-8), 0.1, 1.0) > 1e-5
    v = p.calibrate_scale("laplace", 1e-3, 1.0, 1000, 1.0, 0.5, 1.0)
    assert (
        p.delta_shuffled("laplace", 1.0, 1000, 1.0, v, 0.5, 1.0)
        <= 1e-3
        < p.delta_shuffled("laplace", 1.0, 1000, 1.0, v * (1 - 1e-8), 0.5, 1.0)
    )


def test_epsilon_inverse() -> None:
    target = p.delta_shuffled("gaussian", 1.0, 1000, 1.0, 4.0, 0.5, 2.0)
    eps = p.epsilon_shuffled("gaussian", target, 1000, 1.0, 4.0, 0.5, 2.0)
    assert eps == pytest.approx(1.0, abs=1e-9) and eps >= 1.0 - 1e-12
    assert p.delta_shuffled("gaussian", eps, 1000, 1.0, 4.0, 0.5, 2.0) <= target


# ------------------------------------------------------------------------------- Appendix G (figures)
@pytest.mark.parametrize(("n", "ref"), [(100, 7.1392e-3), (10**4, 7.9752e-5), (10**6, 7.1950e-6), (10**8, 6.0774e-6)])
def test_fig1_shuffled_laplace(n: int, ref: float) -> None:
    v = p.v_fixed(n, FIG_ETA, 1.0, 1e5, 2.0)
    assert p.delta_shuffled("laplace", FIG_EPS, n, FIG_L, v, FIG_ETA, 1.0) == pytest.approx(ref, rel=rel(5))


def test_fig1_limit_and_rate() -> None:
    assert p.delta_star_laplace(1.0, 1e5) == pytest.approx(6.0653066e-6, rel=1e-6)
    assert p.v_fixed(100, FIG_ETA, 1.0, 1e5, 2.0) == pytest.approx(7.20828, rel=rel(6))
    # n (delta - delta*) tends to about 1.213 (O(1/n) convergence): check it at n = 10^10
    n = 10**10
    d = p.delta_shuffled("laplace", 1.0, n, FIG_L, p.v_fixed(n, FIG_ETA, 1.0, 1e5, 2.0), FIG_ETA, 1.0)
    assert n * (d - p.delta_star_laplace(1.0, 1e5)) == pytest.approx(1.213, rel=rel(4))


@pytest.mark.parametrize(
    ("n", "eta", "ref"), [(10**6, 0.1, 1.01405e-5), (10**8, 0.1, 3.33820e-6), (10**8, 0.01, 7.3276e-7)]
)
def test_fig2_fig3_shuffled_gaussian(n: int, eta: float, ref: float) -> None:
    sigma = p.sigma_fixed(n, eta, 1.0, 1e5, 100.0)
    got = p.delta_shuffled("gaussian", FIG_EPS, n, FIG_L, sigma, eta, 1.0)
    assert got == pytest.approx(ref, rel=rel(6 if ref != 7.3276e-7 else 5))


def test_fig2_limit_and_sigma() -> None:
    assert p.delta_star_gaussian(1.0, 1e5) == pytest.approx(3.0326533e-6, rel=1e-6)
    assert p.sigma_fixed(10**8, 0.1, 1.0, 1e5, 100.0) == pytest.approx(1.60494, rel=rel(6))


def test_online_reference_values() -> None:
    # Laplace: A_100, delta*^o (integral from i+1) and the lower bound (integral from i)
    v100 = p.v_online(100, 0.01, 1.0, 1.5, 100.0, 100.0)
    assert p.laplace_terms(1.0, 10.0, v100, 0.01, 1.0).a == pytest.approx(0.356025, rel=rel(6))
    assert p.online_delta_limit(ONLINE_L, 100) == pytest.approx(1.55875e-8, rel=rel(6))
    assert p.online_delta_limit(ONLINE_L, 100, "lower") == pytest.approx(1.53541e-8, rel=rel(6))
    # Gaussian
    s100 = p.sigma_online(100, 0.01, 1.0, 1.5, 100.0, 100.0)
    assert s100 == pytest.approx(26.7258, rel=rel(6))
    assert p.theta(2 * 10.0 / s100, 1.0) == pytest.approx(0.0495035, rel=rel(6))
    assert p.online_delta_limit(ONLINE_G, 100) == pytest.approx(3.00804e-23, rel=rel(6))
    assert p.online_delta_limit(ONLINE_G, 100, "lower") == pytest.approx(2.71178e-23, rel=rel(6))


@pytest.mark.parametrize(("cfg", "ref"), [(ONLINE_L, 1.71707e-8), (ONLINE_G, 3.49881e-23)])
def test_online_exact_at_ten_million(cfg: p.OnlineConfig, ref: float) -> None:
    # exact delta_100(n = 10^7): a product of 10^7 factors, vectorised in blocks
    assert p.online_record_delta(cfg, 100, 10**7) == pytest.approx(ref, rel=rel(6))


# ------------------------------------------------------------------------------------------- monotonicity
def test_theta_monotone() -> None:
    rs = np.geomspace(1e-3, 40, 60)
    th = [p.theta(r, 1.0) for r in rs]
    assert all(b >= a for a, b in zip(th, th[1:], strict=False)) and th[-1] <= 1.0 and th[0] >= 0.0
    by_eps = [p.theta(1.5, e) for e in (0.0, 0.2, 1.0, 3.0, 10.0)]
    assert all(b <= a for a, b in zip(by_eps, by_eps[1:], strict=False))


def test_delta_shuffled_monotone_in_sigma_n_l_and_diameter() -> None:
    base = dict(eps=1.0, n=1000, lipschitz=1.0, scale=4.0, eta=0.5, diameter=2.0)

    def d(**kw: float) -> float:
        args = {**base, **kw}
        return p.delta_shuffled("gaussian", **args)

    by_sigma = [d(scale=s) for s in (1.0, 2.0, 4.0, 8.0, 16.0)]
    by_n = [d(n=n) for n in (1, 10, 100, 10**4, 10**7)]
    by_l = [d(lipschitz=x) for x in (0.1, 0.5, 1.0, 2.0, 4.0)]
    by_dk = [d(diameter=x) for x in (0.5, 1.0, 2.0, 4.0)]
    assert all(b < a for a, b in zip(by_sigma, by_sigma[1:], strict=False))
    assert all(b < a for a, b in zip(by_n, by_n[1:], strict=False))
    assert all(b > a for a, b in zip(by_l, by_l[1:], strict=False))
    assert all(b > a for a, b in zip(by_dk, by_dk[1:], strict=False))
    by_v = [p.delta_shuffled("laplace", 1.0, 1000, 1.0, v, 0.5, 1.0) for v in (0.2, 0.5, 1.0, 2.0)]
    assert all(b <= a for a, b in zip(by_v, by_v[1:], strict=False))


@pytest.mark.parametrize(
    "terms",
    [
        p.gaussian_terms(1.0, 1.0, 4.0, 0.5, 2.0),
        p.gaussian_terms(1.0, 1.0, 1.0, 0.1, 1.0),
        p.gaussian_terms(0.3, 2.0, 3.0, 0.2, 1.0),
        p.laplace_terms(1.0, 1.0, 1.0, 0.5, 1.0),
    ],
)
def test_sandwich_and_randomly_stopped_relation(terms: p.Terms) -> None:
    n = 500
    d = p.delta_from_terms(terms, n)
    assert terms.a * terms.b ** (n - 1) <= d * (1 + 1e-12)
    assert d <= min(terms.a, p.delta_randomly_stopped(terms, n)) * (1 + 1e-12)
    per_index = [p.delta_randomly_stopped(terms, n, i) for i in range(1, n + 1)]
    assert max(per_index) == pytest.approx(d, rel=1e-12) == pytest.approx(per_index[0], rel=1e-12)
    # shuffled = average over positions of the plain per-position bounds A B^(n-j) (Theorem 2's proof)
    plain = [p.delta_plain(terms, n, j) for j in range(1, n + 1)]
    assert float(np.mean(plain)) == pytest.approx(d, rel=1e-9)
    assert p.delta_plain(terms, n, n) == pytest.approx(terms.a, rel=1e-12)  # last position: no amplification


def test_schedules() -> None:
    ns = [1, 10, 100, 10**4, 10**6, 10**7]
    sig = [p.sigma_fixed(n, 0.1, 1.0, 1e5, 100.0) for n in ns]
    vs = [p.v_fixed(n, 0.1, 1.0, 1e5, 2.0) for n in ns]
    assert all(b <= a for a, b in zip(sig, sig[1:], strict=False))
    assert all(b <= a for a, b in zip(vs, vs[1:], strict=False))
    js = np.array([1, 2, 10, 100, 10**4, 10**7], dtype=float)
    sj = p.sigma_online(js, 0.01, 1.0, 1.5, 100.0, 100.0)
    vj = p.v_online(js, 0.01, 1.0, 1.5, 100.0, 100.0)
    assert np.all(np.diff(sj) < 0) and np.all(np.diff(vj) < 0)
    # sigma_j ~ M D_K / (2 eta sqrt(2 alpha log j)) for large j: the ratio tends to 1
    big = np.array([1e10, 1e50, 1e200])
    ratio = p.sigma_online(big, 0.01, 1.0, 1.5, 100.0, 100.0) / (1.0 / (2 * 0.01 * np.sqrt(2 * 1.5 * np.log(big))))
    assert np.all(np.diff(np.abs(ratio - 1)) < 0) and abs(ratio[-1] - 1) < 0.02
    # n (1 - B(n)) -> C1 e^{eps/2} (Laplace, exact form) and 2 C1 e^{eps/2} (Gaussian, slowly)
    n = 10**12
    t_l = p.laplace_terms(1.0, 10.0, p.v_fixed(n, 0.1, 1.0, 1e5, 2.0), 0.1, 1.0)
    assert n * math.exp(t_l.log_1mb) == pytest.approx(1e5 * math.exp(0.5), rel=1e-6)
    lim_g = 2 * 1e5 * math.exp(0.5)
    gaps = []
    for n in (10**8, 10**12, 10**16):
        t_g = p.gaussian_terms(1.0, 10.0, p.sigma_fixed(n, 0.1, 1.0, 1e5, 100.0), 0.1, 1.0)
        gaps.append(abs(n * math.exp(t_g.log_1mb) / lim_g - 1))
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 0.05


def test_online_per_record_delta_properties() -> None:
    seq = [p.online_record_delta(ONLINE_L, 100, n) for n in (100, 101, 1000, 10**4, 10**5, 10**6)]
    assert all(b < a for a, b in zip(seq, seq[1:], strict=False))
    lower = p.online_delta_limit(ONLINE_L, 100, "lower")
    assert all(x >= lower for x in seq)
    # the newest record is barely protected: delta_n(n) = A_n, increasing towards 1
    a_n = [p.online_record_delta(ONLINE_G, n, n) for n in (10, 100, 1000, 10**4)]
    assert all(b > a for a, b in zip(a_n, a_n[1:], strict=False))
    # vector form agrees with the scalar form
    vec = p.online_record_deltas(ONLINE_L, 2000)
    for i in (1, 100, 1999, 2000):
        assert vec[i - 1] == pytest.approx(p.online_record_delta(ONLINE_L, i, 2000), rel=1e-9)
    # fast decay (alpha = 3): the exact value at n = 10^6 lies between the two integral bounds of the limit
    cfg = ONLINE_G._replace(alpha=3.0)
    exact = p.online_record_delta(cfg, 100, 10**6)
    assert p.online_delta_limit(cfg, 100, "lower") <= exact <= p.online_delta_limit(cfg, 100, "upper")


# ------------------------------------------------------------------------------------------------ extremes
def test_extremes_no_overflow_or_nan() -> None:
    for r in (1e-8, 1e-3, 1.0, 30.0, 1e3):
        for eps in (0.0, 1e-6, 1.0, 50.0):
            th = p.theta(r, eps)
            assert 0.0 <= th <= 1.0 and math.isfinite(p.log_one_minus_theta(r, eps))
    for n in (1, 10**7):
        for sigma in (1e-3, 1.0, 1e4):
            d = p.delta_shuffled("gaussian", 1.0, n, 1.0, sigma, 0.1, 1.0)
            assert 0.0 <= d <= 1.0
    # B within 1e-22 of 1 (M D_K/(eta sigma) = 20) and n = 10^7: finite, between A/n and A (here = A)
    t = p.gaussian_terms(1.0, 1.0, 0.5, 0.1, 1.0)
    assert t.log_1mb < -50
    d = p.delta_from_terms(t, 10**7)
    assert t.a / 10**7 <= d <= t.a and d == pytest.approx(t.a, rel=1e-9)
    # B = 0 exactly (Laplace clipping): delta = A / n
    t0 = p.laplace_terms(1.0, 1.0, 0.1, 10.0, 1.0)
    assert t0.b == 0.0 and p.delta_from_terms(t0, 10**7) == pytest.approx(t0.a / 10**7, rel=1e-12)
    # a positive delta is never rounded down to zero
    tiny = p.delta_shuffled("gaussian", 1.0, 10**7, 1.0, 0.01, 0.1, 1.0)
    assert tiny > 0.0


def test_cached_queries_are_fast() -> None:
    p.online_record_delta(ONLINE_L, 50, 10**4)
    p.delta_shuffled("gaussian", 1.0, 10**4, 1.0, 2.0, 0.1, 1.0)
    start = time.perf_counter()
    for _ in range(100):
        p.online_record_delta(ONLINE_L, 50, 10**4)
        p.delta_shuffled("gaussian", 1.0, 10**4, 1.0, 2.0, 0.1, 1.0)
    assert time.perf_counter() - start < 0.5


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("call", "word"),
    [
        (lambda: p.theta(0.0, 1.0), "r"),
        (lambda: p.theta(1.0, -1.0), "eps"),
        (lambda: p.delta_shuffled("gaussian", 1.0, 0, 1.0, 1.0, 0.1, 1.0), "n"),
        (lambda: p.delta_shuffled("gaussian", 1.0, 10, 1.0, 0.0, 0.1, 1.0), "sigma"),
        (lambda: p.delta_shuffled("laplace", 1.0, 10, 1.0, -1.0, 0.1, 1.0), "v"),
        (lambda: p.delta_shuffled("uniform", 1.0, 10, 1.0, 1.0, 0.1, 1.0), "noise"),
        (lambda: p.delta_shuffled("gaussian", 1.0, 10, 1.0, 1.0, 0.1, 1.0, m=1.5), "M"),
        (lambda: p.contraction_factor(1.0, 4.0, 1.0), "eta"),
        (lambda: p.contraction_factor(0.1, 1.0, 2.0), "rho"),
        (lambda: p.calibrate_scale("gaussian", 0.0, 1.0, 10, 1.0, 0.1, 1.0), "target_delta"),
        (lambda: p.calibrate_scale("gaussian", 1.0, 1.0, 10, 1.0, 0.1, 1.0), "target_delta"),
        (lambda: p.sigma_online(5, 0.1, 1.0, 1.0, 1.0, 1.0), "alpha"),
        (lambda: p.v_fixed(10, 0.1, 1.0, 100.0, 0.0), "C2"),
        (lambda: p.online_record_delta(ONLINE_L, 10, 5), "i"),
        (lambda: p.online_delta_limit(ONLINE_L, 10, "middle"), "bound"),
        (lambda: p.delta_plain(p.gaussian_terms(1.0, 1.0, 1.0, 0.1, 1.0), 10, 11), "i"),
    ],
)
def test_bad_input_raises_named_value_error(call, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        call()
