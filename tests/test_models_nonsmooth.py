"""Non-smooth tasks (hinge, absolute, distance), Moreau smoothing (spec 000 Def 4.5 / Lem 4.6), the l2 term and the
Lipschitz / smoothness constants of shuffledp.models."""

import math

import numpy as np
import pytest
from scipy.optimize import minimize

from shuffledp.models import NONSMOOTH_TASKS, SMOOTH_TASKS, TASKS, Model, make_model
from shuffledp.security.rng import make_rng

BETAS = (0.3, 2.0, 10.0, 300.0)


def _problem(task, seed, k=40, f=3, scale=1.0):
    """Random examples and a parameter vector; scale spreads the margins/residuals so that every branch of each
    closed-form prox (clip at 0, at 1/beta, in between) is hit across the betas."""
    rng = make_rng(seed)
    model = make_model(task, f, 1)
    X = rng.normal(size=(k, f)) * scale
    if task == "hinge":
        y = rng.integers(0, 2, size=k)
    elif task == "absolute":
        y = rng.normal(size=k) * 2.0
    else:
        y = np.zeros(k)
    params = rng.normal(size=model.dim)
    return model, X, y, params


def _fd(fun, params, h=1e-6):
    g = np.zeros_like(params)
    for i in range(params.size):  # tiny problems: a loop over coordinates is fine
        e = np.zeros_like(params)
        e[i] = h
        g[i] = (fun(params + e) - fun(params - e)) / (2 * h)
    return g


def _replace(model, **kw):
    import dataclasses

    return dataclasses.replace(model, **kw)


def test_tasks_shapes_and_flags():
    assert TASKS == SMOOTH_TASKS + NONSMOOTH_TASKS
    assert make_model("hinge", 4, 7).dim == 5 and make_model("hinge", 4, 7).num_classes == 1
    assert make_model("absolute", 4, 1).dim == 5
    assert make_model("distance", 4, 1).dim == 4  # no bias
    assert [make_model(t, 3, 3).smooth for t in TASKS] == [True, True, False, False, False]
    # the old call keeps working and the new fields default to off
    m = make_model("logreg", 3, 3)
    assert m.l2 == 0.0 and m.smoothing == 0.0


def test_hinge_labels_accuracy_and_loss():
    model = make_model("hinge", 2, 2)
    X = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
    w = np.array([1.0, -1.0, 0.0])  # predicts 1 iff x0 > x1
    y = np.array([1, 0, 1])
    assert model.accuracy(w, X, y) == 1.0 and model.accuracy(w, X, 1 - y) == 0.0
    # margins s w.z = 1, 1, 2 -> hinge losses 0, 0, 0; with flipped labels 2, 2, 3
    assert model.loss(w, X, y) == 0.0 and np.isclose(model.loss(w, X, 1 - y), 7.0 / 3.0)
    with pytest.raises(ValueError, match="hinge labels"):
        model.loss(w, X, np.array([1, -1, 1]))


def test_absolute_and_distance_loss_values():
    X = np.array([[1.0, 2.0], [0.0, -1.0]])
    ab = make_model("absolute", 2, 1)
    assert np.isclose(ab.loss(np.array([1.0, 0.0, 0.5]), X, np.array([0.0, 1.0])), (1.5 + 0.5) / 2)
    assert ab.accuracy(np.array([1.0, 0.0, 0.0]), X, np.array([1.0, 0.0])) == 1.0
    di = make_model("distance", 2, 1)
    th = np.array([1.0, 2.0])
    assert np.isclose(di.loss(th, X, np.array([7.0, -3.0])), (0.0 + np.hypot(1.0, 3.0)) / 2)  # labels ignored
    assert math.isnan(di.accuracy(th, X, np.zeros(2)))


