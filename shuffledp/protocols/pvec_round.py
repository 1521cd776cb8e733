"""PVEC as a round plug-in (design sec 3.1): everything about a PVEC round that is not the optimizer.

Each party calls the plug-in through shuffledp.protocols.registry.round_protocol(name), never by name:

    analyzer  plan(request) -> RoundPlan           sizing from the budget and the population (once per run)
              spec_fields(plan, params, event, key) the RoundSpec's randomizer, transport, trust model and claim
              decode(batch, n, plan, params, key, info) -> Decoded   the estimate of the sum of the users' vectors
    client    randomize(spec, G, user_ids, nonces, rng, out)   the users' messages (clipped here; COUNTS: group sums;
              PRIO3: each group sum as a Prio3SumVec report, protocols/prio3.py)
              verify_epsilon(spec), noise_key(spec)  what the round costs a user, recomputed from the spec
    config    settings ([privacy.pvec]), check_config(cfg, optimizer)   the protocol's own keys and their checks
    shuffler  nothing protocol-specific: it sums counts (COUNTS), runs the Leader's part of PRIO3 (the analyzer the
              Helper's: services/aggregation.py turns the reports into the same totals before decode), or permutes
              and forwards ciphertexts (BITS, SEALED) by RoundSpec.transport, the only thing it needs to know
              (design 5).

Sizing (spec 000 sec 4/5): sequential rounds are sized for one round at (eps, delta) (disjoint cohorts compose in
parallel); fully interactive rounds per round from calibrate_pvec(eps, delta, ..., rounds=T) (calibrated, RDP
composition) or the paper's (eps_r, delta_r) of Alg 5 (advanced composition). The noise is sized for the threshold
n_min contributors: a released batch has n' >= n_min and fewer contributors means less binomial noise, so the
reserved (worst-case) cost bounds every committed cost (the robust variant of spec 000 sec 3 / A.3).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np

from shuffledp.mechanisms import check_in, pvec
from shuffledp.mechanisms.pvec import PvecParams
from shuffledp.protocols import prio3
from shuffledp.protocols.base import (
    MALFORMED_PLAINTEXT,
    UNDECRYPTABLE,
    AnalyzerHooks,
    BatchError,
    Decoded,
    Nonces,
    PlanRequest,
    RoundPlan,
    open_each,
    release_floor,
)
from shuffledp.security import sealing
from shuffledp.settings import ConfigError, RunConfig, setting
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = [
    "PvecRound",
    "open_bit_messages",
    "pvec_params_from_spec",
    "UNDECRYPTABLE",
    "MALFORMED_PLAINTEXT",
]


def _sized(method: str, eps: float, delta: float, n_min: int, n_max: int, d: int, clip: float, rounds: int):
    """PVEC parameters whose noise is sized for n_min contributors, valid for up to n_max (module docstring)."""
    if method == "calibrated":
        # extension beyond the paper (spec 000 sec 8): exact numerical accountant for the binomial view
        # PLD-certified where a PLD route exists, RDP otherwise (issue 16 item 2)
        from shuffledp.accountants.pvec_pld import calibrate_pvec_pld

        params = calibrate_pvec_pld(eps, delta, n_min, d, clip, rounds=rounds)
    else:
        params = pvec.pvec_params(eps, delta, n_min, d, clip)  # proof of Thm 3.2, paper 000
    return replace(params, n=n_max)


def pvec_params_from_spec(spec: pb.RoundSpec) -> PvecParams:
    """The round's PVEC parameters as the analyzer derived them (randomizer fields; eps/delta/n from
    randomizer.extra when given, else per_user_cost and the cohort). method="calibrated" makes it a plain
    container for (g, m, p): what privacy they give is recomputed by verify_epsilon, never assumed."""
    r = spec.randomizer
    extra = dict(r.extra)
    n = int(extra.get("n", 0)) or max(int(spec.cohort_size), int(spec.min_contributors), 1)
    return PvecParams(
        d=int(r.dim),
        n=n,
        delta2=float(r.clip_norm),
        g=int(r.g),
        m=int(r.m),
        p=float(r.p),
        eps=float(extra.get("eps", 0.0)) or float(spec.per_user_cost.eps),
        delta=float(extra.get("delta", 0.0)) or float(spec.per_user_cost.delta),
        method="calibrated",
    )


# users per sum in the columns a node sends (UserColumns.sums): one sum (d uint64) and Bin(users m, p) per coordinate
# per group. A node splits a large contribution only between groups (split_contribution); 256 users' ids and nonces
# are ~6-10 kB, so even a small chunk size splits, and the draws stay ~d / 256 per user (d per user before)
SUM_GROUP_USERS = 1 << 8


@dataclass(frozen=True)
class PreparedCounts:
    """PvecRound.prepare's rounding for the users who checked in (rows in their check-in order)."""

    first: bytes  # the check-in spec without what the second invitation may change (_first_form)
    xhat: np.ndarray  # (users, d) xhat in {0..g}, in the wire width of g


