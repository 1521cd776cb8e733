"""Durable SQLite for the parties' own records (the shuffler's participation record, a node's users' spend).

What such a record holds must survive a crash at any point after the call that wrote it returned: WAL with
synchronous=FULL, and every write in one BEGIN IMMEDIATE transaction that either commits whole or rolls back.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["INTEGER_LIMIT", "open_durable", "transaction"]

INTEGER_LIMIT = 2**63  # a SQLite INTEGER is signed 64-bit: a stored count or index lies in [0, INTEGER_LIMIT)


def open_durable(path: str | Path) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions explicit, see transaction) with WAL and synchronous=FULL."""
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")  # a committed write survives a power loss, not just a process crash
    return db


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT; ROLLBACK and re-raise on any exception. The caller serializes access."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
