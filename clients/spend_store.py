"""What each of a node's users has spent, kept durably by the node itself (issue 10 item 3; design 6).

A user's total budget (its [policy] max_total_eps / max_total_delta) protects that user against the analyzer, so
its record must not be the analyzer's or the shuffler's, and must survive a node restart: otherwise a restart
gives every user its whole budget again. The node records a round's charge here before any of the round's messages
leave it (a message that may have arrived is spent), with SQLite's WAL and synchronous=FULL, as the analyzer's
ledger does. The in-memory store (tests, in-process benchmarks) has the same interface.

The record is a log of charges: one row per round and distinct (eps, noise key) among its users (one row for a
fully interactive round), so a round costs one insert however many users joined (issue 15: one upsert per user and
round made the record a node's largest cost per round). A row names its users by a set kept once (table user_sets,
by the sha256 of the ids): a fully interactive run's rounds all name one set, so the record grows by a row per
round, not by every user's id (10^5 users: 1.4 MB per round before), and loading decodes each set once and reads
the log row by row (it held every round's id lists at once: 3.3 kB per user after 40 rounds). Loading replays the
log in order with the node's own rounded-up sums (clients/policy.sum_up), so a restarted node holds exactly the
totals it had: per user the basic-composition totals (eps, delta) and the history of verified PVEC rounds as a count
per round_noise_key, from which the node composes the user's spend by RDP like the ledger (clients/policy.py). A
user who ever joined a round without such a key is accounted by basic composition only (history None). A store
written by an earlier version is read as it is: log rows holding their own ids, or (older still: tables spend and
history, absolute per-user values) the totals the log starts from.

Rounds of a protocol whose cost composes per run (protocols.base.UserAccount: sampled central DP-SGD, DP-FTRL) log
the run and what the round added to each user's counts in it ("eligible", "joined", a tree's leaf); replaying them
gives each user's counts per run and what it has paid for the run, from which the node charges the next round
(clients/policy.py, issue 24 items 1-2). Such a row also logs its round: a user answers a round of a run once, and a
shuffler that repeats an invitation after the node restarted must find it refused as before (a run's rounds compose
per round: a second answer to one round would be a second release of the user's data that its counts do not show).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import numpy as np
from shuffledp.clients.policy import Histories, History, parameters_from_json, parameters_to_json, sum_up

from shuffledp.durable import open_durable, transaction

__all__ = ["SpendStore", "MemorySpendStore", "SqliteSpendStore", "DeviceSpendStore", "History"]

# (user ids, eps each, delta each, noise key or None, run or None, what the round added to the users' run counts,
# the run's round or None)
Charge = tuple[list[str], float, float, tuple | None, str | None, str | None, int | None]
# run -> (counts by user, paid eps, paid delta, the last round of the run each user was charged in: -1 for none)
RunCounts = dict[str, tuple[dict[int, Counter], np.ndarray, np.ndarray, np.ndarray]]


class SpendStore(Protocol):
    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Histories]:
        """(eps spent, delta spent, history) per user id; zeros and an empty history for users never charged."""
        ...

    def load_runs(self, user_ids: Sequence[str]) -> RunCounts:
        """Per run: the users' counts (by index in user_ids) and what each has paid for the run."""
        ...

    def load_all(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Histories, RunCounts]:
        """load and load_runs from one read of the log (a node's start)."""
        ...

    def run_parameters(self) -> dict[str, tuple]:
        """Per run: the public parameters of its first charged round (clients/policy.run_parameters)."""
        ...

    def record(
        self,
        user_ids: Sequence[str],
        eps: np.ndarray,
        delta: float | np.ndarray,
        keys: Sequence[tuple | None],
        run: str | None = None,
        steps: Sequence[str] | None = None,
        run_round: int | None = None,
        run_parameters: tuple | None = None,
    ) -> None:
        """Add one round's charge: eps[i] and delta (or delta[i]) to user_ids[i]'s totals, one round of keys[i]
        (None: not RDP-accountable) to its history, and, for a run's charge of its round run_round, steps[i]
        (comma-separated count names) to its counts in `run` and, if the run has none yet, its public parameters
        run_parameters; durable when it returns."""
        ...


