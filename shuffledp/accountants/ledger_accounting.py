"""Accountant dispatch: a history of privacy events (shuffledp.accountants.events) -> (eps, delta), and back.

``account(events, delta, accountant)`` answers "what does this cost"; ``max_rounds`` and ``min_noise`` answer
"how many rounds / how much noise fits a budget". Two accountants (design section 6):

- ``"paper"``: each paper's own bound, to reproduce its numbers;
- ``"tight"``: the tightest rigorous bound available here.

The arithmetic lives in the per-seed modules; this module only routes events to them and composes families:

Routing (tight / paper):
- PvecRound, sequential: parallel composition (max over rounds; disjoint cohorts, spec 000 sec 5) of
  the exact binomial round of calibrated_pvec / of the Lemma 3.1 + 3.3 round (Thm 3.2).
- PvecRound, fully interactive: the tighter of RDP composition of exact rounds (calibrated_pvec) and their PLD /
  GDP composition (pvec_pld.composed_epsilon, issue 16) /
  advanced composition (Dwork-Roth Thm 3.20, spec 000 sec 5).
- LdpShuffleRound: Thm 1 RDP of seed 001 plus monotone envelope and pure-DP cap (spec 001 sec 7.3), optimal
  RDP -> DP conversion / FMT20 numeric shuffle + subsampling + KOV15 (the paper's baseline, spec 001 sec 5).
- GaussianRound, TreeAggregation: exact Gaussian (GDP) curve, or PLD when Poisson sampled (dp_accounting) /
  Lemma 2.5 of seed 002, or RDP over the paper's orders 1.1..199.9 when trees are involved (seed 003). With
  ``noise="discrete"`` (the discrete Gaussian of the central protocols, issue 24 D19) the tight figure is the RDP
  conversion of the same rho instead (gaussian.conversion: the exact curve is proven for continuous noise only),
  and Poisson sampling is refused (no subsampled bound here is proven for it).
- PnsgdRun: Thm 2 of seed 004; several epochs: min(basic, advanced composition) / basic composition.

Events of different families are composed by basic composition (Dwork-Roth Thm 3.16) with delta split evenly.
Events under different trust models are refused (a guarantee against one party does not add to one against
another). Every reported eps is an upper bound rounded up; delta is the one requested.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from shuffledp.accountants.events import (
    GaussianRound,
    LdpShuffleRound,
    PnsgdRun,
    PrivacyEvent,
    PvecRound,
    TreeAggregation,
    trust_of,
)
from shuffledp.accountants.rdp import check_delta, minimise_over_orders, optimal_epsilon, round_up
from shuffledp.lazy import OnFirstUse
from shuffledp.mechanisms.pvec import PvecParams

__all__ = [
    "ACCOUNTANTS",
    "LDP_SHUFFLE_BOUNDS",
    "AccountResult",
    "account",
    "max_rounds",
    "min_noise",
    "pvec_min_noise",
    "pvec_report",
    "calibrate_pvec_round",
    "max_tree_steps",
    "tree_zeta",
]


# imported at first use: a PVEC ledger needs none of these but pvec_pld (dp_accounting, scipy's optimizers: ~0.6 s
# of CPU that an analyzer used to spend in its first round)
dp_event = OnFirstUse("dp_accounting.dp_event")
dpa_pld = OnFirstUse("dp_accounting.pld.pld_privacy_accountant")
dpa_pld_dist = OnFirstUse("dp_accounting.pld.privacy_loss_distribution")
dpa_rdp = OnFirstUse("dp_accounting.rdp.rdp_privacy_accountant")
composition = OnFirstUse("shuffledp.accountants.composition")
fmt_shuffle = OnFirstUse("shuffledp.accountants.fmt_shuffle")
gaussian = OnFirstUse("shuffledp.accountants.gaussian")
pnsgd = OnFirstUse("shuffledp.accountants.pnsgd")
subsampled_shuffle = OnFirstUse("shuffledp.accountants.subsampled_shuffle")
tree_aggregation = OnFirstUse("shuffledp.accountants.tree_aggregation")
pvec_pld = OnFirstUse("shuffledp.accountants.pvec_pld")

Accountant = Literal["tight", "paper"]
ACCOUNTANTS = ("tight", "paper")
# seed 001 bounds: Thm 1 as printed, Thm 1 + envelope/cap, Thm 2 (NOT a guarantee), FMT baseline, FMT PLD
LDP_SHUFFLE_BOUNDS = ("upper", "upper-tightened", "lower", "baseline", "tight-pld")
_PLD_INTERVAL = 1e-4  # dp_accounting's default discretisation for the sampled Gaussian PLD (pessimistic)
_MAX_SEARCH = 10**12  # largest number of rounds the inverse search explores
_MIN_ORDER = 1.01  # lowest Renyi order a grid is extended down to (dp_accounting's conversion stops at 1.01 too)


@dataclass(frozen=True)
class AccountResult:
    """(eps, delta) of a history, the accountant that produced it and the optimal Renyi order (RDP) or None."""

    eps: float
    delta: float
    accountant_name: str
    optimal_order: float | None
    trust: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: eps, delta, accountant, optimal_order, trust, then the details."""
        out: dict[str, Any] = {
            "eps": self.eps,
            "delta": self.delta,
            "accountant": self.accountant_name,
            "optimal_order": self.optimal_order,
            "trust": self.trust,
        }
        out.update(self.details)
        return out


