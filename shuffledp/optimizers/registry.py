"""Optimizers by name (design 3.1 and 4): the run manager plans and builds an optimizer only through this module.

    name = resolve(schedule.optimizer, schedule.kind)           "psgd" | "pgd" | "acsa"
    B = cohort_size(name, ...)                                  sequential: the optimizer's theory cohort
    hyper = hyperparameters(name, ...)                          JSON-able, stored in the run's plan
    opt = make_optimizer(plan["optimizer"])                     the Optimizer (base.py) of a planned run

Which optimizer runs where (spec 000 sec 4): PSGD (Alg 3) and AC-SA (Alg 4) are sequential (disjoint cohorts,
parallel composition); PGD (Alg 5) is fully interactive. The strongly convex reduction (Thm 4.8) wraps PSGD or
AC-SA in phases (phased.py), each phase a fresh set of cohorts started from the previous phase's output.
"""

from __future__ import annotations

import math
from typing import Any

from shuffledp.optimizers.base import Optimizer

__all__ = [
    "OPTIMIZERS",
    "resolve",
    "cohort_size",
    "hyperparameters",
    "make_optimizer",
    "SEQUENTIAL_ONLY",
]

OPTIMIZERS = ("auto", "psgd", "pgd", "acsa", "sgd", "ftrl", "mu2", "pnsgd")  # schedule.optimizer
SEQUENTIAL_ONLY = ("psgd", "acsa")


_AUTO = {"sequential": "psgd", "fully_interactive": "pgd", "subsampled": "sgd"}


def resolve(name: str, kind: str, auto: str | None = None) -> str:
    """schedule.optimizer "auto": the protocol's own optimizer when it has one (its plug-in's auto_optimizer: FTRL
    over tree aggregation, DP-FTRL 003; DP-mu2-FL's AnyTime update, 002; PNSGD's pass, 004), else PSGD when
    sequential, PGD when fully interactive (paper 000's pairing), SGD with a step-change learning rate when
    subsampled (CLDP-SGD, paper 001)."""
    if name != "auto":
        return name
    return auto or _AUTO[kind]


def cohort_size(
    name: str,
    n: int,
    d: int,
    eps: float,
    delta: float,
    lipschitz: float,
    smoothness: float,
    diameter: float,
    smoothed: bool,
) -> int:
    """Users per sequential round from the optimizer's theory, before capping at the users left.

    PSGD: Thm 4.1 of paper 000, B = sqrt(d) ln(d/delta) / eps. AC-SA: Thm 4.3 (smooth loss) or Thm 4.7 (Moreau-
    smoothed loss)."""
    if name == "acsa":
        from shuffledp.optimizers import acsa

        if smoothed:
            return acsa.smoothed_cohort_size(n, d, eps, delta)
        return acsa.acsa_cohort_size(n, d, lipschitz, smoothness, diameter, eps, delta)
    return math.ceil(math.sqrt(d) * math.log(d / delta) / eps)


