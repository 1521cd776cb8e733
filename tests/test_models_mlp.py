"""The non-convex task "mlp" of shuffledp.models (issue 12 item 6): one tanh hidden layer, softmax output, a flat
parameter vector [W1; W2]. Exact backpropagation against finite differences, the layout, theta_0, training on a
problem no linear model can fit, and the refusal of the convex theory's constants and of Moreau smoothing."""

import math

import numpy as np
import pytest

from shuffledp.models import ALL_TASKS, DEFAULT_HIDDEN, NONCONVEX_TASKS, TASKS, Model, make_model
from shuffledp.security.rng import make_rng


def _fd_per_example(model, params, X, y, h=1e-5):
    """Central differences of each example's loss, shape (k, dim) (tiny problems: loops are fine here)."""
    out = np.zeros((X.shape[0], params.size))
    for i in range(X.shape[0]):
        xi, yi = X[i : i + 1], y[i : i + 1]
        for j in range(params.size):
            e = np.zeros_like(params)
            e[j] = h
            out[i, j] = (model.loss(params + e, xi, yi) - model.loss(params - e, xi, yi)) / (2 * h)
    return out


def _problem(seed, k=6, f=3, classes=3, hidden=4, l2=0.0):
    rng = make_rng(seed)
    model = make_model("mlp", f, classes, l2=l2, hidden=hidden)
    X = rng.normal(size=(k, f))
    y = rng.integers(0, classes, size=k)
    params = rng.normal(size=model.dim)  # generic point: hidden units far from 0 and from each other
    return model, X, y, params


def _xor(rng, n, std=0.35):
    """Four Gaussian blobs at (+-1, +-1); class 1 = the blobs where x0 x1 < 0. No line classifies more than about 3
    of the 4 blobs correctly, so every linear model stays near 75% at best (GD on cross-entropy: ~50%)."""
    c = rng.integers(0, 4, size=n)
    centers = np.array([[1.0, 1.0], [-1.0, -1.0], [1.0, -1.0], [-1.0, 1.0]])
    return centers[c] + std * rng.normal(size=(n, 2)), (c >= 2).astype(np.int64)


def test_task_lists_shapes_and_defaults():
    assert NONCONVEX_TASKS == ("mlp",) and ALL_TASKS == TASKS + NONCONVEX_TASKS and "mlp" not in TASKS
    m = make_model("mlp", 4, 3, hidden=5)
    assert m.dim == 5 * (4 + 1) + 3 * (5 + 1) == 43
    assert m.hidden == 5 and m.num_classes == 3 and m.smooth and not m.convex
    assert make_model("mlp", 64, 10).hidden == DEFAULT_HIDDEN == 32
    assert make_model("mlp", 64, 10).dim == 32 * 65 + 10 * 33
    # existing calls are unaffected: hidden is forced to 0 for the other tasks, whose dim is unchanged
    for task in TASKS:
        other = make_model(task, 4, 3, hidden=7)
        assert other.hidden == 0 and other == make_model(task, 4, 3) and other.convex
    assert make_model("logreg", 4, 3).dim == 15
    X = make_rng(1).normal(size=(5, 4))
    params = m.init_params()
    assert m.per_example_gradients(params, X, np.zeros(5, dtype=int)).shape == (5, 43)
    assert m.gradient(params, X, np.zeros(5, dtype=int)).shape == (43,)
    assert m.predict(params, X).shape == (5,)
    assert m.per_example_gradients(params, X[:0], np.zeros(0, dtype=int)).shape == (0, 43)


def test_layout_matches_a_direct_forward_pass():
    model, X, y, params = _problem(2, k=9, f=3, classes=4, hidden=5)
    W1 = params[: 5 * 4].reshape(5, 4)  # (hidden, features + 1), bias last
    W2 = params[5 * 4 :].reshape(4, 6)  # (classes, hidden + 1), bias last
    h = np.tanh(X @ W1[:, :3].T + W1[:, 3])
    s = h @ W2[:, :5].T + W2[:, 5]
    np.testing.assert_array_equal(model.predict(params, X), np.argmax(s, axis=1))
    logp = s - s.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    assert np.isclose(model.loss(params, X, y), -np.mean(logp[np.arange(9), y]), rtol=1e-13)
    assert model.accuracy(params, X, y) == np.mean(np.argmax(s, axis=1) == y)


@pytest.mark.parametrize("l2", [0.0, 0.3])
def test_per_example_gradients_match_finite_differences(l2):
    model, X, y, params = _problem(3, l2=l2)
    per = model.per_example_gradients(params, X, y)
    fd = _fd_per_example(model, params, X, y)
    for i in range(X.shape[0]):  # each example on its own: a mean could hide compensating errors
        # central differences at h = 1e-5 err by ~h^2 |f'''| + eps |f| / h ~ 1e-10 here; 1e-6 relative is loose
        err = np.linalg.norm(per[i] - fd[i]) / np.linalg.norm(fd[i])
        assert err < 1e-6, (i, err)
    # at theta_0 as well (biases 0, small weights), where the network is nearly linear
    theta0 = model.init_params()
    per0, fd0 = model.per_example_gradients(theta0, X, y), _fd_per_example(model, theta0, X, y)
    assert np.max(np.linalg.norm(per0 - fd0, axis=1) / np.linalg.norm(fd0, axis=1)) < 1e-6


