"""PNSGD's optimizer side (seed 004): the analyzer's noisy pass over the records is the mechanism itself, so it lives
in the protocol plug-in (protocols/pnsgd_round.py), which hands the run loop the pass's last iterate; this optimizer
only adopts it. query() is the data-independent start w_0 until then (no record is used before the pass), and
release() the adopted iterate (the only one ever released, for either schedule.output).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from shuffledp.optimizers.base import Optimizer

__all__ = ["PassState", "pnsgd"]


class PassState(NamedTuple):
    passes: int  # passes adopted
    w: np.ndarray

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"passes": np.asarray(self.passes), "w": self.w}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> PassState:
        return cls(int(a["passes"]), np.asarray(a["w"], dtype=np.float64))


def pnsgd() -> Optimizer:
    def init(theta0: np.ndarray) -> PassState:
        return PassState(0, np.zeros_like(np.asarray(theta0, dtype=np.float64)))  # w_0 = 0 (spec 004 sec 2)

    def query(state: PassState) -> np.ndarray:
        return state.w

    def step(w_last: np.ndarray, state: PassState, params: np.ndarray) -> tuple[np.ndarray, PassState]:
        w_last = np.asarray(w_last, dtype=np.float64)
        if w_last.shape != state.w.shape or not np.all(np.isfinite(w_last)):
            raise ValueError(f"the pass's iterate must be {state.w.shape[0]} finite values, got {w_last.shape}")
        new = PassState(state.passes + 1, w_last.copy())
        return new.w, new

    def release(state: PassState, output: str) -> np.ndarray:
        return state.w.copy()

    def monitor(state: PassState) -> dict[str, np.ndarray]:
        return {"mean": state.w, "last": state.w}

    return Optimizer(init, step, query, release, monitor, PassState.from_arrays)
