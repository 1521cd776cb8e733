"""`shuffledp run [CONFIG.toml]`: a whole experiment as separate OS processes on loopback.

Starts the shuffler, the analyzer and the configured number of client nodes (each `shuffledp serve ...`), creates and
starts the run through the analyzer's operator API, prints progress per round, and writes a results directory:
config.toml, metrics.csv, metrics.json, ledger.json, summary.json, model.npz (with its layout), plot.png, logs/.
Everything is stopped on success, failure and Ctrl-C; Ctrl-C (or SIGTERM/SIGHUP of the CLI) first cancels the run
and writes what the analyzer has. With no CONFIG the embedded default (digits, one example per user) runs.

With --analyzer it drives an already running deployment instead; `--fetch RUN_ID` writes the results directory of an
existing run, `--cancel RUN_ID` cancels a run first (one whose CLI was lost) and writes what it has. Operator calls
survive a slow or briefly unreachable analyzer (bounded retries); when the CLI gives up it says so in one line. Exit
status: 0 run COMPLETED (or results fetched), 1 the run ended otherwise, 2 bad usage, configuration or run id, 3 lost
the analyzer (or a local service died), 4 the run ended without releasing any round (every round refused by the
users' policy, below threshold or failed: the model is the initial one), 130 Ctrl-C.

A local run checks what its configuration and data decide alone before it starts anything: the data loads (every
label of data.classes occurs) and the analyzer's planner accepts the run for the data's users (check_before_start).
The results directory must be new or empty; --reuse-out runs in a used one, whose state/ (the users' recorded
spends, the ledger) then carries over.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np

from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

if TYPE_CHECKING:
    from shuffledp.config import RunConfig

STARTUP_TIMEOUT_S = 60.0
FLEET_PROCESSES = 2  # [deployment] users_per_node = 1: the device nodes of a local run, split over this many processes
POLL_S = 0.5
WAIT_MS = 1000  # GetRunStatus long poll; a dead local service is noticed between two polls
TERMINAL = {pb.COMPLETED, pb.FAILED, pb.CANCELLED, pb.BUDGET_EXHAUSTED}

# Operator calls to the analyzer: an analyzer restarting or stalled under load must not end the CLI at once, but the
# CLI must not hang for ever either.
GIVE_UP_S = 120.0  # continuous failure (a TRANSIENT code) after which the CLI gives up
CALL_TIMEOUT_S = 30.0  # per call (GetRunResult: twice this, it carries the model and the ledger)
CREATE_TIMEOUT_S = 60.0  # CreateRun at least this: it loads the data, and a timed-out CreateRun is never repeated
# ... and with a model plug-in ([model] module): CreateRun also imports its framework and builds it (JAX: ~20 s on
# an idle 2-core machine, minutes on a loaded one)
PLUGIN_CREATE_TIMEOUT_S = 600.0
# ... and per million synthetic examples (the analyzer draws the data set at CreateRun: a 10^7-example set took over
# 60 s on 2 cores while the nodes drew theirs)
SYNTHETIC_CREATE_S_PER_MILLION = 60.0
BACKOFF_FIRST_S = 0.5
# --analyzer: how long the CLI tries to reach it before it writes anything (a mistyped address or a deployment that is
# down fails in seconds, not after GIVE_UP_S, and leaves --out as it was); a deployment starting up answers within it
FIRST_CONTACT_S = 10.0
BACKOFF_CAP_S = 8.0
# CANCELLED too: an analyzer stopping (its host going down in a Swarm) or a proxy on the way ends the calls in flight
# with it, and every call repeated on it is one that may be repeated (CreateRun, the one that may not, retries
# UNAVAILABLE only)
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
METRICS_PORT_ENV = "SHUFFLEDP_METRICS_PORT"  # one `shuffledp serve`'s metrics port (serve.py); not a local run's
EXIT_LOST = 3  # exit status: lost the analyzer, or a service of a local run died
EXIT_NOTHING_RELEASED = 4  # exit status: the run ended and no round released an update (untrained model)
_JITTER = secrets.SystemRandom()  # jitter only; the project draws no randomness from `random`


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run an experiment: analyzer, shuffler and client nodes on loopback")
    parser.add_argument("config", nargs="?", type=Path, help="run configuration TOML (default: embedded digits run)")
    parser.add_argument("--out", type=Path, help="results directory (default: results/<config name>-<time>)")
    parser.add_argument(
        "--reuse-out",
        action="store_true",
        help="run in an --out DIR that is not empty (refused otherwise): its results and logs are replaced, and a "
        "local run keeps DIR/state, so the users' recorded spends (against their [policy] limits), the ledger and "
        "the shuffler's state of earlier runs there carry over",
    )
    parser.add_argument("--quiet", action="store_true", help="only the final summary")
    parser.add_argument(
        "--seed",
        type=int,
        metavar="N",
        help="a replayable local simulation: every service's randomness (sampling, noise, shuffles) is keyed from N, "
        "so the same N replays the run bit for bit, and its noise is known to anyone who holds N (refused with "
        "--analyzer or a PKI: research runs only)",
    )
    parser.add_argument(
        "--print-default",
        action="store_true",
        help="print the embedded default configuration (every key, commented) and exit: a start for your own",
    )
    parser.add_argument(
        "--protocol",
        metavar="NAME",
        help="with --print-default: a run of protocol NAME instead (its table [privacy.NAME] and its example keys)",
    )
    parser.add_argument(
        "--analyzer",
        help="drive an already running deployment at HOST:PORT (e.g. docker compose) instead of starting processes",
    )
    parser.add_argument(
        "--pki", type=Path, help="with --analyzer: PKI directory; connects with the operator certificate"
    )
    parser.add_argument(
        "--server-name", default="analyzer", help="with --pki: name expected in the analyzer certificate"
    )
    parser.add_argument(
        "--tensorboard",
        type=Path,
        metavar="DIR",
        help="also log the run for TensorBoard in DIR/<results directory name>: per-round loss, accuracy, eps spent, "
        "contributors and refusals, the configuration and the final spend (optional extra 'tracking')",
    )
    parser.add_argument(
        "--mlflow",
        nargs="?",
        const=True,
        metavar="URI",
        help="also log the run in MLflow (as [tracking] mlflow, which this overrides): without URI a store in the "
        "results directory (mlflow/mlflow.db), else a tracking URI (sqlite:///PATH/mlflow.db, http://HOST:5000); "
        "params, per-round metrics, the results as artifacts (optional extra 'mlflow')",
    )
    parser.add_argument(
        "--fetch",
        metavar="RUN_ID",
        help="with --analyzer: write the results directory of an existing run (default --out: results/RUN_ID)",
    )
    parser.add_argument(
        "--cancel",
        metavar="RUN_ID",
        help="with --analyzer: cancel an existing run (e.g. one whose CLI was lost; one that ended already stays as "
        "it is) and write its results as --fetch does",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="BASE",
        default=0,
        help="a local run's services serve Prometheus metrics (plain HTTP on 127.0.0.1, /metrics) on ports BASE "
        "(shuffler), BASE+1 (analyzer), BASE+2+i (client-i); printed at start. Default 0: off",
    )
    parser.set_defaults(func=_run_command)


class ServiceFailed(RuntimeError):
    """A service process of a local run exited or never started; str() carries its log tail, `summary` and `log`
    make the one line the CLI prints."""

    def __init__(self, name: str, what: str, log: Path, tail: str):
        super().__init__(f"{name} {what}:\n{tail}")
        self.name, self.log = name, log
        self.summary = f"{name} {what}"


@dataclass
class Cluster:
    """The service processes of one local run; stop() always terminates all of them."""

    workdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: list = field(default_factory=list)
    # a pipe whose read end every service watches (serve --parent-fd) and whose write end only this process holds
    # (os.pipe's are not inherited): it closes when this process ends in any way (kill -9, the OOM killer, a notebook
    # kernel's restart), and the services then stop, the analyzer cancelling its run first; their process group of
    # their own keeps every signal of the CLI from them
    lifeline: tuple[int, ...] = field(default_factory=os.pipe)
    # --metrics-port BASE: each service serves its metrics on the next port from BASE, in the order started (shuffler,
    # analyzer, client-0, ...); 0 = off. metrics_ports: name -> port
    metrics_port: int = 0
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def spawn(self, name: str, argv: list[str], metrics: bool = True) -> Path:
        port_file = self.workdir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log = open(self.workdir / "logs" / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self.logs.append(log)
        watch = self.lifeline[0]
        cmd = [sys.executable, "-m", "shuffledp.cli", "serve", *argv, "--port-file", str(port_file)]
        cmd += ["--parent-fd", str(watch)]
        if self.metrics_port and metrics:
            self.metrics_ports[name] = self.metrics_port + len(self.procs)
            cmd += ["--metrics-port", str(self.metrics_ports[name])]
        # one port for one service: every service of the run would take it, and all but the first fail to start
        env = {k: v for k, v in os.environ.items() if k != METRICS_PORT_ENV}
        # a process group of its own: a terminal's Ctrl-C reaches only the CLI, which cancels the run, fetches
        # what exists from the analyzer and then stops the services (the same group would stop them first)
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0, pass_fds=(watch,)
        )
        return port_file

    def wait_port(self, name: str, port_file: Path) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if port_file.exists():
                return int(port_file.read_text())
            if self.procs[name].poll() is not None:
                raise ServiceFailed(name, "exited during start-up", self.log_path(name), self.log_tail(name))
            time.sleep(0.05)
        what = f"did not start within {STARTUP_TIMEOUT_S:.0f} s"
        raise ServiceFailed(name, what, self.log_path(name), self.log_tail(name))

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_path(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                what = f"exited unexpectedly (status {proc.returncode})"
                raise ServiceFailed(name, what, self.log_path(name), self.log_tail(name))

    def terminate(self) -> None:
        """Ask every service to stop (SIGTERM) without waiting; stop() waits."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()

    def stop(self) -> None:
        self.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        for fd in self.lifeline:
            os.close(fd)
        self.lifeline = ()  # a second stop() must not close numbers reused since
        for name in self.procs:
            (self.workdir / f"{name}.port").unlink(missing_ok=True)


