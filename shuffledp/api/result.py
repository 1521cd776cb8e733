"""What a run leaves: its results directory, read back as Python objects.

`load_result(DIR)` reads any results directory `shuffledp run` (or the API) wrote: summary.json (`Result.summary`),
metrics.json (`Result.rows`, `Result.metrics` as a pandas DataFrame), model.npz (`Result.model`, with `predict`),
config.toml and ledger.json. One source: a run driven from Python is written to its directory first and read back
from it, so the object and the files never disagree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

    from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["Result", "ReleasedModel", "Spend", "RoundResult", "load_result", "require_pandas"]


def require_pandas():
    """pandas, or ImportError in one line saying how to get it (the `api` extra)."""
    try:
        import pandas
    except ImportError:
        raise ImportError("shuffledp.api's DataFrames need pandas: pip install 'shuffledp[api]' (or pandas)") from None
    return pandas


@dataclass(frozen=True)
class RoundResult:
    """One round as it arrives (Experiment's stream, the on_round callback): the figures metrics.json holds for it.
    `loss`, `accuracy` are the held-out figures of the iterate after the round (nan where not evaluated, e.g. hidden
    iterates); `eps_spent` the run's total so far."""

    round: int  # 1-based
    rounds_planned: int
    released: bool
    contributors: int
    loss: float
    accuracy: float
    eps_spent: float
    delta_spent: float
    seconds: float
    excess_risk: float | None = None
    eps_spent_local: float | None = None
    refused: int = 0
    not_in_run: int = 0
    checked_in: int = 0
    excluded_silent: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_metrics(cls, m: pb.RoundMetrics, rounds_planned: int) -> RoundResult:
        from shuffledp.cli.run import metrics_row

        return cls(rounds_planned=rounds_planned, **metrics_row(m))


@dataclass(frozen=True)
class Spend:
    """The run's privacy spend as its ledger counts it (summary.json "spend")."""

    eps: float
    delta: float
    eps_limit: float
    delta_limit: float
    accountant: str
    trust_model: str
    eps_with_round_in_flight: float | None = None
    eps_robust: float | None = None
    honest_fraction: float | None = None
    views: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_summary(cls, spend: dict[str, Any]) -> Spend:
        keys = cls.__dataclass_fields__
        return cls(**{k: v for k, v in spend.items() if k in keys})


@dataclass(frozen=True)
class ReleasedModel:
    """The released model (model.npz): the flat parameter vector, its layout and the named arrays it splits into.

    `predict(X)` uses the run's own model definition (built-in task or plug-in) on feature rows as the run's data set
    gives them (`Result.test_data()`): class indices for the classifiers (the labels' order of `class_labels`), the
    real-valued prediction for leastsq/absolute."""

    params: np.ndarray
    layout: dict[str, Any]
    arrays: dict[str, np.ndarray]
    config_toml: str

    @property
    def task(self) -> str:
        return str(self.layout.get("task", ""))

    @property
    def class_labels(self) -> list[int] | None:
        """The data label of each class index (None: not a classifier, or a file's labels in increasing order)."""
        return self.layout.get("class_labels")

    def _model(self):
        from shuffledp.config import parse_config
        from shuffledp.models.plugin import build_model

        cfg = parse_config(self.config_toml)
        return build_model(cfg.model, int(self.layout["num_features"]), int(self.layout["num_classes"]))

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predictions for the rows of X (n x num_features)."""
        model = self._model()
        predict = getattr(model, "predict", None)
        if predict is None:
            raise NotImplementedError(f"the model plug-in {self.layout.get('model')!r} has no predict(params, X)")
        X = np.asarray(X, dtype=np.float64)
        return np.asarray(predict(self.params, X.reshape(len(X), -1)))

    def accuracy(self, X: np.ndarray, y: np.ndarray) -> float:
        """Fraction of rows whose prediction is y (the model's own accuracy rule)."""
        return float(self._model().accuracy(self.params, np.asarray(X, dtype=np.float64), np.asarray(y)))


@dataclass(frozen=True)
class Result:
    """A run's results (its directory `out`), as `shuffledp run` wrote them.

    `summary` is summary.json (the released model's figures, the plan, the spend); `rows` metrics.json (one dict per
    round) and `metrics` the same as a pandas DataFrame; `model` the released model (None when none was released);
    `spend` the ledger's totals. `exit_status` is the one `shuffledp run` would exit with (0 completed, 1 ended
    otherwise, 4 nothing released, 130 interrupted; None when read from a directory)."""

    out: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    model: ReleasedModel | None
    config_toml: str
    exit_status: int | None = None

    @property
    def run_id(self) -> str:
        return str(self.summary.get("run_id", ""))

    @property
    def state(self) -> str:
        """COMPLETED, FAILED, CANCELLED, BUDGET_EXHAUSTED (or RUNNING, CREATED: results so far)."""
        return str(self.summary.get("state", ""))

    @property
    def interrupted(self) -> bool:
        return bool(self.summary.get("interrupted"))

    @property
    def spend(self) -> Spend:
        return Spend.from_summary(self.summary.get("spend") or {})

    def _figure(self, key: str) -> float | None:
        model = self.summary.get("released_model") or {}
        value = model.get(key)
        return None if value is None else float(value)

    @property
    def accuracy(self) -> float | None:
        """The released model's held-out accuracy (None: no model, or not evaluated for its task)."""
        return self._figure("accuracy")

    @property
    def loss(self) -> float | None:
        """The released model's held-out loss (None: no model)."""
        return self._figure("loss")

    @property
    def excess_risk(self) -> float | None:
        """Held-out loss minus the known optimum's (synthetic data only; else None)."""
        return self._figure("excess_risk")

    @property
    def metrics(self) -> pd.DataFrame:
        """The per-round figures as a DataFrame indexed by round (metrics.json; `rejected` a dict per round)."""
        pd = require_pandas()
        frame = pd.DataFrame(self.rows)
        return frame.set_index("round") if "round" in frame else frame

    @property
    def ledger(self) -> dict[str, Any]:
        """ledger.json: the analyzer's export of the run's ledger ({} when it gave none)."""
        path = self.out / "ledger.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @property
    def plot(self) -> Path:
        """plot.png (held-out figures and the spend against rounds)."""
        return self.out / "plot.png"

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        """The run's public held-out split (X, y) as its analyzer evaluates on it (loaded from the configuration's
        [data]; y holds class indices)."""
        from shuffledp.config import parse_config
        from shuffledp.data import load_dataset

        cfg = parse_config(self.config_toml)
        ds = load_dataset(cfg.data, cfg.model.task)
        return ds.X_test, ds.y_test

    def __repr__(self) -> str:
        acc = self.accuracy
        figures = f"accuracy={acc:.4f}, " if acc is not None and math.isfinite(acc) else ""
        s = self.spend
        return (
            f"Result(run_id={self.run_id!r}, state={self.state!r}, rounds={len(self.rows)}, {figures}"
            f"eps_spent={s.eps:.4f}, out={str(self.out)!r})"
        )


def load_result(out: str | Path, exit_status: int | None = None) -> Result:
    """Read a results directory written by `shuffledp run` or the API (FileNotFoundError without summary.json)."""
    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    metrics = out / "metrics.json"
    rows = json.loads(metrics.read_text()) if metrics.exists() else []
    config_toml = (out / "config.toml").read_text() if (out / "config.toml").exists() else ""
    model = None
    if (out / "model.npz").exists():
        with np.load(out / "model.npz") as z:
            layout = json.loads(str(z["layout"]))
            arrays = {k: z[k] for k in z.files if k not in ("params", "layout")}
            model = ReleasedModel(params=z["params"], layout=layout, arrays=arrays, config_toml=config_toml)
    return Result(out=out, summary=summary, rows=rows, model=model, config_toml=config_toml, exit_status=exit_status)
