"""Gaussian mechanism composed over rounds: the accountant of seed 002 (DP-mu2-FL).

Seed 002 (Reshef & Levy, spec 002 section 4) adds Gaussian noise every round to a message whose sensitivity is
constant in t (2S for the untrusted variant, per machine; 2S/M for the trusted variant, on the average). The
rounds compose adaptively in RDP (Mironov, Lemma A.3 of the paper): T Gaussian releases with noise sigma_t and
sensitivity Delta are (alpha, alpha rho^2 / 2)-RDP for every alpha > 1 with

    rho = Delta * sqrt(sum_t 1 / sigma_t^2)                  (Thm 5.1 untrusted, Thm 6.1 trusted)

i.e. (rho^2/2)-zCDP. The whole privacy state is the single number rho ("mu" of mu-GDP: the composition of
Gaussian mechanisms is exactly a Gaussian mechanism with sensitivity/noise ratio rho, Dong-Roth-Su 2019,
Cor. 3.3). Three conversions to (eps, delta) are offered, all monotone in rho:

- ``"paper"``: Lemma 2.5 of seed 002, eps = rho^2/2 + rho sqrt(2 ln(1/delta)) (reproduces the paper);
- ``"rdp"`` (default): the RDP curve alpha rho^2/2 converted by dp_accounting's optimal RDP -> DP conversion
  (Canonne-Kamath-Steinke 2020 / Asoodeh et al. 2020), minimised over a dense order grid plus the continuous
  optimum;
- ``"exact"``: the exact (eps, delta) curve of a Gaussian mechanism with ratio rho (Balle & Wang 2018, via
  ``dp_accounting.get_epsilon_gaussian``). Tightest; valid because each round's sensitivity bound is fixed in
  advance (spec 002 section 4), so adaptive composition is exactly rho-GDP.

Which conversion is proven depends on the noise actually added (issue 24 D19): the exact curve is the
continuous Gaussian's; the discrete Gaussian of the central protocols (shuffledp.mechanisms.discrete_gaussian) is
proven only to have the continuous Gaussian's RDP curve (Canonne-Kamath-Steinke 2020 Thm 14: independent
coordinates, integer shift of l2 norm Delta -> (Delta^2 / (2 sigma^2))-zCDP, i.e. alpha Delta^2 / (2 sigma^2) at
every alpha > 1), so it is converted by ``"rdp"`` (``conversion``), which holds for ANY mechanism with that curve.
Their Thm 7 exact curve is for one coordinate only, and the tau term of Kairouz-Liu-Steinke 2021 (sums of n
discrete Gaussians, tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k/(k+1))) does not arise: every release here
carries one discrete Gaussian draw per coordinate (a prefix sum of tree nodes is a post-processing of them).

The generic Gaussian-curve functions here (``epsilon_for_rho``, ``delta_for_rho``, ``rho_for_epsilon``) are
also used by the tree-aggregation accountant of seed 003, whose mechanism is the same Gaussian curve with
rho^2 = zeta / z^2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import numpy as np
import scipy.optimize
from dp_accounting import dp_event
from dp_accounting import gaussian_mechanism as dpa_gaussian
from dp_accounting.pld import privacy_loss_mechanism as dpa_mech
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

from shuffledp.accountants.rdp import minimise_over_orders, round_up

Method = Literal["paper", "rdp", "exact"]
METHODS: tuple[str, ...] = ("paper", "rdp", "exact")
Noise = Literal["discrete", "continuous"]
NOISES: tuple[str, ...] = (
    "discrete",
    "continuous",
)  # the noise a central protocol adds (the noise key of the protocol's table)

# Orders used by the authors of seed 003 (DP-FTRL repository): 1.1, 1.2, ..., 199.9. Passing these reproduces
# the papers' printed numbers; the default grid is a superset (so never looser).
PAPER_ORDERS: tuple[float, ...] = tuple(round(1 + x / 10, 1) for x in range(1, 1990))
# Default grid: paper grid + dp_accounting's defaults + a geometric tail up to 10^4 (high orders matter only for
# tiny rho; the continuous optimum is added per query anyway).
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    sorted(
        set(PAPER_ORDERS)
        | {float(a) for a in dpa_rdp.DEFAULT_RDP_ORDERS}
        | {float(a) for a in np.round(np.geomspace(200.0, 1.0e4, 60), 6)}
    )
)

_ORDER_CAP = 1.0e7  # largest Renyi order searched (continuous optimum for eps, grid extension for delta)


# ----------------------------------------------------------------------------------------------- validation
def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _check_nonnegative(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def _check_delta(delta: float, name: str = "delta") -> float:
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {delta!r}")
    return delta


def _check_epsilon(eps: float, name: str = "eps") -> float:
    return _check_positive(name, eps)


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def check_noise(noise: str) -> str:
    """One of NOISES, or a one-line ValueError."""
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    return noise


def conversion(noise: str) -> Method:
    """The tightest (eps, delta) conversion of a Gaussian-curve rho that is PROVEN for this noise (module
    docstring): Balle-Wang's exact curve for the continuous Gaussian, the RDP conversion for the discrete one."""
    return "exact" if check_noise(noise) == "continuous" else "rdp"


