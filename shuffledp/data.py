"""Data sets: the embedded default (scikit-learn's digits), loaders from a path, and per-node user shards.

The train/test split is fixed and public and uses no randomness: example i is a test example iff
floor((i+1) f) > floor(i f) (f = test_fraction), i.e. evenly spaced examples, so every party derives the same
split from the same file. The analyzer only ever looks at the test split (to report held-out loss/accuracy); the
training split is cut into users, one example per user by default, and spread over client nodes round-robin.

Digits features are the 8x8 pixel intensities 0..16 divided by 16 (a data-independent scaling: standardizing
with statistics of the training data would itself leak private data).
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shuffledp.config import DataConfig

__all__ = ["Dataset", "load_dataset", "user_shard", "load_csv", "load_npz", "load_libsvm", "load_idx", "split_indices"]


@dataclass(frozen=True)
class Dataset:
    """Features as float64 rows; labels int64 (classification) or float64 (regression)."""

    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    num_classes: int  # distinct labels (classification); 1 for regression targets

    @property
    def num_features(self) -> int:
        return int(self.X_train.shape[1])

    def majority_baseline(self) -> float:
        """Test accuracy of always predicting the most frequent training label."""
        labels, counts = np.unique(self.y_train, return_counts=True)
        return float(np.mean(self.y_test == labels[np.argmax(counts)]))


# ----------------------------------------------------------------------------------------------- loaders
def load_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Comma-separated numbers, label in the last column; one optional header line is skipped."""
    p = Path(path)
    with p.open(encoding="utf-8") as fh:
        first = fh.readline()
    try:
        [float(v) for v in first.strip().split(",")]
        skip = 0
    except ValueError:
        skip = 1  # header line
    arr = np.loadtxt(p, delimiter=",", skiprows=skip, ndmin=2, dtype=np.float64)
    if arr.shape[1] < 2:
        raise ValueError(f"{p}: a CSV needs >= 1 feature column and a label column, got {arr.shape[1]} columns")
    return arr[:, :-1], arr[:, -1]


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """An .npz archive with arrays 'X' (k, features) and 'y' (k,)."""
    with np.load(Path(path), allow_pickle=False) as z:
        if "X" not in z or "y" not in z:
            raise ValueError(f"{path}: an NPZ data file needs arrays 'X' and 'y', found {sorted(z.files)}")
        return np.asarray(z["X"], dtype=np.float64), np.asarray(z["y"])


def load_libsvm(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """LIBSVM / svmlight text format (scikit-learn's reader), densified."""
    from sklearn.datasets import load_svmlight_file

    X, y = load_svmlight_file(str(path))
    return np.asarray(X.todense(), dtype=np.float64), np.asarray(y)


def _read_idx(path: Path) -> np.ndarray:
    raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic)")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ValueError(f"{path}: unknown IDX element type 0x{raw[2]:02x}")
    ndim = raw[3]
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=dtypes[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: IDX header announces shape {shape} but holds {data.size} elements")
    return data.reshape(shape)


def load_idx(images_path: str | Path, labels_path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """MNIST IDX files (optionally .gz): images flattened and scaled by 1/255, labels as integers."""
    images = _read_idx(Path(images_path))
    labels = _read_idx(Path(labels_path))
    if images.shape[0] != labels.shape[0] or labels.ndim != 1:
        raise ValueError(f"IDX images {images.shape} and labels {labels.shape} do not match")
    return images.reshape(images.shape[0], -1).astype(np.float64) / 255.0, labels.astype(np.int64)


_EXT = {".csv": "csv", ".npz": "npz", ".svm": "libsvm", ".libsvm": "libsvm", ".svmlight": "libsvm", ".idx": "idx"}


def _format_of(cfg: DataConfig) -> str:
    if cfg.format:
        return cfg.format
    name = cfg.path.lower().removesuffix(".gz")
    for ext, fmt in _EXT.items():
        if name.endswith(ext):
            return fmt
    if "-idx" in name:  # MNIST's own names: train-images-idx3-ubyte
        return "idx"
    raise ValueError(f"data.format is empty and the extension of data.path={cfg.path!r} is unknown")


# ------------------------------------------------------------------------------------------------ dataset
def split_indices(k: int, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Fixed public split without randomness: evenly spaced test examples (see module docstring)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    i = np.arange(k)
    is_test = np.floor((i + 1) * test_fraction) > np.floor(i * test_fraction)
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def load_dataset(cfg: DataConfig, task: str = "logreg") -> Dataset:
    """Load the configured data set and apply the class subset, the public split and label encoding."""
    if cfg.dataset == "digits":
        from sklearn.datasets import load_digits

        dg = load_digits()
        X, y, name = dg.data / 16.0, dg.target.astype(np.int64), "digits"
    else:
        fmt = _format_of(cfg)
        if not Path(cfg.path).is_file():
            raise ValueError(f"data.path={cfg.path!r} is not a file")
        if fmt == "csv":
            X, y = load_csv(cfg.path)
        elif fmt == "npz":
            X, y = load_npz(cfg.path)
        elif fmt == "libsvm":
            X, y = load_libsvm(cfg.path)
        else:
            if not cfg.labels_path:
                raise ValueError("data.labels_path is required for data.format = 'idx'")
            X, y = load_idx(cfg.path, cfg.labels_path)
        name = Path(cfg.path).name
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"data: X must be (k, features) and y (k,), got {X.shape} and {y.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError("data: features contain NaN or inf")
    if cfg.classes:
        keep = np.isin(y, cfg.classes)
        X, y = X[keep], y[keep]
        # relabel in the order given: classes = [8, 3] makes 8 -> 0 and 3 -> 1
        cls = np.asarray(cfg.classes)
        order = np.argsort(cls)
        y = order[np.searchsorted(cls[order], y)]
    if task == "logreg":
        if not np.all(y == np.floor(y)):
            raise ValueError("data: logreg needs integer class labels")
        values, y = np.unique(y, return_inverse=True)
        num_classes = int(max(len(values), 2))
        y = y.astype(np.int64)
    else:
        y = y.astype(np.float64)
        num_classes = 1
    train, test = split_indices(X.shape[0], cfg.test_fraction)
    return Dataset(name, X[train], y[train], X[test], y[test], num_classes)


def num_users(dataset: Dataset, examples_per_user: int = 1, max_users: int = 0) -> int:
    """Training users: floor(train examples / examples_per_user), capped at max_users when > 0."""
    u = dataset.X_train.shape[0] // examples_per_user
    return min(u, max_users) if max_users > 0 else u


def user_shard(
    dataset: Dataset, node_index: int, num_nodes: int, examples_per_user: int = 1, max_users: int = 0
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The users hosted by one client node: (user ids "n{node}-u{j}", X (u, k, features), y (u, k)).

    User j (j = 0, 1, ...) owns training examples [j k, (j+1) k) with k = examples_per_user and lives on node
    j mod num_nodes, so the nodes partition the users exactly.
    """
    if num_nodes < 1 or not 0 <= node_index < num_nodes:
        raise ValueError(f"node_index must lie in [0, num_nodes={num_nodes}), got {node_index}")
    if examples_per_user < 1:
        raise ValueError(f"examples_per_user must be >= 1, got {examples_per_user}")
    k = examples_per_user
    n = num_users(dataset, k, max_users)
    users = np.arange(node_index, n, num_nodes)
    X = dataset.X_train[: n * k].reshape(n, k, -1)[users]
    y = dataset.y_train[: n * k].reshape(n, k)[users]
    return [f"n{node_index}-u{j}" for j in users], X, y
