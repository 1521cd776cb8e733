"""Gaussian noise that is exact on a grid: the discrete Gaussian (Canonne, Kamath & Steinke 2020, "CKS20").

Why: textbook floating-point Gaussian samplers leak the noiseless value through the low-order bits of the noisy
output (Mironov 2012). Here the released vector is  g * (round(x / g) + Z),  Z_i iid DG(s2) on the integers,
P(Z = z) proportional to exp(-z^2 / (2 s2)), with g a power of two: every output is an exact float multiple of g
whatever x was, and Z is sampled EXACTLY, from integer arithmetic only (CKS20 Alg 1-3), with all randomness from
the injected generator (shuffledp.security.rng: AES-CTR or ChaCha20). numpy's ``integers`` is an unbiased (rejection)
integer
sampler; wider ranges are built here from whole 64-bit words with rejection, so every probability below is exact.

Privacy (what the ledger may keep assuming). The ledger charges a Gaussian of std sigma on a query of l2
sensitivity D, through its RDP curve only (accountants.gaussian.conversion("discrete")). Rounding x to the grid
moves each coordinate by at most g/2, so the rounded query's sensitivity is at most D' = D + g ceil(sqrt(d))
(triangle inequality; deterministic rounding, no extra delta, cf. the conditional rounding of Kairouz, Liu &
Steinke 2021 which is per user). In grid units the shift is an integer vector of norm <= D'/g, and for integer
shifts the discrete Gaussian's Renyi divergence of every order alpha is at most the continuous one's:
D_alpha(DG(mu, s2) || DG(nu, s2)) <= alpha (mu - nu)^2 / (2 s2) (CKS20 Prop 5; the coordinates are independent, so
divergences add, CKS20 Thm 14). We take s2 = ceil((sigma D' / (D g))^2), i.e. the noise std raised by the factor
D'/D, so that alpha D'^2 / (2 g^2 s2) <= alpha D^2 / (2 sigma^2): the released vector satisfies, at every order,
the Renyi DP of the continuous Gaussian at std sigma. Every bound derived from that RDP curve (composition, RDP ->
(eps, delta), subsampling bounds proven for any mechanism with a given RDP curve) holds as is; the exact (eps,
delta) curve / PLD of the continuous Gaussian, and dp_accounting's sampled-Gaussian bounds, are NOT implied by this
argument, so the ledger does not use them for this noise.

Noise kind (the `noise` key of the protocol's table, issue 24 D19): a plan's params["noise"] is "discrete" (this
module) or "continuous" (numpy's float Gaussian, for the figures proven only for it: Poisson-sampled DP-SGD); a plan
without the key adds, and is charged for, the discrete noise (the larger figure). Specs carry it in
randomizer.extra[SPEC_KEY].

Grid: by default g is the largest power of two <= 2^-20 D / ceil(sqrt(d)), so the noise grows by a factor of at
most 1 + 2^-20 (utility unchanged) and sigma / g >= 2^20 z ceil(sqrt d) (z = sigma / D): the discreteness is far
below the noise (for s2 >= 1 the discrete Gaussian's variance is within a relative 1e-8 of s2 and below it,
CKS20 Prop 19 / Cor 9). When z > 2^12 / ceil(sqrt d), g is set by the noise instead (g ~ 2^-32 sigma, so the
sampler's integers stay below 2^34), and when z < 2^4 / ceil(sqrt d) by g <= 2^-16 sigma (so the grid stays far
below the noise); the inflation g ceil(sqrt d) / D is still paid for either way.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

__all__ = [
    "NOISES",
    "SPEC_KEY",
    "noise_of",
    "spec_noise",
    "GRID_BITS",
    "bernoulli_exp",
    "discrete_laplace",
    "sample_discrete_gaussian",
    "default_granularity",
    "granularity",
    "round_to_grid",
    "grid_variance",
    "grid_noise",
    "release_on_grid",
]

NOISES = ("discrete", "continuous")
SPEC_KEY = "discrete_noise"  # RoundSpec.randomizer.extra: 1.0 discrete, 0.0 continuous (absent: discrete)
GRID_BITS = 20  # default g <= 2^-GRID_BITS D / ceil(sqrt d): the rounding raises the noise by <= 2^-20
_EXACT_FLOAT = 2**53  # integers up to this are exact in float64; multiples of a power of two g stay exact
_INT64_SAFE = 2**62


def noise_of(params: dict) -> str:
    """The noise a plan's rounds add (module docstring): params["noise"], "discrete" when absent."""
    noise = params.get("noise", "discrete")
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    return noise


