"""The shuffler's domain logic, transport-independent (design sections 1 and 5; issue 4 item 4).

The shuffler is the anonymizer between client nodes and the analyzer. It knows user ids (admission, cohort
selection, participation limits, replay protection) but forwards to the analyzer only what the protocol's
view allows: per-label totals and the number of contributors (COUNTS, design 5.2; spec 000 sec 8 "count mode":
the multiset of per-user counts would reveal more than the sum, so per-user counts are never kept, they are
added into a running total on arrival), or ciphertexts only in a CSPRNG-permuted order (SEALED / BITS, design
5.1). Ids, node names, nonces, arrival times and arrival order never leave this class.

Everything that arrives is validated (design 5.3) and counted per reason; nothing invalid is aggregated.
Randomness (cohorts, permutation) comes from an injected CSPRNG Generator (shuffledp.security.rng), time from an
injected clock, participation records from an injected store (in-memory or SQLite, same interface).
"""

from __future__ import annotations

import math
import operator
import queue
import sqlite3
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from shuffledp.durable import INTEGER_LIMIT, open_durable, transaction
from shuffledp.mechanisms import check_in
from shuffledp.mechanisms.pvec import count_wire_dtype
from shuffledp.security.rng import make_rng
from shuffledp.security.sealing import BIT_MESSAGE_BYTES, ENC_BYTES, PUBLIC_KEY_BYTES, sealed_length
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
    "Submission",
    "Ack",
    "BatchResult",
    "Population",
    "Subscription",
    "ParticipationStore",
    "MemoryParticipationStore",
    "SqliteParticipationStore",
    "ShufflerState",
]

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


