"""Benchmark (issue 45 item 6): what transport PRIO3 (Prio3SumVec reports, the shuffler as DAP's Leader and the
analyzer as the Helper and Collector) costs against PVEC count mode, at d in {100, 650, 10^4} and 10^3 users, one user
per report (each user a device), for both VDAFs of shuffledp.protocols.prio3 (Field128 with one proof, Field64 with
three).

Run: python benchmarks/bench_split_trust.py [--d 100 650 10000] [--users 1000] [--repeats 10] [--no-crate]
         [--no-round] [--round-users 1000] [--rounds 4] [--insecure] [--quick] [--out DIR]

Every user's counts lie in [0, g + m], with g and m those of the embedded default run (digits, PGD over calibrated
PVEC with the check-in, d = 650): planned for its 1348 users (shuffledp.planning.plan_run), m being each user's
trials after all of them checked in (mechanisms/check_in.share). The same g + m is the range at every d (what the
count width and Prio3's bits depend on), and the crate alone is given the same max_measurement. It prints:

(a) bytes: per user uploaded in count mode (d counts in the narrowest width holding g + m,
    pvec.count_wire_dtype; and what a node's UserColumns.sums carries today for a group of one user: d uint64) and
    in PRIO3 (report id + public share + Leader share + sealed Helper share, and the serialized Prio3Report with its
    framing in UserColumns.reports); what the analyzer receives per report (HelperReport) and sends back (HelperPrep),
    and the Leader's aggregate share (LeaderAggregate, once per round).
(b) CPU per report at each party through protocols/prio3.py's functions: node = shard (report id, Prio3 sharding,
    HPKE sealing of the Helper share); shuffler = leader_init + leader_finish (prep_shares_to_prep, prepare_next,
    aggregate); analyzer = helper_prepare (opening, prepare_init, prep_shares_to_prep, prepare_next, aggregate) and
    unshard (once per batch, over --users reports). "1 rep": a call with one report (prio3._map runs it in the
    calling thread: single-threaded), best of --repeats, ms. Beside it the crate alone for the same VDAF, size and
    max_measurement (native/examples/bench_crate.rs, built and run by bench_prio3_native.crate_alone): node = shard,
    shuffler = prepare_init (Leader) + prep_shares_to_prep + prepare_next (Leader) + aggregate, analyzer = the
    Helper's same steps + unshard / users; ours / crate per party (the issue's bound: at most 1.5x). Then a batch of
    --users reports through the same functions with prio3's thread pool (min(cores, 8) workers): wall ms per report
    and the process's CPU ms per report (every thread).
(c) the round cycle over real processes, count mode against PRIO3 in the same run of this script: `shuffledp run`
    of the default experiment at d = 650 (logreg on digits, 10 classes x 65) with --round-users users, each a
    device ([deployment] users_per_node = 1, client_nodes = users, run by fleet processes), --rounds rounds, mTLS from
    a fresh PKI (--insecure: plain text on loopback); PRIO3 by [privacy.pvec] aggregation = "prio3". Per run: the
    median RoundMetrics.seconds after the first round (the analyzer's clock), the median time between consecutive
    rounds' progress lines (the cycle), the whole run's wall time, the CPU of all its processes (getrusage of the
    waited children), the released model's accuracy and the eps spent. When this checkout's configuration does not
    take aggregation = "prio3" yet (the transport is not wired into the services), the PRIO3 row says so and has no
    figures.

Times depend on what else runs on the machine: the load average is printed. Writes bench_split_trust.json (and the
runs' results directories) to --out (default results/bench_split_trust-<time>).
--quick: d = 100, 20 users, 2 repeats, no crate, a round cycle of 20 devices and 2 rounds (a smoke run).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_prio3_native import best_time, crate_alone  # noqa: E402  (exits with one line without the binding)

from shuffledp.mechanisms import check_in, pvec  # noqa: E402
from shuffledp.protocols import prio3  # noqa: E402
from shuffledp.security import sealing  # noqa: E402
from shuffledp.v1 import shuffledp_pb2 as pb  # noqa: E402

PARTIES = ["node", "shuffler", "analyzer"]
BOUND_RATIO = 1.5  # issue 45: CPU per report at each party at most 1.5x the crate alone
FIELD = {"prio3sumvec": "Field128", "prio3sumvec-field64x3": "Field64"}  # bench_crate.rs's line names
RUN_ID = "bench-split-trust"


# ------------------------------------------------------------------------------------------------ the range
def default_range() -> dict:
    """g and m of the embedded default run: planned for its users, m after all of them checked in (the trials each
    user draws in a round of that run), so g + m is the range of one user's counts."""
    from shuffledp.config import DEFAULT_TOML, parse_config
    from shuffledp.data import load_dataset, num_users
    from shuffledp.models import make_model
    from shuffledp.planning import plan_run

    cfg = parse_config(DEFAULT_TOML)
    ds = load_dataset(cfg.data, cfg.model.task)
    n = num_users(ds, cfg.data.examples_per_user, cfg.data.max_users)
    plan = plan_run(cfg, n, n, make_model(cfg.model.task, ds.num_features, ds.num_classes), ds.feature_norm_bound)
    params, n_min = plan["params"], plan["min_contributors"]
    _, m = check_in.share(params["m"] * n_min, cfg.privacy.settings.report_fraction, n_min, n)
    return {"users": n, "d": params["d"], "g": params["g"], "m_plan": params["m"], "m": m, "bound": params["g"] + m}


