"""Per-user privacy policy, enforced on the client (design 6 "defence in depth"; issue 4 item 5).

Every logical user decides for itself whether to join a round, from the RoundSpec alone:
- the trust model and transport must be ones the user accepts (COUNTS shows the user's noisy counts to the
  shuffler, design 5.2, so a user may refuse it: require_split_trust refuses it with its own reason, PRIO3 passes);
- the round's claimed per-user cost (PrivacyCost) must be within the user's per-round limits;
- the randomizer itself must be no weaker than the user's per-round eps: for PVEC the user recomputes the
  round's eps from (g, m, p) with the numerical accountant at n' = min_contributors, the fewest contributors
  the shuffler will ever release (the worst case for the shuffle amplification), instead of trusting the claim;
- the user's total spend after the round must stay within its limits, by either of two valid upper bounds:
  basic composition of the per-round (eps, delta) (Dwork-Roth Thm 3.16), each round charged at the larger of the
  analyzer's claim and the eps the user verified itself (issue 10 item 2; sums rounded up), or, for a user whose
  every round was a verified PVEC round, composition of those rounds with the ledger's own accountant
  (pvec_pld.epsilon_of_rounds: the tighter of RDP and PLD, from the user's history of round_noise_keys) at
  delta = max_total_delta:
  the same tight arithmetic the analyzer's ledger uses (issue 10), computed from what the user verified;
- for a protocol whose rounds compose per run (protocols.base.UserAccount: sampled central DP-SGD, DP-FTRL), the
  user's cost for the run is computed from its own counts in the run (rounds eligible for, rounds joined, leaves
  per tree), never a per-round share (issue 24 items 1-2). A user of a sampled protocol is counted in every round it
  is eligible for (the shuffler tells every node of every such round), and withdraws from the run, refusing every
  later invitation and counting nothing more, as soon as one more round could take it past its limits: what it
  paid never exceeds them. The shuffler's eligible count must not be below the rate the spec is accounted at.

Decisions are vectorized over the node's invited users (one numpy pass, no per-user Python loop), except a per-run
round's totals (decide_in_run): one Python step per user, its cost memoised per distinct counts.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shuffledp.accountants.calibrated_pvec import NoiseKey
from shuffledp.accountants.pvec_pld import epsilon_of_rounds
from shuffledp.config import PolicyConfig
from shuffledp.durable import INTEGER_LIMIT
from shuffledp.protocols.base import UserAccount
from shuffledp.protocols.pvec_round import pvec_params_from_spec
from shuffledp.protocols.registry import PROTOCOL_NAMES, known_protocol, round_protocol
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = [
    "UserPolicy",
    "PolicyTable",
    "Histories",
    "Refusal",
    "pvec_params_from_spec",
    "verify_round_epsilon",
    "noise_key",
    "sum_up",
    "TRUST_NAMES",
    "TRANSPORT_NAMES",
]

TRUST_NAMES = {pb.SHUFFLE: "shuffle", pb.LOCAL: "local", pb.CENTRAL: "central"}
TRANSPORT_NAMES = {pb.COUNTS: "counts", pb.BITS: "bits", pb.SEALED: "sealed", pb.PRIO3: "prio3"}
# transports whose messages the shuffler reads (design 5.2): what require_split_trust refuses
SHUFFLER_VISIBLE = frozenset({pb.COUNTS})


class Refusal:
    """Refusal reasons (Contribution.refusals[].reason, NodeStatus.refusals keys). A reason that comes from a
    limit names its [policy] key, so the operator reads in the progress line which limit to raise."""

    TRUST_MODEL = "trust_model_not_allowed"
    TRANSPORT = "transport_not_allowed"
    # [policy] require_split_trust: the round's transport shows the shuffler the user's counts (COUNTS)
    SPLIT_TRUST = "transport_visible_to_shuffler_require_split_trust"
    PROTOCOL = "protocol_not_supported"
    PROTOCOL_NOT_ALLOWED = "protocol_not_in_allowed_protocols"
    INVALID_SPEC = "invalid_round_spec"
    ROUND_EPS = "round_eps_above_max_eps_per_round"
    ROUND_DELTA = "round_delta_above_max_delta_per_round"
    WEAK_RANDOMIZER = "verified_eps_above_max_eps_per_round"
    UNVERIFIABLE = "randomizer_unverifiable"
    TOTAL_EPS = "total_eps_above_max_total_eps"
    TOTAL_DELTA = "total_delta_above_max_total_delta"
    # the shuffler drew the cohort from fewer users than the round's accountant assumes (a higher sampling rate)
    POPULATION = "eligible_below_accounted_population"
    PARTICIPATION = "participation_limit_exceeded"  # the user's own record: more leaves in a tree, or too close
    # a per-run round whose public parameters differ from the run's earlier rounds: its counts would be costed at
    # parameters that did not hold for them (e.g. a larger noise multiplier claimed later lowers every past round)
    RUN_CHANGED = "run_parameters_changed"
    # the round's model (RoundSpec.model_name / model_digest) is not the one installed on the node: its definition or
    # parameter layout differs, so the node would compute gradients of another function (issue 26 item 3)
    MODEL_DIFFERS = "model_digest_differs"
    # a round of a run the node has taken already (a repeated invitation, or one after that round's eligibility was
    # counted): a run's rounds compose per round, so a second answer would release the user's data once more than
    # its counts show, and a join whose round was not counted eligible would escape the amplified accountant's count
    ROUND_ANSWERED = "round_already_answered"


@dataclass(frozen=True)
class UserPolicy:
    """One user's limits (a run configuration's [policy] section gives them to every user of a node). Defaults
    accept the embedded default run (eps = 8 in total over PVEC count mode) and refuse what no practitioner would
    accept (eps > 8 in one round)."""

    # the numbers' defaults are the run configuration's [policy] defaults (one source)
    max_eps_per_round: float = PolicyConfig.max_eps_per_round
    max_delta_per_round: float = PolicyConfig.max_delta_per_round
    max_total_eps: float = PolicyConfig.max_total_eps  # basic composition of per-round costs (an upper bound)
    max_total_delta: float = PolicyConfig.max_total_delta
    allowed_trust_models: frozenset[str] = frozenset({"shuffle", "local", "central"})
    allowed_transports: frozenset[str] = frozenset({"counts", "bits", "sealed", "prio3"})  # drop "counts" to refuse it
    require_split_trust: bool = PolicyConfig.require_split_trust  # refuse SHUFFLER_VISIBLE transports (issue 45)
    # the round protocols (randomizers) this user runs; empty = every protocol its node knows (design 6)
    allowed_protocols: frozenset[str] = frozenset()
    verify_randomizer: bool = True  # recompute the randomizer's eps rather than trust PrivacyCost

    def __post_init__(self) -> None:
        for name in ("max_eps_per_round", "max_total_eps"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v >= 0 and not math.isnan(v)):
                raise ValueError(f"{name} must be a number >= 0 (inf allowed), got {v!r}")
        for name in ("max_delta_per_round", "max_total_delta"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and 0.0 <= v <= 1.0):
                raise ValueError(f"{name} must lie in [0, 1], got {v!r}")
        bad = set(self.allowed_trust_models) - set(TRUST_NAMES.values())
        if bad:
            raise ValueError(
                f"allowed_trust_models has unknown names {sorted(bad)}; allowed: {sorted(TRUST_NAMES.values())}"
            )
        bad = set(self.allowed_protocols) - set(PROTOCOL_NAMES)
        if bad:
            raise ValueError(f"allowed_protocols has unknown names {sorted(bad)}; known: {sorted(PROTOCOL_NAMES)}")
        bad = set(self.allowed_transports) - set(TRANSPORT_NAMES.values())
        if bad:
            raise ValueError(
                f"allowed_transports has unknown names {sorted(bad)}; allowed: {sorted(TRANSPORT_NAMES.values())}"
            )


def verify_round_epsilon(spec: pb.RoundSpec) -> float:
    """The eps of this round's randomizer for one user, recomputed from its parameters (not the claim), by the
    round protocol's plug-in (PVEC: the calibrated numerical accountant on (d, g, m, p) at n' = min_contributors,
    the worst case of the shuffle amplification, shuffledp.protocols.pvec_round). Raises LookupError when the
    protocol is unknown here, ValueError when the parameters are invalid, ImportError when the accountant is missing.
    """
    return round_protocol(spec.randomizer.protocol).verify_epsilon(spec)


def noise_key(spec: pb.RoundSpec) -> NoiseKey | None:
    """The round's noise key (what its RDP depends on), as verify_round_epsilon sees the round; None when the
    round has none (unknown protocol, or invalid parameters)."""
    protocol = known_protocol(spec.randomizer.protocol)
    return None if protocol is None else protocol.noise_key(spec)


History = Counter | None  # round_noise_key -> rounds joined; None: some round has no key (basic composition only)


class Histories:
    """Every user's History, as one int32 per user into a table of the distinct histories: users with equal histories
    share one entry (a fully interactive run gives all its users the same one), where a Counter per user cost ~250
    bytes each (issue 30 item 3). Reading a user's history gives a fresh Counter (or None); it changes only through
    __setitem__, add and clear."""

    def __init__(self, num_users: int, entries: Iterable[Mapping | None] | None = None) -> None:
        self._table: list[tuple | None] = [()]  # entry 0: the empty history
        self._index: dict[tuple | None, int] = {(): 0}
        self._of = np.zeros(num_users, dtype=np.int32)
        self._limit = 64  # table entries before the next _compact
        if entries is not None:
            n = 0
            for u, h in enumerate(entries):
                if u < num_users:
                    self[u] = h
                n += 1
            if n != num_users:
                raise ValueError(f"history must hold {num_users} entries, got {n}")

    @staticmethod
    def _frozen(h: Mapping | None) -> tuple | None:
        return None if h is None else tuple(sorted((k, v) for k, v in h.items() if v))

    def _intern(self, frozen: tuple | None) -> int:
        i = self._index.get(frozen)
        if i is None:
            i = self._index[frozen] = len(self._table)
            self._table.append(frozen)
        return i

    def __len__(self) -> int:
        return self._of.size

    def __getitem__(self, u: int) -> Counter | None:
        h = self._table[self._of[u]]
        return None if h is None else Counter(dict(h))

    def __setitem__(self, u: int, h: Mapping | None) -> None:
        self._of[u] = self._intern(self._frozen(h))

    def __iter__(self) -> Iterator[Counter | None]:
        return (self[u] for u in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Histories | Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # mutable

    def ids(self, users: np.ndarray) -> np.ndarray:
        """Each user's entry in the table of distinct histories: users with equal ids have equal histories."""
        return self._of[users]

    def frozen(self, u: int) -> tuple | None:
        """User u's history as sorted (key, count) pairs (None: basic composition only), shared, not copied."""
        return self._table[self._of[u]]

    def add(self, users: np.ndarray, key: tuple) -> None:
        """One more round `key` for each of `users` (distinct indices); a None history stays None."""
        users = np.asarray(users, dtype=np.int64)
        if not users.size:
            return
        ids, inverse = np.unique(self._of[users], return_inverse=True)
        new = np.empty(ids.size, dtype=np.int32)
        for j, i in enumerate(ids.tolist()):
            h = self._table[i]
            if h is None:
                new[j] = i
            else:
                c = Counter(dict(h))
                c[key] += 1
                new[j] = self._intern(self._frozen(c))
        self._of[users] = new[inverse]
        self._compact()

    def clear(self, users: np.ndarray) -> None:
        """Basic composition only from now on for `users` (their history becomes None)."""
        self._of[np.asarray(users, dtype=np.int64)] = self._intern(None)
        self._compact()

    def _compact(self) -> None:
        """Drop the entries no user holds any more once the table doubled since the last time: its size stays
        bounded by the users' distinct histories, whatever the number of rounds (amortized O(1) per change)."""
        if len(self._table) <= self._limit:
            return
        used, inverse = np.unique(self._of, return_inverse=True)
        self._of[:] = inverse
        self._table = [self._table[i] for i in used.tolist()]
        self._index = {h: i for i, h in enumerate(self._table)}
        self._limit = 2 * len(self._table) + 64