@pytest.mark.parametrize("task", NONSMOOTH_TASKS)
def test_subgradients_match_finite_differences_at_generic_points(task):
    # away from kinks (probability 1 for continuous random data) the loss is differentiable and the subgradient
    # returned must be its gradient
    model, X, y, params = _problem(task, 11)
    per = model.per_example_gradients(params, X, y)
    assert per.shape == (X.shape[0], model.dim)
    np.testing.assert_allclose(per.mean(axis=0), _fd(lambda p: model.loss(p, X, y), params), atol=1e-6)


@pytest.mark.parametrize("task", NONSMOOTH_TASKS)
@pytest.mark.parametrize("beta", BETAS)
def test_moreau_gradients_match_finite_differences_of_the_envelope(task, beta):
    model, X, y, params = _problem(task, 12, scale=1.5)
    model = _replace(model, smoothing=beta)
    per = model.per_example_gradients(params, X, y)
    for i in range(X.shape[0]):  # each example on its own: a mean could hide compensating errors
        xi, yi = X[i : i + 1], y[i : i + 1]
        fd = _fd(lambda p, xi=xi, yi=yi: model.smoothed_loss(p, xi, yi), params)
        # f_beta is C^1 with a beta-Lipschitz gradient: central differences err by <= beta h ~ 3e-4 at beta = 300
        np.testing.assert_allclose(per[i], fd, atol=1e-6 + beta * 2e-6, err_msg=f"example {i}")


@pytest.mark.parametrize("task", NONSMOOTH_TASKS)
@pytest.mark.parametrize("beta", (0.5, 3.0, 40.0))
def test_moreau_envelope_and_prox_against_a_brute_force_minimization(task, beta):
    # f_beta(th) = min_u f(u) + beta/2 ||th - u||^2 solved numerically (Nelder-Mead on 3 coordinates); the closed
    # form must reach the same minimum, and its gradient must equal beta (th - u*) (spec 000 Lem 4.6)
    model, X, y, params = _problem(task, 13, k=6, f=3 if task == "distance" else 2, scale=1.5)
    model = _replace(model, smoothing=beta)
    per = model.per_example_gradients(params, X, y)
    plain = _replace(model, smoothing=0.0)
    for i in range(X.shape[0]):
        xi, yi = X[i : i + 1], y[i : i + 1]

        def objective(u, xi=xi, yi=yi):
            return plain.loss(u, xi, yi) + 0.5 * beta * float((params - u) @ (params - u))

        best = min(
            (
                minimize(
                    objective, start, method="Nelder-Mead", options={"xatol": 1e-11, "fatol": 1e-13, "maxiter": 20000}
                )
                for start in (params, params - per[i] / beta)
            ),
            key=lambda r: r.fun,
        )
        closed = model.smoothed_loss(params, xi, yi)
        assert closed <= best.fun + 1e-9, (i, closed, best.fun)  # the closed form is a true minimum ...
        assert best.fun <= closed + 1e-7, (i, closed, best.fun)  # ... and the brute force finds it too
        np.testing.assert_allclose(per[i], beta * (params - best.x), atol=1e-4 * max(1.0, beta))


