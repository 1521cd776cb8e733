"""CLDP-SGD's rounds as plug-ins (seed 001, spec 001 sections 1-3; design sec 3.1): eps0-LDP reports over the
subsampled shuffle, one sealed fixed-length message per user.

One class serves the four randomizers (the module of each holds its math; this one only wires it to the parties):

    "r_inf"     R_inf, l_inf ball of radius C = privacy.clip_norm (clip: g / max(1, ||g||_inf / C))
    "r_one"     R_1 (Hadamard), l_1 ball
    "privunit"  quantized PrivUnit2, l_2 ball
    "rr"        2RR on a scalar task (model dimension 1): u = (g + C) / (2C) in [0, 1]

Round t (spec 001 sec 2): the shuffler draws a secret uniform k-subset of the n admitted users (CSPRNG; schedule
SUBSAMPLED); each sampled user clips its gradient in the randomizer's norm, randomizes it with eps0, encodes the
report as the randomizer's fixed-length message and seals it to the analyzer (HPKE, info = run and round); the
shuffler forwards the permuted ciphertexts only when exactly k arrived (threshold = k: fewer -> nothing released,
nothing charged, spec 001 sec 1); the analyzer opens, validates (length, alphabet), decodes and averages.

Privacy (spec 001 sec 4): each round is a subsampled-shuffle event (eps0, n, k), composed by the accountant of
shuffledp.accountants.ledger_accounting named in BOUND (the same figure as `shuffledp account subsampled-shuffle
--bound tight-pld`); the paper's Thm 1 and the FMT20 baseline are reported next to it (views). A delivered
batch with bad messages is charged with the good ones only as its crowd, k' < k, and a sampling rate no smaller than
k/n (n' = floor(k' n / k)): reports the analyzer had to discard may come from colluding users and hide nobody. The
local view (a party that sees each message with its sender: the shuffler, the network) is eps0 per participation,
composed by basic composition over the rounds (a user may be sampled in every round).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from shuffledp.protocols.base import (
    MALFORMED_PLAINTEXT,
    UNDECRYPTABLE,
    AnalyzerHooks,
    BatchError,
    Decoded,
    PlanRequest,
    RoundPlan,
    open_each,
)
from shuffledp.security import sealing
from shuffledp.settings import setting
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["LdpRound", "LdpSettings", "LDP_PROTOCOLS", "UNDECRYPTABLE", "MALFORMED_PLAINTEXT", "clip_rows_in_norm"]

# The ledger's accountant: FMT20's clone dominating pair of the subsampled shuffle, composed exactly as a privacy loss
# distribution (fmt_shuffle.subsampled_fmt_pld, pessimistic discretisation); 9-16x more rounds than the FMT20
# baseline at n = 60000, k in {1000, 10000}, eps0 in {1, 2}, eps = 4, delta = 1e-5, and 3-4x below Thm 1's eps.
# `shuffledp account subsampled-shuffle --bound tight-pld` gives the same figure.
BOUND = "tight-pld"
# the four randomizers and the norm each clips in (spec 001 sec 3)
LDP_PROTOCOLS = {"r_inf": np.inf, "r_one": 1, "privunit": 2, "rr": np.inf}


def clip_rows_in_norm(G: np.ndarray, radius: float, order: float) -> np.ndarray:
    """g / max(1, ||g||_p / C) per row (spec 001 sec 2); rows stay finite or the call raises ValueError."""
    G = np.asarray(G, dtype=np.float64)
    if not np.all(np.isfinite(G)):
        raise ValueError("gradients must be finite")
    norms = np.linalg.norm(G, ord=order, axis=1)
    out = G / np.maximum(1.0, norms / radius)[:, None]
    # float rounding may leave a norm an ulp above C: shrink those rows once more (the randomizers check <= C)
    over = np.linalg.norm(out, ord=order, axis=1) > radius
    out[over] *= 1.0 - 4.0 * np.finfo(float).eps
    return out


@dataclass(frozen=True)
class _Randomizer:
    """The randomizer module of a protocol and its parameters for one round."""

    name: str
    module: Any
    params: Any

    @classmethod
    def of(cls, name: str, eps0: float, d: int, radius: float) -> _Randomizer:
        if name == "r_inf":
            from shuffledp.mechanisms import r_inf as mod

            return cls(name, mod, mod.make_params(eps0, d, radius))
        if name == "r_one":
            from shuffledp.mechanisms import r_one as mod

            return cls(name, mod, mod.make_params(eps0, d, radius))
        if name == "privunit":
            from shuffledp.mechanisms import privunit as mod

            return cls(name, mod, mod.make_params(eps0, d, radius))
        if name == "rr":
            from shuffledp.mechanisms import rr as mod

            if d != 1:
                raise ValueError(f"rr randomizes one number per user: the model must have dimension 1, got {d}")
            return cls(name, mod, mod.make_params(eps0))
        raise LookupError(f"no LDP randomizer {name!r}")

    @property
    def message_bytes(self) -> int:
        return self.params.message_format.message_bytes

    def encode(self, G: np.ndarray, radius: float, rng: np.random.Generator) -> np.ndarray:
        """Clipped gradients (k, d) -> messages; rr maps its scalar onto [0, 1]."""
        if self.name == "rr":
            return self.module.encode(np.clip((G[:, 0] + radius) / (2.0 * radius), 0.0, 1.0), self.params, rng)
        return self.module.encode(G, self.params, rng)

    def decode_sum(self, messages: np.ndarray, radius: float) -> np.ndarray:
        """Unbiased estimate of the sum of the k clipped gradients (spec 001 sec 3: every decoder is unbiased)."""
        if self.name == "rr":
            units = float(self.module.decode_sum(messages, self.params))
            return np.array([2.0 * radius * units - radius * messages.shape[0]])
        return np.asarray(self.module.decode_sum(messages, self.params), dtype=np.float64)

    def worst_mse(self, d: int, radius: float) -> float:
        """sup_x E||decode(R(x)) - x||^2 of one report: attained at x = 0 (R_inf, R_1, PrivUnit: const - ||x||^2)."""
        if self.name == "rr":
            return float(np.max(self.module.mse(np.array([0.0, 0.5, 1.0]), self.params))) * (2.0 * radius) ** 2
        zero = np.zeros((1, d))
        bound = getattr(self.module, "mse_bound", self.module.mse)
        return float(bound(zero, self.params)[0])


@dataclass(frozen=True)
class LdpSettings:
    """[privacy.r_inf], [privacy.r_one], [privacy.privunit], [privacy.rr]"""

    eps0: float | None = setting(
        None,
        "local eps of each report; unset = the largest for which schedule.rounds fit (eps, delta)",
        lo=0.0,
        hi=36.0,  # ldp_common.MAX_EPS0
        lo_open=True,
        example=1.0,
    )


class LdpRound(AnalyzerHooks):
    """The plug-in of one LDP randomizer over the subsampled shuffle (module docstring)."""

    trust_model = pb.SHUFFLE
    settings = LdpSettings
    schedules = ("subsampled",)
    transports = ("sealed",)
    optimizers = ("sgd",)
    # digits (d = 650) as in docs/benchmarks.md's CLDP-SGD; "rr" sends one number, so it runs mean estimation
    example = {
        "schedule": {"kind": "subsampled", "cohort_size": 1000, "rounds": 20, "learning_rate": 4.0},
        "transport": {"mode": "sealed"},
        "policy": {"max_eps_per_round": 36.0, "max_total_eps": 1e6, "max_total_delta": 1.0},
    }

    def __init__(self, name: str):
        self.name = name
        self.order = LDP_PROTOCOLS[name]
        if name in ("r_inf", "r_one"):
            # their variance grows with d (R_inf as d^2, R_1 as d; spec 001 sec 3): 10-class digits (d = 650) stayed
            # at 0.13-0.2 accuracy at eps 8; two classes (d = 130) learn (issue 43 item 13, docs/benchmarks.md)
            self.example = {
                **self.example,
                "data": {"classes": [0, 1]},
                "schedule": {**self.example["schedule"], "cohort_size": 200, "learning_rate": 1.0},
            }
        if name == "rr":  # one number per report: mean estimation on a one-feature synthetic set
            self.example = {
                **self.example,
                "data": {"dataset": "synthetic", "n": 5000, "dim": 1, "test_fraction": None},
                "model": {"task": "distance", "radius": 2.0},
                "schedule": {**self.example["schedule"], "learning_rate": 0.5},
            }

    # ------------------------------------------------------------------------------------------ analyzer
    def plan(self, req: PlanRequest) -> RoundPlan:
        """eps0 and T from the budget (spec 001 sec 4, sec 7 item 7): both given -> checked against (eps, delta);
        eps0 given, rounds unset -> the most rounds that fit; rounds given, eps0 unset -> the largest eps0 that fits."""
        from shuffledp.accountants import ledger_accounting as la
        from shuffledp.accountants.events import LdpShuffleRound
        from shuffledp.mechanisms.ldp_common import MAX_EPS0

        if req.kind != "subsampled":
            raise ValueError(
                f'privacy.protocol = "{self.name}" runs over schedule.kind = "subsampled", got "{req.kind}"'
            )
        n, k, eps, delta = req.admitted, req.cohort, req.eps, req.delta
        eps0, rounds = req.settings.eps0, req.rounds_requested
        if eps0 is None and rounds is None:
            raise ValueError(f'privacy.protocol = "{self.name}" needs privacy.{self.name}.eps0 or schedule.rounds')
        if eps0 is None:  # the least noise (largest eps0) for which the rounds fit, by the ledger's own accountant
            fit, _ = la.min_noise(LdpShuffleRound(self.name, 1.0, n, k), rounds, eps, delta, ldp_bound=BOUND)
            eps0 = min(float(fit.eps0), MAX_EPS0)  # a smaller eps0 costs less: the cap keeps the rounds fitting
        elif rounds is None:
            fit_rounds = la.max_rounds(LdpShuffleRound(self.name, eps0, n, k), eps, delta, ldp_bound=BOUND)
            rounds = int(min(fit_rounds, _MAX_PLANNED_ROUNDS))
            if rounds < 1:
                raise ValueError(
                    f"not one round of eps0 = {eps0} with k = {k} of n = {n} fits eps = {eps}, delta = {delta}"
                )
        rnd = _Randomizer.of(self.name, eps0, req.dim, req.clip_norm)
        params = {
            "randomizer": self.name,
            "eps0": eps0,
            "n": n,
            "k": k,
            "d": req.dim,
            "radius": req.clip_norm,
            "delta": delta,
            "message_bytes": rnd.message_bytes,
        }
        noise_sq = k * rnd.worst_mse(req.dim, req.clip_norm)  # E||decoded sum - true sum||^2, k reports
        return RoundPlan(params, "rdp", 0.0, noise_sq, rounds=rounds)

    def params(self, plan: dict[str, Any]) -> dict[str, Any]:
        return dict(plan["params"])

    def needs_keypair(self, plan: dict[str, Any]) -> bool:
        return True  # every report is sealed to the analyzer

    def per_user_claim(self, params: dict[str, Any], event: Any) -> tuple[float, float]:
        """One round on its own, against the analyzer (the shuffle model)."""
        return self.round_cost(event)

    def spec_fields(self, plan: dict[str, Any], params: dict[str, Any], event: Any, key: bytes) -> dict[str, Any]:
        eps_r, delta_r = self.per_user_claim(params, event)
        return {
            "trust_model": self.trust_model,
            "transport": pb.SEALED,
            "randomizer": pb.RandomizerSpec(
                protocol=self.name,
                clip_norm=params["radius"],
                dim=params["d"],
                messages_per_user=1,
                message_bytes=params["message_bytes"],
                extra={"eps0": params["eps0"], "n": float(params["n"]), "k": float(params["k"])},
            ),
            "per_user_cost": pb.PrivacyCost(
                eps=eps_r, delta=delta_r, accountant=self.accountant_name(event, "rdp"), trust_model=self.trust_model
            ),
            "analyzer_public_key": key,
            # the accountant's n: the shuffler draws k from no fewer (issue 24 item 3)
            "population": int(params["n"]),
        }

    def decode(
        self,
        batch: pb.ShuffledBatch,
        n: int,
        plan: dict[str, Any],
        params: dict[str, Any],
        private_key: Any,
        info: bytes,
    ) -> Decoded:
        """Open and validate every ciphertext, skip and count the bad ones; decode only a full crowd of k."""
        if len(batch.ciphertexts) != n:
            raise BatchError(n, f"{len(batch.ciphertexts)} ciphertexts do not match {n} contributors (one per user)")
        rnd = _Randomizer.of(self.name, params["eps0"], params["d"], params["radius"])
        fmt = rnd.params.message_format
        opened, undecryptable = open_each(private_key, batch.ciphertexts, info)
        good = [plain for plain in opened if len(plain) == fmt.message_bytes]
        rejected: Counter[str] = Counter({UNDECRYPTABLE: undecryptable, MALFORMED_PLAINTEXT: len(opened) - len(good)})
        messages = np.zeros((0, *fmt.shape), dtype=fmt.dtype)
        if good:
            raw = np.frombuffer(b"".join(good), dtype=np.uint8).reshape(len(good), fmt.message_bytes)
            parsed = raw.view(fmt.dtype.newbyteorder(">")).astype(fmt.dtype).reshape((len(good), *fmt.shape))
            ok = fmt.valid_mask(parsed)  # a symbol outside the randomizer's alphabet: never decoded
            rejected[MALFORMED_PLAINTEXT] += int((~ok).sum())
            messages = parsed[ok]
        rejected_all = dict(Counter(dict(batch.report.rejected)) + rejected)
        used = int(messages.shape[0])
        if used < params["k"]:
            failure = f"{params['k'] - used} of {params['k']} reports rejected: a short crowd releases nothing"
            return Decoded(None, used, max(used, 1), rejected_all, failure)
        total = rnd.decode_sum(messages, params["radius"])
        return Decoded(total, used, used, rejected_all)

    # ------------------------------------------------------------------------------------ ledger arithmetic
    def accountant_name(self, event: Any, composition: str) -> str:
        from shuffledp.accountants.ledger_accounting import _LDP_NAMES

        return _LDP_NAMES[BOUND]

    def _events(self, items: Sequence[tuple[Any, int]], honest_fraction: float = 1.0) -> list[tuple[Any, int]]:
        """The accountant's rounds of (ledger event, rounds with it) items, as (LdpShuffleRound, count)."""
        from shuffledp.accountants.events import LdpShuffleRound

        out: Counter = Counter()
        for e, c in items:
            p = e.params
            k = min(int(e.contributors), int(p["k"]))
            if honest_fraction < 1.0:
                k = max(1, math.floor(honest_fraction * k))
            # a crowd of k' < k reports with a sampling rate >= k/n (module docstring): n' = floor(k' n / k)
            n = int(p["n"]) if k == int(p["k"]) else max(k, (k * int(p["n"])) // int(p["k"]))
            out[LdpShuffleRound(self.name, float(p["eps0"]), n, k)] += c
        return [(r, c) for r, c in out.items() if c > 0]

    def round_cost(self, event: Any) -> tuple[float, float]:
        from shuffledp.accountants.ledger_accounting import account

        delta = float(event.params["delta"])
        return account(self._events([(event, 1)]), delta, "tight", ldp_bound=BOUND).eps, delta

    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]:
        """RDP composition of the rounds (spec 001 sec 4) at the run's delta: `shuffledp account subsampled-shuffle`."""
        return self.compose_counts([(e, 1) for e in events], limit, honest_fraction)

    def compose_counts(
        self, items: Sequence[tuple[Any, int]], limit: Any, honest_fraction: float = 1.0
    ) -> tuple[float, float]:
        """``compose`` of rounds given as (event, rounds with it): the accountant takes identical rounds with their
        count, so the ledger composes a long run per distinct event (issue 30 item 4)."""
        from shuffledp.accountants.ledger_accounting import account

        return account(self._events(items, honest_fraction), limit.delta, "tight", ldp_bound=BOUND).eps, limit.delta

    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]:
        """Other figures of the same rounds, for the report: the paper's Thm 1 (as printed), the FMT20 baseline (the
        paper's comparison), and the local view (eps0 per round, basic composition: against a party that sees
        senders)."""
        return self.views_counts([(e, 1) for e in events], limit)

    def views_counts(self, items: Sequence[tuple[Any, int]], limit: Any) -> dict[str, float]:
        """``views`` of rounds given as (event, rounds with it)."""
        from shuffledp.accountants.ledger_accounting import account

        # basic composition: the exact sum of c eps0 rounded once (Fractions), what fsum over the rounds one by one
        # gives, bit for bit
        local = sum((Fraction(float(e.params["eps0"])) * c for e, c in items), Fraction(0))
        out = {"local": float(local)}
        items = self._events(items)
        out["thm1"] = account(items, limit.delta, "tight", ldp_bound="upper").eps
        try:
            out["fmt_baseline"] = account(items, limit.delta, "tight", ldp_bound="baseline").eps
        except ValueError:  # the baseline accounts identical rounds only
            out["fmt_baseline"] = math.nan
        return out

    # -------------------------------------------------------------------------------------------- client
    def supports(self, spec: pb.RoundSpec) -> bool:
        return spec.transport == pb.SEALED and spec.randomizer.messages_per_user == 1

    def _randomizer(self, spec: pb.RoundSpec) -> _Randomizer:
        r = spec.randomizer
        rnd = _Randomizer.of(self.name, float(dict(r.extra).get("eps0", 0.0)), int(r.dim), float(r.clip_norm))
        if r.message_bytes != rnd.message_bytes:
            raise ValueError(f"randomizer.message_bytes = {r.message_bytes}, the randomizer's is {rnd.message_bytes}")
        return rnd

    def randomize(
        self,
        spec: pb.RoundSpec,
        G: np.ndarray,
        user_ids: Sequence[str],
        nonces: Sequence[bytes],
        rng: np.random.Generator,
        out: pb.Contribution,
    ) -> None:
        rnd = self._randomizer(spec)
        radius = float(spec.randomizer.clip_norm)
        messages = rnd.encode(clip_rows_in_norm(G, radius, self.order), radius, rng)
        plain = rnd.params.message_format.to_bytes(messages)
        info = sealing.round_info(spec.run_id, spec.round)
        cts = sealing.seal_many(spec.analyzer_public_key, [row.tobytes() for row in plain], info)
        for u, nonce, ct in zip(user_ids, nonces, cts, strict=True):
            out.messages.add(user_id=u, nonce=nonce, sealed=pb.SealedMessages(ciphertexts=[ct]))

    def verify_epsilon(self, spec: pb.RoundSpec) -> float:
        """eps0 of the randomizer the user runs itself (its local guarantee, which bounds the round's cost against
        anyone, the analyzer included): what the user pays, whatever amplification the analyzer claims."""
        return float(self._randomizer(spec).params.eps0)

    def noise_key(self, spec: pb.RoundSpec) -> None:
        return None  # users compose LDP rounds by basic composition


_MAX_PLANNED_ROUNDS = 100_000  # schedule.rounds' own upper limit