# ----------------------------------------------------------------------------------------------- helpers
def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    return accountant


def _check_eps(eps: float, name: str = "eps") -> float:
    e = float(eps)
    if not (math.isfinite(e) and e > 0.0):
        raise ValueError(f"{name} (the budget) must be a finite number > 0, got {eps!r}")
    return e


def _up(x: float) -> float:
    """One ulp up: a float sum of upper bounds may round down by an ulp; never report less than the bound."""
    return math.nextafter(float(x), math.inf) if 0.0 < x < math.inf else float(x)


def _sum_up(values: Iterable[float]) -> float:
    vals = list(values)
    s = math.fsum(vals)
    return _up(s) if len(vals) > 1 else s


def _family(event: PrivacyEvent) -> str:
    if isinstance(event, PvecRound):
        return "pvec"
    if isinstance(event, LdpShuffleRound):
        return "ldp_shuffle"
    if isinstance(event, GaussianRound | TreeAggregation):
        return "gaussian"
    if isinstance(event, PnsgdRun):
        return "pnsgd"
    raise ValueError(f"unsupported privacy event {type(event).__name__}")


Items = list[tuple[PrivacyEvent, int]]


def _as_items(events: Iterable[PrivacyEvent] | Iterable[tuple[PrivacyEvent, int]]) -> Items:
    """Events (or (event, count) pairs) -> distinct events with multiplicities, in first-seen order."""
    counts: Counter = Counter()
    for item in events:
        ev, c = item if isinstance(item, tuple) else (item, 1)
        if not isinstance(ev, PrivacyEvent):
            raise ValueError(f"expected a privacy event, got {type(ev).__name__}")
        if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 0:
            raise ValueError(f"an event count must be an integer >= 0, got {c!r}")
        counts[ev] += int(c)
    return [(e, c) for e, c in counts.items() if c > 0]


# ------------------------------------------------------------------------------------------------ account
def account(
    events: Iterable[PrivacyEvent] | Iterable[tuple[PrivacyEvent, int]],
    delta: float,
    accountant: Accountant = "tight",
    ldp_bound: str | None = None,
    noise: str = "continuous",
) -> AccountResult:
    """(eps, delta)-DP guarantee of the whole history at the requested ``delta``.

    ``events`` may repeat an event or give (event, count) pairs (10^6 identical rounds need not be listed).
    ``ldp_bound`` overrides the bound used for LdpShuffleRound events (one of LDP_SHUFFLE_BOUNDS). ``noise``: the
    Gaussian noise GaussianRound / TreeAggregation events were released with (gaussian.NOISES; module docstring).
    """
    n = gaussian_noise_kind(noise)
    return _account(_as_items(events), check_delta(delta), _check_accountant(accountant), ldp_bound, n)


def gaussian_noise_kind(noise: str) -> str:
    """gaussian.check_noise without importing dp_accounting for a wrong value."""
    if noise not in ("discrete", "continuous"):
        raise ValueError(f"noise must be 'discrete' or 'continuous', got {noise!r}")
    return noise


def _account(items: Items, d: float, acc: str, ldp_bound: str | None, noise: str = "continuous") -> AccountResult:
    """``account`` on validated input."""
    if not items:
        raise ValueError("events must contain at least one privacy event")
    trust = trust_of([e for e, _ in items])
    families: dict[str, Items] = {}
    for ev, c in items:
        families.setdefault(_family(ev), []).append((ev, c))
    if len(families) == 1:
        ((fam, its),) = families.items()
        return _account_family(fam, its, d, acc, trust, ldp_bound, noise)
    # Different mechanisms on the same users: basic composition with delta split evenly (Dwork-Roth Thm 3.16).
    share = d / len(families)
    parts = {fam: _account_family(fam, its, share, acc, trust, ldp_bound, noise) for fam, its in families.items()}
    eps = _sum_up(r.eps for r in parts.values())
    name = "basic-composition(" + ", ".join(r.accountant_name for r in parts.values()) + ")"
    details = {
        "rounds": sum(r.details.get("rounds", 0) for r in parts.values()),
        "parts": {fam: r.to_dict() for fam, r in parts.items()},
        "guarantee": all(r.details.get("guarantee", True) for r in parts.values()),
    }
    return AccountResult(eps, d, name, None, trust, details)


