"""The services of a local run (`shuffledp run`, shuffledp.cli.run.start_local_cluster) live no longer than its CLI
(issue 43 item 10): a CLI killed with SIGKILL (or by the OOM killer, or with a notebook's kernel) runs no handler, and
its services, in a process group of their own, used to finish the run, spending its whole budget, write no results
and hold their ports. Now each watches a pipe from the CLI (serve --parent-fd) and stops when it closes, the analyzer
cancelling the run first. Real processes, real signals, the analyzer's own SQLite ledger.

And their metrics ports (item 14): SHUFFLEDP_METRICS_PORT, one `shuffledp serve`'s port, gave every service of a local
run the same one (the run ended with status 3); --metrics-port BASE gives each its own."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _runs import digits_pgd

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the CLI's services through /proc"),
]

GONE_WITHIN_S = 20.0  # the services' orderly stop takes up to their servers' 5 s grace


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    return [
        int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and (_stat(int(e.name)) or ("", 0))[1] == pid
    ]


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _rows(db: Path, sql: str) -> list[tuple]:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return con.execute(sql).fetchall()
    except sqlite3.OperationalError:  # not created or not initialised yet
        return []


def test_kill_9_of_the_cli_stops_its_services_and_no_further_round_is_charged(tmp_path):
    config = tmp_path / "run.toml"
    # paced: the kill comes mid-run, just after a round was reserved and long before the next one is due (a round
    # reserved as the CLI is killed, before the analyzer sees it gone, is a round in flight at the kill)
    config.write_text(digits_pgd(30, 60, "min_round_seconds = 3.0"))
    out = tmp_path / "out"
    db = out / "state" / "ledger.sqlite"
    log = open(tmp_path / "cli.log", "wb")  # noqa: SIM115 (closed below)
    cli = subprocess.Popen(
        [sys.executable, "-m", "shuffledp.cli", "run", str(config), "--out", str(out), "--quiet"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    services: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not _rows(db, "SELECT round FROM rounds"):  # mid-run: a round was reserved
            assert cli.poll() is None, (tmp_path / "cli.log").read_text()
            assert time.monotonic() < deadline, "no round reserved in 90 s"
            time.sleep(0.05)
        services = _children(cli.pid)
        assert len(services) == 3, services  # shuffler, analyzer, one client node
        os.kill(cli.pid, signal.SIGKILL)
        killed_at = time.time()
        cli.wait()
        end = time.monotonic() + GONE_WITHIN_S
        while any(_alive(p) for p in services) and time.monotonic() < end:
            time.sleep(0.1)
        left = [p for p in services if _alive(p)]
        assert not left, f"services still running {GONE_WITHIN_S:.0f} s after the CLI was killed: {left}"
        # the ledger's clock is time.time(): no round reserved after the kill (a round in flight at the kill stays
        # reserved or charged, never released), and the run cancelled, not left RUNNING for a restart to resume
        assert _rows(db, f"SELECT round FROM rounds WHERE reserved_at > {killed_at}") == []
        ((state, message),) = _rows(db, "SELECT state, message FROM runs")
        assert (state, message) == ("CANCELLED", "cancelled: its CLI (shuffledp run) is gone")
    finally:
        log.close()
        if cli.poll() is None:
            cli.kill()
        for pid in services:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _free_ports(k: int) -> int:
    """A base port with k free ports from it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + k > 65535:
            continue
        try:
            for port in range(base, base + k):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no free ports")


def test_a_metrics_port_in_the_environment_does_not_end_a_local_run(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(digits_pgd(2, 60))
    env = {**os.environ, "SHUFFLEDP_METRICS_PORT": str(_free_ports(1))}
    proc = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "run", str(config), "--out", str(tmp_path / "out"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("shuffledp run:")] == [
        "shuffledp run: SHUFFLEDP_METRICS_PORT is one service's port (shuffledp serve): the local run's services do "
        "not take it; --metrics-port BASE gives each its own"
    ]


def _scrape(port: int, cli: subprocess.Popen, within_s: float = 60.0) -> str:
    """/metrics at `port`, once it serves: the ports are printed when the shuffler and the analyzer serve, and a
    client node may still be starting."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
                return page.read().decode()
        except OSError:
            assert cli.poll() is None and time.monotonic() < deadline, f"nothing serves metrics on port {port}"
            time.sleep(0.1)


def test_metrics_port_base_gives_each_service_of_a_local_run_its_own_port(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(digits_pgd(8, 60, "min_round_seconds = 1.0"))  # about 8 s: scraped while it runs
    base = _free_ports(3)
    cmd = [sys.executable, "-m", "shuffledp.cli", "run", str(config), "--out", str(tmp_path / "out"), "--quiet"]
    cli = subprocess.Popen([*cmd, "--metrics-port", str(base)], stdout=subprocess.PIPE, text=True)
    try:
        lines = [cli.stdout.readline(), cli.stdout.readline()]  # the start line, then the ports
        want = {"shuffler": base, "analyzer": base + 1, "client-0": base + 2}
        urls = ", ".join(f"{name} http://127.0.0.1:{port}/metrics" for name, port in want.items())
        assert lines[1] == f"shuffledp run: metrics (Prometheus): {urls}\n", lines
        prefix = {"shuffler": "shuffledp_shuffler_", "analyzer": "shuffledp_analyzer_", "client-0": "shuffledp_node_"}
        for name, port in want.items():
            assert prefix[name] in _scrape(port, cli), name
        rest, _ = cli.communicate(timeout=150)
        assert cli.returncode == 0, rest
    finally:
        if cli.poll() is None:
            cli.kill()
