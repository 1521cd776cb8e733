"""The shuffler's domain logic, transport-independent (design sections 1 and 5; issue 4 item 4).

The shuffler is the anonymizer between client nodes and the analyzer. It knows user ids (admission, cohort
selection, participation limits, replay protection) but forwards to the analyzer only what the protocol's
view allows: per-label totals and the number of contributors (COUNTS, design 5.2; spec 000 sec 8 "count mode":
the multiset of per-user counts would reveal more than the sum, so per-user counts are never kept, they are
added into a running total on arrival), or ciphertexts only in a CSPRNG-permuted order (SEALED / BITS, design
5.1). Ids, node names, nonces, arrival times and arrival order never leave this class.

ShufflerState runs a round (select, invite, collect, threshold, shuffle) over four parts, one concern each (issue
47), all under its one lock:
- shuffler_admission.Admission: node identities, their admitted users, their open streams;
- shuffler_selection.Selection: who is invited to a round;
- shuffler_checks: the round request's validation and every message's checks, counted per reason (design 5.3);
- participation.ParticipationStore: the durable record of who took part (in memory or SQLite, one interface).
The vocabulary (requests, submissions, results, reasons, errors) is in shuffler_types. Randomness (cohorts,
permutation) comes from an injected CSPRNG Generator (shuffledp.security.rng), time from an injected clock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from shuffledp.services.participation import (
    MemoryParticipationStore,
    ParticipationStore,
    SqliteParticipationStore,
    TreeLimits,
)
from shuffledp.services.shuffler_admission import (
    Admission,
    NodeUserIds,
    Subscription,
    by_node,
    check_id,
    split_user_key,
    user_key,
    user_keys,
)
from shuffledp.services.shuffler_checks import CHECK_IN, Checks, check_batch_size, refusal_reason, validate_request
from shuffledp.services.shuffler_selection import Selected, Selection
from shuffledp.services.shuffler_types import (
    MAX_USERS_PER_NODE,
    NONCE_MAX_BYTES,
    NONCE_MIN_BYTES,
    PAYLOAD_REASONS,
    RECENT_CLOSED_ROUNDS,
    Ack,
    Aggregate,
    BatchResult,
    CallerGone,
    CohortUnavailable,
    Invite,
    NonceSet,
    OpenRound,
    Population,
    QuotaExceeded,
    Reason,
    RoundExistsError,
    RoundRejected,
    RoundRequest,
    Schedule,
    ShufflerError,
    Submission,
    Transport,
    UserColumns,
    UserMessage,
)

from shuffledp.mechanisms import check_in
from shuffledp.mechanisms.pvec import count_wire_dtype
from shuffledp.protocols import prio3
from shuffledp.security.rng import make_rng
from shuffledp.security.sealing import ENC_BYTES
from shuffledp.transport.grpc_options import BATCH_MESSAGE_BYTES

__all__ = [
    "Schedule",
    "Transport",
    "Reason",
    "ShufflerError",
    "RoundRejected",
    "RoundExistsError",
    "CohortUnavailable",
    "CallerGone",
    "QuotaExceeded",
    "RoundRequest",
    "TreeLimits",
    "UserMessage",
    "UserColumns",
    "Submission",
    "Ack",
    "BatchResult",
    "Population",
    "Subscription",
    "Invite",
    "NodeUserIds",
    "NonceSet",
    "NONCE_MIN_BYTES",
    "NONCE_MAX_BYTES",
    "ParticipationStore",
    "MemoryParticipationStore",
    "SqliteParticipationStore",
    "ShufflerState",
    "Aggregate",
    "user_key",
    "user_keys",
    "split_user_key",
]


RECENT_RUNS = 64  # PRIO3: runs whose report ids are kept (a replay into an older run fails its proofs anyway)
RECENT_PENDING = 16  # PRIO3: released rounds awaiting FinishAggregation (the oldest is dropped: never aggregated)


@dataclass(frozen=True)
class _Pending:
    """A released PRIO3 round the Leader prepared, until the Helper's prep shares come (FinishAggregation)."""

    vdaf: prio3.Vdaf
    reports: dict[bytes, prio3.LeaderReport]
    min_contributors: int


