"""Check-in: a PVEC round's binomial noise shared by the users who check in (issue 16 item 1; RoundSpec.check_in).

Why: without it, each user adds m binomial trials per coordinate with m sized so that the threshold n_min (90 % of
the cohort by default) of users alone make enough noise. When every user reports, the round carries n / n_min
times the noise it needs (1.11x at 90 %) and the run spends less of its budget than it may (eps 0.945 of 1.0 on the
digits task, issue 16).

The protocol (one extra shuffler <-> node exchange per round, no extra analyzer round trip):
1. The analyzer sizes the worst case as before: m_plan trials per user at n_min contributors, so the round needs
   N* = m_plan n_min trials in total (``noise_trials``), and reserves the round's cost at N* in the ledger.
2. The shuffler invites the cohort with that spec (``checked_in`` = 0). Each node answers for its users, after its
   users' policies accepted the worst-case spec: a payload-free message per user (a check-in) or a refusal.
3. With c users checked in, the shuffler releases nothing if c < n_min. Otherwise it invites those c users again with
   c_min = max(n_min, ceil(f c)) and m = ceil(N* / c_min) (``share``; f = ``report_fraction``), and releases the
   round only if >= c_min of them send a valid message.
4. The analyzer recomputes (c_min, m) from the c the shuffler reports, decodes with m and charges the round in the
   ledger at the m and n' it actually ran.

Privacy argument: the noise of a released round holds m n' >= m c_min >= N* binomial trials. A PVEC round's privacy
depends on its noise only through the trials N (count mode, noise Bin(N, p); ``calibrated_pvec.round_noise_key``)
and is monotone in N: Bin(N + 1, p) is Bin(N, p) plus an independent Bernoulli, a post-processing. So whoever drops
after check-in (c_min <= n' <= c), a released round costs at most its reservation (at N*), and the ledger charges
its exact cost at m n'. c is a count of users online, which like dropouts is assumed independent of the data
(spec 000 sec 3). Each user verifies the second spec itself (eps from (g, m, p) at n' = c_min, and never above the c
the spec states: protocols/base.release_floor; clients/policy.py).

Cost: one more invitation and one more (payload-free) message per user per round, and one more node round trip of
latency. The gain when every user reports: noise N* c / c_min ~ N* / f instead of N* n / n_min (f = 0.99: 1.01x the
needed variance instead of 1.11x).
"""

from __future__ import annotations

import math

__all__ = ["share", "DEFAULT_REPORT_FRACTION"]

DEFAULT_REPORT_FRACTION = 0.99  # privacy.pvec.report_fraction: up to 1 % of the checked-in users may drop


def share(noise_trials: int, report_fraction: float, min_contributors: int, checked_in: int) -> tuple[int, int]:
    """(c_min, m): the threshold and each user's binomial trials after ``checked_in`` users checked in (step 3).

    Everyone (shuffler, analyzer, tests) computes it with this function, so they agree to the last trial.
    Raises ValueError when the inputs admit no round (c < min_contributors, or an invalid fraction).
    """
    if not (isinstance(noise_trials, int) and noise_trials >= 1):
        raise ValueError(f"noise_trials must be an integer >= 1, got {noise_trials!r}")
    if not (math.isfinite(report_fraction) and 0.0 < report_fraction <= 1.0):
        raise ValueError(f"report_fraction must lie in (0, 1], got {report_fraction!r}")
    n_min = max(1, int(min_contributors))
    if checked_in < n_min:
        raise ValueError(f"{checked_in} users checked in, fewer than the threshold {n_min}")
    c_min = max(n_min, math.ceil(report_fraction * checked_in))
    return c_min, -(-noise_trials // c_min)  # ceil: m c_min >= noise_trials
