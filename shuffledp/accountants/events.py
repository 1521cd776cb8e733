"""Privacy events: what one round (or one run) of a protocol did, as data.

Modelled on dp_accounting's ``DpEvent`` (design section 6; anchors/style.md section 1): an event *describes* a
mechanism, its parameters, the number of contributors actually aggregated, the participation schedule and the
trust model; it does no arithmetic. Accountants (``shuffledp.accountants.ledger_accounting``) interpret a list of
events as (eps, delta). The analyzer's ledger stores events as JSON (``to_json`` / ``event_from_json``) so an
auditor can recompute every total from the export.

Stability rule (the stored ledgers depend on it):
  1. Never remove an event kind or a field, and never change the meaning or the unit of a field.
  2. New fields are optional, and their default reproduces the old meaning exactly.
  3. Reading is backward compatible and forward strict: a stored event that lacks an optional field gets the
     default; a stored event with a field (or a kind) this version does not know is REFUSED with a ValueError.
     An unknown field may change the privacy cost (e.g. a smaller honest fraction), so ignoring it could
     under-report what was spent; an accountant must never guess (dp_accounting: unknown events are
     unsupported, never skipped).
  4. ``kind`` strings are part of the format and never change.

Trust models (design section 2): "shuffle" (analyzer untrusted, shuffler trusted not to collude), "local"
(nobody trusted), "central" (analyzer trusted with clipped contributions). Every event carries one; an
accountant refuses to add up events that hold against different parties.

Neighbouring relation: replace-one for every event here (seeds 000, 001, 002, 004) except the tree aggregation of
seed 003 (zero-out, spec 003 A2), as in the papers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from shuffledp.mechanisms.pvec import PvecParams

__all__ = [
    "TRUST_MODELS",
    "PrivacyEvent",
    "PvecRound",
    "LdpShuffleRound",
    "GaussianRound",
    "TreeAggregation",
    "PnsgdRun",
    "EVENT_KINDS",
    "event_from_dict",
    "event_from_json",
    "events_to_json",
    "events_from_json",
    "trust_of",
]

TRUST_MODELS = ("shuffle", "local", "central")


# ----------------------------------------------------------------------------------------------- validation
def _int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    if int(value) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value}")
    return int(value)


def _real(name: str, value: object, lo: float, lo_open: bool = True, hi: float = math.inf, hi_open: bool = True):
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    lo_ok = v > lo if lo_open else v >= lo
    hi_ok = v < hi if hi_open else v <= hi
    if not (math.isfinite(v) and lo_ok and hi_ok):
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {rng}, got {value!r}")
    return v


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return str(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return bool(value)


class PrivacyEvent:
    """Base class of all events: JSON (de)serialisation. Subclasses are frozen dataclasses with a ``KIND``."""

    KIND: ClassVar[str] = ""
    TRUST: ClassVar[tuple[str, ...]] = TRUST_MODELS  # trust models this mechanism can be accounted under

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def _check_trust(self) -> None:
        self._set("trust", _choice(f"{self.KIND}.trust", self.trust, self.TRUST))

    def to_dict(self) -> dict[str, Any]:
        """{"kind": KIND, field: value, ...}; every value is a JSON scalar."""
        out: dict[str, Any] = {"kind": self.KIND}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = getattr(self, f.name)
        return out

    def to_json(self) -> str:
        """Canonical JSON (sorted keys; floats as repr, so the round trip is exact)."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)


