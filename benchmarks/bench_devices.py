"""Benchmark (issue 44 item 5): N single-user device nodes over mTLS against one shuffler, N in {10^2, 10^3, 10^4}.

Run: python benchmarks/bench_devices.py [--devices 100 1000 10000] [--rounds 4] [--fleets 2] [--no-compare]
         [--quick] [--out DIR]

Each size N: the default protocol's round (calibrated PVEC count mode with the check-in, PGD, eps = 8) on the default
task, multinomial logistic regression on scikit-learn's digits (64 pixels + bias, 10 classes: d = 650), one user per
device node ([deployment] users_per_node = 1, client_nodes = N). Digits has 1347 training users, so the data is
digits tiled to 10^4 training users (an NPZ of digits' rows, pixels / 16, repeated in order; [data] dataset = "path",
max_users = N): the same rows, labels and dimension as the default run, only more users.
Every party is its own OS process on loopback, mTLS from one PKI with a certificate per device
(shuffledp.security.pki), as a
deployment runs them: `shuffledp serve shuffler` (its default capacity, 10^4 nodes), `serve analyzer`, and the N
devices in --fleets `serve fleet` processes (devices split evenly, each device its own certificate client-<i>, its
own grpc.aio channel and its own spend store in SQLite). This process plays the operator (CreateRun, StartRun,
GetRunStatus) once the shuffler counts all N devices connected (GetPopulation, with the analyzer's certificate).
Measured, with /proc (bench_round.vm_hwm_mib, cpu_seconds; bench_scale._status, Sampler):
  start-up        fleet processes started until the shuffler counts all N devices connected
  s/round         median RoundMetrics.seconds of the rounds after the first (the analyzer's clock: RoundSpec sent,
                  ExecuteRound with its two invitations to every device, decode, step)
  cycle           median time between consecutive rounds' metrics reaching the operator (what a round costs the run,
                  the analyzer's ledger, evaluation and checkpoint included)
  KiB/device      the shuffler's resident memory (VmRSS) with all N devices connected and idle, minus its RSS before
                  any connected, over N: what one idle connected device (its mTLS connection, its Connect stream,
                  its registered user) costs the shuffler (target 64 KiB, at most 128 KiB: issue 44)
  peak MiB        the shuffler's VmHWM over the whole run
  CPU/report      the shuffler's CPU seconds (user + sys) from the first round's metrics to the last round's, over
                  the reports it used in those rounds (RoundMetrics.contributors; each report comes with the user's
                  check-in message, so two messages per device per round)
  fleet CPU       the fleet processes' CPU over the same rounds per device and round (the devices' own work)
For comparison, the largest N's users on 2 ordinary client nodes (`serve client --num-nodes 2 --node-index i`, N/2
users each) against the same kind of shuffler and analyzer, measured the same way (memory per connected node).
The schedule has --rounds rounds (default 4: the first and 3 measured). PVEC's m (binomial trials per user) is
calibrated for eps over the run's rounds, so it depends on --rounds; a node draws its noise as one binomial per
coordinate (pvec.summed_noise), so its work does not.
Prints a table, writes bench_devices.json to --out (default results/bench_devices-<time>), with the run's logs'
warnings and errors counted by kind. Wall times depend on what else runs on the machine: the load average and the
busy cores are printed with each run. Memory does not; CPU seconds less than wall times, but contention inflates them
too (2026-12-07, two runs at 10^4 devices at load ~30 and ~50: the shuffler's CPU per report 3.7 and 5.7 ms).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from bench_round import cpu_seconds, vm_hwm_mib  # noqa: E402
from bench_scale import Sampler, _status  # noqa: E402

from shuffledp.cli.run import operator_channel  # noqa: E402
from shuffledp.data import load_digits  # noqa: E402
from shuffledp.security import pki  # noqa: E402
from shuffledp.transport import tls  # noqa: E402
from shuffledp.v1 import shuffledp_pb2 as pb  # noqa: E402
from shuffledp.v1 import shuffledp_pb2_grpc as pbg  # noqa: E402

TEST_FRACTION = 0.25  # the default's (every 4th example is a public test example)
TARGET_KIB, LIMIT_KIB = 64, 128  # issue 44: the shuffler's memory per idle connected device
STARTUP_S = 120.0  # a service process up (its port file written)
IDLE_S = 5.0  # connected and idle this long before the connected RSS is read
LOG_MARKS = ("WARNING", "ERROR", "CRITICAL", "Traceback", "RESOURCE_EXHAUSTED")


# ------------------------------------------------------------------------------------------------ set-up
def write_data(path: Path, users: int) -> None:
    """Digits (pixels / 16, as shuffledp.data loads them) tiled in order to at least `users` training users."""
    X, y = load_digits()
    k = math.ceil(users / (1.0 - TEST_FRACTION)) + 8
    idx = np.arange(k) % len(y)
    np.savez(path, X=X[idx] / 16.0, y=y[idx])


def config_toml(data: Path, users: int, nodes: int, rounds: int, deadline: float) -> str:
    """The default run (shuffledp run --print-default: calibrated PVEC with check-in, PGD at learning rate 8, radius
    10) on `users` users; nodes == users: one user per device node."""
    devices = "users_per_node = 1\n" if nodes == users else ""
    return f"""\
