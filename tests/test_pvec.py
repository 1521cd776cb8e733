"""P1D / PVEC (seed 000): parameters, privacy sanity, unbiasedness/variance, bit vs count mode, clipping, errors.

Statistical tolerances (fixed seeds): means within 4 standard errors of the truth (SE from the exact variance
formula of spec 000 sec 2); sample variances inside the two-sided chi-square band of level 1e-4 (Bonferroni-
divided over coordinates); two-sample chi-square test of bit vs count mode at alpha = 1e-3 per label.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from shuffledp.mechanisms import pvec
from shuffledp.mechanisms.pvec import (
    P1dParams,
    PvecParams,
    clip_rows,
    count_in_range,
    decode_bits,
    decode_counts,
    encode_bits,
    encode_counts,
    p1d_decode,
    p1d_encode_counts,
    p1d_params,
    p1d_variance,
    pvec_params,
    pvec_variance,
    pvec_variance_bound,
    shift_to_units,
    validate_counts,
)
from shuffledp.security.rng import make_rng

VAR_ALPHA = 1e-4  # two-sided level of each chi-square variance band


def chi2_band_ok(samples: np.ndarray, true_var: float, alpha: float = VAR_ALPHA) -> bool:
    """(R-1) s^2 / var ~ chi2(R-1) for (near-)normal samples; accept inside the central 1-alpha band."""
    r = samples.size
    stat = (r - 1) * samples.var(ddof=1) / true_var
    return stats.chi2.ppf(alpha / 2, r - 1) <= stat <= stats.chi2.ppf(1 - alpha / 2, r - 1)


def mean_ok(samples: np.ndarray, truth: float, true_var: float, k: float = 4.0) -> bool:
    return abs(samples.mean() - truth) <= k * math.sqrt(true_var / samples.size)


# ----------------------------------------------------------------------------------------------------------
# parameters (spec 000 sec 2, 3, 7 item 2, 8)
# ----------------------------------------------------------------------------------------------------------
def test_p1d_spec_example() -> None:
    P = p1d_params(eps=1.0, delta=1e-3, n=100, Delta=1.0)
    assert (P.g, P.m) == (10, 1369)
    assert P.p == pytest.approx(0.49969, abs=5e-6)
    assert P.p < 0.5
    # Lemma 3.1: n m p = 90 g^2 ln(2/delta) / eps^2 (p rounded up by a few ulps only)
    assert P.n * P.m * P.p == pytest.approx(90 * 10**2 * math.log(2 / 1e-3), rel=1e-13)
    assert P.n * P.m * P.p >= 90 * 10**2 * math.log(2 / 1e-3)
    assert P.scale == 0.1 and P.messages_per_user == 1379


def test_p1d_section8_example_and_scaling_trick() -> None:
    P = p1d_params(eps=1.0, delta=1e-6, n=1000)
    assert (P.g, P.m) == (32, 2675)  # spec 000 sec 8
    std = math.sqrt(p1d_variance(np.full(1000, 0.37), P))
    assert 25.0 < std < 26.0  # "std about 25.6"
    # scaling trick: g does not depend on Delta, the count unit does, the variance scales by Delta^2
    P5 = p1d_params(eps=1.0, delta=1e-6, n=1000, Delta=5.0)
    assert (P5.g, P5.m, P5.p) == (P.g, P.m, P.p) and P5.scale == pytest.approx(5 / 32)
    assert p1d_variance(np.full(1000, 5 * 0.37), P5) == pytest.approx(25 * std**2, rel=1e-12)


def test_p1d_large_eps_raises_g_for_alpha_condition() -> None:
    # n=1 would give g=1, but eps/(3g) must stay <= 0.85 for ln((1+a)/(1-a)) <= 3a (proof of Lemma 3.1)
    P = p1d_params(eps=15.0, delta=0.25, n=1)
    a = 15.0 / (3 * P.g)
    assert a <= 0.85 and math.log((1 + a) / (1 - a)) <= 3 * a
    assert P.g == 6


def test_pvec_params_formulas_section8() -> None:
    eps, delta, n, d, D2 = 1.0, 1e-6, 1000, 100, 1.0
    Q = pvec_params(eps, delta, n, d, D2)
    gamma = delta / (d + 1)
    eps_hat = eps / (18 * math.sqrt(math.log(1 / gamma)))
    assert Q.delta_hat == pytest.approx(gamma, rel=1e-15)
    assert Q.eps_hat == pytest.approx(eps_hat, rel=1e-14) and Q.eps_hat <= eps_hat
    assert Q.eps_hat == pytest.approx(0.01294, abs=5e-6)  # spec 000 sec 8
    assert Q.g == 100  # set by d (2 D2 sqrt(n) = 63.2)
    m_ref = math.floor(180 * Q.g**2 * math.log(2 / gamma) / (eps_hat**2 * n)) + 1
    assert abs(Q.m - m_ref) <= 1 and Q.m == pytest.approx(2.06e8, rel=0.01)
    assert Q.n * Q.m * Q.p == pytest.approx(90 * Q.g**2 * math.log(2 / gamma) / eps_hat**2, rel=1e-12)
    assert Q.p < 0.5 and Q.method == "paper"
    assert Q.messages_per_user == d * (Q.g + Q.m) and Q.scale == 2 * D2 / Q.g and Q.Delta == 2 * D2
    assert math.sqrt(pvec_variance_bound(Q)) == pytest.approx(4.5e3, rel=0.02)  # "noise std about 4.5e3"
    # last step of the proof of Thm 3.2: 18 eps_hat^2 + 6 eps_hat sqrt(ln(1/gamma)) <= eps
    assert 18 * Q.eps_hat**2 + 6 * Q.eps_hat * math.sqrt(math.log(1 / gamma)) <= eps


@pytest.mark.parametrize(
    ("n", "d", "D2", "g"),
    [(10_000, 4, 1.0, 200), (1, 2, 0.5, 4), (100, 3, 0.5, 10), (50, 60, 2.0, 60)],
)
def test_pvec_g_is_max_of_three_terms(n: int, d: int, D2: float, g: int) -> None:
    assert pvec_params(1.0, 1e-5, n, d, D2).g == g  # g = ceil(max(2 D2 sqrt(n), d, 4)), proof of Thm 3.2


def test_pvec_composition_bound_random_neighbours() -> None:
    """Spec 000 sec 7 item 4: sum_j eps_j^2 <= 9 eps_hat^2 and Lemma 3.3's eps' <= eps for random neighbours."""
    rng = make_rng(11)
    for d, n, D2 in [(5, 50, 1.0), (20, 400, 3.0), (100, 1000, 0.5)]:
        Q = pvec_params(2.0, 1e-6, n, d, D2)
        X = clip_rows(rng.normal(size=(2000, d)) * rng.uniform(0.01, 3 * D2, size=(2000, 1)), D2)
        Y = clip_rows(rng.normal(size=(2000, d)) * rng.uniform(0.01, 3 * D2, size=(2000, 1)), D2)
        eps_j = Q.eps_hat * (2 / Q.g + np.abs(X - Y) / (2 * D2))
        sq = (eps_j**2).sum(axis=1)
        assert np.all(sq <= 9 * Q.eps_hat**2)
        eps_prime = (eps_j * np.expm1(eps_j)).sum(axis=1) + 2 * np.sqrt(math.log(1 / Q.delta_hat) * sq)
        assert np.all(eps_prime <= Q.eps)


def _hockey_stick(la: np.ndarray, lb: np.ndarray, eps: float) -> float:
    with np.errstate(invalid="ignore"):
        diff = la - lb - eps
    keep = np.isfinite(la) & (diff > 0)
    return float(np.sum(np.exp(la[keep]) * -np.expm1(-diff[keep])))


def test_p1d_exact_binomial_privacy() -> None:
    """Spec 000 sec 7 item 3: exact hockey-stick between Bin(mn, p) and g + Bin(mn, p) at eps(2/g + 1)."""
    P = p1d_params(1.0, 1e-3, 100)
    M = P.n * P.m
    k = np.arange(M + P.g + 1)
    la = stats.binom.logpmf(k, M, P.p)
    lb = stats.binom.logpmf(k - P.g, M, P.p)
    eps_claim = P.eps * (2 / P.g + 1)
    exact = max(_hockey_stick(la, lb, eps_claim), _hockey_stick(lb, la, eps_claim))
    assert exact <= P.delta and exact < 1e-100  # about 1e-111
    # the computation is not trivially 0: at eps = 0.09 the divergence exceeds delta (tight eps ~ 0.093)
    assert max(_hockey_stick(la, lb, 0.09), _hockey_stick(lb, la, 0.09)) > P.delta
    assert max(_hockey_stick(la, lb, 0.095), _hockey_stick(lb, la, 0.095)) <= P.delta


# ----------------------------------------------------------------------------------------------------------
# Monte Carlo: unbiasedness and exact variance
# ----------------------------------------------------------------------------------------------------------
def test_p1d_unbiased_and_variance() -> None:
    rng = make_rng(1)
    P = p1d_params(1.0, 1e-3, 100, Delta=3.0)
    x = rng.uniform(0, 3.0, size=100)
    x[:3] = [0.0, 3.0, 1.5]  # range ends and an exactly representable midpoint
    R = 4000
    counts = p1d_encode_counts(np.tile(x, R), P, rng).reshape(R, 100)
    assert counts.dtype == np.int64 and np.all(count_in_range(counts, P))
    est = np.array([p1d_decode(int(t), 100, P) for t in counts.sum(axis=1)])
    var = p1d_variance(x, P)
    assert mean_ok(est, x.sum(), var)
    assert chi2_band_ok(est, var)


@pytest.fixture(scope="module")
def small_pvec() -> PvecParams:
    return pvec_params(eps=1.0, delta=1e-3, n=50, d=5, delta2=1.0)


def _rows(rng: np.random.Generator, k: int, d: int, D2: float) -> np.ndarray:
    X = rng.normal(size=(k, d)) * rng.uniform(0.1, 2.0, size=(k, 1)) * D2 / math.sqrt(d)
    X[0] = 0.0
    X[1] = 0.0
    X[1, 0] = -D2  # extreme shifted value 0
    X[2] = 0.0
    X[2, 1] = 5 * D2  # clipped to +D2 -> shifted value 2 D2
    return X


def _mc_pvec(X: np.ndarray, params: PvecParams, R: int, rng: np.random.Generator, n_contrib: int) -> np.ndarray:
    k, d = X.shape
    counts = encode_counts(np.tile(X, (R, 1)), params, rng)  # all R repetitions in one vectorized call
    assert np.all(count_in_range(counts, params))
    totals = counts.reshape(R, k, d).sum(axis=1)
    return np.array([decode_counts(t, n_contrib, params) for t in totals])


def test_pvec_count_mode_unbiased_and_variance(small_pvec: PvecParams) -> None:
    rng = make_rng(2)
    X = _rows(rng, 50, 5, 1.0)
    assert np.linalg.norm(X, axis=1).max() > 1.0  # some rows need clipping
    R = 2500
    est = _mc_pvec(X, small_pvec, R, rng, n_contrib=50)
    truth = clip_rows(X, 1.0).sum(axis=0)  # unbiased for the sum of the CLIPPED inputs
    var = pvec_variance(X, small_pvec)
    alpha = VAR_ALPHA / small_pvec.d
    for j in range(small_pvec.d):
        assert mean_ok(est[:, j], truth[j], var[j]), j
        assert chi2_band_ok(est[:, j], var[j], alpha), j
    # noise independent across coordinates: sample correlations small (|r| < 4/sqrt(R))
    corr = np.corrcoef(est.T)[np.triu_indices(small_pvec.d, 1)]
    assert np.all(np.abs(corr) < 4 / math.sqrt(R))
    assert np.all(var <= pvec_variance_bound(small_pvec))


def test_pvec_dropout_debias_with_actual_contributors(small_pvec: PvecParams) -> None:
    rng = make_rng(3)
    X = _rows(rng, 30, 5, 1.0)  # only n' = 30 of the n = 50 users contribute
    R = 2500
    est = _mc_pvec(X, small_pvec, R, rng, n_contrib=30)
    truth = clip_rows(X, 1.0).sum(axis=0)
    var = pvec_variance(X, small_pvec)
    for j in range(small_pvec.d):
        assert mean_ok(est[:, j], truth[j], var[j]), j
        assert chi2_band_ok(est[:, j], var[j], VAR_ALPHA / small_pvec.d), j
    # debiasing with the nominal n instead would be badly biased (by -20 (scale m p + delta2) per coordinate)
    counts = encode_counts(X, small_pvec, rng).sum(axis=0)
    wrong = decode_counts(counts, 50, small_pvec)
    assert np.all(wrong - truth < -20 * small_pvec.scale * small_pvec.m * small_pvec.p * 0.99)


def test_pvec_vectorized_10k_users_d100() -> None:
    rng = make_rng(4)
    Q = pvec_params(1.0, 1e-6, 10_000, 100, 1.0)
    X = rng.normal(size=(10_000, 100)) * 0.2
    counts = encode_counts(X, Q, rng)
    assert counts.shape == (10_000, 100) and counts.dtype == np.int64
    assert counts.min() >= 0 and counts.max() <= Q.g + Q.m
    est = decode_counts(counts.sum(axis=0), 10_000, Q)
    truth = clip_rows(X, 1.0).sum(axis=0)
    z = (est - truth) / np.sqrt(pvec_variance(X, Q))
    assert np.all(np.abs(z) < 5.0)  # 100 coordinates, each within 5 sd (P(fail) ~ 6e-5)


def test_pvec_paper_scale_m_has_no_float_cancellation() -> None:
    """Paper constants at small eps: m ~ 1e12 and totals beyond 2^53; decoding stays exact to float resolution."""
    Q = pvec_params(0.01, 1e-6, 80_000, 1, 1.0)
    assert Q.m > 10**11 and Q.n * Q.m * Q.p > 2**53
    for offset in (-(10**9), -1, 0, 7, 123_456_789):
        T = Q.n * Q.m * Q.p // 1 + Q.n * Q.g // 2 + offset  # around the mean total for x = 0
        T = int(T)
        out = decode_counts(np.array([T], dtype=np.int64), Q.n, Q)[0]
        exact = Fraction(Q.scale) * (T - Fraction(Q.p) * Q.n * Q.m) - Q.n * Fraction(Q.delta2)
        # float64 subtraction of n m p would be off by several counts (x scale ~ 0.007) here
        assert abs(out - float(exact)) <= 1e-9 + 1e-12 * abs(float(exact)), offset
    rng = make_rng(5)
    X = rng.normal(size=(80_000, 1)) * 0.5
    est = decode_counts(encode_counts(X, Q, rng).sum(axis=0), 80_000, Q)
    z = (est - clip_rows(X, 1.0).sum(axis=0)) / np.sqrt(pvec_variance(X, Q))
    assert abs(z[0]) < 4.5


def test_rounding_variance_term_when_noise_is_small() -> None:
    """Calibrated-size tiny noise: the randomized-rounding term sum r(1-r) dominates the exact variance."""
    Q = PvecParams(d=2, n=10, delta2=1.0, g=4, m=1, p=0.01, eps=1.0, delta=1e-3, method="calibrated")
    X = np.tile([[0.25, -0.375]], (10, 1))  # u g = 2.5 and 1.25: r = 0.5 and 0.25
    var = pvec_variance(X, Q)
    assert var / Q.scale**2 == pytest.approx([10 * 0.25 + 10 * 0.0099, 10 * 0.1875 + 10 * 0.0099])
    rng = make_rng(13)
    est = _mc_pvec(X, Q, 20_000, rng, n_contrib=10)
    for j in range(2):
        assert mean_ok(est[:, j], 10 * X[0, j], var[j]), j
        assert chi2_band_ok(est[:, j], var[j], VAR_ALPHA / 2), j


# ----------------------------------------------------------------------------------------------------------
# bit mode
# ----------------------------------------------------------------------------------------------------------
def test_bit_mode_message_counts_whatever_the_input() -> None:
    Q = pvec_params(eps=15.0, delta=0.4, n=4, d=2, delta2=1.0)  # smallest paper setting: d(g+m) ~ 1.1e4
    rng = make_rng(6)
    inputs = [
        np.zeros(2),
        np.array([1.0, 0.0]),
        np.array([-1.0, 0.0]),
        np.array([0.0, -1.0]),
        np.array([1e6, -1e6]),  # clipped
        rng.normal(size=2) * 0.3,
    ]
    for x in inputs:
        labels, bits = encode_bits(x, Q, rng)
        assert labels.size == bits.size == Q.d * (Q.g + Q.m)
        assert np.array_equal(np.bincount(labels, minlength=Q.d), np.full(Q.d, Q.g + Q.m))
        assert labels.min() >= 0 and labels.max() < Q.d
        assert set(np.unique(bits)) <= {0, 1}


def _pooled_bins(a: np.ndarray, b: np.ndarray, min_count: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Contingency table of two integer samples, pooling adjacent values until each bin has >= min_count."""
    vals = np.arange(min(a.min(), b.min()), max(a.max(), b.max()) + 1)
    ca = np.array([(a == v).sum() for v in vals])
    cb = np.array([(b == v).sum() for v in vals])
    rows_a, rows_b, acc_a, acc_b = [], [], 0, 0
    for x, y in zip(ca, cb, strict=True):
        acc_a, acc_b = acc_a + x, acc_b + y
        if acc_a + acc_b >= min_count:
            rows_a.append(acc_a)
            rows_b.append(acc_b)
            acc_a = acc_b = 0
    rows_a[-1] += acc_a
    rows_b[-1] += acc_b
    return np.array(rows_a), np.array(rows_b)


