"""Issue 44 item 1: a node over the shuffler's capacity is refused with a clear reason, and the run's output names it.

Before, 60 nodes against a shuffler that admitted 48 streams: the other 12 retried every 0.1 s unseen, the run waited
its whole population window and trained on 480 of the 600 users, and nothing in the output said so. Real processes,
mTLS: `shuffledp serve shuffler --max-nodes 48`, an analyzer, a fleet process of 60 single-user device nodes, and the
operator's `shuffledp run --analyzer`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import log_text, serve, stop

from shuffledp.security import pki
from shuffledp.transport import tls
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(240)

NODES, CAPACITY = 60, 48


def _toml() -> str:
    return f"""
[data]
dataset = "digits"
max_users = {NODES}
[privacy]
eps = 8.0
[schedule]
rounds = 1
[deployment]
client_nodes = {NODES}
users_per_node = 1
population_wait_seconds = 8
round_deadline_seconds = 10
"""


def test_nodes_over_the_capacity_are_named_with_the_reason_in_the_runs_output(tmp_path: Path) -> None:
    pki_dir = tmp_path / "pki"
    pki.init_pki(pki_dir, client_nodes=NODES)
    config = tmp_path / "run.toml"
    config.write_text(_toml())
    procs = []
    try:
        shuffler, sport = serve(
            tmp_path,
            "shuffler",
            ["shuffler", "--pki", str(pki_dir), "--state-dir", str(tmp_path / "sh"), "--max-nodes", str(CAPACITY)],
        )
        procs.append(shuffler)
        shuffler_addr = f"127.0.0.1:{sport}"
        analyzer, aport = serve(
            tmp_path,
            "analyzer",
            ["analyzer", "--pki", str(pki_dir), "--shuffler", shuffler_addr, "--state-dir", str(tmp_path / "an")],
        )
        procs.append(analyzer)
        fleet, _ = serve(
            tmp_path,
            "fleet",
            ["fleet", "--pki", str(pki_dir), "--shuffler", shuffler_addr, "--config", str(config)]
            + ["--num-nodes", str(NODES), "--count", str(NODES), "--state-dir", str(tmp_path / "nodes")],
        )
        procs.append(fleet)
        res = subprocess.run(
            [sys.executable, "-m", "shuffledp.cli", "run", str(config), "--analyzer", f"127.0.0.1:{aport}"]
            + ["--pki", str(pki_dir), "--out", str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=180,
        )
        said = res.stdout + res.stderr
        assert res.returncode == 0, said
        lines = [line for line in said.splitlines() if "the shuffler refused 12 nodes: capacity (" in line]
        assert lines, said
        named = set(re.findall(r"client-\d+", lines[-1].split("the shuffler refused", 1)[1]))
        assert len(named) == NODES - CAPACITY, lines[-1]
        assert f"the shuffler's capacity is {CAPACITY} nodes" in lines[-1], lines[-1]
        # the shuffler's own view agrees: the 12 named are the ones not connected, each refused for capacity
        channel = tls.ChannelSecurity(pki_dir, pki.ROLE_ANALYZER, "analyzer").channel(
            shuffler_addr, server_name="shuffler"
        )
        with channel:
            pop = pbg.ShufflerStub(channel).GetPopulation(pb.PopulationRequest(), timeout=10)
        assert pop.connected_nodes == CAPACITY
        assert {r.node for r in pop.refused_nodes} == named and {r.reason for r in pop.refused_nodes} == {"capacity"}
        assert all(r.calls >= 1 for r in pop.refused_nodes)
    finally:
        stop(*procs)
    # a refused device backs off: no flood of retries in the fleet's log (it retried every 0.1 s before)
    refusals = log_text(tmp_path, "fleet").count("RESOURCE_EXHAUSTED")
    assert refusals <= 12 * 10, refusals


def test_max_nodes_must_be_positive(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "serve", "shuffler", "--insecure", "--max-nodes", "0"]
        + ["--state-dir", str(tmp_path / "sh")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and "--max-nodes must be >= 1, got 0" in res.stderr, res.stderr
    assert not (tmp_path / "sh").exists()
