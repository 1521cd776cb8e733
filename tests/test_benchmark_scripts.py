"""The randomizer benchmarks of issue 2 stay runnable: each script runs as a real process on a small batch and
prints one line per randomizer with a finite positive ratio. No timing is asserted (speed targets live in the
benchmarks' output, not in tests)."""

import json
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


def test_bench_calibrated_pvec_quick_runs_to_the_variance_ratio():
    # issue 43 item 8: the 10^4-round lines run at the full run's settings (they raised ValueError when their eps
    # needed more trials than planning certifies); one grid cell, whose PLD ratio the issue 16 target bounds (1.05)
    out = _run("bench_calibrated_pvec.py", "--quick", timeout=240)
    assert re.search(r"^PLD route \(\w+\): m=\d+, certified eps=[0-9.]+", out, re.M), out
    ratio = re.search(r"^max calibrated/Gaussian variance ratio: ([0-9.]+)$", out, re.M)
    assert ratio and 1.0 <= float(ratio.group(1)) <= 1.05, out


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


def test_compare_flower_quick_runs_the_shuffledp_half(tmp_path):
    # issue 15 item 5, --quick --systems shuffledp (CI never installs Flower): 20 users, 2 rounds over one real local
    # cluster, measured by the script's process-tree sampler. The table row has a start-up within the wall time, a
    # positive seconds per round below it, CPU and a peak PSS of several processes; every service was stopped by the
    # CLI itself (none left to kill) and the JSON holds the run
    out = _run("compare_flower.py", "--quick", "--systems", "shuffledp", "--out", str(tmp_path), timeout=60)
    num = r"\s+([0-9]+\.[0-9]+)"
    row = re.search(rf"^shuffledp{num * 5}\s+(\d+){num}\s*$", out, re.M)
    assert row, out
    wall, startup, per_round, cpu, pss, procs, accuracy = (float(v) for v in row.groups())
    assert 0 < per_round < startup < wall and cpu > 0.5 and pss > 100 and procs >= 4 and 0 < accuracy <= 1, out
    assert "flower" not in re.findall(r"^(\w+)\s+[0-9]", out, re.M), out
    (result,) = json.loads((tmp_path / "compare_flower.json").read_text())["results"]
    assert result["system"] == "shuffledp" and result["returncode"] == 0 and result["killed_leftovers"] == 0
    assert len(result["round_ends_s"]) == 2 and result["extra"]["users_sha256"]


def test_compare_flower_deployment_quick_runs_the_shuffledp_half(tmp_path):
    # issue 44 item 5, --quick --systems shuffledp (CI never installs Flower): 4 single-user device nodes in the
    # fleet processes of `shuffledp run`, 2 rounds, measured by the script's process-tree sampler. The row has a
    # start-up within the wall time, seconds per round below it, PSS per node below the total, the processes of a
    # fleet run (CLI, shuffler, analyzer, 2 fleets), status ok; the JSON holds every user in every round
    out = _run(
        "compare_flower_deployment.py", "--quick", "--systems", "shuffledp", "--no-warm-up", "--out", str(tmp_path)
    )
    num = r"\s+([0-9]+\.[0-9]+)"
    row = re.search(rf"^\s+4\s+shuffledp{num * 6}\s+(\d+){num}\s+ok$", out, re.M)
    assert row, out
    startup, per_round, wall, cpu, pss, per_node, procs, accuracy = (float(v) for v in row.groups())
    assert 0 < per_round < startup < wall and cpu > 0.5 and 0 < per_node < pss and procs >= 5, out
    assert 0 <= accuracy <= 1 and not re.search(r"^\s+\d+\s+flower", out, re.M), out
    (result,) = json.loads((tmp_path / "compare_flower_deployment.json").read_text())["results"]
    assert result["system"] == "shuffledp" and result["extra"]["status"] == "ok"
    assert result["extra"]["contributors"] == [4, 4] and len(result["round_ends_s"]) == 2
    assert result["extra"]["peak_processes_by_kind"]["serve fleet"] == 2 and result["extra"]["users_sha256"]


def test_bench_startup_prints_the_split_of_one_default_run():
    # issue 15 item 1: one run of scripts/run-default; the marks come from its output and the services' logs
    out = _run("bench_startup.py", "--repeats", "1", timeout=180)
    med = {m.group(1): float(m.group(2)) for m in re.finditer(r"^  (\S.*?)\s+([0-9]+\.[0-9]+)$", out, re.M)}
    assert 0 < med["cli up"] < med["run id"] < med["round 1 shown"] <= med["last round"] < med["exit"], out
    assert all(med[f"{s} up"] > 0 for s in ("shuffler", "analyzer", "client-0", "client-1")), out
    assert re.search(r"^first round shown at [0-9.]+ s \(target <= 3\), exit at [0-9.]+ s", out, re.M), out