def counts(users: int, d: int, bound: int, seed: int) -> np.ndarray:
    """Each user's counts, uniform in [0, bound] (the sizes and times do not depend on the values)."""
    return np.random.default_rng(seed).integers(0, bound + 1, size=(users, d), dtype=np.uint64)


def helper_reports(prepared: list[prio3.LeaderReport]) -> list[pb.HelperReport]:
    """What the shuffler puts in the released batch for the analyzer (ShuffledBatch.reports)."""
    return [
        pb.HelperReport(
            report_id=p.report_id,
            public_share=p.public_share,
            helper_share=p.helper_share,
            leader_prep_share=p.prep_share,
            users=p.users,
        )
        for p in prepared
    ]


# ------------------------------------------------------------------------------------------------ (a) bytes
def wire_bytes(name: str, d: int, bound: int, key: bytes, private, public_key: bytes) -> dict:
    """One user's report through every party's step, and the size of each message."""
    vdaf = prio3.Vdaf(name, d, bound, RUN_ID, 0)
    sums = counts(1, d, bound, seed=d)
    ((rid, public, leader, sealed),) = prio3.shard(vdaf, sums, [1], public_key)
    report = pb.Prio3Report(report_id=rid, public_share=public, leader_share=leader, helper_share=sealed)
    prepared, _ = prio3.leader_init(vdaf, key, [(rid, public, leader, sealed, 1)])
    (hrep,) = helper_reports(prepared)
    res = prio3.helper_prepare(vdaf, key, private, [hrep])
    agg, reports, users, _ = prio3.leader_finish(vdaf, {p.report_id: p for p in prepared}, res.preps)
    assert reports == users == 1 and (prio3.unshard(vdaf, agg, res.aggregate_share, 1) == sums[0]).all()
    width = pvec.count_wire_dtype(bound).itemsize
    leader_agg = pb.LeaderAggregate(released=True, aggregate_share=agg, reports=1000, contributors=1000)
    return {
        "count B": d * width,  # CountVector.packed / UserColumns.counts: d counts of `width` bytes
        "count width": width,
        "sums B": pb.UserColumns(sums=sums.astype("<u8").tobytes(), sum_users=1).ByteSize(),  # what nodes send
        "id B": len(rid),
        "public B": len(public),
        "leader B": len(leader),
        "sealed B": len(sealed),
        "prio3 B": len(rid) + len(public) + len(leader) + len(sealed),
        "proto B": pb.UserColumns(reports=[report]).ByteSize(),  # the Prio3Report with its framing in UserColumns
        "helper report B": hrep.ByteSize(),
        "helper prep B": pb.HelperPrep(report_id=rid, prep_share=res.preps[0][1]).ByteSize(),
        "aggregate share B": len(agg),
        "leader aggregate B": leader_agg.ByteSize(),
    }


