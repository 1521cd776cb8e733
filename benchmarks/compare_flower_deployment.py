"""Benchmark (issue 44 item 5): shuffledp's single-user device nodes against Flower's *deployment runtime* (a SuperLink
and N SuperNodes, each its own process), on the same task, on this machine, in the same run.

Run (from the repo root, with the repo's venv):
    python benchmarks/compare_flower_deployment.py [--nodes 10 20 50] [--rounds 5] [--systems shuffledp flower]
        [--round1-timeout 300] [--timeout 900] [--repeats 1] [--venv .venv-compare] [--out DIR] [--quick]
        [--no-warm-up]
--quick: 4 nodes, 2 rounds (a smoke test); --systems shuffledp skips Flower and never creates its venv (CI). Before
the measured runs, one untimed run of 2 nodes and 1 round per system warms the page cache. For each N the systems
run one after the other (--repeats times each, alternating; the table shows medians). The default (N = 10, 20, 50,
5 rounds) took 20 and 21 minutes here on 2 cores that other work kept busy (load average 15-75), most of it Flower's
(each Flower run that cannot finish round 1 costs --round1-timeout).

Flower is never a dependency of the product: its half runs from the throwaway venv of benchmarks/compare_flower.py
(.venv-compare/ at the repo root, git-ignored, created on first use with flwr[simulation]==FLWR_VERSION, the newest
release that installs here; the deployment runtime needs none of the simulation extra, the venv is shared so that
both comparisons run the same Flower). Flower's task is benchmarks/_flower_task.py's (its ClientApp, its
ProjectedFedAvg ServerApp), packed as a Flower App (FAB) by a generated module (flower_app()); shuffledp's is
compare_flower.shuffledp_config with `[deployment] client_nodes = N`, `users_per_node = 1`.

Task, the same for both: scikit-learn's digits, shuffledp's public split, N users of one training example each (user
j = training example j), every user in every round, multinomial logistic regression (d = 650), clip 1, learning rate
8, projection onto the ball of radius 10, theta_0 = 0, the mean of the iterates released (compare_flower.py's
docstring and differences() give the details). shuffledp: fully interactive PGD over PVEC (calibrated, the check-in,
eps 8), plain text on loopback (`[deployment] insecure = true`, the default). Flower: FedAvg, no privacy, plain
text on loopback (--insecure). The script checks that both see the same users' data (a sha256 of the examples) and
that Flower releases exactly the model of shuffledp's PGD without noise.

Deployment, per N:
- shuffledp: `shuffledp run config.toml` (the CLI) starts the shuffler, the analyzer and N device nodes, one user
  each, each with its own channel, spend store and policy, run by 2 fleet processes (`shuffledp serve fleet`; the
  fleet runner of clients/device.py). A node the shuffler does not admit makes the run train on fewer users: the
  script reports it as a failure, naming the refusal the devices logged, never as a result.
- Flower (its documented deployment CLI): `flower-superlink --insecure` (one HTTP port for its Fleet, Control and
  Runtime APIs; runtime dependency installation off), then N `flower-supernode --insecure --superlink ... --port P_j
  --node-config "partition-id=j num-partitions=N"` processes, and `flwr run APP bench --stream` with a SuperLink
  connection `bench` (address, insecure = true) in a Flower configuration file of its own (FLWR_HOME in a temporary
  directory, so nothing of the user's ~/.flwr is read or written). The SuperLink runs the ServerApp in a process of
  its own; each SuperNode starts a ClientApp process per message (per round), through a SuperExec process of its
  own. The SuperNodes and `flwr run` start when the SuperLink's port accepts connections.
A run is bounded: if round 1 has not ended --round1-timeout s after the start, or the run has not ended after
--timeout s, the script stops it and reports "did not finish round 1 in X s" (or "finished k of R rounds in X s").

Measured as compare_flower.py measures (its TreeSampler, subreaper and CPU accounting, reused), from the start of the
first process (shuffledp: the CLI; Flower: the SuperLink) on:
- start-up: to the end of round 1 (server side, wall clock stamps: the analyzer's "round 0: ok" log line; the line
  the ServerApp prints after round 1's aggregate). Includes starting every process and connecting every node.
- s/round: the median of the intervals between consecutive round ends after the first.
- wall: to the exit of the command that drives the run (`shuffledp run`, which stops its services first; `flwr run`,
  which returns when the run has finished, before the federation is stopped).
- peak PSS: the peak over samples of the tree's summed Pss (and per role: server side, nodes, CLI). PSS/node =
  the nodes' peak (shuffledp: the fleet processes; Flower: the SuperNodes, their SuperExecs and their ClientApp
  processes) / N.
- CPU: every process of the tree, to its exit, the stopping of the federation included (compare_flower.measure).
The sampler reads /proc/<pid>/smaps_rollup of every process of the tree; with 150 Flower processes one sample costs
tens of ms, so the interval stretches to 9 times the last sample's cost (the sampler then takes at most a tenth of a
core; its own CPU is in the JSON, sampler_cpu_s).

Printed: one table (per N, both systems), what happened to each run, the differences between the two runs of the
task, and the path of the JSON file with every figure (default results/compare_flower_deployment/
compare_flower_deployment.json; every process's log beside it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_flower import (  # noqa: E402
    _ANALYZER_ROUND,
    CLIP,
    CLK_TCK,
    DEFAULT_VENV,
    FLOWER_TASK,
    FLWR_VERSION,
    LR,
    QUIET_ENV,
    RADIUS,
    SAMPLE_S,
    TEST_FRACTION,
    Measurement,
    Run,
    TreeSampler,
    _become_subreaper,
    _figures,
    _ignores_sigchld,
    _machine_busy_s,
    _pss_kib,
    _reap_all,
    _table,
    _tree,
    ensure_flower_venv,
    flower_versions,
    median_of,
    noiseless_accuracy,
    shuffledp_command,
    shuffledp_config,
    shuffledp_users_fingerprint,
)

NODES = (10, 20, 50)
ROUNDS = 5
ROUND1_TIMEOUT_S = 300.0  # ten times Flower's 30 s limit for a ClientApp to pick up its message
TIMEOUT_S = 900.0
PORT_WAIT_S = 60.0  # for the SuperLink to accept connections
STOP_WAIT_S = 15.0  # for the processes of a finished run to exit after SIGTERM (then SIGKILL)
POLL_S = 0.5
SUPERLINK_CONNECTION = "bench"
# no calls home from Flower (telemetry, its update check)
FLOWER_ENV = {**QUIET_ENV, "FLWR_DISABLE_UPDATE_CHECK": "1"}
# Flower's programs by file name: the role of the process (None: the role of its parent)
FLOWER_PROGRAMS = {
    "flower-superlink": "server",
    "flower-supernode": "nodes",
    "flwr": "cli",
    "flower-superexec": None,  # one per SuperLink (runs the ServerApp) and one per SuperNode (runs its ClientApps)
    "flwr-serverapp": None,
    "flwr-clientapp": None,
}
ROLES = ("server", "nodes", "cli")


# ------------------------------------------------------------------------------------------- measuring
def classify(argv: list[str]) -> tuple[str | None, str]:
    """(role, kind) of a process from its command line: the role is "server", "nodes", "cli" or None (the
    parent's role); the kind names the program (a Flower program, `serve fleet`, `shuffledp run`, ...)."""
    names = [Path(a).name for a in argv[:2]]
    for name in names:
        if name in FLOWER_PROGRAMS:
            return FLOWER_PROGRAMS[name], name
    if "serve" in argv[:5] and argv.index("serve") + 1 < len(argv):
        service = argv[argv.index("serve") + 1]
        return ("nodes" if service in ("fleet", "client") else "server"), f"serve {service}"
    if "run" in argv[:3] and any(n == "shuffledp" for n in names):
        return "cli", "shuffledp run"
    return None, names[-1] if names else "(no command line: exited)"


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


class RoleSampler(TreeSampler):
    """compare_flower.TreeSampler, plus each process's role (classify(): by its command line, else its parent's):
    the peak PSS of each role's processes summed per sample, the most processes of each kind at once and how many
    were seen in all (e.g. the ClientApp processes Flower started). Its interval stretches to 9 times the cost of
    the last sample (at most ~0.1 core), since a tree of 150 processes costs tens of ms per sample."""

    def __init__(self, root: int, interval: float = SAMPLE_S) -> None:
        super().__init__(root, interval)
        self.roles: dict[tuple[int, int, str], tuple[str, str]] = {}  # (pid, start, comm) -> (role, kind)
        self.peak_pss_by_role: dict[str, int] = {}
        self.peak_by_kind: dict[str, int] = {}
        self.seen_by_kind: dict[str, set[tuple[int, int]]] = {}
        self.role_of: dict[tuple[int, int], str] = {}  # (pid, start) -> role, as last sampled
        self.sampler_cpu_s = 0.0
        self.max_sample_s = 0.0

    def _role(self, pid: int, table: dict) -> tuple[str, str]:
        proc = table[pid]
        key = (pid, proc.start, proc.name)  # the name too: a forked child's command line is its parent's until exec
        if key not in self.roles:
            role, kind = classify(_cmdline(pid))
            if role is None:
                parent = table.get(proc.ppid)
                inherited = self.roles.get((proc.ppid, parent.start, parent.name)) if parent else None
                role = inherited[0] if inherited else "other"
            self.roles[key] = (role, kind)
        return self.roles[key]

    def sample(self) -> None:
        table = _table()
        tree = _tree(self.root, table)  # parents before their children
        ignoring = {ppid: _ignores_sigchld(ppid) for ppid in {table[pid].ppid for pid in tree}}
        pss, names, by_role, kinds = 0, {}, dict.fromkeys(ROLES, 0), {}
        for pid in tree:
            proc = table[pid]
            self.last[(pid, proc.start)] = (proc, ignoring[proc.ppid])
            names[proc.name] = names.get(proc.name, 0) + 1
            role, kind = self._role(pid, table)
            self.role_of[(pid, proc.start)] = role
            kinds[kind] = kinds.get(kind, 0) + 1
            self.seen_by_kind.setdefault(kind, set()).add((pid, proc.start))
            p = _pss_kib(pid)
            pss += p
            by_role[role] = by_role.get(role, 0) + p
        for name, count in names.items():
            self.peak_by_name[name] = max(self.peak_by_name.get(name, 0), count)
        for kind, count in kinds.items():
            self.peak_by_kind[kind] = max(self.peak_by_kind.get(kind, 0), count)
        for role, kib in by_role.items():
            self.peak_pss_by_role[role] = max(self.peak_pss_by_role.get(role, 0), kib)
        self.peak_pss_kib = max(self.peak_pss_kib, pss)
        self.peak_procs = max(self.peak_procs, len(tree))
        self.samples += 1

    def run(self) -> None:
        while True:
            c0 = time.thread_time()
            self.sample()
            cost = time.thread_time() - c0
            self.sampler_cpu_s += cost
            self.max_sample_s = max(self.max_sample_s, cost)
            if self._stop_event.wait(max(self.interval, 9 * cost)):
                return

    def cpu_by_role(self) -> dict[str, float]:
        """Last sampled own utime + stime summed per role (a lower bound, as sampled_cpu_s)."""
        by: dict[str, float] = {}
        for key, (proc, _) in self.last.items():
            role = self.role_of.get(key, "other")
            by[role] = by.get(role, 0.0) + proc.ticks / CLK_TCK
        return by

    def summary(self) -> dict:
        return {
            "peak_pss_mib_by_role": {r: kib / 1024 for r, kib in self.peak_pss_by_role.items()},
            "peak_processes_by_kind": dict(sorted(self.peak_by_kind.items())),
            "processes_seen_by_kind": {k: len(v) for k, v in sorted(self.seen_by_kind.items())},
            "cpu_s_by_role_sampled": self.cpu_by_role(),
            "sampler_cpu_s": self.sampler_cpu_s,
            "max_sample_s": self.max_sample_s,
        }


class MeasuredRun:
    """Processes started one after the other and measured as one tree (compare_flower.measure, for several
    commands): the sampler's root is the first; this process is a subreaper and all of them are its children."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env, self.cwd = env, cwd
        self.before, self.busy0 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_busy_s()
        self.wall0, self.t0 = time.time(), time.monotonic()
        self.procs: list[subprocess.Popen] = []
        self.sampler: RoleSampler | None = None

    def start(self, cmd: list[str], log: Path) -> subprocess.Popen:
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
        if self.sampler is None:
            self.sampler = RoleSampler(proc.pid)
            self.sampler.start()
        self.procs.append(proc)
        return proc

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def finish(self, returncode: int, wall_s: float) -> Run:
        """SIGTERM what still runs (the last started first), SIGKILL it after STOP_WAIT_S, then wait for every
        process left behind (compare_flower._reap_all) and take the CPU figures."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert self.sampler is not None
        self.sampler.stop()  # before reaping: the last samples of the adopted processes are kept
        reaped, killed = _reap_all()
        after, busy1 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_busy_s()
        kernel = (after.ru_utime - self.before.ru_utime) + (after.ru_stime - self.before.ru_stime)
        waited = reaped | {p.pid for p in self.procs}
        auto = self.sampler.auto_reaped_cpu_s(waited)
        return Run(returncode, self.wall0, wall_s, self.sampler, kernel, auto, killed, busy1 - self.busy0)


class LogTail:
    """New lines of a log that another process writes (read from where the last call stopped)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data, self.partial = (self.partial + data).rsplit(b"\n", 1) if b"\n" in data else (b"", self.partial + data)
        return data.decode(errors="replace").splitlines() if data else []


def watch(main: subprocess.Popen, m: MeasuredRun, round_ends, rounds: int, limits: argparse.Namespace, others=()):
    """Wait for main to exit, or stop waiting at a limit: (main's exit status or None, seconds since the start,
    why the run was stopped or None). round_ends() -> the round ends so far; others: processes whose exit ends the
    run as well (the SuperLink)."""
    while True:
        rc = main.poll()
        if rc is not None:
            return rc, m.elapsed(), None
        ends, elapsed = round_ends(), m.elapsed()
        if not ends and elapsed > limits.round1_timeout:
            return None, elapsed, f"did not finish round 1 in {limits.round1_timeout:.0f} s"
        if elapsed > limits.timeout:
            return None, elapsed, f"finished {len(ends)} of {rounds} rounds in {limits.timeout:.0f} s"
        for name, proc in others:
            if proc.poll() is not None:
                return None, elapsed, f"{name} exited (status {proc.returncode}) after {elapsed:.0f} s"
        time.sleep(POLL_S)


def _free_ports(k: int) -> list[int]:
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def _finish_measurement(system: str, n: int, rounds: int, run: Run, ends: list[float]) -> Measurement:
    m = _figures(system, n, rounds, run, ends)
    assert isinstance(run.sampler, RoleSampler)
    m.extra.update(run.sampler.summary())
    nodes_mib = run.sampler.peak_pss_by_role.get("nodes", 0) / 1024
    m.extra["pss_mib_per_node"] = nodes_mib / n
    m.extra["pss_mib_total_per_node"] = m.peak_pss_mib / n
    return m


# ------------------------------------------------------------------------------------------- shuffledp
def device_config(n: int, rounds: int) -> str:
    """compare_flower.shuffledp_config, each user on a device node of its own (the fleet runner)."""
    return shuffledp_config(n, rounds) + f"[deployment]\nclient_nodes = {n}\nusers_per_node = 1\n"


_DEVICE_REFUSED = re.compile(r"device (client-\d+): shuffler stream failed \((StatusCode\.\w+): (.*)\); reconnecting")


def _analyzer_ends(path: Path, wall0: float) -> list[float]:
    ends: dict[int, float] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        if m := _ANALYZER_ROUND.match(line):
            stamp = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            ends.setdefault(int(m.group(2)), stamp - wall0)
    return [ends[r] for r in sorted(ends)]


def run_shuffledp_devices(n: int, rounds: int, logs: Path, limits: argparse.Namespace, tag: str = "") -> Measurement:
    config = device_config(n, rounds)
    with tempfile.TemporaryDirectory(prefix="compare-shuffledp-devices-") as tmp:
        path, out = Path(tmp) / "config.toml", Path(tmp) / "out"
        path.write_text(config)
        log = logs / f"shuffledp-{n}{tag}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        m = MeasuredRun(env, ROOT)
        cli = m.start([*shuffledp_command(), "run", str(path), "--out", str(out)], log)
        analyzer_log = out / "logs" / "analyzer.log"
        rc, wall, stopped = watch(cli, m, lambda: _analyzer_ends(analyzer_log, m.wall0), rounds, limits)
        if stopped:  # Ctrl-C: the CLI cancels the run, fetches what the analyzer has and stops the services
            cli.send_signal(signal.SIGINT)
            try:
                cli.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        run = m.finish(cli.returncode if cli.returncode is not None else -1, wall)
        ends = _analyzer_ends(analyzer_log, run.wall0)
        if (out / "logs").is_dir():
            for f in (out / "logs").iterdir():
                shutil.copy(f, logs / f"shuffledp-{n}{tag}-{f.name}")
        metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else []
        refused: dict[str, str] = {}
        for f in sorted((out / "logs").glob("fleet-*.log")) if (out / "logs").is_dir() else ():
            for line in f.read_text(errors="replace").splitlines():
                if hit := _DEVICE_REFUSED.search(line):
                    refused.setdefault(hit.group(1), f"{hit.group(2)}: {hit.group(3)}")
    text = log.read_text(errors="replace")
    res = _finish_measurement("shuffledp", n, rounds, run, ends[:rounds])
    if acc := re.search(r"^test accuracy: ([0-9.]+)", text, re.M):
        res.accuracy = float(acc.group(1))
    if spent := re.search(r"^privacy spent: eps = ([0-9.]+), delta = ([0-9.e-]+)", text, re.M):
        res.extra.update(eps_spent=float(spent.group(1)), delta=float(spent.group(2)))
    contributors = [r["contributors"] for r in metrics]
    res.extra.update(contributors=contributors, analyzer_round_seconds=[r["seconds"] for r in metrics])
    res.extra["devices_refused_by_shuffler"] = refused
    res.extra["users_sha256"] = shuffledp_users_fingerprint(config)
    res.extra["config_toml"] = config
    # what happened, in one line
    if stopped:
        status = stopped
    elif cli.returncode != 0:
        status = f"failed: `shuffledp run` exited with status {cli.returncode} (log: {log})"
    elif len(contributors) < rounds:
        status = f"failed: {len(contributors)} of {rounds} rounds in metrics.json (log: {log})"
    elif min(contributors) < n:
        status = f"failed: trained on {min(contributors)} of {n} users"
    else:
        status = "ok"
    if status != "ok" and refused:  # the devices' own account of why they were left out
        reasons = "; ".join(sorted(set(refused.values())))
        status += f"; {len(refused)} of {n} device nodes were refused by the shuffler at least once ({reasons})"
    res.extra["status"] = status
    return res


# ------------------------------------------------------------------------------------------- flower
FLOWER_APP_MODULE = '''"""Generated by benchmarks/compare_flower_deployment.py: the Flower App of one run."""

import argparse

import _flower_task as task
from flwr.serverapp import ServerApp

ARGS = argparse.Namespace(**{args!r})

client_app = task.client_app  # one user per SuperNode: node_config partition-id
server_app = ServerApp()


@server_app.main()
def main(grid, context):
    X, y, _, _ = task.load_digits_split(ARGS.test_fraction)
    print("FLOWER_DATA " + task.fingerprint(X[: ARGS.clients], y[: ARGS.clients]), flush=True)
    task.build_server_app(ARGS)(grid, context)  # built here: the ClientApp processes import this module too
'''

FLOWER_APP_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "digits-logreg"
version = "1.0.0"
description = "shuffledp's digits task (benchmarks/_flower_task.py) on Flower's deployment runtime"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "shuffledp-bench"

[tool.flwr.app.components]
serverapp = "flower_app:server_app"
clientapp = "flower_app:client_app"
"""


def flower_app(directory: Path, n: int, rounds: int) -> Path:
    """A Flower App directory for `flwr run`: _flower_task.py, a module exposing its apps, a pyproject.toml."""
    directory.mkdir(parents=True)
    shutil.copy(FLOWER_TASK, directory / "_flower_task.py")
    args = {"clients": n, "rounds": rounds, "lr": LR, "radius": RADIUS, "clip": CLIP, "test_fraction": TEST_FRACTION}
    (directory / "flower_app.py").write_text(FLOWER_APP_MODULE.format(args=args))
    (directory / "pyproject.toml").write_text(FLOWER_APP_PYPROJECT)
    return directory


def _read(path: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))  # without colour codes


