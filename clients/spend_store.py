"""What each of a node's users has spent, kept durably by the node itself (issue 10 item 3; design 6).

A user's total budget (its [policy] max_total_eps / max_total_delta) protects that user against the analyzer, so
its record must not be the analyzer's or the shuffler's, and must survive a node restart: otherwise a restart
gives every user its whole budget again. The node writes a round's spend here before any of the round's messages
leave it (a message that may have arrived is spent), with SQLite's WAL and synchronous=FULL, as the analyzer's
ledger does. The in-memory store (tests, in-process benchmarks) has the same interface.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["SpendStore", "MemorySpendStore", "SqliteSpendStore"]


class SpendStore(Protocol):
    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(eps spent, delta spent) per user id, zeros for users never charged."""
        ...

    def save(self, user_ids: Sequence[str], eps: np.ndarray, delta: np.ndarray) -> None:
        """Set these users' totals (absolute values); durable when it returns."""
        ...


class MemorySpendStore:
    def __init__(self) -> None:
        self._spent: dict[str, tuple[float, float]] = {}

    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        rows = [self._spent.get(u, (0.0, 0.0)) for u in user_ids]
        a = np.array(rows, dtype=np.float64).reshape(len(rows), 2)
        return a[:, 0].copy(), a[:, 1].copy()

    def save(self, user_ids: Sequence[str], eps: np.ndarray, delta: np.ndarray) -> None:
        for u, e, d in zip(user_ids, eps.tolist(), delta.tolist(), strict=True):
            self._spent[u] = (e, d)


class SqliteSpendStore:
    """One row per user who ever joined a round: (user_id, eps, delta)."""

    def __init__(self, path: str | Path) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a charge must survive a crash before the message leaves
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS spend (user_id TEXT PRIMARY KEY, eps REAL NOT NULL, delta REAL NOT NULL)"
            )

    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            known = dict(((u, (e, d)) for u, e, d in self._db.execute("SELECT user_id, eps, delta FROM spend")))
        rows = [known.get(u, (0.0, 0.0)) for u in user_ids]
        a = np.array(rows, dtype=np.float64).reshape(len(rows), 2)
        return a[:, 0].copy(), a[:, 1].copy()

    def save(self, user_ids: Sequence[str], eps: np.ndarray, delta: np.ndarray) -> None:
        rows = list(zip(user_ids, eps.tolist(), delta.tolist(), strict=True))
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("INSERT OR REPLACE INTO spend (user_id, eps, delta) VALUES (?, ?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._db.close()
