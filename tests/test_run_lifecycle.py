"""A run's life cycle under concurrent operator calls and restarts: the analyzer's RunManager over a real shuffler
(loopback gRPC), client nodes and a SQLite ledger; interleavings are made certain by wrapping the real methods."""

import sqlite3
import threading
import time

import grpc
import pytest
from shuffledp.clients.node import start_node
from shuffledp.services.analyzer import MAX_LONG_POLLS, start_analyzer
from shuffledp.services.ledger import BudgetLimit, Ledger
from shuffledp.services.run_manager import RunManager, RunStateError
from shuffledp.services.shuffler import start_shuffler

from shuffledp.config import parse_config
from shuffledp.data import load_dataset
from shuffledp.models import make_model
from shuffledp.planning import plan_run
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

WAITING = "[deployment]\npopulation_wait_seconds = 60\n"  # no node: the run waits for the population


class _Env:
    def __init__(self, tmp_path, shuffler: str):
        self.shuffler, self.path = shuffler, tmp_path / "ledger.sqlite"
        self.nodes: list = []
        self._channels: list[grpc.Channel] = []

    def manager(self) -> RunManager:
        """A RunManager on the shared ledger file (a second one: the analyzer restarted on the same state)."""
        channel = grpc.insecure_channel(self.shuffler)
        self._channels.append(channel)
        return RunManager(Ledger(self.path), pbg.ShufflerStub(channel))

    def add_nodes(self, toml: str) -> None:
        cfg = parse_config(toml)
        self.nodes += [start_node(f"n{i}", cfg, i, 2, self.shuffler, rng=make_rng(10 + i)) for i in range(2)]


@pytest.fixture
def env(tmp_path):
    shuffler, port = start_shuffler("127.0.0.1:0", rng=make_rng(3))
    e = _Env(tmp_path, f"127.0.0.1:{port}")
    yield e
    for node in e.nodes:
        node.stop()
    for channel in e._channels:
        channel.close()
    shuffler.stop(0)


def _threads(run_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"run-{run_id}"]


def _ended(manager: RunManager, run_id: str) -> dict:
    manager.wait(run_id, timeout=60)
    assert _threads(run_id) == []
    return manager.ledger.run(run_id)


def _cancel_before_the_thread_starts(manager: RunManager) -> None:
    """A cancel, from another thread, in the run's _spawn: after its registration and before its thread starts."""
    spawn = manager._spawn

    def cancelled_meanwhile(rid, *args):
        cancel = threading.Thread(target=manager.cancel_run, args=(rid,))
        cancel.start()
        cancel.join(5)
        spawn(rid, *args)

    manager._spawn = cancelled_meanwhile


def test_a_run_cancelled_while_it_waits_for_the_population_ends_cancelled(env, blobs_data):
    """The cancel cut the population wait short and the run's thread reported that as a planning failure ("no users
    admitted ... after 60 s") over the operator's CANCELLED, or before it (CancelRun answered FAILED)."""
    manager = env.manager()
    run_id = manager.create_run(blobs_data + WAITING)
    manager.start_run(run_id)
    deadline = time.monotonic() + 30
    while "0 users admitted" not in manager.view(run_id).message and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "0 users admitted" in manager.view(run_id).message  # in the wait
    manager.cancel_run(run_id)
    row = _ended(manager, run_id)
    assert (row["state"], row["message"]) == ("CANCELLED", "cancelled by the operator")