def charges(
    user_ids: Sequence[str],
    eps: np.ndarray,
    delta: float | np.ndarray,
    keys: Sequence[tuple | None],
    run: str | None = None,
    steps: Sequence[str] | None = None,
    run_round: int | None = None,
) -> list[Charge]:
    """One round's charge as log entries: the users grouped by (eps, delta, key, step), in first-appearance order."""
    n = len(user_ids)
    eps_, delta_ = np.asarray(eps, dtype=np.float64), np.asarray(delta, dtype=np.float64)
    steps = steps or [None] * n
    if n and all(x.min() == x.max() for x in (eps_, delta_)) and all(s.count(s[0]) == n for s in (keys, steps)):
        # one group, as a fully interactive round's charge is: no step per user
        return [(list(user_ids), float(eps_.flat[0]), float(delta_.flat[0]), keys[0], run, steps[0], run_round)]
    deltas = np.broadcast_to(delta_, (n,)).tolist()
    groups: dict[tuple, list[str]] = {}
    for u, e, d, k, st in zip(user_ids, np.broadcast_to(eps_, (n,)).tolist(), deltas, keys, steps, strict=True):
        groups.setdefault((e, d, k, st), []).append(u)
    return [(users, e, d, k, run, st, run_round) for (e, d, k, st), users in groups.items()]


def replay(
    user_ids: Sequence[str],
    log: Iterable[Charge],
    base: dict[str, tuple[float, float, History]] | None = None,
) -> tuple[np.ndarray, np.ndarray, Histories, RunCounts]:
    """The users' totals and histories after `log` (from `base`: an old store's absolute values), summed in log
    order exactly as PolicyTable.charge sums them (rounded up), and per run the users' counts and what each paid for
    the run (as PolicyTable.apply_run sums them)."""
    index = {u: i for i, u in enumerate(user_ids)}
    eps, delta = np.zeros(len(user_ids)), np.zeros(len(user_ids))
    history = Histories(len(user_ids))  # one int per user, not a Counter each (issue 30 item 3)
    for u, (e, d, h) in (base or {}).items():
        i = index.get(u)
        if i is not None:
            eps[i], delta[i], history[i] = e, d, h
    runs: RunCounts = {}
    last: tuple[list[str], np.ndarray] | None = None  # rows naming the same set share its id list: mapped once
    for users, e, d, key, run, step, run_round in log:
        if last is not None and last[0] is users:
            ix = last[1]
        else:
            ix = np.fromiter((index[u] for u in users if u in index), dtype=np.int64)
            last = (users, ix)
        eps[ix] = sum_up(eps[ix], e)
        delta[ix] = sum_up(delta[ix], d)
        if run is not None:
            if run not in runs:
                n = len(user_ids)
                runs[run] = ({}, np.zeros(n), np.zeros(n), np.full(n, -1, dtype=np.int64))
            counts, paid_eps, paid_delta, last_round = runs[run]
            paid_eps[ix] = sum_up(paid_eps[ix], e)
            paid_delta[ix] = sum_up(paid_delta[ix], d)
            if run_round is not None:  # None: a row of an earlier version, which did not log its round
                last_round[ix] = np.maximum(last_round[ix], run_round)
            for i in ix.tolist():
                counts.setdefault(i, Counter()).update(step.split(",") if step else ())
            if e == 0.0 and d == 0.0:
                continue  # a run's counts that cost nothing yet: the history stays (PolicyTable.apply_run)
        if key is None:
            history.clear(ix)
        else:
            history.add(ix, key)  # a None history stays None
    return eps, delta, history, runs


