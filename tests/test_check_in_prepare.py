"""A node computes a check-in round's rounding while its users' check-in travels (PvecRound.prepare, issue 30 item
1), and sends its users' counts as sums per group of users with their noise drawn at once (pvec_round._put_sums):
each group's sum has the law of the sum of its users' xhat + Bin(m, p) (Alg 1 of paper 000), and a preparation is
used only for the spec and users it fits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _intercept import user_messages
from shuffledp.clients.node import NodeCore, UserShard
from shuffledp.clients.policy import UserPolicy

from shuffledp.mechanisms import check_in
from shuffledp.security.rng import make_rng
from shuffledp.transport.spec_signing import second_spec
from shuffledp.v1 import shuffledp_pb2 as pb

F = 3
D = F + 1
G, M_PLAN, P, FRACTION = 16, 40, 0.5, 0.99
POLICY = UserPolicy(max_total_eps=np.inf, max_total_delta=1.0, verify_randomizer=False)
THETA = np.array([0.3, -0.2, 0.1, 0.05])


def shard(n: int) -> UserShard:
    rng = make_rng(31)
    return UserShard([f"u{j}" for j in range(n)], rng.normal(size=(n, 1, F)) * 4, rng.normal(size=(n, 1)))


def first_spec(planned: int, n_min: int, round_: int = 2) -> pb.RoundSpec:
    """A check-in invitation sized for `planned` users (randomizer.extra n) and n_min contributors."""
    return pb.RoundSpec(
        run_id="run",
        round=round_,
        schedule=pb.FULLY_INTERACTIVE,
        trust_model=pb.SHUFFLE,
        transport=pb.COUNTS,
        randomizer=pb.RandomizerSpec(
            protocol="pvec", dim=D, g=G, m=M_PLAN, p=P, clip_norm=1.0, extra={"n": float(planned)}
        ),
        model=pb.Tensor(shape=[D], f64=THETA.tobytes()),
        task="leastsq",
        min_contributors=n_min,
        deadline_seconds=10,
        per_user_cost=pb.PrivacyCost(eps=1.0, delta=1e-6, trust_model=pb.SHUFFLE),
        local_batch=1,
        check_in=pb.CheckIn(noise_trials=M_PLAN * n_min, report_fraction=FRACTION),
    )


def second(first: pb.RoundSpec, c: int) -> tuple[pb.RoundSpec, int]:
    """The shuffler's second invitation after c check-ins (its own code), and its m."""
    _, m = check_in.share(int(first.check_in.noise_trials), FRACTION, first.min_contributors, c)
    return second_spec(first, c), m


def check_in_and_prepare(core: NodeCore, spec: pb.RoundSpec, ids: list[str]) -> list[str]:
    inv = pb.Invitation(spec=spec, user_ids=ids)
    checked = list(core.handle(inv).columns.user_ids)
    core.prepare(inv)
    return checked


def sums_of(con: pb.Contribution) -> np.ndarray:
    """The contribution's group sums (UserColumns.sums), one row per group."""
    assert not con.columns.counts
    return np.frombuffer(con.columns.sums, dtype="<u8").reshape(-1, D).astype(np.int64)


