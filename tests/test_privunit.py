"""PrivUnit2 (l_2 ball), quantized: exact calibration (density ratio e^eps0), the sampler's law, unbiasedness,
variance (continuous and quantized), Duchi et al. at gamma = 0, fixed messages, vectorization, bad input."""

import math

import mpmath
import numpy as np
import pytest
from _ldp_stats import (
    CountingRng,
    assert_mse_close,
    assert_unbiased,
    assert_variance_in_band,
)
from scipy import integrate, special, stats

from shuffledp.mechanisms import privunit as pu
from shuffledp.security.rng import make_rng


def t_density(t: float, d: int) -> float:
    # density of <V, u> for V ~ Unif(S^{d-1}): (1-t^2)^((d-3)/2) / B((d-1)/2, 1/2)
    return (1 - t * t) ** ((d - 3) / 2) / special.beta((d - 1) / 2, 0.5)


CASES = [(3, 0.5, 0.1), (5, 1.0, 0.0), (5, 1.0, 0.3), (20, 2.0, 0.2), (100, 4.0, 0.15), (1000, 1.0, 0.05)]


@pytest.mark.parametrize("d,eps0,gamma", CASES)
def test_cap_density_ratio_is_exactly_eps0(d, eps0, gamma):
    params = pu.make_params(eps0, d, 1.0, gamma=gamma)
    # cap mass by numerical integration of the density of <V,u>, independent of the incomplete-beta formula
    P_quad, _ = integrate.quad(t_density, gamma, 1.0, args=(d,), epsabs=0, epsrel=1e-12)
    assert params.cap_mass == pytest.approx(P_quad, rel=1e-9)
    p = params.p_cap
    cap_density, off_density = p / params.cap_mass, (1 - p) / (1 - params.cap_mass)
    assert cap_density / off_density == pytest.approx(math.exp(eps0), rel=1e-12)
    assert cap_density / off_density <= math.exp(eps0) * (1 + 1e-15)
    # m = E<V,u> from the integrals E[t 1{cap}] and E[t 1{off cap}]
    Mc, _ = integrate.quad(lambda t: t * t_density(t, d), gamma, 1.0, epsabs=0, epsrel=1e-12)
    Mo, _ = integrate.quad(lambda t: t * t_density(t, d), -1.0, gamma, epsabs=0, epsrel=1e-12)
    assert params.m == pytest.approx(p * Mc / params.cap_mass + (1 - p) * Mo / (1 - params.cap_mass), rel=1e-9)
    # spec 001 section 3 closed form of m(g)
    e = math.exp(eps0)
    assert params.m == pytest.approx(Mc * (e - 1) / (1 + (e - 1) * params.cap_mass), rel=1e-9)


@pytest.mark.parametrize("d,g", [(5, 0.3), (100, 0.04), (1000, 0.2), (26010, 0.0025), (26010, 0.02)])
def test_cap_mass_against_mpmath(d, g):
    with mpmath.workdps(40):
        exact = mpmath.betainc(mpmath.mpf(1) / 2, mpmath.mpf(d - 1) / 2, mpmath.mpf(g) ** 2, 1, regularized=True) / 2
    assert pu.cap_mass(g, d) == pytest.approx(float(exact), rel=1e-13)


@pytest.mark.parametrize("d,eps0", [(2, 36.0), (3, 20.0), (26010, 36.0), (5, 1e-6), (100, 10.0)])
def test_density_ratio_never_above_eps0_even_at_extremes(d, eps0):
    # exact arithmetic on the float parameters the sampler uses: p_cap (a grid point) and the computed P
    params = pu.make_params(eps0, d, 1.0)
    assert params.p_cap * 2**53 == math.floor(params.p_cap * 2**53)
    with mpmath.workdps(50):
        P, p = mpmath.mpf(params.cap_mass), mpmath.mpf(params.p_cap)
        assert p * (1 - P) / ((1 - p) * P) <= mpmath.exp(mpmath.mpf(eps0))
    assert params.m > 0


def test_d2_cap_mass_is_arccos():
    for g in [0.0, 0.3, 0.9]:
        assert pu.cap_mass(g, 2) == pytest.approx(math.acos(g) / math.pi, rel=1e-12)


@pytest.mark.parametrize("d,eps0", [(2, 1.0), (5, 0.5), (100, 2.0), (26010, 1.0)])
def test_gamma_zero_is_duchi_et_al(d, eps0):
    # Duchi, Jordan, Wainwright: scale r (e+1)/(e-1) sqrt(pi) Gamma((d+1)/2)/Gamma(d/2), hemisphere w.p. e/(e+1)
    params = pu.make_params(eps0, d, 2.0, gamma=0.0)
    e = math.exp(eps0)
    with mpmath.workdps(40):  # Gamma ratio in high precision (lgamma differences lose digits at d ~ 1e4)
        ratio = float(mpmath.gamma(mpmath.mpf(d + 1) / 2) / mpmath.gamma(mpmath.mpf(d) / 2))
    assert params.scale == pytest.approx(2.0 * (e + 1) / (e - 1) * math.sqrt(math.pi) * ratio, rel=1e-12)
    assert params.cap_mass == 0.5 and params.p_cap == pytest.approx(e / (e + 1), rel=1e-15)