def _account_family(
    fam: str, items: Items, delta: float, acc: str, trust: str, ldp_bound: str | None, noise: str = "continuous"
) -> AccountResult:
    if fam == "pvec":
        return _account_pvec(items, delta, acc, trust)
    if fam == "ldp_shuffle":
        return _account_ldp_shuffle(items, delta, acc, trust, ldp_bound)
    if fam == "gaussian":
        return _account_gaussian(items, delta, acc, trust, noise)
    return _account_pnsgd(items, delta, acc, trust)


# ------------------------------------------------------------------------------------------- seed 002/003
def tree_zeta(event: TreeAggregation) -> int:
    """zeta (squared sensitivity in units of L^2) of one tree (spec 003 sec 3; tree_aggregation module)."""
    steps, e = event.steps, event.max_participations
    if event.order == "fixed":
        # E epochs of steps/E leaves in the same order; completion pads the tree with virtual leaves
        extra = ((1 << (steps - 1).bit_length()) - steps) if event.completion else 0
        return tree_aggregation.zeta_fixed_order(steps // e, e, extra)
    padded = (1 << (steps - 1).bit_length()) if event.completion else steps
    if e == 1:
        return tree_aggregation.zeta_single_tree(padded)
    # Participations lie in the real leaves only; counting them over the padded tree can only raise the maximum.
    return tree_aggregation.zeta_multi_participation(padded, e, event.min_separation)


def _gaussian_rho_sq(ev: GaussianRound | TreeAggregation) -> float:
    if isinstance(ev, TreeAggregation):
        return tree_zeta(ev) / ev.noise_multiplier**2  # rho^2 = zeta / z^2 (spec 003 sec 3)
    return gaussian.round_rho_sq(ev.sensitivity, ev.sigma)  # (Delta/sigma)^2 (seed 002 Lemma 2.2)


def _account_gaussian(items: Items, delta: float, acc: str, trust: str, noise: str = "continuous") -> AccountResult:
    rounds = sum(c for _, c in items)
    has_tree = any(isinstance(e, TreeAggregation) for e, _ in items)
    sampled = any(isinstance(e, GaussianRound) and e.sampling == "poisson" for e, _ in items)
    if sampled:
        if noise == "discrete":
            raise ValueError(
                "no accountant here is proven for the Poisson-sampled discrete Gaussian (dp_accounting's sampled "
                "Gaussian bounds assume continuous noise): Poisson sampling needs noise = 'continuous'"
            )
        return _account_sampled_gaussian(items, delta, acc, trust, rounds)
    # Unsampled Gaussian mechanisms compose exactly: rho^2 adds (Dong-Roth-Su 2019 Cor. 3.3; Thm 5.1/6.1 of 002);
    # for the discrete Gaussian rho^2 adds in RDP / zCDP (CKS20 Thm 14 per round, Mironov 2017 Prop 1 across).
    rho = math.sqrt(math.fsum(c * _gaussian_rho_sq(e) for e, c in items))
    details: dict[str, Any] = {"rounds": rounds, "rho": rho, "guarantee": True, "noise": noise}
    if acc == "tight":
        if noise == "discrete":
            # CKS20 Thm 14 (zCDP of the discrete Gaussian) + the optimal RDP -> DP conversion (CKS20 Prop 12)
            eps = gaussian.epsilon_for_rho(rho, delta, "rdp")
            name = "gaussian-rdp (discrete Gaussian: CKS20 Thm 14 zCDP, CKS20 Prop 12 conversion)"
            return AccountResult(eps, delta, name, None, trust, details)
        eps = gaussian.epsilon_for_rho(rho, delta, "exact")
        return AccountResult(eps, delta, "gaussian-exact (Balle-Wang 2018, dp_accounting)", None, trust, details)
    if has_tree:
        # seed 003's own conversion: Canonne et al. over alpha in 1.1..199.9 (spec 003 sec 3)
        orders = np.asarray(gaussian.PAPER_ORDERS)
        eps = gaussian.epsilon_for_rho(rho, delta, "rdp", gaussian.PAPER_ORDERS)
        _, order = dpa_rdp.compute_epsilon(orders, orders * rho * rho / 2.0, delta)
        return AccountResult(
            eps, delta, "tree-rdp (seed 003 Thm 3.1 / zeta rule, orders 1.1..199.9)", float(order), trust, details
        )
    eps = gaussian.epsilon_for_rho(rho, delta, "paper")
    # Lemma 2.5 of seed 002 is the RDP bound at alpha* = 1 + sqrt(2 ln(1/delta))/rho (spec 002 sec 4)
    order = 1.0 + math.sqrt(2.0 * math.log(1.0 / delta)) / rho if rho > 0 else None
    return AccountResult(eps, delta, "gaussian-zcdp (seed 002 Lemma 2.5)", order, trust, details)


def _dp_event(ev: GaussianRound | TreeAggregation) -> dp_event.DpEvent:
    if isinstance(ev, TreeAggregation):
        # A tree is a Gaussian mechanism of noise multiplier z / sqrt(zeta) (spec 003 sec 3)
        return dp_event.GaussianDpEvent(ev.noise_multiplier / math.sqrt(tree_zeta(ev)))
    g = dp_event.GaussianDpEvent(ev.noise_multiplier)
    return dp_event.PoissonSampledDpEvent(ev.sampling_rate, g) if ev.sampling == "poisson" else g


@lru_cache(maxsize=64)
def _sampled_gaussian_pld(noise_multiplier: float, q: float) -> dpa_pld_dist.PrivacyLossDistribution:
    """One round's PLD of the Poisson-sampled Gaussian, add-or-remove-one, pessimistic discretisation: what
    dp_accounting's PLDAccountant builds for PoissonSampledDpEvent(q, GaussianDpEvent(z))."""
    return dpa_pld_dist.from_gaussian_mechanism(
        noise_multiplier,
        sensitivity=1.0,
        pessimistic_estimate=True,
        value_discretization_interval=_PLD_INTERVAL,
        sampling_prob=q,
    )


def _account_sampled_gaussian(items: Items, delta: float, acc: str, trust: str, rounds: int) -> AccountResult:
    """Poisson-sampled Gaussian (add/remove-one neighbours, as dp_accounting defines it): RDP or PLD."""
    ev = dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(_dp_event(e), c) for e, c in items])

    def best_on(orders: np.ndarray) -> tuple[float, float]:
        rdp_acc = dpa_rdp.RdpAccountant(orders=[float(a) for a in orders])
        rdp_acc.compose(ev)
        return rdp_acc.get_epsilon_and_optimal_order(delta)

    # dp_accounting's default orders (1.1..1024), extended while the optimum sits at an edge (spec 001 sec 8);
    # integer orders above (dp_accounting's series for fractional orders fails to converge at orders ~2000)
    eps_rdp, order = minimise_over_orders(best_on, dpa_rdp.DEFAULT_RDP_ORDERS, min_order=_MIN_ORDER, integer=True)
    details: dict[str, Any] = {"rounds": rounds, "neighbouring": "add_or_remove_one", "guarantee": True}
    eps_rdp = round_up(eps_rdp)  # dp_accounting's float figures, raised by the float margin
    if acc == "paper":
        return AccountResult(eps_rdp, delta, "sampled-gaussian-rdp (dp_accounting)", float(order), trust, details)
    if len(items) == 1:
        # one mechanism repeated (a run's rounds): its PLD built once, then self-composed (the build is ~90% of
        # the time, and a run's ledger asks again every round)
        ((e, c),) = items
        eps_pld = float(
            _sampled_gaussian_pld(e.noise_multiplier, e.sampling_rate).self_compose(c).get_epsilon_for_delta(delta)
        )
    else:
        pld_acc = dpa_pld.PLDAccountant(value_discretization_interval=_PLD_INTERVAL)
        pld_acc.compose(ev)
        eps_pld = float(pld_acc.get_epsilon(delta))
    eps_pld = round_up(eps_pld)
    details["eps_rdp"] = eps_rdp
    if eps_pld <= eps_rdp:  # both are valid upper bounds (PLD pessimistic); report the smaller
        return AccountResult(eps_pld, delta, "sampled-gaussian-pld (dp_accounting, pessimistic)", None, trust, details)
    return AccountResult(eps_rdp, delta, "sampled-gaussian-rdp (dp_accounting)", float(order), trust, details)


