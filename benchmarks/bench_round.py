"""Benchmark (issue 4): one PVEC count-mode training round, d = 100, 10^3 users, end to end vs in one process.

Run: python benchmarks/bench_round.py [--rounds 20] [--mode both|analyzer|direct] [--check-in both|on|off]
         [--dim 100 650 10000] [--profile]

Problem: synthetic least squares with d - 1 features + bias (d = --dim parameters, default 100), 1000 training
users with one example each (an NPZ file in a temporary directory, read by every party through the run config's
[data]).
Each round is fully interactive (all 1000 users), PVEC count mode, calibrated accounting.

End to end, the services run as separate OS processes on loopback (`python -m shuffledp.cli serve ... --insecure`):
  analyzer mode  shuffler + 2 client nodes (500 users each) + the real analyzer; a run of 1 + R rounds is driven
                 through the operator API and the round time is RoundMetrics.seconds (the analyzer's clock from
                 sending the RoundSpec through ExecuteRound, decode_counts and the optimizer step; since issue 30 the
                 ledger commit is written with the round's checkpoint, after this clock stops). Also printed: the
                 full round cycle, the median gap between consecutive rounds' reservations in the ledger (every
                 durable write of the analyzer, the population probe and the evaluation included).
  direct mode    shuffler + 2 client nodes; this process plays the analyzer: builds the RoundSpec from the same
                 plan (shuffledp.planning.plan_run), calls ExecuteRound, decode_counts, PGD step. No ledger, no
                 evaluation: the pure cost of the distributed round.
Two rounds in one process, each timed over the same R rounds, before and after the services' runs (same load):
  in-process            gradients of the 1000 users at the same model, clipping, each user's rounding, their sum per
                        label plus each node's users' summed noise (what the nodes send), decode_counts, PGD step (the
                        same modules the services call): the arithmetic alone.
  services in one process  the same round with the services' own logic and no processes or gRPC (ServicesRound):
                        the shuffler's ShufflerState with its durable participation record, each node's NodeCore
                        with its durable spend record (the users' policies, the check-in's two invitations, its
                        preparation), decode, PGD step: the work a distributed round
                        does, minus the distribution.
Both rounds in one process run with the services' allocator thresholds (serve.return_large_blocks, which every
service sets at start): with glibc's own, fresh large blocks fault their pages in at every round, and the round at
d = 100 took ~1.8x as long (measured 2026-11-27: 8.5-9.8 ms against 4.5-6.0), and with the services' one BLAS
thread (serve.one_blas_thread; OPENBLAS_NUM_THREADS and the like, if set, are respected by both).
Both with the check-in (privacy.pvec.check_in, the default for calibrated PVEC: the users are invited twice, once to
check in, then to send) and without (one invitation, the same exchange as the in-process round's single pass).
Printed: median round times over R rounds after one warm-up round, the end-to-end round's ratio to each of the two
(target <= 1.3, issue 30), the peak resident memory (VmHWM of /proc/<pid>/status) of every service process and, in
direct mode, each service's CPU time per round (/proc/<pid>/stat; clock-tick resolution, so a mean over R rounds).
--profile: the median of each part of the services' round in one process.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import queue
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
from shuffledp.clients.node import NodeCore, UserShard
from shuffledp.clients.spend_store import SqliteSpendStore
from shuffledp.services.ledger import PrivacyEvent
from shuffledp.services.shuffler import _invitation, _request, _submission
from shuffledp.services.shuffler_state import ShufflerState, SqliteParticipationStore

from shuffledp.cli.run import Cluster, drive_run, start_local_cluster
from shuffledp.cli.serve import one_blas_thread, return_large_blocks
from shuffledp.config import RunConfig, parse_config
from shuffledp.data import load_dataset, user_shard
from shuffledp.mechanisms.pvec import PvecParams, decode_counts, round_counts, summed_noise
from shuffledp.models import Model, make_model
from shuffledp.optimizers.pgd import pgd
from shuffledp.planning import plan_run, round_spec
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

USERS = 1000
NODES = 2
TEST_FRACTION = 0.2  # 1250 examples -> 1000 training users + 250 public test examples
TARGET_RATIO = 1.3  # issue 30 (issue 15: 1.5, issue 4: 3)


# ------------------------------------------------------------------------------------------------ set-up
def write_problem(workdir: Path, rng: np.random.Generator, dim: int = 100) -> Path:
    """Synthetic least squares in d = dim parameters (dim - 1 features + bias): rows of norm ~1,
    y = <w*, x> + b* + noise."""
    features = dim - 1  # shuffledp.models: the leastsq parameter vector has num_features + 1 entries
    k = int(round(USERS / (1.0 - TEST_FRACTION)))
    X = rng.normal(size=(k, features)) / np.sqrt(features)
    w = rng.normal(size=features)
    w /= np.linalg.norm(w)
    y = X @ w + 0.5 + 0.1 * rng.normal(size=k)
    path = workdir / f"lsq_d{dim}.npz"
    np.savez(path, X=X, y=y)
    return path


def config_toml(data_path: Path, rounds: int, check_in: bool = True) -> str:
    return f"""\
