"""The analyzer's durable privacy ledger (design section 6): SQLite in WAL mode, one row per round.

Life of a round:

    reserve(run, r, event)   BEFORE the round spec leaves the analyzer. The event is charged at its worst case
                             (contributors = the threshold min_contributors, the fewest a released batch can
                             have), so a later commit can never cost more. Refused with BudgetExceeded(spent,
                             requested, limit) if the projected run total would exceed the run's (eps, delta).
    commit(run, r, n')       when the batch is used; the cost is recomputed with the n' actually aggregated.
    release(run, r, reason)  only when no batch was delivered (the shuffler answered "below threshold" or refused
                             the spec): the round costs nothing.
    recover()                at start-up: every round still "reserved" has an unknown outcome (the analyzer died
                             between reserve and commit/release) and becomes "spent_unknown", charged at its
                             reserved (worst-case) cost forever.

Totals (spec 000 sec 5): sequential rounds use disjoint cohorts, so they compose in PARALLEL (run total = the
worst single round); fully interactive rounds compose sequentially: calibrated -> composition of the exact PVEC
rounds (composed_epsilon of shuffledp.accountants.pvec_pld: the tighter of RDP and PLD), paper -> advanced composition
(Dwork-Roth Thm 3.20 with slack delta' = delta/(T+1), spec 000 sec 4).

Events are stored as JSON data (mechanism, parameters, contributors, schedule, trust model), in the manner of
dp_accounting's DpEvent: the description is kept apart from the arithmetic, so an auditor can recompute every
total from the export. The arithmetic is shuffledp.accountants.ledger_accounting.account (`compose_events` and
`round_cost` only choose the accountant and the delta that the run's composition rule implies).

A long run's rounds cost no more than its first (issue 30 item 4): the ledger keeps each run's rounds in memory
(_Book: every distinct event parsed once, the counted and spent rounds as multisets event -> rounds, updated by each
write and read back from SQLite at start-up or after another connection wrote). A plug-in whose total depends on
that multiset only (PVEC: rounds composing in parallel take the max, RDP curves and PLDs are composed per distinct
round and count by the accountant) composes it by `compose_counts`, one step per distinct event; the figures are
those of `compose_events` over the list of rounds, bit for bit (tests/test_ledger_incremental.py). Any other
plug-in is given the list, in round order, as before. Totals are composed once per write, not per status poll.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from shuffledp.mechanisms.pvec import PvecParams

__all__ = [
    "BudgetExceeded",
    "LedgerError",
    "RunEnded",
    "PrivacyEvent",
    "BudgetLimit",
    "BudgetTotals",
    "Ledger",
    "compose_events",
    "round_cost",
    "COMPOSITIONS",
    "TERMINAL_STATES",
]

# parallel: disjoint cohorts (max); rdp: RDP composition of calibrated PVEC rounds; advanced: Dwork-Roth 3.20
COMPOSITIONS = ("parallel", "rdp", "advanced")
ROUND_STATES = ("reserved", "committed", "released", "spent_unknown")
# a run in one of these has ended: set_state leaves it there
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "BUDGET_EXHAUSTED")
_COUNTED = ("reserved", "committed", "spent_unknown")


class LedgerError(RuntimeError):
    """A ledger operation that violates the round life cycle (unknown run/round, wrong state, duplicate)."""


class RunEnded(LedgerError):
    """A round reserved for a run that has ended (cancelled meanwhile): refused, nothing stored."""


class BudgetExceeded(Exception):
    """Reserving the round would take the run above its (eps, delta) limit; nothing was reserved."""

    def __init__(self, spent: tuple[float, float], requested: tuple[float, float], limit: tuple[float, float]):
        self.spent = spent
        self.requested = requested  # projected run total if the round were admitted
        self.limit = limit
        super().__init__(
            f"privacy budget exceeded: spent (eps={spent[0]:.6g}, delta={spent[1]:.3g}), with the next round "
            f"(eps={requested[0]:.6g}, delta={requested[1]:.3g}), limit (eps={limit[0]:.6g}, delta={limit[1]:.3g})"
        )


@dataclass(frozen=True)
class PrivacyEvent:
    """One round as data: mechanism, its parameters, contributors accounted, participation schedule."""

    mechanism: str  # "pvec"
    params: dict[str, Any]  # PvecParams fields (d, n, delta2, g, m, p, eps, delta, method)
    contributors: int  # n' the cost is computed for (worst case at reserve, actual at commit)
    schedule: str  # "sequential" | "fully_interactive"
    trust_model: str = "shuffle"

    @classmethod
    def pvec(cls, params: PvecParams, contributors: int, schedule: str) -> PrivacyEvent:
        return cls("pvec", asdict(params), int(contributors), schedule)

    def pvec_params(self) -> PvecParams:
        if self.mechanism != "pvec":
            raise LedgerError(f"unsupported mechanism {self.mechanism!r}")
        return PvecParams(**self.params)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PrivacyEvent:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class BudgetLimit:
    eps: float
    delta: float
    composition: str  # one of COMPOSITIONS
    advanced_slack: float = 0.0  # delta' of advanced composition (paper PGD: delta/(T+1))

    def __post_init__(self) -> None:
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps limit must be a finite number > 0, got {self.eps}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta limit must lie in (0, 1), got {self.delta}")
        if self.composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {self.composition!r}")
        if self.composition == "advanced" and not 0 < self.advanced_slack < self.delta:
            raise ValueError(f"advanced_slack must lie in (0, delta={self.delta}), got {self.advanced_slack}")


@dataclass(frozen=True)
class BudgetTotals:
    eps_spent: float  # committed + spent_unknown rounds
    delta_spent: float
    eps_reserved: float  # the same plus rounds reserved now (in flight)
    delta_reserved: float
    eps_limit: float
    delta_limit: float
    accountant: str
    rounds_committed: int
    honest_fraction: float = 1.0  # robust figure (spec 000 A.3): eps_spent if only this fraction is honest
    eps_spent_robust: float = math.nan
    # the spent rounds under other bounds or trust views, by name (e.g. "local", "thm1"; the protocol's views())
    views: dict[str, float] = field(default_factory=dict)
    trust_model: str = "shuffle"  # whom the guarantee holds against (design 2): "shuffle", "local" or "central"


# --------------------------------------------------------------------------------------------- arithmetic
# The arithmetic of an event belongs to its protocol plug-in (design 3.1: the protocol owns the privacy event the
# ledger charges); the ledger only stores events and asks the plug-in of their mechanism.
def _protocol(events: Sequence[PrivacyEvent]):
    from shuffledp.protocols.registry import round_protocol

    mechanisms = {e.mechanism for e in events}
    if len(mechanisms) != 1:
        raise LedgerError(f"a run's rounds must share one mechanism, got {sorted(mechanisms)}")
    try:
        return round_protocol(mechanisms.pop())
    except LookupError as exc:
        raise LedgerError(str(exc)) from exc


def accountant_name(event: PrivacyEvent, composition: str) -> str:
    return _protocol([event]).accountant_name(event, composition)


def round_cost(event: PrivacyEvent) -> tuple[float, float]:
    """(eps, delta) of one round on its own at its parameters' delta, for the contributors recorded in the event."""
    return _protocol([event]).round_cost(event)


