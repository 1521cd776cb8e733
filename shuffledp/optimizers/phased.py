"""Phased restarts: the strongly convex reduction of paper 000 Thm 4.8 as an optax-style combinator.

    opt = phased(lambda i: acsa(radius, rounds[i], sigma, diameters[i], beta), rounds)

Thm 4.8 (spec 000 sec 4): run k = O(log log n) phases on disjoint groups of n/k users; each phase starts from the
previous phase's output. Here phase i runs make_phase(i) for rounds_per_phase[i] steps; after its last step the
next phase's optimizer is init'ed at release(state, "mean") of the finished one (for AC-SA: theta_ag_{T+1}).
Privacy is unchanged because the groups are disjoint (spec 000 sec 5); that is the caller's cohort plan.

Per-phase D_i (phase_diameters). The analysis replaces D by D_i with D_i^2 = E||theta_i - theta*||^2
<= 2 Delta_i / lambda (strong convexity at the constrained optimum), Delta_i = the previous phase's expected excess
risk. The paper does not say how to set D_i in practice (spec 000 sec 10(d)). We use the computable bound: Delta_i
is the excess-risk bound of the previous phase run with D_{i-1} (e.g. acsa.lan_excess_risk_bound), so
D_{i+1} = min(D_i, sqrt(2 bound_i / lambda)), D_0 = D. The min keeps the sequence non-increasing: D_0 (the set's
diameter) bounds every distance in Theta, and once the bound stops shrinking (the threshold regime in the proof of
Thm 4.8) we keep the last radius rather than letting a phase take larger steps than its predecessor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from shuffledp.optimizers.base import Optimizer

__all__ = ["PhasedState", "phased", "phase_diameters", "phase_count", "split_rounds"]

INNER = "inner."  # prefix of the inner state's arrays in to_arrays()


class PhasedState(NamedTuple):
    """phase = index of the running phase; steps = steps done within it; inner = that phase's optimizer state."""

    phase: int
    steps: int
    inner: Any

    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {"phase": np.asarray(self.phase), "steps": np.asarray(self.steps)}
        out.update({INNER + k: v for k, v in self.inner.to_arrays().items()})
        return out

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray], make_phase: Callable[[int], Optimizer]) -> PhasedState:
        """Inverse of to_arrays; the inner state type is whatever make_phase(phase).state_from_arrays builds."""
        phase = int(a["phase"])
        inner = {k[len(INNER) :]: v for k, v in a.items() if k.startswith(INNER)}
        return cls(phase, int(a["steps"]), make_phase(phase).state_from_arrays(inner))


def _is_int(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | np.integer)


