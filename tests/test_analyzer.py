"""Analyzer service in-process (real gRPC servers on loopback): operator API, planning, threshold release."""

import json
import math
import sqlite3
import threading
import time
from dataclasses import asdict

import grpc
import numpy as np
import pytest
from _runs import wait_for_run
from shuffledp.clients.node import start_node
from shuffledp.clients.policy import PolicyTable, UserPolicy
from shuffledp.services.analyzer import LEDGER_FILE, start_analyzer
from shuffledp.services.checkpoints import decode_state as _decode_state
from shuffledp.services.ledger import Ledger, PrivacyEvent
from shuffledp.services.run_manager import RunManager
from shuffledp.services.shuffler import start_shuffler

from shuffledp.cli.run import _progress_line
from shuffledp.config import DEFAULT_ROUNDS, parse_config
from shuffledp.data import load_dataset
from shuffledp.mechanisms.pvec import PvecParams
from shuffledp.models import make_model
from shuffledp.planning import PlanError, plan_run, round_spec
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

N_USERS = 225


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """[data] section of a synthetic 2-class problem in R^3 (300 examples, 225 training users, d = 8)."""
    from shuffledp.security.rng import make_rng

    path = tmp_path_factory.mktemp("blobs") / "blobs.npz"
    rng = make_rng(7)
    y = np.arange(300) % 2
    np.savez(path, X=rng.normal(size=(300, 3)) * 0.5 + np.where(y[:, None] == 1, 0.6, -0.6), y=y)
    return f'[data]\ndataset = "path"\npath = "{path}"\n'


def _model(cfg):
    ds = load_dataset(cfg.data, cfg.model.task)
    return make_model(cfg.model.task, ds.num_features, ds.num_classes)


@pytest.fixture
def services(tmp_path):
    """Shuffler + analyzer in this process (real sockets); nodes are added by the test."""
    shuffler, sport = start_shuffler("127.0.0.1:0")
    analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state")
    channel = grpc.insecure_channel(f"127.0.0.1:{aport}")
    nodes = []
    yield pbg.AnalyzerStub(channel), f"127.0.0.1:{sport}", nodes, tmp_path / "state"
    for n in nodes:
        n.stop()
    channel.close()
    analyzer.stop(0)
    shuffler.stop(0)


