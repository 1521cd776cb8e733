"""The shuffler's vocabulary: what a round request, a node's submission and a round's result hold, the rejection
reasons, the domain errors, and the state of one open round (design sections 1 and 5; issue 47 split it out of the
shuffler's state). Plain data: no locks, no I/O, nothing that decides."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from shuffledp.services.participation import TreeLimits


# Same numbering as the proto enums (shuffledp.v1.Schedule / Transport), so the servicer converts by value.
class Schedule(IntEnum):
    UNSPECIFIED = 0
    SEQUENTIAL = 1
    FULLY_INTERACTIVE = 2
    SUBSAMPLED = 3
    STREAM = 4


class Transport(IntEnum):
    UNSPECIFIED = 0
    COUNTS = 1
    BITS = 2
    SEALED = 3
    PRIO3 = 4


class Reason(StrEnum):
    """Rejection reasons (design 5.3); the keys of ContributionAck.rejected and BatchReport.rejected."""

    WRONG_ROUND = "wrong_round"  # no such open round (other run, future or unknown round)
    # the round closed (deadline passed, all invitees answered or its report goal reached), or its check-in window did
    # (a check-in after it)
    EXPIRED_ROUND = "expired_round"
    BAD_NONCE = "bad_nonce"  # nonce missing or not 16..64 bytes
    REPLAYED_NONCE = "replayed_nonce"  # nonce already seen in this round (replayed message)
    DUPLICATE_USER = "duplicate_user"  # a second message or refusal from one user in one round
    UNKNOWN_USER = "unknown_user"  # never registered (admitted) at this shuffler
    NOT_INVITED = "not_invited"  # registered, but not invited to this round via this node
    WRONG_PAYLOAD = "wrong_payload"  # payload type does not match the round's transport
    WRONG_COUNT_LENGTH = "wrong_count_length"  # COUNTS: not exactly d counts
    COUNT_OUT_OF_RANGE = "count_out_of_range"  # COUNTS: a count outside [0, g+m]
    WRONG_MESSAGE_COUNT = "wrong_message_count"  # SEALED/BITS: not the round's number of messages per user
    WRONG_CIPHERTEXT_LENGTH = "wrong_ciphertext_length"  # SEALED/BITS: not the round's fixed length
    # SEALED/BITS: a ciphertext whose encapsulated key another one of the round has (a copy: one message counted as
    # several users' by the analyzer's amplification and sums)
    REPLAYED_MESSAGE = "replayed_message"
    PARTIAL_SUM = "partial_sum"  # COUNTS sums: the user's group sum also holds a user refused by a check above
    # PRIO3 (protocols/prio3.py), counted per user of the report: an id seen before in the run, a report that does not
    # decode as the round's VDAF, one the joint verification rejected (out of range, forged proof, mismatched share)
    REPLAYED_REPORT = "replayed_report"
    MALFORMED_REPORT = "malformed_report"
    INVALID_PROOF = "invalid_proof"


PAYLOAD_REASONS = frozenset(
    {
        Reason.WRONG_PAYLOAD,
        Reason.WRONG_COUNT_LENGTH,
        Reason.COUNT_OUT_OF_RANGE,
        Reason.WRONG_MESSAGE_COUNT,
        Reason.WRONG_CIPHERTEXT_LENGTH,
        Reason.REPLAYED_MESSAGE,
        Reason.REPLAYED_REPORT,
        Reason.MALFORMED_REPORT,
    }
)


class ShufflerError(Exception):
    """Base of the domain errors the servicer maps to gRPC status codes."""


class RoundRejected(ShufflerError):
    """A whole contribution refers to a round that is not open (wrong or expired)."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


class RoundExistsError(ShufflerError):
    """(run_id, round) was already executed: a round runs at most once (fresh round numbers after restarts)."""


class CohortUnavailable(ShufflerError):
    """Not enough eligible users for the requested cohort (e.g. sequential users exhausted)."""


class CallerGone(ShufflerError):
    """The analyzer's call ended (deadline, cancel) while the round waited for the state: nobody is selected."""