[data]
dataset = "path"
path = "{data_path.as_posix()}"
test_fraction = {TEST_FRACTION}
max_users = {USERS}

[model]
task = "leastsq"
radius = 10.0

[privacy]
eps = 8.0
delta = 1e-4
clip_norm = 1.0
min_contributors_fraction = 0.9
[privacy.pvec]
calibration = "calibrated"
check_in = {str(check_in).lower()}

[schedule]
kind = "fully_interactive"
rounds = {rounds}
learning_rate = 0.5

[transport]
mode = "counts"

[deployment]
client_nodes = {NODES}
round_deadline_seconds = 60.0
insecure = true
"""


def vm_hwm_mib(pid: int) -> float:
    """Peak resident set size of a process (VmHWM), MiB; nan when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def peak_memory(cluster: Cluster) -> dict[str, float]:
    return {name: vm_hwm_mib(proc.pid) for name, proc in cluster.procs.items()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat fields 14, 15); nan when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# ------------------------------------------------------------------------------------------ in one process
class InProcessRound:
    """The same round without services: all users' gradients, clip, rounding, sum, each node's summed noise (as the
    nodes send it: pvec_round._put_sums), decode, PGD step."""

    def __init__(self, cfg: RunConfig, model: Model, plan: dict, params: PvecParams, nodes: int = NODES):
        ds = load_dataset(cfg.data, cfg.model.task)
        parts = [user_shard(ds, i, nodes, 1, cfg.data.max_users) for i in range(nodes)]
        self.X = np.concatenate([p[1][:, 0, :] for p in parts])
        self.y = np.concatenate([p[2][:, 0] for p in parts])
        self.model, self.params, self.nodes = model, params, nodes
        self.opt = pgd(plan["learning_rate"], plan["radius"])
        self.state = self.opt.init(model.init_params())
        self.rng = make_rng()

    def __call__(self) -> None:
        theta = self.state.last
        # round_counts clips each gradient itself, as the nodes' rounding does: no clip_rows before it (that pass
        # was the in-process round's alone until session 21, ~0.4 ms per 100 users at d = 650)
        G = self.model.per_example_gradients(theta, self.X, self.y)
        totals = round_counts(G, self.params, self.rng).sum(axis=0, dtype=np.uint64)
        n, p = self.X.shape[0], self.params
        for users in np.array_split(np.arange(n), self.nodes):  # each node's users' noise, summed (one draw each)
            totals += summed_noise(p.m, users.size, p.p, p.d, self.rng)
        grad = decode_counts(totals, n, self.params) / n
        _, self.state = self.opt.step(grad, self.state, theta)


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ------------------------------------------------------------------------------------------------ transport floor
def _echo_server(port_out: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """A gRPC server in its own process that echoes raw bytes: a unary method and a bidirectional stream."""
    from concurrent import futures

    echo = {
        "U": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
        "S": grpc.stream_stream_rpc_method_handler(lambda reqs, ctx: (m for m in reqs)),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo", echo),))
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(0)


def transport_floor(repeats: int = 200) -> tuple[float, float]:
    """Median round trips (seconds) of an empty message between this process and another on loopback, unary (the
    analyzer's ExecuteRound) and on a bidirectional stream (the shuffler's invitations to a node and its answers).
    A check-in round takes at least one of the first and two of the second on its path, whatever its work."""
    ctx = multiprocessing.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_echo_server, args=(port_q, stop), daemon=True)
    proc.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port_q.get(timeout=60)}") as ch:
            unary = ch.unary_unary("/echo/U")
            unary(b"x", timeout=30, wait_for_ready=True)
            t_unary = timed(lambda: unary(b"x", timeout=30), repeats)
            out: queue.Queue = queue.Queue()
            replies = ch.stream_stream("/echo/S")(iter(out.get, None))

            def ping() -> None:
                out.put(b"x")
                next(replies)

            t_stream = timed(ping, repeats)
            out.put(None)
        return statistics.median(t_unary), statistics.median(t_stream)
    finally:
        stop.set()
        proc.join(timeout=10)


