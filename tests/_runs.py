"""Shared helpers of the analyzer tests: wait for a run to end through the real operator API; `shuffledp run`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

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
