"""Models (gradients vs finite differences, projection) and data (digits, loaders, split, shards)."""

import gzip
import struct

import numpy as np
import pytest

from shuffledp.config import DataConfig
from shuffledp.data import load_dataset, split_indices, user_shard
from shuffledp.models import make_model, project_l2_ball
from shuffledp.security.rng import make_rng


def _numeric_grad(model, params, X, y, h=1e-6):
    g = np.zeros_like(params)
    for i in range(params.size):  # tiny test problem: a loop over coordinates is fine here
        e = np.zeros_like(params)
        e[i] = h
        g[i] = (model.loss(params + e, X, y) - model.loss(params - e, X, y)) / (2 * h)
    return g


@pytest.mark.parametrize("task, classes", [("logreg", 3), ("leastsq", 1)])
def test_gradients_match_finite_differences(task, classes):
    rng = make_rng(1)
    model = make_model(task, 4, classes)
    X = rng.normal(size=(7, 4))
    y = rng.integers(0, classes, size=7) if task == "logreg" else rng.normal(size=7)
    params = rng.normal(size=model.dim)
    per = model.per_example_gradients(params, X, y)
    assert per.shape == (7, model.dim)
    # tolerance: central differences with h=1e-6 are accurate to ~1e-8 on these smooth losses
    np.testing.assert_allclose(per.mean(axis=0), _numeric_grad(model, params, X, y), atol=1e-6)
    np.testing.assert_allclose(model.gradient(params, X[:1], y[:1]), per[0])


def test_logreg_shapes_accuracy_and_errors():
    model = make_model("logreg", 2, 2)
    assert model.dim == 6 and np.all(model.init_params() == 0)
    X = np.array([[1.0, 0.0], [0.0, 1.0]])
    W = np.array([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0]]).ravel()  # class 0 iff x0 > x1
    assert model.accuracy(W, X, np.array([0, 1])) == 1.0
    assert model.accuracy(W, X, np.array([1, 0])) == 0.0
    assert np.isclose(model.loss(np.zeros(6), X, np.array([0, 1])), np.log(2))
    with pytest.raises(ValueError, match="params"):
        model.loss(np.zeros(5), X, np.array([0, 1]))
    with pytest.raises(ValueError, match="labels"):
        model.loss(W, X, np.array([0, 2]))


def test_projection_onto_ball():
    rng = make_rng(2)
    for _ in range(50):
        v = rng.normal(size=10) * rng.uniform(0.1, 100)
        p = project_l2_ball(v, 3.0)
        assert np.linalg.norm(p) <= 3.0
        if np.linalg.norm(v) <= 3.0:
            assert np.array_equal(p, v)
        else:  # the projection of an outside point is on the sphere, in the same direction
            assert np.isclose(np.linalg.norm(p), 3.0) and np.isclose(p @ v, np.linalg.norm(p) * np.linalg.norm(v))
    with pytest.raises(ValueError, match="radius"):
        project_l2_ball(np.ones(3), 0.0)


def test_digits_default_split_and_shards():
    ds = load_dataset(DataConfig())
    assert ds.num_features == 64 and ds.num_classes == 10
    assert ds.X_train.shape[0] + ds.X_test.shape[0] == 1797
    assert abs(ds.X_test.shape[0] - 0.25 * 1797) <= 1
    assert ds.X_train.min() >= 0 and ds.X_train.max() <= 1
    assert set(np.unique(ds.y_test)) == set(range(10))
    # the split is deterministic and public: loading twice gives the same arrays
    assert np.array_equal(load_dataset(DataConfig()).X_test, ds.X_test)
    shards = [user_shard(ds, i, 3) for i in range(3)]
    ids = [u for s in shards for u in s[0]]
    assert len(ids) == len(set(ids)) == ds.X_train.shape[0]
    assert all(u.startswith(f"n{i}-u") for i, s in enumerate(shards) for u in s[0])
    X1 = np.concatenate([s[1] for s in shards])
    assert X1.shape[1:] == (1, 64)
    # every training example belongs to exactly one user
    assert np.isclose(X1.sum(), ds.X_train.sum())
    ids2, X2, y2 = user_shard(ds, 1, 2, examples_per_user=3, max_users=10)
    assert len(ids2) == 5 and X2.shape == (5, 3, 64) and y2.shape == (5, 3)
    with pytest.raises(ValueError, match="node_index"):
        user_shard(ds, 2, 2)


