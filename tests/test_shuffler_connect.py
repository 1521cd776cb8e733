"""The bidirectional Connect stream (issue 30): a contribution on it is checked exactly as by Submit (design 5.3),
whole-contribution refusals come back as a SubmitResult with Submit's status and reason, and a real node whose
stream breaks mid-round still delivers (by Submit, the same nonces) and reconnects.

Real gRPC servers on 127.0.0.1:0; the test plays the analyzer (ExecuteRound) and, in the first tests, the nodes.
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
from shuffledp.clients.node import start_node_with_shard
from test_shuffler import NO_VERIFY, Shuffler, shard, spec

from shuffledp.mechanisms import pvec
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb

USERS = [f"u{i}" for i in range(6)]
BOUND = 4 + 6  # spec(): g + m
D = 4  # spec(): d = F + 1


class StreamNode:
    """The test as a client node on a Connect stream: contributions in, invitations and results out."""

    def __init__(self, stub, node_id: str, users: list[str], first: pb.NodeMessage | None = None) -> None:
        self.node_id = node_id
        stub.RegisterUsers(pb.RegisterUsersRequest(node_id=node_id, user_ids=users), timeout=5)
        self._out: queue.Queue = queue.Queue()
        self._out.put(first or pb.NodeMessage(subscribe=pb.SubscribeRequest(node_id=node_id)))
        self.invitations: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self._seq = 0
        self.call = stub.Connect(iter(self._out.get, None))
        self.error: grpc.RpcError | None = None
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for msg in self.call:
                if msg.WhichOneof("kind") == "invitation":
                    self.invitations.put(msg.invitation)
                else:
                    self.results.put(msg.result)
        except grpc.RpcError as exc:
            self.error = exc

    def send(self, c: pb.Contribution) -> pb.SubmitResult:
        self._seq += 1
        self._out.put(pb.NodeMessage(seq=self._seq, contribution=c))
        result = self.results.get(timeout=10)
        assert result.seq == self._seq
        return result

    def close(self) -> None:
        self._out.put(None)
        self.call.cancel()


class UnaryNode:
    """The test as a client node on Subscribe + Submit, answering as Connect's results do."""

    def __init__(self, stub, node_id: str, users: list[str]) -> None:
        self.stub, self.node_id = stub, node_id
        stub.RegisterUsers(pb.RegisterUsersRequest(node_id=node_id, user_ids=users), timeout=5)
        self.invitations: queue.Queue = queue.Queue()
        self.call = stub.Subscribe(pb.SubscribeRequest(node_id=node_id))
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for inv in self.call:
                self.invitations.put(inv)
        except grpc.RpcError:
            pass

    def send(self, c: pb.Contribution) -> pb.SubmitResult:
        try:
            return pb.SubmitResult(ack=self.stub.Submit(c, timeout=10))
        except grpc.RpcError as exc:
            reason = dict(exc.trailing_metadata() or ()).get("shuffledp-reason", "")
            return pb.SubmitResult(status=exc.code().name, details=exc.details(), reason=reason)

    def close(self) -> None:
        self.call.cancel()


@pytest.fixture
def shuffler():
    s = Shuffler()
    yield s
    s.stop()


def _msg(user: str, counts=None, packed: bytes | None = None, nonce: bytes | None = None) -> pb.UserMessage:
    m = pb.UserMessage(user_id=user, nonce=nonce if nonce is not None else secrets.token_bytes(16))
    if packed is not None:
        m.counts.packed = packed
    if counts is not None:
        m.counts.counts.extend(counts)
    return m


def _script(node_id: str) -> list[pb.Contribution]:
    """Good, malformed, duplicate, replayed, unknown and late messages, in one order for both entry points."""
    dtype = pvec.count_wire_dtype(BOUND)
    good = np.array([1, 2, 3, BOUND], dtype=dtype).tobytes()
    replayed = secrets.token_bytes(16)

    def c(round_=1, **kw) -> pb.Contribution:
        return pb.Contribution(run_id="r", round=round_, node_id=node_id, **kw)

    cols = pb.UserColumns(user_ids=["u4", "u4"], nonce_bytes=16, nonces=secrets.token_bytes(32), counts=good * 2)
    return [
        c(messages=[_msg("u0", packed=good, nonce=replayed), _msg("u1", packed=good[:-1])]),  # good; wrong length
        c(messages=[_msg("u0", packed=good), _msg("u2", packed=good, nonce=replayed)]),  # duplicate; replayed nonce
        c(messages=[_msg("nobody", packed=good), _msg("u3", packed=good, counts=[1, 2, 3, 4])]),  # unknown; both
        c(messages=[_msg("u5", packed=np.array([0, BOUND + 1, 0, 0], dtype=dtype).tobytes())]),  # out of range
        c(columns=cols, refusals=[pb.Refusal(user_id="u2", reason="policy")]),  # a duplicate in columns
        c(round_=7, messages=[_msg("u3", packed=good)]),  # no such round: refused as a whole
    ]


def _run(shuffler: Shuffler, node) -> tuple[list[tuple], pb.ShuffledBatch]:
    pool = futures.ThreadPoolExecutor(1)
    try:
        fut = pool.submit(shuffler.stub.ExecuteRound, spec(1, deadline_seconds=20.0), timeout=30)
        assert sorted(node.invitations.get(timeout=10).user_ids) == USERS
        outcomes = []
        for c in _script(node.node_id):
            r = node.send(c)
            outcomes.append((r.status, r.reason, r.ack.accepted, dict(r.ack.rejected)))
        return outcomes, fut.result(timeout=30)
    finally:
        node.close()
        pool.shutdown()


