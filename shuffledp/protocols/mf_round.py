"""Matrix-factorization DP-FTRL's rounds as a plug-in (issue 27; design 2 "central"): the tree plug-in's rounds
(protocols.tree_round) with the tree's noise replaced by a factorization A = B C of the prefix-sum workload.

Round t: the shuffler draws k users uniformly among those its durable record allows under the run's participation
limits (each user at most k_max = max_participations rounds of the run, >= xi = min_separation rounds strictly
between two of them: RoundSpec.participation with the whole run as one "tree", the shuffler's own mechanism); each
clips its gradient to L and seals it (protocols.central); the analyzer sums the valid ones (x_t) and adds
w_t = (C^{-1} Z)_t, Z ~ N(0, (z L)^2) per entry (mechanisms.matrix_factorization.next_noise), so the released
prefix sums are A x + B Z: post-processing of C x + Z (Denisov et al. 2022 sec. 2). FTRL (optimizers.ftrl) gets
(x_t + w_t) / k, the fixed cohort dividing, as the tree's residuals (spec 003 sec 4).

Every round index is a row of C: a round that released nothing (below threshold, refused, lost in an analyzer
crash before its checkpoint) is a zero x_t whose w_t is drawn when the next round is noised and released with it,
so rows are round positions (what the shuffler's separation rule and the sensitivity count). The strategy (C's
parameters, optimised by jax_privacy at planning: minutes for large T) is kept as floats in the plan's params and
every spec, so every party works from the same C; the noise state is kept in the run's checkpoints, so a
restarted analyzer never redraws released noise. Only planning imports JAX.

Privacy: the T rounds are one Gaussian mechanism with sensitivity Delta L (Delta = the strategy's worst case over
the allowed participation patterns, mechanisms.matrix_factorization.sensitivity; zero-out neighbours, spec 003
A2), also for adaptive inputs (Denisov et al. 2022 Thm 2.1; arXiv:2211.06530 Thm 2.1): mu-GDP with mu = Delta / z,
charged its exact curve (Balle-Wang 2018; accountants.matrix_factorization.epsilon). A run stopped after t rounds
released C[:t, :t] x + Z[:t]: the ledger charges the sensitivity of the first t rounds (a table in the plan). The
noise is continuous only: C^{-1} Z is not on a grid, so the discrete Gaussian's guarantee does not carry over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shuffledp.mechanisms import matrix_factorization as mfm
from shuffledp.protocols.base import Counts, PlanRequest, RoundPlan, UserAccount
from shuffledp.protocols.central import CentralRound, check_fixed_cohort, noise_multiplier_setting
from shuffledp.settings import ConfigError, RunConfig, setting
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["ACCOUNTANT", "MfRound", "MfSettings", "planned_strategy"]

ACCOUNTANT = "mf-gaussian-exact (issue 27 sensitivity of C, Balle-Wang conversion; central trust)"
# the plan's per-round table (RoundPlan.plan_extra): Delta of the first t rounds, t = 1..T
_PREFIX_SENS = "mf_prefix_sensitivity"


@dataclass(frozen=True)
class MfSettings:
    """[privacy.mf]: the strategy C and the participation limits it is planned for (the shuffler enforces them)."""

    strategy: str = setting(
        "banded",
        '"banded" (b-banded Toeplitz, plans in seconds) or "blt" (buffered Toeplitz, minutes for large rounds)',
        choices=mfm.KINDS,
    )
    bands: int | None = setting(
        None,
        "b of the banded strategy; unset = min_separation + 1 (at most rounds), or rounds if max_participations = 1",
        lo=1,
        hi=10**5,
        example=4,
    )
    max_participations: int = setting(
        1, "rounds a user may join in the run (k; the shuffler enforces it)", lo=1, hi=10**6
    )
    min_separation: int = setting(0, "rounds strictly between two of a user's rounds (xi)", lo=0, hi=10**6)
    noise_multiplier: float | None = noise_multiplier_setting("std of Z / clip_norm")
    noise: str = setting(
        "continuous",
        '"continuous" only (C^-1 Z is not on a grid: the discrete Gaussian does not apply)',
        choices=("discrete", "continuous"),
    )


def _strategy(p: dict[str, Any]) -> mfm.Strategy:
    """The planned C from the params' floats (the same for every party)."""
    return mfm.Strategy.from_arrays(
        {
            "kind": np.asarray(mfm.KINDS.index(p["strategy"])),
            "rounds": np.asarray(int(p["rounds"])),
            "buf_decay": np.asarray(p["buf_decay"], dtype=np.float64),
            "output_scale": np.asarray(p["output_scale"], dtype=np.float64),
            "coefs": np.asarray(p["coefs"], dtype=np.float64),
        }
    )


