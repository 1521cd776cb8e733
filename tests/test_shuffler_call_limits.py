"""Issue 43 item 3: no party can be stalled by one identity. Each call to the shuffler counts against its caller's
certificate identity when it opens, before its first message is read; a call whose first message does not come in
time is cancelled; the analyzer's calls have threads of their own (services/shuffler.py, CallLimits).

Everything here runs over mTLS on real sockets: the probe that found it held every server thread with one client
certificate's Connect streams that never sent a message, and the honest run then failed with 0 rounds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from _procs import serve, stop, write_blobs
from _runs import wait_for_run
from shuffledp.services.shuffler import STREAMS_PER_NODE, serve_shuffler
from shuffledp.services.shuffler_state import ShufflerState

from shuffledp.security import pki
from shuffledp.transport import tls
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(180)

CONNECT = "/shuffledp.v1.Shuffler/Connect"
SUBSCRIBE = "/shuffledp.v1.Shuffler/Subscribe"
SUBMIT = "/shuffledp.v1.Shuffler/Submit"
EXECUTE = "/shuffledp.v1.Shuffler/ExecuteRound"
ATTACKER = "client-2"  # a node certificate of the same CA that hosts no users of the run


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    pki.init_pki(d, client_nodes=3)
    return d


class SilentCalls:
    """`count` calls of one identity that open and never send a message, each opened again `reopen_s` after it
    ended (the attack keeps them all held). Runs on an asyncio loop of its own: no thread per call."""

    def __init__(self, pki_dir: Path, name: str, address: str, methods: list[str], reopen_s: float = 0.5) -> None:
        self._creds = tls.channel_credentials(pki_dir, pki.ROLE_CLIENT_NODE, name)
        self._address, self._methods, self._reopen_s = address, methods, reopen_s
        self.ended: Counter = Counter()  # (method, status code) -> calls that ended so
        self.details: dict[tuple[str, grpc.StatusCode], str] = {}  # one of each
        self.opened = 0
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        options = [("grpc.ssl_target_name_override", "shuffler")]
        async with grpc.aio.secure_channel(self._address, self._creds, options=options) as channel:
            self._started.set()
            await asyncio.gather(*(self._hold(channel, m) for m in self._methods))

    async def _hold(self, channel: grpc.aio.Channel, method: str) -> None:
        stopped = asyncio.ensure_future(self._stop.wait())
        while True:
            call = channel.stream_stream(method)()  # opened; nothing is ever written
            self.opened += 1
            ended = asyncio.ensure_future(call.code())
            await asyncio.wait([stopped, ended], return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():
                call.cancel()
                return
            self.ended[(method, ended.result())] += 1
            self.details[(method, ended.result())] = await call.details()
            await asyncio.wait([stopped], timeout=self._reopen_s)
            if stopped.done():
                return

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)


def _channel(pki_dir: Path, role: str, name: str, address: str) -> grpc.Channel:
    return tls.ChannelSecurity(pki_dir, role, name).channel(address, server_name="shuffler")


def _server(pki_dir: Path, **kw) -> tuple[object, str]:
    """An in-process shuffler on a real socket with mTLS and the role policy, as `shuffledp serve shuffler` has."""
    creds = tls.server_credentials(pki_dir, pki.ROLE_SHUFFLER, "shuffler")
    interceptors = [tls.RoleInterceptor(tls.DEFAULT_POLICY).aio()]
    server, port = serve_shuffler(ShufflerState(), "127.0.0.1:0", creds, interceptors, **kw)
    return server, f"127.0.0.1:{port}"


def _until(what, timeout: float, message: str) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, message()
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------- unit level
def test_streams_and_requests_count_against_the_identity_when_they_open(pki_dir: Path) -> None:
    """Silent calls of one certificate: STREAMS_PER_NODE streams (Connect and Subscribe together) and two requests
    are held, every further one is refused at once with RESOURCE_EXHAUSTED naming the limit; another node connects,
    and a node's silent ExecuteRound is refused at once. Before, every one of them held a thread, unanswered."""
    server, addr = _server(pki_dir)
    silent = SilentCalls(pki_dir, ATTACKER, addr, [CONNECT, SUBSCRIBE] * 3 + [SUBMIT] * 4 + [EXECUTE] * 3, 60)
    try:
        _until(
            lambda: sum(silent.ended.values()) >= 9,
            10,
            lambda: f"only {dict(silent.ended)} refused of {silent.opened} opened",
        )
        time.sleep(0.5)  # nothing more is refused: the held ones stay held
        ended = dict(silent.ended)
        exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sum(n for (m, c), n in ended.items() if m in (CONNECT, SUBSCRIBE) and c == exhausted) == 6 - 2, ended
        assert ended[(SUBMIT, exhausted)] == 2 and ended[(EXECUTE, grpc.StatusCode.PERMISSION_DENIED)] == 3, ended
        assert sum(ended.values()) == 9, ended
        assert f"at most {STREAMS_PER_NODE} per node identity" in silent.details[(CONNECT, exhausted)]
        assert "2 requests of this node are in flight" in silent.details[(SUBMIT, exhausted)]
        assert "may not call this method" in silent.details[(EXECUTE, grpc.StatusCode.PERMISSION_DENIED)]
        assert server.call_limits.refusals() == {"node_streams": 4, "node_requests": 2, "not_analyzer": 3}
        # another identity is served: it registers, subscribes and is counted; the analyzer's call is answered
        node = pbg.ShufflerStub(_channel(pki_dir, pki.ROLE_CLIENT_NODE, "client-0", addr))
        node.RegisterUsers(pb.RegisterUsersRequest(user_ids=["u0"]), timeout=5)
        stream = node.Subscribe(pb.SubscribeRequest())
        analyzer = pbg.ShufflerStub(_channel(pki_dir, pki.ROLE_ANALYZER, "analyzer", addr))
        _until(
            lambda: analyzer.GetPopulation(pb.PopulationRequest(), timeout=5).connected_nodes == 1,
            10,
            lambda: "client-0 never counted",
        )
        stream.cancel()
    finally:
        silent.close()
        server.stop(0)


