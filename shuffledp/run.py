"""`shuffledp run [CONFIG.toml]`: a whole experiment as separate OS processes on loopback.

Starts the shuffler, the analyzer and the configured number of client nodes (each `shuffledp serve ...`), creates and
starts the run through the analyzer's operator API, prints progress per round, and writes a results directory:
config.toml, metrics.csv, metrics.json, ledger.json, model.npz, plot.png, logs/. Everything is stopped on success,
failure and Ctrl-C. With no CONFIG the embedded default (digits, one example per user) runs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

STARTUP_TIMEOUT_S = 60.0
POLL_S = 0.5
TERMINAL = {pb.COMPLETED, pb.FAILED, pb.CANCELLED, pb.BUDGET_EXHAUSTED}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run an experiment: analyzer, shuffler and client nodes on loopback")
    parser.add_argument("config", nargs="?", type=Path, help="run configuration TOML (default: embedded digits run)")
    parser.add_argument("--out", type=Path, help="results directory (default: results/<config name>-<time>)")
    parser.add_argument("--quiet", action="store_true", help="only the final summary")
    parser.add_argument(
        "--print-default",
        action="store_true",
        help="print the embedded default configuration (every key, commented) and exit: a start for your own",
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
    parser.set_defaults(func=_run_command)


@dataclass
class Cluster:
    """The service processes of one local run; stop() always terminates all of them."""

    workdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: list = field(default_factory=list)

    def spawn(self, name: str, argv: list[str]) -> Path:
        port_file = self.workdir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log = open(self.workdir / "logs" / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self.logs.append(log)
        cmd = [sys.executable, "-m", "shuffledp.cli", "serve", *argv, "--port-file", str(port_file)]
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        return port_file

    def wait_port(self, name: str, port_file: Path) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if port_file.exists():
                return int(port_file.read_text())
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited during start-up:\n{self.log_tail(name)}")
            time.sleep(0.05)
        raise RuntimeError(f"{name} did not start within {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited unexpectedly (status {proc.returncode}):\n{self.log_tail(name)}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        for name in self.procs:
            (self.workdir / f"{name}.port").unlink(missing_ok=True)


def start_local_cluster(
    config_path: Path, workdir: Path, client_nodes: int, with_analyzer: bool = True
) -> tuple[Cluster, str, str | None]:
    """Start shuffler, analyzer (unless with_analyzer=False: the caller plays it) and client nodes as processes;
    returns (cluster, shuffler address, analyzer address or None)."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    cluster = Cluster(workdir)
    analyzer = None
    try:
        sec = ["--insecure"]
        pf = cluster.spawn("shuffler", ["shuffler", *sec, "--state-dir", str(workdir / "state")])
        shuffler = f"127.0.0.1:{cluster.wait_port('shuffler', pf)}"
        if with_analyzer:
            pf = cluster.spawn(
                "analyzer", ["analyzer", *sec, "--shuffler", shuffler, "--state-dir", str(workdir / "state")]
            )
            analyzer = f"127.0.0.1:{cluster.wait_port('analyzer', pf)}"
        node_files = {
            f"client-{i}": cluster.spawn(
                f"client-{i}",
                [
                    "client",
                    *sec,
                    "--shuffler",
                    shuffler,
                    "--config",
                    str(config_path),
                    "--node-index",
                    str(i),
                    "--num-nodes",
                    str(client_nodes),
                ],
            )
            for i in range(client_nodes)
        }
        for name, pf in node_files.items():
            cluster.wait_port(name, pf)
    except BaseException:
        cluster.stop()
        raise
    return cluster, shuffler, analyzer


def _progress_line(m: pb.RoundMetrics, planned: int) -> str:
    # why users are missing: their own policy refused the round ([policy] of the configuration), or their
    # messages were rejected (by reason, at the shuffler or the analyzer)
    why = []
    if m.refused:
        why.append(f"{m.refused} users refused by their [policy]")
    if m.rejected:
        why.append("rejected " + ", ".join(f"{k}={v}" for k, v in sorted(m.rejected.items())))
    if not m.released:
        detail = "; ".join([f"below threshold: {m.contributors} contributors", *why])
        return f"round {m.round + 1:>4}/{planned}  NOT RELEASED ({detail})"
    return (
        f"round {m.round + 1:>4}/{planned}  contributors {m.contributors:>6}  loss {m.loss:8.4f}  "
        f"accuracy {m.accuracy:6.3f}  eps spent {m.eps_spent:7.4f}  ({m.seconds:5.2f} s)"
        + "".join(f"  [{w}]" for w in why)
    )


def operator_channel(analyzer: str, pki: Path | None = None, server_name: str = "analyzer") -> grpc.Channel:
    """Channel of the operator to the analyzer: mTLS with the operator certificate, or plain text on loopback."""
    from shuffledp import tls

    if pki is None:
        return tls.ChannelSecurity.insecure_loopback("operator", "operator").channel(analyzer)
    return tls.ChannelSecurity(pki, "operator", "operator").channel(analyzer, server_name=server_name)