@pytest.mark.parametrize("d,eps0", [(5, 1.0), (100, 1.0), (100, 4.0), (26010, 2.0)])
def test_optimal_gamma_beats_neighbours(d, eps0):
    g = pu.optimal_gamma(eps0, d)
    m_opt = pu.make_params(eps0, d, 1.0, gamma=g).m
    # first-order condition: M'(g) = -g f(g), P'(g) = -f(g) give d/dg log m = 0 <=> g = m(g) [derived]
    assert g == pytest.approx(m_opt, rel=1e-6)
    for other in [0.0, 0.5 * g, 0.9 * g, 1.1 * g, min(2 * g, 0.99)]:
        assert m_opt >= pu.make_params(eps0, d, 1.0, gamma=other).m * (1 - 1e-12)


def test_sampler_law_of_t():
    # with ||x|| = r the pre-step keeps u = x/r, so t = <V, u> must follow the truncated laws, cap w.p. p
    d, eps0, gamma, n = 6, 1.0, 0.3, 100_000
    params = pu.make_params(eps0, d, 1.0, gamma=gamma)
    x = np.zeros(d)
    x[2] = 1.0
    V = pu.sample_directions(np.tile(x, (n, 1)), params, make_rng(61))
    np.testing.assert_allclose(np.linalg.norm(V, axis=1), 1.0, atol=1e-12)
    t = V[:, 2]
    cap = t >= gamma
    p = params.p_cap
    assert abs(cap.mean() - p) <= 4 * math.sqrt(p * (1 - p) / n)  # 4 SE
    P = params.cap_mass

    def cdf(s):  # unconditional CDF of t: 1/2 + sign(s) I_{s^2}(1/2, a)/2
        return 0.5 + 0.5 * np.sign(s) * special.betainc(0.5, (d - 1) / 2, s * s)

    # Kolmogorov-Smirnov against the truncated CDFs; reject at p < 1e-4 (fixed seed)
    assert stats.kstest(t[cap], lambda s: (cdf(s) - (1 - P)) / P).pvalue > 1e-4
    assert stats.kstest(t[~cap], lambda s: cdf(s) / (1 - P)).pvalue > 1e-4
    # the orthogonal part is isotropic: each other coordinate has mean 0 and E[V_j^2] = (1 - E t^2)/(d-1)
    rest = np.delete(V, 2, axis=1)
    var_rest = (1 - params.mean_t2) / (d - 1)
    assert_unbiased(rest, np.zeros(d - 1), np.full(d - 1, var_rest))
    assert_variance_in_band(rest, np.full(d - 1, var_rest))


X_CASES = [
    (1.0, [1.0, 0.5, 0.0, 0.0, -0.3]),  # interior
    (2.0, [0.0, 0.0, 0.0, 0.0, 0.0]),  # zero input
    (0.5, [0.0, 1.2, 1.6, 0.0, 0.0]),  # on the sphere ||x|| = r = 2
]


@pytest.mark.parametrize("eps0,x", X_CASES)
def test_continuous_unbiased_variance_mse(eps0, x):
    d, r, n = 5, 2.0, 200_000
    x = np.asarray(x)
    params = pu.make_params(eps0, d, r)
    Y = params.scale * pu.sample_directions(np.tile(x, (n, 1)), params, make_rng(62))
    var = pu.variance(x[None], params)[0]
    assert_unbiased(Y, x, var)  # 4 SE
    assert_variance_in_band(Y, var)  # kurtosis-adjusted chi-square band, 4-sigma
    mse = (r / params.m) ** 2 - x @ x  # spec 001 section 3, ||V|| = 1
    assert pu.mse(x[None], params)[0] == pytest.approx(mse, rel=1e-12)
    assert var.sum() == pytest.approx(mse, rel=1e-9)
    assert_mse_close(Y, x, mse)  # 4 SE


@pytest.mark.parametrize("bits", [2, None])
@pytest.mark.parametrize("eps0,x", X_CASES)
def test_quantized_unbiased_and_mse_within_bound(eps0, x, bits):
    d, r, n = 5, 2.0, 200_000
    x = np.asarray(x)
    params = pu.make_params(eps0, d, r, bits=bits)
    Y = pu.decode(pu.encode(np.tile(x, (n, 1)), params, make_rng(63)), params)
    # per-coordinate variance <= continuous variance + (r/m)^2 Delta^2/4; used as a conservative SE
    var_bound = pu.variance(x[None], params)[0] + params.scale**2 * params.step**2 / 4
    assert_unbiased(Y, x, var_bound)  # 4 SE
    # MSE between the continuous value and the quantization bound (4 SE slack each side)
    assert_mse_close(Y, x, pu.mse(x[None], params)[0], pu.mse_bound(x[None], params)[0])


