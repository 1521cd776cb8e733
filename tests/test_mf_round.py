"""Issue 27: matrix-factorization DP-FTRL as the `mf` round plug-in. Over the real services (`shuffledp run`) the
ledger's eps is accountants.matrix_factorization's for the run's strategy, and the shuffler's durable record respects
the participation limits, also across a shuffler restart; the analyzer's noise (zero rows, checkpoints); the node's
per-user account; configuration errors."""

from __future__ import annotations

import functools
import json
import math
import sqlite3
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from _runs import run_cli
from shuffledp.services.shuffler import _request as shuffler_request
from shuffledp.services.shuffler_state import (
    ShufflerState,
    SqliteParticipationStore,
)

from shuffledp import cli
from shuffledp.accountants import matrix_factorization as mfa
from shuffledp.config import ConfigError, parse_config
from shuffledp.mechanisms import matrix_factorization as mfm
from shuffledp.protocols.base import PlanRequest
from shuffledp.protocols.mf_round import MfRound, MfSettings
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb

pytestmark = pytest.mark.timeout(300)

_CONFIG = """
[data]
dataset = "digits"
[model]
task = "logreg"
radius = 10.0
[privacy]
eps = 8.0
delta = 1e-5
protocol = "mf"
clip_norm = 1.0
[privacy.mf]
{privacy}
[schedule]
kind = "subsampled"
cohort_size = {k}
rounds = {rounds}
learning_rate = 2.0
output = "last"
[transport]
mode = "sealed"
[deployment]
client_nodes = 2
round_deadline_seconds = 30.0
"""


def _strategy_of(params: dict) -> mfm.Strategy:
    return mfm.Strategy.from_arrays(
        {
            "kind": np.asarray(mfm.KINDS.index(params["strategy"])),
            "rounds": np.asarray(params["rounds"]),
            **{name: np.asarray(params[name], dtype=np.float64) for name in ("buf_decay", "output_scale", "coefs")},
        }
    )


