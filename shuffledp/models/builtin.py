"""Models on flat float64 parameter vectors: convex smooth (logistic regression, least squares) and non-smooth
(hinge, absolute error, distance) losses, with an optional l2 term and optional Moreau smoothing; and one non-convex
task, a one-hidden-layer perceptron (mlp), for the deep-model setting of DP-FTRL (Kairouz et al., ICML 2021).

Both parties use this module: client nodes compute per-example gradients at the broadcast iterate, the analyzer
evaluates loss and accuracy on the public test split and projects iterates onto the l2 ball Theta (the convex
set of the SCO problem, spec 000 section 0).

Parameter layout (public, part of the wire contract through RoundSpec.model). z = [x; 1] (bias last):
- logreg: a (num_classes, num_features + 1) matrix W flattened row-major; column num_features is the bias.
  Scores W z; loss = cross-entropy of softmax(W z).
- leastsq: a vector w of length num_features + 1; loss = (w . z - y)^2 / 2.
- hinge: w of length num_features + 1; labels y in {0, 1}, s = 2y - 1; loss = max(0, 1 - s w . z) (linear SVM).
- absolute: w of length num_features + 1; loss = |w . z - y|.
- distance: theta of length num_features (no bias); loss = ||theta - x||_2, labels ignored (spec 000 section 4,
  the paper's test loss).
- mlp (non-convex, not in TASKS): theta = [W1 flattened row-major; W2 flattened row-major] with W1 of shape
  (hidden, num_features + 1) and W2 of shape (num_classes, hidden + 1), bias last in every row as for logreg.
  h = tanh(W1 z) (the activation of the DP-FTRL paper's experiments), scores W2 [h; 1], loss = cross-entropy of
  their softmax; dim = hidden (num_features + 1) + num_classes (hidden + 1). theta_0 is a small Glorot-uniform
  draw from a fixed public seed (init_params). The convex theory's step-size rules do NOT apply to it: the
  Lipschitz / smoothness constants of the SCO theorems are refused (lipschitz_bound, smoothness raise), so a run
  must give its learning rate explicitly, and the clip norm bounds each gradient's sensitivity as for every task.

Options (spec 000 section 4): l2 = lambda adds lambda/2 ||theta||^2 to every example's loss (the strongly convex
task of Thm 4.8; for mlp a plain weight decay, on all parameters); smoothing = beta > 0 (convex non-smooth tasks
only; refused for mlp) makes per_example_gradients return the gradient of each example's Moreau envelope (Def 4.5 /
Lem 4.6) instead of a subgradient, while loss() stays the original loss so that reported losses are comparable
across runs.
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ModelPlugin",
    "model_factory",
    "model_digest",
    "builtin",
    "TASKS",
    "SMOOTH_TASKS",
    "NONSMOOTH_TASKS",
    "NONCONVEX_TASKS",
    "ALL_TASKS",
    "DEFAULT_HIDDEN",
    "MLP_INIT_SEED",
    "Model",
    "make_model",
    "project_l2_ball",
]

SMOOTH_TASKS = ("logreg", "leastsq")
NONSMOOTH_TASKS = ("hinge", "absolute", "distance")
TASKS = SMOOTH_TASKS + NONSMOOTH_TASKS  # the convex tasks: the SCO theory (spec 000) and its constants apply
NONCONVEX_TASKS = ("mlp",)  # no convex theory: explicit learning rate, no Lipschitz / smoothness constants
ALL_TASKS = TASKS + NONCONVEX_TASKS  # every task a Model accepts
CLASSIFIERS = ("logreg", "mlp")  # softmax cross-entropy over num_classes >= 2 integer labels
DEFAULT_HIDDEN = 32  # make_model's hidden width for mlp
# Public, data-independent seed of mlp's theta_0 (see Model.init_params). Not privacy noise: the CSPRNG rule of
# shuffledp.security.rng (design section 6) is about noise that must stay secret; theta_0 is public by design.
MLP_INIT_SEED = 0


class ModelPlugin(ABC):
    """What the client nodes and the analyzer need of a model (issue 26 item 1), on a flat float64 parameter vector.

    A model is public: its definition and its parameter layout are the same on every party (the RoundSpec carries
    its name and digest, and a node refuses a round whose model differs from the one installed on it). Nodes call
    per_user_gradients at the broadcast iterate; the round's protocol then clips and randomizes. The analyzer calls
    init_params, loss and accuracy on the public held-out split, and, for the convex theory's step sizes,
    lipschitz_bound and smoothness. A non-convex model (convex = False) has no such constants: the defaults raise,
    and a run must give schedule.learning_rate (shuffledp/planning/planner.plan_run refuses it otherwise).

    The built-in Model implements it; shuffledp.models.flax_adapter adapts a Flax module. A plug-in is selected by
    [model] module = "package.module:factory" (shuffledp.models.plugin): factory(num_features, num_classes, **args)
    returns an instance.
    """

    # the built-in tasks' options (Model's fields; Model.task names its loss); a plug-in has none of them, its
    # factory's arguments configure it
    l2: float = 0.0
    smoothing: float = 0.0
    hidden: int = 0
    num_features: int
    num_classes: int

    @property
    @abstractmethod
    def dim(self) -> int:
        """Length of the flat parameter vector (d of the randomizers)."""

    @property
    def convex(self) -> bool:
        """True when the SCO theory's constants (lipschitz_bound, smoothness) exist; False = "unknown"."""
        return False

    @abstractmethod
    def init_params(self, seed: int | None = None) -> np.ndarray:
        """theta_0 of shape (dim,), a function of the public seed (None = the model's fixed default) and the
        shapes only, never of data: every party computes the same one."""

    @abstractmethod
    def per_example_gradients(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradient of each example's loss at params: X (k, num_features), y (k,) -> (k, dim) float64."""

    def per_user_gradients(
        self, params: np.ndarray, X: np.ndarray, y: np.ndarray, clip_norm: float | None = None
    ) -> np.ndarray:
        """Mean gradient of each user's examples at params: X (n, b, num_features), y (n, b) -> (n, dim), each
        row scaled to l2 norm <= clip_norm when given (g min(1, C / ||g||), Abadi et al. 2016 eq. (1))."""
        n, b, f = X.shape
        g = self.per_example_gradients(params, X.reshape(n * b, f), y.reshape(n * b))
        # one example per user (the node's default): the mean would copy the (n, dim) gradients for nothing
        g = g if b == 1 else g.reshape(n, b, self.dim).mean(axis=1)
        return g if clip_norm is None else clip_l2(g, clip_norm)

    @abstractmethod
    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Mean loss over the examples."""

    @abstractmethod
    def accuracy(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Fraction of the examples predicted correctly (nan where it has no meaning)."""

    def lipschitz_bound(self, feature_norm_bound: float, radius: float = math.inf) -> float:
        """L of one example's loss over ||x|| <= feature_norm_bound and ||theta|| <= radius; "unknown" (ValueError)
        unless the model states it."""
        raise ValueError(_no_constants("lipschitz_bound", self.describe().get("name", type(self).__name__)))

    def smoothness(self, feature_norm_bound: float) -> float:
        """beta (Lipschitz constant of the gradient) of one example's loss; "unknown" (ValueError) by default."""
        raise ValueError(_no_constants("smoothness", self.describe().get("name", type(self).__name__)))

    @abstractmethod
    def layout(self) -> list[dict[str, Any]]:
        """The flat vector's segments in order: [{"name": str, "shape": [int, ...]}, ...] (sizes sum to dim)."""

    def export(self, params: np.ndarray, directory: Any) -> list[str]:
        """Write params in the model's framework's own form into directory; the file names written ([] = none:
        the flat vector with its layout, model.npz, is what `shuffledp run` always writes)."""
        return []

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The model's public definition as JSON-able values (its name, hyper-parameters, a hash of its code where
        the code is the user's): with layout() the input of model_digest."""


def _no_constants(what: str, name: str) -> str:
    return (
        f"{what}: model {name!r} is non-convex (or states no constants), so the convex theory's step-size rules "
        "(spec 000) do not apply to it; give the learning rate (schedule.learning_rate) and the clip norm "
        "(privacy.clip_norm) explicitly"
    )


def clip_l2(G: np.ndarray, clip_norm: float) -> np.ndarray:
    """Each row of G scaled to l2 norm <= clip_norm (rows inside unchanged; a row over by float rounding is shrunk
    a few ulps more, as mechanisms/pvec.clip_rows does)."""
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    G = np.array(G, dtype=np.float64, copy=True)
    norms = np.sqrt(np.einsum("ij,ij->i", G, G))
    over = norms > clip_norm
    G[over] *= (clip_norm / norms[over])[:, None]
    still = np.sqrt(np.einsum("ij,ij->i", G, G)) > clip_norm
    G[still] *= 1.0 - 4.0 * np.finfo(float).eps
    return G


def model_digest(model: ModelPlugin, origin: dict[str, Any] | None = None) -> str:
    """sha256 (hex) of the model's public definition, its parameter layout and where it was loaded from (the
    plug-in's "package.module:factory", its arguments and a hash of the factory's source file): what a RoundSpec
    carries and a node compares with its own model's (issue 26 item 3)."""
    doc = {"model": model.describe(), "layout": model.layout(), "dim": int(model.dim), "origin": origin or {}}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(text.encode()).hexdigest()


def _json_default(v: Any) -> Any:
    if isinstance(v, np.integer | np.floating):
        return v.item()
    if isinstance(v, tuple | list | np.ndarray):
        return list(v)
    raise TypeError(f"model_digest: {type(v).__name__} is not a JSON value")


def model_factory(fn: Any) -> Any:
    """Marks fn(num_features, num_classes, **args) -> ModelPlugin as a model factory: [model] module may name only
    a marked factory (or a ModelPlugin subclass), so that a configuration cannot make a party call an arbitrary
    installed function (shuffledp.models.plugin)."""
    fn.__shuffledp_model_factory__ = True
    return fn


def _design(X: np.ndarray, num_features: int, bias: bool = True) -> np.ndarray | _Biased:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[1] != num_features:
        raise ValueError(f"X must have shape (k, num_features={num_features}), got {X.shape}")
    return _Biased(X) if bias else X


class _Biased:
    """The inputs with the bias coordinate, Z = [X, 1], without building it: what the models do with Z, read from X.
    At d = 10^4 a copy of a round's (or the test set's) inputs, 80 MB per 1000 examples in a fresh block, cost ~4x
    the product that reads it (its page faults): a node's gradients and the analyzer's every evaluation made one."""

    __slots__ = ("X", "shape")

    def __init__(self, X: np.ndarray) -> None:
        self.X = X
        self.shape = (X.shape[0], X.shape[1] + 1)

    def __matmul__(self, W: np.ndarray) -> np.ndarray:
        """Z @ W for W of shape (f + 1,) or (f + 1, c)."""
        return self.X @ W[:-1] + W[-1]

    def scale_rows(self, r: np.ndarray) -> np.ndarray:
        """r[:, None] * Z, shape (k, f + 1)."""
        out = np.empty(self.shape)
        np.multiply(r[:, None], self.X, out=out[:, :-1])
        out[:, -1] = r
        return out

    def outer(self, P: np.ndarray) -> np.ndarray:
        """(P[:, :, None] * Z[:, None, :]).reshape(k, c (f + 1)) for P of shape (k, c): each row's outer product."""
        k, c = P.shape
        out = np.empty((k, c, self.shape[1]))
        np.multiply(P[:, :, None], self.X[:, None, :], out=out[:, :, :-1])
        out[:, :, -1] = P
        return out.reshape(k, c * self.shape[1])

    def squared_norms(self) -> np.ndarray:
        """||z||^2 of each row (>= 1: the bias coordinate)."""
        return np.einsum("ij,ij->i", self.X, self.X) + 1.0


@dataclass(frozen=True)
class Model(ModelPlugin):
    """A loss family with fixed shapes. All methods are vectorized over examples and pure."""

    task: str
    num_features: int
    num_classes: int = 1  # logreg, mlp: number of classes (>= 2); every other task: 1
    l2: float = 0.0  # lambda >= 0: adds lambda/2 ||theta||^2 (strongly convex task, spec 000 Thm 4.8)
    smoothing: float = 0.0  # beta >= 0: Moreau-envelope gradients (spec 000 Def 4.5); 0 = subgradients
    hidden: int = 0  # mlp: hidden units (>= 1; make_model's default DEFAULT_HIDDEN); every other task: 0

    def __post_init__(self) -> None:
        if self.task not in ALL_TASKS:
            raise ValueError(f"task must be one of {ALL_TASKS}, got {self.task!r}")
        if not isinstance(self.num_features, int | np.integer) or self.num_features < 1:
            raise ValueError(f"num_features must be an integer >= 1, got {self.num_features!r}")
        if self.task in CLASSIFIERS and self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 for {self.task}, got {self.num_classes}")
        if self.task not in CLASSIFIERS and self.num_classes != 1:
            raise ValueError(f"num_classes must be 1 for {self.task}, got {self.num_classes}")
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int | np.integer):
            raise ValueError(f"hidden must be an integer, got {self.hidden!r}")
        if self.task == "mlp" and self.hidden < 1:
            raise ValueError(f"hidden must be >= 1 for mlp, got {self.hidden}")
        if self.task != "mlp" and self.hidden != 0:
            raise ValueError(f"hidden must be 0 for {self.task} (mlp only), got {self.hidden}")
        for name in ("l2", "smoothing"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float | np.floating | np.integer) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"{name} must be finite, got {v!r}")
        if self.smoothing > 0 and self.task in NONCONVEX_TASKS:
            raise ValueError(
                f"smoothing (the Moreau envelope, spec 000 Def 4.5) is for the convex non-smooth tasks "
                f"({', '.join(NONSMOOTH_TASKS)}); task {self.task!r} is non-convex and already differentiable: its "
                "exact gradient is used"
            )
        if self.smoothing > 0 and self.smooth:
            raise ValueError(
                f"smoothing applies to non-smooth tasks ({', '.join(NONSMOOTH_TASKS)}); task {self.task!r} is smooth"
            )

    @property
    def smooth(self) -> bool:
        """True when the task's loss is differentiable with a Lipschitz gradient (logreg, leastsq), so that Moreau
        smoothing does not apply. mlp: True as well (tanh and softmax are C^infinity and its gradient is exact), but
        its gradient is Lipschitz only on bounded sets and with no useful constant: smoothness() refuses it."""
        return self.task in SMOOTH_TASKS or self.task in NONCONVEX_TASKS

    @property
    def convex(self) -> bool:
        """False for mlp: the SCO theory's step sizes and constants (spec 000) do not apply."""
        return self.task in TASKS

    @property
    def dim(self) -> int:
        """Length of the flat parameter vector (d of PVEC)."""
        if self.task == "distance":
            return self.num_features
        if self.task == "mlp":
            return self.hidden * (self.num_features + 1) + self.num_classes * (self.hidden + 1)
        return self.num_classes * (self.num_features + 1)

    def init_params(self, seed: int | None = None) -> np.ndarray:
        """theta_0 (seed: the mlp's public seed; None = MLP_INIT_SEED). Convex tasks: 0 (paper 000 Alg 5 starts
        at 0; 0 is in every ball Theta).

        mlp: 0 is a saddle point (every hidden unit gets the same, zero, gradient: the symmetry is never broken),
        so the weights are drawn Glorot-uniform (Glorot & Bengio 2010, the scaling for tanh): W1 ~ U(-a, a) with
        a = sqrt(6 / (num_features + hidden)), W2 ~ U(-b, b) with b = sqrt(6 / (hidden + num_classes)), biases 0.
        The draw comes from numpy's PCG64 under the fixed public seed MLP_INIT_SEED, so it depends on the shapes
        only (never on data) and every party computes the same theta_0. This is not privacy noise, so the rule
        that noise comes from the secret-keyed CSPRNG of shuffledp.security.rng does not apply (the analyzer broadcasts
        theta in every RoundSpec anyway; clients never call init_params). The ||theta_0||^2 is about
        2 hidden num_features / (num_features + hidden) + 2 num_classes hidden / (hidden + num_classes); the
        optimizers project onto the ball of model.radius, which must be large enough not to shrink it.
        """
        if self.task != "mlp":
            return np.zeros(self.dim)
        F, H, K = self.num_features, self.hidden, self.num_classes
        rng = np.random.default_rng(
            MLP_INIT_SEED if seed is None else seed
        )  # public seed, not privacy noise (see the docstring)
        W1 = np.zeros((H, F + 1))
        W1[:, :F] = rng.uniform(-1.0, 1.0, size=(H, F)) * math.sqrt(6.0 / (F + H))
        W2 = np.zeros((K, H + 1))
        W2[:, :H] = rng.uniform(-1.0, 1.0, size=(K, H)) * math.sqrt(6.0 / (H + K))
        return np.concatenate([W1.ravel(), W2.ravel()])

    def layout(self) -> list[dict[str, Any]]:
        """The segments of the flat vector (the module docstring's layout)."""
        F, K, H = self.num_features, self.num_classes, self.hidden
        if self.task == "mlp":
            return [{"name": "W1", "shape": [H, F + 1]}, {"name": "W2", "shape": [K, H + 1]}]
        if self.task == "logreg":
            return [{"name": "W", "shape": [K, F + 1]}]
        return [{"name": "theta" if self.task == "distance" else "w", "shape": [self.dim]}]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.task,
            "kind": "builtin",
            "num_features": int(self.num_features),
            "num_classes": int(self.num_classes),
            "hidden": int(self.hidden),
            "l2": float(self.l2),
            "smoothing": float(self.smoothing),
        }

    def _check(self, params: np.ndarray) -> np.ndarray:
        params = np.asarray(params, dtype=np.float64)
        if params.shape != (self.dim,):
            raise ValueError(f"params must have shape ({self.dim},), got {params.shape}")
        return params

    def _inputs(self, X: np.ndarray) -> np.ndarray | _Biased:
        return _design(X, self.num_features, bias=self.task != "distance")

    def _labels(self, y: np.ndarray, k: int) -> np.ndarray:
        y = np.asarray(y)
        if y.shape != (k,):
            raise ValueError(f"y must have shape ({k},), got {y.shape}")
        if self.task in CLASSIFIERS:
            if y.dtype.kind not in "iu" and not np.all(y == np.floor(y)):
                raise ValueError(f"{self.task} labels must be integers")
            yi = y.astype(np.int64)
            if k and (yi.min() < 0 or yi.max() >= self.num_classes):
                raise ValueError(
                    f"{self.task} labels must lie in [0, {self.num_classes}), got [{yi.min()}, {yi.max()}]"
                )
            return yi
        if self.task == "hinge":
            yf = y.astype(np.float64)
            if not np.all((yf == 0) | (yf == 1)):
                raise ValueError("hinge labels must be 0 or 1")
            return 2.0 * yf - 1.0  # the sign s in {-1, +1}
        if self.task == "distance":
            return np.zeros(k)  # labels ignored
        return y.astype(np.float64)

    def _softmax(self, params: np.ndarray, Z: _Biased) -> np.ndarray:
        W = params.reshape(self.num_classes, self.num_features + 1)
        s = Z @ W.T
        s -= s.max(axis=1, keepdims=True)  # stable softmax
        e = np.exp(s)
        return e / e.sum(axis=1, keepdims=True)

    def _mlp_forward(self, params: np.ndarray, Z: _Biased) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(W2, [h; 1], scores) of the mlp at params for the inputs Z = [x; 1]: h = tanh(W1 z), scores W2 [h; 1]."""
        H, n1 = self.hidden, self.hidden * (self.num_features + 1)
        W1 = params[:n1].reshape(H, self.num_features + 1)
        W2 = params[n1:].reshape(self.num_classes, H + 1)
        Ht = np.empty((Z.shape[0], H + 1))
        np.tanh(Z @ W1.T, out=Ht[:, :H])
        Ht[:, H] = 1.0
        return W2, Ht, Ht @ W2.T

    def predict(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """logreg, mlp: argmax class; hinge: 1 where w . z > 0 else 0; leastsq/absolute: the real-valued prediction;
        distance: ||theta - x|| (there is nothing to predict)."""
        params = self._check(params)
        Z = self._inputs(X)
        if self.task == "logreg":
            return np.argmax(Z @ params.reshape(self.num_classes, -1).T, axis=1)
        if self.task == "mlp":
            return np.argmax(self._mlp_forward(params, Z)[2], axis=1)
        if self.task == "hinge":
            return (Z @ params > 0).astype(np.int64)
        if self.task == "distance":
            return np.linalg.norm(params[None, :] - Z, axis=1)
        return Z @ params

    # ------------------------------------------------------------------------------------- gradients
    def per_example_gradients(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradients of the loss of each example at params: shape (k, dim). Non-smooth tasks: a subgradient when
        smoothing = 0, else the gradient of the example's Moreau envelope. The l2 term adds lambda theta."""
        params = self._check(params)
        Z = self._inputs(X)
        y = self._labels(y, Z.shape[0])
        if self.task == "logreg":
            # d/dW of cross-entropy = (softmax(Wz) - onehot(y)) z^T, flattened row-major like W
            P = self._softmax(params, Z)
            P[np.arange(Z.shape[0]), y] -= 1.0
            G = Z.outer(P)
        elif self.task == "mlp":
            G = self._mlp_gradients(params, Z, y)
        elif self.task == "leastsq":
            G = Z.scale_rows(Z @ params - y)
        elif self.smoothing > 0:
            G = self._moreau(params, Z, y)[0]
        elif self.task == "hinge":
            active = y * (Z @ params) < 1.0  # subgradient -s z where the margin is violated, 0 elsewhere
            G = Z.scale_rows(-(active * y))
        elif self.task == "absolute":
            G = Z.scale_rows(np.sign(Z @ params - y))  # sign(0) = 0 is a valid subgradient
        else:  # distance: (theta - x) / ||theta - x||, 0 at theta = x
            D = params[None, :] - Z
            r = np.linalg.norm(D, axis=1)
            G = D / np.where(r > 0, r, 1.0)[:, None]
        if self.l2 > 0:
            G = G + self.l2 * params[None, :]
        return G

    def _mlp_gradients(self, params: np.ndarray, Z: _Biased, y: np.ndarray) -> np.ndarray:
        """Exact backpropagation for every example at once, shape (k, dim) in the layout [W1; W2].

        delta2 = softmax(s) - onehot(y) (k, K): dL/dW2 = delta2 [h; 1]^T. delta1 = (1 - h^2) * (W2[:, :H]^T delta2)
        (k, H) (tanh' = 1 - tanh^2; the bias column of W2 does not reach h): dL/dW1 = delta1 z^T.
        """
        k, H = Z.shape[0], self.hidden
        W2, Ht, S = self._mlp_forward(params, Z)
        S -= S.max(axis=1, keepdims=True)  # stable softmax
        P = np.exp(S)
        P /= P.sum(axis=1, keepdims=True)
        P[np.arange(k), y] -= 1.0  # delta2
        D1 = (P @ W2[:, :H]) * (1.0 - Ht[:, :H] ** 2)
        G1 = Z.outer(D1)
        G2 = (P[:, :, None] * Ht[:, None, :]).reshape(k, self.num_classes * (H + 1))
        return np.concatenate([G1, G2], axis=1)

    def _moreau(self, params: np.ndarray, Z: np.ndarray | _Biased, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(gradients, envelope values) of each example's Moreau envelope f_beta(th) = min_u f(u) + beta/2 ||th - u||^2.

        grad f_beta(th) = beta (th - prox_{f/beta}(th)) (spec 000 Def 4.5 / Lem 4.6; Beck, First-Order Methods in
        Optimization, 2017, Thm 6.60). The prox is the closed form of each loss, taken over all of R^d rather than
        over Theta as in the spec's Def 4.5: the unconstrained envelope is then L-Lipschitz (its gradient is a
        subgradient of f at the prox) and beta-smooth, needs no knowledge of Theta on the clients, and the clients'
        clipping to clip_norm bounds the sensitivity whatever the envelope.
        """
        beta = self.smoothing
        if self.task == "distance":
            # prox = x + max(0, 1 - 1/(beta r)) (th - x), r = ||th - x|| (spec 000 section 4): the Huber function
            D = params[None, :] - Z
            r = np.linalg.norm(D, axis=1)
            G = D * np.minimum(beta, 1.0 / np.where(r > 0, r, 1.0))[:, None]
            value = np.where(beta * r >= 1.0, r - 0.5 / beta, 0.5 * beta * r * r)
            return G, value
        zz = Z.squared_norms()  # >= 1 (bias coordinate), no division by 0
        u = Z @ params
        if self.task == "hinge":
            # prox moves th along s z by t: t = 1/beta (still violated), (1 - s th.z)/||z||^2 (onto the hinge) or 0
            t = np.clip((1.0 - y * u) / zz, 0.0, 1.0 / beta)
            G = Z.scale_rows(-(beta * t * y))
            value = np.maximum(0.0, 1.0 - y * u - t * zz) + 0.5 * beta * t * t * zz
            return G, value
        # absolute: prox moves th along -z by c = clip(r/||z||^2, -1/beta, 1/beta), r = th.z - y
        r = u - y
        c = np.clip(r / zz, -1.0 / beta, 1.0 / beta)
        G = Z.scale_rows(beta * c)
        value = np.abs(r - c * zz) + 0.5 * beta * c * c * zz
        return G, value

    def gradient(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Mean gradient over the examples (the non-private full-batch gradient)."""
        return self.per_example_gradients(params, X, y).mean(axis=0)

    # ------------------------------------------------------------------------------------------ losses
    def _l2_term(self, params: np.ndarray) -> float:
        return 0.5 * self.l2 * float(params @ params) if self.l2 > 0 else 0.0

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Mean loss over the examples (the original loss, never the smoothed one) plus lambda/2 ||theta||^2."""
        params = self._check(params)
        Z = self._inputs(X)
        y = self._labels(y, Z.shape[0])
        if self.task in CLASSIFIERS:
            s = Z @ params.reshape(self.num_classes, -1).T if self.task == "logreg" else self._mlp_forward(params, Z)[2]
            smax = s.max(axis=1)
            lse = smax + np.log(np.exp(s - smax[:, None]).sum(axis=1))
            per = lse - s[np.arange(Z.shape[0]), y]
        elif self.task == "leastsq":
            r = Z @ params - y
            per = 0.5 * r * r
        elif self.task == "hinge":
            per = np.maximum(0.0, 1.0 - y * (Z @ params))
        elif self.task == "absolute":
            per = np.abs(Z @ params - y)
        else:
            per = np.linalg.norm(params[None, :] - Z, axis=1)
        return float(np.mean(per)) + self._l2_term(params)

    def smoothed_loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Mean Moreau envelope f_beta (beta = smoothing > 0, non-smooth tasks) plus lambda/2 ||theta||^2: the
        function whose gradient per_example_gradients returns when smoothing > 0."""
        if self.smoothing <= 0:
            raise ValueError(f"smoothed_loss needs smoothing > 0, got {self.smoothing}")
        params = self._check(params)
        Z = self._inputs(X)
        y = self._labels(y, Z.shape[0])
        return float(np.mean(self._moreau(params, Z, y)[1])) + self._l2_term(params)

    def accuracy(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """logreg/mlp/hinge: fraction classified correctly (hinge: sign agreement). leastsq/absolute: fraction whose
        rounded prediction equals y (meaningful when y holds integer labels, e.g. 0/1 regression); nan when y is not
        integer-valued. distance: nan."""
        if self.task == "distance":
            return float("nan")
        pred = self.predict(params, X)
        y = np.asarray(y)
        if self.task in ("logreg", "mlp", "hinge"):
            return float(np.mean(pred == y))
        yf = y.astype(np.float64)
        if not np.all(yf == np.round(yf)):
            return float("nan")
        return float(np.mean(np.round(pred) == yf))

    # ------------------------------------------------------------------------------------- constants
    def lipschitz_bound(self, feature_norm_bound: float, radius: float = math.inf) -> float:
        """Lipschitz constant L of one example's loss in theta over inputs with ||x|| <= feature_norm_bound (and
        over theta with ||theta|| <= radius, which only matters for the l2 term: + lambda radius).

        ||z||^2 = ||x||^2 + 1 (bias). logreg: ||(p - e_y) z^T||_F <= sqrt(2) ||z|| since ||p - e_y||^2 =
        (1 - p_y)^2 + sum_{j != y} p_j^2 <= 2 (1 - p_y)^2. leastsq: the residual is unbounded, so inf. hinge,
        absolute: ||z||. distance: 1. A Moreau envelope over R^d keeps the constant L of its loss (its gradient is
        a subgradient at the prox; Beck 2017 Thm 6.60), so smoothing does not change it.

        mlp: ValueError (see _no_convex_constants).
        """
        self._no_convex_constants("lipschitz_bound")
        B = _bound("feature_norm_bound", feature_norm_bound)
        R = _bound("radius", radius)
        zn = math.sqrt(B * B + 1.0)
        base = {"logreg": math.sqrt(2.0) * zn, "leastsq": math.inf, "hinge": zn, "absolute": zn, "distance": 1.0}
        extra = self.l2 * R if self.l2 > 0 else 0.0
        return base[self.task] + extra

    def smoothness(self, feature_norm_bound: float) -> float:
        """Smoothness beta (Lipschitz constant of the gradient) of one example's loss over ||x|| <= the bound.

        logreg: the Hessian is (diag(p) - p p^T) kron z z^T and diag(p) - p p^T <= (1/2)(I - 11^T/K) (Boehning 1992,
        Ann. Inst. Statist. Math. 44), whose largest eigenvalue is 1/2, so beta <= ||z||^2 / 2. leastsq: Hessian
        z z^T, beta = ||z||^2. Non-smooth tasks: inf, or the smoothing parameter beta of the Moreau envelope (spec
        000 Lem 4.6). The l2 term adds lambda.

        mlp: ValueError (see _no_convex_constants).
        """
        self._no_convex_constants("smoothness")
        B = _bound("feature_norm_bound", feature_norm_bound)
        zz = B * B + 1.0
        if self.task == "logreg":
            base = zz / 2.0
        elif self.task == "leastsq":
            base = zz
        else:
            base = self.smoothing if self.smoothing > 0 else math.inf
        return base + self.l2

    def _no_convex_constants(self, what: str) -> None:
        """The constants feed the convex theory's step-size rules (PSGD's eta = D / (L sqrt(T)), AC-SA's smoothness
        step, Thm 4.8's phase diameters). A non-convex loss has no such guarantee whatever the constants: on the
        ball ||theta|| <= R the mlp's gradient norm is finite (it grows with R and hidden), but no theorem turns it
        into a step size. Refused rather than inf so that a caller cannot mistake it for "not smooth, smooth it"."""
        if self.task in NONCONVEX_TASKS:
            raise ValueError(
                f"{what}: task {self.task!r} is non-convex, so the convex theory's step-size rules (spec 000) do not "
                "apply to it and it has no useful global constant; give the learning rate (schedule.learning_rate) "
                "and the clip norm (privacy.clip_norm) explicitly"
            )


def _bound(name: str, v: float) -> float:
    v = float(v)
    if not v >= 0:  # also refuses nan
        raise ValueError(f"{name} must be >= 0, got {v!r}")
    return v


def make_model(
    task: str,
    num_features: int,
    num_classes: int,
    l2: float = 0.0,
    smoothing: float = 0.0,
    *,
    hidden: int = DEFAULT_HIDDEN,
) -> Model:
    """The model of a task; num_classes is ignored (forced to 1) for every task but logreg and mlp, and hidden (the
    mlp's hidden units) is ignored (forced to 0) for every task but mlp."""
    return Model(
        task=task,
        num_features=int(num_features),
        num_classes=int(num_classes) if task in CLASSIFIERS else 1,
        l2=float(l2),
        smoothing=float(smoothing),
        hidden=int(hidden) if task == "mlp" else 0,
    )


@model_factory
def builtin(num_features: int, num_classes: int, *, task: str = "logreg", **options: Any) -> Model:
    """The built-in models as a plug-in factory: [model] module = "shuffledp.models:builtin" with [model.args]
    task = "mlp", hidden = 16 runs the mlp through the plug-in path (the reference the plug-in tests compare with)."""
    return make_model(task, num_features, num_classes, **options)


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