def start_local_cluster(
    config_path: Path,
    workdir: Path,
    client_nodes: int,
    with_analyzer: bool = True,
    pki: Path | None = None,
    wait_nodes: bool = True,
    metrics_port: int = 0,
    fleets: int = 0,
    seed: int | None = None,
) -> tuple[Cluster, str, str | None]:
    """Start shuffler, analyzer (unless with_analyzer=False: the caller plays it) and client nodes as processes;
    returns (cluster, shuffler address, analyzer address or None) once they serve (with wait_nodes=False, once the
    shuffler and analyzer do: the nodes may still be starting, and Cluster.check_alive reports one that fails). A
    node that serves may not be connected at the shuffler yet: a caller that needs its users in a round waits for
    the shuffler's own count (GetPopulation), as the analyzer does before planning. With
    `pki` (a `shuffledp pki init` directory) every hop is mTLS with role checks, as in a deployment; without it,
    plain text on loopback. `metrics_port` BASE: the services serve their metrics on BASE, BASE + 1, ... (shuffler,
    analyzer, client-0, ...: Cluster.metrics_ports). With `fleets` > 0 the client nodes are device nodes, one user
    each, run by that many `serve fleet` processes (fleet-0, ...: consecutive ranges of nodes; no metrics yet). With
    `seed` (no `pki`), a seeded simulation: every service's generators are keyed from it (serve --simulation-seed)."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    cluster = Cluster(workdir, metrics_port=metrics_port)
    analyzer = None
    try:
        sec = ["--insecure"] if pki is None else ["--pki", str(pki.resolve())]
        sec += [] if seed is None else ["--simulation-seed", str(seed)]  # serve refuses it with --pki
        from shuffledp.transport import grpc_options

        # the configured nodes always fit: its default capacity (10^4) only grows with client_nodes here
        capacity = ["--max-nodes", str(max(client_nodes, grpc_options.DEFAULT_MAX_NODES))]
        # all at once: the others import while the shuffler starts and read its port from its port file
        shuffler_pf = cluster.spawn("shuffler", ["shuffler", *sec, *capacity, "--state-dir", str(workdir / "state")])
        at_shuffler = ["--shuffler-port-file", str(shuffler_pf)]
        if with_analyzer:
            analyzer_pf = cluster.spawn(
                "analyzer", ["analyzer", *sec, *at_shuffler, "--state-dir", str(workdir / "state")]
            )
        # the users' spend is kept by their node (clients/spend_store.py) in the state directory
        nodes = [*sec, *at_shuffler, "--config", str(config_path), "--state-dir", str(workdir / "state")]
        at = ["--num-nodes", str(client_nodes)]
        if fleets:
            size = -(-client_nodes // fleets)
            node_files = {
                f"fleet-{j}": cluster.spawn(
                    f"fleet-{j}",
                    [
                        "fleet",
                        *nodes,
                        *at,
                        "--first-index",
                        str(first),
                        "--count",
                        str(min(size, client_nodes - first)),
                    ],
                    metrics=False,
                )
                for j, first in enumerate(range(0, client_nodes, size))
            }
        else:
            node_files = {
                f"client-{i}": cluster.spawn(f"client-{i}", ["client", *nodes, *at, "--node-index", str(i)])
                for i in range(client_nodes)
            }
        shuffler = f"127.0.0.1:{cluster.wait_port('shuffler', shuffler_pf)}"
        if with_analyzer:
            analyzer = f"127.0.0.1:{cluster.wait_port('analyzer', analyzer_pf)}"
        for name, pf in node_files.items() if wait_nodes else ():
            cluster.wait_port(name, pf)
    except BaseException:
        cluster.stop()
        raise
    return cluster, shuffler, analyzer


def _round_label(m: pb.RoundMetrics, planned: int) -> str:
    if m.round < planned or not planned:
        return f"round {m.round + 1:>4}/{planned}"
    # a protocol that releases only its last iterate (PNSGD, one planned round) runs an unreleased round again: the
    # same planned round, another attempt, not a round beyond the plan
    return f"round {planned:>4}/{planned} (attempt {m.round + 2 - planned})"


def _num(x: float, width: int, digits: int) -> str:
    """A figure of a progress line; "n/a" where it is not defined (hidden iterates, no integer labels), never nan."""
    return f"{x:{width}.{digits}f}" if math.isfinite(x) else f"{'n/a':>{width}}"


def _progress_line(m: pb.RoundMetrics, planned: int) -> str:
    # why users are missing: they refused the round (by the reason their node gave: a [policy] limit it names, or
    # a delivery failure), or their messages were rejected (by reason, at the shuffler or the analyzer)
    why = []
    if m.refused:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(m.refused_reasons.items()))
        why.append(f"{m.refused} users refused" + (f": {reasons}" if reasons else ""))
    if m.not_in_run:
        why.append(f"{m.not_in_run} users joined after the run's first round: not in this run")
    if m.checked_in > m.contributors:  # check-in rounds: dropouts between check-in and message
        why.append(f"{m.checked_in - m.contributors} of {m.checked_in} checked-in users did not report")
    if m.excluded_silent:
        why.append(f"{m.excluded_silent} users not invited: they checked in and then sent nothing in an earlier round")
    if m.rejected:
        why.append("rejected " + ", ".join(f"{k}={v}" for k, v in sorted(m.rejected.items())))
    if not m.released:
        cause = m.failure or f"below threshold: {m.contributors} contributors"
        detail = "; ".join([cause, *why])
        return f"{_round_label(m, planned)}  NOT RELEASED ({detail})"
    return (
        f"{_round_label(m, planned)}  contributors {m.contributors:>6}  loss {_num(m.loss, 8, 4)}  "
        f"accuracy {_num(m.accuracy, 6, 3)}  eps spent {m.eps_spent:7.4f}  ({m.seconds:5.2f} s)"
        + "".join(f"  [{w}]" for w in why)
    )


def operator_channel(analyzer: str, pki: Path | None = None, server_name: str = "analyzer") -> grpc.Channel:
    """Channel of the operator to the analyzer: mTLS with the operator certificate, or plain text on loopback."""
    from shuffledp.transport import grpc_options, tls

    options = grpc_options.operator_channel_options()
    if pki is None:
        return tls.ChannelSecurity.insecure_loopback("operator", "operator").channel(analyzer, options=options)
    return tls.ChannelSecurity(pki, "operator", "operator").channel(analyzer, server_name=server_name, options=options)


def fetch_command(analyzer: str, run_id: str, pki: Path | None = None, server_name: str = "analyzer") -> str:
    """The command line that fetches a run's results later."""
    parts = ["shuffledp run --analyzer", analyzer]
    if pki is not None:
        parts += ["--pki", str(pki)]
        if server_name != "analyzer":
            parts += ["--server-name", server_name]
    return " ".join([*parts, "--fetch", run_id])


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while a run was driven: the run was cancelled; `result` is what the analyzer had (status, ledger,
    metrics, and the model unless it releases only a completed run), None if it did not answer."""

    def __init__(self, run_id: str, result: pb.RunResult | None):
        super().__init__(run_id)
        self.run_id, self.result = run_id, result


def _cancel_and_fetch(stub: pbg.AnalyzerStub, ref: pb.RunRef, config_toml: str) -> pb.RunResult | None:
    """After Ctrl-C: cancel the run, then fetch its result (status, ledger, metrics, model); a hidden-iterate run
    that did not complete has no model. None if the analyzer does not answer or Ctrl-C is pressed again."""
    try:
        with contextlib.suppress(grpc.RpcError):
            stub.CancelRun(ref, timeout=10)
        try:
            return stub.GetRunResult(ref, timeout=30)
        except grpc.RpcError:
            pass
        try:  # no result to give (e.g. not planned yet): the status still carries the metrics and the spend
            return pb.RunResult(status=stub.GetRunStatus(ref, timeout=10), config_toml=config_toml)
        except grpc.RpcError:
            return None
    except KeyboardInterrupt:
        return None


class AnalyzerLost(Exception):
    """The CLI gave up on the analyzer: it stayed unreachable or too slow for the whole retry window, or a CreateRun
    timed out (never repeated). `during` says what the CLI was doing ("" before any run existed)."""

    def __init__(self, analyzer: str, code: grpc.StatusCode, details: str, waited_s: float):
        self.analyzer, self.code, self.details, self.waited_s = analyzer, code, details, waited_s
        self.run_id = ""
        self.outcome = "no run was created"  # what came of the command when no run was reached
        self.during = ""
        super().__init__(analyzer, code, details)

    def __str__(self) -> str:
        return self.what()

    def what(self) -> str:
        """One sentence, without how to resume (that depends on who drove the run)."""
        cause = f"{self.code.name}: {self.details}" if self.details else self.code.name
        if self.run_id:
            return f"lost contact with the analyzer at {self.analyzer} ({cause}) {self.during}"
        if self.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return (
                f"CreateRun at the analyzer {self.analyzer} timed out ({cause}); not repeated, since the analyzer "
                "may have created the run anyway (it would stay CREATED and spend nothing); try again later"
            )
        return f"cannot reach the analyzer at {self.analyzer} ({cause}) for {self.waited_s:.0f} s; {self.outcome}"


def _during(run_id: str, status: pb.RunStatus | None) -> str:
    if status is None or status.state == pb.CREATED:
        return f"while starting run {run_id}"
    if status.state == pb.RUNNING:
        planned = status.rounds_planned
        at = f" (round {min(status.rounds_done + 1, planned)}/{planned})" if planned else ""
        return f"while run {run_id} was RUNNING{at}"
    return f"while fetching the results of run {run_id} ({pb.RunState.Name(status.state)})"


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.Call) else None


def _first_line(exc: grpc.RpcError) -> str:
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or ""
    return details.strip().splitlines()[0] if details.strip() else ""


class _Retrying:
    """Operator calls that outlast a restarting or overloaded analyzer: a call failing with a transient code is
    repeated with capped, jittered exponential backoff until `give_up_s` of continuous failure, then AnalyzerLost.
    One line when the analyzer becomes unreachable and one when it answers again, not one per attempt."""

    def __init__(
        self,
        analyzer: str,
        echo: Callable[[str], object],
        give_up_s: float,
        on_retry: Callable[[], None] | None = None,
    ):
        self.analyzer, self.echo, self.give_up_s, self.on_retry = analyzer, echo, give_up_s, on_retry
        self.failing_since: float | None = None  # spans calls: the window is continuous failure, not per call
        self.retried = False  # the last call was repeated at least once

    def call(self, method: Callable, request: object, timeout: float, retry_on: frozenset = TRANSIENT):
        attempt = 0
        self.retried = False
        while True:
            try:
                response = method(request, timeout=timeout)
            except grpc.RpcError as exc:
                code = _code(exc)
                if code not in retry_on:
                    raise
                if self.on_retry is not None:
                    self.on_retry()  # local run: a dead analyzer process is reported at once, not after the window
                now = time.monotonic()
                if self.failing_since is None:
                    self.failing_since = now
                    self.echo(f"analyzer unreachable ({code.name}), retrying for up to {self.give_up_s:.0f} s...")
                left = self.failing_since + self.give_up_s - now
                if left <= 0:
                    raise AnalyzerLost(self.analyzer, code, _first_line(exc), now - self.failing_since) from None
                delay = min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2**attempt) * _JITTER.uniform(0.5, 1.0)
                time.sleep(min(left, delay))
                attempt += 1
                self.retried = True
                continue
            if self.failing_since is not None:
                self.failing_since = None
                self.echo("analyzer reachable again")
            return response


RunStep = tuple[pb.RunStatus, Sequence[pb.RoundMetrics], int]  # a status, its rounds not seen before, rounds seen


def drive_run(
    analyzer: str,
    config_toml: str,
    cluster: Cluster | None = None,
    echo: Callable[[str], object] = print,
    pki: Path | None = None,
    server_name: str = "analyzer",
    *,
    give_up_s: float = GIVE_UP_S,
    call_timeout_s: float = CALL_TIMEOUT_S,
    on_status: Callable[[pb.RunStatus, Sequence[pb.RoundMetrics], int], object] | None = None,
) -> pb.RunResult:
    """Create and start a run on the analyzer, report progress until it ends, return its result. `on_status` sees
    every status as it arrives, with its rounds not seen before and the number of rounds seen in all (run tracking,
    the live view); Ctrl-C in it cancels the run as anywhere else.

    Transient failures are retried for up to `give_up_s` of continuous failure (each call waits `call_timeout_s`);
    then AnalyzerLost (with run_id and what was going on). Other RPC errors propagate; a dead process of a local
    `cluster` raises ServiceFailed."""
    steps = drive_steps(
        analyzer, config_toml, cluster, echo, pki, server_name, give_up_s=give_up_s, call_timeout_s=call_timeout_s
    )
    next(steps)  # the run started, no round yet
    return follow_steps(steps, on_status)


def follow_steps(
    steps: Generator[RunStep, None, pb.RunResult],
    on_status: Callable[[pb.RunStatus, Sequence[pb.RoundMetrics], int], object] | None = None,
) -> pb.RunResult:
    """Drive a drive_steps generator to its end, each step shown to `on_status`; its result. Ctrl-C while
    `on_status` runs is thrown into the generator, which cancels the run and raises Interrupted."""
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            return done.value
        if on_status is None:
            continue
        try:
            on_status(*step)
        except KeyboardInterrupt:
            steps.throw(KeyboardInterrupt())


def drive_steps(
    analyzer: str,
    config_toml: str,
    cluster: Cluster | None = None,
    echo: Callable[[str], object] = print,
    pki: Path | None = None,
    server_name: str = "analyzer",
    *,
    give_up_s: float = GIVE_UP_S,
    call_timeout_s: float = CALL_TIMEOUT_S,
    on_created: Callable[[str], object] | None = None,
) -> Generator[RunStep, None, pb.RunResult]:
    """drive_run as a generator: create and start the run (`on_created` gets its id), yield (status, (), 0) once it
    is started, then every status as it arrives with its rounds not seen before and the number of rounds seen in
    all; return (StopIteration.value) the run's result. A KeyboardInterrupt raised in it, or thrown into it
    (generator.throw) while it waits at a yield, cancels the run and raises Interrupted with what the analyzer had.
    Errors as drive_run's."""
    run_id, status = "", None
    with operator_channel(analyzer, pki, server_name) as channel:
        stub = pbg.AnalyzerStub(channel)
        rpc = _Retrying(analyzer, echo, give_up_s, cluster.check_alive if cluster is not None else None)
        try:
            # CreateRun is not idempotent: a call that timed out may have created a run, so only a call that never
            # got through (UNAVAILABLE) is repeated; a timeout ends the CLI with one line (AnalyzerLost, no run id)
            try:
                status = rpc.call(
                    stub.CreateRun,
                    pb.CreateRunRequest(config_toml=config_toml),
                    max(call_timeout_s, _create_timeout(config_toml)),
                    retry_on=frozenset({grpc.StatusCode.UNAVAILABLE}),
                )
            except grpc.RpcError as exc:
                if _code(exc) == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise AnalyzerLost(analyzer, grpc.StatusCode.DEADLINE_EXCEEDED, _first_line(exc), 0.0) from None
                raise
            run_id = status.run_id
            ref = pb.RunRef(run_id=run_id)
            hint = f"  (fetch its results again with: {fetch_command(analyzer, run_id, pki, server_name)})"
            echo(f"run id: {run_id}" + (hint if cluster is None else ""))
            if on_created is not None:
                on_created(run_id)
            try:  # from here a Ctrl-C cancels the run and fetches what it has
                try:
                    status = rpc.call(stub.StartRun, ref, call_timeout_s)
                except grpc.RpcError as exc:
                    # a repeated StartRun after a first attempt that did arrive: the run is started, as asked
                    if not (rpc.retried and _code(exc) == grpc.StatusCode.FAILED_PRECONDITION):
                        raise
                shown, message = 0, status.message if status.state == pb.RUNNING else ""
                if message:
                    echo(f"  [analyzer] {message}")
                yield status, (), 0
                while True:
                    # long poll: the analyzer answers when the run differs from what was shown, or after WAIT_MS
                    asked = time.monotonic()
                    seen = dict(seen_rounds=shown, seen_state=status.state, seen_message=message)
                    # only the metrics not shown yet are sent (an older analyzer sends all: metrics_from = 0)
                    poll = pb.RunRef(run_id=run_id, wait_ms=WAIT_MS, metrics_from=shown, **seen)
                    status = rpc.call(stub.GetRunStatus, poll, call_timeout_s + WAIT_MS / 1000)
                    have = status.metrics_from + len(status.metrics)
                    news = (have, status.state, status.message) != tuple(seen.values())
                    new = status.metrics[shown - status.metrics_from :]
                    for m in new:
                        echo(_progress_line(m, status.rounds_planned))
                    yield status, new, have
                    shown = have
                    # what the analyzer is waiting for (population, an unreachable shuffler): only when it changes
                    if status.state == pb.RUNNING and status.message != message:
                        message = status.message
                        if message:
                            echo(f"  [analyzer] {message}")
                    if status.state in TERMINAL:
                        break
                    if cluster is not None:
                        cluster.check_alive()
                    if not news and time.monotonic() - asked < WAIT_MS / 2000:
                        time.sleep(POLL_S)  # an analyzer that does not wait (older version): poll
                return rpc.call(stub.GetRunResult, ref, 2 * call_timeout_s)
            except KeyboardInterrupt:
                echo("interrupted: cancelling the run and fetching what it has")
                raise Interrupted(run_id, _cancel_and_fetch(stub, ref, config_toml)) from None
        except AnalyzerLost as lost:
            if run_id:
                lost.run_id, lost.during = run_id, _during(run_id, status)
            raise


