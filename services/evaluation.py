"""The analyzer's evaluation of a model on the public held-out split (it never uses the training split, which is the
users'): loss, accuracy, the excess risk where the population optimum is known (synthetic data), and the majority
baseline a released accuracy is read against."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

from shuffledp.config import ConfigError, RunConfig
from shuffledp.data import load_dataset
from shuffledp.models import ModelPlugin
from shuffledp.models.plugin import build_model
from shuffledp.optimizers.base import Optimizer

__all__ = ["EvalData", "HeldOut", "evaluate"]


class EvalData(NamedTuple):
    model: ModelPlugin
    X: np.ndarray
    y: np.ndarray
    feature_bound: float | None
    optimum_loss: float | None  # held-out loss of the population optimum (synthetic data): excess risk = loss - it


class HeldOut:
    """The held-out splits by data source: a few, least recently used first (every CreateRun loads one, and
    configurations that differ elsewhere must not each keep a copy)."""

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, EvalData] = OrderedDict()

    def data(self, cfg: RunConfig) -> EvalData:
        """Model and the public held-out split (the analyzer never uses the training split), the data's public
        bound on ||x|| and, for synthetic data, the population optimum (excess risk)."""
        key = repr((cfg.data, cfg.model.task, cfg.model.l2, cfg.model.hidden, cfg.model.module, cfg.model.args))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            ds = load_dataset(cfg.data, cfg.model.task)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"data: {exc}") from exc
        model = build_model(cfg.model, ds.num_features, ds.num_classes)
        # the excess risk of the regularised objective would need its own optimum: reported for l2 = 0 only
        known = ds.optimum is not None and cfg.model.l2 == 0
        optimum_loss = model.loss(ds.optimum, ds.X_test, ds.y_test) if known else None
        entry = EvalData(model, ds.X_test, ds.y_test, ds.feature_norm_bound, optimum_loss)
        with self._lock:
            self._cache[key] = entry
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return entry


def evaluate(data: EvalData, opt: Optimizer, state: Any, r: int) -> dict[str, Any]:
    """Held-out loss/accuracy of the model after round r (r = -1: the initial model theta_0).

    The optimizer's monitor() says what to evaluate: for PSGD / PGD after k steps "last" is theta_k and "mean"
    is mean(theta_0..theta_k), which includes the iterate round r produced, so round 0 already shows a trained
    model (the released output stays the papers' mean(theta_0..theta_{T-1}), spec 000 sec 4); for AC-SA
    "mean" is the aggregated iterate theta_ag (its output) and "last" the prox iterate. With a known optimum
    (synthetic data) the excess risk of each is reported too.
    """
    model, X, y, _, optimum_loss = data
    views = opt.monitor(state)
    out: dict[str, Any] = {"round": r}
    for which in ("mean", "last"):
        out[f"loss_{which}"] = model.loss(views[which], X, y)
        out[f"accuracy_{which}"] = model.accuracy(views[which], X, y)
        if optimum_loss is not None:
            out[f"excess_risk_{which}"] = out[f"loss_{which}"] - optimum_loss
    if r == -1 and not math.isnan(out["accuracy_mean"]):
        # the baseline a released accuracy is read against: always predicting the most frequent held-out label (the
        # analyzer holds no training label: the users' data)
        out["majority_accuracy"] = float(np.unique(y, return_counts=True)[1].max() / max(len(y), 1))
    return out
