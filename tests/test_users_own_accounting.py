"""Each user's own account matches the run's guarantee (issue 24 items 1-3; design 6): a user's node charges what it
can certify for that user alone, for sampled central DP-SGD (Poisson and fixed k of n), DP-FTRL with several
participations, and a population that shrinks mid-run. Runs over real gRPC services with real SQLite stores: the
users' limits lie below the run's guarantee, and every node's record is checked against an independent
recomputation from the user's own counts, never above its limit.

On the code before issue 24 these fail: nodes charged the amplified one-round eps only in the rounds their users
were sampled (Poisson users recorded 1.706 under a 3.33 guarantee), a tree's participations at eps(tree)/E each
(1.0 and 2.0 where 1.319 and 2.339 are due), and the shuffler drew k from whoever was connected."""

from __future__ import annotations

import time
from collections import Counter

import grpc
import numpy as np
import pytest
from _runs import wait_for_run
from shuffledp.clients.node import NodeCore, UserShard, start_node
from shuffledp.clients.policy import Refusal, UserPolicy
from shuffledp.clients.spend_store import SqliteSpendStore
from shuffledp.services.analyzer import LEDGER_FILE, start_analyzer
from shuffledp.services.ledger import Ledger
from shuffledp.services.shuffler import start_shuffler

from shuffledp.config import parse_config
from shuffledp.protocols.gaussian_round import GaussianRound, poisson_epsilon, unamplified_epsilon, wor_epsilon
from shuffledp.protocols.tree_round import _trees_epsilon
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg


class Cluster:
    """Shuffler, analyzer and two nodes in this process over real sockets; the nodes keep their spend in SQLite."""

    def __init__(self, tmp_path, toml: str, nodes: int = 2):
        self.tmp = tmp_path
        self.shuffler, sport = start_shuffler("127.0.0.1:0", rng=make_rng(3))
        self.analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{aport}")
        self.stub = pbg.AnalyzerStub(self.channel)
        self.toml = toml
        cfg = parse_config(toml)
        self.nodes = [
            start_node(f"n{i}", cfg, i, nodes, f"127.0.0.1:{sport}", state_dir=tmp_path / "nodes", rng=make_rng(10 + i))
            for i in range(nodes)
        ]
        self.stopped: set[int] = set()

    def run(self, timeout: float = 180) -> pb.RunStatus:
        run_id = self.stub.CreateRun(pb.CreateRunRequest(config_toml=self.toml)).run_id
        self.stub.StartRun(pb.RunRef(run_id=run_id))
        self.run_id = run_id
        return wait_for_run(self.stub, run_id, timeout=timeout)

    def ledger_rows(self) -> list[dict]:
        return Ledger(self.tmp / "state" / LEDGER_FILE).rounds(self.run_id)

    def records(self) -> list[tuple[float, Counter]]:
        """(recorded eps, counts in the run) of every user of every node, read back from the nodes' SQLite stores."""
        out = []
        for i, n in enumerate(self.nodes):
            ids = n.core.shard.user_ids
            store = SqliteSpendStore(self.tmp / "nodes" / f"n{i}.spend.sqlite")
            eps, _, _ = store.load(ids)
            runs = store.load_runs(ids)
            counts = runs[self.run_id][0] if self.run_id in runs else {}
            out += [(float(eps[u]), counts.get(u, Counter())) for u in range(len(ids))]
            store.close()
        return out

    def stop_node(self, i: int) -> None:
        self.nodes[i].stop()
        self.stopped.add(i)

    def close(self) -> None:
        for i, n in enumerate(self.nodes):
            if i not in self.stopped:
                n.stop()
        self.channel.close()
        self.analyzer.stop(0)
        self.shuffler.stop(0)


