"""Issue 45: what each server of a PRIO3 round checks for itself (protocols/prio3.py, services/shuffler_state.py).

The shuffler's state runs a real round (its own threads, the binding, a node's reports as a node would send them);
the test plays the analyzer. The Leader answers FinishAggregation once per round (a second request with another
subset of reports would isolate one report as the difference of two totals), only over at least the round's
threshold of users, and only for the reports it verified itself; a replayed report id is refused in any later round
of the run. A node with `require_split_trust` refuses a count-mode round with its reason and joins a PRIO3 one.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from shuffledp.clients.policy import PolicyTable, Refusal, UserPolicy
from shuffledp.services.shuffler import _batch, _request
from shuffledp.services.shuffler_state import (
    RoundRejected,
    RoundRequest,
    Schedule,
    ShufflerState,
    Submission,
    Transport,
    UserColumns,
)

from shuffledp.protocols import prio3
from shuffledp.security import sealing
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb

pytestmark = pytest.mark.skipif(not prio3.available(), reason=prio3.MISSING)

D, G, M = 12, 4, 20  # a small round: d labels, counts in [0, g + m]
USERS = 10


class _Round:
    """A PRIO3 round at a real ShufflerState: node "n" with USERS users, each its own report (sum_users = 1)."""

    def __init__(self, state: ShufflerState, r: int, min_contributors: int = 8, counts: np.ndarray | None = None):
        self.private, self.public = sealing.generate_keypair()
        self.key = prio3.new_verify_key()
        self.req = RoundRequest(
            "run", r, Schedule.FULLY_INTERACTIVE, Transport.PRIO3, dim=D, g=G, m=M, min_contributors=min_contributors,
            deadline_seconds=20.0, analyzer_public_key=self.public, verify_key=self.key, prio3_vdaf=prio3.DEFAULT_VDAF,
        )  # fmt: skip
        self.vdaf = prio3.Vdaf(prio3.DEFAULT_VDAF, D, G + M, "run", r)
        rng = make_rng(r)
        self.counts = rng.integers(0, G + M + 1, (USERS, D)).astype(np.uint64) if counts is None else counts
        self.reports = prio3.shard(self.vdaf, self.counts, [1] * USERS, self.public)
        self.out: list = []
        self.thread = threading.Thread(target=lambda: self.out.append(state.execute_round(self.req)))

    def play(self, state: ShufflerState, sub, reports=None) -> object:
        self.thread.start()
        inv = sub.get(timeout=10)
        cols = UserColumns(list(inv.user_ids), secrets.token_bytes(16 * USERS), 16, sum_users=1,
                           reports=reports if reports is not None else self.reports)  # fmt: skip
        state.submit(Submission("run", self.req.round, "n", columns=cols))
        self.thread.join(30)
        return self.out[0]

    def helper(self, batch) -> prio3.HelperResult:
        # what the analyzer receives: the batch as the servicer serializes it (HelperReports)
        return prio3.helper_prepare(self.vdaf, self.key, self.private, _batch(batch).reports)


def _state() -> tuple[ShufflerState, object]:
    state = ShufflerState(rng=make_rng(1), poll_seconds=0.001)
    state.register_users("n", [f"u{i}" for i in range(USERS)])
    return state, state.subscribe("n")


def test_the_leader_answers_once_over_the_threshold_and_its_share_completes_the_total() -> None:
    state, sub = _state()
    rnd = _Round(state, 0)
    batch = rnd.play(state, sub)
    assert batch.released and batch.contributors == USERS and len(batch.reports) == USERS
    helper = rnd.helper(batch)
    assert helper.users == USERS and not helper.rejected
    a = state.finish_aggregation("run", 0, helper.preps)
    assert a.released and a.reports == USERS and a.contributors == USERS
    totals = prio3.unshard(rnd.vdaf, a.aggregate_share, helper.aggregate_share, USERS)
    assert np.array_equal(totals, rnd.counts.sum(axis=0).astype(np.int64))
    # once: a second request (say, all but one report) finds nothing
    with pytest.raises(RoundRejected, match="awaits its aggregation"):
        state.finish_aggregation("run", 0, helper.preps[1:])


def test_the_leader_withholds_its_share_below_the_threshold_and_counts_its_own_verification() -> None:
    state, sub = _state()
    rnd = _Round(state, 0)
    helper = rnd.helper(rnd.play(state, sub))
    # the analyzer names 7 of 10 reports valid (threshold 8): isolating fewer users is refused
    a = state.finish_aggregation("run", 0, helper.preps[:7])
    assert not a.released and a.aggregate_share == b"" and a.contributors == 7
    assert a.rejected == {prio3.HELPER_REJECTED: 3}
    # the Leader decides validity itself: a Helper prep share of another report, or an id it never held, is no vote
    state2, sub2 = _state()
    rnd2 = _Round(state2, 1)
    helper2 = rnd2.helper(rnd2.play(state2, sub2))
    (rid0, share0), (rid1, share1), *rest = helper2.preps
    forged = [(rid0, share1), (rid1, share0), *rest, (secrets.token_bytes(16), share0), rest[0]]
    a2 = state2.finish_aggregation("run", 1, forged)
    assert a2.contributors == USERS - 2 and a2.rejected == {prio3.INVALID_PROOF: 2} and a2.released


def test_a_replayed_report_id_is_refused_in_a_later_round_of_the_run() -> None:
    state, sub = _state()
    first = _Round(state, 0)
    batch = first.play(state, sub)
    state.finish_aggregation("run", 0, first.helper(batch).preps)
    second = _Round(state, 1, min_contributors=1)
    # one user's report of round 0 sent again in round 1 (ids and shares as they were)
    batch = second.play(state, sub, reports=[first.reports[0], *second.reports[1:]])
    assert batch.rejected == {"replayed_report": 1} and batch.contributors == USERS - 1
    # and within the round: two reports with one id
    third = _Round(state, 2, min_contributors=1)
    batch = third.play(state, sub, reports=[third.reports[0], third.reports[0], *third.reports[2:]])
    assert batch.rejected == {"replayed_report": 1} and batch.contributors == USERS - 1


def test_a_report_sealed_for_another_id_or_round_does_not_verify() -> None:
    """The Helper's share is bound to its report id (inside the seal) and the round (HPKE info, VDAF context): a
    Leader that swaps shares between reports, or replays a report into another round, gets it rejected."""
    private, public = sealing.generate_keypair()
    key = prio3.new_verify_key()
    v0, v1 = (prio3.Vdaf(prio3.DEFAULT_VDAF, D, G + M, "run", r) for r in (0, 1))
    counts = np.ones((2, D), dtype=np.uint64)
    (a, b), (c,) = prio3.shard(v0, counts, [1, 1], public), prio3.shard(v1, counts[:1], [1], public)
    leader, _ = prio3.leader_init(v0, key, [(*a, 1), (*b, 1)])

    def helper_view(rep, prep, helper_share):
        return pb.HelperReport(report_id=rep[0], public_share=rep[1], helper_share=helper_share,
                               leader_prep_share=prep.prep_share, users=1)  # fmt: skip

    swapped = [helper_view(a, leader[0], b[3]), helper_view(b, leader[1], a[3])]
    res = prio3.helper_prepare(v0, key, private, swapped)
    assert res.users == 0 and res.rejected == {prio3.INVALID_PROOF: 2}
    # round 1's report presented in round 0: its seal does not open under round 0's info
    (lc,), _ = prio3.leader_init(v1, key, [(*c, 1)])
    res = prio3.helper_prepare(v0, key, private, [helper_view(c, lc, c[3])])
    assert res.rejected == {prio3.UNDECRYPTABLE: 1}


def test_output_shares_of_reports_of_different_sizes_add_up_in_one_aggregate() -> None:
    """A node's groups differ in size (the last is shorter), so their reports are instances with different ranges;
    their output shares are d field elements alike and one instance adds them (prio3.leader_finish)."""
    private, public = sealing.generate_keypair()
    key = prio3.new_verify_key()
    vdaf = prio3.Vdaf("prio3sumvec-field64x3", D, G + M, "run", 0)
    sizes = [256, 37, 1]
    rng = make_rng(4)
    sums = np.stack([rng.integers(0, s * (G + M) + 1, D) for s in sizes]).astype(np.uint64)
    reports = prio3.shard(vdaf, sums, sizes, public)
    leader, rejected = prio3.leader_init(vdaf, key, [(*r, s) for r, s in zip(reports, sizes, strict=True)])
    helper = prio3.helper_prepare(vdaf, key, private, [p.for_helper() for p in leader])
    share, n, users, _ = prio3.leader_finish(vdaf, {p.report_id: p for p in leader}, helper.preps)
    assert not rejected and n == 3 and users == sum(sizes) == helper.users
    assert np.array_equal(prio3.unshard(vdaf, share, helper.aggregate_share, n), sums.sum(axis=0).astype(np.int64))


def test_the_verify_key_is_never_relayed_and_never_signed() -> None:
    spec = pb.RoundSpec(run_id="run", round=0, transport=pb.PRIO3, verify_key=b"k" * 32)
    req = _request(spec)
    assert req.verify_key == b"k" * 32 and not req.relay.spec.verify_key  # plain text: the relayed copy lacks it
    signed = pb.RoundSpec(signed=pb.SignedSpec(spec=spec.SerializeToString()))
    with pytest.raises(ValueError, match="verify_key belongs in ExecuteRound"):
        _request(signed)


@pytest.mark.parametrize("transport, refused", [(pb.COUNTS, True), (pb.PRIO3, False), (pb.BITS, False)])
def test_require_split_trust_refuses_rounds_the_shuffler_can_read(transport, refused: bool) -> None:
    spec = pb.RoundSpec(run_id="run", round=0, transport=transport, trust_model=pb.SHUFFLE)
    spec.randomizer.protocol = "pvec"
    spec.per_user_cost.eps, spec.per_user_cost.delta = 1.0, 1e-6
    strict = PolicyTable(UserPolicy(require_split_trust=True, verify_randomizer=False), 3)
    reasons, _, _ = strict._static(spec, np.arange(3), True)
    assert (set(reasons) == {Refusal.SPLIT_TRUST}) is refused
    assert Refusal.SPLIT_TRUST not in set(PolicyTable(UserPolicy(verify_randomizer=False), 3)._static(
        spec, np.arange(3), True)[0])  # fmt: skip


def test_prio3_without_the_binding_is_refused_in_one_line_before_anything_starts(monkeypatch) -> None:
    from shuffledp.config import default_toml, parse_config
    from shuffledp.settings import ConfigError

    toml = default_toml().replace('aggregation = "counts"', 'aggregation = "prio3"')
    parse_config(toml)  # here the binding is installed
    monkeypatch.setitem(sys.modules, "shuffledp_prio", None)  # as on a machine where native/ was not built
    with pytest.raises(ConfigError, match="needs the Prio3 binding shuffledp_prio") as err:
        parse_config(toml)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match='needs transport.mode = "counts"'):
        parse_config(toml.replace('mode = "counts"', 'mode = "bits"'))


def test_reports_are_prepared_as_they_arrive_and_their_shares_not_kept() -> None:
    """The Leader prepares each report while the round still collects (ShufflerState._prepare_arrivals): it holds a
    report's preparation state (10 kB at d = 650), not its Leader share (162 kB; 2.6 MB at d = 10^4)."""
    state, sub = _state()
    rnd = _Round(state, 0, min_contributors=1)
    rnd.req = replace(rnd.req, deadline_seconds=3.0)
    rnd.thread.start()
    inv = sub.get(timeout=10)
    # all but the last user report: the round waits for it until its deadline
    cols = UserColumns(list(inv.user_ids)[:-1], secrets.token_bytes(16 * (USERS - 1)), 16, sum_users=1,
                       reports=rnd.reports[:-1])  # fmt: skip
    state.submit(Submission("run", 0, "n", columns=cols))
    open_round = state._open[("run", 0)]
    end = time.monotonic() + 2.5
    while len(open_round.prepared) < USERS - 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert not open_round.closed and len(open_round.prepared) == USERS - 1 and not open_round.reports
    assert all(len(p.state) < len(r[2]) / 4 for p, r in zip(open_round.prepared, rnd.reports, strict=False))
    rnd.thread.join(10)
    assert rnd.out[0].released and len(rnd.out[0].reports) == USERS - 1


def test_the_analyzer_takes_totals_only_from_both_aggregate_shares() -> None:
    """A PRIO3 batch with totals or ciphertexts of the shuffler's making is refused before any aggregation: the
    analyzer's totals come only from unsharding the Leader's and its own aggregate shares."""
    from shuffledp.services import aggregation

    spec = pb.RoundSpec(run_id="run", round=0, transport=pb.PRIO3, min_contributors=1)
    spec.randomizer.dim, spec.randomizer.g, spec.randomizer.m = D, G, M
    spec.prio3.vdaf = prio3.DEFAULT_VDAF
    private, _ = sealing.generate_keypair()
    for forged in (
        pb.ShuffledBatch(released=True, label_totals=[1] * D),
        pb.ShuffledBatch(released=True, ciphertexts=[b"x"]),
    ):
        with pytest.raises(aggregation.AggregationFailed, match="totals or ciphertexts"):
            aggregation.finish(None, spec, forged, prio3.new_verify_key(), private, set(), 1.0)
