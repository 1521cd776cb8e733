"""Issue 30 item 3: a node's users' histories of verified rounds (clients.policy.Histories) behave as one Counter (or
None) per user, and take one int per user: users with equal histories share one entry."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest
from shuffledp.clients.policy import Histories, PolicyTable, Refusal, UserPolicy

from shuffledp.v1 import shuffledp_pb2 as pb


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
    trusting = PolicyTable([UserPolicy()] * 7 + [UserPolicy(verify_randomizer=False)], 8, verifier=lambda spec: 0.5)
    for _ in range(3):
        trusting.charge(np.array([6, 7]), 0.5, 1e-7, (40, 0.5, 16, 4))
    assert trusting.history[7] is None and trusting.history[6][(40, 0.5, 16, 4)] == 3


def test_a_policy_shared_by_all_users_decides_as_copies_and_costs_no_memory_per_user():
    """A node whose users share one policy holds its limits once (read-only views), not an array per field per
    user; its decisions and charges equal those of a table of per-user copies of the policy."""
    from dataclasses import replace

    from shuffledp.clients.policy import noise_key

    policy = UserPolicy(max_total_eps=2.0, max_eps_per_round=1.0, verify_randomizer=False)
    n = 50_000
    tracemalloc.start()
    try:
        shared = PolicyTable(policy, n)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 24 * n, held / n  # the spend (eps, delta) and the history index: 20 bytes per user
    copies = PolicyTable([replace(policy) for _ in range(n)], n)
    spec = pb.RoundSpec(
        trust_model=pb.SHUFFLE,
        transport=pb.COUNTS,
        randomizer=pb.RandomizerSpec(protocol="pvec"),
        per_user_cost=pb.PrivacyCost(eps=0.75, delta=1e-7),
    )
    idx = np.arange(0, n, 7)
    for _ in range(3):  # the third round breaks max_total_eps = 2
        (a, cost_a), (b, cost_b) = shared.decide(spec, idx, True), copies.decide(spec, idx, True)
        assert list(a) == list(b) and np.array_equal(cost_a, cost_b)
        join = idx[a == ""]
        shared.charge(join, cost_a[a == ""], 1e-7, noise_key(spec))
        copies.charge(join, cost_b[b == ""], 1e-7, noise_key(spec))
    assert set(a) == {Refusal.TOTAL_EPS} and np.array_equal(shared.eps_spent, copies.eps_spent)
    with pytest.raises(ValueError, match="read-only"):
        shared.max_total_eps[0] = 10.0


def test_the_rdp_check_by_groups_decides_each_user_as_its_own_history_and_limits_would():
    """_tight_ok evaluates one eps per (history, max_total_delta) group; each user's answer must equal the
    per-user evaluation (its own history plus the round, at its own delta, against its own max_total_eps)."""
    from shuffledp.accountants.pvec_pld import epsilon_of_rounds

    key, other = (200_000, 0.5, 16, 2), (100_000, 0.5, 16, 2)  # one round: eps 0.26-0.30 and 0.4-0.45
    rng = np.random.default_rng(3)
    n = 300
    deltas, limits = (1e-6, 1e-5, 0.0), (0.3, 0.5, 0.7, 3.0)
    policies = [
        UserPolicy(max_total_delta=deltas[i % 3], max_total_eps=limits[(i // 3) % 4], verify_randomizer=True)
        for i in range(n)
    ]
    table = PolicyTable(policies, n, verifier=lambda spec: 0.5)
    for _ in range(3):  # histories of 0-3 rounds of two keys, some None (a round that was only trusted)
        users = np.flatnonzero(rng.random(n) < 0.6)
        table.history.add(users, key if rng.random() < 0.5 else other)
    table.history.clear(np.flatnonzero(rng.random(n) < 0.1))
    users = rng.permutation(n)[:250]
    got = table._tight_ok(users, key)
    want = []
    for u in users.tolist():
        h, dlt = table.history[u], policies[u].max_total_delta
        if h is None or dlt <= 0.0:
            want.append(False)
            continue
        h[key] += 1
        want.append(epsilon_of_rounds(h, dlt) <= policies[u].max_total_eps)
    assert got.dtype == bool and got.tolist() == want
    assert 0 < sum(want) < len(want)  # both answers occur: the test can tell a wrong grouping
    assert table._tight_ok(np.array([], dtype=np.int64), key).size == 0