class MemorySpendStore:
    def __init__(self) -> None:
        self._log: list[Charge] = []
        self._parameters: dict[str, tuple] = {}

    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Histories]:
        return self.load_all(user_ids)[:3]

    def load_runs(self, user_ids: Sequence[str]) -> RunCounts:
        return self.load_all(user_ids)[3]

    def load_all(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Histories, RunCounts]:
        return replay(user_ids, self._log)

    def run_parameters(self) -> dict[str, tuple]:
        return dict(self._parameters)

    def record(
        self,
        user_ids: Sequence[str],
        eps: np.ndarray,
        delta: float | np.ndarray,
        keys: Sequence[tuple | None],
        run: str | None = None,
        steps: Sequence[str] | None = None,
        run_round: int | None = None,
        run_parameters: tuple | None = None,
    ) -> None:
        self._log.extend(charges(user_ids, eps, delta, keys, run, steps, run_round))
        if run is not None and run_parameters is not None:
            self._parameters.setdefault(run, run_parameters)


# user sets a load keeps decoded at once (a fully interactive run names one; a sequential run one per round, once each)
SETS_DECODED = 4


class SqliteSpendStore:
    """Table charges(seq, users, eps, delta, noise_key, run, step, users_set, run_round): the log, its users in
    user_sets (an earlier version's rows hold them in users); spend / history: an older version's totals."""

    def __init__(self, path: str | Path) -> None:
        self._db = open_durable(path)  # a charge must survive a crash before the message leaves
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS charges (seq INTEGER PRIMARY KEY AUTOINCREMENT, users BLOB NOT NULL, "
                "eps REAL NOT NULL, delta REAL NOT NULL, noise_key TEXT, run TEXT, step TEXT, users_set INTEGER, "
                "run_round INTEGER)"
            )
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(charges)")}
            older = (("run", "TEXT"), ("step", "TEXT"), ("users_set", "INTEGER"), ("run_round", "INTEGER"))
            for col, kind in older:  # older stores
                if col not in columns:
                    self._db.execute(f"ALTER TABLE charges ADD COLUMN {col} {kind}")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS user_sets (id INTEGER PRIMARY KEY, digest BLOB NOT NULL UNIQUE, "
                "users BLOB NOT NULL)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS run_parameters (run TEXT PRIMARY KEY, parameters TEXT NOT NULL)"
            )
            # digest -> id of every set written (32 bytes and an int per set, not per user)
            self._sets = dict(self._db.execute("SELECT digest, id FROM user_sets").fetchall())

    def _base(self) -> dict[str, tuple[float, float, History]]:
        """An earlier version's per-user totals (tables spend and history), if this store has them."""
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "spend" not in tables:
            return {}
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(spend)")}
        tight = "tight" if "tight" in columns else "0"  # a store from before the histories: basic-only users
        hist: dict[str, Counter] = {}
        if "history" in tables:
            for u, n_total, p, g, d, c in self._db.execute("SELECT user_id, n_total, p, g, d, rounds FROM history"):
                hist.setdefault(u, Counter())[(n_total, p, g, d)] = c
        rows = self._db.execute(f"SELECT user_id, eps, delta, {tight} FROM spend")
        return {u: (e, d, hist.get(u, Counter()) if t else None) for u, e, d, t in rows}

    def _log(self) -> Iterator[Charge]:
        """The log in order, row by row (caller holds the lock until it is consumed); the rows of one set yield one
        list of its ids while it stays among the last SETS_DECODED sets decoded."""
        decoded: OrderedDict[int, list[str]] = OrderedDict()
        rows = self._db.execute(
            "SELECT users, users_set, eps, delta, noise_key, run, step, run_round FROM charges ORDER BY seq"
        )
        for blob, set_id, e, d, k, run, step, run_round in rows:
            if set_id is None:  # a row of an earlier version: its own ids
                users = blob.decode().split("\n")
            elif (users := decoded.get(set_id)) is None:
                (ids,) = self._db.execute("SELECT users FROM user_sets WHERE id = ?", (set_id,)).fetchone()
                users = decoded[set_id] = ids.decode().split("\n")
                if len(decoded) > SETS_DECODED:
                    decoded.popitem(last=False)
            else:
                decoded.move_to_end(set_id)
            yield users, e, d, None if k is None else tuple(json.loads(k)), run, step, run_round

    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Histories]:
        return self.load_all(user_ids)[:3]

    def load_runs(self, user_ids: Sequence[str]) -> RunCounts:
        return self.load_all(user_ids)[3]

    def load_all(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Histories, RunCounts]:
        with self._lock:
            return replay(user_ids, self._log(), self._base())

    def run_parameters(self) -> dict[str, tuple]:
        with self._lock:
            rows = self._db.execute("SELECT run, parameters FROM run_parameters").fetchall()
        return {run: parameters_from_json(text) for run, text in rows}

    def record(
        self,
        user_ids: Sequence[str],
        eps: np.ndarray,
        delta: float | np.ndarray,
        keys: Sequence[tuple | None],
        run: str | None = None,
        steps: Sequence[str] | None = None,
        run_round: int | None = None,
        run_parameters: tuple | None = None,
    ) -> None:
        # ids hold no newline (the shuffler's user_key relies on that too): "\n" separates them
        rows = [
            ("\n".join(users).encode(), e, d, None if k is None else json.dumps(list(k)), r, st, rr)
            for users, e, d, k, r, st, rr in charges(user_ids, eps, delta, keys, run, steps, run_round)
        ]
        with self._lock:
            added: dict[bytes, int] = {}
            with transaction(self._db) as db:
                for blob, *rest in rows:
                    digest = hashlib.sha256(blob).digest()
                    set_id = self._sets.get(digest) or added.get(digest)
                    if set_id is None:
                        set_id = added[digest] = db.execute(
                            "INSERT INTO user_sets (digest, users) VALUES (?, ?)", (digest, blob)
                        ).lastrowid
                    db.execute(
                        "INSERT INTO charges (users, eps, delta, noise_key, run, step, run_round, users_set) "
                        "VALUES (x'', ?, ?, ?, ?, ?, ?, ?)",
                        (*rest, set_id),
                    )
                if run is not None and run_parameters is not None:  # the run's first: a later one is the same
                    db.execute(
                        "INSERT OR IGNORE INTO run_parameters (run, parameters) VALUES (?, ?)",
                        (run, parameters_to_json(run_parameters)),
                    )
            self._sets.update(added)  # only once committed: a rolled-back set is written again next time

    def close(self) -> None:
        with self._lock:
            self._db.close()


