"""Benchmark (issue 11): excess risk against n for PSGD, AC-SA and PGD over the real services.

Run: python benchmarks/excess_risk.py [--ns 1000 10000 100000] [--eps 1 4] [--reps 1] [--dim 20] [--out DIR]

Problem: `[data] dataset = "synthetic"`, binary logistic regression with `dim` features (||x|| <= 1) whose labels
follow a logistic model, so the population optimum is known and every run reports its excess risk (held-out loss of
the released model minus the optimum's, on 20,000 held-out examples). For each n one local cluster runs
(`shuffledp.cli.run.start_local_cluster`: shuffler, analyzer and 2 client nodes as separate OS processes on loopback),
and every (optimizer, eps, repetition) is one run on it, driven through the operator API as `shuffledp run` does:
PSGD (Alg 3) and AC-SA (Alg 4) sequential with their theory cohorts (Thm 4.1, Thm 4.3) and step sizes, PGD (Alg 5)
fully interactive with 16 rounds; PVEC count mode, calibrated accounting, delta = 1/n.

Printed: one row per run (rounds, cohort, excess risk, eps spent, wall seconds), then per optimizer and eps the
mean excess risk per n and the fitted log-log slope, next to the slope of the rate of spec 000 sec 4 / sec 9
(PSGD d^{1/4}/sqrt(eps n): -1/2; AC-SA d^{2/5}/(eps n)^{4/5}: -4/5; PGD sqrt(d)/(eps n): -1; every rate also has
the statistical term DL/sqrt(n), slope -1/2, which dominates at large n). Written: OUT/excess_risk.csv and
OUT/excess_risk.png (log-log, one panel per eps).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from shuffledp.cli.run import drive_run, start_local_cluster

OPTIMIZERS = {  # schedule keys of each method; PGD's 16 rounds are the embedded default's
    "psgd": 'kind = "sequential"\noptimizer = "psgd"\n',
    "acsa": 'kind = "sequential"\noptimizer = "acsa"\n',
    "pgd": 'kind = "fully_interactive"\noptimizer = "pgd"\nrounds = 16\n',
}
THEORY_SLOPE = {"psgd": -0.5, "acsa": -0.8, "pgd": -1.0}  # spec 000 sec 9 (privacy term)


def base_config(n: int, dim: int, seed: int) -> str:
    return (
        f'[data]\ndataset = "synthetic"\nn = {n}\ndim = {dim}\nnoise = 1.0\nseed = {seed}\n'
        '[model]\ntask = "logreg"\nradius = 4.0\n'
        "[deployment]\nclient_nodes = 2\nround_deadline_seconds = 120\n"
        # generous users: the benchmark runs many runs on the same users
        "[policy]\nmax_eps_per_round = 64\nmax_total_eps = 1e6\nmax_delta_per_round = 0.5\nmax_total_delta = 1.0\n"
    )


def run_one(analyzer: str, base: str, opt: str, eps: float) -> dict:
    toml = base + f"[privacy]\neps = {eps}\n[schedule]\n{OPTIMIZERS[opt]}"
    t0 = time.monotonic()
    result = drive_run(analyzer, toml, echo=lambda *_: None)
    status = result.status
    if not result.HasField("excess_risk"):
        raise RuntimeError(f"{opt} eps={eps}: no excess risk reported (state {status.state}: {status.message})")
    return {
        "optimizer": opt,
        "eps": eps,
        "rounds": status.rounds_done,
        "excess_risk": result.excess_risk,
        "eps_spent": status.budget.eps_spent,
        "seconds": time.monotonic() - t0,
    }


def slope(ns: list[int], risks: list[float]) -> float:
    x, y = np.log(np.asarray(ns, float)), np.log(np.maximum(np.asarray(risks, float), 1e-12))
    return float(np.polyfit(x, y, 1)[0]) if len(ns) > 1 else math.nan


def plot(path: Path, rows: list[dict], eps_values: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(eps_values), figsize=(5 * len(eps_values), 4), squeeze=False)
    for ax, eps in zip(axes[0], eps_values, strict=True):
        for opt in OPTIMIZERS:
            pts = sorted({r["n"] for r in rows if r["optimizer"] == opt and r["eps"] == eps})
            means = [
                np.mean([r["excess_risk"] for r in rows if (r["optimizer"], r["eps"], r["n"]) == (opt, eps, n)])
                for n in pts
            ]
            ax.loglog(pts, np.maximum(means, 1e-6), "o-", label=opt)
        ax.set_title(f"eps = {eps:g}")
        ax.set_xlabel("n (users)")
        ax.set_ylabel("excess risk")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dim", type=int, default=20)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, default=Path("results") / "excess_risk")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    print(f"{'n':>7} {'eps':>4} {'optimizer':>9} {'rounds':>6} {'excess risk':>12} {'eps spent':>9} {'s':>6}")
    for n in args.ns:
        base = base_config(n, args.dim, args.seed)
        with tempfile.TemporaryDirectory(prefix="excess-risk-") as tmp:
            work = Path(tmp)
            (work / "config.toml").write_text(base)
            cluster, _, analyzer = start_local_cluster(work / "config.toml", work, 2)
            try:
                for eps in args.eps:
                    for opt in args.optimizers:
                        for _ in range(args.reps):
                            row = {"n": n, **run_one(analyzer, base, opt, eps)}
                            rows.append(row)
                            print(
                                f"{n:>7} {eps:>4g} {opt:>9} {row['rounds']:>6} {row['excess_risk']:>12.5f} "
                                f"{row['eps_spent']:>9.4f} {row['seconds']:>6.1f}",
                                flush=True,
                            )
            finally:
                cluster.stop()
    with open(args.out / "excess_risk.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("\nmean excess risk by n, fitted log-log slope (theory: privacy term of spec 000 sec 9)")
    for eps in args.eps:
        for opt in args.optimizers:
            means = [
                float(np.mean([r["excess_risk"] for r in rows if (r["optimizer"], r["eps"], r["n"]) == (opt, eps, n)]))
                for n in args.ns
            ]
            cells = "  ".join(f"n={n}: {m:.5f}" for n, m in zip(args.ns, means, strict=True))
            fit = slope(args.ns, means)
            print(f"eps={eps:g} {opt:>5}: {cells}  slope {fit:+.2f} (theory {THEORY_SLOPE[opt]:+.2f})")
    try:
        plot(args.out / "excess_risk.png", rows, args.eps)
    except Exception as exc:  # the CSV is written already
        print(f"warning: plot not written: {exc}", file=sys.stderr)
    print(f"written: {args.out / 'excess_risk.csv'}, {args.out / 'excess_risk.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
