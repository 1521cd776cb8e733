"""One test per rejection path of design 5.3 (plus the batch threshold and a client policy refusal).

Every test runs a real Shuffler gRPC server on 127.0.0.1:0. The test plays the analyzer (ExecuteRound through a
real stub, in a thread) and a client node (RegisterUsers, the Subscribe stream, Submit through real stubs), sends
one bad Contribution next to good ones, and checks: the clear status or ack reason, that the shuffler's counter
for that reason went up, and that nothing of the bad message reached the ShuffledBatch.
(The analyzer's own path, an undecryptable or malformed ciphertext, is tested with a real analyzer in
tests/test_analyzer_sealed_rejects.py.)
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from shuffledp.clients.node import UserShard, start_node_with_shard
from shuffledp.clients.policy import UserPolicy
from shuffledp.services.shuffler import REASON_METADATA_KEY, serve_shuffler
from shuffledp.services.shuffler_state import ShufflerState

from shuffledp.security.rng import make_rng
from shuffledp.security.sealing import generate_keypair, round_info, seal, sealed_length
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

D, G, M = 4, 3, 5  # COUNTS rounds: d labels, counts in [0, g+m] = [0, 8]
USERS = [f"u{i}" for i in range(4)]


class FakeNode:
    """The test's own client node: registers users and collects invitations from a real Subscribe stream."""

    def __init__(self, stub: pbg.ShufflerStub, node_id: str, users: list[str]) -> None:
        self.stub, self.node_id, self.users = stub, node_id, users
        self.invitations: queue.Queue = queue.Queue()
        stub.RegisterUsers(pb.RegisterUsersRequest(node_id=node_id, user_ids=users), timeout=5)
        self._call = stub.Subscribe(pb.SubscribeRequest(node_id=node_id))
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for inv in self._call:
                self.invitations.put(inv)
        except grpc.RpcError:
            pass

    def next(self, timeout: float = 5.0) -> pb.Invitation:
        return self.invitations.get(timeout=timeout)

    def close(self) -> None:
        self._call.cancel()


class Cluster:
    def __init__(self) -> None:
        self.state = ShufflerState(rng=make_rng(4))
        self.server, port = serve_shuffler(self.state, "127.0.0.1:0")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pbg.ShufflerStub(self.channel)
        self.address = f"127.0.0.1:{port}"
        self.pool = futures.ThreadPoolExecutor(2)
        self.nodes: list[FakeNode] = []

    def node(self, node_id: str, users: list[str]) -> FakeNode:
        n = FakeNode(self.stub, node_id, users)
        self.nodes.append(n)
        deadline = time.monotonic() + 5
        while self.stub.GetPopulation(pb.PopulationRequest()).connected_nodes < len(self.nodes):
            assert time.monotonic() < deadline, "node did not subscribe"
            time.sleep(0.01)
        return n

    def execute(self, spec: pb.RoundSpec) -> futures.Future:
        return self.pool.submit(self.stub.ExecuteRound, spec, timeout=30)

    def close(self) -> None:
        for n in self.nodes:
            n.close()
        self.channel.close()
        self.server.stop(0).wait()
        self.pool.shutdown()


@pytest.fixture
def cl():
    c = Cluster()
    yield c
    c.close()


def counts_spec(round_=1, schedule=pb.FULLY_INTERACTIVE, cohort=0, min_contrib=1, deadline=10.0) -> pb.RoundSpec:
    return pb.RoundSpec(
        run_id="run-x",
        round=round_,
        schedule=schedule,
        trust_model=pb.SHUFFLE,
        transport=pb.COUNTS,
        randomizer=pb.RandomizerSpec(protocol="pvec", dim=D, g=G, m=M, p=0.5, clip_norm=1.0),
        cohort_size=cohort,
        min_contributors=min_contrib,
        deadline_seconds=deadline,
        per_user_cost=pb.PrivacyCost(eps=1.0, delta=1e-6),
    )


PUB = generate_keypair()[1]


def sealed_spec(round_=1, per_user=2, nbytes=8) -> pb.RoundSpec:
    s = counts_spec(round_)
    s.transport = pb.SEALED
    s.randomizer.messages_per_user = per_user
    s.randomizer.message_bytes = nbytes
    s.analyzer_public_key = PUB
    return s


