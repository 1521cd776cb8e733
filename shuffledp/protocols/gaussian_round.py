"""Central DP-SGD's rounds as a plug-in (the baseline of seed 003's experiments; design 2 "central"): the sampled
Gaussian mechanism on the sum of clipped updates sealed to the analyzer.

Round t: the shuffler draws a uniform k-subset of the n admitted users (CSPRNG; schedule SUBSAMPLED, a fixed cohort
size, secret from the analyzer's point of view only up to what it decodes); each clips its gradient to C and seals
it (protocols.central); the shuffler releases the batch only when all k arrived (threshold k, as for CLDP-SGD: a
dropout releases nothing and costs nothing, dropouts being independent of the data); the analyzer sums the valid
vectors (a skipped one counts as a zero vector, inside the clip ball), adds N(0, (z C)^2 I) from the CSPRNG and
divides by k. The noise (privacy.gaussian.noise, issue 24 D19) is by default numpy's continuous Gaussian: the figures
proven for the discrete Gaussian here are missing (Poisson) or far looser at small eps (fixed cohort, below).
noise = "discrete" (fixed cohort only) adds the discrete Gaussian on a fine grid (mechanisms.discrete_gaussian:
exact sampling, the sum rounded to the grid and the std raised by the rounding's sensitivity growth, <= 2^-20),
whose Renyi DP is at most the continuous Gaussian's at every order (CKS20 Thm 14).

Privacy: what the accountant assumes is what the shuffler does: sampling WITHOUT replacement of a fixed k of n,
under replace-one neighbours (n public). Replacing one user moves the clipped sum by at most 2C, so the Gaussian's
noise multiplier is z C / (2 C) = z / 2. Continuous noise: dp_accounting's RDP accountant, Wang, Balle and
Kasiviswanathan 2019 Thm 27 (SampledWithoutReplacementDpEvent), whose forward differences use the Gaussian's
exact moments. Discrete noise: their Thm 9, proven for ANY mechanism given an upper bound on its RDP at integer
orders (accountants.rdp.subsampled_wor_rdp), capped by the unsampled RDP; equal to Thm 27 at small z and large
eps, but its terms q^j C(alpha, j) 2 e^{(j-1) eps(j)} do not vanish as z grows, so small budgets need far more noise.
Rounds compose in RDP; the conversion to (eps, delta) is the optimal one (CKS20 Prop 12). (Replace-one is the
stronger relation: DP-FTRL's tree accountant uses zero-out, spec 003 A2, so at equal eps this baseline is held to
a stricter guarantee; reports name both.)

schedule.sampling = "poisson" (issue 14 item 5; CONTINUOUS noise: dp_accounting's sampled-Gaussian RDP / PLD are
proven for the continuous Gaussian only, so noise = "discrete" is refused there): the shuffler invites each
eligible user independently with q = k/n from its CSPRNG (RoundSpec.sampling_rate) and releases whatever arrives,
an empty batch included; the analyzer adds N(0, (z C)^2 I) to the sum and divides by the expected k = q n whatever
the batch's size. This is the sampled Gaussian mechanism as Abadi et al. 2016 and dp_accounting define it: add-or-
remove-one neighbours (sensitivity C, noise multiplier z), PoissonSampledDpEvent(q, GaussianDpEvent(z)) per round,
every round charged. The ledger's figure is ledger_accounting.account of the GaussianRound events, i.e. exactly
`shuffledp account gaussian --sigma zC --sensitivity C --sampling-rate q` (the smaller of dp_accounting's
pessimistic PLD and RDP); z is calibrated on the RDP bound alone (a bisection of PLD builds would take seconds per
step), so the ledger charges at most the budget and usually less. A dropout lowers a user's inclusion probability
below q, which only lowers the sampled Gaussian's privacy loss. The count of a round's contributors is seen by the
analyzer (trusted here) and is in its per-round metrics: the accountant covers the released model, not those
operator metrics."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from shuffledp.accountants.rdp import optimal_epsilon, round_up, subsampled_wor_rdp
from shuffledp.mechanisms import discrete_gaussian
from shuffledp.protocols.base import Counts, PlanRequest, RoundPlan, UserAccount
from shuffledp.protocols.central import CentralRound, check_fixed_cohort, noise_multiplier_setting, noise_setting
from shuffledp.settings import ConfigError, RunConfig
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["GaussianRound", "wor_epsilon", "poisson_epsilon", "unamplified_epsilon", "least_noise_multiplier"]

_NOISE_FIELD = "noise_multiplier"


@lru_cache(maxsize=4096)
def wor_epsilon(noise_multiplier: float, n: int, k: int, rounds: int, delta: float, noise: str = "continuous") -> float:
    """eps of `rounds` rounds of the Gaussian (std z C) on the sum of a uniform k-of-n cohort's C-clipped vectors,
    replace-one neighbours (module docstring): continuous noise, dp_accounting RDP (SampledWithoutReplacementDpEvent,
    WBK19 Thm 27); discrete noise, WBK19 Thm 9 on the Gaussian's RDP curve alpha / (2 (z/2)^2) (CKS20 Thm 14)."""
    if rounds == 0:
        return 0.0
    if discrete_gaussian.noise_of({"noise": noise}) == "discrete":
        zr = noise_multiplier / 2.0  # sensitivity 2C under replace-one

        def curve(orders: np.ndarray) -> np.ndarray:
            # and never above the unsampled mechanism's RDP: with the subsample coupled, the outputs are mixtures
            # of pairs at replace-one distance (Renyi divergence is jointly quasi-convex, van Erven-Harremoes Thm 13)
            base = np.asarray(orders, dtype=np.float64) / (2.0 * zr * zr)
            return np.minimum(subsampled_wor_rdp(lambda a: a / (2.0 * zr * zr), k / n, orders), base)

        return float(optimal_epsilon(curve, rounds, delta)[0])
    acc = rdp.RdpAccountant(neighboring_relation=rdp.NeighborRel.REPLACE_ONE)
    inner = dp_event.GaussianDpEvent(noise_multiplier / 2.0)  # sensitivity 2C under replace-one
    acc.compose(dp_event.SampledWithoutReplacementDpEvent(n, k, inner), rounds)
    return round_up(acc.get_epsilon(delta))  # dp_accounting's float figure, raised by the float margin


