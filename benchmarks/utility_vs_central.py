"""Benchmark (issue 16 item 3): shuffle-model PGD over the real services against central DP at equal privacy.

Run: python benchmarks/utility_vs_central.py [--eps 1 4 8] [--seeds 5] [--grid 2 4 8 16] [--rounds 16]
         [--no-check-in] [--quick] [--out /tmp/utility_vs_central]
(--quick: eps 8, one seed, one learning rate, 4 rounds: a smoke test.) The reported run is the default, 3 x 4 x 5 = 60
shuffle runs and as many central ones, about 8 minutes on 2 cores.

Task: scikit-learn's digits, 1348 training users of one example each, multinomial logistic regression (d = 650),
radius 10, the held-out split for accuracy (majority class 0.10). Both methods run the same schedule: T = --rounds
fully interactive rounds of all n users, projected gradient descent with clipping C = 1 (l2) and the released model
mean(theta_0..theta_{T-1}) (paper 000 Alg 5, shuffledp.optimizers.pgd, the same optimizer object for both), at
the same (eps, delta = 1e-5) for the whole run, replace-one adjacency (n public):
- shuffle: `shuffledp` itself, a local cluster (`shuffledp.cli.run.start_local_cluster`: shuffler, analyzer, 2 client
  nodes as OS processes on loopback), privacy.protocol "pvec", transport "counts", calibrated noise (PLD-tight,
  pvec_pld) with the check-in (mechanisms/check_in.py) unless --no-check-in; eps spent is the run's ledger figure.
- central: the Gaussian mechanism in this process: each round the sum of the n clipped gradients plus
  N(0, (C z)^2 I) (l2 sensitivity 2C under replace-one, so z / 2 per unit of sensitivity), divided by n; z is the
  least noise multiplier for which T such rounds meet (eps, delta) exactly: T Gaussian rounds are one Gaussian with
  sqrt(T) times the sensitivity, calibrated by the analytic Gaussian mechanism (Balle & Wang 2018,
  `calibrated_pvec.gaussian_variance`, the baseline of bench_calibrated_pvec), and checked with dp_accounting's PLD
  accountant (T self-composed GaussianDpEvent(z / 2): sensitivity 1 at std z / 2 is the same mechanism). Noise from
  the CSPRNG.
Learning rate: best of --grid per (method, eps) by mean held-out accuracy over the seeds (chosen on the held-out set
for both methods alike, not charged to the budget). Seeds: repetitions differ by the CSPRNG draws only.

Printed: one line per run, then the table eps x method (accuracy mean +- std, best learning rate, eps spent) and
the gap shuffle - central per eps (issue 16's acceptance at eps = 1: within 2 points). Written: OUT/utility.json
and OUT/utility.png (accuracy against eps).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ftrl_vs_sgd import DEPLOYMENT, POLICY, run_line, run_one  # noqa: E402 (one way to drive and show a run)

from shuffledp.cli.run import start_local_cluster  # noqa: E402
from shuffledp.config import parse_config  # noqa: E402
from shuffledp.data import load_dataset  # noqa: E402
from shuffledp.mechanisms.pvec import clip_rows  # noqa: E402
from shuffledp.models import make_model  # noqa: E402
from shuffledp.optimizers.pgd import pgd  # noqa: E402
from shuffledp.security.rng import make_rng  # noqa: E402

DELTA, CLIP, RADIUS = 1e-5, 1.0, 10.0
TASK = f'[data]\ndataset = "digits"\n[model]\ntask = "logreg"\nradius = {RADIUS}\n'
MAJORITY = 0.10


def shuffle_config(eps: float, lr: float, rounds: int, check_in: bool) -> str:
    privacy = f"[privacy]\neps = {eps}\ndelta = {DELTA}\nclip_norm = {CLIP}\n"
    privacy += f"[privacy.pvec]\ncheck_in = {str(check_in).lower()}\n"
    schedule = f'[schedule]\nkind = "fully_interactive"\nrounds = {rounds}\nlearning_rate = {lr}\noutput = "mean"\n'
    return TASK + DEPLOYMENT + POLICY + privacy + schedule + '[transport]\nmode = "counts"\n'


def central_noise_multiplier(eps: float, delta: float, rounds: int) -> tuple[float, float]:
    """(z, eps by dp_accounting's PLD at z): noise std over C of the central mechanism (sensitivity 2C), the least
    for T rounds within (eps, delta) by the analytic Gaussian mechanism, and its check."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from shuffledp.accountants.calibrated_pvec import gaussian_variance

    z = float(np.sqrt(gaussian_variance(eps, delta, CLIP, rounds, method="exact"))) / CLIP
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z / 2.0), rounds))
    return z, float(acc.get_epsilon(delta))