# ------------------------------------------------------------------------------------------------ seed 001
def _ldp_curve(ev: LdpShuffleRound, bound: str) -> Callable[[np.ndarray], np.ndarray]:
    b = "lower" if bound == "lower" else "upper"
    tighten = bound == "upper-tightened"
    return lambda orders: subsampled_shuffle.subsampled_shuffle_rdp(ev.eps0, ev.n, ev.k, orders, b, tighten=tighten)


_LDP_NAMES = {
    "upper": "subsampled-shuffle-rdp (seed 001 Thm 1, optimal conversion)",
    "upper-tightened": "subsampled-shuffle-rdp (seed 001 Thm 1 + envelope/pure-DP cap, optimal conversion)",
    "lower": "subsampled-shuffle-rdp-lower (seed 001 Thm 2; NOT a guarantee)",
    "baseline": "fmt20-numeric+subsampling+kov15 (seed 001 baseline)",
    "tight-pld": "subsampled-fmt-pld (dp_accounting, pessimistic)",
}


def _account_ldp_shuffle(items: Items, delta: float, acc: str, trust: str, bound: str | None) -> AccountResult:
    if bound is None:
        bound = "upper-tightened" if acc == "tight" else "baseline"
    if bound not in LDP_SHUFFLE_BOUNDS:
        raise ValueError(f"bound must be one of {LDP_SHUFFLE_BOUNDS}, got {bound!r}")
    rounds = sum(c for _, c in items)
    details: dict[str, Any] = {"rounds": rounds, "bound": bound, "guarantee": bound != "lower"}
    order: float | None = None
    if bound in ("upper", "upper-tightened", "lower"):
        if len(items) == 1:
            ((ev, c),) = items
            b = "lower" if bound == "lower" else "upper"
            eps, order = subsampled_shuffle.subsampled_shuffle_epsilon(
                ev.eps0, ev.n, ev.k, c, delta, bound=b, tighten=bound == "upper-tightened", return_order=True
            )
        else:
            # heterogeneous rounds: RDP curves add (Mironov 2017 Prop. 1), then the optimal conversion
            curves = [(_ldp_curve(e, bound), c) for e, c in items]
            eps, order = optimal_epsilon(lambda o: sum(c * np.asarray(f(o)) for f, c in curves), 1, delta)
    elif bound == "baseline":
        if len(items) != 1:
            raise ValueError("the FMT20 baseline (KOV15 composition) accounts identical rounds only; use --bound upper")
        ((ev, c),) = items
        eps = fmt_shuffle.baseline_epsilon(ev.eps0, ev.n, ev.k, c, delta)
    else:
        if len(items) == 1:
            ((ev, c),) = items
            eps = fmt_shuffle.tight_pld_epsilon(ev.eps0, ev.n, ev.k, c, delta)
        else:
            pld = None
            for ev, c in items:
                one = fmt_shuffle.subsampled_fmt_pld(ev.eps0, ev.n, ev.k)
                one = one.self_compose(c) if c > 1 else one
                pld = one if pld is None else pld.compose(one)
            eps = round_up(max(0.0, float(pld.get_epsilon_for_delta(delta))))  # type: ignore[union-attr]
    return AccountResult(float(eps), delta, _LDP_NAMES[bound], None if order is None else float(order), trust, details)


