"""Privacy ledger: reserve/commit/release life cycle, composition totals, refusal, durability and recovery."""

import json
import math
import sqlite3
import subprocess
import sys
from dataclasses import replace

import pytest
from shuffledp.services.ledger import (
    BudgetExceeded,
    BudgetLimit,
    Ledger,
    LedgerError,
    PrivacyEvent,
    RunEnded,
    compose_events,
    round_cost,
)

from shuffledp.accountants import ledger_accounting
from shuffledp.accountants.calibrated_pvec import calibrate_pvec
from shuffledp.accountants.events import PvecRound
from shuffledp.accountants.pvec_pld import pvec_round_epsilon
from shuffledp.mechanisms.pvec import pvec_params
from shuffledp.optimizers.pgd import pgd_round_privacy


def _event(eps=1.0, delta=1e-6, n=100, schedule="sequential"):
    return PrivacyEvent.pvec(pvec_params(eps, delta, n, 2, 1.0), n, schedule)


def _ledger(tmp_path, limit, name="l.sqlite"):
    led = Ledger(tmp_path / name)
    led.create_run("r1", "# toml")
    led.set_budget("r1", limit, {"rounds": 3})
    return led


def test_wal_mode_and_lifecycle(tmp_path):
    led = _ledger(tmp_path, BudgetLimit(1.0, 1e-6, "parallel"))
    assert led._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    led.reserve("r1", 0, _event())
    t = led.totals("r1")
    assert (t.eps_spent, t.eps_reserved) == (0.0, 1.0)  # reserved, not yet spent
    led.commit("r1", 0, 97)
    t = led.totals("r1")
    assert t.eps_spent == 1.0 and t.rounds_committed == 1
    assert led.rounds("r1")[0]["contributors"] == 97 and led.rounds("r1")[0]["event"]["contributors"] == 97
    led.reserve("r1", 1, _event())
    led.release("r1", 1, "below threshold")
    assert led.totals("r1").eps_reserved == 1.0  # a released round costs nothing
    with pytest.raises(LedgerError, match="released, not reserved"):
        led.commit("r1", 1, 5)
    with pytest.raises(LedgerError, match="already reserved"):
        led.reserve("r1", 1, _event())
    with pytest.raises(LedgerError, match="never reserved"):
        led.release("r1", 7, "x")
    with pytest.raises(LedgerError, match="unknown run"):
        led.reserve("nope", 0, _event())
    assert led.next_round("r1") == 2


def test_an_ended_run_keeps_its_first_terminal_state(tmp_path):
    """A run's thread still planning when the operator cancels wrote RUNNING (and then FAILED, for the population
    wait the cancel cut short) over CANCELLED: a later cancel then found the run going and cancelled it again."""
    led = _ledger(tmp_path, BudgetLimit(1.0, 1e-6, "parallel"))
    assert led.set_state("r1", "RUNNING", "waiting for the population", only_from="CREATED")
    assert not led.set_state("r1", "RUNNING", "started twice", only_from="CREATED")
    assert led.run("r1")["message"] == "waiting for the population"
    assert led.set_state("r1", "CANCELLED", "cancelled by the operator")
    for state in ("RUNNING", "FAILED", "COMPLETED", "CANCELLED"):
        assert not led.set_state("r1", state, "late")
    row = led.run("r1")
    assert (row["state"], row["message"]) == ("CANCELLED", "cancelled by the operator")
    with pytest.raises(RunEnded, match="has ended"):  # whatever still runs it: no round of an ended run
        led.reserve("r1", 0, _event())
    assert led.rounds("r1") == [] and led.totals("r1").eps_reserved == 0.0
    with pytest.raises(LedgerError, match="unknown run"):
        led.set_state("nope", "RUNNING")