[data]
dataset = "path"
path = "{data.as_posix()}"
test_fraction = {TEST_FRACTION}
max_users = {users}

[model]
task = "logreg"
radius = 10.0

[privacy]
eps = 8.0

[schedule]
kind = "fully_interactive"
rounds = {rounds}
learning_rate = 8.0

[deployment]
client_nodes = {nodes}
{devices}round_deadline_seconds = {deadline:g}
population_wait_seconds = 600.0
"""


class Procs:
    """The service processes of one measurement (`shuffledp serve ...`), each with its log in workdir."""

    def __init__(self, workdir: Path, pki_dir: Path) -> None:
        self.workdir, self.pki_dir = workdir, pki_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> None:
        port_file = self.workdir / f"{name}.port"
        with open(self.workdir / f"{name}.log", "ab") as log:
            cmd = [sys.executable, "-m", "shuffledp.cli", "serve", *argv, "--pki", str(self.pki_dir)]
            cmd += ["--listen", "127.0.0.1:0", "--port-file", str(port_file)]
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def port(self, name: str, timeout: float = STARTUP_S) -> int:
        """The bound port (0 for a fleet) once the process wrote its port file."""
        port_file, end = self.workdir / f"{name}.port", time.monotonic() + timeout
        while not port_file.exists():
            self.check_alive()
            if time.monotonic() > end:
                raise RuntimeError(f"{name} did not start in {timeout:.0f} s:\n{self.log(name)[-3000:]}")
            time.sleep(0.05)
        return int(port_file.read_text())

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)[-3000:]}")

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM each (they stop gracefully), SIGKILL what is left after 60 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def log_summary(self) -> dict[str, dict]:
        """Per process: lines with a warning or error mark, counted by kind (numbers and node names masked), a few
        examples, and the exit status."""
        out = {}
        for name, proc in self.procs.items():
            kinds: Counter = Counter()
            for line in self.log(name).splitlines():
                if any(mark in line for mark in LOG_MARKS):
                    text = line.split(" ", 2)[-1] if re.match(r"\d{4}-\d\d-\d\d ", line) else line
                    kinds[re.sub(r"client-\d+|\d+(\.\d+)?", "#", text)[:200]] += 1
            out[name] = {"returncode": proc.returncode, "marked_lines": sum(kinds.values()), "kinds": dict(kinds)}
        return out


def shuffler_stub_channel(address: str, pki_dir: Path):
    """A channel to the shuffler with the analyzer's certificate (GetPopulation is the analyzer's method)."""
    return tls.ChannelSecurity(pki_dir, pki.ROLE_ANALYZER, "analyzer").channel(address, server_name="shuffler")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ------------------------------------------------------------------------------------------------ one setting
def one_setting(
    label: str,
    users: int,
    nodes: int,
    fleets: int,
    rounds: int,
    deadline: float,
    data: Path,
    pki_dir: Path,
    tmp: Path,
    out: Path,
    row: dict,
) -> dict:
    """One measurement: shuffler, analyzer, and `nodes` nodes hosting `users` users (nodes == users: device nodes in
    `fleets` fleet processes; else ordinary client nodes), a run of `rounds` rounds. The processes' logs are
    copied to out/<label>/."""
    workdir = tmp / label
    workdir.mkdir(parents=True)
    config = workdir / "run.toml"
    toml = config_toml(data, users, nodes, rounds, deadline)
    config.write_text(toml)
    procs = Procs(workdir, pki_dir)
    sampler = Sampler(os.getpid())  # peak memory (VmHWM) of every service process this process started
    row.update(setting=label, users=users, nodes=nodes, machine_before=shared_machine())
    print(f"\n[{label}] {users} users on {nodes} nodes; {row['machine_before']}", flush=True)
    try:
        procs.start("shuffler", ["shuffler", "--state-dir", str(workdir / "shuffler")])
        shuffler = f"127.0.0.1:{procs.port('shuffler')}"
        procs.start("analyzer", ["analyzer", "--shuffler", shuffler, "--state-dir", str(workdir / "analyzer")])
        analyzer = f"127.0.0.1:{procs.port('analyzer')}"
        sampler.start()
        with shuffler_stub_channel(shuffler, pki_dir) as sch, operator_channel(analyzer, pki_dir) as och:
            shuffler_stub, operator = pbg.ShufflerStub(sch), pbg.AnalyzerStub(och)
            shuffler_stub.GetPopulation(pb.PopulationRequest(), timeout=30)  # its analyzer-side path warm
            time.sleep(1.0)
            sh = procs.pid("shuffler")
            row["shuffler_rss_mib_before"] = _status(sh, "VmRSS")
            # the nodes
            t0 = time.monotonic()
            node_names = []
            if nodes == users:
                bounds = np.linspace(0, users, fleets + 1).round().astype(int)
                for f, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                    name = f"fleet-{f}"
                    argv = ["fleet", "--shuffler", shuffler, "--config", str(config), "--num-nodes", str(users)]
                    argv += ["--first-index", str(a), "--count", str(b - a), "--state-dir", str(workdir / "nodes")]
                    procs.start(name, argv)
                    node_names.append(name)
            else:
                for i in range(nodes):
                    name = f"client-{i}"
                    argv = ["client", "--shuffler", shuffler, "--config", str(config), "--num-nodes", str(nodes)]
                    argv += ["--node-index", str(i), "--state-dir", str(workdir / "nodes")]
                    procs.start(name, argv)
                    node_names.append(name)
            for name in node_names:
                sampler.pids[name] = procs.pid(name)
            for name in node_names:
                procs.port(name)  # a fleet writes its port file (0) once its devices have started
            row["node_processes_up_s"] = time.monotonic() - t0
            pop, last_print, poll_errors = None, 0.0, Counter()
            while True:
                try:
                    pop = shuffler_stub.GetPopulation(pb.PopulationRequest(), timeout=30)
                except grpc.RpcError as exc:  # the analyzer's call queued behind the devices' (counted, retried)
                    poll_errors[exc.code().name] += 1
                    row["population_poll_errors"] = dict(poll_errors)
                    print(f"  GetPopulation failed ({exc.code().name}: {exc.details()}); retrying", flush=True)
                    procs.check_alive()
                    time.sleep(1.0)
                    continue
                now = time.monotonic() - t0
                if pop.connected_nodes >= nodes:
                    break
                procs.check_alive()
                if now > 900:
                    raise RuntimeError(f"{pop.connected_nodes} of {nodes} nodes connected after {now:.0f} s")
                if now - last_print >= 10:
                    print(f"  {now:5.0f} s: {pop.connected_nodes} of {nodes} nodes connected", flush=True)
                    last_print = now
                time.sleep(0.25)
            row["startup_s"] = time.monotonic() - t0
            row["refused_at_startup"] = [f"{r.node}: {r.reason} ({r.calls} calls)" for r in pop.refused_nodes]
            print(
                f"  all {nodes} connected after {row['startup_s']:.1f} s (node processes up after "
                f"{row['node_processes_up_s']:.1f} s); {pop.admitted_users} users admitted; refused: "
                f"{len(pop.refused_nodes)}",
                flush=True,
            )
            cpu_idle0, t_idle0 = cpu_seconds(sh), time.monotonic()
            time.sleep(IDLE_S)
            row["shuffler_rss_mib_connected"] = _status(sh, "VmRSS")
            row["shuffler_hwm_mib_connected"] = vm_hwm_mib(sh)
            row["shuffler_idle_cpu_per_s"] = (cpu_seconds(sh) - cpu_idle0) / (time.monotonic() - t_idle0)
            grown = row["shuffler_rss_mib_connected"] - row["shuffler_rss_mib_before"]
            row["shuffler_kib_per_node"] = grown * 1024 / nodes
            print(
                f"  shuffler RSS {row['shuffler_rss_mib_before']:.0f} -> {row['shuffler_rss_mib_connected']:.0f} MiB "
                f"({row['shuffler_kib_per_node']:.1f} KiB per connected node), idle CPU "
                f"{row['shuffler_idle_cpu_per_s'] * 100:.1f} % of a core",
                flush=True,
            )
            # the run
            run_id = operator.CreateRun(pb.CreateRunRequest(config_toml=toml), timeout=120).run_id
            operator.StartRun(pb.RunRef(run_id=run_id), timeout=60)
            t_run = time.monotonic()
            seen, arrivals, cpu_marks = 0, [], []
            status = operator.GetRunStatus(pb.RunRef(run_id=run_id), timeout=60)
            while status.state in (pb.CREATED, pb.RUNNING):
                status = operator.GetRunStatus(
                    pb.RunRef(
                        run_id=run_id,
                        wait_ms=10_000,
                        seen_rounds=seen,
                        seen_state=status.state,
                        seen_message=status.message,
                    ),
                    timeout=60,
                )
                if len(status.metrics) > seen:
                    now = time.monotonic()
                    cpu_marks.append(
                        {name: cpu_seconds(procs.pid(name)) for name in ["shuffler", "analyzer", *node_names]}
                    )
                    for m in status.metrics[seen:]:
                        arrivals.append(now)
                        print(
                            f"  round {m.round}: {m.seconds:6.2f} s, checked in {m.checked_in}, contributors "
                            f"{m.contributors}, released {m.released}, loss {m.loss:.4f}, acc {m.accuracy:.3f}"
                            + (f", failure: {m.failure}" if m.failure else "")
                            + (f", rejected {dict(m.rejected)}" if m.rejected else "")
                            + (f", refused {dict(m.refused_reasons)}" if m.refused else ""),
                            flush=True,
                        )
                    seen = len(status.metrics)
                procs.check_alive()
                if time.monotonic() - t_run > rounds * (2 * deadline + 120):
                    raise RuntimeError(f"run {run_id} not finished: {status.rounds_done} rounds done")
            row["run_s"] = time.monotonic() - t_run
            row["shuffler_hwm_mib"] = vm_hwm_mib(sh)
            sampler.sample()
            row["peak_mib"] = {k: v for k, v in sampler.peak.items() if k != "fleet"}
            pop = shuffler_stub.GetPopulation(pb.PopulationRequest(), timeout=30)
            row["refused_nodes_end"] = [f"{r.node}: {r.reason} ({r.calls} calls)" for r in pop.refused_nodes]
            row["connected_end"] = pop.connected_nodes
        metrics = list(status.metrics)
        row["state"] = pb.RunState.Name(status.state)
        row["message"] = status.message
        row["eps_spent"] = status.budget.eps_spent
        row["rounds"] = [
            {
                "round": m.round,
                "seconds": m.seconds,
                "checked_in": m.checked_in,
                "contributors": m.contributors,
                "released": m.released,
                "loss": m.loss,
                "accuracy": m.accuracy,
                "failure": m.failure,
                "rejected": dict(m.rejected),
                "refused": dict(m.refused_reasons),
            }
            for m in metrics
        ]
        if status.state != pb.COMPLETED:
            raise RuntimeError(f"run ended {row['state']}: {status.message}")
        later = metrics[1:]
        row["seconds_per_round"] = statistics.median(m.seconds for m in later) if later else None
        row["first_round_s"] = metrics[0].seconds
        row["cycle_s"] = statistics.median(np.diff(arrivals)) if len(arrivals) > 1 else None
        reports = sum(m.contributors for m in later)
        if len(cpu_marks) > 1 and reports:
            first, last = cpu_marks[0], cpu_marks[-1]
            # marks per metrics arrival; a poll that brought two rounds at once makes the window longer, not wrong:
            # the reports are those of the rounds after the first mark
            reports = sum(m.contributors for m in metrics[len(metrics) - (len(cpu_marks) - 1) :])
            row["shuffler_cpu_s"] = last["shuffler"] - first["shuffler"]
            row["shuffler_cpu_ms_per_report"] = row["shuffler_cpu_s"] * 1e3 / reports
            row["analyzer_cpu_ms_per_round"] = (last["analyzer"] - first["analyzer"]) * 1e3 / (len(cpu_marks) - 1)
            node_cpu = sum(last[n] - first[n] for n in node_names)
            row["node_cpu_ms_per_user_round"] = node_cpu * 1e3 / reports
        row["all_reported"] = all(m.released and m.contributors == users for m in metrics)
    finally:
        sampler.done.set()
        procs.stop()
        row["logs"] = procs.log_summary()
        logs = out / label.replace(" ", "_").replace(",", "")
        logs.mkdir(parents=True, exist_ok=True)
        for path in workdir.glob("*.log"):
            shutil.copy(path, logs / path.name)
        for name, info in row["logs"].items():
            if info["marked_lines"] or info["returncode"] not in (0, None):
                print(f"  log {name}: exit {info['returncode']}, {info['marked_lines']} warning/error lines:")
                for kind, n in sorted(info["kinds"].items(), key=lambda kv: -kv[1])[:6]:
                    print(f"    {n:6d} x {kind}")
    return row


# ---------------------------------------------------------------------------------------------------- main
def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], shared: str) -> None:
    print(
        "\nthe default check-in round (calibrated PVEC, counts, PGD) at d = 650, digits tiled, one user per device "
        f"node, mTLS, {os.cpu_count()} cores; {shared}"
    )
    head = f"{'setting':>18} {'nodes':>6} {'users':>6} {'start-up':>9} {'s/round':>8} {'cycle':>8} "
    head += f"{'RSS0':>6} {'RSS N':>6} {'KiB/node':>9} {'peak':>6} {'CPU/rep':>8} {'node CPU':>9} {'refused':>8}"
    print(head)
    print(
        f"{'':>18} {'':>6} {'':>6} {'s':>9} {'median':>8} {'s':>8} {'MiB':>6} {'MiB':>6} {'idle':>9} {'MiB':>6} "
        f"{'ms':>8} {'ms/u·rnd':>9} {'':>8}"
    )
    for r in rows:
        print(
            f"{r['setting']:>18} {r['nodes']:>6} {r['users']:>6} {fmt(r.get('startup_s'), '9.1f')} "
            f"{fmt(r.get('seconds_per_round'), '8.2f')} {fmt(r.get('cycle_s'), '8.2f')} "
            f"{fmt(r.get('shuffler_rss_mib_before'), '6.0f')} {fmt(r.get('shuffler_rss_mib_connected'), '6.0f')} "
            f"{fmt(r.get('shuffler_kib_per_node'), '9.1f')} {fmt(r.get('shuffler_hwm_mib'), '6.0f')} "
            f"{fmt(r.get('shuffler_cpu_ms_per_report'), '8.3f')} {fmt(r.get('node_cpu_ms_per_user_round'), '9.2f')} "
            f"{len(r.get('refused_nodes_end', [])):>8}"
        )
    print(
        "s/round: RoundMetrics.seconds after the first round; cycle: between rounds' metrics; RSS0 / RSS N: the "
        "shuffler before any node connected / all connected and idle; KiB/node = (RSS N - RSS0) / nodes (target "
        f"{TARGET_KIB}, at most {LIMIT_KIB} per device); peak: the shuffler's VmHWM; CPU/rep: the shuffler's CPU per "
        "report used (each with its check-in); node CPU: the nodes' processes per user and round"
    )
    for r in rows:
        if "error" in r:
            print(f"  {r['setting']}: FAILED: {r['error'].splitlines()[0][:300]}")
        if r.get("population_poll_errors"):
            print(
                f"  {r['setting']}: the shuffler failed GetPopulation calls while devices connected: "
                f"{r['population_poll_errors']}"
            )
        if r["nodes"] == r["users"] and r.get("shuffler_kib_per_node") is not None:
            kib = r["shuffler_kib_per_node"]
            verdict = "met" if kib <= TARGET_KIB else "within the limit" if kib <= LIMIT_KIB else "MISSED"
            print(f"  {r['setting']}: {kib:.1f} KiB per connected device (target {TARGET_KIB} KiB: {verdict})")


def busy_cores(seconds: float = 1.0) -> float:
    """Cores busy on the whole machine over `seconds` (/proc/stat), before this benchmark starts anything."""

    def ticks() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    (a0, i0), _ = ticks(), time.sleep(seconds)
    a1, i1 = ticks()
    return os.cpu_count() * (1.0 - (i1 - i0) / max(a1 - a0, 1))


def shared_machine() -> str:
    """What else runs: the load average, and the cores busy over one second."""
    return f"load average {load_average()}, {busy_cores():.1f} of {os.cpu_count()} cores busy"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[100, 1000, 10_000], help="device nodes N")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (the first is not measured; default 4)")
    ap.add_argument("--fleets", type=int, default=2, help="fleet processes the devices are split over (default 2)")
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="round_deadline_seconds (default max(60, 0.1 N): ~7.6 ms of device CPU and ~2 ms of the shuffler's per "
        "device and round on 2 cores, shared with other work; a round ends as soon as every device answered)",
    )
    ap.add_argument("--no-compare", action="store_true", help="without the run of the largest N on 2 client nodes")
    ap.add_argument("--quick", action="store_true", help="20 devices, 2 rounds, and 20 users on 2 nodes (smoke test)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / f"bench_devices-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    if args.quick:
        args.devices, args.rounds = [20], 2
    if args.rounds < 2 or min(args.devices) < max(2, args.fleets) or args.fleets < 1:
        ap.error("need --rounds >= 2, --fleets >= 1 and at least 2 devices per size, one per fleet")
    sizes = sorted(set(args.devices))
    started = time.monotonic()
    print(f"machine: {os.cpu_count()} cores, {shared_machine()}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_devices_") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "digits_tiled.npz"
        write_data(data, max(sizes))
        t0 = time.monotonic()
        pki.init_pki(tmp / "pki", client_nodes=max(sizes))
        print(f"PKI: CA, services and {max(sizes)} device certificates in {time.monotonic() - t0:.1f} s", flush=True)
        settings = [(f"{n} devices", n, n) for n in sizes]
        if not args.no_compare:
            settings.append((f"{sizes[-1]} users, 2 nodes", sizes[-1], 2))
        for label, users, nodes in settings:
            deadline = args.deadline or max(60.0, 0.1 * users)
            row: dict = {}
            try:
                one_setting(
                    label, users, nodes, args.fleets, args.rounds, deadline, data, tmp / "pki", tmp, args.out, row
                )
            except Exception as exc:  # the others still run; the row says what went wrong
                print(f"  [{label}] FAILED: {exc}", flush=True)
                row["error"] = str(exc)
            rows.append(row)
            (args.out / "bench_devices.json").write_text(json.dumps({"rows": rows}, indent=2, default=str))
    wall = time.monotonic() - started
    shared = f"figures from a shared machine ({shared_machine()})"
    print_table(rows, shared)
    result = {"rows": rows, "wall_seconds": wall, "machine": shared, "rounds": args.rounds, "fleets": args.fleets}
    (args.out / "bench_devices.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"benchmark wall time {wall:.1f} s; results in {args.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