def _refused(st: pb.RunStatus, reason: str) -> int:
    return sum(m.refused_reasons.get(reason, 0) for m in st.metrics)


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_sampled_dp_sgd_users_are_charged_every_eligible_round_and_stop_at_their_limit(tmp_path, blobs_data, sampling):
    """Item 1: 20 rounds of 30 of 225 users at a budget whose ledger figure is above the users' max_total_eps = 2.5.
    Each user's record equals min(the run's amplified accountant, the unamplified Gaussian), both over every round
    it was eligible for (issue 43 item 4), recomputed here from its counts, sampled or not; no record exceeds 2.5;
    users refuse (withdraw) once one more eligible round could take them past it. On the code before issue 43 the
    unamplified bound counted joins only, and eligible users never sampled recorded 0."""
    toml = blobs_data + (
        '[model]\ntask = "logreg"\n[privacy]\neps = 4.0\ndelta = 1e-5\nprotocol = "gaussian"\n'
        f'[schedule]\nkind = "subsampled"\nsampling = "{sampling}"\ncohort_size = 30\nrounds = 20\n'
        'learning_rate = 0.5\n[transport]\nmode = "sealed"\n[deployment]\nround_deadline_seconds = 5\n'
        "[policy]\nmax_total_eps = 2.5\n"
    )
    c = Cluster(tmp_path, toml)
    try:
        st = c.run()
        rows = c.ledger_rows()
        params = rows[0]["event"]["params"]
        z, n, k = params["noise_multiplier"], params["n"], params["k"]
        poisson = sampling == "poisson"
        planned = poisson_epsilon(z, params.get("q", 0.0), 20, 1e-5) if poisson else wor_epsilon(z, n, k, 20, 1e-5)
        assert planned > 2.5  # the run's guarantee is above the users' limit...
        assert _refused(st, Refusal.TOTAL_EPS) > 0  # ...so users' nodes refused rounds
        records = c.records()
        joined = [r for r in records if r[1]["joined"]]
        assert len(joined) > 30  # more than one round's cohort
        for eps, counts in records:
            e, j = counts["eligible"], counts["joined"]
            assert e >= j and e <= 20
            amplified = poisson_epsilon(z, params.get("q", 0.0), e, 1e-5) if poisson else wor_epsilon(z, n, k, e, 1e-5)
            due = min(amplified, unamplified_epsilon(z, e, 1e-5, poisson))
            assert eps >= due and eps == pytest.approx(due, rel=1e-12, abs=1e-15)
            assert eps <= 2.5
        never = [eps for eps, counts in records if counts["eligible"] and not counts["joined"]]
        assert never and min(never) > 0.0  # eligible, never sampled: charged all the same
        # every user who joined was counted in the rounds before it withdrew, sampled or not: its amplified count
        # is the rounds it stayed in, not the rounds it was sampled in (the old charge)
        assert max(counts["eligible"] for _, counts in joined) > max(counts["joined"] for _, counts in joined)
    finally:
        c.close()


def test_dp_ftrl_charges_participations_by_their_actual_count_in_each_tree(tmp_path, blobs_data):
    """Item 2: one tree of 16 rounds, E = 2 participations per user (>= 3 rounds apart): a user with k leaves is
    charged eps(tree of 16, E = k), 1 leaf ~ half of 2 leaves' cost is NOT what it pays. A user with E leaves records
    at least the ledger's figure; under max_total_eps between eps(1 leaf) and eps(2 leaves), users refuse a second."""
    toml = blobs_data + (
        '[model]\ntask = "logreg"\n[privacy]\neps = 3.0\ndelta = 1e-5\nprotocol = "tree"\n'
        "[privacy.tree]\nmax_participations = 2\nmin_separation = 3\n"
        '[schedule]\nkind = "subsampled"\ncohort_size = 20\nrounds = 16\nlearning_rate = 0.5\n'
        '[transport]\nmode = "sealed"\n[deployment]\nround_deadline_seconds = 5\n'
    )
    one_run = Cluster(tmp_path / "a", toml)
    try:
        st = one_run.run()
        assert st.state == pb.COMPLETED, st.message
        p = one_run.ledger_rows()[0]["event"]["params"]
        z, xi = p["noise_multiplier"], p["min_separation"]
        one, two = (_trees_epsilon(z, 16, xi, False, 1e-5, (k,)) for k in (1, 2))
        assert two > 1.5 * one  # not linear: the old per-participation share was eps(E = 2) / 2 each
        by_leaves = Counter()
        for eps, counts in one_run.records():
            leaves = sum(counts.values())
            by_leaves[leaves] += 1
            assert eps == pytest.approx({0: 0.0, 1: one, 2: two}[leaves], rel=1e-12, abs=0.0)
            assert eps >= {0: 0.0, 1: one, 2: two}[leaves]
        assert by_leaves[2] > 0 and by_leaves[1] > 0
        assert two >= st.budget.eps_spent  # a user with E leaves records at least the ledger's guarantee
    finally:
        one_run.close()
    limited = Cluster(tmp_path / "b", toml + f"[policy]\nmax_total_eps = {(one + two) / 2}\n")
    try:
        st = limited.run()
        assert _refused(st, Refusal.TOTAL_EPS) > 0
        for eps, counts in limited.records():
            assert sum(counts.values()) <= 1 and eps <= (one + two) / 2
    finally:
        limited.close()


