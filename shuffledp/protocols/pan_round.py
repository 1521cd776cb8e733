"""Pan-private AC-SA's rounds as a plug-in (paper 000 App C, Alg 6; spec 000 "Alg 6: pan-private AC-SA"): a
central-trust streaming mode whose running sum is never clean.

Round t (schedule.kind = "sequential": a fresh cohort of B users, each user in one round of the run): each user
clips its gradient to L (clip_norm) and seals it to the analyzer (protocols.central, transport SEALED). The
analyzer's accumulator STARTS at Z1 ~ N(0, (B zeta)^2 I) (sum units; zeta is the mean's noise std of Alg 6) drawn
from a CSPRNG (shuffledp.security.rng.make_rng); it then opens the ciphertexts ONE AT A TIME, checks each (length,
finite,
norm <= L: a bad one is skipped, counted by reason and never added), adds it to the accumulator and drops the
plaintext (Alg 6 lines 4-8). No clean sum, clean partial sum or list of plaintexts is ever formed. add_noise then
adds a second, independent Z2 ~ N(0, (B zeta)^2 I) (Alg 6 line 9) and the optimizer gets the total / B (the fixed
cohort; spec 000: g_t = sum / B). A skipped message or a dropout is a zero vector (inside the clip ball).

Calibration (PlanRequest.calibration):
- "paper": zeta^2 = 8 L^2 log(2/delta) / (B^2 eps^2) (Alg 6 line 1; paper 000 Lemma C.5: the Gaussian mechanism of
  Dwork & Roth 2014 Thm A.1 with ln(1.25/delta) loosened to ln(2/delta)), valid for 0 < eps, delta < 1 only.
- "calibrated" (default): the least zeta for which ONE Gaussian N(0, zeta^2) with l2 sensitivity 2L/B is
  (eps, delta)-DP by its exact curve (Balle & Wang 2018, Thm 8 "analytic Gaussian mechanism";
  shuffledp.mechanisms.gaussian.analytic_gaussian_sigma). Valid for every eps > 0 and smaller than the paper's zeta.
Whatever the calibration, the ledger charges the tightest (eps, delta) figure of that one Gaussian that is proven
for the noise added (round_cost), so the paper's zeta is charged what it really costs (less than eps). Noise
(privacy.pan_gaussian.noise, issue 24 D19): by default the discrete Gaussian on a grid (Z1, Z2 and every rounded item;
mechanisms.discrete_gaussian), charged the RDP conversion of rho = 2L/(B zeta) (CKS20 Thm 14: zCDP; Prop 12:
conversion), and "calibrated" is then the least zeta under that figure; "continuous": numpy's Gaussian, charged
its exact curve (Balle & Wang 2018 Thm 8).

Privacy argument for the joint view (paper 000 Def C.2 after Dwork et al. 2010, "Pan-private streaming
algorithms", and Amin et al. 2020; paper 000 Lemma C.4 and its proof). Neighbours: replace one user's record
(stream element); a clipped vector moves by at most 2L, so the mean g_t = sum / B moves by at most 2L/B. An
intruder reads the analyzer's state once during round t, after j of its items: A = Z1 + S_<=j (S_<=j = the sum of
the valid items 1..j), and later sees the output O = A + S_>j + Z2. (A, O) is a post-processing of the pair
(A, O - A) = (Z1 + S_<=j, S_>j + Z2), whose two parts are independent (Z1, Z2 independent; the items are fixed, the
point theta_md_t where they were computed was fixed before the round from earlier outputs). A user i of round t is
in exactly one of the two parts: if i <= j only A depends on x_i, and A is the Gaussian mechanism with std B zeta
on a sum of sensitivity 2L (= std zeta on the mean, sensitivity 2L/B); if i > j only O - A depends on it, covered
the same way by Z2. So the joint view is exactly as private as one zeta-Gaussian with sensitivity 2L/B, at the run's
delta: that is what the ledger charges per round. Intrusions into other rounds' states and every other round's
output are post-processings of the released O_t, other users' data and independent noise (the sequential schedule
puts each user in one round), and so is an intrusion into stored state: the checkpoints hold only the optimizer
state after the noised update. Without an intrusion the output alone has noise Z1 + Z2 (std sqrt(2) zeta on the
mean), which is more private still. The whole run is (eps, delta) by parallel composition over the disjoint
cohorts (spec 000 sec 5): the ledger's "parallel" rule, the maximum over rounds.

Limits of the guarantee (stated, not hidden):
- One intrusion per round (Def C.2 is a single intrusion; different rounds are fine, see above). Two snapshots in
  the same round differ by the clean sum of the items between them.
- The intrusion is into the accumulator state (Def C.1's internal state). The sealed batch of the round and the
  analyzer's private key are in the same process while decode runs (services/run_manager.py holds both), and an
  attacker who dumps the whole process can open every ciphertext: pan-privacy against that needs the key and the
  batch to live outside the accumulating process (e.g. an enclave that streams opened items). Python bytes cannot
  be scrubbed, so the dropped plaintexts linger in freed memory until reused; the float vector is zeroed.
- Central trust: the analyzer (not an intruder) still sees each opened vector.

Test hook: `probe` (None in production) is called with a COPY of the accumulator once after the initial draw and
once after each of the n ciphertexts (skipped ones too), so a test can read the state an intruder would see.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from shuffledp.mechanisms import discrete_gaussian
from shuffledp.mechanisms.gaussian import analytic_gaussian_sigma, gaussian_delta
from shuffledp.protocols.base import MALFORMED_PLAINTEXT, UNDECRYPTABLE, BatchError, Decoded, PlanRequest, RoundPlan
from shuffledp.protocols.central import (
    _NORM_SLACK,
    OVER_CLIP_NORM,
    WIRE_DTYPE,
    CentralRound,
    message_bytes,
    noise_setting,
)
from shuffledp.security import sealing
from shuffledp.security.rng import make_rng
from shuffledp.settings import ConfigError, RunConfig, setting
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["PanRound", "pan_round_epsilon", "paper_zeta", "calibrated_zeta", "CALIBRATIONS"]

CALIBRATIONS = ("calibrated", "paper")
_EPS_REL_TOL = 1e-15  # bisection on eps stops within this relative width (the upper, feasible end is returned)


def paper_zeta(clip: float, cohort: int, eps: float, delta: float) -> float:
    """zeta = sqrt(8 L^2 log(2/delta) / (B^2 eps^2)), paper 000 Alg 6 line 1 (Lemma C.5; needs 0 < eps, delta < 1)."""
    _check(clip, cohort, delta)
    if not 0.0 < eps < 1.0:
        raise ValueError(
            f"the paper's zeta (Alg 6, Lemma C.5: Dwork-Roth Thm A.1) needs 0 < eps < 1, got eps = {eps}; "
            'use privacy.pan_gaussian.calibration = "calibrated" (the exact Gaussian curve, any eps)'
        )
    return math.sqrt(8.0 * clip**2 * math.log(2.0 / delta) / (cohort**2 * eps**2))


def calibrated_zeta(clip: float, cohort: int, eps: float, delta: float, noise: str = "discrete") -> float:
    """The least zeta (rounded up) for which N(0, zeta^2 I) on a mean of sensitivity 2L/B is (eps, delta)-DP under
    the figure proven for the noise: Balle & Wang 2018 Thm 8 (mechanisms.gaussian.analytic_gaussian_sigma) for
    continuous noise, 2L/B over the largest rho whose RDP conversion fits (CKS20 Thm 14, Prop 12) for discrete."""
    _check(clip, cohort, delta)
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if discrete_gaussian.noise_of({"noise": noise}) == "discrete":
        from shuffledp.accountants.gaussian import rho_for_epsilon

        return math.nextafter(2.0 * clip / cohort / rho_for_epsilon(eps, delta, "rdp"), math.inf)
    return analytic_gaussian_sigma(eps, delta, 2.0 * clip / cohort)


@lru_cache(maxsize=4096)
def pan_round_epsilon(clip: float, cohort: int, zeta: float, delta: float, noise: str = "discrete") -> float:
    """eps of one round's joint (intrusion, output) view (module docstring), one Gaussian with std zeta and
    sensitivity 2L/B. Continuous noise: its exact (eps, delta) curve (Balle & Wang 2018 Thm 8), i.e. the least
    eps >= 0 with gaussian_delta(eps, zeta, 2L/B) <= delta, by bisection; the returned end is always feasible
    (never below). Discrete noise: the RDP conversion of rho = 2L/(B zeta) (CKS20 Thm 14 zCDP, Prop 12)."""
    _check(clip, cohort, delta)
    if not (math.isfinite(zeta) and zeta > 0.0):
        raise ValueError(f"zeta must be a finite number > 0, got {zeta!r}")
    sens = 2.0 * clip / cohort
    if discrete_gaussian.noise_of({"noise": noise}) == "discrete":
        from shuffledp.accountants.gaussian import epsilon_for_rho

        return epsilon_for_rho(sens / zeta, delta, "rdp")
    if gaussian_delta(0.0, zeta, sens) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gaussian_delta(hi, zeta, sens) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e12:
            return math.inf
    for _ in range(400):
        if hi - lo <= _EPS_REL_TOL * hi:
            break
        mid = 0.5 * (lo + hi)
        if gaussian_delta(mid, zeta, sens) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def _check(clip: float, cohort: int, delta: float) -> None:
    if not (math.isfinite(clip) and clip > 0.0):
        raise ValueError(f"clip_norm must be a finite number > 0, got {clip!r}")
    if isinstance(cohort, bool) or not isinstance(cohort, int | np.integer) or cohort < 1:
        raise ValueError(f"the cohort B must be an integer >= 1, got {cohort!r}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")


def _event_epsilon(params: dict[str, Any]) -> float:
    clip, B, zeta, delta = float(params["clip"]), int(params["B"]), float(params["zeta"]), float(params["delta"])
    return pan_round_epsilon(clip, B, zeta, delta, discrete_gaussian.noise_of(params))


@dataclass(frozen=True)
class PanSettings:
    """[privacy.pan_gaussian]"""

    calibration: str = setting(
        "calibrated",
        '"calibrated" (the exact Gaussian curve, any eps) or "paper" (Alg 6\'s zeta, Lemma C.5, eps < 1)',
        choices=CALIBRATIONS,
    )
    round_eps: float | None = setting(
        None, "eps of each round (at most privacy.eps); unset = privacy.eps", lo=0.0, hi=64.0, lo_open=True, example=1.0
    )
    noise: str | None = noise_setting()


class PanRound(CentralRound):
    """The pan-private AC-SA plug-in (module docstring). `rng`: the generator of the accumulator's initial noise
    (None: a fresh make_rng() per round, as the one registry instance serves every run's thread); `probe`: the
    test hook. Both are for tests only."""

    name = "pan_gaussian"
    trust_model = pb.CENTRAL
    trust = "central"
    settings = PanSettings
    schedules = ("sequential",)
    optimizers = ("acsa", "psgd")
    # cohorts of 100 (13 rounds): the theory cohort (26, 51 rounds) reached 0.38 held-out on digits, 100 0.59-0.67
    example = {
        "schedule": {"kind": "sequential", "optimizer": "acsa", "cohort_size": 100},
        "transport": {"mode": "sealed"},
    }

    def check_config(self, cfg: RunConfig, optimizer: str) -> None:
        own: PanSettings = cfg.privacy.settings
        if own.calibration == "paper" and not (own.round_eps or cfg.privacy.eps) < 1.0:
            raise ConfigError(
                'privacy.pan_gaussian.calibration = "paper" is Alg 6\'s zeta (Lemma C.5), valid for eps < 1'
            )

    def __init__(
        self,
        rng: np.random.Generator | None = None,
        probe: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        self.rng = rng
        self.probe = probe

    # ------------------------------------------------------------------------------------------ analyzer
    def plan(self, req: PlanRequest) -> RoundPlan:
        """zeta from the budget (paper or calibrated); the round sized for the fixed cohort B = req.cohort."""
        if req.kind != "sequential":
            raise ValueError(
                f'privacy.protocol = "{self.name}" (pan-private AC-SA, paper 000 Alg 6) needs schedule.kind = '
                f'"sequential" (each user in one round), got "{req.kind}"'
            )
        if req.transport != "sealed":
            raise ValueError(
                f'privacy.protocol = "{self.name}" sends one sealed vector per user: transport.mode = "sealed", '
                f'got "{req.transport}"'
            )
        own: PanSettings = req.settings
        if own.calibration not in CALIBRATIONS:
            raise ValueError(f"privacy.pan_gaussian.calibration must be one of {CALIBRATIONS}, got {own.calibration!r}")
        eps_r = own.round_eps if own.round_eps is not None else req.eps
        if eps_r > req.eps:
            raise ValueError(f"privacy.pan_gaussian.round_eps = {eps_r} exceeds privacy.eps = {req.eps}")
        B, clip, delta = int(req.cohort), float(req.clip_norm), float(req.delta)
        noise = discrete_gaussian.plan_noise(own.noise)
        if own.calibration == "paper":
            zeta = paper_zeta(clip, B, eps_r, delta)
        else:
            zeta = calibrated_zeta(clip, B, eps_r, delta, noise)
        # the ledger refuses a round above the budget: make sure the charged eps (float arithmetic included) fits
        for _ in range(8):
            if pan_round_epsilon(clip, B, zeta, delta, noise) <= eps_r:
                break
            zeta *= 1.0 + 1e-12
        else:
            raise ValueError(f"no zeta found whose round eps fits eps = {eps_r} with {noise} noise")
        params = {
            "d": int(req.dim),
            "clip": clip,
            "B": B,
            "n": int(req.admitted),
            "eps": float(eps_r),
            "delta": delta,
            "zeta": float(zeta),
            "calibration": own.calibration,
            "noise": noise,
        }
        noise_sq = 2.0 * req.dim * (B * zeta) ** 2  # E||Z1 + Z2||^2 in sum units (Alg 6: two zeta-Gaussians)
        n_min = max(1, math.ceil(req.min_contributors_fraction * B))
        return RoundPlan(params, "parallel", 0.0, noise_sq, min_contributors=n_min)

    def event_params(self, plan: dict[str, Any], round_index: int) -> dict[str, Any]:
        return plan["params"]

    def spec_fields(self, plan: dict[str, Any], params: dict[str, Any], event: Any, key: bytes) -> dict[str, Any]:
        eps_r, delta_r = self.round_cost(event)
        extra = {"zeta": float(params["zeta"]), "cohort": float(params["B"]), "delta": float(params["delta"])}
        extra[discrete_gaussian.SPEC_KEY] = float(discrete_gaussian.noise_of(params) == "discrete")
        return {
            **self._sealed_fields(params, key, extra),
            "per_user_cost": pb.PrivacyCost(
                eps=eps_r,
                delta=delta_r,
                accountant=self.accountant_name(event, "parallel"),
                trust_model=self.trust_model,
            ),
        }

    def _initial_noise(
        self, d: int, std: float, rng: np.random.Generator, *, clip: float, grid: float, noise: str = "discrete"
    ) -> np.ndarray:
        """Z1 ~ N(0, std^2 I), the accumulator's starting value (Alg 6 lines 4-5): the discrete Gaussian on the
        run's grid (mechanisms.discrete_gaussian; each item is rounded to it before it is added, _add_one), or
        numpy's continuous Gaussian (noise = "continuous", items not rounded)."""
        return discrete_gaussian.grid_noise(d, std, clip, rng, grid, noise=noise)

    @staticmethod
    def _grid(params: dict[str, Any]) -> float:
        """The grid of Z1, Z2 and the items: sensitivity reference L (the sum's is 2L: more inflation, safe)."""
        clip = float(params["clip"])
        return discrete_gaussian.granularity(params, int(params["B"]) * float(params["zeta"]), clip, int(params["d"]))

    def decode(
        self,
        batch: pb.ShuffledBatch,
        n: int,
        plan: dict[str, Any],
        params: dict[str, Any],
        private_key: Any,
        info: bytes,
    ) -> Decoded:
        """Z1 + the valid clipped vectors, added one at a time (module docstring); every delivered contributor is
        charged (a skipped message is a zero contribution, which the clip bound covers)."""
        if len(batch.ciphertexts) != n:
            raise BatchError(n, f"{len(batch.ciphertexts)} ciphertexts do not match {n} contributors (one per user)")
        d, clip = int(params["d"]), float(params["clip"])
        std = int(params["B"]) * float(params["zeta"])
        size = message_bytes(d)
        rng = self.rng if self.rng is not None else make_rng()
        noise = discrete_gaussian.noise_of(params)
        grid = self._grid(params) if noise == "discrete" else None
        acc = self._initial_noise(d, std, rng, clip=clip, grid=grid, noise=noise)
        probe = self.probe
        if probe is not None:
            probe(acc.copy())
        rejected: Counter[str] = Counter()
        used = 0
        for ct in batch.ciphertexts:
            reason = self._add_one(acc, ct, private_key, info, size, d, clip, grid)
            if reason:
                rejected[reason] += 1
            else:
                used += 1
            if probe is not None:
                probe(acc.copy())
        rejected_all = dict(Counter(dict(batch.report.rejected)) + rejected)
        return Decoded(acc, used, n, rejected_all)

    @staticmethod
    def _add_one(
        acc: np.ndarray, ct: bytes, private_key: Any, info: bytes, size: int, d: int, clip: float, grid: float | None
    ) -> str:
        """Open one ciphertext and add it, rounded to the grid (so the state stays on it; None: continuous noise,
        not rounded), to acc in place if valid; the rejection reason, or "" when added."""
        try:
            plain = sealing.open_sealed(private_key, ct, info)
        except sealing.SealingError:
            return UNDECRYPTABLE
        if len(plain) != size:
            return MALFORMED_PLAINTEXT
        x = np.frombuffer(plain, dtype=WIRE_DTYPE).astype(np.float64)  # a private, writable copy
        del plain
        try:
            if not np.all(np.isfinite(x)):
                return MALFORMED_PLAINTEXT
            if not float(np.linalg.norm(x)) <= clip * (1.0 + _NORM_SLACK):
                return OVER_CLIP_NORM
            acc += x if grid is None else discrete_gaussian.round_to_grid(x, grid)
            return ""
        finally:
            x.fill(0.0)  # drop the plaintext vector (best effort, module docstring)

    # ---------------------------------------------------------------------------------- the analyzer's noise
    def noise_state(self, plan: dict[str, Any]) -> None:
        return None

    def noise_from_arrays(self, plan: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        return None

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
        """The decoded accumulator + Z2 ~ N(0, (B zeta)^2 I), independent of Z1 (Alg 6 line 9); divisor B."""
        B = int(params["B"])
        std, clip = B * float(params["zeta"]), float(params["clip"])
        noise = discrete_gaussian.noise_of(params)
        return discrete_gaussian.release_on_grid(total, std, clip, rng, self._grid(params), noise=noise), float(B), None

    # ------------------------------------------------------------------------------------ ledger arithmetic
    def accountant_name(self, event: Any, composition: str) -> str:
        zeta_from = "Alg 6 zeta" if event.params.get("calibration") == "paper" else "analytic zeta"
        if discrete_gaussian.noise_of(event.params) == "discrete":
            figure, how = "pan-discrete-gaussian-rdp", "CKS20 Thm 14 + Prop 12"
        else:
            figure, how = "pan-gaussian-exact", "Balle-Wang 2018"
        return (
            f"{figure} ({zeta_from}; one zeta-Gaussian per user, sensitivity 2L/B replace-one, "
            f"{how})/parallel (disjoint cohorts); central trust, pan-private (one intrusion per round)"
        )

    def round_cost(self, event: Any) -> tuple[float, float]:
        """The joint (intrusion, output) view of one round: one Gaussian, std zeta, sensitivity 2L/B (module
        docstring), at the run's delta."""
        return _event_epsilon(event.params), float(event.params["delta"])

    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]:
        """Parallel composition over the disjoint sequential cohorts (spec 000 sec 5): the worst round. The analyzer
        adds the noise, so no contributor's honesty enters (honest_fraction is not used)."""
        costs = [self.round_cost(e) for e in events]
        return max(c[0] for c in costs), max(c[1] for c in costs)

    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]:
        return {}

    # -------------------------------------------------------------------------------------------- client
    def verify_epsilon(self, spec: pb.RoundSpec) -> float:
        """One round's eps recomputed from the spec's zeta, cohort, delta and clip norm (the claim the analyzer must
        not understate)."""
        x = dict(spec.randomizer.extra)
        zeta, cohort, delta = x.get("zeta", 0.0), x.get("cohort", 0.0), x.get("delta", 0.0)
        clip = float(spec.randomizer.clip_norm)
        if not (zeta > 0.0 and cohort >= 1.0 and float(cohort).is_integer() and 0.0 < delta < 1.0 and clip > 0.0):
            raise ValueError("the spec lacks a valid zeta, cohort, delta or clip norm")
        noise = discrete_gaussian.spec_noise(x)  # absent: discrete (never the continuous figure by default)
        return pan_round_epsilon(clip, int(cohort), float(zeta), float(delta), noise)