def phased(make_phase: Callable[[int], Optimizer], rounds_per_phase: Sequence[int]) -> Optimizer:
    """Run make_phase(0) for rounds_per_phase[0] steps, then make_phase(1) from its "mean" release, and so on.

    release/monitor/query delegate to the running phase; after the last step of the last phase the state stays in
    that phase, so release(state, out) is its output. Stepping past the last phase is refused.
    """
    rounds = list(rounds_per_phase)
    if not rounds or not all(_is_int(r) and r >= 1 for r in rounds):
        raise ValueError(f"rounds_per_phase must be a non-empty sequence of integers >= 1, got {rounds_per_phase!r}")
    cache: dict[int, Optimizer] = {}

    def opt(phase: int) -> Optimizer:
        if not (_is_int(phase) and 0 <= phase < len(rounds)):
            raise ValueError(f"phase must be in 0..{len(rounds) - 1}, got {phase!r}")
        if phase not in cache:  # make_phase may plan (e.g. compute step sizes); build each phase's optimizer once
            cache[phase] = make_phase(phase)
        return cache[phase]

    def init(params: np.ndarray) -> PhasedState:
        return PhasedState(0, 0, opt(0).init(params))

    def step(grad: np.ndarray, state: PhasedState, params: np.ndarray) -> tuple[np.ndarray, PhasedState]:
        if state.steps >= rounds[state.phase]:
            raise ValueError(f"all {len(rounds)} phases ({sum(rounds)} rounds) are done")
        params, inner = opt(state.phase).step(grad, state.inner, params)
        steps = state.steps + 1
        if steps == rounds[state.phase] and state.phase + 1 < len(rounds):
            # Thm 4.8: the next phase starts from the previous phase's output
            start = opt(state.phase).release(inner, "mean")
            nxt = opt(state.phase + 1)
            new = PhasedState(state.phase + 1, 0, nxt.init(start))
            return nxt.query(new.inner), new
        return params, PhasedState(state.phase, steps, inner)

    def query(state: PhasedState) -> np.ndarray:
        return opt(state.phase).query(state.inner)

    def release(state: PhasedState, output: str) -> np.ndarray:
        return opt(state.phase).release(state.inner, output)

    def monitor(state: PhasedState) -> dict[str, np.ndarray]:
        return opt(state.phase).monitor(state.inner)

    def state_from_arrays(a: dict[str, np.ndarray]) -> PhasedState:
        state = PhasedState.from_arrays(a, opt)
        if not 0 <= state.steps <= rounds[state.phase]:
            raise ValueError(f"steps {state.steps} outside 0..{rounds[state.phase]} for phase {state.phase}")
        return state

    return Optimizer(init, step, query, release, monitor, state_from_arrays)


def phase_diameters(diameter: float, lam: float, bounds: Callable[[int, float], float], phases: int) -> list[float]:
    """[D_0, ..., D_{phases-1}]: D_0 = D, D_{i+1} = min(D_i, sqrt(2 bounds(i, D_i) / lambda)).

    bounds(i, D_i) = the expected excess-risk bound of phase i run with D_i (Thm 4.8: D_{i+1}^2 <= 2 Delta_i/lambda
    by lambda-strong convexity; spec 000 sec 10(d), the choice is documented in the module docstring).
    """
    if not (math.isfinite(diameter) and diameter > 0):
        raise ValueError(f"diameter must be a finite number > 0, got {diameter!r}")
    if not (math.isfinite(lam) and lam > 0):
        raise ValueError(f"lam (strong convexity) must be a finite number > 0, got {lam!r}")
    if not (_is_int(phases) and phases >= 1):
        raise ValueError(f"phases must be an integer >= 1, got {phases!r}")
    ds = [float(diameter)]
    for i in range(phases - 1):
        b = float(bounds(i, ds[-1]))
        # a zero bound would give D = 0, which no step rule can use (it divides by D)
        if not (math.isfinite(b) and b > 0):
            raise ValueError(f"bounds({i}, {ds[-1]}) must be a finite number > 0, got {b!r}")
        ds.append(min(ds[-1], math.sqrt(2.0 * b / lam)))
    return ds


def phase_count(n: int) -> int:
    """k = max(1, ceil(log2(log2 n))) phases (Thm 4.8: k = O(log log n)); 1 for n < 4, where log log n <= 0."""
    if not (_is_int(n) and n >= 1):
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if n < 4:
        return 1
    return max(1, math.ceil(math.log2(math.log2(n))))


def split_rounds(total_rounds: int, phases: int) -> list[int]:
    """total_rounds split into `phases` parts differing by at most 1 (earlier phases get the extra rounds).

    Thm 4.8 gives every phase n/k users, i.e. equal rounds at equal cohort size.
    """
    if not (_is_int(phases) and phases >= 1):
        raise ValueError(f"phases must be an integer >= 1, got {phases!r}")
    if not (_is_int(total_rounds) and total_rounds >= phases):
        raise ValueError(f"need total_rounds >= phases = {phases} (each phase runs >= 1 round), got {total_rounds!r}")
    q, r = divmod(int(total_rounds), int(phases))
    return [q + 1] * r + [q] * (phases - r)
