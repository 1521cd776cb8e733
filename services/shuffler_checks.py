"""What the shuffler checks (design 5.3): a round request completely before any state changes, and every message of
a node's submission: who sent it (nonce, user, invitation, one answer) and what it carries (transport, length, range,
replayed ciphertexts), counted per reason; only what passes is aggregated. Issue 47 split it out of the shuffler's
state; the state's lock guards the Checks (every method: caller holds it)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from shuffledp.services.shuffler_admission import check_id, user_key, user_keys
from shuffledp.services.shuffler_types import (
    MAX_BIT_MESSAGES_PER_USER,
    MAX_REASON_CHARS,
    MAX_REFUSAL_REASONS,
    NONCE_MAX_BYTES,
    NONCE_MIN_BYTES,
    PROTO_BYTES_OVERHEAD,
    U64,
    OpenRound,
    Reason,
    RoundRequest,
    Schedule,
    Transport,
    UserColumns,
    UserMessage,
)

from shuffledp.durable import INTEGER_LIMIT
from shuffledp.protocols import prio3
from shuffledp.security.sealing import BIT_MESSAGE_BYTES, ENC_BYTES, PUBLIC_KEY_BYTES, sealed_length

__all__ = ["validate_request", "check_batch_size", "refusal_reason", "Checks", "CHECK_IN"]

CHECK_IN = object()  # Checks.message: a valid payload-free answer to a check-in invitation


def validate_request(
    req: RoundRequest, max_deadline: float, max_batch_bytes: int, admitted_users: int
) -> tuple[int, int, int]:
    """Check a round request completely, before any state changes; returns (messages per user, ciphertext
    length, g+m)."""
    check_id("run_id", req.run_id)
    if not 0 <= int(req.round) < INTEGER_LIMIT:  # the participation record stores it
        raise ValueError(f"round must lie in [0, 2^63), got {req.round}")
    if req.schedule == Schedule.STREAM:
        raise NotImplementedError("schedule STREAM is not implemented by this shuffler yet")
    if req.schedule not in (Schedule.SEQUENTIAL, Schedule.FULLY_INTERACTIVE, Schedule.SUBSAMPLED):
        raise ValueError(f"schedule must be SEQUENTIAL, FULLY_INTERACTIVE or SUBSAMPLED, got {req.schedule}")
    if req.transport not in (Transport.COUNTS, Transport.BITS, Transport.SEALED, Transport.PRIO3):
        raise ValueError(f"transport must be COUNTS, BITS, SEALED or PRIO3, got {req.transport}")
    if not (0.0 < req.deadline_seconds <= max_deadline) or not math.isfinite(req.deadline_seconds):
        raise ValueError(f"deadline_seconds must lie in (0, {max_deadline}], got {req.deadline_seconds}")
    if req.min_contributors < 0:
        raise ValueError(f"min_contributors must be >= 0, got {req.min_contributors}")
    if req.report_goal:
        # over-selection: closing at the goal must never leave the round below its threshold (a check-in's
        # second phase closes at max(goal, c_min), c_min >= min_contributors)
        if req.report_goal < max(1, req.min_contributors):
            raise ValueError(
                f"report_goal = {req.report_goal} is below min_contributors = {req.min_contributors}: the round "
                "would close below its threshold (0 waits for every invitee)"
            )
        if req.schedule == Schedule.SUBSAMPLED:
            # amplification by sampling assumes the draw alone decides whose reports are in the batch; a goal
            # would keep the fastest of the sampled users
            raise ValueError("report_goal applies to SEQUENTIAL and FULLY_INTERACTIVE rounds, not SUBSAMPLED")
    if not (math.isfinite(req.sampling_rate) and 0.0 <= req.sampling_rate <= 1.0):
        raise ValueError(f"sampling_rate must lie in [0, 1], got {req.sampling_rate}")
    if req.sampling_rate > 0.0:
        # Poisson sampling (the sampled Gaussian's assumption): the draw decides the cohort, nothing else does
        if req.schedule != Schedule.SUBSAMPLED:
            raise ValueError(f"sampling_rate applies to SUBSAMPLED rounds, not {req.schedule.name}")
        if req.cohort_size != 0 or req.limits is not None or req.check_in_trials:
            raise ValueError(
                "a Poisson-sampled round (sampling_rate > 0) takes no cohort_size, participation limits or "
                f"check-in, got cohort_size={req.cohort_size}"
            )
    if req.limits is not None:
        if req.schedule != Schedule.SUBSAMPLED:
            raise ValueError(f"participation limits apply to SUBSAMPLED rounds, not {req.schedule.name}")
        if req.limits.max_per_tree < 1 or req.limits.min_separation < 0 or req.limits.rounds_per_tree < 0:
            raise ValueError(f"participation limits need max_per_tree >= 1, got {tuple(req.limits)}")
    if req.check_in_trials:
        # the second invitation's m = ceil(trials / c_min) <= m (c_min >= min_contributors): the checks of this
        # request's m below hold for it too
        if req.transport not in (Transport.COUNTS, Transport.BITS, Transport.PRIO3):
            raise ValueError(f"check_in applies to COUNTS and BITS rounds (and PRIO3), not {req.transport.name}")
        if not (math.isfinite(req.check_in_fraction) and 0.0 < req.check_in_fraction <= 1.0):
            raise ValueError(f"check_in.report_fraction must lie in (0, 1], got {req.check_in_fraction}")
        if req.min_contributors < 1 or req.check_in_trials > int(req.m) * req.min_contributors:
            raise ValueError(
                f"check_in.noise_trials = {req.check_in_trials} must be <= randomizer.m * min_contributors = "
                f"{req.m} * {req.min_contributors} (min_contributors >= 1)"
            )
    bound = int(req.g) + int(req.m)
    if bound >= U64:  # no count of any transport can reach it; refused here, before any state changes
        raise ValueError(f"g + m must be < 2^64, got g={req.g}, m={req.m}")
    if req.transport in (Transport.COUNTS, Transport.BITS, Transport.PRIO3):
        if req.dim < 1:
            raise ValueError(f"randomizer.dim must be >= 1 for {req.transport.name}, got {req.dim}")
        if req.g < 1 or req.m < 0:
            raise ValueError(f"randomizer g must be >= 1 and m >= 0, got g={req.g}, m={req.m}")
    if req.transport == Transport.COUNTS:
        # the released totals (d uint64) must fit one message the analyzer can receive
        if req.dim * 8 + PROTO_BYTES_OVERHEAD > max_batch_bytes:
            raise ValueError(
                f"randomizer.dim = {req.dim}: its per-label totals would exceed the {max_batch_bytes}-byte "
                "batch message limit"
            )
        # every total is a sum of <= cohort counts in [0, g+m]; it must fit the uint64 wire type
        if max(req.cohort_size, admitted_users, 1) * bound >= U64:
            raise ValueError(f"g+m = {bound} is too large: per-label totals would overflow uint64")
        return req.dim, 0, bound
    if len(req.analyzer_public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(
            f"analyzer_public_key must be a raw {PUBLIC_KEY_BYTES}-byte X25519 key for {req.transport.name}, "
            f"got {len(req.analyzer_public_key)} bytes"
        )
    if req.transport == Transport.PRIO3:
        _validate_prio3(req, bound, admitted_users)
        return req.dim, 0, bound
    if req.transport == Transport.BITS:
        per_user = req.dim * bound  # Alg 2 of paper 000: d (g+m) labelled bits per user
        if per_user > MAX_BIT_MESSAGES_PER_USER:
            raise ValueError(
                f"BITS would need d*(g+m) = {per_user} messages per user (> {MAX_BIT_MESSAGES_PER_USER}); use COUNTS"
            )
        if req.message_bytes not in (0, BIT_MESSAGE_BYTES):
            raise ValueError(f"randomizer.message_bytes must be {BIT_MESSAGE_BYTES} for BITS, got {req.message_bytes}")
        return per_user, sealed_length(BIT_MESSAGE_BYTES), bound
    per_user = req.messages_per_user or 1
    if req.message_bytes < 1:
        raise ValueError(f"randomizer.message_bytes must be >= 1 for SEALED, got {req.message_bytes}")
    return per_user, sealed_length(req.message_bytes), bound


def _validate_prio3(req: RoundRequest, bound: int, admitted_users: int) -> None:
    """A PRIO3 round's own checks (the public key's are the caller's): a verification key, a VDAF this shuffler
    runs, and totals that cannot wrap around the VDAF's field."""
    if len(req.verify_key) != prio3.VERIFY_KEY_BYTES:
        raise ValueError(
            f"a PRIO3 round needs the {prio3.VERIFY_KEY_BYTES}-byte verify_key in ExecuteRound, got "
            f"{len(req.verify_key)} bytes"
        )
    if not prio3.available():
        raise NotImplementedError(f"this shuffler cannot run PRIO3 rounds: {prio3.MISSING}")
    vdaf = prio3.Vdaf(req.prio3_vdaf, req.dim, bound, req.run_id, int(req.round))  # ValueError: unknown VDAF
    if max(req.cohort_size, admitted_users, 1) > vdaf.max_users():
        raise ValueError(f"g+m = {bound} is too large: the totals of {admitted_users} users would wrap in the field")