def test_operator_api_errors_and_cancel(services, data):
    stub, _, _, _ = services
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateRun(pb.CreateRunRequest(config_toml="[privacy]\neps = -1.0"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "privacy.eps" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateRun(pb.CreateRunRequest(config_toml='[data]\ndataset = "path"\npath = "/nonexistent.npz"'))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nonexistent" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.GetRunStatus(pb.RunRef(run_id="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    st = stub.CreateRun(pb.CreateRunRequest(config_toml=data))
    assert st.state == pb.CREATED and st.run_id
    assert stub.GetBudget(pb.RunRef(run_id=st.run_id)).eps_limit == 0.0  # no budget before the run starts
    assert stub.CancelRun(pb.RunRef(run_id=st.run_id)).state == pb.CANCELLED
    for call in (stub.StartRun, stub.CancelRun):
        with pytest.raises(grpc.RpcError) as err:
            call(pb.RunRef(run_id=st.run_id))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_status_long_poll_answers_at_the_first_change_or_after_its_wait(services, data):
    stub, _, _, _ = services
    st = stub.CreateRun(pb.CreateRunRequest(config_toml=data))
    seen = dict(seen_rounds=0, seen_state=pb.CREATED, seen_message=st.message)
    t0 = time.monotonic()
    same = stub.GetRunStatus(pb.RunRef(run_id=st.run_id, wait_ms=400, **seen), timeout=10)
    waited = time.monotonic() - t0
    assert same.state == pb.CREATED and 0.35 <= waited < 5.0  # nothing changed: answered after wait_ms
    t0 = time.monotonic()
    assert stub.GetRunStatus(pb.RunRef(run_id=st.run_id, wait_ms=5000), timeout=10).state == pb.CREATED
    assert time.monotonic() - t0 < 4.0  # the caller has seen nothing (no seen_state): answered, not after 5 s
    cancel = threading.Timer(0.3, lambda: stub.CancelRun(pb.RunRef(run_id=st.run_id)))
    t0 = time.monotonic()
    cancel.start()
    changed = stub.GetRunStatus(pb.RunRef(run_id=st.run_id, wait_ms=8000, **seen), timeout=15)
    woke = time.monotonic() - t0
    cancel.join()
    assert changed.state == pb.CANCELLED and woke < 6.0  # woken by the ledger write, before its 8 s


def test_rounds_below_threshold_are_released_and_cost_nothing(services, data):
    stub, shuffler, nodes, state_dir = services
    # every user's policy ([policy] of the configuration the nodes read) refuses any round costing more than
    # eps 0.01: no batch can reach the threshold
    cfg_text = data + "[privacy]\neps = 4.0\n[schedule]\nrounds = 5\n[deployment]\nround_deadline_seconds = 3\n"
    cfg_text += "[policy]\nmax_eps_per_round = 0.01\n"
    cfg = parse_config(cfg_text)
    nodes += [start_node(f"n{i}", cfg, i, 2, shuffler) for i in range(2)]
    run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=cfg_text)).run_id
    stub.StartRun(pb.RunRef(run_id=run_id))
    st = wait_for_run(stub, run_id)
    assert st.state == pb.FAILED and "consecutive" in st.message
    assert st.budget.eps_spent == 0.0 and st.budget.rounds_committed == 0
    assert all(not m.released for m in st.metrics)
    rows = Ledger(state_dir / LEDGER_FILE).rounds(run_id)
    assert rows and all(r["state"] == "released" and "below threshold" in r["reason"] for r in rows)
    # the nodes did get the invitations (and refused them, counted by reason)
    assert sum(sum(n.core.status().refusals.values()) for n in nodes) == len(rows) * N_USERS
    # ... and the analyzer's round metrics report them (from the shuffler's batch report)
    assert [m.refused for m in st.metrics] == [N_USERS] * len(rows)
    # what the operator sees: how many refused, and the [policy] key that made them refuse
    assert [dict(m.refused_reasons) for m in st.metrics] == [{"round_eps_above_max_eps_per_round": N_USERS}] * len(rows)
    line = _progress_line(st.metrics[0], 5)
    assert f"{N_USERS} users refused: round_eps_above_max_eps_per_round={N_USERS}" in line
    # a poller holding the first k rounds' metrics is sent the others only (issue 30 item 4), the rest of the status
    # unchanged; beyond the last, none
    k = len(st.metrics) - 1
    part = stub.GetRunStatus(pb.RunRef(run_id=run_id, metrics_from=k))
    assert part.metrics_from == k and list(part.metrics) == list(st.metrics)[k:] and len(part.metrics) == 1
    assert (part.rounds_done, part.budget, part.state) == (st.rounds_done, st.budget, st.state)
    assert st.metrics_from == 0 and not stub.GetRunStatus(pb.RunRef(run_id=run_id, metrics_from=k + 5)).metrics


def test_plan_report_goal_is_the_fraction_of_the_cohort_never_below_the_threshold(data):
    """schedule.report_goal_fraction (over-selection): report_goal = max(min_contributors, ceil(fraction x cohort));
    0 (wait for every invitee) at the default 1.0 or when the goal is the whole cohort."""
    head = data + "[privacy]\neps = 2.0\ndelta = 1e-5\nmin_contributors_fraction = 0.7\n[schedule]\n"
    seq = head + 'kind = "sequential"\ncohort_size = 60\n'
    model = _model(parse_config(seq))
    plan = plan_run(parse_config(seq + f"report_goal_fraction = {1 / 1.3}\n"), admitted=270, unused=270, model=model)
    assert (plan["min_contributors"], plan["report_goal"]) == (42, 47)  # ceil(0.7 * 60), ceil(60 / 1.3)
    plan = plan_run(parse_config(seq + "report_goal_fraction = 0.5\n"), admitted=270, unused=270, model=model)
    assert plan["report_goal"] == 42  # never below the threshold
    assert plan_run(parse_config(seq), admitted=270, unused=270, model=model)["report_goal"] == 0
    fi = parse_config(head + "rounds = 3\nreport_goal_fraction = 0.8\n")
    assert plan_run(fi, admitted=270, unused=0, model=model)["report_goal"] == 216  # of the 270 invited


