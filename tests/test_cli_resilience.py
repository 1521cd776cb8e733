"""The operator CLI (`shuffledp run`) when the analyzer dies or stalls mid-run, over real processes on loopback
(shuffledp.cli.run.start_local_cluster) and real signals: SIGKILL ends the CLI with one line naming the run and how to
fetch it (exit 3, no traceback), and `--fetch` gets the results from an analyzer restarted on the same state; SIGSTOP
for longer than the per-call timeout is waited out and the run completes; a local run whose analyzer process dies
ends with one line and the log's path.

A ghost participant (registers users, never answers) makes every round last its deadline (2 s), so a run is still
RUNNING when the signal arrives (a round the client node misses is not released: still a round).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from _procs import GhostNode, wait_connected
from _runs import digits_pgd, wait_for_run
from shuffledp.clients.node import start_node
from shuffledp.services.analyzer import start_analyzer
from shuffledp.services.shuffler import start_shuffler

from shuffledp.cli import build_parser
from shuffledp.cli import main as cli_main
from shuffledp.cli.run import _run_command, drive_run, start_local_cluster
from shuffledp.config import parse_config
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(120)

ROUNDS = 6
CONFIG = digits_pgd(ROUNDS, max_users=200, deployment="round_deadline_seconds = 2.0\n")


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def _ledger_rows(db: Path, sql: str) -> list[tuple]:
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return con.execute(sql).fetchall()
    except sqlite3.OperationalError:  # created but not yet initialised
        return []


class OnLedger:
    """Once the analyzer's ledger answers `sql` with a row, run `action`, in a thread (the CLI blocks the test);
    `join()` stops watching (the run may have ended without the row) and returns whether `action` ran."""

    def __init__(self, db: Path, sql: str, action: Callable[[], None]):
        self.stop, self.done = threading.Event(), threading.Event()

        def watch() -> None:
            while not _ledger_rows(db, sql):
                if self.stop.wait(0.05):
                    return
            action()
            self.done.set()

        self.thread = threading.Thread(target=watch, daemon=True)
        self.thread.start()

    def join(self) -> bool:
        self.stop.set()
        self.thread.join()
        return self.done.is_set()


# a round was committed: the run is planned and RUNNING, rounds 2.. still ahead
ROUND_COMMITTED = "SELECT run_id FROM rounds WHERE state = 'committed'"


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("shuffledp run:")]


@pytest.fixture
def deployment(tmp_path: Path):
    """An already running deployment (shuffler, analyzer, one client node) plus the ghost."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    work = tmp_path / "deployment"
    cluster, shuffler, analyzer = start_local_cluster(config, work, client_nodes=1)
    ghost = GhostNode(shuffler, users=5)
    try:
        wait_connected(shuffler, 2)  # the node and the ghost: every run of the test has both in its population
        yield cluster, shuffler, analyzer, config, work
    finally:
        ghost.close()
        cluster.stop()