def test_a_call_without_a_first_message_is_cancelled_after_the_deadline(pki_dir: Path) -> None:
    """A stream and a request that send nothing are cancelled once first_message_seconds passed, which frees the
    identity's quota (DEADLINE_EXCEEDED); a stream whose first message came in time lives on past it."""
    server, addr = _server(pki_dir, first_message_seconds=1.0)
    silent = SilentCalls(pki_dir, ATTACKER, addr, [CONNECT, SUBMIT], reopen_s=60)
    try:
        node = pbg.ShufflerStub(_channel(pki_dir, pki.ROLE_CLIENT_NODE, "client-0", addr))
        node.RegisterUsers(pb.RegisterUsersRequest(user_ids=["u0"]), timeout=5)
        honest = node.Subscribe(pb.SubscribeRequest())
        opened = time.monotonic()
        _until(lambda: sum(silent.ended.values()) == 2, 10, lambda: f"not cancelled: {dict(silent.ended)}")
        took = time.monotonic() - opened
        late = grpc.StatusCode.DEADLINE_EXCEEDED
        assert dict(silent.ended) == {(CONNECT, late): 1, (SUBMIT, late): 1}
        assert "no request within 1 s of the call's opening" in silent.details[(SUBMIT, late)]
        assert 0.8 <= took < 5, took  # the deadline (1 s), not the caller's patience
        assert server.call_limits.refusals() == {"first_message_deadline": 2}
        time.sleep(1.0)  # the honest stream is past its deadline too
        analyzer = pbg.ShufflerStub(_channel(pki_dir, pki.ROLE_ANALYZER, "analyzer", addr))
        assert analyzer.GetPopulation(pb.PopulationRequest(), timeout=5).connected_nodes == 1  # honest: still on
        assert not honest.done()
        honest.cancel()
    finally:
        silent.close()
        server.stop(0)


# ----------------------------------------------------------------------------------------- over real processes
def test_one_identity_with_1000_silent_streams_stalls_no_run(tmp_path: Path, pki_dir: Path) -> None:
    """The probe, over real processes with mTLS: one node certificate holds 1000 silent streams (Connect and
    Subscribe, each opened again half a second after it ended) from before the run starts to its end, and the
    honest run of two nodes completes every round. Before, the streams held all 64 threads: the run got no round."""
    toml = write_blobs(tmp_path / "blobs.npz") + "[privacy]\neps = 4.0\n[schedule]\nrounds = 6\n"
    toml += "[deployment]\nround_deadline_seconds = 10\n"
    cfg = tmp_path / "run.toml"
    cfg.write_text(toml)
    pki_args = ["--pki", str(pki_dir)]
    shuffler, port = serve(tmp_path, "shuffler", ["shuffler", *pki_args, "--state-dir", str(tmp_path / "sh")])
    addr = f"127.0.0.1:{port}"
    node_argv = ["client", *pki_args, "--shuffler", addr, "--config", str(cfg), "--num-nodes", "2"]
    procs = [shuffler, *(serve(tmp_path, f"node{i}", [*node_argv, "--node-index", str(i)])[0] for i in range(2))]
    analyzer_argv = ["analyzer", *pki_args, "--shuffler", addr, "--state-dir", str(tmp_path / "a")]
    analyzer, aport = serve(tmp_path, "analyzer", analyzer_argv)
    procs.append(analyzer)
    silent = None
    try:
        shuffler_stub = pbg.ShufflerStub(_channel(pki_dir, pki.ROLE_ANALYZER, "analyzer", addr))
        _until(
            lambda: shuffler_stub.GetPopulation(pb.PopulationRequest(), timeout=10).connected_nodes == 2,
            60,
            lambda: "the nodes did not connect",
        )
        silent = SilentCalls(pki_dir, ATTACKER, addr, [CONNECT, SUBSCRIBE] * 500)
        _until(lambda: silent.opened >= 1000, 30, lambda: f"{silent.opened} streams opened")
        time.sleep(1.0)  # they reach the shuffler before the run starts
        operator = tls.ChannelSecurity(pki_dir, pki.ROLE_OPERATOR, "operator")
        with operator.channel(f"127.0.0.1:{aport}", server_name="analyzer") as ch:
            stub = pbg.AnalyzerStub(ch)
            started = time.monotonic()
            run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=toml), timeout=60).run_id
            stub.StartRun(pb.RunRef(run_id=run_id), timeout=10)
            st = wait_for_run(stub, run_id, timeout=60)
            took = time.monotonic() - started
        assert st.state == pb.COMPLETED, st.message
        assert st.rounds_done == 6 and all(m.released for m in st.metrics), st.metrics
        codes = Counter()
        for (_, code), n in silent.ended.items():
            codes[code] += n
        print(f"run of 6 rounds took {took:.1f} s under {silent.opened} silent calls opened, {dict(codes)}")
        # refused when they opened (the two held are cancelled at the 30 s deadline, if the run took that long)
        assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}, codes
        assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 998, codes
        assert "per node identity" in silent.details[(CONNECT, grpc.StatusCode.RESOURCE_EXHAUSTED)]
    finally:
        if silent is not None:
            silent.close()
        stop(*procs)