# ------------------------------------------------------------------------------------------------ analyzer
def bench_analyzer(cfg_path: Path, workdir: Path, toml: str) -> tuple[list[float], dict[str, float], str]:
    """Real analyzer run: RoundMetrics.seconds of every released round after the first; `info` also gives the
    median round cycle (gaps between the ledger's reservation times)."""
    cluster, _, analyzer = start_local_cluster(cfg_path, workdir, NODES)
    try:
        result = drive_run(analyzer, toml, cluster, echo=lambda *_: None)
        mem = peak_memory(cluster)
    finally:
        cluster.stop()
    st = result.status
    if st.state != pb.COMPLETED:
        raise RuntimeError(f"analyzer run ended {pb.RunState.Name(st.state)}: {st.message}")
    released = [m for m in st.metrics if m.released]
    if len(released) != len(st.metrics) or any(m.contributors != USERS for m in released):
        raise RuntimeError(f"not every round was released with {USERS} contributors: {list(st.metrics)}")
    with sqlite3.connect(workdir / "state" / "ledger.sqlite") as db:
        reserved = [t for (t,) in db.execute("SELECT reserved_at FROM rounds ORDER BY round")]
    cycle = statistics.median(np.diff(reserved[1:])) if len(reserved) > 2 else math.nan
    info = (
        f"eps spent {st.budget.eps_spent:.3f} (limit {st.budget.eps_limit:g}), "
        f"test loss {released[0].loss:.4f} -> {released[-1].loss:.4f}; round cycle (reservation to reservation, "
        f"median) {cycle * 1e3:.1f} ms"
    )
    return [m.seconds for m in released[1:]], mem, info


# -------------------------------------------------------------------------------------------------- direct
def wait_population(stub: pbg.ShufflerStub, cluster: Cluster, timeout: float = 60.0) -> pb.PopulationStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pop = stub.GetPopulation(pb.PopulationRequest(run_id="bench"), timeout=10)
        if pop.connected_nodes >= NODES and pop.admitted_users >= USERS:
            return pop
        cluster.check_alive()
        time.sleep(0.1)
    raise RuntimeError(f"population incomplete after {timeout:.0f} s: {pop}")