def test_analyzer_killed_mid_run_one_line_exit_3_then_fetch_from_restarted_analyzer(deployment, tmp_path, capsys):
    cluster, shuffler, analyzer, config, work = deployment
    db = work / "state" / "ledger.sqlite"

    def kill() -> None:
        cluster.procs["analyzer"].send_signal(signal.SIGKILL)
        cluster.procs["analyzer"].wait()

    killer = OnLedger(db, ROUND_COMMITTED, kill)
    started = time.monotonic()
    args = _args(str(config), "--analyzer", analyzer, "--out", str(tmp_path / "results"))
    code = _run_command(args, give_up_s=3.0, call_timeout_s=2.0)
    elapsed = time.monotonic() - started
    assert killer.join(), "the analyzer was not killed mid-run"
    out, err = capsys.readouterr()
    assert code == 3, out + err
    assert "Traceback" not in out + err
    run_id = re.search(r"^run id: (\w+)", out, re.M).group(1)
    assert out.count("analyzer unreachable (UNAVAILABLE), retrying for up to 3 s...") == 1, out
    [line] = _errors(err)
    assert f"lost contact with the analyzer at {analyzer} (UNAVAILABLE" in line
    assert re.search(rf"while run {run_id} was RUNNING \(round \d/{ROUNDS}\)\. The run continues", line), line
    assert line.endswith(f"fetch its results later with: shuffledp run --analyzer {analyzer} --fetch {run_id}")
    assert elapsed < 40  # gave up after the short window, not the default 120 s

    # a new analyzer on the same state resumes the run; --fetch (a real CLI process) writes its results
    port_file = cluster.spawn(
        "analyzer", ["analyzer", "--insecure", "--shuffler", shuffler, "--state-dir", str(work / "state")]
    )
    again = f"127.0.0.1:{cluster.wait_port('analyzer', port_file)}"
    with grpc.insecure_channel(again) as channel:
        assert wait_for_run(pbg.AnalyzerStub(channel), run_id, timeout=60).state == pb.COMPLETED
    fetched = tmp_path / "fetched"
    proc = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "run", "--analyzer", again, "--fetch", run_id, "--out", str(fetched)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"run {run_id}: COMPLETED, {ROUNDS}/{ROUNDS} rounds" in proc.stdout
    for name in ("metrics.json", "ledger.json", "config.toml", "model.npz"):
        assert (fetched / name).stat().st_size > 0, name
    assert run_id in (fetched / "ledger.json").read_text()

    # an unknown run id: one line, exit 2
    capsys.readouterr()
    assert cli_main(["run", "--analyzer", again, "--fetch", "0000000000000000"]) == 2
    _, err = capsys.readouterr()
    assert _errors(err) == [f"shuffledp run: the analyzer at {again} has no run '0000000000000000'"]


def test_analyzer_paused_longer_than_the_call_timeout_is_waited_for(deployment, tmp_path, capsys):
    cluster, _, analyzer, config, work = deployment
    proc = cluster.procs["analyzer"]

    def pause() -> None:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(6.0)  # three per-call timeouts
        proc.send_signal(signal.SIGCONT)

    pauser = OnLedger(work / "state" / "ledger.sqlite", ROUND_COMMITTED, pause)
    try:
        args = _args(str(config), "--analyzer", analyzer, "--out", str(tmp_path / "results"))
        code = _run_command(args, give_up_s=60.0, call_timeout_s=2.0)
    finally:
        paused = pauser.join()
        proc.send_signal(signal.SIGCONT)  # never leave it stopped, even if the CLI failed
    assert paused, "the analyzer was not paused mid-run"
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "Traceback" not in out + err and _errors(err) == []
    lines = out.splitlines()
    unreachable = [i for i, s in enumerate(lines) if s.startswith("analyzer unreachable")]
    assert [lines[i] for i in unreachable] == ["analyzer unreachable (DEADLINE_EXCEEDED), retrying for up to 60 s..."]
    assert lines.count("analyzer reachable again") == 1 and lines.index("analyzer reachable again") > unreachable[0]
    # the analyzer's status messages, each once (printed when it changes: the population's progress)
    said = [s for s in lines if s.startswith("  [analyzer] waiting for the population")]
    assert said and said[0] == "  [analyzer] waiting for the population" and len(set(said)) == len(said), out
    assert "state: COMPLETED" in lines
    assert len([s for s in lines if s.startswith("round ")]) == ROUNDS


