"""The shuffler's participation record: who was in which round of which run (sequential users used up, a fully
interactive run's population, DP-FTRL's per-tree leaves), in memory or in SQLite behind one interface. What it holds
must survive a crash (durable.py): after a restart no sequential user is invited again (design 5.3)."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import NamedTuple, Protocol

from shuffledp.services.shuffler_types import RoundExistsError

from shuffledp.durable import open_durable, transaction

__all__ = ["TreeLimits", "ParticipationStore", "MemoryParticipationStore", "SqliteParticipationStore", "limits_text"]


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


def limits_text(t: TreeLimits) -> str:
    per = f"trees of {t.rounds_per_tree} rounds" if t.rounds_per_tree else "one tree"
    return f"(at most {t.max_per_tree} rounds per user per tree, >= {t.min_separation} rounds apart, {per})"


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