def test_bit_mode_and_count_mode_totals_same_distribution() -> None:
    """Two-sample chi-square test (alpha = 1e-3 per label) on per-label totals, plus exact mean/variance."""
    Q = PvecParams(d=2, n=3, delta2=1.0, g=3, m=8, p=0.35, eps=1.0, delta=1e-3, method="calibrated")
    X = np.array([[0.3, -0.5], [-1.0, 0.0], [0.6, 0.8]])  # fractional u g values, an extreme, norm exactly 1
    rng = make_rng(7)
    R = 4000
    bit_totals = np.empty((R, 2), dtype=np.int64)
    for r in range(R):
        msgs = [encode_bits(x, Q, rng) for x in X]
        labels = np.concatenate([lab for lab, _ in msgs])
        bits = np.concatenate([b for _, b in msgs])
        bit_totals[r] = np.bincount(labels[bits == 1], minlength=2)
    count_totals = encode_counts(np.tile(X, (R, 1)), Q, rng).reshape(R, 3, 2).sum(axis=1)
    u = shift_to_units(X, Q)
    for j in range(2):
        ta, tb = _pooled_bins(bit_totals[:, j], count_totals[:, j])
        _, pval, _, _ = stats.chi2_contingency(np.vstack([ta, tb]))
        assert pval > 1e-3, (j, pval)
        # both agree with the exact law: mean sum_i u_ij g + n m p
        mean = (u[:, j] * Q.g).sum() + 3 * Q.m * Q.p
        var = pvec_variance(X, Q)[j] / Q.scale**2
        assert mean_ok(bit_totals[:, j].astype(float), mean, var)
        assert mean_ok(count_totals[:, j].astype(float), mean, var)