def bench_direct(
    cfg_path: Path, workdir: Path, plan: dict, params: PvecParams, model: Model, rounds: int
) -> tuple[list[float], dict[str, float], dict[str, float], dict[str, float]]:
    """This process calls ExecuteRound exactly as the analyzer does; returns round times, memory, phase split and
    CPU time per round of each service (independent of what else runs on a shared machine)."""
    cluster, shuffler, _ = start_local_cluster(cfg_path, workdir, NODES, with_analyzer=False)  # we play it
    opt = pgd(plan["learning_rate"], plan["radius"])
    state = opt.init(model.init_params())
    event = PrivacyEvent.pvec(params, plan["min_contributors"], plan["kind"])  # the claim the analyzer states
    times: list[float] = []
    phases = {"execute_round": 0.0, "decode+step": 0.0}
    cpu: dict[str, float] = {}
    try:
        with grpc.insecure_channel(shuffler) as channel:
            stub = pbg.ShufflerStub(channel)
            wait_population(stub, cluster)
            for r in range(rounds + 1):
                t0 = time.perf_counter()
                spec = round_spec("bench", r, plan, params, event, state.last)
                batch = stub.ExecuteRound(spec, timeout=plan["deadline"] + 30)
                t1 = time.perf_counter()
                n = int(batch.report.contributors)
                if not batch.released or n != USERS:
                    raise RuntimeError(f"round {r} not released with {USERS} contributors: {batch.report}")
                grad = decode_counts(np.asarray(batch.label_totals, dtype=np.int64), n, params) / n
                _, state = opt.step(grad, state, state.last)
                t2 = time.perf_counter()
                if r == 0:  # round 0 is the warm-up
                    cpu = {name: cpu_seconds(proc.pid) for name, proc in cluster.procs.items()}
                else:
                    times.append(t2 - t0)
                    phases["execute_round"] += (t1 - t0) / rounds
                    phases["decode+step"] += (t2 - t1) / rounds
        mem = peak_memory(cluster)
        cpu = {name: (cpu_seconds(proc.pid) - cpu[name]) / rounds for name, proc in cluster.procs.items()}
    finally:
        cluster.stop()
    return times, mem, phases, cpu


# ------------------------------------------------------------------------------------- services in one process
class ServicesRound:
    """The same round with the services' own logic in this one process, no processes and no gRPC: the shuffler's
    ShufflerState (its durable participation record in SQLite) runs the round in a thread; each node's NodeCore
    (its durable spend record in SQLite) answers its invitations in turn (with the check-in: the check-in, its
    preparation, then the second invitation, as ClientNodeHandle does); then decode and the PGD step. Each node's
    contribution goes through _submission, the shuffler's conversion of what arrives. `parts` collects the time of
    each part per round (medians printed by --profile)."""

    def __init__(self, cfg: RunConfig, model: Model, plan: dict, params: PvecParams, workdir: Path) -> None:
        ds = load_dataset(cfg.data, cfg.model.task)
        workdir.mkdir(parents=True, exist_ok=True)
        self.state = ShufflerState(SqliteParticipationStore(workdir / "shuffler.sqlite"))
        self.cores, self.subs = [], []
        for i in range(NODES):
            ids, X, y = user_shard(ds, i, NODES, 1, cfg.data.max_users)
            store = SqliteSpendStore(workdir / f"node-{i}.spend.sqlite")
            self.cores.append(NodeCore(f"node-{i}", UserShard(ids, X, y), spend_store=store))
            self.state.register_users(f"node-{i}", ids)
            self.subs.append(self.state.subscribe(f"node-{i}"))
        self.plan, self.params = plan, params
        self.opt = pgd(plan["learning_rate"], plan["radius"])
        self.opt_state = self.opt.init(model.init_params())
        self.event = PrivacyEvent.pvec(params, plan["min_contributors"], plan["kind"])
        self.round = 0
        self.parts: dict[str, list[float]] = defaultdict(list)

    def __call__(self) -> None:
        spec = round_spec("in-process", self.round, self.plan, self.params, self.event, self.opt_state.last)
        self.round += 1
        box: dict = {}
        runner = threading.Thread(target=lambda: box.update(batch=self.state.execute_round(_request(spec))))
        runner.start()
        phases = ("check-in", "contribution") if spec.check_in.noise_trials else ("contribution",)
        for phase in phases:  # a check-in round invites twice (mechanisms/check_in.py)
            for core, sub in zip(self.cores, self.subs, strict=True):
                invite = sub.get(timeout=10)
                inv = _invitation(invite)
                t0 = time.perf_counter()
                contribution = core.handle(inv)
                t1 = time.perf_counter()
                ack = self.state.submit(_submission(contribution, core.node_id))
                t2 = time.perf_counter()
                if phase == "check-in":
                    core.prepare(inv)
                    self.parts[f"{phase}: node prepare (500 users)"].append(time.perf_counter() - t2)
                if ack.accepted != len(invite.user_ids):
                    raise RuntimeError(f"in-process shuffler accepted {ack.accepted} of {len(invite.user_ids)}")
                self.parts[f"{phase}: node handle (500 users)"].append(t1 - t0)
                self.parts[f"{phase}: to-domain + shuffler submit"].append(t2 - t1)
        runner.join()
        batch = box["batch"]
        if batch.contributors != USERS:
            raise RuntimeError(f"in-process round released {batch.contributors} contributors")
        t0 = time.perf_counter()
        grad = decode_counts(batch.label_totals, batch.contributors, self.params) / batch.contributors
        _, self.opt_state = self.opt.step(grad, self.opt_state, self.opt_state.last)
        self.parts["decode + step"].append(time.perf_counter() - t0)

    def print_parts(self, model: Model, rng: np.random.Generator) -> None:
        """The medians of `parts`, and the in-process round's own work for 500 users for comparison."""
        core = self.cores[0]
        X, y = core.shard.X[:, 0, :], core.shard.y[:, 0]
        alone = []
        for _ in range(20):
            t0 = time.perf_counter()
            round_counts(model.per_example_gradients(self.opt_state.last, X, y), self.params, rng).sum(axis=0)
            summed_noise(self.params.m, len(y), self.params.p, self.params.d, rng)
            alone.append(time.perf_counter() - t0)
        print("\nbreakdown of the services' logic in one process (median per node contribution):")
        for name, xs in {**self.parts, "grad+clip+round+noise alone (500)": alone}.items():
            print(f"  {name:42s} {statistics.median(xs) * 1e3:6.1f} ms")


