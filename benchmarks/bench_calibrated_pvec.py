"""Calibrated PVEC vs the paper's constants vs the Gaussian mechanism (spec 000 sec 8 "Loose constants").

For (d, n, eps) in {100, 650, 1000} x {10^3, 10^4} x {1, 4} and delta = 1e-6 (all with delta2 = 1), prints:
  * var paper / var calibrated: per-coordinate privacy-noise variance (2 delta2/g)^2 n m p (1-p) of the paper's
    Thm 3.2 parameters over that of ``calibrate_pvec`` (both for one round of n contributors);
  * var calibrated / var Gaussian: against the Gaussian mechanism with l2 sensitivity 2 delta2 at the same
    (eps, delta), exact analytic Gaussian (Balle & Wang 2018) and RDP-accounted (same conversion as ours);
  * the calibrated round's certified eps, g and m;
  * the paper's parameters accounted by this module's exact accountant: eps on the fixed order grid (top order
    1024), eps on the grid extended at its edges (rdp.extended_rdp_to_dp) and the optimal order lam*;
  * timings: calibrate (first call, uncached), composed_epsilon over 10^4 rounds (first and cached call);
  * the PLD route (``pvec_pld.calibrate_pvec_pld``, issue 16 item 2: what runs use) beside the RDP route
    (``calibrate_pvec``): its m, the route ``pvec_pld`` took, var calibrated / var Gaussian (exact) for both routes
    and the seconds each calibration took (first call, uncached).
Then a budget for 10^4 composed rounds (d = 100, n = 10^4) at eps = LONG_EPS, calibrated by both routes.
The last line is the largest calibrated/Gaussian variance ratio of the calibration runs use (PLD route) over the
grid: ``max calibrated/Gaussian variance ratio: X`` (issue 16 acceptance: <= 1.05).
Run: python benchmarks/bench_calibrated_pvec.py [--quick]  (--quick: one grid cell, d=100 n=10^3 eps=4, and the
10^4-round lines unchanged: the smoke test of tests/test_benchmark_scripts.py)
"""

from __future__ import annotations

import argparse
import time

from shuffledp.accountants import calibrated_pvec as cal
from shuffledp.accountants import pvec_pld
from shuffledp.accountants.rdp import rdp_to_dp
from shuffledp.mechanisms.pvec import pvec_params

