"""Benchmark (issue 26 item 4): where one node's round goes for the example CNN (d = 26,698) on mnist5k.

Run: python benchmarks/bench_cnn_round.py [--protocol pvec|tree] [--users 1875] [--repeats 2]

In this process, with the services' own code and no gRPC: the round's spec as the analyzer plans it
(shuffledp.planning.plan_run + round_spec, protocol pvec fully interactive or tree), then for one node of --users
users: the per-user gradients (NodeCore.batch_gradients -> FlaxModel.per_user_gradients, jitted), the protocol's
randomizer on them (pvec: clip, binomial counts, packing; tree: clip and HPKE sealing), the Contribution's wire size
and serialization, and the analyzer's held-out evaluation (loss and accuracy on 1,250 test images). Needs
shuffledp[jax,mnist]. Prints median seconds over --repeats after one warm-up (the jit compilation).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shuffledp.clients.node import NodeCore, UserShard  # noqa: E402
from shuffledp.services.ledger import PrivacyEvent  # noqa: E402

from shuffledp.config import load_config  # noqa: E402
from shuffledp.data import load_dataset, user_shard  # noqa: E402
from shuffledp.models.plugin import build_model, model_identity  # noqa: E402
from shuffledp.planning import plan_run, round_spec  # noqa: E402
from shuffledp.protocols.registry import round_protocol  # noqa: E402
from shuffledp.security import sealing  # noqa: E402
from shuffledp.security.rng import make_rng  # noqa: E402
from shuffledp.v1 import shuffledp_pb2 as pb  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--protocol", choices=["pvec", "tree"], default="pvec")
    ap.add_argument("--users", type=int, default=1875)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    cfg = load_config(EXAMPLES / ("cnn_mnist5k_pgd.toml" if args.protocol == "pvec" else "cnn_mnist5k_ftrl.toml"))
    t0 = time.perf_counter()
    ds = load_dataset(cfg.data)
    model = build_model(cfg.model, ds.num_features, ds.num_classes)
    print(f"model {cfg.model.module}: d = {model.dim}; build {time.perf_counter() - t0:.1f} s")
    n_all = len(ds.y_train)
    plan = plan_run(cfg, n_all, n_all, model, ds.feature_norm_bound)
    proto = round_protocol(plan["protocol"])
    params = proto.params(plan)
    trust = pb.TrustModel.Name(proto.trust_model).lower()
    event = PrivacyEvent(proto.name, proto.event_params(plan, 0), plan["min_contributors"], plan["kind"], trust)
    key = sealing.generate_keypair()[1] if proto.needs_keypair(plan) else b""
    ids, X, y = user_shard(ds, 0, 1, 1, args.users)
    core = NodeCore("bench", UserShard(ids, X, y), rng=make_rng(), model=(model, model_identity(cfg.model, model)))
    idx = np.arange(len(ids))
    theta = model.init_params()
    spec = round_spec("bench", 0, plan, params, event, theta, key)
    times: dict[str, list[float]] = {}
    size = 0
    for r in range(args.repeats + 1):
        t0 = time.perf_counter()
        G = core.batch_gradients(spec, idx)
        t1 = time.perf_counter()
        out = pb.Contribution(run_id="bench", round=0, node_id="bench")
        proto.randomize(spec, G, list(ids), [bytes(16)] * len(ids), make_rng(), out)
        t2 = time.perf_counter()
        wire = out.SerializeToString()
        pb.Contribution.FromString(wire)
        t3 = time.perf_counter()
        model.loss(theta, ds.X_test, ds.y_test), model.accuracy(theta, ds.X_test, ds.y_test)
        t4 = time.perf_counter()
        size = len(wire)
        if r > 0:
            for k, v in (
                ("gradients", t1 - t0),
                ("randomize", t2 - t1),
                ("serialize+parse", t3 - t2),
                ("eval", t4 - t3),
            ):
                times.setdefault(k, []).append(v)
    print(f"protocol {args.protocol}, {len(ids)} users, contribution {size / 2**20:.1f} MiB")
    for k, v in times.items():
        print(f"  {k:16s} {statistics.median(v):8.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
