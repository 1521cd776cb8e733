"""Shuffler trust boundary and schedules, with real gRPC servers on 127.0.0.1:0 and real client nodes.

The test plays the analyzer (ExecuteRound through a real stub). What the shuffler received is captured at its
service boundary by a server interceptor (not by trusting the code); what the analyzer received is the
ShuffledBatch the stub returned.
"""

from __future__ import annotations

import queue
import secrets
import sqlite3
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from _intercept import Recorder, count_total, user_messages
from scipy import stats
from shuffledp.clients.node import UserShard, start_node_with_shard
from shuffledp.clients.policy import UserPolicy
from shuffledp.services.shuffler import serve_shuffler
from shuffledp.services.shuffler_state import (
    CallerGone,
    CohortUnavailable,
    RoundExistsError,
    RoundRejected,
    RoundRequest,
    Schedule,
    ShufflerState,
    SqliteParticipationStore,
    Transport,
    TreeLimits,
    user_key,
)

from shuffledp.mechanisms import pvec
from shuffledp.security.rng import make_rng
from shuffledp.security.sealing import (
    BIT_MESSAGE_BYTES,
    SealingError,
    generate_keypair,
    open_sealed,
    private_key_from_bytes,
    round_info,
    seal,
    sealed_length,
    unpack_labelled_bits,
)
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

NO_VERIFY = UserPolicy(verify_randomizer=False)  # the accountant is tested with the analyzer; here transport
F = 3  # features of the synthetic least-squares shards -> d = F + 1


class Shuffler:
    def __init__(self, state_path=None, listen="127.0.0.1:0", seed=11) -> None:
        self.store = SqliteParticipationStore(state_path) if state_path else None
        self.state = ShufflerState(self.store, rng=make_rng(seed))
        self.recorder = Recorder()
        self.server, self.port = serve_shuffler(self.state, listen, interceptors=[self.recorder])
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address, options=[("grpc.max_receive_message_length", 2**26)])
        self.stub = pbg.ShufflerStub(self.channel)

    def wait_nodes(self, n: int, users: int | None = None, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while True:
            p = self.stub.GetPopulation(pb.PopulationRequest(run_id="r"), timeout=5)
            if p.connected_nodes >= n and (users is None or p.admitted_users >= users):
                return
            assert time.monotonic() < end, f"nodes did not connect: {p}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(0).wait()
        if self.store is not None:
            self.store.close()


@pytest.fixture
def shuffler():
    s = Shuffler()
    yield s
    s.stop()


def shard(prefix: str, n: int, seed: int) -> UserShard:
    rng = make_rng(seed)
    return UserShard([f"{prefix}-u{j}" for j in range(n)], rng.normal(size=(n, 1, F)) * 3, rng.normal(size=(n, 1)))


def spec(round_, transport=pb.COUNTS, schedule=pb.FULLY_INTERACTIVE, cohort=0, g=4, m=6, p=0.3, **kw) -> pb.RoundSpec:
    d = F + 1
    s = pb.RoundSpec(
        run_id="r",
        round=round_,
        schedule=schedule,
        trust_model=pb.SHUFFLE,
        transport=transport,
        randomizer=pb.RandomizerSpec(protocol="pvec", dim=d, g=g, m=m, p=p, clip_norm=1.0),
        model=pb.Tensor(shape=[d], f64=np.linspace(-0.5, 0.5, d).tobytes()),
        task="leastsq",
        cohort_size=cohort,
        min_contributors=1,
        deadline_seconds=20.0,
        per_user_cost=pb.PrivacyCost(eps=1.0, delta=1e-6),
        local_batch=1,
    )
    for k, v in kw.items():
        setattr(s, k, v)
    return s


@pytest.fixture
def nodes(shuffler):
    handles = [
        start_node_with_shard(
            f"node-{i}", shard(f"n{i}", 5 + i, seed=i), shuffler.address, policy=NO_VERIFY, rng=make_rng(100 + i)
        )
        for i in range(2)
    ]
    shuffler.wait_nodes(2, users=11)
    yield handles
    for h in handles:
        h.stop()


def test_count_mode_batch_holds_only_label_totals(shuffler, nodes):
    batch = shuffler.stub.ExecuteRound(spec(1), timeout=30)
    received = shuffler.recorder.for_round(1)
    assert len(received) == 2  # one Submit per node per round
    assert sum(len(user_messages(c)) for c in received) == 11
    assert batch.released and batch.report.contributors == 11 and batch.report.invited == 11
    # only the d per-label totals, equal to the sum of what the nodes sent (their users' sums); no ciphertexts
    assert len(batch.label_totals) == F + 1 and not batch.ciphertexts
    np.testing.assert_array_equal(np.array(batch.label_totals), np.sum([count_total(c) for c in received], axis=0))
    # nothing else: no ids, nonces, node names or per-user counts anywhere in what the analyzer received
    assert {f.name for f, _ in batch.ListFields()} <= {"run_id", "round", "released", "label_totals", "report"}
    assert {f.name for f, _ in batch.report.ListFields()} <= {"invited", "contributors", "rejected", "refused"}
    wire = batch.SerializeToString()
    for c in received:
        assert c.node_id.encode() not in wire
        for m in user_messages(c):
            assert m.user_id.encode() not in wire and m.nonce not in wire
    # population is sizes only
    pop = shuffler.stub.GetPopulation(pb.PopulationRequest(run_id="r"))
    assert (pop.admitted_users, pop.unused_users, pop.connected_nodes) == (11, 11, 2)


def test_bits_mode_only_ciphertexts_shuffler_cannot_open(shuffler, nodes):
    priv, pub = generate_keypair()
    s = spec(1, transport=pb.BITS, g=2, m=3, p=0.4, analyzer_public_key=pub)
    s.randomizer.message_bytes = BIT_MESSAGE_BYTES
    batch = shuffler.stub.ExecuteRound(s, timeout=30)
    d, per_user = F + 1, (F + 1) * (2 + 3)
    assert batch.released and batch.report.contributors == 11 and not batch.label_totals
    assert len(batch.ciphertexts) == 11 * per_user
    assert {len(c) for c in batch.ciphertexts} == {sealed_length(BIT_MESSAGE_BYTES)}  # one length only
    received = [c for con in shuffler.recorder.for_round(1) for m in user_messages(con) for c in m.sealed.ciphertexts]
    assert sorted(received) == sorted(batch.ciphertexts)  # exactly the received multiset ...
    assert list(received) != list(batch.ciphertexts)  # ... in another order
    info = round_info("r", 1)
    # the shuffler holds no private key: the only key material it ever saw (the public key, as bytes), a key it
    # could generate, and the right key with another round's info all fail; the analyzer's key opens everything
    for key in (private_key_from_bytes(pub), generate_keypair()[0]):
        with pytest.raises(SealingError):
            open_sealed(key, batch.ciphertexts[0], info)
    with pytest.raises(SealingError):
        open_sealed(priv, batch.ciphertexts[0], round_info("r", 2))
    labels, bits = unpack_labelled_bits([open_sealed(priv, c, info) for c in batch.ciphertexts])
    assert np.array_equal(np.bincount(labels, minlength=d), np.full(d, 11 * 5))  # n'(g+m) messages per label
    assert set(np.unique(bits)) <= {0, 1}
    assert not any(hasattr(v, "private_bytes") for v in vars(shuffler.state).values())


def test_central_vectors_reach_the_analyzer_as_one_length_of_ciphertext_only(shuffler, nodes):
    """DP-FTRL's transport (central trust): the shuffler holds only HPKE ciphertexts of one fixed length (8 d + 48
    bytes), forwards them permuted without ids; the analyzer opens clipped vectors and sums them, and a message that
    does not open, is too long, non-finite or above the clip norm is counted and never summed."""
    from shuffledp.services.ledger import PrivacyEvent

    from shuffledp.protocols.base import MALFORMED_PLAINTEXT, UNDECRYPTABLE
    from shuffledp.protocols.central import OVER_CLIP_NORM, message_bytes
    from shuffledp.protocols.tree_round import TreeRound

    priv, pub = generate_keypair()
    d, tree = F + 1, TreeRound()
    params = {"d": d, "clip": 1.0, "k": 11, "n": 11, "max_participations": 1, "min_separation": 0}
    params.update(rounds_per_tree=4, trees=1, completion=False, efficient=True, delta=1e-5, noise_multiplier=2.0)
    event = PrivacyEvent("tree", {**params, "round": 1}, 11, "subsampled", "central")
    s = spec(1, schedule=pb.SUBSAMPLED, cohort=11)
    s.MergeFrom(pb.RoundSpec(**tree.spec_fields({}, params, event, pub)))
    s.randomizer.ClearField("g"), s.randomizer.ClearField("m"), s.randomizer.ClearField("p")
    batch = shuffler.stub.ExecuteRound(s, timeout=30)
    assert batch.released and batch.report.contributors == 11 and len(batch.ciphertexts) == 11
    assert {len(c) for c in batch.ciphertexts} == {sealed_length(message_bytes(d))}
    received = [c for con in shuffler.recorder.for_round(1) for m in user_messages(con) for c in m.sealed.ciphertexts]
    assert sorted(received) == sorted(batch.ciphertexts)
    assert set(pb.ShuffledBatch.DESCRIPTOR.fields_by_name) == {
        "run_id",
        "round",
        "released",
        "report",
        "label_totals",
        "ciphertexts",
        "reports",  # PRIO3's Helper parts (issue 45): empty here, and never a Leader share
    }
    assert not batch.reports
    info = round_info("r", 1)
    vectors = np.array([np.frombuffer(open_sealed(priv, c, info), dtype=">f8") for c in batch.ciphertexts])
    assert np.all(np.linalg.norm(vectors, axis=1) <= 1.0 + 1e-12)  # clipped by the users' nodes
    # the analyzer's decoder on the real batch plus bad messages from a dishonest client
    bad = [
        seal(generate_keypair()[1], vectors[0].astype(">f8").tobytes(), info),  # another key
        seal(pub, vectors[0].astype(">f8").tobytes(), round_info("r", 2)),  # replayed from another round
        seal(pub, np.zeros(d + 1).astype(">f8").tobytes(), info),  # oversized
        seal(pub, np.full(d, np.nan).astype(">f8").tobytes(), info),  # non-finite
        seal(pub, np.full(d, 10.0).astype(">f8").tobytes(), info),  # above the clip norm
    ]
    forged = pb.ShuffledBatch(run_id="r", round=1, released=True, ciphertexts=[*batch.ciphertexts, *bad])
    dec = tree.decode(forged, 16, {}, params, priv, info)
    np.testing.assert_allclose(dec.total, vectors.sum(axis=0), atol=1e-12)
    assert (dec.used, dec.charged) == (11, 16)
    assert dec.rejected == {UNDECRYPTABLE: 2, MALFORMED_PLAINTEXT: 2, OVER_CLIP_NORM: 1}


class FakeNode:
    """The test as a client node sending messages it builds itself (to find them again, or malformed)."""

    def __init__(self, stub, node_id: str, users: list[str]) -> None:
        self.stub, self.node_id, self.users = stub, node_id, users
        stub.RegisterUsers(pb.RegisterUsersRequest(node_id=node_id, user_ids=users), timeout=5)
        self.q: queue.Queue = queue.Queue()
        self.call = stub.Subscribe(pb.SubscribeRequest(node_id=node_id))
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for inv in self.call:
                self.q.put(inv)
        except grpc.RpcError:
            pass  # cancelled at the end of the test


def test_permutation_uniform_chi_square(shuffler):
    """Position of a marked user's message over repeated rounds (spec 000 sec 7 item 5): uniform.

    The marked user's message always arrives first; without the CSPRNG permutation it would sit at position 0.
    Chi-square goodness of fit over n positions, R rounds, fixed seeds; fail below p = 0.001.
    """
    n, rounds = 8, 240
    priv, pub = generate_keypair()
    node = FakeNode(shuffler.stub, "fake", [f"m{i}" for i in range(n)])
    shuffler.wait_nodes(1, users=n)
    pool = futures.ThreadPoolExecutor(1)
    positions = []
    try:
        for r in range(rounds):
            s = spec(r, transport=pb.SEALED, analyzer_public_key=pub)
            s.randomizer.messages_per_user, s.randomizer.message_bytes = 1, 4
            fut = pool.submit(shuffler.stub.ExecuteRound, s, timeout=30)
            inv = node.q.get(timeout=10)
            info = round_info("r", r)
            msgs = [
                pb.UserMessage(
                    user_id=u,
                    nonce=secrets.token_bytes(16),
                    sealed=pb.SealedMessages(ciphertexts=[seal(pub, bytes([i]) * 4, info)]),
                )
                for i, u in enumerate(inv.user_ids)
            ]
            marked = msgs[0].sealed.ciphertexts[0]
            shuffler.stub.Submit(pb.Contribution(run_id="r", round=r, node_id="fake", messages=msgs))
            batch = fut.result(timeout=30)
            positions.append(list(batch.ciphertexts).index(marked))
    finally:
        node.call.cancel()
        pool.shutdown()
    assert open_sealed(priv, marked, info) == b"\x00" * 4
    hist = np.bincount(positions, minlength=n)
    chi2 = stats.chisquare(hist)
    assert chi2.pvalue > 1e-3, (hist, chi2)


@pytest.mark.parametrize("g, m", [(4, 6), (4, 300), (4, 70_000)])  # wire widths 1, 2 and 4 bytes
def test_count_vector_packed_malformed_cases_rejected_and_counted(shuffler, g, m):
    """CountVector.packed (d values of count_wire_dtype(g+m), design 5.3): a wrong length, a count above g+m, a
    legacy count that the narrow width would wrap into range, and both encodings in one message are rejected with
    their reason and counted; a valid packed message and a valid legacy repeated-field message, sent in the same
    Submit as two bad ones, are the only ones summed."""
    bound = g + m  # spec(): counts in [0, g+m], d = F + 1 = 4
    dtype = pvec.count_wire_dtype(bound)
    assert dtype.itemsize == {10: 1, 304: 2, 70_004: 4}[bound]
    users = [f"c{i}" for i in range(7)]
    node = FakeNode(shuffler.stub, "fake", users)
    shuffler.wait_nodes(1, users=len(users))
    pool = futures.ThreadPoolExecutor(1)

    def msg(user: str, **payload) -> pb.UserMessage:
        return pb.UserMessage(user_id=user, nonce=secrets.token_bytes(16), counts=pb.CountVector(**payload))

    good_packed, good_legacy = np.array([1, 2, 3, bound], dtype=dtype), [4, 0, bound, 1]
    wraps = bound + 2 ** (8 * dtype.itemsize)  # as the wire width it would read as `bound`: must not be summed
    submissions = [  # (messages, expected accepted, expected rejected)
        (  # d - 1 values; not a whole number of values
            [
                msg("c0", packed=good_packed.tobytes()[: -dtype.itemsize]),
                msg("c1", packed=good_packed.tobytes() + b"\0"),
            ],
            0,
            {"wrong_count_length": 2},
        ),
        ([msg("c2", packed=good_packed.tobytes(), counts=good_legacy)], 0, {"wrong_payload": 1}),
        (
            [
                msg("c3", packed=np.array([0, bound + 1, 0, 0], dtype=dtype).tobytes()),
                msg("c4", packed=good_packed.tobytes()),
                msg("c5", counts=[0, wraps, 0, 0]),
                msg("c6", counts=good_legacy),
            ],
            2,
            {"count_out_of_range": 2},
        ),
    ]
    before = shuffler.state.counters()
    try:
        fut = pool.submit(shuffler.stub.ExecuteRound, spec(1, g=g, m=m), timeout=30)
        assert sorted(node.q.get(timeout=10).user_ids) == users
        for msgs, accepted, rejected in submissions:
            ack = shuffler.stub.Submit(pb.Contribution(run_id="r", round=1, node_id="fake", messages=msgs))
            assert (ack.accepted, dict(ack.rejected)) == (accepted, rejected)
        batch = fut.result(timeout=30)  # every invitee answered: the round closes before its deadline
    finally:
        node.call.cancel()
        pool.shutdown()
    assert batch.released and batch.report.contributors == 2 and batch.report.invited == 7
    np.testing.assert_array_equal(np.array(batch.label_totals), good_packed.astype(np.int64) + good_legacy)
    expected = {"wrong_count_length": 2, "wrong_payload": 1, "count_out_of_range": 2}
    assert dict(batch.report.rejected) == expected
    after = shuffler.state.counters()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in [*expected, "accepted"]} == {**expected, "accepted": 2}