# ------------------------------------------------------------------------------------------------ (b) CPU
def single_report(
    name: str, d: int, bound: int, batch_users: int, repeats: int, key: bytes, private, public_key: bytes
) -> dict:
    """ms per report at each party, one report per call (single-threaded: prio3._map runs fewer than 4 items in the
    calling thread), best of `repeats`; unshard's time is divided by batch_users (once per batch)."""
    vdaf = prio3.Vdaf(name, d, bound, RUN_ID, 0)
    one = counts(1, d, bound, seed=d + 1)
    t_shard, reports = best_time(lambda: prio3.shard(vdaf, one, [1], public_key), repeats)
    ((rid, public, leader, sealed),) = reports
    t_init, (prepared, _) = best_time(lambda: prio3.leader_init(vdaf, key, [(rid, public, leader, sealed, 1)]), repeats)
    hreps = helper_reports(prepared)
    # a fresh `seen` each call (the default): the same report is not a replay across the timing's repeats
    t_helper, res = best_time(lambda: prio3.helper_prepare(vdaf, key, private, hreps), repeats)
    held = {p.report_id: p for p in prepared}
    t_finish, (agg, n, _, _) = best_time(lambda: prio3.leader_finish(vdaf, held, res.preps), repeats)
    t_unshard, totals = best_time(lambda: prio3.unshard(vdaf, agg, res.aggregate_share, 1), repeats)
    assert n == 1 and (totals == one[0]).all(), "the round trip lost the counts"
    return {
        "node": t_shard,
        "shuffler": t_init + t_finish,
        "analyzer": t_helper + t_unshard / batch_users,
        "parts": {
            "shard": t_shard,
            "leader_init": t_init,
            "leader_finish": t_finish,
            "helper_prepare": t_helper,
            "unshard": t_unshard,
        },
    }


def pooled_batch(name: str, d: int, bound: int, users: int, key: bytes, private, public_key: bytes) -> dict:
    """A batch of `users` one-user reports through every party's step with prio3's thread pool: {party: (wall ms,
    process CPU ms) per report}. Checks that the totals are the users' sums."""
    vdaf = prio3.Vdaf(name, d, bound, RUN_ID, 0)
    sums = counts(users, d, bound, seed=d + 2)
    spent: dict[str, list[float]] = {p: [0.0, 0.0] for p in PARTIES}

    def timed(party: str, fn):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        spent[party][0] += time.perf_counter() - w0
        spent[party][1] += time.process_time() - c0
        return out

    reports = timed("node", lambda: prio3.shard(vdaf, sums, [1] * users, public_key))
    uploads = [(*r, 1) for r in reports]  # (report id, public, Leader share, sealed Helper share, users)
    del reports
    prepared, rejected = timed("shuffler", lambda: prio3.leader_init(vdaf, key, uploads))
    uploads.clear()  # the Leader shares: ~2.6 GB at d = 10^4 (Field128)
    hreps = helper_reports(prepared)
    res = timed("analyzer", lambda: prio3.helper_prepare(vdaf, key, private, hreps))
    held = {p.report_id: p for p in prepared}
    agg, n, _, rejected2 = timed("shuffler", lambda: prio3.leader_finish(vdaf, held, res.preps))
    totals = timed("analyzer", lambda: prio3.unshard(vdaf, agg, res.aggregate_share, n))
    assert not rejected and not res.rejected and not rejected2 and n == users
    assert (totals == sums.sum(axis=0, dtype=np.int64)).all(), "the batch's totals are not the users' sums"
    return {p: (w * 1e3 / users, c * 1e3 / users) for p, (w, c) in spent.items()}


