"""Accountant of seed 004: shuffled and online projected noisy SGD (Sordello, Bu, Dong, Su).

Privacy amplification by iteration (Asoodeh-Diaz-Calmon 2020, Theorem 1 of the paper): with only the last
iterate released, a record processed at position i of n is (eps, A * B^(n-i))-DP, where A bounds the step that
touches the record and B the contraction of every later step (spec 004 section 3.1):

    Gaussian N(0, sigma^2 I):  A = theta_{e^eps}(2L/sigma),   B = theta_{e^eps}(M D_K / (eta sigma))   (eq. 3)
    Laplace  Lap(0, v), 1-D:   A = (1 - e^{eps/2 - L/v})_+,   B = (1 - e^{eps/2 - M(b-a)/(2 eta v)})_+  (eq. 4)

    theta_gamma(r) = Q(log(gamma)/r - r/2) - gamma Q(log(gamma)/r + r/2) = E_gamma(N(r,1) || N(0,1)).

Shuffling first puts the record at each position with probability 1/n (Theorem 2):

    delta_shuf(eps) = A (1 - B^n) / (n (1 - B)).

In the regimes of interest 1 - B is ~1e-7 and B^n is not small, so everything is computed in log space from
log A, log B and log(1 - B) (spec 004 section 6.1): 1 - theta = Phi(a) + e^eps Q(b) with logaddexp, and
delta = A * (-expm1(n log1p(-u))) / (n u) with u = 1 - B. theta is cross-checked against dp_accounting's exact
Gaussian privacy loss in the tests.

Also here: the fixed-noise-by-n schedules (Thms 4, 5), the online decaying-noise schedules and per-record delta
(Thms 6, 7), and calibration (smallest sigma / v, smallest eps) for a target.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal, NamedTuple

import mpmath
import numpy as np
import scipy.integrate
import scipy.optimize
from scipy.special import lambertw, log_ndtr

from shuffledp.accountants.composition import bisect_boundary
from shuffledp.accountants.gaussian import (
    _check_delta,
    _check_int,
    _check_nonnegative,
    _check_positive,
)
from shuffledp.accountants.rdp import round_up

Noise = Literal["gaussian", "laplace"]
_NOISES = ("gaussian", "laplace")
_TINY = 5e-324  # smallest positive double
_CHUNK = 1 << 20  # rows per vectorized block of the online product (bounds memory at n = 10^7)


def _check_noise(noise: str) -> str:
    if noise not in _NOISES:
        raise ValueError(f"noise must be one of {_NOISES}, got {noise!r}")
    return noise


def _prob_from_log(log_p: float) -> float:
    """exp(log_p) clipped to [0, 1]; a positive value below the float range is reported as the smallest
    subnormal rather than 0, so a delta is never rounded down to exactly zero."""
    if log_p == -math.inf:
        return 0.0
    return min(1.0, max(math.exp(log_p), _TINY))


# ------------------------------------------------------------------------------------------------ theta
@lru_cache(maxsize=1 << 16)
def _log_theta_mp(r: float, eps: float) -> float:
    # 60-digit fallback where the double-precision difference Q(a) - e^eps Q(b) cancels.
    with mpmath.workdps(60):
        r_, e_ = mpmath.mpf(r), mpmath.mpf(eps)
        a = e_ / r_ - r_ / 2
        b = e_ / r_ + r_ / 2
        q = lambda x: mpmath.erfc(x / mpmath.sqrt(2)) / 2  # noqa: E731
        val = q(a) - mpmath.exp(e_) * q(b)
        return float(mpmath.log(val)) if val > 0 else -math.inf


def log_theta(r: float, eps: float) -> float:
    """log theta_{e^eps}(r): the hockey-stick divergence E_{e^eps}(N(r,1)||N(0,1)) in log space (spec 004 3.1)."""
    r = _check_positive("r", r)
    eps = _check_nonnegative("eps", eps)
    a = eps / r - r / 2.0
    b = eps / r + r / 2.0
    x = float(log_ndtr(-a))  # log Q(a)
    y = eps + float(log_ndtr(-b))  # log(e^eps Q(b))
    if x - y < 1e-3:
        # 1 - e^{y-x} loses digits (or underflows to <= 0): evaluate the difference at high precision.
        return _log_theta_mp(r, eps)
    return x + math.log1p(-math.exp(y - x))


def log_one_minus_theta(r: float, eps: float) -> float:
    """log(1 - theta_{e^eps}(r)) = log(Phi(a) + e^eps Q(b)), accurate when theta is within 1e-16 of 1."""
    r = _check_positive("r", r)
    eps = _check_nonnegative("eps", eps)
    a = eps / r - r / 2.0
    b = eps / r + r / 2.0
    return float(np.logaddexp(log_ndtr(a), eps + log_ndtr(-b)))


def theta(r: float, eps: float) -> float:
    """theta_{e^eps}(r) in [0, 1] (Asoodeh et al. Thm 3/4; equal to the mu-GDP delta(eps) at mu = r)."""
    return _prob_from_log(log_theta(r, eps))


# --------------------------------------------------------------------------------------- A and B terms
class Terms(NamedTuple):
    """log A, log B and log(1 - B) of Theorem 1 (spec 004 section 3.1); -inf encodes 0."""

    log_a: float
    log_b: float
    log_1mb: float

    @property
    def a(self) -> float:
        return math.exp(self.log_a)

    @property
    def b(self) -> float:
        return math.exp(self.log_b)


def contraction_factor(eta: float, beta: float, rho: float = 0.0) -> float:
    """M = sqrt(1 - 2 eta beta rho / (beta + rho)) (Theorem 1), enforcing eta <= 2/(beta + rho) [spec 004 1]."""
    eta = _check_positive("eta", eta)
    beta = _check_positive("beta (smoothness)", beta)
    rho = _check_nonnegative("rho (strong convexity)", rho)
    if rho > beta:
        raise ValueError(f"rho (strong convexity) must be <= beta (smoothness) = {beta}, got {rho}")
    if eta > 2.0 / (beta + rho):
        raise ValueError(
            f"eta must be <= 2/(beta+rho) = {2.0 / (beta + rho)} for the gradient step to be a contraction, got {eta}"
        )
    return math.sqrt(max(0.0, 1.0 - 2.0 * eta * beta * rho / (beta + rho)))


def _check_m(m: float) -> float:
    m = float(m)
    if not (math.isfinite(m) and 0.0 < m <= 1.0):
        raise ValueError(f"M (contraction factor) must lie in (0, 1], got {m!r}")
    return m


def gaussian_terms(eps: float, lipschitz: float, sigma: float, eta: float, diameter: float, m: float = 1.0) -> Terms:
    """A = theta(2L/sigma), B = theta(M D_K/(eta sigma)) (eq. 3 of seed 004); noise N(0, sigma^2) on the gradient."""
    eps = _check_nonnegative("eps", eps)
    lip = _check_positive("L (Lipschitz constant)", lipschitz)
    sigma = _check_positive("sigma", sigma)
    eta = _check_positive("eta", eta)
    dk = _check_positive("diameter (D_K)", diameter)
    r_b = _check_m(m) * dk / (eta * sigma)
    return Terms(log_theta(2.0 * lip / sigma, eps), log_theta(r_b, eps), log_one_minus_theta(r_b, eps))


def _laplace_log_term(eps: float, shift: float) -> tuple[float, float]:
    # E_{e^eps}(Lap(shift,1) || Lap(0,1)) = (1 - e^{(eps - shift)/2})_+  (eq. 4; [derived, checked] in spec 004 3.1)
    x = eps / 2.0 - shift / 2.0
    log_val = math.log(-math.expm1(x)) if x < 0 else -math.inf
    return log_val, min(0.0, x)


def laplace_terms(eps: float, lipschitz: float, v: float, eta: float, width: float, m: float = 1.0) -> Terms:
    """A = (1 - e^{eps/2 - L/v})_+, B = (1 - e^{eps/2 - M(b-a)/(2 eta v)})_+ (eq. 4); K = [a, b], width = b - a."""
    eps = _check_nonnegative("eps", eps)
    lip = _check_positive("L (Lipschitz constant)", lipschitz)
    v = _check_positive("v (Laplace scale)", v)
    eta = _check_positive("eta", eta)
    w = _check_positive("width (b - a)", width)
    log_a, _ = _laplace_log_term(eps, 2.0 * lip / v)
    log_b, log_1mb = _laplace_log_term(eps, _check_m(m) * w / (eta * v))
    return Terms(log_a, log_b, log_1mb)


def _log_delta_shuffled(terms: Terms, n: int) -> float:
    # Theorem 2: delta = A (1 - B^n) / (n (1 - B)), in log space.
    if terms.log_a == -math.inf:
        return -math.inf
    if terms.log_b == -math.inf:  # B = 0: only the last position counts
        return terms.log_a - math.log(n)
    if terms.log_1mb == -math.inf:  # B = 1: no contraction, delta = A
        return terms.log_a
    u = math.exp(terms.log_1mb)
    n_log_b = n * math.log1p(-u) if u < 0.5 else n * terms.log_b
    if n_log_b == 0.0:  # 1 - B below double resolution: (1 - B^n)/(n(1 - B)) -> 1, delta = A (upper bound)
        return terms.log_a
    return terms.log_a + math.log(-math.expm1(n_log_b)) - math.log(n) - terms.log_1mb


def delta_from_terms(terms: Terms, n: int) -> float:
    """delta_shuf = A (1 - B^n)/(n (1 - B)) of Theorem 2 for given terms; in [0, 1]."""
    n = _check_int("n", n, 1)
    return _prob_from_log(_log_delta_shuffled(terms, n))


@lru_cache(maxsize=1 << 16)
def _delta_shuffled_cached(noise: str, eps: float, n: int, lip: float, scale: float, eta: float, dk: float, m: float):
    terms = (gaussian_terms if noise == "gaussian" else laplace_terms)(eps, lip, scale, eta, dk, m)
    # the float margin (rdp.round_up): calibration and the eps search both test this figure, so both stay safe
    return min(1.0, round_up(_prob_from_log(_log_delta_shuffled(terms, n)), probability=True))


def delta_shuffled(
    noise: Noise,
    eps: float,
    n: int,
    lipschitz: float,
    scale: float,
    eta: float,
    diameter: float,
    m: float = 1.0,
) -> float:
    """delta_shuf(eps) of one epoch of shuffled PNSGD (Theorem 2). ``scale`` is sigma (Gaussian) or v (Laplace);
    ``diameter`` is D_K (Gaussian) or b - a (Laplace). Cached per configuration."""
    noise = _check_noise(noise)
    eps = _check_nonnegative("eps", eps)
    n = _check_int("n", n, 1)
    lip = _check_positive("L (Lipschitz constant)", lipschitz)
    scale = _check_positive("sigma" if noise == "gaussian" else "v (Laplace scale)", scale)
    return _delta_shuffled_cached(
        noise, eps, n, lip, scale, _check_positive("eta", eta), _check_positive("diameter", diameter), _check_m(m)
    )


def delta_plain(terms: Terms, n: int, i: int) -> float:
    """Unshuffled PNSGD, record at position i of n: A B^(n-i) (Theorem 1). i = n gives A: no amplification."""
    n = _check_int("n", n, 1)
    i = _check_int("i (position)", i, 1)
    if i > n:
        raise ValueError(f"i (position) must be in [1, n={n}], got {i}")
    if terms.log_a == -math.inf or (terms.log_b == -math.inf and i < n):
        return 0.0
    return _prob_from_log(terms.log_a + (n - i) * terms.log_b if i < n else terms.log_a)


def delta_randomly_stopped(terms: Terms, n: int, i: int | None = None) -> float:
    """Randomly stopped PNSGD (Asoodeh Thm 5, spec 004 3.3): exact A(1-B^(n-i+1))/(n(1-B)) at position i, or the
    reported bound A/(n(1-B)) when i is None (capped at 1)."""
    n = _check_int("n", n, 1)
    if i is None:
        if terms.log_a == -math.inf:
            return 0.0
        return _prob_from_log(terms.log_a - math.log(n) - terms.log_1mb)
    i = _check_int("i (position)", i, 1)
    if i > n:
        raise ValueError(f"i (position) must be in [1, n={n}], got {i}")
    # Same sum as Theorem 2 with n - i + 1 terms, still divided by n.
    k = n - i + 1
    return _prob_from_log(_log_delta_shuffled(terms, k) + math.log(k) - math.log(n))


# ------------------------------------------------------------------------------------------- schedules
def _check_c(c1: float, c2: float) -> tuple[float, float]:
    return _check_positive("C1", c1), _check_nonnegative("C2", c2)


def sigma_fixed(n: int, eta: float, diameter: float, c1: float, c2: float, m: float = 1.0) -> float:
    """sigma(n) = M D_K / (2 eta sqrt(W(n^2/(2 pi C1^2) + C2))) (Theorem 5, eq. 7). Non-increasing in n."""
    n = _check_int("n", n, 1)
    c1, c2 = _check_c(c1, c2)
    x = float(n) ** 2 / (2.0 * math.pi * c1 * c1) + c2
    w = float(lambertw(x).real)
    if not w > 0:
        raise ValueError(f"n^2/(2 pi C1^2) + C2 must be > 0 for the schedule, got {x}")
    return (
        _check_m(m) * _check_positive("diameter (D_K)", diameter) / (2.0 * _check_positive("eta", eta) * math.sqrt(w))
    )


def v_fixed(n: int, eta: float, width: float, c1: float, c2: float, m: float = 1.0) -> float:
    """v(n) = M (b-a) / (2 eta log(n/C1 + C2)) (Theorem 4, eq. 6). Needs n/C1 + C2 > 1."""
    n = _check_int("n", n, 1)
    c1, c2 = _check_c(c1, c2)
    arg = n / c1 + c2
    if not arg > 1.0:
        raise ValueError(f"n/C1 + C2 must be > 1 for a finite Laplace scale, got {arg}")
    return _check_m(m) * _check_positive("width (b - a)", width) / (2.0 * _check_positive("eta", eta) * math.log(arg))


def delta_star_gaussian(eps: float, c1: float) -> float:
    """Limit delta_G* = (1 - e^{-2 C1 e^{eps/2}}) / (2 C1 e^{eps/2}) of the Theorem 5 schedule."""
    x = 2.0 * _check_positive("C1", c1) * math.exp(_check_nonnegative("eps", eps) / 2.0)
    return -math.expm1(-x) / x


def delta_star_laplace(eps: float, c1: float) -> float:
    """Limit delta_L* = (1 - e^{-C1 e^{eps/2}}) / (C1 e^{eps/2}) of the Theorem 4 schedule."""
    x = _check_positive("C1", c1) * math.exp(_check_nonnegative("eps", eps) / 2.0)
    return -math.expm1(-x) / x


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not (math.isfinite(alpha) and alpha > 1.0):
        raise ValueError(f"alpha must be a finite number > 1 (Theorems 6, 7), got {alpha!r}")
    return alpha


def _check_record_indices(j: int | np.ndarray) -> np.ndarray:
    """Record indices j (scalar or array) as float64; each must be finite and >= 1."""
    jj = np.asarray(j, dtype=np.float64)
    if np.any(~np.isfinite(jj)) or np.any(jj < 1):
        raise ValueError("j (record index) must be >= 1")
    return jj


def sigma_online(j: int | np.ndarray, eta: float, diameter: float, alpha: float, c1: float, c2: float, m: float = 1.0):
    """sigma_j = M D_K / (2 eta sqrt(W(j^{2 alpha}/(2 pi C1^2) + C2))) (Theorem 7). Vectorized over j."""
    jj = _check_record_indices(j)
    c1, c2 = _check_c(c1, c2)
    # W(x) for huge x: lambertw is accurate on its own up to ~1e308; use log-space x beyond that.
    log_x1 = 2.0 * _check_alpha(alpha) * np.log(jj) - math.log(2.0 * math.pi * c1 * c1)
    w = _lambertw_from_log(np.logaddexp(log_x1, math.log(c2)) if c2 > 0 else log_x1)
    out = _check_m(m) * _check_positive("diameter (D_K)", diameter) / (2.0 * _check_positive("eta", eta) * np.sqrt(w))
    return float(out) if np.ndim(out) == 0 else out


def _lambertw_from_log(log_x: np.ndarray) -> np.ndarray:
    """W(e^{log_x}) for arrays; Newton on w + log w = log_x where e^{log_x} overflows."""
    log_x = np.asarray(log_x, dtype=np.float64)
    safe = log_x < 700.0
    w = np.empty_like(log_x)
    w[safe] = lambertw(np.exp(log_x[safe])).real
    if np.any(~safe):
        big = log_x[~safe]
        z = big - np.log(big)
        for _ in range(50):
            z = z - (z + np.log(z) - big) / (1.0 + 1.0 / z)
        w[~safe] = z
    return w


def v_online(j: int | np.ndarray, eta: float, width: float, alpha: float, c1: float, c2: float, m: float = 1.0):
    """v_j = M (b-a) / (2 eta log(j^alpha/C1 + C2)) (Theorem 6). Vectorized over j."""
    jj = _check_record_indices(j)
    c1, c2 = _check_c(c1, c2)
    log_arg = np.logaddexp(_check_alpha(alpha) * np.log(jj) - math.log(c1), math.log(c2) if c2 > 0 else -np.inf)
    if np.any(log_arg <= 0):
        raise ValueError("j^alpha/C1 + C2 must be > 1 for every record (choose C2 >= 1)")
    out = _check_m(m) * _check_positive("width (b - a)", width) / (2.0 * _check_positive("eta", eta) * log_arg)
    return float(out) if np.ndim(out) == 0 else out


# --------------------------------------------------------------------------------------- online delta
class OnlineConfig(NamedTuple):
    """Online PNSGD (Theorems 6 and 7): noise kind, eps, L, eta, D_K or b - a, alpha, C1, C2, M."""

    noise: str
    eps: float
    lipschitz: float
    eta: float
    diameter: float
    alpha: float
    c1: float
    c2: float
    m: float = 1.0

    def validated(self) -> OnlineConfig:
        c1, c2 = _check_c(self.c1, self.c2)
        return OnlineConfig(
            _check_noise(self.noise),
            _check_nonnegative("eps", self.eps),
            _check_positive("L (Lipschitz constant)", self.lipschitz),
            _check_positive("eta", self.eta),
            _check_positive("diameter", self.diameter),
            _check_alpha(self.alpha),
            c1,
            c2,
            _check_m(self.m),
        )


def _online_log_b(cfg: OnlineConfig, t: np.ndarray) -> np.ndarray:
    """log B_t for the online schedules, vectorized over record indices t (float array)."""
    if cfg.noise == "laplace":
        # Theorem 6: with v_t, M(b-a)/(2 eta v_t) = log(t^alpha/C1 + C2), so B_t = 1 - C1 e^{eps/2}/(t^alpha + C1 C2).
        log_u = cfg.eps / 2.0 + math.log(cfg.c1) - np.logaddexp(cfg.alpha * np.log(t), math.log(cfg.c1 * cfg.c2))
        return np.where(log_u < 0, np.log1p(-np.exp(np.minimum(log_u, 0.0))), -np.inf)
    # Theorem 7: M D_K/(eta sigma_t) = 2 sqrt(W(t^{2 alpha}/(2 pi C1^2) + C2)).
    log_x1 = 2.0 * cfg.alpha * np.log(t) - math.log(2.0 * math.pi * cfg.c1 * cfg.c1)
    r = 2.0 * np.sqrt(_lambertw_from_log(np.logaddexp(log_x1, math.log(cfg.c2)) if cfg.c2 > 0 else log_x1))
    return _vector_log_theta(r, cfg.eps)


def _vector_log_theta(r: np.ndarray, eps: float) -> np.ndarray:
    a = eps / r - r / 2.0
    b = eps / r + r / 2.0
    x = log_ndtr(-a)
    y = eps + log_ndtr(-b)
    out = x + np.log1p(-np.exp(np.minimum(y - x, 0.0)))
    bad = (x - y) < 1e-3
    if np.any(bad):  # rare cancellation: scalar high-precision path
        out[bad] = [log_theta(float(ri), eps) for ri in r[bad]]
    return out


def _online_log_a(cfg: OnlineConfig, i: int) -> float:
    if cfg.noise == "laplace":
        v_i = v_online(i, cfg.eta, cfg.diameter, cfg.alpha, cfg.c1, cfg.c2, cfg.m)
        return _laplace_log_term(cfg.eps, 2.0 * cfg.lipschitz / v_i)[0]
    s_i = sigma_online(i, cfg.eta, cfg.diameter, cfg.alpha, cfg.c1, cfg.c2, cfg.m)
    return log_theta(2.0 * cfg.lipschitz / s_i, cfg.eps)


def _online_log_b_sum(cfg: OnlineConfig, first: int, last: int) -> float:
    total = 0.0
    for lo in range(first, last + 1, _CHUNK):
        t = np.arange(lo, min(last, lo + _CHUNK - 1) + 1, dtype=np.float64)
        total += float(np.sum(_online_log_b(cfg, t)))
    return total


@lru_cache(maxsize=4096)
def _online_delta_cached(cfg: OnlineConfig, i: int, n: int) -> float:
    log_a = _online_log_a(cfg, i)
    if log_a == -math.inf:
        return 0.0
    return _prob_from_log(log_a + _online_log_b_sum(cfg, i + 1, n))


def online_record_delta(cfg: OnlineConfig, i: int, n: int) -> float:
    """Exact delta_i(n) = A_i prod_{t=i+1}^n B_t of online PNSGD for the record at index i (spec 004 3.5).

    Non-uniform: the newest record (i = n) gets A_n, which tends to 1. Vectorized in blocks (n up to 10^7+).
    """
    cfg = cfg.validated()
    i = _check_int("i (record index)", i, 1)
    n = _check_int("n", n, 1)
    if i > n:
        raise ValueError(f"i (record index) must be in [1, n={n}], got {i}")
    return _online_delta_cached(cfg, i, n)


def online_record_deltas(cfg: OnlineConfig, n: int) -> np.ndarray:
    """delta_i(n) for every i = 1..n at once (cumulative log-sum), for per-record reporting."""
    cfg = cfg.validated()
    n = _check_int("n", n, 1)
    t = np.arange(1, n + 1, dtype=np.float64)
    log_b = _online_log_b(cfg, t)
    # suffix sums: sum_{t=i+1}^n log B_t
    suffix = np.concatenate([np.cumsum(log_b[::-1])[::-1][1:], [0.0]])
    if cfg.noise == "laplace":
        v = v_online(t, cfg.eta, cfg.diameter, cfg.alpha, cfg.c1, cfg.c2, cfg.m)
        x = cfg.eps / 2.0 - cfg.lipschitz / v
        log_a = np.where(x < 0, np.log(-np.expm1(np.minimum(x, -1e-300))), -np.inf)
    else:
        s = sigma_online(t, cfg.eta, cfg.diameter, cfg.alpha, cfg.c1, cfg.c2, cfg.m)
        log_a = _vector_log_theta(2.0 * cfg.lipschitz / np.atleast_1d(s), cfg.eps)
    with np.errstate(invalid="ignore"):
        return np.minimum(1.0, np.exp(log_a + suffix))


@lru_cache(maxsize=4096)
def _online_limit_cached(cfg: OnlineConfig, i: int, bound: str) -> float:
    log_a = _online_log_a(cfg, i)
    if log_a == -math.inf:
        return 0.0
    start = float(i + 1 if bound == "upper" else i)

    k = 1.0 / (cfg.alpha - 1.0)

    def g(u: float) -> float:
        # Substitution x = start * u^-k (k = 1/(alpha-1)) maps [start, inf) to (0, 1]; since log B_x ~ -c x^-alpha
        # the transformed integrand tends to a constant, which quad integrates to full precision.
        if u <= 0.0:
            return 0.0
        x = start * u ** (-k)
        if not math.isfinite(x):
            return 0.0
        return float(_online_log_b(cfg, np.array([x]))[0]) * k * x / u

    # log B_x is increasing in x (noise decays), so sum_{t>i} log B_t lies between the integrals from i and i+1
    # (Theorems 6, 7 and spec 004 3.5).
    total, _ = scipy.integrate.quad(g, 0.0, 1.0, limit=400, epsabs=0.0, epsrel=1e-12)
    return _prob_from_log(log_a + total)


def online_delta_limit(cfg: OnlineConfig, i: int, bound: Literal["upper", "lower"] = "upper") -> float:
    """Limit n -> inf of delta_i(n): the paper's delta*^o (integral from i+1, an upper bound; Thms 6, 7) or the
    matching lower bound (integral from i)."""
    cfg = cfg.validated()
    i = _check_int("i (record index)", i, 1)
    if bound not in ("upper", "lower"):
        raise ValueError(f"bound must be 'upper' or 'lower', got {bound!r}")
    return _online_limit_cached(cfg, i, bound)


# ------------------------------------------------------------------------------------------ calibration
def calibrate_scale(
    noise: Noise,
    target_delta: float,
    eps: float,
    n: int,
    lipschitz: float,
    eta: float,
    diameter: float,
    m: float = 1.0,
    rel_tol: float = 1e-10,
) -> float:
    """Smallest sigma (Gaussian) or v (Laplace) with delta_shuf(eps) <= target_delta (spec 004 section 5).

    delta_shuf is decreasing in the noise scale, so bisection on log(scale); the returned value is the upper end
    of the final bracket (never below the true minimum).
    """
    noise = _check_noise(noise)
    target = _check_delta(target_delta, "target_delta")

    def fits(s: float) -> bool:
        return delta_shuffled(noise, eps, n, lipschitz, s, eta, diameter, m) <= target

    lo, hi = 1e-3, 1.0  # bracket: fits(hi), not fits(lo)
    while not fits(hi):
        lo, hi = hi, hi * 4.0
        if hi > 1e300:
            raise ValueError(f"no noise scale reaches delta <= {target} at eps={eps}")
    while fits(lo):
        hi, lo = lo, lo / 4.0
        if lo < 1e-300:
            return hi
    return bisect_boundary(fits, hi, lo, rel_tol=rel_tol, geometric=True)


def epsilon_shuffled(
    noise: Noise,
    target_delta: float,
    n: int,
    lipschitz: float,
    scale: float,
    eta: float,
    diameter: float,
    m: float = 1.0,
    abs_tol: float = 1e-10,
) -> float:
    """Smallest eps >= 0 with delta_shuf(eps) <= target_delta (delta_shuf is decreasing in eps); rounded up."""
    target = _check_delta(target_delta, "target_delta")

    def fits(e: float) -> bool:
        return delta_shuffled(noise, e, n, lipschitz, scale, eta, diameter, m) <= target

    if fits(0.0):
        return 0.0
    lo, hi = 0.0, 1.0  # bracket: fits(hi), not fits(lo)
    while not fits(hi):
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            raise ValueError(f"delta_shuf stays above {target} for every eps <= 1e6")
    return bisect_boundary(fits, hi, lo, abs_tol=abs_tol)


__all__ = [
    "Terms",
    "OnlineConfig",
    "log_theta",
    "log_one_minus_theta",
    "theta",
    "contraction_factor",
    "gaussian_terms",
    "laplace_terms",
    "delta_from_terms",
    "delta_shuffled",
    "delta_plain",
    "delta_randomly_stopped",
    "sigma_fixed",
    "v_fixed",
    "delta_star_gaussian",
    "delta_star_laplace",
    "sigma_online",
    "v_online",
    "online_record_delta",
    "online_record_deltas",
    "online_delta_limit",
    "calibrate_scale",
    "epsilon_shuffled",
]