def drive_run(
    analyzer: str,
    config_toml: str,
    cluster: Cluster | None = None,
    echo=print,
    pki: Path | None = None,
    server_name: str = "analyzer",
) -> pb.RunResult:
    """Create and start a run on the analyzer, report progress until it ends, return its result."""
    with operator_channel(analyzer, pki, server_name) as channel:
        stub = pbg.AnalyzerStub(channel)
        status = stub.CreateRun(pb.CreateRunRequest(config_toml=config_toml), timeout=60)
        ref = pb.RunRef(run_id=status.run_id)
        echo(f"run id: {status.run_id}  (fetch its results again with GetRunResult / deploy/compose.sh results)")
        stub.StartRun(ref, timeout=30)
        shown = 0
        try:
            while True:
                status = stub.GetRunStatus(ref, timeout=30)
                for m in status.metrics[shown:]:
                    echo(_progress_line(m, status.rounds_planned))
                shown = len(status.metrics)
                if status.state in TERMINAL:
                    break
                if cluster is not None:
                    cluster.check_alive()
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            echo("interrupted: cancelling the run")
            with contextlib.suppress(grpc.RpcError):
                stub.CancelRun(ref, timeout=10)
            raise
        return stub.GetRunResult(ref, timeout=60)


def write_results(out: Path, config_toml: str, result: pb.RunResult) -> None:
    """Write everything a run produced; never raises half-way silently (a missing plot is reported, not fatal)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(config_toml)
    rows = [
        {
            "round": m.round + 1,
            "contributors": m.contributors,
            "released": m.released,
            "loss": m.loss,
            "accuracy": m.accuracy,
            "eps_spent": m.eps_spent,
            "delta_spent": m.delta_spent,
            "seconds": m.seconds,
            "refused": m.refused,
            "rejected": dict(sorted(m.rejected.items())),
        }
        for m in result.status.metrics
    ]
    (out / "metrics.json").write_text(json.dumps(rows, indent=2))
    with open(out / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["round"])
        writer.writeheader()
        # CSV cells are flat: rejected as "reason=count;reason=count"
        writer.writerows({**row, "rejected": ";".join(f"{k}={v}" for k, v in row["rejected"].items())} for row in rows)
    (out / "ledger.json").write_text(result.ledger_json)
    model = np.frombuffer(result.model.f64, dtype="<f8").reshape(tuple(result.model.shape) or (-1,))
    np.savez(out / "model.npz", params=model)
    try:
        _plot(out / "plot.png", rows)
    except Exception as exc:  # the data files above are written already; a plotting failure must not lose them
        print(f"warning: plot not written: {exc}", file=sys.stderr)


def _plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in rows if r["released"]]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(rounds, [r["accuracy"] for r in rows if r["released"]], "o-", color="tab:blue")
    ax1.set_xlabel("round")
    ax1.set_ylabel("held-out accuracy", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.step([r["round"] for r in rows], [r["eps_spent"] for r in rows], where="post", color="tab:red")
    ax2.set_ylabel("eps spent", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run_command(args: argparse.Namespace) -> int:
    from shuffledp.config import DEFAULT_TOML, ConfigError, parse_config

    if args.print_default:
        print(DEFAULT_TOML, end="")
        return 0
    try:
        config_toml = args.config.read_text() if args.config else DEFAULT_TOML
    except OSError as exc:
        print(f"shuffledp run: cannot read {args.config}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        config = parse_config(config_toml)
    except ConfigError as exc:
        print(f"shuffledp run: {args.config or 'default config'}: {exc}", file=sys.stderr)
        return 2
    label = args.config.stem if args.config else "default"
    out = args.out or Path("results") / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.toml"
    config_path.write_text(config_toml)
    echo = (lambda *_: None) if args.quiet else print
    started = time.monotonic()
    if args.analyzer:
        print(f"shuffledp run: {label}: on the deployment at {args.analyzer}; results in {out}")
        try:
            result = drive_run(args.analyzer, config_toml, None, echo, args.pki, args.server_name)
        except KeyboardInterrupt:
            print("stopped by Ctrl-C; the run was cancelled", file=sys.stderr)
            return 130
    else:
        print(f"shuffledp run: {label}: {config.deployment.client_nodes} client node(s); results in {out}")
        cluster, _, analyzer = start_local_cluster(config_path, out, config.deployment.client_nodes)
        try:
            result = drive_run(analyzer, config_toml, cluster, echo)
        except KeyboardInterrupt:
            print("stopped by Ctrl-C; services shut down; partial logs in", out / "logs", file=sys.stderr)
            return 130
        finally:
            cluster.stop()
    write_results(out, config_toml, result)
    status = result.status
    final = next((m for m in reversed(status.metrics) if m.released), None)
    budget = status.budget
    print(f"state: {pb.RunState.Name(status.state)}  {status.message}".rstrip())
    if final is not None:
        print(f"test accuracy: {final.accuracy:.4f}  test loss: {final.loss:.4f}")
    print(
        f"privacy spent: eps = {budget.eps_spent:.4f}, delta = {budget.delta_spent:.3g}  "
        f"(limit eps = {budget.eps_limit:g}, delta = {budget.delta_limit:.3g}; accountant: {budget.accountant}; "
        f"trust model: {pb.TrustModel.Name(budget.trust_model)})"
    )
    print(f"wall time: {time.monotonic() - started:.1f} s; results: {out}")
    return 0 if status.state == pb.COMPLETED else 1
