"""Admission and identities at the shuffler: which users each node identity registered (ids scoped by node), which
nodes hold an invitation stream now (the shuffler's capacity), and the eligible users that cohorts are drawn from
(design 5.3; issue 47 split it out of the shuffler's state). The state's lock guards it; the caller shares it."""

from __future__ import annotations

import operator
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from shuffledp.services.shuffler_types import MAX_ID_CHARS, QuotaExceeded

__all__ = ["user_key", "user_keys", "split_user_key", "NodeUserIds", "Subscription", "Admission", "check_id", "by_node"]


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


CLOSED = object()


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
        self._q.put(CLOSED)

    def get(self, timeout: float) -> Any:
        """Next item (an Invite, or what the stream's server put), None on timeout; raises EOFError once closed."""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is CLOSED:
            raise EOFError(f"subscription of node {self.node_id!r} closed")
        return item


def by_node(keys: Sequence[str]) -> dict[str, list[str]]:
    """User keys grouped by their node (user_key: node id, newline, id), each node's in the order of `keys`."""
    by_node: dict[str, list[str]] = {}
    for k in keys:
        by_node.setdefault(k[: k.index("\n")], []).append(k)
    return by_node


def check_id(name: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise ValueError(f"{name} must be a printable string of 1..{MAX_ID_CHARS} characters, got {value!r}")
    return value


class Admission:
    """The node identities, their admitted users and their open streams. Every method takes the shared lock itself,
    except eligible_users (caller holds it)."""

    def __init__(self, lock: threading.Condition, max_users_per_node: int, max_streams: int) -> None:
        self._lock = lock
        self._max_users_per_node = int(max_users_per_node)
        self._max_streams = int(max_streams)
        # user key (user_key) -> the same key object: the round's tables hold this one object per user, not a fresh
        # string per message (issue 30 item 3)
        self.admitted: dict[str, str] = {}
        self.node_users: dict[str, list[str]] = {}  # node -> its users' keys
        self._registrations = 0  # requests that admitted new users (the key of the eligible_users cache)
        self._eligible: tuple[Any, list[str]] = (None, [])
        self.subs: dict[str, Subscription] = {}

    @property
    def eligible_key(self) -> Any:
        """The version of eligible_users' list: it changes when that list does."""
        return self._eligible[0]

    def register_users(self, node_id: str, user_ids: Sequence[str]) -> tuple[int, int]:
        """Admit the node's users (ids scoped by node: user_key). Idempotent; the whole request is checked before
        anything is admitted, and a node holds at most max_users_per_node users.

        Returns (users of this request now admitted for this node, total admitted users).
        """
        check_id("node_id", node_id)
        ids = list(user_ids)
        for u in ids:
            check_id("user_id", u)
        if len(set(ids)) != len(ids):
            raise ValueError(f"user_ids of node {node_id!r} contain duplicates")
        with self._lock:
            keys = [user_key(node_id, u) for u in ids]
            new = [k for k in keys if k not in self.admitted]
            mine = self.node_users.get(node_id, [])
            if len(mine) + len(new) > self._max_users_per_node:
                raise QuotaExceeded(
                    f"node {node_id!r} would host {len(mine) + len(new)} users; at most {self._max_users_per_node} "
                    "per node identity"
                )
            mine.extend(new)  # in place: no copy of a node's 10^6 keys per request
            self.node_users[node_id] = mine
            self._registrations += bool(new)
            self.admitted.update(zip(new, new, strict=True))
            return len(keys), len(self.admitted)

    def set_max_streams(self, n: int) -> None:
        """How many nodes may hold an invitation stream at once (the server's threads for them)."""
        if n < 1:
            raise ValueError(f"max_streams must be >= 1, got {n}")
        with self._lock:
            self._max_streams = int(n)

    def subscribe(self, node_id: str, make: Callable[[str], Subscription] = Subscription) -> Subscription:
        """Open the node's invitation stream (`make(node_id)`: the Subscription, e.g. one that hands its items to an
        event loop); a previous stream of the same node is closed."""
        check_id("node_id", node_id)
        sub = make(node_id)
        with self._lock:
            old = self.subs.get(node_id)
            if old is None and len(self.subs) >= self._max_streams:
                # the shuffler's capacity (serve shuffler --max-nodes): what it was sized for, memory above all
                raise QuotaExceeded(
                    f"{len(self.subs)} nodes are connected; the shuffler's capacity is {self._max_streams} nodes"
                )
            self.subs[node_id] = sub
        if old is not None:
            old.close()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.close()
        with self._lock:
            if self.subs.get(sub.node_id) is sub:
                del self.subs[sub.node_id]

    def eligible_users(self) -> list[str]:
        """Admitted users on nodes with a live subscription, sorted (deterministic order for the CSPRNG draw). Kept
        until a node registers users or its stream opens or closes (not sorted again at every round: 10^6 keys take
        seconds); callers do not change it. Caller holds the lock."""
        key = (tuple(self.subs), self._registrations)
        if self._eligible[0] != key:
            users: list[str] = []
            for node in self.subs:
                users.extend(self.node_users.get(node, ()))
            users.sort()
            self._eligible = (key, users)
        return self._eligible[1]

    def node_summary(self) -> dict[str, tuple[int, bool]]:
        """Per node identity: (its admitted users, whether it holds an invitation stream now). Counts only."""
        with self._lock:
            nodes = set(self.node_users) | set(self.subs)
            return {n: (len(self.node_users.get(n, ())), n in self.subs) for n in nodes}
