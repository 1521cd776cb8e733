"""DP-FTRL's rounds as a plug-in (seed 003, spec 003 sections 1-4; design 2 "central"): tree aggregation of
clipped updates sealed to the analyzer.

Round t (a leaf of the current tree): the shuffler draws k users uniformly (CSPRNG) among those its durable record
allows under the run's participation limits (each user at most E leaves per tree, >= xi leaves strictly between two
of them; RoundSpec.participation, spec 003 sec 4 "allowed access pattern"); each clips its gradient to C and seals
it (protocols.central); the analyzer sums the valid ones (G_t - G_{t-1}) and adds the tree's residual noise
Z_t - Z_{t-1} (mechanisms.tree_noise: the noise-only binary counter, node std z C, vanilla or Honaker's efficient
estimator), so that the released prefix sums are s_t = G_t + Z_t exactly, whatever the order (spec 003 sec 1,
"residual form"); the optimizer (optimizers.ftrl) gets r_t / k with the fixed cohort k as the divisor (spec 003
sec 4: "divide by the fixed RG").

Trees and restarts: rounds_per_tree consecutive rounds form a tree (one tree when unset); the next round starts a
fresh tree. Summing residuals across the restart keeps theta_0 and G and adds the old tree's final noise Z_end to
the running sum: the centralized repo's restart (spec 003 sec 2). With completion, the last leaf of a tree
releases G_T + Z_end with Z_end the single root noise of the tree padded by virtual zero leaves to the next power
of two (spec 003 sec 2, "tree completion"), and the accountant counts the padded tree.

Every round index of a tree is a leaf: a round that released nothing (below threshold, refused, outcome unknown,
or lost in an analyzer crash before its checkpoint) gets a zero leaf when the next round is noised, and that
round's release carries the zero leaves' residuals too, so leaf positions are round positions (what the shuffler's
separation rule and the accountant count) and every released prefix sum is exactly G_t + Z_t. A node's
noise is drawn once and kept in the run's checkpoints (noise_state), so a restarted analyzer never redraws a node
it released; a node drawn after the last checkpoint was never released (metrics and models leave the analyzer only
through checkpoints), so redrawing it is safe.

Privacy (spec 003 sec 3): the released nodes of tree j form a Gaussian mechanism with squared sensitivity
zeta_j C^2 (zero-out neighbours, leaf sensitivity C; spec 003 A2), zeta_j from (T_j leaves, E, xi, completion)
by the tree accountant; the trees compose (zeta adds up). The ledger composes exactly the events of the rounds it
charged (T_j = last charged leaf of tree j + 1): the same figure as `shuffledp account tree` for the same
(z, steps, E, xi, trees, completion, noise). Noise (privacy.tree.noise, issue 24 D19): by default every node is the
discrete Gaussian on a grid and every leaf is rounded to it (mechanisms.discrete_gaussian), so the node values are
integers (in grid units) whose shift has squared norm <= zeta (C + g ceil(sqrt d))^2 / g^2, and the nodes are
(zeta / (2 z^2))-zCDP (CKS20 Thm 14, std inflated for the rounding); charged the RDP conversion of rho^2 = zeta /
z^2 (CKS20 Prop 12); "continuous": numpy's Gaussian, charged the exact GDP curve (Balle-Wang 2018).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from shuffledp.mechanisms import discrete_gaussian, tree_noise
from shuffledp.protocols.base import Counts, PlanRequest, RoundPlan, UserAccount
from shuffledp.protocols.central import CentralRound, check_fixed_cohort, noise_multiplier_setting, noise_setting
from shuffledp.settings import ConfigError, RunConfig, setting
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["TreeRound", "TreeRun"]


class TreeRun(NamedTuple):
    """The analyzer's tree noise for a run: the next round index to noise, and the current tree's state."""

    next_round: int
    tree: tree_noise.TreeState

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"next_round": np.asarray(self.next_round, dtype=np.int64), **self.tree.to_arrays()}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> TreeRun:
        rest = {k: v for k, v in arrays.items() if k != "next_round"}
        if "next_round" not in arrays or np.asarray(arrays["next_round"]).shape != ():
            raise ValueError("tree noise state needs a scalar next_round")
        return cls(int(arrays["next_round"]), tree_noise.TreeState.from_arrays(rest))


def _tree_event(params: dict[str, Any], steps: int, completion: bool) -> Any:
    from shuffledp.accountants.events import TreeAggregation

    E, xi = int(params["max_participations"]), int(params["min_separation"])
    return TreeAggregation(float(params["noise_multiplier"]), int(steps), E, xi, completion)


def _items(events: Sequence[Any]) -> list[tuple[Any, int]]:
    """One TreeAggregation per tree the rounds touched: T_j = last charged leaf + 1 (module docstring)."""
    last: dict[int, int] = {}
    params: dict[str, Any] = {}
    for e in events:
        params = e.params
        tree, leaf = divmod(int(e.params["round"]), int(e.params["rounds_per_tree"]))
        last[tree] = max(last.get(tree, -1), leaf)
    per_tree = int(params.get("rounds_per_tree", 0))
    out: Counter = Counter()
    for leaf in last.values():
        steps = leaf + 1
        out[_tree_event(params, steps, bool(params["completion"]) and steps == per_tree)] += 1
    return list(out.items())


@dataclass(frozen=True)
class TreeSettings:
    """[privacy.tree]: per tree, each user in at most max_participations rounds, at least min_separation rounds
    strictly between two (spec 003 sec 4; the shuffler enforces both)."""

    noise_multiplier: float | None = noise_multiplier_setting("node noise std / clip_norm")
    noise: str | None = noise_setting()
    max_participations: int = setting(
        1, "rounds a user may join per tree (E; the shuffler enforces it)", lo=1, hi=10**6
    )
    min_separation: int = setting(0, "rounds strictly between two of a user's rounds in one tree (xi)", lo=0, hi=10**6)
    rounds_per_tree: int = setting(
        0, "rounds per tree, a fresh tree after each (restarts); 0 = one tree", lo=0, hi=100_000
    )
    completion: bool = setting(False, "pad each finished tree to a power of two (single-root noise at a restart)")
    tree_estimator: str = setting(
        "efficient",
        '"efficient" (Honaker, less variance, same privacy) or "vanilla"',
        choices=("efficient", "vanilla"),
    )


class TreeRound(CentralRound):
    """The DP-FTRL plug-in (module docstring)."""

    name = "tree"
    settings = TreeSettings
    schedules = ("subsampled",)
    # the tree's residuals feed FTRL, or SGD (post-processing of the same prefix sums; spec 003 sec 1, B.3)
    optimizers = ("ftrl", "sgd")
    auto_optimizer = "ftrl"
    # the central DP-SGD example's cohorts (150 of digits' 1348 users, 24 rounds): 3600 seats need each user in up
    # to 3 rounds (spec 003 sec 4: <= E per tree, >= xi rounds between two; 150 x (7 + 1) <= 1348 users free)
    example = {
        "privacy.tree": {"max_participations": 3, "min_separation": 7},
        "schedule": {"kind": "subsampled", "cohort_size": 150, "rounds": 24, "learning_rate": 2.0},
        "transport": {"mode": "sealed"},
    }

    def check_config(self, cfg: RunConfig, optimizer: str) -> None:
        check_fixed_cohort(cfg, self.name)
        own: TreeSettings = cfg.privacy.settings
        if own.completion and own.rounds_per_tree and own.rounds_per_tree >= cfg.schedule.rounds:
            raise ConfigError(
                "privacy.tree.completion pads a tree before a restart: privacy.tree.rounds_per_tree must be < rounds"
            )

    # ------------------------------------------------------------------------------------------ analyzer
    def plan(self, req: PlanRequest) -> RoundPlan:
        """The node noise multiplier z from the budget (or privacy.tree.noise_multiplier, checked against it); the
        participation limits checked for feasibility against the population."""
        from shuffledp.accountants import ledger_accounting as la

        if req.kind != "subsampled":
            raise ValueError(
                f'privacy.protocol = "tree" (DP-FTRL) needs schedule.kind = "subsampled", got "{req.kind}"'
            )
        if req.rounds_requested is None:
            raise ValueError('privacy.protocol = "tree" needs schedule.rounds (the leaves of the run)')
        o: TreeSettings = req.settings
        T, k, n = int(req.rounds), int(req.cohort), int(req.admitted)
        E, xi = o.max_participations, o.min_separation
        per_tree = o.rounds_per_tree or T
        completion = o.completion
        noise = discrete_gaussian.plan_noise(o.noise)
        if completion and per_tree >= T:
            raise ValueError("privacy.tree.completion pads a tree before a restart: set rounds_per_tree < rounds")
        # the shuffler can fill every leaf only if k users are free at each: a user takes at most one leaf in any
        # xi + 1 consecutive ones and at most E per tree (spec 003 sec 4)
        if k * (xi + 1) > n:
            raise ValueError(
                f"cohort_size {k} x (min_separation {xi} + 1) exceeds the {n} admitted users: the shuffler could not "
                "fill the rounds"
            )
        if min(per_tree, T) * k > E * n:
            raise ValueError(
                f"a tree of {min(per_tree, T)} rounds of {k} users needs more than max_participations {E} x {n} "
                "admitted users"
            )
        trees = math.ceil(T / per_tree)
        params = {
            "d": req.dim,
            "clip": req.clip_norm,
            "k": k,
            "n": n,
            "max_participations": E,
            "min_separation": xi,
            "rounds_per_tree": per_tree,
            "trees": trees,
            "completion": completion,
            "efficient": o.tree_estimator == "efficient",
            "delta": req.delta,
            "noise_multiplier": 1.0,
            "noise": noise,
        }
        # planned as `trees` complete trees: a shorter last tree costs less (zeta grows with the leaves)
        full = _tree_event(params, per_tree, completion)
        z = o.noise_multiplier
        if z is None:
            best, _ = la.min_noise(full, trees, req.eps, req.delta, noise=noise)
            z = best.noise_multiplier
        else:
            ev = _tree_event({**params, "noise_multiplier": z}, per_tree, completion)
            got = la.account([(ev, trees)], req.delta, noise=noise)
            if got.eps > req.eps:
                raise ValueError(
                    f"privacy.tree.noise_multiplier = {z} spends eps = {got.eps:.4g} over {trees} tree(s) of "
                    f"{per_tree} rounds, above privacy.eps = {req.eps}; raise it or leave it unset"
                )
        params["noise_multiplier"] = float(z)
        # E||prefix noise of the sum||^2 at its worst leaf (spec 003 sec 1): what a step-size rule would need
        worst = max(tree_noise.prefix_variance(t, params["efficient"]) for t in range(1, min(per_tree, 4096) + 1))
        noise_sq = req.dim * (float(z) * req.clip_norm) ** 2 * worst
        n_min = max(1, math.ceil(req.min_contributors_fraction * k))
        return RoundPlan(params, "rdp", 0.0, noise_sq, rounds=T, min_contributors=n_min)

    def event_params(self, plan: dict[str, Any], round_index: int) -> dict[str, Any]:
        return {**plan["params"], "round": int(round_index)}  # the leaf position is what the tree accountant counts

    def per_user_claim(self, params: dict[str, Any]) -> tuple[float, float]:
        """A participation's share of one complete tree's cost (eps_tree / E at delta / (E trees)): the claims of a
        user's at most E x trees rounds add up, by basic composition, to at least what the trees cost together."""
        from shuffledp.accountants import ledger_accounting as la

        E, trees = int(params["max_participations"]), int(params["trees"])
        delta_tree = float(params["delta"]) / trees
        full = _tree_event(params, int(params["rounds_per_tree"]), bool(params["completion"]))
        return la.account([full], delta_tree, noise=discrete_gaussian.noise_of(params)).eps / E, delta_tree / E

    def spec_fields(self, plan: dict[str, Any], params: dict[str, Any], event: Any, key: bytes) -> dict[str, Any]:
        eps_r, delta_r = self.per_user_claim(params)
        extra = {
            "noise_multiplier": params["noise_multiplier"],
            "max_participations": float(params["max_participations"]),
            "min_separation": float(params["min_separation"]),
            "rounds_per_tree": float(params["rounds_per_tree"]),
            "trees": float(params["trees"]),
            "completion": float(params["completion"]),
            "delta": float(params["delta"]),
            discrete_gaussian.SPEC_KEY: float(discrete_gaussian.noise_of(params) == "discrete"),
        }
        return {
            **self._sealed_fields(params, key, extra),
            "per_user_cost": pb.PrivacyCost(
                eps=eps_r, delta=delta_r, accountant=self.accountant_name(event, "rdp"), trust_model=self.trust_model
            ),
            "participation": pb.ParticipationLimit(
                max_per_tree=params["max_participations"],
                min_separation=params["min_separation"],
                rounds_per_tree=params["rounds_per_tree"],
            ),
        }

    # ---------------------------------------------------------------------------------- the analyzer's noise
    def noise_state(self, plan: dict[str, Any]) -> TreeRun:
        return TreeRun(0, tree_noise.init_tree(int(plan["params"]["d"])))

    def noise_from_arrays(self, plan: dict[str, Any], arrays: dict[str, np.ndarray]) -> TreeRun:
        return TreeRun.from_arrays(arrays)

    def add_noise(
        self,
        total: np.ndarray,
        round_index: int,
        plan: dict[str, Any],
        params: dict[str, Any],
        state: TreeRun,
        rng: np.random.Generator,
        used: int,
    ) -> tuple[np.ndarray, float, TreeRun]:
        """total + Z_t - Z_s for the round's leaf t, s the last leaf released (zero leaves for the rounds between,
        which released nothing), so the released totals' prefix sums stay G_t + Z_t; the fixed cohort k divides."""
        if round_index < state.next_round:
            raise RuntimeError(f"round {round_index} was already noised (next is {state.next_round})")
        noise = np.zeros(int(params["d"]))
        for r in range(state.next_round, round_index + 1):
            step, state = self._leaf(r, params, state, rng)
            noise += step
        # the leaf rounded to the nodes' grid (mechanisms.discrete_gaussian), so that the tree's values are on it
        if discrete_gaussian.noise_of(params) == "discrete":
            total = discrete_gaussian.round_to_grid(total, self._grid(params))
        return total + noise, float(params["k"]), state

    @staticmethod
    def _grid(params: dict[str, Any]) -> float:
        clip = float(params["clip"])
        return discrete_gaussian.granularity(params, float(params["noise_multiplier"]) * clip, clip, int(params["d"]))

    def _leaf(
        self, r: int, params: dict[str, Any], state: TreeRun, rng: np.random.Generator
    ) -> tuple[np.ndarray, TreeRun]:
        per_tree, efficient = int(params["rounds_per_tree"]), bool(params["efficient"])
        std = float(params["noise_multiplier"]) * float(params["clip"])
        tree = state.tree
        leaf = r % per_tree
        if leaf == 0 and tree.leaves:
            tree = tree_noise.init_tree(tree.dim)  # a restart (spec 003 sec 2)
        before = tree_noise.prefix_noise(tree)
        # a node's sensitivity is C per leaf of the user's (zero-out): the grid's inflation is paid per leaf
        grid = {
            "sensitivity": float(params["clip"]),
            "granularity": self._grid(params),
            "noise": discrete_gaussian.noise_of(params),
        }
        noise, tree = tree_noise.residual_noise(tree, std, rng, efficient, **grid)
        if params["completion"] and leaf == per_tree - 1:
            # the tree's last leaf releases G_T + Z_end, Z_end the padded tree's root noise (spec 003 sec 2)
            z_end, _, tree = tree_noise.complete_tree(tree, std, rng, efficient, **grid)
            noise = z_end - before
        return noise, TreeRun(r + 1, tree)

    # ------------------------------------------------------------------------------------ ledger arithmetic
    def accountant_name(self, event: Any, composition: str) -> str:
        if discrete_gaussian.noise_of(event.params) == "discrete":
            return "tree-discrete-gaussian-rdp (seed 003 zeta rule, CKS20 Thm 14 + Prop 12 conversion; central trust)"
        return "tree-gaussian-exact (seed 003 zeta rule, Balle-Wang conversion; central trust)"

    def round_cost(self, event: Any) -> tuple[float, float]:
        """One complete tree at the event's parameters (what a round belongs to), at the run's delta."""
        from shuffledp.accountants import ledger_accounting as la

        p = event.params
        full = _tree_event(p, int(p["rounds_per_tree"]), bool(p["completion"]))
        return la.account([full], float(p["delta"]), noise=discrete_gaussian.noise_of(p)).eps, float(p["delta"])

    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]:
        """The trees the charged rounds touched, composed exactly (`shuffledp account tree`); the analyzer adds
        the noise, so no contributor's honesty enters (honest_fraction is not used)."""
        from shuffledp.accountants import ledger_accounting as la

        noise = discrete_gaussian.noise_of(events[0].params)
        return la.account(_items(events), limit.delta, noise=noise).eps, limit.delta

    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]:
        """The paper's own conversion (RDP over alpha in 1.1..199.9, spec 003 sec 3) of the same trees."""
        from shuffledp.accountants import ledger_accounting as la

        return {"paper_rdp": la.account(_items(events), limit.delta, "paper").eps}

    # -------------------------------------------------------------------------------------------- client
    def verify_epsilon(self, spec: pb.RoundSpec) -> float:
        """The claim recomputed from the spec's noise multiplier and limits: central trust means trusting the
        analyzer to add that noise, but an analyzer that claims less than its own parameters imply is caught."""
        x = dict(spec.randomizer.extra)
        params = {
            "noise_multiplier": x.get("noise_multiplier", 0.0),
            "max_participations": int(x.get("max_participations", 1)),
            "min_separation": int(x.get("min_separation", 0)),
            "rounds_per_tree": int(x.get("rounds_per_tree", 1)),
            "trees": int(x.get("trees", 1)),
            "completion": bool(x.get("completion", 0.0)),
            "delta": float(x.get("delta", 0.0)),
            "noise": discrete_gaussian.spec_noise(x),  # absent: discrete (never the continuous figure by default)
        }
        return self.per_user_claim(params)[0]

    def user_account(self, spec: pb.RoundSpec) -> UserAccount:
        """A user's cost in the run (issue 24 item 2; design 6): the trees it joined, each as a tree of the run's
        public parameters whose participation limit is the user's actual number of leaves in it, composed exactly
        as the ledger composes trees (zeta adds up, spec 003 sec 3), at the run's delta. eps is not linear in
        participations: two leaves of a 16-leaf tree cost more than twice one's share. Whole trees are counted
        (zeta grows with the leaves), so a user with E leaves in every tree is charged at least the ledger's
        figure. The node checks the limits itself: at most E leaves per tree, >= xi rounds between two."""
        x = dict(spec.randomizer.extra)
        z, delta = float(x.get("noise_multiplier", 0.0)), float(x.get("delta", 0.0))
        E, xi, per_tree = (int(x.get(f, 0)) for f in ("max_participations", "min_separation", "rounds_per_tree"))
        completion = bool(x.get("completion", 0.0))
        noise = discrete_gaussian.spec_noise(x)
        if not (z > 0.0 and 0.0 < delta < 1.0 and E >= 1 and xi >= 0 and per_tree >= 1):
            raise ValueError("the spec lacks a valid noise multiplier, delta or participation limits")
        tree, leaf = divmod(int(spec.round), per_tree)

        def cost(counts: Counts) -> tuple[float, float]:
            per = Counter(key.split(":")[0] for key, _ in counts)  # leaves joined per tree
            leaves = tuple(sorted(per.values()))
            return _trees_epsilon(z, per_tree, xi, completion, delta, leaves, noise), delta

        def allows(counts: Counts) -> bool:
            if any(c > 1 for _, c in counts):  # a leaf joined twice: the cost counts leaves, not answers
                return False
            leaves: dict[str, list[int]] = {}
            for key, _ in counts:
                t, at = key.split(":")
                leaves.setdefault(t, []).append(int(at))
            for ls in leaves.values():
                ls.sort()
                if len(ls) > E or any(b - a - 1 < xi for a, b in zip(ls, ls[1:], strict=False)):
                    return False
            return True

        return UserAccount(spec.run_id, f"{tree}:{leaf}", None, cost, allows)


@lru_cache(maxsize=4096)
def _trees_epsilon(
    z: float, per_tree: int, xi: int, completion: bool, delta: float, leaves: tuple[int, ...], noise: str = "discrete"
) -> float:
    """eps of trees of per_tree leaves in which a user joined leaves[j] leaves (TreeRound.user_account), under the
    figure the ledger charges for the noise."""
    from shuffledp.accountants import ledger_accounting as la
    from shuffledp.accountants.events import TreeAggregation

    if not leaves:
        return 0.0
    items = Counter(TreeAggregation(z, per_tree, k, xi, completion) for k in leaves)
    return la.account(list(items.items()), delta, noise=noise).eps