def check_reachable(
    analyzer: str,
    pki: Path | None = None,
    server_name: str = "analyzer",
    echo: Callable[[str], object] = print,
    *,
    wait_s: float = FIRST_CONTACT_S,
) -> None:
    """Return once the analyzer answers (its gRPC health service, open to the operator's role); AnalyzerLost (no run
    id) when nothing does within `wait_s`. Any answer counts, even a refusal: the run's own calls then say more."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shuffledp.transport import grpc_options, tls

    # plain text: without the insecure mode's warning, which the run's own channel gives (_plain_text_refused has
    # checked the address)
    options = grpc_options.operator_channel_options()
    plain = pki is None
    with tls.plain_channel(analyzer, options) if plain else operator_channel(analyzer, pki, server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with contextlib.suppress(grpc.RpcError):  # an answer that is no transient failure
            _Retrying(analyzer, echo, wait_s).call(stub.Check, health_pb2.HealthCheckRequest(), wait_s / 4)


def fetch_result(
    analyzer: str,
    run_id: str,
    pki: Path | None = None,
    server_name: str = "analyzer",
    echo: Callable[[str], object] = print,
    *,
    give_up_s: float = GIVE_UP_S,
    call_timeout_s: float = CALL_TIMEOUT_S,
    cancel: bool = False,
) -> pb.RunResult:
    """GetRunResult of an existing run, with the retries of drive_run (AnalyzerLost when it gives up); with `cancel`,
    CancelRun first (a run that ended already is left as it is, and says so)."""
    try:  # nothing answering there: AnalyzerLost within seconds, not after give_up_s
        check_reachable(analyzer, pki, server_name, echo)
    except AnalyzerLost as lost:
        lost.outcome = f"run {run_id} was not {'cancelled' if cancel else 'fetched'}"
        raise
    ref = pb.RunRef(run_id=run_id)
    with operator_channel(analyzer, pki, server_name) as channel:
        stub = pbg.AnalyzerStub(channel)
        rpc = _Retrying(analyzer, echo, give_up_s)
        try:
            if cancel:
                try:
                    rpc.call(stub.CancelRun, ref, call_timeout_s)
                except grpc.RpcError as exc:
                    # ended already (or by a first attempt that did arrive): nothing left to cancel
                    if _code(exc) != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    echo(f"not cancelled: {_first_line(exc)}")
            return rpc.call(stub.GetRunResult, ref, 2 * call_timeout_s)
        except AnalyzerLost as lost:
            lost.run_id, lost.during = run_id, f"while {'cancelling' if cancel else 'fetching'} run {run_id}"
            raise


def metrics_row(m: pb.RoundMetrics) -> dict:
    """One round's figures as metrics.json holds them (metrics.csv: the same, `rejected` flattened)."""
    return {
        "round": m.round + 1,
        "contributors": m.contributors,
        "released": m.released,
        "loss": m.loss,
        "accuracy": m.accuracy,
        "eps_spent": m.eps_spent,
        "delta_spent": m.delta_spent,
        **({"excess_risk": m.excess_risk} if m.HasField("excess_risk") else {}),
        **({"eps_spent_local": m.eps_spent_local} if m.HasField("eps_spent_local") else {}),
        "seconds": m.seconds,
        "refused": m.refused,
        "not_in_run": m.not_in_run,
        "checked_in": m.checked_in,
        "excluded_silent": m.excluded_silent,
        "rejected": dict(sorted(m.rejected.items())),
    }