def check_batch_size(req: RoundRequest, invited: int, per_user: int, ct_len: int, max_batch_bytes: int) -> None:
    """A released SEALED / BITS batch holds up to invited * per_user ciphertexts: it must fit one gRPC message
    the analyzer can receive (grpc_options.BATCH_MESSAGE_BYTES), or it could never be delivered. COUNTS: the
    invitees' totals must fit uint64 (_validate checked it for the users admitted then, outside the lock; users
    admitted since could make a cohort larger)."""
    if req.transport in (Transport.COUNTS, Transport.PRIO3):
        # PRIO3: a batch holds at most one report per user, each ~3-15 kB to the analyzer (d <= 10^4), so a 1 GiB
        # message holds >= 65,000 reports; a larger one fails in delivery, which the analyzer charges as spent
        bound = int(req.g) + int(req.m)
        if invited * bound >= U64:
            raise ValueError(f"g+m = {bound} is too large: the totals of {invited} users would overflow uint64")
        return
    worst = invited * per_user * (ct_len + PROTO_BYTES_OVERHEAD)
    if worst > max_batch_bytes:
        raise ValueError(
            f"{req.transport.name} round of {invited} users x {per_user} messages of {ct_len} bytes: the batch "
            f"could reach {worst} bytes, above the {max_batch_bytes}-byte message limit; use fewer users"
            + (" or COUNTS" if req.transport == Transport.BITS else "")
        )


