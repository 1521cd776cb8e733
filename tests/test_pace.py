"""Pace steering ([deployment] min_round_seconds): a round starts at least that long after the previous one started,
so a run lasts a set time whatever the machine's speed (the multi-engine fault tests need runs that outlast a host's
loss and return); a cancel ends the wait at once. Real services over loopback sockets, the ledger read from its
SQLite file."""

from __future__ import annotations

import sqlite3
import time

import grpc
from _runs import digits_pgd, digits_pgd_two_nodes, local_run, wait_first_round, wait_for_run
from shuffledp.clients.node import start_node
from shuffledp.services.analyzer import LEDGER_FILE

from shuffledp.config import parse_config
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

USERS = 40


def _reserved_at(tmp_path, run_id: str) -> list[float]:
    """The rounds' reservation times, from the analyzer's ledger file (local_run's state directory)."""
    with sqlite3.connect(tmp_path / "state" / LEDGER_FILE) as db:
        rows = db.execute("SELECT reserved_at FROM rounds WHERE run_id=? ORDER BY round", (run_id,))
        return [r[0] for r in rows]


def test_rounds_start_at_least_min_round_seconds_apart(tmp_path):
    pace = 0.5
    with local_run(tmp_path, digits_pgd(4, USERS, f"min_round_seconds = {pace}"), 1) as run:
        st = wait_for_run(run.stub, run.run_id, timeout=60)
        assert st.state == pb.COMPLETED, st.message
        starts = _reserved_at(tmp_path, run.run_id)
        assert len(starts) == 4
        # a round of 40 users takes ~0.02 s here: without the pace they start ~0.02 s apart; the 0.02 s below the
        # pace is the time between the ledger's timestamp and the loop's clock reading of the same reservation
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert min(gaps) >= pace - 0.02, gaps


def test_a_cancel_ends_the_pace_wait_at_once(tmp_path):
    with local_run(tmp_path, digits_pgd(4, USERS, "min_round_seconds = 600"), 1) as run:
        deadline = time.monotonic() + 60
        while not _reserved_at(tmp_path, run.run_id):
            assert time.monotonic() < deadline, "no round in 60 s"
            time.sleep(0.05)
        time.sleep(0.3)  # the first round ends; the loop waits for the second's start
        t0 = time.monotonic()
        run.stub.CancelRun(pb.RunRef(run_id=run.run_id))
        st = wait_for_run(run.stub, run.run_id, timeout=30)
        # bounded by the round in flight (its deadline) if the cancel came before it ended, never by the 600 s pace
        assert st.state == pb.CANCELLED and time.monotonic() - t0 < 30, (st.state, st.message)
        assert len(_reserved_at(tmp_path, run.run_id)) == 1


def test_users_who_leave_during_the_pace_wait_are_waited_for(tmp_path):
    """The next round's population check asks the shuffler after the pace wait: the population asked after the
    previous round (issue 30's probe) is older than the wait. A node that stops during the wait and comes back
    within population_wait_seconds has its users in the next round (before, that round ran at the end of the wait
    on the old answer, without them)."""
    pace = 3.0
    toml = digits_pgd_two_nodes(3, USERS, f"min_round_seconds = {pace}\npopulation_wait_seconds = 60")
    with local_run(tmp_path, toml, 2) as run:
        stub, run_id = run.stub, run.run_id
        t_round0 = wait_first_round(run)  # the analyzer waits for the pace now (3 s from round 0's start)
        deadline = t_round0 + 60
        run.nodes[1].stop()
        with grpc.insecure_channel(run.shuffler_address) as shuffler_channel:
            population = pbg.ShufflerStub(shuffler_channel).GetPopulation
            while population(pb.PopulationRequest(run_id=run_id)).admitted_users > USERS // 2:
                assert time.monotonic() < deadline, "the shuffler still counts the stopped node's users"
                time.sleep(0.01)
        assert time.monotonic() - t_round0 < pace / 2, "the node stopped too late for this test"
        time.sleep(max(0.0, t_round0 + pace + 0.5 - time.monotonic()))  # past the pace: round 1 is due
        cfg = parse_config(toml)
        run.nodes[1] = start_node("n1", cfg, 1, 2, run.shuffler_address, rng=make_rng(21))
        st = wait_for_run(stub, run_id, timeout=120)
        assert st.state == pb.COMPLETED, st.message
        contributors = [m.contributors for m in st.metrics if m.round >= 0]
        assert contributors == [USERS, USERS, USERS], contributors