def spec_noise(extra: dict) -> str:
    """The noise a round spec declares (randomizer.extra[SPEC_KEY]); absent = discrete, so that a node never
    charges the continuous figure for a round whose noise may be discrete."""
    v = extra.get(SPEC_KEY, 1.0)
    if v not in (0.0, 1.0):
        raise ValueError(f"the spec's {SPEC_KEY} must be 0 or 1, got {v!r}")
    return "discrete" if v == 1.0 else "continuous"


def plan_noise(noise: str | None, proven_for_discrete: bool = True, default: str = "discrete") -> str:
    """The noise a new plan adds: the protocol's `noise` key when set, else its default ("discrete" where the ledger's
    figure for it is proven and as tight, "continuous" where it is not); "discrete" where no figure is proven for it
    is refused in one line."""
    if noise is None:
        return default if proven_for_discrete else "continuous"
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    if noise == "discrete" and not proven_for_discrete:
        raise ValueError(
            'noise = "discrete" has no proven accountant with schedule.sampling = "poisson" (dp_accounting\'s '
            'sampled-Gaussian bounds assume continuous noise): use noise = "continuous" or a fixed cohort'
        )
    return noise


def _ceil_sqrt(d: int) -> int:
    return math.isqrt(d - 1) + 1 if d > 0 else 0


