"""Run tracking (issue 29 item 3): `shuffledp run --tensorboard DIR` logs a run in TensorBoard's own event format;
with MLflow too (issue 46 item 4: `--mlflow [URI]` or `[tracking] mlflow`, shuffledp/observability/mlflow_tracking.py).
`tracking_refused` and `open_trackers` are what the CLI asks: what was asked for, checked before anything starts, and
the trackers of one run as one (`Trackers`).

Each run is one TensorBoard run, DIR/<results directory name>, so `tensorboard --logdir DIR` shows a project's runs
side by side. Rounds are logged as they end (step = the round, 1-based as in metrics.json; step 0 is the initial
model); the configuration is logged at the start and the final spend at the end, as text. The writer is
tensorboardX (the optional extra `tracking`): it writes the format without TensorFlow or TensorBoard installed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["TensorBoardTracker", "Trackers", "check_tracking", "tracking_refused", "open_trackers", "TAGS"]

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


class Trackers:
    """The trackers of one run as one: each sees every status and the end, in order."""

    def __init__(self, trackers: Sequence[Any]) -> None:
        self.trackers = list(trackers)

    def update(self, status: pb.RunStatus, new: Sequence[pb.RoundMetrics], seen: int) -> None:
        for t in self.trackers:
            t.update(status, new, seen)

    def finish(self, result: pb.RunResult) -> None:
        for t in self.trackers:
            t.finish(result)


def _mlflow_target(flag: bool | str | None, config: Any) -> bool | str:
    """What MLflow tracking is asked for: --mlflow [URI] over [tracking] mlflow; False = none."""
    if flag is not None:
        return flag
    return config.tracking.mlflow if config is not None else False


def tracking_refused(tensorboard: Path | None, mlflow: bool | str | None, config: Any = None) -> str | None:
    """Why the tracking asked for cannot be done (one line), or None: --tensorboard DIR, --mlflow [URI] (a URI that
    is not one: likely a configuration file taken by the flag) and `config`'s [tracking] (a RunConfig; None: not
    known yet, a fetched run's)."""
    if tensorboard is not None:
        why = check_tracking()
        if why:
            return why
    if isinstance(mlflow, str):
        from shuffledp.settings import ConfigError, TrackingConfig, read_table

        try:
            read_table(TrackingConfig, {"mlflow": mlflow}, "tracking")
        except ConfigError as exc:
            if "credentials" in str(exc):
                return str(exc).replace("tracking.mlflow", "--mlflow URI", 1)
            return (
                f"--mlflow URI must be an MLflow tracking URI (sqlite:///PATH/mlflow.db, http://HOST:5000), got "
                f"{mlflow!r}: a configuration file? put --mlflow after it, or write --mlflow=URI"
            )
    target = _mlflow_target(mlflow, config)
    if target is False:
        return None
    from shuffledp.observability.mlflow_tracking import check_mlflow

    why = check_mlflow(target)
    return why and f"{'--mlflow' if mlflow is not None else 'tracking.mlflow'} {why}"


def _tracking_of(config_toml: str) -> Any:
    """The [tracking] table of a run's configuration (TrackingConfig); its defaults (none asked for) when the
    document cannot be read here (a fetched run of another version: its tracking is then the flags' only)."""
    import tomllib

    from shuffledp.settings import ConfigError, TrackingConfig, read_table

    try:
        return read_table(TrackingConfig, tomllib.loads(config_toml).get("tracking", {}), "tracking")
    except (ConfigError, tomllib.TOMLDecodeError):
        return TrackingConfig()


def open_trackers(
    out: Path, config_toml: str, *, tensorboard: Path | None = None, mlflow: bool | str | None = None
) -> Trackers | None:
    """The run's trackers, started (None: none asked for): TensorBoard in tensorboard/<results directory name>, and
    MLflow as --mlflow (flag) or the configuration's [tracking] say."""
    trackers: list[Any] = []
    if tensorboard is not None:
        trackers.append(TensorBoardTracker(tensorboard, Path(out).resolve().name, config_toml))
    tracking = _tracking_of(config_toml)
    target = mlflow if mlflow is not None else tracking.mlflow
    if target is not False:
        from shuffledp.observability.mlflow_tracking import MlflowTracker, check_mlflow

        why = check_mlflow(target)  # a fetched run's [tracking]: not checked before it was fetched
        if why:
            print(f"MLflow tracking {why}; the run is not tracked in MLflow", file=sys.stderr)
        else:
            trackers.append(MlflowTracker(target, out, config_toml, tracking.experiment, tags=TAGS))
    return Trackers(trackers) if trackers else None
