"""Every figure that charges discrete Gaussian noise is one proven for it (issue 24 D19).

The central protocols add the discrete Gaussian (CKS20) by default. Its proven privacy is the continuous Gaussian's
RDP curve (CKS20 Thm 14), not Balle-Wang's exact curve nor dp_accounting's sampled-Gaussian bounds. On the code
before this change the ledger, the planner, the node's verification and its per-run account charged the exact
curve (tree, pan, mu2, the unamplified track of DP-SGD) or WBK19 Thm 27 (fixed cohort) for discrete noise: the
tests marked "old code" below fail there. Reference values are computed independently (dp_accounting, or the
conversion formula and the subsampling bound written out here)."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp
from shuffledp.services.ledger import PrivacyEvent

from shuffledp.accountants import gaussian
from shuffledp.accountants import ledger_accounting as la
from shuffledp.accountants.events import GaussianRound as GaussianEvent
from shuffledp.accountants.events import TreeAggregation
from shuffledp.accountants.rdp import round_up, subsampled_wor_rdp
from shuffledp.config import ConfigError, parse_config
from shuffledp.mechanisms import discrete_gaussian
from shuffledp.protocols.base import PlanRequest
from shuffledp.protocols.gaussian_round import GaussianRound, GaussianSettings, unamplified_epsilon, wor_epsilon
from shuffledp.protocols.tree_round import TreeRound, TreeSettings, _trees_epsilon
from shuffledp.security import sealing
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb

DELTA = 1e-5


def _cks_conversion(rho: float, delta: float) -> float:
    """CKS20 Prop 12 for the curve alpha rho^2 / 2, minimised over a fine order grid (an independent reference)."""
    a = np.concatenate((np.linspace(1.001, 20.0, 200_000), np.geomspace(20.0, 1e6, 200_000)))
    eps = a * rho * rho / 2.0 + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
    return max(0.0, float(eps.min()))


# ------------------------------------------------------------------------------------------ reference values
@pytest.mark.parametrize("rho", [0.02, 0.1, 0.5, 1.0, 3.0, 10.0])
def test_discrete_figure_is_the_zcdp_conversion_and_never_below_the_exact_curve(rho):
    d = gaussian.epsilon_for_rho(rho, DELTA, gaussian.conversion("discrete"))
    exact = gaussian.epsilon_for_rho(rho, DELTA, gaussian.conversion("continuous"))
    assert exact < d  # the exact curve is the tightest for continuous noise, so the proven discrete one is above
    assert d == pytest.approx(_cks_conversion(rho, DELTA), rel=1e-6)  # tolerance: the reference grid's spacing
    assert d <= round_up(_cks_conversion(rho, DELTA) * (1 + 1e-9))  # above it by the float margin at most


def test_subsampled_wor_bound_is_wbk19_theorem_9():
    """WBK19 Thm 9 (generic mechanism, eps(inf) = inf) written out with exact binomials; equal to dp_accounting's
    Stirling branch (the same generic bound) above order 256, and never below its Thm 27 (Gaussian-only)."""
    zr, q = 0.6, 0.05

    def eps(j: int) -> float:
        return j / (2 * zr * zr)

    for a in (2, 3, 7, 20):
        s = 1 + q * q * math.comb(a, 2) * min(4 * (math.exp(eps(2)) - 1), 2 * math.exp(eps(2)))
        s += sum(2 * q**j * math.comb(a, j) * math.exp((j - 1) * eps(j)) for j in range(3, a + 1))
        got = subsampled_wor_rdp(lambda o: o / (2 * zr * zr), q, np.array([a]))[0]
        assert got == pytest.approx(math.log(s) / (a - 1), rel=1e-12)
    orders = np.arange(2, 257)
    mine = subsampled_wor_rdp(lambda o: o / (2 * zr * zr), q, orders)
    assert np.all(mine >= dpa_rdp._compute_rdp_sample_wor_gaussian(q, zr, orders) * (1 - 1e-12))
    big = np.array([300, 1000])
    np.testing.assert_allclose(
        subsampled_wor_rdp(lambda o: o / (2 * 40.0**2), 0.01, big),
        dpa_rdp._compute_rdp_sample_wor_gaussian(0.01, 40.0, big),
        rtol=1e-12,
    )
    with pytest.raises(ValueError, match="integer orders"):
        subsampled_wor_rdp(lambda o: o, q, np.array([1.5]))


def test_fixed_cohort_discrete_figure_is_wbk19_theorem_9_composed():
    """The discrete fixed-cohort figure: T rounds of Thm 9's RDP (orders 2..512, as rdp.optimal_epsilon starts),
    CKS20 Prop 12 conversion; above dp_accounting's Thm 27 figure where the generic bound is looser (large z, q)."""
    z, n, k, t = 4.0, 100, 50, 20
    orders = np.arange(2, 513)
    base = orders / (2 * (z / 2) ** 2)  # capped by the unsampled mechanism's RDP (joint quasi-convexity)
    rdp = t * np.minimum(subsampled_wor_rdp(lambda o: o / (2 * (z / 2) ** 2), k / n, orders), base)
    pairs = zip(orders, rdp, strict=True)
    ref = min(r + math.log1p(-1 / a) - (math.log(DELTA) + math.log(a)) / (a - 1) for a, r in pairs)
    # the reference raised by the float margin (rdp.round_up), never below it (issue 43 item 7)
    assert ref <= wor_epsilon(z, n, k, t, DELTA, "discrete") == pytest.approx(round_up(ref), rel=1e-12)
    assert wor_epsilon(z, n, k, t, DELTA, "discrete") > wor_epsilon(z, n, k, t, DELTA, "continuous") * (1 + 1e-3)
    # small z, q (DP-SGD's usual regime): the two bounds coincide
    assert wor_epsilon(1.0, 1000, 10, 100, DELTA, "discrete") == pytest.approx(
        wor_epsilon(1.0, 1000, 10, 100, DELTA, "continuous"), rel=1e-9
    )


