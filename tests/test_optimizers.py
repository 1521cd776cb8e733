"""PSGD / PGD: convergence without noise, projection, averaging, step-size rules."""

import math

import numpy as np
import pytest

from shuffledp.models import make_model
from shuffledp.optimizers.pgd import pgd, pgd_round_privacy
from shuffledp.optimizers.pgd import theory_learning_rate as pgd_lr
from shuffledp.optimizers.psgd import psgd, theory_learning_rate
from shuffledp.security.rng import make_rng


def test_pgd_noise_off_converges_to_known_least_squares_optimum():
    rng = make_rng(5)
    X = rng.normal(size=(200, 3))
    w_star = np.array([0.5, -0.3, 0.2, 0.1])  # last entry = bias
    y = X @ w_star[:3] + w_star[3]
    model = make_model("leastsq", 3, 1)
    opt = pgd(learning_rate=0.5, radius=5.0)
    params = model.init_params()
    state = opt.init(params)
    for _ in range(300):
        params, state = opt.step(model.gradient(params, X, y), state, params)
    np.testing.assert_allclose(params, w_star, atol=1e-6)  # last iterate: GD on a strongly convex quadratic
    # the averaged output converges at rate O(1/T): within 0.05 after 300 steps here
    assert np.linalg.norm(state.mean() - w_star) < 0.05
    assert state.steps == 300 and np.array_equal(state.last, params)


def test_psgd_noise_off_converges_on_distance_loss_with_fresh_batches():
    # the spec 000 sec 7 item 9 test problem: 1/2 ||th - x||^2 with x uniform in a ball; optimum = mean of x
    rng = make_rng(6)
    center = np.array([0.3, -0.2, 0.1])
    T, B = 400, 25
    xs = center + 0.5 * rng.uniform(-1, 1, size=(T, B, 3))
    opt = psgd(theory_learning_rate(diameter=2.0, lipschitz=1.5, rounds=T, noise_sq=0.0, batch=B), radius=1.0)
    th = np.zeros(3)
    state = opt.init(th)
    for t in range(T):
        th, state = opt.step(th - xs[t].mean(axis=0), state, th)  # fresh cohort each round
    # tolerance: the average over T rounds of O(1/sqrt(T)) SGD error; 0.05 is > 4x the observed spread
    assert np.linalg.norm(state.mean() - center) < 0.05


def test_projection_keeps_iterates_in_ball_even_with_huge_steps():
    rng = make_rng(7)
    opt = psgd(learning_rate=100.0, radius=0.7)
    th = np.zeros(5)
    state = opt.init(th)
    for _ in range(50):
        th, state = opt.step(rng.normal(size=5) * 10, state, th)
        assert np.linalg.norm(th) <= 0.7
    assert np.linalg.norm(state.mean()) <= 0.7 + 1e-12  # a mean of points in a convex set stays in it


def test_optimum_outside_ball_converges_to_its_projection():
    target = np.array([3.0, 4.0])  # norm 5, ball radius 1 -> constrained optimum (0.6, 0.8)
    opt = pgd(0.3, 1.0)
    th = np.zeros(2)
    state = opt.init(th)
    for _ in range(200):
        th, state = opt.step(th - target, state, th)
    np.testing.assert_allclose(th, [0.6, 0.8], atol=1e-9)


def test_mean_of_iterates_excludes_the_final_one():
    opt = pgd(1.0, 10.0)
    th = np.zeros(1)
    state = opt.init(th)
    for _ in range(3):
        th, state = opt.step(np.array([-1.0]), state, th)
    # iterates theta_0..theta_2 = 0, 1, 2 (Alg 3/5 output mean(theta_0..theta_{T-1})); last = 3
    assert state.mean()[0] == 1.0 and state.last[0] == 3.0


def test_step_size_rules_and_pgd_round_budget():
    assert math.isclose(theory_learning_rate(2.0, 1.0, 4, 0.0, 10), 1.0)
    # noise raises L_G: L_G^2 = 1 + 300/10^2 = 4 -> eta halves
    assert math.isclose(theory_learning_rate(2.0, 1.0, 4, 300.0, 10), 0.5)
    assert math.isclose(pgd_lr(2.0, 1.0, 4, 300.0, 10), 0.5)
    eps_r, delta_r = pgd_round_privacy(1.0, 1e-6, 15)
    # spec 000 sec 4: eps_r = eps / (2 sqrt(2 T ln(1/delta))) (0.0246 for the sec 8 example), delta_r = delta/(T+1)
    assert math.isclose(eps_r, 1 / (2 * math.sqrt(30 * math.log(1e6))), rel_tol=1e-12) and eps_r <= 0.0246
    assert delta_r == 1e-6 / 16
    with pytest.raises(ValueError, match="learning_rate"):
        psgd(0.0, 1.0)
    with pytest.raises(ValueError, match="grad"):
        pgd(1.0, 1.0).step(np.array([np.nan]), pgd(1.0, 1.0).init(np.zeros(1)), np.zeros(1))