_PAYLOAD_REASONS = frozenset(
    {
        Reason.WRONG_PAYLOAD,
        Reason.WRONG_COUNT_LENGTH,
        Reason.COUNT_OUT_OF_RANGE,
        Reason.WRONG_MESSAGE_COUNT,
        Reason.WRONG_CIPHERTEXT_LENGTH,
        Reason.REPLAYED_MESSAGE,
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
MAX_BIT_MESSAGES_PER_USER = 2**20  # bit mode is for small settings only (spec 000 sec 8)
MAX_USERS_PER_NODE = 2**20  # what one node identity may register: bounds the memory a node can make us hold
MAX_REFUSAL_REASONS = 16  # distinct refusal reasons kept per round; further ones are counted as "other"
MAX_REASON_CHARS = 64
RECENT_CLOSED_ROUNDS = 4096  # closed rounds remembered in memory (late messages to them count as expired_round)
_U64 = 2**64
_PROTO_BYTES_OVERHEAD = 6  # tag + length varint of one ciphertext in ShuffledBatch.ciphertexts (<= 2^28 bytes)


def user_key(node_id: str, user_id: str) -> str:
    """A user's identity at the shuffler: its id within the node identity that registered it (issue 10 item 1).

    Ids are scoped by node, so one node cannot take, or block, another node's user ids (they are predictable), and
    a node can only ever speak for its own users. The separator is not printable, so it occurs in no checked id.
    """
    return f"{node_id}\n{user_id}"


def user_keys(node_id: str, user_ids: Iterable[str]) -> Iterable[str]:
    """user_key of each id, lazily and without a Python step per id (a key can be dropped as soon as it was looked
    up: a batch of 10^6 ids need not hold 10^6 new strings at once)."""
    return map(user_key(node_id, "").__add__, user_ids)


def split_user_key(key: str) -> tuple[str, str]:
    """(node_id, user_id) of a user_key."""
    node_id, user_id = key.split("\n", 1)
    return node_id, user_id


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
    relay: Any = None
    second_relay: Callable[[int, int, int], Any] | None = None  # check-in: (c, c_min, m) -> the second spec


class TreeLimits(NamedTuple):
    """Per-tree participation limits (spec 003 sec 3; RoundSpec.participation): in one tree of rounds_per_tree
    consecutive rounds (0: one tree), a user joins at most max_per_tree rounds, with at least min_separation
    rounds strictly between two of them (the tree accountant's convention, tree_aggregation module docstring)."""

    max_per_tree: int
    min_separation: int
    rounds_per_tree: int

    def position(self, round_index: int) -> tuple[int, int]:
        """(tree, leaf) of a round."""
        if self.rounds_per_tree == 0:
            return 0, round_index
        return divmod(round_index, self.rounds_per_tree)

    def allows(self, leaves: Sequence[int], leaf: int) -> bool:
        """Whether a user with these leaves in the tree may also take `leaf`."""
        return len(leaves) < self.max_per_tree and all(abs(leaf - x) - 1 >= self.min_separation for x in leaves)


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


@dataclass(frozen=True)
class Population:
    admitted_users: int
    unused_users: int
    connected_nodes: int


class NodeUserIds(Sequence[str]):
    """The node's own ids of some of its users, read from their user keys when asked (user_key: node id, newline,
    id): an invitation waiting to be sent holds one reference per user, to its admitted key, not a fresh id string
    each (issue 30 item 3). Equal to any sequence of the same ids."""

    __slots__ = ("_keys", "_skip")

    def __init__(self, node_id: str, keys: list[str]) -> None:
        self._keys, self._skip = keys, len(node_id) + 1

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [k[self._skip :] for k in self._keys[i]]
        return self._keys[i][self._skip :]

    def __iter__(self):
        return map(operator.itemgetter(slice(self._skip, None)), self._keys)  # k[skip:] of each, in C

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"NodeUserIds({list(self)!r})"


@dataclass(frozen=True)
class Invite:
    relay: Any
    user_ids: Sequence[str]  # a NodeUserIds from the shuffler
    eligible: int = 0  # SUBSAMPLED: the users the cohort was drawn from (Invitation.eligible)


_CLOSED = object()
_CHECK_IN = object()  # _check_message: a valid payload-free answer to a check-in invitation


class Subscription:
    """One node's stream (a queue of Invites, and on a Connect stream of the results of its contributions); closed
    when the node reconnects or the stream ends."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._q: queue.Queue[Any] = queue.Queue()
        self.closed = False

    def put(self, item: Any) -> None:
        self._q.put(item)

    def close(self) -> None:
        self.closed = True
        self._q.put(_CLOSED)

    def get(self, timeout: float) -> Any:
        """Next item (an Invite, or what the stream's server put), None on timeout; raises EOFError once closed."""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _CLOSED:
            raise EOFError(f"subscription of node {self.node_id!r} closed")
        return item


# ---------------------------------------------------------------------------------------------------------------
# participation record (who was in which round of which run): in-memory and SQLite behind one interface
# ---------------------------------------------------------------------------------------------------------------
class ParticipationStore(Protocol):
    def used_users(self, run_id: str) -> AbstractSet[str]:
        """The run's consumed users: a read-only view kept up to date by record_round, not a copy (a sequential
        run's 10^5 users are not read again at every round, issue 30 item 4)."""
        ...

    def run_population(self, run_id: str) -> AbstractSet[str] | None:
        """A fully interactive run's users, fixed at its first round; None before it. A read-only view, not a copy
        (10^6 users are not read again at every round, issue 30 item 3)."""
        ...

    def run_limits(self, run_id: str) -> TreeLimits | None:
        """The run's participation limits, fixed at its first limited round; None before it."""
        ...

    def tree_leaves(self, run_id: str, tree: int) -> dict[str, list[int]]:
        """Each user's leaves (rounds) in one tree of the run."""
        ...

    def round_exists(self, run_id: str, round_index: int) -> bool: ...

    def record_round(
        self,
        run_id: str,
        round_index: int,
        schedule: int,
        sequential_users: Iterable[str],
        population: Iterable[str] = (),
        limits: TreeLimits | None = None,
        tree_users: Iterable[str] = (),
    ) -> None:
        """Atomically record that the round ran, which users it consumed, (a fully interactive run's first round)
        the run's population, and (limited rounds) the limits and the users who took the round's leaf;
        RoundExistsError if it ran."""
        ...


class MemoryParticipationStore:
    def __init__(self) -> None:
        self._rounds: set[tuple[str, int]] = set()
        self._used: dict[str, set[str]] = {}
        self._population: dict[str, frozenset[str]] = {}
        self._limits: dict[str, TreeLimits] = {}
        self._leaves: dict[tuple[str, int], dict[str, list[int]]] = {}

    def used_users(self, run_id: str) -> AbstractSet[str]:
        return self._used.get(run_id, frozenset())

    def run_population(self, run_id: str) -> AbstractSet[str] | None:
        return self._population.get(run_id)

    def run_limits(self, run_id: str) -> TreeLimits | None:
        return self._limits.get(run_id)

    def tree_leaves(self, run_id: str, tree: int) -> dict[str, list[int]]:
        return {u: list(v) for u, v in self._leaves.get((run_id, tree), {}).items()}

    def round_exists(self, run_id: str, round_index: int) -> bool:
        return (run_id, round_index) in self._rounds

    def record_round(
        self,
        run_id: str,
        round_index: int,
        schedule: int,
        sequential_users: Iterable[str],
        population: Iterable[str] = (),
        limits: TreeLimits | None = None,
        tree_users: Iterable[str] = (),
    ) -> None:
        if (run_id, round_index) in self._rounds:
            raise RoundExistsError(f"round {round_index} of run {run_id!r} was already executed")
        pop = frozenset(population)
        if pop and run_id in self._population:
            raise RoundExistsError(f"the population of run {run_id!r} was already fixed")
        self._rounds.add((run_id, round_index))
        self._used.setdefault(run_id, set()).update(sequential_users)
        if pop:
            self._population[run_id] = pop
        if limits is not None:
            self._limits.setdefault(run_id, limits)
            tree, leaf = limits.position(round_index)
            leaves = self._leaves.setdefault((run_id, tree), {})
            for u in tree_users:
                leaves.setdefault(u, []).append(leaf)


class SqliteParticipationStore:
    """Durable participation record (WAL): after a shuffler restart no sequential user is invited again."""

    def __init__(self, path: str | Path) -> None:
        self._db = open_durable(path)  # a consumed user must survive a crash
        self._lock = threading.Lock()
        self._used: dict[str, set[str]] = {}  # by run, read once, then added to by record_round (this process only)
        self._population: dict[str, frozenset[str]] = {}  # by run, read once (or kept from record_round)
        with self._lock:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS rounds (run_id TEXT NOT NULL, round INTEGER NOT NULL, "
                "schedule INTEGER NOT NULL, started REAL NOT NULL, PRIMARY KEY (run_id, round))"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS participation (run_id TEXT NOT NULL, user_id TEXT NOT NULL, "
                "round INTEGER NOT NULL, PRIMARY KEY (run_id, user_id))"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS population (run_id TEXT NOT NULL, user_id TEXT NOT NULL, "
                "PRIMARY KEY (run_id, user_id))"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS tree_limits (run_id TEXT PRIMARY KEY, max_per_tree INTEGER NOT NULL, "
                "min_separation INTEGER NOT NULL, rounds_per_tree INTEGER NOT NULL)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS tree_leaves (run_id TEXT NOT NULL, tree INTEGER NOT NULL, "
                "user_id TEXT NOT NULL, leaf INTEGER NOT NULL, PRIMARY KEY (run_id, tree, user_id, leaf))"
            )

    def used_users(self, run_id: str) -> AbstractSet[str]:
        with self._lock:
            return self._used_locked(run_id)

    def _used_locked(self, run_id: str) -> set[str]:
        used = self._used.get(run_id)
        if used is None:
            rows = self._db.execute("SELECT user_id FROM participation WHERE run_id = ?", (run_id,)).fetchall()
            used = self._used[run_id] = {r[0] for r in rows}
        return used

    def run_population(self, run_id: str) -> AbstractSet[str] | None:
        with self._lock:
            pop = self._population.get(run_id)
            if pop is None:
                rows = self._db.execute("SELECT user_id FROM population WHERE run_id = ?", (run_id,)).fetchall()
                if not rows:
                    return None
                pop = self._population[run_id] = frozenset(r[0] for r in rows)
            return pop

    def run_limits(self, run_id: str) -> TreeLimits | None:
        with self._lock:
            row = self._db.execute(
                "SELECT max_per_tree, min_separation, rounds_per_tree FROM tree_limits WHERE run_id = ?", (run_id,)
            ).fetchone()
        return None if row is None else TreeLimits(*map(int, row))

    def tree_leaves(self, run_id: str, tree: int) -> dict[str, list[int]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT user_id, leaf FROM tree_leaves WHERE run_id = ? AND tree = ?", (run_id, int(tree))
            ).fetchall()
        out: dict[str, list[int]] = {}
        for u, leaf in rows:
            out.setdefault(u, []).append(int(leaf))
        return out

    def round_exists(self, run_id: str, round_index: int) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM rounds WHERE run_id = ? AND round = ?", (run_id, int(round_index))
            ).fetchone()
        return row is not None

    def record_round(
        self,
        run_id: str,
        round_index: int,
        schedule: int,
        sequential_users: Iterable[str],
        population: Iterable[str] = (),
        limits: TreeLimits | None = None,
        tree_users: Iterable[str] = (),
    ) -> None:
        with self._lock:
            sequential_users = list(sequential_users)
            # a frozenset is kept as it is (below): the shuffler then holds one set of a run's users, not two
            population = population if isinstance(population, frozenset) else list(population)
            used = self._used_locked(run_id)
            try:
                with transaction(self._db) as db:
                    db.execute(
                        "INSERT INTO rounds (run_id, round, schedule, started) VALUES (?, ?, ?, ?)",
                        (run_id, int(round_index), int(schedule), time.time()),
                    )
                    db.executemany(
                        "INSERT INTO participation (run_id, user_id, round) VALUES (?, ?, ?)",
                        [(run_id, u, int(round_index)) for u in sequential_users],
                    )
                    db.executemany(
                        "INSERT INTO population (run_id, user_id) VALUES (?, ?)", ((run_id, u) for u in population)
                    )
                    # the run's whole population is this one (kept: these key objects, not a copy read back)
                    alone = bool(population) and db.execute(
                        "SELECT COUNT(*) FROM population WHERE run_id = ?", (run_id,)
                    ).fetchone()[0] == len(population)
                    if limits is not None:
                        db.execute("INSERT OR IGNORE INTO tree_limits VALUES (?, ?, ?, ?)", (run_id, *limits))
                        tree, leaf = limits.position(int(round_index))
                        db.executemany(
                            "INSERT INTO tree_leaves (run_id, tree, user_id, leaf) VALUES (?, ?, ?, ?)",
                            [(run_id, tree, u, leaf) for u in tree_users],
                        )
            except sqlite3.IntegrityError as exc:
                raise RoundExistsError(
                    f"round {round_index} of run {run_id!r} was already executed (or a user was reused): {exc}"
                ) from exc
            used.update(sequential_users)  # only once the transaction committed
            if population:  # added to the run's population: kept if it is all of it, else read once when asked
                if alone:
                    self._population[run_id] = frozenset(population)
                else:
                    self._population.pop(run_id, None)

    def close(self) -> None:
        with self._lock:
            self._db.close()


# ---------------------------------------------------------------------------------------------------------------
# the shuffler
# ---------------------------------------------------------------------------------------------------------------
class _Selection(NamedTuple):
    invited: list[str]
    consumed: list[str]  # SEQUENTIAL: the users this round uses up
    population: list[str]  # FULLY_INTERACTIVE, first round: the run's users from now on
    not_in_run: int  # FULLY_INTERACTIVE: connected users outside the run's population, not invited
    drawn_from: int = 0  # SUBSAMPLED: the users the cohort was drawn from
    excluded_silent: int = 0  # check-in rounds: users left out for their silence in an earlier round
    cohort: _Cohort | None = None  # FULLY_INTERACTIVE: the run's cohort as kept between rounds (invited is its list)


class _Cohort(NamedTuple):
    """A fully interactive run's invitees, kept between its rounds while the eligible users, the run's population
    and its silent users stay the same (the same users every round): built once, not per round (a Python step per
    user each: the population filter, the set, the grouping by node; ~10 % of the shuffler's CPU at 2 x 10^6 users).
    The price: its set stays in memory between rounds (~50 B per invitee), for the last COHORT_RUNS runs."""

    key: Any
    invited: list[str]
    invited_set: frozenset[str]
    by_node: dict[str, list[str]]  # node -> its invited users' keys, in the order of `invited`
    excluded: int  # check-in rounds: users of the run left out for their silence in an earlier round


COHORT_RUNS = 2  # fully interactive runs whose cohort ShufflerState keeps between rounds


@dataclass
class _OpenRound:
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


FRESH_MASK_RUNS = 8  # runs whose mask of fresh users ShufflerState keeps (one byte per eligible user each)


class _FreshUsers:
    """A run's eligible users not used yet: fresh[i] for eligible[i], for the eligible list of `key` and a used set
    of `used` users; `pending`: the positions of the last cohort drawn and the used count once it is recorded."""

    def __init__(self, key: Any, eligible: list[str], used: AbstractSet[str]) -> None:
        self.key = key
        self.fresh = np.fromiter((u not in used for u in eligible), dtype=bool, count=len(eligible))
        self.used = len(used)
        self.pending: tuple[np.ndarray, int] | None = None


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


def _limits_text(t: TreeLimits) -> str:
    per = f"trees of {t.rounds_per_tree} rounds" if t.rounds_per_tree else "one tree"
    return f"(at most {t.max_per_tree} rounds per user per tree, >= {t.min_separation} rounds apart, {per})"


def _refusal_reason(rnd: _OpenRound, why: str) -> str:
    """A node's refusal reason as counted and forwarded: printable, bounded in length and in distinct values (a
    node's free text must not let it grow the round's report, or carry more than a short label to the analyzer)."""
    why = why if isinstance(why, str) and why.isprintable() and 0 < len(why) <= MAX_REASON_CHARS else "unspecified"
    if why not in rnd.refused_reasons and len(rnd.refused_reasons) >= MAX_REFUSAL_REASONS:
        return "other"
    return why


def _by_node(keys: Sequence[str]) -> dict[str, list[str]]:
    """User keys grouped by their node (user_key: node id, newline, id), each node's in the order of `keys`."""
    by_node: dict[str, list[str]] = {}
    for k in keys:
        by_node.setdefault(k[: k.index("\n")], []).append(k)
    return by_node


def _check_id(name: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise ValueError(f"{name} must be a printable string of 1..{MAX_ID_CHARS} characters, got {value!r}")
    return value


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
        self._max_users_per_node = int(max_users_per_node)
        self._max_streams = int(max_streams)
        self._max_batch_bytes = int(max_batch_bytes)
        self._lock = threading.Condition()
        # user key (user_key) -> the same key object: the round's tables hold this one object per user, not a fresh
        # string per message (issue 30 item 3)
        self._admitted: dict[str, str] = {}
        self._node_users: dict[str, list[str]] = {}  # node -> its users' keys
        self._registrations = 0  # requests that admitted new users (the key of the _eligible_users cache)
        self._eligible: tuple[Any, list[str]] = (None, [])
        self._subs: dict[str, Subscription] = {}
        self._open: dict[tuple[str, int], _OpenRound] = {}
        # recently closed rounds, to tell a late message (expired) from a wrong one; bounded, so that the shuffler's
        # memory does not grow with the rounds it ran (a round is never executed twice: the durable record says so)
        self._closed: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._counters: Counter = Counter()
        # check-in rounds (issue 24 item 4): per run, users who checked in and then sent nothing; they are not
        # invited to check in again in that run, so that one silent node cannot hold back every release. Only
        # liveness rests on it (a lost set lets them in again); the noise guarantee rests on c_min and m alone
        self._silent: dict[str, set[str]] = {}
        # per run with used users (sequential), which eligible users are still fresh: _FreshUsers, a few runs only
        self._fresh: OrderedDict[str, _FreshUsers] = OrderedDict()
        self._cohorts: OrderedDict[str, _Cohort] = OrderedDict()  # per fully interactive run (_Cohort)
        # observer of each executed round (shuffledp/observability/metrics.py): its batch and its phases' durations in
        # seconds
        self.on_round: Callable[[BatchResult, dict[str, float]], None] | None = None

    # ----- nodes -----------------------------------------------------------------------------------------------
    def register_users(self, node_id: str, user_ids: Sequence[str]) -> tuple[int, int]:
        """Admit the node's users (ids scoped by node: user_key). Idempotent; the whole request is checked before
        anything is admitted, and a node holds at most max_users_per_node users.

        Returns (users of this request now admitted for this node, total admitted users).
        """
        _check_id("node_id", node_id)
        ids = list(user_ids)
        for u in ids:
            _check_id("user_id", u)
        if len(set(ids)) != len(ids):
            raise ValueError(f"user_ids of node {node_id!r} contain duplicates")
        with self._lock:
            keys = [user_key(node_id, u) for u in ids]
            new = [k for k in keys if k not in self._admitted]
            mine = self._node_users.get(node_id, [])
            if len(mine) + len(new) > self._max_users_per_node:
                raise QuotaExceeded(
                    f"node {node_id!r} would host {len(mine) + len(new)} users; at most {self._max_users_per_node} "
                    "per node identity"
                )
            mine.extend(new)  # in place: no copy of a node's 10^6 keys per request
            self._node_users[node_id] = mine
            self._registrations += bool(new)
            self._admitted.update(zip(new, new, strict=True))
            return len(keys), len(self._admitted)

    def set_max_streams(self, n: int) -> None:
        """How many nodes may hold an invitation stream at once (the server's threads for them)."""
        if n < 1:
            raise ValueError(f"max_streams must be >= 1, got {n}")
        with self._lock:
            self._max_streams = int(n)

    def subscribe(self, node_id: str, make: Callable[[str], Subscription] = Subscription) -> Subscription:
        """Open the node's invitation stream (`make(node_id)`: the Subscription, e.g. one that hands its items to an
        event loop); a previous stream of the same node is closed."""
        _check_id("node_id", node_id)
        sub = make(node_id)
        with self._lock:
            old = self._subs.get(node_id)
            if old is None and len(self._subs) >= self._max_streams:
                # the shuffler's capacity (serve shuffler --max-nodes): what it was sized for, memory above all
                raise QuotaExceeded(
                    f"{len(self._subs)} nodes are connected; the shuffler's capacity is {self._max_streams} nodes"
                )
            self._subs[node_id] = sub
        if old is not None:
            old.close()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.close()
        with self._lock:
            if self._subs.get(sub.node_id) is sub:
                del self._subs[sub.node_id]

    def _eligible_users(self) -> list[str]:
        """Admitted users on nodes with a live subscription, sorted (deterministic order for the CSPRNG draw). Kept
        until a node registers users or its stream opens or closes (not sorted again at every round: 10^6 keys take
        seconds); callers do not change it. Caller holds the lock."""
        key = (tuple(self._subs), self._registrations)
        if self._eligible[0] != key:
            users: list[str] = []
            for node in self._subs:
                users.extend(self._node_users.get(node, ()))
            users.sort()
            self._eligible = (key, users)
        return self._eligible[1]

    def population(self, run_id: str) -> Population:
        with self._lock:
            eligible = self._eligible_users()
            used = self._store.used_users(run_id) if run_id else set()
            # counted on the run's mask of fresh users (the analyzer asks before every round)
            unused = int(np.count_nonzero(self._fresh_users(run_id, eligible).fresh)) if used else len(eligible)
            return Population(len(eligible), unused, len(self._subs))

    def _fresh_users(self, run_id: str, eligible: list[str]) -> _FreshUsers:
        """The run's eligible users not used yet, as a mask over `eligible` (the current _eligible_users list). Kept
        between rounds: a round's cohort is taken off it when its record landed (the used count grew by exactly the
        cohort), and it is built again (a Python step per eligible user) only when the eligible users or the used
        ones changed otherwise. Caller holds the lock."""
        used = self._store.used_users(run_id)
        key = self._eligible[0]
        f = self._fresh.get(run_id)
        if f is not None and f.key == key and f.pending is not None and len(used) == f.pending[1]:
            f.fresh[f.pending[0]] = False  # the last cohort drawn from it was recorded as used
            f.used = len(used)
        if f is None or f.key != key or f.used != len(used):
            f = self._fresh[run_id] = _FreshUsers(key, eligible, used)
            while len(self._fresh) > FRESH_MASK_RUNS:
                self._fresh.popitem(last=False)
        self._fresh.move_to_end(run_id)
        f.pending = None
        return f

    def node_summary(self) -> dict[str, tuple[int, bool]]:
        """Per node identity: (its admitted users, whether it holds an invitation stream now). Counts only."""
        with self._lock:
            nodes = set(self._node_users) | set(self._subs)
            return {n: (len(self._node_users.get(n, ())), n in self._subs) for n in nodes}

    def counters(self) -> dict[str, int]:
        """Totals since start: rejections per reason, plus accepted / refused."""
        with self._lock:
            return dict(self._counters)

    # ----- rounds ----------------------------------------------------------------------------------------------
    def _validate(self, req: RoundRequest) -> tuple[int, int, int]:
        """Check a round request completely, before any state changes; returns (messages per user, ciphertext
        length, g+m)."""
        _check_id("run_id", req.run_id)
        if not 0 <= int(req.round) < INTEGER_LIMIT:  # the participation record stores it
            raise ValueError(f"round must lie in [0, 2^63), got {req.round}")
        if req.schedule == Schedule.STREAM:
            raise NotImplementedError("schedule STREAM is not implemented by this shuffler yet")
        if req.schedule not in (Schedule.SEQUENTIAL, Schedule.FULLY_INTERACTIVE, Schedule.SUBSAMPLED):
            raise ValueError(f"schedule must be SEQUENTIAL, FULLY_INTERACTIVE or SUBSAMPLED, got {req.schedule}")
        if req.transport not in (Transport.COUNTS, Transport.BITS, Transport.SEALED):
            raise ValueError(f"transport must be COUNTS, BITS or SEALED, got {req.transport}")
        if not (0.0 < req.deadline_seconds <= self._max_deadline) or not math.isfinite(req.deadline_seconds):
            raise ValueError(f"deadline_seconds must lie in (0, {self._max_deadline}], got {req.deadline_seconds}")
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
            if req.transport not in (Transport.COUNTS, Transport.BITS):
                raise ValueError(f"check_in applies to COUNTS and BITS rounds, not {req.transport.name}")
            if not (math.isfinite(req.check_in_fraction) and 0.0 < req.check_in_fraction <= 1.0):
                raise ValueError(f"check_in.report_fraction must lie in (0, 1], got {req.check_in_fraction}")
            if req.min_contributors < 1 or req.check_in_trials > int(req.m) * req.min_contributors:
                raise ValueError(
                    f"check_in.noise_trials = {req.check_in_trials} must be <= randomizer.m * min_contributors = "
                    f"{req.m} * {req.min_contributors} (min_contributors >= 1)"
                )
        bound = int(req.g) + int(req.m)
        if bound >= _U64:  # no count of any transport can reach it; refused here, before any state changes
            raise ValueError(f"g + m must be < 2^64, got g={req.g}, m={req.m}")
        if req.transport in (Transport.COUNTS, Transport.BITS):
            if req.dim < 1:
                raise ValueError(f"randomizer.dim must be >= 1 for {req.transport.name}, got {req.dim}")
            if req.g < 1 or req.m < 0:
                raise ValueError(f"randomizer g must be >= 1 and m >= 0, got g={req.g}, m={req.m}")
        if req.transport == Transport.COUNTS:
            # the released totals (d uint64) must fit one message the analyzer can receive
            if req.dim * 8 + _PROTO_BYTES_OVERHEAD > self._max_batch_bytes:
                raise ValueError(
                    f"randomizer.dim = {req.dim}: its per-label totals would exceed the {self._max_batch_bytes}-byte "
                    "batch message limit"
                )
            # every total is a sum of <= cohort counts in [0, g+m]; it must fit the uint64 wire type
            if max(req.cohort_size, len(self._admitted), 1) * bound >= _U64:
                raise ValueError(f"g+m = {bound} is too large: per-label totals would overflow uint64")
            return req.dim, 0, bound
        if len(req.analyzer_public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(
                f"analyzer_public_key must be a raw {PUBLIC_KEY_BYTES}-byte X25519 key for {req.transport.name}, "
                f"got {len(req.analyzer_public_key)} bytes"
            )
        if req.transport == Transport.BITS:
            per_user = req.dim * bound  # Alg 2 of paper 000: d (g+m) labelled bits per user
            if per_user > MAX_BIT_MESSAGES_PER_USER:
                raise ValueError(
                    f"BITS would need d*(g+m) = {per_user} messages per user (> {MAX_BIT_MESSAGES_PER_USER}); "
                    "use COUNTS"
                )
            if req.message_bytes not in (0, BIT_MESSAGE_BYTES):
                raise ValueError(
                    f"randomizer.message_bytes must be {BIT_MESSAGE_BYTES} for BITS, got {req.message_bytes}"
                )
            return per_user, sealed_length(BIT_MESSAGE_BYTES), bound
        per_user = req.messages_per_user or 1
        if req.message_bytes < 1:
            raise ValueError(f"randomizer.message_bytes must be >= 1 for SEALED, got {req.message_bytes}")
        return per_user, sealed_length(req.message_bytes), bound

    def _select(self, req: RoundRequest) -> _Selection:
        """Who is invited, which sequential users it consumes, the population it fixes. Caller holds the lock."""
        limits_of_run = self._store.run_limits(req.run_id)
        if limits_of_run is not None and limits_of_run != req.limits:  # a spec without them would escape them too
            asks = "none" if req.limits is None else _limits_text(req.limits)
            raise ValueError(
                f"run {req.run_id!r} has participation limits {_limits_text(limits_of_run)}; this round asks {asks}"
            )
        eligible = self._eligible_users()
        k = req.cohort_size
        if req.schedule == Schedule.FULLY_INTERACTIVE:
            # every user of the run in every round (PGD, Alg 5). The run's users are those connected at its first
            # round: PGD optimises over one fixed data set, and the analyzer sized every round's noise and its
            # contributor bound for that population. A node that joins later is not invited to this run (its
            # users are counted in the report, under NOT_IN_RUN); one that left and came back is.
            fixed = self._store.run_population(req.run_id)
            silent = self._silent.get(req.run_id, set()) if req.check_in_trials else set()
            # the population is fixed once set and the silent set only grows: their sizes name their versions
            version = (self._eligible[0], None if fixed is None else len(fixed), len(silent))
            cohort = self._cohorts.get(req.run_id)
            if cohort is None or cohort.key != version:
                invited = eligible if fixed is None else [u for u in eligible if u in fixed]
                if len(invited) == len(eligible):
                    invited = eligible  # the same users (the usual case): no second list of them
                excluded = 0
                if silent:
                    kept = [u for u in invited if u not in silent]
                    invited, excluded = kept, len(invited) - len(kept)
                # all of the run's population: the set the store keeps of it is this set (invited is a part of it)
                whole = isinstance(fixed, frozenset) and len(invited) == len(fixed)
                invited_set = fixed if whole else frozenset(invited)
                cohort = _Cohort(version, invited, invited_set, _by_node(invited), excluded)
                self._cohorts[req.run_id] = cohort
                while len(self._cohorts) > COHORT_RUNS:
                    self._cohorts.popitem(last=False)
            self._cohorts.move_to_end(req.run_id)
            invited, excluded = cohort.invited, cohort.excluded
            if not invited:
                raise CohortUnavailable(
                    f"all {excluded} connected users of the run checked in and then sent nothing in an earlier round"
                    if excluded
                    else "no admitted users on connected nodes"
                    if fixed is None
                    else f"none of the run's {len(fixed)} users is connected"
                )
            if k not in (0, len(invited) + excluded):
                raise CohortUnavailable(
                    f"FULLY_INTERACTIVE cohort_size={k} but {len(invited)} admitted users are connected"
                    + ("" if fixed is None else " of the run's population")
                )
            not_in_run = len(eligible) - len(invited) - excluded
            # the first round fixes the population: as the cohort's set, which the store then keeps (frozenset of a
            # frozenset is the same object), so the shuffler holds one set of the run's users, not two
            population = [] if fixed is not None else cohort.invited_set if invited is eligible else eligible
            return _Selection(invited, [], population, not_in_run, excluded_silent=excluded, cohort=cohort)
        if req.schedule == Schedule.SUBSAMPLED and len(eligible) < req.population:
            # the accountant's rate k/n (issue 24 item 3): drawing from fewer users would sample each at a higher
            # rate than the round is charged at; refused before anyone is invited
            raise CohortUnavailable(
                f"SUBSAMPLED round is accounted for a population of {req.population} users but only "
                f"{len(eligible)} are eligible"
            )
        if req.sampling_rate > 0.0:
            # each eligible user independently with probability q (CSPRNG): the cohort may be empty
            take = self._rng.random(len(eligible)) < req.sampling_rate
            chosen = [eligible[i] for i in np.flatnonzero(take)]
            return _Selection(chosen, [], [], 0, len(eligible))
        if k < 1:
            raise ValueError(f"cohort_size must be >= 1 for {req.schedule.name}, got {k}")
        limited = ""
        fresh = None
        if req.schedule == Schedule.SEQUENTIAL:
            # fresh users only (disjoint cohorts), in eligible order: positions into eligible, no Python step per
            # user (a list of them cost O(n) lookups per round, slower as the used set grew: issue 30 item 4)
            fresh = self._fresh_users(req.run_id, eligible)
            pool = np.flatnonzero(fresh.fresh)
        elif req.limits is not None:
            # DP-FTRL (spec 003 sec 3-4): only users whose leaves in this tree leave room for this one. The limits
            # are the run's from its first round on: the tree accountant's (E, xi) describe every tree
            tree, leaf = req.limits.position(int(req.round))
            leaves = self._store.tree_leaves(req.run_id, tree)
            pool = [u for u in eligible if req.limits.allows(leaves.get(u, ()), leaf)]
            limited = f" under the limits {_limits_text(req.limits)} (tree {tree}, round {leaf} in it)"
        else:
            pool = eligible  # SUBSAMPLED: uniform k of n, secret (seed 001)
        if len(pool) < k:
            raise CohortUnavailable(
                f"{req.schedule.name} round needs cohort_size={k} users but only {len(pool)} are eligible{limited}"
            )
        idx = self._rng.choice(len(pool), size=k, replace=False)  # uniform k-subset from the CSPRNG
        if fresh is not None:
            at = pool[np.sort(idx)]
            chosen = [eligible[i] for i in at.tolist()]
            fresh.pending = (at, fresh.used + k)  # taken off the mask once recorded (_fresh_users)
            return _Selection(chosen, chosen, [], 0)
        chosen = [pool[i] for i in np.sort(idx)]
        return _Selection(chosen, [], [], 0, len(pool))

    def _check_batch_size(self, req: RoundRequest, invited: int, per_user: int, ct_len: int) -> None:
        """A released SEALED / BITS batch holds up to invited * per_user ciphertexts: it must fit one gRPC message
        the analyzer can receive (grpc_options.BATCH_MESSAGE_BYTES), or it could never be delivered. COUNTS: the
        invitees' totals must fit uint64 (_validate checked it for the users admitted then, outside the lock; users
        admitted since could make a cohort larger). Caller holds the lock."""
        if req.transport == Transport.COUNTS:
            bound = int(req.g) + int(req.m)
            if invited * bound >= _U64:
                raise ValueError(f"g+m = {bound} is too large: the totals of {invited} users would overflow uint64")
            return
        worst = invited * per_user * (ct_len + _PROTO_BYTES_OVERHEAD)
        if worst > self._max_batch_bytes:
            raise ValueError(
                f"{req.transport.name} round of {invited} users x {per_user} messages of {ct_len} bytes: the batch "
                f"could reach {worst} bytes, above the {self._max_batch_bytes}-byte message limit; use fewer users"
                + (" or COUNTS" if req.transport == Transport.BITS else "")
            )

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
            self._check_batch_size(req, len(invited), per_user, ct_len)
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
            rnd = _OpenRound(
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
            rnd.checking_in = req.check_in_trials > 0
            rnd.is_active = is_active
            self._open[key] = rnd
            rnd.by_node = sel.cohort.by_node if sel.cohort is not None else _by_node(invited)
            self._invite(rnd, req.relay, rnd.by_node)
            t1 = self._clock()
            try:
                # check-in: the first half of the window for the check-ins, the rest for the messages. The last
                # check-in sends the second invitation itself (submit); if the window closes first, it goes from here
                self._collect(rnd, is_active, self._clock() + req.deadline_seconds / 2 if rnd.checking_in else None)
                # an analyzer gone mid-check-in releases nothing: no second invitation for reports that would be lost
                if rnd.second_invitation or (rnd.checking_in and is_active() and self._second_invitation(rnd)):
                    self._collect(rnd, is_active)
            finally:
                rnd.closed = True
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
                    self._silent.setdefault(req.run_id, set()).update(silent)
            t2 = self._clock()
            batch = self._finish(rnd, released_ok=is_active(), invited=len(invited))
        if self.on_round is not None:
            self.on_round(batch, {"select": t1 - t0, "collect": t2 - t1, "release": self._clock() - t2})
        return batch

    def _invite(self, rnd: _OpenRound, relay: Any, invited: dict[str, list[str]]) -> None:
        """Send the invitation to the invited users' nodes (`invited`: node -> its users of rnd.invited, in the order
        they are listed to it); a SUBSAMPLED round's also to every node with eligible users, none of them invited (a
        notice: design 6, a cost relying on sampling counts every round a user was eligible for). Caller holds the
        lock."""
        by_node: dict[str, list[str]] = {}
        if rnd.req.schedule == Schedule.SUBSAMPLED:  # the eligible users are those of the live nodes
            by_node.update((node, []) for node in self._subs if self._node_users.get(node))
        by_node.update(invited)
        for node, keys in by_node.items():
            users = NodeUserIds(node, keys)  # the node's own ids of the users
            sub = self._subs.get(node)
            # a node gone since its users checked in (the check-in's second invitation): they are dropouts, as if
            # the invitation had been lost on the way
            if sub is not None:
                sub.put(Invite(relay, users, rnd.drawn_from))

    def _collect(self, rnd: _OpenRound, is_active: Callable[[], bool], until: float | None = None) -> None:
        """Wait until every invitee answered, the round's report goal was reached, the round's deadline (or `until`)
        passed, or the round is cancelled. Caller holds the lock (released while waiting)."""
        end = rnd.deadline if until is None else min(until, rnd.deadline)
        while len(rnd.answered) < len(rnd.invited) and not rnd.goal_reached and is_active():
            remaining = end - self._clock()
            if remaining <= 0:
                break
            self._lock.wait(min(remaining, self._poll))

    def _second_invitation(self, rnd: _OpenRound) -> bool:
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

    def _finish(self, rnd: _OpenRound, released_ok: bool, invited: int) -> BatchResult:
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

    # ----- collection ------------------------------------------------------------------------------------------
    def _reject(self, rnd: _OpenRound | None, reason: Reason, rejected: Counter, n: int = 1) -> None:
        rejected[reason.value] += n
        self._counters[reason.value] += n
        if rnd is not None:
            rnd.rejected[reason.value] += n

    def submit(self, sub: Submission) -> Ack:
        """Validate and aggregate one node's contribution (design 5.3). Whole-contribution errors raise
        RoundRejected (counted once per message/refusal); per-message errors are counted and acknowledged."""
        rejected: Counter = Counter()
        _check_id("node_id", sub.node_id)
        with self._lock:
            key = (sub.run_id, int(sub.round))
            rnd = self._open.get(key)
            n_columns = len(sub.columns.user_ids) if sub.columns is not None else 0
            n_items = max(1, len(sub.messages) + len(sub.refusals) + n_columns)
            if rnd is None or rnd.closed or rnd.goal_reached or self._clock() >= rnd.deadline:
                reason = Reason.EXPIRED_ROUND if (key in self._closed or rnd is not None) else Reason.WRONG_ROUND
                self._reject(None, reason, rejected, n_items)
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
                checked = self._check_message(rnd, ukey, msg)
                if isinstance(checked, Reason):
                    self._reject(rnd, checked, rejected)
                    if checked in _PAYLOAD_REASONS:
                        # an identified invitee sent a malformed payload: its one answer is used up (no probing
                        # of the validator, and the round need not wait for it until the deadline)
                        rnd.answered.add(ukey)
                    continue
                rnd.answered.add(ukey)  # a valid answer, or a payload the range check may still reject
                if checked is _CHECK_IN:
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
                added, column_rows = self._check_columns(rnd, sub.node_id, sub.columns, rejected)
                accepted += added
            if rows or column_rows:
                block = np.frombuffer(b"".join(rows), dtype=rnd.wire_dtype).reshape(len(rows), rnd.req.dim)
                if column_rows:  # rows of the columns' counts, validated above to hold dim values each
                    table = np.frombuffer(sub.columns.counts, dtype=rnd.wire_dtype).reshape(-1, rnd.req.dim)
                    part = table if isinstance(column_rows, range) else table[column_rows]
                    block = part if not rows else np.concatenate([block, part])
                accepted += self._add_counts(rnd, block, rejected)
            for user_id, why in sub.refusals:
                ukey = user_key(sub.node_id, user_id)
                ukey = admitted.get(ukey, ukey)
                if ukey not in rnd.invited:
                    outside = Reason.NOT_INVITED if ukey in self._admitted else Reason.UNKNOWN_USER
                    self._reject(rnd, Reason.EXPIRED_ROUND if ukey in rnd.first_invited else outside, rejected)
                elif ukey in rnd.answered:
                    self._reject(rnd, Reason.DUPLICATE_USER, rejected)
                else:
                    rnd.answered.add(ukey)
                    rnd.refused += 1
                    rnd.refused_reasons[_refusal_reason(rnd, why)] += 1
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

    def _add_counts(self, rnd: _OpenRound, block: np.ndarray, rejected: Counter) -> int:
        """Range-check COUNTS payloads (rows of d values of rnd.wire_dtype) and add the valid ones into the running
        total, one vectorized pass; returns how many were added. Caller holds the lock."""
        ok = block.max(axis=1) <= rnd.bound  # unsigned: never negative, so [0, g+m] is this one bound
        n_ok = int(np.count_nonzero(ok))
        if n_ok < len(block):
            self._reject(rnd, Reason.COUNT_OUT_OF_RANGE, rejected, len(block) - n_ok)
            block = block[ok]
        # running total only, per-user counts are not kept (spec 000 sec 8); no overflow: _validate bounds
        # cohort * (g+m) below 2^64
        rnd.totals += block.sum(axis=0, dtype=np.uint64)
        rnd.contributors += n_ok
        return n_ok

    def _check_sender(self, rnd: _OpenRound, ukey: str, nonce: bytes) -> Reason | None:
        """The checks of design 5.3 on who sent a message (nonce, user, invitation, one answer), in order; when all
        pass the nonce is recorded. Caller holds the lock."""
        if not NONCE_MIN_BYTES <= len(nonce) <= NONCE_MAX_BYTES:
            return Reason.BAD_NONCE
        if nonce in rnd.nonces:
            return Reason.REPLAYED_NONCE
        if ukey not in self._admitted:
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

    def _check_columns(
        self, rnd: _OpenRound, node_id: str, cols: UserColumns, rejected: Counter
    ) -> tuple[int, list[int] | range]:
        """Every check of _check_message for each user of `cols`, with the same outcome and counts as one
        UserMessage per user in column order; returns (check-ins accepted or users added by their sums, rows of
        cols.counts left for the range check). An honest batch passes the sender checks as set operations, without
        a Python step per user (issue 15: the per-message checks were the shuffler's hot loop). Caller holds the
        lock."""
        n, width = len(cols.user_ids), int(cols.nonce_bytes)
        # the admitted key objects, None for an id never admitted; no set of the batch's keys is built (issue 30
        # item 3: at 10^6 users per node the batch's own key strings and their set were ~100 MiB of the peak)
        keys = list(map(self._admitted.get, user_keys(node_id, cols.user_ids)))
        if not NONCE_MIN_BYTES <= width <= NONCE_MAX_BYTES or len(cols.nonces) != n * width:
            self._reject(rnd, Reason.BAD_NONCE, rejected, n)  # every nonce has a bad length, or none is defined
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
                why = self._check_sender(rnd, ukey, nonce)
                if why is None:
                    rnd.answered.add(ukey)
                    good.append(i)
                else:
                    self._reject(rnd, why, rejected)
        if not good:
            return 0, []
        row_bytes = rnd.req.dim * rnd.wire_dtype.itemsize if rnd.wire_dtype is not None else 0
        if rnd.checking_in:  # a check-in carries no payload (CheckIn)
            if cols.counts or cols.sums:
                self._reject(rnd, Reason.WRONG_PAYLOAD, rejected, len(good))
                return 0, []
            rnd.checked_in.setdefault(node_id, []).extend(keys if isinstance(good, range) else (keys[i] for i in good))
            return len(good), []
        # exactly one COUNTS form: both set would leave open which one is the users' answer
        if rnd.req.transport != Transport.COUNTS or bool(cols.counts) == bool(cols.sums):
            self._reject(rnd, Reason.WRONG_PAYLOAD, rejected, len(good))
            return 0, []
        if cols.sums:
            return self._add_sums(rnd, cols, good, rejected), []
        if len(cols.counts) != n * row_bytes:  # rows cannot be told apart: none has the round's length
            self._reject(rnd, Reason.WRONG_COUNT_LENGTH, rejected, len(good))
            return 0, []
        return 0, good

    def _add_sums(self, rnd: _OpenRound, cols: UserColumns, good: list[int] | range, rejected: Counter) -> int:
        """Range-check the group sums of cols (UserColumns.sums) whose users all passed the sender checks (`good`)
        and add them into the running total; returns the users added. A sum of s users is accepted in [0, s (g + m)]
        per coordinate: exactly the sums of s counts in [0, g + m] each, so a node's users can move the totals no
        further than with one row each (design 5.3). A group with a refused user cannot be split: its other users
        are rejected (PARTIAL_SUM). Caller holds the lock."""
        n, d, size = len(cols.user_ids), rnd.req.dim, int(cols.sum_users)
        groups = -(-n // size) if size > 0 else 0
        if not groups or len(cols.sums) != groups * d * 8:  # the sums cannot be told apart
            self._reject(rnd, Reason.WRONG_COUNT_LENGTH, rejected, len(good))
            return 0
        starts = np.arange(0, n, size)
        sizes = np.minimum(starts + size, n) - starts
        ok = np.zeros(n, dtype=np.int64)
        ok[np.asarray(good, dtype=np.int64)] = 1
        good_in = np.add.reduceat(ok, starts)  # users of each group that passed the sender checks
        whole = good_in == sizes
        partial = int(good_in[~whole].sum())  # a group none of whose users passed has no one left to reject
        if partial:
            self._reject(rnd, Reason.PARTIAL_SUM, rejected, partial)
        sums, sizes = np.frombuffer(cols.sums, dtype="<u8").reshape(groups, d)[whole], sizes[whole]
        if not len(sums):
            return 0
        # no overflow: a whole group's users are distinct admitted users, and _validate bounds users * (g+m) < 2^64
        in_range = sums.max(axis=1) <= sizes.astype(np.uint64) * np.uint64(rnd.bound)
        if not np.all(in_range):
            self._reject(rnd, Reason.COUNT_OUT_OF_RANGE, rejected, int(sizes[~in_range].sum()))
        added = int(sizes[in_range].sum())
        rnd.totals += sums[in_range].sum(axis=0, dtype=np.uint64)
        rnd.contributors += added
        return added

    def _check_message(self, rnd: _OpenRound, ukey: str, msg: UserMessage) -> Reason | bytes | object | None:
        """First failing check of design 5.3 for one user message (a Reason), else for COUNTS the payload as
        d values of rnd.wire_dtype (bytes; its range is checked by _add_counts), else None. Caller holds the lock."""
        why = self._check_sender(rnd, ukey, bytes(msg.nonce))
        if why is not None:
            return why
        if rnd.checking_in:  # a check-in carries no payload (CheckIn)
            empty = msg.counts is None and msg.counts_packed is None and msg.ciphertexts is None
            return _CHECK_IN if empty else Reason.WRONG_PAYLOAD
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