def test_sequential_never_reuses_a_user_across_restart(tmp_path):
    """SEQUENTIAL cohorts are disjoint, also after the shuffler restarts on its SQLite state; the real node
    reconnects by itself (backoff) to the restarted shuffler on the same port."""
    db = tmp_path / "shuffler.sqlite"
    s1 = Shuffler(db, seed=1)
    node = start_node_with_shard("node-0", shard("n0", 10, seed=3), s1.address, policy=NO_VERIFY, rng=make_rng(9))
    seen: list[set[str]] = []
    try:
        s1.wait_nodes(1, users=10)
        for r in (1, 2):
            batch = s1.stub.ExecuteRound(spec(r, schedule=pb.SEQUENTIAL, cohort=3), timeout=30)
            assert batch.released and batch.report.contributors == 3
            seen.append({m.user_id for c in s1.recorder.for_round(r) for m in user_messages(c)})
        assert s1.stub.GetPopulation(pb.PopulationRequest(run_id="r")).unused_users == 4
        port = s1.port
        s1.stop()
        s2 = Shuffler(db, listen=f"127.0.0.1:{port}", seed=1)  # same seed: the same draw would repeat users
        try:
            s2.wait_nodes(1, users=10, timeout=20)
            assert s2.stub.GetPopulation(pb.PopulationRequest(run_id="r")).unused_users == 4
            with pytest.raises(grpc.RpcError) as err:  # a round runs at most once
                s2.stub.ExecuteRound(spec(2, schedule=pb.SEQUENTIAL, cohort=3), timeout=10)
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            batch = s2.stub.ExecuteRound(spec(3, schedule=pb.SEQUENTIAL, cohort=4), timeout=30)
            assert batch.report.contributors == 4
            seen.append({m.user_id for c in s2.recorder.for_round(3) for m in user_messages(c)})
            with pytest.raises(grpc.RpcError) as err:  # every user used once: nobody left
                s2.stub.ExecuteRound(spec(4, schedule=pb.SEQUENTIAL, cohort=1), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # another run has its own participation record
            assert s2.stub.GetPopulation(pb.PopulationRequest(run_id="other")).unused_users == 10
        finally:
            s2.stop()
    finally:
        node.stop()
    assert [len(x) for x in seen] == [3, 3, 4]
    assert len(set.union(*seen)) == 10  # pairwise disjoint and together all users


def test_deadline_ends_round_with_contributors_received(shuffler, nodes):
    """A node that never answers: the round ends at its deadline with the contributions actually received."""
    silent = FakeNode(shuffler.stub, "silent", ["s0", "s1"])
    try:
        shuffler.wait_nodes(3, users=13)
        t0 = time.monotonic()
        batch = shuffler.stub.ExecuteRound(spec(1, deadline_seconds=1.5), timeout=30)
        elapsed = time.monotonic() - t0
        assert 1.4 <= elapsed < 6.0
        assert batch.released and batch.report.invited == 13 and batch.report.contributors == 11
        received = [count_total(c) for c in shuffler.recorder.for_round(1)]
        np.testing.assert_array_equal(np.array(batch.label_totals), np.sum(received, axis=0))
        # threshold above what arrives: released = false, no data at all
        batch = shuffler.stub.ExecuteRound(spec(2, deadline_seconds=1.0, min_contributors=12), timeout=30)
        assert not batch.released and batch.report.below_threshold and batch.report.contributors == 11
        assert not batch.label_totals and not batch.ciphertexts
    finally:
        silent.call.cancel()


def test_subsampled_cohorts_are_uniform():
    """SUBSAMPLED: k of n uniformly, secretly (seed 001). Domain level with a CSPRNG seed; each user's selection
    count over R rounds is Bin(R, k/n); chi-square goodness of fit, fail below p = 0.001."""
    state = ShufflerState(rng=make_rng(21), poll_seconds=0.001)
    users = [f"u{i}" for i in range(9)]
    state.register_users("node", users)
    sub = state.subscribe("node")
    k, rounds = 3, 600
    hits = np.zeros(len(users))
    for r in range(rounds):
        req = RoundRequest(
            "run", r, Schedule.SUBSAMPLED, Transport.COUNTS, dim=2, g=1, m=1, cohort_size=k, deadline_seconds=1e-4
        )
        res = state.execute_round(req)
        assert res.invited == k and not res.released
        inv = sub.get(timeout=1)
        assert len(set(inv.user_ids)) == k
        hits[[users.index(u) for u in inv.user_ids]] += 1
    assert stats.chisquare(hits).pvalue > 1e-3, hits
    assert state.population("run").unused_users == 9  # subsampling consumes nobody


def test_fully_interactive_cohort_must_match_population(shuffler, nodes):
    with pytest.raises(grpc.RpcError) as err:
        shuffler.stub.ExecuteRound(spec(1, cohort=5), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "11 admitted users" in err.value.details()
    batch = shuffler.stub.ExecuteRound(spec(2, cohort=11), timeout=30)
    assert batch.report.contributors == 11


def test_fully_interactive_population_is_fixed_at_the_first_round(tmp_path):
    """A node that connects after a fully interactive run's first round is not invited to that run (PGD optimises
    over the data set it started with, and the analyzer sized the noise and its contributor bound for it); the
    report counts its users as not_in_run. The population is durable: a restarted shuffler keeps it."""
    db = tmp_path / "shuffler.sqlite"

    def fi(state: ShufflerState, r: int, run: str = "run"):
        req = RoundRequest(run, r, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=2, g=1, m=1, deadline_seconds=1e-4)
        return state.execute_round(req)

    store = SqliteParticipationStore(db)
    state = ShufflerState(store, rng=make_rng(3), poll_seconds=0.001)
    state.register_users("a", ["a0", "a1", "a2"])
    sub_a = state.subscribe("a")
    res = fi(state, 0)
    assert (res.invited, res.not_in_run) == (3, 0)
    state.register_users("b", ["b0", "b1"])  # scaled up during the run
    sub_b = state.subscribe("b")
    res = fi(state, 1)
    assert (res.invited, res.not_in_run) == (3, 2)
    assert sub_a.get(timeout=1) is not None and sub_a.get(timeout=1) is not None
    assert sub_b.get(timeout=0.05) is None  # never invited to this run
    assert fi(state, 0, run="other").invited == 5  # a run that starts now has everybody
    store.close()

    store = SqliteParticipationStore(db)  # the shuffler restarts on its state
    state = ShufflerState(store, rng=make_rng(3), poll_seconds=0.001)
    state.register_users("b", ["b0", "b1"])
    state.subscribe("b")
    with pytest.raises(CohortUnavailable, match="none of the run's 3 users is connected"):
        fi(state, 2)
    state.register_users("a", ["a0", "a1", "a2"])
    state.subscribe("a")
    res = fi(state, 3)
    assert (res.invited, res.not_in_run) == (3, 2)
    store.close()


def test_participation_limits_hold_on_the_durable_record_across_a_restart(tmp_path):
    """DP-FTRL's limits (spec 003 sec 3-4): per tree of 6 rounds, each user at most E = 2 rounds with >= xi = 1
    round strictly between them, also after the shuffler restarts on its SQLite record mid-tree; a spec with other
    limits is refused, and a round the limits cannot fill is refused with the numbers."""
    db = tmp_path / "shuffler.sqlite"
    limits = TreeLimits(max_per_tree=2, min_separation=1, rounds_per_tree=6)
    users = [f"u{i}" for i in range(10)]

    def start(seed: int) -> tuple[SqliteParticipationStore, ShufflerState]:
        store = SqliteParticipationStore(db)
        state = ShufflerState(store, rng=make_rng(seed), poll_seconds=0.001)
        state.register_users("node", users)
        state.subscribe("node")
        return store, state

    def limited(state: ShufflerState, r: int, k: int = 2, lim: TreeLimits = limits):
        req = RoundRequest(
            "run",
            r,
            Schedule.SUBSAMPLED,
            Transport.COUNTS,
            dim=2,
            g=1,
            m=1,
            cohort_size=k,
            deadline_seconds=1e-4,
            limits=lim,
        )
        return state.execute_round(req)

    store, state = start(1)
    for r in range(4):
        assert limited(state, r).invited == 2
    store.close()
    store, state = start(1)  # same seed: without the record it would draw the same users again
    with pytest.raises(ValueError, match="has participation limits"):
        limited(state, 4, lim=limits._replace(max_per_tree=3))
    with pytest.raises(ValueError, match="this round asks none"):  # dropping the limits does not escape them
        limited(state, 4, lim=None)
    for r in range(4, 13):
        assert limited(state, r).invited == 2
    # round 13 is leaf 1 of tree 2: round 12's two users must wait a round, so 8 of 10 are eligible
    with pytest.raises(CohortUnavailable, match="only 8 are eligible under the limits"):
        limited(state, 13, k=9)
    store.close()
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT tree, user_id, leaf FROM tree_leaves WHERE run_id = 'run'").fetchall()
    per: dict[tuple[int, str], list[int]] = {}
    for tree, user, leaf in rows:
        per.setdefault((tree, user), []).append(leaf)
    assert len(rows) == 13 * 2 and {t for t, _ in per} == {0, 1, 2}
    assert max(len(v) for v in per.values()) == 2  # the limit binds: 12 leaves per tree over 10 users
    for leaves in per.values():
        leaves.sort()
        assert len(leaves) <= 2 and all(b - a - 1 >= 1 for a, b in zip(leaves, leaves[1:], strict=False)), leaves


def test_a_count_round_whose_totals_could_not_be_sent_is_refused_before_anything_is_allocated():
    """Found by the RPC fuzzer: a COUNTS spec with dim = 2^32 - 1 made the shuffler allocate 32 GiB of totals. The
    totals must fit the batch message the analyzer can receive, so such a spec is refused while it is validated."""
    state = ShufflerState(rng=make_rng(4), poll_seconds=0.001)
    state.register_users("node", ["a", "b"])
    state.subscribe("node")
    req = RoundRequest("run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=2**32 - 1, g=1, m=1)
    with pytest.raises(ValueError, match="batch message limit"):
        state.execute_round(req)
    assert not state._store.round_exists("run", 0)  # refused before any state changed


def test_a_round_whose_caller_is_gone_before_the_selection_selects_nobody():
    """Found by a probe: an ExecuteRound whose caller's deadline passed while it waited for the state lock still
    selected, recorded and invited a cohort (the analyzer charges such a round as spent without any use): those
    users' once-per-run slot in a sequential run, and their nodes' budget, were spent for nothing."""
    state = ShufflerState(rng=make_rng(4), poll_seconds=0.001)
    state.register_users("node", [f"u{i}" for i in range(10)])
    sub = state.subscribe("node")
    req = RoundRequest("run", 0, Schedule.SEQUENTIAL, Transport.COUNTS, cohort_size=3, dim=2, g=1, m=1)
    with pytest.raises(CallerGone, match="ended before its selection"):
        state.execute_round(req, is_active=lambda: False)
    assert not state._store.round_exists("run", 0) and state.population("run").unused_users == 10
    assert sub.get(timeout=0.05) is None  # nobody invited


def _check_in_spec(round_, fraction, **kw) -> pb.RoundSpec:
    # worst case m = 6 trials at min_contributors = 5: noise_trials N* = 30
    s = spec(round_, **{"min_contributors": 5, "deadline_seconds": 6.0, **kw})
    s.check_in.noise_trials, s.check_in.report_fraction = 30, fraction
    return s


def test_check_in_shares_the_noise_and_a_dropout_after_check_in_never_weakens_it(shuffler, nodes):
    """Check-in (mechanisms/check_in.py): 11 real users and 2 of a node that checks in and then goes silent. The
    second invitation carries c = 13, c_min = max(5, ceil(0.8 * 13)) = 11 and m = ceil(30 / 11) = 3; the released
    noise holds m n' = 33 >= 30 trials. Issue 24 item 4: the silent node's two users are not invited to the run's
    next round (at report_fraction 1 they would leave 11 < c_min = 13 and block every release): c = 11, c_min = 11,
    m = 3, released, with the two counted as excluded_silent. A new run invites them again."""
    dropper = FakeNode(shuffler.stub, "dropper", ["d0", "d1"])
    try:
        shuffler.wait_nodes(3, users=13)
        answered: list[pb.RoundSpec] = []

        def check_in_then_vanish() -> None:
            for _ in range(1):
                inv = dropper.q.get(timeout=20)
                answered.append(inv.spec)
                c = pb.Contribution(run_id="r", round=inv.spec.round, node_id="dropper")
                for u in inv.user_ids:
                    c.messages.add(user_id=u, nonce=secrets.token_bytes(16))
                shuffler.stub.Submit(c, timeout=5)
                answered.append(dropper.q.get(timeout=20).spec)  # the second invitation: never answered

        t = threading.Thread(target=check_in_then_vanish, daemon=True)
        t.start()
        batch = shuffler.stub.ExecuteRound(_check_in_spec(1, 0.8), timeout=30)
        first, second = answered[0], answered[1]
        assert first.check_in.checked_in == 0 and first.randomizer.m == 6 and first.min_contributors == 5
        assert second.check_in.checked_in == 13 and second.min_contributors == 11 and second.randomizer.m == 3
        rep = batch.report
        assert batch.released and (rep.invited, rep.checked_in, rep.contributors) == (13, 13, 11)
        assert rep.contributors * second.randomizer.m >= 30
        # the real nodes answered the check-in without payload, then sent their users' sums, each in
        # [0, users (g + 3)] only
        received = shuffler.recorder.for_round(1)
        check_ins = [m for c in received if not c.columns.sums for m in user_messages(c)]
        sent = [c for c in received if c.columns.sums]
        assert len(check_ins) == 13 and sum(len(c.columns.user_ids) for c in sent) == 11
        assert all(count_total(c).max() <= len(c.columns.user_ids) * 7 for c in sent)
        np.testing.assert_array_equal(np.array(batch.label_totals), np.sum([count_total(c) for c in sent], axis=0))

        t.join(timeout=5)
        batch = shuffler.stub.ExecuteRound(_check_in_spec(2, 1.0), timeout=30)
        rep = batch.report
        assert dropper.q.empty()  # not invited again in this run
        assert batch.released and (rep.invited, rep.checked_in, rep.contributors, rep.excluded_silent) == (
            11,
            11,
            11,
            2,
        )
        other_run = _check_in_spec(3, 1.0)
        other_run.run_id = "other"
        done = []
        other = threading.Thread(target=lambda: done.append(shuffler.stub.ExecuteRound(other_run, timeout=30)))
        other.start()
        assert dropper.q.get(timeout=20).spec.run_id == "other"  # another run asks them again
        other.join(timeout=30)
        assert done and done[0].report.excluded_silent == 0
    finally:
        dropper.call.cancel()


def test_a_round_cut_short_by_the_analyzer_marks_no_one_silent(shuffler):
    """CI failure (Swarm, the analyzer's task killed): users who checked in were invited to report, the analyzer's call
    ended before they could, and the shuffler took them all for silent. The resumed run then invited only the rest,
    too few for any release, and failed. A round cut short proves no one silent: the next round invites everyone."""
    a = FakeNode(shuffler.stub, "a", ["a0", "a1", "a2"])
    b = FakeNode(shuffler.stub, "b", ["b0", "b1", "b2"])
    pool = futures.ThreadPoolExecutor(1)
    try:
        shuffler.wait_nodes(2, users=6)
        call = shuffler.stub.ExecuteRound.future(_check_in_spec(1, 0.8), timeout=30)
        for node in (a, b):  # both check in, without payload
            inv = node.q.get(timeout=20)
            c = pb.Contribution(run_id="r", round=inv.spec.round, node_id=node.node_id)
            for u in inv.user_ids:
                c.messages.add(user_id=u, nonce=secrets.token_bytes(16))
            shuffler.stub.Submit(c, timeout=5)
        for node in (a, b):  # the second invitation
            assert node.q.get(timeout=20).spec.check_in.checked_in == 6
        call.cancel()  # the analyzer is gone before anyone reports
        end = time.monotonic() + 20
        while ("r", 1) not in shuffler.state._closed:  # the shuffler has closed the round
            assert time.monotonic() < end, "round 1 never closed"
            time.sleep(0.01)
        nxt = pool.submit(shuffler.stub.ExecuteRound, _check_in_spec(2, 0.8), timeout=30)
        invitations = [node.q.get(timeout=20) for node in (a, b)]
        assert [inv.spec.round for inv in invitations] == [2, 2]
        assert sorted(u for inv in invitations for u in inv.user_ids) == ["a0", "a1", "a2", "b0", "b1", "b2"]
        batch = nxt.result(timeout=30)  # no one answers: nothing released, nobody excluded
        assert not batch.released and batch.report.excluded_silent == 0
    finally:
        a.call.cancel()
        b.call.cancel()
        pool.shutdown(wait=False)


def test_a_node_gone_between_check_in_and_report_is_a_dropout(shuffler):
    """issue 28 (a client host stopped mid-round, multi-engine Swarm): a node's users checked in, then its stream
    ended before the second invitation. Sending it raised KeyError: ExecuteRound failed and the analyzer charged the
    round as spent with an unknown outcome. Its users are dropouts: the round ends with the others."""
    a = FakeNode(shuffler.stub, "a", [f"a{i}" for i in range(5)])
    b = FakeNode(shuffler.stub, "b", ["b0", "b1", "b2"])
    c = FakeNode(shuffler.stub, "c", ["c0"])  # never checks in: the check-in phase lasts its half of the window
    try:
        shuffler.wait_nodes(3, users=9)
        call = shuffler.stub.ExecuteRound.future(_check_in_spec(1, 0.8, deadline_seconds=4.0), timeout=30)
        for node in (a, b):
            inv = node.q.get(timeout=20)
            msg = pb.Contribution(run_id="r", round=1, node_id=node.node_id)
            for u in inv.user_ids:
                msg.messages.add(user_id=u, nonce=secrets.token_bytes(16))
            shuffler.stub.Submit(msg, timeout=5)
        b.call.cancel()  # b's host is gone
        end = time.monotonic() + 10
        while "b" in shuffler.state._subs:
            assert time.monotonic() < end, "the shuffler kept b's stream"
            time.sleep(0.01)
        batch = call.result(timeout=30)  # raised UNKNOWN (KeyError 'b') before
        second = a.q.get(timeout=5).spec
        assert second.check_in.checked_in == 8 and second.min_contributors == 7  # max(5, ceil(0.8 * 8))
        assert not batch.released and batch.report.checked_in == 8 and batch.report.contributors == 0
    finally:
        for node in (a, b, c):
            node.call.cancel()


def test_a_run_whose_every_user_went_silent_says_so(shuffler):
    """Every user checked in and then sent nothing for the whole window: the next round is refused naming that,
    not as if no user were connected."""
    a = FakeNode(shuffler.stub, "a", [f"a{i}" for i in range(5)])
    try:
        shuffler.wait_nodes(1, users=5)
        # its check-in window (half the deadline) long enough for the check-ins on a loaded machine
        call = shuffler.stub.ExecuteRound.future(_check_in_spec(1, 0.8, deadline_seconds=4.0), timeout=30)
        inv = a.q.get(timeout=20)
        c = pb.Contribution(run_id="r", round=1, node_id="a")
        for u in inv.user_ids:
            c.messages.add(user_id=u, nonce=secrets.token_bytes(16))
        shuffler.stub.Submit(c, timeout=5)
        assert not call.result(timeout=30).released  # checked in, then silent for the rest of the window
        with pytest.raises(grpc.RpcError) as err:
            shuffler.stub.ExecuteRound(_check_in_spec(2, 0.8, deadline_seconds=2.0), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "all 5 connected users of the run checked in and then sent nothing" in err.value.details()
    finally:
        a.call.cancel()


def test_check_in_specs_are_validated_before_anyone_is_invited(shuffler, nodes):
    for bad, why in [
        (dict(fraction=0.9, min_contributors=5), "noise_trials = 31 must be <= randomizer.m"),
        (dict(fraction=1.5, min_contributors=5), "report_fraction"),
        (dict(fraction=0.9, min_contributors=5, transport=pb.SEALED), "COUNTS and BITS"),
    ]:
        s = spec(7, transport=bad.get("transport", pb.COUNTS), min_contributors=bad["min_contributors"])
        s.check_in.noise_trials = 31 if "noise_trials" in why else 30
        s.check_in.report_fraction = bad["fraction"]
        if s.transport == pb.SEALED:
            s.randomizer.message_bytes, s.analyzer_public_key = 8, generate_keypair()[1]
        with pytest.raises(grpc.RpcError) as err:
            shuffler.stub.ExecuteRound(s, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
    assert not shuffler.recorder.for_round(7)  # nobody was invited


def test_a_check_in_with_a_payload_is_rejected():
    state, clock = _state_with_test_clock(5)
    state.register_users("node", ["a", "b"])
    sub = state.subscribe("node")
    req = RoundRequest(
        "run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=2, g=1, m=2, min_contributors=1,
        deadline_seconds=0.5, check_in_trials=2, check_in_fraction=1.0,
    )  # fmt: skip
    out: list = []
    t = _RoundThread(clock, target=lambda: out.append(state.execute_round(req)))
    t.start()
    assert sub.get(5.0) is not None
    from shuffledp.services.shuffler_state import Submission, UserMessage

    ack = state.submit(
        Submission("run", 0, "node", [UserMessage("a", b"n" * 16, counts=np.array([1, 1], dtype=np.uint64))])
    )
    assert ack.rejected == {"wrong_payload": 1} and ack.accepted == 0
    t.join()
    assert not out[0].released and out[0].checked_in == 0  # b never answered, a's answer was used up


class _TestClock:
    """The shuffler's clock in a test that sends into an open round: stopped until the test has sent all it sends
    (nothing arrives late on a loaded machine, whatever the round's deadline), then past every deadline and running
    again (a later round of the same state has its own)."""

    def __init__(self) -> None:
        self.stopped: float | None = time.monotonic()
        self.shift = 0.0

    def __call__(self) -> float:
        return self.stopped if self.stopped is not None else time.monotonic() + self.shift

    def expire(self) -> None:
        self.stopped, self.shift = None, 1e6


class _RoundThread(threading.Thread):
    """A round's thread whose join() first lets the round's deadline pass (_TestClock.expire)."""

    def __init__(self, clock: _TestClock, target) -> None:
        super().__init__(target=target)
        self.clock = clock

    def join(self, timeout: float | None = None) -> None:
        self.clock.expire()
        super().join(timeout)


def _state_with_test_clock(seed: int, poll: float = 0.001) -> tuple[ShufflerState, _TestClock]:
    clock = _TestClock()
    return ShufflerState(rng=make_rng(seed), poll_seconds=poll, clock=clock), clock


def _open_counts_round(
    users: list[str], dim: int, bound_m: int, check_in: bool = False, deadline: float = 0.4, poll: float = 0.001
):
    """An in-process shuffler with `users` registered under "node" and one COUNTS round (g = 1) open for all, its
    (first) invitation taken: (state, the round's thread, its result list, the node's subscription). The round ends
    when every invitee answered or when the test joins its thread (_TestClock)."""
    state, clock = _state_with_test_clock(11, poll)
    state.register_users("node", users)
    state.register_users("other", ["o1"])
    sub = state.subscribe("node")
    extra = {"check_in_trials": 2, "check_in_fraction": 1.0} if check_in else {}
    req = RoundRequest(
        "run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=dim, g=1, m=bound_m,
        min_contributors=1, deadline_seconds=deadline, **extra,
    )  # fmt: skip
    out: list = []
    t = _RoundThread(clock, target=lambda: out.append(state.execute_round(req)))
    t.start()
    assert sub.get(5.0) is not None
    return state, t, out, sub


@pytest.mark.parametrize("seed", range(6))
def test_user_columns_are_checked_exactly_as_one_message_per_user(seed):
    # issue 15: a node sends a COUNTS round's messages as UserColumns; every check of design 5.3 must give each
    # user the same outcome as that user's UserMessage would, on honest and on adversarial batches alike
    import random

    from shuffledp.services.shuffler_state import Submission, UserColumns, UserMessage

    r = random.Random(seed)
    dim, m = 3, 4  # bound g + m = 5, wire width 1 byte
    users = [f"u{i}" for i in range(40)]
    ids, nonces, rows = [], [], []
    for i in range(60 if seed else 40):
        kind = r.choice(["ok"] * 6 + ["dup_user", "replay", "unknown", "other_node", "range"]) if seed else "ok"
        uid = users[i % 40] if seed else users[i]
        nonce = r.randbytes(16)
        row = [r.randrange(0, 6) for _ in range(dim)]
        if kind == "dup_user" and ids:
            uid = r.choice(ids)
        elif kind == "replay" and nonces:
            nonce = r.choice(nonces)
        elif kind in ("unknown", "other_node"):
            uid = "stranger" if kind == "unknown" else "o1"
        elif kind == "range":
            row[r.randrange(dim)] = r.randrange(6, 256)
        ids.append(uid)
        nonces.append(nonce)
        rows.append(row)
    counts = np.array(rows, dtype=np.uint8)
    results = []
    for as_columns in (True, False):
        state, t, out, _ = _open_counts_round(users, dim, m)
        if as_columns:
            sub = Submission("run", 0, "node", columns=UserColumns(ids, b"".join(nonces), 16, counts.tobytes()))
        else:
            msgs = [
                UserMessage(u, n, counts_packed=row.tobytes()) for u, n, row in zip(ids, nonces, counts, strict=True)
            ]
            sub = Submission("run", 0, "node", msgs)
        ack = state.submit(sub)
        t.join()
        results.append((ack.accepted, ack.rejected, out[0].contributors, out[0].label_totals.tolist()))
    assert results[0] == results[1]
    if seed == 0:  # the honest batch: everyone counted, totals are the column sums
        assert results[0][:3] == (40, {}, 40) and results[0][3] == counts.sum(axis=0).tolist()


def test_a_batch_failing_its_checks_as_a_whole_leaves_the_earlier_answers_as_they_were():
    """The columns' fast path marks a batch's users answered before its nonces are checked, and takes them back if
    the batch fails (issue 30): what it takes back must be exactly that batch's users. Several batches in a row, each
    compared with the same users' one-message-per-user submissions."""
    from shuffledp.services.shuffler_state import Submission, UserColumns, UserMessage

    users = list("abcdefg")
    nonce = {u: bytes([i + 1]) * 16 for i, u in enumerate(users)}
    batches = [
        [("a", nonce["a"]), ("b", nonce["b"])],  # honest
        [("c", nonce["c"]), ("d", nonce["d"]), ("e", nonce["a"])],  # e replays a's nonce: c, d still count
        [("e", nonce["e"])],  # e's answer was not used up by its replayed nonce
        [("a", bytes([99]) * 16)],  # a answered in the first batch: still answered after the second's failure
        [("f", nonce["f"]), ("f", bytes([98]) * 16)],  # f twice in one batch: the second is a duplicate
        [("g", nonce["g"]), ("zz", bytes([97]) * 16)],  # an unknown user beside an honest one
    ]
    row = np.array([1, 0], dtype=np.uint8)
    outcomes = []
    for as_columns in (True, False):
        state, t, out, _ = _open_counts_round(users, 2, 1, deadline=2.0)
        acks = []
        for batch in batches:
            if as_columns:
                ids, nonces = [u for u, _ in batch], b"".join(n for _, n in batch)
                sub = Submission("run", 0, "node", columns=UserColumns(ids, nonces, 16, row.tobytes() * len(batch)))
            else:
                sub = Submission("run", 0, "node", [UserMessage(u, n, counts_packed=row.tobytes()) for u, n in batch])
            ack = state.submit(sub)
            acks.append((ack.accepted, ack.rejected))
        t.join()
        outcomes.append((acks, out[0].contributors, out[0].label_totals.tolist()))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == [
        (2, {}),
        (2, {"replayed_nonce": 1}),
        (1, {}),
        (0, {"duplicate_user": 1}),
        (1, {"duplicate_user": 1}),
        (1, {"unknown_user": 1}),
    ]
    assert outcomes[0][1:] == (7, [7, 0])


@pytest.mark.parametrize(
    "case, reason",
    [("short_counts", "wrong_count_length"), ("no_counts", "wrong_payload"), ("nonce_width", "bad_nonce")],
)
def test_malformed_user_columns_are_rejected_user_by_user(case, reason):
    from shuffledp.services.shuffler_state import Submission, UserColumns

    users = ["a", "b", "c"]
    state, t, out, _ = _open_counts_round(users, 2, 3)
    counts = bytes(2 * 3) if case != "short_counts" else bytes(5)
    width = 16 if case != "nonce_width" else 8
    cols = UserColumns(users, secrets.token_bytes(width * 3), width, b"" if case == "no_counts" else counts)
    ack = state.submit(Submission("run", 0, "node", columns=cols))
    assert ack.accepted == 0 and ack.rejected == {reason: 3}
    t.join()
    assert not out[0].released and out[0].contributors == 0


def test_check_ins_as_user_columns():
    from shuffledp.services.shuffler_state import Submission, UserColumns

    state, t, out, _ = _open_counts_round(["a", "b"], 2, 2, check_in=True)
    nonces = secrets.token_bytes(32)
    ack = state.submit(Submission("run", 0, "node", columns=UserColumns(["a", "b"], nonces, 16)))
    assert ack.accepted == 2 and not ack.rejected
    again = state.submit(Submission("run", 0, "node", columns=UserColumns(["a"], nonces[:16], 16)))
    assert again.accepted == 0 and again.rejected == {"replayed_nonce": 1}
    t.join()
    assert out[0].checked_in == 2


def test_the_last_check_in_sends_the_second_invitation_before_its_submit_returns():
    """Issue 30: the thread that accepts the last check-in invites the users again (the round's own thread would
    only wake up to do it: one thread hand-off less on the round's path), and the round then collects and releases
    the reports as before."""
    from shuffledp.services.shuffler_state import Submission, UserColumns

    # the round's thread waits up to 1 s between looks: it cannot be the one that invites within the test
    state, t, out, sub = _open_counts_round(["a", "b"], 2, 2, check_in=True, deadline=30, poll=1.0)
    ack = state.submit(Submission("run", 0, "node", columns=UserColumns(["a"], secrets.token_bytes(16), 16)))
    assert ack.accepted == 1 and sub.get(0) is None  # b has not checked in yet: nobody is invited again
    ack = state.submit(Submission("run", 0, "node", columns=UserColumns(["b"], secrets.token_bytes(16), 16)))
    assert ack.accepted == 1
    second = sub.get(0)  # already queued when submit returned
    assert second is not None and list(second.user_ids) == ["a", "b"]
    counts = np.array([[1, 2], [0, 1]], dtype=np.uint8).tobytes()  # g + m = 2 bounds each count
    ack = state.submit(
        Submission("run", 0, "node", columns=UserColumns(["a", "b"], secrets.token_bytes(32), 16, counts))
    )
    assert ack.accepted == 2
    t.join(10)
    assert out[0].released and out[0].checked_in == 2 and out[0].contributors == 2
    assert out[0].label_totals.tolist() == [1, 3]


def test_the_shuffler_remembers_a_bounded_number_of_closed_rounds(monkeypatch):
    # issue 15: the shuffler's memory must not grow with the rounds it ran; a late message to a recent round is
    # expired, one to a forgotten round is a wrong round, and no round runs twice either way (durable record)
    from shuffledp.services import shuffler_state as ss
    from shuffledp.services.shuffler_state import Submission, UserColumns

    monkeypatch.setattr(ss, "RECENT_CLOSED_ROUNDS", 3)
    state = ShufflerState(rng=make_rng(12), poll_seconds=0.001)
    state.register_users("node", ["a"])
    state.subscribe("node")  # connected, never answers: each round ends at its deadline
    for r in range(5):
        req = RoundRequest(
            "run", r, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=1, g=1, m=1, min_contributors=1,
            deadline_seconds=0.01,
        )  # fmt: skip
        state.execute_round(req)
    assert len(state._closed) == 3

    def late(r: int) -> str:
        with pytest.raises(RoundRejected) as exc:
            state.submit(Submission("run", r, "node", columns=UserColumns(["a"], bytes(16), 16, bytes(1))))
        return exc.value.reason.value

    assert late(4) == "expired_round" and late(0) == "wrong_round"
    with pytest.raises(RoundExistsError):
        state.execute_round(
            RoundRequest("run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=1, g=1, m=1, deadline_seconds=0.01)
        )


@pytest.mark.parametrize("durable", [False, True])
def test_used_users_follow_record_round_without_rereading(tmp_path, durable):
    """The consumed users are kept in memory (issue 30 item 4: not read again at every round): a recorded round adds
    its users, a refused one (round or user already recorded) adds none, and a reopened store reads them back."""
    from shuffledp.services.shuffler_state import MemoryParticipationStore, RoundExistsError

    db = tmp_path / "p.sqlite"
    store = SqliteParticipationStore(db) if durable else MemoryParticipationStore()
    assert set(store.used_users("r")) == set()
    store.record_round("r", 0, int(Schedule.SEQUENTIAL), ["u0", "u1"])
    view = store.used_users("r")
    store.record_round("r", 1, int(Schedule.SEQUENTIAL), iter(["u2"]))  # an iterator is consumed once
    assert set(view) == set(store.used_users("r")) == {"u0", "u1", "u2"}
    with pytest.raises(RoundExistsError):
        store.record_round("r", 1, int(Schedule.SEQUENTIAL), ["u3"])  # round 1 ran: nothing recorded
    assert set(view) == {"u0", "u1", "u2"}
    if durable:
        with pytest.raises(RoundExistsError):
            store.record_round("r", 2, int(Schedule.SEQUENTIAL), ["u3", "u0"])  # u0 reused: the transaction fails
        assert set(view) == {"u0", "u1", "u2"}  # u3 was not added either
        store.close()
        again = SqliteParticipationStore(db)
        assert set(again.used_users("r")) == {"u0", "u1", "u2"} and set(again.used_users("other")) == set()
        again.close()


@pytest.mark.parametrize("durable", [False, True])
def test_population_is_kept_not_reread_and_a_failed_record_keeps_none(tmp_path, durable):
    """Issue 30 item 3: a fully interactive run's population is read once (a view, the same object at every round),
    only once its round committed, and read back by a reopened store."""
    from shuffledp.services.shuffler_state import MemoryParticipationStore

    db = tmp_path / "p.sqlite"
    store = SqliteParticipationStore(db) if durable else MemoryParticipationStore()
    assert store.run_population("r") is None
    store.record_round("r", 0, int(Schedule.FULLY_INTERACTIVE), [], iter(["u0", "u1"]))
    view = store.run_population("r")
    assert view == {"u0", "u1"} and store.run_population("r") is view and not hasattr(view, "add")
    if durable:  # the durable record takes further users of the run (a call ShufflerState never makes)
        store.record_round("r", 1, int(Schedule.FULLY_INTERACTIVE), [], ["u2"])
        assert store.run_population("r") == {"u0", "u1", "u2"}
    else:
        with pytest.raises(RoundExistsError):
            store.record_round("r", 1, int(Schedule.FULLY_INTERACTIVE), [], ["u2"])  # fixed once
        assert store.run_population("r") == {"u0", "u1"}
    if durable:
        store.close()
        again = SqliteParticipationStore(db)
        assert again.run_population("r") == {"u0", "u1", "u2"} and again.run_population("other") is None
        again.close()


def test_a_rounds_tables_hold_the_admitted_key_objects():
    """Issue 30 item 3: what a round keeps per user (invited, answered, checked in) is the one key object admitted
    at registration, not a fresh string per message, and the sorted eligible users are not rebuilt per round."""
    from shuffledp.services.shuffler_state import Submission, UserColumns

    users = [f"u{i}" for i in range(6)]
    state, t, out, _ = _open_counts_round(users, 2, 2, check_in=True)
    admitted = {id(k) for k in state._admitted}
    rnd = next(iter(state._open.values()))
    assert {id(k) for k in rnd.invited} == admitted - {id(state._admitted["other\no1"])}
    state.submit(Submission("run", 0, "node", columns=UserColumns(users[:4], secrets.token_bytes(64), 16)))
    state.submit(Submission("run", 0, "node", columns=UserColumns(users[4:5], bytes(16), 16)))  # the slow path
    checked_in = [k for keys in rnd.checked_in.values() for k in keys]
    assert list(rnd.checked_in) == ["node"] and rnd.n_checked_in == len(checked_in) == 5
    assert {id(k) for k in checked_in} <= admitted
    assert {id(k) for k in rnd.answered} <= admitted
    t.join()
    assert out[0].checked_in == 5
    with state._lock:
        assert state._eligible_users() is state._eligible_users()
        before = state._eligible_users()
    state.register_users("node", ["u9"])  # a new user: rebuilt, and sorted
    with state._lock:
        assert state._eligible_users() is not before and state._eligible_users() == sorted(before + ["node\nu9"])


def test_an_invitation_lists_the_node_ids_from_the_admitted_keys():
    """Issue 30 item 3: an invitation waiting to be sent holds the admitted keys, not a fresh id string per user,
    and reads as the node's own ids (in the order of the round's selection) wherever it is used."""
    from shuffledp.services.shuffler_state import NodeUserIds

    state = ShufflerState(rng=make_rng(11), poll_seconds=0.001)
    state.register_users("node", ["u2", "u10", "u1"])
    sub = state.subscribe("node")
    req = RoundRequest("run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=2, g=1, m=2, deadline_seconds=0.2)
    state.execute_round(req)
    invite = sub.get(1.0)
    assert isinstance(invite.user_ids, NodeUserIds) and invite.user_ids == ["u1", "u10", "u2"]  # the sorted keys
    ids = NodeUserIds("node", ["node\nu1", "node\nu10", "node\nu2"])
    assert ids == ["u1", "u10", "u2"] and ids[1:] == ["u10", "u2"] and ids[0] == "u1" and "u10" in ids
    assert list(pb.Invitation(user_ids=ids).user_ids) == ["u1", "u10", "u2"]
    assert ids != ["u1", "u10"] and ids != "u1u10u2"


def test_the_rounds_nonce_set_is_exactly_a_set_of_bytes():
    """Issue 30 item 3: NonceSet (sorted rows by their first 8 bytes) answers as a set of bytes would, with nonces
    that share their first 8 bytes, of several widths, added by batch and one by one."""
    from shuffledp.services.shuffler_state import NonceSet

    rng = np.random.default_rng(3)
    ref: set[bytes] = set()
    ns = NonceSet()
    pool = [bytes(rng.integers(0, 3, size=w, dtype=np.uint8)) for w in (16, 16, 16, 17, 24) for _ in range(60)]
    pool += [b"\x01" * 8 + bytes(rng.integers(0, 256, size=8, dtype=np.uint8)) for _ in range(40)]  # one prefix
    for _ in range(300):
        if rng.random() < 0.3:
            x = pool[int(rng.integers(len(pool)))]
            if x not in ref:
                ns.add(x)
                ref.add(x)
        else:
            w = int(rng.choice([16, 17, 24]))
            n = int(rng.integers(1, 6))
            batch = [pool[i] for i in rng.integers(len(pool), size=n) if len(pool[i]) == w] or [os_nonce(w)]
            ok = ns.add_batch(b"".join(batch), w, len(batch))
            fresh = len(set(batch)) == len(batch) and ref.isdisjoint(batch)
            assert not ok or fresh  # added only what a set would take as new; else nothing
            if ok:
                ref.update(batch)
        for x in pool[::7]:
            assert (x in ns) == (x in ref)
    assert all(x in ns for x in ref)
    fresh = secrets.token_bytes(16 * 1000)
    assert ns.add_batch(fresh, 16, 1000) and not ns.add_batch(fresh[:16], 16, 1) and fresh[-16:] in ns
    assert len(ns) == len(ref) + 1000


def test_a_batch_of_nonces_is_not_compared_with_every_single_nonce_one_by_one():
    """Found by probing as a dishonest node: its users sent one by one (or in a batch that fails) leave their nonces
    as single ones, and every later batch of every node scanned them all under the state's lock (20 000 singles: a
    one-user batch took 1.6 ms instead of 0.1). A batch is now compared with the singles' prefixes, kept by width."""
    from shuffledp.services.shuffler_state import NonceSet

    class Unscannable(set):
        def __iter__(self):
            raise AssertionError("a batch scanned the single nonces one by one")

    ns = NonceSet()
    ns._single = Unscannable()
    singles = [secrets.token_bytes(16) for _ in range(2000)]
    for x in singles:
        ns.add(x)
    assert ns.add_batch(secrets.token_bytes(16), 16, 1)  # fewer in the batch than singles
    assert ns.add_batch(secrets.token_bytes(16 * 3000), 16, 3000)  # more
    assert not ns.add_batch(singles[7][:8] + secrets.token_bytes(8), 16, 1)  # a single's prefix: checked exactly
    assert singles[7] in ns and not ns.add_batch(secrets.token_bytes(16) + singles[9], 16, 2)


def os_nonce(w: int) -> bytes:
    return secrets.token_bytes(w)


def test_sequential_cohorts_are_drawn_from_the_fresh_users_as_a_list_of_them_would(tmp_path):
    """Issue 30 item 4: the shuffler keeps a sequential run's fresh users as a mask between rounds (a list of them,
    built at every round, cost O(n) Python lookups that slowed down as the used set grew: 4 -> 25 ms per round over
    10^4 rounds of 10^5 users). Each cohort must be the one the list gave for the same CSPRNG draws (a twin
    generator replays them on the list), through nodes leaving and coming back, new registrations, a refused round,
    a restart that reads the used users back, and the population counts must agree with the list."""
    from shuffledp.services.shuffler_state import CohortUnavailable, RoundExistsError

    users = {f"n{j}": [f"u{j}-{i}" for i in range(40)] for j in range(3)}
    db = tmp_path / "p.sqlite"

    def start(seed: int) -> tuple[ShufflerState, dict]:
        state = ShufflerState(SqliteParticipationStore(db), rng=make_rng(seed))
        subs = {}
        for node in ("n0", "n1"):
            state.register_users(node, users[node])
            subs[node] = state.subscribe(node)
        return state, subs

    def req(r: int, k: int = 7) -> RoundRequest:
        return RoundRequest(
            "run", r, Schedule.SEQUENTIAL, Transport.COUNTS, dim=2, g=1, m=2, min_contributors=1,
            deadline_seconds=1e-6, cohort_size=k,
        )  # fmt: skip

    state, subs = start(21)
    twin = make_rng(21)
    used: set[str] = set()
    r = 0

    def run_round(k: int = 7) -> None:
        nonlocal r
        eligible = state._eligible_users()
        pool = [u for u in eligible if u not in used]
        pop = state.population("run")
        assert (pop.admitted_users, pop.unused_users) == (len(eligible), len(pool))
        idx = twin.choice(len(pool), size=k, replace=False)
        want = [pool[i] for i in np.sort(idx)]
        batch = state.execute_round(req(r, k))
        assert batch.invited == k
        got = sorted(set(state._store.used_users("run")) - used)
        assert got == sorted(want), r
        used.update(want)
        r += 1

    for _ in range(4):
        run_round()
    state.population("run")  # the mask is up to date with the used users when the eligible users change
    state.unsubscribe(subs.pop("n1"))  # n1's users are not eligible while it is away
    run_round()
    subs["n1"] = state.subscribe("n1")
    state.population("run")
    state.register_users("n2", users["n2"])
    subs["n2"] = state.subscribe("n2")
    for _ in range(3):
        run_round()
    with pytest.raises(RoundExistsError):  # refused: its draw is not taken off the fresh users
        state.execute_round(req(r - 1))
    run_round()
    with pytest.raises(CohortUnavailable):
        state.execute_round(req(r, k=10**4))
    for sub in subs.values():
        state.unsubscribe(sub)
    state, subs = start(22)  # a restart: the used users come back from the durable record
    state.register_users("n2", users["n2"])
    subs["n2"] = state.subscribe("n2")
    twin = make_rng(22)
    for _ in range(3):
        run_round()
    assert len(used) == 7 * 12 and len(state._fresh) == 1


def _sums_submission(ids: list[str], counts: np.ndarray, group: int, sums: np.ndarray | None = None):
    """UserColumns with group sums of `counts` (rows of ids, in order), or the given sums."""
    from shuffledp.services.shuffler_state import Submission, UserColumns

    starts = np.arange(0, len(ids), group)
    if sums is None:
        sums = np.add.reduceat(counts.astype(np.uint64), starts, axis=0)
    cols = UserColumns(ids, secrets.token_bytes(16 * len(ids)), 16, sums=sums.astype("<u8").tobytes(), sum_users=group)
    return Submission("run", 0, "node", columns=cols)


def test_group_sums_are_added_whole_and_checked_against_their_users_bound():
    """Issue 30: a node sends its users' counts as sums per group (UserColumns.sums). A sum of s users is added
    when every one of them passes the checks of design 5.3 and it lies in [0, s (g + m)] (the sums s counts in
    [0, g + m] each can make, and no other); a group with a refused user cannot be split and its other users are
    rejected as partial_sum; a sum above its bound is rejected for all its users."""
    dim, m = 3, 4  # bound g + m = 5
    users = [f"u{i}" for i in range(7)]
    counts = make_rng(21).integers(0, 6, size=(7, dim))
    # honest: groups [u0-u2], [u3-u5], [u6]; the totals are the users' counts summed
    state, t, out, _ = _open_counts_round(users, dim, m)
    ack = state.submit(_sums_submission(users, counts, 3))
    t.join()
    assert (ack.accepted, ack.rejected) == (7, {})
    assert out[0].contributors == 7 and out[0].label_totals.tolist() == counts.sum(axis=0).tolist()
    # a stranger in the middle group: its two others are partial_sum, the other groups are added
    state, t, out, _ = _open_counts_round(users, dim, m)
    ids = users[:4] + ["stranger"] + users[5:]
    ack = state.submit(_sums_submission(ids, counts, 3))
    t.join()
    assert (ack.accepted, ack.rejected) == (4, {"unknown_user": 1, "partial_sum": 2})
    want = counts[[0, 1, 2, 6]].sum(axis=0)
    assert out[0].contributors == 4 and out[0].label_totals.tolist() == want.tolist()
    # a stranger alone in its group: no one else of it to reject (no "partial_sum": 0 in the ack and the report)
    state, t, out, _ = _open_counts_round(users, dim, m)
    ack = state.submit(_sums_submission(users[:6] + ["stranger"], counts, 3))
    t.join()
    assert (ack.accepted, ack.rejected) == (6, {"unknown_user": 1}) and out[0].rejected == {"unknown_user": 1}
    assert "partial_sum" not in state.counters()
    # at the bound (3 users x 5) a sum is added; one above it is not, for all its users
    sums = np.add.reduceat(counts, [0, 3, 6], axis=0)
    sums[0] = [15, 0, 15]
    sums[1, 2] = 16
    state, t, out, _ = _open_counts_round(users, dim, m)
    ack = state.submit(_sums_submission(users, counts, 3, sums))
    t.join()
    assert (ack.accepted, ack.rejected) == (4, {"count_out_of_range": 3})
    assert out[0].label_totals.tolist() == (sums[0] + sums[2]).tolist()
    # the same users again (the round still open: "late" has not answered): their answers are used up
    state, t, out, _ = _open_counts_round(users + ["late"], dim, m, deadline=1)
    sub = _sums_submission(users, counts, 3)
    assert state.submit(sub).accepted == 7
    again = state.submit(sub)
    assert again.accepted == 0 and again.rejected == {"replayed_nonce": 7}
    t.join()
    assert out[0].contributors == 7


@pytest.mark.parametrize(
    "case, reason",
    [
        ("short_sums", "wrong_count_length"),
        ("no_group", "wrong_count_length"),
        ("counts_and_sums", "wrong_payload"),
        ("check_in", "wrong_payload"),
    ],
)
def test_malformed_group_sums_are_rejected_for_all_their_users(case, reason):
    from dataclasses import replace

    users = ["a", "b", "c"]
    state, t, out, _ = _open_counts_round(users, 2, 3, check_in=case == "check_in")
    sub = _sums_submission(users, np.ones((3, 2), dtype=np.uint8), 2)
    cols = sub.columns
    if case == "short_sums":
        cols = replace(cols, sums=cols.sums[:-8])
    elif case == "no_group":
        cols = replace(cols, sum_users=0)
    elif case == "counts_and_sums":
        cols = replace(cols, counts=bytes(6))
    ack = state.submit(replace(sub, columns=cols))
    assert ack.accepted == 0 and ack.rejected == {reason: 3}
    t.join()
    assert out[0].contributors == 0


def test_a_contribution_of_sums_is_split_at_group_boundaries():
    """split_contribution keeps each group's users and sum in one part: the parts together are the contribution,
    and the shuffler adds them up to the same totals."""
    from shuffledp.clients.node import split_contribution

    users = [f"user-{i:03d}" for i in range(50)]
    counts = make_rng(22).integers(0, 6, size=(50, 2))
    sums = np.add.reduceat(counts.astype(np.uint64), np.arange(0, 50, 4), axis=0)
    whole = pb.Contribution(run_id="run", round=0, node_id="node")
    whole.columns.user_ids.extend(users)
    whole.columns.nonce_bytes, whole.columns.nonces = 16, secrets.token_bytes(16 * 50)
    whole.columns.sums, whole.columns.sum_users = sums.astype("<u8").tobytes(), 4
    parts = split_contribution(whole, max_bytes=400)
    assert len(parts) > 3
    for part in parts[:-1]:
        assert len(part.columns.user_ids) % 4 == 0 and part.columns.sum_users == 4
    assert [u for p in parts for u in p.columns.user_ids] == users
    assert b"".join(p.columns.nonces for p in parts) == whole.columns.nonces
    assert b"".join(p.columns.sums for p in parts) == whole.columns.sums
    state, t, out, _ = _open_counts_round(users, 2, 4)
    from shuffledp.services.shuffler import _submission

    assert sum(state.submit(_submission(p, "node")).accepted for p in parts) == 50
    t.join()
    assert out[0].label_totals.tolist() == counts.sum(axis=0).tolist()


def test_a_fully_interactive_runs_cohort_is_kept_between_rounds_and_rebuilt_when_its_users_change():
    """The invitees of a fully interactive run (the same users every round) are listed, put in a set and grouped by
    node once, not per round (a Python step per user each); the second invitation of a check-in round that every
    invitee checked in to reuses them. A user who registers later is not invited (the run's population is fixed),
    a user who falls silent is left out from then on: each rebuilds the cohort, as does the run's population once it
    is fixed (after its first round)."""
    from shuffledp.services.shuffler_state import Submission, UserColumns

    users = [f"u{i}" for i in range(6)]
    state, t, out, sub = _open_counts_round(users, 2, 2, check_in=True, deadline=5.0)
    rnd = next(iter(state._open.values()))
    first = rnd.invited
    state.submit(Submission("run", 0, "node", columns=UserColumns(users, secrets.token_bytes(96), 16)))
    assert sub.get(5.0).user_ids == users  # the second invitation: every invitee checked in
    assert rnd.second_invitation and rnd.invited is first  # the same set, not a new one
    state.submit(Submission("run", 0, "node", refusals=[(u, "policy") for u in users]))
    t.join()
    assert out[0].refused == 6

    def round_(i: int, answer: list[str]) -> tuple[frozenset, list[str]]:
        req = RoundRequest(
            "run", i, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=2, g=1, m=2, min_contributors=1,
            deadline_seconds=0.4, check_in_trials=2, check_in_fraction=1.0,
        )  # fmt: skip
        done: list = []
        th = threading.Thread(target=lambda: done.append(state.execute_round(req)))
        th.start()
        invite = sub.get(5.0)
        invited = next(iter(state._open.values())).invited
        state.submit(
            Submission("run", i, "node", columns=UserColumns(answer, secrets.token_bytes(16 * len(answer)), 16))
        )
        second = sub.get(5.0)  # at once when every invitee checked in, else when half the window has passed
        if len(answer) == len(users):
            state.submit(Submission("run", i, "node", refusals=[(u, "policy") for u in second.user_ids]))
        th.join()
        assert sub.get(0.0) is None  # nothing left over for the next round
        return invited, list(invite.user_ids)

    # the store keeps the run's population as the very set of round 0 (one set of the run's users, not two)
    assert state._store.run_population("run") is first
    fixed, listed = round_(1, users)  # the cohort is built again once (the population is fixed), around that set
    assert fixed is first and listed == users
    again, listed = round_(2, users)
    assert again is first and listed == users  # round 2: the cohort of round 1
    state.register_users("node", ["u9"])  # joins after the run's first round: not in its population
    rebuilt, listed = round_(3, users[:5])  # u0..u4 check in, then send nothing: silent from round 4 on
    assert rebuilt is first and listed == users  # still all of the population: its set
    left, listed = round_(4, users[5:])
    assert listed == ["u5"] and left == {"node\nu5"}  # a set of its own: not all of the population


def test_the_durable_store_keeps_the_population_it_was_given_as_its_set(tmp_path):
    # what lets the shuffler hold one set of a fully interactive run's users (ShufflerState._select): the store
    # keeps the first round's frozenset itself, not a copy, and gives it back until the population changes
    store = SqliteParticipationStore(tmp_path / "p.sqlite")
    users = frozenset(user_key("node", f"u{i}") for i in range(5))
    store.record_round("r", 0, int(Schedule.FULLY_INTERACTIVE), [], users)
    assert store.run_population("r") is users
    store.close()


def test_users_admitted_while_a_round_is_validated_cannot_overflow_its_totals(monkeypatch):
    """Found by reading as a dishonest node: the uint64 bound on a COUNTS round's totals (cohort x (g + m)) was
    checked against the users admitted when the request was validated, outside the lock; users registered before
    the cohort was selected could make the totals wrap. It is checked again on the actual cohort, under the lock,
    before anyone is recorded or invited."""
    state = ShufflerState(rng=make_rng(8), poll_seconds=0.001)
    state.register_users("node", ["a"])
    sub = state.subscribe("node")
    select = state._select

    def late_registration(req):
        state.register_users("node", ["b"])  # between the validation and the selection (the lock is re-entrant)
        return select(req)

    monkeypatch.setattr(state, "_select", late_registration)
    g_plus_m = 2**63  # one user's totals fit uint64, two users' do not
    req = RoundRequest(
        "run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=1, g=1, m=g_plus_m - 1, deadline_seconds=0.5
    )
    with pytest.raises(ValueError, match="overflow uint64"):
        state.execute_round(req)
    assert sub.get(0.05) is None  # nobody was invited
    monkeypatch.setattr(state, "_select", select)
    state.register_users("node", ["c"])  # the refused round left no trace: a valid round 0 can run
    ok = RoundRequest("run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=1, g=1, m=1, deadline_seconds=0.2)
    assert state.execute_round(ok).invited == 3


def test_a_sealed_message_sent_again_under_another_user_is_rejected():
    """Design 5.3 (found by probing): one ciphertext sent for two users (or twice by one user) would reach the
    analyzer as two users' messages; the shuffler rejects a message whose encapsulated key the round has seen."""
    from shuffledp.services.shuffler_state import Submission, UserMessage

    from shuffledp.security.sealing import ENC_BYTES, generate_keypair, seal_many

    _, pub = generate_keypair()
    state, clock = _state_with_test_clock(9)
    state.register_users("node", ["a", "b", "c", "d", "e"])
    state.subscribe("node")
    req = RoundRequest(
        "run", 0, Schedule.FULLY_INTERACTIVE, Transport.SEALED, messages_per_user=2, message_bytes=8,
        analyzer_public_key=pub, min_contributors=1, deadline_seconds=0.5,
    )  # fmt: skip
    out: list = []
    t = _RoundThread(clock, target=lambda: out.append(state.execute_round(req)))
    t.start()
    while not state._open:
        time.sleep(0.001)
    x, y, z, w, v = seal_many(pub, [bytes([i]) * 8 for i in range(5)], b"info")
    same_key = x[:ENC_BYTES] + bytes(len(x) - ENC_BYTES)
    msgs = [
        UserMessage("a", b"1" * 16, ciphertexts=[x, y]),
        UserMessage("b", b"2" * 16, ciphertexts=[z, x]),  # a's first message again
        UserMessage("c", b"3" * 16, ciphertexts=[w, w]),  # one message twice
        UserMessage("d", b"4" * 16, ciphertexts=[v, same_key]),  # another ciphertext under a's key
        UserMessage("e", b"5" * 16, ciphertexts=[z, v]),  # b's and d's were rejected: their keys are not taken
    ]
    ack = state.submit(Submission("run", 0, "node", msgs))
    assert (ack.accepted, ack.rejected) == (2, {"replayed_message": 3})
    again = state.submit(Submission("run", 0, "node", [UserMessage("b", b"6" * 16, ciphertexts=[w, v])]))
    assert again.rejected == {"duplicate_user": 1}  # b's one answer was used up by the copy
    t.join()
    assert out[0].contributors == 2 and sorted(out[0].ciphertexts) == sorted([x, y, z, v])


def _report(node: FakeNode, round_: int, user: str, counts: list[int]) -> pb.Contribution:
    c = pb.Contribution(run_id="r", round=round_, node_id=node.node_id)
    c.messages.add(user_id=user, nonce=secrets.token_bytes(16), counts=pb.CountVector(counts=counts))
    return c


def _check_in(node: FakeNode, round_: int, users) -> None:
    c = pb.Contribution(run_id="r", round=round_, node_id=node.node_id)
    for u in users:
        c.messages.add(user_id=u, nonce=secrets.token_bytes(16))
    node.stub.Submit(c, timeout=5)


def _expired(stub, contribution: pb.Contribution) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(contribution, timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "expired_round" in err.value.details()


def test_a_round_with_a_report_goal_closes_once_it_is_reached_and_refuses_a_later_report(shuffler):
    """Over-selection (Bonawitz et al. 2019 sec 2; RoundSpec.report_goal): 6 users invited, a goal of 3 reports
    (threshold 2), a 20 s deadline. The round releases as soon as the 3rd report is accepted, with those 3 users'
    counts; a 4th report after that is refused as expired_round (its node charged it when it sent it: the shuffler
    cannot tell a late report from one past the deadline, nor need it), and the round's batch is not waited on for
    the 3 users who never answer."""
    a = FakeNode(shuffler.stub, "a", [f"a{i}" for i in range(6)])
    pool = futures.ThreadPoolExecutor(1)
    try:
        shuffler.wait_nodes(1, users=6)
        t0 = time.monotonic()
        call = pool.submit(
            shuffler.stub.ExecuteRound, spec(1, min_contributors=2, report_goal=3, deadline_seconds=20.0), timeout=30
        )
        inv = a.q.get(timeout=10)
        assert list(inv.user_ids) == [f"a{i}" for i in range(6)] and inv.spec.report_goal == 3
        counts = [[i, 1, 2, 3] for i in range(6)]
        for i in range(2):
            shuffler.stub.Submit(_report(a, 1, f"a{i}", counts[i]), timeout=5)
        time.sleep(0.3)
        assert not call.done()  # 2 reports: at the threshold, below the goal
        shuffler.stub.Submit(_report(a, 1, "a2", counts[2]), timeout=5)
        batch = call.result(timeout=10)
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0, elapsed  # not the 20 s deadline
        rep = batch.report
        assert batch.released and (rep.invited, rep.contributors) == (6, 3)
        np.testing.assert_array_equal(np.array(batch.label_totals), np.sum(counts[:3], axis=0))
        _expired(shuffler.stub, _report(a, 1, "a3", counts[3]))
        assert shuffler.state.counters()["expired_round"] == 1
        # a goal of 0: the round waits for every invitee (today's behaviour), here until its deadline
        t0 = time.monotonic()
        call = pool.submit(shuffler.stub.ExecuteRound, spec(2, min_contributors=2, deadline_seconds=1.5), timeout=30)
        a.q.get(timeout=10)
        for i in range(4):
            shuffler.stub.Submit(_report(a, 2, f"a{i}", counts[i]), timeout=5)
        assert call.result(timeout=10).report.contributors == 4 and time.monotonic() - t0 >= 1.4
    finally:
        a.call.cancel()
        pool.shutdown(wait=False)


def test_a_report_goal_below_the_threshold_or_for_a_subsampled_round_is_refused_before_anyone_is_invited(
    shuffler, nodes
):
    """A goal below min_contributors would close a round below its threshold; a subsampled round's amplification
    assumes the draw alone decides whose reports are in it. Both are refused with the reason, nobody invited."""
    for s, why in [
        (spec(7, min_contributors=5, report_goal=4), "report_goal = 4 is below min_contributors = 5"),
        (
            spec(7, schedule=pb.SUBSAMPLED, cohort=4, min_contributors=2, report_goal=3),
            "report_goal applies to SEQUENTIAL and FULLY_INTERACTIVE rounds",
        ),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            shuffler.stub.ExecuteRound(s, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details(), err.value
    assert not shuffler.recorder.for_round(7)  # nobody was invited
    # in the state: a ValueError before any state changes (the round may still run afterwards)
    state = ShufflerState(rng=make_rng(1))
    state.register_users("node", ["a", "b"])
    state.subscribe("node")
    req = RoundRequest("run", 0, Schedule.SEQUENTIAL, Transport.COUNTS, dim=2, g=1, m=2, cohort_size=2,
                       min_contributors=2, report_goal=1, deadline_seconds=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="report_goal = 1 is below min_contributors = 2"):
        state.execute_round(req)
    assert state.population("run").unused_users == 2  # nobody was used


def test_a_check_in_rounds_goal_below_c_min_waits_for_c_min_reports(shuffler):
    """A check-in round (min_contributors 5, report_fraction 0.75) with a goal of 5: all 8 users check in, so the
    second invitation's threshold is c_min = max(5, ceil(0.75 * 8)) = 6. The goal applies to the reports at
    max(5, c_min) = 6: 5 reports leave the round open, the 6th closes it at once (not at the 12 s deadline, not
    waiting for the 2 others), and a 7th is refused as expired_round."""
    a = FakeNode(shuffler.stub, "a", [f"a{i}" for i in range(8)])
    pool = futures.ThreadPoolExecutor(1)
    try:
        shuffler.wait_nodes(1, users=8)
        t0 = time.monotonic()
        call = pool.submit(
            shuffler.stub.ExecuteRound, _check_in_spec(1, 0.75, report_goal=5, deadline_seconds=12.0), timeout=30
        )
        inv = a.q.get(timeout=10)
        _check_in(a, 1, inv.user_ids)
        second = a.q.get(timeout=10).spec
        assert (second.check_in.checked_in, second.min_contributors, second.randomizer.m) == (8, 6, 5)
        counts = [[i, 1, 2, 0] for i in range(8)]
        for i in range(5):
            shuffler.stub.Submit(_report(a, 1, f"a{i}", counts[i]), timeout=5)
        time.sleep(0.5)
        assert not call.done()  # the goal 5 is below c_min = 6: still open
        shuffler.stub.Submit(_report(a, 1, "a5", counts[5]), timeout=5)
        batch = call.result(timeout=10)
        assert time.monotonic() - t0 < 6.0  # the 6th report closed it, well before the 12 s deadline
        rep = batch.report
        assert batch.released and (rep.invited, rep.checked_in, rep.contributors, rep.excluded_silent) == (8, 8, 6, 0)
        np.testing.assert_array_equal(np.array(batch.label_totals), np.sum(counts[:6], axis=0))
        _expired(shuffler.stub, _report(a, 1, "a6", counts[6]))
        # the two cut off were slower, not silent: the run's next check-in invites all 8 again
        nxt = pool.submit(shuffler.stub.ExecuteRound, _check_in_spec(2, 0.75, deadline_seconds=1.0), timeout=30)
        assert len(a.q.get(timeout=10).user_ids) == 8
        assert nxt.result(timeout=10).report.excluded_silent == 0
    finally:
        a.call.cancel()
        pool.shutdown(wait=False)


def test_a_report_right_after_the_goal_is_refused_before_the_round_has_closed():
    """Between the report that reaches the goal and the round's own thread closing it, the round is still open:
    a report in that instant is refused as expired_round all the same (the goal, not the close, ends collection).
    The test holds the state's lock across both submits, so the round's thread cannot close it in between."""
    from shuffledp.services.shuffler_state import Submission, UserMessage

    state = ShufflerState(rng=make_rng(2))
    users = [f"u{i}" for i in range(4)]
    state.register_users("node", users)
    sub = state.subscribe("node")
    req = RoundRequest("run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=2, g=1, m=2,
                       min_contributors=2, report_goal=2, deadline_seconds=20.0)  # fmt: skip
    out: list = []
    t = threading.Thread(target=lambda: out.append(state.execute_round(req)))
    t.start()

    def report(u: str) -> Submission:
        msg = UserMessage(u, secrets.token_bytes(16), counts=np.array([1, 2], dtype=np.uint64))
        return Submission("run", 0, "node", [msg])

    try:
        assert list(sub.get(5.0).user_ids) == users
        assert state.submit(report("u0")).accepted == 1
        with state._lock:
            assert state.submit(report("u1")).accepted == 1  # the goal
            with pytest.raises(RoundRejected) as err:
                state.submit(report("u2"))
            assert err.value.reason.value == "expired_round"
    finally:
        t.join(10)
    assert out[0].released and out[0].contributors == 2
    np.testing.assert_array_equal(out[0].label_totals, [2, 4])
