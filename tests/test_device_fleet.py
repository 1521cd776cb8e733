"""Device nodes (issue 44 item 2): single-user client nodes, K of them on one event loop (clients/device.py), over real
sockets with mTLS (each device its own certificate) against a shuffler and an analyzer that sign and check as in a
deployment; every device's spend in its own SQLite file. Each user's record, read back from its device's store,
is the ledger's guarantee for it; a device that vanishes after its check-in is charged for no more than it sent.
Devices also run as separate OS processes (`shuffledp serve fleet --count 1`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from _procs import log_text, serve, stop
from _runs import run_cli
from shuffledp.clients.device import start_fleet
from shuffledp.clients.node import start_node
from shuffledp.clients.spend_store import DeviceSpendStore, SqliteSpendStore
from shuffledp.services.analyzer import LEDGER_FILE, start_analyzer
from shuffledp.services.ledger import Ledger
from shuffledp.services.shuffler import serve_shuffler
from shuffledp.services.shuffler_state import ShufflerState

from shuffledp.accountants.pvec_pld import epsilon_of_rounds
from shuffledp.cli.run import operator_channel
from shuffledp.config import parse_config
from shuffledp.security import pki
from shuffledp.security.rng import make_rng
from shuffledp.transport import tls
from shuffledp.transport.spec_signing import SpecSigner, SpecVerifier
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg


def _toml(users: int, rounds: int, extra: str = "") -> str:
    """The default protocol (calibrated PVEC with check-in, PGD) on digits, one user per node."""
    return f"""