def test_of_two_concurrent_start_calls_one_starts_the_run(env, blobs_data):
    """Both calls read CREATED before either wrote RUNNING (made certain by a barrier in the ledger's read), and both
    spawned a thread for the run: two planners of one run, the loser ending it FAILED ("already has a budget")."""
    manager = env.manager()
    ledger = manager.ledger
    run_id = manager.create_run(blobs_data + WAITING)
    both_read, read = threading.Barrier(2, timeout=10), ledger.run

    def read_together(rid):
        row, me = read(rid), threading.current_thread()
        if me.name.startswith("start") and not getattr(me, "has_read", False):
            me.has_read = True
            both_read.wait()  # each caller's first read
        return row

    ledger.run = read_together
    outcomes = []

    def start():
        try:
            manager.start_run(run_id)
            outcomes.append("started")
        except RunStateError as exc:
            outcomes.append(str(exc))

    callers = [threading.Thread(target=start, name=f"start-{i}") for i in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(30)
    ledger.run = read
    assert len(_threads(run_id)) == 1
    manager.cancel_run(run_id)
    assert sorted(outcomes) == sorted(["started", f"run {run_id} is RUNNING; only a CREATED run can be started"])
    assert _ended(manager, run_id)["state"] == "CANCELLED"


def test_a_cancel_between_the_start_and_the_runs_thread_stops_the_run(env, blobs_data):
    """A cancel that looked for the run's thread after StartRun wrote RUNNING, before the thread was registered,
    found none, wrote CANCELLED and returned: the thread then planned and ran the rounds of the cancelled run."""
    toml = blobs_data + "[schedule]\nrounds = 3\n"
    env.add_nodes(toml)
    manager = env.manager()
    run_id = manager.create_run(toml)
    _cancel_before_the_thread_starts(manager)
    manager.start_run(run_id)
    row = _ended(manager, run_id)
    assert (row["state"], row["message"]) == ("CANCELLED", "cancelled by the operator")
    assert row["plan"] is None and manager.ledger.rounds(run_id) == []  # never planned, no round reserved


def test_a_cancel_during_the_pre_round_check_reserves_no_round(env, blobs_data):
    """The thread had looked at the cancel event before it asked the shuffler whether the round can go; a cancel
    during that call set the event and wrote CANCELLED only 0.1 s later, after round 0 was reserved and sent.
    The cancel is injected into that call (the shuffler's answer waits until the event is set)."""
    toml = blobs_data + "[schedule]\nrounds = 3\n"
    env.add_nodes(toml)
    manager = env.manager()
    run_id = manager.create_run(toml)
    real, fired = manager.shuffler, []

    class CancelInTheCheck:
        future = real.GetPopulation.future  # the probe sent after a round

        def __call__(self, request, **kwargs):
            if not fired and manager.ledger.run(request.run_id)["plan"]:  # planned: the check before round 0
                fired.append(threading.Thread(target=manager.cancel_run, args=(request.run_id,)))
                fired[0].start()
                assert manager._live[request.run_id].cancel.wait(10)
            return real.GetPopulation(request, **kwargs)

    class Shuffler:
        GetPopulation = CancelInTheCheck()

        def __getattr__(self, name):
            return getattr(real, name)

    manager.shuffler = Shuffler()
    manager.start_run(run_id)
    row = _ended(manager, run_id)
    fired[0].join(10)
    assert (row["state"], manager.ledger.rounds(run_id)) == ("CANCELLED", [])


def test_a_round_reserved_as_the_cancel_came_is_not_sent(env, blobs_data):
    """A cancel that returned between round 0's reservation and its ExecuteRound: the round still went to the
    shuffler after CancelRun had answered (and was charged). The cancel is injected right after the reservation."""
    toml = blobs_data + "[schedule]\nrounds = 3\n"
    env.add_nodes(toml)
    manager = env.manager()
    run_id = manager.create_run(toml)
    reserve = manager.ledger.reserve

    def cancelled_once_reserved(rid, r, event):
        projected = reserve(rid, r, event)
        cancel = threading.Thread(target=manager.cancel_run, args=(rid,))
        cancel.start()
        cancel.join(10)
        return projected

    manager.ledger.reserve = cancelled_once_reserved
    manager.start_run(run_id)
    assert _ended(manager, run_id)["state"] == "CANCELLED"
    rounds = manager.ledger.rounds(run_id)
    assert [(x["round"], x["state"], x["reason"]) for x in rounds] == [(0, "released", "cancelled before it was sent")]
    assert manager.ledger.totals(run_id).eps_spent == 0.0


def test_a_run_started_before_resume_is_not_started_again(env, blobs_data):
    """The analyzer accepted calls before it resumed the ledger's RUNNING runs: a run started in between was started
    again by resume (two threads, the second ending it FAILED "already has a budget")."""
    manager = env.manager()
    run_id = manager.create_run(blobs_data + WAITING)
    manager.recover()
    manager.start_run(run_id)
    assert manager.resume() == [] and len(_threads(run_id)) == 1
    manager.cancel_run(run_id)
    assert _ended(manager, run_id)["state"] == "CANCELLED"


def test_a_cancel_while_resume_starts_the_run_reaches_its_thread(env, blobs_data):
    """A cancel between resume's read of the RUNNING runs and the thread's start found no thread: the run was
    CANCELLED, its thread went on (waiting for the population, then planning it), and nothing could stop it."""
    first = env.manager()
    run_id = first.create_run(blobs_data + WAITING)
    first.ledger.set_state(run_id, "RUNNING", "waiting for the population")  # left so by a stopped analyzer
    manager = env.manager()
    _cancel_before_the_thread_starts(manager)
    manager.recover()
    assert manager.resume() == [run_id]
    manager.wait(run_id, timeout=10)  # the old code's thread waits its 60 s for the population
    assert _threads(run_id) == [] and manager.ledger.run(run_id)["state"] == "CANCELLED"


def _restarted(env: _Env, run_id: str) -> RunManager:
    """The analyzer stopped (the run left RUNNING: its thread never wrote an end) and started again on its ledger;
    returns the new manager once the resumed run has COMPLETED."""
    with sqlite3.connect(env.path) as db:
        db.execute("UPDATE runs SET state='RUNNING', message='' WHERE run_id=?", (run_id,))
    manager = env.manager()
    manager.recover()
    assert manager.resume() == [run_id]
    row = _ended(manager, run_id)
    assert row["state"] == "COMPLETED", row["message"]
    return manager


def test_a_stop_while_a_run_is_planned_leaves_it_resumable(env, blobs_data):
    """The plan (with the budget) and the initial checkpoint were two transactions, with theta_0's evaluation
    between them: stopped there, the run had a plan and no checkpoint, and every restart ended it FAILED
    ("AssertionError"). The checkpoint's write fails here; a restart then plans the run and completes it."""
    toml = blobs_data + "[schedule]\nrounds = 3\n"
    env.add_nodes(toml)
    manager = env.manager()
    run_id = manager.create_run(toml)
    save = manager.ledger.save_checkpoint

    def stopped(rid, r, *args):
        if r == -1:
            raise OSError("the process stopped here")
        return save(rid, r, *args)

    manager.ledger.save_checkpoint = stopped
    manager.start_run(run_id)
    assert _ended(manager, run_id)["plan"] is None  # the plan went with the checkpoint that was not written
    again = _restarted(env, run_id)
    assert [r["state"] for r in again.ledger.rounds(run_id)] == ["committed"] * 3


def test_a_run_planned_without_its_initial_checkpoint_by_an_older_version_is_resumed(env, blobs_data):
    """A ledger an older version left with a plan and no checkpoint (stopped between the two): the resumed run
    writes theta_0's checkpoint from the stored plan and completes."""
    toml = blobs_data + "[schedule]\nrounds = 3\n"
    env.add_nodes(toml)
    first = env.manager()
    run_id = first.create_run(toml)
    cfg = parse_config(toml)
    ds = load_dataset(cfg.data, cfg.model.task)
    plan = plan_run(cfg, admitted=225, unused=225, model=make_model(cfg.model.task, ds.num_features, ds.num_classes))
    first.ledger.set_budget(
        run_id, BudgetLimit(plan["eps"], plan["delta"], plan["composition"], plan["advanced_slack"]), plan
    )
    assert _restarted(env, run_id).ledger.last_checkpoint(run_id)[0] == 2


def test_long_polls_leave_threads_for_the_other_calls(env, blobs_data, tmp_path):
    """Eight long polls of an unchanged status held all eight of the analyzer's threads for their 10 s: a health
    check waited 9.5 s (compose's healthcheck gives up after 8). Beyond MAX_LONG_POLLS, a poll is answered at once."""
    analyzer, port = start_analyzer("127.0.0.1:0", env.shuffler, tmp_path / "state")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pbg.AnalyzerStub(channel)
        run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=blobs_data)).run_id
        seen = pb.RunRef(run_id=run_id, wait_ms=10_000, seen_state=pb.CREATED, seen_rounds=0, seen_message="")
        polls = [stub.GetRunStatus.future(seen, timeout=30) for _ in range(8)]
        answered_at_once = 8 - MAX_LONG_POLLS
        deadline = time.monotonic() + 5  # every poll has arrived (the waiting ones wait 10 s)
        while sum(p.done() for p in polls) < answered_at_once and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stub.GetBudget(pb.RunRef(run_id=run_id), timeout=3).eps_limit == 0.0
        done = [p for p in polls if p.done()]
        assert len(done) == answered_at_once and all(p.result().state == pb.CREATED for p in done)
        stub.CancelRun(pb.RunRef(run_id=run_id), timeout=3)  # a change: the waiting polls answer
        assert all(p.result(timeout=5).state == pb.CANCELLED for p in polls if p not in done)
    finally:
        channel.close()
        analyzer.stop(0)
