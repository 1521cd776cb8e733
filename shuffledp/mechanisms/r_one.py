"""R_1: the eps0-LDP randomizer for the l_1 ball of radius r in R^d, via the Hadamard basis (spec 001 section 3).

Mechanism (spec 001 section 3, [recon] of [GDD+21b]): w.p. |x_j|/r pick (j, u = sign x_j), with the remaining
probability 1 - ||x||_1/r pick j ~ Unif[d] and u ~ Unif{+-1}; pad to D = 2^ceil(log2 d), draw l ~ Unif[D],
b = u H[l, j] (H the +-1 Sylvester matrix, H[l, j] = (-1)^popcount(l & j)), then randomized response on b.
Send (l, b'). Given l, E[b | l] = sum_j (x_j/r) H[l, j] = <x, H_l>/r (the uniform branch has mean 0), so
    P[b' = +1 | l] = flip + (1 - 2 flip)(1 + <x, H_l>/r)/2 = 1/2 + <x, H_l>/(2 r c).
We sample exactly this: l ~ Unif[D] and ONE coin, which is the same output distribution with 2 draws per user.
Message: the symbol s = 2l + [b' = +1] in [0, 2D), i.e. ceil(log2 d) + 1 bits.
Decoder: y = r c b' H[l, :d]; unbiased because (1/D) sum_l H[l, i] H[l, j] = [i = j].

Privacy: |<x, H_l>| <= ||x||_1 <= r, so P[(l, s) | x] = P[b' = s | l]/D lies in [flip/D, (1 - flip)/D] with
(1 - flip)/flip <= e^eps0 for the realized probabilities (ldp_common); attained by x = r e_1 versus -r e_1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from shuffledp.mechanisms import _ldp_kernels
from shuffledp.mechanisms.ldp_common import (
    MessageFormat,
    bernoulli,
    check_batch,
    check_norm_bound,
    decode_mean_from_sum,
    init_ball_rr_params,
    realized_probability,
    rr_success_probability,
    signed_symbol_probabilities,
)

# The kernel splits H_D = H_M (x) H_B with B = 2^b <= 2^_LOW_BITS: its table H_B (<= 512 KB) stays in cache.
_LOW_BITS = 8


@dataclass(frozen=True)
class ROneParams:
    """Parameters of R_1: eps0, dimension d and l_1 radius r are free; the rest is derived."""

    eps0: float
    d: int
    radius: float
    D: int = field(init=False)  # Hadamard size 2^ceil(log2 d)
    flip: float = field(init=False)  # RR flip probability on the 2**-53 grid, >= 1/(1+e^eps0)
    scale: float = field(init=False)  # c = 1/(1 - 2 flip)

    def __post_init__(self) -> None:
        init_ball_rr_params(self, d_max=2**30)
        object.__setattr__(self, "D", 1 << (self.d - 1).bit_length())

    @property
    def message_format(self) -> MessageFormat:
        return MessageFormat(symbols=1, alphabet_size=2 * self.D)


def make_params(eps0: float, d: int, radius: float) -> ROneParams:
    """R_1 parameters for eps0 in (0, 36], d >= 1 and l_1 radius > 0."""
    return ROneParams(eps0, d, radius)


def hadamard_rows_popcount(rows: np.ndarray, d: int) -> np.ndarray:
    """H[rows, :d] of the Sylvester matrix, as float64 +-1: (-1)^popcount(l & j)."""
    parity = np.bitwise_count(np.asarray(rows, dtype=np.int64)[:, None] & np.arange(d, dtype=np.int64)) & 1
    return 1.0 - 2.0 * parity


@lru_cache(maxsize=16)
def _low_table(b: int) -> np.ndarray:
    table = hadamard_rows_popcount(np.arange(1 << b), 1 << b)
    table.flags.writeable = False
    return table


def _hadamard_dots(
    X: np.ndarray, rows: np.ndarray, params: ROneParams, *, portable: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(<X[i], H[rows[i], :d]>, ||X[i]||_1) for every user i, in one pass over X (_ldp_kernels.hadamard_dots_l1).

    The norm is NaN or inf for a row that is not finite. portable=True forces the kernel's non-AVX2 build (tests).
    """
    k, d = X.shape
    b = min(params.D.bit_length() - 1, _LOW_BITS)
    dots, l1 = np.empty(k), np.empty(k)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    _ldp_kernels.hadamard_dots_l1(np.ascontiguousarray(X), rows, _low_table(b), dots, l1, d, b, portable)
    return dots, l1