# --------------------------------------------------------------------------------------- exact integer draws
def _uniform_below(m: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """U_i uniform on {0, ..., m_i - 1}, exactly, for positive integers m (int64 or object arrays of ints)."""
    m = np.asarray(m)
    if m.size == 0:
        return np.zeros(0, dtype=np.int64)
    top = int(m.max())
    if top <= _INT64_SAFE:
        return rng.integers(0, m.astype(np.int64))  # unbiased (numpy's masked/Lemire rejection)
    big = m.astype(object)
    bits = np.array([int(v).bit_length() for v in big], dtype=np.int64)
    words = (int(bits.max()) + 63) // 64
    out = np.empty(m.shape, dtype=object)
    todo = np.arange(m.size)
    while todo.size:
        raw = rng.integers(0, 2**64, size=(words, todo.size), dtype=np.uint64, endpoint=False)
        u = np.zeros(todo.size, dtype=object)
        for w in range(words):
            u = u + (raw[w].astype(object) << (64 * w))
        u = u >> (64 * words - bits[todo]).astype(object)  # uniform on [0, 2^bits): then reject >= m
        ok = u < big[todo]
        out[todo[ok]] = u[ok]
        todo = todo[~ok]  # accepted with probability > 1/2 each pass
    return out


def _bernoulli_exp_unit(num: np.ndarray, den: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num/den <= 1 (CKS20 Alg 1): K <- 1; while Bernoulli(gamma/K): K += 1;
    output [K odd]. P[K odd] = sum_k (-gamma)^k / k! = exp(-gamma)."""
    n = num.shape[0]
    out = np.zeros(n, dtype=bool)
    k = np.ones(n, dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        a = _uniform_below(den[todo] * k[todo], rng) < num[todo]  # Bernoulli(gamma / K), exact
        stop = todo[~a]
        out[stop] = (k[stop] % 2) == 1
        todo = todo[a]
        k[todo] += 1
    return out


def bernoulli_exp(num: np.ndarray, den: np.ndarray | int, rng: np.random.Generator) -> np.ndarray:
    """Bernoulli(exp(-num_i / den_i)) exactly, for integers num >= 0, den >= 1 (CKS20 Alg 1): floor(gamma)
    Bernoulli(exp(-1)) trials, then one of exp(-frac(gamma)); all must succeed."""
    num = np.asarray(num)
    den = np.broadcast_to(np.asarray(den), num.shape)
    if num.size and (num.min() < 0 or den.min() < 1):
        raise ValueError("bernoulli_exp needs integers num >= 0 and den >= 1")
    if num.size and den.dtype != object and int(den.max()) > 2**40:
        den = den.astype(object)  # den * K must not wrap around in int64 (Alg 1's Bernoulli(gamma / K))
    whole, frac = num // den, num % den
    alive = np.ones(num.shape[0], dtype=bool)
    left = whole.copy()
    todo = np.flatnonzero(left > 0)
    one = np.ones(1, dtype=np.int64)
    while todo.size:
        hit = _bernoulli_exp_unit(np.broadcast_to(one, todo.shape), np.broadcast_to(one, todo.shape), rng)
        alive[todo[~hit]] = False
        left[todo] -= 1
        todo = todo[hit & (left[todo] > 0)]
    todo = np.flatnonzero(alive)
    alive[todo] = _bernoulli_exp_unit(frac[todo], den[todo], rng)
    return alive


def _geometric_exp1(n: int, rng: np.random.Generator) -> np.ndarray:
    """V = number of successes of Bernoulli(exp(-1)) before the first failure: P(V = v) = e^-v (1 - e^-1)."""
    v = np.zeros(n, dtype=np.int64)
    todo = np.arange(n)
    one = np.ones(1, dtype=np.int64)
    while todo.size:
        hit = _bernoulli_exp_unit(np.broadcast_to(one, todo.shape), np.broadcast_to(one, todo.shape), rng)
        todo = todo[hit]
        v[todo] += 1
    return v


def discrete_laplace(t: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n iid draws of the discrete Laplace of scale t, P(x) proportional to exp(-|x| / t) (CKS20 Alg 2, s = 1)."""
    if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 1 <= t <= 2**40:
        raise ValueError(f"the discrete Laplace scale must be an integer in [1, 2^40], got {t!r}")
    t = int(t)
    out = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        m = todo.size
        u = rng.integers(0, t, size=m)
        d = bernoulli_exp(u, t, rng)  # accept U with probability exp(-U / t)
        v = _geometric_exp1(m, rng)
        if int(v.max(initial=0)) >= _INT64_SAFE // t:  # probability < exp(-2^22): refuse rather than overflow
            raise OverflowError("discrete Laplace draw beyond int64")
        x = u + t * v
        neg = rng.integers(0, 2, size=m) == 1
        ok = d & ~(neg & (x == 0))  # -0 is rejected so that 0 is not counted twice
        out[todo[ok]] = np.where(neg, -x, x)[ok]
        todo = todo[~ok]
    return out


def sample_discrete_gaussian(s2: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n iid draws of DG(s2) on the integers, P(z) proportional to exp(-z^2 / (2 s2)), s2 a positive integer
    (CKS20 Alg 3): Y ~ discrete Laplace of scale t = floor(sqrt s2) + 1, accepted with probability
    exp(-(|Y| - s2/t)^2 / (2 s2)) = exp(-(|Y| t - s2)^2 / (2 s2 t^2)), a ratio of integers."""
    if isinstance(s2, bool) or not isinstance(s2, int | np.integer) or not 1 <= s2 <= 2**78:
        raise ValueError(f"the discrete Gaussian's variance parameter must be an integer in [1, 2^78], got {s2!r}")
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    s2 = int(s2)
    t = math.isqrt(s2) + 1
    den = 2 * s2 * t * t
    out = np.empty(int(n), dtype=np.int64)
    todo = np.arange(int(n))
    while todo.size:
        y = discrete_laplace(t, todo.size, rng)
        a = np.abs(y).astype(object) * t - s2
        ok = bernoulli_exp(a * a, den, rng)
        out[todo[ok]] = y[ok]
        todo = todo[~ok]
    return out


# ------------------------------------------------------------------------------------------------ the grid
def default_granularity(std: float, sensitivity: float, d: int) -> float:
    """The largest power of two <= min(max(2^-GRID_BITS D / ceil(sqrt d), 2^-32 std), 2^-16 std) (module
    docstring): 2^-32 std keeps std / g <= 2^33 (the sampler's integers small) when the noise is huge against D,
    2^-16 std keeps the grid far below the noise when the noise is tiny against D."""
    s, c = float(std), float(sensitivity)
    if not (math.isfinite(c) and c > 0.0 and math.isfinite(s) and s >= 0.0):
        raise ValueError(f"need std >= 0 and sensitivity > 0 finite, got {std!r}, {sensitivity!r}")
    if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1:
        raise ValueError(f"d must be an integer >= 1, got {d!r}")
    target = max(c / _ceil_sqrt(int(d)) / 2**GRID_BITS, s / 2**32)
    if s > 0.0:
        target = min(target, s / 2**16)
    return math.ldexp(1.0, math.floor(math.log2(target)))


def _grid(std: float, sensitivity: float, d: int, granularity: float | None) -> float:
    if granularity is None:
        return default_granularity(std, sensitivity, d)
    g = float(granularity)
    if not (math.isfinite(g) and g > 0.0 and math.frexp(g)[0] == 0.5):
        raise ValueError(f"granularity must be a positive power of two (exact float grid), got {granularity!r}")
    return g


def grid_variance(std: float, sensitivity: float, d: int, granularity: float) -> int:
    """s2 = ceil((std D' / (D g))^2) with D' = D + g ceil(sqrt d): DG(s2) on the grid g has, for the rounded query,
    at most the continuous Gaussian's RDP at std and sensitivity D (module docstring). Exact rational arithmetic,
    rounded up: never less noise than that."""
    s, c, g = Fraction(float(std)), Fraction(float(sensitivity)), Fraction(float(granularity))
    if not (s > 0 and c > 0 and g > 0):
        raise ValueError("std, sensitivity and granularity must be > 0")
    ratio = s * (c + g * _ceil_sqrt(int(d))) / (c * g)
    return max(1, math.ceil(ratio * ratio))


def granularity(params: dict, std: float, sensitivity: float, d: int) -> float:
    """The run's grid: params["granularity"] when the plan sets one (a power of two), else the default."""
    return _grid(std, sensitivity, int(d), params.get("granularity"))


def grid_noise(
    shape: int | tuple[int, ...],
    std: float,
    sensitivity: float,
    rng: np.random.Generator,
    granularity: float | None = None,
    d: int | None = None,
    noise: str = "discrete",
) -> np.ndarray:
    """g * DG(s2) noise of the given shape (exact multiples of g in float64), s2 = grid_variance(std, D, d, g),
    for a query of d coordinates (default: the shape's size) whose inputs are rounded to the same grid.
    std = 0 gives zeros. noise = "continuous": std * N(0, I) in floating point instead (module docstring)."""
    n = int(np.prod(shape))
    dim = n if d is None else int(d)
    if float(std) == 0.0:
        return np.zeros(shape)
    if noise == "continuous":
        return float(std) * rng.standard_normal(shape)
    g = _grid(std, sensitivity, max(dim, 1), granularity)
    z = sample_discrete_gaussian(grid_variance(std, sensitivity, max(dim, 1), g), n, rng)
    if n and int(np.abs(z).max()) >= _EXACT_FLOAT:
        raise ValueError(f"granularity {g} is too fine for std {std}: the noise leaves float64's exact integers")
    return (z.astype(np.float64) * g).reshape(shape)


def round_to_grid(x: np.ndarray, granularity: float) -> np.ndarray:
    """x rounded (to nearest, ties to even) to multiples of the power of two g: exact in float64."""
    k = np.rint(np.asarray(x, dtype=np.float64) / granularity)
    if k.size and not np.all(np.abs(k) < _EXACT_FLOAT):
        raise ValueError(f"granularity {granularity} is too fine for these values (beyond 2^53 grid steps)")
    return k * granularity


def release_on_grid(
    x: np.ndarray,
    std: float,
    sensitivity: float,
    rng: np.random.Generator,
    granularity: float | None = None,
    noise: str = "discrete",
) -> np.ndarray:
    """round_g(x) + g DG(s2): the discrete Gaussian mechanism replacing x + N(0, std^2 I) for a query x (each row
    of x one query of d = x.shape[-1] coordinates) of l2 sensitivity at least `sensitivity` (module docstring;
    the ledger's continuous-Gaussian RDP at std covers it). A smaller `sensitivity` than the query's is safe: it
    only inflates the noise more. noise = "continuous": x + std N(0, I) in floating point (module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("the noised query must contain only finite values")
    if noise == "continuous":
        return x + float(std) * rng.standard_normal(x.shape)
    d = max(int(x.shape[-1]) if x.ndim else 1, 1)  # one query per row (e.g. one machine's message each)
    g = _grid(std, sensitivity, d, granularity)
    out = round_to_grid(x, g) + grid_noise(x.shape, std, sensitivity, rng, g, d)
    if out.size and not np.all(np.abs(out) < _EXACT_FLOAT * g):
        raise ValueError(f"granularity {g} is too fine: the release leaves float64's exact grid")
    return out