[data]
dataset = "digits"
max_users = {users}
[privacy]
eps = 8.0
[schedule]
rounds = {rounds}
[deployment]
client_nodes = {users}
users_per_node = 1
population_wait_seconds = 3
round_deadline_seconds = 10
{extra}"""


class Services:
    """A shuffler (its default capacity, 10^4 nodes) and an analyzer, mTLS with role checks and signed specs, from a
    PKI with a certificate per device: in this process, or with processes=True each a `shuffledp serve` process of
    its own (the devices' fleet stays in this process, for its drop and delay hooks)."""

    def __init__(self, tmp: Path, devices: int, processes: bool = False) -> None:
        self.tmp, self.pki = tmp, tmp / "pki"
        pki.init_pki(self.pki, client_nodes=devices)
        self.procs: list = []
        if processes:
            sec = ["--pki", str(self.pki)]
            proc, port = serve(tmp, "shuffler", ["shuffler", *sec, "--state-dir", str(tmp / "sh")])
            self.procs.append(proc)
            self.address = f"127.0.0.1:{port}"
            proc, aport = serve(
                tmp, "analyzer", ["analyzer", *sec, "--shuffler", self.address, "--state-dir", str(tmp / "state")]
            )
            self.procs.append(proc)
            self.shuffler = self.analyzer = self.state = None
            channel = tls.ChannelSecurity(self.pki, pki.ROLE_ANALYZER, "analyzer").channel(
                self.address, server_name="shuffler"
            )
            self._population = pbg.ShufflerStub(channel).GetPopulation
        else:
            self.state = ShufflerState(rng=make_rng(3))
            creds = tls.server_credentials(self.pki, "shuffler", "shuffler")
            roles = [tls.RoleInterceptor(tls.DEFAULT_POLICY)]
            self.shuffler, port = serve_shuffler(self.state, "127.0.0.1:0", creds, [r.aio() for r in roles])
            self.address = f"127.0.0.1:{port}"
            self.analyzer, aport = start_analyzer(
                "127.0.0.1:0",
                self.address,
                tmp / "state",
                tls.server_credentials(self.pki, "analyzer", "analyzer"),
                tls.channel_credentials(self.pki, "analyzer", "analyzer"),
                roles,
                SpecSigner.from_pki(self.pki, "analyzer"),
            )
        self.channel = operator_channel(f"127.0.0.1:{aport}", self.pki)
        self.stub = pbg.AnalyzerStub(self.channel)

    def connected_nodes(self) -> int:
        if self.state is not None:
            return self.state.population("").connected_nodes
        return self._population(pb.PopulationRequest(), timeout=10).connected_nodes

    def wait_connected(self, nodes: int, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while (connected := self.connected_nodes()) < nodes:
            assert time.monotonic() < end, f"{connected} of {nodes} devices connected"
            time.sleep(0.05)

    def start_run(self, toml: str) -> str:
        self.run_id = self.stub.CreateRun(pb.CreateRunRequest(config_toml=toml)).run_id
        self.stub.StartRun(pb.RunRef(run_id=self.run_id))
        return self.run_id

    def wait(self, timeout: float = 50) -> pb.RunStatus:
        end = time.monotonic() + timeout
        while (st := self.stub.GetRunStatus(pb.RunRef(run_id=self.run_id))).state in (pb.CREATED, pb.RUNNING):
            assert time.monotonic() < end, f"run not finished in {timeout} s: {st.rounds_done} rounds"
            time.sleep(0.05)
        return st

    def records(self, devices: range) -> dict[int, tuple[float, Counter]]:
        """Device i's user's (eps by basic composition, history of round noise keys), from its own SQLite file."""
        out = {}
        for i in devices:
            eps, _, history = DeviceSpendStore(self.tmp / "nodes" / f"client-{i}.spend.sqlite").load([f"n{i}-u{i}"])
            out[i] = (float(eps[0]), Counter(dict(history[0] or {})))
        return out

    def committed(self) -> list[dict]:
        rows = Ledger(self.tmp / "state" / LEDGER_FILE).rounds(self.run_id)
        return [r for r in rows if r["state"] == "committed"]

    def close(self) -> None:
        self.channel.close()
        if self.procs:
            stop(*self.procs)
            return
        self.analyzer.stop(0)
        self.shuffler.stop(0)


def _open_files() -> list[str]:
    """What this process's file descriptors name (Linux)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return out


def _node_records(services: Services, nodes: int, users: int) -> dict[int, tuple[float, Counter]]:
    """User j's record on ordinary node j mod nodes (its SQLite store), as Services.records reads a device's."""
    out = {}
    for i in range(nodes):
        ids = [f"n{i}-u{j}" for j in range(i, users, nodes)]
        eps, _, history = SqliteSpendStore(services.tmp / "nodes" / f"client-{i}.spend.sqlite").load(ids)
        for u, j in enumerate(range(i, users, nodes)):
            out[j] = (float(eps[u]), Counter(dict(history[u] or {})))
    return out


def test_a_fleet_of_single_user_devices_completes_a_check_in_run_and_each_user_records_the_ledgers_guarantee(
    tmp_path: Path,
) -> None:
    """40 devices (40 certificates, 40 channels, 40 SQLite stores) in one fleet complete 3 rounds of the default
    protocol; each user's record, read from its device's store, is what the same run records for that user on two
    ordinary nodes of 20 users each (basic total and history, exactly), and its history composes to the ledger's
    eps_spent at the run's delta, one charge per round."""
    k, rounds = 40, 3
    devices = Services(tmp_path / "devices", k)
    fleet = start_fleet(
        parse_config(_toml(k, rounds)), 0, k, k, devices.address, pki_dir=devices.pki, state_dir=devices.tmp / "nodes"
    )
    try:
        devices.wait_connected(k)
        assert not list((devices.tmp / "nodes").iterdir())  # reading a device's empty record creates no file
        devices.start_run(_toml(k, rounds))
        st = devices.wait()
        assert st.state == pb.COMPLETED, st.message
        assert [(m.checked_in, m.contributors) for m in st.metrics] == [(k, k)] * rounds
        assert [r["contributors"] for r in devices.committed()] == [k] * rounds
        on_devices = devices.records(range(k))
        assert not [f for f in _open_files() if ".spend.sqlite" in f]  # the stores are open only while charging
        assert sum(d.core.rounds_joined for d in fleet.devices) == k * rounds
        assert all(not d.core.refusals for d in fleet.devices)
    finally:
        fleet.stop()
        devices.close()

    # the same run on two ordinary nodes (ClientNodeHandle, 20 users each)
    ordinary = Services(tmp_path / "nodes", 2)
    two = _toml(k, rounds).replace(f"client_nodes = {k}\nusers_per_node = 1", "client_nodes = 2")
    nodes = [
        start_node(
            f"client-{i}",
            parse_config(two),
            i,
            2,
            ordinary.address,
            channel_credentials=tls.channel_credentials(ordinary.pki, pki.ROLE_CLIENT_NODE, f"client-{i}"),
            server_credentials=tls.server_credentials(ordinary.pki, pki.ROLE_CLIENT_NODE, f"client-{i}"),
            state_dir=ordinary.tmp / "nodes",
            spec_verifier=SpecVerifier.from_pki(ordinary.pki),
        )
        for i in range(2)
    ]
    try:
        ordinary.wait_connected(2)
        ordinary.start_run(two)
        st2 = ordinary.wait()
        assert st2.state == pb.COMPLETED and st2.budget.eps_spent == st.budget.eps_spent, st2.message
        on_nodes = _node_records(ordinary, 2, k)
    finally:
        for node in nodes:
            node.stop()
        ordinary.close()

    assert on_devices == on_nodes  # each user's (eps, history), exactly
    for eps, history in on_devices.values():
        assert sum(history.values()) == rounds  # one verified charge per round
        assert epsilon_of_rounds(history, st.budget.delta_limit) == st.budget.eps_spent  # the ledger's accountant
        assert eps >= st.budget.eps_spent  # basic composition: an upper bound


def test_a_device_that_vanishes_after_its_check_in_is_charged_for_what_it_sent_only(tmp_path: Path) -> None:
    """30 devices; device 7 vanishes once its check-in to round 1 reached the shuffler (switched off mid-round).
    Round 1 releases from the 29 who reported (report_fraction 0.9), round 2 goes on without it. Device 7's store
    holds its round-0 charge only (a check-in costs nothing; it sent nothing after); every other user is charged once
    per round; the charges in all stores are exactly the contributions the ledger used (none twice, none used
    uncharged)."""
    k, rounds, gone = 30, 3, 7
    # the round of the dropout ends at its deadline (the shuffler waits for the 30th report until then)
    toml = _toml(k, rounds, "[privacy.pvec]\nreport_fraction = 0.9\n").replace(
        "deadline_seconds = 10", "deadline_seconds = 3"
    )
    services = Services(tmp_path, k)
    fleet = start_fleet(
        parse_config(toml), 0, k, k, services.address, pki_dir=services.pki, state_dir=tmp_path / "nodes"
    )
    try:
        services.wait_connected(k)
        fleet.drop_after_check_in(gone, 1)
        services.start_run(toml)
        st = services.wait()
        assert st.state == pb.COMPLETED, st.message
        assert [(m.checked_in, m.contributors) for m in st.metrics] == [(k, k), (k, k - 1), (k - 1, k - 1)]
        assert fleet.devices[gone].task is None  # it ended; the others are still connected
        assert fleet.connected() == k - 1
        records = services.records(range(k))
    finally:
        fleet.stop()
        services.close()
    assert sum(records[gone][1].values()) == 1
    assert all(sum(h.values()) == rounds for i, (_, h) in records.items() if i != gone)
    used = sum(r["contributors"] for r in services.committed())
    assert sum(sum(h.values()) for _, h in records.values()) == used == k + 2 * (k - 1)


def test_devices_run_as_separate_processes_next_to_a_fleet(tmp_path: Path) -> None:
    """Devices 0-2 each in its own OS process (`shuffledp serve fleet --count 1`, its own certificate and store),
    devices 3-11 in a fleet in this process: 2 rounds complete with all 12 users, and the processes' users record
    what the fleet's users record."""
    k, rounds = 12, 2
    toml = _toml(k, rounds)
    services = Services(tmp_path, k)
    config = tmp_path / "run.toml"
    config.write_text(toml)
    procs = []
    fleet = None
    try:
        for i in range(3):
            argv = ["fleet", "--pki", str(services.pki), "--shuffler", services.address, "--config", str(config)]
            argv += ["--num-nodes", str(k), "--first-index", str(i), "--count", "1"]
            procs.append(serve(tmp_path, f"device-{i}", [*argv, "--state-dir", str(tmp_path / "nodes")])[0])
        fleet = start_fleet(
            parse_config(toml), 3, k - 3, k, services.address, pki_dir=services.pki, state_dir=tmp_path / "nodes"
        )
        services.wait_connected(k)
        services.start_run(toml)
        st = services.wait()
        assert st.state == pb.COMPLETED, st.message
        assert [m.contributors for m in st.metrics] == [k] * rounds
        records = services.records(range(k))
    finally:
        if fleet is not None:
            fleet.stop()
        stop(*procs)
        services.close()
    assert all(r == records[0] for r in records.values())  # every user, in a process of its own or not, alike
    assert sum(records[0][1].values()) == rounds
    assert "Traceback" not in log_text(tmp_path, "device-0")


def test_shuffledp_run_serves_one_user_per_node_from_fleet_processes(tmp_path: Path) -> None:
    """[deployment] users_per_node = 1: `shuffledp run` starts the 12 device nodes in 2 fleet processes; each user's
    spend is in its device's own store, one charge per round. A client_nodes other than the data's number of users
    is refused before anything starts, with one line."""
    toml = _toml(12, 2).replace("population_wait_seconds = 3", "")
    ledger, metrics, _ = run_cli(tmp_path, "devices", toml)
    assert [m["contributors"] for m in metrics] == [12, 12]
    out = tmp_path / "devices"
    assert sorted(p.name for p in (out / "logs").iterdir() if p.name.startswith("fleet")) == [
        "fleet-0.log",
        "fleet-1.log",
    ]
    for i in range(12):
        _, _, history = DeviceSpendStore(out / "state" / f"client-{i}.spend.sqlite").load([f"n{i}-u{i}"])
        assert sum(history[0].values()) == 2
    bad = tmp_path / "bad.toml"
    bad.write_text(toml.replace("client_nodes = 12", "client_nodes = 11"))
    res = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "run", str(bad), "--out", str(tmp_path / "bad")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and not (tmp_path / "bad").exists()
    assert "users_per_node = 1 puts one user on each client node: client_nodes must be the data's 12 users, got 11" in (
        res.stderr
    )


def test_serve_fleet_refuses_bad_input_with_one_line_before_writing_anything(tmp_path: Path) -> None:
    """Devices outside --num-nodes, a device without its certificate: one line each, no state directory made."""
    pki.init_pki(tmp_path / "pki", client_nodes=2)
    config = tmp_path / "run.toml"
    config.write_text(_toml(3, 1))
    base = [sys.executable, "-m", "shuffledp.cli", "serve", "fleet", "--config", str(config), "--shuffler"]
    base += ["127.0.0.1:1", "--state-dir", str(tmp_path / "state"), "--num-nodes", "3"]
    cases = {
        ("--insecure", "--first-index", "2", "--count", "2"): "--first-index and --count must name nodes in "
        "[0, --num-nodes), got 2..3 of 3",
        ("--pki", str(tmp_path / "pki"), "--count", "3"): "client-2/cert.pem not found",
    }
    for argv, line in cases.items():
        res = subprocess.run([*base, *argv], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and line in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not (tmp_path / "state").exists()
