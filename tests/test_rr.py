"""Binary randomized response (2RR): exact privacy ratio, unbiasedness, variance, fixed messages, vectorization."""

import math

import numpy as np
import pytest
from _ldp_stats import (
    CountingRng,
    assert_matches_pmf,
    assert_max_ratio_is_eps0,
    assert_unbiased,
    assert_variance_in_band,
)

from shuffledp.mechanisms import rr
from shuffledp.security.rng import make_rng

EPS = [0.1, 0.5, 1.0, 2.0, 4.0, 8.0]


@pytest.mark.parametrize("eps0", EPS)
def test_exact_ratio_is_eps0_and_attained(eps0):
    params = rr.make_params(eps0)
    x = np.array([0.0, 1.0, 0.5, 0.25, 0.9, 1e-9])  # both bits (extreme points) and fractions
    assert_max_ratio_is_eps0(rr.exact_output_probabilities(x, params), eps0)


def test_probabilities_match_textbook_2rr():
    # keep the bit w.p. e^eps0/(1+e^eps0) (spec 001 section 3, 2RR)
    params = rr.make_params(1.3)
    probs = rr.exact_output_probabilities(np.array([0.0, 1.0]), params)
    keep = math.exp(1.3) / (1 + math.exp(1.3))
    np.testing.assert_allclose(probs, [[keep, 1 - keep], [1 - keep, keep]], rtol=1e-14)


@pytest.mark.parametrize("x0", [0.0, 1.0, 0.3])
def test_sampler_follows_exact_pmf(x0):
    params = rr.make_params(0.7)
    msgs = rr.encode(np.full(100_000, x0), params, make_rng(21))
    assert_matches_pmf(msgs, rr.exact_output_probabilities(np.array([x0]), params)[0])


@pytest.mark.parametrize("eps0,x0", [(0.5, 0.0), (1.0, 1.0), (2.0, 0.3)])
def test_unbiased_and_variance(eps0, x0):
    params = rr.make_params(eps0)
    n = 200_000
    y = rr.decode(rr.encode(np.full(n, x0), params, make_rng(22)), params)[:, None]
    var = rr.variance(np.array([x0]), params)
    if x0 in (0.0, 1.0):  # closed form e^eps0/(e^eps0-1)^2 for a bit [derived]
        assert var[0] == pytest.approx(math.exp(eps0) / math.expm1(eps0) ** 2, rel=1e-12)
    assert_unbiased(y, np.array([x0]), var)  # within 4 SE
    assert_variance_in_band(y, var)  # kurtosis-adjusted chi-square band, 4-sigma
    np.testing.assert_allclose(rr.mse(np.array([x0]), params), var)


def test_decode_sum_and_mean():
    params = rr.make_params(1.0)
    msgs = rr.encode(make_rng(23).random(1000), params, make_rng(24))
    assert rr.decode_sum(msgs, params) == pytest.approx(rr.decode(msgs, params).sum(), rel=1e-12)
    assert rr.decode_mean(msgs, params) == pytest.approx(rr.decode(msgs, params).mean(), rel=1e-12)
    with pytest.raises(ValueError, match="at least one"):
        rr.decode_mean(np.zeros(0, dtype=np.uint8), params)


def test_fixed_message_format():
    params = rr.make_params(1.0)
    fmt = params.message_format
    assert (fmt.symbols, fmt.alphabet_size, fmt.bits, fmt.message_bytes) == (1, 2, 1, 1)
    for x0 in [0.0, 1.0, 0.5]:
        m = rr.encode(np.full(64, x0), params, make_rng(25))
        assert m.shape == (64,) and m.dtype == np.uint8 and set(np.unique(m)) <= {0, 1}
        assert fmt.to_bytes(m).shape == (64, 1)


def test_vectorized_10k_users_constant_rng_calls():
    params = rr.make_params(1.0)
    small, big = CountingRng(make_rng(26)), CountingRng(make_rng(26))
    rr.encode(np.ones(10), params, small)
    m = rr.encode(make_rng(27).random(10_000), params, big)
    assert m.shape == (10_000,) and small.calls == big.calls == 1


def test_bad_inputs():
    params = rr.make_params(1.0)
    with pytest.raises(ValueError, match="eps0"):
        rr.make_params(0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rr.encode(np.array([0.0, 1.5]), params, make_rng(1))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rr.encode(np.array([np.nan]), params, make_rng(1))
    with pytest.raises(ValueError, match=r"shape \(k,\)"):
        rr.encode(np.zeros((2, 2)), params, make_rng(1))
    with pytest.raises(ValueError, match="alphabet"):
        rr.decode(np.array([0, 2]), params)
