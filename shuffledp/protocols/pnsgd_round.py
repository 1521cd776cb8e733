"""Shuffled projected noisy SGD with hidden iterates as a plug-in (seed 004, Sordello, Bu, Dong, Su; spec 004
sections 2, 3.2, 3.3 and 5): one pass over the users' records, and only the last iterate is ever released.

Client: each user holds one record (x, y) of the public domain ||x|| <= B (B = the data set's public feature bound,
RandomizerSpec.clip_norm) with a label of the task; it seals [x, y] (f + 1 float64) to the analyzer. A record
outside the domain is refused by its user (reason "record_outside_public_domain", logged with the user id): it
cannot be clipped without changing the data, and the loss constants L, beta hold only inside the domain.

Shuffler: collects the batch (threshold n_min of the n users), permutes it with its CSPRNG and forwards it.

Analyzer: opens the records; one that does not open, has the wrong length, a non-finite value, a norm above B or a
label outside the task's is counted by reason and becomes a null step (noise only: the gradient of a constant loss,
which is 0-Lipschitz and smooth, so Thm 2's assumptions still hold and the pass keeps its n steps). It draws its own
uniform permutation from its CSPRNG (the certificate does not rest on the shuffler's claim that it permuted), then
from w_0 = 0 runs

    w <- Pi_K(w - eta (grad l(w, x_pi(j)) + Z)),  Z ~ N(0, sigma^2 I),  j = 1..n       (spec 004 sec 2)

over K = the l2 ball of model.radius (D_K = 2 radius), and releases w_n; with privacy.pnsgd.randomly_stopped it stops
at a secret T ~ Unif{1..n} and releases w_T (sec 3.3: at the worst index its exact bound equals Thm 2's). The iterates,
the permutation and T live in local variables of one call: no log line, metric, checkpoint, RPC or error message
holds them, per-round metrics carry no loss (NaN), and GetRunResult gives the model only once the run COMPLETED.
A pass lost to an analyzer crash is run again from the records collected anew, and charged again (RoundPlan.
hidden_iterates: the run manager repeats a round whose update no checkpoint holds).

Online PNSGD ("pnsgd_online", spec 004 sec 3.5): no secret order: the analyzer runs the records in the order they
arrive from the shuffler, with the decaying noise sigma_j = M D_K / (2 eta sqrt(W(j^(2 alpha)/(2 pi C1^2) + C2)))
of Thm 7 (alpha = 1.5, C1 = C2 = 100, spec 004 sec 4's setting) at step j. The record at position i gets
delta_i(n) = A_i prod_{t > i} B_t: non-uniform, and the newest record's is A_n = theta(2L/sigma_n), i.e. the
Gaussian mechanism's curve at mu = 2L/sigma_n, which dominates every other record's (A_i <= A_n, B <= 1). Release
policy (spec 004 sec 5, option 1): the ledger charges that uniform guarantee, exactly `shuffledp account gaussian
--sigma sigma_n --sensitivity 2L --noise continuous` (passes compose as Gaussian mechanisms), a run is refused
when it would not fit for every user admitted, and the per-record deltas at the charged eps are reported alongside
(the ledger's views: the oldest, median and newest record's delta).

Privacy (Thm 2): delta_shuf(eps) = A (1 - B^n)/(n (1 - B)), A = theta(2L/sigma), B = theta(M D_K/(eta sigma)),
L = the loss's Lipschitz bound over the domain (models.Model.lipschitz_bound), M = sqrt(1 - 2 eta beta rho/(beta +
rho)) with beta the smoothness bound and rho = model.l2; eta <= 2/(beta + rho) is enforced. sigma is the least with
delta_shuf <= delta at eps for n_min records (or privacy.pnsgd.noise_multiplier * L); the ledger charges each pass at
the records it ran, exactly `shuffledp account pnsgd --n n --lipschitz L --sigma sigma --eta eta --diameter D_K
--contraction M`. Trust: central (the analyzer sees the records); the guarantee holds against whoever sees the
released model.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shuffledp.accountants import pnsgd
from shuffledp.models import make_model, project_l2_ball
from shuffledp.protocols.base import (
    MALFORMED_PLAINTEXT,
    UNDECRYPTABLE,
    BatchError,
    Decoded,
    PlanRequest,
    RoundPlan,
    open_each,
    release_floor,
)
from shuffledp.protocols.central import WIRE_DTYPE, CentralRound, message_bytes, noise_multiplier_setting, seal_rows
from shuffledp.settings import ConfigError, NoSettings, RunConfig, setting
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["PnsgdRound", "pnsgd_epsilon", "online_epsilon", "online_sigmas", "OUTSIDE_DOMAIN", "TEST_ITERATE_HOOK"]

log = logging.getLogger(__name__)

OUTSIDE_DOMAIN = "record_outside_public_domain"
_SLACK = 1e-12  # a record on the boundary, rounded to float64
# Test-only: called with (step, iterate, permutation) during the pass when set (tests/test_pnsgd.py checks that none
# of them escapes). None in every real process.
TEST_ITERATE_HOOK: Callable[[int, np.ndarray, np.ndarray], None] | None = None


def pnsgd_epsilon(params: dict[str, Any], n: int, delta: float) -> float:
    """eps of one pass over n records: ledger_accounting.account of the PnsgdRun event (Thm 2)."""
    from shuffledp.accountants import ledger_accounting
    from shuffledp.accountants.events import PnsgdRun

    ev = PnsgdRun("gaussian", n, params["lipschitz"], params["sigma"], params["eta"], params["diameter"], params["m"])
    return float(ledger_accounting.account([ev], delta).eps)


ONLINE_SCHEDULE = {"alpha": 1.5, "c1": 100.0, "c2": 100.0}  # Thm 7's sigma_j (spec 004 sec 4, online setting)


def online_sigmas(params: dict[str, Any], steps: int) -> np.ndarray:
    """sigma_1..sigma_steps of online PNSGD (Thm 7; module docstring)."""
    j = np.arange(1, steps + 1)
    p = params
    return np.atleast_1d(pnsgd.sigma_online(j, p["eta"], p["diameter"], p["alpha"], p["c1"], p["c2"], p["m"]))


def online_epsilon(params: dict[str, Any], passes: Sequence[int], delta: float) -> float:
    """eps of online passes over these record counts: each is the Gaussian mechanism at mu = 2L/sigma_n for its
    newest record, which dominates the others (module docstring); ledger_accounting.account composes them."""
    from shuffledp.accountants import ledger_accounting
    from shuffledp.accountants.events import GaussianRound

    evs = [GaussianRound(float(online_sigmas(params, n)[-1]), 2.0 * params["lipschitz"]) for n in passes]
    return float(ledger_accounting.account(evs, delta).eps)


@dataclass(frozen=True)
class PnsgdSettings:
    """[privacy.pnsgd] (the online pass has Thm 7's noise schedule and no keys of its own)"""

    noise_multiplier: float | None = noise_multiplier_setting("noise std / the step's sensitivity")
    randomly_stopped: bool = setting(False, "stop the pass at a secret T ~ Unif{1..n}, release w_T (seed 004 sec 3.3)")


class PnsgdRound(CentralRound):
    """Shuffled or online PNSGD (module docstring)."""

    schedules = ("fully_interactive",)
    optimizers = ("pnsgd",)
    auto_optimizer = "pnsgd"  # the pass is the protocol's; the optimizer adopts its last iterate (seed 004)
    # a low-noise synthetic set (its optimum 0.88 held-out, majority 0.57; data.noise 0.5 had 0.69 against 0.67).
    # eta well below 1/beta: sigma is set by the one-step term A = theta(2L/sigma) (spec 004 sec 3.1), nearly
    # whatever eta, so the iterate's noise eta sigma shrinks with eta (1/beta = 1 ended at 0.35-0.59 accuracy)
    example = {
        "data": {"dataset": "synthetic", "n": 3000, "dim": 5, "noise": 0.1, "seed": 0, "test_fraction": None},
        "model": {"radius": 5.0},
        "privacy": {"delta": 1e-5},
        "schedule": {"rounds": 1, "learning_rate": 0.01},
        "transport": {"mode": "sealed"},
    }

    def __init__(self, online: bool = False) -> None:
        self.online = online
        self.name = "pnsgd_online" if online else "pnsgd"
        self.settings = NoSettings if online else PnsgdSettings
        if online:
            # Thm 7's noise on the iterate is D_K / (2 eta sqrt(W)) whatever eta, and the newest record is one Gaussian
            # step (spec 004 sec 3.5 flag): at eps 8 the last iterate stays near chance (0.52 against majority 0.57
            # in-process); eta = 1/beta, radius 8: the newest record's eps 7.8 fits privacy.eps
            self.example = {**self.example, "model": {"radius": 8.0}, "schedule": {"rounds": 1, "learning_rate": None}}

    def check_config(self, cfg: RunConfig, optimizer: str) -> None:
        name = f'privacy.protocol = "{self.name}"'
        if cfg.schedule.rounds != 1:
            raise ConfigError(
                f"{name} is one pass over every user's record: schedule.rounds = 1, got {cfg.schedule.rounds}"
            )
        if cfg.model.module:
            raise ConfigError(
                f"{name} differentiates the records at the analyzer with the built-in logreg: unset model.module"
            )
        if cfg.model.task != "logreg":
            raise ConfigError(f'{name} runs model.task = "logreg" (its L and beta), got "{cfg.model.task}"')
        if cfg.data.examples_per_user != 1:
            raise ConfigError(f"{name}: one record per user, got data.examples_per_user = {cfg.data.examples_per_user}")

    # --------------------------------------------------------------------------------- analyzer: sizing
    def plan(self, req: PlanRequest) -> RoundPlan:
        o = req.options
        if req.kind != "fully_interactive" or req.rounds != 1:
            raise ValueError(
                f'privacy.protocol = "{self.name}" is one pass over the records: schedule.kind = '
                f'"fully_interactive" with rounds = 1, got "{req.kind}" with {req.rounds}'
            )
        bound = o.get("feature_bound")
        if bound is None:
            raise ValueError(
                f'privacy.protocol = "{self.name}" needs the public bound on ||x||: data.dataset = "path" has none'
            )
        model = make_model(o["task"], o["num_features"], o["num_classes"], l2=o["l2"])
        L, beta, rho = model.lipschitz_bound(bound, o["radius"]), model.smoothness(bound), float(o["l2"])
        if not (math.isfinite(L) and math.isfinite(beta)):
            raise ValueError(
                f'privacy.protocol = "{self.name}" needs a Lipschitz, smooth loss: model.task = "{o["task"]}"'
            )
        eta = o.get("learning_rate") or 1.0 / beta  # within the contraction condition eta <= 2/(beta + rho)
        if eta > 2.0 / (beta + rho):
            raise ValueError(
                f"schedule.learning_rate = {eta} exceeds 2/(beta + rho) = {2.0 / (beta + rho):.6g} "
                f"(beta = {beta:.6g}, rho = {rho}): the step would not contract (spec 004 sec 1)"
            )
        params = {
            "d": model.dim,  # the model's dimension; the records are f + 1 values
            "record": model.num_features + 1,
            "lipschitz": L,
            "eta": eta,
            "diameter": 2.0 * float(o["radius"]),
            "m": pnsgd.contraction_factor(eta, beta, rho),
            "feature_bound": float(bound),
            "radius": float(o["radius"]),
            "task": o["task"],
            "num_features": model.num_features,
            "num_classes": model.num_classes,
            "l2": rho,
            "delta": req.delta,
            "randomly_stopped": bool(getattr(req.settings, "randomly_stopped", False)),
        }
        if self.online:
            params.update(ONLINE_SCHEDULE, records_max=req.cohort)
            # the most records a pass can run: its newest record's noise is the smallest
            spent = online_epsilon(params, [req.cohort], req.delta)
            if spent > req.eps:
                raise ValueError(
                    f"online PNSGD over up to {req.cohort} records: its newest record alone costs eps = {spent:.4g} "
                    f"(Thm 7's decaying noise, spec 004 sec 3.5), above privacy.eps = {req.eps}; raise eps, widen "
                    'model.radius (the noise grows with D_K), or use privacy.protocol = "pnsgd"'
                )
            sigma_n = float(online_sigmas(params, req.cohort)[-1])
            return RoundPlan(params, "parallel", 0.0, model.dim * sigma_n**2, rounds=1, hidden_iterates=True)
        n = req.min_contributors  # the fewest records a released batch holds: delta_shuf decreases in n
        z = getattr(req.settings, "noise_multiplier", None)
        if z is None:
            params["sigma"] = pnsgd.calibrate_scale(
                "gaussian", req.delta, req.eps, n, L, eta, params["diameter"], params["m"]
            )
        else:
            params["sigma"] = float(z) * L
        spent = pnsgd_epsilon(params, n, req.delta)
        if spent > req.eps:
            raise ValueError(
                f"privacy.pnsgd.noise_multiplier = {z} spends eps = {spent:.4g} on {n} records, above "
                f"privacy.eps = {req.eps}; raise it or leave it unset"
            )
        noise_sq = model.dim * params["sigma"] ** 2
        return RoundPlan(params, "parallel", 0.0, noise_sq, rounds=1, hidden_iterates=True)

    def spec_fields(self, plan: dict[str, Any], params: dict[str, Any], event: Any, key: bytes) -> dict[str, Any]:
        eps_r, delta_r = self.round_cost(event)
        keys = ("lipschitz", "eta", "diameter", "m", "delta", "num_classes")
        keys += ("alpha", "c1", "c2", "records_max") if self.online else ("sigma",)
        fields = self._sealed_fields(
            {"d": params["record"], "clip": params["feature_bound"]}, key, {k: float(params[k]) for k in keys}
        )
        fields["per_user_cost"] = pb.PrivacyCost(
            eps=eps_r, delta=delta_r, accountant=self.accountant_name(event, "parallel"), trust_model=self.trust_model
        )
        return fields

    # ----------------------------------------------------------------------------- analyzer: the records
    def decode(
        self,
        batch: pb.ShuffledBatch,
        n: int,
        plan: dict[str, Any],
        params: dict[str, Any],
        private_key: Any,
        info: bytes,
    ) -> Decoded:
        """The records as an (n, f + 1) array, in the delivered order; a rejected one is a row of NaN (a null step).
        Decoded.total carries the records here: the pass (add_noise) turns them into the released model."""
        if len(batch.ciphertexts) != n:
            raise BatchError(n, f"{len(batch.ciphertexts)} ciphertexts do not match {n} contributors (one per user)")
        k = int(params["record"])
        R = np.full((n, k), np.nan)
        rejected: Counter[str] = Counter()
        info_ok = 0
        for i, c in enumerate(batch.ciphertexts):
            opened, bad = open_each(private_key, [c], info)
            if bad:
                rejected[UNDECRYPTABLE] += 1
                continue
            if len(opened[0]) != message_bytes(k):
                rejected[MALFORMED_PLAINTEXT] += 1
                continue
            row = np.frombuffer(opened[0], dtype=WIRE_DTYPE).astype(np.float64)
            why = _record_problem(row, params)
            if why:
                rejected[why] += 1
                continue
            R[i], info_ok = row, info_ok + 1
        return Decoded(R, info_ok, n, dict(Counter(dict(batch.report.rejected)) + rejected))

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
        """The noisy pass (module docstring): returns the released iterate (divisor 1); nothing else leaves."""
        R = np.asarray(total, dtype=np.float64)
        n, f = R.shape[0], int(params["num_features"])
        model = make_model(params["task"], f, int(params["num_classes"]), l2=float(params["l2"]))
        eta, radius = float(params["eta"]), float(params["radius"])
        # online: the arrival order and Thm 7's decaying noise; shuffled: a secret order (and stop), fixed noise
        order = np.arange(n) if self.online else rng.permutation(n)
        steps = int(rng.integers(1, n + 1)) if params.get("randomly_stopped") else n
        sigmas = online_sigmas(params, steps) if self.online else np.full(steps, float(params["sigma"]))
        w = np.zeros(model.dim)
        for j in range(steps):
            rec = R[order[j]]
            g = np.zeros(model.dim) if np.isnan(rec[0]) else model.per_example_gradients(w, rec[None, :f], rec[f:])[0]
            w = project_l2_ball(w - eta * (g + sigmas[j] * rng.standard_normal(model.dim)), radius)
            if TEST_ITERATE_HOOK is not None:
                TEST_ITERATE_HOOK(j, w, order)
        return w, 1.0, None

    # ------------------------------------------------------------------------------------ ledger arithmetic
    def accountant_name(self, event: Any, composition: str) -> str:
        if self.online:
            return "pnsgd-online (seed 004 Thm 7 noise; newest record's Gaussian curve, exact; central trust)"
        rs = ", randomly stopped" if event.params.get("randomly_stopped") else ""
        return f"pnsgd-shuffled (seed 004 Thm 2{rs}; central trust, last iterate only)"

    def round_cost(self, event: Any) -> tuple[float, float]:
        p, n = event.params, max(int(event.contributors), 1)
        eps = online_epsilon(p, [n], p["delta"]) if self.online else pnsgd_epsilon(p, n, p["delta"])
        return eps, p["delta"]

    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]:
        """Each pass at the records it ran; several passes (a pass redone after a crash) composed by the
        accountant: PnsgdRun events (spec 004 sec 3.6), or online ones as Gaussian mechanisms."""
        from shuffledp.accountants import ledger_accounting
        from shuffledp.accountants.events import PnsgdRun

        counts = [max(int(e.contributors), 1) for e in events]
        p = events[0].params
        if self.online:
            return online_epsilon(p, counts, limit.delta), limit.delta
        theirs = ("lipschitz", "sigma", "eta", "diameter", "m")
        evs = [PnsgdRun("gaussian", n, *(p[k] for k in theirs)) for n in counts]
        return float(ledger_accounting.account(evs, limit.delta).eps), limit.delta

    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]:
        """Online: the per-record deltas of the last pass at the eps it is charged (oldest, median, newest)."""
        if not self.online or not events:
            return {}
        p, n = events[-1].params, max(int(events[-1].contributors), 1)
        eps = online_epsilon(p, [n], limit.delta)
        theirs = (p["lipschitz"], p["eta"], p["diameter"], p["alpha"], p["c1"], p["c2"], p["m"])
        d = pnsgd.online_record_deltas(pnsgd.OnlineConfig("gaussian", eps, *theirs), n)
        return {
            "record_delta_oldest": float(d[0]),
            "record_delta_median": float(d[n // 2]),
            "record_delta_newest": float(d[-1]),
        }

    # -------------------------------------------------------------------------------------------- client
    def verify_epsilon(self, spec: pb.RoundSpec) -> float:
        """The pass's eps from the spec's constants: shuffled at n = release_floor(spec), the fewest records it runs on
        (delta_shuf decreases in n); online at the most records the analyzer says the pass can run (its newest
        record's noise is the smallest)."""
        x = dict(spec.randomizer.extra)
        keys = ("lipschitz", "eta", "diameter", "m", "delta")
        keys += ("alpha", "c1", "records_max") if self.online else ("sigma",)
        if not all(x.get(k, 0.0) > 0 and math.isfinite(x[k]) for k in keys) or spec.min_contributors < 1:
            raise ValueError("the spec lacks valid PNSGD constants")
        if self.online:
            return online_epsilon(x, [int(x["records_max"])], x["delta"])
        return pnsgd_epsilon(x, release_floor(spec), x["delta"])

    def local_vectors(self, spec: pb.RoundSpec, node: Any, idx: np.ndarray) -> np.ndarray:
        """Each user's record [x, y] (its first example)."""
        X, y = node.shard.X[idx, 0], node.shard.y[idx, 0]
        return np.concatenate([np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)[:, None]], axis=1)

    def randomize(
        self,
        spec: pb.RoundSpec,
        G: np.ndarray,
        user_ids: Sequence[str],
        nonces: Sequence[bytes],
        rng: np.random.Generator,
        out: pb.Contribution,
    ) -> None:
        """Seal each record of the public domain; a user whose record lies outside refuses (module docstring)."""
        R = np.asarray(G, dtype=np.float64)
        if R.shape[1] != spec.randomizer.dim:
            raise ValueError(f"records of {R.shape[1]} values, the spec asks for {spec.randomizer.dim}")
        params = {"feature_bound": spec.randomizer.clip_norm, "num_classes": spec.randomizer.extra["num_classes"]}
        ok = np.array([not _record_problem(row, params) for row in R], dtype=bool)
        for u in np.asarray(user_ids)[~ok]:
            log.error(
                "user %s refuses run %s: its record lies outside the public domain (||x|| <= %g, a label of the "
                "task, finite values)",
                u,
                spec.run_id,
                params["feature_bound"],
            )
            out.refusals.append(pb.Refusal(user_id=str(u), reason=OUTSIDE_DOMAIN))
        keep = np.flatnonzero(ok)
        seal_rows(spec, R[keep], [user_ids[i] for i in keep], [nonces[i] for i in keep], out)


def _record_problem(row: np.ndarray, params: dict[str, Any]) -> str:
    """ "" for a record of the public domain, else the reason (OUTSIDE_DOMAIN, or MALFORMED_PLAINTEXT)."""
    if not np.all(np.isfinite(row)):
        return MALFORMED_PLAINTEXT
    x, y = row[:-1], row[-1]
    k = int(params["num_classes"])
    if np.linalg.norm(x) > float(params["feature_bound"]) * (1.0 + _SLACK):
        return OUTSIDE_DOMAIN
    if k >= 2 and not (y == int(y) and 0 <= y < k):
        return OUTSIDE_DOMAIN
    return ""