# ------------------------------------------------------------------------------------------------- the ledger
def test_ledger_charges_the_rdp_conversion_for_discrete_noise_and_refuses_poisson():
    tree = TreeAggregation(2.0, 64, 2, 3)
    rho = math.sqrt(la.tree_zeta(tree)) / 2.0
    rdp, exact = (gaussian.epsilon_for_rho(math.sqrt(3) * rho, DELTA, m) for m in ("rdp", "exact"))
    assert la.account([(tree, 3)], DELTA, noise="discrete").eps == pytest.approx(rdp, rel=1e-12)
    assert la.account([(tree, 3)], DELTA).eps == pytest.approx(exact, rel=1e-12)
    g = GaussianEvent(5.0, 2.0, "local")
    rdp = gaussian.epsilon_for_rho(math.sqrt(10) * 0.4, DELTA)
    assert la.account([(g, 10)], DELTA, noise="discrete").eps == pytest.approx(rdp, rel=1e-12)
    with pytest.raises(ValueError, match="Poisson"):
        la.account([GaussianEvent(1.0, 1.0, "central", "poisson", 0.1)], DELTA, noise="discrete")
    with pytest.raises(ValueError, match="noise"):
        la.account([g], DELTA, noise="gaussian")
    # the planner's inverse queries use the same figure
    best, res = la.min_noise(TreeAggregation(1.0, 64), 1, 1.0, DELTA, noise="discrete")
    assert (
        res.eps <= 1.0 < la.account([TreeAggregation(best.noise_multiplier * 0.999, 64)], DELTA, noise="discrete").eps
    )
    assert la.max_tree_steps(5.0, 1.0, 1e-6, noise="discrete") <= la.max_tree_steps(5.0, 1.0, 1e-6)


# ----------------------------------------------------------------------------------- planner, ledger, node
def _gaussian_request(options: dict) -> PlanRequest:
    own = GaussianSettings(noise=options.pop("noise", None))
    return PlanRequest(
        "subsampled", 2.0, DELTA, 20, 10, 10, 8, 1.0, "sealed", admitted=100, rounds_requested=20, settings=own,
        options=options,
    )  # fmt: skip


