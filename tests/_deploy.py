"""Shared by the Docker deployment tests (test_docker_deploy.py: compose; test_swarm_deploy.py: Swarm): running
docker, whether an engine and the image are there, the example configuration, the trust-boundary probes and the
audit of an exported ledger."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from shuffledp.security import pki

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
EXAMPLE = DEPLOY / "example.toml"
IMAGE = "shuffledp:latest"  # one tag for both: the Swarm tests reuse what the compose tests built
BASE_IMAGE = "shuffledp-base:bookworm"
SERVICE_UID = 10001  # the image's user (deploy/Dockerfile)
BUILD_TIMEOUT_S = 900


def run_cmd(cmd: list[str], timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))[:300]} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def docker_json(*args: str) -> list[dict]:
    return json.loads(run_cmd(["docker", *args]).stdout)


def _exists(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=30).returncode == 0


def engine_unavailable(reuse_image: bool) -> str | None:
    """None when the docker CLI, a reachable engine and the image (or what building it needs) are there; else why
    not. reuse_image: an existing shuffledp:latest will do, else the test builds one."""
    if shutil.which("docker") is None:
        return "docker CLI not installed"
    try:
        info = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if info.returncode != 0 or not info.stdout.strip():
        first = (info.stderr.strip().splitlines() or ["no answer"])[0]
        return f"no Docker engine reachable ({first[:120]})"
    if not (reuse_image and _exists(IMAGE)) and not _exists(BASE_IMAGE) and os.geteuid() != 0:
        return f"{IMAGE} must be built, {BASE_IMAGE} is missing, and building it with debootstrap needs root"
    return None


def skip_module_if(why: str | None, tests: str) -> None:
    """Skip the whole calling test module, with one line saying why, if `why` is not None (call at import)."""
    if why:
        pytest.skip(f"{tests} need a Docker engine: {why}", allow_module_level=True)


def build_image(from_scratch: bool, extras: str = "") -> dict[str, int]:
    """shuffledp:latest from the working tree, offline (--network=none inside deploy/build_image.sh), and its build
    figures. from_scratch: a new debootstrap base and no build cache, unless SHUFFLEDP_TEST_REUSE_IMAGE=1 (for
    iterating on the tests only; CI builds). Otherwise an existing image is reused ({} then). extras: the project's
    optional dependencies too (build_image.sh --extras)."""
    reuse = not from_scratch or os.environ.get("SHUFFLEDP_TEST_REUSE_IMAGE") == "1"
    if reuse and _exists(IMAGE):
        return {}
    cmd = ["bash", str(DEPLOY / "build_image.sh"), "--tag", IMAGE] + (["--extras", extras] if extras else [])
    proc = run_cmd(cmd + (["--force-base", "--no-cache"] if from_scratch else []), timeout=BUILD_TIMEOUT_S)
    figures = {k: int(v) for k, v in re.findall(r"^(\w+)=(\d+)$", proc.stdout, flags=re.M)}
    print(f"\nimage build: {proc.stderr.strip().splitlines()[-1]}")
    assert figures["image_size_bytes"] > 0
    return figures


def config_text(**replace: str) -> str:
    """deploy/example.toml with some `key = value` lines replaced ([data] stays: the nodes' shards match)."""
    text = EXAMPLE.read_text()
    for key, value in replace.items():
        text, n = re.subn(rf"^{key}\s*=.*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, f"{key} not in {EXAMPLE}"
    return text


class Progress:
    """A background `swarm.sh run` (or compose.sh run), its output collected line by line."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self.times: list[float] = []  # seconds since the start, per line
        self._t0 = time.monotonic()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.times.append(time.monotonic() - self._t0)
            self.lines.append(line.rstrip("\n"))

    def rounds_shown(self) -> list[str]:
        return [line for line in self.lines if line.startswith("round ")]

    def wait_rounds(self, k: int, timeout: float = 180) -> None:
        self.wait_for(lambda: len(self.rounds_shown()) >= k, f"{k} rounds", timeout)

    def wait_for(self, done, what: str, timeout: float = 180) -> float:
        """Wait until done() while the run goes on; the seconds it took."""
        t0 = time.monotonic()
        while not done():
            assert self.proc.poll() is None, f"the run ended before {what}:\n" + "\n".join(self.lines)
            assert time.monotonic() < t0 + timeout, f"no {what} after {timeout} s:\n" + "\n".join(self.lines)
            time.sleep(0.1)
        return time.monotonic() - t0

    def finish(self, timeout: float = 300) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("the run did not end:\n" + "\n".join(self.lines[-40:])) from None
        self._reader.join(timeout=10)
        return rc

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


# ------------------------------------------------------------------------------------------------ the audit
def ledger_events(ledger: dict):
    """(the run's budget limit, the composition function, each round's privacy event) of an exported ledger."""
    from shuffledp.services.ledger import BudgetLimit, PrivacyEvent, compose_events

    limit = BudgetLimit(**ledger["run"]["limit"])
    return limit, compose_events, [PrivacyEvent(**r["event"]) for r in ledger["rounds"]]


def check_ledger(ledger: dict) -> None:
    """Each round once, in order, charged once: the totals recomputed from the exported events (an auditor's check)
    equal what the ledger reports, within the limit; no round is still only reserved."""
    rounds = ledger["rounds"]
    assert [r["round"] for r in rounds] == list(range(len(rounds))), "round indices not contiguous from 0"
    states = [r["state"] for r in rounds]
    assert set(states) <= {"committed", "spent_unknown", "released"}, states
    limit, compose_events, events = ledger_events(ledger)
    counted = [e for e, s in zip(events, states, strict=True) if s in ("committed", "spent_unknown")]
    eps, delta = compose_events(counted, limit)
    totals = ledger["totals"]
    assert totals["eps_spent"] == pytest.approx(eps, rel=1e-9, abs=1e-12)
    assert totals["delta_spent"] == pytest.approx(delta, rel=1e-9, abs=1e-15)
    assert totals["eps_spent"] <= limit.eps + 1e-12 and totals["delta_spent"] <= limit.delta + 1e-15
    assert totals["rounds_committed"] == states.count("committed")


# ------------------------------------------------------------------------------------------------ probes
# Runs inside a container: can it open a TCP connection to each host:port argument? In parallel: on an internal
# network a name Docker's DNS does not know takes ~10 s to fail (it asks outside).
CONNECT_PROBE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def probe(target):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        return "connected"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
with ThreadPoolExecutor(len(sys.argv) - 1) as pool:
    print(json.dumps(dict(zip(sys.argv[1:], pool.map(probe, sys.argv[1:])))))
"""

# The stranger: plain gRPC (no shuffledp.transport.tls helpers, which refuse to load bad material) trying each case of
# argv[1]
# with the material (party -> PEMs, as stranger_pems makes) from the file argv[2], else from stdin.
STRANGER_PROBE = """
import json, sys, grpc
from shuffledp.v1 import shuffledp_pb2 as pb, shuffledp_pb2_grpc as pbg
CALLS = {
    "analyzer.GetBudget": lambda ch: pbg.AnalyzerStub(ch).GetBudget(pb.RunRef(run_id="probe"), timeout=10),
    "shuffler.GetPopulation": lambda ch: pbg.ShufflerStub(ch).GetPopulation(pb.PopulationRequest(), timeout=10),
    "shuffler.RegisterUsers": lambda ch: pbg.ShufflerStub(ch).RegisterUsers(pb.RegisterUsersRequest(), timeout=10),
    # a node-scoped call naming client-1: only client-1's certificate may make it (issue 10 item 1)
    "shuffler.RegisterUsersAsClient1": lambda ch: pbg.ShufflerStub(ch).RegisterUsers(
        pb.RegisterUsersRequest(node_id="client-1"), timeout=10),
    "client.GetNodeStatus": lambda ch: pbg.ClientNodeStub(ch).GetNodeStatus(pb.NodeStatusRequest(), timeout=10),
}
material = json.load(open(sys.argv[2]) if len(sys.argv) > 2 else sys.stdin)
out = []
for case in json.loads(sys.argv[1]):
    root = material["ca"].encode()
    if case["party"] is None:
        creds = grpc.ssl_channel_credentials(root_certificates=root)
    else:
        p = material[case["party"]]
        creds = grpc.ssl_channel_credentials(root, p["key"].encode(), p["cert"].encode())
    opts = [("grpc.ssl_target_name_override", case["server_name"])]
    with grpc.secure_channel(case["target"], creds, options=opts) as ch:
        try:
            CALLS[case["call"]](ch)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
    out.append(dict(case, code=code))
print(json.dumps(out))
"""

# call -> (party with the right role, CA-signed parties of a wrong role)
ALLOWED = {
    "analyzer.GetBudget": ("operator", ["client-0", "shuffler", "analyzer"]),
    "shuffler.GetPopulation": ("analyzer", ["client-0", "operator"]),
    "shuffler.RegisterUsers": ("client-0", ["analyzer", "operator"]),
    "shuffler.RegisterUsersAsClient1": ("client-1", ["client-0", "analyzer", "operator"]),
    "client.GetNodeStatus": ("operator", ["client-1", "analyzer", "shuffler"]),
}


def stranger_pems(pki_dir: Path, workdir: Path) -> str:
    """PEMs a stranger might hold, as JSON: this CA's parties (of the wrong role for most calls), another CA's, and
    self-signed ones."""
    m: dict = {"ca": (pki_dir / pki.CA_CERT_FILE).read_text()}
    for party in ("analyzer", "shuffler", "client-0", "client-1", "operator"):
        m[party] = {k: (pki_dir / party / f).read_text() for k, f in (("cert", pki.CERT_FILE), ("key", pki.KEY_FILE))}
    other = workdir / "other-ca"
    pki.init_pki(other, client_nodes=1)
    for role, name in (("operator", "operator"), ("analyzer", "analyzer"), ("client-node", "client-0")):
        m[f"foreign-{name}"] = {
            k: (other / name / f).read_text() for k, f in (("cert", pki.CERT_FILE), ("key", pki.KEY_FILE))
        }
        cert, key = pki.self_signed_cert(role, name)
        m[f"selfsigned-{name}"] = {"cert": pki.cert_pem(cert).decode(), "key": pki.key_pem(key).decode()}
    return json.dumps(m)


def stranger_cases(call: str, target: str, server_name: str) -> list[dict]:
    """The allowed role (positive control) and the four ways a stranger must be refused."""
    right, wrong = ALLOWED[call]
    twin = {"operator": "operator", "analyzer": "analyzer"}.get(right, "client-0")  # self-signed / foreign twin
    base = {"call": call, "target": target, "server_name": server_name}
    return [
        dict(base, party=right, expect="allowed"),
        dict(base, party=None, expect="UNAVAILABLE"),  # no client certificate: handshake refused
        dict(base, party=f"selfsigned-{twin}", expect="UNAVAILABLE"),
        dict(base, party=f"foreign-{twin}", expect="UNAVAILABLE"),
        *(dict(base, party=w, expect="PERMISSION_DENIED") for w in wrong),
    ]


def assert_refusals(results: list[dict]) -> None:
    bad = []
    for r in results:
        if r["expect"] == "allowed":
            # the right role passes authorization (the call itself may still fail on its argument)
            ok = r["code"] not in ("UNAVAILABLE", "PERMISSION_DENIED", "UNAUTHENTICATED", "DEADLINE_EXCEEDED")
        else:
            ok = r["code"] == r["expect"]
        if not ok:
            bad.append(f"{r['call']} at {r['target']} by {r['party']}: got {r['code']}, expected {r['expect']}")
    assert not bad, "\n".join(bad)


def end_runs(procs: list[subprocess.Popen], timeout: float) -> None:
    """Terminate background runs a failed test left behind (SIGTERM reaches their operator container, which would
    otherwise hold operator-net and keep the stack's `down` from removing it)."""
    for proc in procs:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)


def free_port() -> int:
    """A TCP port free on the host's loopback now (for a published port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ Prometheus
def prometheus_query(port: int, promql: str) -> list[dict]:
    """The result of an instant query of the Prometheus published on 127.0.0.1:port (its HTTP API)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def prometheus_wait(port: int, promql: str, want: int = 1, timeout: float = 90) -> list[dict]:
    """Prometheus's answer to `promql` once it has at least `want` series (it scrapes every 5 s)."""
    deadline, got = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            got = prometheus_query(port, promql)
            if len(got) >= want:
                return got
        time.sleep(2)
    raise AssertionError(f"Prometheus has no {want} series for {promql} after {timeout} s: {got}")