# ------------------------------------------------------------------------------------------------ seed 004
def _pnsgd_eps(ev: PnsgdRun, delta: float) -> float:
    """Smallest eps with delta_shuf(eps) <= delta for one epoch (seed 004 Thm 2), rounded up."""
    return pnsgd.epsilon_shuffled(ev.noise, delta, ev.n, ev.lipschitz, ev.scale, ev.eta, ev.diameter, ev.contraction)


def _advanced(eps_counts: Sequence[tuple[float, int]], slack: float) -> float:
    """Advanced composition, heterogeneous form (Dwork-Roth Thm 3.20; Kairouz-Oh-Viswanath 2015): rounds that are
    (eps_i, delta_i)-DP compose to eps = sqrt(2 ln(1/delta') sum eps_i^2) + sum eps_i (e^{eps_i} - 1),
    delta = sum delta_i + delta'. ``eps_counts`` lists (eps_i, multiplicity)."""
    sq = math.fsum(c * e * e for e, c in eps_counts)
    lin = math.fsum(c * e * math.expm1(e) for e, c in eps_counts)
    return round_up(math.sqrt(2.0 * math.log(1.0 / slack) * sq) + lin)


def _account_pnsgd(items: Items, delta: float, acc: str, trust: str) -> AccountResult:
    epochs = sum(c for _, c in items)
    details: dict[str, Any] = {"rounds": epochs, "guarantee": True}
    if epochs == 1:
        ((ev, _),) = items
        return AccountResult(_pnsgd_eps(ev, delta), delta, "pnsgd-shuffled (seed 004 Thm 2)", None, trust, details)
    # Several epochs, each (eps_i, delta_i)-DP (spec 004 sec 3.6 [ext]). Basic: delta split evenly over epochs.
    basic = _sum_up(c * _pnsgd_eps(ev, delta / epochs) for ev, c in items)
    basic = _up(basic) if len(items) == 1 else basic  # c * eps may round down
    if acc == "paper":
        return AccountResult(
            basic, delta, "pnsgd-shuffled + basic composition (seed 004 Thm 2, Remark 3)", None, trust, details
        )
    best, name = basic, "pnsgd-shuffled + basic composition"
    for frac in (0.1, 0.25, 0.5, 0.75, 0.9):  # share of delta for delta'; every split is valid, keep the best
        per = (1.0 - frac) * delta / epochs
        adv = _advanced([(_pnsgd_eps(ev, per), c) for ev, c in items], frac * delta)
        if adv < best:
            best, name = adv, f"pnsgd-shuffled + advanced composition (delta' = {frac:g} delta)"
    return AccountResult(best, delta, name + " (seed 004 Thm 2, Remark 3)", None, trust, details)


