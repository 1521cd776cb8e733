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

from shuffledp.protocols.ldp_common import (
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

# Gather rows of a cached float64 table H[:, :d] when that table is at most this many bytes: at small d the cheapest
# exact way to get <x, H_l>. Beyond it (d > 512) the Kronecker split of `_kron_dots` is faster and needs no table.
_HADAMARD_CACHE_BYTES = 4 * 2**20
# Users go in blocks of at most _CHUNK_ENTRIES entries of X for the work that needs an n x d scratch (small, reused,
# and the block is still in cache for the l_1 norms), and of at most _KRON_CHUNK_ENTRIES per `_kron_dots` call (whose
# temporaries are O(sqrt D) per user, so larger blocks only save per-call overhead).
_CHUNK_ENTRIES = 2**16
_KRON_CHUNK_ENTRIES = 2**18


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


@lru_cache(maxsize=8)
def _hadamard_table(D: int, d: int) -> np.ndarray:
    table = hadamard_rows_popcount(np.arange(D), d)
    table.flags.writeable = False
    return table


def _kron_dots(X: np.ndarray, rows: np.ndarray, D: int) -> np.ndarray:
    """<X[i], H[rows[i], :d]> via H_D = H_M (x) H_B, B = 2^ceil(log2(D)/2), M = D/B: O(sqrt(D)) table work per user.

    With l = lh B + ll and j = jh B + jl, popcount(l & j) = popcount(lh & jh) + popcount(ll & jl), so
    H[l, j] = H[lh, jh] H[ll, jl] and <x, H_l> = sum_jh H[lh, jh] <x[jh B : (jh + 1) B], H[ll, :B]>.
    """
    n, d = X.shape
    b = D.bit_length() // 2  # ceil(log2(D) / 2)
    B = 1 << b
    m, t = divmod(d, B)
    low = hadamard_rows_popcount(rows & (B - 1), B)  # (n, B): H[ll, :B]
    high = hadamard_rows_popcount(rows >> b, m + (t > 0))  # (n, m or m+1): H[lh, jh]; jh < M <= B
    blocks = np.matmul(X[:, : m * B].reshape(n, m, B), low[:, :, None])[:, :, 0]  # (n, m) block dots, one BLAS call
    dots = np.vecdot(blocks, high[:, :m])
    if t:
        dots += high[:, m] * np.vecdot(X[:, m * B :], low[:, :t])
    return dots


def _hadamard_dots(X: np.ndarray, rows: np.ndarray, params: ROneParams, l1: np.ndarray | None = None) -> np.ndarray:
    """<X[i], H[rows[i], :d]> for every user i; if l1 (shape (k,)) is given, it receives ||X[i]||_1 too.

    Users go in blocks; the l_1 norms of a block are taken right after its dot products, while the block is still in
    cache, so X is read from memory about once. Scratch is one reused block of at most _CHUNK_ENTRIES entries.
    """
    k, d = X.shape
    out = np.empty(k)
    sub = max(1, _CHUNK_ENTRIES // d)
    scratch = np.empty((min(k, sub), d))  # reused across blocks: no fresh pages to fault in
    ones = np.ones(d)
    if params.D * d * 8 <= _HADAMARD_CACHE_BYTES:
        table = _hadamard_table(params.D, d)
        for a in range(0, k, sub):
            Xa = X[a : a + sub]
            S = scratch[: Xa.shape[0]]
            np.take(table, rows[a : a + sub], axis=0, out=S, mode="clip")  # rows < D: "clip" only avoids a copy
            np.vecdot(Xa, S, out=out[a : a + sub])
            if l1 is not None:
                np.matmul(np.abs(Xa, out=S), ones, out=l1[a : a + sub])  # BLAS row sums of |X|
        return out
    step = max(sub, _KRON_CHUNK_ENTRIES // d)
    for a in range(0, k, step):
        e = min(a + step, k)
        out[a:e] = _kron_dots(X[a:e], rows[a:e], params.D)
        if l1 is not None:
            for b in range(a, e, sub):
                f = min(b + sub, e)
                np.matmul(np.abs(X[b:f], out=scratch[: f - b]), ones, out=l1[b:f])
    return out


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
    l1 = np.empty(X.shape[0])
    dots = _hadamard_dots(X, rows, params, l1)  # the norm check shares the pass over X
    check_norm_bound(l1, params.radius, "l_1")
    z = dots / params.radius  # clamped to [-1, 1] by rr_success_probability
    plus = bernoulli(rr_success_probability(z, params.flip), rng)
    return (2 * rows + plus).astype(params.message_format.dtype)


def exact_output_probabilities(X: np.ndarray, params: ROneParams) -> np.ndarray:
    """(k, 2D) array: P[symbol s | x] as realized by `encode`; column 2l is (l, -1), column 2l+1 is (l, +1)."""
    X = _check_X(X, params)
    z = X @ _hadamard_table(params.D, params.d).T / params.radius  # (k, D); meant for the small d of tests
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