def cmsg(user: str, counts, nonce: bytes | None = None) -> pb.UserMessage:
    return pb.UserMessage(user_id=user, nonce=nonce or secrets.token_bytes(16), counts=pb.CountVector(counts=counts))


def smsg(user: str, cts: list[bytes], nonce: bytes | None = None) -> pb.UserMessage:
    return pb.UserMessage(
        user_id=user, nonce=nonce or secrets.token_bytes(16), sealed=pb.SealedMessages(ciphertexts=cts)
    )


def contribution(node: FakeNode, round_: int, msgs=(), refusals=(), run_id="run-x") -> pb.Contribution:
    return pb.Contribution(
        run_id=run_id,
        round=round_,
        node_id=node.node_id,
        messages=list(msgs),
        refusals=[pb.Refusal(user_id=u, reason="test") for u in refusals],
    )


GOOD = {u: [i + 1, 0, 2, i] for i, u in enumerate(USERS)}  # valid counts (<= g+m), distinct per user
BAD = [8, 8, 8, 8]  # what a bad message carries: would show in the totals if it were aggregated


def finish_counts_round(cl: Cluster, node: FakeNode, fut, round_: int, good_users, refuse_users=(), already=()):
    """Good messages for good_users, refusals for refuse_users; returns (ack, batch). `already`: users whose
    good message was accepted earlier in this round."""
    ack = cl.stub.Submit(contribution(node, round_, [cmsg(u, GOOD[u]) for u in good_users], refuse_users))
    batch = fut.result(timeout=15)
    assert batch.released
    expected = np.sum([GOOD[u] for u in [*already, *good_users]], axis=0)
    np.testing.assert_array_equal(np.array(batch.label_totals), expected)  # bad message not aggregated
    assert batch.report.contributors == len(already) + len(good_users)
    assert not batch.ciphertexts
    return ack, batch


def assert_rejected_per_message(cl, node, fut, round_, bad_msg, reason, good_users=USERS, refuse=()):
    before = cl.state.counters().get(reason, 0)
    ack = cl.stub.Submit(contribution(node, round_, [bad_msg]))
    assert ack.accepted == 0 and dict(ack.rejected) == {reason: 1}
    assert cl.state.counters()[reason] == before + 1
    _, batch = finish_counts_round(cl, node, fut, round_, good_users, refuse)
    assert batch.report.rejected[reason] == 1
    return batch