# ---------------------------------------------------------------------------------------------------- main
def fmt_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:7.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f}, n={len(xs)})"


def fmt_mem(mem: dict[str, float]) -> str:
    return ", ".join(f"{name} {mib:.0f} MiB" for name, mib in mem.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="measured rounds after one warm-up round (default 20)")
    ap.add_argument("--mode", choices=["both", "analyzer", "direct"], default="both")
    ap.add_argument(
        "--check-in",
        choices=["both", "on", "off"],
        default="both",
        help="rounds with the check-in's extra invitation (privacy.pvec.check_in, the default), without, or both",
    )
    ap.add_argument("--dim", type=int, nargs="+", default=[100], help="model dimensions d, one run each (>= 2)")
    ap.add_argument("--profile", action="store_true", help="also time the services' parts in one process")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if min(args.dim) < 2:
        ap.error(f"--dim must be >= 2 (a feature and the bias), got {min(args.dim)}")
    # the rounds in this process run with the services' allocator thresholds (each service sets them at start):
    # glibc's own cost the in-process round at d = 100 ~1.8x its time in page faults of fresh blocks
    print(f"allocator thresholds of the services in this process: {'set' if return_large_blocks() else 'not glibc'}")
    print(f"BLAS threads in this process, as in every service: {one_blas_thread()}")
    started = time.monotonic()
    for dim in args.dim:
        bench_dim(dim, args)
    print(f"benchmark wall time {time.monotonic() - started:.1f} s")
    return 0


