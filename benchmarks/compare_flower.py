"""Benchmark (issue 15 item 5): shuffledp against Flower's simulation engine on the same task, on this machine.

Run (from the repo root, with the repo's venv):
    python benchmarks/compare_flower.py [--clients 100 1000] [--rounds 10] [--flower-rounds R] [--out DIR]
        [--systems shuffledp flower] [--venv .venv-compare] [--client-cpus 1 0.25] [--repeats 3] [--quick]
        [--no-warm-up]
--quick: 20 clients, 2 rounds, 1 repeat (a smoke test); --systems shuffledp skips Flower and never creates its venv
(CI). Before the measured runs, one untimed run of 20 users and 1 round per system warms the page cache. Each system
runs --repeats times per client count (alternating), the table shows medians. Flower runs once per --client-cpus
value (Ray num_cpus per ClientApp actor; default 1 = one actor per core and 0.25 = 8 actors, see CLIENT_CPUS).
Run it on an otherwise idle machine: the CPU time the machine spent outside the measured tree is kept in the JSON
(other_cpu_s) and printed. The default
(100 and 1000 clients, 10 rounds, 3 repeats, two Flower settings) takes about 10 minutes on 2 cores.

Flower is never a dependency of the product: the script creates (or reuses) a throwaway venv, .venv-compare/ at
the repo root (git-ignored; --venv elsewhere), and pip-installs flwr[simulation]==FLWR_VERSION (the newest release
that installs here, with its Ray), numpy and scikit-learn into it. Flower's half is benchmarks/_flower_task.py, run
by that venv's python; shuffledp's half is `<repo venv>/bin/shuffledp run config.toml --out TMPDIR`.

Task, the same for both (the differences that remain are printed by the script: differences()): scikit-learn's
digits (1797 x 64, pixels / 16), shuffledp's public split (every 4th example held out), N users of one training
example each (user j = training example j), N = clients per round, every user in every round; multinomial logistic
regression (d = 650), l2 clipping to 1, learning rate 8, projection onto the ball of radius 10, theta_0 = 0, the
mean of the iterates released. shuffledp: fully interactive PGD over PVEC with the default privacy (calibrated,
eps 8). Flower: FedAvg over N virtual SuperNodes, fraction_train 1.0, min nodes N, each ClientApp one SGD step on
its clipped gradient, no privacy. The script checks that both see the same users' data (a sha256 of the examples)
and that Flower releases exactly the model of shuffledp's PGD without noise (computed here with shuffledp's code).

Each system runs as its own subprocess, one after the other, and is measured the same way:
- wall: from starting the command to its exit (this process's monotonic clock).
- start-up: from starting the command to the end of round 1, as logged by the system's server side with a wall
  clock time stamp (shuffledp: the analyzer's "round 0: ok" log line, ms resolution; Flower: the line the ServerApp
  prints after round 1's aggregate, from its evaluate_fn).
- s/round: the median of the intervals between consecutive round ends after the first (rounds 2..T).
- peak PSS: a sampler thread reads /proc/<pid>/smaps_rollup of the command and all its descendants every 0.1 s
  and sums their Pss (shared pages split between their users, so a process tree is not counted twice); the peak
  of those sums. A spike shorter than 0.1 s can be missed.
- CPU: this process makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so that every descendant
  orphaned on the way (a daemon, a Ray worker whose parent died) is re-parented to it and can still be waited for;
  after the command exits it waits up to LINGER_S for what remains (then SIGTERM, SIGKILL: only descendants of the
  command it started) and reaps everything. CPU = what the kernel reports for the waited children
  (getrusage(RUSAGE_CHILDREN) after minus before: each process's own utime + stime plus those of every descendant
  it waited for, so each process once, to its exit) + the last sampled utime + stime (own and waited children's,
  /proc/<pid>/stat) of the processes the kernel reaped by itself because their parent ignores SIGCHLD (Ray's raylet
  does: its workers' time reaches no rusage) and that this process did not wait for itself. The sampler keeps each
  process's last sample keyed by (pid, start time). Printed as a check: every process's last sampled own utime +
  stime summed (a lower bound: it misses each process's last < 0.1 s and processes shorter than a sample).
- procs: the most processes of the tree seen in one sample.
The sampler runs in this process (not measured) on the same 2 cores: about 5 ms of CPU per sample of shuffledp's
tree and 17 ms of Flower's (smaps_rollup walks the large mappings of Ray's processes), i.e. ~0.17 core during a Flower
run; in a check at 1000 clients Flower's rounds were ~5% slower than with 1 s sampling, with the same peak PSS.

Printed: one table per clients-per-round (both systems' figures and the ratios Flower / shuffledp), the list of
differences between the two runs of the task, and the path of the JSON file with every figure (default
results/compare_flower/compare_flower.json; logs beside it).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FLWR_VERSION = "1.42.0"  # newest flwr on PyPI that installs here (Python 3.11; its simulation extra brings Ray 2.55)
FLOWER_TASK = ROOT / "benchmarks" / "_flower_task.py"
DEFAULT_VENV = ROOT / ".venv-compare"
SAMPLE_S = 0.1
LINGER_S = 10.0  # how long processes left behind by a finished command may take to exit by themselves
CLK_TCK = os.sysconf("SC_CLK_TCK")
PR_SET_CHILD_SUBREAPER = 36
LR, RADIUS, CLIP, EPS, TEST_FRACTION = 8.0, 10.0, 1.0, 8.0, 0.25
# Ray num_cpus per ClientApp actor, each value a Flower run of its own: 1 = one actor per core (starts fastest, least
# memory); 0.25 = 8 actors on 2 cores, the fastest rounds at 1000 clients in a sweep of 1, 0.5, 0.25 and 0.125
# (about 7.0, 5.0, 3.8 and 4.4 s/round: a ClientApp call mostly waits on messages, not on a core)
CLIENT_CPUS = (1.0, 0.25)
# no network calls home from either side (Flower's telemetry, Ray's usage stats); CPU only for Ray
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "CUDA_VISIBLE_DEVICES": ""}


# ------------------------------------------------------------------------------------------- measuring
class Proc(NamedTuple):
    ppid: int
    start: int  # start time in ticks since boot: (pid, start) names a process even if its pid is reused
    ticks: int  # utime + stime of the process itself (all its threads)
    child_ticks: int  # cutime + cstime: of the children it has waited for
    name: str


def _stat(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:  # gone
        return None
    close = raw.rfind(b")")  # the name in parentheses may hold spaces
    fields = raw[close + 2 :].split()  # fields[0] is field 3 of proc(5), "state"
    name = raw[raw.find(b"(") + 1 : close].decode(errors="replace")
    return Proc(
        int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]), name
    )


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1])
    except OSError:  # gone, or a zombie (no memory left)
        pass
    return 0


def _ignores_sigchld(pid: int) -> bool:
    """Whether pid ignores SIGCHLD: its exited children are then reaped by the kernel, their CPU time is lost."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGCHLD - 1) & 1)
    except OSError:
        pass
    return False