_ARRAYS = ("buf_decay", "output_scale", "coefs")
_MAX_ROUNDS = 100_000  # schedule.rounds' own bound (shuffledp.config)
_MAX_FLOATS = 20_000_000  # T x k of the columns a node builds (160 MB of float64)


def _whole(x: dict[str, float], key: str) -> int:
    """An integer field of the spec's extra (absent: -1, which no check accepts); ValueError for nan, inf, 2.5."""
    v = x.get(key, -1.0)
    if not (math.isfinite(v) and v == int(v)):
        raise ValueError(f"the spec's {key} must be an integer, got {v!r}")
    return int(v)


def _params_of_spec(spec: pb.RoundSpec) -> dict[str, Any]:
    """The run's public parameters as the spec carries them (randomizer.extra: numbers only, arrays as name_i)."""
    x = dict(spec.randomizer.extra)
    kind = _whole(x, "strategy")
    if not 0 <= kind < len(mfm.KINDS):
        raise ValueError(f"the spec's strategy must be < {len(mfm.KINDS)}, got {x.get('strategy')!r}")
    p: dict[str, Any] = {
        "strategy": mfm.KINDS[kind],
        "rounds": _whole(x, "rounds"),
        "noise_multiplier": float(x.get("noise_multiplier", 0.0)),
        "max_participations": _whole(x, "max_participations"),
        "min_separation": _whole(x, "min_separation"),
        "delta": float(x.get("delta", 0.0)),
        "sensitivity": float(x.get("sensitivity", 0.0)),
    }
    for name in _ARRAYS:
        p[name] = [x[f"{name}_{i}"] for i in range(sum(1 for key in x if key.startswith(name + "_")))]
    if not (
        p["noise_multiplier"] > 0.0
        and 0.0 < p["delta"] < 1.0
        and p["max_participations"] >= 1
        and p["min_separation"] >= 0
        and p["rounds"] >= 1
        and int(spec.round) < p["rounds"]
    ):
        raise ValueError("the spec lacks a valid noise multiplier, delta, rounds or participation limits")
    # the node's own figures build C's columns of a user's rounds (T floats each): bounded work for any spec
    if p["rounds"] > _MAX_ROUNDS or p["rounds"] * min(p["max_participations"], p["rounds"]) > _MAX_FLOATS:
        raise ValueError(
            f"the spec's {p['rounds']} rounds x {p['max_participations']} participations exceed what a node verifies"
        )
    return p


def _canonical_sensitivity(strategy: mfm.Strategy, k: int, xi: int) -> float:
    """Delta of the pattern of k participations xi + 1 apart from round 0: the worst one for a non-negative
    non-increasing Toeplitz C (arXiv:2405.13763 Thm 2), a lower bound of the worst one for any C. Numpy only."""
    return mfm.pattern_sensitivity(strategy, range(0, strategy.rounds, xi + 1)[:k])


def _prefix_sensitivities(strategy: mfm.Strategy, k: int, xi: int, whole: float) -> list[float]:
    """Delta of the first t rounds, t = 1..T (C[:t, :t], a run stopped after t rounds), the last = ``whole``
    (mechanisms.matrix_factorization.sensitivity). For a non-negative non-increasing C the canonical pattern is the
    worst (arXiv:2405.13763 Thm 2), numpy only (one JAX compilation per t would take minutes); for any other C
    every prefix is charged the whole run's Delta (releasing t rows is post-processing of releasing all T)."""
    c = strategy.toeplitz_coefs()
    if not (np.all(c >= 0) and np.all(np.diff(c) <= 0)):
        return [whole] * strategy.rounds
    # C[:t, :t] is the Toeplitz matrix of the first t coefficients: the same strategy cut at t rounds
    cut = [_canonical_sensitivity(strategy._replace(rounds=t), k, xi) for t in range(1, strategy.rounds)]
    return [min(s, whole) for s in cut] + [whole]


