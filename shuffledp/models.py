"""Convex models on flat float64 parameter vectors: multinomial logistic regression and least squares.

Both parties use this module: client nodes compute per-example gradients at the broadcast iterate, the analyzer
evaluates loss and accuracy on the public test split and projects iterates onto the l2 ball Theta (the convex
set of the SCO problem, spec 000 section 0).

Parameter layout (public, part of the wire contract through RoundSpec.model):
- logreg: a (num_classes, num_features + 1) matrix W flattened row-major; column num_features is the bias.
  Scores z = W [x; 1]; loss = cross-entropy of softmax(z).
- leastsq: a vector w of length num_features + 1 (bias last); loss = (w . [x; 1] - y)^2 / 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TASKS", "Model", "make_model", "project_l2_ball"]

TASKS = ("logreg", "leastsq")


def _design(X: np.ndarray, num_features: int) -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[1] != num_features:
        raise ValueError(f"X must have shape (k, num_features={num_features}), got {X.shape}")
    return np.concatenate([X, np.ones((X.shape[0], 1))], axis=1)


@dataclass(frozen=True)
class Model:
    """A loss family with fixed shapes. All methods are vectorized over examples and pure."""

    task: str
    num_features: int
    num_classes: int = 1  # logreg: number of classes (>= 2); leastsq: 1

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not isinstance(self.num_features, int | np.integer) or self.num_features < 1:
            raise ValueError(f"num_features must be an integer >= 1, got {self.num_features!r}")
        if self.task == "logreg" and self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 for logreg, got {self.num_classes}")
        if self.task == "leastsq" and self.num_classes != 1:
            raise ValueError(f"num_classes must be 1 for leastsq, got {self.num_classes}")

    @property
    def dim(self) -> int:
        """Length of the flat parameter vector (d of PVEC)."""
        return self.num_classes * (self.num_features + 1)

    def init_params(self) -> np.ndarray:
        """theta_0 = 0 (paper 000 Alg 5 starts at 0; 0 is in every ball Theta)."""
        return np.zeros(self.dim)

    def _check(self, params: np.ndarray) -> np.ndarray:
        params = np.asarray(params, dtype=np.float64)
        if params.shape != (self.dim,):
            raise ValueError(f"params must have shape ({self.dim},), got {params.shape}")
        return params

    def _labels(self, y: np.ndarray, k: int) -> np.ndarray:
        y = np.asarray(y)
        if y.shape != (k,):
            raise ValueError(f"y must have shape ({k},), got {y.shape}")
        if self.task == "logreg":
            if y.dtype.kind not in "iu" and not np.all(y == np.floor(y)):
                raise ValueError("logreg labels must be integers")
            yi = y.astype(np.int64)
            if k and (yi.min() < 0 or yi.max() >= self.num_classes):
                raise ValueError(f"logreg labels must lie in [0, {self.num_classes}), got [{yi.min()}, {yi.max()}]")
            return yi
        return y.astype(np.float64)

    def _softmax(self, params: np.ndarray, Z: np.ndarray) -> np.ndarray:
        W = params.reshape(self.num_classes, self.num_features + 1)
        s = Z @ W.T
        s -= s.max(axis=1, keepdims=True)  # stable softmax
        e = np.exp(s)
        return e / e.sum(axis=1, keepdims=True)

    def predict(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """logreg: argmax class; leastsq: the real-valued prediction."""
        params = self._check(params)
        Z = _design(X, self.num_features)
        if self.task == "logreg":
            return np.argmax(Z @ params.reshape(self.num_classes, -1).T, axis=1)
        return Z @ params

    def per_example_gradients(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradients of the loss of each example at params: shape (k, dim)."""
        params = self._check(params)
        Z = _design(X, self.num_features)
        y = self._labels(y, Z.shape[0])
        if self.task == "logreg":
            # d/dW of cross-entropy = (softmax(Wz) - onehot(y)) z^T, flattened row-major like W
            P = self._softmax(params, Z)
            P[np.arange(Z.shape[0]), y] -= 1.0
            return (P[:, :, None] * Z[:, None, :]).reshape(Z.shape[0], self.dim)
        r = Z @ params - y
        return r[:, None] * Z

    def gradient(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Mean gradient over the examples (the non-private full-batch gradient)."""
        return self.per_example_gradients(params, X, y).mean(axis=0)

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Mean loss over the examples."""
        params = self._check(params)
        Z = _design(X, self.num_features)
        y = self._labels(y, Z.shape[0])
        if self.task == "logreg":
            W = params.reshape(self.num_classes, -1)
            s = Z @ W.T
            smax = s.max(axis=1)
            lse = smax + np.log(np.exp(s - smax[:, None]).sum(axis=1))
            return float(np.mean(lse - s[np.arange(Z.shape[0]), y]))
        r = Z @ params - y
        return float(np.mean(0.5 * r * r))

    def accuracy(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """logreg: fraction classified correctly. leastsq: fraction whose rounded prediction equals y (meaningful
        when y holds integer labels, e.g. 0/1 regression); nan when y is not integer-valued."""
        pred = self.predict(params, X)
        y = np.asarray(y)
        if self.task == "logreg":
            return float(np.mean(pred == y))
        yf = y.astype(np.float64)
        if not np.all(yf == np.round(yf)):
            return float("nan")
        return float(np.mean(np.round(pred) == yf))


def make_model(task: str, num_features: int, num_classes: int) -> Model:
    """The model of a task; num_classes is ignored (forced to 1) for leastsq."""
    return Model(task=task, num_features=int(num_features), num_classes=int(num_classes) if task == "logreg" else 1)


def project_l2_ball(params: np.ndarray, radius: float) -> np.ndarray:
    """Euclidean projection onto {theta : ||theta||_2 <= radius} (Proj_Theta of paper 000 Alg 3 / Alg 5)."""
    if not (np.isfinite(radius) and radius > 0):
        raise ValueError(f"radius must be a finite number > 0, got {radius!r}")
    params = np.asarray(params, dtype=np.float64)
    norm = float(np.linalg.norm(params))
    if norm <= radius:
        return params.copy()
    out = params * (radius / norm)
    # float rounding may leave the norm an ulp above the radius; shrink once more so the ball is never left
    if np.linalg.norm(out) > radius:
        out *= 1.0 - 4.0 * np.finfo(float).eps
    return out
