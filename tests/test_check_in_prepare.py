"""A node draws a check-in round's noise while its users' check-in travels (PvecRound.prepare, issue 30 item 1):
the second invitation adds only the trials that invitation adds, each count is still xhat + Bin(m, p), and the draws
are used only for the spec, users and m they fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _intercept import user_messages
from shuffledp.clients.node import NodeCore, UserShard
from shuffledp.clients.policy import UserPolicy
from shuffledp.services.shuffler import _second_spec

from shuffledp.mechanisms import check_in
from shuffledp.rng import make_rng
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
    c_min, m = check_in.share(int(first.check_in.noise_trials), FRACTION, first.min_contributors, c)
    return _second_spec(first, c, c_min, m), m


def check_in_and_prepare(core: NodeCore, spec: pb.RoundSpec, ids: list[str]) -> list[str]:
    inv = pb.Invitation(spec=spec, user_ids=ids)
    checked = list(core.handle(inv).columns.user_ids)
    core.prepare(inv)
    return checked


def counts_of(con: pb.Contribution, m: int) -> np.ndarray:
    from shuffledp.mechanisms.pvec import count_wire_dtype

    return np.frombuffer(con.columns.counts, dtype=count_wire_dtype(G + m)).reshape(-1, D).astype(np.int64)


def units(sh: UserShard, ids: list[str]) -> np.ndarray:
    """Independent reference: each user's clipped least-squares gradient shifted to [0, 1] (Alg 2 line 4)."""
    rows = [int(u[1:]) for u in ids]
    Z = np.concatenate([sh.X[rows, 0, :], np.ones((len(rows), 1))], axis=1)
    g = (Z @ THETA - sh.y[rows, 0])[:, None] * Z
    g *= np.minimum(1.0, 1.0 / np.linalg.norm(g, axis=1, keepdims=True))
    return (g + 1.0) / 2.0


@pytest.mark.parametrize(
    "n_users, planned, c, subset, block, ahead",
    [
        (6000, 6000, 6000, False, None, False),  # everyone checks in as planned: m = m_low, nothing added
        (6000, 8000, 6000, False, None, False),  # fewer than planned: m > m_low, Bin(m - m_low, p) added
        (6000, 8000, 6000, True, None, False),  # and invited again in another order, some not (rows picked)
        (6000, 8000, 6000, True, 1024, False),  # the same, the vectors by blocks of 1024 users (the last: 880)
        (6000, 6000, 6000, False, None, True),  # Bin(m_low, p) drawn between rounds (NodeCore.predraw)
        (6000, 8000, 6000, True, 1024, True),  # and by blocks, rows picked, Bin(m - m_low, p) added
    ],
)
def test_second_invitation_from_prepared_draws_has_the_exact_mean_and_variance(
    n_users, planned, c, subset, block, ahead, monkeypatch
):
    """Each count minus its mean u g + m p (Alg 1 of paper 000), over the users: the sum per coordinate within 4.5
    standard deviations of 0 (exact variance sum r(1 - r) + m p (1 - p), spec 000 sec 2), and the summed squares
    within 6 % of that variance (relative sd of a sum of 6000 x 4 squares ~ 1.3 %). Fixed seeds. ahead: the
    round before ran with the same plan, and the node drew this round's Bin(m_low, p) between the two."""
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
    if ahead:
        check_in_and_prepare(core, first_spec(planned, n_min, round_=1), sh.user_ids)
        core.predraw()
        if block is not None:
            calls.clear()
    checked = check_in_and_prepare(core, first, sh.user_ids)
    assert checked == sh.user_ids
    assert core.predrawn_rows == (n_users if ahead else 0)
    if block is not None:
        assert calls == [1024] * 5 + [880]
    spec, m = second(first, c)
    _, m_low = check_in.share(int(first.check_in.noise_trials), FRACTION, first.min_contributors, planned)
    assert (m == m_low) == (planned == c)
    if subset:
        checked = checked[::-1][:5000]
    con = core.handle(pb.Invitation(spec=spec, user_ids=checked))
    assert core.prepared_rounds == 1 and list(con.columns.user_ids) == checked
    counts = counts_of(con, m)
    assert counts.min() >= 0 and counts.max() <= G + m
    v = units(sh, checked) * G
    r = v - np.floor(v)
    resid = counts - (v + m * P)
    var = r * (1 - r) + m * P * (1 - P)
    z = resid.sum(axis=0) / np.sqrt(var.sum(axis=0))
    assert np.all(np.abs(z) < 4.5), z
    assert abs((resid**2).sum() / var.sum() - 1.0) < 0.06
    # xhat is floor(v) or floor(v) + 1: the counts minus the noise mean can only sit near v (m p = 20 +- ~7 sd)
    assert np.all(np.abs(resid) < 1 + 8 * math.sqrt(m * P * (1 - P)))