# ---------------------------------------------------------------------------------------------- round level
def test_wrong_round(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    for bad in (contribution(node, 99, [cmsg("u0", BAD)]), contribution(node, 1, [cmsg("u0", BAD)], run_id="other")):
        with pytest.raises(grpc.RpcError) as err:
            cl.stub.Submit(bad)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details().startswith("wrong_round:")
        assert dict(err.value.trailing_metadata())[REASON_METADATA_KEY] == "wrong_round"
    assert cl.state.counters()["wrong_round"] == 2
    finish_counts_round(cl, node, fut, 1, USERS)


def test_expired_round(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    finish_counts_round(cl, node, fut, 1, USERS)
    with pytest.raises(grpc.RpcError) as err:
        cl.stub.Submit(contribution(node, 1, [cmsg("u0", BAD)]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details().startswith("expired_round:")
    assert cl.state.counters()["expired_round"] == 1
    # a late message after the deadline (round still being closed) is expired too, and not in the batch
    fut = cl.execute(counts_spec(2, deadline=3.0))  # the two answers arrive in time even on a loaded machine
    node.next()
    cl.stub.Submit(contribution(node, 2, [cmsg(u, GOOD[u]) for u in USERS[:2]]))
    batch = fut.result(timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        cl.stub.Submit(contribution(node, 2, [cmsg("u3", BAD)]))
    assert err.value.details().startswith("expired_round:")
    np.testing.assert_array_equal(batch.label_totals, np.add(GOOD["u0"], GOOD["u1"]))
    assert cl.state.counters()["expired_round"] == 2


# ---------------------------------------------------------------------------------------------- message level
def test_bad_nonce(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    assert_rejected_per_message(cl, node, fut, 1, cmsg("u0", BAD, nonce=b"1234"), "bad_nonce")


def test_replayed_nonce(cl):
    # nonces are remembered for their round (a closed round refuses every message anyway), so what a sender can
    # make the shuffler hold ends with the round (issue 10)
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    first = cmsg("u0", GOOD["u0"])
    assert cl.stub.Submit(contribution(node, 1, [first])).accepted == 1
    replay = pb.UserMessage()
    replay.CopyFrom(first)
    replay.user_id = "u1"  # the same message again, even under another invited user
    replay.counts.counts[:] = BAD
    before = cl.state.counters().get("replayed_nonce", 0)
    ack = cl.stub.Submit(contribution(node, 1, [replay]))
    assert ack.accepted == 0 and dict(ack.rejected) == {"replayed_nonce": 1}
    assert cl.state.counters()["replayed_nonce"] == before + 1
    _, batch = finish_counts_round(cl, node, fut, 1, USERS[1:], already=["u0"])
    assert batch.report.rejected["replayed_nonce"] == 1


def test_nonces_held_are_bounded_by_the_invitees(cl):
    """Messages of unknown or uninvited users, each with a fresh nonce, leave nothing behind (issue 10: 1.6M
    rejected messages kept +300 MB of nonces); only an invitee's one answer is remembered, until the round closes."""
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    spam = [cmsg(f"stranger-{i}", BAD) for i in range(2000)]
    ack = cl.stub.Submit(contribution(node, 1, spam))
    assert ack.accepted == 0 and dict(ack.rejected) == {"unknown_user": 2000}
    (open_round,) = cl.state._open.values()  # the round's own state: the only place nonces live
    assert len(open_round.nonces) == 0
    finish_counts_round(cl, node, fut, 1, USERS)
    assert len(open_round.nonces) == len(USERS) and not cl.state._open


def test_duplicate_user(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    ack = cl.stub.Submit(contribution(node, 1, [cmsg("u0", GOOD["u0"])]))
    assert ack.accepted == 1
    before = cl.state.counters().get("duplicate_user", 0)
    ack = cl.stub.Submit(contribution(node, 1, [cmsg("u0", BAD)]))
    assert dict(ack.rejected) == {"duplicate_user": 1} and ack.accepted == 0
    assert cl.state.counters()["duplicate_user"] == before + 1
    finish_counts_round(cl, node, fut, 1, USERS[1:], already=["u0"])  # u0 counted once, the duplicate not


def test_unknown_user(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    assert_rejected_per_message(cl, node, fut, 1, cmsg("ghost", BAD), "unknown_user")


def test_not_invited(cl):
    node = cl.node("node-a", USERS)
    # v0 is admitted (registered by node-b, which is not subscribed, so never invited)
    cl.stub.RegisterUsers(pb.RegisterUsersRequest(node_id="node-b", user_ids=["v0"]))
    fut = cl.execute(counts_spec(1, schedule=pb.SUBSAMPLED, cohort=2))
    invited = list(node.next().user_ids)
    assert len(invited) == 2
    outsider = next(u for u in USERS if u not in invited)
    # not invited; and v0, which is node-b's user: ids are scoped by node, so node-a has no user v0 at all
    bad_msgs = [cmsg(outsider, BAD), cmsg("v0", BAD)]
    before = cl.state.counters().get("not_invited", 0)
    ack = cl.stub.Submit(contribution(node, 1, bad_msgs))
    assert ack.accepted == 0 and dict(ack.rejected) == {"not_invited": 1, "unknown_user": 1}
    assert cl.state.counters()["not_invited"] == before + 1
    finish_counts_round(cl, node, fut, 1, invited)


def test_wrong_payload(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    assert_rejected_per_message(cl, node, fut, 1, smsg("u0", [b"x" * 60]), "wrong_payload", USERS[1:])


def test_wrong_count_length(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    assert_rejected_per_message(cl, node, fut, 1, cmsg("u0", BAD[:3]), "wrong_count_length", USERS[1:])


def test_count_out_of_range(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1))
    node.next()
    bad = cmsg("u0", [0, 0, G + M + 1, 0])
    assert_rejected_per_message(cl, node, fut, 1, bad, "count_out_of_range", USERS[1:])


def sealed_round(cl, node, reason, bad_msg):
    fut = cl.execute(sealed_spec(1, per_user=2, nbytes=8))
    node.next()
    info = round_info("run-x", 1)
    good = {u: [seal(PUB, u.encode().ljust(8, b"."), info) for _ in range(2)] for u in USERS[1:]}
    before = cl.state.counters().get(reason, 0)
    ack = cl.stub.Submit(contribution(node, 1, [bad_msg]))
    assert ack.accepted == 0 and dict(ack.rejected) == {reason: 1}
    assert cl.state.counters()[reason] == before + 1
    ack = cl.stub.Submit(contribution(node, 1, [smsg(u, c) for u, c in good.items()]))
    assert ack.accepted == 3
    batch = fut.result(timeout=15)
    assert batch.released and batch.report.rejected[reason] == 1 and batch.report.contributors == 3
    assert sorted(batch.ciphertexts) == sorted(c for cs in good.values() for c in cs)  # only the good ones
    assert not batch.label_totals


def test_wrong_message_count(cl):
    node = cl.node("node-a", USERS)
    bad = smsg("u0", [seal(PUB, b"12345678", round_info("run-x", 1))])  # 1 message, the round wants 2
    sealed_round(cl, node, "wrong_message_count", bad)


def test_wrong_ciphertext_length(cl):
    node = cl.node("node-a", USERS)
    info = round_info("run-x", 1)
    bad = smsg("u0", [seal(PUB, b"12345678", info), seal(PUB, b"123456789", info)])
    assert len(bad.sealed.ciphertexts[1]) == sealed_length(9)
    sealed_round(cl, node, "wrong_ciphertext_length", bad)


def test_below_threshold_releases_nothing(cl):
    node = cl.node("node-a", USERS)
    fut = cl.execute(counts_spec(1, min_contrib=3))
    node.next()
    cl.stub.Submit(contribution(node, 1, [cmsg(u, GOOD[u]) for u in USERS[:2]], refusals=USERS[2:]))
    batch = fut.result(timeout=10)
    assert not batch.released and batch.report.below_threshold
    assert not batch.label_totals and not batch.ciphertexts
    assert batch.report.contributors == 2 and batch.report.refused == 2


def test_bad_round_spec_is_invalid_argument(cl):
    cl.node("node-a", USERS)
    bad_specs = [counts_spec(1, deadline=0.0), sealed_spec(2), counts_spec(3, schedule=pb.SUBSAMPLED, cohort=0)]
    bad_specs[1].analyzer_public_key = b"short"
    for spec in bad_specs:
        with pytest.raises(grpc.RpcError) as err:
            cl.stub.ExecuteRound(spec, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert any(k in err.value.details() for k in ("deadline_seconds", "analyzer_public_key", "cohort_size"))


# ---------------------------------------------------------------------------------------------- client policy
def test_client_policy_refusal_counts_not_allowed(cl):
    """A real client node whose users refuse COUNTS: refusals reach the shuffler with the reason, nothing else."""
    rng = make_rng(5)
    shard = UserShard([f"p{i}" for i in range(3)], rng.normal(size=(3, 1, 3)), rng.normal(size=(3, 1)))
    policy = UserPolicy(allowed_transports=frozenset({"bits", "sealed"}), verify_randomizer=False)
    handle = start_node_with_shard("node-p", shard, cl.address, policy=policy, rng=make_rng(6))
    try:
        deadline = time.monotonic() + 5
        while cl.stub.GetPopulation(pb.PopulationRequest()).connected_nodes < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        spec = counts_spec(1)
        spec.task, spec.randomizer.dim = "leastsq", 4
        spec.model.shape[:] = [4]
        spec.model.f64 = np.zeros(4).tobytes()
        batch = cl.execute(spec).result(timeout=15)
        assert not batch.released and batch.report.below_threshold and not batch.label_totals
        assert batch.report.refused == 3 and batch.report.contributors == 0
        assert cl.state.counters()["refused"] == 3
        status = pbg.ClientNodeStub(grpc.insecure_channel(f"127.0.0.1:{handle.port}")).GetNodeStatus(
            pb.NodeStatusRequest(), timeout=5
        )
        assert dict(status.refusals) == {"transport_not_allowed": 3}
        assert handle.core.spent("p0") == (0.0, 0.0)  # a refusing user spends nothing
    finally:
        handle.stop()
