"""JAX/Flax adapter of the model interface (issue 26 item 2): bring a Flax module and a loss, get per-user gradients.

Needs the optional extra: pip install 'shuffledp[jax]'. Nothing else in shuffledp imports this module: the default
run and the built-in models need no JAX.

The user writes a Flax module (linen, or an nnx constructor ``make(rngs) -> nnx.Module``) mapping a batch of inputs
of shape (k, *input_shape) to outputs (k, num_classes), and a loss ``loss(outputs, labels) -> (k,)`` of per-example
losses; a model factory returns ``FlaxModel(module, loss, ...)`` (see shuffledp/models/examples/cnn.py). The adapter

- flattens the parameter pytree into the flat float64 vector the protocols and optimizers use
  (jax.flatten_util.ravel_pytree; the layout is the pytree's leaves in jax.tree_util order, named by their paths);
- computes per-user gradients with vmap(grad) under jit (per_user = "vmap"; or "scan": jax.lax.map of grad, one
  user after another inside one compiled call, for convolutional networks on CPU, where XLA turns a vmapped
  convolution's weight gradient into a grouped convolution with one group per user that is ~100x slower in float64
  than the loop: measured 18 s against 0.18 s for 128 users of shuffledp/models/examples/flax_models.py's CNN): user i's
  gradient is the gradient of the mean loss over its
  own b examples, so no quantity is shared between users (the sensitivity argument of DP-SGD, Abadi et al. 2016,
  needs each row to depend on one user's data only), then clips each user's gradient in l2 when asked
  (g min(1, C / ||g||), Abadi et al. 2016 eq. (1));
- evaluates loss and accuracy (argmax of the outputs) on held-out data.

Batch normalization across users is refused: a module whose variables hold anything besides parameters (linen
collections other than "params", e.g. "batch_stats"; nnx variables other than nnx.Param) raises ValueError, since
batch statistics would mix users' data (use LayerNorm or GroupNorm, whose statistics are per example).

Arithmetic is float64 (jax_enable_x64 is switched on when this module is imported, for the whole process) so that
the gradients the node randomizes are those of the float64 iterate the analyzer broadcasts. The model is
non-convex as far as the theory is concerned (convex = False): a run must set schedule.learning_rate.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from shuffledp.models import ModelPlugin, clip_l2

jax.config.update("jax_enable_x64", True)  # float64 throughout (see the module docstring)

__all__ = ["FlaxModel", "softmax_cross_entropy", "save_params", "load_params"]

USERS_PER_CALL = 128  # users per jitted call: bounds the activations held at once; the last call is padded


def softmax_cross_entropy(outputs: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy of softmax(outputs) against integer labels: (k, K), (k,) -> (k,)."""
    logp = jax.nn.log_softmax(outputs, axis=-1)
    return -jnp.take_along_axis(logp, labels.astype(jnp.int32)[:, None], axis=-1)[:, 0]


def _source_sha256(obj: Any) -> str:
    """sha256 of an object's source code ("" when it has none, e.g. a builtin): part of the model's definition."""
    try:
        return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()
    except (OSError, TypeError):
        return ""


