"""Client node: gradients, clipping and randomizing for its logical users; per-user policy; gRPC status/health."""

from __future__ import annotations

import time
from collections import Counter

import grpc
import numpy as np
import pytest
from _intercept import count_total, user_messages
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shuffledp.clients.node import NodeCore, UserShard, start_node
from shuffledp.clients.policy import PolicyTable, Refusal, UserPolicy
from shuffledp.services.shuffler import start_shuffler

from shuffledp.config import parse_config
from shuffledp.mechanisms import pvec
from shuffledp.security.rng import make_rng
from shuffledp.security.sealing import (
    BIT_MESSAGE_BYTES,
    SealingError,
    generate_keypair,
    open_sealed,
    round_info,
    sealed_length,
    unpack_labelled_bits,
)
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

F, N = 3, 40
D = F + 1
NO_VERIFY = UserPolicy(verify_randomizer=False)


def make_shard(n: int = N, seed: int = 1) -> UserShard:
    rng = make_rng(seed)
    # large features: most gradients have norm > clip_norm, so clipping is active
    return UserShard([f"u{j}" for j in range(n)], rng.normal(size=(n, 1, F)) * 4, rng.normal(size=(n, 1)))


def make_spec(round_=1, transport=pb.COUNTS, g=16, m=8, p=0.5, eps=1.0, delta=1e-6, **kw) -> pb.RoundSpec:
    s = pb.RoundSpec(
        run_id="run",
        round=round_,
        schedule=pb.FULLY_INTERACTIVE,
        trust_model=pb.SHUFFLE,
        transport=transport,
        randomizer=pb.RandomizerSpec(protocol="pvec", dim=D, g=g, m=m, p=p, clip_norm=1.0),
        model=pb.Tensor(shape=[D], f64=np.array([0.3, -0.2, 0.1, 0.05]).tobytes()),
        task="leastsq",
        min_contributors=1,
        deadline_seconds=10,
        per_user_cost=pb.PrivacyCost(eps=eps, delta=delta, trust_model=pb.SHUFFLE),
        local_batch=1,
    )
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def clipped_gradients(shard: UserShard, w: np.ndarray, clip: float) -> np.ndarray:
    """Independent reference: least-squares gradient (w.[x;1] - y)[x;1], then l2 clipping."""
    Z = np.concatenate([shard.X[:, 0, :], np.ones((len(shard.user_ids), 1))], axis=1)
    g = (Z @ w - shard.y[:, 0])[:, None] * Z
    norms = np.linalg.norm(g, axis=1, keepdims=True)
    return g * np.minimum(1.0, clip / norms)


def invite(spec, shard) -> pb.Invitation:
    return pb.Invitation(spec=spec, user_ids=shard.user_ids)


def test_counts_pipeline_is_unbiased_for_clipped_gradient_sum():
    """Mean over R rounds of the decoded aggregate equals the sum of clipped gradients within 4 standard errors
    (standard error from PVEC's exact variance, spec 000 sec 2)."""
    shard = make_shard()
    core = NodeCore(
        "node", shard, UserPolicy(max_total_eps=np.inf, max_total_delta=1.0, verify_randomizer=False), rng=make_rng(2)
    )
    spec = make_spec()
    params = pvec.PvecParams(d=D, n=N, delta2=1.0, g=16, m=8, p=0.5, eps=1.0, delta=1e-6, method="calibrated")
    ref = clipped_gradients(shard, np.frombuffer(spec.model.f64), 1.0)
    assert np.all(np.linalg.norm(ref, axis=1) <= 1.0 + 1e-12) and np.mean(np.linalg.norm(ref, axis=1) > 0.999) > 0.5
    R, est = 300, []
    for r in range(R):
        con = core.handle(invite(make_spec(round_=r), shard))
        assert not con.refusals and len(user_messages(con)) == N
        # the N users' counts as one group sum (pvec_round._put_sums), in [0, N (g + m)]
        assert not con.messages and not con.columns.counts and len(con.columns.sums) == 8 * D
        total = count_total(con)
        assert total.shape == (D,) and total.min() >= 0 and total.max() <= N * (16 + 8)
        assert len({m.nonce for m in user_messages(con)}) == N and all(len(m.nonce) == 16 for m in user_messages(con))
        est.append(pvec.decode_counts(total, N, params))
    se = np.sqrt(pvec.pvec_variance(ref, params) / R)
    assert np.all(np.abs(np.mean(est, axis=0) - ref.sum(axis=0)) <= 4 * se), (np.mean(est, axis=0), ref.sum(0), se)
    # each user's spend is the sum of its round costs
    assert core.spent("u0") == pytest.approx((R * 1.0, R * 1e-6))
    assert core.status().rounds_joined == R