@lru_cache(maxsize=4096)
def poisson_epsilon(noise_multiplier: float, q: float, rounds: int, delta: float, accountant: str = "tight") -> float:
    """eps of `rounds` Poisson-sampled rounds (rate q) of the Gaussian (std z C) on the sum of C-clipped vectors,
    add-or-remove-one (module docstring): what `shuffledp account gaussian --sampling-rate q` reports ("tight": the
    smaller of PLD and RDP; "paper": dp_accounting's RDP alone, what the calibration uses). Continuous noise only
    (module docstring)."""
    from shuffledp.accountants import ledger_accounting
    from shuffledp.accountants.events import GaussianRound as GaussianEvent

    if rounds == 0:
        return 0.0
    event = GaussianEvent(noise_multiplier, 1.0, "central", "poisson", q)  # sigma = z C, sensitivity C, C = 1
    return float(ledger_accounting.account([(event, rounds)], delta, accountant).eps)


@lru_cache(maxsize=4096)
def unamplified_epsilon(
    noise_multiplier: float, rounds: int, delta: float, poisson: bool, noise: str = "continuous"
) -> float:
    """eps of `rounds` rounds of the Gaussian (std z C) on a sum that may hold the user's C-clipped vector, without
    amplification by sampling (a round that samples the user or not is no worse than one that holds it:
    GaussianRound.user_account): a Gaussian mechanism composed exactly (mu-GDP, Dong-Roth-Su 2019 Cor 3.3) with
    mu = sqrt(rounds) * sensitivity / (z C): sensitivity 2C under replace-one (fixed cohort), C under
    add-or-remove-one (Poisson), the neighbouring relation of the run's own accountant; the tightest conversion
    proven for the noise (accountants.gaussian.conversion: Balle-Wang 2018's exact curve for continuous noise, the
    RDP conversion of CKS20 Thm 14's zCDP for discrete noise)."""
    from shuffledp.accountants.gaussian import conversion, epsilon_for_rho

    if rounds == 0:
        return 0.0
    sensitivity = 1.0 if poisson else 2.0
    return epsilon_for_rho(math.sqrt(rounds) * sensitivity / noise_multiplier, delta, conversion(noise))


