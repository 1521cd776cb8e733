"""Mistakes a new user makes with `shuffledp run` (and `serve`, `account`), over the real command in a subprocess
(issue 24 items B5, B7, B9, B10, B13): each ends in one clear line and a distinct exit status, before anything starts
where the configuration and the data decide it alone, never in a traceback, a silently wrong result or lost results.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shuffledp.cli.run import start_local_cluster
from shuffledp.config import ConfigError, load_config, parse_config
from shuffledp.data import load_dataset
from shuffledp.v1 import shuffledp_pb2 as pb

pytestmark = pytest.mark.timeout(180)

# a small digits run: 100 users on one node, two fully interactive rounds (~3 s)
SMALL = """
[data]
max_users = 100
[schedule]
rounds = 2
[deployment]
client_nodes = 1
round_deadline_seconds = 5.0
"""


def _cli(*argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def _one_line(proc: subprocess.CompletedProcess, prefix: str = "shuffledp run: ") -> str:
    """The one error line on stderr (gRPC's own log lines aside), and no traceback anywhere."""
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = [s for s in proc.stderr.splitlines() if s.startswith(prefix)]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _config(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------- B5: data.classes
def test_a_class_that_does_not_occur_is_refused():
    with pytest.raises(ValueError, match=r"label\(s\) \[42\] of data\.classes do not occur in digits"):
        load_dataset(parse_config("[data]\nclasses = [3, 42]\n").data)
    assert load_dataset(parse_config("[data]\nclasses = [3, 8]\n").data).num_classes == 2


def test_run_refuses_a_class_that_does_not_occur_before_anything_starts(tmp_path: Path):
    # it trained on class 3 alone and printed test accuracy 1.0000, exit 0
    cfg = _config(tmp_path, "classes", SMALL.replace("[data]\n", "[data]\nclasses = [3, 42]\n"))
    out = tmp_path / "out"
    proc = _cli("run", str(cfg), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_line(proc)
    assert "label(s) [42] of data.classes do not occur in digits (its labels: 0, 1, 2" in line
    assert "test accuracy" not in proc.stdout and not out.exists()


# --------------------------------------------------------------------------------------------- B7: a used --out
def test_a_used_out_is_refused_unless_reuse_out_says_what_carries_over(tmp_path: Path):
    cfg = _config(tmp_path, "small", SMALL)
    out = tmp_path / "out"
    first = _cli("run", str(cfg), "--out", str(out), "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    spends = (out / "state" / "client-0.spend.sqlite").read_bytes()

    again = _cli("run", str(cfg), "--out", str(out), "--quiet", cwd=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    line = _one_line(again)
    assert f"--out {out} is not empty" in line and "--reuse-out" in line and "state/ carries over" in line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing overwritten
    assert (out / "state" / "client-0.spend.sqlite").read_bytes() == spends

    reused = _cli("run", str(cfg), "--out", str(out), "--quiet", "--reuse-out", cwd=tmp_path)
    assert reused.returncode == 0, reused.stdout + reused.stderr
    assert f"--reuse-out: the results and logs in {out} are replaced; its state/ carries over" in reused.stdout

    # an existing but empty directory is fine (docker's mounted results directory is one)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _cli("run", str(cfg), "--out", str(empty), "--quiet", cwd=tmp_path).returncode == 0


# ------------------------------------------------------------------------------ B9: no round released (exit 4)
def test_a_run_whose_every_round_is_refused_ends_with_exit_4_and_the_reasons(tmp_path: Path):
    # the users' own policy refuses every round: it ended COMPLETED, exit 0, with the untrained model
    # (a local run refuses this plan before it starts, issue 43 item 17; a deployment's analyzer runs it)
    cfg = _config(tmp_path, "refused", SMALL + "[policy]\nmax_eps_per_round = 0.5\n")
    cluster, _, analyzer = start_local_cluster(cfg, tmp_path / "deployment", client_nodes=1)
    try:
        proc = _cli("run", str(cfg), "--analyzer", analyzer, "--out", str(tmp_path / "out"), cwd=tmp_path)
    finally:
        cluster.stop()
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert "no round released: none of the 2 round(s) run released an update; model.npz is the initial model" in lines
    assert "  users refused: round_eps_above_max_eps_per_round (up to 100 users, in 2 of 2 rounds)" in lines
    assert (tmp_path / "out" / "model.npz").exists()  # the results are still written


# ------------------------------------------------------------------ B10: what only planning found, found first
ONLINE = """
[data]
dataset = "synthetic"
n = 600
dim = 2
[model]
task = "logreg"
radius = 5.0
[privacy]
eps = {eps}
delta = 1e-5
protocol = "pnsgd_online"
[schedule]
kind = "fully_interactive"
rounds = 1
[transport]
mode = "sealed"
[deployment]
client_nodes = 1
round_deadline_seconds = 20.0
"""
SUBSAMPLED = """
[data]
max_users = 100
[privacy]
protocol = "{protocol}"
eps = 4.0
[schedule]
kind = "subsampled"
cohort_size = {k}
rounds = 2
[transport]
mode = "sealed"
[deployment]
client_nodes = 1
"""

SEQUENTIAL = """
[data]
max_users = 100
[schedule]
kind = "sequential"
cohort_size = {k}
[deployment]
client_nodes = 1
"""


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("rr", SUBSAMPLED.format(protocol="rr", k=50), "rr randomizes one number per user"),
        ("cohort", SUBSAMPLED.format(protocol="gaussian", k=500), "cohort_size = 500 must lie in [1, admitted"),
        ("online", ONLINE.format(eps=2.0), "online PNSGD over up to 600 records: its newest record alone costs"),
        # issue 43 item 11: a sequential cohort of at least the users was cut to one round that released theta_0
        (
            "seq_cohort_above_users",
            SEQUENTIAL.format(k=150),
            "schedule.cohort_size = 150 exceeds the 100 unused users: a sequential round takes 150 fresh users, so "
            "0 rounds fit; set cohort_size <= 50",
        ),
        (
            "seq_one_round",
            SEQUENTIAL.format(k=100),
            "schedule.cohort_size = 100 with 100 unused users plans 1 sequential round: PSGD releases the mean of "
            "theta_0..theta_(T-1) (Alg 3), with T = 1 the initial model theta_0",
        ),
    ],
)
def test_what_the_configuration_and_the_data_decide_is_refused_before_anything_starts(tmp_path, name, text, says):
    # each failed at planning, after the services started (exit 1, a results directory, a meaningless summary)
    cfg = _config(tmp_path, name, text)
    out = tmp_path / "out"
    started = time.monotonic()
    proc = _cli("run", str(cfg), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_line(proc)
    assert line.startswith(f"shuffledp run: {cfg}: the run cannot be planned for the data's ") and says in line
    assert not out.exists() and proc.stdout == ""
    assert time.monotonic() - started < 30


def test_a_plan_above_the_users_own_policy_is_refused_before_anything_starts(tmp_path: Path):
    # issue 43 item 17: a round above the local run's own [policy] limit started, and failed after 3 attempts (exit 4)
    cfg = _config(tmp_path, "above_policy", ONLINE.format(eps=12.0))
    out = tmp_path / "out"
    proc = _cli("run", str(cfg), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_line(proc) == (
        f"shuffledp run: {cfg}: a round costs each user eps = 9.812 (privacy.protocol 'pnsgd_online', privacy.eps = "
        "12), above the users' [policy] max_eps_per_round = 8: the run's nodes would refuse every round; raise "
        "policy.max_eps_per_round or lower privacy.eps"
    )
    assert not out.exists() and proc.stdout == ""


def test_after_a_failed_planning_the_summary_prints_only_what_is_meaningful(tmp_path: Path):
    # a deployment's analyzer plans for its own population: cohort_size above it fails there, after CreateRun
    cfg = _config(tmp_path, "cohort", SUBSAMPLED.format(protocol="gaussian", k=500))
    cluster, _, analyzer = start_local_cluster(cfg, tmp_path / "deployment", client_nodes=1)
    try:
        proc = _cli("run", str(cfg), "--analyzer", analyzer, "--out", str(tmp_path / "out"), cwd=tmp_path)
    finally:
        cluster.stop()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "state: FAILED  planning failed: schedule.cohort_size = 500 must lie in" in proc.stdout
    assert "privacy spent: nothing (the run was never planned)" in proc.stdout
    for meaningless in ("limit eps = 0", "TRUST_MODEL_UNSPECIFIED", "only 0 of", "no round released"):
        assert meaningless not in proc.stdout, proc.stdout


def test_online_pnsgd_repeats_its_one_round_as_attempts_not_rounds_beyond_the_plan(tmp_path: Path):
    # eps 12 costs more per round than the default policy's max_eps_per_round = 8: every user refuses, the run
    # repeats its one round; the CLI printed "round 2/1", "round 3/1"
    # (a local run refuses this plan before it starts, issue 43 item 17: a deployment's analyzer cannot know its
    # nodes' policies, and runs it)
    cfg = _config(tmp_path, "online", ONLINE.format(eps=12.0))
    cluster, _, analyzer = start_local_cluster(cfg, tmp_path / "deployment", client_nodes=1)
    try:
        proc = _cli("run", str(cfg), "--analyzer", analyzer, "--out", str(tmp_path / "out"), cwd=tmp_path)
    finally:
        cluster.stop()
    assert proc.returncode == 4, proc.stdout + proc.stderr
    rounds = [s.split("  NOT RELEASED")[0].strip() for s in proc.stdout.splitlines() if s.startswith("round ")]
    assert rounds == ["round    1/1", "round    1/1 (attempt 2)", "round    1/1 (attempt 3)"], proc.stdout


# --------------------------------------------------------------------------------- B13: one line, no traceback
@pytest.mark.parametrize("fetch", [[], ["--fetch", "abc"]])
def test_plain_text_to_a_remote_analyzer_is_one_line(tmp_path: Path, fetch: list[str]):
    proc = _cli("run", "--analyzer", "host.example:50051", *fetch, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_line(proc)
    assert "--analyzer 'host.example:50051': plain text (insecure mode) is allowed only on loopback" in line
    assert "--pki DIR" in line and not (tmp_path / "results").exists()


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path):
    cfg = tmp_path / "latin1.toml"
    cfg.write_bytes("[data]\nmax_users = 100  # café\n".encode("latin-1"))
    proc = _cli("run", str(cfg), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{str(cfg)!r} is not UTF-8 text (byte 0xe9 at offset 29)" in _one_line(proc)
    with pytest.raises(ConfigError, match="is not UTF-8 text"):  # what a client node reads with --config
        load_config(cfg)


def test_an_out_that_cannot_be_created_is_one_line(tmp_path: Path):
    cfg = _config(tmp_path, "small", SMALL)
    (tmp_path / "file").write_text("")
    proc = _cli("run", str(cfg), "--out", str(tmp_path / "file" / "results"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        _one_line(proc)
        == f"shuffledp run: cannot create the results directory {tmp_path}/file/results: Not a directory"
    )
    proc = _cli("run", str(cfg), "--out", str(tmp_path / "file"), cwd=tmp_path)
    assert _one_line(proc) == f"shuffledp run: --out {tmp_path}/file is a file, not a directory"


def test_a_port_held_by_another_program_is_one_line(tmp_path: Path):
    with socket.socket() as held:  # no SO_REUSEPORT: gRPC cannot share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        argv = ["serve", "shuffler", "--insecure", "--listen", address, "--state-dir", str(tmp_path / "state")]
        proc = _cli(*argv, cwd=tmp_path, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = _one_line(proc, "shuffledp serve shuffler: ")  # grpc_options.check_address_free, before any state
    assert line.startswith(f"shuffledp serve shuffler: cannot listen on {address}: the address is already in use")
    assert not (tmp_path / "state").exists()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="waits for the CPU time of the process in /proc")
def test_ctrl_c_during_account_is_one_line(tmp_path: Path):
    # a question that takes ~7 s of CPU (near the smallest eps planning certifies at this size: issue 24 B8 refuses
    # eps 0.01 at once), interrupted once its imports are done (~1.5 s of CPU): a Ctrl-C
    # inside a C extension's initialisation surfaces as that import's ImportError, which is no Ctrl-C to report
    argv = ["account", "pvec", "--n", "1000", "--d", "100", "--delta", "1e-6", "--eps", "0.06", "--schedule", "pgd"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shuffledp.cli", *argv, "--rounds", "16", "--min-noise"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        # a shell's background job ignores SIGINT, and a child inherits that: Ctrl-C's default for the command
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        while _cpu_seconds(proc.pid) < 3.0:
            assert proc.poll() is None, "the question was answered before it could be interrupted: ask a slower one"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip() == "shuffledp account: interrupted (Ctrl-C)", err


def test_fetch_refreshes_the_same_runs_results_but_not_another_runs(tmp_path: Path):
    from shuffledp.cli.run import _out_refused

    out = tmp_path / "results"
    assert _out_refused(out, reuse=False, local=False, run_id="abc") is None  # new
    out.mkdir()
    assert _out_refused(out, reuse=False, local=False, run_id="abc") is None  # empty
    (out / "ledger.json").write_text('{"run": {"run_id": "abc"}}')
    assert _out_refused(out, reuse=False, local=False, run_id="abc") is None  # "fetch again later"
    refused = _out_refused(out, reuse=False, local=False, run_id="xyz")
    assert refused.startswith(f"--out {out} is not empty: choose a new directory, or pass --reuse-out to replace")
    assert "state/" not in refused  # a deployment keeps its state itself
    assert _out_refused(out, reuse=True, local=False, run_id="xyz") is None


def test_a_round_closed_at_its_deadline_with_silent_invitees_says_so():
    # issue 43 item 17: a too short round deadline showed only as "0 contributors"
    from shuffledp.services.run_manager import _deadline_failure

    silent = pb.BatchReport(invited=40, contributors=0, refused=5, rejected={"duplicate": 1}, below_threshold=True)
    assert _deadline_failure(silent, 0.2) == (
        "below threshold: 0 contributors; 34 of 40 invited users sent nothing before the round deadline (0.2 s: "
        "[deployment] round_deadline_seconds)"
    )
    answered = pb.BatchReport(invited=40, contributors=30, refused=10, below_threshold=True)
    assert _deadline_failure(answered, 0.2) == ""  # every invitee answered: the threshold, not the deadline


def test_results_carry_the_baseline_and_the_plot_the_eps_limit(tmp_path: Path):
    # issue 43 item 12: a hinge run at the majority class (0.6741 every round) looked like learning; nothing to read
    # the released accuracy against, and no line for the eps limit on the plot
    import json
    from collections import Counter

    from shuffledp.cli.run import _plot

    cfg = _config(tmp_path, "small", SMALL)
    out = tmp_path / "out"
    proc = _cli("run", str(cfg), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    base = summary["baseline"]
    # theta_0 = 0 scores every class alike: argmax picks class 0, loss ln 10
    assert base["initial_model"]["loss"] == pytest.approx(2.302585, abs=1e-5)
    y_test = load_dataset(parse_config(SMALL).data, "logreg").y_test
    majority = max(Counter(y_test.tolist()).values()) / len(y_test)
    assert base["majority_class_accuracy"] == pytest.approx(majority)
    lines = [s for s in proc.stdout.splitlines() if s.startswith("baseline: ")]
    assert lines == [
        f"baseline: initial model theta_0: accuracy {base['initial_model']['accuracy']:.4f}, loss 2.3026; always the "
        f"majority class: accuracy {base['majority_class_accuracy']:.4f}"
    ], proc.stdout
    drawn = _plot(tmp_path / "plot.png", json.loads((out / "metrics.json").read_text()), summary)
    assert drawn["eps_limit"] == [f"{summary['spend']['eps_limit']:g}"]
