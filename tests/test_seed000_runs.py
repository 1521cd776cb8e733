"""Issue 11 acceptance over the real services: `shuffledp run` (shuffler, analyzer and two client nodes as separate
OS processes on loopback) with AC-SA on a smooth loss, AC-SA on a Moreau-smoothed hinge loss, the strongly convex
phased schedule and PGD on a smoothed non-smooth loss. Each run completes, its released model beats the initial one,
and the ledger's total equals the accountant's figure recomputed independently for the rounds actually run (and is
never above the limit); the robust figure (honest fraction h, spec 000 A.3) likewise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _runs import run_cli

from shuffledp.accountants.pvec_pld import composed_epsilon, pvec_round_epsilon
from shuffledp.mechanisms.pvec import PvecParams

pytestmark = pytest.mark.timeout(240)

DATA = '[data]\ndataset = "synthetic"\nn = 3000\ndim = 5\nnoise = 0.5\nseed = 3\n'
FAST = "[deployment]\nround_deadline_seconds = 20\n[policy]\nmax_eps_per_round = 16\n"


def check_ledger(ledger: dict) -> dict:
    """Totals == the accountant's figure for the committed rounds, recomputed here; <= the limit. Returns the plan."""
    run, rounds, totals = ledger["run"], ledger["rounds"], ledger["totals"]
    plan, limit = run["plan"], run["limit"]
    assert run["state"] == "COMPLETED", run["message"]
    assert rounds and all(r["state"] == "committed" for r in rounds)
    used = [(PvecParams(**r["event"]["params"]), r["contributors"]) for r in rounds]
    h = plan["honest_fraction"]
    honest = [(p, max(1, math.floor(h * n))) for p, n in used]
    if plan["kind"] == "sequential":  # disjoint cohorts: parallel composition, the worst round (spec 000 sec 5)
        expect = max(pvec_round_epsilon(p, n, plan["delta"]) for p, n in used)
        robust = max(pvec_round_epsilon(p, n, plan["delta"]) for p, n in honest)
    else:  # calibrated fully interactive: RDP composition at the run's delta
        expect, robust = composed_epsilon(used, plan["delta"]), composed_epsilon(honest, plan["delta"])
    assert totals["eps_spent"] == pytest.approx(expect, rel=1e-12)
    assert totals["eps_spent"] <= limit["eps"] and totals["delta_spent"] <= limit["delta"]
    assert totals["eps_spent_robust"] == pytest.approx(robust, rel=1e-12) and robust >= expect
    return plan


def test_acsa_on_a_smooth_loss(tmp_path):
    toml = DATA + '[model]\ntask = "logreg"\n[privacy]\neps = 4.0\n[schedule]\nkind = "sequential"\n'
    ledger, rows, stdout = run_cli(tmp_path, "acsa", toml + 'optimizer = "acsa"\n' + FAST)
    plan = check_ledger(ledger)
    opt = plan["optimizer"]
    assert opt["name"] == "acsa" and opt["smoothness"] == 1.0  # synthetic ||x|| <= 1: beta = (1 + 1) / 2
    assert plan["rounds"] == 3000 // plan["cohort"] and len(rows) == plan["rounds"]
    assert all(r["released"] for r in rows) and "excess_risk" in rows[-1]
    assert rows[-1]["excess_risk"] < rows[0]["excess_risk"]  # the aggregated iterate improves
    assert "excess risk:" in stdout and "robust: eps" in stdout


def test_acsa_on_the_moreau_smoothed_hinge_loss(tmp_path):
    toml = DATA + '[model]\ntask = "hinge"\nsmoothing = "paper"\n[privacy]\neps = 4.0\n'
    toml += '[schedule]\nkind = "sequential"\noptimizer = "acsa"\n' + FAST
    ledger, rows, _ = run_cli(tmp_path, "hinge", toml)
    plan = check_ledger(ledger)
    n, d, delta = 3000, plan["dim"], plan["delta"]
    # Thm 4.7 of paper 000: beta = (eps n)^{2/3} L / (d^{1/3} D log^{2/3}(d/delta)), B = (nd)^{1/3} log^{2/3}/eps^{2/3}
    beta = (4.0 * n) ** (2 / 3) * 1.0 / (d ** (1 / 3) * 8.0 * math.log(d / delta) ** (2 / 3))
    assert plan["smoothing"] == pytest.approx(beta, rel=1e-12) and plan["optimizer"]["smoothness"] == plan["smoothing"]
    assert plan["cohort"] == math.ceil((n * d) ** (1 / 3) * math.log(d / delta) ** (2 / 3) / 4.0 ** (2 / 3))
    assert all(r["released"] for r in rows)
    assert rows[-1]["accuracy"] > 0.7  # hinge labels from a linear rule with noise 0.5: majority is about 0.5