def write_results(
    out: Path, config_toml: str, result: pb.RunResult, *, interrupted: bool = False, seed: int | None = None
) -> None:
    """Write everything a run produced (a cancelled or interrupted run: what exists); never raises half-way silently
    (a missing plot is reported, not fatal)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(config_toml)
    rows = [metrics_row(m) for m in result.status.metrics]
    (out / "metrics.json").write_text(json.dumps(rows, indent=2))
    with open(out / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["round"])
        writer.writeheader()
        # CSV cells are flat: rejected as "reason=count;reason=count"
        writer.writerows({**row, "rejected": ";".join(f"{k}={v}" for k, v in row["rejected"].items())} for row in rows)
    if result.ledger_json:
        (out / "ledger.json").write_text(result.ledger_json)
    plan = _plan_of(result)
    released = _released(result)
    layout = None
    if released is not None:
        layout = model_layout(plan, config_toml, released.size)
        np.savez(out / "model.npz", params=released, layout=json.dumps(layout), **_named_arrays(released, layout))
        if "model_layout" in plan:
            _export_plugin(out, config_toml, plan, released)
    summary = run_summary(result, plan, layout, interrupted=interrupted, seed=seed)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    try:
        _plot(out / "plot.png", rows, summary)
    except Exception as exc:  # the data files above are written already; a plotting failure must not lose them
        print(f"warning: plot not written: {exc}", file=sys.stderr)


def _export_plugin(out: Path, config_toml: str, plan: dict, released: np.ndarray) -> None:
    """The released model in its framework's own form too (ModelPlugin.export; Flax: model.msgpack), built from
    what is installed here; a warning (model.npz is written already) when it cannot be."""
    from shuffledp.config import parse_config
    from shuffledp.models.plugin import build_model

    try:
        model = build_model(parse_config(config_toml).model, plan["num_features"], plan["num_classes"])
        written = model.export(released, out)
    except Exception as exc:  # noqa: BLE001 - the plug-in's own code: whatever it raises, the results stay written
        print(
            f"warning: {plan.get('model_name')}: only model.npz written: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return
    for name in written:
        print(f"released model also in {out / name}")


def _plan_of(result: pb.RunResult) -> dict:
    """The analyzer's plan of the run, from its ledger export ({} before the run was planned)."""
    if not result.ledger_json:
        return {}
    try:
        return json.loads(result.ledger_json).get("run", {}).get("plan") or {}
    except ValueError:
        return {}


def _initial_of(result: pb.RunResult) -> dict:
    """theta_0's held-out metrics from the ledger export ({} from an analyzer that does not export them)."""
    try:
        return json.loads(result.ledger_json).get("initial_model") or {} if result.ledger_json else {}
    except ValueError:
        return {}


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def baseline_line(summary: dict) -> str:
    """The final summary's line of the run's baseline ("" when the analyzer gave none)."""
    base = summary.get("baseline") or {}
    init, majority = base.get("initial_model") or {}, base.get("majority_class_accuracy")
    parts = [f"{k} {init[k]:.4f}" for k in ("accuracy", "loss") if init.get(k) is not None]
    text = f"initial model theta_0: {', '.join(parts)}" if parts else ""
    if majority is not None:
        text += f"{'; ' if text else ''}always the majority class: accuracy {majority:.4f}"
    return f"baseline: {text}" if text else ""


def _released(result: pb.RunResult) -> np.ndarray | None:
    """The released model, or None when the analyzer sent none (nothing released yet, or hidden iterates of a run
    that did not complete)."""
    if not result.HasField("model") or not result.model.f64:
        return None
    return np.frombuffer(result.model.f64, dtype="<f8").reshape(tuple(result.model.shape) or (-1,))


def _class_labels(config_toml: str, task: str) -> list[int] | None:
    """The data label of each class index (None: a file's distinct labels, in increasing order; the CLI does not read
    the data). Mirrors shuffledp.data.load_dataset: data.classes in the order given, else the sorted labels."""
    if task not in ("logreg", "mlp", "hinge"):
        return None
    from shuffledp.config import ConfigError, parse_config

    try:
        data = parse_config(config_toml).data
    except ConfigError:
        return None
    if data.classes:
        return list(data.classes)
    return {"digits": list(range(10)), "mnist5k": list(range(10)), "synthetic": [0, 1]}.get(data.dataset)


def model_layout(plan: dict, config_toml: str, size: int) -> dict:
    """How the flat parameter vector of model.npz is laid out (shuffledp.models.Model): its task, the named arrays
    it splits into and what their rows and columns mean."""
    task = plan.get("task", "")
    f, c, h = int(plan.get("num_features", 0)), int(plan.get("num_classes", 1)), int(plan.get("hidden", 0))
    if "model_layout" in plan:  # a model plug-in: its own segments, in order (shuffledp.models.ModelPlugin.layout)
        arrays = {seg["name"]: list(seg["shape"]) for seg in plan["model_layout"]}
        how = f"the plug-in {plan.get('model_name')} (digest {plan.get('model_digest')}): its framework's own file"
    elif task == "logreg":
        arrays = {"W": [c, f + 1]}
        how = "scores = W @ [x, 1]; predicted class index = argmax"
    elif task == "mlp":
        arrays = {"W1": [h, f + 1], "W2": [c, h + 1]}
        how = "h = tanh(W1 @ [x, 1]); scores = W2 @ [h, 1]; predicted class index = argmax"
    elif task == "hinge":
        arrays = {"w": [f + 1]}
        how = "class index 1 where w @ [x, 1] > 0, else 0"
    elif task == "distance":
        arrays = {"w": [f]}
        how = "the point theta itself (loss ||theta - x||)"
    elif task:
        arrays = {"w": [f + 1]}
        how = "prediction = w @ [x, 1]"
    else:
        arrays = {}
        how = "unknown (the run was not planned)"
    layout = {
        "task": task,
        "num_features": f,
        "num_classes": c,
        "hidden": h,
        "params": [size],
        "arrays": arrays,
        "bias": "last column" if task not in ("distance", "") else "none",
        "predict": how,
        "class_labels": _class_labels(config_toml, task or ("logreg" if "model_layout" in plan else "")),
    }
    if "model_layout" in plan:
        layout.update(model=plan.get("model_name"), model_digest=plan.get("model_digest"), bias="see arrays")
    if sum(math.prod(s) for s in arrays.values()) != size:  # a protocol with another layout: say so, keep params
        layout["arrays"] = {}
        layout["predict"] = f"unknown layout: {size} parameters"
    return layout


