"""What each of a node's users has spent, kept durably by the node itself (issue 10 item 3; design 6).

A user's total budget (its [policy] max_total_eps / max_total_delta) protects that user against the analyzer, so
its record must not be the analyzer's or the shuffler's, and must survive a node restart: otherwise a restart
gives every user its whole budget again. The node writes a round's spend here before any of the round's messages
leave it (a message that may have arrived is spent), with SQLite's WAL and synchronous=FULL, as the analyzer's
ledger does. The in-memory store (tests, in-process benchmarks) has the same interface.

Per user: the basic-composition totals (eps, delta), and the user's history of verified PVEC rounds as a count per
round_noise_key, from which the node composes the user's spend by RDP like the ledger (clients/policy.py). A user
who ever joined a round without such a key ("tight" = False) is accounted by basic composition only.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from shuffledp.durable import open_durable, transaction

__all__ = ["SpendStore", "MemorySpendStore", "SqliteSpendStore", "History"]

History = Counter | None  # round_noise_key -> rounds joined; None: some round has no key (basic composition only)


class SpendStore(Protocol):
    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[History]]:
        """(eps spent, delta spent, history) per user id; zeros and an empty history for users never charged."""
        ...

    def save(self, user_ids: Sequence[str], eps: np.ndarray, delta: np.ndarray, keys: Sequence[tuple | None]) -> None:
        """Set these users' totals (absolute values) and add one round of each user's key (None: not
        RDP-accountable) to their histories; durable when it returns."""
        ...


class MemorySpendStore:
    def __init__(self) -> None:
        self._spent: dict[str, tuple[float, float]] = {}
        self._history: dict[str, History] = {}

    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[History]]:
        rows = [self._spent.get(u, (0.0, 0.0)) for u in user_ids]
        a = np.array(rows, dtype=np.float64).reshape(len(rows), 2)
        hist = [self._history.get(u, Counter()) for u in user_ids]
        return a[:, 0].copy(), a[:, 1].copy(), [None if h is None else Counter(h) for h in hist]

    def save(self, user_ids: Sequence[str], eps: np.ndarray, delta: np.ndarray, keys: Sequence[tuple | None]) -> None:
        for u, e, d, key in zip(user_ids, eps.tolist(), delta.tolist(), keys, strict=True):
            self._spent[u] = (e, d)
            h = self._history.setdefault(u, Counter())
            if key is None or h is None:
                self._history[u] = None
            else:
                h[key] += 1


class SqliteSpendStore:
    """Tables spend(user_id, eps, delta, tight) and history(user_id, n_total, p, g, d, rounds)."""

    def __init__(self, path: str | Path) -> None:
        self._db = open_durable(path)  # a charge must survive a crash before the message leaves
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS spend (user_id TEXT PRIMARY KEY, eps REAL NOT NULL, delta REAL NOT NULL, "
                "tight INTEGER NOT NULL)"
            )
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(spend)")}
            if "tight" not in columns:  # a store written before the histories existed: its users are basic-only
                self._db.execute("ALTER TABLE spend ADD COLUMN tight INTEGER NOT NULL DEFAULT 0")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS history (user_id TEXT NOT NULL, n_total INTEGER NOT NULL, "
                "p REAL NOT NULL, g INTEGER NOT NULL, d INTEGER NOT NULL, rounds INTEGER NOT NULL, "
                "PRIMARY KEY (user_id, n_total, p, g, d))"
            )

    def load(self, user_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[History]]:
        with self._lock:
            spent = {u: (e, d, t) for u, e, d, t in self._db.execute("SELECT user_id, eps, delta, tight FROM spend")}
            rows = self._db.execute("SELECT user_id, n_total, p, g, d, rounds FROM history").fetchall()
        hist: dict[str, Counter] = {}
        for u, n_total, p, g, d, c in rows:
            hist.setdefault(u, Counter())[(n_total, p, g, d)] = c
        eps = np.array([spent.get(u, (0.0, 0.0, 1))[0] for u in user_ids], dtype=np.float64)
        delta = np.array([spent.get(u, (0.0, 0.0, 1))[1] for u in user_ids], dtype=np.float64)
        out: list[History] = [hist.get(u, Counter()) if spent.get(u, (0, 0, 1))[2] else None for u in user_ids]
        return eps, delta, out

    def save(self, user_ids: Sequence[str], eps: np.ndarray, delta: np.ndarray, keys: Sequence[tuple | None]) -> None:
        triples = zip(user_ids, eps.tolist(), delta.tolist(), keys, strict=True)
        rows = [(u, e, d, int(k is not None)) for u, e, d, k in triples]
        with self._lock, transaction(self._db) as db:
            # tight stays 0 once a round without a noise key was joined
            db.executemany(
                "INSERT INTO spend (user_id, eps, delta, tight) VALUES (?, ?, ?, ?) ON CONFLICT(user_id) DO UPDATE "
                "SET eps = excluded.eps, delta = excluded.delta, tight = MIN(tight, excluded.tight)",
                rows,
            )
            db.executemany(
                "INSERT INTO history (user_id, n_total, p, g, d, rounds) VALUES (?, ?, ?, ?, ?, 1) "
                "ON CONFLICT(user_id, n_total, p, g, d) DO UPDATE SET rounds = rounds + 1",
                [(u, *k) for u, k in zip(user_ids, keys, strict=True) if k is not None],
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()
