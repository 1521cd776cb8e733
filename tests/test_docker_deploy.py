"""The docker compose deployment (issue 5): image built offline, trust boundaries checked on running containers.

One deployment (unique compose project name, its own PKI and host port) is brought up by deploy/compose.sh for the
whole module and torn down with its volumes at the end, also when a test fails. What is checked is what the
containers can actually do and what the analyzer actually stored, not what the code intends:

- the image has the Prio3 binding (shuffledp_prio, built on the host where cargo exists) and runs it;
- the analyzer container cannot open a connection to any client node (by name or by address), the shuffler can;
- no certificate, a self-signed one, one from another CA, or a CA-signed one of the wrong role is refused by every
  service (from the host for the published analyzer port, from a helper container on the internal networks for
  the others), while the right certificate gets through (so a refusal is not a typo in the address);
- a short PSGD run completes through `shuffledp run --analyzer ... --pki ...` and its results are fetched;
- the analyzer's ledger, exported results and logs contain no user id and no client address, although the same
  search finds the user ids in the shuffler's participation record;
- a client container stopped mid-round: the round ends at its deadline with the contributors actually received
  (checked against the shuffler's record of whom it invited), and the ledger stays consistent;
- the analyzer container killed mid-round and started again resumes the run; the round in flight is charged;
- `down` then `up` keeps the ledger and the participation record (named volumes): old results still fetchable.

Without a reachable engine (or compose tool) the whole module is skipped with one line saying why.
SHUFFLEDP_TEST_REUSE_IMAGE=1 reuses an existing shuffledp:latest instead of building (iterating on the tests).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import _deploy as common
import grpc
import numpy as np
import pytest
from _deploy import IMAGE, SERVICE_UID, run_cmd

COMPOSE_SH = common.DEPLOY / "compose.sh"
USER_ID_RE = re.compile(rb"n\d+-u\d+")  # shuffledp.data.user_shard ids: "n{node}-u{j}"
NODE_ID_RE = re.compile(rb"client-\d+")  # client node ids (a node's id is its certificate name, client-<index>)
UP_TIMEOUT_S = 240  # compose.sh up: until every container is healthy
DEPLOY_TIMEOUT_S = 900  # per test, including the module's image build and compose up on a loaded 2-core machine


def _unavailable() -> str | None:
    """None when a Docker engine, a compose tool and what the image build needs are there; else why not."""
    if why := common.engine_unavailable(reuse_image=False):
        return why
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
    if not v2 and shutil.which("docker-compose") is None:
        return "neither 'docker compose' nor 'docker-compose' is installed"
    return None


common.skip_module_if(_unavailable(), "docker deployment tests")
pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def image() -> dict[str, int]:
    """shuffledp:latest built from scratch from the working tree (new base, no cache, host-built wheels, offline),
    with the mf extra (jax_privacy) so that this one deployment runs every protocol."""
    return common.build_image(from_scratch=True, extras="mf")


# the Prio3 binding's round trip in the image's Python: two reports sharded, verified by both Aggregators, summed
PRIO3_ROUND_TRIP = """
import os
import shuffledp_prio as prio
v = prio.Prio3SumVec(length=3, max_measurement=5)
key, outs = os.urandom(32), [[], []]
for m in ([1, 2, 3], [5, 0, 4]):
    nonce = os.urandom(16)
    public, *shares = v.shard(m, nonce)
    states, ps = zip(*(v.prepare_init(key, i, nonce, public, s) for i, s in enumerate(shares)))
    msg = v.prep_shares_to_prep(list(ps))
    for i, st in enumerate(states):
        outs[i].append(v.prepare_next(st, msg))