class DeviceSpendStore:
    """A device's own SqliteSpendStore (the same file and format as a node's), open only while it is read or written
    (issue 44 item 2). A fleet of 10^4 devices in one process holding its stores open would need three descriptors
    each (database, WAL, shared memory) besides its socket: past a 20000 descriptor limit. Open per use, a fleet holds
    at most one store per thread of its pool. Each charge is as durable as a node's (SqliteSpendStore.record commits
    before it returns). A device never charged has no file: reading one that does not exist gives the empty record
    without creating it (a fleet starts without 10^4 files and their fsyncs)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @contextmanager
    def _open(self) -> Iterator[SqliteSpendStore]:
        store = SqliteSpendStore(self.path)
        try:
            yield store
        finally:
            store.close()

    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Histories]:
        return self.load_all(user_ids)[:3]

    def load_runs(self, user_ids: Sequence[str]) -> RunCounts:
        return self.load_all(user_ids)[3]

    def load_all(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, Histories, RunCounts]:
        if not self.path.exists():
            return replay(user_ids, ())
        with self._open() as store:
            return store.load_all(user_ids)

    def run_parameters(self) -> dict[str, tuple]:
        if not self.path.exists():
            return {}
        with self._open() as store:
            return store.run_parameters()

    def record(
        self,
        user_ids: Sequence[str],
        eps: np.ndarray,
        delta: float | np.ndarray,
        keys: Sequence[tuple | None],
        run: str | None = None,
        steps: Sequence[str] | None = None,
        run_round: int | None = None,
        run_parameters: tuple | None = None,
    ) -> None:
        with self._open() as store:
            store.record(user_ids, eps, delta, keys, run, steps, run_round, run_parameters)