def _check_orders(orders: Sequence[float] | None) -> tuple[float, ...]:
    """Explicit orders are used exactly as given; None means DEFAULT_ORDERS plus the continuous optimum."""
    if orders is None:
        return ()
    orders_t = tuple(float(a) for a in orders)
    if not orders_t or any(not (math.isfinite(a) and a > 1.0) for a in orders_t):
        raise ValueError(f"orders must be a non-empty sequence of finite numbers > 1, got {orders!r}")
    return orders_t


# ------------------------------------------------------------------------------------ seed 002 quantities
def sensitivity(lipschitz_increment: float, machines: int = 1, trusted: bool = False) -> float:
    """Sensitivity of one round's release: 2S per machine (untrusted) or 2S/M on the average (trusted).

    ``lipschitz_increment`` is S = G + 2 L D (Lemma 4.2); spec 002 section 4.
    """
    s = _check_positive("lipschitz_increment (S)", lipschitz_increment)
    m = _check_int("machines (M)", machines, 1)
    return 2.0 * s / m if trusted else 2.0 * s


def theorem_sigma(
    lipschitz_increment: float, rounds: int, rho: float, machines: int = 1, trusted: bool = False
) -> float:
    """The paper's noise std: sigma_u = 2 S sqrt(T)/rho (Alg. 1, Thm 5.1), sigma_c = sigma_u / M (Alg. 2, Thm 6.1)."""
    t = _check_int("rounds (T)", rounds, 1)
    r = _check_positive("rho", rho)
    return sensitivity(lipschitz_increment, machines, trusted) * math.sqrt(t) / r


def round_rho_sq(sens: float, sigma: float) -> float:
    """One round's contribution to rho^2: (Delta/sigma)^2 (Gaussian RDP, Lemma 2.2 / spec 002 section 7)."""
    d = _check_positive("sensitivity", sens)
    s = _check_positive("sigma", sigma)
    return (d / s) ** 2


@lru_cache(maxsize=4096)
def _rho_from_sigmas_cached(sens: float, sigmas: tuple[float, ...]) -> float:
    inv = np.asarray(sigmas, dtype=np.float64)
    return sens * math.sqrt(float(np.sum(1.0 / inv**2)))


def rho_from_sigmas(sens: float, sigmas: Sequence[float] | np.ndarray) -> float:
    """rho = Delta sqrt(sum_t 1/sigma_t^2) for T composed rounds (Thm 5.1 / 6.1 of seed 002). Cached per input."""
    d = _check_positive("sensitivity", sens)
    arr = np.asarray(sigmas, dtype=np.float64).ravel()
    if arr.size == 0:
        raise ValueError("sigmas must contain at least one round's noise std, got an empty sequence")
    if not np.all(np.isfinite(arr) & (arr > 0)):
        raise ValueError(f"every sigma must be a finite number > 0, got min {arr.min()!r}")
    return _rho_from_sigmas_cached(d, tuple(arr.tolist()))


