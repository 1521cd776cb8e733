"""PSGD: projected SGD over disjoint cohorts (paper 000 Alg 3, sequential), as optax-style pure functions.

    opt = psgd(learning_rate, radius)
    state = opt.init(params)
    params, state = opt.step(grad_estimate, state, params)

Round t (paper 000 Alg 3, spec 000 sec 4): B fresh users send grad l(theta_{t-1}, x); the analyzer decodes the
PVEC sum and divides by the contributors n' (the paper divides by B; n' keeps the estimate unbiased under
dropouts, spec 000 sec 3 robust note); theta_t = Proj_Theta(theta_{t-1} - eta g_t) (descent sign: spec 000
sec 4, the "+" of the extracted text is a typo). Output: the mean of theta_0..theta_{T-1}; the state also keeps
the last iterate theta_T so both can be reported.

Step size (Thm 4.1 with Lemma 4.2): eta = D / (L_G sqrt(T)), L_G^2 = L^2 + E||noise||^2 / B^2, where
E||noise||^2 is the PVEC variance of the decoded sum summed over the d coordinates (spec 000 sec 4 says to take it
from the exact PVEC variance; we use its data-free upper bound so eta is never too large).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from shuffledp.models import project_l2_ball
from shuffledp.optimizers.base import Optimizer

__all__ = ["AveragingState", "Optimizer", "psgd", "theory_learning_rate", "projected_step", "averaging_optimizer"]


class AveragingState(NamedTuple):
    """Optimizer state: steps taken, running sum of the iterates the gradients were taken at, last iterate."""

    steps: int
    iterate_sum: np.ndarray
    last: np.ndarray

    def mean(self) -> np.ndarray:
        """mean(theta_0..theta_{T-1}): the papers' output (Alg 3 / Alg 5 of paper 000)."""
        if self.steps == 0:
            return self.last.copy()
        return self.iterate_sum / self.steps

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"steps": np.asarray(self.steps), "iterate_sum": self.iterate_sum, "last": self.last}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> AveragingState:
        return cls(int(a["steps"]), np.asarray(a["iterate_sum"], dtype=np.float64), np.asarray(a["last"]))


def projected_step(
    grad: np.ndarray, state: AveragingState, params: np.ndarray, learning_rate: float, radius: float
) -> tuple[np.ndarray, AveragingState]:
    """theta' = Proj(theta - eta g); adds theta (the point the gradient was taken at) to the running sum."""
    grad = np.asarray(grad, dtype=np.float64)
    params = np.asarray(params, dtype=np.float64)
    if grad.shape != params.shape:
        raise ValueError(f"grad shape {grad.shape} != params shape {params.shape}")
    if not np.all(np.isfinite(grad)):
        raise ValueError("grad must be finite")
    new = project_l2_ball(params - learning_rate * grad, radius)
    return new, AveragingState(state.steps + 1, state.iterate_sum + params, new)


def _check_lr_radius(learning_rate: float, radius: float) -> None:
    if not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}")
    if not (math.isfinite(radius) and radius > 0):
        raise ValueError(f"radius must be a finite number > 0, got {radius!r}")


def _init(params: np.ndarray) -> AveragingState:
    params = np.asarray(params, dtype=np.float64)
    return AveragingState(0, np.zeros_like(params), params.copy())


def _release(state: AveragingState, output: str) -> np.ndarray:
    return state.mean() if output == "mean" else state.last.copy()


def _monitor(state: AveragingState) -> dict[str, np.ndarray]:
    # "mean" includes the newest iterate, mean(theta_0..theta_k), so round 0 already shows a trained model; the
    # released output stays the papers' mean(theta_0..theta_{T-1}) (_release)
    return {"mean": (state.iterate_sum + state.last) / (state.steps + 1), "last": state.last}


def averaging_optimizer(learning_rate: float, radius: float) -> Optimizer:
    """Projected (S)GD with a fixed step and iterate averaging: the update of Alg 3 and Alg 5 of paper 000."""
    _check_lr_radius(learning_rate, radius)

    def step(grad: np.ndarray, state: AveragingState, params: np.ndarray) -> tuple[np.ndarray, AveragingState]:
        return projected_step(grad, state, params, learning_rate, radius)

    return Optimizer(_init, step, lambda s: s.last.copy(), _release, _monitor, AveragingState.from_arrays)


def psgd(learning_rate: float, radius: float) -> Optimizer:
    """Projected SGD with iterate averaging (paper 000 Alg 3). Iterates stay in the l2 ball of `radius`."""
    return averaging_optimizer(learning_rate, radius)


def theory_learning_rate(diameter: float, lipschitz: float, rounds: int, noise_sq: float, batch: int) -> float:
    """eta = D / (L_G sqrt(T)), L_G^2 = L^2 + noise_sq / batch^2 (paper 000 Thm 4.1 / Lemma 4.2).

    noise_sq = E||decoded sum - true sum||^2 (sum of the d per-coordinate variances); batch = users per sum.
    """
    if diameter <= 0 or lipschitz <= 0 or rounds < 1 or batch < 1 or noise_sq < 0:
        raise ValueError(
            f"need diameter > 0, lipschitz > 0, rounds >= 1, batch >= 1, noise_sq >= 0; got "
            f"{diameter}, {lipschitz}, {rounds}, {batch}, {noise_sq}"
        )
    lg = math.sqrt(lipschitz**2 + noise_sq / batch**2)
    return diameter / (lg * math.sqrt(rounds))
