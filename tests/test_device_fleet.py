"""Device nodes (issue 44 item 2): single-user client nodes, K of them on one event loop (clients/device.py), over real
sockets with mTLS (each device its own certificate) against a shuffler and an analyzer that sign and check as in a
deployment; every device's spend in its own SQLite file. Each user's record, read back from its device's store,
is the ledger's guarantee for it; a device that vanishes after its check-in is charged for no more than it sent.
Devices also run as separate OS processes (`shuffledp serve fleet --count 1`)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from shuffledp.clients.device import start_fleet
from shuffledp.clients.node import start_node
from shuffledp.clients.spend_store import DeviceSpendStore, SqliteSpendStore
from shuffledp.services.analyzer import LEDGER_FILE, start_analyzer
from shuffledp.services.ledger import Ledger
from shuffledp.services.shuffler import RESERVED_WORKERS, serve_shuffler
from shuffledp.services.shuffler_state import ShufflerState

from shuffledp import pki, tls
from shuffledp.accountants.pvec_pld import epsilon_of_rounds
from shuffledp.config import parse_config
from shuffledp.rng import make_rng
from shuffledp.run import operator_channel
from shuffledp.spec_signing import SpecSigner, SpecVerifier
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
    """A shuffler whose stream capacity fits the devices (serve_shuffler's max_workers) and an analyzer, in this
    process, mTLS with role checks and signed specs, from a PKI with a certificate per device."""

    def __init__(self, tmp: Path, devices: int) -> None:
        self.tmp, self.pki = tmp, tmp / "pki"
        pki.init_pki(self.pki, client_nodes=devices)
        self.state = ShufflerState(rng=make_rng(3))
        creds = tls.server_credentials(self.pki, "shuffler", "shuffler")
        roles = [tls.RoleInterceptor(tls.DEFAULT_POLICY)]
        self.shuffler, port = serve_shuffler(
            self.state, "127.0.0.1:0", creds, roles, max_workers=RESERVED_WORKERS + devices + 4
        )
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

    def wait_connected(self, nodes: int, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while self.state.population("").connected_nodes < nodes:
            assert time.monotonic() < end, f"{self.state.population('').connected_nodes} of {nodes} devices connected"
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
        self.analyzer.stop(0)
        self.shuffler.stop(0)


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
        devices.start_run(_toml(k, rounds))
        st = devices.wait()
        assert st.state == pb.COMPLETED, st.message
        assert [(m.checked_in, m.contributors) for m in st.metrics] == [(k, k)] * rounds
        assert [r["contributors"] for r in devices.committed()] == [k] * rounds
        on_devices = devices.records(range(k))
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