def assert_sums_have_the_law_of_the_counts(con: pb.Contribution, sh: UserShard, m: int, group: int) -> None:
    """Each group sum minus its mean (sum of u g + m p over its users; Alg 1 of paper 000): the sum over the groups
    per coordinate within 4.5 standard deviations of 0 (exact variance: sum of r (1 - r) + users m p (1 - p), spec
    000 sec 2), and the summed squares within 6 % of that variance (~3000 groups x 4 coordinates: relative sd
    ~1.3 %). Each sum lies in [0, users (g + m)]."""
    ids = list(con.columns.user_ids)
    assert con.columns.sum_users == group
    sums = sums_of(con)
    assert sums.shape[0] == -(-len(ids) // group)
    v = units(sh, ids) * G
    r = v - np.floor(v)
    starts = np.arange(0, len(ids), group)
    sizes = np.minimum(starts + group, len(ids)) - starts
    mean = np.add.reduceat(v, starts, axis=0) + (sizes * m * P)[:, None]
    var = np.add.reduceat(r * (1 - r), starts, axis=0) + (sizes * m * P * (1 - P))[:, None]
    assert sums.min() >= 0 and np.all(sums <= (sizes * (G + m))[:, None])
    resid = sums - mean
    z = resid.sum(axis=0) / np.sqrt(var.sum(axis=0))
    assert np.all(np.abs(z) < 4.5), z
    assert abs((resid**2).sum() / var.sum() - 1.0) < 0.06


def units(sh: UserShard, ids: list[str]) -> np.ndarray:
    """Independent reference: each user's clipped least-squares gradient shifted to [0, 1] (Alg 2 line 4)."""
    rows = [int(u[1:]) for u in ids]
    Z = np.concatenate([sh.X[rows, 0, :], np.ones((len(rows), 1))], axis=1)
    g = (Z @ THETA - sh.y[rows, 0])[:, None] * Z
    g *= np.minimum(1.0, 1.0 / np.linalg.norm(g, axis=1, keepdims=True))
    return (g + 1.0) / 2.0


@pytest.mark.parametrize(
    "n_users, planned, c, subset, block",
    [
        (6000, 6000, 6000, False, None),  # everyone checks in as planned
        (6000, 8000, 6000, False, None),  # fewer than planned: a larger m than the plan's share
        (6000, 8000, 6000, True, None),  # and invited again in another order, some not (rows picked)
        (6000, 8000, 6000, True, 1024),  # the same, the vectors by blocks of 1024 users (the last: 880)
    ],
)
def test_sums_from_the_prepared_rounding_have_the_law_of_the_users_counts(
    n_users, planned, c, subset, block, monkeypatch
):
    """The preparation is each checked-in user's rounding, floor(u g) or one more; the second invitation sends the
    sums of groups of 2 users with the noise of its own m, of the law above. Fixed seeds."""
    import shuffledp.protocols.pvec_round as pvec_round

    monkeypatch.setattr(pvec_round, "SUM_GROUP_USERS", 2)
    if block is not None:
        import shuffledp.clients.node as node_module

        monkeypatch.setattr(node_module, "PREPARE_BLOCK_USERS", block)
        monkeypatch.setattr(node_module, "PREPARE_BLOCK_BYTES", 1)
        calls = []
        batch_gradients = NodeCore.batch_gradients
        monkeypatch.setattr(
            NodeCore,
            "batch_gradients",
            lambda self, spec, idx: calls.append(idx.size) or batch_gradients(self, spec, idx),
        )
    sh = shard(n_users)
    core = NodeCore("node", sh, POLICY, rng=make_rng(7))
    n_min = int(0.9 * planned) if planned == n_users else 5000
    first = first_spec(planned, n_min)
    checked = check_in_and_prepare(core, first, sh.user_ids)
    assert checked == sh.user_ids
    if block is not None:
        assert calls == [1024] * 5 + [880]
    xhat = core._prepared[3].xhat.astype(np.int64)
    v = units(sh, checked) * G
    assert np.all((xhat == np.floor(v)) | (xhat == np.floor(v) + 1))
    spec, m = second(first, c)
    if subset:
        checked = checked[::-1][:5000]
    con = core.handle(pb.Invitation(spec=spec, user_ids=checked))
    assert core.prepared_rounds == 1 and list(con.columns.user_ids) == checked
    assert_sums_have_the_law_of_the_counts(con, sh, m, 2)


def test_the_preparation_serves_only_the_spec_and_users_it_fits():
    """Not used (and the round is computed from scratch) for another model, another round or a user not checked in
    here; used whatever the second invitation's m (the preparation holds no noise); used once only."""
    sh = shard(40)
    core = NodeCore("node", sh, POLICY, rng=make_rng(8))

    def answer(spec: pb.RoundSpec, ids: list[str]) -> pb.Contribution:
        con = core.handle(pb.Invitation(spec=spec, user_ids=ids))
        assert len(con.columns.user_ids) == len(ids) and not con.refusals and con.columns.sums
        return con

    first = first_spec(planned=30, n_min=20)
    cases = []
    # another model in the second invitation
    spec, _ = second(first, 30)
    spec.model.f64 = (THETA * 2).tobytes()
    cases.append((spec, sh.user_ids[:30]))
    # a user invited who did not check in at this node's check-in (the preparation holds 30 users)
    spec, _ = second(first, 31)
    cases.append((spec, sh.user_ids[:31]))
    for spec, ids in cases:
        check_in_and_prepare(core, first, sh.user_ids[:30])
        answer(spec, ids)
        assert core.prepared_rounds == 0
    # another round: the preparation of round 2 does not answer round 3
    check_in_and_prepare(core, first, sh.user_ids[:30])
    other = first_spec(planned=30, n_min=20, round_=3)
    answer(second(other, 30)[0], sh.user_ids[:30])
    assert core.prepared_rounds == 0
    # a preparation asked for a round whose check-in this node did not answer last computes nothing
    core.handle(pb.Invitation(spec=first, user_ids=sh.user_ids[:30]))
    core.prepare(pb.Invitation(spec=other, user_ids=sh.user_ids[:30]))
    answer(second(other, 30)[0], sh.user_ids[:30])
    assert core.prepared_rounds == 0
    # more users checked in than planned (a smaller m than the plan's share): used
    check_in_and_prepare(core, first, sh.user_ids)
    spec, m = second(first, 40)
    assert m < second(first, 30)[1]
    answer(spec, sh.user_ids)
    assert core.prepared_rounds == 1
    # the fitting case: used, then gone (a repeated invitation computes afresh)
    check_in_and_prepare(core, first, sh.user_ids[:30])
    spec, _ = second(first, 30)
    answer(spec, sh.user_ids[:30])
    assert core.prepared_rounds == 2
    answer(spec, sh.user_ids[:30])
    assert core.prepared_rounds == 2


def one_invitation(planned: int, n_min: int, round_: int, m: int = M_PLAN) -> pb.RoundSpec:
    """A COUNTS round of one invitation (no check-in), its noise m trials per user."""
    spec = first_spec(planned, n_min, round_)
    spec.ClearField("check_in")
    spec.randomizer.m = m
    return spec


def test_a_round_of_one_invitation_sends_sums_of_the_same_law(monkeypatch):
    """Without the check-in nothing is prepared: the node rounds and sums as it answers, groups of 2 users, the
    law above over 6000 users; with the default group size (256), 24 groups (the last of 112 users)."""
    import shuffledp.protocols.pvec_round as pvec_round

    sh = shard(6000)
    core = NodeCore("node", sh, POLICY, rng=make_rng(11))
    con = core.handle(pb.Invitation(spec=one_invitation(6000, 5400, 1), user_ids=sh.user_ids))
    assert core.prepared_rounds == 0 and sums_of(con).shape == (24, D)
    assert con.columns.sum_users == pvec_round.SUM_GROUP_USERS
    monkeypatch.setattr(pvec_round, "SUM_GROUP_USERS", 2)
    con = core.handle(pb.Invitation(spec=one_invitation(6000, 5400, 2), user_ids=sh.user_ids))
    assert core.prepared_rounds == 0
    assert_sums_have_the_law_of_the_counts(con, sh, M_PLAN, 2)


def test_round_counts_is_the_rounding_of_encode_counts():
    """round_counts: floor(u g) + Bernoulli(frac), the same draws as _round_units on the shifted rows; 1-D is one
    user; its values lie in {0..g} and their mean is u g (one seed, 40000 values: within 4.5 sd)."""
    from shuffledp.mechanisms.pvec import PvecParams, _round_units, round_counts, shift_to_units

    params = PvecParams(d=4, n=10, delta2=1.0, g=8, m=50, p=0.5, eps=1.0, delta=1e-6, method="calibrated")
    X = make_rng(4).normal(size=(10000, 4))
    got = round_counts(X, params, make_rng(6))
    u = shift_to_units(X, params)
    assert np.array_equal(got, _round_units(u, 8, make_rng(6)))
    assert np.array_equal(round_counts(X[0], params, make_rng(6)), got[0])
    assert got.min() >= 0 and got.max() <= 8
    v = u * 8
    r = v - np.floor(v)
    assert abs((got - v).sum()) < 4.5 * math.sqrt((r * (1 - r)).sum())


@pytest.mark.parametrize("m, users, p, max_m", [(3, 5, 0.5, 4), (3, 5, 0.3, 2**53), (7, 1, 0.5, 3), (2, 9, 0.7, 5)])
def test_summed_noise_is_the_binomial_of_the_summed_trials(m, users, p, max_m, monkeypatch):
    """summed_noise(m, users, p) against the exact pmf of Bin(users m, p), the law of the sum of the users'
    Bin(m, p) (also when drawn in pieces of at most MAX_M trials, monkeypatched small): a chi-square test over
    200000 draws, p-value > 1e-4 (fixed seed), every value in [0, users m]."""
    from scipy import stats

    from shuffledp.mechanisms import pvec

    monkeypatch.setattr(pvec, "MAX_M", max_m)
    x = pvec.summed_noise(m, users, p, 200_000, make_rng(12))
    assert x.dtype == np.uint64 and x.max() <= users * m
    n = users * m
    observed = np.bincount(x.astype(np.int64), minlength=n + 1)
    expected = stats.binom.pmf(np.arange(n + 1), n, p) * x.size
    keep = expected >= 5  # the chi-square approximation needs >= 5 expected per bin: the rest pooled
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-4
    assert np.array_equal(pvec.summed_noise(m, 0, p, 3, make_rng(1)), np.zeros(3, dtype=np.uint64))
    with pytest.raises(ValueError, match="m must be an integer >= 1"):
        pvec.summed_noise(0, users, p, 3, make_rng(1))


def test_a_second_invitation_from_the_preparation_is_charged_as_any_other():
    """Preparing charges nothing; the second invitation charges each user once, the same as without preparing."""
    sh = shard(30)
    prepared, plain = (NodeCore("node", sh, POLICY, rng=make_rng(9)) for _ in range(2))
    first = first_spec(planned=30, n_min=20)
    spec, _ = second(first, 30)
    for core, prep in ((prepared, True), (plain, False)):
        core.handle(pb.Invitation(spec=first, user_ids=sh.user_ids))
        if prep:
            core.prepare(pb.Invitation(spec=first, user_ids=sh.user_ids))
        assert core.spent("u0") == (0.0, 0.0)
        assert len(user_messages(core.handle(pb.Invitation(spec=spec, user_ids=sh.user_ids)))) == 30
    assert prepared.prepared_rounds == 1 and plain.prepared_rounds == 0
    assert [prepared.spent(u) for u in sh.user_ids] == [plain.spent(u) for u in sh.user_ids]
    assert prepared.spent("u0") == pytest.approx((1.0, 1e-6))


def test_the_preparation_thread_runs_at_lower_cpu_priority():
    """ClientNodeHandle's preparer thread: nice +10 on Linux (a thread's own nice value), the node's threads not."""
    import os
    import sys
    import threading

    from shuffledp.clients.node import _lower_priority

    if sys.platform != "linux":
        pytest.skip("per-thread nice values are Linux's")
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int] = {}

    def run() -> None:
        _lower_priority()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["nice"] == min(base + 10, 19)  # the kernel caps nice at 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # only that thread


