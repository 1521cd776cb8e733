"""PrivUnit2: the eps0-LDP randomizer for the l_2 ball of radius r in R^d, quantized to a fixed-length message.

Mechanism (spec 001 section 3, after Bhowmick et al. 2018 "PrivUnit2"; gamma = 0 is Duchi, Jordan, Wainwright 2013):
  1. Pre-step: u = x/||x|| w.p. (1 + ||x||/r)/2, else u = -x/||x|| (u = +-e_1 w.p. 1/2 each when x = 0).
  2. Cap mass P(g) = P[<V, u> >= g] = 0.5 I_{1-g^2}((d-1)/2, 1/2) for V ~ Unif(S^{d-1}), g in [0, 1).
     Cap probability p = e^eps0 P/(e^eps0 P + 1 - P).
  3. W.p. p draw V uniformly on the cap {<V,u> >= g}, else uniformly on its complement: t = <V,u> by the exact
     inverse CDF of the truncated law of t (t^2 ~ Beta(1/2, (d-1)/2), symmetric sign), then
     V = t u + sqrt(1 - t^2) w with w uniform on the unit sphere orthogonal to u.
  4. m = E<V, u> = M(g) (p/P - (1-p)/(1-P)) = M(g)(e^eps0 - 1)/(1 + (e^eps0 - 1)P(g)),
     M(g) = (1-g^2)^((d-1)/2)/((d-1) B((d-1)/2, 1/2)). The unquantized estimate is y = (r/m) V.
  gamma defaults to the g in [0, 1) maximizing m (i.e. minimizing the variance (r/m)^2 - ||x||^2).

Privacy of steps 1-3 (exactly eps0). Given u, V has density (w.r.t. the uniform measure on the sphere) p/P on the
cap and (1-p)/(1-P) off it; by the choice of p their ratio is exactly e^eps0, so for any u, u' and any v the
densities differ by at most e^eps0. Step 1 mixes two such densities, so the bound holds for every pair x, x'.

Quantization (the message). Each coordinate of V (in [-1, 1]) is rounded stochastically to the grid
    G = {-1 + i Delta : i = 0..L-1},  L = 2^bits,  Delta = 2/(L - 1):
index i = floor((V_j + 1)/Delta) + Bernoulli(frac), frac the fractional part. The message is the d indices
(d * bits bits, stored as d fixed-width unsigned integers) and the decoder is y = (r/m)(-1 + i Delta).
  * Privacy stays exactly eps0: the rounding kernel K(i | V) uses only V and fresh randomness independent of x,
    so P[i | x] = integral K(i | v) f_x(v) dv <= e^eps0 integral K(i | v) f_x'(v) dv = e^eps0 P[i | x'].
    This is post-processing of an eps0-LDP output; no budget is spent on it, and the message range is discrete
    (finite, L^d symbols), as seed 001's Theorem 1 requires.
  * Unbiased: E[-1 + i Delta | V] = V coordinate-wise, so E[y] = (r/m) E[V] = (r/m) m E[u] = x.
  * Variance increase: E||Q(V) - V||^2 = Delta^2 sum_j E[frac_j (1 - frac_j)] <= d Delta^2/4, so
    E||y - x||^2 <= (r/m)^2 (1 + d Delta^2/4) - ||x||^2. The default `bits` is the smallest with
    d Delta^2/4 <= 1% (d = 100: 7 bits, +0.6%; d = 26010: 11 bits, +0.6%).

Floating point: the cap coin uses p rounded DOWN to the sampler's 2**-53 grid (1 - p rounded up), so the
cap/off-cap ratio stays <= e^eps0 for the computed P (it is e^eps0 to ~1e-15 relative for moderate eps0), and the
decoder uses that p. The continuous steps (scipy's incomplete beta, accurate to ~1e-15 relative, its inverse, the
Gaussian directions) are, as for any continuous sampler, not exact; the message only carries the stochastically
rounded grid index, never the low-order bits of V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import mpmath
import numpy as np
from scipy import optimize, special

from shuffledp.mechanisms.ldp_common import (
    UNIFORM_RESOLUTION,
    MessageFormat,
    bernoulli,
    check_batch,
    check_eps0,
    check_int,
    check_norm_bound,
    check_positive,
    decode_mean_from_sum,
)

MAX_BITS = 16
DEFAULT_QUANTIZATION_OVERHEAD = 0.01  # d Delta^2 / 4 <= 1% of E||V||^2 = 1


def cap_mass(gamma: float | np.ndarray, d: int) -> float | np.ndarray:
    """P(g) = P[<V, u> >= g] = 0.5 I_{1-g^2}((d-1)/2, 1/2) = 0.5 (1 - I_{g^2}(1/2, (d-1)/2)) (spec 001 section 3)."""
    g = np.asarray(gamma, dtype=np.float64)
    return 0.5 * special.betaincc(0.5, (d - 1) / 2.0, g * g)


def log_cap_moment(gamma: float | np.ndarray, d: int) -> float | np.ndarray:
    """log M(g), M(g) = E[t 1{t >= g}] = (1-g^2)^((d-1)/2)/((d-1) B((d-1)/2, 1/2)) (spec 001 section 3)."""
    g = np.asarray(gamma, dtype=np.float64)
    return (d - 1) / 2.0 * np.log1p(-g * g) - math.log(d - 1) - _log_beta_half(d)


@lru_cache(maxsize=64)
def _log_beta_half(d: int) -> float:
    # log B((d-1)/2, 1/2) in 30 digits: scipy's betaln loses ~1e-12 relative at d ~ 1e4
    with mpmath.workdps(30):
        return float(mpmath.log(mpmath.beta(mpmath.mpf(d - 1) / 2, mpmath.mpf(1) / 2)))


def off_cap_probability(eps0: float, P: float) -> float:
    """1 - p with p = e^eps0 P/(e^eps0 P + 1 - P), the calibration making the density ratio exactly e^eps0
    (spec 001 section 3); computed directly because 1 - p loses its precision when p ~ 1."""
    return (1.0 - P) * math.exp(-eps0) / (P + (1.0 - P) * math.exp(-eps0))


def _log_m(gamma: float | np.ndarray, eps0: float, d: int) -> float | np.ndarray:
    # log m(g) = log M(g) + log(e^eps0 - 1) - log(1 + (e^eps0 - 1) P(g)), divided through by e^eps0
    P = cap_mass(gamma, d)
    em1 = -math.expm1(-eps0)  # 1 - e^-eps0
    return log_cap_moment(gamma, d) + math.log(em1) - np.log(math.exp(-eps0) + em1 * P)


def optimal_gamma(eps0: float, d: int) -> float:
    """The cap threshold g in [0, 1) maximizing m(g), i.e. minimizing PrivUnit's variance (r/m)^2 - ||x||^2."""
    eps0 = check_eps0(eps0)
    d = check_int("d", d, 2)
    grid = np.unique(
        np.concatenate([np.linspace(0.0, 0.99, 991), np.geomspace(1e-5, 0.99, 400), 1.0 - np.geomspace(1e-2, 1e-9, 50)])
    )
    with np.errstate(divide="ignore"):
        vals = _log_m(grid, eps0, d)
    i = int(np.nanargmax(vals))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    res = optimize.minimize_scalar(
        lambda g: -float(_log_m(g, eps0, d)), bounds=(lo, hi), method="bounded", options={"xatol": 1e-10}
    )
    best = float(res.x) if -res.fun >= vals[i] else float(grid[i])
    return best


