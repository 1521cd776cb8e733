"""Run tracking (issue 29 item 3): `shuffledp run --tensorboard DIR` logs a run in TensorBoard's own event format.

Each run is one TensorBoard run, DIR/<results directory name>, so `tensorboard --logdir DIR` shows a project's runs
side by side. Rounds are logged as they end (step = the round, 1-based as in metrics.json; step 0 is the initial
model); the configuration is logged at the start and the final spend at the end, as text. The writer is
tensorboardX (the optional extra `tracking`): it writes the format without TensorFlow or TensorBoard installed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["TensorBoardTracker", "check_tracking", "TAGS"]

# the scalars of every round (tag -> what of RoundMetrics); loss and accuracy only where defined (hidden iterates
# and regression tasks have none)
TAGS = {
    "round/loss": lambda m: m.loss,
    "round/accuracy": lambda m: m.accuracy,
    "privacy/eps_spent": lambda m: m.eps_spent,
    "privacy/delta_spent": lambda m: m.delta_spent,
    "round/contributors": lambda m: m.contributors,
    "round/refused": lambda m: m.refused,
    "round/rejected": lambda m: sum(m.rejected.values()),
    "round/released": lambda m: float(m.released),
    "round/seconds": lambda m: m.seconds,
}


def check_tracking() -> str | None:
    """Why --tensorboard cannot be used here (one line), or None."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return "--tensorboard needs the optional extra 'tracking': pip install 'shuffledp[tracking]' (tensorboardX)"
    return None


def _code_block(text: str) -> str:
    # TensorBoard renders text summaries as Markdown: indented lines stay verbatim
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardTracker:
    """Writes one run's event file; `round` for each round as it ends (a round seen twice is logged once)."""

    def __init__(self, logdir: Path, name: str, config_toml: str) -> None:
        from tensorboardX import SummaryWriter

        self.path = Path(logdir) / name
        self._writer = SummaryWriter(logdir=str(self.path))
        self._logged: set[int] = set()
        self._writer.add_text("run/config", _code_block(config_toml), 0)

    def update(self, status: pb.RunStatus, new: Sequence[pb.RoundMetrics], seen: int) -> None:
        """drive_run's on_status: log the rounds that are new."""
        for m in new:
            self.round(m)

    def round(self, m: pb.RoundMetrics) -> None:
        step = m.round + 1  # metrics.json's numbering: 0 is the initial model
        if step in self._logged:
            return
        self._logged.add(step)
        for tag, get in TAGS.items():
            value = float(get(m))
            if math.isfinite(value):
                self._writer.add_scalar(tag, value, step)
        for reason, n in sorted(m.refused_reasons.items()):
            self._writer.add_scalar(f"refused_by_reason/{reason}", n, step)

    def finish(self, result: pb.RunResult) -> None:
        """Log the rounds not seen yet (a fetched or interrupted run) and the final spend; close the file."""
        status = result.status
        for m in status.metrics:
            self.round(m)
        b = status.budget
        last = max(self._logged, default=0)
        spend = (
            f"state: {pb.RunState.Name(status.state)}  \n"
            f"eps spent: {b.eps_spent:.6g} of {b.eps_limit:g}  \n"
            f"delta spent: {b.delta_spent:.6g} of {b.delta_limit:.3g}  \n"
            f"accountant: {b.accountant}; rounds committed: {b.rounds_committed}"
        )
        self._writer.add_text("run/final_spend", spend, last)
        self._writer.add_scalar("final/eps_spent", b.eps_spent, last)
        self._writer.add_scalar("final/eps_limit", b.eps_limit, last)
        self._writer.add_scalar("final/delta_spent", b.delta_spent, last)
        self._writer.close()
