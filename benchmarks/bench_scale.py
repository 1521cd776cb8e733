"""Benchmark (issue 15 item 4): how a fully interactive run scales with the users per round on one machine.

Run: python benchmarks/bench_scale.py [--users 1000 10000 100000 1000000] [--rounds 3] [--nodes 4] [--out DIR]

For each population size N: synthetic logistic regression (data.dataset = "synthetic", n = N training users with
one example each, dim 10, the generator's fixed 20000-example test set), PVEC count mode calibrated for eps = 8,
fully interactive (every user in every round), `--nodes` client nodes. The run is `shuffledp run` as a separate
process (shuffler, analyzer and nodes as its child processes on loopback), sampled every 0.2 s through /proc:
  s/round      median of RoundMetrics.seconds over the rounds after the first (the analyzer's clock, spec to model)
  start-up     command start until round 1 begins (its line's arrival minus round 1's own seconds)
  peak MiB     VmHWM of each service process (the shuffler, the analyzer, the largest client node)
  in-process   the same round's work for all N users in this one process (gradients, clip, encode_counts, sum,
               decode, step: benchmarks/bench_round.InProcessRound, with the services' allocator thresholds),
               median of 3 after a warm-up
The shuffler's resident memory after each round is sampled too: `shuffler MiB by round` shows whether it grows
with the number of rounds. Per-user memory is the slope of peak memory between the two largest sizes (bytes per
user the process hosts: all N at the shuffler and analyzer, N / nodes at a node).
Prints a table, writes bench_scale.json and bench_scale.png (log-log) to --out (default results/bench_scale-<time>).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_round import InProcessRound, timed  # noqa: E402
from shuffledp.services.shuffler_state import MAX_USERS_PER_NODE  # noqa: E402

from shuffledp.cli.serve import one_blas_thread, return_large_blocks  # noqa: E402
from shuffledp.config import parse_config  # noqa: E402
from shuffledp.data import load_dataset  # noqa: E402
from shuffledp.mechanisms.pvec import PvecParams  # noqa: E402
from shuffledp.models import make_model  # noqa: E402
from shuffledp.planning import plan_run  # noqa: E402

DIM = 10


def config_toml(users: int, rounds: int, nodes: int, dim: int = DIM, check_in: bool | None = None) -> str:
    """The run of one size; check_in None = PVEC's default (on with calibrated noise)."""
    pvec = "" if check_in is None else f"\n[privacy.pvec]\ncheck_in = {str(check_in).lower()}\n"
    return f"""\
[data]
dataset = "synthetic"
n = {users}
dim = {dim}

[model]
task = "logreg"

[privacy]
eps = 8.0
{pvec}
[schedule]
kind = "fully_interactive"
rounds = {rounds}

[deployment]
client_nodes = {nodes}
round_deadline_seconds = 600.0
population_wait_seconds = 900.0  # 10^7 users: every process draws the data set on 2 cores before registering
"""


def _status(pid: int, field: str) -> float:
    """A /proc/<pid>/status field in MiB (VmHWM, VmRSS); nan once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def _services(parent: int) -> dict[str, int]:
    """The service processes started by the `shuffledp run` process `parent`: name -> pid."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid != parent or "serve" not in argv:
            continue
        kind = argv[argv.index("serve") + 1]
        name = f"client-{argv[argv.index('--node-index') + 1]}" if kind == "client" else kind
        out[name] = int(entry.name)
    return out


