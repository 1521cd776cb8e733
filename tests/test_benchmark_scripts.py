"""The randomizer benchmarks of issue 2 stay runnable: each script runs as a real process on a small batch and
prints one line per randomizer with a finite positive ratio. No timing is asserted (speed targets live in the
benchmarks' output, not in tests)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, timeout=timeout
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


def test_excess_risk_benchmark_runs_over_the_services(tmp_path):
    # issue 11 item 7: a tiny grid (2 sizes, 2 optimizers) over real local clusters; the script prints one row per
    # run with a finite excess risk and one slope line per optimizer, and writes the CSV and the PNG
    out = _run(
        "excess_risk.py",
        "--ns",
        "600",
        "1200",
        "--eps",
        "4",
        "--optimizers",
        "psgd",
        "acsa",
        "--dim",
        "3",
        "--out",
        str(tmp_path),
    )
    rows = re.findall(r"^\s*(600|1200)\s+4\s+(psgd|acsa)\s+\d+\s+(-?[0-9.]+)\s", out, re.MULTILINE)
    assert len(rows) == 4 and all(abs(float(r[2])) < 1.0 for r in rows), out
    assert len(re.findall(r"slope [+-][0-9.]+ \(theory -0\.(50|80)\)", out)) == 2, out
    assert (tmp_path / "excess_risk.csv").read_text().count("\n") == 5 and (tmp_path / "excess_risk.png").exists()


def test_ftrl_vs_sgd_benchmark_runs_over_the_services(tmp_path):
    # issue 12 item 7, --quick: digits, eps 8, one learning rate per method over one real local cluster; every run
    # completes within its budget, and the JSON and the PNG are written
    out = _run("ftrl_vs_sgd.py", "--quick", "--out", str(tmp_path))
    rows = re.findall(r"^\s*(dp-ftrlm?|dp-sgd|pgd)\s+8\s+[0-9.]+\s+\d+\s+([0-9.]+)\s+([0-9.]+)\s.*COMPLETED", out, re.M)
    assert {r[0] for r in rows} == {"dp-ftrl", "dp-ftrlm", "dp-sgd", "pgd"}, out
    assert all(0.1 < float(acc) <= 1.0 and float(eps) <= 8.0 for _, acc, eps in rows), out
    assert (tmp_path / "ftrl_vs_sgd.json").exists() and (tmp_path / "ftrl_vs_sgd.png").exists()


def test_utility_vs_central_benchmark_runs_over_the_services(tmp_path):
    # issue 16 item 3, --quick: eps 8, one seed, one learning rate, 4 rounds; the shuffle run (real services, with
    # the check-in) spends at most its eps, the central one's dp_accounting check equals it to 1e-9
    out = _run("utility_vs_central.py", "--quick", "--out", str(tmp_path))
    rows = dict(re.findall(r"^\s*(shuffle|central)\s+8\s+8\s+0\s+[0-9.]+\s+([0-9.]+)\s.*COMPLETED", out, re.M))
    assert set(rows) == {"shuffle", "central"}, out
    assert 7.9 <= float(rows["shuffle"]) <= 8.0 and abs(float(rows["central"]) - 8.0) < 1e-4, out
    assert "shuffle - central" in out
    assert (tmp_path / "utility.json").exists() and (tmp_path / "utility.png").exists()


def test_mu2_pnsgd_benchmark_runs_over_the_services(tmp_path):
    # issue 14 item 6, --quick: DP-mu2 trusted and untrusted at M in {1, 10}, shuffled and online PNSGD at one n, all
    # over real local clusters; every run completes within its budget, and the JSON and the PNG are written
    out = _run("mu2_pnsgd.py", "--quick", "--out", str(tmp_path), timeout=300)
    rows = re.findall(
        r"^\s*(mu2_untrusted|mu2_trusted|pnsgd|pnsgd_online)\s+(\d+)\s.*\s([0-9.]+)\s+[0-9.]+\s+COMPLETED$", out, re.M
    )
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        [("mu2_untrusted", "1"), ("mu2_untrusted", "10"), ("mu2_trusted", "1"), ("mu2_trusted", "10"),
         ("pnsgd", "300"), ("pnsgd_online", "300")]
    ), out  # fmt: skip
    assert all(float(eps) <= 60.0 for _, _, eps in rows), out
    assert (tmp_path / "mu2_pnsgd.json").exists() and (tmp_path / "mu2_pnsgd.png").exists()