def run_parameters(spec: pb.RoundSpec) -> tuple:
    """A per-run round's public parameters (RunTable.parameters): its randomizer's extra fields, sampling rate and
    population; every round of a run must state the same (Refusal.RUN_CHANGED)."""
    return tuple(sorted(spec.randomizer.extra.items())), spec.sampling_rate, spec.population


def parameters_to_json(parameters: tuple) -> str:
    extra, rate, population = parameters
    return json.dumps([[[k, v] for k, v in extra], rate, population])


def parameters_from_json(text: str) -> tuple:
    """The tuple run_parameters made (floats round-trip exactly through JSON)."""
    extra, rate, population = json.loads(text)
    return tuple((str(k), float(v)) for k, v in extra), float(rate), int(population)


@dataclass
class RunTable:
    """A run's per-user counts (UserAccount), what each user has paid for the run, and who withdrew from it."""

    counts: dict[int, Counter]
    paid_eps: np.ndarray
    paid_delta: np.ndarray
    withdrawn: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # per user, the last round of the run it was charged in (joined, or counted eligible), -1 for none
    last_round: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    counted_round: int = -1  # the last round whose eligibility was counted (each round once)
    # the run's public parameters, fixed by its first round (kept in the node's spend store: also after a restart)
    parameters: tuple | None = None