# ------------------------------------------------------------------------------------------------ seed 000
def calibrate_pvec_round(eps: float, delta: float, n: int, d: int, delta2: float, rounds: int = 1) -> PvecParams:
    """pvec_pld.calibrate_pvec_pld: least binomial noise meeting (eps, delta) over ``rounds`` rounds (PLD-certified
    where a PLD route exists, else calibrated_pvec's RDP; issue 16 item 2)."""
    return pvec_pld.calibrate_pvec_pld(eps, delta, n, d, delta2, rounds=rounds)


def _paper_round(ev: PvecRound) -> tuple[float, float]:
    """(eps_r, delta_r) of one round by the paper's bounds (Lemma A.1 per coordinate, Lemma 3.3 across).

    The Lemma chain is evaluated for the contributors actually aggregated (accountants.pvec.pvec_paper_round,
    noise Bin(m n', p)). For parameters derived by the paper (method "paper") the round is reported at no less
    than Thm 3.2's claim (target_eps, target_delta), which is what the paper states and what reproduces its
    numbers (spec 000 sec 5: PGD eps=1, T=15, delta=1e-6 gives 0.557); the max of two valid bounds is valid
    and keeps the cost non-increasing in n'.
    """
    from shuffledp.accountants import pvec as paper_pvec

    bound = paper_pvec.pvec_paper_round(ev.params, ev.contributors)
    if ev.method == "paper":
        return max(bound.eps, ev.target_eps), max(bound.delta, ev.target_delta)
    return bound.eps, bound.delta


def _split_pvec(items: Items) -> tuple[Items, list[PvecRound | None]]:
    """Fully interactive rounds (every user in each) and the candidate sequential round a user may add."""
    fi = [(e, c) for e, c in items if e.schedule == "fully_interactive"]  # type: ignore[attr-defined]
    seq = [e for e, _ in items if e.schedule == "sequential"]  # type: ignore[attr-defined]
    # Disjoint cohorts: each user is in at most one sequential round, so the worst user sees every fully
    # interactive round plus one sequential round (adaptive parallel composition, spec 000 sec 5).
    return fi, (seq if seq else [None])  # type: ignore[return-value]


def _pvec_composed(hist: Items, delta: float) -> tuple[float, float | None]:
    """(eps, optimal order) of adaptively composed PVEC rounds: the smaller of calibrated_pvec's exact-binomial RDP
    (RDP adds, Mironov 2017 Prop. 1; CKS20 conversion over an extended grid) and pvec_pld's PLD / GDP bound
    (pvec_pld.composed_epsilon; order None when the PLD bound is the smaller)."""
    eps, order = pvec_pld.composed_epsilon([(e.params, e.contributors, c) for e, c in hist], delta, True)
    return eps, (float(order) if math.isfinite(eps) and order is not None else None)


def _account_pvec(items: Items, delta: float, acc: str, trust: str) -> AccountResult:
    fi, seq = _split_pvec(items)
    rounds = sum(c for _, c in items)
    n_seq = sum(c for e, c in items if e.schedule == "sequential")  # type: ignore[attr-defined]
    details: dict[str, Any] = {"rounds": rounds, "guarantee": True}
    worst_eps, worst_order = -1.0, None
    if acc == "tight":
        for s in seq:
            hist = fi + ([(s, 1)] if s is not None else [])
            eps, order = _pvec_composed(hist, delta)
            if eps > worst_eps:
                worst_eps, worst_order = eps, order
        if not math.isfinite(worst_eps):  # no finite guarantee at this delta: report inf (the safe side)
            details["note"] = f"delta={delta} is below the rounds' binomial tail slack: no finite eps"
            name = "pvec-exact-binomial (calibrated_pvec, pvec_pld)"
            return AccountResult(math.inf, delta, name, None, trust, details)
        route = "rdp" if worst_order is not None else "pld"
        name = f"pvec-exact-binomial-{route} (pvec_pld: PLD where one route covers every round; beyond the paper)"
        name += " + parallel composition" if n_seq > 1 else ""
        return AccountResult(worst_eps, delta, name, worst_order, trust, details)
    for s in seq:
        hist = fi + ([(s, 1)] if s is not None else [])
        costs = [(_paper_round(e), c) for e, c in hist]
        spent_delta = math.fsum(c * dl for (_, dl), c in costs)
        if sum(c for _, c in hist) == 1:
            (eps, dl), _ = costs[0]
            if dl > delta:  # the round's own delta_r exceeds the request: no guarantee at this delta
                eps = math.inf
                details["note"] = f"delta={delta} is below the round's delta_r={dl:.6g} (Thm 3.2 of paper 000)"
        else:
            slack = delta - spent_delta  # delta' of advanced composition (spec 000 sec 5)
            if slack > 0.0 and len(costs) == 1:
                (e_r, d_r), c = costs[0]
                eps = composition.advanced_composition(e_r, d_r, c, slack)[0]  # Dwork-Roth Thm 3.20
            elif slack > 0.0:
                eps = _advanced([(e, c) for (e, _), c in costs], slack)  # heterogeneous form of Thm 3.20
            else:
                eps = math.inf
                details["note"] = f"delta={delta} leaves no slack: the rounds alone spend delta={spent_delta:.6g}"
        worst_eps = max(worst_eps, eps)
    name = "pvec-lemma-3.1+3.3 (paper 000 Thm 3.2)"
    if fi and sum(c for _, c in fi) + (seq[0] is not None) > 1:
        name += " + advanced composition (Dwork-Roth 3.20)"
    if n_seq > 1:
        name += " + parallel composition"
    return AccountResult(worst_eps, delta, name, None, trust, details)


