"""Privacy events (shuffledp.accountants.events) and the accountant dispatch (shuffledp.accountants.ledger_accounting).

Events: JSON round trip, the stability rule (old ledgers without optional fields still parse, unknown fields and
kinds are refused), validation. Dispatch: account() agrees with the per-seed accountant modules, composition
rules (parallel, RDP, advanced, basic across families), inverse queries are consistent and safe.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant as dpa_pld
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

import shuffledp.accountants.ledger_accounting as la
from shuffledp.accountants import (
    calibrated_pvec,
    composition,
    fmt_shuffle,
    gaussian,
    pnsgd,
    pvec_pld,
    subsampled_shuffle,
    tree_aggregation,
)
from shuffledp.accountants.events import (
    EVENT_KINDS,
    GaussianRound,
    LdpShuffleRound,
    PnsgdRun,
    PvecRound,
    TreeAggregation,
    event_from_dict,
    event_from_json,
    events_from_json,
    events_to_json,
    trust_of,
)
from shuffledp.accountants.rdp import round_up
from shuffledp.mechanisms.pvec import pvec_params

# One PVEC configuration reused everywhere (the exact accountant caches per configuration).
PVEC_SEQ = pvec_params(1.0, 1e-6, 1000, 10, 1.0)
EPS_R, DELTA_R = composition.pgd_round_budget(1.0, 1e-6, 15)
PVEC_PGD = pvec_params(EPS_R, DELTA_R, 1000, 10, 1.0)

EXAMPLES = [
    PvecRound.from_params(PVEC_SEQ, 990, "sequential"),
    PvecRound.from_params(PVEC_PGD, None, "fully_interactive"),
    LdpShuffleRound("r_inf", 1.5, 60000, 1000),
    GaussianRound(3.0, 2.0, "local"),
    GaussianRound(1.1, 1.0, "central", "poisson", 0.01),
    TreeAggregation(1.2, 1000, 3, 50, True),
    TreeAggregation(0.9, 12, 3, order="fixed"),
    PnsgdRun("laplace", 1000, 1.0, 1.0, 0.5, 1.0),
    PnsgdRun("gaussian", 10000, 1.0, 3.3, 0.1, 1.0, 0.9),
]


# ------------------------------------------------------------------------------------------------ events
@pytest.mark.parametrize("ev", EXAMPLES, ids=lambda e: e.KIND)
def test_json_round_trip_is_exact(ev) -> None:
    text = ev.to_json()
    back = event_from_json(text)
    assert back == ev and type(back) is type(ev)
    assert back.to_json() == text  # canonical
    assert json.loads(text)["kind"] == ev.KIND
    assert json.loads(text)["trust"] == ev.trust  # every event records its trust model


def test_event_list_round_trip_and_hashable() -> None:
    back = events_from_json(events_to_json(EXAMPLES))
    assert back == EXAMPLES
    assert len(set(back)) == len(EXAMPLES)  # frozen dataclasses: usable as keys (counts of identical rounds)


def test_events_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EXAMPLES[3].sigma = 10.0  # type: ignore[misc]


def test_pinned_stored_format_still_parses() -> None:
    # Stability rule: these strings are what a ledger wrote; kinds and field names must keep their meaning.
    stored = (
        '[{"kind": "gaussian_round", "sigma": 2.0, "sensitivity": 0.5, "trust": "local", "sampling": "none",'
        ' "sampling_rate": 1.0},'
        ' {"kind": "ldp_shuffle_round", "randomizer": "rr", "eps0": 1.0, "n": 100, "k": 10,'
        ' "schedule": "subsampled", "trust": "shuffle"},'
        ' {"kind": "tree_aggregation", "noise_multiplier": 1.0, "steps": 8, "max_participations": 1,'
        ' "min_separation": 0, "completion": false, "order": "any", "trust": "central"},'
        ' {"kind": "pnsgd_run", "noise": "gaussian", "n": 10, "lipschitz": 1.0, "scale": 2.0, "eta": 0.1,'
        ' "diameter": 1.0, "contraction": 1.0, "schedule": "shuffled", "trust": "central"}]'
    )
    evs = events_from_json(stored)
    assert evs[0] == GaussianRound(sigma=2.0, sensitivity=0.5, trust="local")
    assert evs[0].noise_multiplier == 4.0
    assert evs[1] == LdpShuffleRound("rr", 1.0, 100, 10) and evs[1].sampling_rate == 0.1
    assert evs[2] == TreeAggregation(1.0, 8)
    assert evs[3] == PnsgdRun("gaussian", 10, 1.0, 2.0, 0.1, 1.0)
    assert set(EVENT_KINDS) == {"pvec_round", "ldp_shuffle_round", "gaussian_round", "tree_aggregation", "pnsgd_run"}


def test_missing_optional_fields_take_defaults() -> None:
    # An older ledger that predates the optional fields still parses, with the defaults' (old) meaning.
    assert event_from_dict({"kind": "gaussian_round", "sigma": 2.0}) == GaussianRound(2.0, 1.0, "central")
    d = EXAMPLES[0].to_dict()
    del d["schedule"], d["trust"]
    assert event_from_dict(d).schedule == "sequential" and event_from_dict(d).trust == "shuffle"


def test_unknown_fields_and_kinds_are_refused() -> None:
    d = GaussianRound(2.0).to_dict()
    d["honest_fraction"] = 0.5  # a future optional field could change the cost: never ignore it
    with pytest.raises(ValueError, match="honest_fraction"):
        event_from_dict(d)
    with pytest.raises(ValueError, match="unknown privacy event kind 'laplace_round'"):
        event_from_json('{"kind": "laplace_round", "b": 1.0}')
    with pytest.raises(ValueError, match=r"lacks required fields \['sigma'\]"):
        event_from_dict({"kind": "gaussian_round"})
    with pytest.raises(ValueError, match="not valid JSON"):
        event_from_json("{not json")
    with pytest.raises(ValueError, match="JSON array"):
        events_from_json('{"kind": "gaussian_round", "sigma": 1.0}')


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LdpShuffleRound("rr", 1.0, 10, 20), r"k must satisfy 1 <= k <= n = 10, got 20"),
        (lambda: LdpShuffleRound("rr", 0.0, 10, 2), "eps0 must be a finite number"),
        (lambda: LdpShuffleRound("rr", 1.0, 10, 2, schedule="sequential"), "schedule"),
        (lambda: GaussianRound(-1.0), "sigma must be a finite number"),
        (lambda: GaussianRound(1.0, trust="shuffle"), r"trust must be one of \('local', 'central'\)"),
        (lambda: GaussianRound(1.0, sampling_rate=0.5), "sampling_rate must be 1 when sampling is 'none'"),
        (lambda: GaussianRound(1.0, sampling="poisson", sampling_rate=1.5), "sampling_rate"),
        (lambda: TreeAggregation(1.0, 10, 3, order="fixed"), "multiple of max_participations"),
        (lambda: TreeAggregation(1.0, 0), "steps must be an integer >= 1"),
        (lambda: TreeAggregation(1.0, 10, completion=1), "completion must be true or false"),
        (lambda: PnsgdRun("cauchy", 10, 1.0, 1.0, 0.1, 1.0), "noise must be one of"),
        (lambda: PnsgdRun("gaussian", 10, 1.0, 1.0, 0.1, 1.0, contraction=1.5), "contraction"),
        (lambda: PvecRound.from_params(PVEC_SEQ, 1001), "contributors must be <= n = 1000"),
        (lambda: PvecRound.from_params(PVEC_SEQ, schedule="subsampled"), "schedule"),
        (lambda: dataclasses.replace(EXAMPLES[0], p=0.7), "p must lie in"),
    ],
)
def test_bad_values_name_the_field(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_numpy_scalars_are_normalised_and_pvec_params_round_trip() -> None:
    ev = LdpShuffleRound("rr", np.float64(1.0), np.int64(100), np.int64(10))
    assert type(ev.n) is int and type(ev.eps0) is float
    json.dumps(ev.to_dict())  # JSON-serialisable
    assert EXAMPLES[0].params == PVEC_SEQ and EXAMPLES[0].contributors == 990


def test_mixed_trust_models_are_refused() -> None:
    assert trust_of([GaussianRound(1.0), TreeAggregation(1.0, 4)]) == "central"
    with pytest.raises(ValueError, match="different trust models"):
        la.account([GaussianRound(1.0, trust="local"), GaussianRound(1.0)], 1e-5)


# ----------------------------------------------------------------------------------- dispatch: seed 002/003
def test_gaussian_matches_seed002_accountant_and_lemma25() -> None:
    ev = GaussianRound(20.0, 2.0, "local")
    rho = 2.0 * math.sqrt(100) / 20.0
    tight = la.account([(ev, 100)], 1e-5)
    assert tight.eps == gaussian.epsilon_constant_noise(2.0, 20.0, 100, 1e-5, "exact")
    assert tight.trust == "local" and tight.optimal_order is None and tight.delta == 1e-5
    paper = la.account([ev] * 100, 1e-5, "paper")
    lemma25 = rho * rho / 2 + rho * math.sqrt(2 * math.log(1e5))  # seed 002 Lemma 2.5, independent
    assert lemma25 <= paper.eps == pytest.approx(round_up(lemma25), rel=1e-12)  # + the float margin (issue 43)
    assert paper.optimal_order == pytest.approx(1 + math.sqrt(2 * math.log(1e5)) / rho, rel=1e-12)
    assert tight.eps < paper.eps
    # heterogeneous noise: rho^2 adds (Thm 5.1)
    hetero = la.account([(GaussianRound(10.0), 3), (GaussianRound(5.0), 2)], 1e-5)
    assert hetero.eps == pytest.approx(gaussian.epsilon(1.0, [10.0] * 3 + [5.0] * 2, 1e-5, "exact"), rel=1e-12)


def test_sampled_gaussian_matches_dp_accounting() -> None:
    ev = GaussianRound(1.1, 1.0, "central", "poisson", 0.01)
    dpe = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)), 500)
    rdp = dpa_rdp.RdpAccountant().compose(dpe)
    eps_rdp, order = rdp.get_epsilon_and_optimal_order(1e-5)
    paper = la.account([(ev, 500)], 1e-5, "paper")
    # dp_accounting's figures raised by the float margin (rdp.round_up; issue 43 item 7), never below them
    assert paper.eps == pytest.approx(round_up(eps_rdp), rel=1e-12) and paper.eps >= eps_rdp
    assert paper.optimal_order == order
    pld = dpa_pld.PLDAccountant(value_discretization_interval=1e-4).compose(dpe)
    tight = la.account([(ev, 500)], 1e-5)
    assert tight.eps == pytest.approx(round_up(min(pld.get_epsilon(1e-5), eps_rdp)), rel=1e-12)
    assert tight.eps <= paper.eps


def test_sampled_gaussian_order_grid_is_extended_above_1024() -> None:
    # sigma = 50, q = 0.01, 10 rounds: the RDP optimum lies far above dp_accounting's top default order 1024
    ev = GaussianRound(50.0, 1.0, "central", "poisson", 0.01)
    dpe = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(50.0)), 10)
    fixed, fixed_order = dpa_rdp.RdpAccountant().compose(dpe).get_epsilon_and_optimal_order(1e-6)
    assert fixed_order == 1024
    paper = la.account([(ev, 10)], 1e-6, "paper")
    assert paper.optimal_order > 4 * 1024 and paper.eps < fixed / 3  # 0.00188 vs 0.00596
    # valid: the same accountant at exactly that (integer) order, and not below an optimistic PLD (a lower
    # bound on the true eps, discretisation 1e-5)
    at_order = dpa_rdp.RdpAccountant(orders=[paper.optimal_order]).compose(dpe)
    eps_at = at_order.get_epsilon_and_optimal_order(1e-6)[0]
    assert paper.eps == pytest.approx(round_up(eps_at), rel=1e-12) and paper.eps >= eps_at  # + the float margin
    optimistic = pld_lib.from_gaussian_mechanism(
        50.0, sampling_prob=0.01, pessimistic_estimate=False, value_discretization_interval=1e-5, use_connect_dots=False
    ).self_compose(10)
    assert optimistic.get_epsilon_for_delta(1e-6) <= paper.eps


def test_tree_matches_seed003_accountant() -> None:
    one = TreeAggregation(1.5, 1000)
    zeta = tree_aggregation.zeta_single_tree(1000)
    assert la.account([one], 1e-6).eps == tree_aggregation.epsilon(zeta, 1.5, 1e-6, "exact")
    paper = la.account([one], 1e-6, "paper")
    assert paper.eps == tree_aggregation.epsilon(zeta, 1.5, 1e-6, "rdp", tree_aggregation.PAPER_ORDERS)
    assert paper.optimal_order in tree_aggregation.PAPER_ORDERS
    # restarts with completion: every tree but the last is padded (spec 003 sec 3)
    padded = TreeAggregation(1.5, 1000, completion=True)
    z = tree_aggregation.zeta_restarts([1000, 1000, 1000], completion=True)
    assert la.tree_zeta(padded) * 2 + la.tree_zeta(one) == z
    assert la.account([(padded, 2), one], 1e-6).eps == pytest.approx(
        tree_aggregation.epsilon(z, 1.5, 1e-6, "exact"), rel=1e-12
    )
    multi = TreeAggregation(1.5, 64, 4, 7)
    assert la.tree_zeta(multi) == tree_aggregation.zeta_multi_participation(64, 4, 7)
    assert la.tree_zeta(TreeAggregation(1.5, 12, 3, order="fixed")) == tree_aggregation.zeta_fixed_order(4, 3)
    # trees and Gaussian rounds are both Gaussian mechanisms: rho^2 adds
    mixed = la.account([one, (GaussianRound(4.0), 3)], 1e-6)
    rho = math.sqrt(zeta / 1.5**2 + 3 / 16.0)
    assert mixed.eps == pytest.approx(gaussian.epsilon_for_rho(rho, 1e-6, "exact"), rel=1e-12)


# ------------------------------------------------------------------------------------------- seed 001
LDP = LdpShuffleRound("rr", 1.0, 60000, 10000)


def test_ldp_shuffle_matches_seed001_accountant_and_spec_values() -> None:
    upper = la.account([(LDP, 600)], 1e-5, ldp_bound="upper")
    eps, order = subsampled_shuffle.subsampled_shuffle_epsilon(1.0, 60000, 10000, 600, 1e-5, return_order=True)
    assert (upper.eps, upper.optimal_order) == (eps, order)
    assert upper.eps == pytest.approx(0.96728, rel=1e-5) and upper.optimal_order == 16  # spec 001 sec 6 table
    tight = la.account([(LDP, 600)], 1e-5)  # default tight: Thm 1 + envelope / pure-DP cap
    assert tight.eps <= upper.eps
    paper = la.account([(LDP, 600)], 1e-5, "paper")  # FMT20 numeric + subsampling + KOV15
    assert paper.eps == fmt_shuffle.baseline_epsilon(1.0, 60000, 10000, 600, 1e-5)
    assert paper.eps == pytest.approx(1.282, abs=5e-4)  # spec 001 sec 6 baseline row 1
    lower = la.account([(LDP, 600)], 1e-5, ldp_bound="lower")
    assert lower.details["guarantee"] is False and lower.eps <= tight.eps


def test_ldp_shuffle_heterogeneous_path_equals_grouped_path() -> None:
    # Same mechanism under two labels: the RDP-sum path must reproduce the module's T-fold composition.
    other = dataclasses.replace(LDP, randomizer="r_inf")
    split = la.account([(LDP, 250), (other, 350)], 1e-5, ldp_bound="upper")
    assert split.eps == pytest.approx(la.account([(LDP, 600)], 1e-5, ldp_bound="upper").eps, rel=1e-12)
    with pytest.raises(ValueError, match="identical rounds only"):
        la.account([(LDP, 2), (other, 2)], 1e-5, "paper")


def test_ldp_shuffle_tight_pld_matches_fmt_module() -> None:
    ev = LdpShuffleRound("rr", 1.0, 2000, 200)
    got = la.account([(ev, 20)], 1e-6, ldp_bound="tight-pld")
    assert got.eps == fmt_shuffle.tight_pld_epsilon(1.0, 2000, 200, 20, 1e-6)


# ------------------------------------------------------------------------------------------- seed 004
def test_pnsgd_matches_seed004_accountant() -> None:
    ev = PnsgdRun("gaussian", 10000, 1.0, 3.28531, 0.1, 1.0)
    one = la.account([ev], 1e-5)
    assert one.eps == pnsgd.epsilon_shuffled("gaussian", 1e-5, 10000, 1.0, 3.28531, 0.1, 1.0)
    assert pnsgd.delta_shuffled("gaussian", one.eps, 10000, 1.0, 3.28531, 0.1, 1.0) <= 1e-5
    assert one.eps == pytest.approx(1.0, abs=1e-4)  # spec 004 sec 4: sigma ~ 3.28531 calibrates eps=1 at 1e-5
    paper = la.account([(ev, 3)], 1e-5, "paper")
    basic = 3 * pnsgd.epsilon_shuffled("gaussian", 1e-5 / 3, 10000, 1.0, 3.28531, 0.1, 1.0)
    assert paper.eps == pytest.approx(basic, rel=1e-12) and paper.eps >= basic
    assert la.account([(ev, 3)], 1e-5).eps <= paper.eps


# ------------------------------------------------------------------------------------------- seed 000
def test_pvec_paper_reproduces_spec_pgd_total() -> None:
    ev = PvecRound.from_params(PVEC_PGD, None, "fully_interactive")
    got = la.account([(ev, 15)], 1e-6, "paper")
    # spec 000 sec 5: eps_r sqrt(2T ln(1/d')) + T eps_r (e^eps_r - 1), d' = delta/(T+1); ~0.557
    d_prime = 1e-6 / 16
    formula = EPS_R * math.sqrt(2 * 15 * math.log(1 / d_prime)) + 15 * EPS_R * math.expm1(EPS_R)
    assert got.eps == pytest.approx(formula, rel=1e-9) and got.eps == pytest.approx(0.557, abs=1e-3)
    assert la.max_rounds(ev, 1.0, 1e-6, "paper") == 15  # the 16th round exhausts delta (T delta_r + d' > delta)


def test_pvec_sequential_rounds_compose_in_parallel() -> None:
    full = PvecRound.from_params(PVEC_SEQ)
    fewer = PvecRound.from_params(PVEC_SEQ, 900)
    paper = la.account([(full, 7), fewer], 1e-6, "paper")
    assert paper.eps == 1.0  # Thm 3.2's claim; parallel composition, not 8 eps
    tight = la.account([(full, 7), fewer], 1e-6)
    worst = max(
        pvec_pld.pvec_round_epsilon(PVEC_SEQ, 1000, 1e-6),
        pvec_pld.pvec_round_epsilon(PVEC_SEQ, 900, 1e-6),
    )
    assert tight.eps == worst == pvec_pld.pvec_round_epsilon(PVEC_SEQ, 900, 1e-6)
    assert tight.eps < paper.eps / 10  # the paper's constants are loose (spec 000 sec 7.3)
    assert la.max_rounds(full, 1.0, 1e-6) == math.inf  # limited by fresh users, not by privacy


def test_pvec_fully_interactive_matches_calibrated_composition() -> None:
    ev = PvecRound.from_params(PVEC_PGD, None, "fully_interactive")
    got = la.account([(ev, 15)], 1e-6)
    assert got.eps == pvec_pld.composed_epsilon([(PVEC_PGD, 1000)] * 15, 1e-6)
    # the optimal order is reported, and it is the one of the (edge-extended) grid that gives eps
    assert (got.eps, got.optimal_order) == pvec_pld.composed_epsilon([(PVEC_PGD, 1000, 15)], 1e-6, True)
    assert got.optimal_order > 1.0
    # one sequential round on top: the worst user is in all 15 rounds and in that one
    seq = PvecRound.from_params(PVEC_SEQ)
    mixed = la.account([(ev, 15), (seq, 4)], 1e-6)
    assert mixed.eps == pvec_pld.composed_epsilon([(PVEC_PGD, 1000)] * 15 + [(PVEC_SEQ, 1000)], 1e-6)
    # very long histories are passed as counts (no list of 10^7 rounds)
    long_path = la.account([(ev, 10**7)], 1e-6)
    assert long_path.eps == pvec_pld.composed_epsilon([(PVEC_PGD, 1000, 10**7)], 1e-6) > got.eps


def test_pvec_min_noise_paper_and_calibrated() -> None:
    ev = la.pvec_min_noise(1.0, 1e-6, 1000, 10, 1.0, 15, "fully_interactive", "paper")
    assert ev.params == PVEC_PGD  # Alg 5: eps_r = eps/(2 sqrt(2T ln(1/delta))), delta_r = delta/(T+1)
    small = la.pvec_min_noise(1.0, 1e-5, 100, 2, 1.0, 4, "fully_interactive", "tight")
    assert small.params == pvec_pld.calibrate_pvec_pld(1.0, 1e-5, 100, 2, 1.0, rounds=4)
    assert la.account([(small, 4)], 1e-5).eps <= 1.0


def test_pvec_paper_bound_with_fewer_contributors_uses_lemma_chain() -> None:
    from shuffledp.accountants import pvec as paper_pvec

    cal = calibrated_pvec.calibrate_pvec(1.0, 1e-5, 100, 2, 1.0)
    ev = PvecRound.from_params(cal, 80)
    got = la.account([ev], 1e-5, "paper")
    b = paper_pvec.pvec_paper_round(cal, 80)
    assert got.eps == b.eps or (math.isinf(b.eps) and math.isinf(got.eps))


# ----------------------------------------------------------------------------------- families, inverses
def test_families_compose_by_basic_composition() -> None:
    g = GaussianRound(10.0)
    p = PnsgdRun("gaussian", 10000, 1.0, 3.28531, 0.1, 1.0)
    got = la.account([(g, 5), p], 1e-5)
    parts = la.account([(g, 5)], 5e-6).eps + la.account([p], 5e-6).eps
    assert got.eps >= parts and got.eps == pytest.approx(parts, rel=1e-12)
    assert set(got.details["parts"]) == {"gaussian", "pnsgd"} and got.optimal_order is None


@pytest.mark.parametrize(
    ("ev", "eps"),
    [
        (GaussianRound(20.0, 1.0), 2.0),
        (GaussianRound(1.1, 1.0, sampling="poisson", sampling_rate=0.01), 1.0),
        (TreeAggregation(5.0, 255), 6.0),
        (LDP, 1.0),
        (PnsgdRun("gaussian", 10000, 1.0, 5.0, 0.1, 1.0), 4.0),
    ],
    ids=["gaussian", "sampled-gaussian", "tree", "ldp-shuffle", "pnsgd"],
)
@pytest.mark.parametrize("accountant", ["tight", "paper"])
def test_max_rounds_is_consistent(ev, eps, accountant) -> None:
    t = la.max_rounds(ev, eps, 1e-5, accountant)
    assert t >= 1
    assert la.account([(ev, t)], 1e-5, accountant).eps <= eps < la.account([(ev, t + 1)], 1e-5, accountant).eps


def test_max_rounds_agrees_with_modules_and_respects_spent() -> None:
    g = GaussianRound(20.0)
    assert la.max_rounds(g, 2.0, 1e-5) == gaussian.max_rounds(1.0, 20.0, 2.0, 1e-5, "exact")
    assert la.max_rounds(LDP, 1.0, 1e-5, ldp_bound="upper") == subsampled_shuffle.max_rounds(
        1.0, 60000, 10000, 1.0, 1e-5
    )
    total = la.max_rounds(g, 2.0, 1e-5)
    assert la.max_rounds(g, 2.0, 1e-5, spent=[(g, 10)]) == total - 10
    assert la.max_rounds(GaussianRound(0.1), 0.5, 1e-5) == 0


def test_min_noise_agrees_with_modules_and_is_safe() -> None:
    ev, res = la.min_noise(GaussianRound(1.0, 2.0), 100, 2.0, 1e-5)
    ref = gaussian.min_sigma(2.0, 100, 2.0, 1e-5, "exact")
    assert ev.sigma == pytest.approx(ref, rel=1e-8) and res.eps <= 2.0
    assert la.account([(dataclasses.replace(ev, sigma=ev.sigma * (1 - 1e-7)), 100)], 1e-5).eps > 2.0  # minimal
    tree, res = la.min_noise(TreeAggregation(1.0, 1000, 2, 100), 3, 1.0, 1e-6)
    zeta = 3 * tree_aggregation.zeta_multi_participation(1000, 2, 100)
    assert tree.noise_multiplier == pytest.approx(
        tree_aggregation.min_noise_multiplier(zeta, 1.0, 1e-6, "exact"), rel=1e-8
    )
    assert res.eps <= 1.0
    run, res = la.min_noise(PnsgdRun("gaussian", 10000, 1.0, 1.0, 0.1, 1.0), 1, 1.0, 1e-5)
    assert run.scale == pytest.approx(pnsgd.calibrate_scale("gaussian", 1e-5, 1.0, 10000, 1.0, 0.1, 1.0), rel=1e-8)
    assert res.eps <= 1.0
    ldp, res = la.min_noise(LDP, 600, 1.0, 1e-5, ldp_bound="upper")
    assert ldp.eps0 == pytest.approx(subsampled_shuffle.max_eps0(60000, 10000, 600, 1.0, 1e-5), rel=1e-5)
    assert res.eps <= 1.0


def test_results_are_valid_numbers_at_the_extremes() -> None:
    # no overflow or NaN: 10^6 rounds, n = 10^7 clients, tiny and huge noise
    cases = [
        la.account([(GaussianRound(1000.0), 10**6)], 1e-9),
        la.account([(GaussianRound(1e-3), 10**6)], 1e-9, "paper"),
        la.account([(LdpShuffleRound("rr", 1.0, 10**7, 1000), 10**6)], 1e-9),
        la.account([(TreeAggregation(10.0, 10**6), 1000)], 1e-9),
    ]
    for r in cases:
        assert r.eps >= 0.0 and not math.isnan(r.eps) and 0.0 <= r.delta <= 1.0
    assert la.account([(GaussianRound(1e6), 1)], 0.5).eps == 0.0


def test_bad_queries_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="delta must be in the open interval"):
        la.account([GaussianRound(1.0)], 1.5)
    with pytest.raises(ValueError, match="accountant must be one of"):
        la.account([GaussianRound(1.0)], 1e-5, "loose")
    with pytest.raises(ValueError, match="at least one privacy event"):
        la.account([], 1e-5)
    with pytest.raises(ValueError, match="eps \\(the budget\\) must be a finite number > 0"):
        la.max_rounds(GaussianRound(1.0), 0.0, 1e-5)
    with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
        la.min_noise(GaussianRound(1.0), 0, 1.0, 1e-5)
    with pytest.raises(ValueError, match="bound must be one of"):
        la.account([LDP], 1e-5, ldp_bound="loose")