def test_prepared_draws_serve_only_the_spec_users_and_m_they_fit():
    """Not used (and the round is drawn from scratch) for another model, another round, a user not checked in
    here, or an m below the trials already drawn (more users checked in than planned); and used once only."""
    sh = shard(40)
    core = NodeCore("node", sh, POLICY, rng=make_rng(8))

    def answer(spec: pb.RoundSpec, ids: list[str]) -> pb.Contribution:
        con = core.handle(pb.Invitation(spec=spec, user_ids=ids))
        assert len(con.columns.user_ids) == len(ids) and not con.refusals
        return con

    first = first_spec(planned=30, n_min=20)
    cases = []
    # another model in the second invitation
    spec, _ = second(first, 30)
    spec.model.f64 = (THETA * 2).tobytes()
    cases.append((spec, sh.user_ids[:30]))
    # more users checked in than planned: m < m_low
    spec, m = second(first, 40)
    assert m < second(first, 30)[1]
    cases.append((spec, sh.user_ids))
    # a user invited who did not check in at this node's check-in (the draws hold 30 users)
    spec, _ = second(first, 31)
    cases.append((spec, sh.user_ids[:31]))
    for spec, ids in cases:
        check_in_and_prepare(core, first, sh.user_ids[:30] if len(ids) <= 31 else sh.user_ids)
        answer(spec, ids)
        assert core.prepared_rounds == 0
    # another round: the draws of round 2 do not answer round 3
    check_in_and_prepare(core, first, sh.user_ids[:30])
    other = first_spec(planned=30, n_min=20, round_=3)
    answer(second(other, 30)[0], sh.user_ids[:30])
    assert core.prepared_rounds == 0
    # a preparation asked for a round whose check-in this node did not answer last draws nothing
    core.handle(pb.Invitation(spec=first, user_ids=sh.user_ids[:30]))
    core.prepare(pb.Invitation(spec=other, user_ids=sh.user_ids[:30]))
    answer(second(other, 30)[0], sh.user_ids[:30])
    assert core.prepared_rounds == 0
    # the fitting case: used, then gone (a repeated invitation draws afresh)
    check_in_and_prepare(core, first, sh.user_ids[:30])
    spec, _ = second(first, 30)
    answer(spec, sh.user_ids[:30])
    assert core.prepared_rounds == 1
    answer(spec, sh.user_ids[:30])
    assert core.prepared_rounds == 1


def test_a_second_invitation_from_prepared_draws_is_charged_as_any_other():
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


def test_noise_drawn_between_rounds_serves_one_preparation_of_the_same_plan():
    """NodeCore.predraw draws the last preparation's Bin(m_low, p) for as many users; the next preparation adds it
    (each count minus its predrawn noise is the rounding, floor(u g) or one more) when its plan is the same, and
    drops it unused otherwise (another m_low); a second preparation never sees it again."""
    from shuffledp.protocols.pvec_round import NoisePlan

    sh = shard(40)
    core = NodeCore("node", sh, POLICY, rng=make_rng(10))
    assert core._noise_plan is None
    core.predraw()  # nothing prepared yet: nothing drawn
    assert core._predrawn is None
    check_in_and_prepare(core, first_spec(planned=30, n_min=20, round_=1), sh.user_ids[:30])
    m_low = core._prepared[3].m_low
    assert core._noise_plan == (NoisePlan(m_low, P, D), 30)
    core.predraw()
    ahead = core._predrawn
    assert ahead.plan == NoisePlan(m_low, P, D) and ahead.counts.shape == (30, D) and core._noise_plan is None
    noise = ahead.counts.astype(np.int64)
    # the same plan: used, one row per user in check-in order
    check_in_and_prepare(core, first_spec(planned=30, n_min=20, round_=2), sh.user_ids[:30])
    assert core._predrawn is None and core.predrawn_rows == 30
    xhat = core._prepared[3].counts.astype(np.int64) - noise
    v = units(sh, sh.user_ids[:30]) * G
    assert np.all((xhat == np.floor(v)) | (xhat == np.floor(v) + 1))
    # another plan (another m_low: fewer noise trials): dropped, the preparation draws its own
    core.predraw()
    assert core._predrawn is not None
    other = first_spec(planned=30, n_min=20, round_=3)
    other.check_in.noise_trials = M_PLAN * 10
    check_in_and_prepare(core, other, sh.user_ids[:30])
    assert core._predrawn is None and core.predrawn_rows == 30
    assert core._prepared[3].m_low != m_low
    # more users than were drawn for (one block of 40 users, 30 rows drawn): that block draws its own
    core.predraw()
    check_in_and_prepare(core, first_spec(planned=30, n_min=20, round_=4), sh.user_ids)
    assert core.predrawn_rows == 30 and core._predrawn is None