class QuotaExceeded(ShufflerError):
    """A node asked for more than the shuffler holds for one party (users per node, open streams)."""


NONCE_MIN_BYTES = 16
NONCE_MAX_BYTES = 64
MAX_ID_CHARS = 128
MAX_USERS_PER_NODE = 2**20  # what one node identity may register: bounds the memory a node can make us hold
MAX_BIT_MESSAGES_PER_USER = 2**20  # bit mode is for small settings only (spec 000 sec 8)
MAX_REFUSAL_REASONS = 16  # distinct refusal reasons kept per round; further ones are counted as "other"
MAX_REASON_CHARS = 64
RECENT_CLOSED_ROUNDS = 4096  # closed rounds remembered in memory (late messages to them count as expired_round)
U64 = 2**64
PROTO_BYTES_OVERHEAD = 6  # tag + length varint of one ciphertext in ShuffledBatch.ciphertexts (<= 2^28 bytes)


@dataclass(frozen=True)
class RoundRequest:
    """What the shuffler needs from a RoundSpec; `relay` is the spec itself, forwarded to the invited nodes."""

    run_id: str
    round: int
    schedule: Schedule
    transport: Transport
    dim: int = 0
    g: int = 0
    m: int = 0
    messages_per_user: int = 0
    message_bytes: int = 0
    cohort_size: int = 0
    min_contributors: int = 1
    deadline_seconds: float = 30.0
    analyzer_public_key: bytes = b""
    limits: TreeLimits | None = None  # DP-FTRL's per-tree participation limits, or None
    check_in_trials: int = 0  # RoundSpec.check_in.noise_trials: > 0 runs the check-in (mechanisms/check_in.py)
    check_in_fraction: float = 0.0  # RoundSpec.check_in.report_fraction
    sampling_rate: float = 0.0  # RoundSpec.sampling_rate: > 0 = Poisson sampling (SUBSAMPLED, cohort_size 0)
    population: int = 0  # RoundSpec.population: SUBSAMPLED, the eligible users the accountant assumes (0: no claim)
    # RoundSpec.report_goal: the round closes once this many users' reports were accepted (over-selection); 0 = it
    # waits for every invitee until the deadline. >= min_contributors; a check-in's second phase uses max(it, c_min)
    report_goal: int = 0
    verify_key: bytes = b""  # PRIO3: the VDAF verification key (RoundSpec.verify_key; never relayed)
    prio3_vdaf: str = ""  # PRIO3: RoundSpec.prio3.vdaf
    relay: Any = None
    second_relay: Callable[[int, int, int], Any] | None = None  # check-in: (c, c_min, m) -> the second spec


@dataclass(frozen=True)
class UserMessage:
    """One user's message. A COUNTS payload is `counts` or `counts_packed`, never both (both -> wrong_payload)."""

    user_id: str
    nonce: bytes
    counts: np.ndarray | None = None  # COUNTS payload (uint64 array), or None
    ciphertexts: Sequence[bytes] | None = None  # SEALED / BITS payload, or None
    counts_packed: bytes | None = None  # COUNTS payload: d values of the round's count_wire_dtype, or None


@dataclass(frozen=True)
class UserColumns:
    """Many users' messages as columns (proto UserColumns): user i has user_ids[i], the i-th nonce_bytes of
    `nonces` and, in a COUNTS round, the i-th row of `counts`, or a share of the sum of its group of sum_users
    (`sums`); neither counts nor sums is a payload-free check-in."""

    user_ids: Sequence[str]
    nonces: bytes
    nonce_bytes: int
    counts: bytes = b""
    sums: bytes = b""
    sum_users: int = 0
    # PRIO3, instead of sums: per group of sum_users users, (report_id, public_share, leader_share, sealed helper
    # share) of its Prio3SumVec report
    reports: Sequence[tuple[bytes, bytes, bytes, bytes]] = ()


@dataclass(frozen=True)
class Submission:
    run_id: str
    round: int
    node_id: str
    messages: Sequence[UserMessage] = ()
    refusals: Sequence[tuple[str, str]] = ()  # (user_id, reason)
    columns: UserColumns | None = None  # further users' messages, checked after `messages`