class ShufflerState:
    """Thread-safe shuffler: admission, cohorts, invitations, collection, validation, threshold, shuffle."""

    def __init__(
        self,
        store: ParticipationStore | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: np.random.Generator | None = None,
        max_deadline_seconds: float = 3600.0,
        poll_seconds: float = 0.05,
        max_users_per_node: int = MAX_USERS_PER_NODE,
        max_streams: int = 48,
        max_batch_bytes: int = BATCH_MESSAGE_BYTES,
    ) -> None:
        self._store = store if store is not None else MemoryParticipationStore()
        self._clock = clock
        self._rng = rng if rng is not None else make_rng()
        self._max_deadline = float(max_deadline_seconds)
        self._poll = float(poll_seconds)
        self._max_batch_bytes = int(max_batch_bytes)
        self._lock = threading.Condition()
        self._admission = Admission(self._lock, max_users_per_node, max_streams)
        self._admitted = self._admission.admitted  # user key -> the one key object (shared, read here)
        self._subs = self._admission.subs  # node -> its open stream (shared, read here)
        self._selection = Selection(self._admission, self._store, self._rng)
        self._fresh = self._selection.fresh
        self._counters: Counter = Counter()
        self._checks = Checks(self._admitted, self._counters)
        self._open: dict[tuple[str, int], OpenRound] = {}
        # PRIO3: per run (the latest RECENT_RUNS), the report ids seen (a replayed id is refused in any later round)
        self._report_ids: OrderedDict[str, set[bytes]] = OrderedDict()
        # PRIO3: released rounds awaiting the Helper's prep shares (FinishAggregation), oldest first
        self._pending: OrderedDict[tuple[str, int], _Pending] = OrderedDict()
        # recently closed rounds, to tell a late message (expired) from a wrong one; bounded, so that the shuffler's
        # memory does not grow with the rounds it ran (a round is never executed twice: the durable record says so)
        self._closed: OrderedDict[tuple[str, int], None] = OrderedDict()
        # observer of each executed round (shuffledp/observability/metrics.py): its batch and its phases' durations in
        # seconds
        self.on_round: Callable[[BatchResult, dict[str, float]], None] | None = None

    # ----- nodes (shuffler_admission) --------------------------------------------------------------------------
    def register_users(self, node_id: str, user_ids: Sequence[str]) -> tuple[int, int]:
        """Admit the node's users (Admission.register_users): (users of this request now admitted, total)."""
        return self._admission.register_users(node_id, user_ids)

    def set_max_streams(self, n: int) -> None:
        """How many nodes may hold an invitation stream at once (the server's threads for them)."""
        self._admission.set_max_streams(n)

    def subscribe(self, node_id: str, make: Callable[[str], Subscription] = Subscription) -> Subscription:
        """Open the node's invitation stream (Admission.subscribe); a previous stream of the same node is closed."""
        return self._admission.subscribe(node_id, make)

    def unsubscribe(self, sub: Subscription) -> None:
        self._admission.unsubscribe(sub)

    def node_summary(self) -> dict[str, tuple[int, bool]]:
        """Per node identity: (its admitted users, whether it holds an invitation stream now). Counts only."""
        return self._admission.node_summary()

    def _eligible_users(self) -> list[str]:
        """Admitted users on nodes with a live subscription, sorted. Caller holds the lock."""
        return self._admission.eligible_users()

    def population(self, run_id: str) -> Population:
        with self._lock:
            return self._selection.population(run_id)

    def counters(self) -> dict[str, int]:
        """Totals since start: rejections per reason, plus accepted / refused."""
        with self._lock:
            return dict(self._counters)

    # ----- rounds ----------------------------------------------------------------------------------------------
    def _validate(self, req: RoundRequest) -> tuple[int, int, int]:
        return validate_request(req, self._max_deadline, self._max_batch_bytes, len(self._admitted))

    def _select(self, req: RoundRequest) -> Selected:
        """Who is invited (Selection.select). Caller holds the lock."""
        return self._selection.select(req)

    def execute_round(self, req: RoundRequest, is_active: Callable[[], bool] = lambda: True) -> BatchResult:
        """Select, invite, collect until the deadline, all invitees answered or the report goal was reached, then
        threshold and shuffle."""
        per_user, ct_len, bound = self._validate(req)
        # COUNTS only: the wire width is part of the validation (a bound no width holds is refused here)
        wire_dtype = count_wire_dtype(bound) if req.transport == Transport.COUNTS else None
        key = (req.run_id, int(req.round))
        t0 = self._clock()
        with self._lock:
            if key in self._open or key in self._closed or self._store.round_exists(*key):
                raise RoundExistsError(f"round {req.round} of run {req.run_id!r} was already executed")
            if not is_active():
                # nobody would receive the batch: selecting a cohort would spend its users' once-per-run slot (and
                # their nodes' budget) for a round the analyzer charges without any use
                raise CallerGone(f"the call for round {req.round} of run {req.run_id!r} ended before its selection")
            sel = self._select(req)
            invited = sel.invited
            check_batch_size(req, len(invited), per_user, ct_len, self._max_batch_bytes)
            # the last state-free check is above; record before anyone is invited: a sequential user counts as
            # used once asked (even if silent)
            self._store.record_round(
                req.run_id,
                int(req.round),
                int(req.schedule),
                sel.consumed,
                sel.population,
                req.limits,
                invited if req.limits is not None else (),
            )
            rnd = OpenRound(
                req=req,
                deadline=self._clock() + req.deadline_seconds,
                invited=sel.cohort.invited_set if sel.cohort is not None else frozenset(invited),
                expected_messages=per_user,
                expected_ct_len=ct_len,
                bound=bound,
                not_in_run=sel.not_in_run,
                wire_dtype=wire_dtype,
                drawn_from=sel.drawn_from,
                excluded_silent=sel.excluded_silent,
            )
            if req.transport == Transport.COUNTS:
                rnd.totals = np.zeros(req.dim, dtype=np.uint64)
            if req.transport == Transport.PRIO3:
                rnd.report_ids = self._report_ids.setdefault(req.run_id, set())
                self._report_ids.move_to_end(req.run_id)
                while len(self._report_ids) > RECENT_RUNS:
                    self._report_ids.popitem(last=False)
            rnd.checking_in = req.check_in_trials > 0
            rnd.is_active = is_active
            self._open[key] = rnd
            rnd.by_node = sel.cohort.by_node if sel.cohort is not None else by_node(invited)
            self._invite(rnd, req.relay, rnd.by_node)
            t1 = self._clock()
            if req.transport == Transport.PRIO3:  # ends once the round is closed (below)
                rnd.preparer = threading.Thread(target=self._prepare_arrivals, args=(rnd,), daemon=True)
                rnd.preparer.start()
            try:
                # check-in: the first half of the window for the check-ins, the rest for the messages. The last
                # check-in sends the second invitation itself (submit); if the window closes first, it goes from here
                self._collect(rnd, is_active, self._clock() + req.deadline_seconds / 2 if rnd.checking_in else None)
                # an analyzer gone mid-check-in releases nothing: no second invitation for reports that would be lost
                if rnd.second_invitation or (rnd.checking_in and is_active() and self._second_invitation(rnd)):
                    self._collect(rnd, is_active)
            finally:
                rnd.closed = True
                self._lock.notify_all()  # a PRIO3 round's preparer drains what is left and ends
                del self._open[key]
                self._closed[key] = None
                while len(self._closed) > RECENT_CLOSED_ROUNDS:
                    self._closed.popitem(last=False)
            if rnd.second_invitation and is_active() and not rnd.goal_reached:
                # checked in, invited again, and sent nothing for the whole window: not asked to check in again in
                # this run (item 4). A round cut short (the analyzer gone, or its report goal reached: the rest
                # were slower, not silent) proves no one silent: its resumed run would otherwise find too few users
                # left to release anything again
                if len(rnd.answered) < len(rnd.invited):
                    silent = [u for u in rnd.invited if u not in rnd.answered]
                    self._selection.mark_silent(req.run_id, silent)
            t2 = self._clock()
            batch = self._finish(rnd, released_ok=is_active(), invited=len(invited))
        if rnd.req.transport == Transport.PRIO3:
            batch = self._release_prepared(rnd, batch, is_active)
        if self.on_round is not None:
            self.on_round(batch, {"select": t1 - t0, "collect": t2 - t1, "release": self._clock() - t2})
        return batch

    def _invite(self, rnd: OpenRound, relay: Any, invited: dict[str, list[str]]) -> None:
        """Send the invitation to the invited users' nodes (`invited`: node -> its users of rnd.invited, in the order
        they are listed to it); a SUBSAMPLED round's also to every node with eligible users, none of them invited (a
        notice: design 6, a cost relying on sampling counts every round a user was eligible for). Caller holds the
        lock."""
        by_node: dict[str, list[str]] = {}
        if rnd.req.schedule == Schedule.SUBSAMPLED:  # the eligible users are those of the live nodes
            by_node.update((node, []) for node in self._subs if self._admission.node_users.get(node))
        by_node.update(invited)
        for node, keys in by_node.items():
            users = NodeUserIds(node, keys)  # the node's own ids of the users
            sub = self._subs.get(node)
            # a node gone since its users checked in (the check-in's second invitation): they are dropouts, as if
            # the invitation had been lost on the way
            if sub is not None:
                sub.put(Invite(relay, users, rnd.drawn_from))

    def _collect(self, rnd: OpenRound, is_active: Callable[[], bool], until: float | None = None) -> None:
        """Wait until every invitee answered, the round's report goal was reached, the round's deadline (or `until`)
        passed, or the round is cancelled. Caller holds the lock (released while waiting)."""
        end = rnd.deadline if until is None else min(until, rnd.deadline)
        while len(rnd.answered) < len(rnd.invited) and not rnd.goal_reached and is_active():
            remaining = end - self._clock()
            if remaining <= 0:
                break
            self._lock.wait(min(remaining, self._poll))

    def _second_invitation(self, rnd: OpenRound) -> bool:
        """Check-in rounds (mechanisms/check_in.py, step 3): invite the c users who checked in with c_min and their
        share m of the noise; False (nothing is released) when fewer than the threshold checked in. Caller holds
        the lock."""
        req, c = rnd.req, rnd.n_checked_in
        rnd.checking_in = False
        if c < max(1, req.min_contributors):
            return False
        c_min, m = check_in.share(req.check_in_trials, req.check_in_fraction, req.min_contributors, c)
        relay = req.relay if req.second_relay is None else req.second_relay(c, c_min, m)
        # the report goal applies to this phase's reports, never below its threshold c_min
        goal = max(req.report_goal, c_min) if req.report_goal else 0
        second = replace(req, m=m, min_contributors=c_min, report_goal=goal, relay=relay)
        per_user, ct_len, bound = self._validate(second)  # cannot fail: m <= req.m (see _validate)
        rnd.req, rnd.bound, rnd.expected_messages, rnd.expected_ct_len = second, bound, per_user, ct_len
        rnd.wire_dtype = count_wire_dtype(bound) if req.transport == Transport.COUNTS else None
        if c == len(rnd.invited):
            # every invitee checked in (each at most once, each an invitee): the same users, per node too. A node
            # lists them in its invitation's order, so its rows of the check-in line up with the same list
            invited = rnd.by_node
        else:
            rnd.first_invited = rnd.invited
            rnd.invited = frozenset(k for keys in rnd.checked_in.values() for k in keys)
            invited = rnd.checked_in
        rnd.answered = set()
        rnd.second_invitation = True
        self._invite(rnd, relay, invited)
        return True

    def _finish(self, rnd: OpenRound, released_ok: bool, invited: int) -> BatchResult:
        """Threshold, then strip everything but totals / permuted ciphertexts. Caller holds the lock."""
        req = rnd.req
        # never release an empty batch, except a Poisson round asking for none: its accountant charges every round,
        # an empty one included, and the analyzer adds its noise to the zero sum
        threshold = req.min_contributors if req.sampling_rate > 0.0 else max(1, req.min_contributors)
        below = rnd.contributors < threshold
        released = released_ok and not below
        totals = None
        cts: list[bytes] = []
        if released:
            if req.transport == Transport.COUNTS:
                totals = rnd.totals.copy()
            else:
                perm = self._rng.permutation(len(rnd.ciphertexts))  # CSPRNG shuffle (design 1, spec 000 7.5)
                cts = [rnd.ciphertexts[i] for i in perm]
        rnd.ciphertexts = []
        rnd.encapsulations = set()
        rnd.totals = None
        return BatchResult(
            run_id=req.run_id,
            round=int(req.round),
            released=released,
            label_totals=totals,
            ciphertexts=cts,
            invited=invited,
            contributors=rnd.contributors,
            rejected=dict(rnd.rejected),
            refused=rnd.refused,
            below_threshold=below,
            refused_reasons=dict(rnd.refused_reasons),
            not_in_run=rnd.not_in_run,
            checked_in=rnd.n_checked_in,
            eligible=rnd.drawn_from,
            excluded_silent=rnd.excluded_silent,
        )

    # ----- PRIO3: the Leader (protocols/prio3.py) ------------------------------------------------------------------
    def _prepare_arrivals(self, rnd: OpenRound) -> None:
        """A PRIO3 round's preparer: the Leader's prepare_init of each report as it arrives (outside the lock, ~1.4 ms
        per report at d = 650, on every core), so that collection and preparation overlap and the round holds each
        report's preparation state (10 kB at d = 650) instead of its share (162 kB; 2.6 MB at d = 10^4, where 10^4
        devices' shares would not fit in memory). Ends once the round closed and nothing is left."""
        while True:
            with self._lock:
                while not rnd.reports and not rnd.closed:
                    self._lock.wait()  # every submission and the round's close notify
                todo, rnd.reports = rnd.reports, []
                if not todo:
                    return
                req, bound = rnd.req, rnd.bound  # reports arrive only after a check-in's second invitation set them
            vdaf = prio3.Vdaf(req.prio3_vdaf, req.dim, bound, req.run_id, int(req.round))
            prepared, rejected = prio3.leader_init(vdaf, req.verify_key, todo)
            with self._lock:
                rnd.prepared.extend(prepared)
                rnd.prep_rejected.update(rejected)

    def _release_prepared(self, rnd: OpenRound, batch: BatchResult, is_active: Callable[[], bool]) -> BatchResult:
        """A closed PRIO3 round, once its preparer prepared every report (_prepare_arrivals): drop those that did not
        decode, threshold again, and hand the Helper its part of each in a CSPRNG-permuted order; the prepared
        reports wait for FinishAggregation."""
        rnd.preparer.join()
        req, prepared, rejected = rnd.req, rnd.prepared, Counter(rnd.prep_rejected)
        rnd.prepared = []
        if not batch.released:
            return batch
        vdaf = prio3.Vdaf(req.prio3_vdaf, req.dim, rnd.bound, req.run_id, int(req.round))
        users = sum(p.users for p in prepared)
        below = users < max(1, req.min_contributors)
        with self._lock:
            for reason, k in rejected.items():
                self._counters[reason] += k
            rejected.update(batch.rejected)
            released = not below and is_active()
            if released:
                perm = self._rng.permutation(len(prepared))  # CSPRNG shuffle (design 1), as for ciphertexts
                prepared = [prepared[i] for i in perm]
                key = (req.run_id, int(req.round))
                self._pending[key] = _Pending(vdaf, {p.report_id: p for p in prepared}, req.min_contributors)
                while len(self._pending) > RECENT_PENDING:
                    self._pending.popitem(last=False)
        return replace(
            batch,
            released=released,
            below_threshold=below,
            contributors=users,
            rejected=dict(rejected),
            reports=prepared if released else (),
        )

    def finish_aggregation(self, run_id: str, round_index: int, preps: Sequence[tuple[bytes, bytes]]) -> Aggregate:
        """The Helper's prep shares of a released PRIO3 round -> the Leader's aggregate share over the reports both
        servers verified, only over at least the round's threshold of users (the check that protects the users is
        the Leader's own: it combines the prep shares itself). Answered once per round: a second request (another
        subset of reports, whose difference would isolate one) finds nothing (RoundRejected, wrong_round)."""
        with self._lock:
            pending = self._pending.pop((run_id, int(round_index)), None)
        if pending is None:
            raise RoundRejected(
                Reason.WRONG_ROUND, f"no PRIO3 round {round_index} of run {run_id!r} awaits its aggregation"
            )
        share, reports, users, rejected = prio3.leader_finish(pending.vdaf, pending.reports, preps)
        with self._lock:
            for reason, k in rejected.items():
                self._counters[reason] += k
        released = share is not None and users >= max(1, pending.min_contributors)
        return Aggregate(released, share if released else b"", reports, users, dict(rejected))

    # ----- collection -------------------------------------------------------------------------------------------
    def submit(self, sub: Submission) -> Ack:
        """Validate and aggregate one node's contribution (design 5.3). Whole-contribution errors raise
        RoundRejected (counted once per message/refusal); per-message errors are counted and acknowledged."""
        rejected: Counter = Counter()
        check_id("node_id", sub.node_id)
        with self._lock:
            key = (sub.run_id, int(sub.round))
            rnd = self._open.get(key)
            n_columns = len(sub.columns.user_ids) if sub.columns is not None else 0
            n_items = max(1, len(sub.messages) + len(sub.refusals) + n_columns)
            if rnd is None or rnd.closed or rnd.goal_reached or self._clock() >= rnd.deadline:
                reason = Reason.EXPIRED_ROUND if (key in self._closed or rnd is not None) else Reason.WRONG_ROUND
                self._checks.reject(None, reason, rejected, n_items)
                if reason == Reason.EXPIRED_ROUND:
                    raise RoundRejected(reason, f"round {sub.round} of run {sub.run_id!r} is closed")
                raise RoundRejected(reason, f"no open round {sub.round} of run {sub.run_id!r}")
            accepted = 0
            rows: list[bytes] = []  # COUNTS payloads valid but for the range check, done below for all at once
            # row indices of sub.columns.counts whose user passed every check but the range check
            column_rows: list[int] | range = []
            admitted = self._admitted
            for msg in sub.messages:
                ukey = user_key(sub.node_id, msg.user_id)
                ukey = admitted.get(ukey, ukey)
                checked = self._checks.message(rnd, ukey, msg)
                if isinstance(checked, Reason):
                    self._checks.reject(rnd, checked, rejected)
                    if checked in PAYLOAD_REASONS:
                        # an identified invitee sent a malformed payload: its one answer is used up (no probing
                        # of the validator, and the round need not wait for it until the deadline)
                        rnd.answered.add(ukey)
                    continue
                rnd.answered.add(ukey)  # a valid answer, or a payload the range check may still reject
                if checked is CHECK_IN:
                    rnd.checked_in.setdefault(sub.node_id, []).append(ukey)
                    accepted += 1
                elif checked is not None:
                    rows.append(checked)
                else:
                    rnd.ciphertexts.extend(bytes(c) for c in msg.ciphertexts)
                    rnd.encapsulations.update(bytes(c[:ENC_BYTES]) for c in msg.ciphertexts)
                    rnd.contributors += 1
                    accepted += 1
            if sub.columns is not None and sub.columns.user_ids:
                added, column_rows = self._checks.columns(rnd, sub.node_id, sub.columns, rejected)
                accepted += added
            if rows or column_rows:
                block = np.frombuffer(b"".join(rows), dtype=rnd.wire_dtype).reshape(len(rows), rnd.req.dim)
                if column_rows:  # rows of the columns' counts, validated above to hold dim values each
                    table = np.frombuffer(sub.columns.counts, dtype=rnd.wire_dtype).reshape(-1, rnd.req.dim)
                    part = table if isinstance(column_rows, range) else table[column_rows]
                    block = part if not rows else np.concatenate([block, part])
                accepted += self._checks.add_counts(rnd, block, rejected)
            for user_id, why in sub.refusals:
                ukey = user_key(sub.node_id, user_id)
                ukey = admitted.get(ukey, ukey)
                if ukey not in rnd.invited:
                    outside = Reason.NOT_INVITED if ukey in self._admitted else Reason.UNKNOWN_USER
                    self._checks.reject(rnd, Reason.EXPIRED_ROUND if ukey in rnd.first_invited else outside, rejected)
                elif ukey in rnd.answered:
                    self._checks.reject(rnd, Reason.DUPLICATE_USER, rejected)
                else:
                    rnd.answered.add(ukey)
                    rnd.refused += 1
                    rnd.refused_reasons[refusal_reason(rnd, why)] += 1
                    self._counters["refused"] += 1
            self._counters["accepted"] += accepted
            goal = rnd.req.report_goal
            if goal and not rnd.checking_in and rnd.contributors >= goal:
                # over-selection: enough reports; what arrives from now on is refused as expired_round (above) and
                # execute_round releases at once instead of waiting for the slowest invitee until the deadline
                rnd.goal_reached = True
            if rnd.checking_in and len(rnd.answered) >= len(rnd.invited) and rnd.is_active():
                # every invitee checked in or answered otherwise: invite again now, from this thread (execute_round
                # would only wake up to do it); fewer than the threshold ends the round as below it
                self._second_invitation(rnd)
            self._lock.notify_all()
            return Ack(accepted, dict(rejected))