def pvec_report(ev: PvecRound) -> dict[str, Any]:
    """Parameters and noise of one PVEC round for reports: g, m, p, method, variance bound per coordinate."""
    from shuffledp.mechanisms.pvec import pvec_variance_bound

    params = ev.params
    return {
        "method": ev.method,
        "g": ev.g,
        "m": ev.m,
        "p": ev.p,
        "contributors": ev.contributors,
        "messages_per_user": params.messages_per_user,
        # scale^2 n' (1/4 + m p (1-p)): privacy noise + worst-case rounding, in data units (mechanisms.pvec)
        "variance_per_coordinate": pvec_variance_bound(params, ev.contributors),
    }


# ------------------------------------------------------------------------------------------------ inverses
def _parallel_only(event: PrivacyEvent) -> bool:
    return isinstance(event, PvecRound) and event.schedule == "sequential"


def max_rounds(
    event: PrivacyEvent,
    eps: float,
    delta: float,
    accountant: Accountant = "tight",
    spent: Sequence[PrivacyEvent] | Sequence[tuple[PrivacyEvent, int]] = (),
    ldp_bound: str | None = None,
    t_max: int = _MAX_SEARCH,
    noise: str = "continuous",
) -> int | float:
    """Largest T such that ``spent`` plus T copies of ``event`` cost at most (eps, delta); 0 if none fits.

    math.inf when the rounds compose in parallel (sequential PVEC: disjoint cohorts) and one round fits: then
    the number of rounds is limited by the number of fresh users, not by privacy. Exponential then binary search;
    every accountant here is non-decreasing in T, so cost(T) <= eps < cost(T + 1) for the returned T.
    """
    e = _check_eps(eps)
    d = check_delta(delta)
    acc = _check_accountant(accountant)
    n = gaussian_noise_kind(noise)
    prior = _as_items(spent)

    def fits(t: int) -> bool:
        return _account(_as_items(prior + [(event, t)]), d, acc, ldp_bound, n).eps <= e

    if _parallel_only(event):
        return math.inf if fits(1) else 0
    t = composition.max_rounds(fits, t_max)
    if t >= t_max:
        raise ValueError(f"{t_max} rounds fit eps={e}, delta={d}: the budget does not bind")
    return t


_NOISE_FIELD: dict[type, str] = {
    GaussianRound: "sigma",
    TreeAggregation: "noise_multiplier",
    PnsgdRun: "scale",
    LdpShuffleRound: "eps0",  # "less noise" = larger eps0: min_noise returns the LARGEST eps0 that fits
}
_EPS0_CAP = 50.0