def crate_parties(alone: dict[str, float], users: int) -> dict[str, float]:
    """The crate's steps grouped as protocols/prio3.py's parties run them."""
    return {
        "node": alone["shard"],
        "shuffler": alone["init L"] + alone["combine"] + alone["next L"] + alone["aggregate"],
        "analyzer": alone["init H"]
        + alone["combine"]
        + alone["next H"]
        + alone["aggregate"]
        + alone["unshard"] / users,
    }


# ------------------------------------------------------------------------------------------------ (c) rounds
def run_toml(users: int, rounds: int, pki_dir: Path | None, prio3_vdaf: str | None) -> str:
    """The default run (shuffledp run --print-default: calibrated PVEC with the check-in, PGD at learning rate 8,
    radius 10) on digits' first `users` users, each a device; PRIO3 with prio3_vdaf when given."""
    pvec_table = f'\n[privacy.pvec]\naggregation = "prio3"\nprio3_vdaf = "{prio3_vdaf}"\n' if prio3_vdaf else ""
    security = "insecure = true\n" if pki_dir is None else f'insecure = false\npki_dir = "{pki_dir.as_posix()}"\n'
    return f"""\
[data]
dataset = "digits"
max_users = {users}

[model]
task = "logreg"
radius = 10.0

[privacy]
eps = 8.0
{pvec_table}
[schedule]
kind = "fully_interactive"
rounds = {rounds}
learning_rate = 8.0

[deployment]
client_nodes = {users}
users_per_node = 1
round_deadline_seconds = {max(60.0, 0.1 * users):g}
population_wait_seconds = 600.0
{security}"""


def prio3_unavailable(toml: str) -> str | None:
    """Why this checkout cannot run transport PRIO3 (None: its configuration takes it and the binding is here)."""
    from shuffledp.config import parse_config

    if not prio3.available():
        return prio3.MISSING
    try:
        cfg = parse_config(toml)
    except Exception as exc:  # noqa: BLE001 - any refusal means the transport is not wired in yet
        return f'transport not available yet: the configuration refuses aggregation = "prio3" ({exc})'
    if getattr(cfg.privacy.settings, "aggregation", None) != "prio3":
        return 'transport not available yet: the configuration has no privacy.pvec.aggregation = "prio3"'
    return None


ROUND_LINE = re.compile(r"^\s*round\s+\d+/\d+")