# --------------------------------------------------------------------------------------------- seed 000
@dataclass(frozen=True)
class PvecRound(PrivacyEvent):
    """One PVEC round (Alg 2 of paper 000): the analyzer sees per-label totals of ``contributors`` users.

    View: for each coordinate j, C_j = sum_i xhat_ij + Bin(n' m, p), with xhat_ij in {0..g} the randomized
    rounding of (x_ij + delta2) g / (2 delta2) and n' = ``contributors`` (design 5.2, spec 000 sec 3).
    Parameters (d, n, delta2, g, m, p, target_eps, target_delta, method) are exactly those of
    ``shuffledp.mechanisms.pvec.PvecParams`` (target_eps/target_delta are its eps/delta: the per-round target the
    parameters were derived for, NOT the accounted cost, which the accountant computes for n').
    Per-round cost: method="paper" -> Lemma 3.1 per coordinate + Lemma 3.3 over coordinates (Thm 3.2);
    method="calibrated" -> the exact binomial accountant of calibrated_pvec (an extension beyond the paper).
    schedule: "sequential" (disjoint cohorts, each user in one round: rounds compose in parallel, spec 000
    sec 5) or "fully_interactive" (PGD, every user in every round: rounds compose sequentially).
    """

    KIND: ClassVar[str] = "pvec_round"
    TRUST: ClassVar[tuple[str, ...]] = ("shuffle",)

    d: int
    n: int
    delta2: float
    g: int
    m: int
    p: float
    target_eps: float
    target_delta: float
    method: str
    contributors: int
    schedule: str = "sequential"
    trust: str = "shuffle"

    def __post_init__(self) -> None:
        self._check_trust()
        self._set("schedule", _choice("pvec_round.schedule", self.schedule, ("sequential", "fully_interactive")))
        params = self.params  # validates every parameter (PvecParams.__post_init__)
        for name in ("d", "n", "delta2", "g", "m", "p", "method"):
            self._set(name, getattr(params, name))
        self._set("target_eps", params.eps)
        self._set("target_delta", params.delta)
        c = _int("pvec_round.contributors", self.contributors, 1)
        if c > params.n:
            # the parameters were derived for n users; more contributors means an accounting error upstream
            raise ValueError(f"pvec_round.contributors must be <= n = {params.n}, got {c}")
        self._set("contributors", c)

    @property
    def params(self) -> PvecParams:
        return PvecParams(
            d=self.d,
            n=self.n,
            delta2=self.delta2,
            g=self.g,
            m=self.m,
            p=self.p,
            eps=self.target_eps,
            delta=self.target_delta,
            method=self.method,
        )

    @classmethod
    def from_params(cls, params: PvecParams, contributors: int | None = None, schedule: str = "sequential"):
        """Event of one round run with ``params`` and aggregated over ``contributors`` users (default: n)."""
        return cls(
            d=params.d,
            n=params.n,
            delta2=params.delta2,
            g=params.g,
            m=params.m,
            p=params.p,
            target_eps=params.eps,
            target_delta=params.delta,
            method=params.method,
            contributors=params.n if contributors is None else contributors,
            schedule=schedule,
        )


# --------------------------------------------------------------------------------------------- seed 001
@dataclass(frozen=True)
class LdpShuffleRound(PrivacyEvent):
    """One round of CLDP-SGD over the subsampled shuffle (seed 001, spec 001 sections 1-2).

    The shuffler draws a secret uniform k-subset of the n clients (without replacement, gamma = k/n); each sampled
    client sends one report of an eps0-LDP randomizer with a discrete range; the analyzer sees the shuffled
    multiset. Replace-one neighbours. Accounted by Thm 1 of the paper (RDP upper bound, composed additively over
    rounds, optimal RDP -> DP conversion) or by the FMT20 baseline / its PLD composition.
    ``randomizer`` is informational ("rr", "r_inf", "r_1", "privunit", ...): the accounting uses eps0 only.
    ``k`` is the number of reports actually shuffled (a short batch is released never, so k is never smaller
    than planned).
    """

    KIND: ClassVar[str] = "ldp_shuffle_round"
    TRUST: ClassVar[tuple[str, ...]] = ("shuffle",)

    randomizer: str
    eps0: float
    n: int
    k: int
    schedule: str = "subsampled"
    trust: str = "shuffle"

    def __post_init__(self) -> None:
        self._check_trust()
        if not isinstance(self.randomizer, str) or not self.randomizer:
            raise ValueError(f"ldp_shuffle_round.randomizer must be a non-empty string, got {self.randomizer!r}")
        self._set("schedule", _choice("ldp_shuffle_round.schedule", self.schedule, ("subsampled",)))
        self._set("eps0", _real("ldp_shuffle_round.eps0", self.eps0, 0.0))
        n = _int("ldp_shuffle_round.n", self.n, 1)
        k = _int("ldp_shuffle_round.k", self.k, 1)
        if k > n:
            raise ValueError(f"ldp_shuffle_round.k must satisfy 1 <= k <= n = {n}, got {k}")
        self._set("n", n)
        self._set("k", k)

    @property
    def sampling_rate(self) -> float:
        return self.k / self.n