def _child_analyzer(state_dir: Path) -> int | None:
    """Pid of the analyzer process this test's CLI started (a child of this process serving `state_dir`)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"analyzer" in argv and str(state_dir).encode() in argv:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the CLI's analyzer process through /proc")
def test_local_run_whose_analyzer_dies_ends_with_one_line_and_the_log_path(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    out_dir = tmp_path / "results"
    killed: list[int] = []

    def kill() -> None:
        pid = _child_analyzer(out_dir / "state")
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    killer = OnLedger(out_dir / "state" / "ledger.sqlite", "SELECT run_id FROM runs", kill)
    started = time.monotonic()
    code = _run_command(_args(str(config), "--out", str(out_dir)), give_up_s=60.0, call_timeout_s=5.0)
    killer.join()
    out, err = capsys.readouterr()
    assert killed, f"the analyzer process was not killed mid-run:\n{out}{err}"
    assert code == 3, out + err
    assert "Traceback" not in out + err
    assert _errors(err) == [
        "shuffledp run: analyzer exited unexpectedly (status -9); all services stopped; "
        f"its log: {out_dir / 'logs' / 'analyzer.log'}"
    ]
    assert time.monotonic() - started < 40  # seen by the process check, not after the 60 s retry window


def test_fetch_usage_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert cli_main(["run", "--fetch", "abc"]) == 2
    assert cli_main(["run", str(tmp_path / "x.toml"), "--analyzer", "127.0.0.1:1", "--fetch", "abc"]) == 2
    assert cli_main(["run", "--analyzer", "127.0.0.1:1", "--fetch", " "]) == 2
    assert cli_main(["run", "--cancel", "abc"]) == 2
    assert cli_main(["run", "--analyzer", "127.0.0.1:1", "--cancel", "abc", "--fetch", "abc"]) == 2
    out, err = capsys.readouterr()
    assert _errors(err) == [
        "shuffledp run: --fetch RUN_ID needs --analyzer HOST:PORT (the analyzer that holds the run)",
        "shuffledp run: --fetch takes no CONFIG (the run's own configuration is fetched with its results)",
        "shuffledp run: --fetch needs a RUN_ID (printed by `shuffledp run` as 'run id: ...')",
        "shuffledp run: --cancel RUN_ID needs --analyzer HOST:PORT (the analyzer that holds the run)",
        "shuffledp run: --cancel RUN_ID fetches the run's results too: give it without --fetch",
    ]
    assert out == "" and not (tmp_path / "results").exists()


def test_operator_channel_receives_results_above_4_mib() -> None:
    """A RunResult carries the whole ledger: the operator's channel takes what the analyzer may send
    (grpc_options.BATCH_MESSAGE_BYTES), not gRPC's default 4 MiB."""
    from shuffledp.cli.run import operator_channel

    big = pb.RunResult(ledger_json="x" * (5 * 2**20))

    class Analyzer(pbg.AnalyzerServicer):
        def GetRunResult(self, request, context):
            return big

    server = grpc.server(futures.ThreadPoolExecutor(2))
    pbg.add_AnalyzerServicer_to_server(Analyzer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with operator_channel(f"127.0.0.1:{port}") as ch:
            result = pbg.AnalyzerStub(ch).GetRunResult(pb.RunRef(run_id="r"), timeout=30)
        assert len(result.ledger_json) == 5 * 2**20
    finally:
        server.stop(0)


def test_a_service_imports_only_its_own_subcommand():
    # start-up (issue 15): `shuffledp serve ...` must not import `account`'s accountants (dp_accounting, ~1 s of CPU
    # in every service process); `shuffledp --help` still lists every subcommand
    code = (
        "import sys\n"
        "from shuffledp.cli import build_parser\n"
        "build_parser('serve')\n"
        "print(sorted(m for m in ('shuffledp.cli.account', 'dp_accounting', 'scipy.stats') if m in sys.modules))\n"
        "print(sorted(build_parser()._subparsers._group_actions[0].choices))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "['account', 'health', 'pki', 'run', 'serve', 'sweep']"]


def test_create_run_waits_longer_for_a_large_synthetic_data_set():
    """CreateRun draws the data set at the analyzer, and a timed-out CreateRun is never repeated: the CLI allows
    60 s plus 60 s per million synthetic examples (a 10^7-example run took over 60 s on 2 cores: issue 30)."""
    from shuffledp.cli.run import CREATE_TIMEOUT_S, _create_timeout

    assert _create_timeout("") == CREATE_TIMEOUT_S
    assert _create_timeout('[data]\ndataset = "synthetic"\nn = 10000000\n') == CREATE_TIMEOUT_S + 600
    assert _create_timeout('[data]\ndataset = "digits"\n') == CREATE_TIMEOUT_S


def test_a_run_whose_cli_was_lost_is_cancelled_by_run_id_and_its_results_written(deployment, tmp_path, capsys):
    """`--cancel RUN_ID` (deploy/compose.sh and swarm.sh: `cancel RUN_ID`): the run stops and its results so far are
    written; a run that ended already is left as it is, and the command says so."""
    _, _, analyzer, config, _ = deployment
    with grpc.insecure_channel(analyzer) as channel:
        stub = pbg.AnalyzerStub(channel)
        run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=config.read_text()), timeout=60).run_id
        stub.StartRun(pb.RunRef(run_id=run_id), timeout=30)
        out = tmp_path / "cancelled"
        assert cli_main(["run", "--analyzer", analyzer, "--cancel", run_id, "--out", str(out)]) == 0
        assert stub.GetRunStatus(pb.RunRef(run_id=run_id), timeout=10).state == pb.CANCELLED
    printed, err = capsys.readouterr()
    assert err == "" and f"run {run_id}: CANCELLED, " in printed, printed + err
    assert run_id in (out / "ledger.json").read_text() and (out / "metrics.json").exists()
    # again, on the ended run: nothing to cancel, its results fetched again
    assert cli_main(["run", "--analyzer", analyzer, "--cancel", run_id, "--out", str(out)]) == 0
    printed, _ = capsys.readouterr()
    assert printed.splitlines()[0] == f"not cancelled: run {run_id} already ended (CANCELLED)", printed
    assert f"run {run_id}: CANCELLED, " in printed