def test_bits_mode_sealed_per_labelled_bit():
    shard = make_shard(n=5)
    core = NodeCore("node", shard, NO_VERIFY, rng=make_rng(3))
    priv, pub = generate_keypair()
    spec = make_spec(round_=7, transport=pb.BITS, g=4, m=3, p=0.5, analyzer_public_key=pub)
    spec.randomizer.message_bytes = BIT_MESSAGE_BYTES
    con = core.handle(invite(spec, shard))
    assert len(user_messages(con)) == 5
    info = round_info("run", 7)
    for msg in user_messages(con):
        cts = list(msg.sealed.ciphertexts)
        assert len(cts) == D * (4 + 3)  # d (g+m) messages per user (Alg 2, spec 000 sec 7 item 1)
        assert {len(c) for c in cts} == {sealed_length(BIT_MESSAGE_BYTES)}
        labels, bits = unpack_labelled_bits([open_sealed(priv, c, info) for c in cts])
        assert np.array_equal(np.bincount(labels, minlength=D), np.full(D, 7))
        assert set(np.unique(bits)) <= {0, 1}
        with pytest.raises(SealingError):  # bound to run and round
            open_sealed(priv, cts[0], round_info("run", 8))


def test_policy_refusals_with_reasons():
    shard = make_shard(n=4)
    policies = [
        UserPolicy(max_eps_per_round=0.5, verify_randomizer=False),  # u0: round too expensive
        UserPolicy(allowed_transports=frozenset({"bits", "sealed"}), verify_randomizer=False),  # u1: no COUNTS
        UserPolicy(max_total_eps=1.5, verify_randomizer=False),  # u2: budget for one round only
        UserPolicy(allowed_trust_models=frozenset({"shuffle"}), verify_randomizer=False),  # u3
    ]
    core = NodeCore("node", shard, policies, rng=make_rng(4))
    con = core.handle(invite(make_spec(1), shard))
    assert [m.user_id for m in user_messages(con)] == ["u2", "u3"]
    assert {r.user_id: r.reason for r in con.refusals} == {"u0": Refusal.ROUND_EPS, "u1": Refusal.TRANSPORT}
    con = core.handle(invite(make_spec(2, trust_model=pb.CENTRAL), shard))
    assert {r.user_id: r.reason for r in con.refusals} == {
        "u0": Refusal.ROUND_EPS,  # u0 allows every trust model; its round cost is still too high
        "u1": Refusal.TRANSPORT,
        "u2": Refusal.TOTAL_EPS,
        "u3": Refusal.TRUST_MODEL,
    }
    assert core.spent("u2") == (1.0, 1e-6) and core.spent("u0") == (0.0, 0.0)
    assert dict(core.status().refusals) == {
        Refusal.ROUND_EPS: 2,
        Refusal.TRANSPORT: 2,
        Refusal.TOTAL_EPS: 1,
        Refusal.TRUST_MODEL: 1,
    }