def compose_events(
    events: Sequence[PrivacyEvent], limit: BudgetLimit, honest_fraction: float = 1.0
) -> tuple[float, float]:
    """Run total (eps, delta) of the counted rounds under the run's composition rule; honest_fraction h < 1: the
    robust figure when only a fraction h of each round's contributors are honest (spec 000 A.3)."""
    if not events:
        return 0.0, 0.0
    return _protocol(events).compose(events, limit, honest_fraction)


Items = list[tuple[PrivacyEvent, int]]


def _compose_items(
    items: Items, ordered: Callable[[], list[PrivacyEvent]], limit: BudgetLimit, honest_fraction: float = 1.0
) -> tuple[float, float]:
    """``compose_events`` of a multiset of rounds (distinct events, rounds of each). A plug-in whose total depends
    on the multiset only says so with ``compose_counts`` (one step per distinct event, not per round); any other is
    given the rounds in round order (``ordered``), as compose_events gives them."""
    if not items:
        return 0.0, 0.0
    protocol = _protocol([e for e, _ in items])
    by_counts = getattr(protocol, "compose_counts", None)
    if by_counts is not None:
        return by_counts(items, limit, honest_fraction)
    return protocol.compose(ordered(), limit, honest_fraction)


def _views_items(items: Items, ordered: Callable[[], list[PrivacyEvent]], limit: BudgetLimit) -> dict[str, float]:
    """The plug-in's views of the spent rounds, by ``views_counts`` where it has one (as _compose_items)."""
    if not items:
        return {}
    protocol = _protocol([e for e, _ in items])
    by_counts = getattr(protocol, "views_counts", None)
    return by_counts(items, limit) if by_counts is not None else protocol.views(ordered(), limit)