class Sampler(threading.Thread):
    """Peak memory (VmHWM) of every service of one run, and the shuffler's RSS whenever a round line arrives."""

    def __init__(self, parent: int) -> None:
        super().__init__(daemon=True)
        self.parent, self.peak, self.pids = parent, {}, {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.sample()

    def sample(self) -> None:
        self.pids.update(_services(self.parent))
        for name, pid in self.pids.items():
            hwm = _status(pid, "VmHWM")
            if hwm == hwm:  # not nan: the process is alive
                self.peak[name] = max(self.peak.get(name, 0.0), hwm)


def one_run(users: int, rounds: int, nodes: int, workdir: Path, dim: int = DIM, check_in: bool | None = None) -> dict:
    cfg_path = workdir / f"scale-{users}.toml"
    cfg_path.write_text(config_toml(users, rounds, nodes, dim, check_in))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shuffledp.cli", "run", str(cfg_path), "--out", str(workdir / f"run-{users}")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    sampler = Sampler(proc.pid)
    sampler.start()
    lines, shuffler_by_round = [], []
    for line in proc.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
        if line.startswith("round "):
            sampler.sample()
            shuffler_by_round.append(_status(sampler.pids.get("shuffler", -1), "VmRSS"))
            print(f"  [{users}] {line.rstrip()}", flush=True)
    rc = proc.wait()
    sampler.done.set()
    wall = time.monotonic() - t0
    text = "\n".join(t for _, t in lines)
    if rc != 0 or "state: COMPLETED" not in text:
        raise SystemExit(f"run with {users} users failed (exit {rc}):\n{text}")
    rounds_seen = [(t, float(re.search(r"\(\s*([0-9.]+) s\)", s).group(1))) for t, s in lines if s.startswith("round ")]
    nodes_peak = [v for k, v in sampler.peak.items() if k.startswith("client-")]
    return {
        "users": users,
        "nodes": nodes,
        "rounds": len(rounds_seen),
        "seconds_per_round": statistics.median(s for _, s in rounds_seen[1:]) if len(rounds_seen) > 1 else None,
        "first_round_seconds": rounds_seen[0][1],
        "startup_seconds": rounds_seen[0][0] - rounds_seen[0][1],
        "wall_seconds": wall,
        "peak_mib": {
            "shuffler": sampler.peak.get("shuffler"),
            "analyzer": sampler.peak.get("analyzer"),
            "client node (max)": max(nodes_peak) if nodes_peak else None,
        },
        "shuffler_rss_mib_by_round": shuffler_by_round,
        "eps_spent": float(re.search(r"privacy spent: eps = ([0-9.]+)", text).group(1)),
    }


def in_process_seconds(users: int, rounds: int, nodes: int, dim: int = DIM, check_in: bool | None = None) -> float:
    cfg = parse_config(config_toml(users, rounds, nodes, dim, check_in))
    ds = load_dataset(cfg.data, cfg.model.task)
    model = make_model(cfg.model.task, ds.num_features, ds.num_classes)
    plan = plan_run(cfg, users, users, model, ds.feature_norm_bound)
    round_ = InProcessRound(cfg, model, plan, PvecParams(**plan["params"]), nodes)
    return statistics.median(timed(round_, 3))


def per_user_bytes(rows: list[dict], key: str, hosted) -> float | None:
    """Slope of peak memory between the two largest sizes, in bytes per user the process hosts."""
    if len(rows) < 2 or rows[-1]["peak_mib"][key] is None or rows[-2]["peak_mib"][key] is None:
        return None
    a, b = rows[-2], rows[-1]
    du = hosted(b) - hosted(a)
    return (b["peak_mib"][key] - a["peak_mib"][key]) * 2**20 / du if du else None


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = [r["users"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("seconds_per_round", "end to end (s/round)"), ("in_process_seconds", "in one process")):
        ax1.loglog(users, [r[key] for r in rows], "o-", label=label)
    ax1.loglog(users, [r["startup_seconds"] for r in rows], "s--", label="start-up (s)")
    ax1.set_xlabel("users per round")
    ax1.set_ylabel("seconds")
    ax1.legend()
    for key in rows[0]["peak_mib"]:
        ax2.loglog(users, [r["peak_mib"][key] for r in rows], "o-", label=key)
    ax2.set_xlabel("users per round")
    ax2.set_ylabel("peak resident memory (MiB)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, nargs="+", default=[1000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per run (the first is not in s/round)")
    ap.add_argument("--nodes", type=int, default=4, help="client nodes (processes) sharing the users")
    ap.add_argument("--dim", type=int, default=DIM, help=f"features of the synthetic data (default {DIM})")
    ap.add_argument(
        "--check-in",
        choices=["default", "on", "off"],
        default="default",
        help="privacy.pvec.check_in: the default (on with calibrated noise), on, or off",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results" / f"bench_scale-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    if args.rounds < 2 or args.nodes < 1 or min(args.users) < args.nodes or args.dim < 1:
        ap.error("need --rounds >= 2, --nodes >= 1, --dim >= 1 and at least one user per node")
    if max(args.users) > args.nodes * MAX_USERS_PER_NODE:
        need = -(-max(args.users) // MAX_USERS_PER_NODE)
        ap.error(f"{max(args.users)} users need --nodes >= {need}: the shuffler admits at most 2^20 users per node")
    check_in = {"default": None, "on": True, "off": False}[args.check_in]
    return_large_blocks()  # the in-process round runs with the services' allocator thresholds (bench_round)
    one_blas_thread()  # and their BLAS threads
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        for users in sorted(args.users):
            row = one_run(users, args.rounds, args.nodes, Path(tmp), args.dim, check_in)
            row["in_process_seconds"] = in_process_seconds(users, args.rounds, args.nodes, args.dim, check_in)
            rows.append(row)
    print(
        f"\nfully interactive PVEC rounds, synthetic logreg dim {args.dim}, check-in {args.check_in}, {args.nodes} "
        "client nodes, 2-core machine"
    )
    head = f"{'users/round':>12} {'s/round':>8} {'in-proc':>8} {'ratio':>6} {'start-up':>9} {'shuffler':>9} "
    print(head + f"{'analyzer':>9} {'node max':>9}  shuffler MiB by round")
    for r in rows:
        m = r["peak_mib"]
        ratio = r["seconds_per_round"] / r["in_process_seconds"]
        by_round = " ".join(f"{x:.0f}" for x in r["shuffler_rss_mib_by_round"])
        print(
            f"{r['users']:>12} {r['seconds_per_round']:>8.3f} {r['in_process_seconds']:>8.4f} {ratio:>6.2f} "
            f"{r['startup_seconds']:>8.1f}s {m['shuffler']:>8.0f}M {m['analyzer']:>8.0f}M "
            f"{m['client node (max)']:>8.0f}M  {by_round}"
        )
    slopes = {
        "shuffler": per_user_bytes(rows, "shuffler", lambda r: r["users"]),
        "analyzer": per_user_bytes(rows, "analyzer", lambda r: r["users"]),
        "client node": per_user_bytes(rows, "client node (max)", lambda r: r["users"] / r["nodes"]),
    }
    if any(v is not None for v in slopes.values()):
        print("memory per hosted user (slope between the two largest sizes): " + ", ".join(
            f"{k} {v:.0f} B" for k, v in slopes.items() if v is not None
        ))  # fmt: skip
    (args.out / "bench_scale.json").write_text(json.dumps({"rows": rows, "bytes_per_user": slopes}, indent=2))
    plot(args.out / "bench_scale.png", rows)
    print(f"largest run: {rows[-1]['users']} users per round; results in {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
