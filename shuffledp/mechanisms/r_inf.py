"""R_inf: the eps0-LDP randomizer for the l_inf ball of radius r in R^d (spec 001 section 3, after [GDD+21b]).

Mechanism (spec 001 section 3): draw j ~ Unif[d]; b = +1 w.p. (1 + x_j/r)/2, else -1; keep b w.p. e^eps0/(1+e^eps0),
else flip it; send (j, b'). We draw b' with ONE coin of success probability
    P[b' = +1 | j] = flip + (1 - 2 flip)(1 + x_j/r)/2 = 1/2 + x_j/(2 r c),
which is the same output distribution. Message: the symbol s = 2j + [b' = +1] in [0, 2d), i.e. ceil(log2 d) + 1 bits.
Decoder: y = d r c b' e_j with c = 1/(1 - 2 flip) = c(eps0) (spec 001 section 3), unbiased.

Privacy: P[(j, s) | x] = P[b' = s | j]/d lies in [flip/d, (1 - flip)/d] for every x in the ball, and the flip
probability is chosen on the sampler's grid (ldp_common) so that (1 - flip)/flip <= e^eps0 holds for the
realized probabilities; the ratio is attained by x_j = r versus x_j = -r.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from shuffledp.mechanisms import _ldp_kernels
from shuffledp.mechanisms.ldp_common import (
    NORM_RTOL,
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


@dataclass(frozen=True)
class RInfParams:
    """Parameters of R_inf: eps0, dimension d and l_inf radius r are free; the rest is derived."""

    eps0: float
    d: int
    radius: float
    flip: float = field(init=False)  # RR flip probability on the 2**-53 grid, >= 1/(1+e^eps0)
    scale: float = field(init=False)  # c = 1/(1 - 2 flip) = (e^eps0+1)/(e^eps0-1) up to the grid rounding

    def __post_init__(self) -> None:
        init_ball_rr_params(self, d_max=2**31)

    @property
    def message_format(self) -> MessageFormat:
        return MessageFormat(symbols=1, alphabet_size=2 * self.d)


def make_params(eps0: float, d: int, radius: float) -> RInfParams:
    """R_inf parameters for eps0 in (0, 36], d >= 1 and l_inf radius > 0."""
    return RInfParams(eps0, d, radius)


def _check_X(X: np.ndarray, params: RInfParams) -> np.ndarray:
    """X as a (k, d) float batch whose rows are finite and in the l_inf ball (slack NORM_RTOL), else ValueError.

    One pass in C (_ldp_kernels.rows_over) finds rows with an entry above the bound or NaN; only then does numpy
    compute the norms, to name the first offending row.
    """
    X = check_batch(X, params.d)
    over = np.empty(X.shape[0], dtype=bool)
    bound = min(params.radius * (1.0 + NORM_RTOL), sys.float_info.max)  # finite: inf entries are "over" too
    _ldp_kernels.rows_over(np.ascontiguousarray(X), over, params.d, bound)
    if over.any():
        check_norm_bound(np.abs(X).max(axis=1), params.radius, "l_inf")  # raises: same bound, names the row
        raise AssertionError("rows_over flagged a row that numpy finds inside the l_inf ball")
    return X


def encode(X: np.ndarray, params: RInfParams, rng: np.random.Generator) -> np.ndarray:
    """Randomize a batch X of shape (k, d) into k symbols 2j + [b' = +1] in [0, 2d).

    Draws 1 integer and 1 uniform per user.
    """
    X = _check_X(X, params)
    k = X.shape[0]
    j = rng.integers(0, params.d, size=k)  # exactly uniform (numpy rejects the biased tail)
    z = X[np.arange(k), j] / params.radius
    plus = bernoulli(rr_success_probability(z, params.flip), rng)
    return (2 * j + plus).astype(params.message_format.dtype)


def exact_output_probabilities(X: np.ndarray, params: RInfParams) -> np.ndarray:
    """(k, 2d) array: P[symbol s | x] as realized by `encode`; column 2j is (j, -1), column 2j+1 is (j, +1)."""
    X = _check_X(X, params)
    p_plus = realized_probability(rr_success_probability(X / params.radius, params.flip))
    return signed_symbol_probabilities(p_plus, params.d)


def validate_messages(messages: np.ndarray, params: RInfParams) -> np.ndarray:
    """Check k received messages (shape (k,), symbols in [0, 2d)); returns them or raises ValueError."""
    return params.message_format.validate(messages)


def _split(messages: np.ndarray, params: RInfParams) -> tuple[np.ndarray, np.ndarray]:
    s = validate_messages(messages, params).astype(np.int64)
    return s >> 1, 2.0 * (s & 1) - 1.0  # coordinate j, sign b' in {-1, +1}


def decode(messages: np.ndarray, params: RInfParams) -> np.ndarray:
    """(k, d) per-user unbiased estimates y = d r c b' e_j."""
    j, sign = _split(messages, params)
    y = np.zeros((j.shape[0], params.d))
    y[np.arange(j.shape[0]), j] = params.d * params.radius * params.scale * sign
    return y


def decode_sum(messages: np.ndarray, params: RInfParams) -> np.ndarray:
    """Unbiased estimate of sum_i x_i, in O(k + d) from the signed histogram of the symbols."""
    j, sign = _split(messages, params)
    return params.d * params.radius * params.scale * np.bincount(j, weights=sign, minlength=params.d)


def decode_mean(messages: np.ndarray, params: RInfParams) -> np.ndarray:
    """Unbiased estimate of mean_i x_i over the k >= 1 messages."""
    return decode_mean_from_sum(messages, params, decode_sum)


def variance(X: np.ndarray, params: RInfParams) -> np.ndarray:
    """(k, d) per-coordinate variances Var[y_i] = d r^2 c^2 - x_i^2 [derived from spec 001 section 3]."""
    X = _check_X(X, params)
    return params.d * (params.radius * params.scale) ** 2 - X**2


def mse(X: np.ndarray, params: RInfParams) -> np.ndarray:
    """(k,) E||y - x||^2 = d^2 r^2 c^2 - ||x||_2^2 (spec 001 section 3, R_inf)."""
    X = _check_X(X, params)
    return (params.d * params.radius * params.scale) ** 2 - np.einsum("ij,ij->i", X, X)