def default_bits(d: int, overhead: float = DEFAULT_QUANTIZATION_OVERHEAD) -> int:
    """Smallest bits in [1, 16] with d Delta^2/4 = d/(2^bits - 1)^2 <= overhead (16 if none is small enough)."""
    d = check_int("d", d, 1)
    for bits in range(1, MAX_BITS + 1):
        if d / (2**bits - 1) ** 2 <= overhead:
            return bits
    return MAX_BITS


@dataclass(frozen=True)
class PrivUnitParams:
    """Parameters of quantized PrivUnit2. eps0, d, radius, gamma, bits are free; the rest is derived here only."""

    eps0: float
    d: int
    radius: float
    gamma: float
    bits: int
    cap_mass: float = field(init=False)  # P(gamma)
    p_cap: float = field(init=False)  # cap probability, on the 2**-53 grid, <= e^eps0 P/(e^eps0 P + 1 - P)
    m: float = field(init=False)  # E<V, u> for this p
    scale: float = field(init=False)  # r/m: the decoder's factor
    levels: int = field(init=False)  # L = 2^bits grid points per coordinate
    step: float = field(init=False)  # Delta = 2/(L - 1)
    mean_t2: float = field(init=False)  # E[<V, u>^2], for the per-coordinate variance

    def __post_init__(self) -> None:
        eps0 = check_eps0(self.eps0)
        d = check_int("d", self.d, 2, 2**31)
        radius = check_positive("radius", self.radius)
        bits = check_int("bits", self.bits, 1, MAX_BITS)
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int | float | np.integer | np.floating):
            raise ValueError(f"gamma must be a real number, got {self.gamma!r}")
        gamma = float(self.gamma)
        if not (0.0 <= gamma < 1.0):
            raise ValueError(f"gamma must be in [0, 1), got {gamma}")
        P = float(cap_mass(gamma, d))
        if not P > 1e-250:
            raise ValueError(f"gamma={gamma} leaves a cap of mass {P} in d={d}; use a smaller gamma (e.g. the optimum)")
        # Round on the safe side (module docstring): 1 - p, inflated by 8 ulps to cover its own rounding, is rounded
        # UP to the 2**-53 grid; p = 1 - that is a grid point, so the coin realizes it exactly.
        q = off_cap_probability(eps0, P)
        p_cap = 1.0 - math.ceil(q * (1.0 + 2.0**-50) / UNIFORM_RESOLUTION) * UNIFORM_RESOLUTION
        M = math.exp(float(log_cap_moment(gamma, d)))
        m = M * (p_cap / P - (1.0 - p_cap) / (1.0 - P))  # E<V,u> = p E[t|cap] + (1-p) E[t|off]
        # E[t^2 1{t >= g}] = E[S 1{S >= g^2}]/2 with S ~ Beta(1/2, (d-1)/2): = I^c_{g^2}(3/2, (d-1)/2)/(2d) [derived]
        t2_cap = float(special.betaincc(1.5, (d - 1) / 2.0, gamma * gamma)) / (2.0 * d)
        mean_t2 = p_cap * t2_cap / P + (1.0 - p_cap) * (1.0 / d - t2_cap) / (1.0 - P)
        levels = 2**bits
        for name, value in [
            ("eps0", eps0),
            ("d", d),
            ("radius", radius),
            ("gamma", gamma),
            ("bits", bits),
            ("cap_mass", P),
            ("p_cap", p_cap),
            ("m", m),
            ("scale", radius / m),
            ("levels", levels),
            ("step", 2.0 / (levels - 1)),
            ("mean_t2", mean_t2),
        ]:
            object.__setattr__(self, name, value)

    @property
    def density_ratio(self) -> float:
        """Cap density over off-cap density, (p/P)/((1-p)/(1-P)): at most e^eps0 (equal up to the 2**-53 rounding)."""
        return (self.p_cap / self.cap_mass) / ((1.0 - self.p_cap) / (1.0 - self.cap_mass))

    @property
    def message_format(self) -> MessageFormat:
        return MessageFormat(symbols=self.d, alphabet_size=self.levels, vector=True)