def least_noise_multiplier(fits: Callable[[float], bool], what: str) -> float:
    """The least z (within 1e-9 relative, on the feasible side) with fits(z), for a fits that holds for large z:
    a geometric bracket, then bisection (composition.bisect_boundary)."""
    from shuffledp.accountants import composition

    good = 1.0
    while not fits(good):
        good *= 4.0
        if good > 1e9:
            raise ValueError(f"no noise multiplier fits {what}")
    bad = good
    while fits(bad) and bad > 1e-6:
        bad /= 4.0
    return composition.bisect_boundary(fits, good, bad, rel_tol=1e-9, geometric=True)


def _poisson(params: dict[str, Any]) -> bool:
    return params.get("sampling") == "poisson"  # plans from before issue 14 have no key: a fixed k of n


def _epsilon(params: dict[str, Any], rounds: int, delta: float) -> float:
    """The run's accountant for its sampling (module docstring)."""
    z = float(params[_NOISE_FIELD])
    if _poisson(params):
        if discrete_gaussian.noise_of(params) == "discrete":
            raise ValueError("a Poisson-sampled plan must add continuous noise (module docstring)")
        return poisson_epsilon(z, float(params["q"]), rounds, delta)
    return wor_epsilon(z, int(params["n"]), int(params["k"]), rounds, delta, discrete_gaussian.noise_of(params))


@dataclass(frozen=True)
class GaussianSettings:
    """[privacy.gaussian]"""

    noise_multiplier: float | None = noise_multiplier_setting()
    noise: str | None = noise_setting(
        '"continuous" (the discrete noise\'s fixed-cohort bound needs far more at small eps)'
    )


