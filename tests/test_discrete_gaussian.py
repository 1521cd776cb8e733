"""The exact discrete Gaussian (CKS20) and its use as the central protocols' noise (issue 24 item D19).

Statistical checks use fixed seeds and state their tolerances (about 5 standard errors unless said otherwise).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from shuffledp.mechanisms import discrete_gaussian as dg
from shuffledp.protocols.gaussian_round import GaussianRound
from shuffledp.protocols.mu2_round import Mu2Round
from shuffledp.protocols.pan_round import PanRound
from shuffledp.protocols.tree_round import TreeRound
from shuffledp.security.rng import make_rng


# --------------------------------------------------------------------------------------------- the sampler
@pytest.mark.parametrize(("num", "den"), [(0, 1), (1, 3), (1, 1), (7, 5), (3, 1), (2**90 // 3, 2**90)])
def test_bernoulli_exp_has_probability_exp_minus_gamma(num, den):
    n = 200_000
    hits = dg.bernoulli_exp(np.full(n, num, dtype=object if num > 2**62 else np.int64), den, make_rng(1))
    p = math.exp(-num / den)
    assert abs(hits.mean() - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12  # 5 standard errors


def test_discrete_laplace_ratio():
    # P(x+1)/P(x) = exp(-1/t) for x >= 0; t = 3, 400k draws; checked on the empirical counts of x = 0..5
    t, n = 3, 400_000
    x = dg.discrete_laplace(t, n, make_rng(2))
    counts = np.array([(x == k).sum() for k in range(7)], dtype=float)
    ratios = counts[1:] / counts[:-1]
    assert np.allclose(ratios, math.exp(-1 / t), rtol=0.03)  # ~3 standard errors at these counts
    assert abs(x.mean()) < 5 * x.std() / math.sqrt(n)


def test_discrete_gaussian_probability_ratio_mean_and_variance():
    """P(x)/P(x+1) = exp((2x+1)/(2 s2)) on the empirical distribution (s2 = 4, 10^6 draws, seed 3): for x = 0..3 the
    relative error of each ratio is within 4 standard errors of the log-ratio (sqrt(1/c_x + 1/c_{x+1})); mean 0 and
    variance within 5 standard errors (the variance of DG(4) is 4 up to 1e-8, CKS20 Prop 19)."""
    s2, n = 4, 1_000_000
    z = dg.sample_discrete_gaussian(s2, n, make_rng(3))
    counts = {k: int((z == k).sum()) for k in range(-6, 7)}
    for x in range(4):
        want = (2 * x + 1) / (2 * s2)
        got = math.log(counts[x] / counts[x + 1])
        se = math.sqrt(1 / counts[x] + 1 / counts[x + 1])
        assert abs(got - want) < 4 * se, (x, got, want)
        assert abs(math.log(counts[-x] / counts[-x - 1]) - want) < 4 * se  # symmetric
    assert abs(z.mean()) < 5 * math.sqrt(s2 / n)
    # Var of the sample variance ~ (m4 - s^4)/n = 2 s2^2 / n for a near-Gaussian law
    assert abs(z.var() - s2) < 5 * math.sqrt(2 * s2**2 / n)


def test_large_variance_is_exact_integers_with_the_right_spread():
    s2, n = 2**60, 200_000
    z = dg.sample_discrete_gaussian(s2, n, make_rng(4))
    assert z.dtype == np.int64
    assert abs(z.var() / s2 - 1) < 5 * math.sqrt(2 / n)
    assert abs(z.mean()) < 5 * math.sqrt(s2 / n)


def test_the_sampler_uses_only_the_injected_generator():
    a = dg.sample_discrete_gaussian(1000, 50, make_rng(9))
    b = dg.sample_discrete_gaussian(1000, 50, make_rng(9))
    assert np.array_equal(a, b)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="variance parameter"):
        dg.sample_discrete_gaussian(0, 3, make_rng(1))
    with pytest.raises(ValueError, match="power of two"):
        dg.release_on_grid(np.zeros(3), 1.0, 1.0, make_rng(1), granularity=0.3)
    with pytest.raises(ValueError, match="finite"):
        dg.release_on_grid(np.array([np.nan]), 1.0, 1.0, make_rng(1))


# ----------------------------------------------------------------------------- the grid and the accounting
def test_release_is_on_the_grid_whatever_the_input():
    """Mironov's attack reads the input off the output's low bits; here every output is an exact multiple of g
    (a power of two), so the set of possible outputs does not depend on the input."""
    rng = make_rng(5)
    x = np.random.default_rng(0).normal(size=1000) * 3.7
    out = dg.release_on_grid(x, 2.0, 1.0, rng)
    g = dg.default_granularity(2.0, 1.0, 1000)
    assert np.array_equal(out / g, np.rint(out / g))
    assert g <= 2.0**-20 / math.sqrt(1000) and g <= 2.0 * 2**-16


@pytest.mark.parametrize(("std", "sens", "d"), [(1.0, 1.0, 10_000), (5.0, 2.0, 650), (1e-6, 1e3, 7), (1e4, 1e-3, 100)])
def test_noise_covers_the_rounding_sensitivity_growth(std, sens, d):
    """The ledger charges std / D; the rounded query has sensitivity D' = D + g ceil(sqrt d), and the discrete
    Gaussian's std on it is g sqrt(s2) >= std D' / D: its RDP is at most what the ledger charges (CKS20 Prop 5)."""
    g = dg.default_granularity(std, sens, d)
    s2 = dg.grid_variance(std, sens, d, g)
    d_rounded = sens + g * math.isqrt(d - 1) + g
    assert g * math.sqrt(s2) / d_rounded >= std / sens * (1 - 1e-15)
    assert g * math.sqrt(s2) <= std * d_rounded / sens + g  # no more than that (s2 is rounded up to an integer)
    if std / sens < 2**12 / math.sqrt(d):  # z not huge: the default grid keeps the inflation below 2^-20
        assert g * math.sqrt(s2) <= std * (1 + 2**-19)


def test_rounding_can_grow_the_sensitivity_by_g_sqrt_d():
    """Why the inflation is needed: two sums at distance D can round to points at distance D + g sqrt(d) - ."""
    g, d = 1.0, 100
    a = np.full(d, 0.5 - 1e-9)  # rounds down to 0
    b = a + 1.0 / math.sqrt(d) * (1 + 1e-9)  # distance ~1, rounds up to 1 in every coordinate
    assert np.linalg.norm(b - a) <= 1.0 + 1e-6
    assert np.linalg.norm(dg.round_to_grid(b, g) - dg.round_to_grid(a, g)) == pytest.approx(math.sqrt(d))


# ------------------------------------------------------------------------------ the protocols' add_noise
def _is_on_grid(x: np.ndarray, g: float) -> bool:
    return bool(np.array_equal(x / g, np.rint(x / g)))


def test_gaussian_round_adds_discrete_noise_of_the_planned_std():
    d, clip, z, k = 20_000, 1.0, 1.3, 10
    params = {"d": d, "clip": clip, "k": k, "n": 100, "delta": 1e-6, "noise_multiplier": z}
    total = np.random.default_rng(1).normal(size=d) * 0.01
    out, div, _ = GaussianRound().add_noise(total, 0, {}, params, None, make_rng(6), k)
    g = dg.default_granularity(z * clip, clip, d)
    assert div == k and _is_on_grid(out, g)
    noise = out - total
    assert abs(noise.std() / (z * clip) - 1) < 5 / math.sqrt(2 * d)  # 5 standard errors of a sample std


def test_gaussian_round_honours_a_plan_granularity():
    params = {"d": 4, "clip": 1.0, "k": 1, "n": 2, "delta": 1e-6, "noise_multiplier": 1.0, "granularity": 2.0**-8}
    out, _, _ = GaussianRound().add_noise(np.full(4, 0.3), 0, {}, params, None, make_rng(6), 1)
    assert _is_on_grid(out, 2.0**-8)


def test_tree_round_leaves_and_nodes_are_on_the_grid():
    d, clip, z = 50, 1.0, 2.0
    params = {"d": d, "clip": clip, "k": 4, "noise_multiplier": z, "rounds_per_tree": 8, "efficient": False}
    params["completion"] = False
    proto = TreeRound()
    state = proto.noise_state({"params": params})
    g = TreeRound._grid(params)
    rng = make_rng(7)
    for r in range(5):
        out, _, state = proto.add_noise(np.random.default_rng(r).normal(size=d), r, {}, params, state, rng, 4)
        assert _is_on_grid(out, g)
        assert _is_on_grid(state.tree.values, g)


def test_mu2_trusted_and_pan_release_on_the_grid():
    d = 30
    p = {"d": d, "clip": 1.0, "machines": 3, "sigma": 0.5}
    out, _, _ = Mu2Round(trusted=True).add_noise(np.ones(d) * 0.123, 0, {}, p, None, make_rng(8), 3)
    assert _is_on_grid(out, dg.default_granularity(1.5, 1.0, d))
    pp = {"d": d, "clip": 1.0, "B": 4, "zeta": 0.2}
    out, _, _ = PanRound().add_noise(np.ones(d) * 0.123, 0, {}, pp, None, make_rng(8), 4)
    assert _is_on_grid(out, PanRound._grid(pp))


def test_ten_thousand_coordinates_take_well_under_a_second():
    import time

    t0 = time.perf_counter()
    dg.release_on_grid(np.zeros(10_000), 1.0, 1.0, make_rng(10))
    assert time.perf_counter() - t0 < 2.0  # ~0.07 s measured on the 2-core CI machine
