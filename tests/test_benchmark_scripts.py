"""The randomizer benchmarks of issue 2 stay runnable: each script runs as a real process on a small batch and
prints one line per randomizer with a finite positive ratio. No timing is asserted (speed targets live in the
benchmarks' output, not in tests)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_bench_ldp_prints_every_randomizer():
    out = _run("bench_ldp.py", "--k", "300", "--d", "20", "--reps", "1")
    for name in ("rr", "r_inf", "r_one", "privunit"):
        row = re.search(rf"^\s*{name}\s+(.*)$", out, re.MULTILINE)
        assert row, f"no row for {name} in:\n{out}"
        ratio = float(row.group(1).split()[5])  # msg bits, users/s, draws, read X, encode ms, ratio, ...
        assert 0.0 < ratio < float("inf")


def test_bench_pvec_prints_count_mode_ratios():
    out = _run("bench_pvec.py", "--users", "300", "--d", "20", "--repeats", "1")
    ratios = [float(r) for r in re.findall(r"PVEC count mode .*ratio\s+([0-9.]+)", out)]
    assert len(ratios) == 3 and all(r > 0 for r in ratios), out