def test_quantize_is_unbiased_for_a_fixed_vector():
    params = pu.make_params(1.0, 4, 1.0, bits=3)
    v = np.array([0.123, -0.7, 0.999, -1.0])
    n = 200_000
    Q = pu.quantize(np.tile(v, (n, 1)), params, make_rng(64)) * params.step - 1.0
    frac = (v + 1) / params.step - np.floor((v + 1) / params.step)
    var = np.maximum(frac * (1 - frac) * params.step**2, 1e-300)  # exact rounding variance per coordinate
    assert_unbiased(Q, v, var)
    assert Q[:, 3].min() == -1.0 and Q[:, 3].max() == -1.0  # a grid point is never moved


def test_default_bits_and_overhead():
    assert pu.default_bits(100) == 7 and pu.default_bits(26010) == 11
    for d in [2, 5, 100, 26010]:
        params = pu.make_params(1.0, d, 1.0)
        assert d * params.step**2 / 4 <= 0.01  # at most 1% extra E||V||^2


@pytest.mark.parametrize("d", [2, 5, 100])
def test_fixed_message_format(d):
    params = pu.make_params(1.0, d, 1.0)
    fmt = params.message_format
    assert fmt.symbols == d and fmt.alphabet_size == 2**params.bits and fmt.bits == d * params.bits
    e1 = np.eye(1, d)
    for X in [np.zeros((20, d)), np.repeat(e1, 20, 0), np.repeat(-0.3 * e1, 20, 0)]:
        m = pu.encode(X, params, make_rng(65))
        assert m.shape == (20, d) and m.dtype == fmt.dtype and m.max() < fmt.alphabet_size
        raw = fmt.to_bytes(m)
        assert raw.shape == (20, fmt.message_bytes)
        np.testing.assert_array_equal(pu.validate_messages(fmt.from_bytes(raw), params), m)


def test_decode_sum_mean_match_per_user():
    params = pu.make_params(2.0, 30, 1.0)
    X = make_rng(66).standard_normal((400, 30))
    X /= np.linalg.norm(X, axis=1, keepdims=True) * 1.5
    msgs = pu.encode(X, params, make_rng(67))
    np.testing.assert_allclose(pu.decode_sum(msgs, params), pu.decode(msgs, params).sum(0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(pu.decode_mean(msgs, params), pu.decode(msgs, params).mean(0), rtol=1e-9, atol=1e-9)


def test_vectorized_10k_users_constant_rng_calls():
    params = pu.make_params(1.0, 100, 1.0)
    small, big = CountingRng(make_rng(68)), CountingRng(make_rng(68))
    pu.encode(np.zeros((10, 100)), params, small)
    X = make_rng(69).standard_normal((10_000, 100))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    m = pu.encode(X, params, big)
    assert m.shape == (10_000, 100) and small.calls == big.calls == 5
    assert np.isfinite(pu.decode_mean(m, params)).all()


def test_bad_inputs():
    params = pu.make_params(1.0, 3, 1.0)
    for kwargs, match in [
        (dict(eps0=0.0, d=3, radius=1.0), "eps0"),
        (dict(eps0=1.0, d=1, radius=1.0), r"d must be in \[2"),
        (dict(eps0=1.0, d=3, radius=-1.0), "radius"),
        (dict(eps0=1.0, d=3, radius=1.0, gamma=1.0), r"gamma must be in \[0, 1\)"),
        (dict(eps0=1.0, d=3, radius=1.0, gamma=-0.1), "gamma"),
        (dict(eps0=1.0, d=3, radius=1.0, bits=0), r"bits must be in \[1, 16\]"),
        (dict(eps0=1.0, d=3, radius=1.0, bits=17), "bits"),
        (dict(eps0=1.0, d=10_000, radius=1.0, gamma=0.9999), "cap of mass"),
    ]:
        with pytest.raises(ValueError, match=match):
            pu.make_params(**kwargs)
    with pytest.raises(ValueError, match="l_2 norm"):
        pu.encode(np.array([[0.8, 0.8, 0.0]]), params, make_rng(1))
    for bad in [np.inf, np.nan]:
        with pytest.raises(ValueError, match="finite"):
            pu.encode(np.array([[0.0, bad, 0.0]]), params, make_rng(1))
    with pytest.raises(ValueError, match="alphabet"):
        pu.decode(np.full((1, 3), params.levels), params)
    with pytest.raises(ValueError, match="shape"):
        pu.decode(np.zeros((2, 4), dtype=np.uint8), params)
