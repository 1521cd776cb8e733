"""Benchmark (issue 13): seed 001's comparison on our services. CLDP-SGD over the subsampled shuffle.

Run: python benchmarks/cldp_sgd.py [--part accountants|services|both] [--eps 1 2 4 8] [--rounds 20] [--out DIR]

Part A, accountants only (spec 001 sec 6 defaults: n = 60000, k in {1000, 10000}, eps0 in {1, 2}, delta = 1e-5):
eps after T rounds by the paper's Thm 1 (as printed), Thm 1 tightened (envelope and pure-DP cap), the tight
accountant the ledger charges (FMT20's clone dominating pair composed as a PLD) and the FMT20 baseline (numeric
FMT20 + subsampling + KOV15, the paper's comparison); then the most rounds that fit eps in {1, 4} by the tight
accountant and by the baseline, and their ratio (spec 001's claim: several times more rounds).

Part B, over the real services (`shuffledp.cli.run.start_local_cluster`: shuffler, analyzer and 2 client nodes as OS
processes on loopback): held-out accuracy of CLDP-SGD on scikit-learn's digits (1348 users, multinomial logistic
regression, d = 650) against the total eps, for R_inf and PrivUnit, k = 1000 reports per round, `--rounds` rounds,
eps0 unset (the largest for which the rounds fit eps, delta = 1e-5). Majority class: 0.091.

Written: OUT/cldp_accountants.csv, OUT/cldp_accuracy.csv, OUT/cldp_sgd.png.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

from shuffledp.accountants import ledger_accounting as la
from shuffledp.accountants.events import LdpShuffleRound
from shuffledp.cli.run import drive_run, start_local_cluster

N, DELTA = 60000, 1e-5
BOUNDS = {"thm1": "upper", "thm1_tightened": "upper-tightened", "tight": "tight-pld", "fmt_baseline": "baseline"}
LR = {"privunit": 4.0, "r_inf": 0.5}  # tuned by hand on digits at eps = 4 (one run each)


def accountants(out: Path) -> list[dict]:
    rows = []
    print(f"{'k':>6} {'eps0':>4} {'T':>6}  " + "  ".join(f"{b:>15}" for b in BOUNDS))
    for k in (1000, 10000):
        for eps0 in (1.0, 2.0):
            ev = LdpShuffleRound("generic", eps0, N, k)
            for T in (10, 100, 1000, 10000):
                row = {"k": k, "eps0": eps0, "T": T}
                for name, bound in BOUNDS.items():
                    row[name] = la.account([(ev, T)], DELTA, "tight", ldp_bound=bound).eps
                rows.append(row)
                print(f"{k:>6} {eps0:>4g} {T:>6}  " + "  ".join(f"{row[b]:>15.4f}" for b in BOUNDS))
    print("\nmost rounds that fit (eps, delta = 1e-5): tight accountant vs FMT20 baseline")
    for k in (1000, 10000):
        for eps0 in (1.0, 2.0):
            ev = LdpShuffleRound("generic", eps0, N, k)
            for eps in (1.0, 4.0):
                tight = la.max_rounds(ev, eps, DELTA, ldp_bound="tight-pld")
                base = la.max_rounds(ev, eps, DELTA, ldp_bound="baseline")
                ratio = tight / base if base else float("inf")
                print(f"  k={k:>5} eps0={eps0:g} eps={eps:g}: tight {tight:>7}  baseline {base:>6}  {ratio:5.1f}x")
    with open(out / "cldp_accountants.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def run_config(randomizer: str, eps: float, rounds: int) -> str:
    """One CLDP-SGD run on digits; eps0 unset: the largest for which the rounds fit (eps, delta)."""
    return (
        f'[privacy]\nprotocol = "{randomizer}"\neps = {eps}\ndelta = {DELTA}\n'
        f'[schedule]\nkind = "subsampled"\ncohort_size = 1000\nrounds = {rounds}\nlearning_rate = {LR[randomizer]}\n'
        '[transport]\nmode = "sealed"\n[model]\nradius = 10.0\n[deployment]\nround_deadline_seconds = 60\n'
        # generous users: the benchmark runs many runs on the same users
        "[policy]\nmax_eps_per_round = 36\nmax_total_eps = 1e6\nmax_total_delta = 1.0\n"
    )


def services(out: Path, eps_values: list[float], rounds: int) -> list[dict]:
    rows = []
    print(f"\n{'randomizer':>10} {'eps':>4} {'eps0':>7} {'accuracy':>8} {'eps spent':>9} {'s':>6}")
    with tempfile.TemporaryDirectory(prefix="cldp-") as tmp:
        work = Path(tmp)
        (work / "config.toml").write_text(run_config("privunit", 4.0, rounds))  # the nodes read [data], [policy]
        cluster, _, analyzer = start_local_cluster(work / "config.toml", work, 2)
        try:
            for randomizer in ("privunit", "r_inf"):
                for eps in eps_values:
                    t0 = time.monotonic()
                    result = drive_run(analyzer, run_config(randomizer, eps, rounds), echo=lambda *_: None)
                    budget = result.status.budget
                    row = {
                        "randomizer": randomizer,
                        "eps": eps,
                        "eps0": budget.views.get("local", float("nan")) / max(result.status.rounds_done, 1),
                        "accuracy": result.accuracy,
                        "eps_spent": budget.eps_spent,
                        "seconds": time.monotonic() - t0,
                    }
                    rows.append(row)
                    print(
                        f"{randomizer:>10} {eps:>4g} {row['eps0']:>7.3f} {row['accuracy']:>8.3f} "
                        f"{row['eps_spent']:>9.4f} {row['seconds']:>6.1f}",
                        flush=True,
                    )
        finally:
            cluster.stop()
    with open(out / "cldp_accuracy.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def plot(path: Path, acc_rows: list[dict], svc_rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in (1000, 10000):
        for eps0 in (1.0, 2.0):
            pts = [r for r in acc_rows if r["k"] == k and r["eps0"] == eps0]
            for name, style in (("tight", "-"), ("fmt_baseline", ":"), ("thm1", "--")):
                axes[0].loglog([r["T"] for r in pts], [r[name] for r in pts], style, label=f"{name} k={k} e0={eps0:g}")
    axes[0].set_xlabel("rounds T")
    axes[0].set_ylabel("eps (delta = 1e-5)")
    axes[0].legend(fontsize=6)
    for randomizer in ("privunit", "r_inf"):
        pts = [r for r in svc_rows if r["randomizer"] == randomizer]
        axes[1].plot([r["eps"] for r in pts], [r["accuracy"] for r in pts], "o-", label=randomizer)
    axes[1].axhline(0.091, color="grey", lw=0.8, label="majority class")
    axes[1].set_xlabel("total eps")
    axes[1].set_ylabel("held-out accuracy (digits)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["accountants", "services", "both"], default="both")
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("results") / "cldp_sgd")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    acc_rows = accountants(args.out) if args.part in ("accountants", "both") else []
    svc_rows = services(args.out, args.eps, args.rounds) if args.part in ("services", "both") else []
    if acc_rows and svc_rows:
        try:
            plot(args.out / "cldp_sgd.png", acc_rows, svc_rows)
        except Exception as exc:  # the CSVs are written already
            print(f"warning: plot not written: {exc}", file=sys.stderr)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