def make_params(
    eps0: float, d: int, radius: float, gamma: float | None = None, bits: int | None = None
) -> PrivUnitParams:
    """Quantized PrivUnit2 parameters. gamma=None: the optimal cap threshold; gamma=0: Duchi et al.'s hemisphere
    mechanism. bits=None: the smallest grid with at most 1% extra variance (`default_bits`)."""
    eps0 = check_eps0(eps0)
    d = check_int("d", d, 2, 2**31)
    return PrivUnitParams(
        eps0,
        d,
        radius,
        optimal_gamma(eps0, d) if gamma is None else gamma,
        default_bits(d) if bits is None else bits,
    )


def _check_X(X: np.ndarray, params: PrivUnitParams) -> tuple[np.ndarray, np.ndarray]:
    X = check_batch(X, params.d)
    norms = np.sqrt(np.einsum("ij,ij->i", X, X))
    check_norm_bound(norms, params.radius, "l_2")
    return X, norms


def _sample_t(cap: np.ndarray, uniform: np.ndarray, params: PrivUnitParams) -> np.ndarray:
    """t = <V, u> from its law truncated to the cap [g, 1] (cap True) or to [-1, g) (cap False), by inverse CDF.

    P[t >= s] = 0.5 I^c_{s^2}(1/2, a) for s >= 0, with a = (d-1)/2 (t^2 ~ Beta(1/2, a), symmetric sign).
    """
    a = (params.d - 1) / 2.0
    P, g = params.cap_mass, params.gamma
    t = np.empty(uniform.shape)
    # cap: P[t >= s | cap] = P(s)/P(g) is uniform on (0, 1]
    level = (1.0 - uniform[cap]) * (2.0 * P)
    t[cap] = np.clip(np.sqrt(special.betainccinv(0.5, a, level)), g, 1.0)
    # off the cap: the CDF level F = P[t <= s] is uniform on [0, 1 - P)
    F = uniform[~cap] * (1.0 - P)
    neg = F < 0.5
    t_off = np.empty(F.shape)
    t_off[neg] = -np.sqrt(special.betainccinv(0.5, a, 2.0 * F[neg]))  # F(s) = 0.5 I^c_{s^2} for s < 0
    t_off[~neg] = np.sqrt(special.betaincinv(0.5, a, 2.0 * F[~neg] - 1.0))  # F(s) = 0.5 + 0.5 I_{s^2} for s >= 0
    t[~cap] = np.clip(t_off, -1.0, g)
    return t