def test_a_contribution_over_the_stream_is_checked_exactly_as_by_submit():
    """The same contributions, in the same order, over Connect and over Submit (each against a fresh shuffler):
    the same acks, the same rejections by reason, the same whole-round refusal, the same batch and counters."""
    seen = {}
    for kind in (StreamNode, UnaryNode):
        s = Shuffler()
        try:
            node = kind(s.stub, "n", USERS)
            s.wait_nodes(1, users=len(USERS))
            outcomes, batch = _run(s, node)
            report = batch.report
            seen[kind] = (outcomes, (report.contributors, dict(report.rejected), report.refused), s.state.counters())
        finally:
            s.stop()
    assert seen[StreamNode] == seen[UnaryNode]
    outcomes, (contributors, rejected, refused), _ = seen[StreamNode]
    assert outcomes[0][2:] == (1, {"wrong_count_length": 1})
    assert outcomes[1][2:] == (0, {"duplicate_user": 1, "replayed_nonce": 1})
    assert outcomes[-1][:2] == ("FAILED_PRECONDITION", "wrong_round")
    assert outcomes[4][2:] == (1, {"duplicate_user": 1})  # the columns' second u4
    # summed: u0 and the columns' first u4; refused: u2 (its message was a replay, so its refusal counts)
    assert contributors == 2 and refused == 1 and rejected["duplicate_user"] == 2


def test_a_contribution_for_another_node_on_a_stream_is_refused(shuffler):
    """A stream speaks for the node that subscribed on it: a contribution naming another node is refused
    (PERMISSION_DENIED, nothing counted), as Submit refuses one under mTLS; the stream stays usable."""
    node = StreamNode(shuffler.stub, "n", USERS)
    other = UnaryNode(shuffler.stub, "other", USERS)
    shuffler.wait_nodes(2, users=2 * len(USERS))
    pool = futures.ThreadPoolExecutor(1)
    try:
        fut = pool.submit(shuffler.stub.ExecuteRound, spec(1, deadline_seconds=3.0), timeout=30)
        node.invitations.get(timeout=10)
        good = np.array([1, 2, 3, 4], dtype=pvec.count_wire_dtype(BOUND)).tobytes()
        forged = pb.Contribution(run_id="r", round=1, node_id="other", messages=[_msg("u0", packed=good)])
        result = node.send(forged)
        assert result.status == "PERMISSION_DENIED" and "speak for themselves" in result.details
        mine = pb.Contribution(run_id="r", round=1, messages=[_msg("u0", packed=good)])  # node_id empty: the stream's
        assert node.send(mine).ack.accepted == 1
        batch = fut.result(timeout=30)
    finally:
        node.close()
        other.close()
        pool.shutdown()
    assert batch.report.contributors == 1 and not batch.report.rejected


def test_a_stream_must_start_with_subscribe(shuffler):
    c = pb.NodeMessage(seq=1, contribution=pb.Contribution(run_id="r", round=1, node_id="n"))
    node = StreamNode(shuffler.stub, "n", USERS, first=c)
    end = time.monotonic() + 10
    while node.error is None and time.monotonic() < end:
        time.sleep(0.01)
    assert node.error is not None and node.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert shuffler.state.population("r").connected_nodes == 0


class CutFirstContribution(grpc.aio.ServerInterceptor):
    """Breaks a node's Connect stream when its first contribution arrives: the contribution is dropped and the
    node's subscription replaced (which ends the stream), as a connection lost mid-round would."""

    def __init__(self) -> None:
        self.state = None
        self.cut = threading.Event()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.endswith("/Connect"):
            return handler
        inner = handler.stream_stream

        async def requests(it):
            async for raw in it:
                msg = pb.NodeMessage.FromString(raw)
                if msg.WhichOneof("kind") == "contribution" and not self.cut.is_set():
                    self.cut.set()
                    self.state.unsubscribe(self.state.subscribe(msg.contribution.node_id))  # ends this stream
                    continue
                yield raw

        async def connect(request_iterator, context):
            async for response in inner(requests(request_iterator), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            connect, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def test_a_node_whose_stream_breaks_mid_round_delivers_by_submit_and_reconnects():
    """The stream ends after the node sent its contribution, before its result: the node sends it again by Submit
    (the round gets all its users once), then reconnects, and the next round runs on the new stream."""
    from shuffledp.services.shuffler import serve_shuffler
    from shuffledp.services.shuffler_state import ShufflerState

    cutter = CutFirstContribution()
    state = ShufflerState(rng=make_rng(5))
    cutter.state = state
    server, port = serve_shuffler(state, "127.0.0.1:0", interceptors=[cutter])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    from shuffledp.v1 import shuffledp_pb2_grpc as pbg

    stub = pbg.ShufflerStub(channel)
    node = start_node_with_shard(
        "node-0", shard("n0", 5, seed=1), f"127.0.0.1:{port}", policy=NO_VERIFY, rng=make_rng(7)
    )
    node._backoff = (0.05, 0.2)
    try:
        assert node.connected.wait(10)
        end = time.monotonic() + 10
        while state.population("r").admitted_users < 5:
            assert time.monotonic() < end
            time.sleep(0.02)
        first = stub.ExecuteRound(spec(1), timeout=30)
        assert cutter.cut.is_set()
        assert first.released and first.report.contributors == 5 and not first.report.rejected
        end = time.monotonic() + 10
        while state.population("r").connected_nodes < 1:  # reconnected with its backoff
            assert time.monotonic() < end, "the node did not reconnect"
            time.sleep(0.02)
        second = stub.ExecuteRound(spec(2), timeout=30)
        assert second.released and second.report.contributors == 5
        assert node.core.rounds_joined == 2
    finally:
        node.stop()
        channel.close()
        server.stop(0).wait()
