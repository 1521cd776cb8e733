"""A planned run computed in one process with the services' own modules (test helper, fixed seeds).

The same plan (shuffledp.planning.plan_run), the same RoundSpec (round_spec), the same protocol plug-in (randomize on
the client side, decode on the analyzer side), the same optimizer (planning.planned_optimizer): only the transport is
replaced by summing the users' count vectors here, which is what the shuffler forwards in count mode. The cohort
order stands in for the shuffler's secret selection. Randomness from make_rng(seed) (a fixed test seed).
"""

from __future__ import annotations

import numpy as np
from _intercept import count_total
from shuffledp.services.ledger import PrivacyEvent

from shuffledp.config import parse_config
from shuffledp.data import excess_risk, load_dataset, num_users
from shuffledp.models import make_model
from shuffledp.planning import plan_run, round_spec
from shuffledp.planning import planned_optimizer as _optimizer
from shuffledp.protocols.registry import round_protocol
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb


def simulate_run(config_toml: str, seed: int) -> tuple[float, dict]:
    """(excess risk of the released model, plan) of one count-mode run of the configuration."""
    cfg = parse_config(config_toml)
    ds = load_dataset(cfg.data, cfg.model.task)
    model = make_model(cfg.model.task, ds.num_features, ds.num_classes, l2=cfg.model.l2)
    n = num_users(ds)
    plan = plan_run(cfg, n, n, model, ds.feature_norm_bound)
    protocol = round_protocol(plan["protocol"])
    params, opt = protocol.params(plan), _optimizer(plan)
    users = make_model(cfg.model.task, ds.num_features, ds.num_classes, l2=plan["l2"], smoothing=plan["smoothing"])
    rng = make_rng(seed)
    order = rng.permutation(n)
    B = plan["cohort"]
    event = PrivacyEvent(protocol.name, plan["params"], plan["min_contributors"], plan["kind"])
    state = opt.init(model.init_params())
    for r in range(plan["rounds"]):
        idx = order[r * B : (r + 1) * B] if plan["kind"] == "sequential" else np.arange(n)
        theta = opt.query(state)
        spec = round_spec("sim", r, plan, params, event, theta)
        out = pb.Contribution()
        G = users.per_example_gradients(theta, ds.X_train[idx], ds.y_train[idx])
        protocol.randomize(spec, G, [str(i) for i in idx], [b""] * idx.size, rng, out)
        totals = count_total(out)
        decoded = protocol.decode(pb.ShuffledBatch(label_totals=totals.tolist()), idx.size, plan, params, None, b"")
        _, state = opt.step(decoded.total / decoded.used, state, theta)
    return excess_risk(model, opt.release(state, plan["output"]), ds), plan