def test_bit_mode_decode_unbiased_and_variance() -> None:
    Q = PvecParams(d=3, n=5, delta2=2.0, g=6, m=20, p=0.3, eps=1.0, delta=1e-3, method="calibrated")
    rng = make_rng(8)
    X = rng.normal(size=(4, 3))  # n' = 4 < n = 5 contributors (dropout); some rows clipped
    R = 2000
    est = np.empty((R, 3))
    for r in range(R):
        msgs = [encode_bits(x, Q, rng) for x in X]
        labels = np.concatenate([lab for lab, _ in msgs])
        bits = np.concatenate([b for _, b in msgs])
        perm = rng.permutation(labels.size)  # the shuffler's permutation (decode must not depend on order)
        est[r] = decode_bits(labels[perm], bits[perm], Q)
    truth = clip_rows(X, 2.0).sum(axis=0)
    var = pvec_variance(X, Q)
    for j in range(3):
        assert mean_ok(est[:, j], truth[j], var[j]), j
        assert chi2_band_ok(est[:, j], var[j], VAR_ALPHA / 3), j


# ----------------------------------------------------------------------------------------------------------
# clipping and ranges
# ----------------------------------------------------------------------------------------------------------
def test_clip_rows() -> None:
    rng = make_rng(9)
    X = rng.normal(size=(100_000, 7)) * rng.uniform(0, 10, size=(100_000, 1))
    X_before = X.copy()
    C = clip_rows(X, 1.3)
    assert np.array_equal(X, X_before)  # input not modified in place
    norms = np.linalg.norm(X, axis=1)
    cn = np.sqrt(np.einsum("ij,ij->i", C, C))
    assert np.all(cn <= 1.3)  # strictly in float arithmetic
    inside = norms <= 1.3
    assert np.array_equal(C[inside], X[inside])  # untouched
    assert np.allclose(cn[~inside], 1.3, rtol=1e-14)
    assert np.allclose(C[~inside] * (norms[~inside] / 1.3)[:, None], X[~inside], rtol=1e-12)  # same direction
    assert np.array_equal(clip_rows(np.zeros((2, 3)), 1.0), np.zeros((2, 3)))
    assert clip_rows(np.array([3.0, 4.0]), 1.0) == pytest.approx([0.6, 0.8])  # 1-D input: one row


