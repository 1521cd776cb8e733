"""Optimizers by name (design 3.1 and 4): which optimizer a schedule runs, and the Optimizer of a planned run.

    name = resolve(schedule.optimizer, schedule.kind)           "psgd" | "pgd" | "acsa" | ...
    opt = make_optimizer(plan["optimizer"])                     the Optimizer (base.py) of a planned run

The plan's optimizer part (cohort, step sizes) is computed by shuffledp.planning from the theory functions of each
optimizer's module.

Which optimizer runs where (spec 000 sec 4): PSGD (Alg 3) and AC-SA (Alg 4) are sequential (disjoint cohorts,
parallel composition); PGD (Alg 5) is fully interactive. The strongly convex reduction (Thm 4.8) wraps PSGD or
AC-SA in phases (phased.py), each phase a fresh set of cohorts started from the previous phase's output.
"""

from __future__ import annotations

from typing import Any

from shuffledp.optimizers.base import Optimizer

__all__ = [
    "OPTIMIZERS",
    "resolve",
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