def test_a_fixed_cohort_is_never_drawn_from_fewer_users_than_it_is_charged_for(tmp_path, blobs_data):
    """Item 3: after one of two nodes leaves, the shuffler would sample the remaining users at about twice the
    rate the ledger charges. It refuses every such round before inviting anyone (nothing charged); the ledger's
    figure is the fixed-cohort accountant over the committed rounds at the planned n."""
    toml = blobs_data + (
        '[model]\ntask = "logreg"\n[privacy]\neps = 6.0\ndelta = 1e-5\nprotocol = "gaussian"\n'
        '[schedule]\nkind = "subsampled"\ncohort_size = 30\nrounds = 30\nlearning_rate = 0.5\n'
        '[transport]\nmode = "sealed"\n[deployment]\nround_deadline_seconds = 5\n'
        "min_round_seconds = 0.1\n"  # >= 3 s: the node stops while most rounds are still to run
    )
    c = Cluster(tmp_path, toml)
    try:
        run_id = c.stub.CreateRun(pb.CreateRunRequest(config_toml=toml)).run_id
        c.run_id = run_id
        c.stub.StartRun(pb.RunRef(run_id=run_id))
        for _ in range(600):
            st = c.stub.GetRunStatus(pb.RunRef(run_id=run_id))
            if st.rounds_done >= 3:
                break
            time.sleep(0.05)
        c.stop_node(1)
        st = wait_for_run(c.stub, run_id, timeout=240)
        rows = c.ledger_rows()
        committed = [r for r in rows if r["state"] == "committed"]
        p = rows[0]["event"]["params"]
        assert 3 <= len(committed) < 30
        refused = [m for m in st.metrics if "accounted for a population of" in m.failure]
        assert refused, [m.failure for m in st.metrics]
        expected = wor_epsilon(p["noise_multiplier"], p["n"], p["k"], len(committed), 1e-5)
        assert st.budget.eps_spent == pytest.approx(expected, rel=1e-9)
    finally:
        c.close()


def _gaussian_spec(run: str, r: int, population: int, **extra) -> pb.RoundSpec:
    """A fixed-cohort central DP-SGD round (k = 10 of n = 100, z = 1) for logistic regression on 3 features;
    `extra` overrides the plan's parameters (e.g. sampling = "poisson", q)."""
    from types import SimpleNamespace

    from shuffledp.security import sealing

    params = {"d": 8, "clip": 1.0, "k": 10, "n": 100, "delta": 1e-5, "noise_multiplier": 1.0, "noise": "continuous"}
    params.update(extra)
    fields = GaussianRound().spec_fields({}, params, SimpleNamespace(params=params), sealing.generate_keypair()[1])
    spec = pb.RoundSpec(run_id=run, round=r, schedule=pb.SUBSAMPLED, task="logreg", num_classes=2, **fields)
    spec.model.shape.append(8)  # 2 classes x (3 features + bias)
    spec.model.f64 = np.zeros(8).tobytes()
    spec.population = population
    return spec