def _flower_run_state(bin_dir: Path, env: dict[str, str], cwd: Path, run_log: Path) -> dict | None:
    """`flwr ls --run-id` of the run started in run_log (status, status details) and the count of SuperNodes per
    status (`flwr supernode ls`), asked while the SuperLink still runs."""
    run_id = re.search(r"Successfully started run (\d+)", _read(run_log))
    cmd = [str(bin_dir / "flwr"), "ls", SUPERLINK_CONNECTION, "--format", "json"]  # this SuperLink's one run, if any
    cmd += ["--run-id", run_id.group(1)] if run_id else []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=30)
    except subprocess.TimeoutExpired:
        return {"status": "unknown (`flwr ls` took over 30 s)"}
    try:
        runs = json.loads(out.stdout)["runs"]
        state = runs[0] if runs else {"status": "no run submitted"}
    except (ValueError, KeyError, IndexError):
        return {"status": "unknown", "flwr_ls_output": (out.stdout + out.stderr)[-2000:]}
    cmd = [str(bin_dir / "flwr"), "supernode", "ls", SUPERLINK_CONNECTION, "--format", "json"]
    try:  # the SuperNodes as the SuperLink sees them: how many per status (online, offline, registered, ...)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=30)
        state["supernodes"] = dict(Counter(node["status"] for node in json.loads(out.stdout)["nodes"]))
    except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        pass
    return state