def _first_form(spec: pb.RoundSpec) -> bytes:
    """The spec without the fields a check-in's second invitation sets (services/shuffler.py _second_spec)."""
    s = pb.RoundSpec()
    s.CopyFrom(spec)
    s.check_in.checked_in = 0
    s.min_contributors = 0
    s.randomizer.m = 0
    s.randomizer.messages_per_user = 0
    return s.SerializeToString(deterministic=True)


def _round_wire(blocks: Iterable[np.ndarray], params: PvecParams, rng: np.random.Generator) -> np.ndarray:
    """Each user's xhat (rounding of Alg 1, clipped to ||g||_2 <= clip_norm before the shift, spec 000 sec 7 item
    7) in the narrowest width that holds g, written straight in it: no int64 (k, d) array (at mnist5k's k d ~ 1.5e7
    per node that copy costs more CPU than the rounding)."""
    dtype = pvec.count_wire_dtype(params.g)
    parts = [pvec.round_counts(G, params, rng, dtype) for G in blocks]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty((0, params.d), dtype=dtype)


def _put_sums(
    out: pb.Contribution,
    user_ids: Sequence[str],
    nonces: Sequence[bytes],
    xhat: np.ndarray,
    params: PvecParams,
    rng: np.random.Generator,
    spec: pb.RoundSpec,
) -> None:
    """UserColumns with the users' ids and nonces and, per group of SUM_GROUP_USERS users, the sum of their counts
    (UserColumns.sums): their xhat summed plus Bin(group m, p) per coordinate (pvec.summed_noise), which has the
    law of the sum of their xhat + Bin(m, p) (Alg 1 of paper 000). The shuffler adds up counts and forwards only
    their totals (design 5.2), so the analyzer's view is the same; the shuffler sees sums of many users instead
    of each user's counts, and checks each against [0, users (g + m)]: every sum a node's users could make with
    counts in [0, g + m] each, and no other. PRIO3: each sum goes as a Prio3SumVec report instead (protocols/prio3.py)
    proving that same range, its Helper share sealed to the analyzer's key in the signed spec."""
    out.columns.user_ids.extend(user_ids)
    if isinstance(nonces, Nonces):
        out.columns.nonce_bytes, out.columns.nonces = nonces.width, nonces.blob
    else:
        out.columns.nonce_bytes = len(nonces[0]) if len(nonces) else 0
        out.columns.nonces = b"".join(nonces)
    k = xhat.shape[0]
    sums = np.empty((-(-k // SUM_GROUP_USERS), params.d), dtype="<u8")
    sizes = []  # users per group (the last may be fewer)
    for j, a in enumerate(range(0, k, SUM_GROUP_USERS)):
        group = xhat[a : a + SUM_GROUP_USERS]
        sizes.append(group.shape[0])
        sums[j] = group.sum(axis=0, dtype=np.uint64)
        sums[j] += pvec.summed_noise(params.m, group.shape[0], params.p, params.d, rng)
    out.columns.sum_users = SUM_GROUP_USERS
    if spec.transport != pb.PRIO3:
        out.columns.sums = sums.tobytes()
        return
    vdaf = prio3.Vdaf(spec.prio3.vdaf, params.d, params.g + params.m, spec.run_id, int(spec.round))
    for rid, public, leader, helper in prio3.shard(vdaf, sums, sizes, spec.analyzer_public_key):
        out.columns.reports.add(report_id=rid, public_share=public, leader_share=leader, helper_share=helper)


def open_bit_messages(
    private_key: Any, ciphertexts: Sequence[bytes], info: bytes, d: int
) -> tuple[np.ndarray, np.ndarray, Counter[str]]:
    """Open and validate a BITS batch message by message (design 5.1, 5.3): (labels, bits, rejected by reason).

    A ciphertext that does not open (SealingError) counts as UNDECRYPTABLE; one that opens to anything but a
    5-byte (label < d, bit in {0, 1}) message counts as MALFORMED_PLAINTEXT; both are skipped, so one bad message
    cannot void the others. Nothing of a message (ciphertext, plaintext) is logged or kept.
    """
    labels: list[int] = []
    bits: list[int] = []
    opened, undecryptable = open_each(private_key, ciphertexts, info)
    rejected: Counter[str] = Counter({UNDECRYPTABLE: undecryptable} if undecryptable else {})
    for plain in opened:
        try:
            (label,), (bit,) = sealing.unpack_labelled_bits([plain])
        except ValueError:
            rejected[MALFORMED_PLAINTEXT] += 1
            continue
        if label >= d:
            rejected[MALFORMED_PLAINTEXT] += 1
            continue
        labels.append(int(label))
        bits.append(int(bit))
    return np.asarray(labels, dtype=np.int64), np.asarray(bits, dtype=np.uint8), rejected


def _accounted_round(event: Any, schedule: str, honest_fraction: float):
    """The event for the accountant. More contributors than the parameters' n are charged as n: the extra users'
    noise Bin(m (n' - n), p) is independent of the rest, so dropping it is post-processing (an upper bound).
    honest_fraction h < 1 (robust variant, spec 000 A.3): only floor(h n') contributors' noise is counted, the rest
    may be known to the adversary (colluding users); the binomial view of floor(h n') users is exact for that."""
    from shuffledp.accountants.events import PvecRound as AccountedRound

    params = PvecParams(**event.params)
    n = min(event.contributors, params.n)
    if honest_fraction < 1.0:
        n = max(1, math.floor(honest_fraction * n))
    return AccountedRound.from_params(params, n, schedule)


def _account(rounds: Sequence[Any], delta: float, accountant: str) -> float:
    # imported on first use: the accountants pull in dp_accounting and scipy (~1 s), not needed to open a ledger
    from shuffledp.accountants.ledger_accounting import account

    return account(rounds, delta, accountant).eps  # type: ignore[arg-type]


def _accountant(events: Sequence[Any]) -> str:
    """The paper's parameters: the paper's bounds ("paper", Thm 3.2 and Dwork-Roth 3.20); otherwise the exact
    binomial accountant ("tight"). RDP composition is always the tight accountant's."""
    return "paper" if all(e.params.get("method") == "paper" for e in events) else "tight"


@dataclass(frozen=True)
class PvecSettings:
    """[privacy.pvec]"""

    aggregation: str = setting(
        "counts",
        '"counts" (the shuffler adds the users\' counts: it sees each node\'s sums) or "prio3" (Prio3SumVec reports: '
        "the shuffler and the analyzer verify and add them without seeing one; needs the native/ binding, issue 45)",
        choices=("counts", "prio3"),
    )
    prio3_vdaf: str = setting(
        prio3.DEFAULT_VDAF,
        'aggregation = "prio3": "prio3sumvec" (Field128, one proof) or "prio3sumvec-field64x3" (Field64, three '
        "proofs: about half the upload)",
        choices=tuple(prio3.VDAFS),
    )
    calibration: str = setting(
        "calibrated",
        '"calibrated" (exact numerical accountant) or "paper" (Lemma 3.1/3.3 constants)',
        choices=("calibrated", "paper"),
    )
    check_in: bool | None = setting(
        None,
        "the round's noise is shared by the users who check in instead of sized for min_contributors (one more node "
        'round trip; mechanisms/check_in.py); unset = on with calibration = "calibrated"',
        example=True,
    )
    report_fraction: float = setting(
        0.99,
        "check-in: share of the checked-in users that must report, else nothing is released",
        lo=0.0,
        hi=1.0,
        lo_open=True,
    )
    round_eps: float | None = setting(
        None,
        "fixed eps per round, rounds run while the total fits privacy.eps; unset = from eps and rounds",
        lo=0.0,
        hi=64.0,
        lo_open=True,
        example=1.0,
    )

    @property
    def check_in_on(self) -> bool:
        """Whether rounds run the check-in (unset: where it applies, with the calibrated accountant)."""
        return self.check_in if self.check_in is not None else self.calibration == "calibrated"


class PvecRound(AnalyzerHooks):
    """The PVEC plug-in (paper 000 Alg 2 over the shuffler; count mode or sealed labelled bits)."""

    name = "pvec"
    trust_model = pb.SHUFFLE
    settings = PvecSettings
    schedules = ("sequential", "fully_interactive")
    transports = ("counts", "bits")
    optimizers = ("psgd", "acsa", "pgd")

    def check_config(self, cfg: RunConfig, optimizer: str) -> None:
        own: PvecSettings = cfg.privacy.settings
        if own.check_in and own.calibration != "calibrated":
            raise ConfigError(
                "privacy.pvec.check_in shares PVEC's binomial noise: it needs privacy.pvec.calibration = "
                f'"calibrated", got "{own.calibration}"'
            )
        if own.report_fraction != PvecSettings.report_fraction and not own.check_in_on:
            raise ConfigError("privacy.pvec.report_fraction applies to check-in rounds; privacy.pvec.check_in is off")
        if own.aggregation == "prio3":
            if cfg.transport.mode != "counts":
                raise ConfigError(
                    'privacy.pvec.aggregation = "prio3" aggregates count vectors: it needs transport.mode = "counts", '
                    f'got "{cfg.transport.mode}"'
                )
            if not prio3.available():
                raise ConfigError(prio3.MISSING)
        elif own.prio3_vdaf != PvecSettings.prio3_vdaf:
            raise ConfigError('privacy.pvec.prio3_vdaf applies to privacy.pvec.aggregation = "prio3"')

    def needs_keypair(self, plan: dict[str, Any]) -> bool:
        """BITS: the analyzer opens the ciphertexts with a key of its own (design 5.1); PRIO3: the Helper's input
        shares are sealed to it."""
        return plan["transport"] == "bits" or plan.get("aggregation") == "prio3"

    # ------------------------------------------------------------------------------------------ analyzer
    def plan(self, req: PlanRequest) -> RoundPlan:
        """Per-round parameters, composition rule and noise of a run (module docstring; spec 000 sec 4, 5)."""
        if req.kind not in ("sequential", "fully_interactive") or req.transport not in ("counts", "bits"):
            raise ValueError(
                f'privacy.protocol = "pvec" runs sequential or fully interactive rounds in transport.mode "counts" or '
                f'"bits", got schedule.kind = "{req.kind}", transport.mode = "{req.transport}"'
            )
        slack, own = 0.0, req.settings
        if req.kind == "sequential":
            composition = "parallel"  # disjoint cohorts (spec 000 sec 5)
            eps_r, delta_r, rounds = (own.round_eps or req.eps), req.delta, 1
        elif own.calibration == "calibrated":
            composition = "rdp"
            if own.round_eps is not None:
                eps_r, delta_r, rounds = own.round_eps, req.delta, 1
            else:
                eps_r, delta_r, rounds = req.eps, req.delta, req.rounds
        else:
            from shuffledp.optimizers.pgd import pgd_round_privacy

            composition = "advanced"
            slack = req.delta / (req.rounds + 1)  # delta' of advanced composition (spec 000 sec 4)
            eps_r, delta_r = pgd_round_privacy(req.eps, req.delta, req.rounds)  # Alg 5 per-round budget
            if own.round_eps is not None:
                eps_r = own.round_eps
            rounds = 1
        n_min, d = req.min_contributors, req.dim
        try:
            params = _sized(own.calibration, eps_r, delta_r, n_min, req.cohort, d, req.clip_norm, rounds)
        except ValueError as exc:
            raise ValueError(f"cannot size PVEC for eps={eps_r}, delta={delta_r}, n={n_min}, d={d}: {exc}") from exc
        noise_sq = d * pvec.pvec_variance_bound(params, n_min)  # E||decoded sum - sum||^2 (spec 000 sec 2)
        fraction = own.report_fraction if own.check_in_on else None
        if fraction is not None and params.method != "calibrated":
            raise ValueError('check-in needs privacy.pvec.calibration = "calibrated"')
        # check-in: the noise the worst case (n_min users of m trials each) holds, shared by who checks in
        extra: dict[str, Any] = (
            {} if fraction is None else {"check_in": {"noise_trials": params.m * n_min, "report_fraction": fraction}}
        )
        if own.aggregation == "prio3" and req.transport == "counts":
            extra.update(aggregation="prio3", prio3_vdaf=own.prio3_vdaf)
        return RoundPlan(asdict(params), composition, slack, noise_sq, plan_extra=extra)

    def released(
        self, plan: dict[str, Any], params: PvecParams, report: pb.BatchReport
    ) -> tuple[PvecParams, int, dict[str, Any] | None]:
        """Check-in rounds: the threshold c_min and each user's trials m follow from who checked in, and the round is
        charged at the m it ran with (mechanisms/check_in.py). A report that admits no such round stops the run and
        is charged at the reservation (RuntimeError: the run manager's charge for a batch it cannot use), an upper
        bound of every round it could have been: the m its nodes were told is not known (a charge at the reported
        contributors and the reservation's m fell up to ~0.15 eps below a consistent round's, found by probing)."""
        ci, n = plan.get("check_in"), int(report.contributors)
        if not ci:
            return params, plan["min_contributors"], None
        c = int(report.checked_in)
        try:
            n_min, m = check_in.share(ci["noise_trials"], ci["report_fraction"], plan["min_contributors"], c)
        except ValueError as exc:
            raise RuntimeError(f"the shuffler released a check-in round it could not run: {exc}") from None
        if n > c:
            raise RuntimeError(f"batch has {n} contributors but only {c} users checked in")
        return replace(params, m=m), n_min, {"m": m}

    def per_user_claim(self, plan: dict[str, Any], params: PvecParams, event: Any) -> tuple[float, float]:
        """What one round costs a participating user on its own (RoundSpec.per_user_cost; clients check it).

        Sequential and paper rounds: the round's own (eps, delta). Fully interactive calibrated rounds are composed
        in RDP by the ledger; for the clients' per-round policy (which adds deltas over rounds) we state the round's
        eps at delta/T, so T such claims add up to at most the run's delta. Clients can recompute it from (g, m, p).
        """
        if plan["kind"] == "sequential" or params.method != "calibrated":
            return self.round_cost(event)
        from shuffledp.accountants.pvec_pld import pvec_round_epsilon

        delta_claim = plan["delta"] / plan["rounds"]
        return float(pvec_round_epsilon(params, event.contributors, delta_claim)), delta_claim

    def params(self, plan: dict[str, Any]) -> PvecParams:
        return PvecParams(**plan["params"])

    def spec_fields(
        self, plan: dict[str, Any], params: PvecParams, event: Any, analyzer_public_key: bytes
    ) -> dict[str, Any]:
        """The RoundSpec fields this protocol owns."""
        eps_r, delta_r = self.per_user_claim(plan, params, event)
        bits = plan["transport"] == "bits"
        split = plan.get("aggregation") == "prio3"
        return {
            "trust_model": self.trust_model,
            "transport": pb.BITS if bits else pb.PRIO3 if split else pb.COUNTS,
            "randomizer": pb.RandomizerSpec(
                protocol=self.name,
                clip_norm=params.delta2,
                dim=params.d,
                g=params.g,
                m=params.m,
                p=params.p,
                messages_per_user=params.messages_per_user if bits else params.d,
                message_bytes=sealing.BIT_MESSAGE_BYTES if bits else 0,
                extra={"eps": params.eps, "delta": params.delta, "n": float(params.n)},
            ),
            "per_user_cost": pb.PrivacyCost(
                eps=eps_r, delta=delta_r, accountant=f"pvec-{params.method}", trust_model=self.trust_model
            ),
            "analyzer_public_key": analyzer_public_key if bits or split else b"",
            "check_in": pb.CheckIn(**plan["check_in"]) if plan.get("check_in") else None,
            "prio3": pb.Prio3Spec(vdaf=plan["prio3_vdaf"]) if split else None,
        }

    def decode(
        self, batch: pb.ShuffledBatch, n: int, plan: dict[str, Any], params: PvecParams, private_key: Any, info: bytes
    ) -> Decoded:
        """The released batch of n contributors (n in [n_min, cohort], checked by the caller), decoded."""
        if plan["transport"] != "bits":
            total = pvec.decode_counts(np.asarray(batch.label_totals, dtype=np.int64), n, params)
            return Decoded(total, n, n, dict(batch.report.rejected))
        return self._decode_bits(batch, n, plan, params, private_key, info)

    def _decode_bits(self, batch, n, plan, params: PvecParams, private_key, info: bytes) -> Decoded:
        """A released BITS batch: open every ciphertext, skip and count bad ones, decode the rest with their n'.

        Messages cannot be attributed to users (that is the shuffle), so the good messages are decoded only when
        they form whole contributions: n' = good / (d (g + m)) with every label carrying n' (g + m) messages, which
        is what a contributor whose messages all fail (wrong key, stale round, corrupt node) leaves. The batch was
        delivered and opened, so the round is always charged (never released, design 6), with the contributors
        whose messages the analyzer could read: n' when n' >= n_min (cost <= reservation); a round with
        n' < n_min fails like a below-threshold batch (nothing released, no optimizer step) but is committed at
        max(n', 1), which may cost MORE than the reservation: those n' users' messages were read with only n' users'
        noise. Scattered bad messages (labels unbalanced) cannot be decoded without bias: the round fails, charged
        at the contributions certainly intact, max(n - bad, 1) (each bad message spoils at most one contribution).
        """
        per_user = params.messages_per_user
        if len(batch.ciphertexts) != n * per_user:
            # delivered: charged at what the shuffler reported; the run stops
            raise BatchError(n, f"{len(batch.ciphertexts)} bit messages do not match {n} contributors")
        labels, bits, rejected_counter = open_bit_messages(private_key, batch.ciphertexts, info, params.d)
        n_bad = sum(rejected_counter.values())
        rejected = dict(Counter(dict(batch.report.rejected)) + rejected_counter)  # the shuffler's and ours
        n_min = plan["min_contributors"]
        whole = labels.size % per_user == 0
        n_good, total = (labels.size // per_user if whole else 0), None
        if n_good:
            try:
                # also checks every label carries n'(g+m) messages; the estimate is used only if n' >= n_min
                total = pvec.decode_bits(labels, bits, params)
            except ValueError:
                whole, n_good = False, 0
        if total is None or n_good < n_min:
            if whole:
                failure, charged = f"below threshold after rejecting bad messages: {n_good} < {n_min}", max(n_good, 1)
            else:
                failure, charged = "bad messages left incomplete contributions: not decodable", max(n - n_bad, 1)
            return Decoded(None, n_good, charged, rejected, failure)
        return Decoded(total, n_good, n_good, rejected)

    # ------------------------------------------------------------------------------------ ledger arithmetic
    # Events are the ledger's PrivacyEvent (mechanism "pvec", params = PvecParams fields, contributors, schedule).
    def accountant_name(self, event: Any, composition: str) -> str:
        per_round = "pvec-calibrated" if event.params.get("method") == "calibrated" else "pvec-lemma-3.1+3.3"
        across = {"parallel": "parallel", "rdp": "pld-or-rdp-composition", "advanced": "advanced-composition"}
        return f"{per_round}/{across[composition]}"

    def round_cost(self, event: Any) -> tuple[float, float]:
        """(eps, delta) of one round on its own at the params' delta, for the contributors recorded in the event.

        calibrated: the exact accountant of calibrated_pvec for n' contributors (its noise is Bin(n' m, p), so
        fewer contributors cost more). paper: the params' (eps, delta) (Thm 3.2 / Lemma 3.1 of paper 000), or the
        Lemma chain for n' contributors where that is larger (ledger_accounting's paper accountant).
        """
        delta = float(event.params["delta"])
        return _account([_accounted_round(event, event.schedule, 1.0)], delta, _accountant([event])), delta

    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]:
        """Run total (eps, delta) of the counted rounds under the run's composition rule (services/ledger.py):
        ``compose_counts`` of the rounds, each once."""
        return self.compose_counts([(e, 1) for e in events], limit, honest_fraction)

    def compose_counts(
        self, items: Sequence[tuple[Any, int]], limit: Any, honest_fraction: float = 1.0
    ) -> tuple[float, float]:
        """Run total (eps, delta) of rounds given as (event, rounds with it): the total depends on that multiset only,
        so the ledger composes a run of thousands of rounds in one step per distinct event (issue 30 item 4).

        parallel: at the rounds' delta (disjoint cohorts: the max over rounds, spec 000 sec 5); rdp: at the limit's
        delta; advanced: at sum delta_r + delta', so the slack of Dwork-Roth 3.20 is the run's fixed delta'.
        """
        schedule = "sequential" if limit.composition == "parallel" else "fully_interactive"
        rounds: Counter = Counter()  # identical rounds as (round, count): the accountant takes them so
        for e, c in items:
            if c > 0:
                rounds[_accounted_round(e, schedule, honest_fraction)] += c
        if limit.composition == "parallel":
            delta = max(r.target_delta for r in rounds)
        elif limit.composition == "rdp":
            delta = limit.delta
        else:
            # the exact sum of every round's delta_r rounded once (c delta_r is exact as a Fraction): what fsum over
            # the rounds one by one gives, bit for bit
            exact = sum((Fraction(r.target_delta) * c for r, c in rounds.items()), Fraction(0))
            delta = float(exact) + limit.advanced_slack
        if delta >= 1.0:  # the rounds alone spend all of delta: no guarantee
            return math.inf, delta
        acc = "tight" if limit.composition == "rdp" else _accountant([e for e, c in items if c > 0])
        return _account(list(rounds.items()), delta, acc), delta

    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]:
        """No other figure of a PVEC run is reported (its local view is not a guarantee: PVEC is not LDP)."""
        return {}

    def views_counts(self, items: Sequence[tuple[Any, int]], limit: Any) -> dict[str, float]:
        return self.views([], limit)

    # -------------------------------------------------------------------------------------------- client
    def supports(self, spec: pb.RoundSpec) -> bool:
        return spec.transport in (pb.COUNTS, pb.BITS, pb.PRIO3)

    def randomize(
        self,
        spec: pb.RoundSpec,
        G: np.ndarray,
        user_ids: Sequence[str],
        nonces: Sequence[bytes],
        rng: np.random.Generator,
        out: pb.Contribution,
    ) -> None:
        """The users' messages (G: their gradients, in user_ids order): COUNTS as out.columns with the sums of
        groups of users (_put_sums), BITS as one UserMessage per user in out.messages."""
        params = pvec_params_from_spec(spec)
        if spec.transport in (pb.COUNTS, pb.PRIO3):
            _put_sums(out, user_ids, nonces, _round_wire([G], params, rng), params, rng, spec)
            return
        G = pvec.clip_rows(G, params.delta2)  # ||g||_2 <= clip_norm before the shift (spec 000 sec 7 item 7)
        if spec.randomizer.message_bytes not in (0, sealing.BIT_MESSAGE_BYTES):
            raise ValueError(
                f"BITS needs randomizer.message_bytes = {sealing.BIT_MESSAGE_BYTES}, "
                f"got {spec.randomizer.message_bytes}"
            )
        info = sealing.round_info(spec.run_id, spec.round)
        for u, nonce, row in zip(user_ids, nonces, G, strict=True):  # one HPKE seal per labelled bit: per message
            labels, bits = pvec.encode_bits(row, params, rng)
            cts = sealing.seal_many(spec.analyzer_public_key, sealing.pack_labelled_bits(labels, bits), info)
            out.messages.add(user_id=u, nonce=nonce, sealed=pb.SealedMessages(ciphertexts=cts))

    def prepare(
        self, spec: pb.RoundSpec, blocks: Iterable[np.ndarray], rng: np.random.Generator
    ) -> PreparedCounts | None:
        """Check-in rounds in COUNTS (mechanisms/check_in.py): what the users who just checked in can compute before
        the second invitation tells them their m: their rounding (xhat). None: nothing to do (BITS, one invitation,
        a second invitation). blocks: their vectors, consecutive rows at a time (only their xhat are held at once,
        not their floats)."""
        ci = spec.check_in
        if spec.transport not in (pb.COUNTS, pb.PRIO3) or not ci.noise_trials or ci.checked_in:
            return None
        params = pvec_params_from_spec(spec)
        return PreparedCounts(_first_form(spec), _round_wire(blocks, params, rng))

    def randomize_prepared(
        self,
        spec: pb.RoundSpec,
        prepared: PreparedCounts,
        rows: np.ndarray,
        user_ids: Sequence[str],
        nonces: Sequence[bytes],
        rng: np.random.Generator,
        out: pb.Contribution,
    ) -> bool:
        """randomize for a check-in's second invitation from prepare's rounding (rows: each user's row in it): the
        users' sums with the noise of this spec's m, exactly as randomize makes them. False, with nothing drawn or
        written, when the rounding does not fit this spec: another round, model or parameters."""
        ci = spec.check_in
        if spec.transport not in (pb.COUNTS, pb.PRIO3) or not ci.checked_in or _first_form(spec) != prepared.first:
            return False
        xhat = prepared.xhat if np.array_equal(rows, np.arange(prepared.xhat.shape[0])) else prepared.xhat[rows]
        _put_sums(out, user_ids, nonces, xhat, pvec_params_from_spec(spec), rng, spec)
        return True

    def verify_epsilon(self, spec: pb.RoundSpec) -> float:
        """The eps of this round's randomizer for one user, recomputed from its parameters (not the claim):
        the calibrated numerical accountant on (d, g, m, p) at n' = release_floor(spec), the fewest contributors
        the shuffler will release (the worst case of the shuffle amplification), and the claimed delta."""
        from shuffledp.accountants.pvec_pld import pvec_round_epsilon  # H3 (issue 4 contract); the ledger's

        n_release = release_floor(spec)
        return float(pvec_round_epsilon(pvec_params_from_spec(spec), n_release, float(spec.per_user_cost.delta)))

    def noise_key(self, spec: pb.RoundSpec):
        """The round's round_noise_key (what its RDP depends on) at n' = release_floor(spec); None if invalid."""
        from shuffledp.accountants.calibrated_pvec import round_noise_key

        try:
            return round_noise_key(pvec_params_from_spec(spec), release_floor(spec))
        except ValueError:
            return None