class GaussianRound(CentralRound):
    """The central DP-SGD plug-in (module docstring)."""

    name = "gaussian"
    settings = GaussianSettings
    schedules = ("subsampled",)
    optimizers = ("sgd",)
    poisson_sampling = True  # the sampled Gaussian's accountant (dp_accounting) assumes it
    example = {
        "schedule": {"kind": "subsampled", "cohort_size": 150, "rounds": 24, "learning_rate": 2.0},
        "transport": {"mode": "sealed"},
    }

    def check_config(self, cfg: RunConfig, optimizer: str) -> None:
        check_fixed_cohort(cfg, self.name)
        if cfg.privacy.settings.noise == "discrete" and cfg.schedule.sampling == "poisson":
            raise ConfigError(
                'privacy.gaussian.noise = "discrete" has no proven accountant with schedule.sampling = "poisson": use '
                '"continuous"'
            )

    def plan(self, req: PlanRequest) -> RoundPlan:
        if req.kind != "subsampled":
            raise ValueError(
                f'privacy.protocol = "gaussian" (central DP-SGD) needs schedule.kind = "subsampled", got "{req.kind}"'
            )
        if req.rounds_requested is None:
            raise ValueError('privacy.protocol = "gaussian" needs schedule.rounds')
        T, n, k = int(req.rounds), int(req.admitted), int(req.cohort)
        z = req.settings.noise_multiplier
        poisson = req.options.get("sampling") == "poisson"
        # continuous by default: WBK19 Thm 9 (the discrete noise's fixed-cohort figure) has a floor that needs far
        # more noise at small eps (eps 1, 40 rounds of 100 of 1348: z 1.9e5 against 8.07); discrete on request
        noise = discrete_gaussian.plan_noise(req.settings.noise, proven_for_discrete=not poisson, default="continuous")
        q = k / n  # Poisson: the expected cohort is k

        def fits(x: float) -> bool:
            if poisson:  # RDP alone (fast); the ledger's min(PLD, RDP) is never larger
                return poisson_epsilon(x, q, T, req.delta, "paper") <= req.eps
            return wor_epsilon(x, n, k, T, req.delta, noise) <= req.eps

        if z is None:
            z = least_noise_multiplier(fits, f"eps = {req.eps} over {T} rounds of {k} of {n}")
        params = {"d": req.dim, "clip": req.clip_norm, "k": k, "n": n, "delta": req.delta, _NOISE_FIELD: float(z)}
        params["noise"] = noise
        if poisson:
            params.update(sampling="poisson", q=q)
        spent = _epsilon(params, T, req.delta)  # the ledger's figure
        if spent > req.eps:
            raise ValueError(
                f"privacy.gaussian.noise_multiplier = {z} spends eps = {spent:.4g} over {T} rounds, above "
                f"privacy.eps = {req.eps}; raise it or leave it unset"
            )
        noise_sq = req.dim * (float(z) * req.clip_norm) ** 2
        # Poisson: whatever arrives is released, none included (the accountant charges every round)
        return RoundPlan(params, "rdp", 0.0, noise_sq, rounds=T, min_contributors=0 if poisson else k)

    def spec_fields(self, plan: dict[str, Any], params: dict[str, Any], event: Any, key: bytes) -> dict[str, Any]:
        eps_r, delta_r = self.round_cost(event)
        extra = {_NOISE_FIELD: params[_NOISE_FIELD], "n": float(params["n"]), "k": float(params["k"])}
        extra["delta"] = float(params["delta"])
        extra[discrete_gaussian.SPEC_KEY] = float(discrete_gaussian.noise_of(params) == "discrete")
        if _poisson(params):
            extra["q"] = float(params["q"])  # what RoundSpec.sampling_rate must say (verify_epsilon)
        # a fixed cohort's rate is k/n: the shuffler draws from no fewer than n (issue 24 item 3); a Poisson round's
        # rate is q whatever the population
        population = {} if _poisson(params) else {"population": int(params["n"])}
        return {
            **self._sealed_fields(params, key, extra),
            **population,
            "per_user_cost": pb.PrivacyCost(
                eps=eps_r, delta=delta_r, accountant=self.accountant_name(event, "rdp"), trust_model=self.trust_model
            ),
        }

    # ---------------------------------------------------------------------------------- the analyzer's noise
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
        clip = float(params["clip"])
        std = float(params[_NOISE_FIELD]) * clip
        # the discrete Gaussian on a grid (mechanisms.discrete_gaussian): sensitivity C (add-or-remove) is the
        # smaller of the two relations', so the rounding's noise inflation covers replace-one's 2C too
        g = discrete_gaussian.granularity(params, std, clip, int(params["d"]))
        noisy = discrete_gaussian.release_on_grid(total, std, clip, rng, g, noise=discrete_gaussian.noise_of(params))
        # divided by k, fixed (Poisson: the expected cohort), never by the batch's size, which the noise does not hide
        return noisy, float(params["k"]), None

    # ------------------------------------------------------------------------------------ ledger arithmetic
    def accountant_name(self, event: Any, composition: str) -> str:
        if _poisson(event.params):
            return "sampled-gaussian-poisson (add-or-remove-one, dp_accounting min(PLD, RDP); central trust)"
        if discrete_gaussian.noise_of(event.params) == "discrete":
            return "sampled-discrete-gaussian-wor-rdp (replace-one, WBK19 Thm 9, CKS20 Thm 14; central trust)"
        return "sampled-gaussian-wor-rdp (replace-one, Wang-Balle-Kasiviswanathan 2019; central trust)"

    def round_cost(self, event: Any) -> tuple[float, float]:
        p = event.params
        return _epsilon(p, 1, float(p["delta"])), float(p["delta"])

    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]:
        """The charged rounds composed (all of one run share z, n, k, q); the analyzer adds the noise, so no
        contributor's honesty enters."""
        return _epsilon(events[0].params, len(events), limit.delta), limit.delta

    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]:
        return {}

    def verify_epsilon(self, spec: pb.RoundSpec) -> float:
        """One round's eps recomputed from the spec's z, n, k (the claim the analyzer must not understate)."""
        z, n, k, q, delta, noise = _spec_params(spec)
        if q > 0.0:
            return poisson_epsilon(z, q, 1, delta)
        return wor_epsilon(z, n, k, 1, delta, noise)

    def user_account(self, spec: pb.RoundSpec) -> UserAccount:
        """A user's cost in the run (issue 24 item 1, issue 43 item 4; design 6): a function of E, the number of rounds
        the user was eligible for (its node counts every one, sampled or not), never of the rounds it joined: which
        rounds those are is the outcome of the shuffler's secret sampling, and a bound for the run (the mixture over
        samplings) is only the worst case over outcomes (an E-round user never sampled recorded 0 before).

        The charge is min(A(E), U(E)), each a bound for the run's output with this user's data in its E eligible
        rounds (rounds it was not eligible for hold none of its data). A(E): the run's amplified accountant over the
        E rounds at the spec's rate (k/n, n no more than the eligible count the shuffler reported: a smaller rate
        costs less), the ledger's figure. U(E): each eligible round's release, conditioned on the past, is a mixture
        over the round's cohort, drawn independently of the data with the same law for both neighbours (Poisson: the
        user is in with probability q; fixed cohort: a uniform k of the n indices, the user's data replaced at its
        index); with the draws coupled, each pair of components is either identical or the Gaussian pair at the
        relation's sensitivity (C add-or-remove, 2C replace-one). Hockey-stick divergences are jointly convex, so the
        mixture's privacy profile is at most that Gaussian's: the round is (sensitivity / z C)-GDP (Dong-Roth-Su
        2019 Prop 2.12), and E such rounds compose adaptively to sqrt(E) sensitivity / (z C)-GDP (their Cor 3.3).
        Discrete noise: Renyi divergence is jointly quasi-convex (van Erven-Harremoes Thm 13), so each round keeps
        the Gaussian's zCDP (CKS20 Thm 14), which composes additively. Both bounds hold at the spec's delta, so
        their minimum does. The eligible count is not secret: a user withdraws (policy.decide_in_run) as soon as
        one more ELIGIBLE round would take it past its limit."""
        z, n, k, q, delta, noise = _spec_params(spec)

        def cost(counts: Counts) -> tuple[float, float]:
            c = dict(counts)
            # a join comes with its round's eligibility in one charge (policy.decide_in_run); max() keeps a record
            # without it from charging less than its joins
            rounds = max(c.get("eligible", 0), c.get("joined", 0))
            if rounds == 0:
                return 0.0, 0.0  # in no round's draw: the user's data was in no release
            if q > 0.0:
                amplified = poisson_epsilon(z, q, rounds, delta)
            else:
                amplified = wor_epsilon(z, n, k, rounds, delta, noise)
            return min(amplified, unamplified_epsilon(z, rounds, delta, q > 0.0, noise)), delta

        return UserAccount(spec.run_id, "joined", "eligible", cost)


