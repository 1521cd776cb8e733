"""AC-SA: accelerated stochastic approximation (Lan 2012), the optimizer of PAGD (paper 000 Alg 4), optax-style.

    opt = acsa(radius, rounds, sigma, diameter, smoothness)
    state = opt.init(theta_0)
    params = opt.query(state)                      # theta_md_t: users' gradients are taken here
    params, state = opt.step(grad, state, params)  # next query point, new state
    model = opt.release(state, "mean")             # theta_ag_{T+1}, the method's output

Round t = 1..T (paper 000 Alg 4, spec 000 sec 4), starting from theta_ag_1 = theta_1 = theta_0:
    theta_md_t     = a_t theta_t + (1 - a_t) theta_ag_t
    g_t            = decoded PVEC sum at theta_md_t / B
    theta_{t+1}    = Proj_Theta(theta_t - g_t / L_t)   (= argmin <g_t, th - theta_t> + L_t/2 ||th - theta_t||^2)
    theta_ag_{t+1} = a_t theta_{t+1} + (1 - a_t) theta_ag_t
Output theta_ag_{T+1}.

Step rule. The paper (Lemma 4.4 / Thm 4.3) prints a_t = 2/(t+2), L_t = ((T+2)^{3/2} sigma/D + beta)/(t+1). Spec 000
sec 10(c) flags that this violates Lan's step condition 2 beta gamma_t <= 1/a_t (gamma_t = 1/L_t), i.e.
L_t >= 2 beta a_t, whenever sigma is small (sigma = 0: L_t = beta/(t+1) < 4 beta/(t+2) = 2 beta a_t), and a_1 = 2/3
also breaks Lan's a_1 = 1 (which is what makes the start theta_ag_1 drop out of the bound). We therefore use Lan's
own policy (Lan 2012, Cor 1 step sizes, Euclidean prox so alpha = 1):
    a_t = 2/(t+1),  gamma_t = 1/L_t = (t+1) gamma/2,  gamma = min{1/(2 beta), D/((T+2)^{3/2} sigma)}
i.e. L_t = 2 max{2 beta, (T+2)^{3/2} sigma/D}/(t+1). It satisfies every hypothesis of Lan's Thm 1: a_1 = 1,
L_t = 2 beta a_t at worst, and the weights w_t = 1/(a_t L_t) obey w_{t+1}(1 - a_{t+1}) <= w_t. Compared with the
printed rule it differs only by constant factors (between 1 and 4 in L_t, 2/(t+1) vs 2/(t+2) in a_t), so Thm 4.3's
rate is unchanged. sigma = 0 gives the deterministic accelerated method (L_t = 4 beta/(t+1)); beta = 0 leaves only
the noise term; both 0 makes the step infinite and is refused.

Bound (lan_excess_risk_bound). With E[g_t] = grad f(theta_md_t), E||g_t - grad f||^2 <= sigma^2 and
||theta_1 - theta*|| <= D, the proof of Lan's Thm 1 in the Euclidean case gives
    E f(theta_ag_{T+1}) - f* <= a_T L_T [D^2/2 + sigma^2 sum_{t<=T} 1/L_t^2]
(smoothness + convexity for theta_ag, three-point inequality for the prox step, Young on the noise term using
L_t >= 2 beta a_t, then the weighted telescoping above). With the policy above this is
    <= 4 beta D^2/(T+1)^2 + (3 + 5/12) sigma D/sqrt(T) <= 4 beta D^2/(T+1)^2 + 4 sigma D/sqrt(T),
the explicit-constant form of the spec's O(beta D^2/T^2 + sigma D/sqrt(T)). Note D is only used as a bound on
||theta_1 - theta*|| (the diameter of Theta bounds it); the strongly convex reduction (phased.py) passes a smaller
D_i per phase while the projection stays onto the whole ball.

Variance (acsa_sigma): sigma^2 = L^2/B + E||noise||^2/B^2 (paper 000 proof of Thm 4.3, eq. (5); spec 000 sec 4 says
to take E||noise||^2 from the exact PVEC variance). For the Moreau-smoothed loss pass lipschitz = 2L (Lemma 4.6).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from shuffledp.models import project_l2_ball
from shuffledp.optimizers.base import OUTPUTS, Optimizer

__all__ = [
    "AcsaState",
    "acsa",
    "acsa_step_parameters",
    "acsa_sigma",
    "acsa_cohort_size",
    "smoothing_beta",
    "smoothed_cohort_size",
    "pgd_smoothing_beta",
    "lan_excess_risk_bound",
]


class AcsaState(NamedTuple):
    """steps = rounds done (the next round is t = steps + 1); theta = prox iterate theta_t; theta_ag = aggregate."""

    steps: int
    theta: np.ndarray
    theta_ag: np.ndarray

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"steps": np.asarray(self.steps), "theta": self.theta, "theta_ag": self.theta_ag}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> AcsaState:
        theta = np.asarray(a["theta"], dtype=np.float64)
        theta_ag = np.asarray(a["theta_ag"], dtype=np.float64)
        if theta.shape != theta_ag.shape:
            raise ValueError(f"theta shape {theta.shape} != theta_ag shape {theta_ag.shape}")
        return cls(int(a["steps"]), theta, theta_ag)


def _finite(x: float, name: str, minimum: float = 0.0, strict: bool = True) -> float:
    x = float(x)
    if not math.isfinite(x) or (x <= minimum if strict else x < minimum):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {minimum}, got {x!r}")
    return x


def _check_rounds(rounds: int) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, int | np.integer) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    return int(rounds)


def _averaging_weight(t: int) -> float:
    # a_t = 2/(t+1): Lan 2012 Cor 1 (beta_t = (t+1)/2 in Lan's notation, a_t = 1/beta_t); a_1 = 1
    return 2.0 / (t + 1)


def acsa_step_parameters(t: int, rounds: int, sigma: float, diameter: float, smoothness: float) -> tuple[float, float]:
    """(a_t, L_t) for round t in 1..T: a_t = 2/(t+1), L_t = 2 max{2 beta, (T+2)^{3/2} sigma/D}/(t+1).

    Lan 2012 Cor 1 policy gamma_t = 1/L_t = (t+1) gamma/2, gamma = min{1/(2 beta), D/((T+2)^{3/2} sigma)}; this is
    the safe replacement (spec 000 sec 10(c)) of paper 000 Lemma 4.4's L_t = ((T+2)^{3/2} sigma/D + beta)/(t+1).
    Always L_t >= 2 beta a_t (Lan's Thm 1 condition 2 L gamma_t <= beta_t in his notation: his L is our beta, his
    beta_t is 1/a_t). Lan's gamma carries a constant c in the noise term (spec 000 sec 10(c)); we take c = 1, the
    spec's (T+2)^{3/2} sigma/D, and derive the matching bound constants ourselves (module docstring).
    """
    rounds = _check_rounds(rounds)
    if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 1 <= t <= rounds:
        raise ValueError(f"round t must be an integer in 1..rounds={rounds}, got {t!r}")
    sigma = _finite(sigma, "sigma", strict=False)
    diameter = _finite(diameter, "diameter")
    smoothness = _finite(smoothness, "smoothness", strict=False)
    # 1/gamma = max{2 beta, (T+2)^{3/2} sigma / D}: written as a max so sigma = 0 or beta = 0 never divides by 0
    inv_gamma = max(2.0 * smoothness, (rounds + 2) ** 1.5 * sigma / diameter)
    if inv_gamma == 0.0:
        raise ValueError(
            "AC-SA needs sigma > 0 or smoothness > 0: with a noiseless gradient of a 0-smooth (linear) loss the "
            "step 1/L_t is unbounded; pass the true smoothness beta or the gradient noise level sigma"
        )
    a = _averaging_weight(t)
    # L_t = 1/gamma_t = 2/((t+1) gamma) = a_t/gamma; written as a_t * max{2 beta, .} so L_t >= 2 beta a_t holds
    # in floating point too (rounding is monotone)
    return a, a * inv_gamma


def lan_excess_risk_bound(rounds: int, sigma: float, diameter: float, smoothness: float) -> float:
    """E f(theta_ag_{T+1}) - f* <= 4 beta D^2/(T+1)^2 + 4 sigma D/sqrt(T) for acsa() with these parameters.

    Lan 2012 Thm 1 / Cor 1 (the spec's O(beta D^2/T^2 + sigma D/sqrt(T)), paper 000 Lemma 4.4) with the constants
    of the Euclidean derivation in the module docstring; D bounds ||theta_0 - theta*||.
    """
    rounds = _check_rounds(rounds)
    sigma = _finite(sigma, "sigma", strict=False)
    diameter = _finite(diameter, "diameter")
    smoothness = _finite(smoothness, "smoothness", strict=False)
    return 4.0 * smoothness * diameter**2 / (rounds + 1) ** 2 + 4.0 * sigma * diameter / math.sqrt(rounds)


def acsa_sigma(lipschitz: float, batch: int, noise_sq: float) -> float:
    """sigma = sqrt(L^2/B + noise_sq/B^2): the gradient oracle's standard deviation (paper 000 proof of Thm 4.3, (5)).

    The sampling part: a mean of B i.i.d. gradients of norm <= L has E||. - mean||^2 <= L^2/B. The privacy part:
    noise_sq = E||decoded sum - true sum||^2 (summed over coordinates, spec 000 sec 4: the exact PVEC variance),
    divided by B^2 because g_t = sum/B.
    """
    lipschitz = _finite(lipschitz, "lipschitz")
    noise_sq = _finite(noise_sq, "noise_sq", strict=False)
    if isinstance(batch, bool) or not isinstance(batch, int | np.integer) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    return math.sqrt(lipschitz**2 / batch + noise_sq / batch**2)


def _check_privacy(n: int, d: int, eps: float, delta: float) -> None:
    for name, v in (("n", n), ("d", d)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    _finite(eps, "eps")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")


def _cohort(b: float, n: int) -> int:
    # the theorems' B is real; a cohort is a whole number of users, at least 1 and at most everyone
    return int(min(max(math.ceil(b), 1), n))


def acsa_cohort_size(
    n: int, d: int, lipschitz: float, smoothness: float, diameter: float, eps: float, delta: float
) -> int:
    """Thm 4.3 (paper 000): B = n^{3/5} d^{1/5} L^{2/5} log^{2/5}(d/delta) / (eps^{2/5} beta^{2/5} D^{2/5}).

    Rounded up and clamped to [1, n]; T = floor(n/B) rounds follow (Alg 4).
    """
    _check_privacy(n, d, eps, delta)
    lipschitz = _finite(lipschitz, "lipschitz")
    smoothness = _finite(smoothness, "smoothness")
    diameter = _finite(diameter, "diameter")
    num = n**0.6 * d**0.2 * lipschitz**0.4 * math.log(d / delta) ** 0.4
    return _cohort(num / (eps * smoothness * diameter) ** 0.4, n)


def smoothing_beta(n: int, d: int, lipschitz: float, diameter: float, eps: float, delta: float) -> float:
    """Thm 4.7 (paper 000): the Moreau smoothing level beta = (eps n)^{2/3} L / (d^{1/3} D log^{2/3}(d/delta))."""
    _check_privacy(n, d, eps, delta)
    lipschitz = _finite(lipschitz, "lipschitz")
    diameter = _finite(diameter, "diameter")
    return (eps * n) ** (2 / 3) * lipschitz / (d ** (1 / 3) * diameter * math.log(d / delta) ** (2 / 3))


def smoothed_cohort_size(n: int, d: int, eps: float, delta: float) -> int:
    """Thm 4.7 (paper 000): B = (n d)^{1/3} log^{2/3}(d/delta) / eps^{2/3}, rounded up and clamped to [1, n].

    (This is Thm 4.3's B with beta = smoothing_beta(...): L and D cancel.)
    """
    _check_privacy(n, d, eps, delta)
    return _cohort((n * d) ** (1 / 3) * math.log(d / delta) ** (2 / 3) / eps ** (2 / 3), n)


def pgd_smoothing_beta(n: int, d: int, lipschitz: float, diameter: float, eps: float, delta: float) -> float:
    """Thm 4.9 (paper 000): beta = (L/D) min{sqrt(n), eps n / (sqrt(d) log^{3/2}(n d/delta))} for PGD on l_beta."""
    _check_privacy(n, d, eps, delta)
    lipschitz = _finite(lipschitz, "lipschitz")
    diameter = _finite(diameter, "diameter")
    privacy_term = eps * n / (math.sqrt(d) * math.log(n * d / delta) ** 1.5)
    return lipschitz / diameter * min(math.sqrt(n), privacy_term)


def acsa(radius: float, rounds: int, sigma: float, diameter: float, smoothness: float) -> Optimizer:
    """AC-SA over the l2 ball of `radius` for `rounds` rounds (paper 000 Alg 4 with Lan 2012 Cor 1 step sizes).

    sigma: gradient-oracle std (acsa_sigma); diameter: a bound on ||theta_0 - theta*|| (2 * radius when nothing
    better is known); smoothness: beta. Running more than `rounds` steps is refused (the step sizes depend on T).
    """
    radius = _finite(radius, "radius")
    rounds = _check_rounds(rounds)
    acsa_step_parameters(1, rounds, sigma, diameter, smoothness)  # validates the rest, incl. sigma = beta = 0

    def query(state: AcsaState) -> np.ndarray:
        a = _averaging_weight(state.steps + 1)
        # a convex combination of points of the ball stays in it; the projection only removes float rounding
        return project_l2_ball(a * state.theta + (1.0 - a) * state.theta_ag, radius)

    def init(params: np.ndarray) -> AcsaState:
        # Alg 4 needs theta_1 in Theta; theta_ag_1 = theta_1 (its value is irrelevant since a_1 = 1)
        theta = project_l2_ball(np.asarray(params, dtype=np.float64), radius)
        return AcsaState(0, theta, theta.copy())

    def step(grad: np.ndarray, state: AcsaState, params: np.ndarray) -> tuple[np.ndarray, AcsaState]:
        grad = np.asarray(grad, dtype=np.float64)
        params = np.asarray(params, dtype=np.float64)
        if grad.shape != state.theta.shape or params.shape != state.theta.shape:
            raise ValueError(
                f"grad shape {grad.shape} / params shape {params.shape} != state shape {state.theta.shape}"
            )
        if not np.all(np.isfinite(grad)):
            raise ValueError("grad must be finite")
        t = state.steps + 1
        if t > rounds:
            raise ValueError(f"AC-SA was planned for {rounds} rounds and has finished; its step sizes depend on T")
        md = query(state)
        # the gradient must be taken at theta_md (not theta_t or theta_ag): a caller passing another point would
        # silently run a different algorithm. The tolerance admits a float32 round trip of the broadcast model.
        if not np.allclose(params, md, rtol=1e-6, atol=1e-9 * radius):
            raise ValueError("params must be the query point opt.query(state) (theta_md) the gradient was taken at")
        a, lt = acsa_step_parameters(t, rounds, sigma, diameter, smoothness)
        theta = project_l2_ball(state.theta - grad / lt, radius)  # prox step, Alg 4 line 5
        theta_ag = project_l2_ball(a * theta + (1.0 - a) * state.theta_ag, radius)  # Alg 4 line 6 (+ rounding)
        new = AcsaState(t, theta, theta_ag)
        return query(new), new

    def release(state: AcsaState, output: str) -> np.ndarray:
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        # "mean": theta_ag_{T+1}, Alg 4's output; "last": the last prox iterate theta_{T+1}
        return state.theta_ag.copy() if output == "mean" else state.theta.copy()

    def monitor(state: AcsaState) -> dict[str, np.ndarray]:
        return {"mean": state.theta_ag.copy(), "last": state.theta.copy()}

    return Optimizer(init, step, query, release, monitor, AcsaState.from_arrays)
