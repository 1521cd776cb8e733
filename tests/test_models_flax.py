"""Issue 26 item 2: the JAX/Flax adapter's per-user gradients equal a straightforward per-example loop (to 1e-6,
clipping included) for a CNN and for an MLP; batch norm across users is refused. Needs shuffledp[jax] (the test
command installs it: scripts/_venv.sh)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

from shuffledp.models import ModelPlugin  # noqa: E402
from shuffledp.models.examples.flax_models import cnn, mlp  # noqa: E402
from shuffledp.models.flax_adapter import FlaxModel, load_params, softmax_cross_entropy  # noqa: E402
from shuffledp.security.rng import make_rng  # noqa: E402

N_USERS, PER_USER = 5, 3


def _loop_gradients(model: FlaxModel, theta, X, y, clip):
    """The reference: for each user, for each of its examples, jax.grad of that one example's loss on the parameter
    pytree, averaged over the user's examples, flattened, clipped to l2 norm clip in numpy. No vmap, no jit."""
    tree = model.params_tree(theta)
    rows = []
    for i in range(X.shape[0]):
        acc = None
        for j in range(X.shape[1]):
            x = jnp.asarray(X[i, j]).reshape(1, *model.input_shape)

            def one(p, x=x, label=y[i, j]):
                return model.loss_fn(model._apply(p, x), jnp.asarray([label]))[0]

            g = np.asarray(ravel_pytree(jax.grad(one)(tree))[0])
            acc = g if acc is None else acc + g
        g = acc / X.shape[1]
        norm = np.linalg.norm(g)
        rows.append(g * min(1.0, clip / norm) if clip else g)
    return np.stack(rows)


def _data(features: int, classes: int, seed: int):
    rng = make_rng(seed)
    X = rng.uniform(0.0, 1.0, size=(N_USERS, PER_USER, features))
    y = rng.integers(0, classes, size=(N_USERS, PER_USER))
    return X, y


@pytest.mark.parametrize("which", ["cnn", "cnn-vmap", "mlp", "nnx"])
def test_per_user_gradients_equal_a_per_example_loop(which):
    if which.startswith("cnn"):
        # a small CNN over 8x8 images (the example's architecture, narrower); 2 users per jitted call: the padded
        # last call is covered too
        model = cnn(64, 4, channels=[2, 3], hidden=6, image_shape=[8, 8, 1])
        model.users_per_call = 2
        model.per_user = "vmap" if which == "cnn-vmap" else "scan"
        model._grads = jax.jit(model._user_gradients)
    elif which == "mlp":
        model = mlp(6, 3, widths=[5, 4])
    else:

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.a, self.b = nnx.Linear(6, 5, rngs=rngs), nnx.Linear(5, 3, rngs=rngs)

            def __call__(self, x):
                return self.b(jnp.tanh(self.a(x)))

        model = FlaxModel(Net, softmax_cross_entropy, num_features=6, num_classes=3)
    assert isinstance(model, ModelPlugin) and not model.convex
    X, y = _data(model.num_features, model.num_classes, seed=3)
    theta = model.init_params() + 0.05 * make_rng(4).normal(size=model.dim)
    unclipped = _loop_gradients(model, theta, X, y, None)
    np.testing.assert_allclose(model.per_user_gradients(theta, X, y), unclipped, rtol=0, atol=1e-6)
    # clip at the median norm: some users are clipped, some not
    clip = float(np.median(np.linalg.norm(unclipped, axis=1)))
    got = model.per_user_gradients(theta, X, y, clip_norm=clip)
    np.testing.assert_allclose(got, _loop_gradients(model, theta, X, y, clip), rtol=0, atol=1e-6)
    assert np.all(np.linalg.norm(got, axis=1) <= clip * (1 + 1e-12))
    assert np.sum(np.linalg.norm(unclipped, axis=1) > clip) >= 1
    # one example per user: the per-example path
    pe = model.per_example_gradients(theta, X[:, 0], y[:, 0])
    np.testing.assert_allclose(pe, _loop_gradients(model, theta, X[:, :1], y[:, :1], None), rtol=0, atol=1e-6)
    # each user's row depends on that user's data only: changing user 0's examples leaves the others' rows
    X2 = X.copy()
    X2[0] = 1.0 - X2[0]
    np.testing.assert_array_equal(model.per_user_gradients(theta, X2, y)[1:], model.per_user_gradients(theta, X, y)[1:])


def test_layout_seed_and_loss():
    model = cnn(784, 10)
    assert model.dim == sum(int(np.prod(s["shape"])) for s in model.layout())
    assert 10_000 <= model.dim <= 100_000
    assert model.layout()[0]["name"].startswith("Conv_0/")
    np.testing.assert_array_equal(model.init_params(), model.init_params(0))
    assert not np.array_equal(model.init_params(1), model.init_params(0))
    X, y = _data(784, 10, seed=5)
    X, y = X.reshape(-1, 784), y.reshape(-1)
    theta = model.init_params()
    assert model.loss(theta, X, y) == pytest.approx(np.log(10), abs=0.5)
    assert 0.0 <= model.accuracy(theta, X, y) <= 1.0


def test_batch_norm_across_users_is_refused():
    class BN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.BatchNorm(use_running_average=False)(x))

    with pytest.raises(ValueError, match="batch norm across users"):
        FlaxModel(BN(), softmax_cross_entropy, num_features=4, num_classes=3)

    class NnxBN(nnx.Module):
        def __init__(self, rngs):
            self.bn, self.out = nnx.BatchNorm(4, rngs=rngs), nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(self.bn(x))

    with pytest.raises(ValueError, match="BatchNorm"):
        FlaxModel(NnxBN, softmax_cross_entropy, num_features=4, num_classes=3)


def test_export_roundtrip(tmp_path):
    from flax import serialization

    model = mlp(6, 3, widths=[5])
    theta = model.init_params() + 1.0
    assert model.export(theta, tmp_path) == ["model.msgpack"]
    tree = load_params(model, str(tmp_path / "model.msgpack"))
    np.testing.assert_array_equal(np.asarray(ravel_pytree(tree)[0]), theta)
    # docs/how-to/own-model.md's one line: no template needed
    restored = serialization.msgpack_restore(open(tmp_path / "model.msgpack", "rb").read())
    np.testing.assert_array_equal(restored["Dense_0"]["kernel"], np.asarray(tree["Dense_0"]["kernel"]))
    X, _ = _data(6, 3, seed=1)
    out = model.module.apply({"params": tree}, jnp.asarray(X[:, 0]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(model._eval(theta, jnp.asarray(X[:, 0]))))