def refusal_reason(rnd: OpenRound, why: str) -> str:
    """A node's refusal reason as counted and forwarded: printable, bounded in length and in distinct values (a
    node's free text must not let it grow the round's report, or carry more than a short label to the analyzer)."""
    why = why if isinstance(why, str) and why.isprintable() and 0 < len(why) <= MAX_REASON_CHARS else "unspecified"
    if why not in rnd.refused_reasons and len(rnd.refused_reasons) >= MAX_REFUSAL_REASONS:
        return "other"
    return why


class Checks:
    """The per-message checks of a submission against its open round, and the rejection counts."""

    def __init__(self, admitted: dict[str, str], counters: Counter) -> None:
        self.admitted = admitted  # the admitted users' keys (shuffler_admission.Admission.admitted, shared)
        self.counters = counters  # totals since start, per reason (ShufflerState.counters)

    def reject(self, rnd: OpenRound | None, reason: Reason, rejected: Counter, n: int = 1) -> None:
        rejected[reason.value] += n
        self.counters[reason.value] += n
        if rnd is not None:
            rnd.rejected[reason.value] += n

    def add_counts(self, rnd: OpenRound, block: np.ndarray, rejected: Counter) -> int:
        """Range-check COUNTS payloads (rows of d values of rnd.wire_dtype) and add the valid ones into the running
        total, one vectorized pass; returns how many were added. Caller holds the lock."""
        ok = block.max(axis=1) <= rnd.bound  # unsigned: never negative, so [0, g+m] is this one bound
        n_ok = int(np.count_nonzero(ok))
        if n_ok < len(block):
            self.reject(rnd, Reason.COUNT_OUT_OF_RANGE, rejected, len(block) - n_ok)
            block = block[ok]
        # running total only, per-user counts are not kept (spec 000 sec 8); no overflow: _validate bounds
        # cohort * (g+m) below 2^64
        rnd.totals += block.sum(axis=0, dtype=np.uint64)
        rnd.contributors += n_ok
        return n_ok

    def sender(self, rnd: OpenRound, ukey: str, nonce: bytes) -> Reason | None:
        """The checks of design 5.3 on who sent a message (nonce, user, invitation, one answer), in order; when all
        pass the nonce is recorded. Caller holds the lock."""
        if not NONCE_MIN_BYTES <= len(nonce) <= NONCE_MAX_BYTES:
            return Reason.BAD_NONCE
        if nonce in rnd.nonces:
            return Reason.REPLAYED_NONCE
        if ukey not in self.admitted:
            return Reason.UNKNOWN_USER
        if ukey not in rnd.invited:
            # an invitee whose check-in came after the check-in window (it was not invited again): late, not a stranger
            return Reason.EXPIRED_ROUND if ukey in rnd.first_invited else Reason.NOT_INVITED
        if ukey in rnd.answered:
            return Reason.DUPLICATE_USER
        # a re-sent copy of this message (accepted or not) is a replay. Kept only for an invitee's one answer and
        # only while the round is open (then every message to it is refused as expired): at most one nonce per
        # invited user, whatever a sender sends
        rnd.nonces.add(nonce)
        return None

    def columns(
        self, rnd: OpenRound, node_id: str, cols: UserColumns, rejected: Counter
    ) -> tuple[int, list[int] | range]:
        """Every check of message for each user of `cols`, with the same outcome and counts as one
        UserMessage per user in column order; returns (check-ins accepted or users added by their sums, rows of
        cols.counts left for the range check). An honest batch passes the sender checks as set operations, without
        a Python step per user (issue 15: the per-message checks were the shuffler's hot loop). Caller holds the
        lock."""
        n, width = len(cols.user_ids), int(cols.nonce_bytes)
        # the admitted key objects, None for an id never admitted; no set of the batch's keys is built (issue 30
        # item 3: at 10^6 users per node the batch's own key strings and their set were ~100 MiB of the peak)
        keys = list(map(self.admitted.get, user_keys(node_id, cols.user_ids)))
        if not NONCE_MIN_BYTES <= width <= NONCE_MAX_BYTES or len(cols.nonces) != n * width:
            self.reject(rnd, Reason.BAD_NONCE, rejected, n)  # every nonce has a bad length, or none is defined
            return 0, []
        answered = rnd.answered
        # invitees are admitted users (nothing is ever un-admitted): being invited implies being admitted (None is
        # not invited)
        honest = rnd.invited.issuperset(keys) and (not answered or answered.isdisjoint(keys))
        if honest:
            # each answer is used up once its sender checks pass, whether or not its payload passes below
            before = len(answered)
            answered.update(keys)
            # n new answers iff the n users are distinct (none had answered); the nonces last: add_batch adds them
            # only when they are new and distinct
            honest = len(answered) - before == n and rnd.nonces.add_batch(cols.nonces, width, n)
            if not honest:
                answered.difference_update(keys)  # exactly the keys just added: none had answered before
        if honest:
            good: list[int] | range = range(n)
        else:  # somebody fails: the per-user checks in order give each message its reason
            keys = [k if k is not None else user_key(node_id, u) for k, u in zip(keys, cols.user_ids, strict=True)]
            nonces = [cols.nonces[i : i + width] for i in range(0, n * width, width)]
            good = []
            for i, (ukey, nonce) in enumerate(zip(keys, nonces, strict=True)):
                why = self.sender(rnd, ukey, nonce)
                if why is None:
                    rnd.answered.add(ukey)
                    good.append(i)
                else:
                    self.reject(rnd, why, rejected)
        if not good:
            return 0, []
        row_bytes = rnd.req.dim * rnd.wire_dtype.itemsize if rnd.wire_dtype is not None else 0
        if rnd.checking_in:  # a check-in carries no payload (CheckIn)
            if cols.counts or cols.sums or cols.reports:
                self.reject(rnd, Reason.WRONG_PAYLOAD, rejected, len(good))
                return 0, []
            rnd.checked_in.setdefault(node_id, []).extend(keys if isinstance(good, range) else (keys[i] for i in good))
            return len(good), []
        if rnd.req.transport == Transport.PRIO3:
            if cols.counts or cols.sums or not cols.reports:
                self.reject(rnd, Reason.WRONG_PAYLOAD, rejected, len(good))
                return 0, []
            return self.add_reports(rnd, cols, good, rejected), []
        if cols.reports:
            self.reject(rnd, Reason.WRONG_PAYLOAD, rejected, len(good))
            return 0, []
        # exactly one COUNTS form: both set would leave open which one is the users' answer
        if rnd.req.transport != Transport.COUNTS or bool(cols.counts) == bool(cols.sums):
            self.reject(rnd, Reason.WRONG_PAYLOAD, rejected, len(good))
            return 0, []
        if cols.sums:
            return self.add_sums(rnd, cols, good, rejected), []
        if len(cols.counts) != n * row_bytes:  # rows cannot be told apart: none has the round's length
            self.reject(rnd, Reason.WRONG_COUNT_LENGTH, rejected, len(good))
            return 0, []
        return 0, good

    def _whole_groups(
        self, rnd: OpenRound, n: int, size: int, good: list[int] | range, rejected: Counter
    ) -> tuple[np.ndarray, np.ndarray]:
        """The groups of `size` consecutive users (the last may be shorter) all of whose users passed the sender
        checks (`good`): (whether each group is whole, each group's size). A group with a refused user cannot be
        split: its other users are rejected (PARTIAL_SUM)."""
        starts = np.arange(0, n, size)
        sizes = np.minimum(starts + size, n) - starts
        ok = np.zeros(n, dtype=np.int64)
        ok[np.asarray(good, dtype=np.int64)] = 1
        good_in = np.add.reduceat(ok, starts)  # users of each group that passed the sender checks
        whole = good_in == sizes
        partial = int(good_in[~whole].sum())  # a group none of whose users passed has no one left to reject
        if partial:
            self.reject(rnd, Reason.PARTIAL_SUM, rejected, partial)
        return whole, sizes

    def add_reports(self, rnd: OpenRound, cols: UserColumns, good: list[int] | range, rejected: Counter) -> int:
        """Keep the Prio3 reports of cols (UserColumns.reports, one per group of sum_users users) whose users all
        passed the sender checks, unread: their ids are checked here (length, never seen in the run: `rnd.report_ids`
        holds the run's), their shares by the joint verification after the round closes (protocols/prio3.py).
        Returns the users kept. Caller holds the lock."""
        n, size = len(cols.user_ids), int(cols.sum_users)
        groups = -(-n // size) if size > 0 else 0
        if not groups or len(cols.reports) != groups:  # the reports cannot be matched to their users
            self.reject(rnd, Reason.MALFORMED_REPORT, rejected, len(good))
            return 0
        whole, sizes = self._whole_groups(rnd, n, size, good, rejected)
        added = 0
        for j in np.flatnonzero(whole).tolist():
            rid, public, leader, helper = cols.reports[j]
            users = int(sizes[j])
            if len(rid) != prio3.REPORT_ID_BYTES or max(len(public), len(helper)) > prio3.MAX_SHARE_BYTES:
                self.reject(rnd, Reason.MALFORMED_REPORT, rejected, users)
            elif rid in rnd.report_ids:
                self.reject(rnd, Reason.REPLAYED_REPORT, rejected, users)
            else:
                rnd.report_ids.add(rid)
                rnd.reports.append((rid, public, leader, helper, users))
                added += users
        rnd.contributors += added
        return added

    def add_sums(self, rnd: OpenRound, cols: UserColumns, good: list[int] | range, rejected: Counter) -> int:
        """Range-check the group sums of cols (UserColumns.sums) whose users all passed the sender checks (`good`)
        and add them into the running total; returns the users added. A sum of s users is accepted in [0, s (g + m)]
        per coordinate: exactly the sums of s counts in [0, g + m] each, so a node's users can move the totals no
        further than with one row each (design 5.3). A group with a refused user cannot be split: its other users
        are rejected (PARTIAL_SUM). Caller holds the lock."""
        n, d, size = len(cols.user_ids), rnd.req.dim, int(cols.sum_users)
        groups = -(-n // size) if size > 0 else 0
        if not groups or len(cols.sums) != groups * d * 8:  # the sums cannot be told apart
            self.reject(rnd, Reason.WRONG_COUNT_LENGTH, rejected, len(good))
            return 0
        whole, sizes = self._whole_groups(rnd, n, size, good, rejected)
        sums, sizes = np.frombuffer(cols.sums, dtype="<u8").reshape(groups, d)[whole], sizes[whole]
        if not len(sums):
            return 0
        # no overflow: a whole group's users are distinct admitted users, and _validate bounds users * (g+m) < 2^64
        in_range = sums.max(axis=1) <= sizes.astype(np.uint64) * np.uint64(rnd.bound)
        if not np.all(in_range):
            self.reject(rnd, Reason.COUNT_OUT_OF_RANGE, rejected, int(sizes[~in_range].sum()))
        added = int(sizes[in_range].sum())
        rnd.totals += sums[in_range].sum(axis=0, dtype=np.uint64)
        rnd.contributors += added
        return added

    def message(self, rnd: OpenRound, ukey: str, msg: UserMessage) -> Reason | bytes | object | None:
        """First failing check of design 5.3 for one user message (a Reason), else for COUNTS the payload as
        d values of rnd.wire_dtype (bytes; its range is checked by add_counts), else None. Caller holds the lock."""
        why = self.sender(rnd, ukey, bytes(msg.nonce))
        if why is not None:
            return why
        if rnd.checking_in:  # a check-in carries no payload (CheckIn)
            empty = msg.counts is None and msg.counts_packed is None and msg.ciphertexts is None
            return CHECK_IN if empty else Reason.WRONG_PAYLOAD
        if rnd.req.transport == Transport.PRIO3:  # reports come in columns (UserColumns.reports) only
            return Reason.WRONG_PAYLOAD
        if rnd.req.transport == Transport.COUNTS:
            # exactly one COUNTS encoding: both set would leave open which one is the user's answer
            if msg.ciphertexts is not None or (msg.counts is None) == (msg.counts_packed is None):
                return Reason.WRONG_PAYLOAD
            if msg.counts_packed is not None:
                packed = bytes(msg.counts_packed)
                ok = len(packed) == rnd.req.dim * rnd.wire_dtype.itemsize
                return packed if ok else Reason.WRONG_COUNT_LENGTH
            if msg.counts.shape != (rnd.req.dim,):
                return Reason.WRONG_COUNT_LENGTH
            if msg.counts.dtype.kind not in "ui" or (msg.counts.size and int(msg.counts.min()) < 0):
                return Reason.COUNT_OUT_OF_RANGE  # only non-negative integers are counts
            if msg.counts.size and int(msg.counts.max()) > rnd.bound:
                return Reason.COUNT_OUT_OF_RANGE  # checked here: the narrow wire width below would wrap it
            return msg.counts.astype(rnd.wire_dtype).tobytes()
        if msg.ciphertexts is None or msg.counts is not None or msg.counts_packed is not None:
            return Reason.WRONG_PAYLOAD
        if len(msg.ciphertexts) != rnd.expected_messages:
            return Reason.WRONG_MESSAGE_COUNT
        if any(len(c) != rnd.expected_ct_len for c in msg.ciphertexts):
            return Reason.WRONG_CIPHERTEXT_LENGTH
        encs = {bytes(c[:ENC_BYTES]) for c in msg.ciphertexts}
        if len(encs) < len(msg.ciphertexts) or not rnd.encapsulations.isdisjoint(encs):
            return Reason.REPLAYED_MESSAGE
        return None
