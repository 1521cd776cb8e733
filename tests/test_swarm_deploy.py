"""The Docker Swarm deployment (issue 17): deploy/stack.yml driven by deploy/swarm.sh on a single-node swarm.

One stack (unique name, its own PKI, 3 client-node replicas of at most 5) is brought up by `swarm.sh up` for the
whole module and removed by `swarm.sh down --volumes` at the end, also when a test fails; then nothing of it may be
left (services, secrets, configs, networks, volumes, containers, node labels). The test creates the swarm only if
the engine is in none, and leaves it again only then. The image is the one the compose tests build (same tag),
built offline with deploy/build_image.sh if it is missing.

What is checked is what the running tasks can do and hold, not what the stack file intends:
- services, placement by role label, restart and update policies, no published port; client-net, analyzer-net and
  operator-net are encrypted internal overlays, and the analyzer shares none of them with a client node;
- each task holds the CA certificate and its own certificate and key and nothing else: every file mounted under
  /pki and /run/secrets of every task is read and matched against the PKI. Client replica slot s holds
  client-(s-1)'s key only;
- the analyzer cannot open a connection to any client replica (by name, by tasks.* name, by address). The shuffler
  can, as a control;
- no certificate, a self-signed one, one of another CA, and a CA-signed one of the wrong role are refused by every
  service, from the networks where a stranger would come from; the right role gets through;
- the stateful entrypoint refuses an empty state volume (a task rescheduled onto a host without the volume);
- a PSGD (sequential) experiment runs to completion through `swarm.sh run`, and its results are fetched, again
  with `swarm.sh results`; the stack runs with the monitoring overlay (`up --monitoring`): Prometheus scraped every
  task, and its committed rounds and eps spent are the ledger's;
- the analyzer task killed mid-run: Swarm restarts it on its labelled host, the run resumes from the ledger, and no
  budget is lost or counted twice;
- `swarm.sh scale 5` during a fully interactive run: the new replicas serve shards 3 and 4 and subscribe, but a
  fully interactive run's population is fixed at its first round (PGD optimises over one data set, and the noise
  and the contributor bound were sized for it): their users are not invited to it, every round reports them as
  not_in_run, the run completes with the planned users and the ledger is consistent. A run started after the
  scale-up has all five replicas' users.

Without a reachable engine, or with an engine in a swarm this test cannot use, the module is skipped with one line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import _deploy as common
import pytest
from _deploy import IMAGE, SERVICE_UID, docker_json, run_cmd

from shuffledp.security import pki

SWARM_SH = common.DEPLOY / "swarm.sh"
CLIENTS, MAX_CLIENTS = 3, 5
ROLES = ("analyzer", "shuffler", "clients")
UP_TIMEOUT_S = 240
TEST_TIMEOUT_S = 900  # per test, including the module's image build (if any) and swarm.sh up


def _swarm_unusable() -> str | None:
    """None when this module can run a stack on a single-node swarm (existing or to be created); else why not."""
    if why := common.engine_unavailable(reuse_image=True):
        return why
    sw = docker_json("info", "--format", "{{json .Swarm}}")
    state = sw.get("LocalNodeState")
    if state == "active":
        if not sw.get("ControlAvailable"):
            return "this engine is a swarm worker; the tests need a manager"
        if int(sw.get("Nodes") or 0) > 1:
            return "this engine is in a swarm of several hosts; the tests deploy on a single-node swarm only"
    elif state != "inactive":
        return f"this engine's swarm state is {state!r}"
    if subprocess.run(["docker", "stack", "ls"], capture_output=True, timeout=30).returncode not in (0, 1):
        return "the docker CLI has no 'docker stack'"
    return None


common.skip_module_if(_swarm_unusable(), "swarm deployment tests")
pytestmark = pytest.mark.docker

TIMINGS: dict[str, float] = {}
RUNS: list[subprocess.Popen] = []  # background `swarm.sh run`s (Progress), ended before `down`


@pytest.fixture(scope="module")
def swarm():
    """A single-node swarm whose node has every role label; created (and left afterwards) only if there is none."""
    state = run_cmd(["docker", "info", "--format", "{{.Swarm.LocalNodeState}}"]).stdout.strip()
    gwbridge_before = run_cmd(["docker", "network", "inspect", "docker_gwbridge"], check=False).returncode == 0
    created = state == "inactive"
    if created:
        run_cmd(["docker", "swarm", "init", "--advertise-addr", "127.0.0.1"])
    node = run_cmd(["docker", "info", "--format", "{{.Swarm.NodeID}}"]).stdout.strip()
    labels = docker_json("node", "inspect", node)[0]["Spec"].get("Labels") or {}
    added = [f"shuffledp.role.{r}" for r in ROLES if labels.get(f"shuffledp.role.{r}") != "true"]
    if added:
        run_cmd(["docker", "node", "update", *[a for k in added for a in ("--label-add", f"{k}=true")], node])
    try:
        yield node
    finally:
        if added and not created:
            run_cmd(["docker", "node", "update", *[a for k in added for a in ("--label-rm", k)], node], check=False)
        if created:
            run_cmd(["docker", "swarm", "leave", "--force"], timeout=120)
            if not gwbridge_before:  # made by the swarm for its tasks; nothing else of ours uses it
                run_cmd(["docker", "network", "rm", "docker_gwbridge"], check=False)
            after = run_cmd(["docker", "info", "--format", "{{.Swarm.LocalNodeState}}"]).stdout.strip()
            assert after == "inactive", f"the swarm this test created was not left: {after}"
        if TIMINGS:
            print("\nswarm test timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMINGS.items()))


@pytest.fixture(scope="module")
def image() -> None:
    """The compose tests' image if present, else built offline."""
    t0 = time.monotonic()
    if common.build_image(from_scratch=False):
        TIMINGS["image build"] = time.monotonic() - t0


