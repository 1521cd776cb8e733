"""Prio3SumVec (draft-irtf-cfrg-vdaf-18) for shuffledp: a thin PyO3 binding of the `prio` crate, pinned to 0.18.1.

Two instances: `Prio3SumVec` (Field128, one proof, draft-18 section 7.4.3) and `Prio3SumVecField64Multiproof`
(Field64, three proofs by default, the draft's Prio3SumVecWithMultiproof). Every message in and out is the crate's
own encoding (bytes), so it can travel over gRPC unchanged. The two-Aggregator flow, per report:

    public, leader, helper = vdaf.shard(measurement, nonce)               # Client
    state_i, share_i = vdaf.prepare_init(key, i, nonce, public, input_i)  # Aggregator i (0 = leader, 1 = helper)
    message = vdaf.prep_shares_to_prep([share_0, share_1])                # either one; the FLP decision is here
    out_i = vdaf.prepare_next(state_i, message)                           # each Aggregator
    agg_i = vdaf.aggregate([out_i, ...])                                  # each Aggregator, over a batch
    result = vdaf.unshard([agg_0, agg_1], num_measurements)               # Collector

Replay is the caller's concern: the VDAF does not remember reports, so the servers must refuse a nonce (report
id) they have seen (draft-18 section 9.2). They must also check that both got the same public share (section 9.3).
"""

from ._native import (
    PRIO_CRATE_VERSION,
    VDAF_DRAFT,
    DecodeError,
    Prio3SumVec,
    Prio3SumVecField64Multiproof,
    VdafError,
    VerificationError,
)

__all__ = [
    "PRIO_CRATE_VERSION",
    "VDAF_DRAFT",
    "DecodeError",
    "Prio3SumVec",
    "Prio3SumVecField64Multiproof",
    "VdafError",
    "VerificationError",
]