def _named_arrays(params: np.ndarray, layout: dict) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for name, shape in layout["arrays"].items():
        k = math.prod(shape)
        out[name] = params[at : at + k].reshape(shape)
        at += k
    return out


def accuracy_note(task: str, accuracy: float) -> str:
    """What to print instead of a NaN accuracy: why the model's accuracy was not evaluated."""
    if not math.isnan(accuracy):
        return ""
    if task == "distance":
        return "not evaluated (the distance task has no labels)"
    if task in ("leastsq", "absolute"):
        return "not evaluated (the targets are not integer labels: see the loss)"
    return "not evaluated"


def run_summary(
    result: pb.RunResult, plan: dict, layout: dict | None, *, interrupted: bool = False, seed: int | None = None
) -> dict:
    """summary.json: the released model's held-out figures, the planner's choices and the final spend (and a seeded
    simulation's seed, with what it means)."""
    s, b = result.status, result.status.budget
    task = plan.get("task", "")
    model = None
    if layout is not None:
        note = accuracy_note(task, result.accuracy)
        model = {
            "file": "model.npz",
            "loss": result.loss,
            "accuracy": None if note else result.accuracy,
            **({"accuracy_note": note} if note else {}),
            "excess_risk": result.excess_risk if result.HasField("excess_risk") else None,
            "output": plan.get("output", "mean"),
            "layout": layout,
        }
    why = (
        ""
        if model
        else (
            "hidden iterates: the model is released only when the run completes"
            if plan.get("hidden_iterates")
            else "no round was released"
        )
    )
    optimizer = plan.get("optimizer") or {}
    initial = _initial_of(result)
    return {
        "run_id": s.run_id,
        "state": pb.RunState.Name(s.state),
        "message": s.message,
        "interrupted": interrupted,
        **({"seed": seed, "seed_note": SEED_NOTE} if seed is not None else {}),
        "rounds_done": s.rounds_done,
        "rounds_planned": s.rounds_planned,
        "released_model": model,
        **({"no_model": why} if why else {}),
        # what the released figures are read against: theta_0's, and always predicting the majority label
        "baseline": {
            "initial_model": {k: _finite_or_none(initial.get(f"{k}_mean")) for k in ("loss", "accuracy")},
            "majority_class_accuracy": initial.get("majority_accuracy"),
        },
        "plan": {
            "protocol": plan.get("protocol"),
            "schedule": plan.get("kind"),
            "optimizer": optimizer.get("name"),
            "rounds": plan.get("rounds"),
            "cohort": plan.get("cohort"),
            "min_contributors": plan.get("min_contributors"),
            "sampling_rate": plan.get("sampling_rate") or None,
            "learning_rate": plan.get("learning_rate"),
            "radius": plan.get("radius"),
            "eps": plan.get("eps"),
            "delta": plan.get("delta"),
            # the protocol's own sizing: PVEC's (g, m, p), an LDP randomizer's eps0, a noise multiplier z, ...
            "protocol_params": plan.get("params"),
            "check_in": plan.get("check_in"),
        },
        "spend": {
            "eps": b.eps_spent,
            "delta": b.delta_spent,
            "eps_with_round_in_flight": b.eps_reserved,  # the ledger's total with the rounds reserved now
            "eps_limit": b.eps_limit,
            "delta_limit": b.delta_limit,
            "accountant": b.accountant,
            "trust_model": pb.TrustModel.Name(b.trust_model),
            "eps_robust": b.eps_spent_robust if b.honest_fraction < 1.0 else None,
            "honest_fraction": b.honest_fraction,
            "views": dict(sorted(b.views.items())),
        },
    }