@pytest.mark.parametrize("task", NONSMOOTH_TASKS)
@pytest.mark.parametrize("beta", BETAS)
def test_envelope_sandwich_and_lipschitz_gradients(task, beta):
    # Lem 4.6: f_beta <= f <= f_beta + L^2 / (2 beta), per example; and ||grad|| <= L (the unconstrained envelope
    # keeps the Lipschitz constant of f)
    model, X, y, _ = _problem(task, 14, k=200, scale=0.6)
    sm = _replace(model, smoothing=beta)
    B = float(np.max(np.linalg.norm(X, axis=1)))
    L_each = np.ones(X.shape[0]) if task == "distance" else np.sqrt(np.einsum("ij,ij->i", X, X) + 1.0)  # 1 or ||z||
    rng = make_rng(15)
    for _ in range(5):
        params = rng.normal(size=model.dim) * rng.uniform(0.1, 3.0)
        for i in range(X.shape[0]):
            f = model.loss(params, X[i : i + 1], y[i : i + 1])
            fb = sm.smoothed_loss(params, X[i : i + 1], y[i : i + 1])
            assert fb <= f + 1e-12 and f <= fb + L_each[i] ** 2 / (2 * beta) + 1e-12, (i, f, fb)
        L = sm.lipschitz_bound(B)
        assert np.all(np.linalg.norm(sm.per_example_gradients(params, X, y), axis=1) <= L * (1 + 1e-12))
        assert np.all(np.linalg.norm(model.per_example_gradients(params, X, y), axis=1) <= L * (1 + 1e-12))
    # the gap is attained far from the kink: there the envelope is exactly f - L_i^2/(2 beta) (hinge/absolute: the
    # prox moves by 1/beta along z; distance: r - 1/(2 beta)), so the sandwich's upper bound is tight
    for i in range(5):
        z = np.append(X[i], 1.0)
        far = {"hinge": -(2 * y[i] - 1) * 1e3 * z, "absolute": 1e3 * z, "distance": X[i] + 1e3}[task]
        gap = model.loss(far, X[i : i + 1], y[i : i + 1]) - sm.smoothed_loss(far, X[i : i + 1], y[i : i + 1])
        assert np.isclose(gap, L_each[i] ** 2 / (2 * beta), rtol=1e-9), (i, gap)


@pytest.mark.parametrize("task", NONSMOOTH_TASKS)
def test_large_beta_recovers_the_subgradient_and_small_beta_shrinks_it(task):
    model, X, y, params = _problem(task, 16)
    sub = model.per_example_gradients(params, X, y)
    np.testing.assert_allclose(_replace(model, smoothing=1e9).per_example_gradients(params, X, y), sub, atol=1e-6)
    tiny = _replace(model, smoothing=1e-9).per_example_gradients(params, X, y)
    assert np.max(np.abs(tiny)) < 1e-6  # the envelope of a tiny beta is nearly flat


@pytest.mark.parametrize(
    "task, smoothing", [(t, 0.0) for t in TASKS] + [(t, 5.0) for t in NONSMOOTH_TASKS]
)  # smoothing is for non-smooth tasks only
def test_l2_adds_lambda_theta(task, smoothing):
    rng = make_rng(17)
    classes = 3 if task == "logreg" else 1
    base = make_model(task, 3, classes, smoothing=smoothing)
    reg = make_model(task, 3, classes, l2=0.7, smoothing=smoothing)
    X = rng.normal(size=(9, 3))
    y = rng.integers(0, 2, size=9) if task in ("logreg", "hinge") else rng.normal(size=9)
    params = rng.normal(size=base.dim)
    np.testing.assert_allclose(
        reg.per_example_gradients(params, X, y), base.per_example_gradients(params, X, y) + 0.7 * params, atol=1e-14
    )
    assert np.isclose(reg.loss(params, X, y), base.loss(params, X, y) + 0.35 * params @ params)
    fun = reg.smoothed_loss if smoothing else reg.loss
    np.testing.assert_allclose(reg.gradient(params, X, y), _fd(lambda p: fun(p, X, y), params), atol=1e-6)


def test_smoothing_and_l2_validation():
    with pytest.raises(ValueError, match=r"smoothing.*non-smooth.*'logreg' is smooth"):
        make_model("logreg", 3, 3, smoothing=1.0)
    with pytest.raises(ValueError, match="leastsq"):
        Model("leastsq", 3, smoothing=0.5)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="l2"):
            make_model("hinge", 3, 1, l2=bad)
        with pytest.raises(ValueError, match="smoothing"):
            make_model("hinge", 3, 1, smoothing=bad)
    with pytest.raises(ValueError, match="smoothed_loss"):
        make_model("hinge", 3, 1).smoothed_loss(np.zeros(4), np.zeros((1, 3)), np.zeros(1))
    with pytest.raises(ValueError, match="num_classes"):
        Model("distance", 3, num_classes=2)