def run_flower_deployment(
    python: Path, n: int, rounds: int, logs: Path, limits: argparse.Namespace, tag: str = ""
) -> Measurement:
    bin_dir = python.parent
    run_logs = logs / f"flower-{n}{tag}"
    run_logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="compare-flower-deployment-") as tmp:
        app = flower_app(Path(tmp) / "app", n, rounds)
        link_port, *node_ports = _free_ports(n + 1)
        home = Path(tmp) / "flwr-home"  # Flower's configuration and installed apps: not the user's ~/.flwr
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{SUPERLINK_CONNECTION}"\n\n[superlink.{SUPERLINK_CONNECTION}]\n'
            f'address = "127.0.0.1:{link_port}"\ninsecure = true\n'
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLWR_HOME": str(home), **FLOWER_ENV}
        # the SuperLink and the SuperNodes start flower-superexec by name
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env.pop("VIRTUAL_ENV", None)
        m = MeasuredRun(env, Path(tmp))
        link_cmd = [str(bin_dir / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation"]
        link = m.start([*link_cmd, "--host", "127.0.0.1", "--port", str(link_port)], run_logs / "superlink.log")
        run_log = run_logs / "flwr-run.log"
        by_round: dict[int, float] = {}
        tail = LogTail(run_log)

        def round_ends() -> list[float]:
            for line in tail.lines():  # `flwr run --stream` may send a line twice (it resumes a broken stream)
                if hit := re.match(r"^FLOWER_ROUND (\d+) \d+ ([0-9.]+) ", line):
                    by_round.setdefault(int(hit.group(1)), float(hit.group(2)) - m.wall0)
            return [by_round[r] for r in sorted(by_round)]

        marks: dict[str, float] = {}
        nodes: list[subprocess.Popen] = []
        run_state = None
        if not _wait_port(link_port, link, PORT_WAIT_S):
            rc, wall, stopped = -1, m.elapsed(), f"the SuperLink did not accept connections in {PORT_WAIT_S:.0f} s"
        else:
            marks["superlink_port_open"] = m.elapsed()
            for j, port in enumerate(node_ports):
                node = [str(bin_dir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}"]
                node += ["--port", str(port), "--node-config", f"partition-id={j} num-partitions={n}"]
                nodes.append(m.start(node, run_logs / f"supernode-{j}.log"))
            marks["supernodes_started"] = m.elapsed()
            cli = m.start([str(bin_dir / "flwr"), "run", str(app), SUPERLINK_CONNECTION, "--stream"], run_log)
            rc, wall, stopped = watch(cli, m, round_ends, rounds, limits, others=[("the SuperLink", link)])
            if stopped and cli.poll() is None:
                cli.send_signal(signal.SIGINT)  # `flwr run` stops streaming; the federation is stopped below
            if "FLOWER_RESULT" not in run_log.read_text(errors="replace"):  # what the SuperLink says of the run
                run_state = _flower_run_state(bin_dir, env, Path(tmp), run_log)
        # SuperNodes that exited by themselves before the end (exit code: how many)
        gone = dict(sorted(Counter(p.returncode for p in nodes if p.poll() is not None).items()))
        run = m.finish(rc if rc is not None else -1, wall)
    ends = round_ends()
    text = run_log.read_text(errors="replace") if run_log.exists() else ""
    res = _finish_measurement("flower", n, rounds, run, ends[:rounds])
    marks.update({name: float(t) - run.wall0 for name, t in re.findall(r"^FLOWER_MARK (\S+) ([0-9.]+)", text, re.M)})
    res.extra["marks_s"] = marks  # where the start-up goes
    if data := re.search(r"^FLOWER_DATA ([0-9a-f]+)", text, re.M):
        res.extra["users_sha256"] = data.group(1)
    if result := re.search(r"^FLOWER_RESULT (.*)$", text, re.M):
        res.accuracy = json.loads(result.group(1))["accuracy"]
    res.extra["ports"] = {"superlink": link_port, "supernodes": [node_ports[0], node_ports[-1]] if n else []}
    clientapps = res.extra["processes_seen_by_kind"].get("flwr-clientapp", 0)
    res.extra["clientapp_processes_seen"] = clientapps
    if stopped:
        status = stopped
    elif rc != 0:
        status = f"failed: `flwr run` exited with status {rc} (log: {run_log})"
    elif len(ends) < rounds or res.accuracy is None:
        status = f"failed: {len(ends)} of {rounds} rounds and no result (log: {run_log})"
    else:
        status = "ok"
    res.extra["supernodes_exited_early"] = gone
    res.extra["flower_run_state"] = run_state
    if status != "ok":
        if run_state:
            status += f"; the SuperLink's state of the run: {run_state.get('status')}"
            status += f" ({run_state['status-details']})" if run_state.get("status-details") else ""
            if "supernodes" in run_state:
                listed = ", ".join(f"{count} {state}" for state, count in sorted(run_state["supernodes"].items()))
                status += f"; SuperNodes as the SuperLink lists them: {listed or 'none'}"
        if gone:
            exits = ", ".join(f"{count} with exit code {code}" for code, count in gone.items())
            logs_text = "".join(_read(f) for f in run_logs.glob("supernode-*.log"))
            why = sorted(set(re.findall(r"Exit Code: \d+\n(.*)", logs_text)))
            status += f"; {sum(gone.values())} of {n} SuperNodes exited before the end ({exits}: {'; '.join(why)})"
        status += f"; {clientapps} ClientApp processes seen, for {n} nodes x {len(ends) + 1} round(s) started"
    res.extra["status"] = status
    return res


# ------------------------------------------------------------------------------------------- report
COLUMNS = ("start-up s", "s/round", "wall s", "CPU s", "peak PSS MiB", "PSS/node MiB", "procs", "accuracy")


def _cells(m: Measurement) -> list[float | None]:
    per_node = m.extra.get("pss_mib_per_node")
    return [m.startup_s, m.s_per_round, m.wall_s, m.cpu_s, m.peak_pss_mib, per_node, m.peak_procs, m.accuracy]


def _fmt(v: float | None, col: str) -> str:
    if v is None:
        return "-"
    if col == "procs":
        return f"{v:.0f}"
    if col in ("s/round", "accuracy"):
        return f"{v:.3f}"
    return f"{v:.1f}"


def _status(m: Measurement) -> str:
    status = m.extra.get("status", "?")
    return "ok" if status == "ok" else ("DNF round 1" if status.startswith("did not finish round 1") else "FAILED")


def print_table(results: list[Measurement], rounds: int, reps: int) -> None:
    print(f"\n== shuffledp device nodes vs Flower deployment runtime ({rounds} rounds, median of {reps} run(s)) ==")
    print(f"{'N':>4}  {'system':<10}" + "".join(f"{c:>14}" for c in COLUMNS) + "  status")
    for n in sorted({m.clients for m in results}):
        rows = [m for m in results if m.clients == n]
        for m in rows:
            cells = "".join(f"{_fmt(v, c):>14}" for v, c in zip(_cells(m), COLUMNS, strict=True))
            print(f"{n:>4}  {m.system:<10}{cells}  {_status(m)}")
        sd = next((m for m in rows if m.system == "shuffledp" and _status(m) == "ok"), None)
        fl = next((m for m in rows if m.system == "flower" and _status(m) == "ok"), None)
        if sd and fl:
            ratios = [
                f"{f / s:.1f}" if f is not None and s and c != "accuracy" else "-"
                for f, s, c in zip(_cells(fl), _cells(sd), COLUMNS, strict=True)
            ]
            print(f"{'':>4}  {'fl/sd':<10}" + "".join(f"{r:>14}" for r in ratios))
    print("\nwhat happened:")
    for m in results:
        e = m.extra
        pss = ", ".join(f"{r} {v:.0f}" for r, v in e.get("peak_pss_mib_by_role", {}).items())
        print(
            f"- N = {m.clients}, {m.system}: {e.get('status')}. Peak PSS MiB by role: {pss}; CPU s = "
            f"{m.cpu_kernel_s:.1f} waited + {m.cpu_auto_reaped_s:.1f} auto-reaped; other CPU s on the machine "
            f"{e.get('other_cpu_s', 0):.1f} (the sampler's own {e.get('sampler_cpu_s', 0):.1f})"
        )


def differences(versions: dict[str, str]) -> list[str]:
    return [
        "same: digits, public split, user j = training example j, one example per user, N users = N nodes, all in "
        f"every round; logreg (d = 650), theta_0 = 0, clip {CLIP} (l2), learning rate {LR}, projection onto the ball "
        f"of radius {RADIUS}, released model = mean of theta_0..theta_{{T-1}}, test accuracy on the held-out split "
        "(server side in both). Checked: sha256 of the users' examples.",
        "privacy: shuffledp clips and randomizes on each device (PVEC, calibrated accountant, the check-in, per-user "
        "policy and durable spend record, a privacy ledger), the shuffler aggregates anonymous messages, eps 8. "
        "Flower: none (FedAvg of clipped gradients, no noise, eps = inf); its accuracy is the noiseless upper "
        "bound (checked against shuffledp's PGD without noise), not comparable.",
        "processes: shuffledp = the `shuffledp run` CLI + shuffler + analyzer + 2 fleet processes hosting the N "
        "device nodes (each node its own gRPC channel and stream to the shuffler, spend store and policy). "
        f"Flower {versions.get('flwr', FLWR_VERSION)} = SuperLink (+ its SuperExec, + a ServerApp process per run) + "
        "N SuperNode processes (each + a SuperExec, + a ClientApp process per message, i.e. per round) + the "
        "`flwr run --stream` CLI. Both plain text on loopback.",
        "transport: shuffledp: gRPC, a stream per node, invitations pushed; Flower 1.42: HTTP (its Fleet API), the "
        "SuperNodes poll the SuperLink for messages.",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", help=f"N: nodes = users, all in every round (default {NODES})")
    p.add_argument("--rounds", type=int, help=f"rounds (default {ROUNDS})")
    p.add_argument("--systems", nargs="+", choices=("shuffledp", "flower"), default=["shuffledp", "flower"])
    p.add_argument("--round1-timeout", type=float, default=ROUND1_TIMEOUT_S, help="stop a run whose round 1 has not "
                   f"ended this many s after its start (default {ROUND1_TIMEOUT_S:.0f})")  # fmt: skip
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"stop a run after this many s ({TIMEOUT_S:.0f})")
    p.add_argument("--repeats", type=int, default=1, help="runs of each system per N, medians shown (default 1)")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="Flower's venv (created if missing)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "compare_flower_deployment", help="for the JSON")
    p.add_argument("--quick", action="store_true", help="smoke test: 4 nodes, 2 rounds")
    p.add_argument("--no-warm-up", action="store_true", help="skip the untimed tiny run of each system first")
    args = p.parse_args(argv)
    nodes = args.nodes or ([4] if args.quick else list(NODES))
    rounds = args.rounds or (2 if args.quick else ROUNDS)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    _become_subreaper()
    t_start = time.monotonic()

    python, versions = None, {}
    if "flower" in args.systems:
        python = ensure_flower_venv(args.venv)
        versions = flower_versions(python)
    print(
        f"compare_flower_deployment: nodes {nodes}, rounds {rounds}, repeats {args.repeats}, systems {args.systems}, "
        f"flwr {versions or '-'}; a run is stopped if round 1 has not ended after {args.round1_timeout:.0f} s or "
        f"the run after {args.timeout:.0f} s",
        flush=True,
    )
    if not args.no_warm_up:
        print("warm-up: one untimed run of 2 nodes and 1 round per system ...", flush=True)
        warm = logs / "warm-up"
        warm.mkdir(exist_ok=True)
        if "shuffledp" in args.systems:
            run_shuffledp_devices(2, 1, warm, args)
        if python is not None:
            run_flower_deployment(python, 2, 1, warm, args)

    results: list[Measurement] = []
    for n in nodes:
        runs: dict[str, list[Measurement]] = {}
        for r in range(args.repeats):  # the systems alternate, so that a slow spell of the machine hits both
            tag = f"-r{r + 1}" if args.repeats > 1 else ""
            for system in args.systems:
                print(f"running {system} with {n} nodes (repeat {r + 1}/{args.repeats}) ...", flush=True)
                if system == "shuffledp":
                    m = run_shuffledp_devices(n, rounds, logs, args, tag)
                else:
                    assert python is not None
                    m = run_flower_deployment(python, n, rounds, logs, args, tag)
                print(f"  {system} N = {n}: {m.extra['status']}", flush=True)
                runs.setdefault(system, []).append(m)
        rows = []
        for ms in runs.values():
            row = median_of(ms)
            row.extra["status"] = "; ".join(sorted({x.extra["status"] for x in ms}))
            for key in ("pss_mib_per_node", "pss_mib_total_per_node"):
                row.extra[key] = statistics.median(x.extra[key] for x in ms)
            rows.append(row)
        shas = {m.extra.get("users_sha256") for ms in runs.values() for m in ms} - {None}
        if len(shas) > 1:
            print(f"WARNING: the systems saw different users' data: {shas}")
        for fl in (m for m in rows if m.system == "flower" and _status(m) == "ok"):
            fl.extra["noiseless_pgd_accuracy"] = ref = noiseless_accuracy(n, fl.rounds)
            if fl.accuracy is None or abs(fl.accuracy - ref) > 1e-9:
                print(f"WARNING: Flower released accuracy {fl.accuracy}, shuffledp's PGD without noise {ref}")
        results.extend(rows)

    print_table(results, rounds, args.repeats)
    diffs = differences(versions)
    print("\ndifferences between the two runs of the task:")
    for d in diffs:
        print(f"- {d}")
    total = time.monotonic() - t_start
    out = args.out / "compare_flower_deployment.json"
    payload = {
        "flwr_pinned": FLWR_VERSION,
        "flower_venv_versions": versions,
        "command": [sys.executable, *sys.argv],
        "cores": os.cpu_count(),
        "sample_s": SAMPLE_S,
        "round1_timeout_s": args.round1_timeout,
        "timeout_s": args.timeout,
        "total_s": total,
        "results": [asdict(m) for m in results],
        "differences": diffs,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nresults: {out} (the whole script: {total:.0f} s)")
    # Flower's runs that cannot finish are results; shuffledp's own runs must finish
    return 0 if all(m.extra.get("status") == "ok" for m in results if m.system == "shuffledp") else 1


if __name__ == "__main__":
    sys.exit(main())
