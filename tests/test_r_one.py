"""R_1 (l_1 ball via Hadamard): exact privacy ratio, equivalence with the spec's multi-step description,
unbiasedness, variance, Hadamard helpers, fixed messages, vectorization, bad input."""

import functools
import math

import numpy as np
import pytest
from _ldp_stats import (
    CountingRng,
    assert_matches_pmf,
    assert_max_ratio_is_eps0,
    assert_mse_close,
    assert_unbiased,
    assert_variance_in_band,
)
from scipy.linalg import hadamard

from shuffledp.mechanisms import _ldp_kernels, r_one
from shuffledp.security.rng import make_rng

_HADAMARD_DOTS = r_one._hadamard_dots


def input_grid(d: int, r: float, rng: np.random.Generator) -> np.ndarray:
    extreme = np.vstack([np.eye(d) * r, -np.eye(d) * r])  # the l_1 ball's vertices
    interior = rng.uniform(-1, 1, size=(20, d))
    interior *= (r * rng.uniform(0, 1, 20) / np.abs(interior).sum(1))[:, None]
    on_sphere = rng.uniform(-1, 1, size=(10, d))
    on_sphere *= (r / np.abs(on_sphere).sum(1))[:, None]  # ||x||_1 = r, not a vertex
    return np.vstack([extreme, np.zeros((1, d)), interior, on_sphere])


@pytest.mark.parametrize("eps0,d,r", [(0.1, 1, 1.0), (0.5, 3, 1.5), (1.0, 5, 0.2), (2.0, 8, 1.0), (8.0, 6, 3.0)])
def test_exact_ratio_is_eps0_and_attained(eps0, d, r):
    params = r_one.make_params(eps0, d, r)
    probs = r_one.exact_output_probabilities(input_grid(d, r, make_rng(41)), params)
    assert probs.shape[1] == 2 * params.D
    assert_max_ratio_is_eps0(probs, eps0)


def test_probabilities_equal_spec_multistep_mechanism():
    # spec 001 section 3: (j, u=sign x_j) w.p. |x_j|/r, else j ~ Unif[d], u ~ Unif{+-1}; l ~ Unif[D];
    # b = u H[l, j]; keep b w.p. e^eps0/(1+e^eps0). Enumerate every branch.
    eps0, d, r = 0.9, 5, 2.0
    params = r_one.make_params(eps0, d, r)
    D = params.D
    H = hadamard(D)
    keep = math.exp(eps0) / (1 + math.exp(eps0))
    for x in input_grid(d, r, make_rng(42)):
        branches = [(abs(x[j]) / r, j, 1 if x[j] >= 0 else -1) for j in range(d)]
        rest = 1 - np.abs(x).sum() / r
        branches += [(rest / (2 * d), j, u) for j in range(d) for u in (-1, 1)]
        expected = np.zeros(2 * D)
        for w, j, u in branches:
            for l in range(D):
                b = u * H[l, j]
                expected[2 * l + (b > 0)] += w / D * keep
                expected[2 * l + (b < 0)] += w / D * (1 - keep)
        np.testing.assert_allclose(r_one.exact_output_probabilities(x[None], params)[0], expected, atol=1e-14)


def test_sampler_follows_exact_pmf():
    params = r_one.make_params(1.0, 5, 1.0)
    x = np.array([0.5, -0.25, 0.0, 0.125, 0.0])
    msgs = r_one.encode(np.tile(x, (200_000, 1)), params, make_rng(43))
    assert_matches_pmf(msgs, r_one.exact_output_probabilities(x[None], params)[0])


