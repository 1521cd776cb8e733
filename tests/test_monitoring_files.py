"""The monitoring files of the compose deployment (issue 29 item 2) agree with what the services expose: every metric
the dashboard queries is one a service's registry has (read from the real registries over real service objects),
Prometheus scrapes each service of the overlay on the port the overlay gives it, and promtool (Debian's
`prometheus` package) accepts the configuration when it is installed. The deployment itself runs in
tests/test_docker_monitoring.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from shuffledp.clients.node import NodeCore, UserShard
from shuffledp.services.ledger import Ledger
from shuffledp.services.run_manager import RunManager
from shuffledp.services.shuffler_state import ShufflerState

from shuffledp.observability.metrics import analyzer_registry, node_registry, shuffler_registry

MONITORING = Path(__file__).resolve().parents[1] / "deploy" / "monitoring"
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def _exposed(tmp_path: Path) -> set[str]:
    """Names of every metric family the three services' registries expose."""
    manager = RunManager(Ledger(tmp_path / "ledger.sqlite"), shuffler=None)
    shard = UserShard(["a", "b"], np.zeros((2, 1, 3)), np.zeros((2, 1)))
    node = SimpleNamespace(core=NodeCore("client-0", shard), connected=threading.Event())
    registries = (analyzer_registry(manager), shuffler_registry(ShufflerState()), node_registry(node))
    return {family.name for r in registries for family in r.collect()}


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_every_metric_on_the_dashboard_is_exposed_by_a_service(tmp_path):
    exposed = _exposed(tmp_path)
    assert {"shuffledp_analyzer_epsilon_spent", "shuffledp_shuffler_open_streams", "shuffledp_node_users"} <= exposed
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {name for e in exprs for name in re.findall(r"shuffledp_[a-z_]+", e)}
    missing = sorted(n for n in used if n not in exposed and _family(n) not in exposed)
    assert not missing, f"the dashboard queries metrics no service exposes: {missing}"
    # and it covers what the issue asks to see per run: rounds, eps spent vs limit, refusals by reason, latency
    for name in (
        "shuffledp_analyzer_rounds_total",
        "shuffledp_analyzer_epsilon_spent",
        "shuffledp_analyzer_epsilon_limit",
        "shuffledp_analyzer_user_refusals_total",
        "shuffledp_analyzer_round_duration_seconds_bucket",
    ):
        assert name in used, name


def test_prometheus_scrapes_each_service_of_the_overlay_on_its_metrics_port():
    overlay = (MONITORING / "compose.yml").read_text()
    port = re.search(r'SHUFFLEDP_METRICS_PORT: "(\d+)"', overlay).group(1)
    services = set(re.findall(r"^  (analyzer|shuffler|client-\d+):$", overlay, flags=re.M))
    config = (MONITORING / "prometheus.yml").read_text()
    targets = set(re.findall(r'"([a-z0-9-]+):(\d+)"', config))
    assert targets == {(s, port) for s in services}
    assert services >= {"analyzer", "shuffler", "client-0", "client-1"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_configuration():
    proc = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(MONITORING / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