def fwht(v: np.ndarray) -> np.ndarray:
    """Unnormalized fast Walsh-Hadamard transform H v of a length-2^m vector (H Sylvester, symmetric)."""
    v = np.array(v, dtype=np.float64)
    n = v.shape[0]
    if n & (n - 1):
        raise ValueError(f"fwht needs a length that is a power of 2, got {n}")
    h = 1
    while h < n:
        w = v.reshape(-1, 2, h)
        v = np.stack([w[:, 0] + w[:, 1], w[:, 0] - w[:, 1]], axis=1).reshape(n)
        h *= 2
    return v


def _check_X(X: np.ndarray, params: ROneParams) -> np.ndarray:
    X = check_batch(X, params.d)
    check_norm_bound(np.abs(X).sum(axis=1), params.radius, "l_1")
    return X


def encode(X: np.ndarray, params: ROneParams, rng: np.random.Generator) -> np.ndarray:
    """Randomize a batch X of shape (k, d) into k symbols 2l + [b' = +1] in [0, 2D).

    Draws 1 integer and 1 uniform per user. A row outside the l_1 ball (or not finite) raises ValueError after the
    row draw and before any coin, i.e. before anything depends on X.
    """
    X = check_batch(X, params.d)
    rows = rng.integers(0, params.D, size=X.shape[0])
    dots, l1 = _hadamard_dots(X, rows, params)  # the norm check shares the pass over X
    check_norm_bound(l1, params.radius, "l_1")
    z = dots / params.radius  # clamped to [-1, 1] by rr_success_probability
    plus = bernoulli(rr_success_probability(z, params.flip), rng)
    return (2 * rows + plus).astype(params.message_format.dtype)


def exact_output_probabilities(X: np.ndarray, params: ROneParams) -> np.ndarray:
    """(k, 2D) array: P[symbol s | x] as realized by `encode`; column 2l is (l, -1), column 2l+1 is (l, +1)."""
    X = _check_X(X, params)
    H = hadamard_rows_popcount(np.arange(params.D), params.d)  # (D, d); meant for the small d of tests
    z = X @ H.T / params.radius
    p_plus = realized_probability(rr_success_probability(z, params.flip))
    return signed_symbol_probabilities(p_plus, params.D)


def validate_messages(messages: np.ndarray, params: ROneParams) -> np.ndarray:
    """Check k received messages (shape (k,), symbols in [0, 2D)); returns them or raises ValueError."""
    return params.message_format.validate(messages)


def _split(messages: np.ndarray, params: ROneParams) -> tuple[np.ndarray, np.ndarray]:
    s = validate_messages(messages, params).astype(np.int64)
    return s >> 1, 2.0 * (s & 1) - 1.0  # Hadamard row l, sign b' in {-1, +1}


def decode(messages: np.ndarray, params: ROneParams) -> np.ndarray:
    """(k, d) per-user unbiased estimates y = r c b' H[l, :d]."""
    rows, sign = _split(messages, params)
    return (params.radius * params.scale * sign)[:, None] * hadamard_rows_popcount(rows, params.d)


def decode_sum(messages: np.ndarray, params: ROneParams) -> np.ndarray:
    """Unbiased estimate of sum_i x_i in O(k + D log D): r c (H v)[:d] with v the signed histogram over rows."""
    rows, sign = _split(messages, params)
    v = np.bincount(rows, weights=sign, minlength=params.D)
    return params.radius * params.scale * fwht(v)[: params.d]


def decode_mean(messages: np.ndarray, params: ROneParams) -> np.ndarray:
    """Unbiased estimate of mean_i x_i over the k >= 1 messages."""
    return decode_mean_from_sum(messages, params, decode_sum)


def variance(X: np.ndarray, params: ROneParams) -> np.ndarray:
    """(k, d) per-coordinate variances Var[y_i] = r^2 c^2 - x_i^2 (|y_i| = r c always) [derived]."""
    X = _check_X(X, params)
    return (params.radius * params.scale) ** 2 - X**2


def mse(X: np.ndarray, params: ROneParams) -> np.ndarray:
    """(k,) E||y - x||^2 = d r^2 c^2 - ||x||_2^2 (spec 001 section 3, R_1)."""
    X = _check_X(X, params)
    return params.d * (params.radius * params.scale) ** 2 - np.einsum("ij,ij->i", X, X)