@dataclass
class Stack:
    name: str
    pki: Path
    config: Path
    workdir: Path
    node: str
    prometheus_port: int = 0

    def sh(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """deploy/swarm.sh with this stack's name, PKI and configuration."""
        cmd = ["bash", str(SWARM_SH), "--stack", self.name, "--pki", str(self.pki), "--config", str(self.config)]
        return run_cmd([*cmd, "--timeout", str(UP_TIMEOUT_S), *args], timeout=timeout, check=check)

    def popen(self, *args: str) -> subprocess.Popen:
        cmd = ["bash", str(SWARM_SH), "--stack", self.name, "--pki", str(self.pki), "--config", str(self.config)]
        return subprocess.Popen(
            [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
        )

    def service(self, svc: str) -> dict:
        return docker_json("service", "inspect", f"{self.name}_{svc}")[0]

    def containers(self, svc: str) -> dict[int, str]:
        """Running containers of a service on this host: task slot -> container id."""
        out = run_cmd(
            ["docker", "ps", "--filter", f"label=com.docker.swarm.service.name={self.name}_{svc}"]
            + ["--format", '{{.ID}} {{.Label "com.docker.swarm.task.name"}}']
        ).stdout.split("\n")
        found = {}
        for line in filter(None, out):
            cid, task = line.split()
            found[int(task.split(".")[1])] = cid
        return found

    def cid(self, svc: str) -> str:
        (cid,) = self.containers(svc).values()
        return cid

    def exec_python(self, cid: str, script: str, *args: str, stdin: str | None = None, timeout: float = 90) -> str:
        cmd = ["docker", "exec", "-i", cid, "python", "-c", script, *args]
        return run_cmd(cmd, input=stdin, timeout=timeout).stdout

    def ip(self, cid: str, network: str) -> str:
        nets = docker_json("inspect", cid)[0]["NetworkSettings"]["Networks"]
        return nets[f"{self.name}_{network}"]["IPAddress"]

    def logs(self, svc: str, tail: int = 60) -> str:
        proc = run_cmd(
            ["docker", "service", "logs", "--no-trunc", "--tail", str(tail), f"{self.name}_{svc}"], check=False
        )
        return proc.stdout + proc.stderr


def _config_text(**replace: str) -> str:
    """deploy/example.toml with `key = value` lines replaced, and CLIENTS client nodes."""
    return common.config_text(client_nodes=str(CLIENTS), **replace)


def _leftovers(name: str) -> dict[str, list[str]]:
    label = f"label=com.docker.stack.namespace={name}"
    left = {
        kind: run_cmd(["docker", kind, "ls", "-q", "--filter", label]).stdout.split()
        for kind in ("service", "secret", "config", "network", "volume")
    }
    left["container"] = run_cmd(["docker", "ps", "-aq", "--filter", label]).stdout.split()
    left["volume"] += [v for v in run_cmd(["docker", "volume", "ls", "-q"]).stdout.split() if v.startswith(f"{name}_")]
    left["service"] += run_cmd(
        ["docker", "service", "ls", "-q", "--filter", f"label=org.shuffledp.stack={name}"]
    ).stdout.split()
    node_labels = []
    for n in run_cmd(["docker", "node", "ls", "-q"]).stdout.split():
        node_labels += [k for k in docker_json("node", "inspect", n)[0]["Spec"].get("Labels") or {} if name in k]
    left["node label"] = node_labels
    return {k: v for k, v in left.items() if v}


@pytest.fixture(scope="module")
def stack(swarm: str, image, tmp_path_factory: pytest.TempPathFactory):
    """swarm.sh up (3 of at most 5 client nodes) with a unique stack name; always `down --volumes` afterwards."""
    work = tmp_path_factory.mktemp("swarm")
    st = Stack(
        name=f"sdpsw{os.getpid() % 10000}{int(time.time()) % 10000}",
        pki=work / "pki",
        config=work / "config.toml",
        workdir=work,
        node=swarm,
    )
    st.config.write_text(_config_text())
    st.prometheus_port = common.free_port()
    try:
        t0 = time.monotonic()
        monitoring = ["--monitoring", "--monitoring-port", str(st.prometheus_port)]
        st.sh("--max-clients", str(MAX_CLIENTS), "up", *monitoring, timeout=UP_TIMEOUT_S + 200)
        TIMINGS["up"] = time.monotonic() - t0
        yield st
    finally:
        common.end_runs(RUNS, timeout=60)
        t0 = time.monotonic()
        down = st.sh("down", "--volumes", timeout=240, check=False)
        TIMINGS["down"] = time.monotonic() - t0
        left = _leftovers(st.name)
        assert down.returncode == 0, f"swarm.sh down failed:\n{down.stdout}\n{down.stderr}"
        assert not left, f"left behind by stack {st.name}: {left}"


# ------------------------------------------------------------------------------------------------ topology
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_services_networks_and_placement(stack: Stack):
    nets: dict[str, set[str]] = {}
    for svc in ROLES:
        spec = stack.service(svc)["Spec"]
        task = spec["TaskTemplate"]
        assert task["Placement"]["Constraints"] == [f"node.labels.shuffledp.role.{svc} == true"], task["Placement"]
        assert task["RestartPolicy"]["Condition"] == "any"
        # never two tasks of one slot at once: one identity, one SQLite state
        assert spec["UpdateConfig"]["Order"] == "stop-first" and spec["RollbackConfig"]["Order"] == "stop-first"
        assert spec["EndpointSpec"]["Mode"] == "dnsrr" and not spec["EndpointSpec"].get("Ports"), spec["EndpointSpec"]
        assert not stack.service(svc)["Endpoint"].get("Ports"), f"{svc} publishes a port"
        cs = task["ContainerSpec"]
        assert cs["ReadOnly"] is True and cs["CapabilityDrop"] == ["ALL"], cs
        assert "python" in " ".join(cs["Healthcheck"]["Test"])
        want = CLIENTS if svc == "clients" else 1
        assert spec["Mode"]["Replicated"]["Replicas"] == want
        ids = {n["Target"] for n in task["Networks"]}
        nets[svc] = {docker_json("network", "inspect", i)[0]["Name"].removeprefix(f"{stack.name}_") for i in ids}
    # the stack runs with the monitoring overlay: one metrics network per party, which Prometheus joins
    assert nets == {
        "analyzer": {"analyzer-net", "operator-net", "metrics-analyzer-net"},
        "shuffler": {"analyzer-net", "client-net", "metrics-shuffler-net"},
        "clients": {"client-net", "metrics-client-net"},
    }, nets
    assert not nets["analyzer"] & nets["clients"], "the analyzer shares a network with the client nodes"
    for net in set().union(*nets.values()):
        info = docker_json("network", "inspect", f"{stack.name}_{net}")[0]
        assert info["Driver"] == "overlay" and info["Scope"] == "swarm", info
        assert "encrypted" in (info.get("Options") or {}), f"{net} is not encrypted: {info.get('Options')}"
        assert info["Internal"] is True, f"{net} is not internal"
        # only the operator's network (swarm.sh run) and the metrics networks (Prometheus) take other containers
        want = net == "operator-net" or net.startswith("metrics-")
        assert info["Attachable"] is want, f"{net}: Attachable={info['Attachable']}"
    # every task runs, healthy, as the image's unprivileged user, on the host labelled for its role
    assert sorted(stack.containers("clients")) == list(range(1, CLIENTS + 1))
    for svc in ROLES:
        for slot, cid in stack.containers(svc).items():
            info = docker_json("inspect", cid)[0]
            assert info["State"]["Health"]["Status"] == "healthy", f"{svc}.{slot}: {info['State']['Health']}"
            assert run_cmd(["docker", "exec", cid, "id", "-u"]).stdout.strip() == str(SERVICE_UID)
            assert info["HostConfig"]["ReadonlyRootfs"] is True
            assert not any(m["Type"] == "bind" for m in info["Mounts"]), f"{svc}.{slot} bind-mounts {info['Mounts']}"
            # the image's /results volume is a tmpfs: no anonymous volume per task
            assert all(m["Type"] != "volume" or m["Name"].startswith(f"{stack.name}_") for m in info["Mounts"])


# Every regular file under the given roots (secret mounts), and whether the environment holds key material.
_FILES_PROBE = """
import json, os, sys
out = {}
for root in sys.argv[1:]:
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            try:
                out[p] = open(p, 'rb').read().decode('latin-1')
            except OSError as exc:
                out[p] = f'unreadable: {exc}'
env = any('PRIVATE KEY' in v for v in os.environ.values())
print(json.dumps({'files': out, 'env_has_key': env}))
"""


def _pki_files(d: Path) -> dict[str, str]:
    """File content -> what it is ("ca.crt", "ca.key", "<party>/cert.pem", "<party>/key.pem")."""
    known = {(d / pki.CA_CERT_FILE).read_text(): "ca.crt", (d / pki.CA_KEY_FILE).read_text(): "ca.key"}
    for party in ("analyzer", "shuffler", "operator", *(f"client-{i}" for i in range(MAX_CLIENTS))):
        for f in (pki.CERT_FILE, pki.KEY_FILE):
            known[(d / party / f).read_text()] = f"{party}/{f}"
    return known


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_each_task_holds_only_the_ca_and_its_own_key(stack: Stack):
    # the services' specs: three secrets each, of its own
    for svc, own in (("analyzer", "analyzer"), ("shuffler", "shuffler"), ("clients", "clients")):
        cs = stack.service(svc)["Spec"]["TaskTemplate"]["ContainerSpec"]
        names = {s["SecretName"].removeprefix(f"{stack.name}_") for s in cs["Secrets"]}
        assert names == {"ca-crt", f"{own}-crt", f"{own}-key"}, f"{svc} gets secrets {sorted(names)}"
        keys = [s for s in cs["Secrets"] if s["SecretName"].endswith("-key")]
        assert all(s["File"]["Mode"] == 0o400 and s["File"]["UID"] == str(SERVICE_UID) for s in keys), keys
        assert "PRIVATE KEY" not in json.dumps(stack.service(svc)), f"key material in the {svc} service spec"
    # what each running task really holds
    known = _pki_files(stack.pki)
    for svc in ROLES:
        for slot, cid in stack.containers(svc).items():
            party = f"client-{slot - 1}" if svc == "clients" else svc
            held = json.loads(stack.exec_python(cid, _FILES_PROBE, "/pki", "/run/secrets"))
            assert not held["env_has_key"], f"{svc}.{slot} has key material in its environment"
            what = {path: known.get(text, f"unknown ({text[:40]!r})") for path, text in held["files"].items()}
            assert sorted(what.values()) == sorted(["ca.crt", f"{party}/cert.pem", f"{party}/key.pem"]), (
                f"{svc} task {slot} holds {what}"
            )
            assert "PRIVATE KEY" not in json.dumps(docker_json("inspect", cid)), f"key material in {svc}.{slot}"


# ------------------------------------------------------------------------------------------------ trust boundaries
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_analyzer_has_no_route_to_any_client(stack: Stack):
    clients = stack.containers("clients")
    targets = ["clients:50053", "tasks.clients:50053", f"{stack.name}_clients:50053"]
    targets += [f"{stack.ip(cid, 'client-net')}:50053" for cid in clients.values()]
    shuffler = stack.cid("shuffler")
    targets.append(f"{stack.ip(shuffler, 'client-net')}:50052")  # the shuffler's side facing the clients
    from_analyzer = json.loads(
        stack.exec_python(stack.cid("analyzer"), common.CONNECT_PROBE, *targets, "shuffler:50052")
    )
    by_address = [t for t in targets if t[0].isdigit()]
    from_shuffler = json.loads(stack.exec_python(shuffler, common.CONNECT_PROBE, "clients:50053", *by_address))
    # controls: the probe works, the replicas listen, and the analyzer reaches its one peer
    assert from_shuffler == {t: "connected" for t in ["clients:50053", *by_address]}, from_shuffler
    assert from_analyzer.pop("shuffler:50052") == "connected"
    reached = {t: r for t, r in from_analyzer.items() if r == "connected"}
    assert not reached, f"the analyzer reached {sorted(reached)}"


@pytest.fixture(scope="module")
def stranger_material(stack: Stack) -> str:
    """PEMs a stranger might hold (JSON for the probe's stdin)."""
    return common.stranger_pems(stack.pki, stack.workdir)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_strangers_are_refused_by_every_service(stack: Stack, stranger_material: str):
    results = []
    # the analyzer from operator-net, the one network a one-off container can join: a helper there
    cases = common.stranger_cases("analyzer.GetBudget", "analyzer:50051", "analyzer")
    helper = ["docker", "run", "--rm", "-i", "--network", f"{stack.name}_operator-net", "--read-only"]
    helper += ["--tmpfs", "/tmp", "--tmpfs", "/results", "--entrypoint", "python", IMAGE, "-c", common.STRANGER_PROBE]
    results += json.loads(run_cmd([*helper, json.dumps(cases)], input=stranger_material, timeout=120).stdout)
    # the shuffler from both sides: client-net (from a client replica) and analyzer-net (from the analyzer)
    shuffler_cases = [
        c
        for call in common.ALLOWED
        if call.startswith("shuffler")
        for c in common.stranger_cases(call, "shuffler:50052", "shuffler")
    ]
    for svc in ("clients", "analyzer"):
        cid = next(iter(stack.containers(svc).values()))
        out = stack.exec_python(cid, common.STRANGER_PROBE, json.dumps(shuffler_cases), stdin=stranger_material)
        results += [dict(r, target=f"{r['target']} (from {svc})") for r in json.loads(out)]
    # every client replica from client-net (from the shuffler), by its address
    client_cases = []
    for slot, cid in stack.containers("clients").items():
        client_cases += common.stranger_cases(
            "client.GetNodeStatus", f"{stack.ip(cid, 'client-net')}:50053", f"client-{slot - 1}"
        )
    out = stack.exec_python(
        stack.cid("shuffler"), common.STRANGER_PROBE, json.dumps(client_cases), stdin=stranger_material
    )
    results += json.loads(out)
    assert len(results) == len(cases) + 2 * len(shuffler_cases) + len(client_cases)
    common.assert_refusals(results)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_stateful_task_refuses_a_volume_without_its_state(stack: Stack):
    """A task rescheduled onto a host without the state volume gets a new, empty one there: it must not start. Run
    exactly the service's container spec on an empty volume; the running tasks show the prepared volume works."""
    for svc in ("analyzer", "shuffler"):
        cid = stack.cid(svc)
        marker = run_cmd(["docker", "exec", cid, "cat", "/var/lib/shuffledp/.shuffledp-state"]).stdout
        assert f"stack={stack.name} role={svc}" in marker, marker
        cs = stack.service(svc)["Spec"]["TaskTemplate"]["ContainerSpec"]
        empty = f"{stack.name}_elsewhere-{svc}"
        cmd = ["docker", "run", "--rm", "--read-only", "--tmpfs", "/tmp", "--tmpfs", "/results", "--network", "none"]
        cmd += ["-v", f"{empty}:/var/lib/shuffledp", "--entrypoint", cs["Command"][0], IMAGE, *cs["Command"][1:]]
        try:
            proc = run_cmd([*cmd, *cs["Args"]], check=False, timeout=60)
        finally:
            run_cmd(["docker", "volume", "rm", empty], check=False)
        assert proc.returncode == 78, f"{svc} started on an empty volume:\n{proc.stdout}\n{proc.stderr}"
        assert f"shuffledp {svc}: refusing to start" in proc.stderr and "labelled shuffledp.role" in proc.stderr
        assert not proc.stdout.strip(), proc.stdout


# ------------------------------------------------------------------------------------------------ experiments
def Progress(stack: Stack, config: Path, out: Path) -> common.Progress:
    """`swarm.sh run` in the background (ended before `down` if a test fails)."""
    proc = stack.popen("run", str(config), "--out", str(out))
    RUNS.append(proc)
    return common.Progress(proc)


def _shards(config: Path) -> list[int]:
    """Users per data shard of the stack's MAX_CLIENTS (user j lives on shard j mod MAX_CLIENTS)."""
    from shuffledp.config import load_config
    from shuffledp.data import load_dataset, num_users

    cfg = load_config(config)
    n = num_users(load_dataset(cfg.data, cfg.model.task), cfg.data.examples_per_user, cfg.data.max_users)
    return [len(range(i, n, MAX_CLIENTS)) for i in range(MAX_CLIENTS)]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_psgd_experiment_runs_to_completion_and_results_are_fetched(stack: Stack):
    out = stack.workdir / "psgd"
    t0 = time.monotonic()
    proc = stack.sh("run", str(stack.config), "--out", str(out), timeout=400, check=False)
    TIMINGS["psgd run"] = time.monotonic() - t0
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{stack.logs('analyzer')}"
    assert "state: COMPLETED" in proc.stdout
    assert len([x for x in proc.stdout.splitlines() if x.startswith("round ")]) >= 2, proc.stdout
    for f in ("config.toml", "metrics.csv", "metrics.json", "ledger.json", "model.npz"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f"results lack {f}"
    ledger = json.loads((out / "ledger.json").read_text())
    plan = ledger["run"]["plan"]
    assert ledger["run"]["state"] == "COMPLETED" and plan["kind"] == "sequential"
    # the users of the 3 running replicas of 5 shards, and nobody else's
    assert plan["admitted"] == sum(_shards(stack.config)[:CLIENTS]), plan
    common.check_ledger(ledger)
    states = [(r["state"], r["reason"]) for r in ledger["rounds"]]
    assert all(r["state"] == "committed" for r in ledger["rounds"]) and len(states) == plan["rounds"], (states, plan)
    metrics = json.loads((out / "metrics.json").read_text())
    released = [m for m in metrics if m["released"]]
    assert len(released) == plan["rounds"] and released[-1]["accuracy"] > 0.3, metrics
    # Prometheus (up --monitoring) scraped every task, and its figures are the ledger's once it has scraped the end
    port, run_id = stack.prometheus_port, ledger["run"]["run_id"]
    for job, n in (("analyzer", 1), ("shuffler", 1), ("client-node", CLIENTS)):
        assert len(common.prometheus_wait(port, f'up{{job="{job}"}} == 1', want=n)) == n, job
    committed = sum(r["state"] == "committed" for r in ledger["rounds"])
    rounds = f'shuffledp_analyzer_rounds_total{{run_id="{run_id}",outcome="committed"}}'
    common.prometheus_wait(port, f"{rounds} == {committed}")
    spent = common.prometheus_query(port, f'shuffledp_analyzer_epsilon_spent{{run_id="{run_id}"}}')
    assert float(spent[0]["value"][1]) == pytest.approx(ledger["totals"]["eps_spent"], rel=1e-9)
    every = json.dumps(common.prometheus_query(port, '{__name__=~"shuffledp_.+"}'))
    assert "shuffledp_node_users" in every and not re.search(r"n\d+-u\d+", every)  # no user id in any series
    # fetched again by run id
    again = stack.workdir / "psgd-again"
    proc = stack.sh("results", run_id, "--out", str(again), timeout=120)
    assert json.loads((again / "ledger.json").read_text()) == ledger


def _fully_interactive(rounds: int, pace: float = 0.0) -> str:
    """pace: [deployment] min_round_seconds, for a run that must outlast what the test does meanwhile (its rounds
    alone take 0.01-0.03 s)."""
    text = _config_text(kind='"fully_interactive"', cohort_size="0", min_round_seconds=str(pace))
    return text.replace("cohort_size = 0", f"rounds = {rounds}")


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_analyzer_task_killed_is_restarted_and_the_run_resumes(stack: Stack):
    """SIGKILL the analyzer's container mid-run: Swarm starts a new task on the labelled host, which resumes the run
    from the ledger. The round in flight is charged (spent, outcome unknown), none before it is lost, none twice."""
    cfg = stack.workdir / "fi-kill.toml"
    cfg.write_text(_fully_interactive(rounds=100, pace=0.2))  # >= 20 s: most rounds after the kill
    out = stack.workdir / "fi-kill"
    old = stack.cid("analyzer")
    t0 = time.monotonic()
    run = Progress(stack, cfg, out)
    run.wait_rounds(8)
    shown_before = run.rounds_shown()
    run_cmd(["docker", "kill", old])  # a crash: SIGKILL, a round in flight
    rc = run.finish()
    TIMINGS["kill run"] = time.monotonic() - t0
    logs = "\n".join(stack.logs(svc, tail=200) for svc in ("analyzer", "shuffler", "clients"))
    assert rc == 0 and "state: COMPLETED" in run.text, run.text + "\n" + logs
    # Swarm replaced the task: the old one failed (137), a new one runs on the host labelled analyzer
    tasks = [
        json.loads(line)
        for line in run_cmd(
            ["docker", "service", "ps", "--no-trunc", "--format", "{{json .}}", f"{stack.name}_analyzer"]
        ).stdout.splitlines()
    ]
    running = [t for t in tasks if t["DesiredState"] == "Running"]
    failed = [t for t in tasks if "137" in t["Error"]]
    assert len(running) == 1 and running[0]["CurrentState"].startswith("Running") and failed, tasks
    new = stack.cid("analyzer")
    assert new != old
    node = docker_json("inspect", new)[0]["Config"]["Labels"]["com.docker.swarm.node.id"]
    assert (docker_json("node", "inspect", node)[0]["Spec"]["Labels"] or {}).get("shuffledp.role.analyzer") == "true"
    ledger = json.loads((out / "ledger.json").read_text())
    plan = ledger["run"]["plan"]
    common.check_ledger(ledger)
    states = [r["state"] for r in ledger["rounds"]]
    assert len(states) == plan["rounds"], "a round index was skipped or reused"
    # the kill lands inside a round or between two: at most the one round in flight is charged without a batch
    reasons = [(r["round"], r["state"], r["reason"]) for r in ledger["rounds"] if r["state"] != "committed"]
    assert states.count("spent_unknown") <= 1 and "released" not in states, reasons
    # no budget lost: the rounds shown before the kill are still committed, at what was shown then
    k = len(shown_before)
    assert all(s == "committed" for s in states[:k]), states[:k]
    limit, compose_events, events = common.ledger_events(ledger)
    shown_eps = float(re.search(r"eps spent\s+([0-9.]+)", shown_before[-1]).group(1))
    assert compose_events(events[:k], limit)[0] == pytest.approx(shown_eps, abs=6e-5)
    assert any(r["contributors"] == plan["cohort"] for r in ledger["rounds"][k:]), "no round after the restart"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_scale_to_five_during_a_fully_interactive_run(stack: Stack):
    # beyond the stack's certificates and data shards: refused with one line, nothing changes
    proc = stack.sh("scale", str(MAX_CLIENTS + 1), check=False)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert f"certificates and data shards for 1..{MAX_CLIENTS} client nodes" in proc.stderr
    cfg = stack.workdir / "fi-scale.toml"
    cfg.write_text(_fully_interactive(rounds=250, pace=0.2))  # >= 50 s: the new replicas (~16 s) join during it
    out = stack.workdir / "fi-scale"
    t0 = time.monotonic()
    run = Progress(stack, cfg, out)
    run.wait_rounds(3)
    scaled = stack.sh("scale", str(MAX_CLIENTS), timeout=UP_TIMEOUT_S + 60)
    TIMINGS["scale 3->5"] = time.monotonic() - t0
    assert "ready: clients:5" in scaled.stderr, scaled.stderr
    assert sorted(stack.containers("clients")) == list(range(1, MAX_CLIENTS + 1))
    rc = run.finish()
    TIMINGS["scale run"] = time.monotonic() - t0
    ledger = json.loads((out / "ledger.json").read_text())
    plan = ledger["run"]["plan"]
    common.check_ledger(ledger)
    shard = _shards(cfg)
    assert plan["admitted"] == sum(shard[:CLIENTS]) == plan["cohort"], plan
    joined = {sum(shard[CLIENTS : CLIENTS + k]) for k in (1, 2)}  # one new replica, or both, subscribed
    # the run's population is fixed at its first round (the shuffler's record): the newcomers are connected but not
    # invited, every round has the planned users, each report counts them, and the run completes
    assert rc == 0 and ledger["run"]["state"] == "COMPLETED", ledger["run"]
    assert len(ledger["rounds"]) == plan["rounds"]
    assert all(r["state"] == "committed" and r["contributors"] == plan["cohort"] for r in ledger["rounds"])
    metrics = json.loads((out / "metrics.json").read_text())
    late = [m["not_in_run"] for m in metrics if m["not_in_run"]]
    assert late and set(late) <= joined, (late, shard)
    assert metrics[-1]["not_in_run"] == max(joined), metrics[-1]  # both new replicas by the end
    assert f"{max(joined)} users joined after the run's first round: not in this run" in run.text
    print(
        f"\nscale during a fully interactive run: {max(joined)} new users not invited (joined from round "
        f"{next(m['round'] for m in metrics if m['not_in_run'])}); run completed with {plan['cohort']} users"
    )
    # a run that starts after the scale-up has every replica's users
    cfg2 = stack.workdir / "fi-after-scale.toml"
    cfg2.write_text(_fully_interactive(rounds=3))
    out2 = stack.workdir / "fi-after-scale"
    assert Progress(stack, cfg2, out2).finish() == 0
    after = json.loads((out2 / "ledger.json").read_text())
    # (a first round may miss its deadline while the new replicas verify their first randomizer: released, free)
    used = [r["contributors"] for r in after["rounds"] if r["state"] == "committed"]
    assert used and set(used) == {sum(shard)}, after["rounds"]