def planned_strategy(
    kind: str, rounds: int, max_participations: int, min_separation: int, bands: int | None
) -> tuple[mfm.Strategy, float, list[float]]:
    """(C, its sensitivity Delta, Delta of each prefix of the run) as planning builds them (JAX): the analyzer's
    plan and `shuffledp account mf` share it, so both charge the same C."""
    # b <= xi + 1: the worst case of k participations is sqrt(k) times one's (mechanisms.matrix_factorization);
    # one participation: any b has sensitivity = C's largest column norm, so the full Toeplitz (b = T) errs least
    default = rounds if max_participations == 1 else min_separation + 1
    b = min(bands or default, rounds) if kind == "banded" else None
    strategy = mfm.build_strategy(kind, rounds, max_participations, min_separation, bands=b)
    sens = mfm.sensitivity(strategy, max_participations, min_separation)
    return strategy, sens, _prefix_sensitivities(strategy, max_participations, min_separation, sens)


def _epsilon(z: float, sens: float, delta: float) -> float:
    from shuffledp.accountants import matrix_factorization as mfa

    return mfa.epsilon(z, sens, delta)


class MfRound(CentralRound):
    """The matrix-factorization DP-FTRL plug-in (module docstring)."""

    name = "mf"
    settings = MfSettings
    schedules = ("subsampled",)
    optimizers = ("ftrl", "sgd")  # post-processing of the released sums, as the tree's
    auto_optimizer = "ftrl"
    # the central DP-SGD example's cohorts (150 of digits' 1348 users, 24 rounds): 3600 seats need each user in up
    # to 3 rounds (the tree's limits over the run, spec 003 sec 4: >= xi rounds between two; 150 x (7 + 1) <= 1348)
    example = {
        "privacy.mf": {"max_participations": 3, "min_separation": 7},
        "schedule": {"kind": "subsampled", "cohort_size": 150, "rounds": 24, "learning_rate": 2.0},
        "transport": {"mode": "sealed"},
    }

    def check_config(self, cfg: RunConfig, optimizer: str) -> None:
        check_fixed_cohort(cfg, self.name)
        own: MfSettings = cfg.privacy.settings
        if own.noise != "continuous":
            raise ConfigError(
                f'privacy.mf.noise = "{own.noise}" is not available: C^-1 Z is not on a grid; use "continuous"'
            )
        if own.bands is not None and own.strategy != "banded":
            raise ConfigError(f'privacy.mf.bands applies to strategy = "banded" only, not "{own.strategy}"')
        if own.bands is not None and cfg.schedule.rounds is not None and own.bands > cfg.schedule.rounds:
            raise ConfigError(f"privacy.mf.bands = {own.bands} exceeds schedule.rounds = {cfg.schedule.rounds}")

    # ------------------------------------------------------------------------------------------ analyzer
    def plan(self, req: PlanRequest) -> RoundPlan:
        """C optimised for (T, k_max, xi) by jax_privacy, its sensitivity for every prefix of the run, and the
        noise multiplier z from the budget (or privacy.mf.noise_multiplier, checked against it)."""
        from shuffledp.accountants import matrix_factorization as mfa

        if req.kind != "subsampled":
            raise ValueError(f'privacy.protocol = "mf" needs schedule.kind = "subsampled", got "{req.kind}"')
        if req.rounds_requested is None:
            raise ValueError('privacy.protocol = "mf" needs schedule.rounds (the rows of C)')
        o: MfSettings = req.settings
        T, k, n = int(req.rounds), int(req.cohort), int(req.admitted)
        E, xi = o.max_participations, o.min_separation
        # the shuffler can fill every round only if k users are free at each (the tree's rule, spec 003 sec 4)
        if k * (xi + 1) > n:
            raise ValueError(
                f"cohort_size {k} x (min_separation {xi} + 1) exceeds the {n} admitted users: the shuffler could not "
                "fill the rounds"
            )
        if T * k > E * n:
            raise ValueError(f"{T} rounds of {k} users need more than max_participations {E} x {n} admitted users")
        strategy, sens, prefix = planned_strategy(o.strategy, T, E, xi, o.bands)
        z = o.noise_multiplier
        if z is None:
            z = mfa.min_noise_multiplier(sens, req.eps, req.delta)
        elif mfa.epsilon(z, sens, req.delta) > req.eps:
            raise ValueError(
                f"privacy.mf.noise_multiplier = {z} spends eps = {mfa.epsilon(z, sens, req.delta):.4g} over "
                f"{T} rounds, above privacy.eps = {req.eps}; raise it or leave it unset"
            )
        arrays = strategy.to_arrays()
        params = {
            "d": req.dim,
            "clip": req.clip_norm,
            "k": k,
            "n": n,
            "rounds": T,
            "max_participations": E,
            "min_separation": xi,
            "delta": req.delta,
            "noise_multiplier": float(z),
            "noise": "continuous",
            "strategy": o.strategy,
            "sensitivity": sens,
            **{name: [float(v) for v in arrays[name]] for name in _ARRAYS},
        }
        # E||prefix noise of the sum||^2 at its worst round: d (z L)^2 max_t ||B_t||^2
        noise_sq = req.dim * (float(z) * req.clip_norm) ** 2 * float(np.max(mfm.prefix_variance(strategy)))
        n_min = max(1, math.ceil(req.min_contributors_fraction * k))
        return RoundPlan(
            params, "rdp", 0.0, noise_sq, rounds=T, min_contributors=n_min, plan_extra={_PREFIX_SENS: prefix}
        )

    def event_params(self, plan: dict[str, Any], round_index: int) -> dict[str, Any]:
        # the round's position and the sensitivity of the run up to it: what compose charges (module docstring)
        return {**plan["params"], "round": int(round_index), "prefix_sensitivity": plan[_PREFIX_SENS][round_index]}

    def per_user_claim(self, params: dict[str, Any]) -> tuple[float, float]:
        """A participation's share of the whole run's cost (eps / k_max at delta / k_max): the claims of a user's at
        most k_max rounds add up, by basic composition, to at least what the run costs."""
        E = int(params["max_participations"])
        eps = _epsilon(float(params["noise_multiplier"]), float(params["sensitivity"]), float(params["delta"]))
        return eps / E, float(params["delta"]) / E

    def spec_fields(self, plan: dict[str, Any], params: dict[str, Any], event: Any, key: bytes) -> dict[str, Any]:
        eps_r, delta_r = self.per_user_claim(params)
        extra = {
            "strategy": float(mfm.KINDS.index(params["strategy"])),
            "rounds": float(params["rounds"]),
            "noise_multiplier": params["noise_multiplier"],
            "max_participations": float(params["max_participations"]),
            "min_separation": float(params["min_separation"]),
            "delta": float(params["delta"]),
            "sensitivity": float(params["sensitivity"]),
            **{f"{name}_{i}": float(v) for name in _ARRAYS for i, v in enumerate(params[name])},
        }
        return {
            **self._sealed_fields(params, key, extra),
            "per_user_cost": pb.PrivacyCost(
                eps=eps_r, delta=delta_r, accountant=self.accountant_name(event, "rdp"), trust_model=self.trust_model
            ),
            # the whole run is one "tree" of the shuffler's limits: no change there (issue 25)
            "participation": pb.ParticipationLimit(
                max_per_tree=params["max_participations"],
                min_separation=params["min_separation"],
                rounds_per_tree=params["rounds"],
            ),
        }

    # ---------------------------------------------------------------------------------- the analyzer's noise
    def noise_state(self, plan: dict[str, Any]) -> mfm.NoiseState:
        p = plan["params"]
        return mfm.init_noise(_strategy(p), int(p["d"]))

    def noise_from_arrays(self, plan: dict[str, Any], arrays: dict[str, np.ndarray]) -> mfm.NoiseState:
        state = mfm.NoiseState.from_arrays(arrays)
        p = plan["params"]
        if state.buffers.shape != (_strategy(p).state_rows, int(p["d"])):
            raise ValueError(f"matrix-factorization noise state has shape {state.buffers.shape}, not the plan's")
        return state

    def add_noise(
        self,
        total: np.ndarray,
        round_index: int,
        plan: dict[str, Any],
        params: dict[str, Any],
        state: mfm.NoiseState,
        rng: np.random.Generator,
        used: int,
    ) -> tuple[np.ndarray, float, mfm.NoiseState]:
        """total + w_s + ... + w_t for the round t, s the first row not yet noised (the rounds between released
        nothing: zero rows, their noise released now), so the released prefix sums are (A x + B Z)_t; the fixed
        cohort k divides."""
        if round_index < state.round:
            raise RuntimeError(f"round {round_index} was already noised (next is {state.round})")
        strategy = _strategy(params)
        std = float(params["noise_multiplier"]) * float(params["clip"])
        noise = np.zeros(int(params["d"]))
        for _ in range(state.round, round_index + 1):
            w, state = mfm.next_noise(state, strategy, std, rng)
            noise += w
        return total + noise, float(params["k"]), state

    # ------------------------------------------------------------------------------------ ledger arithmetic
    def accountant_name(self, event: Any, composition: str) -> str:
        return ACCOUNTANT

    def round_cost(self, event: Any) -> tuple[float, float]:
        """The whole run at the event's parameters (what a round belongs to), at the run's delta."""
        p = event.params
        return _epsilon(float(p["noise_multiplier"]), float(p["sensitivity"]), float(p["delta"])), float(p["delta"])

    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]:
        """One Gaussian mechanism: the charged rounds' rows of C, i.e. the sensitivity of the run up to the last
        charged round; the analyzer adds the noise, so no contributor's honesty enters."""
        p = events[0].params
        sens = max(float(e.params["prefix_sensitivity"]) for e in events)
        return _epsilon(float(p["noise_multiplier"]), sens, limit.delta), limit.delta

    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]:
        return {}

    # -------------------------------------------------------------------------------------------- client
    def verify_epsilon(self, spec: pb.RoundSpec) -> float:
        """The claim recomputed from the spec's strategy and limits without JAX: the run's Delta is at least the
        canonical pattern's (exact for non-negative non-increasing C), so an analyzer claiming less is caught."""
        p = _params_of_spec(spec)
        E, xi = p["max_participations"], p["min_separation"]
        sens = max(p["sensitivity"], _canonical_sensitivity(_strategy(p), E, xi))
        return self.per_user_claim({**p, "sensitivity": sens})[0]

    def user_account(self, spec: pb.RoundSpec) -> UserAccount:
        """A user's cost in the run (issue 24 item 2; design 6): the Gaussian mechanism restricted to the rounds
        the user actually joined, Delta_u = sqrt(sum_{i,j in u} |X_ij|) over all T rows of C (pattern_sensitivity,
        arXiv:2306.08153 eq. (5)), at the run's delta: a user of the worst pattern pays the ledger's figure, one
        of fewer rounds less. The node checks the limits itself: at most k_max rounds, >= xi between two."""
        p = _params_of_spec(spec)
        strategy = _strategy(p)
        z, delta = p["noise_multiplier"], p["delta"]
        E, xi = p["max_participations"], p["min_separation"]

        def joined(counts: Counts) -> list[int]:
            return sorted(int(key) for key, c in counts if c)

        def cost(counts: Counts) -> tuple[float, float]:
            rounds = joined(counts)
            if not rounds:
                return 0.0, 0.0
            return _epsilon(z, mfm.pattern_sensitivity(strategy, rounds), delta), delta

        def allows(counts: Counts) -> bool:
            rounds = joined(counts)
            if any(c > 1 for _, c in counts):  # a round joined twice: its count holds one row of C, not two
                return False
            return len(rounds) <= E and all(b - a - 1 >= xi for a, b in zip(rounds, rounds[1:], strict=False))

        return UserAccount(spec.run_id, str(int(spec.round)), None, cost, allows)