def one_run(label: str, toml: str, out: Path, timeout: float) -> dict:
    """`shuffledp run` of `toml` (its own process tree); the round lines are echoed as they arrive."""
    row: dict = {"label": label}
    (out / f"{label}.toml").write_text(toml)
    results = out / label
    cmd = [sys.executable, "-m", "shuffledp.cli", "run", str(out / f"{label}.toml"), "--out", str(results)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    timer = threading.Timer(timeout, proc.terminate)  # SIGTERM: the CLI cancels the run and stops its services
    timer.start()
    arrivals, tail = [], collections.deque(maxlen=30)
    try:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if ROUND_LINE.match(line):
                arrivals.append(time.monotonic())
                print(f"  [{label}] {line.strip()}", flush=True)
        rc = proc.wait()
    finally:
        timer.cancel()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row["wall_s"] = time.monotonic() - t0
    row["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row["returncode"] = rc
    metrics = json.loads((results / "metrics.json").read_text()) if (results / "metrics.json").exists() else []
    summary = json.loads((results / "summary.json").read_text()) if (results / "summary.json").exists() else {}
    row["rounds"] = metrics
    later = [m["seconds"] for m in metrics[1:]]
    row["seconds_per_round"] = statistics.median(later) if later else None
    row["first_round_s"] = metrics[0]["seconds"] if metrics else None
    row["cycle_s"] = statistics.median(np.diff(arrivals)) if len(arrivals) > 1 else None
    row["accuracy"] = (summary.get("released_model") or {}).get("accuracy")
    row["eps_spent"] = metrics[-1]["eps_spent"] if metrics else None
    row["contributors"] = [m["contributors"] for m in metrics]
    row["rejected"] = [m["rejected"] for m in metrics if m["rejected"]]
    row["state"] = summary.get("state")
    if rc != 0:
        row["error"] = f"shuffledp run exited {rc}: " + " | ".join(t for t in tail if t.strip())[-1500:]
    return row


def round_cycles(args, out: Path) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_split_trust_") as tmp:
        pki_dir = None
        if not args.insecure:
            from shuffledp.security import pki

            pki_dir = Path(tmp) / "pki"
            pki.init_pki(pki_dir, client_nodes=args.round_users)
        timeout = args.rounds * (2 * max(60.0, 0.1 * args.round_users) + 120) + 900
        settings = [("count", None)] + [(f"prio3 {v}", v) for v in args.round_vdafs]
        for label, vdaf in settings:
            toml = run_toml(args.round_users, args.rounds, pki_dir, vdaf)
            why = prio3_unavailable(toml) if vdaf else None
            if why:
                print(f"  [{label}] not run: {why}", flush=True)
                rows.append({"label": label, "unavailable": why})
                continue
            print(f"  [{label}] {args.round_users} devices, {args.rounds} rounds; load {load_average()}", flush=True)
            try:
                row = one_run(label.replace(" ", "-"), toml, out, timeout)
            except Exception as exc:  # the other run still goes; the row says what went wrong
                row = {"label": label, "error": f"{type(exc).__name__}: {exc}"}
            row["label"] = label
            if "error" in row:
                print(f"  [{label}] FAILED: {row['error'][:600]}", flush=True)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ output
def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_bytes(rows: list[dict], rng: dict) -> None:
    print(
        f"\n(a) bytes per user (one user per report), counts in [0, g + m = {rng['bound']}]: count mode's d counts of "
        f"{rows[0]['bytes']['count width']} B (pvec.count_wire_dtype) and UserColumns.sums for one user (d uint64, "
        "what a node sends today); PRIO3's report id + public + Leader + sealed Helper share, raw and as a "
        "Prio3Report in UserColumns"
    )
    print(
        f"{'d':>6} {'vdaf':>22} {'count B':>8} {'sums B':>8} {'public':>6} {'leader':>9} {'sealed':>6} "
        f"{'prio3 B':>9} {'proto B':>9} {'x count':>8} | {'to analyzer':>11} {'back':>5} {'agg share':>9} "
        f"{'LeaderAgg':>9}"
    )
    for r in rows:
        b = r["bytes"]
        print(
            f"{r['d']:>6} {r['vdaf']:>22} {b['count B']:>8} {b['sums B']:>8} {b['public B']:>6} {b['leader B']:>9} "
            f"{b['sealed B']:>6} {b['prio3 B']:>9} {b['proto B']:>9} {b['proto B'] / b['count B']:>8.1f} | "
            f"{b['helper report B']:>11} {b['helper prep B']:>5} {b['aggregate share B']:>9} "
            f"{b['leader aggregate B']:>9}"
        )
    print(
        "x count: proto B / count B; to analyzer: one HelperReport in the released batch; back: the Helper's prep "
        "share (HelperPrep in FinishAggregation); agg share / LeaderAgg: the Leader's aggregate share, raw and as "
        "LeaderAggregate, once per round"
    )


def print_cpu(rows: list[dict], users: int, with_crate: bool) -> None:
    workers = min(os.cpu_count() or 1, 8)
    print(
        f"\n(b) CPU ms per report at each party through protocols/prio3.py: 1 rep = one report per call "
        f"(single-threaded), best of the repeats; crate = native/examples/bench_crate.rs, the same steps, VDAF, size "
        f"and max_measurement; x = ours / crate (bound {BOUND_RATIO}x); batch = {users} reports with prio3's pool "
        f"({workers} workers on {os.cpu_count()} cores): wall ms and process CPU ms per report"
    )
    print(
        f"{'d':>6} {'vdaf':>22} {'party':>9} {'1 rep ms':>9} {'crate ms':>9} {'x':>6} {'batch wall':>10} "
        f"{'batch CPU':>10}"
    )
    for r in rows:
        for party in PARTIES:
            ours = r["single"][party]
            crate = r["crate"][party] if r.get("crate") else None
            ratio = ours / crate if crate else None
            wall, cpu = r["batch"][party]
            print(
                f"{r['d']:>6} {r['vdaf']:>22} {party:>9} {ours:>9.3f} {fmt(crate, '9.3f')} {fmt(ratio, '6.2f')} "
                f"{wall:>10.3f} {cpu:>10.3f}"
            )
    if with_crate:
        worst = max((r["single"][p] / r["crate"][p], r["d"], r["vdaf"], p) for r in rows for p in PARTIES)
        verdict = "within" if worst[0] <= BOUND_RATIO else "ABOVE"
        print(f"largest ours / crate: {worst[0]:.2f}x ({worst[3]}, d = {worst[1]}, {worst[2]}): {verdict} the bound")
    print(
        "node: shard (report id, Prio3 sharding, HPKE seal); shuffler: leader_init + leader_finish; analyzer: "
        "helper_prepare (HPKE open, prepare_init, combine, prepare_next, aggregate) + unshard / batch"
    )


def print_rounds(rows: list[dict], users: int, rounds: int, mtls: bool) -> None:
    print(
        f"\n(c) round cycle over real processes (shuffledp run): the default experiment (d = 650) on {users} devices, "
        f"{rounds} rounds, {'mTLS' if mtls else 'plain text on loopback'}"
    )
    print(
        f"{'transport':>26} {'s/round':>8} {'cycle s':>8} {'1st s':>7} {'run s':>7} {'CPU s':>7} {'accuracy':>8} "
        f"{'eps':>6} {'contributors':>14}"
    )
    for r in rows:
        if "unavailable" in r:
            print(f"{r['label']:>26}  not run: {r['unavailable']}")
            continue
        if "wall_s" not in r:
            print(f"{r['label']:>26}  FAILED: {r.get('error', '')[:300]}")
            continue
        contributors = ",".join(str(c) for c in r["contributors"])
        print(
            f"{r['label']:>26} {fmt(r['seconds_per_round'], '8.2f')} {fmt(r['cycle_s'], '8.2f')} "
            f"{fmt(r['first_round_s'], '7.2f')} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {fmt(r['accuracy'], '8.3f')} "
            f"{fmt(r['eps_spent'], '6.3f')} {contributors:>14}"
        )
        if "error" in r:
            print(f"{'':>26}  FAILED: {r['error'][:300]}")
    done = {r["label"]: r for r in rows if r.get("seconds_per_round")}
    if "count" in done:
        for label, r in done.items():
            if label != "count":
                ratio = r["seconds_per_round"] / done["count"]["seconds_per_round"]
                print(f"{label} / count mode, s/round: {ratio:.2f}x")
    print(
        "s/round: median RoundMetrics.seconds after the first round; cycle: median time between rounds' progress "
        "lines; run s: the whole `shuffledp run` (start-up included); CPU s: every process of the run"
    )


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[100, 650, 10_000], help="entries per report")
    ap.add_argument("--users", type=int, default=1000, help="one-user reports in the pooled batch (default 10^3)")
    ap.add_argument("--repeats", type=int, default=10, help="best of this many one-report calls per step")
    ap.add_argument("--no-crate", action="store_true", help="skip the Rust baseline (cargo build of the example)")
    ap.add_argument("--no-round", action="store_true", help="skip (c), the round cycle over real processes")
    ap.add_argument("--round-users", type=int, default=1000, help="(c): devices (default 10^3)")
    ap.add_argument("--rounds", type=int, default=4, help="(c): rounds per run (the first is not in s/round)")
    ap.add_argument(
        "--round-vdafs",
        nargs="*",
        default=[prio3.DEFAULT_VDAF],
        choices=sorted(prio3.VDAFS),
        help=f"(c): the PRIO3 runs' VDAFs (default {prio3.DEFAULT_VDAF}; none: count mode only)",
    )
    ap.add_argument("--insecure", action="store_true", help="(c): plain text on loopback instead of mTLS")
    ap.add_argument(
        "--quick", action="store_true", help="d = 100, 20 users, 2 repeats, no crate, 20 devices x 2 rounds"
    )
    ap.add_argument("--out", type=Path, default=None, help="default results/bench_split_trust-<time>")
    args = ap.parse_args(argv)
    if args.quick:
        args.d, args.users, args.repeats, args.no_crate = [100], 20, 2, True
        args.round_users, args.rounds = 20, 2
    if args.rounds < 2 or args.round_users < 2 or args.users < 1:
        ap.error("need --rounds >= 2, --round-users >= 2 and --users >= 1")
    out = args.out or ROOT / "results" / f"bench_split_trust-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    with_crate = not args.no_crate and shutil.which("cargo") is not None
    started = time.monotonic()

    import shuffledp_prio

    rng = default_range()
    bound = rng["bound"]
    print(
        f"shuffledp_prio: prio {shuffledp_prio.PRIO_CRATE_VERSION} ({shuffledp_prio.VDAF_DRAFT}); {os.cpu_count()} "
        f"cores, load {load_average()}\nthe default run: {rng['users']} users, d = {rng['d']}, g = {rng['g']}, m = "
        f"{rng['m']} trials per user after the check-in (planned {rng['m_plan']} at the threshold): counts in "
        f"[0, {bound}], {bound.bit_length()} bits, at every d here",
        flush=True,
    )
    private, public_key = sealing.generate_keypair()
    key = prio3.new_verify_key()
    rows = []
    for d in args.d:
        alone = crate_alone(d, args.repeats, bound) if with_crate else {}
        for name in prio3.VDAFS:
            t0 = time.monotonic()
            row = {"d": d, "vdaf": name, "bytes": wire_bytes(name, d, bound, key, private, public_key)}
            row["single"] = single_report(name, d, bound, args.users, args.repeats, key, private, public_key)
            row["batch"] = pooled_batch(name, d, bound, args.users, key, private, public_key)
            if alone:
                row["crate"] = crate_parties(alone[FIELD[name]], args.users)
                row["crate_steps"] = alone[FIELD[name]]
            rows.append(row)
            print(f"  d = {d:>5} {name}: measured in {time.monotonic() - t0:.1f} s", flush=True)
    print_bytes(rows, rng)
    print_cpu(rows, args.users, with_crate)
    result = {"range": rng, "users": args.users, "repeats": args.repeats, "rows": rows}
    (out / "bench_split_trust.json").write_text(json.dumps(result, indent=2, default=str))
    failed = False
    if not args.no_round:
        print(f"\n(c) round cycle: count mode, then PRIO3 {args.round_vdafs}", flush=True)
        cycles = round_cycles(args, out)
        print_rounds(cycles, args.round_users, args.rounds, not args.insecure)
        result["rounds"] = cycles
        failed = any("error" in r for r in cycles)
    result["wall_s"] = time.monotonic() - started
    (out / "bench_split_trust.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"\nbenchmark wall time {result['wall_s']:.1f} s; load {load_average()}; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