def test_hadamard_helpers_match_scipy():
    for D, d in [(1, 1), (8, 5), (64, 64)]:
        H = hadamard(D)
        np.testing.assert_array_equal(r_one.hadamard_rows_popcount(np.arange(D), d), H[:, :d])
        v = make_rng(44).standard_normal(D)
        np.testing.assert_allclose(r_one.fwht(v), H @ v, atol=1e-12)
    with pytest.raises(ValueError, match="power of 2"):
        r_one.fwht(np.ones(6))


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("d", [1, 2, 3, 5, 7, 8, 9, 64, 100, 129, 255, 256, 257, 1000, 1025, 3000])
def test_kernel_dots_and_l1_match_numpy(d, portable):
    # <x, H_l> and ||x||_1 from the C kernel (AVX2 and portable builds) against numpy on H rows (checked against
    # scipy above); d covers d < 8 (no vector loop), tails, one block (D <= 256) and several blocks with a partial
    # last one. Sums of d terms in another order: |error| <= 1e-13 ||x||_1.
    params = r_one.make_params(1.0, d, 1.0)
    rng = make_rng(52)
    k = 37
    X, rows = rng.standard_normal((k, d)), rng.integers(0, params.D, k)
    X[0] = 0.0
    rows[1], rows[2] = 0, params.D - 1
    expected = np.einsum("ij,ij->i", X, r_one.hadamard_rows_popcount(rows, d))
    l1_expected = np.abs(X).sum(1)
    dots, l1 = r_one._hadamard_dots(X, rows, params, portable=portable)
    np.testing.assert_allclose(dots, expected, rtol=0, atol=1e-13 * l1_expected.max())
    np.testing.assert_allclose(l1, l1_expected, rtol=1e-13)
    X[3, d - 1], X[4, 0], X[5, d // 2] = np.nan, np.inf, -np.inf  # last entry: in the tail loop when d % 8
    l1 = r_one._hadamard_dots(X, rows, params, portable=portable)[1]
    assert np.isnan(l1[3]) and l1[4] == l1[5] == np.inf and np.isfinite(np.delete(l1, [3, 4, 5])).all()


def test_kernel_checks_its_buffers():
    k, d, b = 4, 10, 3
    X, rows, table = np.zeros((k, d)), np.zeros(k, dtype=np.int64), np.ones((8, 8))
    dots, l1 = np.empty(k), np.empty(k)
    _ldp_kernels.hadamard_dots_l1(X, rows, table, dots, l1, d, b)
    for args, what in [
        ((X[:, :9].copy(), rows, table, dots, l1, d, b), "X has"),
        ((X, rows, table, dots[:3], l1, d, b), "dots has"),
        ((X, rows, np.ones((4, 4)), dots, l1, d, b), "table has"),
        ((X, rows, table, dots, l1, 0, b), "d >= 1"),
        ((np.zeros((0, d)), rows[:1], table, dots[:1], l1[:1], 2**61, b), "X has"),  # 2^61 * 8 bytes wraps to 0
    ]:
        with pytest.raises(ValueError, match=what):
            _ldp_kernels.hadamard_dots_l1(*args)
    with pytest.raises(ValueError, match="not C-contiguous"):  # refused, never read with wrong strides
        _ldp_kernels.hadamard_dots_l1(np.zeros((k, 2 * d))[:, ::2], rows, table, dots, l1, d, b)
    frozen = np.empty(k)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="read-write"):  # outputs must be writable
        _ldp_kernels.hadamard_dots_l1(X, rows, table, frozen, l1, d, b)


def test_encode_same_messages_on_both_builds(monkeypatch):
    # Same seed, same draws: the builds' z differ by ~1e-16, so a coin could differ only if a uniform fell that
    # close to its threshold (probability ~1e-13 per user); with the fixed seed the messages must be identical.
    params = r_one.make_params(1.5, 300, 2.0)
    X = make_rng(53).uniform(-1, 1, (3000, 300))
    X *= (2.0 * make_rng(54).uniform(0, 1, 3000) / np.abs(X).sum(1))[:, None]
    X[:10] = 0.0
    X[10:20] = 2.0 * np.eye(300)[:10]  # vertices: |z| = 1, the clamped extremes
    msgs = []
    for portable in (False, True):
        monkeypatch.setattr(r_one, "_hadamard_dots", functools.partial(_HADAMARD_DOTS, portable=portable))
        msgs.append(r_one.encode(X, params, make_rng(55)))
        bad = X[:5].copy()
        bad[3, 7] = 2.5  # l_1 norm 2.5 > radius 2
        with pytest.raises(ValueError, match="row 3 of X has l_1 norm"):
            r_one.encode(bad, params, make_rng(55))
        bad[3, 7] = np.inf
        with pytest.raises(ValueError, match="row 3 of X must be finite"):
            r_one.encode(bad, params, make_rng(55))
    np.testing.assert_array_equal(msgs[0], msgs[1])


