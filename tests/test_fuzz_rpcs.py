"""Issue 10 acceptance: a bounded, fixed-seed fuzz of every RPC of every service, as real mTLS processes.

Three `shuffledp serve` processes (shuffler, analyzer, one client node) with certificates from `shuffledp pki init`.
Every method of proto/shuffledp/v1/shuffledp.proto (Analyzer, Shuffler, ClientNode) and the standard
grpc.health.v1.Health (Check, Watch) of each server gets, from a certificate of a role allowed to call it:
(a) raw garbage bytes, (b) valid messages with mutated fields (2^64-1, NaN/inf, empty/huge strings, random bytes,
unknown enum values; half of them a valid request with 1-3 fields changed), (c) bit-flipped serializations of such
messages; and the same kinds of bytes from roles that may NOT call it, which must be PERMISSION_DENIED whatever the
bytes (the role is checked before decoding).

Asserted, all reported together: every process is alive and answers a health check, and the node is still connected
to the shuffler; no Python traceback in any service log (an exception that escaped to a catch-all or to grpcio);
every status in ALLOWED, never UNKNOWN or INTERNAL, an undecodable request INVALID_ARGUMENT (or RESOURCE_EXHAUSTED
when over a size limit), a wrong role PERMISSION_DENIED, DEADLINE_EXCEEDED only where a call may wait, and the
service's own status reaching the caller; RSS growth per call in the measured batch under MAX_RSS_PER_CALL.
"""

from __future__ import annotations

import collections
import functools
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from _fuzz import Fuzzer, cpu_seconds, rss_bytes
from _procs import stop
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2

from shuffledp.config import DEFAULT_TOML
from shuffledp.mechanisms.pvec import PvecParams, pvec_params
from shuffledp.models import make_model
from shuffledp.security import pki
from shuffledp.transport import tls
from shuffledp.transport.spec_signing import SpecSigner
from shuffledp.v1 import shuffledp_pb2 as pb

SEED = 10  # issue 10; test input only (never privacy noise). Phase 1 uses SEED, phase 2 SEED + 1.
# Phase 1 (fuzz, and the warm-up of the memory reading): inputs of every kind, with huge fields and one oversized
# request per process. Phase 2 (the measured batch): the same generator with small fields only, so that RSS is not
# dominated by where the allocator happens to keep a few freed 256 KiB buffers (a per-call leak is what we look for).
# Calls per RPC: 3 kinds x PER_KIND from an allowed caller + 3 kinds x WRONG_PER_KIND from each wrong caller (<= 4):
# 240 in phase 1 and 210 in phase 2 per RPC with 3 wrong roles, ~7000 calls in all; ~25 s on 2 cores with start-up.
PER_KIND = 50
MEASURED_PER_KIND = 40
WRONG_PER_KIND = 10  # per wrong role and kind: the answer must not depend on the bytes, few are enough
STREAM_FACTOR = 0.5  # Subscribe/Watch wait up to STREAM_WAIT_S for an answer: fewer of them
RPC_TIMEOUT_S = 15.0  # unary calls; far above a loaded 2-core answer, so DEADLINE_EXCEEDED means a hang
ROUND_TIMEOUT_S = 2.0  # ExecuteRound: specs keep deadline_seconds <= ROUND_DEADLINE_S (or invalid)
ROUND_DEADLINE_S = 0.1
STREAM_WAIT_S = 0.15  # a stream with no answer within this is open (fine) and is cancelled
STARTUP_TIMEOUT_S = 60.0
HUGE = 256 * 1024  # phase 1: length of a "huge" string or bytes field
MAX_BYTES = 3 * 2**20  # phase 1: largest mutated message
MEASURED_HUGE = 2048  # phase 2
MEASURED_MAX_BYTES = 16 * 2**10
OVERSIZED = 5 * 2**20  # over gRPC's default 4 MiB receive limit; undecodable (field 1 then a zero tag)
# RSS growth bound over the measured batch, per call to the process measured (phase 2: 1230 calls to the shuffler,
# 1620 to the analyzer, 420 to the node). Measured on this tree (grpcio 1.85.3, 2 cores, seeds 11-17, idle
# before and after each process's window): shuffler -2.5 MiB to +0.8 MiB (<= 0.7 KiB/call), analyzer +8 KiB to
# +140 KiB (<= 0.09 KiB/call) when no new valid configuration is created, node 0 to +24 KiB (<= 0.06 KiB/call).
# 2 KiB per call (2.4 / 3.2 / 0.8 MiB) leaves ~3x for allocator noise; the bug of issue 10 (+19 KB per
# undecodable call, +18 KB per wrong-role CreateRun) is ~10x over it. (Each CreateRun of a configuration text not
# seen before adds ~240 KiB to the analyzer, never freed: with the ~20 such calls of phase 2 the analyzer is over.)
MAX_RSS_PER_CALL = 2 * 2**10