def _table() -> dict[int, Proc]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            table[int(name)] = st
    return table


def _tree(root: int, table: dict[int, Proc]) -> list[int]:
    """root and its descendants, plus whatever this (subreaper) process has adopted and their descendants."""
    me = os.getpid()
    children: dict[int, list[int]] = {}
    for pid, proc in table.items():
        children.setdefault(proc.ppid, []).append(pid)
    todo = [root] + [p for p in children.get(me, []) if p != root]
    seen: list[int] = []
    while todo:
        pid = todo.pop()
        if pid in table:
            seen.append(pid)
            todo.extend(children.get(pid, []))
    return seen


class TreeSampler(threading.Thread):
    """Samples the process tree of one command every SAMPLE_S (module docstring: peak PSS, last CPU per process)."""

    def __init__(self, root: int, interval: float = SAMPLE_S) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.interval = interval
        self.peak_pss_kib = 0
        self.peak_procs = 0
        self.samples = 0
        # (pid, start) -> (its last sample, whether its parent then ignored SIGCHLD)
        self.last: dict[tuple[int, int], tuple[Proc, bool]] = {}
        self.peak_by_name: dict[str, int] = {}  # process name -> most seen at once (what the tree is made of)
        self._stop_event = threading.Event()

    def sample(self) -> None:
        table = _table()
        tree = _tree(self.root, table)
        ignoring = {ppid: _ignores_sigchld(ppid) for ppid in {table[pid].ppid for pid in tree}}
        pss, names = 0, {}
        for pid in tree:
            proc = table[pid]
            self.last[(pid, proc.start)] = (proc, ignoring[proc.ppid])
            names[proc.name] = names.get(proc.name, 0) + 1
            pss += _pss_kib(pid)
        for name, count in names.items():
            self.peak_by_name[name] = max(self.peak_by_name.get(name, 0), count)
        self.peak_pss_kib = max(self.peak_pss_kib, pss)
        self.peak_procs = max(self.peak_procs, len(tree))
        self.samples += 1

    def run(self) -> None:
        self.sample()
        while not self._stop_event.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def sampled_cpu_s(self) -> float:
        """Sum of every process's last sampled own utime + stime (the check: a lower bound)."""
        return sum(proc.ticks for proc, _ in self.last.values()) / CLK_TCK

    def sampled_cpu_by_name(self) -> dict[str, float]:
        """Where the CPU went: last sampled own utime + stime summed per process name."""
        by: dict[str, float] = {}
        for proc, _ in self.last.values():
            by[proc.name] = by.get(proc.name, 0.0) + proc.ticks / CLK_TCK
        return dict(sorted(by.items(), key=lambda kv: -kv[1]))

    def auto_reaped_cpu_s(self, reaped: set[int]) -> float:
        """Last sampled utime + stime (own and waited children's) of the processes whose parent ignored SIGCHLD
        and that this process did not wait for itself: the kernel's RUSAGE_CHILDREN never saw them."""
        lost = [p.ticks + p.child_ticks for (pid, _), (p, ign) in self.last.items() if ign and pid not in reaped]
        return sum(lost) / CLK_TCK