def test_plan_sequential_and_fully_interactive(data):
    seq = parse_config(data + '[privacy]\neps = 2.0\ndelta = 1e-5\n[schedule]\nkind = "sequential"\ncohort_size = 60\n')
    model = _model(seq)
    plan = plan_run(seq, admitted=270, unused=270, model=model)
    assert plan["rounds"] == 4 and plan["cohort"] == 60 and plan["composition"] == "parallel"
    assert plan["min_contributors"] == 54 and plan["dim"] == 8  # ceil(0.9 * 60); 2 classes x (3 + 1)
    assert plan["params"]["n"] == 60 and plan["params"]["method"] == "calibrated"
    # Thm 4.1 default cohort B = sqrt(d) ln(d/delta)/eps
    auto = parse_config(data + '[privacy]\neps = 2.0\ndelta = 1e-5\n[schedule]\nkind = "sequential"\n')
    plan = plan_run(auto, admitted=270, unused=270, model=model)
    assert plan["cohort"] == math.ceil(math.sqrt(8) * math.log(8 / 1e-5) / 2.0)
    fi = parse_config(data + "[privacy]\neps = 2.0\n[schedule]\nrounds = 7\n")
    plan = plan_run(fi, admitted=270, unused=0, model=model)
    assert plan["rounds"] == 7 and plan["cohort"] == 270 and plan["composition"] == "rdp"
    assert plan["delta"] == 1e-3  # default delta = min(1/n, policy.max_delta_per_round) = min(1/270, 1e-3)
    paper = parse_config(data + '[privacy]\neps = 2.0\n[privacy.pvec]\ncalibration = "paper"\n[schedule]\nrounds = 7\n')
    plan = plan_run(paper, admitted=270, unused=0, model=model)
    assert plan["composition"] == "advanced" and math.isclose(plan["advanced_slack"], 1e-3 / 8)
    # per-round eps of Alg 5: eps / (2 sqrt(2 T ln(1/delta)))
    assert plan["params"]["eps"] <= 2.0 / (2 * math.sqrt(14 * math.log(1e3)))
    with pytest.raises(PlanError):
        plan_run(seq, admitted=270, unused=0, model=model)


def _offer_every_round(cfg, plan, users: int):
    """Every round of `plan` offered to users whose policy is [policy] of cfg, decided and charged as the client
    nodes do (sequential: a fresh cohort per round; fully interactive: everyone). Returns (refusals, PolicyTable)."""
    table = PolicyTable(UserPolicy(**asdict(cfg.policy)), users)
    params = PvecParams(**plan["params"])
    event = PrivacyEvent.pvec(params, plan["min_contributors"], plan["kind"])
    refusals = []
    for r in range(plan["rounds"]):
        spec = round_spec("run", r, plan, params, event, np.zeros(plan["dim"]))
        sequential = plan["kind"] == "sequential"
        idx = np.arange(r * plan["cohort"], (r + 1) * plan["cohort"]) if sequential else np.arange(users)
        reasons, cost = table.decide(spec, idx, True)
        table.charge(idx[reasons == ""], cost[reasons == ""], spec.per_user_cost.delta)
        refusals.append(reasons)
    return np.concatenate(refusals), table


@pytest.mark.parametrize(
    "extra",
    [
        '[schedule]\nkind = "sequential"\n',  # per-round delta = delta: 1/225 > 1e-3 was refused by everyone
        "[schedule]\nrounds = 2\n",  # per-round claim delta/T = 1/450 > 1e-3 was refused too
        "",  # the built-in default: fully interactive, 16 rounds
        '[privacy.pvec]\ncalibration = "paper"\n',  # per-round delta_r = delta/(T+1) (Alg 5)
        "[policy]\nmax_total_delta = 5e-4\n",  # the users' total limit binds: T claims delta/T must add up below it
    ],
    ids=["sequential", "fi-2-rounds", "fi-default", "fi-paper", "total-delta-binds"],
)
def test_default_delta_is_accepted_by_the_default_users_of_a_small_run(data, extra):
    # issue 10: n = 225 < 1000 users with privacy.delta unset; every user's policy is [policy] of the same file
    cfg = parse_config(data + extra)
    assert cfg.privacy.delta is None
    plan = plan_run(cfg, admitted=N_USERS, unused=N_USERS, model=_model(cfg))
    refusals, table = _offer_every_round(cfg, plan, N_USERS)
    assert set(refusals) == {""}, set(refusals)  # every user joins every round it is invited to ...
    pol = cfg.policy
    assert table.delta_spent.max() <= pol.max_total_delta and table.eps_spent.max() <= pol.max_total_eps  # in total
    assert plan["delta"] <= min(1 / N_USERS, pol.max_delta_per_round, pol.max_total_delta)
    assert plan["delta"] == pytest.approx(min(1 / N_USERS, pol.max_delta_per_round, pol.max_total_delta), rel=1e-6)