def hyperparameters(
    name: str,
    *,
    rounds: int,
    n_min: int,
    noise_sq: float,
    lipschitz: float,
    radius: float,
    smoothness: float,
    learning_rate: float | None,
    phases: int = 0,
    l2: float = 0.0,
    lr_steps: tuple[int, ...] = (),
    lr_step_factor: float = 0.1,
    momentum: float = 0.0,
) -> dict[str, Any]:
    """The optimizer part of a run's plan (JSON-able). noise_sq = E||decoded sum - true sum||^2 of one round at
    n_min contributors (the protocol's sizing); lipschitz = the clip norm; diameter D = 2 radius."""
    diameter = 2.0 * radius
    out: dict[str, Any] = {"name": name, "radius": radius, "rounds": rounds, "phases": phases}
    per_phase = _split(rounds, phases) if phases else [rounds]
    out["phase_rounds"] = per_phase
    if name == "acsa":
        from shuffledp.optimizers import acsa

        sigma = acsa.acsa_sigma(lipschitz, n_min, noise_sq)  # sigma^2 = L^2/B + noise/B^2 (spec 000 sec 4)
        out.update(sigma=sigma, smoothness=smoothness, diameters=_diameters(per_phase, sigma, diameter, smoothness, l2))
        return out
    if name == "pnsgd":
        return out  # the step size is the protocol's (it runs the pass)
    if name == "mu2":
        from shuffledp.optimizers import mu2

        # noise_sq: E||noise of the averaged message||^2 (the protocol's sizing); Thm 5.2 / 6.2's step
        lr = learning_rate or mu2.theory_learning_rate(diameter, rounds, noise_sq, smoothness)
        out.update(learning_rates=[lr], learning_rate=lr, smoothness=smoothness)
        return out
    from shuffledp.optimizers.psgd import theory_learning_rate

    if learning_rate is not None:
        out["learning_rates"] = [learning_rate] * len(per_phase)
    else:
        # Thm 4.1 / Lemma 4.2 (PSGD), Lemma B.6 (PGD): eta = D / (L_G sqrt(T)), per phase with that phase's T
        # (the phases' D_i: see _diameters; PSGD phases use the same diameter rule as AC-SA's with beta = 0)
        ds = _diameters(per_phase, _psgd_sigma(lipschitz, n_min, noise_sq), diameter, 0.0, l2)
        out["learning_rates"] = [
            theory_learning_rate(D, lipschitz, T, noise_sq, n_min) for D, T in zip(ds, per_phase, strict=True)
        ]
    out["learning_rate"] = out["learning_rates"][0]
    if name == "sgd":
        out.update(lr_steps=list(lr_steps), lr_step_factor=lr_step_factor)
    if name == "ftrl":
        # eta = 1/lambda: DP-FTRL on the residuals is SGD with this step (spec 003 sec 2, B.3), so SGD's rule
        # gives its default; the non-convex mlp task has no such rule (config requires schedule.learning_rate)
        out["momentum"] = momentum
    return out


def _psgd_sigma(lipschitz: float, batch: int, noise_sq: float) -> float:
    return math.sqrt(lipschitz**2 / batch + noise_sq / batch**2)


def _split(rounds: int, phases: int) -> list[int]:
    from shuffledp.optimizers.phased import split_rounds

    return split_rounds(rounds, phases)


def _diameters(per_phase: list[int], sigma: float, diameter: float, smoothness: float, l2: float) -> list[float]:
    """D_i of each phase (Thm 4.8: D_i^2 <= 2 Delta_i / lambda, Delta_i the previous phase's excess-risk bound)."""
    if len(per_phase) == 1 or l2 <= 0:
        return [diameter] * len(per_phase)
    from shuffledp.optimizers.acsa import lan_excess_risk_bound
    from shuffledp.optimizers.phased import phase_diameters

    def bound(i: int, D: float) -> float:
        return lan_excess_risk_bound(per_phase[i], sigma, D, smoothness)

    return phase_diameters(diameter, l2, bound, len(per_phase))


def _one_phase(name: str, hyper: dict[str, Any], i: int) -> Optimizer:
    radius = float(hyper["radius"])
    T = int(hyper["phase_rounds"][i])
    if name == "acsa":
        from shuffledp.optimizers.acsa import acsa

        return acsa(radius, T, float(hyper["sigma"]), float(hyper["diameters"][i]), float(hyper["smoothness"]))
    if name == "ftrl":
        from shuffledp.optimizers.ftrl import ftrl

        return ftrl(1.0 / float(hyper["learning_rates"][i]), float(hyper["momentum"]), radius)
    if name == "pnsgd":
        from shuffledp.optimizers.pnsgd import pnsgd

        return pnsgd()
    if name == "mu2":
        from shuffledp.optimizers.mu2 import mu2

        return mu2(float(hyper["learning_rates"][i]), radius)
    if name == "sgd":
        from shuffledp.optimizers.sgd import sgd

        return sgd(float(hyper["learning_rates"][i]), radius, hyper["lr_steps"], float(hyper["lr_step_factor"]))
    from shuffledp.optimizers.psgd import averaging_optimizer

    return averaging_optimizer(float(hyper["learning_rates"][i]), radius)


def make_optimizer(hyper: dict[str, Any]) -> Optimizer:
    """The Optimizer of a planned run (hyperparameters() output)."""
    name = hyper["name"]
    if not hyper.get("phases"):
        return _one_phase(name, hyper, 0)
    from shuffledp.optimizers.phased import phased

    return phased(lambda i: _one_phase(name, hyper, i), hyper["phase_rounds"])
