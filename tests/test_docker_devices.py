"""Devices in the container deployments (issue 44 items 3 and 6): `[deployment] users_per_node = 1` makes
deploy/compose.sh and deploy/swarm.sh run the client nodes as single-user device nodes in fleet containers
(`shuffledp serve fleet`), each device with its own certificate; a device revoked while the deployment runs is refused
by the running shuffler.

For each of compose and Swarm (a single-node swarm, created and left again only if the engine is in none):
- up with DEVICES devices in FLEETS fleets; each fleet holds exactly its own devices' certificates and keys, and the
  shuffler mounts a directory holding only the published revocation list (never the PKI directory);
- a PVEC check-in run completes with every device's user in every round;
- `revoke client-7` while everything runs (the shuffler is not restarted), then the fleet holding client-7 restarts:
  its devices reconnect, client-7 is refused (PERMISSION_DENIED, "revoked" in the device's log), and the next run has
  DEVICES - 1 contributors in every round;
- down --volumes leaves nothing of the deployment.

DEVICES defaults to 100 (beyond the 48 node streams the thread-per-stream shuffler admitted);
SHUFFLEDP_TEST_DEVICES=N sets it. The image is reused if present (else built offline, about 2 minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import _deploy as common
import pytest
from _deploy import run_cmd

DEVICES = int(os.environ.get("SHUFFLEDP_TEST_DEVICES", "100"))
FLEETS = 2
REVOKED = 7  # client-7: in fleet-0 (devices 0 .. DEVICES/2 - 1)
UP_TIMEOUT_S = 240
TEST_TIMEOUT_S = 600


def _unavailable() -> str | None:
    if why := common.engine_unavailable(reuse_image=True):
        return why
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
    if not v2 and shutil.which("docker-compose") is None:
        return "neither 'docker compose' nor 'docker-compose' is installed"
    state = run_cmd(["docker", "info", "--format", "{{.Swarm.LocalNodeState}}"]).stdout.strip()
    if state not in ("inactive", "active"):
        return f"this engine's swarm state is {state!r}"
    return None


common.skip_module_if(_unavailable(), "device deployment tests")
pytestmark = pytest.mark.docker


def _config() -> str:
    """The default protocol (calibrated PVEC with check-in) on digits, one user per device."""
    return f"""
[data]
dataset = "digits"
max_users = {DEVICES}

[privacy]
eps = 8.0

[schedule]
rounds = 3