OK = grpc.StatusCode.OK
ALLOWED = frozenset(
    {
        OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
# gRPC's words when the status details (grpc-message) of an answer exceed the caller's 16 KiB metadata limit: the
# caller then sees RESOURCE_EXHAUSTED "Stream removed" instead of the service's status, which is not a clear status
METADATA_TOO_BIG = "metadata size exceeds"
# only these legitimately wait: a round collects until its deadline, a subscription until an invitation
MAY_WAIT = frozenset({"/shuffledp.v1.Shuffler/ExecuteRound", "/shuffledp.v1.Shuffler/Subscribe"})

SERVER_NAMES = ("shuffler", "analyzer", "client-0")  # processes, by certificate name
PARTIES = ("operator", "analyzer", "shuffler", "client-0", "client-1")  # callers, by certificate name


@dataclass(frozen=True)
class Rpc:
    server: str  # the process that serves it
    method: str  # "/pkg.Service/Method"
    request: type[Message]
    streaming: bool  # server streaming (Subscribe, Connect, Watch)
    right: str  # a caller allowed to call it (design section 1, tls.DEFAULT_POLICY)
    wrong: tuple[str, ...]  # callers that must get PERMISSION_DENIED
    client_streaming: bool = False  # Connect: the fuzzed request is the stream's one message, then it half-closes


def _rpcs() -> list[Rpc]:
    """Every method of the three services from the proto descriptors (a new RPC is fuzzed without edits here),
    with who may call it (design section 1), plus Health.Check (open to every role) and Health.Watch (refused to
    every role) on each server."""
    right = {
        "/shuffledp.v1.Analyzer/": "operator",
        "/shuffledp.v1.Shuffler/ExecuteRound": "analyzer",
        "/shuffledp.v1.Shuffler/GetPopulation": "analyzer",
        "/shuffledp.v1.Shuffler/FinishAggregation": "analyzer",
        "/shuffledp.v1.Shuffler/": "client-1",  # RegisterUsers, Subscribe, Submit: client nodes
        "/shuffledp.v1.ClientNode/": "operator",
    }
    server_of = {"Analyzer": "analyzer", "Shuffler": "shuffler", "ClientNode": "client-0"}
    out = []
    for svc in pb.DESCRIPTOR.services_by_name.values():
        for m in svc.methods:
            method = f"/{svc.full_name}/{m.name}"
            caller = right.get(method) or right[f"/{svc.full_name}/"]
            cls = getattr(pb, m.input_type.name)
            assert m.server_streaming or not m.client_streaming, "a client-streaming unary-response RPC: add it here"
            wrong = tuple(p for p in PARTIES if p != caller and _role(p) != _role(caller))
            out.append(Rpc(server_of[svc.name], method, cls, m.server_streaming, caller, wrong, m.client_streaming))
    for server in SERVER_NAMES:
        caller = "client-1" if server == "shuffler" else "operator"
        out.append(Rpc(server, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, False, caller, ()))
        # Watch is refused to every role (tls.DEFAULT_POLICY): no right caller
        out.append(Rpc(server, "/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest, True, "", PARTIES))
    return out


def _role(party: str) -> str:
    return pki.ROLE_CLIENT_NODE if party.startswith("client-") else party


@dataclass
class Outcome:
    rpc: Rpc
    caller: str
    kind: str
    data: bytes
    code: grpc.StatusCode
    details: str
    seconds: float


class Cluster:
    """The three services as `python -m shuffledp.cli serve ... --pki` processes, and a channel per caller."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.pki_dir = workdir / "pki"
        pki.init_pki(self.pki_dir, client_nodes=2)
        self.procs: dict[str, subprocess.Popen] = {}
        self.addr: dict[str, str] = {}
        self._channels: dict[tuple[str, str], grpc.Channel] = {}
        self._logs = []
        self.run_id = ""  # set by the fixture
        node_toml = workdir / "node.toml"
        node_toml.write_text("[data]\nmax_users = 50\n")  # small shard: quick start, quick rounds
        try:
            self._spawn("shuffler", ["shuffler", "--state-dir", str(workdir / "shuffler")])
            shuffler = self.addr["shuffler"]
            self._spawn("analyzer", ["analyzer", "--shuffler", shuffler, "--state-dir", str(workdir / "analyzer")])
            node = ["client", "--shuffler", shuffler, "--config", str(node_toml), "--node-index", "0"]
            self._spawn("client-0", [*node, "--state-dir", str(workdir / "client-0")])  # never the cwd's state/
        except BaseException:
            self.stop()  # no process outlives a failed start
            raise

    def _spawn(self, name: str, argv: list[str]) -> None:
        port_file = self.workdir / f"{name}.port"
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        cmd = [sys.executable, "-m", "shuffledp.cli", "serve", *argv, "--pki", str(self.pki_dir)]
        cmd += ["--listen", "127.0.0.1:0", "--port-file", str(port_file)]
        self.procs[name] = proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (status {proc.poll()}):\n{self.log_tail(name)}")
            time.sleep(0.05)
        self.addr[name] = f"127.0.0.1:{int(port_file.read_text())}"

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def channel(self, caller: str, server: str) -> grpc.Channel:
        key = (caller, server)
        if key not in self._channels:
            sec = tls.ChannelSecurity(self.pki_dir, _role(caller), caller)
            self._channels[key] = sec.channel(self.addr[server], server_name=server)
        return self._channels[key]

    def tracebacks(self) -> dict[str, collections.Counter[str]]:
        """Per process, the Python tracebacks in its log, counted by exception type and innermost frame (with the
        first message as an example): an exception that escaped to a catch-all, or to grpcio (which answers
        UNKNOWN), is a crash of that request."""
        out: dict[str, collections.Counter[str]] = {}
        for name in self.procs:
            lines = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
            examples: dict[str, str] = {}
            counts: collections.Counter[str] = collections.Counter()
            for i, line in enumerate(lines):
                if line.startswith("Traceback (most recent call last)"):
                    j = i + 1
                    while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                        j += 1
                    frames = [x.strip() for x in lines[i + 1 : j] if x.strip().startswith("File ")]
                    last = lines[j] if j < len(lines) else "?"
                    key = f"{last.split(':', 1)[0]} at {frames[-1] if frames else '?'}"
                    examples.setdefault(key, last)
                    counts[key] += 1
            if counts:
                out[name] = collections.Counter({f"{k}, e.g. {examples[k]!r}": n for k, n in counts.items()})
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Wait until no process uses CPU (< 20 ms in 250 ms), e.g. the node computing a fuzzed round."""
        end = time.monotonic() + timeout_s
        last = {n: cpu_seconds(p.pid) for n, p in self.procs.items()}
        while time.monotonic() < end:
            time.sleep(0.25)
            now = {n: cpu_seconds(p.pid) for n, p in self.procs.items()}
            if all(now[n] - last[n] < 0.02 for n in now):
                return
            last = now
        raise AssertionError(f"processes still busy after {timeout_s:.0f} s: {last}")

    def rss(self) -> dict[str, int]:
        """VmRSS of each process; 0 for one that exited (reported as dead, not as a memory figure)."""
        return {name: rss_bytes(p.pid) if p.poll() is None else 0 for name, p in self.procs.items()}

    def dead(self) -> dict[str, int]:
        return {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}

    def stop(self) -> None:
        for ch in self._channels.values():
            ch.close()
        stop(*self.procs.values())
        for log in self._logs:
            log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("fuzz"))
    try:
        # the node must be registered and subscribed, so that fuzzed rounds reach it (and it has to answer them)
        pop = pb.PopulationStatus()
        end = time.monotonic() + STARTUP_TIMEOUT_S
        get_pop = c.channel("analyzer", "shuffler").unary_unary(
            "/shuffledp.v1.Shuffler/GetPopulation", response_deserializer=pb.PopulationStatus.FromString
        )
        while time.monotonic() < end and pop.connected_nodes < 1:
            pop = get_pop(pb.PopulationRequest().SerializeToString(), timeout=RPC_TIMEOUT_S)
            time.sleep(0.1)
        assert pop.connected_nodes >= 1 and pop.admitted_users > 0, f"node not connected:\n{c.log_tail('client-0')}"
        # the node joins a valid round (its policy verifier warms up, ~3 s the first time): what a mutated round
        # reaches
        execute = c.channel("analyzer", "shuffler").unary_unary(
            "/shuffledp.v1.Shuffler/ExecuteRound", response_deserializer=pb.ShuffledBatch.FromString
        )
        # signed with the analyzer's key, as the node acts on nothing else (spec_signing); fuzzed rounds are not:
        # they reach the shuffler's checks and the node's signature check
        signed = pb.RoundSpec(signed=SpecSigner.from_pki(c.pki_dir).sign(_round_template(0, 0, deadline=30.0)))
        batch = execute(signed.SerializeToString(), timeout=60)
        assert batch.released and batch.report.contributors == 5, f"{batch.report}\n{c.log_tail('client-0')}"
        # a run that exists, so that RunRef inputs reach past NOT_FOUND; cancelled, so that a StartRun of it cannot
        # start a training loop in the background (FAILED_PRECONDITION)
        operator = c.channel("operator", "analyzer")
        create = operator.unary_unary("/shuffledp.v1.Analyzer/CreateRun", response_deserializer=pb.RunStatus.FromString)
        c.run_id = create(pb.CreateRunRequest(config_toml="").SerializeToString(), timeout=RPC_TIMEOUT_S).run_id
        cancel = operator.unary_unary("/shuffledp.v1.Analyzer/CancelRun", response_deserializer=pb.RunStatus.FromString)
        assert cancel(pb.RunRef(run_id=c.run_id).SerializeToString(), timeout=RPC_TIMEOUT_S).state == pb.CANCELLED
        yield c
    finally:
        c.stop()


def _call(ch: grpc.Channel, rpc: Rpc, data: bytes, may_stay_open: bool = True) -> tuple[grpc.StatusCode, str]:
    """Send raw request bytes (serializer None); the status, or OK for a stream still open after STREAM_WAIT_S.
    may_stay_open=False (a wrong role, undecodable bytes): a stream must end with a status, wait for it."""
    if not rpc.streaming:
        timeout = ROUND_TIMEOUT_S if rpc.method.endswith("/ExecuteRound") else RPC_TIMEOUT_S
        try:
            ch.unary_unary(rpc.method)(data, timeout=timeout)
            return OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    if rpc.client_streaming:
        call = ch.stream_stream(rpc.method)(iter([data]), timeout=RPC_TIMEOUT_S)
    else:
        call = ch.unary_stream(rpc.method)(data, timeout=RPC_TIMEOUT_S)
    if not may_stay_open:
        # a watchdog, should the stream outlive its own deadline: the test reports it instead of hanging
        watchdog = threading.Timer(RPC_TIMEOUT_S + 5.0, call.cancel)
        watchdog.start()
        try:
            for _ in call:
                pass
            return OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        finally:
            watchdog.cancel()
    timed_out = threading.Event()

    def give_up() -> None:
        timed_out.set()
        call.cancel()

    # cancel right away once the stream is open: a subscription or watch would otherwise wait forever
    timer = threading.Timer(STREAM_WAIT_S, give_up)
    timer.start()
    try:
        next(call)
        return OK, ""
    except StopIteration:
        return OK, ""
    except grpc.RpcError as exc:
        if timed_out.is_set() and exc.code() == grpc.StatusCode.CANCELLED:
            return OK, "open"
        return exc.code(), exc.details() or ""
    finally:
        timer.cancel()
        call.cancel()


def _decodes(cls: type[Message], data: bytes) -> bool:
    try:
        cls.FromString(data)
        return True
    except DecodeError:
        return False


def _inputs(fz: Fuzzer, rpc: Rpc, n: int, run_id: str) -> Iterator[tuple[str, bytes]]:
    """n inputs of each kind for `rpc`: garbage, mutated, bitflip."""
    for _ in range(n):
        yield "garbage", fz.garbage()
    for _ in range(n):
        yield "mutated", _mutated(fz, rpc, run_id).SerializeToString()
    for _ in range(n):
        yield "bitflip", fz.bitflip(_mutated(fz, rpc, run_id).SerializeToString())


@functools.cache
def _round_params() -> tuple[int, PvecParams]:
    d = make_model("logreg", 64, 10).dim
    return d, pvec_params(8.0, 1e-6, 5, d, 1.0)


def _round_template(run: int, round_index: int, deadline: float = ROUND_DEADLINE_S) -> pb.RoundSpec:
    """A COUNTS round the node joins: its logreg model on digits users (64 features, 10 classes), PVEC parameters
    of Thm 3.2 for eps = 8 at 5 contributors (its policy re-verifies them). A fresh run id, else the round exists."""
    d, params = _round_params()
    return pb.RoundSpec(
        run_id=f"fuzz-{run}",
        round=round_index,
        schedule=pb.SEQUENTIAL,
        trust_model=pb.SHUFFLE,
        transport=pb.COUNTS,
        randomizer=pb.RandomizerSpec(
            protocol="pvec", clip_norm=1.0, dim=d, g=params.g, m=params.m, p=params.p, messages_per_user=1
        ),
        model=pb.Tensor(shape=[d], f64=bytes(8 * d)),
        task="logreg",
        num_classes=10,
        cohort_size=5,
        min_contributors=5,
        deadline_seconds=deadline,
        per_user_cost=pb.PrivacyCost(eps=params.eps, delta=1e-6, accountant="fuzz", trust_model=pb.SHUFFLE),
        local_batch=1,
    )


def _template(cls: type[Message], fz: Fuzzer, run_id: str) -> Message | None:
    """A valid request of type `cls`, to mutate a few fields of: fuzzing from valid messages reaches the code past
    the first checks (a run that exists, a round the shuffler actually runs and the node answers)."""
    r = fz.rng
    if cls is pb.CreateRunRequest:
        # a valid configuration (all defaults, or the embedded default), made distinct by a comment
        return pb.CreateRunRequest(config_toml=f"# fuzz {r.randrange(10**9)}\n" + r.choice(["", DEFAULT_TOML]))
    if cls is pb.RunRef:
        return pb.RunRef(run_id=run_id)
    if cls is pb.PopulationRequest:
        return pb.PopulationRequest(run_id=run_id)
    if cls is pb.RoundSpec:
        return _round_template(r.randrange(10**9), r.randrange(100))
    # node methods: the caller's own certificate name (another node's is PERMISSION_DENIED, issue 10 item 1)
    if cls is pb.RegisterUsersRequest:
        return pb.RegisterUsersRequest(node_id="client-1", user_ids=["fuzz-u0", "fuzz-u1"])
    if cls is pb.SubscribeRequest:
        return pb.SubscribeRequest(node_id="client-1")
    if cls is pb.Contribution:
        msg = pb.UserMessage(user_id="fuzz-u0", nonce=r.randbytes(16), counts=pb.CountVector(packed=bytes(650)))
        return pb.Contribution(run_id=f"fuzz-{r.randrange(10**9)}", round=0, node_id="client-1", messages=[msg])
    if cls is pb.NodeMessage:  # Connect: its first message subscribes; a contribution first is refused
        if r.random() < 0.5:
            return pb.NodeMessage(subscribe=pb.SubscribeRequest(node_id="client-1"))
        return pb.NodeMessage(seq=1, contribution=_template(pb.Contribution, fz, run_id))
    if cls is health_pb2.HealthCheckRequest:
        return health_pb2.HealthCheckRequest(service=r.choice(["", "shuffledp.v1.Shuffler", "shuffledp.v1.ClientNode"]))
    return None  # e.g. NodeStatusRequest: no fields


def _mutated(fz: Fuzzer, rpc: Rpc, run_id: str) -> Message:
    template = _template(rpc.request, fz, run_id)
    if isinstance(template, pb.CreateRunRequest):
        # one field only: mutating it is a random string; so a third each: valid, random, a real configuration
        # with wrong values (reaches the validation)
        x = fz.rng.random()
        if x < 1 / 3:
            return template
        if x < 2 / 3:
            return pb.CreateRunRequest(config_toml=fz.toml(DEFAULT_TOML))
    msg = fz.message(rpc.request, template=template)
    if isinstance(msg, pb.RoundSpec) and 0 < msg.deadline_seconds <= 3600:
        msg.deadline_seconds = ROUND_DEADLINE_S  # a valid round must not hold the call for long
    return msg


def _run_batch(
    cluster: Cluster,
    fz: Fuzzer,
    rpcs: list[Rpc],
    per_kind: int,
    wrong_per_kind: int,
    oversized: bool,
    rss_by_method: dict[str, int] | None = None,
) -> list[Outcome]:
    """Each of `rpcs`: per_kind inputs of each kind from its right caller, wrong_per_kind from each wrong caller.
    rss_by_method, if given, gets each method's RSS change of its server (which method to look at first)."""
    out: list[Outcome] = []
    for rpc in rpcs:
        pid = cluster.procs[rpc.server].pid
        rss0 = rss_bytes(pid)
        n = max(1, int(per_kind * (STREAM_FACTOR if rpc.streaming else 1)))
        todo = [(rpc.right, kind, data) for kind, data in _inputs(fz, rpc, n, cluster.run_id)] if rpc.right else []
        if (
            oversized
            and rpc.right
            and not rpc.streaming
            and rpc.method.endswith(("/CreateRun", "/Submit", "/GetNodeStatus"))
        ):
            # one per process: undecodable and over any receive limit a service may set (4 MiB default)
            todo.append((rpc.right, "oversized", b"\x0a" + bytes(OVERSIZED)))
        for caller in rpc.wrong:
            todo += [(caller, kind, data) for kind, data in _inputs(fz, rpc, wrong_per_kind, cluster.run_id)]
        for caller, kind, data in todo:
            t0 = time.monotonic()
            may_stay_open = caller == rpc.right and _decodes(rpc.request, data)
            code, details = _call(cluster.channel(caller, rpc.server), rpc, data, may_stay_open)
            out.append(Outcome(rpc, caller, kind, data, code, details, time.monotonic() - t0))
        if rss_by_method is not None:
            key = f"{rpc.server}: {rpc.method}"
            rss_by_method[key] = rss_by_method.get(key, 0) + rss_bytes(pid) - rss0
    return out


def _problems(outcomes: list[Outcome]) -> list[str]:
    """Outcomes that break the contract, grouped (method, caller, kind, code) with one example each."""
    bad: dict[tuple[str, str, str, str], list[Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        r = o.rpc
        code = o.code.name
        if METADATA_TOO_BIG in o.details:
            # not the server's status: its details (echoing the request) were too long for the caller to read
            ok, code = False, f"{code} (client-side: {METADATA_TOO_BIG})"
        elif o.caller in r.wrong:
            ok = o.code == grpc.StatusCode.PERMISSION_DENIED
        elif not _decodes(r.request, o.data):
            ok = o.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
        else:
            ok = o.code in ALLOWED or (o.code == grpc.StatusCode.DEADLINE_EXCEEDED and r.method in MAY_WAIT)
        if not ok:
            bad[(r.method, o.caller, o.kind, code)].append(o)
    lines = []
    for (method, caller, kind, code), os_ in sorted(bad.items()):
        ex = min(os_, key=lambda o: len(o.data))
        lines.append(
            f"{method} as {caller}, {kind}: {code} x{len(os_)}; e.g. {len(ex.data)} bytes "
            f"{ex.data[:48].hex()}{'...' if len(ex.data) > 48 else ''} -> {ex.details[:200]!r}"
        )
    return lines


def _health(cluster: Cluster) -> dict[str, str]:
    """Health.Check("") of every server, SERVING or the error."""
    out = {}
    for server in SERVER_NAMES:
        ch = cluster.channel("operator", server)
        check = ch.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            status = check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S).status
            out[server] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as exc:
            out[server] = f"{exc.code().name}: {exc.details()}"
    return out


def _node_connected(cluster: Cluster, wait_s: float = 10.0) -> str:
    """The node's own health status of shuffledp.v1.ClientNode (SERVING = its shuffler stream is up); a reconnect
    with backoff may be under way after a fuzzed Subscribe, so wait a little for it."""
    check = cluster.channel("operator", "client-0").unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    end = time.monotonic() + wait_s
    while True:
        try:
            status = check(health_pb2.HealthCheckRequest(service="shuffledp.v1.ClientNode"), timeout=RPC_TIMEOUT_S)
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
        except grpc.RpcError as exc:
            name = f"{exc.code().name}: {exc.details()}"
        if name == "SERVING" or time.monotonic() > end:
            return name
        time.sleep(0.2)


def test_fuzz_every_rpc(cluster: Cluster) -> None:
    t0 = time.monotonic()
    # phase 1: the fuzz, and the warm-up of the memory reading (thread pools, caches, data set loads and allocator
    # arenas are in place after it)
    fz = Fuzzer(SEED, huge=HUGE, max_bytes=MAX_BYTES)
    fuzz = _run_batch(cluster, fz, _rpcs(), PER_KIND, WRONG_PER_KIND, oversized=True)
    # phase 2, the measured batch: one process at a time, RSS read when every process is idle before and after
    # its calls (a fuzzed round keeps the node computing for seconds after ExecuteRound returns: that is the
    # shuffler's window, and the node's own window starts when it is done)
    fz = Fuzzer(SEED + 1, huge=MEASURED_HUGE, max_bytes=MEASURED_MAX_BYTES)
    measured: list[Outcome] = []
    growth: dict[str, int] = {}
    by_method: dict[str, int] = {}
    side: dict[str, dict[str, int]] = {}  # growth of the other processes during a window (printed, not asserted)
    for server in SERVER_NAMES:
        cluster.wait_idle()
        before = cluster.rss()
        rpcs = [r for r in _rpcs() if r.server == server]
        measured += _run_batch(cluster, fz, rpcs, MEASURED_PER_KIND, WRONG_PER_KIND, False, by_method)
        cluster.wait_idle()
        after = cluster.rss()
        growth[server] = after[server] - before[server]
        side[server] = {s: after[s] - before[s] for s in SERVER_NAMES if s != server}

    calls = collections.Counter(o.rpc.server for o in measured)
    report = ", ".join(
        f"{s}: {growth[s] / 2**10:+.0f} KiB over {calls[s]} calls ({growth[s] / calls[s] / 1024:+.2f} KiB/call)"
        for s in SERVER_NAMES
    )
    codes = collections.Counter((o.rpc.method.rsplit("/", 1)[1], o.code.name) for o in fuzz + measured)
    slow = sorted(fuzz + measured, key=lambda o: -o.seconds)[:3]
    print(f"\nfuzz: {len(fuzz)} + {len(measured)} calls in {time.monotonic() - t0:.1f} s")
    print(f"fuzz RSS {dict((s, f'{v / 2**20:.0f} MiB') for s, v in cluster.rss().items())}; growth: {report}")
    others = {k: {s: v >> 10 for s, v in d.items()} for k, d in side.items()}
    print(f"fuzz RSS growth of the other processes in each window (KiB): {others}")
    print(f"fuzz codes: {dict(sorted(codes.items()))}")
    print("fuzz slowest: " + "; ".join(f"{o.rpc.method} {o.kind} {o.code.name} {o.seconds:.2f} s" for o in slow))

    # every check runs, so that one report shows every kind of failure
    failures = []
    if dead := cluster.dead():
        failures.append(f"processes died: {dead}\n" + "\n".join(cluster.log_tail(n) for n in dead))
    health = _health(cluster)
    if any(v != "SERVING" for v in health.values()):
        failures.append(f"health checks: {health}")
    if (node := _node_connected(cluster)) != "SERVING":
        failures.append(f"the node is not connected to the shuffler ({node}):\n{cluster.log_tail('client-0')}")
    for name, found in cluster.tracebacks().items():
        failures.append(f"exceptions in the log of {name}: " + "; ".join(f"{t} x{k}" for t, k in found.items()))
    if problems := _problems(fuzz + measured):
        failures.append(f"status codes outside the contract (seeds {SEED}, {SEED + 1}):\n" + "\n".join(problems))
    if over := {s: g for s, g in growth.items() if g >= MAX_RSS_PER_CALL * calls[s]}:
        top = sorted(by_method.items(), key=lambda kv: -kv[1])[:4]
        methods = ", ".join(f"{m} {g / 2**10:+.0f} KiB" for m, g in top)
        failures.append(
            f"RSS growth over {MAX_RSS_PER_CALL / 2**10:.0f} KiB per call in the measured batch ({sorted(over)}): "
            f"{report}; largest by method: {methods}"
        )
    assert not failures, "\n\n".join(failures)
