"""Throughput of the eps0-LDP randomizers of seed 001 (rr, r_inf, r_one, privunit).

For each randomizer: users/second of `encode` on a batch of k users in dimension d, and the ratio of its time to
drawing the same random numbers alone (same Generator calls and sizes, shuffledp.security.rng). Target ratio: <= 3.
R_inf and R_1 draw O(1) numbers per user but must read the O(d) input, so a second ratio divides by
(draws + one read of the input, X.sum()). Also users/second of `decode_sum` (the analyzer's work on a batch).

    python benchmarks/bench_ldp.py                 # d = 100, k = 10^4
    python benchmarks/bench_ldp.py --d 26010 --k 1000   # the MNIST CNN of spec 001 section 6

Benchmarks use a fixed seed, so they set the project's test-seed switch for this process only.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

os.environ.setdefault("SHUFFLEDP_ALLOW_TEST_SEED", "1")  # fixed seed for a reproducible benchmark input

from shuffledp.mechanisms import privunit, r_inf, r_one, rr  # noqa: E402
from shuffledp.security.rng import make_rng  # noqa: E402


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Minimum wall time over reps runs (the least disturbed by other processes on a shared machine)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def unit_rows(rng: np.random.Generator, k: int, d: int, ord: float) -> np.ndarray:
    X = rng.uniform(-1.0, 1.0, (k, d))
    return X / np.linalg.norm(X, ord=ord, axis=1, keepdims=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=100)
    ap.add_argument("--k", type=int, default=10_000)
    ap.add_argument("--eps0", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    k, d, eps0 = args.k, args.d, args.eps0
    data_rng, rng = make_rng(1), make_rng(2)

    bits = data_rng.integers(0, 2, k).astype(np.float64)
    X_inf = data_rng.uniform(-1.0, 1.0, (k, d))
    X_one = unit_rows(data_rng, k, d, 1)
    X_two = unit_rows(data_rng, k, d, 2)
    p_rr = rr.make_params(eps0)
    p_inf = r_inf.make_params(eps0, d, 1.0)
    p_one = r_one.make_params(eps0, d, 1.0)
    p_pu = privunit.make_params(eps0, d, 1.0)

    cases = [
        ("rr", lambda: rr.encode(bits, p_rr, rng), lambda: rng.random(k), rr.decode_sum, p_rr, bits),
        (
            "r_inf",
            lambda: r_inf.encode(X_inf, p_inf, rng),
            lambda: (rng.integers(0, d, k), rng.random(k)),
            r_inf.decode_sum,
            p_inf,
            X_inf,
        ),
        (
            "r_one",
            lambda: r_one.encode(X_one, p_one, rng),
            lambda: (rng.integers(0, p_one.D, k), rng.random(k)),
            r_one.decode_sum,
            p_one,
            X_one,
        ),
        (
            "privunit",
            lambda: privunit.encode(X_two, p_pu, rng),
            lambda: (rng.random(k), rng.random(k), rng.random(k), rng.standard_normal((k, d)), rng.random((k, d))),
            privunit.decode_sum,
            p_pu,
            X_two,
        ),
    ]
    generator = type(make_rng().bit_generator).__name__
    print(f"k = {k} users, d = {d}, eps0 = {eps0}, best of {args.reps} runs ({generator} Generator)")
    print(
        f"{'randomizer':>10} {'msg bits':>9} {'encode users/s':>15} {'draws ms':>9} {'read X ms':>9} "
        f"{'encode ms':>10} {'ratio':>7} {'ratio*':>6} {'decode_sum users/s':>19}"
    )
    for name, enc, draws, dec_sum, params, inp in cases:
        enc()  # warm caches (Hadamard table, scipy)
        t_enc = best_time(enc, args.reps)
        t_draw = best_time(draws, args.reps)
        t_read = best_time(inp.sum, args.reps)
        msgs = enc()
        t_dec = best_time(lambda msgs=msgs, dec_sum=dec_sum, params=params: dec_sum(msgs, params), args.reps)
        print(
            f"{name:>10} {params.message_format.bits:>9} {k / t_enc:>15.3g} {1e3 * t_draw:>9.3f} "
            f"{1e3 * t_read:>9.3f} {1e3 * t_enc:>10.3f} {t_enc / t_draw:>7.2f} {t_enc / (t_draw + t_read):>6.2f} "
            f"{k / t_dec:>19.3g}"
        )
    print("ratio = encode / draws only; ratio* = encode / (draws + one read of X)")


if __name__ == "__main__":
    main()