def sample_directions(X: np.ndarray, params: PrivUnitParams, rng: np.random.Generator) -> np.ndarray:
    """The continuous PrivUnit2 output V (unit vectors, shape (k, d)) for a batch X; unbiased: E[(r/m) V] = x.

    Draws 3 uniforms and d normals per user. `encode` quantizes this; use it directly only for analysis.
    """
    X, norms = _check_X(X, params)
    k, d = X.shape
    # pre-step: direction +-x/||x|| with P[+] = (1 + ||x||/r)/2, clamped onto the ball
    u = np.zeros((k, d))
    nz = norms > 0.0
    u[nz] = X[nz] / norms[nz, None]
    u[~nz, 0] = 1.0
    plus = bernoulli(0.5 + 0.5 * np.minimum(norms / params.radius, 1.0), rng)
    u *= np.where(plus, 1.0, -1.0)[:, None]
    cap = bernoulli(np.full(k, params.p_cap), rng)  # p_cap on the grid: realized exactly
    t = _sample_t(cap, rng.random(k), params)
    # w uniform on the sphere orthogonal to u: project a standard Gaussian and normalize
    Z = rng.standard_normal((k, d))
    Z -= np.einsum("ij,ij->i", Z, u)[:, None] * u
    wn = np.sqrt(np.einsum("ij,ij->i", Z, Z))
    bad = wn < 1e-150
    while bad.any():  # probability ~0; redraw only those rows
        Zb = rng.standard_normal((int(bad.sum()), d))
        Zb -= np.einsum("ij,ij->i", Zb, u[bad])[:, None] * u[bad]
        Z[bad], wn[bad] = Zb, np.sqrt(np.einsum("ij,ij->i", Zb, Zb))
        bad = wn < 1e-150
    Z *= (np.sqrt(np.maximum(1.0 - t * t, 0.0)) / wn)[:, None]
    Z += t[:, None] * u
    return Z


