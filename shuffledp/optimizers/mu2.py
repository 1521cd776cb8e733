"""DP-mu2-FL's server update (seed 002, Reshef & Levy; spec 002 sections 2-3), optax style.

The machines send q_{t,i} = t d_{t,i} (the mu2-SGD estimator, protocols/mu2_round.py); the analyzer averages them
(and, trusted, adds its noise), then

    w_{t+1} = Pi_K(w_t - eta q~_t)
    x_{t+1} = (1 - 2/(t+2)) x_t + (2/(t+2)) w_{t+1}        (AnyTime weights alpha_t = t, spec 002 sec 0)

with w_1 = x_1 = x_0 = Pi_K(theta_0). The machines take their two gradients at x_t and x_{t-1}, so the broadcast
query is the pair: query(state) = [x_t, x_{t-1}] (shape (2, d)). x_t is itself the AnyTime-weighted average of
w_1..w_t, so it is the released model for either schedule.output (the paper outputs x_T; spec 002 sec 9: x_{T+1}
is equally private, and it is what the state holds after T steps).

Step size (Thm 5.2 / 6.2): eta = min{rho D sqrt(M) / (2 S T sqrt(d)), 1/(4 L T)} untrusted, with M instead of
sqrt(M) trusted. Both privacy terms equal D / sqrt(T E||Y||^2), Y the noise on the averaged q~ (untrusted:
E||Y||^2 = d sigma_u^2 / M, trusted: d sigma_c^2 with sigma_c = sigma_u / M), which is how theory_learning_rate
takes them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from shuffledp.models import project_l2_ball
from shuffledp.optimizers.base import Optimizer

__all__ = ["Mu2State", "mu2", "theory_learning_rate"]


class Mu2State(NamedTuple):
    t: int  # the next step's index (1 before the first)
    w: np.ndarray
    x: np.ndarray  # x_t, where the machines' first gradient is taken
    x_prev: np.ndarray  # x_{t-1} (x_0 = x_1)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"t": np.asarray(self.t), "w": self.w, "x": self.x, "x_prev": self.x_prev}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> Mu2State:
        f = {k: np.asarray(a[k], dtype=np.float64) for k in ("w", "x", "x_prev")}
        return cls(int(a["t"]), **f)


def theory_learning_rate(diameter: float, rounds: int, noise_sq: float, smoothness: float) -> float:
    """min{D / sqrt(T E||Y||^2), 1/(4 L T)} (Thm 5.2 / 6.2, module docstring); L = 0: the first term alone."""
    if not (diameter > 0 and rounds >= 1 and noise_sq > 0 and smoothness >= 0):
        raise ValueError(
            f"need D > 0, T >= 1, noise > 0, L >= 0; got D={diameter}, T={rounds}, noise={noise_sq}, L={smoothness}"
        )
    eta = diameter / math.sqrt(rounds * noise_sq)
    return min(eta, 1.0 / (4.0 * smoothness * rounds)) if smoothness > 0 else eta


def mu2(learning_rate: float, radius: float) -> Optimizer:
    """The AnyTime-averaged projected update of DP-mu2-FL (module docstring)."""
    if not (math.isfinite(learning_rate) and learning_rate > 0 and math.isfinite(radius) and radius > 0):
        raise ValueError(f"need a finite learning_rate > 0 and radius > 0, got {learning_rate}, {radius}")

    def init(theta0: np.ndarray) -> Mu2State:
        x = project_l2_ball(np.asarray(theta0, dtype=np.float64).ravel(), radius)
        return Mu2State(1, x.copy(), x.copy(), x.copy())

    def query(state: Mu2State) -> np.ndarray:
        return np.stack([state.x, state.x_prev])

    def step(q_mean: np.ndarray, state: Mu2State, params: np.ndarray) -> tuple[np.ndarray, Mu2State]:
        q_mean = np.asarray(q_mean, dtype=np.float64)
        if q_mean.shape != state.w.shape or not np.all(np.isfinite(q_mean)):
            raise ValueError(f"the averaged message must be {state.w.shape[0]} finite values, got {q_mean.shape}")
        t = state.t
        w = project_l2_ball(state.w - learning_rate * q_mean, radius)
        x = (1.0 - 2.0 / (t + 2)) * state.x + (2.0 / (t + 2)) * w  # alpha_{t+1} / alpha_{1:t+1} = 2/(t+2)
        new = Mu2State(t + 1, w, x, state.x)
        return query(new), new

    def release(state: Mu2State, output: str) -> np.ndarray:
        return state.x.copy()

    def monitor(state: Mu2State) -> dict[str, np.ndarray]:
        return {"mean": state.x, "last": state.x}

    return Optimizer(init, step, query, release, monitor, Mu2State.from_arrays)