def test_a_node_refuses_a_round_drawn_from_fewer_users_than_accounted_and_counts_notices():
    """Items 1 and 3 at one node: the rate is checked on the shuffler's eligible count, not the analyzer's n; a
    notice (an invitation with no user of this node) counts every user eligible once per round and charges it for
    that round at once (issue 43 item 4: before it, nothing until the user joined), and is not answered."""
    shard = UserShard([f"u{i}" for i in range(4)], np.zeros((4, 1, 3)), np.zeros((4, 1), dtype=np.int64))
    core = NodeCore("node", shard, UserPolicy(max_total_eps=100.0))
    low = core.handle(pb.Invitation(spec=_gaussian_spec("r", 0, 100), user_ids=["u0"], eligible=99))
    assert [x.reason for x in low.refusals] == [Refusal.POPULATION]
    assert "r" not in core.policy.runs or not core.policy.runs["r"].counts
    spec = _gaussian_spec("r", 1, 100)
    with pytest.raises(ValueError, match="population"):
        GaussianRound().user_account(_gaussian_spec("r", 1, 0))  # a spec that escapes the shuffler's check
    for _ in range(2):  # the same round twice counts once
        out = core.handle(pb.Invitation(spec=spec, user_ids=[], eligible=100))
        assert not out.refusals and not out.messages
    counts = core.policy.runs["r"].counts
    assert [counts[u]["eligible"] for u in range(4)] == [1, 1, 1, 1]
    one = min(wor_epsilon(1.0, 100, 10, 1, 1e-5), unamplified_epsilon(1.0, 1, 1e-5, False))
    assert all(core.spent(f"u{i}")[0] >= one > 0.0 for i in range(4))
    # round 2, u1 sampled: every user is charged min(amplified, unamplified) over its 2 eligible rounds, in all
    out = core.handle(pb.Invitation(spec=_gaussian_spec("r", 2, 100), user_ids=["u1"], eligible=100))
    assert len(out.messages) == 1 and not out.refusals
    due = min(wor_epsilon(1.0, 100, 10, 2, 1e-5), unamplified_epsilon(1.0, 2, 1e-5, False))
    for u in ("u0", "u1"):
        assert core.spent(u) == (pytest.approx(due, rel=1e-12), 1e-5) and core.spent(u)[0] >= due


@pytest.mark.parametrize("kind", ["poisson", "fixed", "fixed-discrete"])
def test_sampled_dp_sgd_cost_is_a_function_of_the_eligible_rounds_alone(kind):
    """Issue 43 item 4, the cost function: min(amplified, unamplified), both over the E eligible rounds, whatever
    the number of rounds joined (the outcome of the secret sampling); 0 only when eligible for none. Old code: a
    user never sampled cost 0, and the unamplified bound counted joins only."""
    if kind == "poisson":
        spec = _gaussian_spec("r", 0, 0, sampling="poisson", q=0.074)
        spec.sampling_rate = 0.074
    else:
        spec = _gaussian_spec("r", 0, 100, noise="discrete" if kind == "fixed-discrete" else "continuous")
    poisson, noise = kind == "poisson", "discrete" if kind == "fixed-discrete" else "continuous"
    cost = GaussianRound().user_account(spec).cost
    assert cost(()) == (0.0, 0.0)
    for e in (1, 2, 7, 20):
        amplified = poisson_epsilon(1.0, 0.074, e, 1e-5) if poisson else wor_epsilon(1.0, 100, 10, e, 1e-5, noise)
        due = min(amplified, unamplified_epsilon(1.0, e, 1e-5, poisson, noise))
        for j in (0, 1, e):
            counts = tuple(sorted(x for x in (("eligible", e), ("joined", j)) if x[1]))
            assert cost(counts) == (due, 1e-5)
        assert due > 0.0
    # a cohort of everyone: the exact unamplified curve is below the RDP accountant's, and is charged over the
    # eligible rounds too
    full = GaussianRound().user_account(_gaussian_spec("r", 0, 100, k=100)).cost
    assert full((("eligible", 3),)) == (unamplified_epsilon(1.0, 3, 1e-5, False), 1e-5)
    assert unamplified_epsilon(1.0, 3, 1e-5, False) < wor_epsilon(1.0, 100, 100, 3, 1e-5)


def test_a_user_withdraws_when_one_more_eligible_round_would_pass_its_limit_sampled_or_not():
    """Issue 43 item 4 at one node (policy.decide_in_run): with max_total_eps between the charge for 1 and for 2
    eligible rounds, a user never sampled is charged for round 0's eligibility, then withdraws at round 1's notice
    (not counted, nothing more charged) and refuses round 2's invitation. Old code: it paid nothing and stayed."""
    one = min(wor_epsilon(1.0, 100, 10, 1, 1e-5), unamplified_epsilon(1.0, 1, 1e-5, False))
    two = min(wor_epsilon(1.0, 100, 10, 2, 1e-5), unamplified_epsilon(1.0, 2, 1e-5, False))
    shard = UserShard(["u0"], np.zeros((1, 1, 3)), np.zeros((1, 1), dtype=np.int64))
    core = NodeCore("node", shard, UserPolicy(max_total_eps=(one + two) / 2))
    core.handle(pb.Invitation(spec=_gaussian_spec("r", 0, 100), user_ids=[], eligible=100))
    assert core.spent("u0")[0] == pytest.approx(one, rel=1e-12) and core.spent("u0")[0] >= one
    core.handle(pb.Invitation(spec=_gaussian_spec("r", 1, 100), user_ids=[], eligible=100))
    assert core.policy.runs["r"].counts[0]["eligible"] == 1 and core.spent("u0")[0] < two
    out = core.handle(pb.Invitation(spec=_gaussian_spec("r", 2, 100), user_ids=["u0"], eligible=100))
    assert [x.reason for x in out.refusals] == [Refusal.TOTAL_EPS] and not out.messages


