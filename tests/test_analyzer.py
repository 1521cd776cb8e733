"""Analyzer service in-process (real gRPC servers on loopback): operator API, planning, threshold release."""

import math

import grpc
import numpy as np
import pytest
from _runs import wait_for_run
from shuffledp.clients.node import start_node
from shuffledp.services.analyzer import LEDGER_FILE, start_analyzer
from shuffledp.services.ledger import Ledger
from shuffledp.services.run_manager import PlanError, plan_run
from shuffledp.services.shuffler import start_shuffler

from shuffledp.config import parse_config
from shuffledp.data import load_dataset
from shuffledp.models import make_model
from shuffledp.run import _progress_line
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

N_USERS = 225


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """[data] section of a synthetic 2-class problem in R^3 (300 examples, 225 training users, d = 8)."""
    from shuffledp.rng import make_rng

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
    assert f"{N_USERS} users refused by their [policy]" in _progress_line(st.metrics[0], 5)  # what the operator sees


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
    assert plan["delta"] == 1 / 270  # default delta = 1/n
    paper = parse_config(data + '[privacy]\neps = 2.0\ncalibration = "paper"\n[schedule]\nrounds = 7\n')
    plan = plan_run(paper, admitted=270, unused=0, model=model)
    assert plan["composition"] == "advanced" and math.isclose(plan["advanced_slack"], 1 / 270 / 8)
    # per-round eps of Alg 5: eps / (2 sqrt(2 T ln(1/delta)))
    assert plan["params"]["eps"] <= 2.0 / (2 * math.sqrt(14 * math.log(270)))
    with pytest.raises(PlanError):
        plan_run(seq, admitted=270, unused=0, model=model)


def test_bits_transport_decodes_sealed_labelled_bits(services, tmp_path):
    """BITS mode: every labelled bit is HPKE-sealed to the run's key; the analyzer opens and decodes them."""
    from shuffledp.rng import make_rng

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