def test_sequential_rounds_compose_in_parallel(tmp_path):
    led = _ledger(tmp_path, BudgetLimit(1.0, 1e-6, "parallel"))
    for r in range(5):  # five disjoint cohorts at (1, 1e-6) each: the run is (1, 1e-6), not (5, 5e-6)
        led.reserve("r1", r, _event())
        led.commit("r1", r, 100)
    t = led.totals("r1")
    assert (t.eps_spent, t.delta_spent) == (1.0, 1e-6)
    assert "parallel" in t.accountant


def test_advanced_composition_matches_spec_reference(tmp_path):
    # spec 000 sec 5: eps = 1, T = 15, delta = 1e-6 -> PGD total eps about 0.557, delta_tot = delta
    eps, delta, T = 1.0, 1e-6, 15
    eps_r, delta_r = pgd_round_privacy(eps, delta, T)
    led = _ledger(tmp_path, BudgetLimit(eps, delta, "advanced", delta / (T + 1)))
    for r in range(T):
        led.reserve("r1", r, _event(eps_r, delta_r, 1000, "fully_interactive"))
        led.commit("r1", r, 1000)
    t = led.totals("r1")
    expected = eps_r * math.sqrt(2 * T * math.log((T + 1) / delta)) + T * eps_r * math.expm1(eps_r)
    assert math.isclose(t.eps_spent, expected, rel_tol=1e-12)
    assert abs(t.eps_spent - 0.557) < 0.001
    assert math.isclose(t.delta_spent, delta, rel_tol=1e-12) and t.delta_spent <= delta * (1 + 1e-12)


def test_refusal_names_spent_requested_limit_and_stores_nothing(tmp_path):
    eps_r, delta_r = 0.1, 1e-7  # advanced composition: 0.58, 0.82, then 1.01 > 1
    led = _ledger(tmp_path, BudgetLimit(1.0, 1e-6, "advanced", 1e-7))
    r = 0
    with pytest.raises(BudgetExceeded) as err:
        while True:
            led.reserve("r1", r, _event(eps_r, delta_r, 1000, "fully_interactive"))
            led.commit("r1", r, 1000)
            r += 1
    exc = err.value
    assert r == 2  # two rounds fit
    assert exc.limit == (1.0, 1e-6)
    assert exc.spent[0] <= 1.0 < exc.requested[0]
    assert "spent" in str(exc) and "limit" in str(exc)
    # the refused round left no trace; the spent total is exactly that of the r committed rounds
    assert led.next_round("r1") == r
    events = [_event(eps_r, delta_r, 1000, "fully_interactive")] * r
    assert led.totals("r1").eps_spent == compose_events(events, BudgetLimit(1.0, 1e-6, "advanced", 1e-7))[0]


def test_first_round_over_limit_is_refused(tmp_path):
    led = _ledger(tmp_path, BudgetLimit(0.5, 1e-6, "parallel"))
    with pytest.raises(BudgetExceeded):
        led.reserve("r1", 0, _event(1.0))
    assert led.rounds("r1") == []


def test_crash_between_reserve_and_commit_counts_as_spent(tmp_path):
    led = _ledger(tmp_path, BudgetLimit(2.0, 1e-6, "parallel"))
    led.reserve("r1", 0, _event(1.0))
    led.commit("r1", 0, 100)
    led.reserve("r1", 1, _event(1.5))
    led.close()  # the process dies: round 1 is in flight
    led2 = Ledger(tmp_path / "l.sqlite")  # restart on the same file
    assert led2.recover() == [("r1", 1)]
    rows = {r["round"]: r["state"] for r in led2.rounds("r1")}
    assert rows == {0: "committed", 1: "spent_unknown"}
    t = led2.totals("r1")
    assert t.eps_spent == 1.5  # the unknown round is charged at its reservation
    with pytest.raises(LedgerError):
        led2.release("r1", 1, "too late: the outcome is unknown, never released")
    assert led2.recover() == []  # idempotent
    assert led2.next_round("r1") == 2  # no round index is reused


