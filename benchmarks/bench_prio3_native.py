"""Benchmark: Prio3SumVec through the shuffledp_prio binding (native/, issue 45 phase 1), both field choices.

For d in {100, 650, 10^4} entries of 16 bits (max_measurement 65535) and each instance, Field128 with one proof
(Prio3SumVec, draft-irtf-cfrg-vdaf-18 section 7.4.3) and Field64 with three proofs (Prio3SumVecWithMultiproof,
section 9.7), it prints one row: milliseconds to shard a report (Client), prepare_init at the Leader and at the
Helper, to finish (prep_shares_to_prep once, then prepare_next at both Aggregators), and the bytes of the Leader's
input share, the Helper's input share, the public share and one Aggregator's prep share. Times are the best of
--repeats (least disturbed by other processes on a shared machine), one core, bytes in and out as over gRPC.

Unless --no-crate (or --quick), it then builds and runs native/examples/bench_crate.rs, the same steps in Rust on the
crate alone, and prints binding / crate per step: what the binding adds (the issue's bound is 1.5x).

Run: python benchmarks/bench_prio3_native.py [--quick] [--d 100 650 10000] [--repeats 10] [--no-crate]
(--quick: 2 repeats, no crate baseline, a few seconds)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    import shuffledp_prio as prio
except ImportError:  # pragma: no cover - only without a Rust toolchain at set-up
    sys.exit("shuffledp_prio is not built: pip install ./native (needs cargo; scripts/_venv.sh does it)")

NATIVE = Path(__file__).resolve().parents[1] / "native"
MAX_MEASUREMENT = 65535  # 16 bits
STEPS = ["shard", "init L", "init H", "finish"]


def best_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Best wall time in ms over `repeats` calls, and the last call's result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


def bench(kind, d: int, repeats: int) -> dict:
    vdaf = kind(d, MAX_MEASUREMENT)
    key, nonce = os.urandom(vdaf.verify_key_size), os.urandom(vdaf.nonce_size)
    m = np.random.default_rng(d).integers(0, MAX_MEASUREMENT + 1, size=d, dtype=np.uint64)
    t_shard, (public, leader, helper) = best_time(lambda: vdaf.shard(m, nonce), repeats)
    t_init_l, (state_l, share_l) = best_time(lambda: vdaf.prepare_init(key, 0, nonce, public, leader), repeats)
    t_init_h, (state_h, share_h) = best_time(lambda: vdaf.prepare_init(key, 1, nonce, public, helper), repeats)

    def finish() -> list[bytes]:
        message = vdaf.prep_shares_to_prep([share_l, share_h])
        return [vdaf.prepare_next(state_l, message), vdaf.prepare_next(state_h, message)]

    t_finish, outs = best_time(finish, repeats)
    result = vdaf.unshard([vdaf.aggregate([outs[0]]), vdaf.aggregate([outs[1]])], 1)
    assert result == m.tolist(), "the round trip lost the measurement"
    return {
        "field": vdaf.field,
        "proofs": vdaf.num_proofs,
        "chunk": vdaf.chunk_length,
        "d": d,
        "shard": t_shard,
        "init L": t_init_l,
        "init H": t_init_h,
        "finish": t_finish,
        "leader B": len(leader),
        "helper B": len(helper),
        "public B": len(public),
        "prep B": len(share_l),
    }


def crate_alone(d: int, repeats: int, max_measurement: int = MAX_MEASUREMENT) -> dict[str, dict[str, float]]:
    """native/examples/bench_crate.rs at the same size: {field: {step: ms}}, each the best of `repeats`. Steps: this
    script's STEPS ("finish" = the message once, then both Aggregators' verify_next) and each part on its own:
    "combine" (verifier_shares_to_message), "next L", "next H", "aggregate" (one output share into an aggregate
    share) and "unshard" (both aggregate shares, once per batch)."""
    proc = subprocess.run(
        ["cargo", "run", "--quiet", "--release", "--example", "bench_crate", "--", str(d), str(max_measurement),
         str(repeats)],
        cwd=NATIVE, capture_output=True, text=True, check=True,
    )  # fmt: skip
    out = {}
    for line in proc.stdout.splitlines():
        field, *cells = line.split()
        shard, init_l, init_h, combine, next_l, next_h, aggregate, unshard = map(float, cells)
        out[field] = {
            "shard": shard,
            "init L": init_l,
            "init H": init_h,
            # the same work as the binding's "finish": the message once, then both Aggregators' verify_next
            "finish": combine + next_l + next_h,
            "combine": combine,
            "next L": next_l,
            "next H": next_h,
            "aggregate": aggregate,
            "unshard": unshard,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[100, 650, 10_000], help="entries per measurement")
    ap.add_argument("--repeats", type=int, default=10, help="best of this many calls per step")
    ap.add_argument("--quick", action="store_true", help="2 repeats and no crate baseline: a few seconds")
    ap.add_argument("--no-crate", action="store_true", help="skip the Rust baseline (cargo build of the example)")
    args = ap.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    with_crate = not (args.quick or args.no_crate) and shutil.which("cargo") is not None

    print(f"shuffledp_prio: prio {prio.PRIO_CRATE_VERSION} ({prio.VDAF_DRAFT}), 16-bit entries, best of {repeats}")
    header = (
        f"{'field':>8} {'proofs':>6} {'d':>6} {'chunk':>5} {'shard ms':>9} {'init L ms':>9} {'init H ms':>9} "
        f"{'finish ms':>9} {'leader B':>10} {'helper B':>8} {'public B':>8} {'prep B':>7}"
    )
    print(header)
    rows = []
    for d in args.d:
        for kind in (prio.Prio3SumVec, prio.Prio3SumVecField64Multiproof):
            r = bench(kind, d, repeats)
            rows.append(r)
            print(
                f"{r['field']:>8} {r['proofs']:>6} {d:>6} {r['chunk']:>5} {r['shard']:>9.3f} {r['init L']:>9.3f} "
                f"{r['init H']:>9.3f} {r['finish']:>9.3f} {r['leader B']:>10} {r['helper B']:>8} "
                f"{r['public B']:>8} {r['prep B']:>7}"
            )
    if with_crate:
        print("\nthe crate alone (native/examples/bench_crate.rs, same steps) and binding / crate:")
        print(f"{'field':>8} {'d':>6} " + " ".join(f"{s + ' ms':>10} {'x':>5}" for s in STEPS))
        for d in args.d:
            alone = crate_alone(d, repeats)
            for r in (r for r in rows if r["d"] == d):
                c = alone[r["field"]]
                cells = " ".join(f"{c[s]:>10.3f} {r[s] / c[s]:>5.2f}" for s in STEPS)
                print(f"{r['field']:>8} {d:>6} {cells}")


if __name__ == "__main__":
    main()