def _machine_busy_s() -> float:
    """CPU time the machine has spent busy since boot, all cores (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _adopted() -> list[int]:
    me = os.getpid()
    return [pid for pid, proc in _table().items() if proc.ppid == me]


def _reap_all() -> tuple[set[int], int]:
    """Wait for every process left over (all adopted by this subreaper), killing them after LINGER_S: (the pids
    waited for, how many had to be killed)."""
    deadline, killed, reaped = time.monotonic() + LINGER_S, 0, set()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            left = _adopted()
            killed = max(killed, len(left))
            for pid in left:  # only descendants of the command this script started (they were re-parented here)
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 3.0
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return reaped, killed  # no child left: everything waited for
            if pid == 0:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            else:
                reaped.add(pid)
    return reaped, killed


@dataclass
class Measurement:
    system: str
    clients: int
    rounds: int
    returncode: int
    wall_s: float
    startup_s: float | None
    s_per_round: float | None
    cpu_s: float  # cpu_kernel_s + cpu_auto_reaped_s
    cpu_kernel_s: float
    cpu_auto_reaped_s: float
    cpu_sampled_s: float
    peak_pss_mib: float
    peak_procs: int
    samples: int
    killed_leftovers: int
    round_ends_s: list[float] = field(default_factory=list)  # since the command's start
    accuracy: float | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Run:
    returncode: int
    wall0: float  # time.time() when the command was started
    wall_s: float
    sampler: TreeSampler
    cpu_kernel_s: float
    cpu_auto_reaped_s: float
    killed: int
    machine_cpu_s: float  # busy CPU time of the whole machine over the run (/proc/stat)


def measure(cmd: list[str], log: Path, env: dict[str, str], cwd: Path, interval: float = SAMPLE_S) -> Run:
    """Run cmd (its output to log) under the sampler, then wait for its whole tree (module docstring)."""
    before, busy0 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_busy_s()
    with log.open("wb") as out:
        wall0, t0 = time.time(), time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        sampler = TreeSampler(proc.pid, interval)
        sampler.start()
        rc = proc.wait()
        wall = time.monotonic() - t0
    sampler.stop()  # before reaping: the last samples of the adopted processes are kept
    reaped, killed = _reap_all()
    after, busy1 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_busy_s()
    kernel = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(rc, wall0, wall, sampler, kernel, sampler.auto_reaped_cpu_s(reaped | {proc.pid}), killed, busy1 - busy0)


def _figures(system: str, clients: int, rounds: int, run: Run, ends: list[float]) -> Measurement:
    intervals = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    s = run.sampler
    return Measurement(
        system=system,
        clients=clients,
        rounds=rounds,
        returncode=run.returncode,
        wall_s=run.wall_s,
        startup_s=ends[0] if ends else None,
        s_per_round=statistics.median(intervals) if intervals else None,
        cpu_s=run.cpu_kernel_s + run.cpu_auto_reaped_s,
        cpu_kernel_s=run.cpu_kernel_s,
        cpu_auto_reaped_s=run.cpu_auto_reaped_s,
        cpu_sampled_s=s.sampled_cpu_s(),
        peak_pss_mib=s.peak_pss_kib / 1024,
        peak_procs=s.peak_procs,
        samples=s.samples,
        killed_leftovers=run.killed,
        round_ends_s=ends,
        extra={
            "processes_by_name": dict(sorted(s.peak_by_name.items())),
            "cpu_s_by_name": s.sampled_cpu_by_name(),
            # the machine's busy CPU time outside the measured tree (this script's sampler included): other work
            # running at the same time would skew every figure
            "other_cpu_s": run.machine_cpu_s - run.cpu_kernel_s - run.cpu_auto_reaped_s,
        },
    )


def fingerprint(X: np.ndarray, y: np.ndarray) -> str:
    """The same sha256 as _flower_task.fingerprint (which cannot be imported here: it imports flwr)."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(X, dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(y, dtype=np.int64).tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- shuffledp