def test_the_shuffler_refuses_a_fixed_cohort_round_with_fewer_eligible_users_and_tells_every_node():
    """Item 3 at the shuffler: a SUBSAMPLED round is refused before anyone is invited (nothing recorded) when fewer
    users are eligible than its population; otherwise every live node with eligible users hears of it, with the
    count the cohort was drawn from. CLDP-SGD's specs carry their accountant's n as the population too."""
    from shuffledp.services.shuffler_state import CohortUnavailable, RoundRequest, Schedule, ShufflerState, Transport

    from shuffledp.protocols.ldp_round import LdpRound
    from shuffledp.security.sealing import PUBLIC_KEY_BYTES

    state = ShufflerState(rng=make_rng(2), poll_seconds=0.001)
    state.register_users("a", ["u0", "u1", "u2"])
    state.register_users("b", ["v0"])
    subs = {node: state.subscribe(node) for node in ("a", "b")}
    common = dict(message_bytes=16, analyzer_public_key=bytes(PUBLIC_KEY_BYTES), deadline_seconds=1e-4)
    with pytest.raises(CohortUnavailable, match="population of 5 users but only 4 are eligible"):
        state.execute_round(
            RoundRequest("run", 0, Schedule.SUBSAMPLED, Transport.SEALED, cohort_size=1, population=5, **common)
        )
    assert not state._store.round_exists("run", 0) and all(s.get(timeout=0.01) is None for s in subs.values())
    res = state.execute_round(
        RoundRequest("run", 0, Schedule.SUBSAMPLED, Transport.SEALED, cohort_size=1, population=4, **common)
    )
    assert res.eligible == 4 and res.invited == 1
    got = {node: s.get(timeout=1) for node, s in subs.items()}
    assert all(inv.eligible == 4 for inv in got.values()) and sum(len(inv.user_ids) for inv in got.values()) == 1
    from test_seed001_runs import _request, _spec

    ldp = LdpRound("r_inf")
    params = ldp.plan(_request(eps0=1.5, rounds=2, k=2)).params
    assert _spec(ldp, params, bytes(PUBLIC_KEY_BYTES)).population == params["n"] > 0


def test_a_node_refuses_a_run_whose_public_parameters_change(tmp_path):
    """A user's cost for a run is computed from all its rounds at the spec's parameters: an analyzer that claims a
    larger noise multiplier (or a larger population) in a later round would lower the cost of every earlier round.
    The node fixes the run's parameters at the first round it sees and refuses a round that differs, counting
    nothing of it; its spend store keeps them, so a restart does not let other parameters in (session 20: they
    were kept in memory only)."""
    shard = UserShard([f"u{i}" for i in range(4)], np.zeros((4, 1, 3)), np.zeros((4, 1), dtype=np.int64))
    core = NodeCore("node", shard, UserPolicy(max_total_eps=100.0), spend_store=SqliteSpendStore(tmp_path / "s.db"))
    out = core.handle(pb.Invitation(spec=_gaussian_spec("r", 0, 100), user_ids=["u0"], eligible=100))
    assert len(out.messages) == 1
    spent = core.spent("u0")
    louder = _gaussian_spec("r", 1, 100)
    louder.randomizer.extra["noise_multiplier"] = 10.0
    out = core.handle(pb.Invitation(spec=louder, user_ids=["u0", "u1"], eligible=100))
    assert [r.reason for r in out.refusals] == [Refusal.RUN_CHANGED] * 2 and not out.messages
    assert core.spent("u0") == spent and core.policy.runs["r"].counts[1]["eligible"] == 1  # round 1 not counted
    again = core.handle(pb.Invitation(spec=_gaussian_spec("r", 2, 100), user_ids=["u1"], eligible=100))
    assert len(again.messages) == 1  # the run's own parameters are still accepted
    restarted = NodeCore(
        "node", shard, UserPolicy(max_total_eps=100.0), spend_store=SqliteSpendStore(tmp_path / "s.db")
    )
    louder.round = 3
    out = restarted.handle(pb.Invitation(spec=louder, user_ids=["u2"], eligible=100))
    assert [r.reason for r in out.refusals] == [Refusal.RUN_CHANGED] and not out.messages
    out = restarted.handle(pb.Invitation(spec=_gaussian_spec("r", 4, 100), user_ids=["u2"], eligible=100))
    assert len(out.messages) == 1


