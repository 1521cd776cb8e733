"""Projected SGD with a step-change learning rate: CLDP-SGD's server update (seed 001, spec 001 sec 2), optax style.

theta_{t+1} = Proj_Theta(theta_t - eta_t gbar_t), gbar_t the decoded mean of the round's k reports; "a learning-rate
step change is the only schedule used" (spec 001 sec 2, paper Sec. 5): eta_t = eta * factor^(number of step rounds
s in lr_steps with t >= s), t counted from 0. The state keeps the running sum of the iterates, so both the last
iterate and the average can be released (schedule.output).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shuffledp.optimizers.base import Optimizer
from shuffledp.optimizers.psgd import AveragingState, _check_lr_radius, _init, _monitor, _release, projected_step

__all__ = ["sgd", "step_learning_rate"]


def step_learning_rate(learning_rate: float, steps: Sequence[int], factor: float, t: int) -> float:
    """eta_t of the step-change schedule (module docstring)."""
    return learning_rate * factor ** sum(1 for s in steps if t >= s)


def sgd(learning_rate: float, radius: float, lr_steps: Sequence[int] = (), lr_step_factor: float = 0.1) -> Optimizer:
    """Projected SGD; the learning rate is multiplied by lr_step_factor after each round listed in lr_steps."""
    _check_lr_radius(learning_rate, radius)
    if not 0.0 < lr_step_factor <= 1.0:
        raise ValueError(f"lr_step_factor must lie in (0, 1], got {lr_step_factor}")
    steps = tuple(int(s) for s in lr_steps)

    def step(grad: np.ndarray, state: AveragingState, params: np.ndarray) -> tuple[np.ndarray, AveragingState]:
        eta = step_learning_rate(learning_rate, steps, lr_step_factor, state.steps)
        return projected_step(grad, state, params, eta, radius)

    return Optimizer(_init, step, lambda s: s.last.copy(), _release, _monitor, AveragingState.from_arrays)