def test_shift_in_range_and_counts_in_range(small_pvec: PvecParams) -> None:
    rng = make_rng(10)
    X = rng.normal(size=(2000, 5)) * 10  # mostly far outside the ball
    X[0] = [1e300, -1e300, 0, 0, 0]
    u = shift_to_units(X, small_pvec)
    w = u * 2 * small_pvec.delta2 - small_pvec.delta2  # back to x after clipping
    assert np.all((u >= 0) & (u <= 1))
    assert np.all(np.linalg.norm(w, axis=1) <= small_pvec.delta2 * (1 + 1e-12))
    counts = encode_counts(X, small_pvec, rng)
    assert np.all((counts >= 0) & (counts <= small_pvec.g + small_pvec.m))
    # encode_counts clips by itself: same law as pre-clipped input (same seed -> identical draws)
    a = encode_counts(X, small_pvec, make_rng(99))
    b = encode_counts(clip_rows(X, small_pvec.delta2), small_pvec, make_rng(99))
    assert np.array_equal(a, b)


def test_count_validation_helpers(small_pvec: PvecParams) -> None:
    top = small_pvec.g + small_pvec.m
    c = np.array([0, 1, top, top + 1, -1])
    assert count_in_range(c, small_pvec).tolist() == [True, True, True, False, False]
    assert count_in_range(np.array([0.5, 2.0, np.nan]), small_pvec).tolist() == [False, True, False]
    assert count_in_range(np.array(["a"]), small_pvec).tolist() == [False]
    ok = validate_counts(np.arange(5), small_pvec)
    assert ok.dtype == np.int64
    with pytest.raises(ValueError, match="g\\+m"):
        validate_counts(np.array([0, 1, 2, 3, top + 1]), small_pvec)
    with pytest.raises(ValueError, match="shape"):
        validate_counts(np.arange(4), small_pvec)


