"""Poisson sampling at the shuffler (issue 14 item 5): what the sampled Gaussian's accountant assumes is what the
shuffler does. Domain-level statistics with a fixed CSPRNG seed, and a central DP-SGD run over real gRPC services
(seeded shuffler, real nodes, real SQLite ledger) whose empty rounds are released and charged."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import grpc
import numpy as np
import pytest
from _runs import wait_for_run
from scipy import stats
from shuffledp.clients.node import start_node
from shuffledp.services.analyzer import LEDGER_FILE, start_analyzer
from shuffledp.services.ledger import Ledger
from shuffledp.services.shuffler import start_shuffler
from shuffledp.services.shuffler_state import RoundRequest, Schedule, ShufflerState, Transport

from shuffledp.config import parse_config
from shuffledp.protocols.gaussian_round import poisson_epsilon
from shuffledp.security.rng import make_rng
from shuffledp.security.sealing import PUBLIC_KEY_BYTES
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

KEY = bytes(PUBLIC_KEY_BYTES)  # a well-formed key: these rounds are never answered, nothing is sealed to it


def _request(r: int, q: float, **kw) -> RoundRequest:
    fields = dict(message_bytes=16, analyzer_public_key=KEY, min_contributors=0, deadline_seconds=1e-4)
    return RoundRequest("run", r, Schedule.SUBSAMPLED, Transport.SEALED, sampling_rate=q, **{**fields, **kw})


def test_inclusion_rate_matches_q_and_users_are_drawn_independently():
    """Over R rounds each of n users is invited independently with probability q: the total count of invitations
    is Bin(nR, q) (two-sided binomial test), every user's count is Bin(R, q) (chi-square against uniform), and
    the round sizes follow Bin(n, q) (chi-square on the size histogram). Fixed seed; each test fails below
    p = 0.001."""
    state = ShufflerState(rng=make_rng(5), poll_seconds=0.001)
    users = [f"u{i:02d}" for i in range(30)]
    state.register_users("node", users)
    sub = state.subscribe("node")
    q, rounds = 0.2, 400
    hits, sizes = np.zeros(len(users)), []
    for r in range(rounds):
        res = state.execute_round(_request(r, q))
        # nobody answers: released anyway (Poisson, min_contributors 0), empty
        assert res.released and res.contributors == 0 and res.ciphertexts == []
        sizes.append(res.invited)
        # every round reaches the node, sampled or not (a notice: issue 24 item 1), with the count drawn from
        inv = sub.get(timeout=1)
        assert len(set(inv.user_ids)) == res.invited and inv.eligible == res.eligible == len(users)
        hits[[users.index(u) for u in inv.user_ids]] += 1
    total = int(hits.sum())
    assert total == sum(sizes)
    assert stats.binomtest(total, len(users) * rounds, q).pvalue > 1e-3, total / (len(users) * rounds)
    assert stats.chisquare(hits).pvalue > 1e-3, hits
    # sizes against Bin(30, 0.2), bins with expected count >= 5 (tails merged)
    counts = np.bincount(sizes, minlength=len(users) + 1).astype(float)
    expected = stats.binom.pmf(np.arange(len(users) + 1), len(users), q) * rounds
    lo, hi = 2, 10
    obs = [counts[: lo + 1].sum(), *counts[lo + 1 : hi], counts[hi:].sum()]
    exp = [expected[: lo + 1].sum(), *expected[lo + 1 : hi], expected[hi:].sum()]
    assert stats.chisquare(obs, exp).pvalue > 1e-3, (obs, exp)


def test_a_round_with_nobody_sampled_is_released_empty():
    state = ShufflerState(rng=make_rng(9), poll_seconds=0.001)
    state.register_users("node", ["a", "b"])
    sub = state.subscribe("node")
    res = state.execute_round(_request(0, 1e-9))  # P(anyone) = 2e-9
    assert res.invited == 0 and res.released and res.contributors == 0 and not res.below_threshold
    notice = sub.get(timeout=1)  # the node still learns of the round its users were eligible for
    assert notice is not None and notice.user_ids == [] and notice.eligible == 2
    # a fixed-cohort round with nobody answering releases nothing (never an empty batch there)
    fixed = RoundRequest(
        "run",
        1,
        Schedule.SUBSAMPLED,
        Transport.SEALED,
        message_bytes=16,
        analyzer_public_key=KEY,
        cohort_size=1,
        min_contributors=0,
        deadline_seconds=1e-4,
    )
    assert not state.execute_round(fixed).released


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(sampling_rate=1.5), r"sampling_rate must lie in \[0, 1\]"),
        (dict(sampling_rate=math.nan), r"sampling_rate must lie in \[0, 1\]"),
        (dict(cohort_size=3), "takes no cohort_size"),
        (dict(schedule=Schedule.FULLY_INTERACTIVE), "applies to SUBSAMPLED rounds"),
    ],
)
def test_poisson_requests_are_validated_before_any_state_changes(kw, match):
    state = ShufflerState(rng=make_rng(1), poll_seconds=0.001)
    state.register_users("node", ["a"])
    sub = state.subscribe("node")
    req = _request(0, 1.0)  # everyone, surely
    fields = {**req.__dict__, **kw}
    with pytest.raises(ValueError, match=match):
        state.execute_round(RoundRequest(**fields))
    assert sub.get(timeout=0.01) is None  # nobody was invited
    res = state.execute_round(req)  # the same round is still free: nothing was recorded
    assert res.released and res.invited == 1 and sub.get(timeout=1).user_ids == ["a"]


# ------------------------------------------------------------------------------------- over the services
def test_central_dp_sgd_with_poisson_sampling_releases_and_charges_empty_rounds(tmp_path, blobs_data):
    """q = 1/225: about a third of the rounds sample nobody (fixed shuffler seed). Every round is committed in the
    ledger, empty ones with 0 contributors, and the run's eps is exactly `shuffledp account gaussian` of the
    Poisson-sampled Gaussian over all its rounds."""
    shuffler, sport = start_shuffler("127.0.0.1:0", rng=make_rng(3))
    analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state")
    channel = grpc.insecure_channel(f"127.0.0.1:{aport}")
    toml = blobs_data + (
        '[model]\ntask = "logreg"\n[privacy]\neps = 4.0\ndelta = 1e-5\nprotocol = "gaussian"\n'
        '[schedule]\nkind = "subsampled"\nsampling = "poisson"\ncohort_size = 1\nrounds = 12\nlearning_rate = 0.5\n'
        '[transport]\nmode = "sealed"\n[deployment]\nround_deadline_seconds = 5\n'
    )
    cfg = parse_config(toml)
    nodes = [start_node(f"n{i}", cfg, i, 2, f"127.0.0.1:{sport}") for i in range(2)]
    try:
        stub = pbg.AnalyzerStub(channel)
        run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=toml)).run_id
        stub.StartRun(pb.RunRef(run_id=run_id))
        st = wait_for_run(stub, run_id, timeout=120)
        assert st.state == pb.COMPLETED, st.message
        rows = Ledger(tmp_path / "state" / LEDGER_FILE).rounds(run_id)
        assert [r["state"] for r in rows] == ["committed"] * 12
        contributors = [r["contributors"] for r in rows]
        assert 0 in contributors and max(contributors) <= 3, contributors
        assert [m.contributors for m in st.metrics] == contributors and all(m.released for m in st.metrics)
        params = rows[0]["event"]["params"]
        assert params["sampling"] == "poisson" and params["q"] == pytest.approx(1 / 225, rel=1e-12)
        assert "poisson" in st.budget.accountant and st.budget.trust_model == pb.CENTRAL
        z = params["noise_multiplier"]
        argv = ["gaussian", "--sigma", repr(z), "--sensitivity", "1", "--sampling-rate", repr(params["q"])]
        argv += ["--rounds", "12", "--delta", "1e-05", "--json"]
        proc = subprocess.run(
            [sys.executable, "-m", "shuffledp.cli", "account", *argv], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        cli_eps = json.loads(proc.stdout)["eps"]
        assert st.budget.eps_spent == pytest.approx(cli_eps, rel=1e-9, abs=1e-9)
        assert st.budget.eps_spent == pytest.approx(poisson_epsilon(z, params["q"], 12, 1e-5), rel=1e-12)
        assert st.budget.eps_spent <= 4.0
    finally:
        for n in nodes:
            n.stop()
        channel.close()
        analyzer.stop(0)
        shuffler.stop(0)