def _spec_params(spec: pb.RoundSpec) -> tuple[float, int, int, float, float, str]:
    """(z, n, k, q, delta, noise) of a spec, checked: what a user's node computes the round's cost from. A Poisson
    round must declare continuous noise (the only noise its accountant is proven for)."""
    x = dict(spec.randomizer.extra)
    n, k = int(x.get("n", 0)), int(x.get("k", 0))
    if not (1 <= k <= n and x.get(_NOISE_FIELD, 0.0) > 0.0 and 0.0 < x.get("delta", 0.0) < 1.0):
        raise ValueError("the spec lacks a valid noise multiplier, n, k or delta")
    q = spec.sampling_rate  # what the shuffler will do decides the accountant, not the extra's claim
    noise = discrete_gaussian.spec_noise(x)
    if q > 0.0 and noise == "discrete":
        raise ValueError("the spec's Poisson round declares discrete noise, for which no accountant here is proven")
    if q > 0.0:
        if not (q <= 1.0 and x.get("q") == q):
            raise ValueError(f"the spec's sampling_rate {q} is not a probability or disagrees with its q")
    elif spec.population != n:
        raise ValueError(f"the spec's population {spec.population} is not its accountant's n = {n}")
    return float(x[_NOISE_FIELD]), n, k, q, float(x["delta"]), noise
