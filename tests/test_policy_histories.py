"""Issue 30 item 3: a node's users' histories of verified rounds (clients.policy.Histories) behave as one Counter (or
None) per user, and take one int per user: users with equal histories share one entry."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest
from shuffledp.clients.policy import Histories, PolicyTable, UserPolicy


def test_histories_behave_as_a_list_of_counters_and_stay_bounded():
    rng = np.random.default_rng(0)
    n = 50
    ref: list[Counter | None] = [Counter() for _ in range(n)]
    h = Histories(n)
    keys = [(40, 0.5, 16, m) for m in range(6)]
    for step in range(400):  # many rounds: the table is compacted on the way
        users = rng.choice(n, size=int(rng.integers(0, n)), replace=False)
        if rng.random() < 0.05:
            h.clear(users)
            for u in users.tolist():
                ref[u] = None
        else:
            key = keys[int(rng.integers(len(keys)))]
            h.add(users, key)
            for u in users.tolist():
                if ref[u] is not None:
                    ref[u][key] += 1
        if step % 50 == 0:
            u = int(rng.integers(n))
            h[u] = ref[u] = Counter({keys[0]: 2})
    assert h == ref and list(h) == ref and len(h) == n
    for u in range(n):
        assert h.frozen(u) == (None if ref[u] is None else tuple(sorted(ref[u].items())))
    got = h[0]
    if got is not None:
        got[keys[0]] += 99  # a copy: the table does not change
        assert h[0] == ref[0]
    assert len(h._table) <= 2 * n + 64  # bounded by the users, not by the 400 rounds
    with pytest.raises(ValueError, match="3 entries"):
        Histories(3, [Counter()])


def test_a_fully_interactive_run_keeps_one_history_entry_not_a_counter_per_user():
    """The histories of 20000 users charged the same rounds take 4 bytes per user (a Counter each took ~250)."""
    n = 20_000
    table = PolicyTable(UserPolicy(), n, verifier=lambda spec: 0.5)
    idx = np.arange(n)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for r in range(5):
            keys = table.charge(idx, 0.5, 1e-7, (40, 0.5, 16, 4 + r % 2))
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert keys == [(40, 0.5, 16, 4)] * n
    assert table.history[n - 1] == Counter({(40, 0.5, 16, 4): 3, (40, 0.5, 16, 5): 2})
    assert held < 16 * n, held / n  # the int per user and the returned list of keys
    # a user who only trusted a round (no verification) leaves RDP composition, alone
    table.verify[7] = False
    table.charge(np.array([6, 7]), 0.5, 1e-7, (40, 0.5, 16, 4))
    assert table.history[7] is None and table.history[6][(40, 0.5, 16, 4)] == 4
