"""Shared helpers of the analyzer tests: wait for a run to end through the real operator API; `shuffledp run`; a run
over services started in this process (local_run)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from shuffledp.clients.node import start_node
from shuffledp.services.analyzer import start_analyzer
from shuffledp.services.shuffler import start_shuffler

from shuffledp.config import parse_config
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg


def wait_for_run(stub: pbg.AnalyzerStub, run_id: str, timeout: float = 30) -> pb.RunStatus:
    """Poll GetRunStatus until the run leaves CREATED/RUNNING; AssertionError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = stub.GetRunStatus(pb.RunRef(run_id=run_id))
        if st.state not in (pb.CREATED, pb.RUNNING):
            return st
        time.sleep(0.1)
    raise AssertionError(f"run {run_id} did not finish in {timeout} s")


def run_cli(tmp_path: Path, name: str, toml: str, quiet: bool = True) -> tuple[dict, list[dict], str]:
    """`shuffledp run` of the configuration over real local processes; (ledger export, metrics rows, stdout; with
    quiet=False the progress lines too)."""
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(toml)
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "run", str(cfg), "--out", str(out), *(["--quiet"] if quiet else [])],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ledger = json.loads((out / "ledger.json").read_text())
    return ledger, json.loads((out / "metrics.json").read_text()), proc.stdout


def digits_pgd(rounds: int, max_users: int = 60, deployment: str = "") -> str:
    """A small fully interactive PGD run on digits served by one client node (the CLI tests' run); `deployment`:
    more [deployment] lines."""
    return f"""
[data]
dataset = "digits"
max_users = {max_users}
[privacy]
eps = 8.0
[schedule]
kind = "fully_interactive"
rounds = {rounds}
learning_rate = 8.0
[deployment]
client_nodes = 1
{deployment}"""


def digits_pgd_two_nodes(rounds: int, max_users: int, deployment: str = "") -> str:
    """digits_pgd served by two client nodes, whose rounds release with one node's users (noise sized for 40 %)."""
    return (
        digits_pgd(rounds, max_users, deployment)
        .replace("client_nodes = 1", "client_nodes = 2")
        .replace("eps = 8.0", "eps = 8.0\nmin_contributors_fraction = 0.4")
    )


@dataclass
class LocalRun:
    """A run over a shuffler, an analyzer and client nodes in this process (real sockets on loopback)."""

    stub: pbg.AnalyzerStub
    run_id: str
    nodes: list  # the client nodes (clients.node.start_node), which a test may stop and replace
    shuffler_address: str


def wait_first_round(run: LocalRun, timeout: float = 60) -> float:
    """Block until the run's round 0 has ended (its metrics are in the status); returns then's time.monotonic()."""
    deadline = time.monotonic() + timeout
    while not run.stub.GetRunStatus(pb.RunRef(run_id=run.run_id)).metrics:
        assert time.monotonic() < deadline, f"no round in {timeout} s"
        time.sleep(0.01)
    return time.monotonic()


@contextmanager
def local_run(tmp_path: Path, toml: str, num_nodes: int) -> Iterator[LocalRun]:
    """Start the services and the run of `toml` (its nodes' seeds fixed); stop everything afterwards."""
    cfg = parse_config(toml)
    shuffler, sport = start_shuffler("127.0.0.1:0", rng=make_rng(3))
    analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state")
    address = f"127.0.0.1:{sport}"
    nodes = [start_node(f"n{i}", cfg, i, num_nodes, address, rng=make_rng(10 + i)) for i in range(num_nodes)]
    channel = grpc.insecure_channel(f"127.0.0.1:{aport}")
    try:
        stub = pbg.AnalyzerStub(channel)
        run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=toml)).run_id
        stub.StartRun(pb.RunRef(run_id=run_id))
        yield LocalRun(stub, run_id, nodes, address)
    finally:
        channel.close()
        for node in nodes:
            node.stop()
        analyzer.stop(0)
        shuffler.stop(0)