def test_digits_reader_equals_scikit_learns_loader():
    # data.load_digits reads scikit-learn's file without importing scikit-learn (start-up time); same arrays
    from sklearn.datasets import load_digits as sk_load_digits

    from shuffledp.data import load_digits

    X, y = load_digits()
    X_ref, y_ref = sk_load_digits(return_X_y=True)
    assert X.dtype == np.float64 and y.dtype == np.int64
    np.testing.assert_array_equal(X, X_ref)
    np.testing.assert_array_equal(y, y_ref)


def test_class_subset_relabels_in_given_order():
    ds = load_dataset(DataConfig(classes=(8, 3)))
    assert ds.num_classes == 2
    full = load_dataset(DataConfig())
    n8 = int(np.sum(full.y_train == 8) + np.sum(full.y_test == 8))
    assert int(np.sum(ds.y_train == 0) + np.sum(ds.y_test == 0)) == n8


def test_split_indices_evenly_spaced():
    tr, te = split_indices(100, 0.25)
    assert len(te) == 25 and len(tr) == 75 and set(tr) | set(te) == set(range(100))
    assert np.all(np.diff(te) == 4)


def _write_idx(path, arr, code):
    header = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + arr.astype(">u1").tobytes())


def test_loaders_csv_npz_libsvm_idx(tmp_path):
    rng = make_rng(3)
    X = np.round(rng.uniform(size=(20, 3)), 4)
    y = np.arange(20) % 2
    (tmp_path / "d.csv").write_text(
        "a,b,c,label\n" + "\n".join(",".join(map(str, [*r, t])) for r, t in zip(X, y, strict=True))
    )
    np.savez(tmp_path / "d.npz", X=X, y=y)
    with open(tmp_path / "d.svm", "w") as fh:
        for r, t in zip(X, y, strict=True):
            fh.write(f"{t} " + " ".join(f"{j + 1}:{v}" for j, v in enumerate(r)) + "\n")
    for name in ("d.csv", "d.npz", "d.svm"):
        ds = load_dataset(DataConfig(dataset="path", path=str(tmp_path / name), test_fraction=0.25))
        np.testing.assert_allclose(np.concatenate([ds.X_train, ds.X_test]).sum(), X.sum(), rtol=1e-12)
        assert ds.X_train.shape == (15, 3) and ds.num_classes == 2
    imgs = rng.integers(0, 256, size=(12, 2, 2))
    _write_idx(tmp_path / "im-idx3-ubyte.gz", imgs, 0x08)
    _write_idx(tmp_path / "lb-idx1-ubyte.gz", np.arange(12) % 3, 0x08)
    ds = load_dataset(
        DataConfig(
            dataset="path", path=str(tmp_path / "im-idx3-ubyte.gz"), labels_path=str(tmp_path / "lb-idx1-ubyte.gz")
        )
    )
    assert ds.num_features == 4 and ds.num_classes == 3 and ds.X_train.max() <= 1.0
    np.savez(tmp_path / "bad.npz", A=X)
    with pytest.raises(ValueError, match="'X' and 'y'"):
        load_dataset(DataConfig(dataset="path", path=str(tmp_path / "bad.npz")))
    ds = load_dataset(DataConfig(dataset="path", path=str(tmp_path / "d.npz")), task="leastsq")
    assert ds.num_classes == 1 and ds.y_train.dtype == np.float64
