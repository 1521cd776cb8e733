"""Benchmark (issue 30 item 4): does a long run's per-round cost grow with the rounds already run?

Run: python benchmarks/bench_long_run.py [--rounds 10000] [--nodes 2] [--eps 4]

A sequential PSGD run over the real services (shuffler, analyzer, client nodes as OS processes on loopback, driven
through the operator API as `shuffledp run` drives it, long poll included): synthetic least squares, dim 10,
cohort 10 per round, n = 10 (R + 1) training users (>= 10^5 at R = 10^4), PVEC count mode, calibrated, the default
check-in. Sequential rounds compose in parallel (disjoint cohorts), so any eps that one round of 9 contributors
fits lets all R rounds run.

Printed, from the analyzer's own ledger (rounds.reserved_at: when each round was reserved, just before its spec
left): the median seconds between consecutive rounds over rounds 1-100 and over the last 100, and their ratio
(target <= 1.2, issue 30); the CPU time per round of each service over the same two windows (/proc/<pid>/stat,
sampled every SAMPLE_S with the ledger's round count: on a machine shared with other work the gaps also measure
the wait for a core, the CPU time less so, though it too rises when the cores are contended), and by tenths of
the run; the run's final eps_spent next to an independent recomposition of the ledger's exported events
(ledger_accounting.account on every round's event, at the rounds' delta: equal to 1e-9).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from shuffledp.accountants.events import PvecRound
from shuffledp.accountants.ledger_accounting import account
from shuffledp.cli.run import Cluster, drive_run, start_local_cluster
from shuffledp.mechanisms.pvec import PvecParams
from shuffledp.v1 import shuffledp_pb2 as pb

COHORT = 10
DIM = 10
WINDOW = 100  # rounds at each end whose gaps are compared
TARGET_RATIO = 1.2  # issue 30 acceptance
EQUAL_TOL = 1e-9
SAMPLE_S = 0.2


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
clip_norm = 1.0
[privacy.pvec]
calibration = "calibrated"

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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat fields 14, 15); nan when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class CpuSampler(threading.Thread):
    """Every SAMPLE_S: (rounds reserved so far, CPU seconds of each service)."""

    def __init__(self, cluster: Cluster, ledger_path: Path):
        super().__init__(daemon=True)
        self.cluster, self.ledger_path = cluster, ledger_path
        self.samples: list[tuple[int, dict[str, float]]] = []
        self.stop = threading.Event()

    def rounds(self) -> int:
        try:
            db = sqlite3.connect(f"file:{self.ledger_path}?mode=ro", uri=True, timeout=5)
            try:
                return int(db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0])
            finally:
                db.close()
        except sqlite3.Error:
            return 0  # no ledger file or table yet

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            cpu = {name: cpu_seconds(proc.pid) for name, proc in self.cluster.procs.items()}
            self.samples.append((self.rounds(), cpu))

    def per_round(self, first: int, last: int) -> dict[str, float]:
        """CPU ms per round of each service between the samples nearest to `first` and `last` rounds."""
        a = min(self.samples, key=lambda s: abs(s[0] - first))
        b = min(self.samples, key=lambda s: abs(s[0] - last))
        rounds = max(b[0] - a[0], 1)
        return {k: 1e3 * (b[1][k] - a[1][k]) / rounds for k in a[1]}


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
        sampler = CpuSampler(cluster, workdir / "state" / "ledger.sqlite")
        sampler.start()
        try:
            t_run = time.monotonic()
            result = drive_run(analyzer, toml, cluster, echo=lambda *_: None)
            t_run = time.monotonic() - t_run
        finally:
            sampler.stop.set()
            sampler.join()
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
        n = len(gaps) + 1
        cpu_first, cpu_last = sampler.per_round(1, 1 + WINDOW), sampler.per_round(n - WINDOW, n)
        for name in cpu_first:
            print(
                f"  CPU per round, {name}: rounds 1-{WINDOW} {cpu_first[name]:.1f} ms, last {WINDOW} "
                f"{cpu_last[name]:.1f} ms"
            )
        total_first, total_last = sum(cpu_first.values()), sum(cpu_last.values())
        print(
            f"CPU per round, all services: {total_first:.1f} ms -> {total_last:.1f} ms "
            f"(ratio {total_last / total_first:.3f})"
        )
        # by tenths of the run: state kept per round makes a service's CPU per round rise steadily; a machine shared
        # with other work makes all services' rise and fall together (the wait for a core, shared caches: up to
        # +50 % between windows of one run at load average 10, issue 43), which one window at each end cannot tell
        tenth = n // 10
        for a in range(0, n - tenth + 1, max(tenth, 1)):
            cpu = sampler.per_round(a, a + tenth)
            print(f"  CPU per round, rounds {a}-{a + tenth}: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
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