class Central:
    """Central-DP PGD on the digits users in this process (module docstring)."""

    def __init__(self) -> None:
        ds = load_dataset(parse_config(TASK).data, "logreg")
        self.model = make_model("logreg", ds.num_features, ds.num_classes)
        self.X, self.y = ds.X_train.reshape(len(ds.y_train), -1), ds.y_train
        self.X_test, self.y_test = ds.X_test, ds.y_test

    def run(self, eps: float, lr: float, rounds: int) -> dict:
        t0 = time.monotonic()
        z, eps_pld = central_noise_multiplier(eps, DELTA, rounds)
        rng = make_rng()  # the CSPRNG; seeds are repetitions
        opt = pgd(lr, RADIUS)
        state = opt.init(self.model.init_params())
        n = len(self.y)
        for _ in range(rounds):
            theta = opt.query(state)
            g = clip_rows(self.model.per_example_gradients(theta, self.X, self.y), CLIP).sum(axis=0)
            g += rng.normal(0.0, CLIP * z, size=g.shape)  # std z C for sensitivity 2C (z/2 per unit sensitivity)
            _, state = opt.step(g / n, state, theta)
        out = opt.release(state, "mean")
        return {
            "accuracy": float(self.model.accuracy(out, self.X_test, self.y_test)),
            "eps_spent": eps_pld,  # dp_accounting's figure for the noise used (pessimistic PLD: a hair above eps)
            "noise_multiplier": z,
            "completed": True,
            "state": "COMPLETED",
            "seconds": time.monotonic() - t0,
        }


def summarize(rows: list[dict], methods: list[str], eps_values: list[float]) -> list[dict]:
    table = []
    for method in methods:
        for eps in eps_values:
            by_lr: dict[float, list[dict]] = {}
            for r in rows:
                if (r["method"], r["eps"]) == (method, eps):
                    by_lr.setdefault(r["lr"], []).append(r)
            if not by_lr:
                continue

            def mean_acc(runs: list[dict]) -> float:
                return float(np.mean([r["accuracy"] if r["completed"] else 0.0 for r in runs]))

            lr, runs = max(by_lr.items(), key=lambda kv: mean_acc(kv[1]))
            accs = [r["accuracy"] if r["completed"] else 0.0 for r in runs]
            table.append(
                {
                    "method": method,
                    "eps": eps,
                    "lr": lr,
                    "accuracy": float(np.mean(accs)),
                    "accuracy_std": float(np.std(accs)),
                    "eps_spent": float(np.mean([r["eps_spent"] for r in runs])),
                    "seeds": len(runs),
                    "grid": {str(k): mean_acc(v) for k, v in sorted(by_lr.items())},
                    "failed": sum(not r["completed"] for r in runs),
                }
            )
    return table