def _in_run_spec(protocol: str, r: int) -> tuple[pb.RoundSpec, int]:
    """A round r of a run whose cost composes per run (design 6): (spec, features of its leastsq/logreg model)."""
    from types import SimpleNamespace

    from shuffledp.security import sealing

    if protocol == "gaussian":
        return _gaussian_spec("run", r, 100), 3
    if protocol == "mf":
        from test_mf_round import _plan

        from shuffledp.protocols.mf_round import MfRound

        plan = _plan(max_participations=3, min_separation=2, bands=3)
        fields = MfRound().spec_fields(plan, plan["params"], None, sealing.generate_keypair()[1])
        spec = pb.RoundSpec(run_id="run", round=r, schedule=pb.SUBSAMPLED, task="leastsq", **fields)
        d = int(plan["params"]["d"])
    else:
        from shuffledp.protocols.base import PlanRequest
        from shuffledp.protocols.tree_round import TreeRound, TreeSettings

        settings = TreeSettings(max_participations=2, min_separation=1)
        req = PlanRequest(
            "subsampled", 1.0, 1e-5, 16, 4, 4, 4, 1.0, "sealed", admitted=64, rounds_requested=16, settings=settings
        )
        p = TreeRound().plan(req).params
        event = SimpleNamespace(params={**p, "round": r})
        fields = TreeRound().spec_fields({}, p, event, sealing.generate_keypair()[1])
        spec = pb.RoundSpec(run_id="run", round=r, schedule=pb.SUBSAMPLED, task="leastsq", **fields)
        d = int(p["d"])
    spec.model.shape.append(d)
    spec.model.f64 = np.zeros(d).tobytes()
    return spec, d - 1


@pytest.mark.parametrize("protocol", ["gaussian", "mf", "tree"])
def test_a_repeated_invitation_to_a_round_of_a_run_is_refused_also_after_a_restart(tmp_path, protocol):
    """A shuffler that sends one round's invitation twice must not get a second release of a user's data: these
    runs compose per round (a tree's leaf, a matrix-factorization round, a sampled round), so a second answer would
    cost nothing in the user's counts (found by probing: the node answered again and charged nothing). The node
    refuses it from its own durable record, after a restart too, and later rounds of the run are answered."""
    spec, features = _in_run_spec(protocol, 3)
    shard = UserShard(["u0", "u1"], np.ones((2, 1, features)), np.zeros((2, 1), dtype=np.int64))
    policy = UserPolicy(max_total_eps=1e9, max_total_delta=1.0)
    store = SqliteSpendStore(tmp_path / "spend.sqlite")
    core = NodeCore("node", shard, policy, spend_store=store)
    inv = pb.Invitation(spec=spec, user_ids=["u0"], eligible=100)

    def answered(c: pb.Contribution) -> list[str]:
        return [m.user_id for m in c.messages] + list(c.columns.user_ids)

    first = core.handle(inv)
    spent = core.spent("u0")
    assert answered(first) == ["u0"] and spent[0] > 0
    again = core.handle(inv)
    assert not answered(again) and [x.reason for x in again.refusals] == [Refusal.ROUND_ANSWERED]
    assert core.spent("u0") == spent
    store.close()
    store = SqliteSpendStore(tmp_path / "spend.sqlite")
    restarted = NodeCore("node", shard, policy, spend_store=store)
    assert restarted.spent("u0") == spent
    after = restarted.handle(inv)
    assert not answered(after) and [x.reason for x in after.refusals] == [Refusal.ROUND_ANSWERED]
    later, _ = _in_run_spec(protocol, 6)  # far enough for the tree's and the factorization's separation
    assert answered(restarted.handle(pb.Invitation(spec=later, user_ids=["u0"], eligible=100))) == ["u0"]
    assert restarted.spent("u0")[0] >= spent[0]
    store.close()