def rho_constant_noise(sens: float, sigma: float, rounds: int) -> float:
    """rho after T rounds of constant noise: Delta sqrt(T)/sigma (Thm 5.1 / 6.1 with sigma_t = sigma)."""
    t = _check_int("rounds (T)", rounds, 0)
    return math.sqrt(t * round_rho_sq(sens, sigma))


def rdp_curve(rho: float, orders: Sequence[float] | None = None) -> np.ndarray:
    """RDP epsilons alpha rho^2 / 2 at each order (Gaussian RDP, Lemma 2.2; zCDP form, spec 002 section 4)."""
    r = _check_nonnegative("rho", rho)
    return np.asarray(_check_orders(orders) or DEFAULT_ORDERS) * r * r / 2.0


# ------------------------------------------------------------------------------------------ conversions
def _canonne_optimal_order(rho: float, delta: float) -> float:
    """Continuous minimiser of the RDP -> DP conversion for a linear RDP curve (used to tighten the grid)."""
    c = rho * rho / 2.0
    log_d = math.log(delta)

    def objective(a: float) -> float:
        # dp_accounting.compute_epsilon's bound (Canonne et al. 2020, Prop. 12 of arXiv:2004.00010)
        return a * c + math.log1p(-1.0 / a) - (log_d + math.log(a)) / (a - 1.0)

    guess = 1.0 + math.sqrt(2.0 * math.log(1.0 / delta)) / max(rho, 1e-12)
    hi = min(max(4.0 * guess, 2.0), _ORDER_CAP)
    res = scipy.optimize.minimize_scalar(objective, bounds=(1.02, hi), method="bounded", options={"xatol": 1e-10})
    return float(res.x)


@lru_cache(maxsize=65536)
def _epsilon_cached(rho: float, delta: float, method: str, orders: tuple[float, ...]) -> float:
    """eps of the conversion, raised by the float margin (rdp.round_up): the inverse queries search this figure,
    so what they return holds for the reported one too."""
    if rho == 0.0:
        return 0.0
    if method == "paper":
        # Seed 002, Lemma 2.5: (alpha, alpha rho^2/2)-RDP for all alpha => (rho^2/2 + rho sqrt(2 ln 1/delta), delta)
        return round_up(rho * rho / 2.0 + rho * math.sqrt(2.0 * math.log(1.0 / delta)))
    if method == "exact":
        # Gaussian mechanism with sensitivity/std ratio rho (Balle & Wang 2018), via dp_accounting: a brentq root
        # to 1e-12 that may sit on either side of the exact eps
        with np.errstate(divide="ignore"):  # log1p(-1) = -inf inside is handled by dp_accounting's search
            return round_up(dpa_gaussian.get_epsilon_gaussian(1.0 / rho, delta))
    # "rdp": dp_accounting's optimal conversion over the given orders, or over DEFAULT_ORDERS plus the
    # continuous optimum of the (linear) RDP curve when no orders were given.
    grid_t = orders if orders else DEFAULT_ORDERS + (_canonne_optimal_order(rho, delta),)
    grid = np.asarray(grid_t, dtype=np.float64)
    eps, _ = dpa_rdp.compute_epsilon(grid, grid * rho * rho / 2.0, delta)
    return round_up(eps)


def epsilon_for_rho(rho: float, delta: float, method: Method = "rdp", orders: Sequence[float] | None = None) -> float:
    """eps(rho, delta) of a mechanism that is (alpha, alpha rho^2/2)-RDP / rho-GDP. Never negative."""
    r = _check_nonnegative("rho", rho)
    d = _check_delta(delta)
    m = _check_method(method)
    eps = _epsilon_cached(r, d, m, _check_orders(orders) if m == "rdp" else ())
    return max(0.0, eps)


@lru_cache(maxsize=65536)
def _delta_cached(rho: float, eps: float, method: str, orders: tuple[float, ...]) -> float:
    """delta of the conversion, raised by the float margin (rdp.round_up)."""
    return 0.0 if rho == 0.0 else round_up(_delta_float(rho, eps, method, orders), probability=True)