def test_default_delta_on_digits_with_max_users_300_is_accepted():
    # the example: the embedded data set cut to 300 users, sequential PSGD, default privacy and policy
    cfg = parse_config('[data]\nmax_users = 300\n[schedule]\nkind = "sequential"\n')
    plan = plan_run(cfg, admitted=300, unused=300, model=_model(cfg))
    assert plan["delta"] == 1e-3 < 1 / 300
    refusals, _ = _offer_every_round(cfg, plan, 300)
    assert set(refusals) == {""}


def test_default_delta_refuses_a_policy_that_accepts_no_delta(data):
    cfg = parse_config(data + "[policy]\nmax_delta_per_round = 0.0\n")
    with pytest.raises(PlanError, match="privacy.delta is unset.*max_delta_per_round"):
        plan_run(cfg, admitted=N_USERS, unused=N_USERS, model=_model(cfg))


def test_schedule_rounds_caps_a_sequential_run(data):
    # issue 10: schedule.rounds was ignored in sequential runs (T = floor(unused / B) always)
    base = data + '[privacy]\neps = 2.0\ndelta = 1e-5\n[schedule]\nkind = "sequential"\ncohort_size = 60\n'
    model = _model(parse_config(base))
    unset = plan_run(parse_config(base), admitted=270, unused=270, model=model)
    assert unset["rounds"] == 4  # unset: as many fresh cohorts as the unused users allow, floor(270 / 60)
    two = plan_run(parse_config(base + "rounds = 2\n"), admitted=270, unused=270, model=model)
    assert two["rounds"] == 2 and two["cohort"] == 60
    # the theory step size is sized for the T actually run: eta = D / (L_G sqrt(T)) (Thm 4.1), same B and noise
    assert two["learning_rate"] == pytest.approx(unset["learning_rate"] * math.sqrt(4 / 2), rel=1e-12)
    nine = plan_run(parse_config(base + "rounds = 9\n"), admitted=270, unused=270, model=model)
    assert nine["rounds"] == 4  # never more rounds than fresh cohorts (each user is queried once)
    # fully interactive: rounds is T; unset = DEFAULT_ROUNDS
    fi = parse_config(data + "[privacy]\neps = 2.0\n")
    assert fi.schedule.rounds is None
    assert plan_run(fi, admitted=270, unused=0, model=model)["rounds"] == DEFAULT_ROUNDS == 16


