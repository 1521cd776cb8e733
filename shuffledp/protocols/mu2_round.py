"""DP-mu2-FL's rounds as a plug-in (seed 002, Reshef & Levy; spec 002 sections 1-4 and 7): M machines, every
machine in every round, each with an ordered stream of its own examples.

Client (a machine = one user of a node; clients/node.py keeps the per-run state this module defines):
  round t, broadcast (x_t, x_{t-1}) as the model tensor of shape (2, d); z = the machine's t-th example
      s_t = g + (t - 1)(g - g~),  g = grad f(x_t; z),  g~ = grad f(x_{t-1}; z)     (Lemma 4.1, alpha_t = t)
      s_t clipped to l2 norm S = clip_norm                                         ([derived] spec 002 sec 9)
      q_t = q_{t-1} + s_t                                                          (= t d_t, the STORM estimate)
  untrusted server (Alg 1, "mu2_untrusted"): the machine adds Y ~ N(0, sigma_u^2 I) itself (CSPRNG) and seals
      q_t + Y to the analyzer: the raw q_t never leaves it (trust "local");
  trusted server (Alg 2, "mu2_trusted"): it seals the raw q_t and the analyzer adds N(0, sigma_c^2 I) to the
      average (trust "central": the guarantee is against the other machines and the outside, not the analyzer).
  Which t a spec asks for the machine reads off its own state, never off a claim: a spec whose x_{t-1} is the
  x_t it last answered is the next step; one that repeats that x_t and x_{t-1} is the same step again (the
  round was not released, or the analyzer restarted before it stepped), recomputed from q_{t-1} with fresh
  noise; the first spec must have x_0 = x_1. Anything else, and a step past the machine's stream (no example to
  use; it must not fabricate one, spec 002 sec 7), is refused as an invalid spec.

Analyzer: the shuffler releases a round only when all M machines answered (min_contributors = M: the analysis
assumes full participation, spec 002 sec 7); the analyzer opens the M ciphertexts, sums the well-formed ones (a
skipped one counts as zero), adds its noise (trusted: N(0, (M sigma_c)^2 I) on the sum), divides by M and takes
the AnyTime step (optimizers/mu2.py).

Privacy (spec 002 sec 4): replacing one example of one machine changes its q_t for t >= tau* by s_tau*(z) -
s_tau*(z'), norm <= 2S; so each round is a Gaussian mechanism of sensitivity Delta = 2S (per machine, untrusted) or
2S/M (the average, trusted), and T rounds compose exactly to rho-GDP, rho = Delta sqrt(T)/sigma (Thm 5.1 / 6.1;
Dong-Roth-Su Cor 3.3). The ledger's figure is ledger_accounting.account of T GaussianRound events, the same as
`shuffledp account gaussian --sigma sigma --lipschitz-increment S --machines M --trust local|central --noise N`.
sigma is the paper's 2S sqrt(T)/rho (/ M trusted) with rho the largest that fits (eps, delta) under that figure,
rounded up until the composed figure fits; or its table's noise_multiplier * Delta. The noise (its table's `noise`,
issue 24 D19) is by default the discrete Gaussian on a grid (mechanisms.discrete_gaussian), whose rounds are charged
the RDP conversion of the same rho (CKS20 Thm 14: zCDP; the exact GDP curve holds for continuous noise only).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shuffledp.accountants import gaussian
from shuffledp.mechanisms import discrete_gaussian
from shuffledp.mechanisms.discrete_gaussian import noise_of
from shuffledp.protocols.base import (
    Decoded,
    PlanRequest,
    RoundPlan,
    release_floor,
    tensor_to_array,
)
from shuffledp.protocols.central import (
    CentralRound,
    noise_multiplier_setting,
    noise_setting,
    open_vectors,
    seal_rows,
)
from shuffledp.protocols.ldp_round import clip_rows_in_norm
from shuffledp.settings import ConfigError, RunConfig
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["Mu2Round", "Mu2Machines", "mu2_epsilon", "OUT_OF_SYNC", "STREAM_EXHAUSTED"]

OUT_OF_SYNC = "the spec's (x_t, x_{t-1}) follow neither this machine's last step nor its first"
STREAM_EXHAUSTED = "this machine's stream holds no example for step"
_FIELDS = ("sigma", "sensitivity", "machines", "rounds", "delta")


def mu2_epsilon(
    sigma: float, sensitivity: float, trust: str, rounds: int, delta: float, noise: str = "discrete"
) -> float:
    """eps of `rounds` Gaussian rounds (module docstring): ledger_accounting.account of GaussianRound events."""
    from shuffledp.accountants import ledger_accounting
    from shuffledp.accountants.events import GaussianRound

    if rounds == 0:
        return 0.0
    ev = GaussianRound(sigma, sensitivity, trust)
    return float(ledger_accounting.account([(ev, rounds)], delta, noise=noise).eps)


@dataclass
class Mu2Machines:
    """One node's machines in one run: per user, the last step t answered (0: none), the (x_t, x_{t-1}) it
    answered, q_{t-1} and q_t (clients/node.py holds one per run, in memory: a machine whose node restarts is out of
    sync, refuses, and the run stops after its consecutive failed rounds)."""

    t: np.ndarray
    x: np.ndarray  # (n, 2, d)
    q_prev: np.ndarray  # (n, d)
    q: np.ndarray  # (n, d)

    @classmethod
    def empty(cls, n: int, d: int) -> Mu2Machines:
        return cls(np.zeros(n, np.int64), np.zeros((n, 2, d)), np.zeros((n, d)), np.zeros((n, d)))


@dataclass(frozen=True)
class Mu2Settings:
    """[privacy.mu2_untrusted], [privacy.mu2_trusted]"""

    noise_multiplier: float | None = noise_multiplier_setting("noise std / the message's sensitivity")
    noise: str | None = noise_setting()


class Mu2Round(CentralRound):
    """DP-mu2-FL, untrusted (local noise) or trusted (central noise) server (module docstring)."""

    settings = Mu2Settings
    schedules = ("fully_interactive",)
    optimizers = ("mu2",)
    auto_optimizer = "mu2"
    # M machines = the users, each with a stream of examples_per_user >= rounds examples, one fresh per round
    # privacy.delta: each of the T rounds claims the run's delta to the users, who add the claims up (basic
    # composition, clients/policy.py): unset (1e-3, policy.max_delta_per_round) refused round 11 at max_total_delta
    example = {
        "data": {"examples_per_user": 20},
        "privacy": {"delta": 1e-4},
        "schedule": {"rounds": 20, "learning_rate": 0.5},
        "transport": {"mode": "sealed"},
    }

    def check_config(self, cfg: RunConfig, optimizer: str) -> None:
        s = cfg.schedule
        if s.rounds is None:
            raise ConfigError(
                f'privacy.protocol = "{self.name}" needs schedule.rounds (T, one example per machine each)'
            )
        if cfg.data.examples_per_user < s.rounds:
            raise ConfigError(
                f"DP-mu2-FL uses one fresh example per machine per round: data.examples_per_user = "
                f"{cfg.data.examples_per_user} must be >= schedule.rounds = {s.rounds}"
            )

    def __init__(self, trusted: bool) -> None:
        self.trusted = trusted
        self.name = "mu2_trusted" if trusted else "mu2_untrusted"
        self.trust_model = pb.CENTRAL if trusted else pb.LOCAL
        self.trust = "central" if trusted else "local"

    # --------------------------------------------------------------------------------- analyzer: sizing
    def plan(self, req: PlanRequest) -> RoundPlan:
        if req.kind != "fully_interactive":
            raise ValueError(
                f'privacy.protocol = "{self.name}" needs schedule.kind = "fully_interactive" (every '
                f'machine every round, spec 002 sec 7), got "{req.kind}"'
            )
        T, M, S = int(req.rounds), int(req.cohort), float(req.clip_norm)
        sens = gaussian.sensitivity(S, M, self.trusted)  # 2S or 2S/M (spec 002 sec 4)
        noise = discrete_gaussian.plan_noise(req.settings.noise)
        z = req.settings.noise_multiplier
        if z is not None:
            sigma = float(z) * sens
        else:
            rho = gaussian.rho_for_epsilon(req.eps, req.delta, gaussian.conversion(noise))
            sigma = gaussian.theorem_sigma(S, T, rho, M, self.trusted)  # Alg 1 / Alg 2
            for _ in range(64):  # rho is rounded down already; make sure the composed figure fits
                if mu2_epsilon(sigma, sens, self.trust, T, req.delta, noise) <= req.eps:
                    break
                sigma *= 1.0 + 1e-9
        spent = mu2_epsilon(sigma, sens, self.trust, T, req.delta, noise)
        if spent > req.eps:
            raise ValueError(
                f"privacy.{self.name}.noise_multiplier = {z} spends eps = {spent:.4g} over {T} rounds, above "
                f"privacy.eps = {req.eps}; raise it or leave it unset"
            )
        params = {"d": req.dim, "clip": S, "machines": M, "rounds": T, "delta": req.delta}
        params.update(sigma=sigma, sensitivity=sens, noise=noise)
        # E||noise of the averaged message||^2: d sigma_u^2 / M untrusted, d sigma_c^2 trusted (optimizers/mu2.py)
        noise_sq = req.dim * sigma**2 * (1.0 if self.trusted else 1.0 / M)
        return RoundPlan(params, "rdp", 0.0, noise_sq, rounds=T, min_contributors=M)

    def spec_fields(self, plan: dict[str, Any], params: dict[str, Any], event: Any, key: bytes) -> dict[str, Any]:
        eps_r, delta_r = self.round_cost(event)
        extra = {k: float(params[k]) for k in _FIELDS}
        extra[discrete_gaussian.SPEC_KEY] = float(discrete_gaussian.noise_of(params) == "discrete")
        fields = self._sealed_fields(params, key, extra)
        fields["per_user_cost"] = pb.PrivacyCost(
            eps=eps_r, delta=delta_r, accountant=self.accountant_name(event, "rdp"), trust_model=self.trust_model
        )
        return fields

    # ----------------------------------------------------------------------------- analyzer: the batch
    def decode(
        self,
        batch: pb.ShuffledBatch,
        n: int,
        plan: dict[str, Any],
        params: dict[str, Any],
        private_key: Any,
        info: bytes,
    ) -> Decoded:
        """Sum of the well-formed messages (d finite float64 values); a skipped one counts as zero. No norm bound:
        an untrusted machine's message is noisy, and a machine that sends a wrong q_t harms only itself."""
        X, rejected = open_vectors(batch, n, int(params["d"]), private_key, info)
        rejected_all = dict(Counter(dict(batch.report.rejected)) + rejected)
        return Decoded(X.sum(axis=0), X.shape[0], n, rejected_all)

    def add_noise(
        self,
        total: np.ndarray,
        round_index: int,
        plan: dict[str, Any],
        params: dict[str, Any],
        state: None,
        rng: np.random.Generator,
        used: int,
    ) -> tuple[np.ndarray, float, None]:
        M = float(params["machines"])
        total = np.asarray(total, dtype=np.float64)
        if self.trusted:  # Alg 2: N(0, sigma_c^2) on the average = N(0, (M sigma_c)^2) on the sum
            # as the discrete Gaussian on a grid (mechanisms.discrete_gaussian); the sum's sensitivity is 2S, S the
            # smaller reference (more inflation, safe)
            std, clip = M * float(params["sigma"]), float(params["clip"])
            g = discrete_gaussian.granularity(params, std, clip, total.shape[-1])
            noise = discrete_gaussian.noise_of(params)
            total = discrete_gaussian.release_on_grid(total, std, clip, rng, g, noise=noise)
        return total, M, None  # always M: a skipped message is a zero, the sensitivity stays 2S/M

    # ------------------------------------------------------------------------------------ ledger arithmetic
    def accountant_name(self, event: Any, composition: str) -> str:
        who = "trusted server, central" if self.trusted else "untrusted server, local"
        thm = "6.1" if self.trusted else "5.1"
        if discrete_gaussian.noise_of(event.params) == "discrete":
            return f"gaussian-rdp (seed 002 Thm {thm}; discrete Gaussian, CKS20 Thm 14 + Prop 12; {who} trust)"
        return f"gaussian-exact (seed 002 Thm {thm}, Balle-Wang; {who} trust)"

    def round_cost(self, event: Any) -> tuple[float, float]:
        p = event.params
        eps = mu2_epsilon(float(p["sigma"]), float(p["sensitivity"]), self.trust, 1, p["delta"], noise_of(p))
        return eps, p["delta"]

    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]:
        p = events[0].params
        eps = mu2_epsilon(float(p["sigma"]), float(p["sensitivity"]), self.trust, len(events), limit.delta, noise_of(p))
        return eps, limit.delta

    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]:
        return {}

    # -------------------------------------------------------------------------------------------- client
    def verify_epsilon(self, spec: pb.RoundSpec) -> float:
        """One round's eps from what the machine knows itself: it clips s_t to clip_norm S, so the sensitivity is
        2S, or 2S/M on an average the shuffler releases only with M = release_floor(spec) machines in it."""
        x = dict(spec.randomizer.extra)
        S, M = float(spec.randomizer.clip_norm), release_floor(spec)
        sigma, delta = x.get("sigma", 0.0), x.get("delta", 0.0)
        if not (S > 0 and spec.min_contributors >= 1 and sigma > 0 and math.isfinite(sigma) and 0 < delta < 1):
            raise ValueError("the spec lacks a valid clip norm, machine count, sigma or delta")
        noise = discrete_gaussian.spec_noise(x)  # absent: discrete (never the continuous figure by default)
        return mu2_epsilon(sigma, gaussian.sensitivity(S, M, self.trusted), self.trust, 1, delta, noise)

    def local_vectors(self, spec: pb.RoundSpec, node: Any, idx: np.ndarray) -> np.ndarray:
        """q_t of each machine of idx (module docstring); its state advances here (the node's lock is held)."""
        xs = tensor_to_array(spec.model)
        d = int(spec.randomizer.dim)
        if xs.shape != (2, d):
            raise ValueError(f"the model must be (x_t, x_(t-1)) of shape (2, {d}), got {xs.shape}")
        st = node.protocol_state(spec.run_id, lambda n: Mu2Machines.empty(n, d))
        t_last, seen = st.t[idx], st.x[idx]
        first = (t_last == 0) & np.array_equal(xs[0], xs[1])
        again = (t_last > 0) & np.all(seen == xs, axis=(1, 2))
        after = (t_last > 0) & np.all(seen[:, 0] == xs[1], axis=1) & ~again
        if not np.all(first | again | after):
            raise ValueError(OUT_OF_SYNC)
        t = np.where(again, t_last, t_last + 1)
        stream = node.shard.X.shape[1]
        if int(t.max()) > stream:
            raise ValueError(f"{STREAM_EXHAUSTED} {int(t.max())} (it holds {stream})")
        base = np.where(again[:, None], st.q_prev[idx], st.q[idx])
        g = node.example_gradients(spec, idx, xs[0], t - 1)
        g_prev = node.example_gradients(spec, idx, xs[1], t - 1)
        s = clip_rows_in_norm(g + (t - 1)[:, None] * (g - g_prev), float(spec.randomizer.clip_norm), 2)
        q = base + s
        st.q_prev[idx], st.q[idx], st.t[idx], st.x[idx] = base, q, t, xs
        return q

    def randomize(
        self,
        spec: pb.RoundSpec,
        G: np.ndarray,
        user_ids: Sequence[str],
        nonces: Sequence[bytes],
        rng: np.random.Generator,
        out: pb.Contribution,
    ) -> None:
        """Seal q_t (trusted) or q_t + N(0, sigma_u^2 I) from the node's CSPRNG (untrusted) per machine."""
        Q = np.asarray(G, dtype=np.float64)
        if not self.trusted:  # each machine's q_t (sensitivity 2S, S = clip_norm) with the grid's discrete Gaussian
            x = dict(spec.randomizer.extra)
            noise = discrete_gaussian.spec_noise(x)  # what the spec's figure is proven for
            Q = discrete_gaussian.release_on_grid(
                Q, float(x["sigma"]), float(spec.randomizer.clip_norm), rng, noise=noise
            )
        seal_rows(spec, Q, user_ids, nonces, out)