def plot(path: Path, table: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method in ("shuffle", "central"):
        rows = sorted((r for r in table if r["method"] == method), key=lambda r: r["eps"])
        ax.errorbar(
            [r["eps"] for r in rows],
            [r["accuracy"] for r in rows],
            yerr=[r["accuracy_std"] for r in rows],
            marker="o",
            capsize=3,
            label=method,
        )
    ax.axhline(MAJORITY, color="grey", lw=0.8, ls=":", label="majority class")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("eps (delta = 1e-5, whole run)")
    ax.set_ylabel("held-out accuracy (best lr, mean of seeds)")
    ax.set_title("digits: shuffle-model PGD vs central DP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--grid", type=float, nargs="+", default=[2.0, 4.0, 8.0, 16.0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--no-check-in", action="store_true", help="shuffle runs without the check-in (for comparison)")
    ap.add_argument("--quick", action="store_true", help="smoke test: eps 8, one seed, lr 8, 4 rounds")
    ap.add_argument("--out", type=Path, default=Path("/tmp/utility_vs_central"))
    args = ap.parse_args(argv)
    if args.quick:
        args.eps, args.seeds, args.grid, args.rounds = [8.0], 1, [8.0], 4
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    central = Central()
    rows: list[dict] = []
    print(f"digits, n = {len(central.y)} users, T = {args.rounds}, delta = {DELTA}, C = {CLIP}")
    print(f"{'method':>8} {'eps':>4} {'lr':>6} {'seed':>4} {'accuracy':>8} {'eps spent':>9} {'s':>6}  state")

    def show(row: dict) -> None:
        rows.append(row)
        print(run_line(row, 8), flush=True)

    with tempfile.TemporaryDirectory(prefix="utility-vs-central-") as tmp:
        work = Path(tmp)
        (work / "config.toml").write_text(TASK + DEPLOYMENT + POLICY)  # the nodes read [data] and [policy]
        cluster, _, analyzer = start_local_cluster(work / "config.toml", work, 2)
        try:
            for eps in args.eps:
                for lr in args.grid:
                    for seed in range(args.seeds):
                        row = {"method": "shuffle", "eps": eps, "lr": lr, "seed": seed}
                        row.update(run_one(analyzer, shuffle_config(eps, lr, args.rounds, not args.no_check_in)))
                        show(row)
                        show(
                            {"method": "central", "eps": eps, "lr": lr, "seed": seed}
                            | central.run(eps, lr, args.rounds)
                        )
        finally:
            cluster.stop()
    table = summarize(rows, ["shuffle", "central"], args.eps)
    print(f"\nheld-out accuracy, best of grid {args.grid} per method and eps (mean +- std of {args.seeds} seeds)")
    print(f"{'eps':>4} {'method':>8} {'accuracy':>13} {'lr':>5} {'eps spent':>9}  grid (lr: accuracy)")
    for r in sorted(table, key=lambda r: (r["eps"], r["method"] != "shuffle")):
        grid = ", ".join(f"{k}: {v:.3f}" for k, v in r["grid"].items())
        print(
            f"{r['eps']:>4g} {r['method']:>8} {r['accuracy']:>7.3f}±{r['accuracy_std']:.3f} {r['lr']:>5g} "
            f"{r['eps_spent']:>9.4f}  {grid}" + (f"  ({r['failed']} failed)" if r["failed"] else "")
        )
    gaps = {}
    for eps in args.eps:
        cell = {r["method"]: r for r in table if r["eps"] == eps}
        if {"shuffle", "central"} <= cell.keys():
            gaps[eps] = cell["shuffle"]["accuracy"] - cell["central"]["accuracy"]
            spent = cell["shuffle"]["eps_spent"] / eps
            print(
                f"eps = {eps:g}: shuffle - central = {100 * gaps[eps]:+.1f} points; shuffle spent {spent:.4f} "
                "of its eps"
            )
    total = time.monotonic() - started
    print(f"total time {total:.0f} s for {len(rows)} runs")
    doc = {
        "command": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)],
        "settings": {
            "eps": args.eps,
            "delta": DELTA,
            "clip_norm": CLIP,
            "rounds": args.rounds,
            "seeds": args.seeds,
            "grid": args.grid,
            "check_in": not args.no_check_in,
        },
        "runs": rows,
        "table": table,
        "gap_shuffle_minus_central": {str(k): v for k, v in gaps.items()},
        "total_seconds": total,
    }
    (args.out / "utility.json").write_text(json.dumps(doc, indent=2))
    plot(args.out / "utility.png", table)
    print(f"wrote {args.out / 'utility.json'} and {args.out / 'utility.png'}")
    return 0 if all(r["completed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