@pytest.mark.parametrize("output", ["mean", "last"])
def test_round_metrics_show_the_model_after_the_round(services, data, output):
    """issue 10: round r's metrics evaluate the model after round r, including the iterate round r produced (round 0
    used to show the untrained mean); the released model stays the spec's output (spec 000 sec 4, Alg 3 / Alg 5)."""
    stub, shuffler, nodes, state_dir = services
    cfg_text = data + "[privacy]\neps = 4.0\ndelta = 1e-3\n[schedule]\nrounds = 2\nlearning_rate = 2.0\n"
    cfg_text += f'output = "{output}"\n[deployment]\nround_deadline_seconds = 20\n'
    cfg = parse_config(cfg_text)
    nodes += [start_node(f"o{i}", cfg, i, 2, shuffler) for i in range(2)]
    run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=cfg_text)).run_id
    stub.StartRun(pb.RunRef(run_id=run_id))
    st = wait_for_run(stub, run_id, timeout=60)
    assert st.state == pb.COMPLETED and all(m.released for m in st.metrics), st.message
    released = np.frombuffer(stub.GetRunResult(pb.RunRef(run_id=run_id)).model.f64, dtype="<f8")
    with sqlite3.connect(state_dir / LEDGER_FILE) as con:  # the checkpoint the analyzer wrote after each round
        rows = con.execute("SELECT round, blob FROM checkpoints WHERE run_id=? ORDER BY round", (run_id,)).fetchall()
    assert [r for r, _ in rows] == [-1, 0, 1]
    after0, after1 = _decode_state(bytes(rows[1][1])), _decode_state(bytes(rows[2][1]))
    theta0, theta1, theta2 = np.zeros(8), after0.last, after1.last  # theta_0 = 0 (Alg 5)
    assert np.array_equal(after1.iterate_sum, theta0 + theta1) and not np.array_equal(theta1, theta0)
    initial, m0, m1 = Ledger(state_dir / LEDGER_FILE).metrics(run_id)
    ds = load_dataset(cfg.data, cfg.model.task)
    model, X, y = _model(cfg), ds.X_test, ds.y_test
    # round 0: the model after one step, not the initial model
    assert m0["loss_last"] == model.loss(theta1, X, y) != initial["loss_last"] == model.loss(theta0, X, y)
    assert m0["loss_mean"] == model.loss((theta0 + theta1) / 2, X, y) != initial["loss_mean"]
    assert m1["loss_last"] == model.loss(theta2, X, y)
    assert m1["loss_mean"] == model.loss((theta0 + theta1 + theta2) / 3, X, y)
    # what the operator sees is the configured output's figure
    assert [m.loss for m in st.metrics] == [m0[f"loss_{output}"], m1[f"loss_{output}"]]
    # the released model: mean(theta_0..theta_{T-1}) (spec 000 sec 4, Alg 5), or the last iterate theta_T
    np.testing.assert_array_equal(released, (theta0 + theta1) / 2 if output == "mean" else theta2)


def test_a_result_is_one_snapshot_of_the_ledger(services, data):
    """A round settling while the analyzer composes a result (the one in flight when the operator cancels) landed
    between the result's budget and its exported ledger: the CLI printed a spend that its ledger.json contradicted.
    The interleaving is made certain by settling the round inside the evaluation the view runs."""
    stub, shuffler, nodes, state_dir = services
    cfg_text = data + "[privacy]\neps = 8.0\ndelta = 1e-3\n[privacy.pvec]\nround_eps = 1.0\n[schedule]\nrounds = 2\n"
    cfg_text += "[deployment]\nround_deadline_seconds = 20\n"
    cfg = parse_config(cfg_text)
    nodes += [start_node(f"s{i}", cfg, i, 2, shuffler) for i in range(2)]
    run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=cfg_text)).run_id
    stub.StartRun(pb.RunRef(run_id=run_id))
    assert wait_for_run(stub, run_id, timeout=60).state == pb.COMPLETED
    ledger = Ledger(state_dir / LEDGER_FILE)
    channel = grpc.insecure_channel(shuffler)
    manager = RunManager(ledger, pbg.ShufflerStub(channel))
    # a round in flight: reserved while the run was going, then the operator cancels (an ended run reserves none)
    with sqlite3.connect(state_dir / LEDGER_FILE) as db:
        db.execute("UPDATE runs SET state='RUNNING' WHERE run_id=?", (run_id,))
    ledger.reserve(run_id, 2, ledger.event(run_id, 1))
    ledger.set_state(run_id, "CANCELLED", "cancelled by the operator")
    evaluate = manager._evaluation_data

    def settled_meanwhile(run_cfg):
        ledger.mark_spent(run_id, 2, "settled while the result was composed")
        return evaluate(run_cfg)

    manager._evaluation_data = settled_meanwhile
    view = manager.view(run_id, with_result=True)
    channel.close()
    exported = json.loads(view.ledger_json)["totals"]
    assert (view.budget.eps_spent, view.budget.eps_reserved) == (exported["eps_spent"], exported["eps_reserved"])
    assert view.budget.eps_spent < view.budget.eps_reserved  # taken before the round settled, in both
    assert ledger.totals(run_id).eps_spent == view.budget.eps_reserved  # and it did settle, as spent


