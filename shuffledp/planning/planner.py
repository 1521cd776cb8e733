"""A run's plan, computed once (issue 47 item 3): from the configuration and the population the shuffler reports
(sizes only), the rounds T, the cohort B, the threshold n_min, delta, the protocol's parameters and composition rule
(its plug-in's plan()), and the optimizer's step sizes (the optimizers' theory: pure functions in
shuffledp/optimizers). The result is a JSON-able dict that the analyzer stores in the ledger with the run's
(eps, delta) limit and never recomputes; `planned_optimizer` builds the optimizer a stored plan names.

Schedules (spec 000 sec 4): sequential = disjoint fresh cohorts (PSGD, AC-SA, their strongly convex phases),
T = floor(unused users / B) (at most schedule.rounds when set); fully interactive = all n users for T rounds (PGD);
subsampled = k of n per round, drawn secretly by the shuffler (spec 001 sec 1). The protocol's noise is sized for the
threshold n_min = ceil(min_contributors_fraction * cohort): a released batch has n' >= n_min, and fewer contributors
means less noise, so the reserved (worst-case) cost bounds every committed cost (spec 000 sec 3 / A.3).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from shuffledp.config import DEFAULT_ROUNDS, RunConfig
from shuffledp.data import load_dataset
from shuffledp.models import ModelPlugin
from shuffledp.models.plugin import model_identity
from shuffledp.optimizers import registry as optimizers
from shuffledp.optimizers.base import Optimizer
from shuffledp.protocols.base import PlanRequest
from shuffledp.protocols.registry import round_protocol
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["PlanError", "plan_run", "planned_optimizer", "cohort_size", "hyperparameters"]


class PlanError(ValueError):
    """The run cannot be planned (too few users, parameters out of the protocol's range)."""


def _resolve_delta(cfg: RunConfig, admitted: int) -> float:
    p = cfg.privacy
    if p.delta is not None:
        return p.delta
    # Unset delta: 1/n (issue 4: practitioner-acceptable delta <= 1/n), capped by the users' own [policy] so that
    # default users accept every round (issue 10). A user's per-round delta is <= delta (per_user_claim of the
    # protocol: sequential rounds claim delta, calibrated fully interactive ones delta/T, paper ones
    # delta_r = delta/(T+1), Alg 5) and its run total is <= delta (sequential: one round; fully interactive: T such
    # claims, basic composition as in clients/policy.py). The total cap is shrunk by 1e-9 (relative) so that a
    # client's float sum of T claims delta/T (up to T ulps above delta) still fits it.
    pol = cfg.policy
    delta = min(1.0 / admitted, pol.max_delta_per_round, pol.max_total_delta * (1.0 - 1e-9))
    if not delta > 0.0:
        raise PlanError(
            "privacy.delta is unset and [policy] max_delta_per_round or max_total_delta is 0, so every user "
            "would refuse every round: set privacy.delta or raise those limits"
        )
    return delta


def plan_run(
    cfg: RunConfig, admitted: int, unused: int, model: ModelPlugin, feature_bound: float | None | str = "load"
) -> dict[str, Any]:
    """The round plan of a run from the population sizes (JSON-able dict, stored in the ledger).

    Resolves the run-dependent defaults of the configuration: an unset privacy.delta and schedule.rounds, the
    sequential cohort (the optimizer's theory), the protocol's per-round parameters (the protocol plug-in) and the
    optimizer's step sizes (optimizers/registry.py).
    """
    p, s = cfg.privacy, cfg.schedule
    d = model.dim
    if admitted < 1:
        raise PlanError("no users are admitted at the shuffler")
    delta = _resolve_delta(cfg, admitted)
    protocol = round_protocol(p.protocol)
    name = optimizers.resolve(s.optimizer, s.kind, protocol.auto_optimizer)
    smoothing = _smoothing(cfg, model, s.kind, admitted if s.kind != "sequential" else unused, d, delta)
    model = replace(model, smoothing=smoothing) if smoothing else model  # type: ignore[type-var]
    if not model.convex and (s.learning_rate is None or name == "acsa" or s.phases):
        # the config refuses these for the built-in mlp; a plug-in states its convexity only once it is built
        raise PlanError(
            f"model {cfg.model.module or cfg.model.task!r} is non-convex: the theory step size, AC-SA and "
            "schedule.phases rest on convexity; set schedule.learning_rate (and optimizer pgd, sgd or ftrl)"
        )
    identity = model_identity(cfg.model, model)
    task = "" if cfg.model.module else model.task  # type: ignore[attr-defined]  # a plug-in: RoundSpec.model_name
    if feature_bound == "load":
        needs = name in ("acsa", "mu2", "pnsgd")
        feature_bound = load_dataset(cfg.data, cfg.model.task).feature_norm_bound if needs else None
    smoothness = _smoothness(cfg, model, name, feature_bound)
    sequential = s.kind == "sequential"
    if s.kind == "subsampled":
        # k of the n admitted users per round, drawn secretly by the shuffler (spec 001 sec 1); T from the config
        # or, unset, from the budget (the protocol's plan)
        B, T = s.cohort_size, s.rounds or 0
        if not 1 <= B <= admitted:
            raise PlanError(f"schedule.cohort_size = {B} must lie in [1, admitted users = {admitted}]")
    elif sequential:
        n_pool = unused
        if s.cohort_size:
            B = s.cohort_size
        else:
            B = cohort_size(name, n_pool, d, p.eps, delta, p.clip_norm, smoothness, 2 * cfg.model.radius, smoothing > 0)
        if n_pool < 1:
            raise PlanError(f"no unused users left for a sequential run (unused={unused})")
        what = f"schedule.cohort_size = {B}" if s.cohort_size else f"Thm 4.1's cohort B = {B} (cohort_size unset)"
        if s.cohort_size > n_pool:  # each round takes B fresh users: not one round fits (issue 43 item 11)
            raise PlanError(
                f"{what} exceeds the {n_pool} unused users: a sequential round takes {B} fresh users, so 0 rounds "
                f"fit; set cohort_size <= {n_pool // 2} for 2 rounds or more"
            )
        B = min(B, n_pool)
        T = n_pool // B  # T = n / B fresh cohorts (spec 000 sec 4, Alg 3 / Alg 4)
        if s.rounds is not None:
            T = min(T, s.rounds)  # schedule.rounds set: at most that many of them (issue 10)
        if T == 1 and name == "psgd" and s.output == "mean":
            # Alg 3 releases mean(theta_0..theta_{T-1}) (spec 000 sec 4): one round releases theta_0, the initial
            # model, for the whole round's budget (issue 43 item 11)
            raise PlanError(
                f"{what} with {n_pool} unused users plans 1 sequential round: PSGD releases the mean of "
                f"theta_0..theta_(T-1) (Alg 3), with T = 1 the initial model theta_0; set cohort_size <= "
                f'{n_pool // 2} (and schedule.rounds >= 2) for 2 rounds or more, or schedule.output = "last"'
            )
    else:
        B, T = admitted, (s.rounds if s.rounds is not None else DEFAULT_ROUNDS)  # all n users for T rounds (Alg 5)
    # Poisson sampling: each of the n admitted users with q = k/n, so a round invites anywhere from 0 to n of them
    q = B / admitted if s.sampling == "poisson" else 0.0
    # the threshold: a subsampled round releases exactly k reports or nothing (spec 001 sec 1)
    n_min = B if s.kind == "subsampled" else max(1, math.ceil(p.min_contributors_fraction * B))
    request = PlanRequest(
        s.kind,
        p.eps,
        delta,
        T,
        B,
        n_min,
        d,
        p.clip_norm,
        cfg.transport.mode,
        admitted=admitted,
        rounds_requested=s.rounds,
        min_contributors_fraction=p.min_contributors_fraction,
        settings=p.settings,
        # PNSGD runs the pass itself: it needs the loss, its public domain and the step size
        options={
            "sampling": s.sampling,
            "task": task,
            "num_features": model.num_features,
            "num_classes": model.num_classes,
            "l2": cfg.model.l2,
            "radius": cfg.model.radius,
            "feature_bound": feature_bound,
            "learning_rate": s.learning_rate,
        },
    )
    try:
        sized = protocol.plan(request)
        T = sized.rounds or T
        n_min = sized.min_contributors if sized.min_contributors is not None else n_min
        if s.phases > T:
            raise PlanError(f"schedule.phases = {s.phases} needs at least {s.phases} rounds; the plan has {T}")
        hyper = hyperparameters(
            name,
            rounds=T,
            n_min=n_min,
            noise_sq=sized.noise_sq,
            lipschitz=p.clip_norm,
            radius=cfg.model.radius,
            smoothness=smoothness,
            learning_rate=s.learning_rate,
            phases=s.phases,
            l2=cfg.model.l2,
            lr_steps=s.lr_steps,
            lr_step_factor=s.lr_step_factor,
            momentum=s.momentum,
        )
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    # over-selection (Bonawitz et al. 2019 sec 2): a round closes once this many of the B users it invites reported
    # (RoundSpec.report_goal), never below the threshold; 0 (fraction 1, or a goal of every invitee) = wait for all
    # until the deadline. Subsampled runs have none (the config refuses it)
    goal = 0
    if s.report_goal_fraction < 1.0 and s.kind != "subsampled":
        goal = max(n_min, math.ceil(s.report_goal_fraction * B - 1e-9))
        goal = goal if goal < B else 0
    return {
        "protocol": protocol.name,
        "kind": s.kind,
        "admitted": admitted,
        "cohort": admitted if q else B,  # the most users a round invites
        "sampling_rate": q,
        "rounds": T,
        "min_contributors": n_min,
        "report_goal": goal,
        "eps": p.eps,
        "delta": delta,
        # robust accounting (spec 000 A.3) is about users' own noise; where the analyzer adds it, it does not apply
        "honest_fraction": (p.honest_fraction or p.min_contributors_fraction)
        if protocol.trust_model == pb.SHUFFLE
        else 1.0,
        "composition": sized.composition,
        "advanced_slack": sized.advanced_slack,
        "params": sized.params,
        **sized.plan_extra,
        "hidden_iterates": sized.hidden_iterates,
        "optimizer": hyper,
        "learning_rate": hyper.get("learning_rate"),
        "radius": cfg.model.radius,
        "dim": d,
        "task": task,
        "model_name": identity.name,
        "model_digest": identity.digest,
        **({"model_layout": model.layout()} if cfg.model.module else {}),  # a plug-in's segments (model.npz)
        "l2": cfg.model.l2,
        "smoothing": smoothing,
        "num_features": model.num_features,
        "num_classes": model.num_classes,
        "hidden": model.hidden,
        "transport": cfg.transport.mode,
        "deadline": cfg.deployment.round_deadline_seconds,
        "output": s.output,
    }


def _smoothing(cfg: RunConfig, model: ModelPlugin, kind: str, n: int, d: int, delta: float) -> float:
    """beta of the Moreau envelope the users differentiate (0: none). model.smoothing = "paper": Thm 4.7's beta
    for sequential runs, Thm 4.9's for fully interactive ones (spec 000 sec 4)."""
    beta = cfg.model.smoothing
    if beta != "paper":
        return float(beta)
    from shuffledp.optimizers import acsa

    L, D, eps = cfg.privacy.clip_norm, 2 * cfg.model.radius, cfg.privacy.eps
    if kind == "sequential":
        return acsa.smoothing_beta(max(n, 1), d, L, D, eps, delta)
    return acsa.pgd_smoothing_beta(max(n, 1), d, L, D, eps, delta)


def _smoothness(cfg: RunConfig, model: ModelPlugin, name: str, bound: float | None) -> float:
    """beta of the loss the optimizer descends (AC-SA's step rule needs it; DP-mu2's caps its step at 1/(4 L T)
    with it, and goes without the cap when it is unknown): model.smoothness when set, else from the data set's
    public domain bound on ||x|| (models.Model.smoothness)."""
    if name not in ("acsa", "mu2"):
        return 0.0
    if cfg.model.smoothness:
        return cfg.model.smoothness
    if name == "mu2":
        beta = model.smoothness(bound) if bound is not None and model.smoothing == 0 else math.inf
        return float(beta) if math.isfinite(beta) else 0.0
    if bound is None and model.smoothing == 0:
        raise PlanError(
            'schedule.optimizer = "acsa" needs the smoothness of the loss: data.dataset = "path" has no public bound '
            "on ||x||, so set model.smoothness"
        )
    beta = model.smoothness(bound if bound is not None else 0.0)
    if not math.isfinite(beta):
        raise PlanError(
            f'schedule.optimizer = "acsa" needs a smooth loss: model.task = "{model.task}" is not smooth; set '
            'model.smoothing (e.g. "paper", the Moreau smoothing of Thm 4.7)'
        )
    return float(beta)


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


def planned_optimizer(plan: dict[str, Any]) -> Optimizer:
    """The planned run's optimizer (plans written before optimizers were plug-ins: PSGD / PGD, one phase)."""
    hyper = plan.get("optimizer") or {
        "name": "psgd" if plan["kind"] == "sequential" else "pgd",
        "radius": plan["radius"],
        "rounds": plan["rounds"],
        "phases": 0,
        "phase_rounds": [plan["rounds"]],
        "learning_rates": [plan["learning_rate"]],
    }
    return optimizers.make_optimizer(hyper)