def test_a_sampled_dp_sgd_join_always_comes_with_its_rounds_eligibility():
    """Found by probing as a dishonest shuffler: a notice of round r that every user refuses (here an unknown trust
    model) marked r counted, so the genuine invitation to r then let a user join without being counted eligible:
    ten such rounds cost it 0 instead of 17.5. A round that counted nobody is not counted, and a join only comes in
    the charge that counts its round; rounds seen before are refused."""

    def shard() -> UserShard:
        return UserShard(["u0", "u1"], np.zeros((2, 1, 3)), np.zeros((2, 1), dtype=np.int64))

    policy = UserPolicy(max_total_eps=1e9, max_total_delta=1.0)
    poisoned, honest = NodeCore("node", shard(), policy), NodeCore("node", shard(), policy)
    for r in range(10):
        notice = _gaussian_spec("run", r, 100)
        notice.trust_model = 99  # no user allows it: nobody is counted
        assert not poisoned.handle(pb.Invitation(spec=notice, user_ids=[], eligible=100)).refusals
        for core in (poisoned, honest):
            out = core.handle(pb.Invitation(spec=_gaussian_spec("run", r, 100), user_ids=["u0"], eligible=100))
            assert [m.user_id for m in out.messages] == ["u0"]
    assert poisoned.spent("u0") == honest.spent("u0") and poisoned.spent("u0")[0] > 10
    assert poisoned.policy.runs["run"].counts[0] == Counter({"eligible": 10, "joined": 10})
    # a notice every user accepts counts round 10: its invitation after it is not answered (u0 would join uncounted
    # by that invitation's charge, and was counted by the notice's), round 11 is
    core = honest
    assert not core.handle(pb.Invitation(spec=_gaussian_spec("run", 10, 100), user_ids=[], eligible=100)).messages
    late = core.handle(pb.Invitation(spec=_gaussian_spec("run", 10, 100), user_ids=["u0"], eligible=100))
    assert not late.messages and [x.reason for x in late.refusals] == [Refusal.ROUND_ANSWERED]
    nxt = core.handle(pb.Invitation(spec=_gaussian_spec("run", 11, 100), user_ids=["u0"], eligible=100))
    assert [m.user_id for m in nxt.messages] == ["u0"]
    assert core.policy.runs["run"].counts[0] == Counter({"eligible": 12, "joined": 11})
    # a round number the spend log cannot hold is refused, not answered or charged
    spent = core.spent("u1")
    huge = core.handle(pb.Invitation(spec=_gaussian_spec("run", 2**63, 100), user_ids=["u1"], eligible=100))
    assert not huge.messages and [x.reason for x in huge.refusals] == [Refusal.INVALID_SPEC]
    assert core.spent("u1") == spent


@pytest.mark.parametrize("protocol", ["mf", "tree"])
def test_a_round_answered_before_the_spend_log_recorded_rounds_is_not_answered_again(tmp_path, protocol):
    """A store written before the spend log kept each run charge's round (its rows have none): the per-round count
    itself (an MF round, a tree's leaf) must not take a second answer of that round."""
    from shuffledp.protocols.registry import known_protocol

    spec, features = _in_run_spec(protocol, 3)
    join = known_protocol(spec.randomizer.protocol).user_account(spec).join
    store = SqliteSpendStore(tmp_path / "old.sqlite")
    store.record(["u0"], np.array([0.5]), 1e-5, [None], "run", [join])  # no run_round: an earlier version's row
    store.close()
    shard = UserShard(["u0"], np.ones((1, 1, features)), np.zeros((1, 1), dtype=np.int64))
    core = NodeCore(
        "node",
        shard,
        UserPolicy(max_total_eps=1e9, max_total_delta=1.0),
        spend_store=SqliteSpendStore(tmp_path / "old.sqlite"),
    )
    out = core.handle(pb.Invitation(spec=spec, user_ids=["u0"], eligible=100))
    assert not out.messages and not out.columns.user_ids
    assert [x.reason for x in out.refusals] == [Refusal.PARTICIPATION] and core.spent("u0") == (0.5, 1e-5)