def _rounds_by_user(state_db: Path, run_id: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    with sqlite3.connect(state_db) as db:
        for tree, user, leaf in db.execute("SELECT tree, user_id, leaf FROM tree_leaves WHERE run_id = ?", (run_id,)):
            assert tree == 0  # the whole run is one "tree" of the shuffler's limits
            out[user].append(leaf)
    return out


def _check_limits(record: dict[str, list[int]], k: int, xi: int) -> int:
    """Every user's rounds: at most k, >= xi rounds strictly between two; returns the most any user took."""
    for rounds in record.values():
        rounds.sort()
        assert len(rounds) <= k and all(b - a - 1 >= xi for a, b in zip(rounds, rounds[1:], strict=False)), rounds
    return max(len(v) for v in record.values())


def test_mf_run_over_the_services_charges_the_accountants_eps_and_the_shuffler_keeps_the_limits(tmp_path: Path, capsys):
    k, rounds, E, xi = 100, 12, 2, 2
    privacy = f'strategy = "banded"\nbands = 3\nmax_participations = {E}\nmin_separation = {xi}'
    ledger, metrics, _ = run_cli(tmp_path, "mf", _CONFIG.format(privacy=privacy, k=k, rounds=rounds))
    plan = ledger["run"]["plan"]
    assert ledger["run"]["state"] == "COMPLETED" and plan["protocol"] == "mf"
    assert ledger["totals"]["trust_model"] == "central"
    assert [r["contributors"] for r in ledger["rounds"]] == [k] * rounds
    params = plan["params"]
    strategy = _strategy_of(params)
    assert strategy.kind == "banded" and len(strategy.coefs) == 3 and strategy.rounds == rounds
    # the accountant's figure for the run's parameters, the sensitivity recomputed from the plan's strategy
    expected = mfa.epsilon(params["noise_multiplier"], mfm.sensitivity(strategy, E, xi), 1e-5)
    assert ledger["totals"]["eps_spent"] == pytest.approx(expected, abs=1e-9)
    assert 7.9 < expected <= 8.0  # z is the least that fits
    # `shuffledp account mf` for the same parameters: the same least z and eps (issue 27 acceptance, 1e-9)
    argv = ["--rounds", str(rounds), "--bands", "3", "--max-participations", str(E), "--min-separation", str(xi)]
    assert cli.main(["account", "mf", *argv, "--eps", "8", "--delta", "1e-5", "--min-noise", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["noise_multiplier"] == params["noise_multiplier"]
    assert abs(answer["eps"] - ledger["totals"]["eps_spent"]) <= 1e-9
    record = _rounds_by_user(tmp_path / "mf" / "state" / "shuffler.sqlite", ledger["run"]["run_id"])
    assert sum(len(v) for v in record.values()) == k * rounds
    assert _check_limits(record, E, xi) == E  # the limit binds: 1200 rounds joined by fewer users
    # it learns: theta_0 is at chance (0.1)
    assert metrics[-1]["accuracy"] > 0.45, metrics[-1]


# ------------------------------------------------------------------------------------------- planning
def _request(k=5, rounds=12, n=100, eps=4.0, **options) -> PlanRequest:
    return PlanRequest(
        "subsampled", eps, 1e-5, rounds, k, k, 3, 1.0, "sealed", n, rounds, settings=MfSettings(**options)
    )


@functools.cache
def _sized(**options):
    return MfRound().plan(_request(**options))  # jax_privacy: seconds per plan, shared by the tests


def _plan(**options) -> dict:
    sized = _sized(**options)
    return {"params": sized.params, **sized.plan_extra, "min_contributors": sized.min_contributors}


def test_plan_sizes_the_least_noise_and_refuses_what_does_not_fit():
    plan = _plan(max_participations=2, min_separation=3, bands=4)
    p = plan["params"]
    z, strategy = p["noise_multiplier"], _strategy_of(p)
    sens = mfm.sensitivity(strategy, 2, 3)
    assert p["sensitivity"] == sens and plan["mf_prefix_sensitivity"][-1] == sens
    assert mfa.epsilon(z, sens, 1e-5) <= 4.0 < mfa.epsilon(z * 0.999, sens, 1e-5)
    # a stopped run is charged the sensitivity of its first t rounds (the plan's numpy table = jax_privacy's)
    for t in (1, 4, 5, 9):
        assert plan["mf_prefix_sensitivity"][t - 1] == pytest.approx(mfm.sensitivity(strategy, 2, 3, t), rel=1e-12)
    assert plan["mf_prefix_sensitivity"] == sorted(plan["mf_prefix_sensitivity"])
    with pytest.raises(ValueError, match="spends eps"):
        MfRound().plan(_request(max_participations=2, min_separation=3, bands=4, noise_multiplier=z * 0.99))
    with pytest.raises(ValueError, match=r"min_separation 29 \+ 1\) exceeds the 100 admitted"):
        MfRound().plan(_request(min_separation=29))
    with pytest.raises(ValueError, match="need more than max_participations 1"):
        MfRound().plan(_request(k=10))  # 12 rounds x 10 users > 1 x 100


def test_default_bands_are_xi_plus_one_or_every_round_for_one_participation():
    """b <= xi + 1 keeps two participations' columns orthogonal; with one participation any b has C's largest column
    norm as sensitivity, so the planner takes the full Toeplitz (b = T), whose prefix error is the least."""
    assert len(_strategy_of(_plan(max_participations=2, min_separation=3)["params"]).coefs) == 4
    one = _strategy_of(_plan()["params"])
    assert len(one.coefs) == 12
    narrow = _strategy_of(_plan(bands=1)["params"])
    # at equal privacy (noise std proportional to the sensitivity) the full Toeplitz's worst prefix error is lower
    full, banded1 = (mfm.sensitivity(c) ** 2 * float(np.max(mfm.prefix_variance(c))) for c in (one, narrow))
    assert full < 0.8 * banded1, (full, banded1)


def test_the_ledger_charges_the_rounds_it_committed():
    """compose: the run stopped after round 4 is charged C[:5, :5]'s sensitivity; round_cost the whole run's."""
    from shuffledp.services.ledger import PrivacyEvent

    plan = _plan(max_participations=2, min_separation=3, bands=4)
    p = plan["params"]
    proto = MfRound()
    events = [PrivacyEvent("mf", proto.event_params(plan, r), 3, "subsampled", "central") for r in range(5)]
    limit = type("Limit", (), {"delta": 1e-5})()
    eps, delta = proto.compose(events, limit)
    assert delta == 1e-5
    assert eps == pytest.approx(mfa.epsilon(p["noise_multiplier"], mfm.sensitivity(_strategy_of(p), 2, 3, 5), 1e-5))
    assert eps < proto.round_cost(events[0])[0] <= 4.0


# ------------------------------------------------------------------------------ the analyzer's noise
def _noise_run(plan: dict, rounds: list[int], seed: int, state=None) -> tuple[list, object]:
    proto, rng = MfRound(), make_rng(seed)
    p = plan["params"]
    state = proto.noise_state(plan) if state is None else state
    out = []
    for r in rounds:
        total, divisor, state = proto.add_noise(np.zeros(p["d"]), r, plan, p, state, rng, 3)
        assert divisor == p["k"]  # the fixed cohort, not the contributors
        out.append(total)
    return out, state


def test_a_round_that_released_nothing_is_a_zero_row_whose_noise_the_next_release_carries():
    plan = _plan(max_participations=2, min_separation=3, bands=4)
    p = plan["params"]
    noises, state = _noise_run(plan, [0, 1, 2, 4, 5], seed=7)
    # the same CSPRNG stream through the mechanism row by row (row 3 drawn, released with row 4)
    strategy, rng = _strategy_of(p), make_rng(7)
    ns = mfm.init_noise(strategy, p["d"])
    rows = []
    for _ in range(6):
        w, ns = mfm.next_noise(ns, strategy, p["noise_multiplier"] * p["clip"], rng)
        rows.append(w)
    np.testing.assert_allclose(noises, [rows[0], rows[1], rows[2], rows[3] + rows[4], rows[5]], atol=1e-12)
    assert state.round == 6


def test_noise_state_survives_a_checkpoint_and_is_never_redrawn():
    plan = _plan(max_participations=2, min_separation=3, bands=4)
    p = plan["params"]
    whole, _ = _noise_run(plan, list(range(9)), seed=3)
    proto, rng = MfRound(), make_rng(3)
    first, state = [], proto.noise_state(plan)
    for r in range(4):
        total, _, state = proto.add_noise(np.zeros(p["d"]), r, plan, p, state, rng, 3)
        first.append(total)
    restored = proto.noise_from_arrays(plan, {k: np.array(v) for k, v in state.to_arrays().items()})
    rest = []
    for r in range(4, 9):
        total, _, restored = proto.add_noise(np.zeros(p["d"]), r, plan, p, restored, rng, 3)
        rest.append(total)
    np.testing.assert_array_equal(np.array(first + rest), np.array(whole))
    with pytest.raises(RuntimeError, match="already noised"):
        proto.add_noise(np.zeros(p["d"]), 8, plan, p, restored, rng, 3)
    with pytest.raises(ValueError, match="noise state has shape"):
        proto.noise_from_arrays(plan, {"round": np.asarray(2), "buffers": np.zeros((1, p["d"]))})


# ---------------------------------------------------------------------------------- spec, node, shuffler
def _spec(plan: dict, round_: int) -> pb.RoundSpec:
    proto = MfRound()
    fields = proto.spec_fields(plan, plan["params"], None, b"k" * 32)
    p = plan["params"]
    return pb.RoundSpec(
        run_id="run", round=round_, schedule=pb.SUBSAMPLED, cohort_size=p["k"], min_contributors=1, **fields
    )


def test_the_node_charges_a_user_its_actual_rounds_and_verifies_the_claim():
    plan = _plan(max_participations=3, min_separation=2, bands=3)
    p = plan["params"]
    proto = MfRound()
    spec = _spec(plan, 0)
    eps_run = mfa.epsilon(p["noise_multiplier"], p["sensitivity"], 1e-5)
    assert spec.per_user_cost.eps == pytest.approx(eps_run / 3)
    assert spec.per_user_cost.delta == pytest.approx(1e-5 / 3)
    assert proto.verify_epsilon(spec) == pytest.approx(spec.per_user_cost.eps, rel=1e-12)
    account = proto.user_account(spec)
    assert account.join == "0" and account.eligible is None
    # the worst pattern (0, 3, 6) pays the ledger's figure; fewer or farther rounds less (the node's own figure)
    worst = account.cost((("0", 1), ("3", 1), ("6", 1)))
    assert worst[0] == pytest.approx(eps_run, rel=1e-9) and worst[1] == 1e-5
    assert account.cost((("0", 1),))[0] < account.cost((("0", 1), ("9", 1)))[0] < worst[0]
    assert account.allows((("0", 1), ("3", 1), ("6", 1)))
    assert not account.allows((("0", 1), ("2", 1)))  # one round between: xi = 2 needs two
    assert not account.allows((("0", 1), ("3", 1), ("6", 1), ("9", 1)))  # four > k = 3
    # an analyzer that claims a smaller sensitivity than its strategy has is caught by the node's own figure
    low = _spec(plan, 0)
    low.randomizer.extra["sensitivity"] = p["sensitivity"] / 2
    low.per_user_cost.eps = mfa.epsilon(p["noise_multiplier"], p["sensitivity"] / 2, 1e-5) / 3
    assert proto.verify_epsilon(low) == pytest.approx(eps_run / 3, rel=1e-9)
    assert eps_run / 3 > low.per_user_cost.eps
    beyond = _spec(plan, 12)
    with pytest.raises(ValueError, match="lacks a valid"):
        proto.user_account(beyond)
    huge = _spec(plan, 0)
    huge.randomizer.extra["rounds"], huge.randomizer.extra["max_participations"] = 90_000, 1_000
    with pytest.raises(ValueError, match="exceed what a node verifies"):
        proto.verify_epsilon(huge)
    for bad in (math.inf, math.nan, 2.5):
        odd = _spec(plan, 0)
        odd.randomizer.extra["rounds"] = bad
        with pytest.raises(ValueError, match="rounds must be an integer"):
            proto.user_account(odd)


def test_a_blt_strategy_travels_in_the_spec_and_streams_its_noise():
    """A BLT C (one buffer; jax_privacy's optimisation is minutes, so set by hand) through the plan's params, the
    spec's extra and the node's figures: the canonical pattern's Delta is the exact one (C non-increasing)."""
    strategy = mfm.Strategy("blt", 10, np.array([0.6]), np.array([0.3]), np.array([]))
    sens = mfm.sensitivity(strategy, 2, 1)
    params = {"d": 4, "clip": 2.0, "k": 3, "n": 30, "rounds": 10, "max_participations": 2, "min_separation": 1}
    params.update(delta=1e-5, noise_multiplier=3.0, noise="continuous", strategy="blt", sensitivity=sens)
    params.update(buf_decay=[0.6], output_scale=[0.3], coefs=[])
    plan = {"params": params, "mf_prefix_sensitivity": [sens] * 10}
    proto, spec = MfRound(), _spec(plan, 4)
    assert {k for k in spec.randomizer.extra if k.startswith(("buf", "out", "coef"))} == {
        "buf_decay_0",
        "output_scale_0",
    }
    assert proto.verify_epsilon(spec) == pytest.approx(mfa.epsilon(3.0, sens, 1e-5) / 2, rel=1e-9)
    assert proto.user_account(spec).cost((("0", 1), ("2", 1)))[0] == pytest.approx(mfa.epsilon(3.0, sens, 1e-5))
    noises, state = _noise_run(plan, [0, 2], seed=11)
    rng, ns, rows = make_rng(11), mfm.init_noise(strategy, 4), []
    for _ in range(3):
        w, ns = mfm.next_noise(ns, strategy, 6.0, rng)
        rows.append(w)
    np.testing.assert_allclose(noises, [rows[0], rows[1] + rows[2]], atol=1e-12)
    assert state.round == 3 and state.buffers.shape == (1, 4)


def test_the_shuffler_keeps_the_limits_of_the_mf_spec_across_a_restart(tmp_path: Path):
    """The plug-in's spec carries the tree's participation field (the whole run one tree), so the unchanged
    shuffler enforces k and xi on its durable SQLite record, also after a restart mid-run."""
    plan = _plan(k=3, rounds=6, n=10, max_participations=2, min_separation=1, bands=2)
    assert tuple(shuffler_request(_spec(plan, 0)).limits) == (2, 1, 6)
    db, users = tmp_path / "shuffler.sqlite", [f"u{i}" for i in range(10)]

    def start(seed: int) -> tuple[SqliteParticipationStore, ShufflerState]:
        store = SqliteParticipationStore(db)
        state = ShufflerState(store, rng=make_rng(seed), poll_seconds=0.001)
        state.register_users("node", users)
        state.subscribe("node")
        return store, state

    def execute(state: ShufflerState, r: int):
        spec = _spec(plan, r)
        spec.deadline_seconds = 1e-4  # nobody answers: only the draw and its durable record matter here
        return state.execute_round(shuffler_request(spec))  # the shuffler's own reading of the plug-in's spec

    store, state = start(1)
    for r in range(3):
        assert execute(state, r).invited == 3
    store.close()
    store, state = start(1)  # same seed: without the record it would draw the same users again
    for r in range(3, 6):
        assert execute(state, r).invited == 3
    store.close()
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT tree, user_id, leaf FROM tree_leaves WHERE run_id = 'run'").fetchall()
    record: dict[str, list[int]] = defaultdict(list)
    for tree, user, leaf in rows:
        assert tree == 0
        record[user].append(leaf)
    assert len(rows) == 6 * 3 and _check_limits(record, 2, 1) == 2  # 18 rounds joined by 10 users: k binds


# ------------------------------------------------------------------------------------------ configuration
_CENTRAL = """
[privacy]
protocol = "mf"
[privacy.mf]
{privacy}
[schedule]
kind = "subsampled"
cohort_size = 10
rounds = 12
learning_rate = 1.0
[transport]
mode = "sealed"
"""


@pytest.mark.parametrize(
    "privacy, key",
    [
        ('noise = "discrete"', "privacy.mf.noise"),
        ('strategy = "blt"\nbands = 2', "privacy.mf.bands"),
        ("bands = 13", "privacy.mf.bands"),
        ('strategy = "toeplitz"', "privacy.mf.strategy"),
        ("max_participations = 0", "privacy.mf.max_participations"),
    ],
)
def test_config_errors_are_one_line_naming_the_key(privacy, key):
    with pytest.raises(ConfigError) as err:
        parse_config(_CENTRAL.format(privacy=privacy))
    assert key in str(err.value) and "\n" not in str(err.value), err.value


def test_a_valid_mf_config_parses_and_feeds_ftrl():
    cfg = parse_config(_CENTRAL.format(privacy='strategy = "banded"\nbands = 2\nmax_participations = 2'))
    assert cfg.privacy.protocol == "mf" and cfg.privacy.settings.bands == 2


# ------------------------------------------------------------------------------------- users' own accounts
def test_each_users_node_charges_the_rounds_it_joined_and_keeps_its_limit(tmp_path, blobs_data):
    """Issue 24 item 2 for mf, over real gRPC services with the nodes' SQLite spend stores: 16 rounds of 20 of 225
    users, k = 2 rounds per user >= 3 apart. Every user's record is eps(z, pattern_sensitivity(its rounds), delta),
    recomputed here from the rounds in its node's record; none is above the ledger's (worst-pattern) figure; under
    a max_total_eps between one round's and two rounds' cost, users refuse and stay within it."""
    from shuffledp.clients.policy import Refusal
    from test_users_own_accounting import Cluster

    toml = blobs_data + (
        '[model]\ntask = "logreg"\n[privacy]\neps = 3.0\ndelta = 1e-5\nprotocol = "mf"\n'
        "[privacy.mf]\nbands = 4\nmax_participations = 2\nmin_separation = 3\n"
        '[schedule]\nkind = "subsampled"\ncohort_size = 20\nrounds = 16\nlearning_rate = 0.5\n'
        '[transport]\nmode = "sealed"\n[deployment]\nround_deadline_seconds = 5\n'
    )
    one_run = Cluster(tmp_path / "a", toml)
    try:
        st = one_run.run()
        assert st.state == pb.COMPLETED, st.message
        p = one_run.ledger_rows()[0]["event"]["params"]
        strategy, z = _strategy_of(p), p["noise_multiplier"]
        assert st.budget.eps_spent == pytest.approx(mfa.epsilon(z, mfm.sensitivity(strategy, 2, 3), 1e-5), abs=1e-9)
        by_rounds = Counter()
        for eps, counts in one_run.records():
            rounds = sorted(int(r) for r, c in counts.items() if c)
            due = mfa.epsilon(z, mfm.pattern_sensitivity(strategy, rounds), 1e-5) if rounds else 0.0
            assert eps >= due and eps == pytest.approx(due, rel=1e-12, abs=0.0)
            assert eps <= st.budget.eps_spent * (1 + 1e-12)
            by_rounds[len(rounds)] += 1
        assert by_rounds[2] > 0 and by_rounds[1] > 0 and set(by_rounds) <= {0, 1, 2}
    finally:
        one_run.close()
    one = mfa.epsilon(z, mfm.pattern_sensitivity(strategy, [0]), 1e-5)
    limit = (one + st.budget.eps_spent) / 2
    limited = Cluster(tmp_path / "b", toml + f"[policy]\nmax_total_eps = {limit}\n")
    try:
        st = limited.run()
        assert _refused(st, Refusal.TOTAL_EPS) > 0
        assert all(eps <= limit for eps, _ in limited.records())
    finally:
        limited.close()


def _refused(st: pb.RunStatus, reason: str) -> int:
    return sum(m.refused_reasons.get(reason, 0) for m in st.metrics)


def test_a_node_verifies_and_accounts_an_mf_round_without_jax():
    """Only planning needs JAX: the node's figures (verify_epsilon, user_account) are numpy and dp_accounting."""
    plan = _plan(max_participations=3, min_separation=2, bands=3)
    spec = _spec(plan, 3).SerializeToString()
    code = (
        "import sys\n"
        "from shuffledp.protocols.registry import round_protocol\n"
        "from shuffledp.v1 import shuffledp_pb2 as pb\n"
        f"spec = pb.RoundSpec.FromString({spec!r})\n"
        "proto = round_protocol('mf')\n"
        "eps = proto.verify_epsilon(spec)\n"
        "cost = proto.user_account(spec).cost((('0', 1), ('3', 1)))\n"
        "print(eps > 0 and cost[0] > 0, sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jax_privacy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["True", "[]"], out.stdout + out.stderr
