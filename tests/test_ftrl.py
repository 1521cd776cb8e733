"""DP-FTRL / DP-FTRLM optimizer (spec 003 sec 2, property 7.4), fed residuals from the noise-only tree."""

import io
import math

import numpy as np
import pytest

from shuffledp.mechanisms.tree_noise import init_tree, residual_noise
from shuffledp.optimizers.base import Optimizer
from shuffledp.optimizers.ftrl import FtrlState, ftrl
from shuffledp.security.rng import make_rng

DIM = 6


def residual_stream(steps: int, seed: int, std: float = 0.7, efficient: bool = True) -> list[np.ndarray]:
    """Released residual means r_t = (g_t + Z_t - Z_{t-1}) / B for a synthetic gradient stream (B = 10)."""
    rng = make_rng(seed)
    state = init_tree(DIM)
    out = []
    for _ in range(steps):
        g = rng.normal(0.0, 1.0, DIM)
        noise, state = residual_noise(state, std, rng, efficient)
        out.append((g + noise) / 10.0)
    return out


def run(opt: Optimizer, theta0: np.ndarray, residuals: list[np.ndarray]):
    state = opt.init(theta0)
    params = opt.query(state)
    iterates = [params]
    for r in residuals:
        params, state = opt.step(r, state, params)
        iterates.append(params)
    return iterates, state


def heavy_ball(theta0: np.ndarray, residuals: list[np.ndarray], eta: float, gamma: float, m0=None):
    theta, m = theta0.copy(), np.zeros_like(theta0) if m0 is None else m0.copy()
    iterates = [theta.copy()]
    for r in residuals:
        m = gamma * m + r
        theta = theta - eta * m
        iterates.append(theta.copy())
    return iterates, m


THETA0 = np.array([0.3, -0.2, 0.1, 0.0, 0.5, -0.4])


@pytest.mark.parametrize("gamma", [0.0, 0.9, 0.5])
def test_equals_sgd_and_heavy_ball_on_residuals(gamma):
    # spec 7.4: DP-FTRL(C = R^p) == SGD with eta = 1/lambda on the residuals; DP-FTRLM == heavy-ball SGD.
    # Both are the same linear recursions summed in another order: agreement to 1e-9 (observed ~1e-13).
    lam = 4.0
    residuals = residual_stream(50, seed=2024)
    got, _ = run(ftrl(lam, gamma), THETA0, residuals)
    want, _ = heavy_ball(THETA0, residuals, 1.0 / lam, gamma)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
    # and the spec's closed form: v_t = gamma v_{t-1} + s_t, theta_{t+1} = theta_0 - v_t / lambda
    v, s = np.zeros(DIM), np.zeros(DIM)
    for t, r in enumerate(residuals, start=1):
        s = s + r
        v = gamma * v + s
        np.testing.assert_allclose(got[t], THETA0 - v / lam, rtol=0, atol=1e-9)


def test_plain_ftrl_is_theta0_minus_prefix_sum():
    residuals = residual_stream(20, seed=7)
    _, state = run(ftrl(2.0), THETA0, residuals)
    s = np.sum(residuals, axis=0)
    np.testing.assert_allclose(state.s, s, rtol=0, atol=1e-12)
    np.testing.assert_allclose(state.v, s, rtol=0, atol=1e-12)  # gamma = 0: v = s
    np.testing.assert_allclose(state.theta, THETA0 - s / 2.0, rtol=0, atol=1e-12)