# ----------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eps": 15.01}, "eps"),
        ({"eps": 0.0}, "eps"),
        ({"eps": -1.0}, "eps"),
        ({"eps": float("nan")}, "eps"),
        ({"eps": "1"}, "eps"),
        ({"delta": 0.5}, "delta"),
        ({"delta": 0.0}, "delta"),
        ({"delta": -1e-9}, "delta"),
        ({"n": 0}, "n"),
        ({"n": 10.5}, "n"),
        ({"n": True}, "n"),
        ({"Delta": 0.0}, "Delta"),
        ({"Delta": float("inf")}, "Delta"),
        ({"eps": 1e-9, "n": 1}, "2\\^53"),  # paper constants need too many trials
    ],
)
def test_p1d_params_errors(kwargs: dict, match: str) -> None:
    args = {"eps": 1.0, "delta": 1e-3, "n": 100, "Delta": 1.0} | kwargs
    with pytest.raises(ValueError, match=match):
        p1d_params(**args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eps": 16.0}, "eps"),
        ({"eps": 0.0}, "eps"),
        ({"delta": 0.5}, "delta"),
        ({"delta": 0.0}, "delta"),
        ({"n": 0}, "n"),
        ({"d": 0}, "d"),
        ({"d": 2.0}, "d"),
        ({"delta2": 0.0}, "delta2"),
        ({"delta2": -1.0}, "delta2"),
        ({"delta2": float("nan")}, "delta2"),
    ],
)
def test_pvec_params_errors(kwargs: dict, match: str) -> None:
    args = {"eps": 1.0, "delta": 1e-3, "n": 100, "d": 3, "delta2": 1.0} | kwargs
    with pytest.raises(ValueError, match=match):
        pvec_params(**args)


