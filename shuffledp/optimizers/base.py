"""The optimizer interface the analyzer's round loop calls (design sec 3.1 and 4), optax style.

    opt = psgd(learning_rate, radius)          # or pgd(...), acsa(...), phased(...)
    state = opt.init(theta_0)
    params = opt.query(state)                  # the model broadcast this round: users' gradients are taken here
    params, state = opt.step(grad, state, params)   # decoded mean gradient at `params` -> next query point, state
    model = opt.release(state, "mean")         # the released model: the method's output ("mean") or "last"
    views = opt.monitor(state)                 # {"mean": ..., "last": ...}: what per-round metrics evaluate

Everything is a pure function of its arguments; a state is a NamedTuple of numbers and float64 arrays with
to_arrays() / from_arrays() (checkpoints are np.savez of to_arrays(), so no pickle is ever loaded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Optimizer", "OUTPUTS"]

OUTPUTS = ("mean", "last")  # schedule.output


class Optimizer(NamedTuple):
    init: Callable[[np.ndarray], Any]
    step: Callable[[np.ndarray, Any, np.ndarray], tuple[np.ndarray, Any]]
    query: Callable[[Any], np.ndarray]
    release: Callable[[Any, str], np.ndarray]
    monitor: Callable[[Any], dict[str, np.ndarray]]
    state_from_arrays: Callable[[dict[str, np.ndarray]], Any]