class _Cancels(grpc.ServerInterceptor):
    """The real analyzer, whose first calls of some methods end CANCELLED before they reach it: what an analyzer
    whose host is stopping (or a proxy on the way) does to the calls in flight, seen in the multi-host Swarm test."""

    def __init__(self, **first: int) -> None:
        self.left, self.lock = dict(first), threading.Lock()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        if handler is None or method not in self.left:
            return handler
        inner = handler.unary_unary

        def call(request, context):
            with self.lock:
                cancel = self.left[method] > 0
                self.left[method] -= cancel
            if cancel:
                context.abort(grpc.StatusCode.CANCELLED, "cancelled on the way")
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def test_operator_calls_ended_cancelled_are_repeated_and_the_run_completes(tmp_path):
    """The operator's StartRun, status polls and GetRunResult ending CANCELLED are repeated within the retry window
    (the CLI ended with "refused the run (CANCELLED)" while the run went on without it)."""
    config = digits_pgd(3)
    cancels = _Cancels(StartRun=1, GetRunStatus=2, GetRunResult=1)
    shuffler, sport = start_shuffler("127.0.0.1:0")
    analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state", interceptors=[cancels])
    node = start_node("n0", parse_config(config), 0, 1, f"127.0.0.1:{sport}")
    said: list[str] = []
    try:
        result = drive_run(f"127.0.0.1:{aport}", config, echo=said.append, give_up_s=60.0, call_timeout_s=10.0)
    finally:
        node.stop()
        analyzer.stop(0)
        shuffler.stop(0)
    assert result.status.state == pb.COMPLETED and result.status.rounds_done == 3, said
    assert cancels.left == {"StartRun": 0, "GetRunStatus": 0, "GetRunResult": 0}
    assert said.count("analyzer unreachable (CANCELLED), retrying for up to 60 s...") == 3, said


class _CancelsPopulation(grpc.aio.ServerInterceptor):
    """The real shuffler, whose first `n` GetPopulation calls end CANCELLED: what a shuffler that 10^4 devices connect
    to at once does to calls it has no time to pick up, the analyzer's among them (bench_devices.py, issue 44)."""

    def __init__(self, n: int) -> None:
        self.left = n

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.endswith("/GetPopulation"):
            return handler
        inner = handler.unary_unary

        async def call(raw, context):
            if self.left > 0:  # the server's one event loop: no lock
                self.left -= 1
                await context.abort(grpc.StatusCode.CANCELLED, "cancelled: not picked up in time")
            return await inner(raw, context)

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def test_the_analyzer_asks_the_population_again_when_the_shuffler_cancels_its_call(tmp_path):
    """GetPopulation ending CANCELLED (before planning and before each round) is asked again, like a shuffler out of
    reach, and the run completes; before, the first CANCELLED ended the run FAILED."""
    config = digits_pgd(3)
    cancels = _CancelsPopulation(4)
    shuffler, sport = start_shuffler("127.0.0.1:0", interceptors=[cancels])
    analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state")
    node = start_node("n0", parse_config(config), 0, 1, f"127.0.0.1:{sport}")
    said: list[str] = []
    try:
        result = drive_run(f"127.0.0.1:{aport}", config, echo=said.append, give_up_s=60.0, call_timeout_s=10.0)
    finally:
        node.stop()
        analyzer.stop(0)
        shuffler.stop(0)
    assert result.status.state == pb.COMPLETED and result.status.rounds_done == 3, (result.status.message, said)
    assert cancels.left == 0
