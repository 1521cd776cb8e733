"""Benchmark (issue 14 item 6): DP-mu2-FL trusted against untrusted as M grows (seed 002), and shuffled PNSGD's
privacy against n at a fixed noise (seed 004), over the real services.

Run: python benchmarks/mu2_pnsgd.py [--examples 1000] [--machines 1 10 100] [--eps 0.5] [--seeds 3]
         [--pnsgd-n 500 1000 2000] [--quick] [--out /tmp/mu2_pnsgd]
(--quick: 100 examples, M in {1, 10}, one seed, PNSGD at n = 300: a smoke test, about a minute.)

DP-mu2-FL (seed 002's finding: untrusted results degrade with M, trusted ones barely do). A synthetic binary
logistic regression with a known optimum (`[data] dataset = "synthetic"`, dim 5, label noise 0.5, generator seed 4,
||x|| <= 1, radius 5): --examples = M T examples in all, split into M machines of T examples each (one fresh example
per machine per round, the paper's single pass; its experiments keep M T = 60000 fixed too). For each M one local
cluster (`shuffledp.cli.run.start_local_cluster`: shuffler, analyzer, 2 client nodes as OS processes on loopback) runs
`mu2_untrusted` and `mu2_trusted` with the same (eps, delta = 1e-5), clip S = 1, Thm 5.2 / 6.2's step size, and the
paper's noise (sigma_u = 2 S sqrt(T) / rho, sigma_c = sigma_u / M). The table gives the released x_T's excess risk
(held-out loss minus the optimum's), mean +- std over seeds.

PNSGD (seed 004's delta versus n, shuffled against online). The same synthetic task with one record per user and
n users (--pnsgd-n), one pass, eta = 1/beta, radius 5, over the services: shuffled PNSGD at a fixed sigma = 4 L
([privacy.pnsgd] noise_multiplier = 4), online PNSGD in arrival order with Thm 7's decaying sigma_j. The table gives
eps each ledger charges at delta = 1e-5 for the records the pass ran (shuffled: Thm 2, falling with n, the shuffle's
amplification; online: its newest record's Gaussian curve, which rises with n as the noise decays), the online
run's oldest and median records' delta at that eps (its per-record report), and, from the accountant at one common
eps (the smallest n's shuffled charge), the shuffled delta_shuf(n) beside the online newest record's delta.
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
from ftrl_vs_sgd import DEPLOYMENT, POLICY, run_one  # noqa: E402 (one way to drive a run)

from shuffledp.accountants import pnsgd  # noqa: E402
from shuffledp.cli.run import start_local_cluster  # noqa: E402
from shuffledp.protocols import pnsgd_round  # noqa: E402

DELTA, DIM, RADIUS = 1e-5, 5, 5.0


def data(n: int, per_user: int, users: int) -> str:
    return (
        f'[data]\ndataset = "synthetic"\nn = {n}\ndim = {DIM}\nnoise = 0.5\nseed = 4\nexamples_per_user = {per_user}\n'
        f'max_users = {users}\n[model]\ntask = "logreg"\nradius = {RADIUS}\n'
    )


def mu2_config(base: str, protocol: str, eps: float, rounds: int) -> str:
    return (
        base + f'[privacy]\neps = {eps}\ndelta = {DELTA}\nclip_norm = 1.0\nprotocol = "{protocol}"\n'
        f'[schedule]\nkind = "fully_interactive"\nrounds = {rounds}\n[transport]\nmode = "sealed"\n'
    )


def pnsgd_config(base: str, protocol: str) -> str:
    noise = "[privacy.pnsgd]\nnoise_multiplier = 4.0\n" if protocol == "pnsgd" else ""
    return (
        base + f'[privacy]\neps = 60\ndelta = {DELTA}\nprotocol = "{protocol}"\n{noise}'
        '[schedule]\nkind = "fully_interactive"\nrounds = 1\n[transport]\nmode = "sealed"\n'
    )


def cluster_runs(toml_base: str, configs: list[tuple[dict, str]], show) -> list[dict]:
    """Start one local cluster on toml_base's data split and run every (row, config) on it."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="mu2-pnsgd-") as tmp:
        work = Path(tmp)
        (work / "config.toml").write_text(toml_base + DEPLOYMENT + POLICY)
        cluster, _, analyzer = start_local_cluster(work / "config.toml", work, 2)
        try:
            for row, toml in configs:
                row = row | run_one(analyzer, toml)
                rows.append(row)
                show(row)
        finally:
            cluster.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="M T, examples over all machines")
    ap.add_argument("--machines", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--eps", type=float, default=0.5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--pnsgd-n", type=int, nargs="+", default=[500, 1000, 2000])
    ap.add_argument("--quick", action="store_true", help="smoke test: 100 examples, M in {1, 10}, one seed")
    ap.add_argument("--out", type=Path, default=Path("/tmp/mu2_pnsgd"))
    args = ap.parse_args(argv)
    if args.quick:
        args.examples, args.machines, args.seeds, args.pnsgd_n = 100, [1, 10], 1, [300]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def show(row: dict) -> None:
        risk = "-" if row["excess_risk"] is None else f"{row['excess_risk']:.4f}"
        print(
            f"{row['what']:>14} {row['M']:>5} {row['T']:>6} {row['seed']:>4} {risk:>10} {row['eps_spent']:>9.4f} "
            f"{row['seconds']:>6.1f}  {row['state']}" + ("" if row["completed"] else f": {row['message']}"),
            flush=True,
        )

    print(f"DP-mu2-FL: synthetic logreg (dim {DIM}), M T = {args.examples}, eps = {args.eps}, delta = {DELTA}")
    print(f"{'protocol':>14} {'M':>5} {'T':>6} {'seed':>4} {'excess':>10} {'eps spent':>9} {'s':>6}  state")
    mu2_rows: list[dict] = []
    for M in args.machines:
        T = args.examples // M
        base = data(args.examples, T, M)
        configs = [
            ({"what": p, "M": M, "T": T, "seed": s}, mu2_config(base, p, args.eps, T))
            for s in range(args.seeds)
            for p in ("mu2_untrusted", "mu2_trusted")
        ]
        mu2_rows += cluster_runs(base, configs, show)
    table = []
    for p in ("mu2_untrusted", "mu2_trusted"):
        for M in args.machines:
            cell = [r["excess_risk"] for r in mu2_rows if r["what"] == p and r["M"] == M and r["completed"]]
            table.append({"protocol": p, "M": M, "excess_risk": float(np.mean(cell)), "std": float(np.std(cell))})
    print(f"\nexcess risk of x_T (mean +- std of {args.seeds} seeds)")
    print(f"{'M':>5} " + " ".join(f"{p:>22}" for p in ("mu2_untrusted", "mu2_trusted")))
    for M in args.machines:
        cells = [next(t for t in table if t["protocol"] == p and t["M"] == M) for p in ("mu2_untrusted", "mu2_trusted")]
        print(f"{M:>5} " + " ".join(f"{c['excess_risk']:>14.4f}±{c['std']:<7.4f}" for c in cells))

    print(f"\nPNSGD: synthetic logreg (dim {DIM}), one record per user, radius {RADIUS}, delta = {DELTA}")
    print(f"{'protocol':>14} {'n':>5} {'T':>6} {'seed':>4} {'excess':>10} {'eps spent':>9} {'s':>6}  state")
    pn_rows = []
    for n in args.pnsgd_n:
        base = data(n, 1, n)
        configs = [({"what": p, "M": n, "T": 1, "seed": 0}, pnsgd_config(base, p)) for p in ("pnsgd", "pnsgd_online")]
        pn_rows += cluster_runs(base, configs, show)
    L, eta, dk = 2.0, 1.0, 2 * RADIUS  # logreg over ||x|| <= 1: L = sqrt(2) sqrt(2), beta = 1 (eta = 1/beta)
    shuffled = {r["M"]: r for r in pn_rows if r["what"] == "pnsgd"}
    online = {r["M"]: r for r in pn_rows if r["what"] == "pnsgd_online"}
    eps0 = shuffled[args.pnsgd_n[0]]["eps_spent"]
    print(f"\nledger eps at delta = {DELTA}; online per-record deltas at its eps; deltas at eps = {eps0:.4f}:")
    head = f"{'n':>6} {'shuffled eps':>12} {'online eps':>10} {'oldest':>9} {'median':>9}"
    print(head + f" {'delta_shuf':>11} {'online newest':>13}")
    pn_table = []
    for n in args.pnsgd_n:
        views = online[n]["views"]
        sched = {"eta": eta, "diameter": dk, "m": 1.0, **pnsgd_round.ONLINE_SCHEDULE}
        sigma_n = float(pnsgd_round.online_sigmas(sched, n)[-1])
        row = {
            "n": n,
            "eps_shuffled": shuffled[n]["eps_spent"],
            "eps_online": online[n]["eps_spent"],
            "online_delta_oldest": views.get("record_delta_oldest"),
            "online_delta_median": views.get("record_delta_median"),
            "delta_shuffled": pnsgd.delta_shuffled("gaussian", eps0, n, L, 4 * L, eta, dk),
            "delta_online_newest": pnsgd.theta(2 * L / sigma_n, eps0),
        }
        pn_table.append(row)
        print(
            f"{n:>6} {row['eps_shuffled']:>12.4f} {row['eps_online']:>10.4f} {row['online_delta_oldest']:>9.2e} "
            f"{row['online_delta_median']:>9.2e} {row['delta_shuffled']:>11.3e} {row['delta_online_newest']:>13.3e}"
        )
    total = time.monotonic() - started
    print(f"total time {total:.0f} s")
    doc = {
        "command": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)],
        "mu2": {"rows": mu2_rows, "table": table},
        "pnsgd": {"rows": pn_rows, "table": pn_table},
        "seconds": total,
    }
    (args.out / "mu2_pnsgd.json").write_text(json.dumps(doc, indent=2))
    plot(table, pn_table, args.machines, args.out / "mu2_pnsgd.png")
    print(f"wrote {args.out / 'mu2_pnsgd.json'} and {args.out / 'mu2_pnsgd.png'}")
    return 0


def plot(table: list[dict], pn_table: list[dict], machines: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for p in ("mu2_untrusted", "mu2_trusted"):
        cells = [next(t for t in table if t["protocol"] == p and t["M"] == M) for M in machines]
        a.errorbar(machines, [c["excess_risk"] for c in cells], [c["std"] for c in cells], marker="o", label=p)
    a.set_xscale("log")
    a.set_xlabel("machines M (M T fixed)")
    a.set_ylabel("excess risk of x_T")
    a.set_title("DP-mu2-FL (seed 002)")
    a.legend()
    ns = [r["n"] for r in pn_table]
    b.plot(ns, [r["delta_shuffled"] for r in pn_table], "o-", label="shuffled, sigma = 4L (Thm 2)")
    b.plot(ns, [r["delta_online_newest"] for r in pn_table], "s--", label="online, newest record (Thm 7 noise)")
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("users n")
    b.set_ylabel("delta at a fixed eps")
    b.set_title("PNSGD (seed 004)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