class FlaxModel(ModelPlugin):
    """A Flax module and a per-example loss as a ModelPlugin (see the module docstring)."""

    def __init__(
        self,
        module: Any,
        loss: Callable[[jax.Array, jax.Array], jax.Array],
        *,
        num_features: int,
        num_classes: int,
        input_shape: Sequence[int] | None = None,
        seed: int = 0,
        users_per_call: int = USERS_PER_CALL,
        per_user: str = "vmap",
    ) -> None:
        self.num_features = int(num_features)
        self.num_classes = int(num_classes)
        self.input_shape = tuple(int(s) for s in (input_shape or (num_features,)))
        if int(np.prod(self.input_shape)) != self.num_features:
            raise ValueError(f"input_shape {self.input_shape} does not hold {self.num_features} features")
        self.module, self.loss_fn, self.seed = module, loss, int(seed)
        self.users_per_call = int(users_per_call)
        if per_user not in ("vmap", "scan"):
            raise ValueError(f'per_user must be "vmap" or "scan", got {per_user!r}')
        self.per_user = per_user
        from flax import linen

        self._linen = isinstance(module, linen.Module)
        if not self._linen and not callable(module):
            raise ValueError("module must be a flax.linen.Module or a constructor make(rngs) -> flax.nnx.Module")
        params, self._apply = self._init(self.seed)
        flat, self._unravel = ravel_pytree(params)
        self._dim = int(flat.size)
        paths = jax.tree_util.tree_flatten_with_path(params)[0]
        self._layout = [
            {"name": "/".join(_key(k) for k in path), "shape": [int(s) for s in leaf.shape]} for path, leaf in paths
        ]
        self._grads = jax.jit(self._user_gradients)
        self._eval = jax.jit(self._outputs)

    # ----- construction ----------------------------------------------------------------------------------------
    def _init(self, seed: int) -> tuple[Any, Callable[[Any, jax.Array], jax.Array]]:
        """(parameter pytree drawn from the public seed, apply(params, x) -> outputs)."""
        x0 = jnp.zeros((1, *self.input_shape), dtype=jnp.float64)
        if self._linen:
            variables = self.module.init(jax.random.PRNGKey(seed), x0)
            extra = sorted(set(variables) - {"params"})
            if extra:
                raise ValueError(
                    f"the module keeps {extra} besides its parameters: batch statistics would mix users' data "
                    "(batch norm across users); use LayerNorm or GroupNorm"
                )
            module = self.module
            return variables["params"], lambda p, x: module.apply({"params": p}, x)
        from flax import nnx

        graphdef, params, rest = nnx.split(self.module(nnx.Rngs(seed)), nnx.Param, ...)
        if jax.tree_util.tree_leaves(rest):
            raise ValueError(
                "the module keeps variables besides nnx.Param (e.g. BatchNorm's batch statistics, which would mix "
                "users' data); use LayerNorm or GroupNorm"
            )
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
        return params, lambda p, x: nnx.merge(graphdef, p, rest)(x)

    # ----- the interface ---------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self._dim

    def init_params(self, seed: int | None = None) -> np.ndarray:
        params = self._init(self.seed if seed is None else int(seed))[0]
        return np.asarray(ravel_pytree(params)[0], dtype=np.float64)

    def _outputs(self, flat: jax.Array, X: jax.Array) -> jax.Array:
        return self._apply(self._unravel(flat), X.reshape(X.shape[0], *self.input_shape))

    def _user_loss(self, flat: jax.Array, X: jax.Array, y: jax.Array) -> jax.Array:
        """Mean loss over one user's b examples X (b, features), y (b,)."""
        return jnp.mean(self.loss_fn(self._outputs(flat, X), y))

    def _user_gradients(self, flat: jax.Array, X: jax.Array, y: jax.Array, clip: jax.Array) -> jax.Array:
        """(n, dim) per-user gradients (grad of each user's mean loss, vmapped or scanned over the users), each
        scaled to l2 norm <= clip when clip > 0 (Abadi et al. 2016 eq. (1))."""
        grad = jax.grad(self._user_loss)
        if self.per_user == "vmap":
            G = jax.vmap(grad, in_axes=(None, 0, 0))(flat, X, y)
        else:  # one user after another in one compiled loop (see the module docstring: convolutions on CPU)
            G = jax.lax.map(lambda xy: grad(flat, xy[0], xy[1]), (X, y))
        norms = jnp.sqrt(jnp.sum(G * G, axis=1))
        scale = jnp.where(clip > 0, jnp.minimum(1.0, clip / jnp.maximum(norms, 1e-300)), 1.0)
        return G * scale[:, None]

    def per_user_gradients(
        self, params: np.ndarray, X: np.ndarray, y: np.ndarray, clip_norm: float | None = None
    ) -> np.ndarray:
        flat = self._check(params)
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y)
        if X.ndim != 3 or X.shape[2] != self.num_features or y.shape != X.shape[:2]:
            raise ValueError(f"X must be (n, b, {self.num_features}) and y (n, b), got {X.shape} and {y.shape}")
        n, c = X.shape[0], self.users_per_call
        clip = jnp.float64(0.0 if clip_norm is None else clip_norm)
        out = np.empty((n, self.dim))
        for a in range(0, n, c):
            Xc, yc = X[a : a + c], y[a : a + c]
            k = Xc.shape[0]
            if k < c and n > c:  # pad the last call to the same shape: one compilation per batch shape
                Xc = np.concatenate([Xc, np.zeros((c - k, *Xc.shape[1:]))])
                yc = np.concatenate([yc, np.zeros((c - k, *yc.shape[1:]), dtype=yc.dtype)])
            out[a : a + k] = np.asarray(self._grads(flat, Xc, yc, clip))[:k]
        if not np.all(np.isfinite(out)):
            raise ValueError("the model's gradients are not finite")
        # the in-jit clip may leave a norm an ulp above C: the same guarantee as the built-in path
        return out if clip_norm is None else clip_l2(out, clip_norm)

    def per_example_gradients(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        return self.per_user_gradients(params, X[:, None, :], np.asarray(y)[:, None])

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        out = self._eval(self._check(params), jnp.asarray(X, dtype=jnp.float64))
        return float(jnp.mean(self.loss_fn(out, jnp.asarray(y))))

    def accuracy(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        out = np.asarray(self._eval(self._check(params), jnp.asarray(X, dtype=jnp.float64)))
        return float(np.mean(np.argmax(out, axis=1) == np.asarray(y)))

    def layout(self) -> list[dict[str, Any]]:
        return [dict(seg) for seg in self._layout]

    def describe(self) -> dict[str, Any]:
        kind = "flax-linen" if self._linen else "flax-nnx"
        definition = type(self.module) if self._linen else self.module
        return {
            "name": getattr(definition, "__qualname__", repr(definition)),
            "kind": kind,
            "module": repr(self.module) if self._linen else "",  # linen's repr lists the module's attributes
            "module_source_sha256": _source_sha256(definition),
            "loss": getattr(self.loss_fn, "__qualname__", repr(self.loss_fn)),
            "loss_source_sha256": _source_sha256(self.loss_fn),
            "input_shape": list(self.input_shape),
            "num_features": self.num_features,
            "num_classes": self.num_classes,
            "seed": self.seed,
        }

    def export(self, params: np.ndarray, directory: Any) -> list[str]:
        """model.msgpack: the parameter pytree in Flax's serialization; load it back with
        flax.serialization.msgpack_restore(open("model.msgpack", "rb").read()) -> {"Conv_0": {"kernel": ...}, ...}."""
        save_params(self, params, os.path.join(directory, "model.msgpack"))
        return ["model.msgpack"]

    def params_tree(self, params: np.ndarray) -> Any:
        """The flat vector as the module's parameter pytree (what module.apply / nnx.update take)."""
        return self._unravel(jnp.asarray(self._check(params)))

    def _check(self, params: np.ndarray) -> np.ndarray:
        params = np.asarray(params, dtype=np.float64)
        if params.shape != (self.dim,):
            raise ValueError(f"params must have shape ({self.dim},), got {params.shape}")
        return params


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def save_params(model: FlaxModel, params: np.ndarray, path: str) -> None:
    """The released flat vector as the module's parameter pytree in Flax's own serialization (msgpack)."""
    from flax import serialization

    with open(path, "wb") as f:
        f.write(serialization.to_bytes(_pure(model.params_tree(params))))


def load_params(model: FlaxModel, path: str) -> Any:
    """The parameter pytree save_params wrote (flax.serialization.from_bytes against the module's own shapes)."""
    from flax import serialization

    with open(path, "rb") as f:
        return serialization.from_bytes(_pure(model.params_tree(model.init_params())), f.read())


def _pure(tree: Any) -> Any:
    """nnx.State as nested dicts of arrays (what nnx.State.replace_by_pure_dict takes back); linen's dict as is."""
    return tree.to_pure_dict() if hasattr(tree, "to_pure_dict") else tree