def test_lipschitz_and_smoothness_constants():
    B = 3.0  # ||z||^2 = 10
    zn = math.sqrt(10.0)
    assert np.isclose(make_model("logreg", 2, 4).lipschitz_bound(B), math.sqrt(2) * zn)
    assert make_model("leastsq", 2, 1).lipschitz_bound(B) == math.inf
    assert np.isclose(make_model("hinge", 2, 1).lipschitz_bound(B), zn)
    assert np.isclose(make_model("absolute", 2, 1, smoothing=4.0).lipschitz_bound(B), zn)
    assert make_model("distance", 2, 1).lipschitz_bound(B) == 1.0
    assert make_model("hinge", 2, 1, l2=0.5).lipschitz_bound(B) == math.inf  # unbounded theta
    assert np.isclose(make_model("hinge", 2, 1, l2=0.5).lipschitz_bound(B, radius=4.0), zn + 2.0)
    assert np.isclose(make_model("logreg", 2, 4).smoothness(B), 5.0)
    assert np.isclose(make_model("leastsq", 2, 1, l2=0.25).smoothness(B), 10.25)
    assert make_model("hinge", 2, 1).smoothness(B) == math.inf
    assert make_model("distance", 2, 1, smoothing=7.0, l2=1.0).smoothness(B) == 8.0
    with pytest.raises(ValueError, match="feature_norm_bound"):
        make_model("hinge", 2, 1).smoothness(-1.0)


@pytest.mark.parametrize("task", TASKS)
def test_gradients_respect_the_stated_constants(task):
    # ||grad(a) - grad(b)|| <= smoothness ||a - b|| and ||grad|| <= L per example, over ||x|| <= B
    rng = make_rng(18)
    B = 1.5
    classes = 4 if task == "logreg" else 1
    model = make_model(task, 3, classes, smoothing=2.5 if task in NONSMOOTH_TASKS else 0.0)
    X = rng.normal(size=(300, 3))
    X *= (B * rng.uniform(0, 1, size=300) / np.linalg.norm(X, axis=1))[:, None]
    y = rng.integers(0, classes if task == "logreg" else 2, size=300).astype(float)
    L, beta = model.lipschitz_bound(B), model.smoothness(B)
    worst_ratio = 0.0
    for _ in range(20):
        a, b = rng.normal(size=model.dim) * 2, rng.normal(size=model.dim) * 2
        b = a + (b - a) * rng.uniform(1e-3, 1)
        ga, gb = model.per_example_gradients(a, X, y), model.per_example_gradients(b, X, y)
        assert np.all(np.linalg.norm(ga, axis=1) <= L * (1 + 1e-12))
        ratio = np.max(np.linalg.norm(ga - gb, axis=1)) / np.linalg.norm(a - b)
        worst_ratio = max(worst_ratio, ratio)
    assert worst_ratio <= beta * (1 + 1e-9)


def test_the_inputs_with_their_bias_coordinate_act_as_the_concatenated_matrix():
    """models._Biased (Z = [X, 1] read from X, no copy: issue 30) gives what the explicit matrix gives, to rounding."""
    from shuffledp.models.builtin import _Biased

    rng = make_rng(12)
    X = rng.normal(size=(50, 7))
    Z = np.concatenate([X, np.ones((50, 1))], axis=1)
    B = _Biased(X)
    w, W, r, P = rng.normal(size=8), rng.normal(size=(8, 3)), rng.normal(size=50), rng.normal(size=(50, 3))
    assert B.shape == Z.shape
    assert np.allclose(B @ w, Z @ w, rtol=1e-13, atol=1e-13)
    assert np.allclose(B @ W, Z @ W, rtol=1e-13, atol=1e-13)
    assert np.array_equal(B.scale_rows(r), r[:, None] * Z)
    assert np.array_equal(B.outer(P), (P[:, :, None] * Z[:, None, :]).reshape(50, 24))
    assert np.allclose(B.squared_norms(), np.einsum("ij,ij->i", Z, Z), rtol=1e-14)
