"""The compose deployment with monitoring (issue 29 item 2): Prometheus built offline from Debian's package
(deploy/monitoring/build_prometheus.sh) scrapes the three kinds of service through the overlay
deploy/monitoring/compose.yml. A run goes to its end through deploy/compose.sh, and then Prometheus's HTTP API
answers with a metric from each service. The run's eps spent, as Prometheus scraped it, equals the ledger's, and
every query of the dashboard is valid PromQL that Prometheus evaluates.

Without a reachable engine (or compose tool) the module is skipped with one line. SHUFFLEDP_TEST_REUSE_IMAGE=1
reuses existing shuffledp:latest and shuffledp-prometheus:latest images.
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

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MONITORING = DEPLOY / "monitoring"
IMAGE, PROM_IMAGE = "shuffledp:latest", "shuffledp-prometheus:latest"
TIMEOUT_S = 900


def _unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "docker CLI not installed"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if info.returncode != 0:
        return "no Docker engine reachable"
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        return "the Prometheus image is built from Debian's package: needs apt-get and dpkg-deb"
    return None


_WHY = _unavailable()
if _WHY:
    pytest.skip(f"docker monitoring test needs a Docker engine: {_WHY}", allow_module_level=True)
pytestmark = [pytest.mark.docker, pytest.mark.timeout(TIMEOUT_S)]


def _run(cmd: list[str], timeout: float = 300, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)[:300]} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def _has(image: str) -> bool:
    return _run(["docker", "image", "inspect", image], check=False).returncode == 0


@pytest.fixture(scope="module")
def images() -> None:
    reuse = os.environ.get("SHUFFLEDP_TEST_REUSE_IMAGE") == "1"
    if not (reuse and _has(IMAGE)):
        _run(["bash", str(DEPLOY / "build_image.sh"), "--tag", IMAGE], timeout=TIMEOUT_S)
    _run(["bash", str(MONITORING / "build_prometheus.sh"), *([] if reuse else ["--force"])], timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def deployment(images, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("monitoring")
    project = f"sdpmon{os.getpid()}{int(time.time()) % 100000}"
    prom_port = common.free_port()
    env = {
        **os.environ,
        "SHUFFLEDP_COMPOSE_FILES": str(MONITORING / "compose.yml"),
        "SHUFFLEDP_PROMETHEUS_PORT": str(prom_port),
    }
    config = work / "config.toml"
    shutil.copy(DEPLOY / "example.toml", config)
    base = ["bash", str(DEPLOY / "compose.sh"), "--project", project, "--pki", str(work / "pki")]
    base += ["--port", str(common.free_port()), "--config", str(config)]

    def sh(*args: str, timeout: float = 400, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*base, *args], timeout=timeout, check=check, env=env)

    try:
        sh("up")
        sh("compose", "up", "-d", "prometheus")
        yield sh, prom_port, work
    finally:
        with contextlib.suppress(Exception):
            sh("down", "--volumes", timeout=180, check=False)
        with contextlib.suppress(Exception):
            # compose.sh down knows only its own services' files: the overlay's network and volume too
            sh("compose", "down", "--volumes", "--remove-orphans", timeout=180, check=False)


def test_prometheus_scrapes_every_service_during_a_run_and_agrees_with_the_ledger(deployment):
    sh, port, work = deployment
    for job, n in (("analyzer", 1), ("shuffler", 1), ("client-node", 2)):
        up = common.prometheus_wait(port, f'up{{job="{job}"}} == 1', want=n)
        assert len(up) == n, (job, up)
    out = work / "results"
    sh("run", "--out", str(out), timeout=600)
    ledger = json.loads((out / "ledger.json").read_text())
    run_id, eps = ledger["run"]["run_id"], ledger["totals"]["eps_spent"]

    # a metric from each service, as Prometheus stored it. Prometheus's last scrape may predate the run's end (it
    # scrapes every 5 s; the run's 13 rounds take about as long): wait for a scrape that shows the run COMPLETED (the
    # ledger closes every round before it says so), then compare. The eps spent reaching the ledger's is no sign of
    # the end: the rounds compose in parallel, so it is final from the first committed round on (CI saw 1 committed
    # round of 13 in Prometheus after waiting for it)
    common.prometheus_wait(port, 'shuffledp_analyzer_runs{state="COMPLETED"} == 1')
    spent = common.prometheus_query(port, f'shuffledp_analyzer_epsilon_spent{{run_id="{run_id}"}}')
    assert float(spent[0]["value"][1]) == pytest.approx(eps, rel=1e-9)
    rounds = f'shuffledp_analyzer_rounds_total{{run_id="{run_id}",outcome="committed"}}'
    committed = common.prometheus_query(port, rounds)
    assert int(float(committed[0]["value"][1])) == sum(1 for r in ledger["rounds"] if r["state"] == "committed")
    streams = common.prometheus_wait(port, "shuffledp_shuffler_open_streams")
    assert float(streams[0]["value"][1]) == 2
    users = common.prometheus_wait(port, "shuffledp_node_users", want=2)
    assert all(float(u["value"][1]) > 0 for u in users)

    # every query of the dashboard is valid PromQL (Prometheus evaluates it) and no series carries a user id
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$run_id", ".*")
            common.prometheus_query(port, expr)
    every = common.prometheus_query(port, '{__name__=~"shuffledp_.+"}')
    assert every and "n0-u" not in json.dumps(every) and "n1-u" not in json.dumps(every)