def test_projection_onto_ball():
    # large residuals push theta_0 - v/lambda far outside; every iterate is the projection of the closed form
    lam, gamma, radius = 0.5, 0.9, 1.0
    residuals = [5.0 * r for r in residual_stream(30, seed=3)]
    got, state = run(ftrl(lam, gamma, radius), THETA0 * 4, residuals)
    assert np.linalg.norm(got[0]) <= radius + 1e-12  # theta_1 = Proj(theta_0), ||theta_0|| = 3.2 > 1
    np.testing.assert_allclose(got[0], THETA0 * 4 / np.linalg.norm(THETA0 * 4), atol=1e-12)
    v = np.zeros(DIM)
    s = np.zeros(DIM)
    outside = 0
    for t, r in enumerate(residuals, start=1):
        s = s + r
        v = gamma * v + s
        raw = THETA0 * 4 - v / lam
        assert np.linalg.norm(got[t]) <= radius * (1 + 1e-12)
        if np.linalg.norm(raw) > radius:
            outside += 1
            np.testing.assert_allclose(got[t], raw / np.linalg.norm(raw), atol=1e-9)  # lazy projection
        else:
            np.testing.assert_allclose(got[t], raw, atol=1e-9)
    assert outside > 0  # the projection was exercised
    # unprojected: the same stream leaves the ball
    free, _ = run(ftrl(lam, gamma), THETA0 * 4, residuals)
    assert max(np.linalg.norm(x) for x in free) > radius


def test_release_and_monitor():
    opt = ftrl(2.0, 0.5)
    residuals = residual_stream(5, seed=4)
    iters, state = run(opt, THETA0, residuals)
    assert np.array_equal(opt.release(state, "last"), iters[-1])
    np.testing.assert_allclose(opt.release(state, "mean"), np.mean(iters[:-1], axis=0), atol=1e-12)
    views = opt.monitor(state)
    np.testing.assert_allclose(views["mean"], np.mean(iters, axis=0), atol=1e-12)
    assert np.array_equal(views["last"], iters[-1])
    fresh = opt.init(THETA0)
    assert np.array_equal(opt.release(fresh, "mean"), THETA0)
    with pytest.raises(ValueError, match="output"):
        opt.release(state, "best")


def test_state_round_trip_continues_identically():
    opt = ftrl(2.5, 0.9, radius=2.0)
    residuals = residual_stream(20, seed=8)
    full, _ = run(opt, THETA0, residuals)
    _, state = run(opt, THETA0, residuals[:7])
    buf = io.BytesIO()
    np.savez(buf, **state.to_arrays())
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        loaded = opt.state_from_arrays(dict(f))
    assert isinstance(loaded, FtrlState) and loaded.steps == 7
    params = opt.query(loaded)
    for t, r in enumerate(residuals[7:], start=8):
        params, loaded = opt.step(r, loaded, params)
        assert np.array_equal(params, full[t])


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.pop("m"), "missing"),
        (lambda a: a.update(v=np.zeros(DIM + 1)), "shape"),
        (lambda a: a.update(steps=np.asarray(-1)), "steps"),
        (lambda a: a.update(steps=np.asarray(1.5)), "steps"),
        (lambda a: a.update(theta=np.full(DIM, np.inf)), "finite"),
    ],
)
def test_bad_state_arrays_rejected(change, match):
    _, state = run(ftrl(1.0), THETA0, residual_stream(3, seed=5))
    a = state.to_arrays()
    FtrlState.from_arrays(dict(a))
    change(a)
    with pytest.raises(ValueError, match=match):
        FtrlState.from_arrays(a)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lam": 0.0}, "lam"),
        ({"lam": -1.0}, "lam"),
        ({"lam": math.inf}, "lam"),
        ({"lam": math.nan}, "lam"),
        ({"lam": 1.0, "momentum": 1.0}, "momentum"),
        ({"lam": 1.0, "momentum": -0.1}, "momentum"),
        ({"lam": 1.0, "momentum": math.nan}, "momentum"),
        ({"lam": 1.0, "radius": 0.0}, "radius"),
        ({"lam": 1.0, "radius": -2.0}, "radius"),
        ({"lam": 1.0, "radius": math.nan}, "radius"),
    ],
)
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ftrl(**kwargs)


def test_step_input_errors():
    opt = ftrl(1.0)
    state = opt.init(THETA0)
    with pytest.raises(ValueError, match="shape"):
        opt.step(np.zeros(DIM + 1), state, THETA0)
    with pytest.raises(ValueError, match="finite"):
        opt.step(np.full(DIM, np.nan), state, THETA0)
    with pytest.raises(ValueError, match="finite"):
        opt.init(np.full(DIM, np.inf))