def test_params_dataclass_validation(small_pvec: PvecParams) -> None:
    base = {f: getattr(small_pvec, f) for f in ("d", "n", "delta2", "g", "m", "p", "eps", "delta", "method")}
    cal = base | {"method": "calibrated"}
    assert PvecParams(**(cal | {"p": 0.9, "eps": 40.0, "delta": 0.7})).p == 0.9  # calibrated: p<1/2 not needed
    bad = [
        (base | {"method": "magic"}, "method"),
        (cal | {"g": 0}, "g"),
        (cal | {"m": 0}, "m"),
        (cal | {"m": 2**53 + 1}, "2\\^53"),
        (cal | {"p": 0.0}, "p"),
        (cal | {"p": 1.0}, "p"),
        (cal | {"n": 10**6, "m": 2**53}, "int64"),
        (base | {"p": 0.6}, "p"),
        (base | {"m": base["m"] // 2}, "less noise"),  # paper method refuses too little noise
        (base | {"g": 4}, "g"),  # below d... d=5 here
        (base | {"eps": 20.0}, "eps"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            PvecParams(**kw)
    P = p1d_params(1.0, 1e-3, 100)
    with pytest.raises(ValueError, match="Lemma 3.1"):
        P1dParams(n=100, Delta=1.0, g=10, m=P.m, p=P.p * 0.9, eps=1.0, delta=1e-3)
    with pytest.raises(ValueError, match="eps/\\(3g\\)"):
        P1dParams(n=1, Delta=1.0, g=1, m=10**6, p=0.4, eps=15.0, delta=0.1)


def test_encode_decode_errors(small_pvec: PvecParams) -> None:
    rng = make_rng(12)
    Q = small_pvec
    with pytest.raises(ValueError, match="shape"):
        encode_counts(np.zeros((3, 4)), Q, rng)
    with pytest.raises(ValueError, match="finite"):
        encode_counts(np.full((2, 5), np.nan), Q, rng)
    with pytest.raises(ValueError, match="shape"):
        decode_counts(np.zeros(4, dtype=np.int64), 10, Q)
    with pytest.raises(ValueError, match="n_contrib"):
        decode_counts(np.zeros(5, dtype=np.int64), 0, Q)
    with pytest.raises(ValueError, match="n_contrib"):
        decode_counts(np.zeros(5, dtype=np.int64), Q.n + 1, Q)
    with pytest.raises(ValueError, match="totals"):
        decode_counts(np.array([-1, 0, 0, 0, 0]), 10, Q)
    with pytest.raises(ValueError, match="totals"):
        decode_counts(np.full(5, 10 * (Q.g + Q.m) + 1), 10, Q)
    with pytest.raises(ValueError, match="integers"):
        decode_counts(np.full(5, 0.5), 10, Q)
    # bit mode
    Qb = PvecParams(d=2, n=5, delta2=1.0, g=2, m=3, p=0.3, eps=1.0, delta=1e-3, method="calibrated")
    labels, bits = encode_bits(np.zeros(2), Qb, rng)
    assert decode_bits(labels, bits, Qb).shape == (2,)
    cases = [
        (labels, bits[:-1], "equal length"),
        (labels[:-1], bits[:-1], "multiple"),
        (np.where(labels == 1, 2, labels), bits, "labels"),
        (labels, np.where(bits == 1, 2, bits), "bits"),
        (np.zeros_like(labels), bits, "exactly"),
        (labels.astype(float), bits, "integer"),
    ]
    for lab, b, match in cases:
        with pytest.raises(ValueError, match=match):
            decode_bits(lab, b, Qb)
    with pytest.raises(ValueError, match="count mode"):
        encode_bits(np.zeros(5), pvec_params(1.0, 1e-3, 100, 5, 1.0), rng)
    with pytest.raises(ValueError, match="shape"):
        encode_bits(np.zeros((1, 2)), Qb, rng)
    # P1D inputs must be in [0, Delta]
    P = p1d_params(1.0, 1e-3, 100, Delta=2.0)
    for x in (np.array([-0.1]), np.array([2.1]), np.array([np.nan])):
        with pytest.raises(ValueError, match="Delta"):
            p1d_encode_counts(x, P, rng)
    with pytest.raises(ValueError, match="totals"):
        p1d_decode(-1, 10, P)


def test_module_exports_exist() -> None:
    for name in pvec.__all__:
        assert hasattr(pvec, name), name


def test_count_wire_dtype_is_the_narrowest_width_that_holds_g_plus_m():
    cases = {0: 1, 255: 1, 256: 2, 65535: 2, 65536: 4, 2**32 - 1: 4, 2**32: 8, 2**64 - 1: 8}
    for max_count, width in cases.items():
        dt = pvec.count_wire_dtype(max_count)
        assert (
            dt.itemsize == width and dt.kind == "u" and dt.byteorder in "<=|"
        )  # little-endian (or one byte), unsigned
        assert np.array([max_count], dtype=dt)[0] == max_count  # holds the largest count exactly
    for bad in (-1, 2**64, 1.5):
        with pytest.raises(ValueError):
            pvec.count_wire_dtype(bad)


def _kernel_rows(seed: int, k: int, d: int, delta2: float) -> np.ndarray:
    """Rows of every kind the rounding meets: inside and far outside the ball, zero, on its boundary, one entry
    only, tiny, and finite rows whose squares overflow."""
    rng = np.random.default_rng(seed)  # inputs only; the rounding's uniforms come from make_rng
    X = rng.normal(size=(k, d)) * np.exp(rng.normal(size=(k, 1)) * 3)
    X[0] = 0.0
    X[1] = delta2 / math.sqrt(d)  # on the boundary (up to rounding)
    X[2] = 0.0
    X[2, -1] = -5 * delta2
    X[3] *= 1e-300
    X[4, :2] = [1e300, -1e300][: min(2, d)]
    return X


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("d", [1, 7, 8, 9, 37])
@pytest.mark.parametrize("g, width", [(200, 1), (1632, 2), (70_000, 4), (2**31 + 5, 4), (2**40, 8)])
def test_rounding_kernel_is_the_numpy_reference_exactly(d, g, width, portable) -> None:
    """_ldp_kernels.round_rows (round_counts' one pass per row) gives exactly clip_rows + shift_to_units +
    _round_units on the same uniforms, in every wire width and both builds (baseline and AVX2), for every kind of
    row; its values lie in {0..g} (what PVEC's privacy rests on)."""
    from shuffledp.mechanisms import _ldp_kernels

    delta2 = 0.7
    X = _kernel_rows(d + width, 600, d, delta2)
    params = PvecParams(d=d, n=10, delta2=delta2, g=g, m=50, p=0.5, eps=1.0, delta=1e-6, method="calibrated")
    ref = pvec._round_units(shift_to_units(X, params), g, make_rng(3))
    uniforms = make_rng(3).random(X.shape)
    out = np.zeros(X.shape, dtype=f"<u{width}")
    assert _ldp_kernels.round_rows(X, uniforms, out, d, delta2, float(g), width, portable) == -1
    assert np.array_equal(out.astype(np.int64), ref)
    assert out.max() <= g
    got = pvec.round_counts(X, params, make_rng(3), out.dtype)
    assert got.dtype == out.dtype and np.array_equal(got, out)
    assert np.array_equal(pvec.round_counts(X, params, make_rng(3)), ref)  # int64 by default


@pytest.mark.parametrize("portable", [False, True])
def test_rounding_kernel_stops_at_the_first_row_that_is_not_finite(portable) -> None:
    from shuffledp.mechanisms import _ldp_kernels

    X = np.ones((5, 9))
    U = np.zeros_like(X)
    for bad in (np.nan, np.inf, -np.inf):
        X[3, 8] = bad  # in the tail after the 8-wide lanes, then inside them
        out = np.zeros(X.shape, dtype=np.uint16)
        assert _ldp_kernels.round_rows(X, U, out, 9, 1.0, 100.0, 2, portable) == 3
        X[3, 8], X[3, 2] = 1.0, bad
        assert _ldp_kernels.round_rows(X, U, out, 9, 1.0, 100.0, 2, portable) == 3
        X[3, 2] = 1.0
    params = PvecParams(d=9, n=10, delta2=1.0, g=100, m=50, p=0.5, eps=1.0, delta=1e-6, method="calibrated")
    X[4, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        pvec.round_counts(X, params, make_rng(1))


def test_rounding_kernel_checks_its_buffers_and_parameters() -> None:
    """Memory safety does not rest on the caller: every length and parameter is checked in the kernel."""
    from shuffledp.mechanisms import _ldp_kernels

    X, U, out = np.zeros((4, 3)), np.zeros((4, 3)), np.zeros((4, 3), dtype=np.uint16)
    bad_calls = [
        (X, U, out[:3], 3, 1.0, 100.0, 2),  # out short
        (X[:3], U, out, 3, 1.0, 100.0, 2),  # X short
        (X, U, out, 0, 1.0, 100.0, 2),  # d
        (X, U, out, 3, 0.0, 100.0, 2),  # delta2
        (X, U, out, 3, np.inf, 100.0, 2),
        (X, U, out, 3, 1.0, 100.5, 2),  # g not an integer
        (X, U, out, 3, 1.0, 0.0, 2),
        (X, U, out, 3, 1.0, 65536.0, 2),  # g does not fit the width
        (X, U, out, 3, 1.0, 2.0**53, 8),
        (X, U, out, 3, 1.0, 100.0, 3),  # width
    ]
    for args in bad_calls:
        with pytest.raises(ValueError):
            _ldp_kernels.round_rows(*args)
    with pytest.raises(ValueError, match="dtype"):
        pvec.round_counts(X, PvecParams(3, 10, 1.0, 100, 50, 0.5, 1.0, 1e-6, "calibrated"), make_rng(1), np.int32)


def test_clipping_keeps_the_direction_of_a_row_whose_squares_overflow() -> None:
    """[1e300, -1e300] has a finite norm; clip_rows scaled it by delta2 / inf = 0 (a zero gradient, u = 1/2)."""
    got = clip_rows(np.array([[1e300, -1e300, 0.0], [3.0, 4.0, 0.0]]), 2.0)
    assert np.allclose(got[0], [math.sqrt(2), -math.sqrt(2), 0.0], rtol=1e-15)
    assert np.allclose(got[1], [1.2, 1.6, 0.0], rtol=1e-15)