@dataclass(frozen=True)
class RunCharge:
    """One round's charges in a run (PolicyTable.decide_in_run), applied by PolicyTable.apply_run once recorded."""

    run: str
    round: int
    counted: bool  # the round's eligibility was counted
    parameters: tuple  # the round's public parameters (RunTable.parameters)
    users: np.ndarray  # user indices whose counts change
    steps: list[str]  # per user: the counts the round adds, comma-separated
    eps: np.ndarray  # per user: what it pays now (its run cost minus what it paid for the run), >= 0
    delta: np.ndarray
    withdraw: np.ndarray  # user indices that withdraw from the run


class PolicyTable:
    """The policies of a node's users as arrays, for vectorized decisions, plus each user's running spend."""

    def __init__(
        self,
        policies: UserPolicy | Sequence[UserPolicy],
        num_users: int,
        verifier: Callable[[pb.RoundSpec], float] = verify_round_epsilon,
        spent: tuple[np.ndarray, np.ndarray] | None = None,
        history: Histories | Sequence[Counter | None] | None = None,
    ) -> None:
        if not isinstance(policies, UserPolicy) and len(policies) != num_users:
            raise ValueError(f"policies must be one UserPolicy or one per user ({num_users}), got {len(policies)}")
        self._verifier = verifier
        if not isinstance(policies, UserPolicy) and policies and all(p is policies[0] for p in policies):
            policies = policies[0]

        def column(get: Callable[[UserPolicy], Any], dtype: type) -> np.ndarray:
            """One field of every user's policy; read-only, and no memory per user when they share one policy."""
            if isinstance(policies, UserPolicy):
                return np.broadcast_to(np.asarray(get(policies), dtype=dtype), (num_users,))
            return np.array([get(p) for p in policies], dtype=dtype).reshape(num_users)

        for f in ("max_eps_per_round", "max_delta_per_round", "max_total_eps", "max_total_delta"):
            setattr(self, f, column(lambda p, f=f: getattr(p, f), np.float64))
        self.verify = column(lambda p: p.verify_randomizer, bool)
        self.trust_ok = {
            t: column(lambda p, n=name: n in p.allowed_trust_models, bool) for t, name in TRUST_NAMES.items()
        }
        self.transport_ok = {
            t: column(lambda p, n=name: n in p.allowed_transports, bool) for t, name in TRANSPORT_NAMES.items()
        }
        self.split_trust = column(lambda p: p.require_split_trust, bool)
        self.protocol_ok = {
            name: column(lambda p, n=name: not p.allowed_protocols or n in p.allowed_protocols, bool)
            for name in PROTOCOL_NAMES
        }
        if spent is None:
            self.eps_spent, self.delta_spent = np.zeros(num_users), np.zeros(num_users)
        else:  # what the users spent before this process (the node's spend store)
            self.eps_spent, self.delta_spent = (np.array(a, dtype=np.float64) for a in spent)
            if self.eps_spent.shape != (num_users,) or self.delta_spent.shape != (num_users,):
                raise ValueError(f"spent must hold {num_users} values each")
        # each user's verified PVEC rounds (round_noise_key -> count); None: some round was not, basic only
        if isinstance(history, Histories):  # the node's spend store replays into this form: taken as it is
            if len(history) != num_users:
                raise ValueError(f"history must hold {num_users} entries")
            self.history = history
        else:
            self.history = Histories(num_users, history)
        self.runs: dict[str, RunTable] = {}  # per-run accounts (UserAccount), loaded by the node from its store

    def _static(
        self, spec: pb.RoundSpec, idx: np.ndarray, supported: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The checks of one round alone, before any total: (reason per user, "" = passes; eps each is charged
        under basic composition: the claim, raised to what it verified; whether its round was verified)."""
        out = np.full(idx.size, "", dtype=object)

        def refuse(mask: np.ndarray, reason: str) -> None:
            out[(out == "") & mask] = reason

        none = np.zeros(idx.size, dtype=bool)
        nobody = np.zeros(self.verify.size, dtype=bool)  # an unknown trust model or transport: no user allows it
        refuse(~self.trust_ok.get(spec.trust_model, nobody)[idx], Refusal.TRUST_MODEL)
        refuse(~self.transport_ok.get(spec.transport, nobody)[idx], Refusal.TRANSPORT)
        if spec.transport in SHUFFLER_VISIBLE:
            refuse(self.split_trust[idx], Refusal.SPLIT_TRUST)
        if not supported:
            refuse(~none, Refusal.PROTOCOL)
        refuse(~self.protocol_ok.get(spec.randomizer.protocol, nobody)[idx], Refusal.PROTOCOL_NOT_ALLOWED)
        eps, delta = float(spec.per_user_cost.eps), float(spec.per_user_cost.delta)
        cost = np.full(idx.size, eps)
        tight = np.zeros(idx.size, dtype=bool)  # users whose round is verified: RDP composition applies
        if not (math.isfinite(eps) and eps >= 0.0 and 0.0 <= delta <= 1.0):
            refuse(~none, Refusal.INVALID_SPEC)  # a missing or negative cost is never "free"
            return out, cost, tight
        refuse(eps > self.max_eps_per_round[idx], Refusal.ROUND_EPS)
        refuse(delta > self.max_delta_per_round[idx], Refusal.ROUND_DELTA)
        need = self.verify[idx] & (out == "")
        if np.any(need):
            try:
                verified = float(self._verifier(spec))
            except (LookupError, ValueError, ImportError):
                refuse(need, Refusal.UNVERIFIABLE)  # what cannot be checked is not trusted
            else:
                if not verified >= 0.0:  # nan or negative: not a privacy guarantee
                    refuse(need, Refusal.UNVERIFIABLE)
                else:
                    # what this user pays is what it verified, whatever the analyzer claims (issue 10 item 2)
                    cost[need] = max(eps, verified)
                    tight = need.copy()
                refuse(need & (verified > self.max_eps_per_round[idx]), Refusal.WEAK_RANDOMIZER)
        return out, cost, tight

    def decide(self, spec: pb.RoundSpec, idx: np.ndarray, supported: bool) -> tuple[np.ndarray, np.ndarray]:
        """(refusal reason per invited user as an object array, "" = join; eps each user is charged if it joins).

        idx: the users' indices on this node. The charge is the claimed eps, raised to the eps the user verified
        itself from the randomizer's parameters when its policy verifies (never less than either).
        """
        idx = np.asarray(idx, dtype=np.int64)
        out, cost, tight = self._static(spec, idx, supported)
        delta = float(spec.per_user_cost.delta)
        if not (np.isfinite(cost).all() and 0.0 <= delta <= 1.0):
            return out, cost  # every user refused it as invalid_round_spec

        def refuse(mask: np.ndarray, reason: str) -> None:
            out[(out == "") & mask] = reason

        eps_ok = sum_up(self.eps_spent[idx], cost) <= self.max_total_eps[idx]
        basic_ok = eps_ok & (sum_up(self.delta_spent[idx], delta) <= self.max_total_delta[idx])
        key = noise_key(spec)
        check = (out == "") & ~basic_ok & tight
        if key is not None and np.any(check):
            basic_ok[check] = self._tight_ok(idx[check], key)
        refuse(~basic_ok & ~eps_ok, Refusal.TOTAL_EPS)
        refuse(~basic_ok, Refusal.TOTAL_DELTA)
        return out, cost

    # ----- rounds of a protocol whose cost composes per run (UserAccount) -------------------------------------
    def run_table(self, run: str) -> RunTable:
        table = self.runs.get(run)
        if table is None:
            n = self.verify.size
            table = self.runs[run] = RunTable({}, np.zeros(n), np.zeros(n))
        if table.withdrawn.size != self.verify.size:
            table.withdrawn = np.zeros(self.verify.size, dtype=bool)
        if table.last_round.size != self.verify.size:
            table.last_round = np.full(self.verify.size, -1, dtype=np.int64)
        return table

    def decide_in_run(
        self, spec: pb.RoundSpec, account: UserAccount, idx: np.ndarray, supported: bool, join_allowed: bool = True
    ) -> tuple[np.ndarray, RunCharge]:
        """(refusal reason per invited user, "" = join; the round's charges in the run). Changes nothing: the node
        records the charges durably, then applies them (apply_run).

        A user joins when its cost for the run with this round joined stays within its limits (and its own record
        of the run keeps the protocol's participation limits). When the protocol counts eligibility, every user of
        the node that passes the round's own checks and has not withdrawn is counted eligible, invited or not, once
        per round; a user for whom one more eligible round and a join would not fit withdraws (is not counted, and
        refuses this and every later round of the run), so that what it is charged never exceeds its limits."""
        idx = np.asarray(idx, dtype=np.int64)
        table = self.run_table(account.run)
        parameters = run_parameters(spec)
        changed, round_index = table.parameters not in (None, parameters), int(spec.round)
        if changed or not 0 <= round_index < INTEGER_LIMIT:  # the spend log stores the round
            nothing = np.array([], dtype=np.int64)
            empty = RunCharge(account.run, round_index, False, table.parameters, nothing, [], *[nothing] * 3)
            why = Refusal.RUN_CHANGED if changed else Refusal.INVALID_SPEC
            return np.full(idx.size, why, dtype=object), empty
        counting = account.eligible is not None and round_index > table.counted_round
        candidates = np.arange(self.verify.size) if counting else idx
        static, _, _ = self._static(spec, candidates, supported)
        reasons = dict(zip(candidates.tolist(), static.tolist(), strict=True))  # "" = passes the round's checks
        invited = set(idx.tolist())
        memo: dict[tuple, tuple[float, float]] = {}

        def cost(c: Counter) -> tuple[float, float]:
            key = tuple(sorted((k, v) for k, v in c.items() if v))
            if key not in memo:
                memo[key] = account.cost(key)
            return memo[key]

        def due(u: int, c: Counter) -> tuple[float, float, str]:
            """(eps, delta) user u pays now for the run at counts c, and the limit it would break ("" = none)."""
            e, d = cost(c)
            pay_e, pay_d = _owed(e, table.paid_eps[u]), _owed(d, table.paid_delta[u])
            if not sum_up(self.eps_spent[u], pay_e) <= self.max_total_eps[u]:
                return pay_e, pay_d, Refusal.TOTAL_EPS
            if not sum_up(self.delta_spent[u], pay_d) <= self.max_total_delta[u]:
                return pay_e, pay_d, Refusal.TOTAL_DELTA
            return pay_e, pay_d, ""

        users, steps, pay_eps, pay_delta, withdraw = [], [], [], [], []
        for u in candidates.tolist():
            if reasons[u]:
                continue
            if table.withdrawn[u]:
                reasons[u] = Refusal.TOTAL_EPS  # withdrew when one more round could not fit
                continue
            if u in invited and (table.last_round[u] >= round_index or (account.eligible and not counting)):
                # one answer per user and round, whatever the shuffler sends; and where eligibility is counted, a
                # join only with this round's eligibility in the same charge (a round counted before, by a notice
                # this user refused, must not let it join uncounted: it would pay nothing)
                reasons[u] = Refusal.ROUND_ANSWERED
                continue
            c = table.counts.get(u, Counter())
            full = c + Counter([account.join] + ([account.eligible] if counting else []))
            why = "" if account.allows(tuple(sorted(full.items()))) else Refusal.PARTICIPATION
            if not why:
                why = due(u, full)[2]
            if why:
                reasons[u] = why
                if counting:
                    withdraw.append(u)
                continue
            step = [account.eligible] if counting else []
            if u in invited and join_allowed:
                step.append(account.join)
            if step:
                e, d, _ = due(u, c + Counter(step))
                users.append(u)
                steps.append(",".join(step))
                pay_eps.append(e)
                pay_delta.append(d)
        out = np.array([reasons[u] for u in idx.tolist()], dtype=object)
        charge = RunCharge(
            account.run,
            round_index,
            counting,
            parameters,
            np.array(users, dtype=np.int64),
            steps,
            np.array(pay_eps, dtype=np.float64),
            np.array(pay_delta, dtype=np.float64),
            np.array(withdraw, dtype=np.int64),
        )
        return out, charge

    def apply_run(self, charge: RunCharge) -> None:
        """Apply a recorded RunCharge: the users' counts, what they paid (rounded up, as the store replays it), their
        totals, and withdrawals. A user charged a positive amount leaves RDP composition (history None)."""
        table = self.run_table(charge.run)
        for u, step, e, d in zip(charge.users.tolist(), charge.steps, charge.eps, charge.delta, strict=True):
            table.counts.setdefault(u, Counter()).update(step.split(","))
            if e > 0.0 or d > 0.0:
                self.history[u] = None
        ix = charge.users
        if ix.size:  # (a refused round's empty charge may carry a round no int64 holds)
            table.last_round[ix] = np.maximum(table.last_round[ix], charge.round)
        table.paid_eps[ix] = sum_up(table.paid_eps[ix], charge.eps)
        table.paid_delta[ix] = sum_up(table.paid_delta[ix], charge.delta)
        self.eps_spent[ix] = sum_up(self.eps_spent[ix], charge.eps)
        self.delta_spent[ix] = sum_up(self.delta_spent[ix], charge.delta)
        table.withdrawn[charge.withdraw] = True
        table.parameters = charge.parameters
        if charge.counted and charge.users.size:  # a round that counted no user is not counted
            table.counted_round = max(table.counted_round, charge.round)

    def _tight_ok(self, users: np.ndarray, key: NoiseKey) -> np.ndarray:
        """Whether each user's RDP-composed spend with one more round `key`, at delta = its max_total_delta, stays
        within its max_total_eps. Users with equal histories and limits share one evaluation (fully interactive
        runs: one per round), found by array operations: no Python step per user."""
        hist, delta = self.history.ids(users), self.max_total_delta[users]
        _, at_h = np.unique(hist, return_inverse=True)
        deltas, at_d = np.unique(delta, return_inverse=True)
        groups, first, at = np.unique(at_h * deltas.size + at_d, return_index=True, return_inverse=True)
        eps = np.full(groups.size, math.inf)
        for j, (u, dlt) in enumerate(zip(users[first].tolist(), delta[first].tolist(), strict=True)):
            h = self.history.frozen(u)
            if h is not None and dlt > 0.0:  # None: joined a round without a noise key, basic composition only
                after = Counter(dict(h))
                after[key] += 1
                eps[j] = epsilon_of_rounds(after, dlt)
        return eps[at.reshape(-1)] <= self.max_total_eps[users]

    def tight_spent(self, u: int) -> float:
        """User u's RDP-composed eps at its max_total_delta (inf if it cannot be accounted so)."""
        h, dlt = self.history[u], float(self.max_total_delta[u])
        return math.inf if h is None or dlt <= 0.0 else epsilon_of_rounds(h, dlt)

    def charge(
        self, idx: np.ndarray, eps: np.ndarray | float, delta: float, key: NoiseKey | None = None
    ) -> list[NoiseKey | None]:
        """Add a round's cost (eps per user, as decide() returned it) to the users who sent a message (basic
        composition, Dwork-Roth Thm 3.16), and the round's noise_key to the history of those who verified it.
        idx holds distinct indices (one message per user per round). Returns the key recorded per user."""
        idx = np.asarray(idx, dtype=np.int64)
        self.eps_spent[idx] = sum_up(self.eps_spent[idx], eps)
        self.delta_spent[idx] = sum_up(self.delta_spent[idx], delta)
        # a round only trusted, not verified, has no place in RDP: that user's history becomes None (and stays so)
        verified = self.verify[idx] if key is not None else np.zeros(idx.size, dtype=bool)
        self.history.clear(idx[~verified])
        self.history.add(idx[verified], key)
        if verified.all():
            return [key] * idx.size
        return [key if v else None for v in verified.tolist()]


def _owed(cost: float, paid: float) -> float:
    """What to add to `paid` so that the rounded-up sum covers `cost` (0 when it does already)."""
    owe = max(0.0, cost - float(paid))
    while float(sum_up(paid, owe)) < cost:
        owe = math.nextafter(owe, math.inf)
    return owe


def sum_up(a: np.ndarray, b: np.ndarray | float) -> np.ndarray:
    """a + b rounded up: a spent total is never below the exact sum (float addition rounds to nearest)."""
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    with np.errstate(invalid="ignore"):  # inf operands give nan errors; s is then inf already
        s = a + b
        bb = s - a
        err = (a - (s - bb)) + (b - bb)  # the exact a + b - s (Knuth's TwoSum); > 0 means s rounded down
    return np.where(err > 0, np.nextafter(s, np.inf), s)