def test_invalid_or_unsupported_specs_are_refused():
    shard = make_shard(n=2)
    core = NodeCore("node", shard, NO_VERIFY, rng=make_rng(5))
    for s, reason in (
        (make_spec(1, eps=-1.0), Refusal.INVALID_SPEC),
        (make_spec(2, delta=float("nan")), Refusal.INVALID_SPEC),
        (make_spec(3, transport=pb.SEALED), Refusal.PROTOCOL),
    ):
        con = core.handle(invite(s, shard))
        assert not user_messages(con) and {r.reason for r in con.refusals} == {reason}
    bad_model = make_spec(4)
    bad_model.randomizer.dim = D + 1  # model and randomizer disagree: nothing computed, nothing charged
    con = core.handle(invite(bad_model, shard))
    assert not user_messages(con) and {r.reason for r in con.refusals} == {Refusal.INVALID_SPEC}
    assert core.spent("u0") == (0.0, 0.0)


def test_randomizer_is_verified_not_trusted():
    """With verify_randomizer on, each user recomputes the round's eps from (d, g, m, p) with the calibrated
    accountant at n' = min_contributors, whatever per_user_cost claims."""
    from shuffledp.accountants.calibrated_pvec import calibrate_pvec
    from shuffledp.accountants.pvec_pld import pvec_round_epsilon

    shard = make_shard(n=2)
    core = NodeCore("node", shard, UserPolicy(max_eps_per_round=2.0), rng=make_rng(6))
    n = 50
    good = calibrate_pvec(1.0, 1e-6, n, D, 1.0)
    assert pvec_round_epsilon(good, n, 1e-6) <= 1.0
    spec = make_spec(1, g=good.g, m=good.m, p=good.p, eps=1.0, delta=1e-6, min_contributors=n, cohort_size=n)
    assert len(user_messages(core.handle(invite(spec, shard)))) == 2  # honest round: joined
    # the same randomizer with a threshold of 1 contributor: far less noise in the released sum -> weaker
    weak = make_spec(2, g=good.g, m=good.m, p=good.p, eps=1.0, delta=1e-6, min_contributors=1, cohort_size=n)
    assert pvec_round_epsilon(good, 1, 1e-6) > 2.0
    con = core.handle(invite(weak, shard))
    assert not user_messages(con) and {r.reason for r in con.refusals} == {Refusal.WEAK_RANDOMIZER}
    # parameters the accountant cannot evaluate (m n' < g) are not trusted either
    odd = make_spec(3, g=16, m=1, p=0.01, eps=0.5, delta=1e-6, min_contributors=1)
    con = core.handle(invite(odd, shard))
    assert not user_messages(con) and {r.reason for r in con.refusals} == {Refusal.UNVERIFIABLE}