def bench_dim(dim: int, args: argparse.Namespace) -> None:
    """Every setting of --check-in and --mode at one dimension, and their ratios to the in-process round."""
    settings = {"both": (False, True), "on": (True,), "off": (False,)}[args.check_in]
    with tempfile.TemporaryDirectory(prefix="bench_round_") as tmp:
        workdir = Path(tmp)
        data_path = write_problem(workdir, make_rng(), dim)
        results: dict[tuple[str, str], list[float]] = {}
        t_local: list[float] = []
        t_services: dict[str, list[float]] = {}
        for check_in in settings:
            toml = config_toml(data_path, args.rounds + 1, check_in)
            cfg_path = workdir / f"config-{check_in}.toml"
            cfg_path.write_text(toml)
            cfg = parse_config(toml)
            ds = load_dataset(cfg.data, cfg.model.task)
            model = make_model(cfg.model.task, ds.num_features, ds.num_classes)
            plan = plan_run(cfg, USERS, USERS, model)  # the analyzer's own planning (calibrate_pvec, rounds = 1 + R)
            params = PvecParams(**plan["params"])
            label = "check-in: two invitations" if check_in else "one invitation"
            print(
                f"round ({label}): d={model.dim}, {USERS} users ({NODES} client nodes x {USERS // NODES}), PVEC count "
                f"mode, g={params.g}, m={params.m}, p={params.p:.4g} (calibrated for eps={plan['eps']:g} over "
                f"{plan['rounds']} rounds, delta={plan['delta']:g}, n_min={plan['min_contributors']})"
            )
            in_proc = InProcessRound(cfg, model, plan, params)
            services = ServicesRound(cfg, model, plan, params, workdir / f"services-{check_in}")
            t_local += timed(in_proc, args.rounds)
            t_services[label] = timed(services, args.rounds)
            if args.mode in ("analyzer", "both"):
                secs, mem, info = bench_analyzer(cfg_path, workdir / f"analyzer_run-{check_in}", toml)
                results[(label, "analyzer")] = secs
                print(f"\n[analyzer mode, {label}] real analyzer run, RoundMetrics.seconds; {info}")
                print(f"  end-to-end round  {fmt_ms(secs)}")
                print(f"  peak memory (VmHWM): {fmt_mem(mem)}")
            if args.mode in ("direct", "both"):
                run_dir = workdir / f"direct_run-{check_in}"
                secs, mem, phases, cpu = bench_direct(cfg_path, run_dir, plan, params, model, args.rounds)
                results[(label, "direct")] = secs
                print(f"\n[direct mode, {label}] this process calls ExecuteRound as the analyzer does, decode, step")
                print(f"  end-to-end round  {fmt_ms(secs)}")
                print("  split (mean): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()))
                print("  CPU per round (user+sys): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in cpu.items()))
                print(f"  peak memory (VmHWM): {fmt_mem(mem)}; driver process {vm_hwm_mib(os.getpid()):.0f} MiB")
            # again after the services: both ends, same machine load
            t_local += timed(in_proc, args.rounds)
            t_services[label] += timed(services, args.rounds)
            print(f"the services' logic in one process ({label}): {fmt_ms(t_services[label])}")
            if args.profile:
                services.print_parts(model, make_rng())
        # the in-process round is the same for both settings (one pass over the users: it never invites anyone)
        print(f"\nin one process (d={dim})  {fmt_ms(t_local)}")
        unary, stream = transport_floor()
        floor = {True: unary + 2 * stream, False: unary + stream}  # check-in: two invitations, each answered
        for check_in in settings:
            label = "check-in: two invitations" if check_in else "one invitation"
            print(
                f"transport floor [{label}]: {floor[check_in] * 1e3:.2f} ms (empty messages between two processes: "
                f"a unary round trip {unary * 1e3:.2f} ms + {1 + check_in} on a stream at {stream * 1e3:.2f} ms) = "
                f"{floor[check_in] / statistics.median(t_local):.2f} x the in-process round"
            )
        for (label, mode), secs in results.items():
            for base_name, base in (("in-process", t_local), ("services in one process", t_services[label])):
                ratio = statistics.median(secs) / statistics.median(base)
                verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
                best = min(secs) / min(base)  # least disturbed by the other processes of a shared machine
                print(
                    f"ratio end-to-end / {base_name} [d={dim}, {mode}, {label}]: median {ratio:5.2f} "
                    f"(target <= {TARGET_RATIO:g}: {verdict}); ratio of the minima {best:5.2f}"
                )


if __name__ == "__main__":
    sys.exit(main())
