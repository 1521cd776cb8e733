"""Issue 11 acceptance: on the synthetic problem (n = 10^4, d = 20, eps = 4) AC-SA's excess risk is at most PSGD's,
as spec 000 sec 4 predicts (AC-SA d^{2/5}/(eps n)^{4/5} against PSGD d^{1/4}/sqrt(eps n)), each with its own theory
cohort and step sizes. Computed in one process with the services' modules (tests/_simulate.py), 5 fixed seeds.

Measured (seeds 0-4): PSGD mean 0.0127 (B = 21, T = 476), AC-SA mean 0.0102 (B = 370, T = 27), with the PLD-tight
calibration of issue 16 (before it, with more noise: 0.0172 and 0.0104). Tolerance: none on the ordering of the
means (the theory's prediction); the AC-SA mean must also lie below 0.9x PSGD's, a margin the observed spread (AC-SA
per-seed 0.004-0.019) keeps for these seeds.
"""

from __future__ import annotations

import numpy as np
import pytest
from _simulate import simulate_run

pytestmark = pytest.mark.timeout(300)

BASE = """
[data]
dataset = "synthetic"
n = 10000
dim = 20
noise = 1.0
seed = 0
[model]
task = "logreg"
radius = 4.0
[privacy]
eps = 4.0
[policy]
max_eps_per_round = 64
[schedule]
kind = "sequential"
"""


def test_acsa_excess_risk_is_at_most_psgd_on_the_synthetic_problem():
    risks = {}
    for opt in ("psgd", "acsa"):
        runs = [simulate_run(BASE + f'optimizer = "{opt}"\n', seed) for seed in range(5)]
        risks[opt] = np.array([r for r, _ in runs])
        plan = runs[0][1]
        assert plan["optimizer"]["name"] == opt and plan["eps"] == 4.0 and plan["dim"] == 42  # 2 x (20 + 1)
    assert np.all(risks["psgd"] > 0) and np.all(risks["acsa"] > -1e-3)  # a released model, not the optimum
    assert risks["acsa"].mean() <= 0.9 * risks["psgd"].mean(), risks
