"""CLDP-SGD's server update (spec 001 sec 2): projected SGD with a step-change learning rate."""

import numpy as np
import pytest

from shuffledp.optimizers.sgd import sgd, step_learning_rate


def test_step_changes_multiply_the_learning_rate_after_each_listed_round():
    assert [step_learning_rate(1.0, (2, 4), 0.1, t) for t in range(6)] == pytest.approx(
        [1.0, 1.0, 0.1, 0.1, 0.01, 0.01]
    )
    opt = sgd(1.0, radius=100.0, lr_steps=(2,), lr_step_factor=0.5)
    theta = np.zeros(2)
    state = opt.init(theta)
    moves = []
    for _ in range(4):
        new, state = opt.step(np.array([1.0, 0.0]), state, theta)
        moves.append(float(theta[0] - new[0]))
        theta = new
    assert moves == pytest.approx([1.0, 1.0, 0.5, 0.5])  # eta_t = 1 for t < 2, then 0.5
    assert np.array_equal(opt.release(state, "last"), theta) and np.array_equal(opt.query(state), theta)
    np.testing.assert_allclose(opt.release(state, "mean"), np.array([-1.375, 0.0]))  # mean(0, -1, -2, -2.5)


def test_iterates_stay_in_the_ball_and_bad_arguments_are_refused():
    opt = sgd(10.0, radius=0.5)
    theta = np.zeros(3)
    state = opt.init(theta)
    for g in np.eye(3) * 7:
        theta, state = opt.step(g, state, theta)
        assert np.linalg.norm(theta) <= 0.5
    with pytest.raises(ValueError, match="lr_step_factor"):
        sgd(1.0, 1.0, (3,), 0.0)
    with pytest.raises(ValueError, match="learning_rate"):
        sgd(-1.0, 1.0)