# --------------------------------------------------------------------------------------------- seed 002
@dataclass(frozen=True)
class GaussianRound(PrivacyEvent):
    """One Gaussian release: a query of l2 sensitivity ``sensitivity`` plus N(0, sigma^2 I) (seed 002).

    RDP: alpha sensitivity^2 / (2 sigma^2) per round (Mironov 2017; seed 002 Lemma 2.2); rounds compose
    additively, so T rounds are rho-GDP with rho = sensitivity sqrt(sum 1/sigma_t^2) (Thm 5.1 / 6.1).
    trust="local": each machine adds the noise to its own message (untrusted server, Alg. 1, sensitivity 2S);
    trust="central": the server adds it to the average (trusted server, Alg. 2, sensitivity 2S/M).
    sampling="none": every record is in the round; "poisson": each record is included independently with
    probability ``sampling_rate`` (sampled Gaussian mechanism, accounted by dp_accounting).
    """

    KIND: ClassVar[str] = "gaussian_round"
    TRUST: ClassVar[tuple[str, ...]] = ("local", "central")

    sigma: float
    sensitivity: float = 1.0
    trust: str = "central"
    sampling: str = "none"
    sampling_rate: float = 1.0

    def __post_init__(self) -> None:
        self._check_trust()
        self._set("sigma", _real("gaussian_round.sigma", self.sigma, 0.0))
        self._set("sensitivity", _real("gaussian_round.sensitivity", self.sensitivity, 0.0))
        self._set("sampling", _choice("gaussian_round.sampling", self.sampling, ("none", "poisson")))
        q = _real("gaussian_round.sampling_rate", self.sampling_rate, 0.0, hi=1.0, hi_open=False)
        if self.sampling == "none" and q != 1.0:
            raise ValueError(f"gaussian_round.sampling_rate must be 1 when sampling is 'none', got {q}")
        self._set("sampling_rate", q)

    @property
    def noise_multiplier(self) -> float:
        """sigma / sensitivity (dp_accounting's GaussianDpEvent parameter)."""
        return self.sigma / self.sensitivity


# --------------------------------------------------------------------------------------------- seed 003
@dataclass(frozen=True)
class TreeAggregation(PrivacyEvent):
    """One tree of DP-FTRL's tree aggregation (seed 003): every node of the binary tree over ``steps`` leaves is
    released with noise N(0, z^2 L^2) (z = ``noise_multiplier``, L = leaf sensitivity, zero-out neighbours).

    It is a Gaussian mechanism with squared sensitivity zeta L^2, hence (alpha, alpha zeta / (2 z^2))-RDP, where
    zeta = max over neighbours of sum over released nodes of (occurrences of the record in the node)^2
    (spec 003 sec 3). Participation pattern:
      max_participations = 1: zeta = depth(steps) = floor(log2 steps) + 1 (Thm 3.1);
      max_participations = E > 1, order "any": at most E leaves per record, >= min_separation leaves between
        two of them (dynamic program of App. D.2);
      order "fixed": the same data order repeated for E = max_participations epochs of steps/E leaves
        (count^2 per node, exact).
    completion=True: the tree was padded with virtual leaves to the next power of two before a restart, and the
    padded tree was released. Restarts are several TreeAggregation events (zeta adds up).
    """

    KIND: ClassVar[str] = "tree_aggregation"
    TRUST: ClassVar[tuple[str, ...]] = ("central",)

    noise_multiplier: float
    steps: int
    max_participations: int = 1
    min_separation: int = 0
    completion: bool = False
    order: str = "any"
    trust: str = "central"

    def __post_init__(self) -> None:
        self._check_trust()
        self._set("noise_multiplier", _real("tree_aggregation.noise_multiplier", self.noise_multiplier, 0.0))
        steps = _int("tree_aggregation.steps", self.steps, 1)
        e = _int("tree_aggregation.max_participations", self.max_participations, 1)
        self._set("steps", steps)
        self._set("max_participations", e)
        self._set("min_separation", _int("tree_aggregation.min_separation", self.min_separation, 0))
        self._set("completion", _bool("tree_aggregation.completion", self.completion))
        self._set("order", _choice("tree_aggregation.order", self.order, ("any", "fixed")))
        if self.order == "fixed" and steps % e:
            raise ValueError(
                f"tree_aggregation.steps must be a multiple of max_participations (epochs) = {e} for order 'fixed', "
                f"got {steps}"
            )


