"""The analyzer's side of a PRIO3 round (issue 45; protocols/prio3.py): the Helper and the Collector.

The run manager draws the round's verification key and sends it beside the (signed) spec in ExecuteRound only
(`attach_key`). A released PRIO3 batch holds no totals but the Helper's part of each report; `finish` verifies them
(its own FLP decision), sends its prep shares to the shuffler (FinishAggregation), and unshards both aggregate shares
into the per-label totals, so that the protocol decodes the batch as in count mode (design 5.2: the same view).

Every failure after the batch arrived raises AggregationFailed: the shares left the shuffler, so the run manager books
the round as spent (never as refused), though nothing about the totals was learned.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import grpc

from shuffledp.protocols import prio3
from shuffledp.transport.spec_signing import second_spec
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["AggregationFailed", "attach_key", "finish"]

log = logging.getLogger(__name__)


class AggregationFailed(RuntimeError):
    """A released PRIO3 round gave no totals (below the threshold once verified, the Leader's refusal, or the two
    servers disagreeing): charged as spent, nothing released."""


def attach_key(spec: pb.RoundSpec, wire: pb.RoundSpec) -> bytes:
    """PRIO3: a fresh verification key on the ExecuteRound request `wire`, beside the spec and never inside what is
    signed or relayed (draft-18 sec 9.1); b"" for other transports."""
    if spec.transport != pb.PRIO3:
        return b""
    key = prio3.new_verify_key()
    wire.verify_key = key
    return key


def finish(
    shuffler: Any,
    spec: pb.RoundSpec,
    batch: pb.ShuffledBatch,
    verify_key: bytes,
    private_key: Any,
    seen: set[bytes],
    timeout: float,
) -> pb.ShuffledBatch:
    """The released PRIO3 batch as count mode's: its totals over the reports both servers verified, contributors
    their users, rejections by reason (the Leader's and the Helper's). `seen`: the run's report ids (replays)."""
    if batch.label_totals or batch.ciphertexts:  # a PRIO3 batch carries reports only: totals come from both shares
        raise AggregationFailed("the shuffler sent totals or ciphertexts in a PRIO3 batch")
    acting = spec
    if spec.check_in.noise_trials:  # the round ran at the m the nodes derived from the users who checked in
        try:
            acting = second_spec(spec, int(batch.report.checked_in))
        except ValueError as exc:
            raise AggregationFailed(f"the shuffler released a check-in round it could not run: {exc}") from None
    r = acting.randomizer
    vdaf = prio3.Vdaf(acting.prio3.vdaf, int(r.dim), int(r.g) + int(r.m), spec.run_id, int(spec.round))
    threshold = max(1, int(acting.min_contributors))
    helper = prio3.helper_prepare(vdaf, verify_key, private_key, batch.reports, seen)
    if helper.users < threshold:
        raise AggregationFailed(
            f"below threshold once verified: {helper.users} users in valid reports < {threshold} "
            f"(rejected: {dict(helper.rejected)})"
        )
    request = pb.AggregationRequest(
        run_id=spec.run_id,
        round=spec.round,
        preps=[pb.HelperPrep(report_id=rid, prep_share=share) for rid, share in helper.preps],
    )
    try:
        leader = shuffler.FinishAggregation(request, timeout=timeout)
    except grpc.RpcError as exc:  # no aggregate share, whatever the reason
        raise AggregationFailed(f"FinishAggregation failed ({exc.code().name}: {exc.details()})") from None
    if not leader.released:
        raise AggregationFailed(
            f"the shuffler withheld its aggregate share: {leader.contributors} users in reports it verified"
        )
    if leader.reports != helper.reports or leader.contributors != helper.users:
        # the two aggregate shares would cover different reports: their sum is no total
        raise AggregationFailed(
            f"the servers disagree on the valid reports: shuffler {leader.reports} ({leader.contributors} users), "
            f"analyzer {helper.reports} ({helper.users} users)"
        )
    totals = prio3.unshard(vdaf, leader.aggregate_share, helper.aggregate_share, helper.reports)
    log.info(
        "run %s round %d: %d Prio3 reports (%d users) verified by both servers; rejected: %s",
        spec.run_id,
        spec.round,
        helper.reports,
        helper.users,
        dict(helper.rejected),
    )
    own = Counter(dict(leader.rejected))
    own.pop(prio3.HELPER_REJECTED, None)  # the reports the Helper left out: its own reasons are counted here
    rejected = Counter(dict(batch.report.rejected)) + helper.rejected + own
    out = pb.ShuffledBatch()
    out.CopyFrom(batch)
    del out.reports[:]
    out.label_totals.extend(totals.tolist())
    out.report.contributors = helper.users
    out.report.rejected.clear()
    out.report.rejected.update(rejected)
    return out