def test_node_service_status_health_and_registration():
    server, port = start_shuffler("127.0.0.1:0")
    cfg = parse_config('[data]\ndataset = "digits"\nmax_users = 30\n')
    handles = [
        start_node(f"node-{i}", cfg, i, 2, f"127.0.0.1:{port}", policy=NO_VERIFY, rng=make_rng(10 + i))
        for i in range(2)
    ]
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pbg.ShufflerStub(ch)
        end = time.monotonic() + 10
        while stub.GetPopulation(pb.PopulationRequest()).admitted_users < 30:
            assert time.monotonic() < end
            time.sleep(0.02)
        assert server.shuffler_state.population("").connected_nodes == 2
        for i, h in enumerate(handles):
            nch = grpc.insecure_channel(f"127.0.0.1:{h.port}")
            st = pbg.ClientNodeStub(nch).GetNodeStatus(pb.NodeStatusRequest(), timeout=5)
            assert st.node_id == f"node-{i}" and st.users == 15
            hs = health_pb2_grpc.HealthStub(nch)
            for service in ("", "shuffledp.v1.ClientNode"):
                serving, end = health_pb2.HealthCheckResponse.SERVING, time.monotonic() + 10
                # set by the node once its stream is open: not ordered with the shuffler's count above
                while (resp := hs.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status != serving:
                    assert time.monotonic() < end, resp
                    time.sleep(0.02)
            nch.close()
        assert handles[0].core.shard.user_ids[:2] == ["n0-u0", "n0-u2"]
        ch.close()
    finally:
        for h in handles:
            h.stop()
        server.stop(0).wait()


def test_users_compose_their_spend_like_the_ledger_and_keep_it_across_restarts(tmp_path):
    """A user may join as many rounds as the ledger's own RDP accountant allows at its max_total_delta (issue 10:
    basic composition stopped a default 100-round run at round 85 while the ledger showed eps 6.66), never more;
    and the history it composes survives a node restart (real SQLite)."""
    from shuffledp.clients.spend_store import SqliteSpendStore

    from shuffledp.accountants.calibrated_pvec import calibrate_pvec
    from shuffledp.accountants.pvec_pld import composed_epsilon

    n_release, total_delta, limit = 50, 1e-2, 6.0
    params = calibrate_pvec(1.0, 1e-4, n_release, D, 1.0)
    extra = {"eps": params.eps, "delta": params.delta, "n": float(n_release)}
    shard = make_shard(n=4)
    policy = UserPolicy(max_total_eps=limit, max_total_delta=total_delta)

    def spec(r: int) -> pb.RoundSpec:
        s = make_spec(r, g=params.g, m=params.m, p=params.p, eps=1.0, delta=1e-4, min_contributors=n_release)
        s.randomizer.extra.update(extra)
        return s

    def joined_until_refused(core: NodeCore, start: int) -> int:
        for r in range(start, start + 200):
            con = core.handle(invite(spec(r), shard))
            if not user_messages(con):
                assert {x.reason for x in con.refusals} == {Refusal.TOTAL_EPS}
                return r - start
            assert len(user_messages(con)) == 4
        raise AssertionError("never refused")

    store = SqliteSpendStore(tmp_path / "spend.sqlite")
    core = NodeCore("node", shard, policy, rng=make_rng(8), spend_store=store)
    joined = joined_until_refused(core, 0)
    # exactly as many rounds as the ledger's accountant certifies within the limit at the user's total delta
    assert composed_epsilon([(params, n_release, joined)], total_delta) <= limit
    assert composed_epsilon([(params, n_release, joined + 1)], total_delta) > limit
    assert joined > limit / 1.0  # basic composition (eps 1 per round) would have stopped at 6 rounds
    assert core.policy.tight_spent(0) == composed_epsilon([(params, n_release, joined)], total_delta)
    assert core.spent("u0")[0] >= joined * 1.0  # the basic totals are still kept (an upper bound too)
    store.close()
    restarted = NodeCore(
        "node", shard, policy, rng=make_rng(9), spend_store=SqliteSpendStore(tmp_path / "spend.sqlite")
    )
    assert joined_until_refused(restarted, joined) == 0
    assert restarted.policy.tight_spent(0) == core.policy.tight_spent(0)


@pytest.mark.parametrize(
    "field, value, reason", [("trust_model", 17, Refusal.TRUST_MODEL), ("transport", 9, Refusal.TRANSPORT)]
)
def test_unknown_enum_values_are_refused_not_a_crash(field, value, reason):
    """An analyzer may send enum values no user knows: every user refuses (found by the RPC fuzz test: the node
    raised IndexError and sent nothing, so the round waited for its deadline)."""
    shard = make_shard(n=5)
    core = NodeCore("node", shard, NO_VERIFY, rng=make_rng(3))
    spec = make_spec(1)
    setattr(spec, field, value)
    con = core.handle(pb.Invitation(spec=spec, user_ids=shard.user_ids[1:4]))
    assert not user_messages(con) and [r.reason for r in con.refusals] == [reason] * 3


def test_check_in_invitation_is_answered_without_payload_and_charges_nothing():
    """Check-in (mechanisms/check_in.py): the first invitation is answered with one payload-free message per user
    whose policy accepts the worst case, nothing is computed or charged; the second invitation (checked_in > 0) is
    a normal round, charged once. A user whose policy refuses the worst case refuses at check-in already."""
    shard = make_shard(n=6)
    policies = [NO_VERIFY] * 5 + [UserPolicy(max_eps_per_round=0.5, verify_randomizer=False)]
    core = NodeCore("node", shard, policies, rng=make_rng(4))
    first = make_spec(round_=3, g=16, m=8, min_contributors=5)
    first.check_in.noise_trials, first.check_in.report_fraction = 40, 0.99
    con = core.handle(invite(first, shard))
    assert [m.user_id for m in user_messages(con)] == shard.user_ids[:5]
    assert all(m.WhichOneof("payload") is None and len(m.nonce) == 16 for m in user_messages(con))
    assert [(r.user_id, r.reason) for r in con.refusals] == [(shard.user_ids[5], Refusal.ROUND_EPS)]
    assert core.spent("u0") == (0.0, 0.0) and core.status().rounds_joined == 0
    second = make_spec(round_=3, g=16, m=8, min_contributors=5)
    second.CopyFrom(first)
    second.check_in.checked_in, second.randomizer.m = 5, 8  # c = 5: c_min = 5, m = ceil(40 / 5)
    con = core.handle(pb.Invitation(spec=second, user_ids=shard.user_ids[:5]))
    assert [m.user_id for m in user_messages(con)] == shard.user_ids[:5] and con.columns.sums
    assert core.spent("u0") == pytest.approx((1.0, 1e-6)) and core.status().rounds_joined == 1


@pytest.mark.parametrize("check_in", [False, True])
def test_a_user_named_twice_in_an_invitation_sends_one_message_for_its_one_charge(check_in):
    """A shuffler that names a user twice in one invitation (or in a check-in) gets one message from that user, not
    two independent randomizations of one gradient for one charge (the node charges a round once per user); ids
    this node does not host (another node's, or none) are not answered."""
    shard = make_shard(n=6)
    core = NodeCore("node", shard, NO_VERIFY, rng=make_rng(5))
    spec = make_spec(round_=2, min_contributors=1)
    twice = ["u1", "u9", "u1", "u2", "", "u3", "u2", "u1", "node\nu0"]
    if check_in:
        spec.check_in.noise_trials, spec.check_in.report_fraction = 40, 0.99
        con = core.handle(pb.Invitation(spec=spec, user_ids=twice))
        assert [m.user_id for m in user_messages(con)] == ["u1", "u2", "u3"]
        second = pb.RoundSpec()
        second.CopyFrom(spec)
        second.check_in.checked_in, second.randomizer.m = 3, 14  # c = 3: m = ceil(40 / 3)
        core.prepare(pb.Invitation(spec=spec, user_ids=twice))
        spec = second
    con = core.handle(pb.Invitation(spec=spec, user_ids=twice))
    assert [m.user_id for m in user_messages(con)] == ["u1", "u2", "u3"] and con.columns.sums
    assert core.spent("u1") == pytest.approx((1.0, 1e-6)) and core.spent("u0") == (0.0, 0.0)


def test_a_rounds_charge_is_grouped_by_eps_delta_key_and_step_in_first_appearance_order():
    """spend_store.charges against a grouping written out here, on one-group rounds (its fast path) and mixed ones."""
    from shuffledp.clients.spend_store import charges

    rng = make_rng(23)
    ids = [f"u{i}" for i in range(50)]
    key_a, key_b = (1000, 0.5, 4, 8), (2000, 0.5, 4, 8)
    for case in range(40):
        mixed = case % 2 == 1
        eps = rng.choice([0.25, 0.5], size=50) if mixed else np.full(50, 0.25)
        delta = rng.choice([1e-6, 0.0], size=50) if mixed and case % 4 == 1 else 1e-6
        keys = [[key_a, tuple(key_a), key_b, None][j] for j in rng.integers(0, 4 if mixed else 1, size=50)]
        steps = [["joined", "eligible"][j] for j in rng.integers(0, 2 if mixed else 1, size=50)] if case % 3 else None
        want: dict[tuple, list[str]] = {}
        deltas = np.broadcast_to(delta, (50,))
        for i, u in enumerate(ids):
            want.setdefault((float(eps[i]), float(deltas[i]), keys[i], steps[i] if steps else None), []).append(u)
        got = charges(ids, eps, delta, keys, "run", steps, case)
        assert got == [(users, e, d, k, "run", st, case) for (e, d, k, st), users in want.items()]
        assert (len(got) == 1) == (not mixed)


def test_spend_store_is_a_log_of_rounds_that_replays_to_the_same_totals(tmp_path):
    """Issue 15: the node's spend record costs one row per round and (eps, key) group, not one per user, and a
    restarted node reads back bitwise the totals and histories it held; a store of the earlier per-user layout is
    read as the starting totals."""
    import sqlite3

    from shuffledp.clients.spend_store import SqliteSpendStore

    ids = [f"u{i}" for i in range(300)]
    table = PolicyTable(UserPolicy(), len(ids))
    store = SqliteSpendStore(tmp_path / "spend.sqlite")
    key_a, key_b = (1000, 0.5, 4, 8), (2000, 0.5, 4, 8)
    rng = make_rng(21)
    for r in range(12):
        idx = np.sort(rng.choice(len(ids), size=200, replace=False))
        cost = np.where(idx % 3 == 0, 0.1 + r * 1e-3, 0.7 / 3.0)  # two distinct costs per round
        key = key_a if r % 2 else key_b
        keys = table.charge(idx, cost, 1e-7, None if r == 5 else key)
        store.record([ids[i] for i in idx], cost, 1e-7, keys)
    db = sqlite3.connect(tmp_path / "spend.sqlite")
    assert db.execute("SELECT COUNT(*) FROM charges").fetchone()[0] == 24  # 12 rounds x 2 costs, not 2400 rows
    store.close()
    eps, delta, history = SqliteSpendStore(tmp_path / "spend.sqlite").load(ids)
    assert eps.tobytes() == table.eps_spent.tobytes() and delta.tobytes() == table.delta_spent.tobytes()
    assert history == table.history

    old = tmp_path / "old.sqlite"  # the earlier layout: absolute per-user totals and histories
    db = sqlite3.connect(old)
    db.execute("CREATE TABLE spend (user_id TEXT PRIMARY KEY, eps REAL, delta REAL, tight INTEGER)")
    db.execute("CREATE TABLE history (user_id TEXT, n_total INTEGER, p REAL, g INTEGER, d INTEGER, rounds INTEGER)")
    db.executemany("INSERT INTO spend VALUES (?, ?, ?, ?)", [("u0", 2.5, 1e-6, 1), ("u1", 1.0, 0.0, 0)])
    db.execute("INSERT INTO history VALUES ('u0', 1000, 0.5, 4, 8, 3)")
    db.commit()
    db.close()
    store = SqliteSpendStore(old)
    store.record(["u0", "u1"], np.array([0.5, 0.5]), 1e-6, [key_a, key_a])
    eps, delta, history = SqliteSpendStore(old).load(["u0", "u1", "u2"])
    assert eps.tolist() == [3.0, 1.5, 0.0] and delta.tolist() == [2e-6, 1e-6, 0.0]
    assert history == [Counter({key_a: 4}), None, Counter()]


def test_spend_store_keeps_a_set_of_users_once_and_loads_row_by_row(tmp_path):
    """Issue 30 (found in session 17): every round's row held all its users' ids, so a node's record grew by every id
    per round and a restart held every round's id lists at once (10^5 users, 40 rounds: 57 MB on disk, +325 MiB to
    load). Rounds of the same users name one stored set; loading decodes it once and reads the log row by row, to
    the same totals as rows of the earlier layout (their own ids), which a store may still hold."""
    import sqlite3
    import tracemalloc

    from shuffledp.clients.spend_store import SqliteSpendStore

    ids = [f"user-{i:06d}" for i in range(3000)]
    key = (1000, 0.5, 4, 8)

    def load_peak(path) -> tuple[int, tuple]:
        store = SqliteSpendStore(path)
        tracemalloc.start()
        out = store.load_all(ids)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        store.close()
        return peak, out

    one, many = tmp_path / "one.sqlite", tmp_path / "many.sqlite"
    SqliteSpendStore(one).record(ids, np.full(len(ids), 0.25), 1e-7, [key] * len(ids))
    store = SqliteSpendStore(many)
    table = PolicyTable(UserPolicy(), len(ids))
    for r in range(60):
        idx = np.arange(len(ids)) if r % 10 else np.arange(0, len(ids), 2)  # every tenth round: half of them
        table.charge(idx, np.full(idx.size, 0.25), 1e-7, key)
        store.record([ids[i] for i in idx], np.full(idx.size, 0.25), 1e-7, [key] * idx.size)
    store.close()
    db = sqlite3.connect(many)
    assert db.execute("SELECT COUNT(*) FROM user_sets").fetchone()[0] == 2  # all users, and every second one
    assert db.execute("SELECT COUNT(*), MAX(LENGTH(users)) FROM charges").fetchone() == (60, 0)
    db.close()
    peak_one, _ = load_peak(one)
    peak_many, (eps, delta, history, _) = load_peak(many)
    assert peak_many < 2 * peak_one, (peak_many, peak_one)  # not 60 rounds of id lists (old code: ~25x)
    assert eps.tobytes() == table.eps_spent.tobytes() and delta.tobytes() == table.delta_spent.tobytes()
    assert history == table.history

    # a store of the earlier log layout (rows holding their ids, no user_sets) reads the same and takes new rows
    old = tmp_path / "old-log.sqlite"
    db = sqlite3.connect(old)
    db.execute(
        "CREATE TABLE charges (seq INTEGER PRIMARY KEY AUTOINCREMENT, users BLOB NOT NULL, eps REAL NOT NULL, "
        "delta REAL NOT NULL, noise_key TEXT, run TEXT, step TEXT)"
    )
    db.execute("INSERT INTO charges (users, eps, delta, noise_key) VALUES (?, 0.5, 1e-7, '[1000, 0.5, 4, 8]')",
               ("\n".join(ids[:2]).encode(),))  # fmt: skip
    db.commit()
    db.close()
    SqliteSpendStore(old).record(ids[1:3], np.full(2, 0.25), 1e-7, [None, None])
    eps, _, history = SqliteSpendStore(old).load(ids[:4])
    assert eps.tolist() == [0.5, 0.75, 0.25, 0.0]
    assert history == [Counter({key: 1}), None, None, Counter()]


def test_a_rounds_nonces_are_one_buffer_read_as_a_sequence_of_bytes():
    """protocols.base.Nonces: per-message protocols read nonce i as bytes i*w..(i+1)*w of the buffer, PVEC's columns
    take the buffer itself; every nonce of a node's round is fresh (16 bytes from the OS CSPRNG each)."""
    from shuffledp.clients.node import NONCE_BYTES, _nonces

    from shuffledp.protocols.base import Nonces

    blob = bytes(range(48))
    n = Nonces(blob, 16)
    assert len(n) == 3 and n[0] == blob[:16] and n[2] == blob[32:] and n[-1] == blob[32:]
    assert list(n) == [blob[:16], blob[16:32], blob[32:]] and n[1:] == [blob[16:32], blob[32:]]
    with pytest.raises(IndexError):
        n[3]
    with pytest.raises(ValueError, match="not nonces of 16 bytes"):
        Nonces(blob[:40], 16)
    fresh = _nonces(1000)
    assert fresh.width == NONCE_BYTES and len(fresh.blob) == 1000 * NONCE_BYTES and len(set(fresh)) == 1000
    shard = make_shard(n=3)
    core = NodeCore("node", shard, NO_VERIFY, rng=make_rng(6))
    out = core.handle(invite(make_spec(), shard))
    assert out.columns.nonce_bytes == NONCE_BYTES and len(out.columns.nonces) == 3 * NONCE_BYTES