def _delta_float(rho: float, eps: float, method: str, orders: tuple[float, ...]) -> float:
    if method == "paper":
        # Lemma 2.5 solved for delta: eps = rho^2/2 + rho sqrt(2 ln 1/delta)
        #   =>  delta = exp(-(eps - rho^2/2)^2 / (2 rho^2))
        slack = eps - rho * rho / 2.0
        return 1.0 if slack <= 0 else math.exp(-(slack**2) / (2.0 * rho * rho))
    if method == "exact":
        # E_{e^eps}(N(rho,1) || N(0,1)) = Phi(-eps/rho + rho/2) - e^eps Phi(-eps/rho - rho/2) (Balle & Wang 2018)
        return float(dpa_mech.GaussianPrivacyLoss(1.0 / rho, sensitivity=1.0).get_delta_for_epsilon(eps))

    def best_on(grid: np.ndarray) -> tuple[float, float]:
        # dp_accounting's compute_delta fails when exp(-rdp) rounds to 1; raising a tiny RDP value to 1e-15 keeps
        # a valid (larger) RDP bound.
        return dpa_rdp.compute_delta(grid, np.maximum(grid * rho * rho / 2.0, 1e-15), eps)

    if orders:  # explicit orders are used exactly as given (reproducing a paper's grid)
        return float(best_on(np.asarray(orders, dtype=np.float64))[0])
    # default grid: extended while the optimum sits at its top (spec 001 section 8), as far as the eps side goes
    return float(minimise_over_orders(best_on, DEFAULT_ORDERS, order_cap=_ORDER_CAP)[0])


def delta_for_rho(rho: float, eps: float, method: Method = "rdp", orders: Sequence[float] | None = None) -> float:
    """delta(rho, eps) in [0, 1] for the same three conversions as :func:`epsilon_for_rho`."""
    r = _check_nonnegative("rho", rho)
    e = _check_nonnegative("eps", eps)
    m = _check_method(method)
    return min(1.0, max(0.0, _delta_cached(r, e, m, _check_orders(orders) if m == "rdp" else ())))


@lru_cache(maxsize=65536)
def _rho_for_epsilon_cached(eps: float, delta: float, method: str, orders: tuple[float, ...]) -> float:
    log_inv = math.log(1.0 / delta)
    # Inverse of Lemma 2.5 [spec 002 section 4, derived]: rho = sqrt(2 ln(1/delta) + 2 eps) - sqrt(2 ln(1/delta)),
    # written as 2 eps / (sqrt(2L + 2 eps) + sqrt(2L)) to avoid cancellation for small eps.
    rho_paper = 2.0 * eps / (math.sqrt(2.0 * log_inv + 2.0 * eps) + math.sqrt(2.0 * log_inv))
    if method == "paper":
        rho = rho_paper
    else:
        # eps(rho) is increasing; both conversions are at least as tight as Lemma 2.5, so rho >= rho_paper.
        lo, hi = rho_paper * 0.5, rho_paper
        while _epsilon_cached(hi, delta, method, orders) < eps:
            lo, hi = hi, hi * 2.0
        rho = scipy.optimize.brentq(
            lambda r: _epsilon_cached(r, delta, method, orders) - eps, lo, hi, xtol=1e-15, rtol=1e-13
        )
    # Never round in the unsafe direction: step rho down until eps(rho) <= eps holds in floating point.
    while _epsilon_cached(rho, delta, method, orders) > eps:
        rho = math.nextafter(rho, 0.0) if rho < 1e-300 else rho * (1.0 - 1e-13)
    return rho


def rho_for_epsilon(eps: float, delta: float, method: Method = "rdp", orders: Sequence[float] | None = None) -> float:
    """Largest rho whose (eps, delta) fits the budget (the inverse query; rounded down, never up)."""
    e = _check_epsilon(eps)
    d = _check_delta(delta)
    m = _check_method(method)
    return _rho_for_epsilon_cached(e, d, m, _check_orders(orders) if m == "rdp" else ())


