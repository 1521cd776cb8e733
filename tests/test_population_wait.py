"""How long a run waits for missing users ([deployment] population_wait_seconds): once per loss, not once per round.

A fully interactive run invites every user of its population. When a node goes away mid-run, the analyzer waits up
to population_wait_seconds for its users to come back (after a shuffler restart every node reconnects with its own
backoff), then goes on without them. It must not wait again at every later round for users it has already given up
on: before, a node lost for good cost the whole wait (60 s by default) at each remaining round. Real services over
loopback sockets.
"""

from __future__ import annotations

import time

import grpc
from _runs import digits_pgd_two_nodes, local_run, wait_first_round, wait_for_run
from shuffledp.clients.node import start_node
from shuffledp.services.shuffler import start_shuffler

from shuffledp.config import parse_config
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

WAIT_S = 2.0
DEADLINE_S = 3.0
ROUNDS = 40
USERS = 60


def test_a_lost_node_costs_one_wait_and_the_run_goes_on_without_its_users(tmp_path):
    # a round in flight when the node stops waits for its users until the round's deadline (documented), once
    deployment = f"population_wait_seconds = {WAIT_S}\nround_deadline_seconds = {DEADLINE_S}"
    with local_run(tmp_path, digits_pgd_two_nodes(ROUNDS, USERS, deployment), 2) as run:
        stub, run_id = run.stub, run.run_id
        deadline = time.monotonic() + 60
        while len(stub.GetRunStatus(pb.RunRef(run_id=run_id)).metrics) < 3:
            assert time.monotonic() < deadline, "no 3 rounds in 60 s"
            time.sleep(0.01)
        run.nodes[1].stop()
        t0 = time.monotonic()
        st = wait_for_run(stub, run_id, timeout=ROUNDS * WAIT_S + 60)
        after_loss = time.monotonic() - t0
        assert st.state == pb.COMPLETED, st.message
        rounds = [m for m in st.metrics if m.round >= 0]
        assert len(rounds) == ROUNDS
        # the run went on with the other node's users (each node hosts half)
        assert [m.contributors for m in rounds][-1] == USERS // 2, [m.contributors for m in rounds]
        # one wait for the lost users, then rounds at their own pace: well below a wait per remaining round
        # (which took (ROUNDS - 3) * WAIT_S = 74 s before); the bound leaves 10 s for a loaded machine
        assert WAIT_S <= after_loss < WAIT_S + DEADLINE_S + 10, (
            after_loss,
            [(m.round, m.contributors, round(m.seconds, 2)) for m in rounds],
        )


def test_the_probe_asked_after_a_round_is_the_next_rounds_check_and_a_failed_one_is_asked_again(tmp_path):
    """Issue 30: the analyzer asks GetPopulation once a round is applied (answered while it writes the round) and
    the next round's check uses that answer instead of a round trip of its own; a probe that failed (the shuffler
    gone meanwhile) counts as one failed attempt: the check asks afresh, it never waits on the failed one again."""
    from shuffledp.services.ledger import Ledger
    from shuffledp.services.run_manager import RunManager, _Live

    shuffler, sport = start_shuffler("127.0.0.1:0", rng=make_rng(5))
    live_channel = grpc.insecure_channel(f"127.0.0.1:{sport}")
    dead_channel = grpc.insecure_channel("127.0.0.1:1")  # nothing listens there
    try:
        stub = pbg.ShufflerStub(live_channel)
        asked: list[str] = []
        real = stub.GetPopulation
        stub.GetPopulation = lambda *a, **kw: asked.append("call") or real(*a, **kw)
        stub.GetPopulation.future = real.future
        ledger = Ledger(tmp_path / "ledger.sqlite")
        ledger.create_run("r", "", state="RUNNING")
        manager = RunManager(ledger, stub)
        live = _Live()
        # answered: the check takes it and asks nothing more
        live.probe = real.future(pb.PopulationRequest(run_id="r"), timeout=10)
        assert manager._await_shuffler("r", live) and asked == [] and live.probe is None
        # failed (UNAVAILABLE): one failed attempt, then a fresh question answers
        live.probe = pbg.ShufflerStub(dead_channel).GetPopulation.future(pb.PopulationRequest(run_id="r"), timeout=10)
        t0 = time.monotonic()
        assert manager._await_shuffler("r", live) and asked == ["call"] and live.probe is None
        assert time.monotonic() - t0 < 5  # one backoff step (~0.5 s), not a wait on the failed probe
        assert "reachable again" in ledger.run("r")["message"]  # the operator saw the outage and its end
    finally:
        live_channel.close()
        dead_channel.close()
        shuffler.stop(0)


def test_a_sequential_round_waits_for_fresh_users_of_a_node_that_went_away(tmp_path):
    """The shuffler knows connected users only: with a node away (restarting, or every node after a shuffler
    restart) a sequential round found too few fresh users, was refused RESOURCE_EXHAUSTED and the run ended
    COMPLETED "no fresh cohort left" with the node's fresh users unused. Now the round waits for a cohort of fresh
    users (up to population_wait_seconds, once, as fully interactive rounds wait for theirs). 40 users, cohorts of
    20: after round 0 the node left holds ~10 fresh users."""
    pace, users = 3.0, 40
    toml = digits_pgd_two_nodes(2, users, f"min_round_seconds = {pace}\npopulation_wait_seconds = 60")
    toml = toml.replace('kind = "fully_interactive"\nrounds = 2', 'kind = "sequential"\ncohort_size = 20')
    with local_run(tmp_path, toml, 2) as run:
        stub, run_id = run.stub, run.run_id
        t_round0 = wait_first_round(run)  # the analyzer waits for the pace now (3 s from round 0's start)
        run.nodes[1].stop()
        time.sleep(max(0.0, t_round0 + pace + 1.0 - time.monotonic()))  # round 1 is due, its check has found 10
        assert "fresh users connected" in stub.GetRunStatus(pb.RunRef(run_id=run_id)).message
        run.nodes[1] = start_node("n1", parse_config(toml), 1, 2, run.shuffler_address, rng=make_rng(21))
        st = wait_for_run(stub, run_id, timeout=120)
        assert st.state == pb.COMPLETED and st.message == "", st.message
        assert [(m.released, m.contributors) for m in st.metrics if m.round >= 0] == [(True, 20), (True, 20)]
