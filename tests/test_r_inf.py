"""R_inf (l_inf ball): exact privacy ratio, equivalence with the spec's two-step description, unbiasedness,
variance, fixed messages, vectorization, bad input."""

import itertools
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

from shuffledp.mechanisms import _ldp_kernels, r_inf
from shuffledp.security.rng import make_rng


def input_grid(d: int, r: float, rng: np.random.Generator) -> np.ndarray:
    vertices = np.array(list(itertools.product([-r, r], repeat=d)))  # extreme points of the cube
    faces = np.vstack([np.eye(d) * r, -np.eye(d) * r, np.zeros((1, d))])
    interior = rng.uniform(-r, r, size=(20, d))
    return np.vstack([vertices, faces, interior])


@pytest.mark.parametrize("eps0,d,r", [(0.1, 1, 1.0), (0.5, 3, 1.5), (1.0, 3, 0.2), (2.0, 4, 1.0), (8.0, 2, 3.0)])
def test_exact_ratio_is_eps0_and_attained(eps0, d, r):
    params = r_inf.make_params(eps0, d, r)
    probs = r_inf.exact_output_probabilities(input_grid(d, r, make_rng(31)), params)
    assert probs.shape[1] == 2 * d
    assert_max_ratio_is_eps0(probs, eps0)


def test_probabilities_equal_spec_two_step_mechanism():
    # spec 001 section 3: j ~ Unif[d]; b = +1 w.p. (1 + x_j/r)/2; keep w.p. e^eps0/(1+e^eps0)
    eps0, d, r = 1.2, 3, 2.0
    params = r_inf.make_params(eps0, d, r)
    keep = math.exp(eps0) / (1 + math.exp(eps0))
    for x in input_grid(d, r, make_rng(32)):
        expected = np.zeros(2 * d)
        for j in range(d):
            pb = (1 + x[j] / r) / 2
            expected[2 * j + 1] = (pb * keep + (1 - pb) * (1 - keep)) / d
            expected[2 * j] = ((1 - pb) * keep + pb * (1 - keep)) / d
        np.testing.assert_allclose(r_inf.exact_output_probabilities(x[None], params)[0], expected, atol=1e-14)


def test_sampler_follows_exact_pmf():
    params = r_inf.make_params(1.0, 4, 1.0)
    x = np.array([1.0, -0.5, 0.0, 0.25])
    msgs = r_inf.encode(np.tile(x, (200_000, 1)), params, make_rng(33))
    assert_matches_pmf(msgs, r_inf.exact_output_probabilities(x[None], params)[0])


@pytest.mark.parametrize(
    "eps0,x", [(1.0, [1.0, -0.5, 0.0, 0.25, 0.9]), (0.5, [0.0] * 5), (3.0, [-2.0, 2.0, 1.0, -1.0, 0.3])]
)
def test_unbiased_variance_mse(eps0, x):
    d, r, n = 5, 2.0, 200_000
    x = np.asarray(x)
    params = r_inf.make_params(eps0, d, r)
    Y = r_inf.decode(r_inf.encode(np.tile(x, (n, 1)), params, make_rng(34)), params)
    var = r_inf.variance(x[None], params)[0]
    c = (math.exp(eps0) + 1) / (math.exp(eps0) - 1)
    np.testing.assert_allclose(var, d * r**2 * c**2 - x**2, rtol=1e-12)  # spec closed form, independent of code
    assert_unbiased(Y, x, var)  # 4 SE
    assert_variance_in_band(Y, var)  # kurtosis-adjusted chi-square band, 4-sigma
    mse = (d * r * c) ** 2 - x @ x  # spec 001 section 3: E||y-x||^2 = d^2 r^2 c^2 - ||x||^2
    assert r_inf.mse(x[None], params)[0] == pytest.approx(mse, rel=1e-12)
    assert_mse_close(Y, x, mse)  # 4 SE


def test_decode_sum_mean_match_per_user():
    params = r_inf.make_params(1.0, 7, 1.0)
    X = make_rng(35).uniform(-1, 1, (500, 7))
    msgs = r_inf.encode(X, params, make_rng(36))
    np.testing.assert_allclose(r_inf.decode_sum(msgs, params), r_inf.decode(msgs, params).sum(0), atol=1e-9)
    np.testing.assert_allclose(r_inf.decode_mean(msgs, params), r_inf.decode(msgs, params).mean(0), atol=1e-9)


