"""Prometheus metrics of the services (issue 29 item 1), over real processes on loopback: a shuffler, an analyzer and
two client nodes (`shuffledp serve ... --metrics-port`) plus a ghost participant whose users never answer (each
round then lasts its deadline, so the run is scraped while it proceeds). `shuffledp run --analyzer` drives a real
run; every service's /metrics is scraped during the run and at its end, and the values must agree with the ledger
and metrics.json the CLI wrote. Every exposed series is scanned: no label or value may carry a user id, a node's
user list or message content (labels are checked against what each may hold).
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from _procs import GhostNode, log_text, serve, stop, wait_connected
from prometheus_client.parser import text_string_to_metric_families

from shuffledp.observability.metrics import RUN_STATES, safe_reason

pytestmark = pytest.mark.timeout(180)

ROUNDS = 5
NODES = 2
MAX_USERS = 60
CONFIG = f"""
[data]
dataset = "digits"
max_users = {MAX_USERS}
[privacy]
eps = 8.0
min_contributors_fraction = 0.3  # node 1's users refuse every round (STRICT): the others still make the threshold
[schedule]
kind = "fully_interactive"
rounds = {ROUNDS}
learning_rate = 8.0
[deployment]
client_nodes = {NODES}
round_deadline_seconds = 4.0
"""
# node 1's users accept no round this run asks for: refusals by a policy reason, in every round
STRICT = "[policy]\nmax_eps_per_round = 0.01\n"
REFUSAL = "round_eps_above_max_eps_per_round"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> tuple[str, dict[tuple[str, tuple], float]]:
    """(exposition text, {(sample name, sorted labels): value}) of the service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def _get(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _sum(samples: dict, name: str, **labels: str) -> float:
    """Sum of `name` over the series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


@pytest.fixture
def services(tmp_path: Path):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    (tmp_path / "strict.toml").write_text(CONFIG + STRICT)
    state = tmp_path / "state"
    sec = ["--insecure"]
    ports = {name: _free_port() for name in ("shuffler", "analyzer", "client-0", "client-1")}
    procs = []
    try:
        argv = ["shuffler", *sec, "--state-dir", str(state), "--metrics-port", str(ports["shuffler"])]
        shuffler, sport = serve(tmp_path, "shuffler", argv)
        procs.append(shuffler)
        at = ["--shuffler", f"127.0.0.1:{sport}"]
        analyzer, aport = serve(
            tmp_path,
            "analyzer",
            ["analyzer", *sec, *at, "--state-dir", str(state), "--metrics-port", str(ports["analyzer"])],
        )
        procs.append(analyzer)
        for i in range(NODES):
            cfg = config if i == 0 else tmp_path / "strict.toml"
            argv = ["client", *sec, *at, "--config", str(cfg), "--node-index", str(i), "--num-nodes", str(NODES)]
            argv += ["--state-dir", str(state), "--metrics-port", str(ports[f"client-{i}"])]
            procs.append(serve(tmp_path, f"client-{i}", argv)[0])
        ghost = GhostNode(f"127.0.0.1:{sport}", users=3)
        try:
            wait_connected(f"127.0.0.1:{sport}", NODES + 1)  # every run of the test has all three in its population
            yield config, f"127.0.0.1:{aport}", ports
        finally:
            ghost.close()
    finally:
        stop(*procs)


def _user_ids() -> list[str]:
    # shuffledp.data.user_shard names node i's users "n{i}-u{j}"; the ghost's are "g-u{j}" (tests/_procs.py)
    return [f"n{i}-u{j}" for i in range(NODES) for j in range(MAX_USERS)] + [f"g-u{j}" for j in range(3)]


# what each label may hold (a closed set or a known shape): nothing else is allowed to appear
def _label_ok(key: str, value: str, run_id: str) -> bool:
    allowed = {
        "state": lambda v: v in RUN_STATES,
        "run_id": lambda v: v == run_id,
        "outcome": lambda v: v in ("committed", "released", "refused", "spent_unknown", "below_threshold"),
        "reason": lambda v: v == safe_reason(v) or (v.islower() and v.replace("_", "").isalpha()),
        "node": lambda v: v in ("client-0", "client-1", "ghost"),
        "phase": lambda v: v in ("select", "collect", "release"),
        "le": lambda v: v == "+Inf" or float(v) >= 0,
    }
    return key in allowed and allowed[key](value)


def _check_no_private_data(text: str, run_id: str) -> None:
    ids = _user_ids()
    for uid in ids:
        assert uid not in text, f"user id {uid} in the metrics"
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("shuffledp_"), family.name
        for s in family.samples:
            assert isinstance(s.value, float | int)
            for key, value in s.labels.items():
                assert _label_ok(key, value, run_id), f"{s.name}: label {key}={value!r}"


def test_each_service_exposes_metrics_that_agree_with_the_ledger_and_hold_no_user_data(services, tmp_path):
    config, analyzer, ports = services
    out = tmp_path / "results"
    cli = subprocess.Popen(
        [sys.executable, "-m", "shuffledp.cli", "run", str(config), "--analyzer", analyzer, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # scrape while the run proceeds: at least once between its first committed round and its last
    seen_mid_run = None
    deadline = time.monotonic() + 120
    while cli.poll() is None and time.monotonic() < deadline:
        _, a = _scrape(ports["analyzer"])
        running = _get(a, "shuffledp_analyzer_runs", state="RUNNING")
        committed = _sum(a, "shuffledp_analyzer_rounds_total", outcome="committed")
        if running == 1 and 0 < committed < ROUNDS and seen_mid_run is None:
            scraped = {name: _scrape(port) for name, port in ports.items()}
            seen_mid_run = scraped
        time.sleep(0.2)
    text_out, _ = cli.communicate(timeout=60)
    assert cli.returncode == 0, text_out + log_text(tmp_path, "analyzer")[-3000:]
    assert seen_mid_run is not None, "no scrape found the run in progress"

    ledger = json.loads((out / "ledger.json").read_text())
    rows = [r for r in json.loads((out / "metrics.json").read_text()) if r["round"] >= 1]  # round 0: initial model
    run_id = ledger["run"]["run_id"]
    end = {name: _scrape(port) for name, port in ports.items()}

    # mid-run: the analyzer's run is RUNNING and its spend is between nothing and the final spend
    _, mid = seen_mid_run["analyzer"]
    assert _get(mid, "shuffledp_analyzer_runs", state="RUNNING") == 1
    assert 0 < _get(mid, "shuffledp_analyzer_epsilon_spent", run_id=run_id) <= ledger["totals"]["eps_spent"]
    _, mid_shuffler = seen_mid_run["shuffler"]
    assert _get(mid_shuffler, "shuffledp_shuffler_open_streams") == NODES + 1  # and the ghost

    # analyzer at the end == the ledger and metrics.json
    _, a = end["analyzer"]
    assert _get(a, "shuffledp_analyzer_runs", state="COMPLETED") == 1
    assert sum(_get(a, "shuffledp_analyzer_runs", state=s) for s in RUN_STATES) == 1
    by_state = {}
    for r in ledger["rounds"]:
        by_state[r["state"]] = by_state.get(r["state"], 0) + 1
    assert by_state.get("committed", 0) == len([r for r in rows if r["released"]]) == ROUNDS
    for outcome in ("committed", "spent_unknown"):
        assert _get(a, "shuffledp_analyzer_rounds_total", run_id=run_id, outcome=outcome) == by_state.get(outcome, 0)
    released = _get(a, "shuffledp_analyzer_rounds_total", run_id=run_id, outcome="released")
    refused = _get(a, "shuffledp_analyzer_rounds_total", run_id=run_id, outcome="refused")
    assert released + refused == by_state.get("released", 0)
    assert _get(a, "shuffledp_analyzer_rounds_in_flight", run_id=run_id) == 0
    assert _get(a, "shuffledp_analyzer_rounds_planned", run_id=run_id) == ledger["run"]["plan"]["rounds"]
    assert _get(a, "shuffledp_analyzer_epsilon_spent", run_id=run_id) == pytest.approx(ledger["totals"]["eps_spent"])
    assert _get(a, "shuffledp_analyzer_epsilon_spent", run_id=run_id) == pytest.approx(rows[-1]["eps_spent"])
    assert _get(a, "shuffledp_analyzer_delta_spent", run_id=run_id) == pytest.approx(ledger["totals"]["delta_spent"])
    assert _get(a, "shuffledp_analyzer_epsilon_limit", run_id=run_id) == pytest.approx(ledger["totals"]["eps_limit"])
    assert _get(a, "shuffledp_analyzer_delta_limit", run_id=run_id) == pytest.approx(ledger["totals"]["delta_limit"])
    assert _get(a, "shuffledp_analyzer_round_duration_seconds_count", run_id=run_id) == len(rows)
    assert _get(a, "shuffledp_analyzer_round_duration_seconds_sum", run_id=run_id) == pytest.approx(
        sum(r["seconds"] for r in rows)
    )
    refused_users = sum(r["refused"] for r in rows)
    assert refused_users > 0
    assert _sum(a, "shuffledp_analyzer_user_refusals_total", run_id=run_id) == refused_users
    assert _get(a, "shuffledp_analyzer_user_refusals_total", run_id=run_id, reason=REFUSAL) == refused_users
    assert _get(a, "shuffledp_analyzer_planning_seconds_count") == 1

    # shuffler: users per node identity, and every accepted message is a contributor of a batch
    _, s = end["shuffler"]
    users = {i: _get(end[f"client-{i}"][1], "shuffledp_node_users") for i in range(NODES)}
    assert sum(users.values()) == MAX_USERS
    for i in range(NODES):
        assert _get(s, "shuffledp_shuffler_admitted_users", node=f"client-{i}") == users[i]
    assert _get(s, "shuffledp_shuffler_admitted_users", node="ghost") == 3
    contributors = sum(r["contributors"] for r in rows)
    assert _get(s, "shuffledp_shuffler_batch_contributors_count") == len(rows)
    assert _get(s, "shuffledp_shuffler_batch_contributors_sum") == contributors
    # the default run checks in first (protocols/check_in.py): a check-in and then a message per contributor
    checked_in = sum(r["checked_in"] for r in rows)
    assert checked_in >= contributors
    assert _get(s, "shuffledp_shuffler_messages_accepted_total") == contributors + checked_in
    assert _get(s, "shuffledp_shuffler_rounds_total", outcome="released") == ROUNDS
    for phase in ("select", "collect", "release"):
        assert _get(s, "shuffledp_shuffler_round_phase_seconds_count", phase=phase) == len(rows)

    # nodes: every joined user's charge was recorded once per round
    n = [end[f"client-{i}"][1] for i in range(NODES)]
    assert sum(_get(x, "shuffledp_node_spend_records_total") for x in n) == contributors
    assert _get(n[0], "shuffledp_node_rounds_joined_total") == ROUNDS
    assert _get(n[1], "shuffledp_node_rounds_joined_total") == 0 == _get(n[1], "shuffledp_node_spend_records_total")
    assert _sum(n[0], "shuffledp_node_user_refusals_total") == 0
    assert _get(n[1], "shuffledp_node_user_refusals_total", reason=REFUSAL) == refused_users
    assert refused_users == users[1] * ROUNDS  # every user of node 1, every round
    for x in n:
        assert _get(x, "shuffledp_node_connected") == 1

    # no user id, user list or message content in any series, mid-run or at the end
    for text, _ in [*seen_mid_run.values(), *end.values()]:
        _check_no_private_data(text, run_id)


def test_metrics_port_bad_input_is_one_line_before_any_state(tmp_path):
    state = tmp_path / "state"
    base = [sys.executable, "-m", "shuffledp.cli", "serve", "shuffler", "--insecure", "--state-dir", str(state)]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra, want in (
            (["--metrics-port", "70000"], "--metrics-port must be in 1..65535"),
            (["--metrics-port", str(port)], "already in use"),
            (["--listen", "unix:/tmp/x.sock", "--metrics-port", "9100"], "needs a host:port --listen"),
        ):
            p = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
            # the insecure-mode warning is logged first; the error is one line, the last
            lines = [x for x in p.stderr.strip().splitlines() if "WITHOUT TLS" not in x]
            assert p.returncode != 0 and len(lines) == 1 and want in lines[0], p.stderr
            assert lines[0].startswith("shuffledp serve shuffler: metrics:"), lines[0]
    assert not state.exists()


def test_a_reason_a_node_made_up_is_counted_as_other():
    # the shuffler forwards a node's free-text reason (bounded, printable): it could name a user
    assert safe_reason("n0-u3") == "other" and safe_reason("my users: n0-u1, n0-u2") == "other"
    assert safe_reason("round_eps_above_max_eps_per_round") == "round_eps_above_max_eps_per_round"
    assert safe_reason("submit_failed_unavailable") == "submit_failed_unavailable"


SEQUENTIAL = """
[data]
dataset = "digits"
max_users = 400
[privacy]
eps = 8.0
protocol = "pvec"
min_contributors_fraction = 0.5
[schedule]
kind = "sequential"  # disjoint cohorts: parallel composition, as deploy/example.toml (the Docker monitoring test)
cohort_size = 30
output = "last"
[deployment]
client_nodes = 2
round_deadline_seconds = 8.0
"""


def test_a_sequential_run_s_committed_rounds_are_the_ledger_s_once_a_scrape_shows_it_completed(tmp_path):
    """CI's Docker monitoring test found 1 committed round in Prometheus where the ledger had 13: it waited for the
    eps spent to reach the ledger's, which a parallel-composition run reaches at its first round, so Prometheus's
    last scrape could predate the run's end. The analyzer's counters themselves agree with the ledger.json once a
    scrape shows the run COMPLETED (the ledger closes every round before), which is what that test now waits for."""
    config = tmp_path / "run.toml"
    config.write_text(SEQUENTIAL)
    state, mport = tmp_path / "state", _free_port()
    procs = []
    try:
        shuffler, sport = serve(tmp_path, "shuffler", ["shuffler", "--insecure", "--state-dir", str(state)])
        procs.append(shuffler)
        at = ["--insecure", "--shuffler", f"127.0.0.1:{sport}", "--state-dir", str(state)]
        analyzer, aport = serve(tmp_path, "analyzer", ["analyzer", *at, "--metrics-port", str(mport)])
        procs.append(analyzer)
        for i in range(2):
            argv = ["client", *at, "--config", str(config), "--node-index", str(i), "--num-nodes", "2"]
            procs.append(serve(tmp_path, f"client-{i}", argv)[0])
        out = tmp_path / "results"
        cli = subprocess.Popen(
            [sys.executable, "-m", "shuffledp.cli", "run", str(config), "--analyzer", f"127.0.0.1:{aport}"]
            + ["--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        scrapes = []  # (runs COMPLETED, committed rounds, eps spent) of each scrape during the run
        while cli.poll() is None:
            _, a = _scrape(mport)
            scrapes.append(
                (
                    _get(a, "shuffledp_analyzer_runs", state="COMPLETED"),
                    _sum(a, "shuffledp_analyzer_rounds_total", outcome="committed"),
                    _sum(a, "shuffledp_analyzer_epsilon_spent"),
                )
            )
            time.sleep(0.05)
        text_out, _ = cli.communicate(timeout=60)
        assert cli.returncode == 0, text_out + log_text(tmp_path, "analyzer")[-3000:]
        _, end = _scrape(mport)
    finally:
        stop(*procs)
    ledger = json.loads((out / "ledger.json").read_text())
    run_id, eps = ledger["run"]["run_id"], ledger["totals"]["eps_spent"]
    committed = sum(1 for r in ledger["rounds"] if r["state"] == "committed")
    assert committed == ledger["run"]["plan"]["rounds"] == 400 // 30
    assert _get(end, "shuffledp_analyzer_runs", state="COMPLETED") == 1
    assert _get(end, "shuffledp_analyzer_rounds_total", run_id=run_id, outcome="committed") == committed
    assert _get(end, "shuffledp_analyzer_epsilon_spent", run_id=run_id) == pytest.approx(eps, rel=1e-12)
    for done, n, spent in scrapes:
        assert n <= committed and spent <= eps * (1 + 1e-12)
        if done:  # a scrape that shows the run completed shows all its rounds
            assert n == committed and spent == pytest.approx(eps, rel=1e-12)
        elif n > 0:  # the premise the old wait missed: eps is final from the first committed round on
            assert spent == pytest.approx(eps, rel=1e-12)


def _analyzer_samples(collector) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_the_analyzer_s_scrape_reads_each_round_once_and_agrees_with_a_fresh_reading(tmp_path):
    """A scrape decodes only the rounds' metrics it has not read yet (a long run's scrape costs what changed): what
    it shows after rounds were added, in order or not (a gap filled later: all read again), is what a collector
    that reads everything at once shows."""
    from shuffledp.services.ledger import Ledger

    from shuffledp.observability.metrics import _AnalyzerCollector

    ledger = Ledger(tmp_path / "ledger.db")
    ledger.create_run("r1", "")
    kept = _AnalyzerCollector(ledger)

    def save(r: int) -> None:
        reasons = {REFUSAL: r % 3, "made up by n0-u1": 1} if r % 2 else {}
        m = {"round": r, "seconds": 0.03 * (r + 1) ** 2, "refused_reasons": reasons, "rejected": {"replay": r % 2}}
        ledger.save_checkpoint("r1", r, b"", m)

    ledger.save_checkpoint("r1", -1, b"", {"round": -1, "seconds": 99.0})  # the initial model: not a round
    for batch in ([0, 1, 2], [3], [], [5, 6], [4], [7, 8, 9]):  # round 4 arrives after 5 and 6
        for r in batch:
            save(r)
        got = _analyzer_samples(kept)
        assert got == _analyzer_samples(_AnalyzerCollector(ledger))
    n = 10
    assert got[("shuffledp_analyzer_round_duration_seconds_count", (("run_id", "r1"),))] == n
    assert got[("shuffledp_analyzer_round_duration_seconds_sum", (("run_id", "r1"),))] == pytest.approx(
        sum(0.03 * (r + 1) ** 2 for r in range(n))
    )
    # scrapes at once (the metrics server answers each in a thread of its own): each new round is still read once
    db = sqlite3.connect(tmp_path / "ledger.db")
    with db:
        db.executemany(
            "INSERT INTO checkpoints(run_id, round, blob, metrics_json) VALUES (?,?,?,?)",
            (("r1", r, b"", json.dumps({"round": r, "seconds": 0.01})) for r in range(n, 20_000)),
        )
    db.close()
    with ThreadPoolExecutor(4) as pool:
        readings = list(pool.map(lambda _: _analyzer_samples(kept), range(4)))
    fresh = _analyzer_samples(_AnalyzerCollector(ledger))
    assert all(r == fresh for r in readings)
    assert fresh[("shuffledp_analyzer_round_duration_seconds_count", (("run_id", "r1"),))] == 20_000
    le_1 = ("shuffledp_analyzer_round_duration_seconds_bucket", (("le", "1.0"), ("run_id", "r1")))
    assert got[le_1] == sum(1 for r in range(n) if 0.03 * (r + 1) ** 2 <= 1.0)
    assert fresh[le_1] == got[le_1] + 20_000 - n
    refusals = ("shuffledp_analyzer_user_refusals_total", (("reason", REFUSAL), ("run_id", "r1")))
    assert got[refusals] == sum(r % 3 for r in range(1, n, 2))
    assert got[("shuffledp_analyzer_user_refusals_total", (("reason", "other"), ("run_id", "r1")))] == n // 2
    ledger.close()


def test_made_up_node_ids_make_a_bounded_number_of_series(tmp_path):
    """Issue 43 item 6: in insecure mode any caller names its node. 3000 RegisterUsers with distinct node ids to a real
    shuffler (a process, loopback) made 3002 admitted_users series; now at most MAX_NODE_SERIES nodes have one (a
    node holding a stream first, whatever its name) and the rest are summed under node="other"."""
    from shuffledp.observability.metrics import MAX_NODE_SERIES, OTHER
    from shuffledp.v1 import shuffledp_pb2 as pb
    from shuffledp.v1 import shuffledp_pb2_grpc as pbg

    mport = _free_port()
    argv = ["shuffler", "--insecure", "--state-dir", str(tmp_path / "state"), "--metrics-port", str(mport)]
    shuffler, sport = serve(tmp_path, "shuffler", argv)
    calls = 3000
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sport}") as channel:
            stub = pbg.ShufflerStub(channel)
            for i in range(calls):
                stub.RegisterUsers(pb.RegisterUsersRequest(node_id=f"made-up-{i:04d}", user_ids=["u"]), timeout=10)
        ghost = GhostNode(f"127.0.0.1:{sport}", users=3)  # "ghost" sorts after every made-up name
        try:
            wait_connected(f"127.0.0.1:{sport}", 1)
            text, s = _scrape(mport)
        finally:
            ghost.close()
    finally:
        stop(shuffler)
    series = {dict(lab)["node"]: v for (name, lab), v in s.items() if name == "shuffledp_shuffler_admitted_users"}
    assert len(series) == MAX_NODE_SERIES + 1, len(series)
    assert series["ghost"] == 3  # the node holding a stream has its own series
    assert series[OTHER] == calls - (MAX_NODE_SERIES - 1)  # one user per made-up node without a series
    assert sum(series.values()) == calls + 3
    assert len(text) < 64_000, len(text)  # was 304 kB


def test_the_analyzer_s_series_are_bounded_whatever_runs_and_reasons_there_are(tmp_path):
    """Issue 43 item 6: each run had ~12 series of its own, and each rejection reason the shuffler named (free
    lower-case words on the wire) one more per run. Only the newest MAX_RUN_SERIES runs have series of their own, the
    older runs' counts are summed under run_id="other" (their budgets are not summed), and a run shows at most
    MAX_REASON_SERIES reasons of its own, the rest under reason="other"."""
    from shuffledp.services.ledger import BudgetLimit, Ledger

    from shuffledp.observability.metrics import MAX_REASON_SERIES, MAX_RUN_SERIES, OTHER, _AnalyzerCollector

    ledger = Ledger(tmp_path / "ledger.db")
    runs = [f"r{i:04d}" for i in range(MAX_RUN_SERIES + 30)]
    for run_id in runs:
        ledger.create_run(run_id, "")
        ledger.set_budget(run_id, BudgetLimit(1.0, 1e-6, "parallel"), {"rounds": 1})
        # lower-case words (safe_label), as a shuffler may name them
        reasons = {f"made_up_{chr(97 + k // 26)}{chr(97 + k % 26)}": 1 for k in range(3 * MAX_REASON_SERIES)}
        ledger.save_checkpoint(run_id, 0, b"", {"round": 0, "seconds": 0.2, "rejected": reasons})
    got = _analyzer_samples(_AnalyzerCollector(ledger))
    ledger.close()
    run_ids = {dict(lab).get("run_id") for (_, lab) in got} - {None}
    assert run_ids == set(runs[-MAX_RUN_SERIES:]) | {OTHER}
    count = ("shuffledp_analyzer_round_duration_seconds_count", (("run_id", OTHER),))
    assert got[count] == 30  # one round of each older run
    for run_id in (runs[-1], OTHER):
        reasons = {
            dict(lab)["reason"]: v
            for (n, lab), v in got.items()
            if n.startswith("shuffledp_analyzer_messages_") and dict(lab)["run_id"] == run_id
        }
        assert len(reasons) == MAX_REASON_SERIES + 1 and reasons[OTHER] > 0
        assert sum(reasons.values()) == 3 * MAX_REASON_SERIES * (1 if run_id != OTHER else 30)
    assert got[("shuffledp_analyzer_epsilon_limit", (("run_id", runs[-1]),))] == 1.0
    assert ("shuffledp_analyzer_epsilon_limit", (("run_id", OTHER),)) not in got
    assert ("shuffledp_analyzer_rounds_planned", (("run_id", OTHER),)) not in got
    # samples (histogram buckets included): about 26 a run plus its reasons; were 130 runs of 26 + 96
    assert len(got) <= (MAX_RUN_SERIES + 1) * (30 + MAX_REASON_SERIES + 1) + len(RUN_STATES) + 10, len(got)


def test_nodes_over_the_shuffler_s_capacity_are_counted_by_reason_and_named_in_a_bounded_number_of_series(tmp_path):
    """Issue 44: a node over the shuffler's capacity (--max-nodes) is reported by node and reason in the metrics too.
    A real shuffler process with capacity 2: 2 nodes hold their streams, 150 more (made-up names, plain text) are each
    refused once; the refusals are counted by reason, and by node for the last MAX_NODE_SERIES refused, the rest
    summed under node="other"."""
    from shuffledp.observability.metrics import MAX_NODE_SERIES, OTHER
    from shuffledp.v1 import shuffledp_pb2 as pb
    from shuffledp.v1 import shuffledp_pb2_grpc as pbg

    mport = _free_port()
    argv = ["shuffler", "--insecure", "--state-dir", str(tmp_path / "state"), "--metrics-port", str(mport)]
    shuffler, sport = serve(tmp_path, "shuffler", [*argv, "--max-nodes", "2"])
    held = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sport}") as channel:
            stub = pbg.ShufflerStub(channel)
            for i in range(2):
                stream = stub.Subscribe(pb.SubscribeRequest(node_id=f"held-{i}"))
                held.append(stream)
                assert stream.initial_metadata()  # subscribed: the shuffler says so before any invitation
            codes = []
            for i in range(150):
                with pytest.raises(grpc.RpcError) as err:
                    next(stub.Subscribe(pb.SubscribeRequest(node_id=f"over-{i:03d}"), timeout=10))
                codes.append(err.value.code())
            text, s = _scrape(mport)
            for stream in held:
                stream.cancel()
    finally:
        stop(shuffler)
    assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert s[("shuffledp_shuffler_refused_calls_total", (("reason", "capacity"),))] == 150
    per_node = "shuffledp_shuffler_refused_node_calls_total"
    by_node = {dict(lab)["node"]: v for (name, lab), v in s.items() if name == per_node}
    assert len(by_node) == MAX_NODE_SERIES + 1 and by_node[OTHER] == 150 - MAX_NODE_SERIES
    assert "over-149" in by_node and "over-000" not in by_node  # the ones refused last have their own series
    assert not any(n.startswith("held-") for n in by_node)