@pytest.mark.parametrize(
    "eps0,x", [(1.0, [1.0, -0.5, 0.0, 0.25, 0.2]), (0.5, [0.0] * 5), (3.0, [-2.0, 0.0, 0.0, 0.0, 0.0])]
)
def test_unbiased_variance_mse(eps0, x):
    d, r, n = 5, 2.0, 200_000
    x = np.asarray(x)
    params = r_one.make_params(eps0, d, r)
    Y = r_one.decode(r_one.encode(np.tile(x, (n, 1)), params, make_rng(46)), params)
    var = r_one.variance(x[None], params)[0]
    c = (math.exp(eps0) + 1) / (math.exp(eps0) - 1)
    np.testing.assert_allclose(var, r**2 * c**2 - x**2, rtol=1e-12)
    assert_unbiased(Y, x, var)  # 4 SE
    assert_variance_in_band(Y, var)  # kurtosis-adjusted chi-square band, 4-sigma
    mse = d * (r * c) ** 2 - x @ x  # spec 001 section 3: E||y-x||^2 = d r^2 c^2 - ||x||^2
    assert r_one.mse(x[None], params)[0] == pytest.approx(mse, rel=1e-12)
    assert_mse_close(Y, x, mse)  # 4 SE


def test_decode_sum_mean_match_per_user():
    params = r_one.make_params(1.0, 11, 1.0)
    X = make_rng(47).uniform(-1, 1, (500, 11))
    X /= np.abs(X).sum(1, keepdims=True)
    msgs = r_one.encode(X, params, make_rng(48))
    np.testing.assert_allclose(r_one.decode_sum(msgs, params), r_one.decode(msgs, params).sum(0), atol=1e-9)
    np.testing.assert_allclose(r_one.decode_mean(msgs, params), r_one.decode(msgs, params).mean(0), atol=1e-9)


@pytest.mark.parametrize("d,D,bits,nbytes", [(1, 1, 1, 1), (5, 8, 4, 1), (100, 128, 8, 1), (129, 256, 9, 2)])
def test_fixed_message_format(d, D, bits, nbytes):
    params = r_one.make_params(1.0, d, 1.0)
    fmt = params.message_format
    assert params.D == D and fmt.alphabet_size == 2 * D and fmt.bits == bits == math.ceil(math.log2(d)) + 1
    assert fmt.message_bytes == nbytes
    for X in [np.zeros((30, d)), np.eye(1, d).repeat(30, 0), -np.full((30, d), 1.0 / d)]:
        m = r_one.encode(X, params, make_rng(49))
        assert m.shape == (30,) and m.dtype == fmt.dtype and m.max() < 2 * D
        assert fmt.to_bytes(m).shape == (30, nbytes)


def test_vectorized_10k_users_constant_rng_calls():
    params = r_one.make_params(1.0, 100, 1.0)
    small, big = CountingRng(make_rng(50)), CountingRng(make_rng(50))
    r_one.encode(np.zeros((10, 100)), params, small)
    X = make_rng(51).uniform(-1, 1, (10_000, 100))
    X /= np.abs(X).sum(1, keepdims=True)
    m = r_one.encode(X, params, big)
    assert m.shape == (10_000,) and small.calls == big.calls == 2
    assert r_one.decode_mean(m, params).shape == (100,)


def test_bad_inputs():
    params = r_one.make_params(1.0, 3, 1.0)
    with pytest.raises(ValueError, match="eps0"):
        r_one.make_params(float("nan"), 3, 1.0)
    with pytest.raises(ValueError, match="radius"):
        r_one.make_params(1.0, 3, -2.0)
    with pytest.raises(ValueError, match="l_1 norm"):
        r_one.encode(np.array([[0.5, 0.5, 0.1]]), params, make_rng(1))
    with pytest.raises(ValueError, match=r"shape \(k, 3\)"):
        r_one.encode(np.zeros(3), params, make_rng(1))
    with pytest.raises(ValueError, match="finite"):
        r_one.encode(np.array([[0.0, np.nan, 0.0]]), params, make_rng(1))
    with pytest.raises(ValueError, match="alphabet"):
        r_one.decode(np.array([8]), params)