def min_noise(
    event: PrivacyEvent,
    rounds: int,
    eps: float,
    delta: float,
    accountant: Accountant = "tight",
    spent: Sequence[PrivacyEvent] | Sequence[tuple[PrivacyEvent, int]] = (),
    ldp_bound: str | None = None,
    rel_tol: float = 1e-9,
    noise: str = "continuous",
) -> tuple[PrivacyEvent, AccountResult]:
    """The event with the least noise for which ``spent`` plus ``rounds`` copies fit (eps, delta), and its cost.

    Noise parameter: sigma (GaussianRound), noise_multiplier (TreeAggregation), scale (PnsgdRun), eps0
    (LdpShuffleRound: the largest eps0). PvecRound: see ``pvec_min_noise`` (parameters are re-derived).
    Bisection in log space; the returned value is the end of the bracket that was checked to fit, so it is never
    on the unsafe side (within ``rel_tol`` of the optimum).
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int | np.integer) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    e = _check_eps(eps)
    d = check_delta(delta)
    acc = _check_accountant(accountant)
    n = gaussian_noise_kind(noise)
    if isinstance(event, PvecRound):
        if spent:
            raise ValueError("min_noise for PVEC re-derives the parameters and takes no spent history")
        ev = pvec_min_noise(e, d, event.n, event.d, event.delta2, int(rounds), event.schedule, acc)
        return ev, account([(ev, int(rounds))], d, acc)
    name = _NOISE_FIELD.get(type(event))
    if name is None:
        raise ValueError(f"unsupported privacy event {type(event).__name__}")
    prior = _as_items(spent)

    def with_value(x: float) -> PrivacyEvent:
        return dataclasses.replace(event, **{name: x})

    def fits(x: float) -> bool:
        return _account(_as_items(prior + [(with_value(x), int(rounds))]), d, acc, ldp_bound, n).eps <= e

    x0 = float(getattr(event, name))
    if name == "eps0":  # fits for small eps0; find the largest
        good, bad = x0, x0
        while not fits(good):
            good /= 4.0
            if good < 1e-12:
                raise ValueError(f"no eps0 >= 1e-12 fits eps={e}, delta={d} over {rounds} rounds")
        if fits(_EPS0_CAP):
            good = bad = _EPS0_CAP
        else:
            bad = max(bad, good)
            while fits(bad):
                bad = min(bad * 4.0, _EPS0_CAP)
    else:  # fits for large noise; find the smallest
        good, bad = x0, x0
        while not fits(good):
            good *= 4.0
            if good > 1e15:
                raise ValueError(f"no {name} <= 1e15 fits eps={e}, delta={d} over {rounds} rounds")
        while fits(bad):
            bad /= 4.0
            if bad < 1e-12:
                raise ValueError(f"every {name} >= 1e-12 fits eps={e}, delta={d}: the budget does not bind")
    best = with_value(composition.bisect_boundary(fits, good, bad, rel_tol=rel_tol, geometric=True))
    return best, account(prior + [(best, int(rounds))], d, acc, ldp_bound, n)


def pvec_min_noise(
    eps: float,
    delta: float,
    n: int,
    d: int,
    delta2: float,
    rounds: int = 1,
    schedule: str = "sequential",
    accountant: Accountant = "tight",
) -> PvecRound:
    """PVEC parameters with the least noise for ``rounds`` rounds of ``n`` users within (eps, delta), as an event.

    tight: calibrated_pvec.calibrate_pvec (sequential: one round's budget, the rounds compose in parallel;
    fully interactive: the total over ``rounds``). paper: pvec_params with (eps, delta) per round (sequential) or
    PGD's eps_r = eps / (2 sqrt(2 T ln(1/delta))), delta_r = delta/(T+1) (spec 000 sec 4, Alg 5).
    The result is checked with ``account`` before it is returned.
    """
    from shuffledp.mechanisms.pvec import pvec_params

    e = _check_eps(eps)
    dl = check_delta(delta)
    acc = _check_accountant(accountant)
    if schedule not in ("sequential", "fully_interactive"):
        raise ValueError(f"schedule must be 'sequential' or 'fully_interactive', got {schedule!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int | np.integer) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    fi = schedule == "fully_interactive"
    if acc == "tight":
        params = calibrate_pvec_round(e, dl, n, d, delta2, rounds=int(rounds) if fi else 1)
    elif fi:
        eps_r = e / (2.0 * math.sqrt(2.0 * rounds * math.log(1.0 / dl)))
        params = pvec_params(eps_r, dl / (rounds + 1), n, d, delta2)
    else:
        params = pvec_params(e, dl, n, d, delta2)
    ev = PvecRound.from_params(params, None, schedule)
    got = account([(ev, int(rounds))], dl, acc).eps
    if got > e:
        raise ValueError(f"the derived PVEC parameters cost eps={got:.6g} > {e} at delta={dl} (accountant {acc})")
    return ev


def max_tree_steps(
    noise_multiplier: float, eps: float, delta: float, accountant: Accountant = "tight", noise: str = "continuous"
) -> int:
    """Largest T such that one participation in one tree of T leaves fits (eps, delta) (seed 003), with the same
    conversion as ``account``: the tightest proven for the noise (tight) or RDP over the paper's orders (paper)."""
    acc = _check_accountant(accountant)
    if acc == "tight":
        return tree_aggregation.max_steps_single_tree(
            noise_multiplier, eps, delta, gaussian.conversion(gaussian_noise_kind(noise))
        )
    return tree_aggregation.max_steps_single_tree(noise_multiplier, eps, delta, "rdp", gaussian.PAPER_ORDERS)