def test_bits_transport_decodes_sealed_labelled_bits(services, tmp_path):
    """BITS mode: every labelled bit is HPKE-sealed to the run's key; the analyzer opens and decodes them."""
    from shuffledp.security.rng import make_rng

    stub, shuffler, nodes, state_dir = services
    rng = make_rng(11)
    X = rng.uniform(-1, 1, size=(53, 1))
    np.savez(tmp_path / "tiny.npz", X=X, y=0.5 * X[:, 0] + 0.2)
    cfg_text = (
        f'[data]\ndataset = "path"\npath = "{tmp_path / "tiny.npz"}"\n[model]\ntask = "leastsq"\nradius = 2.0\n'
        '[privacy]\neps = 8.0\ndelta = 1e-3\n[schedule]\nrounds = 2\nlearning_rate = 1.0\n[transport]\nmode = "bits"\n'
        "[deployment]\nround_deadline_seconds = 20\n"
    )
    cfg = parse_config(cfg_text)
    nodes += [start_node(f"b{i}", cfg, i, 2, shuffler) for i in range(2)]
    run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=cfg_text)).run_id
    stub.StartRun(pb.RunRef(run_id=run_id))
    st = wait_for_run(stub, run_id, timeout=60)
    assert st.state == pb.COMPLETED, st.message
    assert all(m.released and m.contributors == 40 for m in st.metrics)
    # initial loss of theta = 0 on y = 0.5 x + 0.2 is E[y^2]/2 ~ 0.06; two noisy steps must reduce it
    assert st.metrics[-1].loss < st.metrics[0].loss
    assert 0 < st.budget.eps_spent <= 8.0


def test_a_round_whose_evaluation_fails_is_still_charged(services, data, monkeypatch):
    """The round's ledger commit shares the checkpoint's durable write (issue 30); when what comes before that write
    fails (here the evaluation of round 1), the round's batch was used all the same: committed, never left
    reserved, and the run stops FAILED with the cause."""
    stub, shuffler, nodes, state_dir = services
    evaluate = RunManager._evaluate

    def failing(self, cfg, opt, state, r):
        if r == 1:
            raise RuntimeError("evaluation failed")
        return evaluate(self, cfg, opt, state, r)

    monkeypatch.setattr(RunManager, "_evaluate", failing)
    cfg_text = data + "[privacy]\neps = 4.0\n[schedule]\nrounds = 4\n"
    nodes += [start_node(f"n{i}", parse_config(cfg_text), i, 2, shuffler) for i in range(2)]
    run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=cfg_text)).run_id
    stub.StartRun(pb.RunRef(run_id=run_id))
    st = wait_for_run(stub, run_id)
    assert st.state == pb.FAILED and "evaluation failed" in st.message
    rows = Ledger(state_dir / LEDGER_FILE).rounds(run_id)
    assert [r["state"] for r in rows] == ["committed", "committed"], rows
    assert st.budget.rounds_committed == 2 and st.budget.eps_spent > 0


