"""The Flower half of benchmarks/compare_flower.py: shuffledp's embedded default task on Flower's simulation engine.

Run by the comparison venv's python (the one with flwr[simulation]), never by the product's, and without importing
shuffledp (it is not installed there), so the data split is reproduced here and checked by the caller:

    .venv-compare/bin/python benchmarks/_flower_task.py --clients 100 --rounds 10 [--lr 8 --radius 10 --clip 1]

Task (the same as `shuffledp run` with model.task = "logreg", one example per user, fully interactive PGD):
scikit-learn's digits, pixels / 16, the public split of shuffledp.data.split_indices (example i is a test example
iff floor((i+1) f) > floor(i f), f = 0.25), user j = training example j for j < --clients. Multinomial logistic
regression, W of shape (10, 65) flattened row-major, bias last (shuffledp.models' layout), theta_0 = 0.
Each round every client (one virtual SuperNode per user) computes the cross-entropy gradient of its one example at
the server's model, clips it to l2 norm --clip and returns one local SGD step theta - lr g; the server's FedAvg
(fraction_train 1.0, min nodes = --clients, every node weighted by its 1 example) averages them, which is
theta - lr mean(g), and projects onto the l2 ball of --radius: the noiseless update of shuffledp's PGD.

Printed on stdout (the caller parses these lines; everything else is Flower's and Ray's log):
    FLOWER_DATA <sha256 of the users' examples>           before the simulation starts
    FLOWER_MARK <name> <unix time>                        program start, ServerApp main entered, before round 1
    FLOWER_ROUND <t> <T> <unix time> <accuracy> <loss>    when round t's aggregate is done (server-side, flushed)
    FLOWER_RESULT <json>                                  final figures of the released model
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

NUM_CLASSES = 10
NUM_FEATURES = 64
DIM = NUM_CLASSES * (NUM_FEATURES + 1)  # 650, shuffledp's logreg dim on digits


def load_digits_split(test_fraction: float = 0.25) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, y_train, X_test, y_test) exactly as shuffledp.data.load_dataset builds them for digits."""
    spec = importlib.util.find_spec("sklearn")  # read the file scikit-learn ships, like shuffledp (no sklearn import)
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is not None and path.is_file():
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",")
        X, y = table[:, :-1], table[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_digits

        X, y = load_digits(return_X_y=True)
        y = y.astype(np.int64)
    X = X / 16.0
    _, y = np.unique(y, return_inverse=True)  # labels 0..9 already; kept for parity with shuffledp
    i = np.arange(X.shape[0])
    is_test = np.floor((i + 1) * test_fraction) > np.floor(i * test_fraction)
    return X[~is_test], y[~is_test].astype(np.int64), X[is_test], y[is_test].astype(np.int64)


def fingerprint(X: np.ndarray, y: np.ndarray) -> str:
    """sha256 over the users' features (float64) and labels (int64): the caller compares it with shuffledp's."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(X, dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(y, dtype=np.int64).tobytes())
    return h.hexdigest()


def clipped_gradient(theta: np.ndarray, x: np.ndarray, label: int, clip: float) -> np.ndarray:
    """Cross-entropy gradient (softmax(W z) - onehot(y)) z^T at theta for one example, scaled to l2 norm <= clip."""
    z = np.append(x, 1.0)
    s = theta.reshape(NUM_CLASSES, NUM_FEATURES + 1) @ z
    p = np.exp(s - s.max())
    p /= p.sum()
    p[label] -= 1.0
    g = np.outer(p, z).ravel()
    norm = float(np.linalg.norm(g))
    return g * (clip / norm) if norm > clip else g


def project(theta: np.ndarray, radius: float) -> np.ndarray:
    norm = float(np.linalg.norm(theta))
    return theta * (radius / norm) if norm > radius else theta


def loss_accuracy(theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    Z = np.concatenate([X, np.ones((X.shape[0], 1))], axis=1)
    S = Z @ theta.reshape(NUM_CLASSES, NUM_FEATURES + 1).T
    S -= S.max(axis=1, keepdims=True)
    logp = S - np.log(np.exp(S).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean()), float(np.mean(np.argmax(S, axis=1) == y))


# ------------------------------------------------------------------------------------------------ Flower apps
# Defined at import time of this module (not of __main__) so that Ray pickles them by reference and every actor
# imports this module once and keeps its data cache between the messages it runs.

_TRAIN: dict[float, tuple[np.ndarray, np.ndarray]] = {}  # per actor process: test_fraction -> training split

client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One user: the clipped gradient of its one example at the server's model, as one local SGD step."""
    config = msg.content["config"]
    fraction = float(config["test-fraction"])
    if fraction not in _TRAIN:
        _TRAIN[fraction] = load_digits_split(fraction)[:2]
    X, y = _TRAIN[fraction]
    user = int(context.node_config["partition-id"])  # virtual SuperNode j hosts user j
    theta = msg.content["arrays"].to_numpy_ndarrays()[0]
    g = clipped_gradient(theta, X[user], int(y[user]), float(config["clip"]))
    reply = RecordDict(
        {
            "arrays": ArrayRecord([theta - float(config["lr"]) * g]),
            "metrics": MetricRecord({"num-examples": 1}),  # FedAvg weight: every user counts once
        }
    )
    return Message(content=reply, reply_to=msg)


class ProjectedFedAvg(FedAvg):
    """FedAvg followed by the projection onto the l2 ball of shuffledp's model.radius (its PGD projects too)."""

    def __init__(self, radius: float, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.radius = radius

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            arrays = ArrayRecord([project(arrays.to_numpy_ndarrays()[0], self.radius)])
        return arrays, metrics


def build_server_app(args: argparse.Namespace) -> ServerApp:
    _, _, X_test, y_test = load_digits_split(args.test_fraction)
    server_app = ServerApp()
    iterates: list[np.ndarray] = []  # theta_0..theta_{T-1}: shuffledp releases their mean (schedule.output)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        theta = arrays.to_numpy_ndarrays()[0]
        if server_round < args.rounds:
            iterates.append(theta)
        loss, acc = loss_accuracy(theta, X_test, y_test)
        if server_round == 0:  # called once before round 1 as well
            mark("before-round-1")
        else:
            print(f"FLOWER_ROUND {server_round} {args.rounds} {time.time():.6f} {acc:.6f} {loss:.6f}", flush=True)
        return MetricRecord({"accuracy": acc, "loss": loss})

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        mark("server-main")
        strategy = ProjectedFedAvg(
            radius=args.radius,
            fraction_train=1.0,
            fraction_evaluate=0.0,  # no federated evaluation: shuffledp's analyzer evaluates on the public split
            min_train_nodes=args.clients,
            min_available_nodes=args.clients,
        )
        config = ConfigRecord({"lr": args.lr, "clip": args.clip, "test-fraction": args.test_fraction})
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord([np.zeros(DIM)]),
            num_rounds=args.rounds,
            train_config=config,
            evaluate_fn=evaluate,
        )
        released = np.mean(iterates, axis=0)
        loss, acc = loss_accuracy(released, X_test, y_test)
        print("FLOWER_RESULT " + json.dumps({"accuracy": acc, "loss": loss, "rounds": args.rounds}), flush=True)

    return server_app


def mark(name: str) -> None:
    """A time stamp for the caller's split of the start-up."""
    print(f"FLOWER_MARK {name} {time.time():.6f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    mark("program")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, required=True, help="users = virtual SuperNodes, all in every round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--lr", type=float, default=8.0)
    p.add_argument("--radius", type=float, default=10.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--test-fraction", type=float, default=0.25)
    p.add_argument("--client-cpus", type=float, default=1.0, help="Ray num_cpus per ClientApp actor")
    args = p.parse_args(argv)

    X, y, _, _ = load_digits_split(args.test_fraction)
    if args.clients > X.shape[0]:
        sys.exit(f"--clients {args.clients} > {X.shape[0]} training examples")
    print(f"FLOWER_DATA {fingerprint(X[: args.clients], y[: args.clients])}", flush=True)

    from flwr.simulation import run_simulation

    run_simulation(
        server_app=build_server_app(args),
        client_app=client_app,
        num_supernodes=args.clients,
        backend_config={"client_resources": {"num_cpus": args.client_cpus, "num_gpus": 0.0}},
    )


if __name__ == "__main__":
    # run the module's own objects (import by name), not __main__'s copies: see the comment above client_app
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _flower_task

    _flower_task.main()
