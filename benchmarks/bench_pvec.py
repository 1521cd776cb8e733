"""Benchmark: PVEC count-mode encoding vs drawing its random numbers alone; Gaussian/Laplace noise likewise.

Run: python benchmarks/bench_pvec.py [--users 10000] [--d 100] [--repeats 5]

For each setting it prints users/second of the full client-side encoding (validation, clipping, shift,
randomized rounding, binomial noise) for all users in one vectorized call, and the ratio of its time to the
time of drawing the same random numbers alone from the same kind of generator (shuffledp.security.rng: AES-CTR or
ChaCha20):
one uniform per coordinate (Bernoulli rounding) plus one Binomial(m, p) per coordinate. Target ratio <= 3.
Times are the minimum over repeats (least disturbed by other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from shuffledp.mechanisms.gaussian import add_gaussian_noise, analytic_gaussian_sigma
from shuffledp.mechanisms.laplace import add_laplace_noise, laplace_scale
from shuffledp.mechanisms.pvec import PvecParams, decode_counts, encode_counts, pvec_params
from shuffledp.security.rng import make_rng


def best_time(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_pvec(label: str, params: PvecParams, X: np.ndarray, repeats: int) -> None:
    rng = make_rng()
    k, d = X.shape
    t_enc = best_time(lambda: encode_counts(X, params, rng), repeats)

    def draws_only() -> None:
        rng.random((k, d))
        rng.binomial(params.m, params.p, size=(k, d))

    t_rng = best_time(draws_only, repeats)
    totals = encode_counts(X, params, rng).sum(axis=0)
    t_dec = best_time(lambda: decode_counts(totals, k, params), repeats)
    print(
        f"PVEC count mode [{label}] d={d} users={k} g={params.g} m={params.m:.3g} p={params.p:.4f}: "
        f"encode {t_enc * 1e3:8.1f} ms = {k / t_enc:12,.0f} users/s; random draws alone {t_rng * 1e3:8.1f} ms; "
        f"ratio {t_enc / t_rng:5.2f}; decode totals {t_dec * 1e6:6.0f} us"
    )


def bench_noise(name: str, add: Callable, draw: Callable, X: np.ndarray, repeats: int) -> None:
    rng = make_rng()
    k, d = X.shape
    t_add = best_time(lambda: add(X, rng), repeats)
    t_rng = best_time(lambda: draw(rng, (k, d)), repeats)
    print(
        f"{name:8s} noise d={d} users={k}: add {t_add * 1e3:8.1f} ms = {k / t_add:12,.0f} users/s; "
        f"draws alone {t_rng * 1e3:8.1f} ms; ratio {t_add / t_rng:5.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=10_000)
    ap.add_argument("--d", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    k, d = args.users, args.d

    X = make_rng().normal(size=(k, d)) * (1.5 / np.sqrt(d))  # norms around 1.5: most rows get clipped
    paper = pvec_params(eps=1.0, delta=1e-6, n=k, d=d, delta2=1.0)
    bench_pvec("paper constants", paper, X, args.repeats)
    for m in (10**4, 100):
        cal = PvecParams(d=d, n=k, delta2=1.0, g=paper.g, m=m, p=0.25, eps=1.0, delta=1e-6, method="calibrated")
        bench_pvec(f"calibrated-size m={m}", cal, X, args.repeats)

    sigma = analytic_gaussian_sigma(1.0, 1e-6, 2.0)
    bench_noise(
        "Gaussian",
        lambda x, r: add_gaussian_noise(x, sigma, r),
        lambda r, s: r.normal(0.0, sigma, size=s),
        X,
        args.repeats,
    )
    b = laplace_scale(1.0, 2.0)
    bench_noise(
        "Laplace",
        lambda x, r: add_laplace_noise(x, b, r),
        lambda r, s: r.laplace(0.0, b, size=s),
        X,
        args.repeats,
    )


if __name__ == "__main__":
    main()