def test_gradient_is_the_mean_of_per_example_gradients_and_l2_adds_lambda_theta():
    model, X, y, params = _problem(4, k=50, f=5, classes=3, hidden=6)
    per = model.per_example_gradients(params, X, y)
    np.testing.assert_allclose(model.gradient(params, X, y), per.mean(axis=0), rtol=1e-14, atol=1e-15)
    reg = make_model("mlp", 5, 3, l2=0.7, hidden=6)
    np.testing.assert_allclose(reg.per_example_gradients(params, X, y), per + 0.7 * params, atol=1e-14)
    assert np.isclose(reg.loss(params, X, y), model.loss(params, X, y) + 0.35 * params @ params, rtol=1e-13)


def test_init_is_deterministic_public_nonzero_and_glorot_scaled():
    model = make_model("mlp", 6, 3, hidden=8)
    a = model.init_params()
    np.random.seed(123)  # the global numpy state plays no part
    b = make_model("mlp", 6, 3, hidden=8).init_params()
    np.testing.assert_array_equal(a, b)
    W1, W2 = a[: 8 * 7].reshape(8, 7), a[8 * 7 :].reshape(3, 9)
    assert np.all(W1[:, 6] == 0) and np.all(W2[:, 8] == 0)  # biases start at 0
    assert np.all(W1[:, :6] != 0) and np.all(W2[:, :8] != 0)  # weights do not: the symmetry is broken
    assert np.max(np.abs(W1)) <= math.sqrt(6 / (6 + 8)) and np.max(np.abs(W2)) <= math.sqrt(6 / (8 + 3))
    assert len(np.unique(np.round(W1[:, :6], 12), axis=0)) == 8  # distinct hidden units
    # the convex tasks keep theta_0 = 0
    assert not np.any(make_model("logreg", 6, 3).init_params())
    # gradient at theta_0 is non-zero for every hidden unit (at 0 it would vanish for all of W1)
    X, y = make_rng(5).normal(size=(20, 6)), np.arange(20) % 3
    g1 = model.gradient(a, X, y)[: 8 * 7].reshape(8, 7)
    assert np.all(np.linalg.norm(g1, axis=1) > 0)
    zero_g1 = model.gradient(np.zeros(model.dim), X, y)[: 8 * 7]
    assert not np.any(zero_g1)  # why theta_0 = 0 would not do


def test_mlp_fits_xor_where_the_linear_softmax_model_cannot():
    rng = make_rng(6)
    X_train, y_train = _xor(rng, 400)
    X_test, y_test = _xor(rng, 1000)
    acc = {}
    for task in ("logreg", "mlp"):
        model = make_model(task, 2, 2, hidden=8)
        theta = model.init_params()
        for _ in range(500):  # plain full-batch gradient descent, same step for both
            theta = theta - 0.5 * model.gradient(theta, X_train, y_train)
        acc[task] = model.accuracy(theta, X_test, y_test)
    # measured (seed 6): logreg ~0.5, mlp ~0.99; a linear rule cannot pass ~0.75 on these four blobs
    assert acc["logreg"] <= 0.8, acc
    assert acc["mlp"] >= 0.95, acc
    assert acc["mlp"] - acc["logreg"] >= 0.25, acc


def test_convex_constants_and_smoothing_are_refused():
    model = make_model("mlp", 3, 2, hidden=4)
    for method in (model.lipschitz_bound, model.smoothness):
        with pytest.raises(ValueError, match=r"non-convex.*step-size rules.*learning rate"):
            method(1.0)
    with pytest.raises(ValueError, match=r"smoothing.*'mlp' is non-convex"):
        make_model("mlp", 3, 2, smoothing=1.0)
    with pytest.raises(ValueError, match="smoothed_loss"):
        model.smoothed_loss(model.init_params(), np.zeros((1, 3)), np.zeros(1, dtype=int))


def test_validation():
    with pytest.raises(ValueError, match="hidden must be >= 1 for mlp"):
        Model("mlp", 3, num_classes=2)  # the dataclass default hidden = 0 is for the linear tasks
    with pytest.raises(ValueError, match="hidden must be >= 1"):
        make_model("mlp", 3, 2, hidden=0)
    with pytest.raises(ValueError, match="hidden must be 0 for logreg"):
        Model("logreg", 3, num_classes=2, hidden=4)
    with pytest.raises(ValueError, match="hidden must be an integer"):
        Model("mlp", 3, num_classes=2, hidden=2.5)
    with pytest.raises(ValueError, match="num_classes must be >= 2 for mlp"):
        make_model("mlp", 3, 1)
    with pytest.raises(ValueError, match="task must be one of"):
        make_model("cnn", 3, 2)
    model = make_model("mlp", 2, 3, hidden=4)
    X = np.zeros((2, 2))
    with pytest.raises(ValueError, match="mlp labels must lie in"):
        model.loss(model.init_params(), X, np.array([0, 3]))
    with pytest.raises(ValueError, match="mlp labels must be integers"):
        model.per_example_gradients(model.init_params(), X, np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="params"):
        model.loss(np.zeros(model.dim - 1), X, np.array([0, 1]))
