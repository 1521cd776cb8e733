"""Benchmark (issue 30 item 4): does a long run's per-round cost grow with the rounds already run?

Run: python benchmarks/bench_long_run.py [--rounds 10000] [--nodes 2] [--eps 4]

A sequential PSGD run over the real services (shuffler, analyzer, client nodes as OS processes on loopback, driven
through the operator API as `shuffledp run` drives it, long poll included): synthetic least squares, dim 10,
cohort 10 per round, n = 10 (R + 1) training users (>= 10^5 at R = 10^4), PVEC count mode, calibrated, the default
check-in. Sequential rounds compose in parallel (disjoint cohorts), so any eps that one round of 9 contributors
fits lets all R rounds run.

Printed, from the analyzer's own ledger (rounds.reserved_at: when each round was reserved, just before its spec
left): the median seconds between consecutive rounds over rounds 1-100 and over the last 100, and their ratio
(target <= 1.2, issue 30); the run's final eps_spent next to an independent recomposition of the ledger's exported
events (ledger_accounting.account on every round's event, at the rounds' delta: equal to 1e-9).
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shuffledp.accountants.ledger_accounting import account
from shuffledp.events import PvecRound
from shuffledp.protocols.pvec import PvecParams
from shuffledp.run import drive_run, start_local_cluster
from shuffledp.v1 import shuffledp_pb2 as pb

COHORT = 10
DIM = 10
WINDOW = 100  # rounds at each end whose gaps are compared
TARGET_RATIO = 1.2  # issue 30 acceptance
EQUAL_TOL = 1e-9


def config_toml(rounds: int, eps: float, nodes: int) -> str:
    return f"""\
[data]
dataset = "synthetic"
n = {COHORT * (rounds + 1)}
dim = {DIM}

[model]
task = "leastsq"
radius = 10.0

[privacy]
eps = {eps}
calibration = "calibrated"
clip_norm = 1.0

[schedule]
kind = "sequential"
optimizer = "psgd"
cohort_size = {COHORT}
rounds = {rounds}
learning_rate = 0.5

[transport]
mode = "counts"

[deployment]
client_nodes = {nodes}
round_deadline_seconds = 60.0
insecure = true
"""


def round_gaps(ledger_path: Path, run_id: str) -> list[float]:
    """Seconds between the reservations of consecutive rounds (gap[i]: round i to round i + 1)."""
    db = sqlite3.connect(f"file:{ledger_path}?mode=ro", uri=True)
    try:
        t = [r[0] for r in db.execute("SELECT reserved_at FROM rounds WHERE run_id=? ORDER BY round", (run_id,))]
    finally:
        db.close()
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def recompose(ledger_json: str) -> float:
    """The run's spent eps from its export alone, without the ledger or the plug-in: every committed or spent round
    as the accountant's PvecRound (contributors above the parameters' n charged as n: post-processing, the plug-in's
    rule), composed by ledger_accounting.account at the largest of the rounds' deltas (parallel composition)."""
    export = json.loads(ledger_json)
    rounds = [r for r in export["rounds"] if r["state"] in ("committed", "spent_unknown")]
    events = []
    for r in rounds:
        e = r["event"]
        params = PvecParams(**e["params"])
        events.append(PvecRound.from_params(params, min(e["contributors"], params.n), "sequential"))
    delta = max(ev.target_delta for ev in events)
    return account(events, delta, "tight").eps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10_000, help="rounds of the run (default 10^4)")
    ap.add_argument("--nodes", type=int, default=2, help="client nodes (default 2)")
    ap.add_argument("--eps", type=float, default=4.0, help="the run's eps (each round's: parallel composition)")
    args = ap.parse_args(argv)
    if args.rounds < 2 * WINDOW + 1:
        ap.error(f"--rounds must be >= {2 * WINDOW + 1} (two windows of {WINDOW} gaps), got {args.rounds}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_long_run_") as tmp:
        workdir = Path(tmp)
        toml = config_toml(args.rounds, args.eps, args.nodes)
        cfg_path = workdir / "config.toml"
        cfg_path.write_text(toml)
        print(
            f"sequential PSGD, synthetic leastsq dim {DIM}, n = {COHORT * (args.rounds + 1)} users, cohort {COHORT}, "
            f"{args.rounds} rounds, eps {args.eps:g}, PVEC counts, calibrated, check-in; {args.nodes} client nodes"
        )
        cluster, _, analyzer = start_local_cluster(cfg_path, workdir, args.nodes)
        try:
            t_run = time.monotonic()
            result = drive_run(analyzer, toml, cluster, echo=lambda *_: None)
            t_run = time.monotonic() - t_run
        finally:
            cluster.stop()
        st = result.status
        if st.state != pb.COMPLETED:
            print(f"run ended {pb.RunState.Name(st.state)}: {st.message}", file=sys.stderr)
            return 1
        gaps = round_gaps(workdir / "state" / "ledger.sqlite", st.run_id)
        first = statistics.median(gaps[1 : 1 + WINDOW])  # rounds 1..100 (round 0 pays first-use imports)
        last = statistics.median(gaps[-WINDOW:])
        ratio = last / first
        eps_ledger = st.budget.eps_spent
        eps_indep = recompose(result.ledger_json)
        same = math.isclose(eps_ledger, eps_indep, rel_tol=EQUAL_TOL, abs_tol=0.0)
        print(f"run: {len(gaps) + 1} rounds in {t_run:.1f} s; {st.budget.accountant}")
        print(f"median seconds between rounds, rounds 1-{WINDOW}:        {first:.4f} s")
        print(f"median seconds between rounds, last {WINDOW} rounds:    {last:.4f} s")
        verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
        print(f"ratio last / first: {ratio:.3f} (target <= {TARGET_RATIO:g}: {verdict})")
        for at in (500, 1000, 2000, 5000):
            if at + WINDOW <= len(gaps):
                mid = statistics.median(gaps[at : at + WINDOW])
                print(f"  median gap over rounds {at}-{at + WINDOW - 1}: {mid:.4f} s")
        print(
            f"final eps: ledger {eps_ledger!r}, independent recomposition {eps_indep!r} "
            f"({'equal' if same else 'DIFFERENT'} to {EQUAL_TOL:g})"
        )
    print(f"benchmark wall time {time.monotonic() - started:.1f} s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