# --------------------------------------------------------------------------------------------- seed 004
@dataclass(frozen=True)
class PnsgdRun(PrivacyEvent):
    """One epoch of shuffled projected noisy SGD (seed 004, Thm 2); only the last iterate is released.

    Each of the n records is used once, in a secret uniformly random order, by w <- Proj_K(w - eta (grad + Z)),
    Z ~ N(0, scale^2 I) ("gaussian") or Laplace(0, scale) in 1-D ("laplace"). Privacy profile (any eps >= 0):
        delta(eps) = A (1 - B^n) / (n (1 - B)),
    Gaussian: A = theta_{e^eps}(2L/sigma), B = theta_{e^eps}(M D_K / (eta sigma)); Laplace: A = (1 - e^{eps/2 -
    L/v})_+, B = (1 - e^{eps/2 - M (b - a)/(2 eta v)})_+ (spec 004 sec 3). ``diameter`` is D_K (Gaussian) or b - a
    (Laplace); ``contraction`` is M = sqrt(1 - 2 eta beta rho/(beta + rho)) (1 for plain convex losses).
    Several epochs are several events (composed; spec 004 sec 3.6).
    """

    KIND: ClassVar[str] = "pnsgd_run"
    TRUST: ClassVar[tuple[str, ...]] = ("central",)

    noise: str
    n: int
    lipschitz: float
    scale: float
    eta: float
    diameter: float
    contraction: float = 1.0
    schedule: str = "shuffled"
    trust: str = "central"

    def __post_init__(self) -> None:
        self._check_trust()
        self._set("noise", _choice("pnsgd_run.noise", self.noise, ("gaussian", "laplace")))
        self._set("n", _int("pnsgd_run.n", self.n, 1))
        self._set("lipschitz", _real("pnsgd_run.lipschitz", self.lipschitz, 0.0))
        self._set("scale", _real("pnsgd_run.scale", self.scale, 0.0))
        self._set("eta", _real("pnsgd_run.eta", self.eta, 0.0))
        self._set("diameter", _real("pnsgd_run.diameter", self.diameter, 0.0))
        self._set("contraction", _real("pnsgd_run.contraction", self.contraction, 0.0, hi=1.0, hi_open=False))
        self._set("schedule", _choice("pnsgd_run.schedule", self.schedule, ("shuffled",)))


# --------------------------------------------------------------------------------------------- (de)serialise
EVENT_KINDS: dict[str, type[PrivacyEvent]] = {
    cls.KIND: cls for cls in (PvecRound, LdpShuffleRound, GaussianRound, TreeAggregation, PnsgdRun)
}


def event_from_dict(data: dict[str, Any]) -> PrivacyEvent:
    """Inverse of ``to_dict``. Missing optional fields take their defaults; unknown kinds or fields are refused
    (stability rule 3 of the module docstring)."""
    if not isinstance(data, dict):
        raise ValueError(f"a privacy event must be a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    cls = EVENT_KINDS.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown privacy event kind {kind!r}; this version knows {tuple(EVENT_KINDS)}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known - {"kind"})
    if unknown:
        raise ValueError(
            f"privacy event {kind!r} has fields this version does not know: {unknown}; refusing to account it "
            "(an unknown field may change its cost)"
        )
    missing = sorted(
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name not in data and f.default is dataclasses.MISSING
    )
    if missing:
        raise ValueError(f"privacy event {kind!r} lacks required fields {missing}")
    return cls(**{k: v for k, v in data.items() if k != "kind"})


def event_from_json(text: str) -> PrivacyEvent:
    """Parse one event written by ``PrivacyEvent.to_json``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"privacy event is not valid JSON: {exc}") from None
    return event_from_dict(data)


def events_to_json(events: Iterable[PrivacyEvent]) -> str:
    """A JSON array of events (a ledger export)."""
    return json.dumps([e.to_dict() for e in events], sort_keys=True, allow_nan=False)


def events_from_json(text: str) -> list[PrivacyEvent]:
    """Inverse of ``events_to_json``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"privacy event list is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"a privacy event list must be a JSON array, got {type(data).__name__}")
    return [event_from_dict(d) for d in data]


def trust_of(events: Sequence[PrivacyEvent]) -> str:
    """The one trust model shared by ``events``; ValueError if they hold against different parties."""
    models = sorted({e.trust for e in events})  # type: ignore[attr-defined]
    if len(models) != 1:
        raise ValueError(
            f"events hold under different trust models {models}; account each trust model separately "
            "(a guarantee against one party does not add to a guarantee against another)"
        )
    return models[0]