DELTA = 1e-6
ROUNDS = 10**4
# eps of the 10^4-round budget. It was 1: that needs ~3.0e11 binomial trials per coordinate, above the 1e11 that
# planning certifies (pvec_pld.PLAN_MAX_N, issue 24 B8), whose refusal names 1.9 as the smallest eps that can work
# at this size; 2 is the round number just above it (~8.4e10 trials) and keeps the 10^4 rounds the line is about.
LONG_EPS = 2.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one grid cell (d=100, n=10^3, eps=4) and the 10^4 rounds")
    args = ap.parse_args(argv)
    dims, ns, epss = ((100,), (10**3,), (4.0,)) if args.quick else ((100, 650, 1000), (10**3, 10**4), (1.0, 4.0))
    print(f"delta = {DELTA}, delta2 = 1; noise variance per coordinate in data units")
    hdr = (
        f"{'d':>5} {'n':>6} {'eps':>4} | {'g':>5} {'m':>9} {'eps_cert':>8} | {'paper/cal':>10} "
        f"{'cal/Gauss':>9} {'cal/GaussRDP':>12} | {'t_cal[s]':>8} {'t_1e4[s]':>8} {'t_1e4 cached':>12} | "
        f"{'paper eps fixed':>15} {'extended':>9} {'lam*':>6} {'t[s]':>5} | {'m PLD':>9} {'route':>8} "
        f"{'RDP/Gauss':>9} {'PLD/Gauss':>9} {'t_RDP[s]':>8} {'t_PLD[s]':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    worst = 0.0
    for d in dims:
        for n in ns:
            for eps in epss:
                paper = pvec_params(eps, DELTA, n, d, 1.0)
                t0 = time.perf_counter()
                pr = cal.calibrate_pvec(eps, DELTA, n, d, 1.0)
                t_cal = time.perf_counter() - t0
                e_cert = cal.pvec_round_epsilon(pr, n, DELTA)
                rounds = [(pr, n)] * ROUNDS
                t0 = time.perf_counter()
                cal.composed_epsilon(rounds, DELTA)
                t_first = time.perf_counter() - t0
                t0 = time.perf_counter()
                cal.composed_epsilon(rounds, DELTA)
                t_cached = time.perf_counter() - t0
                v_cal = cal.noise_variance(pr)
                ratio_paper = cal.noise_variance(paper) / v_cal
                g_exact = v_cal / cal.gaussian_variance(eps, DELTA, 1.0, method="exact")
                g_rdp = v_cal / cal.gaussian_variance(eps, DELTA, 1.0, method="rdp")
                t0 = time.perf_counter()
                e_paper, lam = cal.composed_epsilon([(paper, n)], DELTA, return_order=True)
                t_paper = time.perf_counter() - t0
                e_fixed = rdp_to_dp(cal.DEFAULT_ORDERS, cal.pvec_round_rdp(paper, n, cal.DEFAULT_ORDERS), DELTA)[0]
                t0 = time.perf_counter()
                pp = pvec_pld.calibrate_pvec_pld(eps, DELTA, n, d, 1.0)
                t_pld = time.perf_counter() - t0
                p_exact = cal.noise_variance(pp) / cal.gaussian_variance(eps, DELTA, 1.0, method="exact")
                worst = max(worst, p_exact)
                print(
                    f"{d:>5} {n:>6} {eps:>4.0f} | {pr.g:>5} {pr.m:>9} {e_cert:>8.4f} | {ratio_paper:>10.1f} "
                    f"{g_exact:>9.3f} {g_rdp:>12.3f} | {t_cal:>8.2f} {t_first:>8.3f} {t_cached:>12.4f} | "
                    f"{e_fixed:>15.5f} {e_paper:>9.5f} {lam:>6.0f} {t_paper:>5.1f} | {pp.m:>9} "
                    f"{pvec_pld.pld_route(pp, n):>8} {g_exact:>9.3f} {p_exact:>9.3f} {t_cal:>8.2f} {t_pld:>8.2f}",
                    flush=True,
                )
    # a budget for 10^4 composed rounds (fully interactive, e.g. PGD with all n users every round)
    t0 = time.perf_counter()
    pr = cal.calibrate_pvec(LONG_EPS, DELTA, 10**4, 100, 1.0, rounds=ROUNDS)
    t_cal = time.perf_counter() - t0
    t0 = time.perf_counter()
    e = cal.composed_epsilon([(pr, 10**4)] * ROUNDS, DELTA)
    t_q = time.perf_counter() - t0
    ratio = cal.noise_variance(pr) / cal.gaussian_variance(LONG_EPS, DELTA, 1.0, rounds=ROUNDS, method="exact")
    print(
        f"\n{ROUNDS} rounds, d=100, n=1e4, eps={LONG_EPS:g}: m={pr.m}, certified eps={e:.4f}, "
        f"var/Gauss(exact, {ROUNDS} rounds)={ratio:.3f}; calibrate {t_cal:.2f} s, composed query {t_q * 1e3:.1f} ms"
    )
    t0 = time.perf_counter()
    pp = pvec_pld.calibrate_pvec_pld(LONG_EPS, DELTA, 10**4, 100, 1.0, rounds=ROUNDS)
    t_pld = time.perf_counter() - t0
    e_pld = pvec_pld.pld_epsilon(pp, 10**4, ROUNDS, DELTA)
    ratio_pld = cal.noise_variance(pp) / cal.gaussian_variance(LONG_EPS, DELTA, 1.0, rounds=ROUNDS, method="exact")
    print(
        f"PLD route ({pvec_pld.pld_route(pp, 10**4)}): m={pp.m}, certified eps={e_pld:.4f}, var/Gauss(exact, "
        f"{ROUNDS} rounds)={ratio_pld:.3f} (RDP route {ratio:.3f}); calibrate {t_pld:.2f} s"
    )
    print(f"max calibrated/Gaussian variance ratio: {worst:.4f}")


if __name__ == "__main__":
    main()