@pytest.mark.parametrize("d,bits,nbytes", [(1, 1, 1), (5, 4, 1), (100, 8, 1), (128, 8, 1), (129, 9, 2)])
def test_fixed_message_format(d, bits, nbytes):
    params = r_inf.make_params(1.0, d, 1.0)
    fmt = params.message_format
    assert fmt.alphabet_size == 2 * d and fmt.bits == bits == math.ceil(math.log2(d)) + 1
    assert fmt.message_bytes == nbytes
    for X in [np.zeros((30, d)), np.ones((30, d)), -np.ones((30, d))]:
        m = r_inf.encode(X, params, make_rng(37))
        assert m.shape == (30,) and m.dtype == fmt.dtype and m.max() < 2 * d
        assert r_inf.validate_messages(m, params) is not None
        assert fmt.to_bytes(m).shape == (30, nbytes)


def test_vectorized_10k_users_constant_rng_calls():
    params = r_inf.make_params(1.0, 100, 1.0)
    small, big = CountingRng(make_rng(38)), CountingRng(make_rng(38))
    r_inf.encode(np.zeros((10, 100)), params, small)
    m = r_inf.encode(make_rng(39).uniform(-1, 1, (10_000, 100)), params, big)
    assert m.shape == (10_000,) and small.calls == big.calls == 2
    assert r_inf.decode_mean(m, params).shape == (100,)


def test_bad_inputs():
    params = r_inf.make_params(1.0, 3, 1.0)
    for kwargs, match in [
        (dict(eps0=-1.0, d=3, radius=1.0), "eps0"),
        (dict(eps0=1.0, d=0, radius=1.0), "d must be"),
        (dict(eps0=1.0, d=3, radius=0.0), "radius"),
        (dict(eps0=1.0, d=3.5, radius=1.0), "d must be an integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            r_inf.make_params(**kwargs)
    with pytest.raises(ValueError, match="l_inf norm"):
        r_inf.encode(np.array([[0.0, 1.1, 0.0]]), params, make_rng(1))
    with pytest.raises(ValueError, match=r"shape \(k, 3\)"):
        r_inf.encode(np.zeros((2, 4)), params, make_rng(1))
    for bad in [np.inf, -np.inf, np.nan]:
        with pytest.raises(ValueError, match="finite"):
            r_inf.encode(np.array([[0.0, 0.0, 0.0], [0.0, bad, 0.0]]), params, make_rng(1))
    with pytest.raises(ValueError, match="alphabet"):
        r_inf.decode(np.array([0, 6]), params)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("d", [1, 3, 8, 9, 17, 100])
def test_norm_check_kernel_flags_exactly_the_rows_outside(d, portable):
    # rows_over (C, both builds) against numpy's ~(|x| <= bound).all(): entries exactly at the bound pass, the next
    # double above and any NaN/inf fail, wherever they sit (vector loop or tail), and -0.0 is 0.
    bound = 0.75
    up = np.nextafter(bound, np.inf)
    values = [0.0, -0.0, bound, -bound, up, -up, np.nan, -np.nan, np.inf, -np.inf, 1e300, 5e-324]
    rows = [np.zeros(d)]
    for v, j in itertools.product(values, sorted({0, d // 2, d - 1})):
        row = make_rng(60).uniform(-bound, bound, d)
        row[j] = v
        rows.append(row)
    X = np.array(rows)
    over = np.empty(X.shape[0], dtype=bool)
    _ldp_kernels.rows_over(X, over, d, bound, portable)
    np.testing.assert_array_equal(over, ~(np.abs(X) <= bound).all(axis=1))
    assert over.sum() == 7 * len({0, d // 2, d - 1})  # up, -up, 2 NaN, 2 inf, 1e300; no false alarm
    with pytest.raises(ValueError, match="finite bound"):
        _ldp_kernels.rows_over(X, over, d, np.inf, portable)
    with pytest.raises(ValueError, match="X has"):
        _ldp_kernels.rows_over(X, over[:-1], d, bound, portable)
    with pytest.raises(ValueError, match="X has"):  # 1 row of 2^61 doubles = 2^64 bytes, which wraps to 0
        _ldp_kernels.rows_over(np.zeros((0, d)), over[:1], 2**61, bound, portable)


def test_encode_names_the_first_row_outside_the_ball():
    params = r_inf.make_params(1.0, 20, 0.5)
    X = make_rng(61).uniform(-0.5, 0.5, (50, 20))
    X[17, 19] = np.nextafter(0.5 * (1 + 1e-9), 1.0)  # just above the slack: refused
    X[30, 0] = 0.5 * (1 + 1e-10)  # within the slack: accepted
    with pytest.raises(ValueError, match="row 17 of X has l_inf norm"):
        r_inf.encode(X, params, make_rng(1))
    X[17, 19] = 0.5
    assert r_inf.encode(X, params, make_rng(1)).shape == (50,)
