"""Timings and a table of the specs' settings for the accountants of seeds 002, 003 and 004.

Run: python benchmarks/bench_accountants_002_004.py
Prints, for each accountant, the time of a first (cold-cache) and a repeated (cached) query for 10^4 composed
rounds / steps, then the spec settings with the bound each conversion gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from shuffledp.accountants import gaussian as g
from shuffledp.accountants import pnsgd as p
from shuffledp.accountants import tree_aggregation as ta
from shuffledp.accountants.gaussian import PAPER_ORDERS


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def first_and_cached(name: str, fn: Callable[[], object]) -> None:
    out, cold = timed(fn)
    _, warm = timed(fn)
    ratio = cold / warm if warm > 0 else float("inf")
    print(f"  {name:<58s} first {cold * 1e3:9.3f} ms   cached {warm * 1e6:9.1f} us   (x{ratio:,.0f})  -> {out:.6g}")


def bench_gaussian() -> None:
    print("Seed 002 (DP-mu2-FL, Gaussian RDP/zCDP per machine)")
    sigmas = np.linspace(800.0, 1200.0, 10_000)  # 10^4 rounds with varying noise
    first_and_cached("eps after 10^4 rounds (heterogeneous sigma, rdp)", lambda: g.epsilon(2.0, sigmas, 1e-5))
    first_and_cached(
        "eps after 10^4 rounds (constant sigma, exact)",
        lambda: g.epsilon_constant_noise(2.0, 1e3, 10_000, 1e-5, "exact"),
    )
    first_and_cached("max rounds at sigma/Delta = 500, (1, 1e-5)", lambda: g.max_rounds(2.0, 1e3, 1.0, 1e-5))
    first_and_cached("min sigma for 10^4 rounds, (1, 1e-5), Delta = 2", lambda: g.min_sigma(2.0, 10_000, 1.0, 1e-5))
    print("  rho   eps(paper Lemma 2.5)  eps(rdp)   eps(exact)   [delta = 1e-5]")
    for rho in (0.204, 1.449, 4.0, 8.0, 16.0):
        row = [g.epsilon_for_rho(rho, 1e-5, m) for m in ("paper", "rdp", "exact")]
        print(f"  {rho:5.3f} {row[0]:12.3f} {row[1]:15.3f} {row[2]:11.3f}")
    s_mnist = (2 * 785) ** 0.5 + 2 * (785 / 2) * 0.1  # S = G + 2 L D, spec 002 section 6
    print(f"  MNIST setup (S = {s_mnist:.2f}, rho = 4): M, T, sigma_u, sigma_c")
    for m, t in ((1, 60000), (10, 6000), (100, 600)):
        su = g.theorem_sigma(s_mnist, t, 4.0, m, trusted=False)
        sc = g.theorem_sigma(s_mnist, t, 4.0, m, trusted=True)
        print(f"  {m:4d} {t:6d} {su:10.1f} {sc:10.2f}")


def bench_tree() -> None:
    print("\nSeed 003 (DP-FTRL, tree aggregation zeta + RDP)")
    first_and_cached(
        "zeta, 10^4 steps, E = 4, xi = 20 (dynamic program)", lambda: ta.zeta_multi_participation(10_000, 4, 20)
    )
    first_and_cached(
        "zeta, 2000 steps, E = 20, xi = 99 (dynamic program)", lambda: ta.zeta_multi_participation(2000, 20, 99)
    )
    first_and_cached(
        "zeta, fixed order 100 x 20 epochs, 5 trees + completion",
        lambda: ta.zeta_fixed_order_restarts(100, [20] * 5, True),
    )
    first_and_cached(
        "eps, 10^4 restarted trees of 1395 steps, z = 200",
        lambda: ta.epsilon(ta.zeta_restarts([1395] * 10_000), 200.0, 1e-6),
    )
    first_and_cached(
        "min z for one tree of 10^4 steps at (1, 1e-5)",
        lambda: ta.min_noise_multiplier(ta.zeta_single_tree(10_000), 1.0, 1e-5),
    )
    print("  setting                        zeta     z   delta   eps(paper grid)  eps(default)  eps(exact)")
    rows = [
        ("StackOverflow, 1 participation", 11, 1.13, 1e-6),
        ("MNIST restart/epoch", 160, 4.0, 1e-5),
        ("MNIST restart/epoch", 160, 32.0, 1e-5),
        ("CIFAR restart/epoch", 700, 8.0, 1e-5),
        ("EMNIST restart/epoch", 550, 16.0, 1e-6),
        ("CIFAR 5 trees, completion", ta.zeta_fixed_order_restarts(100, [20] * 5, True), 46.3, 1e-5),
        ("CIFAR 5 trees, no completion", ta.zeta_fixed_order_restarts(100, [20] * 5, False), 46.3, 1e-5),
    ]
    for name, zeta, z, delta in rows:
        e1 = ta.epsilon(zeta, z, delta, orders=PAPER_ORDERS)
        e2 = ta.epsilon(zeta, z, delta)
        e3 = ta.epsilon(zeta, z, delta, "exact")
        print(f"  {name:<30s} {zeta:5d} {z:6.2f} {delta:7.0e} {e1:12.2f} {e2:14.3f} {e3:11.3f}")


def bench_pnsgd() -> None:
    print("\nSeed 004 (shuffled / online PNSGD, log-space delta)")
    cfg_l = p.OnlineConfig("laplace", 1.0, 10.0, 0.01, 1.0, 1.5, 100.0, 100.0)
    cfg_g = cfg_l._replace(noise="gaussian")
    first_and_cached(
        "delta_shuf, n = 10^4, Gaussian", lambda: p.delta_shuffled("gaussian", 1.0, 10_000, 1.0, 3.0, 0.1, 1.0)
    )
    first_and_cached(
        "online delta_100(n = 10^4), Gaussian (10^4 factors)", lambda: p.online_record_delta(cfg_g, 100, 10_000)
    )
    first_and_cached(
        "online delta_100(n = 10^7), Laplace (10^7 factors)", lambda: p.online_record_delta(cfg_l, 100, 10**7)
    )
    first_and_cached("online limit delta*^o, Gaussian (integral)", lambda: p.online_delta_limit(cfg_g, 100))
    first_and_cached(
        "calibrate sigma: eps=1, n=1e4, target 1e-5",
        lambda: p.calibrate_scale("gaussian", 1e-5, 1.0, 10**4, 1.0, 0.1, 1.0),
    )
    lim_l, lim_g = p.delta_star_laplace(1.0, 1e5), p.delta_star_gaussian(1.0, 1e5)
    print(f"  Appendix G, eps = 1:  n        Laplace delta(n)   Gaussian delta(n)   (limits {lim_l:.6e}, {lim_g:.6e})")
    for n in (10**2, 10**4, 10**6, 10**8):
        dl = p.delta_shuffled("laplace", 1.0, n, 10.0, p.v_fixed(n, 0.1, 1.0, 1e5, 2.0), 0.1, 1.0)
        dg = p.delta_shuffled("gaussian", 1.0, n, 10.0, p.sigma_fixed(n, 0.1, 1.0, 1e5, 100.0), 0.1, 1.0)
        print(f"  {n:25d} {dl:16.5e} {dg:19.5e}")
    up_l, lo_l = p.online_delta_limit(cfg_l, 100), p.online_delta_limit(cfg_l, 100, "lower")
    up_g, lo_g = p.online_delta_limit(cfg_g, 100), p.online_delta_limit(cfg_g, 100, "lower")
    print(f"  online i=100: Laplace limit {up_l:.5e} (lower {lo_l:.5e}), Gaussian limit {up_g:.5e} (lower {lo_g:.5e})")


if __name__ == "__main__":
    bench_gaussian()
    bench_tree()
    bench_pnsgd()