def test_mark_spent_and_checkpoints_and_export(tmp_path):
    led = _ledger(tmp_path, BudgetLimit(2.0, 1e-6, "parallel"))
    led.reserve("r1", 0, _event(1.0))
    led.mark_spent("r1", 0, "shuffler call failed")
    assert led.totals("r1").eps_spent == 1.0
    led.save_checkpoint("r1", -1, b"init", {"round": -1})
    led.save_checkpoint("r1", 0, b"after0", {"round": 0, "loss": 1.0})
    assert led.last_checkpoint("r1") == (0, b"after0")
    assert [m["round"] for m in led.metrics("r1")] == [-1, 0]
    exported = json.loads(led.export_json("r1"))
    assert exported["rounds"][0]["state"] == "spent_unknown"
    assert exported["run"]["limit"]["eps"] == 2.0 and exported["totals"]["eps_spent"] == 1.0
    with pytest.raises(LedgerError, match="fixed once"):
        led.set_budget("r1", BudgetLimit(9.0, 1e-6, "parallel"), {})


def test_committed_rows_survive_a_reopen(tmp_path):
    led = _ledger(tmp_path, BudgetLimit(2.0, 1e-6, "parallel"))
    led.reserve("r1", 0, _event(1.0))
    led.commit("r1", 0, 100)
    led.close()
    # an independent reader sees the committed row (durable, not just in a cache)
    con = sqlite3.connect(tmp_path / "l.sqlite")
    assert con.execute("SELECT state, contributors FROM rounds").fetchall() == [("committed", 100)]


def test_a_rounds_commit_and_checkpoint_are_one_transaction(tmp_path):
    """atomic() (issue 30: one durable write per round): the commit and the checkpoint land together, seen by an
    independent reader only once both are written; a failure in between leaves neither, the round reserved (a
    restart counts it as spent at its reservation, never twice)."""
    led = _ledger(tmp_path, BudgetLimit(3.0, 1e-6, "parallel"))
    led.save_checkpoint("r1", -1, b"init", {"round": -1})
    other = sqlite3.connect(tmp_path / "l.sqlite")
    led.reserve("r1", 0, _event(1.0))
    with led.atomic():
        led.commit("r1", 0, 90)
        assert other.execute("SELECT state FROM rounds WHERE round=0").fetchone() == ("reserved",)
        led.save_checkpoint("r1", 0, b"after0", {"round": 0, "eps_spent": led.totals("r1").eps_spent})
    assert other.execute("SELECT state, contributors FROM rounds WHERE round=0").fetchone() == ("committed", 90)
    assert led.last_checkpoint("r1") == (0, b"after0")
    led.reserve("r1", 1, _event(1.5))
    with pytest.raises(RuntimeError, match="dies"), led.atomic():
        led.commit("r1", 1, 100)
        raise RuntimeError("the analyzer dies before its checkpoint")
    assert [r["state"] for r in led.rounds("r1")] == ["committed", "reserved"]
    assert led.last_checkpoint("r1") == (0, b"after0")
    led.close()
    led2 = Ledger(tmp_path / "l.sqlite")
    assert led2.recover() == [("r1", 1)]
    assert led2.totals("r1").eps_spent == 1.5  # parallel: the larger, once
    assert led2.next_round("r1") == 2


def test_limit_validation():
    with pytest.raises(ValueError, match="eps limit"):
        BudgetLimit(0.0, 1e-6, "parallel")
    with pytest.raises(ValueError, match="composition"):
        BudgetLimit(1.0, 1e-6, "basic")
    with pytest.raises(ValueError, match="advanced_slack"):
        BudgetLimit(1.0, 1e-6, "advanced", 0.0)