@dataclass(frozen=True)
class Ack:
    accepted: int
    rejected: dict[str, int]


@dataclass(frozen=True)
class BatchResult:
    """Everything the analyzer learns about a round: no ids, no order, no timing."""

    run_id: str
    round: int
    released: bool
    label_totals: np.ndarray | None  # COUNTS, released only
    ciphertexts: list[bytes]  # SEALED / BITS, released only, CSPRNG-permuted
    invited: int
    contributors: int
    rejected: dict[str, int]
    refused: int
    below_threshold: bool
    refused_reasons: dict[str, int] = field(default_factory=dict)  # the nodes' reasons, sanitized and bounded
    not_in_run: int = 0  # FULLY_INTERACTIVE: connected users who joined after the run's first round, not invited
    checked_in: int = 0  # check-in rounds: users who checked in
    eligible: int = 0  # SUBSAMPLED: the users the cohort was drawn from
    excluded_silent: int = 0  # check-in rounds: users left out for having checked in and then sent nothing
    # PRIO3, released only: the Helper's part of each report the Leader prepared (protocols.prio3.LeaderReport),
    # CSPRNG-permuted
    reports: Sequence[Any] = ()


@dataclass(frozen=True)
class Aggregate:
    """PRIO3: the Leader's answer to the Helper (FinishAggregation): its aggregate share when released."""

    released: bool
    aggregate_share: bytes
    reports: int
    contributors: int
    rejected: dict[str, int]


@dataclass(frozen=True)
class Population:
    admitted_users: int
    unused_users: int
    connected_nodes: int


@dataclass(frozen=True)
class Invite:
    relay: Any
    user_ids: Sequence[str]  # a NodeUserIds from the shuffler
    eligible: int = 0  # SUBSAMPLED: the users the cohort was drawn from (Invitation.eligible)


class NonceSet:
    """The nonces one round has seen (replay protection, design 5.3), as exact as a set of bytes. A node's batch of
    nonces of one width is kept as its rows (numpy void) sorted by their first 8 bytes: ~24 bytes per nonce, where a
    bytes object and its set slot took ~100 (issue 30 item 3). Single nonces (the per-message path) go in a set."""

    def __init__(self) -> None:
        self._single: set[bytes] = set()
        # width -> the first 8 bytes (little-endian) of the single nonces of that width: a batch is compared with
        # them in time of its own size, not of theirs (a node that sent 10^5 single messages made every later batch
        # of every node scan them all, under the state's lock)
        self._single_prefixes: dict[int, set[int]] = {}
        # width -> runs of (first 8 bytes as sorted uint64, the rows in that order); a run is merged into the one
        # before it once that one is at most twice its size (O(log n) runs, each row copied O(log n) times)
        self._runs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def __len__(self) -> int:
        return len(self._single) + sum(pre.size for runs in self._runs.values() for pre, _ in runs)

    @staticmethod
    def _prefixes(blob: bytes, width: int, n: int) -> np.ndarray:
        return np.ndarray((n,), dtype="<u8", buffer=blob, strides=(width,))  # widths are >= NONCE_MIN_BYTES >= 8

    def __contains__(self, nonce: bytes) -> bool:
        if nonce in self._single:
            return True
        runs = self._runs.get(len(nonce), ())
        if not runs:
            return False
        p = np.uint64(int.from_bytes(nonce[:8], "little"))
        for pre, rows in runs:
            a, b = int(np.searchsorted(pre, p, "left")), int(np.searchsorted(pre, p, "right"))
            if any(rows[i].tobytes() == nonce for i in range(a, b)):
                return True
        return False

    def add(self, nonce: bytes) -> None:
        self._single.add(nonce)
        if len(nonce) >= 8:
            self._single_prefixes.setdefault(len(nonce), set()).add(int.from_bytes(nonce[:8], "little"))

    def add_batch(self, blob: bytes, width: int, n: int) -> bool:
        """Add the n nonces of `width` bytes in `blob` and return True if no two of them, and none of them and a
        nonce seen before, share their first 8 bytes; else add nothing and return False (the caller checks them one
        by one, exactly: random 16-byte nonces share 8 bytes with probability ~n^2 / 2^65)."""
        pre = self._prefixes(blob, width, n)
        order = np.argsort(pre, kind="stable")
        pre = pre[order]
        if n > 1 and bool((pre[1:] == pre[:-1]).any()):
            return False
        for old, _ in self._runs.get(width, ()):
            at = np.minimum(np.searchsorted(old, pre), old.size - 1)
            if bool((old[at] == pre).any()):
                return False
        seen = self._single_prefixes.get(width)
        if seen:
            if len(seen) <= n:  # O(n) either way: the smaller side is looked up in the larger
                hit = bool(np.isin(np.fromiter(seen, dtype=np.uint64, count=len(seen)), pre).any())
            else:
                hit = not seen.isdisjoint(pre.tolist())
            if hit:
                return False
        runs = self._runs.setdefault(width, [])
        runs.append((pre, np.frombuffer(blob, dtype=f"V{width}")[order]))
        while len(runs) > 1 and runs[-2][0].size <= 2 * runs[-1][0].size:
            (p1, r1), (p2, r2) = runs.pop(), runs.pop()
            p, r = np.concatenate([p2, p1]), np.concatenate([r2, r1])
            o = np.argsort(p, kind="stable")
            runs.append((p[o], r[o]))
        return True