[deployment]
client_nodes = {DEVICES}
users_per_node = 1
population_wait_seconds = 5
round_deadline_seconds = 20
insecure = false
pki_dir = "/pki"
"""


@pytest.fixture(scope="module")
def image() -> None:
    common.build_image(from_scratch=False)


def _fleet_of(device: int) -> int:
    size = -(-DEVICES // FLEETS)
    return device // size


def _fleet_devices(j: int) -> set[str]:
    size = -(-DEVICES // FLEETS)
    return {f"client-{i}" for i in range(j * size, min(DEVICES, (j + 1) * size))}


def _run(script: list[str], config: Path, out: Path) -> list[dict]:
    """`run CONFIG --out OUT` of the script: completes; its metrics (one entry per round)."""
    proc = run_cmd([*script, "run", str(config), "--out", str(out)], timeout=300)
    assert "state: COMPLETED" in proc.stdout, proc.stdout[-3000:]
    common.check_ledger(json.loads((out / "ledger.json").read_text()))
    return json.loads((out / "metrics.json").read_text())


def _wait_log(read_log, text: str, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = read_log()
        if text in log:
            return log
        time.sleep(1)
    raise AssertionError(f"no {text!r} in the log after {timeout} s:\n{read_log()[-3000:]}")


def _revoked_line(name: str) -> str:
    return f"device {name}: shuffler stream failed (StatusCode.PERMISSION_DENIED: certificate of {name} is revoked"


def _check_refusal(log: str) -> None:
    """The revoked device is refused, and only it (its fleet's other devices reconnected)."""
    assert _revoked_line(f"client-{REVOKED}") in log
    others = sorted(_fleet_devices(_fleet_of(REVOKED)) - {f"client-{REVOKED}"})
    assert not [n for n in others if _revoked_line(n) in log], log[-3000:]


# ------------------------------------------------------------------------------------------------ compose
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_compose_runs_devices_in_fleets_and_a_revoked_device_is_refused(image, tmp_path: Path):
    project = f"sdpdev{os.getpid()}{int(time.time()) % 100000}"
    pki, config = tmp_path / "pki", tmp_path / "devices.toml"
    config.write_text(_config())
    sh = ["bash", str(common.DEPLOY / "compose.sh"), "--project", project, "--pki", str(pki)]
    sh += ["--port", str(common.free_port()), "--config", str(config), "--timeout", str(UP_TIMEOUT_S)]
    label = f"label=com.docker.compose.project={project}"
    times: dict[str, float] = {}

    def cid(service: str) -> str:
        out = run_cmd(
            ["docker", "ps", "-q", "--filter", label, "--filter", f"label=com.docker.compose.service={service}"]
        )
        assert len(out.stdout.split()) == 1, f"{service}: {out.stdout}"
        return out.stdout.strip()

    try:
        t0 = time.monotonic()
        run_cmd([*sh, "--fleets", str(FLEETS), "up"], timeout=UP_TIMEOUT_S + 120)
        times["up"] = time.monotonic() - t0
        services = {
            c["Config"]["Labels"]["com.docker.compose.service"]: c
            for c in common.docker_json("inspect", *run_cmd(["docker", "ps", "-q", "--filter", label]).stdout.split())
        }
        assert set(services) == {"analyzer", "shuffler", *(f"fleet-{j}" for j in range(FLEETS))}, sorted(services)
        # the shuffler: its revocation list from a directory holding only that list, never the PKI directory
        mounts = {m["Destination"]: m for m in services["shuffler"]["Mounts"]}
        assert {d for d in mounts if d.startswith("/pki")} == {"/pki/ca.crt", "/pki/shuffler", "/pki-crl"}
        assert Path(mounts["/pki-crl"]["Source"]) == pki / "crl" and not mounts["/pki-crl"]["RW"]
        assert sorted(os.listdir(pki / "crl")) == ["crl.pem"]
        # each fleet: ca.crt and its own devices' certificates and keys, the PKI's files themselves (hard links)
        for j in range(FLEETS):
            mounts = {m["Destination"]: m for m in services[f"fleet-{j}"]["Mounts"]}
            assert {d for d in mounts if d.startswith("/pki")} == {"/pki"} and not mounts["/pki"]["RW"]
            held = run_cmd(["docker", "exec", cid(f"fleet-{j}"), "ls", "/pki"]).stdout.split()
            assert set(held) == {"ca.crt", *_fleet_devices(j)}, held
            for name in _fleet_devices(j):
                for f in ("cert.pem", "key.pem"):
                    assert os.path.samefile(pki / "fleets" / f"fleet-{j}" / name / f, pki / name / f)
        t0 = time.monotonic()
        metrics = _run(sh, config, tmp_path / "run1")
        times["run"] = time.monotonic() - t0
        assert [m["contributors"] for m in metrics] == [DEVICES] * 3, metrics

        # revoked while everything runs: the shuffler reads the published list again, no restart
        shuffler_started = services["shuffler"]["State"]["StartedAt"]
        t0 = time.monotonic()
        out = run_cmd([*sh, "revoke", f"client-{REVOKED}"])
        assert f"client-{REVOKED}" in out.stderr and "revoked" in out.stderr, out.stderr
        fleet = f"fleet-{_fleet_of(REVOKED)}"
        since = run_cmd(["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"]).stdout.strip()
        run_cmd(["docker", "restart", cid(fleet)], timeout=120)
        log = _wait_log(
            lambda: run_cmd(["docker", "logs", "--since", since, cid(fleet)]).stderr, _revoked_line(f"client-{REVOKED}")
        )
        times["revoke to refusal"] = time.monotonic() - t0
        _check_refusal(log)
        assert common.docker_json("inspect", cid("shuffler"))[0]["State"]["StartedAt"] == shuffler_started
        metrics = _run(sh, config, tmp_path / "run2")
        assert [m["contributors"] for m in metrics] == [DEVICES - 1] * 3, metrics
    finally:
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            run_cmd([*sh, "down", "--volumes"], timeout=180, check=False)
        times["down"] = time.monotonic() - t0
        (common.DEPLOY / ".build" / f"fleets.{project}.yml").unlink(missing_ok=True)
        print(
            f"\ncompose devices ({DEVICES} in {FLEETS} fleets), s: "
            + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
        )
    for kind in ("container", "volume", "network"):
        left = run_cmd(["docker", kind, "ls", "-q", "--filter", label] + (["-a"] if kind == "container" else []))
        assert not left.stdout.strip(), f"{kind}s of {project} left behind: {left.stdout.split()}"


# ------------------------------------------------------------------------------------------------ Swarm
@pytest.fixture
def swarm():
    """A single-node swarm (this engine's, or one made here and left afterwards) whose node has every role."""
    info = common.docker_json("info", "--format", "{{json .Swarm}}")
    if info.get("LocalNodeState") == "active" and (not info.get("ControlAvailable") or int(info.get("Nodes") or 0) > 1):
        pytest.skip("this engine is in a swarm that is not a single-node swarm it manages")
    created = info.get("LocalNodeState") == "inactive"
    gwbridge_before = run_cmd(["docker", "network", "inspect", "docker_gwbridge"], check=False).returncode == 0
    if created:
        run_cmd(["docker", "swarm", "init", "--advertise-addr", "127.0.0.1"])
    node = run_cmd(["docker", "info", "--format", "{{.Swarm.NodeID}}"]).stdout.strip()
    labels = common.docker_json("node", "inspect", node)[0]["Spec"].get("Labels") or {}
    roles = [f"shuffledp.role.{r}" for r in ("analyzer", "shuffler", "clients")]
    added = [k for k in roles if labels.get(k) != "true"]
    if added:
        run_cmd(["docker", "node", "update", *[a for k in added for a in ("--label-add", f"{k}=true")], node])
    try:
        yield node
    finally:
        if added and not created:
            run_cmd(["docker", "node", "update", *[a for k in added for a in ("--label-rm", k)], node], check=False)
        if created:
            run_cmd(["docker", "swarm", "leave", "--force"], timeout=120)
            if not gwbridge_before:
                run_cmd(["docker", "network", "rm", "docker_gwbridge"], check=False)
            state = run_cmd(["docker", "info", "--format", "{{.Swarm.LocalNodeState}}"]).stdout.strip()
            assert state == "inactive", f"the swarm this test created was not left: {state}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_swarm_runs_devices_in_fleets_and_a_revoked_device_is_refused(image, swarm, tmp_path: Path):
    stack = f"sdpdev{os.getpid() % 10000}{int(time.time()) % 1000}"
    pki, config = tmp_path / "pki", tmp_path / "devices.toml"
    config.write_text(_config())
    sh = ["bash", str(common.DEPLOY / "swarm.sh"), "--stack", stack, "--pki", str(pki), "--config", str(config)]
    sh += ["--timeout", str(UP_TIMEOUT_S)]
    label = f"label=com.docker.stack.namespace={stack}"
    times: dict[str, float] = {}

    def task(service: str) -> str:
        out = run_cmd(["docker", "ps", "-q", "--filter", f"label=com.docker.swarm.service.name={stack}_{service}"])
        assert len(out.stdout.split()) == 1, f"{service}: {out.stdout}"
        return out.stdout.strip()

    try:
        t0 = time.monotonic()
        run_cmd([*sh, "--fleets", str(FLEETS), "up"], timeout=UP_TIMEOUT_S + 180)
        times["up"] = time.monotonic() - t0
        replicas = run_cmd(
            ["docker", "service", "inspect", "--format", "{{.Spec.Mode.Replicated.Replicas}}", f"{stack}_clients"]
        )
        assert replicas.stdout.strip() == "0"
        # each fleet task: the CA certificate and one secret with its own devices' keys, split into /tmp/pki
        for j in range(FLEETS):
            cid = task(f"fleet-{j}")
            assert sorted(run_cmd(["docker", "exec", cid, "ls", "/pki"]).stdout.split()) == ["ca.crt", "devices.pem"]
            held = run_cmd(["docker", "exec", cid, "ls", "/tmp/pki"]).stdout.split()
            assert set(held) == {"ca.crt", *_fleet_devices(j)}, held
        t0 = time.monotonic()
        metrics = _run(sh, config, tmp_path / "run1")
        times["run"] = time.monotonic() - t0
        assert [m["contributors"] for m in metrics] == [DEVICES] * 3, metrics

        shuffler = task("shuffler")
        t0 = time.monotonic()
        out = run_cmd([*sh, "revoke", f"client-{REVOKED}"], timeout=180)
        assert "published crl.pem" in out.stderr, out.stderr
        fleet = f"{stack}_fleet-{_fleet_of(REVOKED)}"
        run_cmd(["docker", "service", "update", "--force", "--detach=true", fleet], timeout=120)
        log = _wait_log(
            lambda: (
                run_cmd(["docker", "service", "logs", "--raw", fleet]).stdout
                + run_cmd(["docker", "service", "logs", "--raw", fleet]).stderr
            ),
            _revoked_line(f"client-{REVOKED}"),
        )
        times["revoke to refusal"] = time.monotonic() - t0
        _check_refusal(log)
        assert task("shuffler") == shuffler, "the shuffler was restarted"
        deadline = time.monotonic() + UP_TIMEOUT_S  # the fleet's new task healthy, its other devices connected
        while (
            run_cmd(
                [
                    "docker",
                    "ps",
                    "-q",
                    "--filter",
                    f"label=com.docker.swarm.service.name={fleet}",
                    "--filter",
                    "health=healthy",
                ]
            ).stdout.strip()
            == ""
        ):
            assert time.monotonic() < deadline, "the restarted fleet is not healthy"
            time.sleep(1)
        metrics = _run(sh, config, tmp_path / "run2")
        assert [m["contributors"] for m in metrics] == [DEVICES - 1] * 3, metrics
    finally:
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            run_cmd([*sh, "down", "--volumes"], timeout=240, check=False)
        times["down"] = time.monotonic() - t0
        print(
            f"\nswarm devices ({DEVICES} in {FLEETS} fleets), s: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
        )
    for kind in ("service", "secret", "config", "volume", "network"):
        left = run_cmd(["docker", kind, "ls", "-q", "--filter", label])
        assert not left.stdout.strip(), f"{kind}s of {stack} left behind: {left.stdout.split()}"