def test_encode_counts_adds_noise_drawn_beforehand_and_checks_its_shape():
    from shuffledp.mechanisms.pvec import PvecParams, _round_units, encode_counts, shift_to_units

    params = PvecParams(d=3, n=10, delta2=1.0, g=8, m=50, p=0.5, eps=1.0, delta=1e-6, method="calibrated")
    X = make_rng(4).normal(size=(7, 3))
    noise = make_rng(5).binomial(50, 0.5, size=(7, 3)).astype(np.uint8)
    got = encode_counts(X, params, make_rng(6), noise) - noise
    assert np.array_equal(got, _round_units(shift_to_units(X, params), 8, make_rng(6)))
    with pytest.raises(ValueError, match="shape of X"):
        encode_counts(X, params, make_rng(6), noise[:6])


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
    lying = _second_spec(first, c, planned, m)  # threshold 30 > the 21 who checked in
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


def one_invitation(planned: int, n_min: int, round_: int, m: int = M_PLAN) -> pb.RoundSpec:
    """A COUNTS round of one invitation (no check-in), its noise m trials per user."""
    spec = first_spec(planned, n_min, round_)
    spec.ClearField("check_in")
    spec.randomizer.m = m
    return spec


def test_a_round_of_one_invitation_adds_the_noise_drawn_since_the_last_round():
    """Without the check-in, a node draws the next round's Bin(m, p) between rounds too (issue 30): the round adds it
    when its plan (m, p, d) is the last one's, each count being xhat + Bin(m, p) with xhat floor(u g) or one more,
    and draws afresh otherwise; the draws serve one round. The exact mean and variance over 6000 users (4.5 sd, 6 %,
    as above; fixed seeds) hold for the round that used them."""
    from shuffledp.protocols.pvec_round import NoisePlan

    sh = shard(6000)
    core = NodeCore("node", sh, POLICY, rng=make_rng(12))
    con = core.handle(pb.Invitation(spec=one_invitation(6000, 5400, 1), user_ids=sh.user_ids))
    assert list(con.columns.user_ids) == sh.user_ids and core._noise_plan == (NoisePlan(M_PLAN, P, D), 6000)
    core.predraw()
    noise = core._predrawn.counts.astype(np.int64)
    con = core.handle(pb.Invitation(spec=one_invitation(6000, 5400, 2), user_ids=sh.user_ids))
    assert core._predrawn is None and core.predrawn_rows == 6000
    counts = counts_of(con, M_PLAN)
    v = units(sh, sh.user_ids) * G
    xhat = counts - noise
    assert np.all((xhat == np.floor(v)) | (xhat == np.floor(v) + 1))
    r = v - np.floor(v)
    resid = counts - (v + M_PLAN * P)
    var = r * (1 - r) + M_PLAN * P * (1 - P)
    assert np.all(np.abs(resid.sum(axis=0) / np.sqrt(var.sum(axis=0))) < 4.5)
    assert abs((resid**2).sum() / var.sum() - 1.0) < 0.06
    # another m: the draws are dropped unused and the round draws its own
    core.predraw()
    assert core._predrawn is not None
    con = core.handle(pb.Invitation(spec=one_invitation(6000, 5400, 3, m=M_PLAN + 8), user_ids=sh.user_ids[:50]))
    assert core._predrawn is None and core.predrawn_rows == 6000 and len(con.columns.user_ids) == 50
    assert counts_of(con, M_PLAN + 8).max() <= G + M_PLAN + 8