@dataclass
class OpenRound:
    req: RoundRequest
    deadline: float
    invited: AbstractSet[str]  # user keys (user_key), the admitted key objects themselves
    expected_messages: int
    expected_ct_len: int
    bound: int  # g + m
    not_in_run: int
    wire_dtype: np.dtype | None  # COUNTS: CountVector.packed is count_wire_dtype(g + m); None otherwise
    drawn_from: int = 0  # SUBSAMPLED: the users the cohort was drawn from (_Selection)
    excluded_silent: int = 0
    checking_in: bool = False  # check-in rounds: the first invitation's answers are being collected
    second_invitation: bool = False  # check-in rounds: the checked-in users were invited to report
    # check-in rounds: per node, its users' keys that checked in, in the order they did
    checked_in: dict[str, list[str]] = field(default_factory=dict)
    by_node: dict[str, list[str]] = field(default_factory=dict)  # the first invitation's users per node
    # check-in rounds, once some invitees did not check in: the first invitation's users (the set `invited` was), so
    # that a check-in or refusal of theirs after the check-in window is refused as late (EXPIRED_ROUND), not as
    # from a stranger (NOT_INVITED)
    first_invited: AbstractSet[str] = frozenset()
    answered: set[str] = field(default_factory=set)  # user keys (user_key)
    nonces: NonceSet = field(default_factory=lambda: NonceSet())  # replay protection; dropped with the round (5.3)
    totals: np.ndarray | None = None  # COUNTS running per-label total (uint64); per-user counts never kept
    ciphertexts: list[bytes] = field(default_factory=list)
    # PRIO3: the accepted reports (report_id, public_share, leader_share, sealed helper share, users), unread, until
    # the round's preparer takes them (ShufflerState._prepare_arrivals); what it made of them (LeaderReports), and
    # the users of those that did not decode, by reason
    reports: list[tuple[bytes, bytes, bytes, bytes, int]] = field(default_factory=list)
    prepared: list[Any] = field(default_factory=list)
    prep_rejected: Counter = field(default_factory=Counter)
    preparer: Any = None  # PRIO3: the round's preparer thread
    report_ids: set[bytes] = field(default_factory=set)  # PRIO3: the run's report ids so far (replays, design 5.3)
    encapsulations: set[bytes] = field(default_factory=set)  # SEALED/BITS: of the ciphertexts accepted (replays)
    contributors: int = 0
    refused: int = 0
    refused_reasons: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    closed: bool = False
    # the round's report goal (RoundRequest.report_goal) was reached: it takes nothing more (over-selection)
    goal_reached: bool = False
    is_active: Callable[[], bool] = lambda: True  # whether the analyzer still waits for the round (execute_round)

    @property
    def n_checked_in(self) -> int:
        return sum(map(len, self.checked_in.values()))