_SPENT = ("committed", "spent_unknown")
COMPOSED_KEPT = 8  # a round needs ~4 multisets (spent and counted, before and after it): two rounds' worth


class _Book:
    """A run's rounds in memory, kept in step with its rows (issue 30 item 4): each distinct event is parsed once,
    and the counted and spent rounds are multisets (event key -> rounds), updated by each write, so composing the
    run costs one step per distinct event, not one per round (and nothing while nothing changed: ``memo``)."""

    def __init__(self, limit: BudgetLimit | None, honest_fraction: float):
        self.limit = limit
        self.honest_fraction = honest_fraction
        self.rounds: dict[int, tuple[str, str]] = {}  # round -> (state, event key), in round order
        self.events: dict[str, PrivacyEvent] = {}  # event key (its JSON) -> the event
        self.counted: Counter[str] = Counter()  # reserved + committed + spent_unknown rounds by event
        self.spent: Counter[str] = Counter()  # committed + spent_unknown
        self.committed = 0
        self.closed = 0  # rounds no longer reserved
        self.with_metrics = 0  # rounds with a checkpoint (metrics), the initial model's (round -1) not counted
        self.memo: dict[str, Any] = {}  # figures of the current rounds (totals), emptied by every change
        # compose_counts totals by (multiset of event keys, honest fraction): a pure function of them, so kept across
        # writes; a round's reservation composes what its totals after it and after its commit read again
        self.composed: dict[tuple[frozenset[tuple[str, int]], float], tuple[float, float]] = {}

    @classmethod
    def load(cls, db: sqlite3.Connection, run_id: str) -> _Book:
        row = db.execute("SELECT limit_json, plan_json FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if row is None:
            raise LedgerError(f"unknown run {run_id!r}")
        limit = BudgetLimit(**json.loads(row[0])) if row[0] else None
        h = float((json.loads(row[1]) if row[1] else {}).get("honest_fraction", 1.0))
        book = cls(limit, h)
        for r, state, key in db.execute(
            "SELECT round, state, event_json FROM rounds WHERE run_id=? ORDER BY round", (run_id,)
        ):
            book.set(int(r), state, key)
        (book.with_metrics,) = db.execute(
            "SELECT COUNT(*) FROM checkpoints WHERE run_id=? AND round >= 0", (run_id,)
        ).fetchone()
        return book

    def set(self, round_index: int, state: str, key: str, event: PrivacyEvent | None = None) -> None:
        """Round ``round_index`` is now in ``state`` with the event of JSON ``key``."""
        old = self.rounds.get(round_index)
        if old is not None:
            self._count(*old, -1)
        if key not in self.events:
            self.events[key] = event if event is not None else PrivacyEvent.from_json(key)
        out_of_order = old is None and self.rounds and round_index < next(reversed(self.rounds))
        self.rounds[round_index] = (state, key)
        if out_of_order:
            self.rounds = dict(sorted(self.rounds.items()))
        self._count(state, key, 1)
        self.memo.clear()

    def _count(self, state: str, key: str, sign: int) -> None:
        if state in _COUNTED:
            self.counted[key] += sign
        if state in _SPENT:
            self.spent[key] += sign
        self.committed += sign * (state == "committed")
        self.closed += sign * (state != "reserved")

    def event(self, round_index: int) -> PrivacyEvent:
        return self.events[self.rounds[round_index][1]]

    def items(self, counts: Counter[str]) -> Items:
        return [(self.events[k], c) for k, c in counts.items() if c > 0]

    def compose(
        self,
        counts: Counter[str],
        ordered: Callable[[], list[PrivacyEvent]],
        honest_fraction: float = 1.0,
        extra: PrivacyEvent | None = None,
    ) -> tuple[float, float]:
        """``_compose_items`` of the rounds in ``counts`` (event key -> rounds; ``extra``: the event of a key not
        in the book yet) under the book's limit. A plug-in that composes by multiset (``compose_counts``) is
        composed once per distinct multiset (``composed``, the latest COMPOSED_KEPT); any other every time."""
        items = [(self.events[k] if k in self.events else extra, c) for k, c in counts.items() if c > 0]
        if not items or getattr(_protocol([e for e, _ in items]), "compose_counts", None) is None:
            return _compose_items(items, ordered, self.limit, honest_fraction)
        key = (frozenset((k, c) for k, c in counts.items() if c > 0), honest_fraction)
        total = self.composed.get(key)
        if total is None:
            total = self.composed[key] = _compose_items(items, ordered, self.limit, honest_fraction)
            if len(self.composed) > COMPOSED_KEPT:
                del self.composed[next(iter(self.composed))]  # the oldest: insertion order
        return total

    def ordered(self, states: Sequence[str], extra: PrivacyEvent | None = None) -> Callable[[], list[PrivacyEvent]]:
        """The rounds in ``states`` in round order (and ``extra`` last), built only if a plug-in asks for them."""

        def build() -> list[PrivacyEvent]:
            out = [self.events[k] for s, k in self.rounds.values() if s in states]
            return [*out, extra] if extra is not None else out

        return build

    def first_counted(self) -> PrivacyEvent | None:
        for state, key in self.rounds.values():
            if state in _COUNTED:
                return self.events[key]
        return None


# ------------------------------------------------------------------------------------------------ storage
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY,
  config_toml TEXT NOT NULL,
  state TEXT NOT NULL,
  message TEXT NOT NULL DEFAULT '',
  plan_json TEXT,
  limit_json TEXT,
  created_at REAL NOT NULL,
  updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  round INTEGER NOT NULL,
  state TEXT NOT NULL,
  event_json TEXT NOT NULL,
  reserved_eps REAL NOT NULL,
  reserved_delta REAL NOT NULL,
  contributors INTEGER,
  reason TEXT NOT NULL DEFAULT '',
  reserved_at REAL NOT NULL,
  closed_at REAL,
  PRIMARY KEY (run_id, round)
);
CREATE TABLE IF NOT EXISTS checkpoints (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  round INTEGER NOT NULL,
  blob BLOB NOT NULL,
  metrics_json TEXT NOT NULL,
  PRIMARY KEY (run_id, round)
);
"""


class Ledger:
    """Thread-safe SQLite ledger (one connection behind a lock; WAL; synchronous=FULL for durability)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.RLock()
        # every committed write bumps the version and wakes wait_change (the operator API's long poll)
        self._changed = threading.Condition(self._lock)
        self._version = 0
        self._depth = 0  # nesting of _tx (atomic): only the outermost begins and commits
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a commit survives power loss before the next round leaves
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        # rounds in memory by run (_Book), valid while no other connection has written (PRAGMA data_version)
        self._books: dict[str, _Book] = {}
        self._data_version = self._db.execute("PRAGMA data_version").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ----------------------------------------------------------------------------------------- helpers
    def _tx(self):
        """One write transaction; inside another (atomic), part of it: the outermost commits or rolls back all."""
        ledger = self

        class _Tx:
            def __enter__(self_inner):
                ledger._lock.acquire()
                if ledger._depth == 0:
                    try:
                        ledger._db.execute("BEGIN IMMEDIATE")
                    except BaseException:
                        ledger._lock.release()
                        raise
                ledger._depth += 1
                return ledger._db

            def __exit__(self_inner, exc_type, exc, tb):
                ledger._depth -= 1
                if ledger._depth:  # an inner write: the outermost transaction decides
                    ledger._lock.release()
                    return False
                try:
                    if exc_type:
                        ledger._books.clear()  # they may hold what was rolled back: read again from the rows
                        ledger._db.execute("ROLLBACK")
                        return False
                    try:
                        ledger._db.execute("COMMIT")
                    except BaseException:
                        ledger._books.clear()
                        raise
                    ledger._version += 1
                    ledger._changed.notify_all()
                finally:
                    ledger._lock.release()
                return False

        return _Tx()

    def atomic(self):
        """`with ledger.atomic():` the writes inside commit together in one durable transaction (one fsync), or
        none of them (issue 30: a round's commit and its checkpoint)."""
        return self._tx()

    def snapshot(self) -> threading.RLock:
        """Hold it (`with ledger.snapshot():`) to read several tables with no write landing in between."""
        return self._lock

    @property
    def version(self) -> int:
        """Count of committed writes since this process opened the ledger (for wait_change)."""
        with self._lock:
            return self._version

    def wait_change(self, version: int, timeout: float) -> None:
        """Block until a write after `version` has been committed, or for `timeout` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != version, max(timeout, 0.0))

    def _book(self, run_id: str) -> _Book:
        """The run's rounds in memory (under the lock); read again from SQLite if another connection wrote."""
        version = self._db.execute("PRAGMA data_version").fetchone()[0]
        if version != self._data_version:
            self._books.clear()
            self._data_version = version
        book = self._books.get(run_id)
        if book is None:
            book = self._books[run_id] = _Book.load(self._db, run_id)
        return book

    def _run_row(self, db: sqlite3.Connection, run_id: str) -> sqlite3.Row | tuple:
        row = db.execute("SELECT state, limit_json FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if row is None:
            raise LedgerError(f"unknown run {run_id!r}")
        return row

    def _limit(self, db: sqlite3.Connection, run_id: str) -> BudgetLimit:
        _, limit_json = self._run_row(db, run_id)
        if not limit_json:
            raise LedgerError(f"run {run_id!r} has no budget yet (set_budget is called when the run starts)")
        return BudgetLimit(**json.loads(limit_json))

    # ------------------------------------------------------------------------------------------- runs
    def create_run(self, run_id: str, config_toml: str, state: str = "CREATED") -> None:
        now = self._clock()
        with self._tx() as db:
            if db.execute("SELECT 1 FROM runs WHERE run_id=?", (run_id,)).fetchone():
                raise LedgerError(f"run {run_id!r} already exists")
            db.execute(
                "INSERT INTO runs(run_id, config_toml, state, created_at, updated_at) VALUES (?,?,?,?,?)",
                (run_id, config_toml, state, now, now),
            )

    def set_budget(self, run_id: str, limit: BudgetLimit, plan: dict[str, Any]) -> None:
        """Fix the run's (eps, delta) limit, composition rule and round plan (once, when the run starts)."""
        with self._tx() as db:
            _, existing = self._run_row(db, run_id)
            if existing:
                raise LedgerError(f"run {run_id!r} already has a budget; it is fixed once")
            db.execute(
                "UPDATE runs SET limit_json=?, plan_json=?, updated_at=? WHERE run_id=?",
                (json.dumps(asdict(limit)), json.dumps(plan, sort_keys=True), self._clock(), run_id),
            )
            self._books.pop(run_id, None)

    def set_state(self, run_id: str, state: str, message: str = "", *, only_from: str | None = None) -> bool:
        """Set the run's state and status message; False, and nothing written, once the run has ended: its first
        terminal state stays (the run's thread, still planning or polling when an operator cancels, must not report
        the cancelled run RUNNING again, nor FAILED for a population wait the cancel cut short). With `only_from`,
        only a run in that state moves (one write: of two concurrent StartRun calls one starts the run)."""
        with self._tx() as db:
            self._run_row(db, run_id)
            ended = ",".join("?" * len(TERMINAL_STATES))
            sql = f"UPDATE runs SET state=?, message=?, updated_at=? WHERE run_id=? AND state NOT IN ({ended})"
            args: list[Any] = [state, message, self._clock(), run_id, *TERMINAL_STATES]
            if only_from is not None:
                sql += " AND state=?"
                args.append(only_from)
            cur = db.execute(sql, args)
            return cur.rowcount == 1

    def run(self, run_id: str) -> dict[str, Any]:
        with self._lock:
            row = self._db.execute(
                "SELECT run_id, config_toml, state, message, plan_json, limit_json, created_at "
                "FROM runs WHERE run_id=?",
                (run_id,),
            ).fetchone()
        if row is None:
            raise LedgerError(f"unknown run {run_id!r}")
        keys = ("run_id", "config_toml", "state", "message", "plan", "limit", "created_at")
        out = dict(zip(keys, row, strict=True))
        out["plan"] = json.loads(out["plan"]) if out["plan"] else None
        out["limit"] = json.loads(out["limit"]) if out["limit"] else None
        return out

    def runs_in_state(self, state: str) -> list[str]:
        with self._lock:
            return [
                r[0] for r in self._db.execute("SELECT run_id FROM runs WHERE state=? ORDER BY created_at", (state,))
            ]

    # ----------------------------------------------------------------------------------------- rounds
    def reserve(self, run_id: str, round_index: int, event: PrivacyEvent) -> tuple[float, float]:
        """Charge the round at its worst case before it starts; returns the projected run total.

        Raises BudgetExceeded (nothing stored) if the projected total exceeds the limit in eps or delta.
        """
        with self._tx() as db:
            state = self._run_row(db, run_id)[0]
            if state in TERMINAL_STATES:  # whatever still runs it, an ended run starts no round
                raise RunEnded(f"run {run_id!r} has ended ({state}): no round {round_index}")
            limit = self._limit(db, run_id)
            if db.execute("SELECT 1 FROM rounds WHERE run_id=? AND round=?", (run_id, round_index)).fetchone():
                raise LedgerError(f"round {round_index} of run {run_id!r} was already reserved")
            book = self._book(run_id)
            key = event.to_json()
            with_it = book.counted.copy()
            with_it[key] += 1
            projected = book.compose(with_it, book.ordered(_COUNTED, event), extra=event)
            if projected[0] > limit.eps or projected[1] > limit.delta:
                spent = book.compose(book.counted, book.ordered(_COUNTED))
                raise BudgetExceeded(spent, projected, (limit.eps, limit.delta))
            eps_r, delta_r = round_cost(event)
            db.execute(
                "INSERT INTO rounds(run_id, round, state, event_json, reserved_eps, reserved_delta, reserved_at)"
                " VALUES (?,?,?,?,?,?,?)",
                (run_id, round_index, "reserved", key, eps_r, delta_r, self._clock()),
            )
            book.set(round_index, "reserved", key, event)
            return projected

    def _close(self, run_id: str, round_index: int, state: str, event: PrivacyEvent | None, n: int | None, reason: str):
        with self._tx() as db:
            row = db.execute("SELECT state FROM rounds WHERE run_id=? AND round=?", (run_id, round_index)).fetchone()
            if row is None:
                raise LedgerError(f"round {round_index} of run {run_id!r} was never reserved")
            if row[0] != "reserved":
                raise LedgerError(f"round {round_index} of run {run_id!r} is {row[0]}, not reserved")
            book = self._book(run_id)
            sets = "state=?, contributors=?, reason=?, closed_at=?"
            args: list[Any] = [state, n, reason, self._clock()]
            key = book.rounds[round_index][1]
            if event is not None:
                key = event.to_json()
                sets += ", event_json=?"
                args.append(key)
            db.execute(f"UPDATE rounds SET {sets} WHERE run_id=? AND round=?", (*args, run_id, round_index))
            book.set(round_index, state, key, event)

    def event(self, run_id: str, round_index: int) -> PrivacyEvent:
        with self._lock:
            book = self._book(run_id)
            if round_index not in book.rounds:
                raise LedgerError(f"round {round_index} of run {run_id!r} was never reserved")
            return book.event(round_index)

    def commit(
        self, run_id: str, round_index: int, contributors: int, params: dict[str, Any] | None = None
    ) -> PrivacyEvent:
        """The batch of the round is being used: record the actual contributors n' (cost recomputed with n') and,
        for a check-in round, the parameters it actually ran with (``params`` updates the reserved ones: PVEC's m,
        mechanisms/check_in.py)."""
        reserved = self.event(run_id, round_index)
        # >= 1, except for a round reserved for none (Poisson sampling: an empty batch is released and charged)
        least = min(1, reserved.contributors)
        if isinstance(contributors, bool) or not isinstance(contributors, int) or contributors < least:
            raise ValueError(f"contributors must be an integer >= {least}, got {contributors!r}")
        ev = replace(reserved, contributors=contributors)
        if params:
            unknown = set(params) - set(ev.params)
            if unknown:
                raise ValueError(f"commit can only update the event's own parameters, not {sorted(unknown)}")
            ev = replace(ev, params={**ev.params, **params})
        self._close(run_id, round_index, "committed", ev, contributors, "")
        return ev

    def release(self, run_id: str, round_index: int, reason: str) -> None:
        """No batch was delivered for the round (below threshold / spec refused): it costs nothing."""
        self._close(run_id, round_index, "released", None, None, reason)

    def mark_spent(self, run_id: str, round_index: int, reason: str) -> None:
        """The round's outcome is unknown (e.g. the shuffler call failed mid-round): charge it at its reservation."""
        self._close(run_id, round_index, "spent_unknown", None, None, reason)

    def is_reserved(self, run_id: str, round_index: int) -> bool:
        """Whether the round is reserved and not closed yet (committed, released or spent)."""
        with self._lock:
            state = self._book(run_id).rounds.get(round_index)
            return state is not None and state[0] == "reserved"

    def recover(self) -> list[tuple[str, int]]:
        """At start-up: rounds left 'reserved' by a crash have an unknown outcome and count as spent."""
        with self._tx() as db:
            rows = db.execute("SELECT run_id, round FROM rounds WHERE state='reserved'").fetchall()
            db.execute(
                "UPDATE rounds SET state='spent_unknown', reason='analyzer restarted with the round in flight', "
                "closed_at=? WHERE state='reserved'",
                (self._clock(),),
            )
            self._books.clear()
        return [(r[0], int(r[1])) for r in rows]

    def rounds(self, run_id: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT round, state, event_json, reserved_eps, reserved_delta, contributors, reason "
                "FROM rounds WHERE run_id=? ORDER BY round",
                (run_id,),
            ).fetchall()
        keys = ("round", "state", "event", "reserved_eps", "reserved_delta", "contributors", "reason")
        out = [dict(zip(keys, r, strict=True)) for r in rows]
        for r in out:
            r["event"] = json.loads(r["event"])
        return out

    def next_round(self, run_id: str) -> int:
        """First round index never reserved (rounds are never reused, whatever their outcome)."""
        with self._lock:
            row = self._db.execute("SELECT MAX(round) FROM rounds WHERE run_id=?", (run_id,)).fetchone()
        return 0 if row[0] is None else int(row[0]) + 1

    def rounds_done(self, run_id: str) -> int:
        """Rounds no longer reserved (committed, released or spent_unknown)."""
        with self._lock:
            return self._book(run_id).closed

    def totals(self, run_id: str) -> BudgetTotals:
        """The run's totals (compose_events of its counted and spent rounds), from the rounds in memory: composed
        once per distinct event and recomposed only after a write (_Book)."""
        with self._lock:
            book = self._book(run_id)
            if book.limit is None:
                raise LedgerError(f"run {run_id!r} has no budget yet (set_budget is called when the run starts)")
            cached = book.memo.get("totals")
            if cached is not None:
                return replace(cached, views=dict(cached.views))  # the caller's copy: the memo stays as composed
            limit, h = book.limit, book.honest_fraction
            spent = book.compose(book.spent, book.ordered(_SPENT))
            reserved = book.compose(book.counted, book.ordered(_COUNTED))
            first = book.first_counted()
            name = accountant_name(first, limit.composition) if first is not None else limit.composition
            robust = book.compose(book.spent, book.ordered(_SPENT), h)[0] if h < 1.0 else spent[0]
            views = _views_items(book.items(book.spent), book.ordered(_SPENT), limit)
            trust = first.trust_model if first is not None else "shuffle"
            totals = BudgetTotals(
                spent[0],
                spent[1],
                reserved[0],
                reserved[1],
                limit.eps,
                limit.delta,
                name,
                book.committed,
                h,
                robust,
                views,
                trust,
            )
            book.memo["totals"] = totals
            return totals

    # ------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, run_id: str, round_index: int, blob: bytes, metrics: dict[str, Any]) -> None:
        with self._tx() as db:
            book = self._book(run_id)
            new = (
                round_index >= 0
                and not db.execute(
                    "SELECT 1 FROM checkpoints WHERE run_id=? AND round=?", (run_id, round_index)
                ).fetchone()
            )
            db.execute(
                "INSERT OR REPLACE INTO checkpoints(run_id, round, blob, metrics_json) VALUES (?,?,?,?)",
                (run_id, round_index, blob, json.dumps(metrics, sort_keys=True)),
            )
            book.with_metrics += new

    def last_checkpoint(self, run_id: str) -> tuple[int, bytes] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT round, blob FROM checkpoints WHERE run_id=? ORDER BY round DESC LIMIT 1", (run_id,)
            ).fetchone()
        return None if row is None else (int(row[0]), bytes(row[1]))

    def progress(self, run_id: str) -> tuple[int, str, str] | None:
        """(rounds with metrics, state, message) of a run, None if unknown: what an operator's status shows changing,
        read without decoding the metrics or composing the budget (the status long poll checks it at every write)."""
        with self._lock:
            row = self._db.execute("SELECT state, message FROM runs WHERE run_id=?", (run_id,)).fetchone()
            if row is None:
                return None
            return self._book(run_id).with_metrics, row[0], row[1]

    def metrics(self, run_id: str, skip: int | None = None) -> list[dict[str, Any]]:
        """Per-round metrics in round order (round -1 is the initial model). ``skip``: the rounds' metrics only
        (round >= 0), without the first ``skip`` of them (a status poll reads and decodes only the new ones)."""
        with self._lock:
            if skip is None:
                q, args = "SELECT metrics_json FROM checkpoints WHERE run_id=? ORDER BY round", (run_id,)
                rows = self._db.execute(q, args).fetchall()
            else:
                # the last rows, counted from the end: OFFSET steps over every skipped row, so a long run's poll
                # read all of its rounds' index entries to send the newest (0.46 ms at 10^4 rounds; issue 43)
                take = self._book(run_id).with_metrics - max(int(skip), 0)
                q = "SELECT metrics_json FROM checkpoints WHERE run_id=? AND round >= 0 ORDER BY round DESC LIMIT ?"
                rows = self._db.execute(q, (run_id, take)).fetchall()[::-1] if take > 0 else []
        return [json.loads(r[0]) for r in rows]

    def export_json(self, run_id: str) -> str:
        """Everything an auditor needs to recompute the run's privacy: limit, plan, each round's event/state, totals."""
        run = self.run(run_id)
        run.pop("config_toml")
        out: dict[str, Any] = {"run": run, "rounds": self.rounds(run_id)}
        first = self.metrics(run_id)[:1]
        if first and first[0].get("round") == -1:  # theta_0's held-out figures: the run's baseline
            out["initial_model"] = first[0]
        if run["limit"]:
            out["totals"] = asdict(self.totals(run_id))
        return json.dumps(out, indent=1, sort_keys=True)