def test_strongly_convex_phased_schedule(tmp_path):
    toml = DATA + '[model]\ntask = "logreg"\nl2 = 0.05\n[privacy]\neps = 4.0\n'
    toml += '[schedule]\nkind = "sequential"\noptimizer = "acsa"\nphases = 3\n' + FAST
    ledger, rows, _ = run_cli(tmp_path, "phases", toml)
    plan = check_ledger(ledger)
    opt = plan["optimizer"]
    assert opt["phases"] == 3 and sum(opt["phase_rounds"]) == plan["rounds"] == len(rows)
    assert opt["diameters"][0] == 8.0 and opt["diameters"] == sorted(opt["diameters"], reverse=True)
    assert all(r["released"] for r in rows) and rows[-1]["loss"] < rows[0]["loss"]


def test_pgd_on_a_smoothed_absolute_loss_fully_interactive(tmp_path):
    toml = DATA + '[model]\ntask = "absolute"\nsmoothing = "paper"\n[privacy]\neps = 4.0\n'
    toml += '[schedule]\nkind = "fully_interactive"\nrounds = 4\n' + FAST
    ledger, rows, _ = run_cli(tmp_path, "pgd-absolute", toml)
    plan = check_ledger(ledger)
    n, d, delta = 3000, plan["dim"], plan["delta"]
    # Thm 4.9: beta = (L/D) min{sqrt(n), eps n / (sqrt(d) log^{3/2}(n d / delta))}
    beta = (1.0 / 8.0) * min(math.sqrt(n), 4.0 * n / (math.sqrt(d) * math.log(n * d / delta) ** 1.5))
    assert plan["smoothing"] == pytest.approx(beta, rel=1e-12) and plan["optimizer"]["name"] == "pgd"
    assert len(rows) == 4 and all(r["released"] and r["contributors"] == n for r in rows)
    assert np.isfinite(rows[-1]["excess_risk"]) and rows[-1]["excess_risk"] < rows[0]["excess_risk"]


def test_eps_1_run_with_check_in_spends_at_least_99_percent_of_its_budget(tmp_path):
    """Issue 16: the embedded digits task at eps = 1 (16 fully interactive rounds, every user reports). The check-in
    shares the reserved noise N* = m n_min among the 1348 users who checked in, so the run spends >= 0.99 of eps;
    each round is charged at the m it ran with. Without the check-in the same plan spends less (computed here)."""
    from shuffledp.mechanisms import check_in

    ledger, rows, _ = run_cli(tmp_path, "eps1", "[privacy]\neps = 1.0\ndelta = 1e-5\n" + FAST)
    plan = check_ledger(ledger)
    n, n_min, ci = plan["cohort"], plan["min_contributors"], plan["check_in"]
    assert (n, n_min) == (1348, 1214) and ci["noise_trials"] == plan["params"]["m"] * n_min
    c_min, m = check_in.share(ci["noise_trials"], ci["report_fraction"], n_min, n)
    assert all(r["released"] and r["contributors"] == n and r["checked_in"] == n for r in rows)
    assert {r["event"]["params"]["m"] for r in ledger["rounds"]} == {m} and m < plan["params"]["m"]
    spent = ledger["totals"]["eps_spent"]
    assert 0.99 <= spent <= 1.0
    without = composed_epsilon([(PvecParams(**plan["params"]), n, 16)], plan["delta"])
    assert without < 0.96 < spent  # the same run sized for n_min and every user reporting: 1.11x the variance
