"""Benchmark tool (issue 30): where a round's time goes, hop by hop, across the services' processes.

Run: python benchmarks/trace_round.py [--dim 100] [--rounds 60] [--check-in on|off]

bench_round.py's problem (d = --dim parameters, 1000 users on 2 client nodes, fully interactive PVEC count rounds)
through the real analyzer: shuffler, analyzer and nodes as OS processes on loopback, each timing the entry and exit of
the functions on a round's path (benchmarks/tracing/sitecustomize.py, loaded through PYTHONPATH; shuffledp itself
is unchanged). Printed: the median round cycle (one reservation to the next) over the rounds after the first two,
then every event that occurs in at least 80 % of the cycles, as its median time since the cycle's reservation, in
that order, one line per process and occurrence ("#2": the event's third call in the cycle). The differences
between consecutive lines are the hops and the work between them (e.g. the shuffler's _invite/end to a node's
_answer: an invitation on its way; SqliteSpendStore.record: a node's durable charge before its users' data leave).
The wrappers cost ~2 us per call; the timeline is for finding where the time goes, not for the round's figure
(bench_round.py gives that).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_round import NODES, bench_analyzer, config_toml, write_problem  # noqa: E402

from shuffledp.security.rng import make_rng  # noqa: E402

CYCLE_START = "Ledger.reserve"  # the analyzer books each round before its spec leaves: one per cycle
SKIPPED_CYCLES = 2  # the first rounds do the run's one-time work (accounting, first preparations)


def _role(labels: set[str]) -> str | None:
    if CYCLE_START in labels:
        return "analyzer"
    if "ShufflerState.execute_round" in labels:
        return "shuffler"
    if "NodeCore.handle" in labels:
        return "node"
    return None  # a process that traced nothing of a round (the operator CLI)


def timeline(trace_dir: Path) -> tuple[list[float], list[tuple[float, str, int]]]:
    """(cycle lengths in ms, [(median ms since the cycle's start, "process event#k", cycles it occurs in)])."""
    events: list[tuple[int, str]] = []
    nodes = 0
    for path in sorted(trace_dir.glob("*.log"), key=lambda p: int(p.stem)):  # pids: nodes in start order
        rows = [(int(t), name) for t, name in (line.split() for line in path.read_text().splitlines())]
        role = _role({name for _, name in rows})
        if role == "node":
            role, nodes = f"node {nodes}", nodes + 1
        if role is not None:
            events += [(t, f"{role:9s} {name}") for t, name in rows]
    events.sort()
    starts = [t for t, name in events if name.endswith(f" {CYCLE_START}")][SKIPPED_CYCLES:]
    at: dict[str, list[float]] = collections.defaultdict(list)
    i = 0
    for start, end in zip(starts, starts[1:], strict=False):
        while events[i][0] < start:
            i += 1
        seen: collections.Counter[str] = collections.Counter()
        j = i
        while j < len(events) and events[j][0] < end:
            name = events[j][1]
            at[f"{name}#{seen[name]}" if seen[name] else name].append((events[j][0] - start) / 1e6)
            seen[name] += 1
            j += 1
    cycles = [(b - a) / 1e6 for a, b in zip(starts, starts[1:], strict=False)]
    rows = [(statistics.median(v), k, len(v)) for k, v in at.items() if len(v) >= 0.8 * len(cycles)]
    return cycles, sorted(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=100, help="model parameters d (default 100)")
    p.add_argument("--rounds", type=int, default=60, help="rounds traced (default 60)")
    p.add_argument("--check-in", choices=("on", "off"), default="on", help="privacy.pvec.check_in (default on)")
    args = p.parse_args(argv)
    if args.rounds < SKIPPED_CYCLES + 2:
        p.error(f"--rounds must be >= {SKIPPED_CYCLES + 2}")
    with tempfile.TemporaryDirectory(prefix="trace_round_") as tmp:
        workdir, trace_dir = Path(tmp), Path(tmp) / "trace"
        trace_dir.mkdir()
        toml = config_toml(write_problem(workdir, make_rng(), args.dim), args.rounds, args.check_in == "on")
        cfg_path = workdir / "config.toml"
        cfg_path.write_text(toml)
        # the services inherit this environment: each loads the tracing wrappers at start-up
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "benchmarks" / "tracing"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        os.environ["SHUFFLEDP_TRACE_DIR"] = str(trace_dir)
        try:
            _, _, info = bench_analyzer(cfg_path, workdir / "run", toml)
        finally:
            del os.environ["SHUFFLEDP_TRACE_DIR"]
        cycles, rows = timeline(trace_dir)
    if not cycles:
        raise SystemExit("no complete round cycle was traced")
    print(
        f"d={args.dim}, 1000 users on {NODES} client nodes, check-in {args.check_in}, {args.rounds} rounds; {info}\n"
        f"traced cycles: {len(cycles)}, median {statistics.median(cycles):.2f} ms (the wrappers included)\n"
        "median ms since the cycle's reservation, process, event (/end: its return; #k: its k+1-th call):"
    )
    for ms, name, n in rows:
        print(f"{ms:8.2f}  {name}" + (f"  (in {n} of {len(cycles)} cycles)" if n != len(cycles) else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