def test_a_second_invitation_is_certified_at_no_more_contributors_than_checked_in():
    # helper probe (session 17): a lying shuffler's second invitation said 21 users checked in and set the release
    # threshold at 30, which no release of those 21 can meet; the node certified (and charged) the round at n' = 30,
    # a smaller eps than any release of <= 21 users has. It now certifies at n' = min(threshold, checked in)
    from shuffledp.accountants.pvec_pld import calibrate_pvec_pld, pvec_round_epsilon
    from shuffledp.protocols.pvec_round import pvec_params_from_spec

    n_min, planned, delta = 20, 30, 1e-6
    prm = calibrate_pvec_pld(1.0, delta, n_min, D, 1.0, rounds=1)
    first = first_spec(planned, n_min)
    first.randomizer.g, first.randomizer.m, first.randomizer.p = prm.g, prm.m, prm.p
    first.check_in.noise_trials = prm.m * n_min
    first.per_user_cost.eps = 0.01  # the claim: the node charges what it verifies
    core = NodeCore("node", shard(planned), UserPolicy(max_total_eps=100, max_total_delta=1.0), rng=make_rng(3))
    ids = core.shard.user_ids
    assert len(check_in_and_prepare(core, first, ids)) == planned
    c = 21
    _, m = check_in.share(int(first.check_in.noise_trials), FRACTION, n_min, c)
    lying = second_spec(first, c)
    lying.min_contributors, lying.randomizer.m = planned, m  # threshold 30 > the 21 who checked in
    con = core.handle(pb.Invitation(spec=lying, user_ids=ids[:c]))
    assert len(con.columns.user_ids) == c and not con.refusals
    at_c = pvec_round_epsilon(pvec_params_from_spec(lying), c, delta)
    at_claim = pvec_round_epsilon(pvec_params_from_spec(lying), planned, delta)
    assert at_claim < 0.9 * at_c  # the lie matters: certified at 30 the round would look much cheaper
    assert core.spent(ids[0])[0] == pytest.approx(at_c, rel=1e-9)
    # an honest second invitation (c_min <= c) is certified at its own threshold, as before
    honest, _ = second(first, c)
    assert honest.min_contributors <= c
    core2 = NodeCore("node", shard(planned), UserPolicy(max_total_eps=100, max_total_delta=1.0), rng=make_rng(4))
    check_in_and_prepare(core2, first, ids)
    core2.handle(pb.Invitation(spec=honest, user_ids=ids[:c]))
    expected = pvec_round_epsilon(pvec_params_from_spec(honest), int(honest.min_contributors), delta)
    assert core2.spent(ids[0])[0] == pytest.approx(expected, rel=1e-9)
