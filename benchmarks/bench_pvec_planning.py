"""Benchmark (issue 24 B8, C14): how long planning the embedded default run takes at small eps, and what the
`shuffledp account` queries cost against dp_accounting on the same question.

Run: python benchmarks/bench_pvec_planning.py [--eps 8 0.3 0.1 0.073 0.01] [--skip-account]

Planning: each eps in a fresh interpreter (no warm cache), `plan_run` on the embedded default (digits, PGD over
calibrated PVEC, 1348 users, d = 650, 16 rounds); prints the wall time and m, or the refusal (eps below
pvec_pld.smallest_plannable_eps). Account: wall time of `shuffledp account ...` subprocesses (imports included)
beside the same question put to dp_accounting directly.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

PLAN = """
import time
from shuffledp.config import DEFAULT_TOML, parse_config
from shuffledp.data import load_dataset
from shuffledp.models import make_model
from shuffledp.planning import PlanError, plan_run
cfg = parse_config(DEFAULT_TOML.replace("eps = 8.0", "eps = {eps}"))
ds = load_dataset(cfg.data, cfg.model.task)
model = make_model("logreg", ds.num_features, ds.num_classes)
t = time.perf_counter()
try:
    plan = plan_run(cfg, 1348, 1348, model, ds.feature_norm_bound)
    what = f"m = {{plan['params']['m']}}"
except PlanError as exc:
    what = "refused: " + str(exc).rsplit("; ", 1)[-1]
print(f"{{time.perf_counter() - t:.2f}}", what)
"""

ACCOUNT = [
    ("--help", ["--help"], None),
    (
        "poisson gaussian eps",
        ["gaussian", "--noise-multiplier", "1.1", "--sampling-probability", "0.01", "--rounds", "1000",
         "--delta", "1e-5"],
        "from dp_accounting import dp_event as e, pld\n"
        "a = pld.PLDAccountant(); a.compose(e.PoissonSampledDpEvent(0.01, e.GaussianDpEvent(1.1)), 1000)\n"
        "print(a.get_epsilon(1e-5))",
    ),
    (
        "least noise for eps 1",
        [
            "gaussian", "--sampling-probability", "0.01", "--rounds", "1000", "--eps", "1", "--delta", "1e-5",
            "--min-noise",
        ],
        "from dp_accounting import dp_event as e, pld, mechanism_calibration as mc\n"
        "f = lambda z: e.SelfComposedDpEvent(e.PoissonSampledDpEvent(0.01, e.GaussianDpEvent(z)), 1000)\n"
        "print(mc.calibrate_dp_mechanism(pld.PLDAccountant, f, 1.0, 1e-5, mc.LowerEndpointAndGuess(0.1, 1.0)))",
    ),
]  # fmt: skip


def _timed(argv: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    out = (proc.stdout.strip().splitlines() or [proc.stderr.strip()])[-1]
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", type=float, nargs="+", default=[8.0, 0.3, 0.1, 0.073, 0.01])
    ap.add_argument("--skip-account", action="store_true")
    args = ap.parse_args()
    for eps in args.eps:
        _, out = _timed([sys.executable, "-c", PLAN.format(eps=eps)])
        print(f"plan eps={eps:<6g} {out}")
    if args.skip_account:
        return
    for name, argv, reference in ACCOUNT:
        t_cli, out = _timed([sys.executable, "-m", "shuffledp.cli", "account", *argv])
        line = f"account {name:<22} shuffledp {t_cli:6.2f} s"
        if reference is not None:
            t_ref, ref = _timed([sys.executable, "-c", reference])
            line += f"   dp_accounting {t_ref:6.2f} s   ratio {t_cli / t_ref:5.1f}   ({out.strip()} | {ref})"
        print(line)


if __name__ == "__main__":
    main()