def test_bench_round_prints_both_invitation_settings_for_each_dimension():
    out = _run("bench_round.py", "--rounds", "2", "--mode", "direct", "--dim", "100", "30", timeout=240)
    ratios = re.findall(r"^ratio end-to-end / in-process \[d=(\d+), direct, (.+?)\]: median\s+([0-9.]+)", out, re.M)
    settings = ["one invitation", "check-in: two invitations"]
    assert [(r[0], r[1]) for r in ratios] == [(d, s) for d in ("100", "30") for s in settings], out
    assert all(float(r[2]) > 0 for r in ratios), out
    assert "d=30, 1000 users" in out  # the model the round ran has the dimension asked for


def test_trace_round_prints_every_party_on_the_round_path():
    out = _run("trace_round.py", "--rounds", "6", "--dim", "30", timeout=240)
    rows = re.findall(r"^\s+([0-9.]+)  (analyzer|shuffler|node 0|node 1)\s+(\S+)", out, re.M)
    events = {(who, what) for _, who, what in rows}
    for expected in [
        ("analyzer", "Ledger.reserve"),
        ("shuffler", "ShufflerState.execute_round"),
        ("shuffler", "SqliteParticipationStore.record_round"),
        ("node 0", "SqliteSpendStore.record"),
        ("node 1", "NodeCore.prepare"),  # the check-in's preparation (on by default)
        ("analyzer", "RunManager._metrics"),
    ]:
        assert expected in events, out
    times = [float(t) for t, _, _ in rows]
    assert times == sorted(times) and times[0] == 0.0, out  # a timeline from each cycle's reservation


def test_bench_scale_runs_two_sizes_over_the_services(tmp_path):
    # issue 15 item 4 at a small size: the table's rows, the per-user memory line, the JSON and the plot
    argv = ["--users", "200", "400", "--rounds", "2", "--nodes", "2", "--dim", "20", "--check-in", "off"]
    out = _run("bench_scale.py", *argv, "--out", str(tmp_path))
    assert "synthetic logreg dim 20, check-in off" in out
    rows = re.findall(r"^\s+(200|400)\s+([0-9.]+)\s+([0-9.]+)\s+[0-9.]+\s+([0-9.]+)s\s+(\d+)M", out, re.M)
    assert [r[0] for r in rows] == ["200", "400"], out
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and float(r[3]) > 0 and int(r[4]) > 10 for r in rows), out
    data = json.loads((tmp_path / "bench_scale.json").read_text())
    assert [r["users"] for r in data["rows"]] == [200, 400] and (tmp_path / "bench_scale.png").exists()


def test_bench_long_run_prints_both_windows_and_equal_eps():
    # issue 30 item 4: a short run of the long-run benchmark over the real services (201 rounds: two windows of
    # 100 gaps); the script exits 0 only when the ledger's eps equals the independent recomposition to 1e-9
    out = _run("bench_long_run.py", "--rounds", "201", timeout=600)
    assert re.search(r"ratio last / first: [0-9.]+", out), out
    assert "CPU per round, all services" in out and "(equal to 1e-09)" in out, out
    assert len(re.findall(r"^  CPU per round, rounds \d+-\d+: shuffler [0-9.]+", out, re.M)) == 10, out


def test_bench_metrics_scrape_prints_the_three_scrapes():
    out = _run("bench_metrics_scrape.py", "--rounds", "50", timeout=120)
    assert re.search(r"^\s+50\s+[0-9.]+ s\s+[0-9.]+ s\s+[0-9.]+ s$", out, re.M), out


def test_bench_devices_quick_runs_devices_and_two_nodes_over_mtls(tmp_path):
    # issue 44 item 5, --quick: 20 single-user device nodes in 2 fleet processes and the same 20 users on 2 client
    # nodes, each against a shuffler and an analyzer (processes, mTLS): both rows, every round with all 20 users
    out = _run("bench_devices.py", "--quick", "--out", str(tmp_path), timeout=240)
    rows = re.findall(r"^\s+(20 devices|20 users, 2 nodes)\s+(\d+)\s+20\s+([0-9.]+)\s+([0-9.]+)\s", out, re.M)
    assert [(r[0], r[1]) for r in rows] == [("20 devices", "20"), ("20 users, 2 nodes", "2")], out
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows), out
    data = json.loads((tmp_path / "bench_devices.json").read_text())
    assert [r["all_reported"] for r in data["rows"]] == [True, True], out
    assert all(not r["refused_nodes_end"] and r["shuffler_kib_per_node"] > 0 for r in data["rows"]), out