def quantize(V: np.ndarray, params: PrivUnitParams, rng: np.random.Generator) -> np.ndarray:
    """Unbiased stochastic rounding of each coordinate of V in [-1, 1] to the grid -1 + i Delta, i in [0, L).

    Uses only V and fresh randomness (post-processing; module docstring). Returns the grid indices.
    """
    pos = np.clip((np.asarray(V, dtype=np.float64) + 1.0) / params.step, 0.0, params.levels - 1.0)
    lo = np.floor(pos)
    idx = lo + (rng.random(pos.shape) < (pos - lo))
    return np.minimum(idx, params.levels - 1).astype(params.message_format.dtype)


def encode(X: np.ndarray, params: PrivUnitParams, rng: np.random.Generator) -> np.ndarray:
    """Randomize a batch X of shape (k, d) with ||x||_2 <= r: (k, d) grid indices in [0, 2^bits)."""
    return quantize(sample_directions(X, params, rng), params, rng)


def validate_messages(messages: np.ndarray, params: PrivUnitParams) -> np.ndarray:
    """Check k received messages (shape (k, d), symbols in [0, 2^bits)); returns them or raises ValueError."""
    return params.message_format.validate(messages)


def decode(messages: np.ndarray, params: PrivUnitParams) -> np.ndarray:
    """(k, d) per-user unbiased estimates y = (r/m)(-1 + i Delta)."""
    idx = validate_messages(messages, params)
    return params.scale * (idx * params.step - 1.0)


def decode_sum(messages: np.ndarray, params: PrivUnitParams) -> np.ndarray:
    """Unbiased estimate of sum_i x_i from exact integer column sums of the indices."""
    idx = validate_messages(messages, params)
    total = idx.sum(axis=0, dtype=np.int64)
    return params.scale * (total * params.step - idx.shape[0])


def decode_mean(messages: np.ndarray, params: PrivUnitParams) -> np.ndarray:
    """Unbiased estimate of mean_i x_i over the k >= 1 messages."""
    return decode_mean_from_sum(messages, params, decode_sum)


def variance(X: np.ndarray, params: PrivUnitParams) -> np.ndarray:
    """(k, d) per-coordinate variances of the UNQUANTIZED estimate (r/m) V [derived]:
    (r/m)^2 [E t^2 u_j^2 + (1 - E t^2)(1 - u_j^2)/(d-1)] - x_j^2, u = x/||x|| (e_1 if x = 0).
    Quantization adds at most (r/m)^2 Delta^2/4 per coordinate."""
    X, norms = _check_X(X, params)
    u2 = np.zeros_like(X)
    nz = norms > 0.0
    u2[nz] = (X[nz] / norms[nz, None]) ** 2
    u2[~nz, 0] = 1.0
    e2 = params.mean_t2
    return params.scale**2 * (e2 * u2 + (1.0 - e2) * (1.0 - u2) / (params.d - 1)) - X**2


def mse(X: np.ndarray, params: PrivUnitParams) -> np.ndarray:
    """(k,) E||(r/m) V - x||^2 = (r/m)^2 - ||x||^2 for the unquantized estimate (spec 001 section 3, ||V|| = 1)."""
    X, norms = _check_X(X, params)
    return params.scale**2 - norms**2


def mse_bound(X: np.ndarray, params: PrivUnitParams) -> np.ndarray:
    """(k,) upper bound on E||decode(encode(x)) - x||^2: (r/m)^2 (1 + d Delta^2/4) - ||x||^2."""
    return mse(X, params) + params.scale**2 * params.d * params.step**2 / 4.0
