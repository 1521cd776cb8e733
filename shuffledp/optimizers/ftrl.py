"""DP-FTRL and DP-FTRLM (spec 003 sec 2, Kairouz et al. 2021 Alg 1) as an optax-style Optimizer.

    opt = ftrl(lam, momentum, radius)
    state = opt.init(theta_0)
    params = opt.query(state)
    params, state = opt.step(r_t, state, params)   # r_t: the released residual mean of round t

The analyzer adds the tree's residual noise Z_t - Z_{t-1} (shuffledp.mechanisms.tree_noise) to the exact round
total and divides by the cohort, so step() receives r_t with prefix sums s_t = sum_{i<=t} r_i = (G_t + Z_t)/B and
the optimizer is noise-free post-processing:

    s_t = s_{t-1} + r_t
    v_t = gamma v_{t-1} + s_t                       (gamma = 0: plain DP-FTRL, v_t = s_t)
    theta_{t+1} = Proj_C(theta_0 - v_t / lambda)    (C = l2 ball of `radius`; inf = R^p, no projection)
    theta_1 = Proj_C(theta_0)                       (Alg 1's first output)

Implementation. v_t is kept as the sum of the heavy-ball buffers, v_t = sum_{i<=t} m_i with m_t = gamma m_{t-1} +
r_t, m_0 = 0. This is the same v: sum_{i<=t} m_i = sum_{j<=t} r_j sum_{i=j}^{t} gamma^{i-j} and
sum_{i<=t} gamma^{t-i} s_i = sum_{j<=t} r_j sum_{i=j}^{t} gamma^{t-i}, equal sums (tests check both forms). The
buffer m makes the spec 7.4 equivalences visible: for C = R^p, theta_{t+1} = theta_0 - (1/lambda) sum_i m_i, i.e.
heavy-ball SGD (theta -= eta m_t, eta = 1/lambda) fed r_t.

Tree restarts need nothing here: the analyzer starts a fresh noise tree and the residuals keep summing, which keeps
theta_0, G and v and adds the old tree's final noise Z_end to the running sum, the centralized repo's restart
(spec 003 sec 2; protocols.tree_round). The FL/TF variant (theta_0 <- theta, sums zeroed) is not offered.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from shuffledp.models import project_l2_ball
from shuffledp.optimizers.base import OUTPUTS, Optimizer

__all__ = ["FtrlState", "ftrl"]


class FtrlState(NamedTuple):
    """steps: rounds done; theta0: the FTRL anchor theta_0; s: sum of the residuals
    so far; v: FTRL(M) accumulator (= s when gamma = 0); m: heavy-ball buffer (v_t - v_{t-1});
    theta: current iterate theta_{t+1}; iterate_sum: sum of the iterates the residuals were taken at ("mean")."""

    steps: int
    theta0: np.ndarray
    s: np.ndarray
    v: np.ndarray
    m: np.ndarray
    theta: np.ndarray
    iterate_sum: np.ndarray

    def mean(self) -> np.ndarray:
        """Average of the query points theta_1..theta_T (the psgd convention); theta_1 before any step."""
        if self.steps == 0:
            return self.theta.copy()
        return self.iterate_sum / self.steps

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {
            "steps": np.asarray(self.steps, dtype=np.int64),
            "theta0": self.theta0,
            "s": self.s,
            "v": self.v,
            "m": self.m,
            "theta": self.theta,
            "iterate_sum": self.iterate_sum,
        }

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> FtrlState:
        vectors = ("theta0", "s", "v", "m", "theta", "iterate_sum")
        missing = {"steps", *vectors} - set(a)
        if missing:
            raise ValueError(f"FTRL state is missing arrays {sorted(missing)}")
        steps = np.asarray(a["steps"])
        if steps.shape != () or not np.issubdtype(steps.dtype, np.integer) or int(steps) < 0:
            raise ValueError(f"FTRL state 'steps' must be an integer scalar >= 0, got {steps!r}")
        arrs = [np.asarray(a[k], dtype=np.float64) for k in vectors]
        shape = arrs[0].shape
        for k, arr in zip(vectors, arrs, strict=True):
            if arr.shape != shape:
                raise ValueError(f"FTRL state {k!r} has shape {arr.shape}, expected {shape} (theta0's)")
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"FTRL state {k!r} must be finite")
        return cls(int(steps), *arrs)


def _project(params: np.ndarray, radius: float) -> np.ndarray:
    return params.copy() if math.isinf(radius) else project_l2_ball(params, radius)


def ftrl(lam: float, momentum: float = 0.0, radius: float = math.inf) -> Optimizer:
    """DP-FTRL (momentum = 0) or DP-FTRLM (0 < momentum < 1) with regularization strength lam = 1/eta.

    step() expects the released residual mean r_t (noise already added, spec 003 sec 1 residual form).
    radius: C = l2 ball of that radius around 0; math.inf for C = R^p.
    """
    lam = float(lam)
    if not (math.isfinite(lam) and lam > 0):
        raise ValueError(f"lam (lambda = 1/learning rate) must be a finite number > 0, got {lam!r}")
    gamma = float(momentum)
    if not (math.isfinite(gamma) and 0.0 <= gamma < 1.0):
        raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
    radius = float(radius)
    if math.isnan(radius) or radius <= 0:
        raise ValueError(f"radius must be > 0 (math.inf for no projection), got {radius!r}")

    def init(params: np.ndarray) -> FtrlState:
        theta0 = np.array(params, dtype=np.float64)
        if not np.all(np.isfinite(theta0)):
            raise ValueError("initial params must be finite")
        zero = np.zeros_like(theta0)
        # theta_1 = argmin_C lambda/2 ||theta - theta_0||^2 = Proj_C(theta_0) (Alg 1)
        return FtrlState(0, theta0, zero, zero.copy(), zero.copy(), _project(theta0, radius), zero.copy())

    def step(grad: np.ndarray, state: FtrlState, params: np.ndarray) -> tuple[np.ndarray, FtrlState]:
        r = np.asarray(grad, dtype=np.float64)
        params = np.asarray(params, dtype=np.float64)
        if r.shape != state.theta.shape or params.shape != state.theta.shape:
            raise ValueError(
                f"grad {r.shape} and params {params.shape} must have the model's shape {state.theta.shape}"
            )
        if not np.all(np.isfinite(r)):
            raise ValueError("grad (residual) must be finite")
        s = state.s + r  # s_t: the noisy prefix sum
        m = gamma * state.m + r  # heavy-ball buffer m_t = v_t - v_{t-1}
        v = state.v + m  # = gamma v_{t-1} + s_t (module docstring)
        theta = _project(state.theta0 - v / lam, radius)  # theta_{t+1} = Proj_C(theta_0 - v_t / lambda)
        new = FtrlState(state.steps + 1, state.theta0, s, v, m, theta, state.iterate_sum + params)
        return theta.copy(), new

    def query(state: FtrlState) -> np.ndarray:
        return state.theta.copy()

    def release(state: FtrlState, output: str) -> np.ndarray:
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        return state.mean() if output == "mean" else state.theta.copy()

    def monitor(state: FtrlState) -> dict[str, np.ndarray]:
        # as psgd: "mean" includes the newest iterate so round 0 already shows a model
        return {"mean": (state.iterate_sum + state.theta) / (state.steps + 1), "last": state.theta.copy()}

    return Optimizer(init, step, query, release, monitor, FtrlState.from_arrays)