class _Tamper(grpc.aio.ServerInterceptor):
    """A dishonest shuffler: the real one, whose ExecuteRound answers from round 1 on are rewritten by `change` (its
    grpc.aio handlers take and give serialized messages)."""

    def __init__(self, change) -> None:
        self.change = change

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.endswith("/ExecuteRound"):
            return handler
        inner = handler.unary_unary

        async def execute(raw, context):
            answer = await inner(raw, context)
            if pb.RoundSpec.FromString(raw).round < 1:
                return answer
            batch = pb.ShuffledBatch.FromString(answer)
            self.change(batch)
            return batch.SerializeToString()

        return grpc.unary_unary_rpc_method_handler(
            execute, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def _copies(batch: pb.ShuffledBatch) -> None:
    """Every message replaced by a copy of the first (the shuffler picks one user and counts it as the cohort)."""
    first = batch.ciphertexts[0]
    del batch.ciphertexts[:]
    batch.ciphertexts.extend([first] * batch.report.contributors)


SEALED_GAUSSIAN = (
    '[privacy]\nprotocol = "gaussian"\neps = 4.0\n[schedule]\nkind = "subsampled"\ncohort_size = 60\nrounds = 3\n'
    '[transport]\nmode = "sealed"\n'
)


def _lying_run(tmp_path, change, cfg_text: str) -> tuple[pb.RunStatus, Ledger, str]:
    """A run of cfg_text on 2 real nodes and the real analyzer, through a shuffler whose ExecuteRound answers from
    round 1 on are rewritten by `change`: (its final status, its ledger, its run id)."""
    shuffler, sport = start_shuffler("127.0.0.1:0", interceptors=[_Tamper(change)])
    analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state")
    nodes = []
    try:
        nodes += [start_node(f"n{i}", parse_config(cfg_text), i, 2, f"127.0.0.1:{sport}") for i in range(2)]
        with grpc.insecure_channel(f"127.0.0.1:{aport}") as ch:
            stub = pbg.AnalyzerStub(ch)
            run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=cfg_text)).run_id
            stub.StartRun(pb.RunRef(run_id=run_id))
            st = wait_for_run(stub, run_id)
    finally:
        for n in nodes:
            n.stop()
        analyzer.stop(0)
        shuffler.stop(0)
    return st, Ledger(tmp_path / "state" / LEDGER_FILE), run_id


@pytest.mark.parametrize(
    "kind, change",
    [
        ("data marked not released", lambda b: setattr(b, "released", False)),
        ("another round's", lambda b: setattr(b, "round", b.round + 7)),
        ("totals one short", lambda b: b.label_totals.pop()),
        ("a total beyond any count", lambda b: b.label_totals.__setitem__(0, 2**64 - 1)),
        ("copies of one sealed message", _copies),
        ("more contributors than check-ins", lambda b: setattr(b.report, "checked_in", b.report.contributors - 1)),
        ("no check-in", lambda b: setattr(b.report, "checked_in", 0)),
    ],
)
def test_a_batch_the_analyzer_cannot_use_is_charged_at_its_reservation(tmp_path, data, kind, change):
    """Found by probing as a dishonest shuffler: such batches stopped the run but left their round reserved, so the
    budget read less than the delivered data cost until the analyzer restarted (and copies of one sealed message
    were opened as that many users'). The round is charged at its reservation, the run stops, nothing is used."""
    cfg = SEALED_GAUSSIAN if kind.startswith("copies") else "[privacy]\neps = 4.0\n[schedule]\nrounds = 3\n"
    st, ledger, run_id = _lying_run(tmp_path, change, data + cfg)
    rows = ledger.rounds(run_id)
    assert st.state == pb.FAILED and [r["state"] for r in rows] == ["committed", "spent_unknown"], (st.message, rows)
    assert ledger.recover() == []  # nothing left for a restart to charge: the budget read was the whole cost
    totals = ledger.totals(run_id)
    # the reserved total (spent plus outstanding) is all spent: the reading did not wait for a restart
    assert totals.eps_spent == pytest.approx(totals.eps_reserved) == pytest.approx(st.budget.eps_spent)
    assert sum(m.released for m in st.metrics) == 1  # round 0 only: nothing of round 1 was used


def test_a_batch_drawn_from_fewer_eligible_users_is_charged_at_the_rate_it_was_drawn_at(tmp_path, data):
    """Found by probing as a dishonest shuffler: a fixed-cohort round drawn from fewer eligible users than its spec's
    population stopped the run but was charged at the planned population (a lower sampling rate than the batch was
    drawn at). It is committed with the eligible users as its population: never less than its actual cost."""

    def fewer(batch: pb.ShuffledBatch) -> None:
        batch.report.eligible = 100  # of the 225 the round's accountant assumes

    st, ledger, run_id = _lying_run(tmp_path, fewer, data + SEALED_GAUSSIAN)
    rows = ledger.rounds(run_id)
    assert st.state == pb.FAILED and "fewer than the 225" in st.message
    assert [r["state"] for r in rows] == ["committed", "committed"]
    assert rows[0]["event"]["params"]["n"] == 225 and rows[1]["event"]["params"]["n"] == 100
    planned, drawn = ledger.event(run_id, 0), ledger.event(run_id, 1)
    assert drawn.params["k"] == planned.params["k"] and drawn.params["n"] < planned.params["n"]