def shuffledp_config(clients: int, rounds: int) -> str:
    """The embedded default task (digits, logreg, fully interactive PGD, PVEC calibrated, eps 8) for `clients`
    users; radius and learning rate set as the embedded default file sets them (the built-ins differ)."""
    return (
        f'[data]\ndataset = "digits"\ntest_fraction = {TEST_FRACTION}\nexamples_per_user = 1\nmax_users = {clients}\n'
        f'[model]\ntask = "logreg"\nradius = {RADIUS}\n'
        f'[privacy]\neps = {EPS}\nprotocol = "pvec"\nclip_norm = {CLIP}\n'
        '[privacy.pvec]\ncalibration = "calibrated"\n'
        f'[schedule]\nkind = "fully_interactive"\nrounds = {rounds}\nlearning_rate = {LR}\noutput = "mean"\n'
    )


def shuffledp_users_fingerprint(config_toml: str) -> str:
    """sha256 of the users' examples as shuffledp's client nodes hold them (user_shard over every node)."""
    from shuffledp.config import parse_config
    from shuffledp.data import load_dataset, user_shard

    cfg = parse_config(config_toml)
    ds = load_dataset(cfg.data, cfg.model.task)
    users: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    nodes = cfg.deployment.client_nodes
    for node in range(nodes):
        ids, X, y = user_shard(ds, node, nodes, cfg.data.examples_per_user, cfg.data.max_users)
        for uid, xs, ys in zip(ids, X, y, strict=True):
            users[int(uid.split("-u")[1])] = (xs[0], ys[0])  # one example per user
    order = sorted(users)
    return fingerprint(np.array([users[j][0] for j in order]), np.array([users[j][1] for j in order]))


def noiseless_accuracy(clients: int, rounds: int) -> float:
    """Held-out accuracy of shuffledp's PGD without its privacy noise, computed here with shuffledp's own model,
    clipping and projection: what Flower's run must release if both run the same task."""
    from shuffledp.config import parse_config
    from shuffledp.data import load_dataset
    from shuffledp.mechanisms.pvec import clip_rows
    from shuffledp.models import make_model, project_l2_ball

    cfg = parse_config(shuffledp_config(clients, rounds))
    ds = load_dataset(cfg.data, cfg.model.task)
    model = make_model(cfg.model.task, ds.num_features, ds.num_classes)
    X, y = ds.X_train[:clients], ds.y_train[:clients]
    theta, iterates = model.init_params(), []
    for _ in range(rounds):
        iterates.append(theta)
        g = clip_rows(model.per_example_gradients(theta, X, y), CLIP).mean(axis=0)
        theta = project_l2_ball(theta - LR * g, RADIUS)
    return float(np.mean(model.predict(np.mean(iterates, axis=0), ds.X_test) == ds.y_test))