def test_totals_come_from_the_accountant_module():
    # the ledger does no privacy arithmetic of its own: compose_events / round_cost call ledger_accounting.account
    params = calibrate_pvec(2.0, 1e-5, 40, 2, 1.0)
    fi = [PrivacyEvent.pvec(params, 40, "fully_interactive"), PrivacyEvent.pvec(params, 30, "fully_interactive")]
    rounds = [PvecRound.from_params(params, k, "fully_interactive") for k in (40, 30)]
    assert compose_events(fi, BudgetLimit(5.0, 1e-5, "rdp")) == (ledger_accounting.account(rounds, 1e-5).eps, 1e-5)
    # disjoint cohorts: the worst round, here the one with fewer contributors (less noise)
    seq = [replace(e, schedule="sequential") for e in fi]
    assert compose_events(seq, BudgetLimit(5.0, 1e-5, "parallel")) == (pvec_round_epsilon(params, 30, 1e-5), 1e-5)
    assert round_cost(seq[1]) == (pvec_round_epsilon(params, 30, 1e-5), 1e-5)
    # more contributors than the parameters' n are charged as n (the extra noise only helps; post-processing)
    assert round_cost(replace(seq[0], contributors=60)) == round_cost(seq[0])
    # the paper's parameters keep the paper's per-round claim (Thm 3.2), also for fewer contributors than sized
    paper = _event()
    assert round_cost(replace(paper, contributors=90)) == (1.0, 1e-6)


def test_a_pvec_ledger_needs_neither_dp_accounting_nor_scipy_optimizers(tmp_path):
    # start-up (issue 15): the analyzer's default run plans, reserves, commits and totals PVEC rounds without the
    # other seeds' accountants, whose imports cost ~0.6 s of CPU in its first round
    code = f"""
import sys
from shuffledp.config import DEFAULT_TOML, parse_config
from shuffledp.data import load_dataset
from shuffledp.models import make_model
from shuffledp.protocols.registry import round_protocol
from shuffledp.services.ledger import BudgetLimit, Ledger, PrivacyEvent
from shuffledp.planning import plan_run
cfg = parse_config(DEFAULT_TOML)
ds = load_dataset(cfg.data, cfg.model.task)
plan = plan_run(cfg, 1348, 1348, make_model("logreg", ds.num_features, ds.num_classes), ds.feature_norm_bound)
led = Ledger({str(tmp_path / "l.sqlite")!r})
led.create_run("r", DEFAULT_TOML)
led.set_budget("r", BudgetLimit(plan["eps"], plan["delta"], plan["composition"], plan["advanced_slack"]), plan)
pvec = round_protocol("pvec")
for r in range(2):
    led.reserve("r", r, PrivacyEvent("pvec", pvec.event_params(plan, r), plan["min_contributors"], plan["kind"]))
    led.commit("r", r, 1348)
print(led.totals("r").eps_spent > 0, sorted(m for m in ("dp_accounting", "scipy.optimize") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "[]"]


def test_a_status_poll_reads_only_the_metrics_it_does_not_have(tmp_path):
    """metrics(skip=k), what the status long poll asks when its caller holds k rounds' metrics: the rounds' metrics
    after the first k, in round order (a round without metrics is no row), and SQLite's work for the newest one does
    not grow with the rounds before it (issue 43 item 9: LIMIT -1 OFFSET k stepped over all k index entries, a poll
    cost 0.46 ms more at 10^4 rounds). The work is counted in SQLite VM instructions (the progress handler)."""
    led = _ledger(tmp_path, BudgetLimit(2.0, 1e-6, "parallel"))
    led.save_checkpoint("r1", -1, b"init", {"round": -1})
    rounds = [r for r in range(3000) if r != 5]
    with led.atomic():
        for r in rounds:
            led.save_checkpoint("r1", r, b"", {"round": r})
    assert [m["round"] for m in led.metrics("r1", skip=3)] == rounds[3:]
    assert [m["round"] for m in led.metrics("r1", skip=0)] == rounds
    assert led.metrics("r1", skip=len(rounds)) == [] == led.metrics("r1", skip=len(rounds) + 5)
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    led._db.set_progress_handler(tick, 1)
    assert [m["round"] for m in led.metrics("r1", skip=len(rounds) - 1)] == [2999]
    led._db.set_progress_handler(None, 1)
    assert steps[0] < 200, steps  # 27 here; 12015 with OFFSET