print(*v.unshard([v.aggregate(o) for o in outs], 2))
"""


def test_the_image_has_the_prio3_binding_where_the_host_builds_it(image: dict[str, int]):
    """deploy/build_image.sh builds native/'s wheel on the host where cargo exists (issue 45) and the image installs
    it offline: `import shuffledp_prio` works in the image's own Python (the base's CPython and glibc, not the host's)
    and the crate verifies and sums two reports there. Without cargo the image is built without it (one line)."""
    if shutil.which("cargo") is None:
        pytest.skip("no Rust toolchain (cargo) on this host: build_image.sh builds the image without shuffledp_prio")
    if image:  # built by this module (not an image reused with SHUFFLEDP_TEST_REUSE_IMAGE=1)
        assert image["prio3_binding"] == 1
    run = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", IMAGE, "-c"]
    assert run_cmd([*run, "import shuffledp_prio"], timeout=60).returncode == 0
    assert run_cmd([*run, PRIO3_ROUND_TRIP], timeout=60).stdout.split() == ["6", "2", "7"]


@dataclass
class Deployment:
    project: str
    pki: Path
    port: int
    config: Path
    workdir: Path

    @property
    def analyzer(self) -> str:
        return f"127.0.0.1:{self.port}"

    def sh(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """deploy/compose.sh with this deployment's project, PKI, port and configuration."""
        cmd = ["bash", str(COMPOSE_SH), "--project", self.project, "--pki", str(self.pki), "--port", str(self.port)]
        cmd += ["--config", str(self.config), "--timeout", str(UP_TIMEOUT_S)]
        return run_cmd([*cmd, *args], timeout=timeout, check=check)

    def cid(self, service: str) -> str:
        """Container id of `service` (running or not), found by the labels both compose versions set."""
        labels = [f"label=com.docker.compose.project={self.project}", f"label=com.docker.compose.service={service}"]
        out = run_cmd(["docker", "ps", "-aq", "--filter", labels[0], "--filter", labels[1]]).stdout.split()
        assert len(out) == 1, f"expected one container for {service}, found {out}"
        return out[0]

    def exec_python(self, service: str, script: str, *args: str, timeout: float = 60) -> str:
        return run_cmd(["docker", "exec", self.cid(service), "python", "-c", script, *args], timeout=timeout).stdout

    def ip(self, service: str, network: str) -> str:
        fmt = f'{{{{(index .NetworkSettings.Networks "{self.project}_{network}").IPAddress}}}}'
        return run_cmd(["docker", "inspect", "--format", fmt, self.cid(service)]).stdout.strip()

    def logs(self, service: str = "", tail: int = 60) -> str:
        args = ["compose", "logs", "--no-color", f"--tail={tail}"] + ([service] if service else [])
        return self.sh(*args, check=False).stdout

    def read_volume(self, service: str, path: str) -> dict[str, bytes]:
        """Every file under `path` in the container (docker cp as a tar stream): name -> bytes."""
        raw = subprocess.run(["docker", "cp", f"{self.cid(service)}:{path}", "-"], capture_output=True, timeout=60)
        assert raw.returncode == 0, raw.stderr.decode(errors="replace")
        out = {}
        with tarfile.open(fileobj=io.BytesIO(raw.stdout)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    out[member.name] = tar.extractfile(member).read()
        return out


@pytest.fixture(scope="module")
def deployment(image, tmp_path_factory: pytest.TempPathFactory):
    """deploy/compose.sh up with a unique project name; always `down --volumes` afterwards."""
    work = tmp_path_factory.mktemp("deploy")
    dep = Deployment(
        project=f"sdptest{os.getpid()}{int(time.time()) % 100000}",
        pki=work / "pki",
        port=common.free_port(),
        config=work / "config.toml",
        workdir=work,
    )
    shutil.copy(common.EXAMPLE, dep.config)
    try:
        dep.sh("up", timeout=UP_TIMEOUT_S + 200)
        yield dep
    finally:
        with contextlib.suppress(Exception):
            dep.sh("down", "--volumes", timeout=180, check=False)
        # the generated override (more than two clients) and nothing else of ours stays behind
        (common.DEPLOY / ".build" / f"clients.{dep.project}.yml").unlink(missing_ok=True)
        label = f"label=com.docker.compose.project={dep.project}"
        for kind in ("container", "volume", "network"):
            left = run_cmd(["docker", kind, "ls", "-q", "--filter", label] + (["-a"] if kind == "container" else []))
            assert not left.stdout.strip(), f"{kind}s of {dep.project} left behind: {left.stdout.split()}"


class Operator:
    """The operator's API client (mTLS with the operator certificate), reconnecting across analyzer restarts."""

    def __init__(self, dep: Deployment):
        from shuffledp.cli.run import operator_channel

        self.dep = dep
        self._open = lambda: operator_channel(dep.analyzer, dep.pki)
        self.channel = self._open()

    def call(self, method: str, request, timeout: float = 30, retry_for: float = 120):
        from shuffledp.v1 import shuffledp_pb2_grpc as pbg

        deadline = time.monotonic() + retry_for
        while True:
            try:
                return getattr(pbg.AnalyzerStub(self.channel), method)(request, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                self.channel.close()
                time.sleep(1.0)
                self.channel = self._open()

    def start(self, config_toml: str) -> str:
        from shuffledp.v1 import shuffledp_pb2 as pb

        run_id = self.call("CreateRun", pb.CreateRunRequest(config_toml=config_toml), timeout=60).run_id
        self.call("StartRun", pb.RunRef(run_id=run_id))
        return run_id

    def status(self, run_id: str):
        from shuffledp.v1 import shuffledp_pb2 as pb

        return self.call("GetRunStatus", pb.RunRef(run_id=run_id))

    def wait(self, run_id: str, timeout: float = 240):
        from shuffledp.cli.run import TERMINAL

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status(run_id)
            if st.state in TERMINAL:
                return st
            time.sleep(0.5)
        raise AssertionError(f"run {run_id} not finished after {timeout} s:\n{self.dep.logs('analyzer')}")

    def result(self, run_id: str):
        from shuffledp.v1 import shuffledp_pb2 as pb

        return self.call("GetRunResult", pb.RunRef(run_id=run_id), timeout=60)


_RESERVED_ROUNDS = """
import json, sqlite3, sys
db = sqlite3.connect("/var/lib/shuffledp/state/ledger.sqlite")
print(json.dumps(db.execute("SELECT round, state FROM rounds WHERE run_id=?", (sys.argv[1],)).fetchall()))
"""


def _wait_in_flight(dep: Deployment, op: Operator, run_id: str, min_done: int, timeout: float = 120) -> int:
    """Wait until rounds 0..k-1 (k >= min_done) are closed and round k is reserved (its cost counted, not closed);
    returns k. The analyzer's ledger's own word, read in its container: not the status' eps_reserved > eps_spent,
    which a reserved round need not make true (parallel composition: a round reserved at the cost round 0
    committed with leaves the max as it is; the stop CI's failure), nor a guess from how long no round has ended."""
    from shuffledp.v1 import shuffledp_pb2 as pb

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = op.status(run_id)
        assert st.state in (pb.CREATED, pb.RUNNING), f"run ended early: {pb.RunState.Name(st.state)} {st.message}"
        rounds = dict(json.loads(dep.exec_python("analyzer", _RESERVED_ROUNDS, run_id)))
        reserved = [r for r, state in rounds.items() if state == "reserved"]
        if reserved and reserved[0] >= min_done and all(rounds[r] != "reserved" for r in range(reserved[0])):
            return reserved[0]
        time.sleep(0.1)
    raise AssertionError(f"run {run_id}: no round in flight after {min_done} done")


def _check_ledger_consistent(ledger_json: str, status) -> dict:
    """The exported ledger agrees with itself (check_ledger) and with the run's metrics; returns it parsed."""
    ledger = json.loads(ledger_json)
    common.check_ledger(ledger)
    assert status.budget.eps_spent == pytest.approx(ledger["totals"]["eps_spent"], rel=1e-9, abs=1e-12)
    # every committed round is charged for the contributors its released batch really had
    by_round = {m.round: m for m in status.metrics}
    for r in ledger["rounds"]:
        m = by_round.get(r["round"])
        if r["state"] == "committed":
            assert m is not None and m.released, f"committed round {r['round']} has no released metrics"
            assert r["contributors"] == m.contributors == r["event"]["contributors"]
        elif r["state"] == "released":
            assert m is None or not m.released
    return ledger


# ------------------------------------------------------------------------------------------------ deployment tests
@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_topology_networks_ports_and_mounts(deployment: Deployment):
    """Networks, published port and certificate mounts are what the trust model needs."""
    dep = deployment
    services = ["analyzer", "shuffler", "client-0", "client-1"]
    nets, mounts = {}, {}
    for svc in services:
        info = json.loads(run_cmd(["docker", "inspect", dep.cid(svc)]).stdout)[0]
        assert info["State"]["Health"]["Status"] == "healthy", f"{svc}: {info['State']['Health']}"
        assert info["Config"]["User"] == f"{SERVICE_UID}:{SERVICE_UID}", f"{svc} does not run as the service user"
        assert info["HostConfig"]["ReadonlyRootfs"] is True
        nets[svc] = {n.removeprefix(f"{dep.project}_") for n in info["NetworkSettings"]["Networks"]}
        mounts[svc] = {m["Destination"]: m for m in info["Mounts"]}
        if svc == "analyzer":
            bindings = info["HostConfig"]["PortBindings"]["50051/tcp"]
            assert [b["HostIp"] for b in bindings] == ["127.0.0.1"], f"analyzer published beyond loopback: {bindings}"
        else:
            assert not info["HostConfig"]["PortBindings"], (
                f"{svc} publishes ports: {info['HostConfig']['PortBindings']}"
            )
    assert nets == {
        "analyzer": {"analyzer-net", "operator-net"},
        "shuffler": {"analyzer-net", "client-net"},
        "client-0": {"client-net"},
        "client-1": {"client-net"},
    }
    for net, internal in (("analyzer-net", True), ("client-net", True), ("operator-net", False)):
        info = json.loads(run_cmd(["docker", "network", "inspect", f"{dep.project}_{net}"]).stdout)[0]
        assert info["Internal"] is internal, f"{net}: Internal={info['Internal']}"
    for svc in services:
        pki_mounts = {d: m for d, m in mounts[svc].items() if d.startswith("/pki")}
        # only the trust anchor and the container's own certificate directory, read-only; never ca/ or operator/;
        # the shuffler also the directory compose.sh publishes the revocation list in (only crl.pem: never the PKI's)
        crl = {"/pki-crl"} if svc == "shuffler" else set()
        assert set(pki_mounts) == {"/pki/ca.crt", f"/pki/{svc}", *crl}, f"{svc} mounts {sorted(pki_mounts)}"
        assert all(not m["RW"] for m in pki_mounts.values())
        assert Path(pki_mounts[f"/pki/{svc}"]["Source"]) == dep.pki / svc
    assert Path(mounts["shuffler"]["/pki-crl"]["Source"]) == dep.pki / "crl"
    assert sorted(os.listdir(dep.pki / "crl")) == ["crl.pem"]
    assert (dep.pki / "crl" / "crl.pem").read_bytes() == (dep.pki / "crl.pem").read_bytes()
    # the ONE configuration file, mounted read-only into the client nodes
    for svc in ("client-0", "client-1"):
        cfg = mounts[svc]["/etc/shuffledp/config.toml"]
        assert Path(cfg["Source"]) == dep.config and not cfg["RW"]


@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_analyzer_has_no_route_to_any_client(deployment: Deployment):
    dep = deployment
    targets = []
    for i in range(2):
        # by service name (DNS) and by the node's address on client-net (routing, not just name resolution)
        targets += [f"client-{i}:50053", f"{dep.ip(f'client-{i}', 'client-net')}:50053"]
    from_analyzer = json.loads(dep.exec_python("analyzer", common.CONNECT_PROBE, *targets, "shuffler:50052"))
    from_shuffler = json.loads(dep.exec_python("shuffler", common.CONNECT_PROBE, *targets))
    # controls: the probe works, the clients do listen, and the analyzer does reach its one peer
    assert from_shuffler == {t: "connected" for t in targets}, from_shuffler
    assert from_analyzer.pop("shuffler:50052") == "connected"
    for target, outcome in from_analyzer.items():
        assert outcome != "connected", f"the analyzer reached {target}"


@pytest.fixture(scope="module")
def stranger_material(deployment: Deployment) -> Path:
    """Certificates a stranger might hold (none, self-signed, another CA's, this CA's of the wrong role), as a file."""
    m = deployment.workdir / "stranger.json"
    m.write_text(common.stranger_pems(deployment.pki, deployment.workdir))
    return m


@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_strangers_are_refused_by_every_service(deployment: Deployment, stranger_material: Path):
    dep = deployment
    # from the host: the analyzer's published port
    host_cases = common.stranger_cases("analyzer.GetBudget", dep.analyzer, "analyzer")
    proc = run_cmd([sys.executable, "-c", common.STRANGER_PROBE, json.dumps(host_cases), str(stranger_material)])
    host_results = json.loads(proc.stdout)
    # from a helper container attached to both internal networks: shuffler, both client nodes, analyzer
    cases = common.stranger_cases("analyzer.GetBudget", "analyzer:50051", "analyzer")
    for call in ("shuffler.GetPopulation", "shuffler.RegisterUsers", "shuffler.RegisterUsersAsClient1"):
        cases += common.stranger_cases(call, "shuffler:50052", "shuffler")
    for i in range(2):
        cases += common.stranger_cases("client.GetNodeStatus", f"client-{i}:50053", f"client-{i}")
    name = f"{dep.project}-stranger"
    run_cmd(
        ["docker", "create", "--name", name, "--user", "0", "--network", f"{dep.project}_client-net"]
        + ["-v", f"{stranger_material}:/m.json:ro", "--entrypoint", "python", IMAGE, "-c", common.STRANGER_PROBE]
        + [json.dumps(cases), "/m.json"]
    )
    try:
        run_cmd(["docker", "network", "connect", f"{dep.project}_analyzer-net", name])
        proc = run_cmd(["docker", "start", "-a", name], timeout=180)
    finally:
        run_cmd(["docker", "rm", "-f", "-v", name], check=False)  # -v: its anonymous /results volume
    inside_results = json.loads(proc.stdout)
    assert len(inside_results) == len(cases) and len(host_results) == len(host_cases)
    common.assert_refusals(host_results + inside_results)


@pytest.fixture(scope="module")
def finished_run(deployment: Deployment) -> tuple[subprocess.CompletedProcess, Path]:
    """The example PSGD experiment, driven as the operator through deploy/compose.sh run (shuffledp run)."""
    out = deployment.workdir / "results"
    proc = deployment.sh("run", str(deployment.config), "--out", str(out), timeout=400, check=False)
    return proc, out


@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_psgd_experiment_runs_to_completion_and_results_are_fetched(deployment: Deployment, finished_run):
    proc, out = finished_run
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{deployment.logs()}"
    assert "state: COMPLETED" in proc.stdout
    progress = [line for line in proc.stdout.splitlines() if line.lstrip().startswith("round")]
    assert len(progress) >= 2, proc.stdout  # progress was shown per round
    for f in ("config.toml", "metrics.csv", "metrics.json", "ledger.json", "model.npz"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f"results lack {f}"
    metrics = json.loads((out / "metrics.json").read_text())
    released = [m for m in metrics if m["released"]]
    assert len(released) >= 2
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["run"]["state"] == "COMPLETED"
    assert f"run id: {ledger['run']['run_id']}" in proc.stdout  # what `compose.sh results RUN_ID` needs
    assert ledger["totals"]["eps_spent"] <= 8.0 and ledger["totals"]["delta_spent"] <= ledger["run"]["limit"]["delta"]
    # the model learned something: better than the 10-class chance level (0.1) on the held-out split
    assert released[-1]["accuracy"] > 0.3, metrics


@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_mf_run_completes_and_charges_what_shuffledp_account_says(deployment: Deployment):
    """Matrix-factorization DP-FTRL (issue 27) over the containers: the analyzer plans C with jax_privacy inside its
    image, the nodes verify from the spec alone, and the ledger's eps is `shuffledp account mf`'s to 1e-9."""
    from shuffledp import cli

    # a node verifies its first mf spec after importing that protocol's accountant (dp_accounting, scipy): seconds
    # on a loaded machine, beyond the example's 8 s deadline, which then releases round 0 with no one
    text = common.config_text(
        protocol='"mf"',
        kind='"subsampled"\nrounds = 12\nlearning_rate = 4.0',
        mode='"sealed"',
        round_deadline_seconds="60.0",
    )
    text = re.sub(r"^\[privacy\.pvec\]\ncalibration.*\n", '[privacy.mf]\nstrategy = "banded"\n', text, flags=re.M)
    cfg = deployment.workdir / "mf.toml"
    cfg.write_text(text)
    out = deployment.workdir / "mf-results"
    proc = deployment.sh("run", str(cfg), "--out", str(out), timeout=600, check=False)
    assert proc.returncode == 0 and "state: COMPLETED" in proc.stdout, f"{proc.stdout}\n{proc.stderr}"
    ledger = json.loads((out / "ledger.json").read_text())
    plan, totals = ledger["run"]["plan"], ledger["totals"]
    assert plan["protocol"] == "mf" and totals["trust_model"] == "central"
    rounds = [(r["round"], r["state"], r["contributors"], r["reason"]) for r in ledger["rounds"]]
    assert [r[1] for r in rounds] == ["committed"] * 12, f"{rounds}\n{proc.stdout}\n{deployment.logs()}"
    delta = ledger["run"]["limit"]["delta"]
    argv = ["account", "mf", "--rounds", "12", "--eps", "8", "--delta", repr(delta), "--min-noise", "--json"]
    capture = io.StringIO()
    with contextlib.redirect_stdout(capture):
        assert cli.main(argv) == 0
    answer = json.loads(capture.getvalue())
    assert answer["noise_multiplier"] == plan["params"]["noise_multiplier"]
    assert abs(answer["eps"] - totals["eps_spent"]) <= 1e-9 and totals["eps_spent"] <= 8.0
    assert json.loads((out / "metrics.json").read_text())[-1]["accuracy"] > 0.3  # chance is 0.1


@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_analyzer_restart_resumes_the_run(deployment: Deployment):
    from shuffledp.v1 import shuffledp_pb2 as pb

    dep = deployment
    op = Operator(dep)
    client1 = dep.cid("client-1")
    # Rounds take milliseconds, so a kill "mid-round" is arranged: client-1 is frozen (its stream stays open, so
    # it is still invited), every round then lasts until its deadline. Round 0 is released with client-0's half
    # (threshold 30%), and the analyzer is killed inside round 1.
    run_cmd(["docker", "pause", client1])
    try:
        run_id = op.start(common.config_text(min_contributors_fraction="0.3"))
        in_flight = _wait_in_flight(dep, op, run_id, min_done=1)
        run_cmd(["docker", "kill", dep.cid("analyzer")])  # a crash: SIGKILL with round 1 in flight (~4 s long)
    finally:
        run_cmd(["docker", "unpause", client1], check=False)
    run_cmd(["docker", "start", dep.cid("analyzer")])
    final = op.wait(run_id)
    result = op.result(run_id)
    assert final.state == pb.COMPLETED, f"{pb.RunState.Name(final.state)} {final.message}\n{dep.logs('analyzer')}"
    ledger = _check_ledger_consistent(result.ledger_json, final)
    states = {r["round"]: r["state"] for r in ledger["rounds"]}
    assert in_flight >= 1  # rounds 0..in_flight-1 were closed before the kill
    assert states[in_flight] == "spent_unknown", states  # charged at its reserved cost, never released
    assert all(states[r] == "committed" for r in range(in_flight)), states  # kept across the crash
    after = [r for r in states if r > in_flight]
    assert after and all(states[r] == "committed" for r in after), f"the run did not continue: {states}"
    assert len(states) == ledger["run"]["plan"]["rounds"]  # no round index reused or skipped
    # metrics from before the crash were kept, and rounds continued with new indices
    rounds = [m.round for m in final.metrics if m.round >= 0]
    assert len(rounds) == len(set(rounds)) and rounds == sorted(rounds)
    assert set(range(in_flight)) <= set(rounds) and in_flight not in rounds and max(rounds) > in_flight
    assert final.budget.eps_spent <= final.budget.eps_limit


@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_client_stopped_mid_round_ends_round_at_deadline(deployment: Deployment):
    from shuffledp.v1 import shuffledp_pb2 as pb

    dep = deployment
    op = Operator(dep)
    deadline_s = float(re.search(r"^round_deadline_seconds\s*=\s*([0-9.]+)", common.EXAMPLE.read_text(), re.M).group(1))
    # threshold 30% of the cohort: the half of round 0 that client-0 holds is enough to release
    # client-1 is gone for good: once client-0's fresh users are fewer than a cohort, the run waits once for the
    # lost node's (population_wait_seconds: 10 s here, not the example's 60), then completes
    text = common.config_text(min_contributors_fraction="0.3", population_wait_seconds="10.0")
    client1 = dep.cid("client-1")
    # frozen first so that the stop lands inside round 0 (client-1's invitees have not answered yet), then
    # stopped hard, as a crashed or unplugged node
    run_cmd(["docker", "pause", client1])
    try:
        run_id = op.start(text)
        _wait_invited(dep, run_id)
        time.sleep(1.0)
        # SIGKILL: a graceful stop (SIGTERM) would let the node finish and send the answers it is computing
        run_cmd(["docker", "kill", client1], timeout=60)
    except BaseException:
        run_cmd(["docker", "unpause", client1], check=False)
        raise
    final = op.wait(run_id)
    result = op.result(run_id)
    assert final.state == pb.COMPLETED, f"{pb.RunState.Name(final.state)} {final.message}\n{dep.logs('analyzer')}"
    ledger = _check_ledger_consistent(result.ledger_json, final)
    plan = ledger["run"]["plan"]
    m0 = next(m for m in final.metrics if m.round == 0)
    # whom the shuffler invited to round 0, per node (its own participation record): client-0 answered, client-1
    # was stopped, so the contributors actually received are exactly client-0's invitees
    invited = _invited_by_node(dep, run_id, 0)
    assert set(invited) == {"n0", "n1"} and sum(invited.values()) == plan["cohort"], invited
    assert m0.contributors == invited["n0"], (m0.contributors, invited)
    # check-in rounds (calibrated PVEC's default): client-1's users never check in, so the round waits out the
    # check-in window (half the deadline), then only for the users who checked in, all of them client-0's
    assert m0.checked_in == invited["n0"], (m0.checked_in, invited)
    assert m0.seconds >= deadline_s / 2 - 0.5, f"round 0 ended after {m0.seconds:.2f} s, before its check-in window"
    assert m0.released == (m0.contributors >= plan["min_contributors"])
    assert m0.released  # 30% threshold and half the cohort on client-0: released with n' < cohort
    r0 = ledger["rounds"][0]
    assert r0["state"] == "committed" and r0["contributors"] == invited["n0"]
    # later rounds only invite users of nodes still connected: nothing waits for client-1 again
    later = [m for m in final.metrics if m.round >= 1]
    full = [m for m in later if m.released]
    assert full and all(m.contributors == plan["cohort"] and m.seconds < deadline_s for m in full), later
    # client-0's users left after round 0 make floor(left / cohort) full rounds; then the shuffler has no fresh
    # cohort, refuses the spec, the round is released in the ledger (costs nothing) and the run completes
    users_node0 = -(-plan["admitted"] // 2)  # user j lives on node j mod 2 (shuffledp.data.user_shard)
    assert len(full) == (users_node0 - invited["n0"]) // plan["cohort"]
    for m in later[len(full) :]:
        assert not m.released and ledger["rounds"][m.round]["state"] == "released"
    run_cmd(["docker", "start", client1])


def _participation(dep: Deployment, run_id: str) -> list[tuple[str, int]]:
    script = (
        "import json, sqlite3, sys; db = sqlite3.connect('file:/var/lib/shuffledp/state/shuffler.sqlite?mode=ro',"
        " uri=True); print(json.dumps(db.execute('SELECT user_id, round FROM participation WHERE run_id=?',"
        " (sys.argv[1],)).fetchall()))"
    )
    return [tuple(r) for r in json.loads(dep.exec_python("shuffler", script, run_id))]


def _wait_invited(dep: Deployment, run_id: str, timeout: float = 120) -> None:
    """Wait until the shuffler has recorded round 0's cohort (invitations are sent right after)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _participation(dep, run_id):
            return
        time.sleep(0.3)
    raise AssertionError(f"round 0 of {run_id} never started:\n{dep.logs('analyzer')}")


def _invited_by_node(dep: Deployment, run_id: str, round_index: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for user, r in _participation(dep, run_id):
        if r == round_index:
            # the shuffler keys a user by its node's identity and its id there ("client-0\nn0-u5")
            node = user.split("\n", 1)[-1].split("-", 1)[0]
            counts[node] = counts.get(node, 0) + 1
    return counts


@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_analyzer_never_received_user_ids_or_client_addresses(deployment: Deployment, finished_run):
    """Search everything the analyzer holds: its ledger (all runs), the fetched results and its logs."""
    dep = deployment
    _, out = finished_run
    addresses = []
    for i in range(2):
        cid = dep.cid(f"client-{i}")
        info = json.loads(run_cmd(["docker", "inspect", cid]).stdout)[0]
        addresses += [n["IPAddress"].encode() for n in info["NetworkSettings"]["Networks"].values() if n["IPAddress"]]
        addresses += [info["Config"]["Hostname"].encode(), info["Name"].lstrip("/").encode()]
    assert addresses
    held = dep.read_volume("analyzer", "/var/lib/shuffledp/state")
    assert any(name.endswith("ledger.sqlite") for name in held), sorted(held)
    held.update({f"results/{p.name}": p.read_bytes() for p in out.iterdir() if p.is_file()})
    logs = run_cmd(["docker", "logs", dep.cid("analyzer")])
    held["analyzer.log"] = (logs.stdout + logs.stderr).encode()
    ledger_db = next(v for k, v in held.items() if k.endswith("ledger.sqlite"))
    assert b"committed" in ledger_db or any(k.endswith("-wal") for k in held)  # the ledger holds the runs
    for name, data in held.items():
        assert not USER_ID_RE.search(data), f"{name} contains a user id: {USER_ID_RE.search(data).group()!r}"
        assert not NODE_ID_RE.search(data), f"{name} contains a client node id"
        for addr in addresses:
            assert addr not in data, f"{name} contains the client address/name {addr!r}"
    # control: the same search finds the user ids where they do live, in the shuffler's participation record
    shuffler_held = dep.read_volume("shuffler", "/var/lib/shuffledp/state")
    assert any(USER_ID_RE.search(v) for v in shuffler_held.values()), "the search would not find a user id"


@pytest.mark.timeout(DEPLOY_TIMEOUT_S)
def test_down_and_up_loses_nothing(deployment: Deployment, finished_run):
    """The ledger (analyzer) and participation record (shuffler) live in named volumes: `down` then `up` keeps
    them, and the results of an earlier run can still be fetched (deploy/compose.sh results)."""
    from shuffledp.v1 import shuffledp_pb2 as pb

    dep = deployment
    _, out = finished_run
    run_id = json.loads((out / "ledger.json").read_text())["run"]["run_id"]
    used_before = len(_participation(dep, run_id))
    assert used_before > 0
    dep.sh("down", timeout=180)  # containers and networks go, volumes stay
    assert not run_cmd(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={dep.project}"]).stdout
    dep.sh("up", timeout=UP_TIMEOUT_S + 200)
    again = dep.workdir / "results-again"
    proc = dep.sh("results", run_id, "--out", str(again), timeout=120)
    assert "COMPLETED" in proc.stdout
    before, after = json.loads((out / "ledger.json").read_text()), json.loads((again / "ledger.json").read_text())
    assert after["rounds"] == before["rounds"] and after["totals"] == before["totals"]
    with np.load(out / "model.npz") as m1, np.load(again / "model.npz") as m2:
        assert m1["params"].size > 0 and np.array_equal(m1["params"], m2["params"])
    assert len(_participation(dep, run_id)) == used_before
    st = Operator(dep).status(run_id)
    assert st.state == pb.COMPLETED and st.budget.eps_spent == before["totals"]["eps_spent"]
