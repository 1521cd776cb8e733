"""The RoundSpec of each round of a planned run: what the analyzer signs and sends (design 3.2): the schedule's fields
from the plan, the protocol's own (randomizer, transport, trust model, per-user claim, key) from its plug-in."""

from __future__ import annotations

from typing import Any

import numpy as np

from shuffledp.protocols.base import tensor
from shuffledp.protocols.registry import planned_protocol
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["round_spec"]

_SCHEDULES = {"sequential": pb.SEQUENTIAL, "fully_interactive": pb.FULLY_INTERACTIVE, "subsampled": pb.SUBSAMPLED}


def round_spec(
    run_id: str,
    r: int,
    plan: dict[str, Any],
    params: Any,
    event: Any,  # services.ledger.PrivacyEvent: the round's charge, for the spec's per-user claim
    theta: np.ndarray,
    analyzer_public_key: bytes = b"",
) -> pb.RoundSpec:
    """The RoundSpec the analyzer sends for round r of a planned run at model theta: the schedule's fields here, the
    protocol's (randomizer, transport, trust model, per-user claim, key) from its plug-in."""
    protocol = planned_protocol(plan)
    return pb.RoundSpec(
        run_id=run_id,
        round=r,
        schedule=_SCHEDULES[plan["kind"]],
        model=tensor(theta),
        task=plan["task"],
        num_classes=plan["num_classes"] if plan["task"] in ("logreg", "mlp") else 0,
        hidden=plan.get("hidden", 0),
        model_name=plan.get("model_name", ""),
        model_digest=plan.get("model_digest", ""),
        # fully interactive: every user; Poisson: as many as the shuffler's draw (RoundSpec.sampling_rate)
        cohort_size=plan["cohort"] if plan["kind"] != "fully_interactive" and not plan.get("sampling_rate") else 0,
        sampling_rate=plan.get("sampling_rate", 0.0),
        min_contributors=plan["min_contributors"],
        report_goal=plan.get("report_goal", 0),  # plans stored before over-selection have none
        deadline_seconds=plan["deadline"],
        local_batch=1,
        l2=plan.get("l2", 0.0),
        smoothing=plan.get("smoothing", 0.0),
        **protocol.spec_fields(plan, params, event, analyzer_public_key),
    )