def _finite(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["round"], r[key]) for r in rows if r["released"] and key in r and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot(path: Path, rows: list[dict], summary: dict) -> dict[str, list[str]]:
    """Held-out loss (and excess risk where known), accuracy where it is defined, and the eps spent, against rounds;
    the released model's figures as a dashed line (it is the mean of the iterates unless output = "last", so it
    differs from the last round's point). Hidden-iterate runs have no per-round figures: the plot says so.
    Returns what it drew: {"panels": [metric, ...], "notes": [text, ...]}."""
    # a Figure of its own, without pyplot: the caller's backend (a notebook's inline one) is left as it was
    from matplotlib.figure import Figure

    model = summary.get("released_model") or {}
    panels = [("loss", "held-out loss"), ("excess_risk", "excess risk"), ("accuracy", "held-out accuracy")]
    per_round = any(_finite(rows, k)[0] for k, _ in panels)
    shown = [(k, label) for k, label in panels if _finite(rows, k)[0] or model.get(k) is not None]
    n = len(shown) + (0 if per_round else 1) + 1  # a line of text where no round has figures; eps at the bottom
    fig = Figure(figsize=(7, 2.4 * n))
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    last = max((r["round"] for r in rows), default=1)
    drawn: dict[str, list[str]] = {"panels": [k for k, _ in shown] + ["eps_spent"], "notes": []}
    if not per_round:
        hidden = summary.get("plan", {}).get("protocol") in ("pnsgd", "pnsgd_online")
        why = "iterates are hidden (spec 004): no per-round figures" if hidden else "no per-round figures"
        figures = ", ".join(f"{k} {model[k]:.4g}" for k, _ in panels if model.get(k) is not None)
        what = f"released model: {figures}" if model else summary.get("no_model", "no model released")
        ax = axes.pop(0)
        drawn["notes"].append(f"{why}\n{what}")
        ax.text(0.5, 0.5, drawn["notes"][-1], ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    for ax, (key, label) in zip(axes, shown, strict=False):
        x, y = _finite(rows, key)
        if x:
            ax.plot(x, y, "o-", ms=3, color="tab:blue", label="after each round")
        if model.get(key) is not None:
            ax.axhline(model[key], ls="--", color="tab:green", label=f"released model: {model[key]:.4g}")
            ax.plot([last], [model[key]], "*", ms=12, color="tab:green")
        ax.set_ylabel(label)
        ax.legend(fontsize=8, loc="best")
    ax = axes[-1]
    ax.step([r["round"] for r in rows], [r["eps_spent"] for r in rows], "o-", where="post", ms=3, color="tab:red")
    limit = (summary.get("spend") or {}).get("eps_limit")
    if limit:  # the run's budget: the spend approaches it, never crosses it
        ax.axhline(limit, ls="--", color="tab:gray", label=f"eps limit {limit:g}")
        ax.legend(fontsize=8, loc="best")
        drawn["eps_limit"] = [f"{limit:g}"]
    ax.set_ylabel("eps spent")
    ax.set_xlabel("round")
    fig.suptitle(
        f"{summary.get('plan', {}).get('protocol') or ''} run {summary.get('run_id', '')}: {summary.get('state', '')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return drawn


@contextlib.contextmanager
def _hangup_interrupts():
    """SIGTERM and SIGHUP of the CLI act as Ctrl-C while it drives a local run: the services have a process group of
    their own (Cluster.spawn), so a closed terminal or a `kill` must reach them through the CLI. Restored after."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        yield
        return
    old = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _interrupted(out: Path, config_toml: str, exc: KeyboardInterrupt, tracker=None, seed: int | None = None) -> int:
    """Ctrl-C during a run: write what the analyzer had (drive_run fetched it before the services stopped), print
    the spend; exit status 130."""
    result, run_id = getattr(exc, "result", None), getattr(exc, "run_id", "")
    try:
        if result is None:
            what = f"run {run_id} cancelled, but the analyzer gave no results" if run_id else "no run was started"
            print(f"stopped by Ctrl-C: {what}; logs in {out / 'logs'}", file=sys.stderr)
            return 130
        write_results(out, config_toml, result, interrupted=True, seed=seed)
        if tracker is not None:
            tracker.finish(result)
        s, b = result.status, result.status.budget
        print(
            f"stopped by Ctrl-C: run {run_id} {pb.RunState.Name(s.state)} after {s.rounds_done} of "
            f"{s.rounds_planned} rounds; results so far in {out}",
            file=sys.stderr,
        )
        # the ledger's reserved total includes a round in flight, which counts as spent if it was delivered
        in_flight = f"; eps = {b.eps_reserved:.4f} with the round in flight" if b.eps_reserved > b.eps_spent else ""
        print(
            f"privacy spent: eps = {b.eps_spent:.4f}, delta = {b.delta_spent:.3g}  (limit eps = {b.eps_limit:g}, "
            f"delta = {b.delta_limit:.3g}; accountant: {b.accountant}){in_flight}"
        )
        if _released(result) is None:
            print(f"no model: {run_summary(result, _plan_of(result), None).get('no_model', '')}")
    except KeyboardInterrupt:
        print("stopped by a second Ctrl-C: the results were not all written", file=sys.stderr)
    return 130


def _rpc_failed(exc: grpc.RpcError, analyzer: str, doing: str) -> int:
    """One line for an RPC error that is not a lost analyzer (refused configuration, unknown run, permission)."""
    code = _code(exc)
    name = code.name if code is not None else type(exc).__name__
    print(f"shuffledp run: the analyzer at {analyzer} refused {doing} ({name}: {_first_line(exc)})", file=sys.stderr)
    return 2 if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) else EXIT_LOST


def _plain_text_refused(args: argparse.Namespace) -> str | None:
    """Why --analyzer cannot be dialled in plain text (None: it can, or --pki is given): a one-line usage error
    before anything is written, instead of the channel's ValueError."""
    from shuffledp.transport import tls

    if not args.analyzer or args.pki is not None:
        return None
    try:
        tls.check_plain_text(args.analyzer, "--analyzer")
    except ValueError as exc:
        return f"{exc} (--pki DIR)"
    return None


def _holds_run(out: Path, run_id: str) -> bool:
    """Whether `out` holds the results of run `run_id` (its ledger.json): --fetch may refresh them."""
    try:
        return json.loads((out / "ledger.json").read_text())["run"]["run_id"] == run_id
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _out_refused(out: Path, reuse: bool, local: bool, run_id: str = "") -> str | None:
    """Why the results directory cannot be used (None: it can): it is a file, or it is not empty and --reuse-out is
    not given (a run there would replace its results and logs, and a local one would reuse its state/: the users'
    spends would carry over without a word). --fetch may refresh the results of the same run."""
    try:
        if out.exists() and not out.is_dir():
            return f"--out {out} is a file, not a directory"
        if reuse or not out.is_dir() or not any(out.iterdir()) or (run_id and _holds_run(out, run_id)):
            return None
    except OSError as exc:
        return f"cannot use --out {out}: {exc.strerror}"
    kept = "; its state/ carries over: the users' recorded spends count against their [policy] limits" if local else ""
    return (
        f"--out {out} is not empty: choose a new directory, or pass --reuse-out to replace the results and logs "
        f"there{kept}"
    )


# what a seeded run's start line and summary.json say (issue 46 item 3)
SEED_NOTE = "a seeded simulation: its sampling, noise and shuffles are known to anyone who holds the seed"


def _seed_refused(args: argparse.Namespace, config: RunConfig, shared: bool = False) -> str | None:
    """Why --seed cannot be used (None: it can, or it is not given): a seed makes the noise known to whoever holds
    it, so it is taken only by a local run in plain text (no PKI: a deployment), on services started with it."""
    seed = args.seed
    if seed is None:
        return None
    from shuffledp.security.rng import SIMULATION_SEED_LIMIT

    if not 0 <= seed < SIMULATION_SEED_LIMIT:  # the range rng.start_simulation takes, as the option's own line
        return f"--seed must be in [0, 2^63), got {seed}"
    if args.analyzer:
        return "--seed is for local simulations: a deployment's (--analyzer) noise must stay unknown to anyone"
    if not config.deployment.insecure:
        return (
            "--seed is for local simulations in plain text: this run has a PKI ([deployment] insecure = false), "
            "whose noise must stay unknown to anyone"
        )
    if shared:
        return "--seed needs local services of its own, started with the seed (not services shared between runs)"
    return None


def _metrics_refused(args: argparse.Namespace, client_nodes: int) -> str | None:
    """Why --metrics-port BASE cannot be used (None: it can, or it is not given)."""
    if not args.metrics_port:
        return None
    if args.analyzer:
        return "--metrics-port is for a local run: a deployment's services take their own (serve --metrics-port)"
    last = args.metrics_port + client_nodes + 1  # shuffler, analyzer, the client nodes
    if not 0 < args.metrics_port or last > 65535:
        return f"--metrics-port BASE must leave BASE..BASE+{client_nodes + 1} in 1..65535, got {args.metrics_port}"
    from shuffledp.transport.grpc_options import BindError, check_address_free

    try:
        for port in range(args.metrics_port, last + 1):
            check_address_free(f"127.0.0.1:{port}")
    except BindError as exc:
        return f"--metrics-port {args.metrics_port}: {exc}"
    return None


def _clear_out(out: Path, existed: bool, reused: bool) -> None:
    """A run on a deployment that ended before any result was written (no run created, the analyzer lost): --out as
    it was before (absent or empty), so that the next try is not refused as a used directory."""
    if reused or {p.name for p in out.iterdir()} != {"config.toml"}:
        return
    (out / "config.toml").unlink()
    if not existed:
        out.rmdir()


def _make_out(out: Path) -> str | None:
    """Create the results directory; why it cannot be created, or None."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the results directory {out}: {exc.strerror}"
    return None


def _create_timeout(config_toml: str) -> float:
    from shuffledp.config import ConfigError, parse_config

    try:
        cfg = parse_config(config_toml)
    except ConfigError:
        return CREATE_TIMEOUT_S  # the analyzer answers with the error at once
    base = PLUGIN_CREATE_TIMEOUT_S if cfg.model.module else CREATE_TIMEOUT_S
    synthetic = cfg.data.n if cfg.data.dataset == "synthetic" else 0
    return base + SYNTHETIC_CREATE_S_PER_MILLION * synthetic / 1e6


def check_before_start(config: RunConfig) -> dict:
    """What a local run's configuration and data decide alone, checked in the CLI before any process starts (else
    the run fails at planning, after the services started): the data loads (every data.classes label occurs), and
    the analyzer's own planner (shuffledp/planning/planner.plan_run) accepts the run with every user of the data
    admitted (privacy.protocol "rr" needs a one-number model, cohort_size <= n, an eps that the protocol can reach,
    ...). Raises ConfigError naming the problem; returns the plan (plan_run's)."""
    from shuffledp.config import ConfigError
    from shuffledp.data import load_dataset, num_users
    from shuffledp.models.plugin import build_model
    from shuffledp.planning import plan_run
    from shuffledp.services.run_manager import policy_refusal

    try:
        ds = load_dataset(config.data, config.model.task)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data: {exc}") from exc
    n = num_users(ds, config.data.examples_per_user, config.data.max_users)
    if n < 1:
        raise ConfigError(
            f"data: {ds.name} has no training user ({len(ds.X_train)} training examples, data.examples_per_user = "
            f"{config.data.examples_per_user})"
        )
    if config.deployment.users_per_node == 1 and config.deployment.client_nodes != n:
        # node i hosts user i (data.user_shard: user j on node j mod client_nodes): one each only at n nodes
        raise ConfigError(
            f"deployment.users_per_node = 1 puts one user on each client node: client_nodes must be the data's {n} "
            f"users, got {config.deployment.client_nodes}"
        )
    # the analyzer's model for this data (as its _evaluation_data builds it)
    model = build_model(config.model, ds.num_features, ds.num_classes)
    try:
        plan = plan_run(config, n, n, model, ds.feature_norm_bound)
    except ValueError as exc:  # PlanError, and what the planner's helpers raise before it wraps them
        raise ConfigError(f"the run cannot be planned for the data's {n} users: {exc}") from exc
    # a local run's nodes enforce this configuration's [policy]: a plan they refuse would start and fail (issue 43
    # item 17: online PNSGD at 11.33 per round against max_eps_per_round = 8 ended after 3 attempts, exit 4)
    refusal = policy_refusal(config, plan)
    if refusal:
        raise ConfigError(refusal)
    return plan


def _nothing_released(status: pb.RunStatus) -> list[str]:
    """The summary's lines for a run that ended without releasing any round (the users' policy refused every one,
    or each was below threshold or failed): its model is the initial one. [] when a round was released, none was
    run, or the run was cancelled."""
    rounds = list(status.metrics)
    if not rounds or any(m.released for m in rounds) or status.state == pb.CANCELLED:
        return []
    total = len(rounds)
    lines = [f"no round released: none of the {total} round(s) run released an update; model.npz is the initial model"]
    refused: dict[str, list[int]] = {}  # reason -> users refusing, per round where it occurred
    for m in rounds:
        for reason, users in m.refused_reasons.items():
            refused.setdefault(reason, []).append(users)
    for reason, users in sorted(refused.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  users refused: {reason} (up to {max(users)} users, in {len(users)} of {total} rounds)")
    failures = [m.failure for m in rounds if m.failure]
    for failure in sorted(set(failures), key=failures.count, reverse=True):
        lines.append(f"  round failed: {failure} (in {failures.count(failure)} of {total} rounds)")
    rejected = sorted({reason for m in rounds for reason in m.rejected})
    if rejected:
        lines.append(f"  messages rejected: {', '.join(rejected)}")
    if len(lines) == 1:
        lines.append(f"  below threshold: at most {max(m.contributors for m in rounds)} contributors in a round")
    return lines


def _fetch_command(args: argparse.Namespace, give_up_s: float, call_timeout_s: float) -> int:
    """--fetch RUN_ID, or --cancel RUN_ID (cancel, then fetch)."""
    flag, run_id = ("--cancel", args.cancel) if args.cancel is not None else ("--fetch", args.fetch)
    run_id = run_id.strip()
    usage = None
    if args.cancel is not None and args.fetch is not None:
        usage = "--cancel RUN_ID fetches the run's results too: give it without --fetch"
    elif not args.analyzer:
        usage = f"{flag} RUN_ID needs --analyzer HOST:PORT (the analyzer that holds the run)"
    elif args.config is not None:
        usage = f"{flag} takes no CONFIG (the run's own configuration is fetched with its results)"
    elif not run_id:
        usage = f"{flag} needs a RUN_ID (printed by `shuffledp run` as 'run id: ...')"
    out = args.out or Path("results") / run_id
    usage = usage or _plain_text_refused(args) or _out_refused(out, args.reuse_out, False, run_id)
    usage = usage or _tracking_refused(args)
    if usage:
        print(f"shuffledp run: {usage}", file=sys.stderr)
        return 2
    try:
        result = fetch_result(
            args.analyzer,
            run_id,
            args.pki,
            args.server_name,
            give_up_s=give_up_s,
            call_timeout_s=call_timeout_s,
            cancel=args.cancel is not None,
        )
    except AnalyzerLost as lost:
        print(f"shuffledp run: {lost.what()}; try again later", file=sys.stderr)
        return EXIT_LOST
    except grpc.RpcError as exc:
        if _code(exc) == grpc.StatusCode.NOT_FOUND:
            print(f"shuffledp run: the analyzer at {args.analyzer} has no run {run_id!r}", file=sys.stderr)
            return 2
        call = "CancelRun" if args.cancel is not None else "GetRunResult"
        return _rpc_failed(exc, args.analyzer, f"{call} of run {run_id}")
    failed = _make_out(out)  # only now: a failed fetch leaves no empty directory behind
    if failed:
        print(f"shuffledp run: {failed}", file=sys.stderr)
        return 2
    write_results(out, result.config_toml, result)
    tracker = _tracker(args, out, result.config_toml)
    if tracker is not None:
        tracker.finish(result)
    s = result.status
    print(
        f"run {run_id}: {pb.RunState.Name(s.state)}, {s.rounds_done}/{s.rounds_planned} rounds, "
        f"eps spent {s.budget.eps_spent:.4f}; results in {out}"
    )
    if s.state not in TERMINAL:
        print("the run has not ended: these are its results so far; fetch again later")
    return 0


def _tracking_refused(args: argparse.Namespace, config=None) -> str | None:
    """Why the run tracking asked for (flags, config's [tracking]) cannot be done (one line), or None."""
    from shuffledp.observability.tracking import tracking_refused

    return tracking_refused(getattr(args, "tensorboard", None), getattr(args, "mlflow", None), config)


def _tracker(args: argparse.Namespace, out: Path, config_toml: str):
    """The run's trackers (--tensorboard, --mlflow / [tracking] mlflow) as one, or None when none is asked for."""
    from shuffledp.observability.tracking import open_trackers

    tensorboard, mlflow = getattr(args, "tensorboard", None), getattr(args, "mlflow", None)
    return open_trackers(out, config_toml, tensorboard=tensorboard, mlflow=mlflow)


def _watch(*watchers) -> Callable[[pb.RunStatus, Sequence[pb.RoundMetrics], int], None] | None:
    """One on_status for drive_run from the watchers given (None: not asked for); each sees the new rounds."""
    active = [w for w in watchers if w is not None]
    if not active:
        return None

    def on_status(status: pb.RunStatus, new: Sequence[pb.RoundMetrics], seen: int) -> None:
        for w in active:
            w.update(status, new, seen)

    return on_status


def run_args(**options: object) -> argparse.Namespace:
    """The options of `shuffledp run` as its own parser gives them (every default), then `options` set by name (the
    argparse dest: out, reuse_out, quiet, analyzer, pki, server_name, tensorboard, metrics_port, ...): the Python
    API's runs take exactly the command's options. TypeError for a name the command does not have."""
    parser = argparse.ArgumentParser(prog="shuffledp")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run"])
    for name, value in options.items():
        if name in ("command", "func") or not hasattr(args, name):
            raise TypeError(f"`shuffledp run` has no option {name!r}")
        setattr(args, name, value)
    return args


class RunRefused(Exception):
    """A run that cannot start, decided before any process exists (usage, configuration, results directory, an
    unreachable deployment): str() is the one line `shuffledp run` prints after "shuffledp run: ", `status` its exit
    status (2, or EXIT_LOST for an analyzer that does not answer)."""

    def __init__(self, line: str, status: int = 2):
        super().__init__(line)
        self.status = status


@dataclass
class RunSession:
    """One run as `shuffledp run` performs it, in the phases the command and the Python API (shuffledp.api) share:
    prepare_run (every check that needs no process, RunRefused), open (the results directory), start (the services of
    a local run, or the deployment's analyzer), steps / drive (the run), then finish (results written, services
    stopped) or interrupted (Ctrl-C: what the analyzer had written, the spend printed), and close (always: a local
    run's services stopped, a deployment run's unused results directory left as it was)."""

    args: argparse.Namespace
    config_toml: str
    config: RunConfig
    label: str
    out: Path
    give_up_s: float = GIVE_UP_S
    call_timeout_s: float = CALL_TIMEOUT_S
    existed: bool = False
    reused: bool = False
    analyzer: str = ""  # the analyzer the run is driven on (start)
    pki: Path | None = None
    cluster: Cluster | None = None
    tracker: object = None
    live: object = None
    echo: Callable[[str], object] = print
    started: float = 0.0
    result: pb.RunResult | None = None
    # the local services were started by the caller (a sweep runs many runs on them): not started nor stopped here
    shared: bool = False

    @property
    def local(self) -> bool:
        return not self.args.analyzer

    def open(self) -> None:
        """Create the results directory (RunRefused when it cannot be), write config.toml, set up the progress lines
        (a live status line on a terminal) and the run tracking."""
        args, out = self.args, self.out
        self.existed = out.exists()
        self.reused = out.is_dir() and any(out.iterdir())
        failed = _make_out(out)
        if failed:
            raise RunRefused(failed)
        if self.reused:
            kept = "" if args.analyzer else "; its state/ carries over (the users' recorded spends, the ledger)"
            print(f"shuffledp run: --reuse-out: the results and logs in {out} are replaced{kept}")
        (out / "config.toml").write_text(self.config_toml)
        self.echo = (lambda *_: None) if args.quiet else print
        if not args.quiet and sys.stdout.isatty():  # a terminal: the lines, and a live status line below them
            from shuffledp.observability.live import LiveView

            self.live = LiveView(sys.stdout)
            self.echo = self.live.echo
        self.started = time.monotonic()
        self.tracker = _tracker(args, out, self.config_toml)

    def start(self, hangup_signals: bool = False) -> None:
        """Say where the run goes; a local run starts its services (ServiceFailed, the others stopped). With
        `hangup_signals` (the command), SIGTERM and SIGHUP of this process act as Ctrl-C from now on."""
        args, config = self.args, self.config
        if args.analyzer:
            print(f"shuffledp run: {self.label}: on the deployment at {args.analyzer}; results in {self.out}")
            self.analyzer, self.pki = args.analyzer, args.pki
            return
        # insecure mode has no certificates, so no signed specs: the trust model's table holds only with mTLS
        trust = "; insecure mode: unsigned specs, nothing holds against a dishonest shuffler"
        trust = trust if config.deployment.insecure else ""
        nodes = config.deployment.client_nodes
        # [deployment] insecure = false: the local processes talk mTLS from pki_dir too (and so does the operator)
        self.pki = None if config.deployment.insecure else Path(config.deployment.pki_dir)
        if self.shared:
            on = f"on the local services started at {self.analyzer} ({nodes} client node(s))"
            print(f"shuffledp run: {self.label}: {on}; results in {self.out}{trust}")
            return
        seeded = "" if args.seed is None else f"; seed {args.seed}: {SEED_NOTE}"
        print(f"shuffledp run: {self.label}: {nodes} client node(s); results in {self.out}{trust}{seeded}")
        # the run is created while the nodes still start: the analyzer plans once their population is known
        fleets = min(FLEET_PROCESSES, nodes) if config.deployment.users_per_node == 1 else 0
        self.cluster, _, self.analyzer = start_local_cluster(
            self.out / "config.toml",
            self.out,
            nodes,
            pki=self.pki,
            wait_nodes=False,
            metrics_port=args.metrics_port,
            fleets=fleets,
            seed=args.seed,
        )
        if self.cluster.metrics_ports:
            at = ", ".join(
                f"{name} http://127.0.0.1:{port}/metrics" for name, port in self.cluster.metrics_ports.items()
            )
            print(f"shuffledp run: metrics (Prometheus): {at}")
        # the services have a process group of their own (Cluster.spawn): a hang-up or SIGTERM of the CLI must
        # stop them too, as Ctrl-C does
        if hangup_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.default_int_handler)

    def steps(self, on_created: Callable[[str], object] | None = None) -> Generator[RunStep, None, pb.RunResult]:
        """The run as drive_steps yields it, on the started analyzer (the live status line closed at its end)."""
        try:
            return (
                yield from drive_steps(
                    self.analyzer,
                    self.config_toml,
                    self.cluster,
                    self.echo,
                    self.pki,
                    self.args.server_name if not self.local else "analyzer",
                    give_up_s=self.give_up_s,
                    call_timeout_s=self.call_timeout_s,
                    on_created=on_created,
                )
            )
        finally:  # whatever follows (summary, error line) prints where the status line was
            if self.live is not None:
                self.live.close()

    @property
    def on_status(self) -> Callable[[pb.RunStatus, Sequence[pb.RoundMetrics], int], None] | None:
        """What sees each status: the run tracking and the live view (None: neither)."""
        return _watch(self.tracker, self.live)

    def drive(self) -> pb.RunResult:
        """The whole run (drive_run), its result kept in `result`."""
        steps = self.steps()
        next(steps)  # the run started, no round yet
        self.result = follow_steps(steps, self.on_status)
        return self.result

    def finish(self, result: pb.RunResult) -> None:
        """Write the results (and the tracking's), the services stopped meanwhile."""
        self.result = result
        if self.cluster is not None and not self.shared:
            self.cluster.terminate()  # the services shut down while the results are written; stopped (waited) below
        try:
            write_results(self.out, self.config_toml, result, seed=self.args.seed)
            if self.tracker is not None:
                self.tracker.finish(result)
        finally:
            self.close()

    def interrupted(self, exc: KeyboardInterrupt) -> int:
        """Ctrl-C: what the analyzer had (fetched before the services stop) written, the spend printed; 130."""
        if self.cluster is not None and not self.shared:
            self.cluster.terminate()  # what the analyzer had is fetched already: the services stop while it is written
        self.result = getattr(exc, "result", None)
        return _interrupted(self.out, self.config_toml, exc, self.tracker, self.args.seed)

    def close(self) -> None:
        """A local run's services stopped (waited for); a deployment run that wrote nothing leaves --out as it was."""
        if self.cluster is not None and not self.shared:
            cluster, self.cluster = self.cluster, None
            cluster.stop()
        elif not self.local and self.result is None:
            _clear_out(self.out, self.existed, self.reused)


def prepare_run(
    args: argparse.Namespace,
    *,
    config_toml: str | None = None,
    label: str | None = None,
    source: str | None = None,
    give_up_s: float = GIVE_UP_S,
    call_timeout_s: float = CALL_TIMEOUT_S,
    services: tuple[Cluster, str] | None = None,
    checked: bool = False,
) -> RunSession:
    """Everything `shuffledp run` checks before the results directory or any process exists: the configuration
    (args.config, or `config_toml` given as text, named `source` in messages), a local run's PKI, the options, the
    results directory, then a local run's data and plan (check_before_start) or the deployment's analyzer answering.
    RunRefused (one line) for the first mistake. `label` names the run (default: the file's stem, or "default").
    `services` (a Cluster and its analyzer's address, started by the caller for this configuration's [data],
    [deployment] and [policy]) runs the run on them instead of its own; `checked`: the caller ran check_before_start on
    this configuration already."""
    from shuffledp.config import DEFAULT_TOML, ConfigError, parse_config, read_config_text

    name = source or str(args.config or "default config")
    if config_toml is None:
        try:
            config_toml = read_config_text(args.config) if args.config else DEFAULT_TOML
        except ConfigError as exc:
            raise RunRefused(str(exc)) from None
    try:
        config = parse_config(config_toml)
    except ConfigError as exc:
        raise RunRefused(f"{name}: {exc}") from None
    if config.model.module:  # this file is the operator's own: it registers its model plug-in in this process and
        # the services it starts (a deployment's analyzer imports only what its own installation registers)
        from shuffledp.models.plugin import register_plugin

        register_plugin(config.model.module)
    seed_refused = _seed_refused(args, config, shared=services is not None)  # before a PKI is asked for
    if seed_refused:
        raise RunRefused(seed_refused)
    if not args.analyzer and not config.deployment.insecure:  # before anything starts (issue 24 item 11)
        from shuffledp.security.pki import check_local_run

        try:
            check_local_run(config.deployment.pki_dir, config.deployment.client_nodes)
        except (OSError, ValueError) as exc:
            raise RunRefused(f"{name}: deployment.pki_dir: {exc}") from None
    label = label or (args.config.stem if args.config else "default")
    out = args.out or Path("results") / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    # every mistake that the configuration, the data and the command line decide alone: one line, before the results
    # directory or any process exists
    usage = _plain_text_refused(args) or _out_refused(out, args.reuse_out, local=not args.analyzer)
    usage = usage or _tracking_refused(args, config) or _metrics_refused(args, config.deployment.client_nodes)
    if usage:
        raise RunRefused(usage)
    if not args.analyzer and os.environ.get(METRICS_PORT_ENV, "0") not in ("", "0"):
        print(
            f"shuffledp run: {METRICS_PORT_ENV} is one service's port (shuffledp serve): the local run's services do "
            "not take it; --metrics-port BASE gives each its own",
            file=sys.stderr,
        )
    if not args.analyzer:  # a deployment's analyzer checks its own data when the run is created
        try:
            if not checked:
                check_before_start(config)
        except ConfigError as exc:
            raise RunRefused(f"{name}: {exc}") from None
    else:  # before anything is written: nothing answering there is one line within seconds
        try:
            check_reachable(args.analyzer, args.pki, args.server_name, (lambda *_: None) if args.quiet else print)
        except AnalyzerLost as lost:
            raise RunRefused(lost.what(), EXIT_LOST) from None
    session = RunSession(args, config_toml, config, label, out, give_up_s=give_up_s, call_timeout_s=call_timeout_s)
    if services is not None:
        if args.analyzer:
            raise RunRefused("started local services take no --analyzer")
        session.cluster, session.analyzer = services
        session.shared = True
    return session


def _run_command(
    args: argparse.Namespace, *, give_up_s: float = GIVE_UP_S, call_timeout_s: float = CALL_TIMEOUT_S
) -> int:
    from shuffledp.config import ConfigError, default_toml

    if args.protocol is not None and not args.print_default:
        print(
            "shuffledp run: --protocol goes with --print-default (a run's protocol is its privacy.protocol)",
            file=sys.stderr,
        )
        return 2
    if args.print_default:
        try:
            print(default_toml(args.protocol or "pvec"), end="")
        except ConfigError as exc:
            print(f"shuffledp run: --protocol: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.fetch is not None or args.cancel is not None:
        return _fetch_command(args, give_up_s, call_timeout_s)
    try:
        session = prepare_run(args, give_up_s=give_up_s, call_timeout_s=call_timeout_s)
        session.open()
    except RunRefused as refused:
        print(f"shuffledp run: {refused}", file=sys.stderr)
        return refused.status
    try:
        try:
            session.start(hangup_signals=True)
        except ServiceFailed as exc:  # start_local_cluster stopped the others already
            print(f"shuffledp run: {exc.summary}; all services stopped; its log: {exc.log}", file=sys.stderr)
            return EXIT_LOST
        try:
            with _hangup_interrupts() if session.local else contextlib.nullcontext():
                result = session.drive()
        except KeyboardInterrupt as exc:
            return session.interrupted(exc)
        except ServiceFailed as exc:
            print(f"shuffledp run: {exc.summary}; all services stopped; its log: {exc.log}", file=sys.stderr)
            return EXIT_LOST
        except AnalyzerLost as lost:
            if session.local:
                print(
                    f"shuffledp run: {lost.what()}; all services stopped; logs in {session.out / 'logs'}",
                    file=sys.stderr,
                )
                return EXIT_LOST
            # the deployment keeps the run (its ledger): say how to pick it up again
            resume = ""
            if lost.run_id:
                fetch = fetch_command(args.analyzer, lost.run_id, args.pki, args.server_name)
                resume = f". The run continues if the analyzer comes back; fetch its results later with: {fetch}"
            print(f"shuffledp run: {lost.what()}{resume}", file=sys.stderr)
            return EXIT_LOST
        except grpc.RpcError as exc:
            return _rpc_failed(exc, session.analyzer, "the run")
        session.finish(result)
    finally:
        session.close()
    return print_summary(result, session.out, session.started)


def print_summary(result: pb.RunResult, out: Path, started: float) -> int:
    """The final summary `shuffledp run` prints (state, the released model's figures, the spend and its views, the
    baseline, why nothing was released); its exit status."""
    status = result.status
    final = next((m for m in reversed(status.metrics) if m.released), None)
    budget = status.budget
    print(f"state: {pb.RunState.Name(status.state)}  {status.message}".rstrip())
    if final is not None:  # the released model's figures (model.npz), not the last round's
        risk = f"  excess risk: {result.excess_risk:.4g}" if result.HasField("excess_risk") else ""
        acc = accuracy_note(_plan_of(result).get("task", ""), result.accuracy) or f"{result.accuracy:.4f}"
        print(f"test accuracy: {acc}  test loss: {result.loss:.4f}{risk}")
    if not status.rounds_planned:  # planning failed (or never happened): there is no limit, accountant or trust model
        print("privacy spent: nothing (the run was never planned)")
    else:
        print(
            f"privacy spent: eps = {budget.eps_spent:.4f}, delta = {budget.delta_spent:.3g}  "
            f"(limit eps = {budget.eps_limit:g}, delta = {budget.delta_limit:.3g}; accountant: {budget.accountant}; "
            f"trust model: {pb.TrustModel.Name(budget.trust_model)})"
        )
    if budget.trust_model == pb.CENTRAL:
        print(
            "  central trust: the guarantee holds against everyone who sees what the analyzer releases (the other "
            "clients, the shuffler, the outside world), not against the analyzer, which sees every clipped update"
        )
    # spec 000 A.3: if some contributors collude with the analyzer (an unplanned run has no figure)
    if status.rounds_planned and budget.honest_fraction < 1.0:
        print(
            f"  robust: eps = {budget.eps_spent_robust:.4f} if only {budget.honest_fraction:g} of each round's "
            "contributors are honest"
        )
    for name, value in sorted(budget.views.items()):  # e.g. the local view of an LDP run, the paper's bounds
        if name.startswith("record_delta_"):  # online PNSGD's per-record guarantee at the eps charged
            print(f"  {name.removeprefix('record_delta_')} record: delta = {value:.3g} at eps = {budget.eps_spent:.4f}")
            continue
        label = "local view (a party that sees senders)" if name == "local" else name
        print(f"  {label}: eps = {value:.4f}")
    baseline = baseline_line(run_summary(result, _plan_of(result), None))
    if baseline:
        print(baseline)
    nothing = _nothing_released(status)
    for line in nothing:
        print(line)
    print(f"wall time: {time.monotonic() - started:.1f} s; results: {out}")
    if nothing:
        return EXIT_NOTHING_RELEASED
    return 0 if status.state == pb.COMPLETED else 1