def _gaussian_spec(params: dict) -> pb.RoundSpec:
    fields = GaussianRound().spec_fields({}, params, SimpleNamespace(params=params), sealing.generate_keypair()[1])
    spec = pb.RoundSpec(run_id="r", round=0, schedule=pb.SUBSAMPLED, task="logreg", num_classes=2, **fields)
    spec.population = int(params["n"])
    return spec


def test_dp_sgd_plan_ledger_and_node_use_the_discrete_figure():
    """privacy.noise = "discrete" with a fixed cohort (DP-SGD's default is continuous: WBK19 Thm 9's floor). Old
    code: discrete noise was charged WBK19 Thm 27 and, on the node's unamplified track, the exact curve."""
    proto = GaussianRound()
    assert proto.plan(_gaussian_request({})).params["noise"] == "continuous"
    plan = proto.plan(_gaussian_request({"noise": "discrete"}))
    p = plan.params
    assert p["noise"] == "discrete"
    z = p["noise_multiplier"]
    spent = wor_epsilon(z, 100, 10, 20, DELTA, "discrete")  # the ledger's figure for the default noise
    assert spent <= 2.0 < wor_epsilon(z * 0.999, 100, 10, 20, DELTA, "discrete")
    events = [PrivacyEvent(proto.name, p, 10, "subsampled", "central") for _ in range(20)]
    assert proto.compose(events, SimpleNamespace(delta=DELTA))[0] == spent
    spec = _gaussian_spec(p)
    assert dict(spec.randomizer.extra)[discrete_gaussian.SPEC_KEY] == 1.0
    assert spec.per_user_cost.eps == proto.verify_epsilon(spec) == wor_epsilon(z, 100, 10, 1, DELTA, "discrete")
    cost = proto.user_account(spec).cost
    # one join, one eligible round: min(amplified, unamplified), the unamplified one by CKS20 Thm 14's zCDP
    unamplified = gaussian.epsilon_for_rho(2.0 / z, DELTA, "rdp")
    assert unamplified_epsilon(z, 1, DELTA, False, "discrete") == unamplified
    assert cost((("eligible", 1), ("joined", 1)))[0] == min(wor_epsilon(z, 100, 10, 1, DELTA, "discrete"), unamplified)
    assert cost((("eligible", 40), ("joined", 40)))[0] == min(
        wor_epsilon(z, 100, 10, 40, DELTA, "discrete"), unamplified_epsilon(z, 40, DELTA, False, "discrete")
    )
    assert unamplified_epsilon(z, 40, DELTA, False, "discrete") > unamplified_epsilon(z, 40, DELTA, False, "continuous")
    # a spec without the key (an analyzer that omits it) is charged the discrete figure, never the continuous one
    del spec.randomizer.extra[discrete_gaussian.SPEC_KEY]
    assert proto.verify_epsilon(spec) == wor_epsilon(z, 100, 10, 1, DELTA, "discrete")

    # continuous noise: today's figures (the exact curve on the unamplified track), less noise for the budget
    cp = proto.plan(_gaussian_request({})).params
    assert cp["noise"] == "continuous" and cp["noise_multiplier"] <= z
    cspec = _gaussian_spec(cp)
    assert dict(cspec.randomizer.extra)[discrete_gaussian.SPEC_KEY] == 0.0
    ccost = proto.user_account(cspec).cost((("eligible", 40), ("joined", 40)))[0]
    zc = cp["noise_multiplier"]
    assert ccost == min(
        wor_epsilon(zc, 100, 10, 40, DELTA, "continuous"), unamplified_epsilon(zc, 40, DELTA, False, "continuous")
    )


def test_poisson_dp_sgd_keeps_continuous_noise_and_refuses_discrete():
    proto = GaussianRound()
    p = proto.plan(_gaussian_request({"sampling": "poisson"})).params
    assert p["noise"] == "continuous"
    noisy, _, _ = proto.add_noise(np.zeros(8), 0, {}, p, None, make_rng(1), 10)
    assert not np.all(noisy / discrete_gaussian.granularity(p, p["noise_multiplier"], 1.0, 8) % 1.0 == 0.0)
    with pytest.raises(ValueError, match="no proven accountant"):
        proto.plan(_gaussian_request({"sampling": "poisson", "noise": "discrete"}))
    spec = pb.RoundSpec(run_id="r", round=0, sampling_rate=0.1)
    spec.randomizer.extra.update({"noise_multiplier": 1.0, "n": 100.0, "k": 10.0, "delta": DELTA, "q": 0.1})
    with pytest.raises(ValueError, match="discrete noise"):
        proto.verify_epsilon(spec)  # no key: discrete, which a Poisson round cannot be charged for


