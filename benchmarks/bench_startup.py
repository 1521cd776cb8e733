"""Benchmark (issue 15): where the embedded default run's wall time goes, from the command to its exit.

Run: python benchmarks/bench_startup.py [--repeats 3] [-- extra `shuffledp run` arguments]

Runs `scripts/run-default` (= `shuffledp run` on the embedded default: shuffler, analyzer and two client nodes as
separate processes on loopback) --repeats times, each into a fresh temporary results directory, and reads two
clocks: the time each line of the command's output appears (this process's monotonic clock from the moment the
command is started), and the services' own log lines (wall clock, ms resolution, converted with the start time):
  cli up        the command's first output line (its imports and the config parsed)
  <service> up  "<service> serving on port" in each service's log
  run id        the run created and planned by the analyzer (CreateRun answered)
  round 1 done  the analyzer's log "round 0: ok" (the first training round over the services)
  round 1 shown the first progress line printed by the command
  last round    the last progress line printed
  exit          the command has exited (results written, services stopped)
Printed: each repeat's split and the median of each mark; the last line is the acceptance check of issue 15
(first round shown within 3 s, exit within 8 s) on the medians, with the run's eps and test accuracy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("shuffler", "analyzer", "client-0", "client-1")
FIRST_ROUND_TARGET_S, EXIT_TARGET_S = 3.0, 8.0
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _log_time(line: str, wall0: float) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall0


def _first(path: Path, needle: str, wall0: float) -> float | None:
    if not path.exists():
        return None
    for line in path.read_text(errors="replace").splitlines():
        if needle in line:
            return _log_time(line, wall0)
    return None


def one_run(extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        out = Path(tmp) / "results"
        wall0, t0 = time.time(), time.monotonic()
        proc = subprocess.Popen(
            [str(ROOT / "scripts" / "run-default"), "--out", str(out), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stdout]
        rc = proc.wait()
        marks = {"exit": time.monotonic() - t0}
        if rc != 0:
            raise SystemExit("run failed:\n" + "\n".join(text for _, text in lines))
        rounds = [t for t, text in lines if text.startswith("round ")]
        marks["cli up"] = lines[0][0]
        for name in SERVICES:
            marks[f"{name} up"] = _first(out / "logs" / f"{name}.log", " serving on port ", wall0)
        marks["run id"] = next(t for t, text in lines if text.startswith("run id:"))
        marks["round 1 done"] = _first(out / "logs" / "analyzer.log", " round 0: ok", wall0)
        marks["round 1 shown"], marks["last round"] = rounds[0], rounds[-1]
        text = "\n".join(t for _, t in lines)
        marks["eps"] = float(re.search(r"privacy spent: eps = ([0-9.]+)", text).group(1))
        marks["accuracy"] = float(re.search(r"test accuracy: ([0-9.]+)", text).group(1))
        return marks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more `shuffledp run` arguments (after --)")
    args = parser.parse_args()
    order = ["cli up", *(f"{s} up" for s in SERVICES), "run id", "round 1 done", "round 1 shown", "last round"]
    order.append("exit")
    runs = []
    for i in range(args.repeats):
        marks = one_run(args.extra)
        runs.append(marks)
        split = "  ".join(f"{k} {marks[k]:.2f}" for k in order if marks[k] is not None)
        print(f"run {i + 1}: {split}  (eps {marks['eps']:.4f}, accuracy {marks['accuracy']:.4f})", flush=True)
    med = {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in order}
    print("median seconds from the command's start:")
    for k in order:
        print(f"  {k:14s} {med[k]:6.2f}")
    ok = med["round 1 shown"] <= FIRST_ROUND_TARGET_S and med["exit"] <= EXIT_TARGET_S
    print(
        f"first round shown at {med['round 1 shown']:.2f} s (target <= {FIRST_ROUND_TARGET_S:g}), exit at "
        f"{med['exit']:.2f} s (target <= {EXIT_TARGET_S:g}): {'ok' if ok else 'MISSED'}; "
        f"eps {runs[0]['eps']:.4f}, accuracy {runs[0]['accuracy']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
