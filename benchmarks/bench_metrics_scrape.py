"""Benchmark (issue 29 with issue 30 item 4): what a Prometheus scrape of the analyzer costs in a long run.

Run: python benchmarks/bench_metrics_scrape.py [--rounds 10000 100000]

For each R: a ledger (services/ledger.py, in a temporary directory) holds one run with R rounds' metrics (one row
each in its checkpoints table, as the analyzer writes them); the analyzer's collector
(shuffledp/observability/metrics.py) is
scraped three times: the first scrape (every round read), a scrape with nothing new, and a scrape after one more
round. Printed: the seconds of each (best of 3 repetitions of the last two).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
from pathlib import Path

from shuffledp.services.ledger import Ledger

from shuffledp.observability.metrics import _AnalyzerCollector

METRICS = {
    "seconds": 0.02,
    "loss": 1.0,
    "accuracy": 0.5,
    "eps_spent": 3.9,
    "delta_spent": 1e-5,
    "contributors": 10,
    "refused": 1,
    "refused_reasons": {"round_eps_above_max_eps_per_round": 1},
    "rejected": {},
    "released": True,
    "checked_in": 10,
    "not_in_run": 0,
}


def _scrape(collector: _AnalyzerCollector) -> float:
    t = time.perf_counter()
    list(collector.collect())
    return time.perf_counter() - t


def measure(rounds: int, workdir: Path) -> tuple[float, float, float]:
    ledger = Ledger(workdir / f"ledger-{rounds}.db")
    ledger.create_run("r1", "")
    # the rows straight into the table: R durable commits of save_checkpoint would only make this slower
    db = sqlite3.connect(workdir / f"ledger-{rounds}.db")
    with db:
        db.executemany(
            "INSERT INTO checkpoints(run_id, round, blob, metrics_json) VALUES (?,?,?,?)",
            (("r1", r, b"", json.dumps({**METRICS, "round": r})) for r in range(rounds)),
        )
    collector = _AnalyzerCollector(ledger)
    first = _scrape(collector)
    same = min(_scrape(collector) for _ in range(3))
    new = []
    for k in range(3):
        ledger.save_checkpoint("r1", rounds + k, b"", {**METRICS, "round": rounds + k})
        new.append(_scrape(collector))
    db.close()
    ledger.close()
    return first, same, min(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, nargs="+", default=[10_000, 100_000], help="rounds in the ledger")
    args = ap.parse_args()
    if any(r < 1 for r in args.rounds):
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        print("rounds   first scrape   nothing new   one new round")
        for r in args.rounds:
            first, same, new = measure(r, Path(tmp))
            print(f"{r:>7}   {first:10.4f} s   {same:9.4f} s   {new:11.4f} s")


if __name__ == "__main__":
    main()