def test_dp_ftrl_plan_ledger_and_node_use_the_discrete_figure():
    """Old code: a tree was charged (and planned, verified, and accounted per user) by the exact curve."""
    proto = TreeRound()
    req = PlanRequest(
        "subsampled", 1.0, DELTA, 16, 4, 4, 8, 1.0, "sealed", admitted=64, rounds_requested=16,
        settings=TreeSettings(max_participations=2, min_separation=1),
    )  # fmt: skip
    p = proto.plan(req).params
    assert p["noise"] == "discrete"
    z = p["noise_multiplier"]
    full = TreeAggregation(z, 16, 2, 1)
    assert la.account([full], DELTA, noise="discrete").eps <= 1.0  # the least z that fits under the discrete figure
    assert la.account([TreeAggregation(z * 0.999, 16, 2, 1)], DELTA, noise="discrete").eps > 1.0
    events = [PrivacyEvent(proto.name, {**p, "round": r}, 4, "subsampled", "central") for r in range(16)]
    charged = proto.compose(events, SimpleNamespace(delta=DELTA))[0]
    assert charged == la.account([full], DELTA, noise="discrete").eps <= 1.0
    assert charged > la.account([full], DELTA).eps  # the exact (continuous) figure is below
    fields = proto.spec_fields({}, p, SimpleNamespace(params={**p, "round": 0}), sealing.generate_keypair()[1])
    spec = pb.RoundSpec(run_id="t", round=0, **fields)
    assert spec.per_user_cost.eps == proto.verify_epsilon(spec) == la.account([full], DELTA, noise="discrete").eps / 2
    cost = proto.user_account(spec).cost
    assert cost((("0:0", 1), ("0:5", 1)))[0] == _trees_epsilon(z, 16, 1, False, DELTA, (2,)) == charged
    assert _trees_epsilon(z, 16, 1, False, DELTA, (2,), "continuous") < charged
    cp = proto.plan(replace(req, settings=replace(req.settings, noise="continuous"))).params
    assert cp["noise"] == "continuous" and cp["noise_multiplier"] < z


def test_tree_noise_kind_decides_the_grid():
    proto = TreeRound()
    base = {"d": 4, "clip": 1.0, "k": 2, "rounds_per_tree": 4, "completion": False, "efficient": False}
    base["noise_multiplier"] = 2.0
    for noise, on_grid in (("discrete", True), ("continuous", False)):
        params = {**base, "noise": noise}
        state = proto.noise_state({"params": params})
        out, _, _ = proto.add_noise(np.full(4, 0.1), 0, {}, params, state, make_rng(5), 2)
        g = proto._grid(params)
        assert bool(np.all(out / g == np.rint(out / g))) is on_grid


# -------------------------------------------------------------------------------------------------- config
def test_privacy_noise_key():
    base = '[privacy]\nprotocol = "gaussian"\n[transport]\nmode = "sealed"\n[schedule]\nkind = "subsampled"\n'
    base += "cohort_size = 10\nrounds = 5\n"
    table = "[privacy.gaussian]\n"
    assert parse_config(base).privacy.settings.noise is None
    got = parse_config(base.replace("[transport]", table + 'noise = "continuous"\n[transport]'))
    assert got.privacy.settings.noise == "continuous"
    with pytest.raises(ConfigError, match="privacy.gaussian.noise"):
        parse_config(base.replace("[transport]", table + 'noise = "float"\n[transport]'))
    with pytest.raises(ConfigError, match="poisson"):
        parse_config(base.replace("[transport]", table + 'noise = "discrete"\n[transport]') + 'sampling = "poisson"\n')
    with pytest.raises(ConfigError, match="privacy.noise belongs to the table of another protocol"):
        parse_config('[privacy]\nprotocol = "pvec"\nnoise = "discrete"\n')