def shuffledp_command() -> list[str]:
    for exe in (ROOT / ".venv" / "bin" / "shuffledp", Path(sys.executable).parent / "shuffledp"):
        if exe.exists():
            return [str(exe)]
    found = shutil.which("shuffledp")
    return [found] if found else [sys.executable, "-m", "shuffledp.cli"]


_ANALYZER_ROUND = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* round (\d+): ")


def run_shuffledp(clients: int, rounds: int, logs: Path, tag: str = "") -> Measurement:
    config = shuffledp_config(clients, rounds)
    with tempfile.TemporaryDirectory(prefix="compare-shuffledp-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(config)
        out = Path(tmp) / "out"
        log = logs / f"shuffledp-{clients}{tag}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        run = measure([*shuffledp_command(), "run", str(path), "--out", str(out)], log, env, ROOT)
        ends: dict[int, float] = {}
        analyzer_log = out / "logs" / "analyzer.log"
        if analyzer_log.exists():
            shutil.copy(analyzer_log, logs / f"shuffledp-{clients}{tag}-analyzer.log")
            for line in analyzer_log.read_text(errors="replace").splitlines():
                if m := _ANALYZER_ROUND.match(line):
                    stamp = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    ends.setdefault(int(m.group(2)), stamp - run.wall0)
        per_round = []
        if (out / "metrics.json").exists():
            per_round = [r["seconds"] for r in json.loads((out / "metrics.json").read_text())]
    text = log.read_text(errors="replace")
    m = _figures("shuffledp", clients, rounds, run, [ends[r] for r in sorted(ends)])
    if acc := re.search(r"^test accuracy: ([0-9.]+)", text, re.M):
        m.accuracy = float(acc.group(1))
    if spent := re.search(r"^privacy spent: eps = ([0-9.]+), delta = ([0-9.e-]+)", text, re.M):
        m.extra.update(eps_spent=float(spent.group(1)), delta=float(spent.group(2)))
    m.extra["analyzer_round_seconds"] = per_round  # the analyzer's own per-round durations (metrics.json)
    m.extra["users_sha256"] = shuffledp_users_fingerprint(config)
    m.extra["config_toml"] = config
    return m


# ------------------------------------------------------------------------------------------- flower
def ensure_flower_venv(venv: Path) -> Path:
    """The comparison venv's python, with flwr[simulation]==FLWR_VERSION installed (created on first use)."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} (Flower's throwaway venv, never the product's)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = "import importlib.metadata as m; print(m.version('flwr'))"
    have = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if have.returncode != 0 or have.stdout.strip() != FLWR_VERSION:
        print(f"installing flwr[simulation]=={FLWR_VERSION} into {venv}", flush=True)
        pip = [str(python), "-m", "pip", "install", "-q", f"flwr[simulation]=={FLWR_VERSION}", "numpy", "scikit-learn"]
        subprocess.run(pip, check=True)
    return python


def flower_versions(python: Path) -> dict[str, str]:
    probe = "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in %r}))"
    names = ["flwr", "ray", "numpy", "scikit-learn"]
    out = subprocess.run([str(python), "-c", probe % names], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_flower(
    python: Path, clients: int, rounds: int, client_cpus: float, logs: Path, tag: str = "", label: str = "flower"
) -> Measurement:
    log = logs / f"{label}-{clients}{tag}.log"
    cmd = [str(python), str(FLOWER_TASK), "--clients", str(clients), "--rounds", str(rounds)]
    cmd += ["--lr", str(LR), "--radius", str(RADIUS), "--clip", str(CLIP), "--test-fraction", str(TEST_FRACTION)]
    cmd += ["--client-cpus", str(client_cpus)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **QUIET_ENV}
    env.pop("VIRTUAL_ENV", None)  # the comparison venv's python, whatever venv this script runs in
    with tempfile.TemporaryDirectory(prefix="compare-flower-") as tmp:  # Flower's and Ray's files stay out of ROOT
        run = measure(cmd, log, env, Path(tmp))
    text = log.read_text(errors="replace")
    ends = [float(t) - run.wall0 for t in re.findall(r"^FLOWER_ROUND \d+ \d+ ([0-9.]+) ", text, re.M)]
    m = _figures(label, clients, rounds, run, ends)
    m.extra["client_cpus"] = client_cpus
    if res := re.search(r"^FLOWER_RESULT (.*)$", text, re.M):
        m.accuracy = json.loads(res.group(1))["accuracy"]
    marks = re.findall(r"^FLOWER_MARK (\S+) ([0-9.]+)", text, re.M)
    m.extra["marks_s"] = {name: float(t) - run.wall0 for name, t in marks}  # where the start-up goes
    if data := re.search(r"^FLOWER_DATA ([0-9a-f]+)", text, re.M):
        m.extra["users_sha256"] = data.group(1)
    # Ray names an actor's process after its class, cut to 15 characters by the kernel: ray::ClientAppA
    m.extra["ray_actors"] = sum(c for name, c in run.sampler.peak_by_name.items() if name.startswith("ray::ClientApp"))
    return m


# ------------------------------------------------------------------------------------------- report
def median_of(ms: list[Measurement]) -> Measurement:
    """Every figure's median over the repeats (each repeat kept in extra["repeats"])."""
    if len(ms) == 1:
        return ms[0]

    def med(name: str) -> float | None:
        values = [getattr(m, name) for m in ms]
        return None if any(v is None for v in values) else statistics.median(values)

    numbers = ("wall_s", "startup_s", "s_per_round", "cpu_s", "cpu_kernel_s", "cpu_auto_reaped_s", "cpu_sampled_s")
    numbers += ("peak_pss_mib", "peak_procs", "samples", "accuracy")
    m = Measurement(**{**asdict(ms[0]), **{name: med(name) for name in numbers}})
    m.returncode = max((x.returncode for x in ms), key=abs)
    m.killed_leftovers = max(x.killed_leftovers for x in ms)
    m.round_ends_s = []
    m.extra = {**ms[0].extra, "repeats": [asdict(x) for x in ms]}
    return m


COLUMNS = ("wall s", "start-up s", "s/round", "CPU s", "peak PSS MiB", "procs", "accuracy")


def _cells(m: Measurement) -> list[float | None]:
    return [m.wall_s, m.startup_s, m.s_per_round, m.cpu_s, m.peak_pss_mib, m.peak_procs, m.accuracy]


def _fmt(v: float | None, col: str) -> str:
    if v is None:
        return "-"
    if col == "s/round":
        return f"{v:.4f}"
    if col == "procs":
        return f"{v:.0f}"
    return f"{v:.3f}" if col == "accuracy" else f"{v:.2f}"


def print_table(clients: int, rows: list[Measurement]) -> None:
    rounds = ", ".join(f"{m.system} {m.rounds}" for m in rows)
    reps = len(rows[0].extra.get("repeats", [])) or 1
    print(f"\n== {clients} clients per round (rounds: {rounds}; median of {reps} run(s) each) ==")
    print(f"{'':<22}" + "".join(f"{c:>14}" for c in COLUMNS))
    for m in rows:
        status = "" if m.returncode == 0 else f"  FAILED (exit {m.returncode})"
        cells = "".join(f"{_fmt(v, c):>14}" for v, c in zip(_cells(m), COLUMNS, strict=True))
        print(f"{m.system:<22}{cells}{status}")
    sd = next((m for m in rows if m.system == "shuffledp"), None)
    for fl in (m for m in rows if m.system.startswith("flower") and sd is not None):
        ratios = []
        for f, s, c in zip(_cells(fl), _cells(sd), COLUMNS, strict=True):
            ratios.append(f"{f / s:.2f}" if f is not None and s and c != "accuracy" else "-")
        print(f"{fl.system + '/shuffledp':<22}" + "".join(f"{r:>14}" for r in ratios))
    for m in rows:
        others = [x["extra"]["other_cpu_s"] for x in m.extra.get("repeats", [asdict(m)])]
        print(
            f"{m.system} CPU s = {m.cpu_kernel_s:.2f} waited + {m.cpu_auto_reaped_s:.2f} auto-reaped (sampled); "
            f"check, every process's last sample summed: {m.cpu_sampled_s:.2f}; the machine's other CPU s during "
            "the run(s): " + "/".join(f"{o:.2f}" for o in others)
        )
        if reps > 1:  # the spread behind each median
            spread = [
                f"{c} " + "/".join(_fmt(v, c) for v in vals)
                for c, *vals in zip(COLUMNS[:5], *(_cells(Measurement(**x)) for x in m.extra["repeats"]), strict=False)
            ]
            print(f"{m.system} runs: " + ", ".join(spread))


def differences(results: list[Measurement], versions: dict[str, str]) -> list[str]:
    sd = next((m for m in results if m.system == "shuffledp"), None)
    spent = (
        f"spent eps = {sd.extra.get('eps_spent')}, delta = {sd.extra.get('delta')}"
        if sd and "eps_spent" in sd.extra
        else "eps 8, delta min(1/n, 1e-3)"
    )
    settings = {m.system: m.extra for m in results if m.system.startswith("flower")}
    actors = " or ".join(
        f"{e.get('ray_actors', '?')} ClientApp actors at num_cpus {e.get('client_cpus')} ({name})"
        for name, e in settings.items()
    )
    return [
        "same: digits, public split (every 4th example held out), user j = training example j, one example per "
        "user, N users = clients per round, all in every round; logreg (d = 650), theta_0 = 0, clip 1 (l2), "
        f"learning rate {LR}, projection onto the ball of radius {RADIUS}, released model = mean of theta_0..theta_"
        "{T-1}, test accuracy on the held-out split (server side in both). Checked: sha256 of the users' examples.",
        "privacy: shuffledp clips and randomizes locally (PVEC, calibrated accountant, the check-in round trip, "
        f"per-user policy checks, a privacy ledger), the shuffler aggregates the anonymous messages, {spent}. "
        "Flower: none: clipped gradients are averaged exactly (no noise, no shuffling, no accounting, eps = inf); "
        "its accuracy is the noiseless upper bound, not comparable.",
        "update: shuffledp's analyzer takes theta - lr * (decoded noisy sum / contributors) and projects (PGD, paper "
        "000 Alg 5). Flower: each ClientApp returns one SGD step theta - lr * g on its clipped gradient, FedAvg "
        "averages them weighted by num-examples = 1 (= theta - lr * mean g) and a FedAvg subclass projects. "
        "Checked: Flower's released accuracy equals that of shuffledp's PGD run here without noise (shuffledp.models, "
        "clip_rows, project_l2_ball): same arithmetic, only the noise differs.",
        "processes: shuffledp = the `shuffledp run` CLI + shuffler + analyzer + 2 client-node processes over gRPC "
        "on loopback (plain text), each node hosting N/2 users and computing their gradients vectorised. Flower "
        f"{versions.get('flwr', FLWR_VERSION)} (Ray {versions.get('ray', '?')}) = one Python process running "
        "run_simulation (ServerApp, in-process SuperLink) + Ray's head processes + "
        f"{actors or 'its ClientApp actors'} on {os.cpu_count()} cores; one message per user "
        "per round, each run by an actor as one ClientApp call.",
        "evaluation: shuffledp's analyzer evaluates each round on the public split; Flower's evaluate_fn the same "
        "(federated evaluation off: fraction_evaluate 0).",
        "API: flwr.simulation.run_simulation (deprecated in Flower 1.42 for `flwr run`, which starts a detached local "
        "SuperLink daemon outside the command's process tree and keeps it running: it could not be measured the "
        "same way). Flower's telemetry and Ray's usage stats off, Ray's dashboard off (Flower's default).",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", help="clients (= users) per round (default 100 1000)")
    p.add_argument("--rounds", type=int, help="rounds (default 10)")
    p.add_argument("--flower-rounds", type=int, help="Flower's rounds if fewer than --rounds (a long Flower run)")
    p.add_argument("--systems", nargs="+", choices=("shuffledp", "flower"), default=["shuffledp", "flower"])
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="Flower's venv (created if missing)")
    p.add_argument(
        "--client-cpus",
        type=float,
        nargs="+",
        default=list(CLIENT_CPUS),
        help="Ray num_cpus per ClientApp actor; one Flower run (and table row flower@CPUS) per value (1 0.25)",
    )
    p.add_argument("--repeats", type=int, help="runs of each system per client count, medians shown (default 3)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "compare_flower", help="directory for the JSON")
    p.add_argument("--quick", action="store_true", help="smoke test: 20 clients, 2 rounds")
    p.add_argument("--no-warm-up", action="store_true", help="skip the untimed tiny run of each system first")
    args = p.parse_args(argv)
    clients = args.clients or ([20] if args.quick else [100, 1000])
    rounds = args.rounds or (2 if args.quick else 10)
    flower_rounds = args.flower_rounds or rounds
    repeats = args.repeats or (1 if args.quick else 3)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    _become_subreaper()

    python, versions = None, {}
    if "flower" in args.systems:
        python = ensure_flower_venv(args.venv)
        versions = flower_versions(python)
    print(
        f"compare_flower: clients {clients}, rounds {rounds} (flower {flower_rounds}), repeats {repeats}, "
        f"systems {args.systems}, flwr {versions or '-'}"
    )
    if not args.no_warm_up:
        # one tiny untimed run of each first: every file both read (interpreters, libraries, Ray's binaries) is then
        # in the page cache, so that neither pays a cold disk and the first system measured is not penalised
        print("warm-up: one untimed run of 20 users and 1 round per system ...", flush=True)
        warm = logs / "warm-up"
        warm.mkdir(exist_ok=True)
        if "shuffledp" in args.systems:
            run_shuffledp(20, 1, warm)
        if python is not None:
            run_flower(python, 20, 1, args.client_cpus[-1], warm)

    results: list[Measurement] = []
    for n in clients:
        runs: dict[str, list[Measurement]] = {}
        for r in range(repeats):  # the systems alternate, so that a slow spell of the machine hits both
            tag = f"-r{r + 1}" if repeats > 1 else ""
            if "shuffledp" in args.systems:
                print(f"running shuffledp with {n} users (repeat {r + 1}/{repeats}) ...", flush=True)
                runs.setdefault("shuffledp", []).append(run_shuffledp(n, rounds, logs, tag))
            if python is not None:
                for cpus in args.client_cpus:
                    label = f"flower@{cpus:g}" if len(args.client_cpus) > 1 else "flower"
                    print(f"running {label} with {n} users (repeat {r + 1}/{repeats}) ...", flush=True)
                    m = run_flower(python, n, flower_rounds, cpus, logs, tag, label)
                    runs.setdefault(label, []).append(m)
        rows = [median_of(ms) for ms in runs.values()]
        shas = {m.extra.get("users_sha256") for ms in runs.values() for m in ms}
        if len(shas) != 1:
            print(f"WARNING: the systems saw different users' data: {shas}")
        for fl in (m for m in rows if m.system.startswith("flower")):
            fl.extra["noiseless_pgd_accuracy"] = ref = noiseless_accuracy(n, fl.rounds)
            if fl.accuracy is None or abs(fl.accuracy - ref) > 1e-9:
                print(f"WARNING: {fl.system} released accuracy {fl.accuracy}, shuffledp's PGD without noise {ref}")
        print_table(n, rows)
        results.extend(rows)

    diffs = differences(results, versions)
    print("\ndifferences between the two runs of the task:")
    for d in diffs:
        print(f"- {d}")
    out = args.out / "compare_flower.json"
    payload = {
        "flwr_pinned": FLWR_VERSION,
        "flower_venv_versions": versions,
        "command": [sys.executable, *sys.argv],
        "cores": os.cpu_count(),
        "sample_s": SAMPLE_S,
        "results": [asdict(m) for m in results],
        "differences": diffs,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nresults: {out}")
    return 0 if all(m.returncode == 0 for m in results) else 1


if __name__ == "__main__":
    sys.exit(main())