# -------------------------------------------------------------------------------- seed-002 level queries
def epsilon(
    sens: float,
    sigmas: Sequence[float] | np.ndarray,
    delta: float,
    method: Method = "rdp",
    orders: Sequence[float] | None = None,
) -> float:
    """eps of one machine after the rounds with noise stds ``sigmas`` (Thm 5.1 / 6.1, then conversion)."""
    return epsilon_for_rho(rho_from_sigmas(sens, sigmas), delta, method, orders)


def epsilon_constant_noise(
    sens: float,
    sigma: float,
    rounds: int,
    delta: float,
    method: Method = "rdp",
    orders: Sequence[float] | None = None,
) -> float:
    """eps after T rounds with the same sigma (the paper's schedule). O(1) in T."""
    return epsilon_for_rho(rho_constant_noise(sens, sigma, rounds), delta, method, orders)


@lru_cache(maxsize=65536)
def _max_rounds_cached(per_round: float, eps: float, delta: float, method: str, orders: tuple[float, ...]) -> int:
    rho_max = _rho_for_epsilon_cached(eps, delta, method, orders)
    ratio = rho_max * rho_max / per_round if per_round > 0 else math.inf
    if ratio > 1e15:
        raise ValueError(f"noise this large affords more than 1e15 rounds (rho_max^2 / per-round cost = {ratio:.3g})")
    t = int(math.floor(ratio))
    # floor() can be off by one in floating point: make eps(T) <= eps certain and T+1 infeasible.
    while t > 0 and _epsilon_cached(math.sqrt(t * per_round), delta, method, orders) > eps:
        t -= 1
    while _epsilon_cached(math.sqrt((t + 1) * per_round), delta, method, orders) <= eps:
        t += 1
    return t


def max_rounds(
    sens: float,
    sigma: float,
    eps: float,
    delta: float,
    method: Method = "rdp",
    orders: Sequence[float] | None = None,
) -> int:
    """Largest T such that T rounds with noise sigma stay within (eps, delta). Cached per configuration."""
    per_round = round_rho_sq(sens, sigma)
    e, d, m = _check_epsilon(eps), _check_delta(delta), _check_method(method)
    return _max_rounds_cached(per_round, e, d, m, _check_orders(orders) if m == "rdp" else ())


def min_sigma(
    sens: float,
    rounds: int,
    eps: float,
    delta: float,
    method: Method = "rdp",
    orders: Sequence[float] | None = None,
) -> float:
    """Smallest constant sigma for which T rounds fit (eps, delta): Delta sqrt(T)/rho(eps, delta), rounded up.

    With method="paper" this is the paper's calibration sigma = 2S sqrt(T)/rho (Alg. 1/2).
    """
    d_ = _check_positive("sensitivity", sens)
    t = _check_int("rounds (T)", rounds, 1)
    rho = rho_for_epsilon(eps, delta, method, orders)
    sigma = d_ * math.sqrt(t) / rho
    while epsilon_for_rho(d_ * math.sqrt(t) / sigma, delta, method, orders) > eps:
        sigma = math.nextafter(sigma, math.inf)
    return sigma


def admits_round(
    spent_rho_sq: float,
    sens: float,
    sigma: float,
    eps: float,
    delta: float,
    method: Method = "rdp",
    orders: Sequence[float] | None = None,
) -> bool:
    """Budget check before a round (spec 002 section 7): would spending (Delta/sigma)^2 more exceed (eps, delta)?"""
    s = _check_nonnegative("spent_rho_sq", spent_rho_sq)
    projected = s + round_rho_sq(sens, sigma)
    return epsilon_for_rho(math.sqrt(projected), delta, method, orders) <= _check_epsilon(eps)


def dp_event_for_rounds(sens: float, sigma: float, rounds: int) -> dp_event.DpEvent:
    """The dp_accounting description of T rounds at constant noise: SelfComposed(Gaussian(sigma/Delta), T)."""
    z = _check_positive("sigma", sigma) / _check_positive("sensitivity", sens)
    return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), _check_int("rounds (T)", rounds, 1))
