"""Binary randomized response (2RR), the eps0-LDP randomizer of seed 001's lower bound (spec 001 section 3, "2RR").

Input: one value x in [0, 1] per user; x in {0, 1} is the classical 2RR on a bit. A fractional x is first rounded
to the bit 1 w.p. x (unbiased), which keeps P[report 1] in [flip, 1 - flip], so the mechanism stays eps0-LDP on
the whole interval. Message: one symbol in {0, 1} (1 bit). Decoder: y = (b - flip)/(1 - 2 flip), unbiased.

The flip probability is 1/(1 + e^eps0) rounded up to the sampler's 2**-53 grid (ldp_common), so the realized
probabilities satisfy the eps0 ratio exactly; the effective epsilon log((1-flip)/flip) is <= eps0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shuffledp.mechanisms.ldp_common import (
    MessageFormat,
    bernoulli,
    check_eps0,
    decode_mean_from_sum,
    realized_probability,
    rr_flip_probability,
    rr_success_probability,
)


@dataclass(frozen=True)
class RRParams:
    """Parameters of 2RR. Only eps0 is free; the rest is derived in __post_init__."""

    eps0: float
    flip: float = field(init=False)  # P[report the other bit], on the 2**-53 grid, >= 1/(1+e^eps0)
    scale: float = field(init=False)  # 1/(1-2 flip) = c(effective_eps0), c(e) = (e^e+1)/(e^e-1) (spec 001 s.3)
    effective_eps0: float = field(init=False)  # log((1-flip)/flip) <= eps0

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps0", check_eps0(self.eps0))
        flip = rr_flip_probability(self.eps0)
        object.__setattr__(self, "flip", flip)
        object.__setattr__(self, "scale", 1.0 / (1.0 - 2.0 * flip))
        object.__setattr__(self, "effective_eps0", math.log((1.0 - flip) / flip))

    @property
    def message_format(self) -> MessageFormat:
        return MessageFormat(symbols=1, alphabet_size=2)


def make_params(eps0: float) -> RRParams:
    """The 2RR parameters for local privacy eps0 in (0, 36]."""
    return RRParams(eps0)


def _check_x(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"x must have shape (k,) (one value per user), got shape {x.shape}")
    if not np.isfinite(x).all() or (x.size and (x.min() < 0.0 or x.max() > 1.0)):
        raise ValueError("x must be in [0, 1] (bits 0/1, or fractions rounded unbiasedly), got values outside it")
    return x


def _p_one(x: np.ndarray, params: RRParams) -> np.ndarray:
    # P[b=1] = x, keep w.p. 1-flip: flip + (1-2flip) x, i.e. the +-1 coin with z = 2x - 1
    return rr_success_probability(2.0 * x - 1.0, params.flip)


def encode(x: np.ndarray, params: RRParams, rng: np.random.Generator) -> np.ndarray:
    """Randomize k values x in [0, 1]: returns k symbols in {0, 1} (uint8), one uniform draw per user."""
    x = _check_x(x)
    return bernoulli(_p_one(x, params), rng).astype(np.uint8)


def exact_output_probabilities(x: np.ndarray, params: RRParams) -> np.ndarray:
    """(k, 2) array: the probabilities of symbols 0 and 1 that `encode` realizes for each x."""
    p1 = realized_probability(_p_one(_check_x(x), params))
    return np.stack([1.0 - p1, p1], axis=1)


def validate_messages(messages: np.ndarray, params: RRParams) -> np.ndarray:
    """Check k received messages (shape (k,), symbols in {0, 1}); returns them as uint8 or raises ValueError."""
    return params.message_format.validate(messages)


def decode(messages: np.ndarray, params: RRParams) -> np.ndarray:
    """Per-user unbiased estimates of x: (b - flip)/(1 - 2 flip)."""
    b = validate_messages(messages, params).astype(np.float64)
    return (b - params.flip) * params.scale


def decode_sum(messages: np.ndarray, params: RRParams) -> float:
    """Unbiased estimate of sum_i x_i, from the count of ones (all the shuffled multiset reveals)."""
    b = validate_messages(messages, params)
    ones = int(np.count_nonzero(b))
    return (ones - b.shape[0] * params.flip) * params.scale


def decode_mean(messages: np.ndarray, params: RRParams) -> float:
    """Unbiased estimate of mean_i x_i over the k >= 1 messages."""
    return decode_mean_from_sum(messages, params, decode_sum)


def variance(x: np.ndarray, params: RRParams) -> np.ndarray:
    """Var[decode(encode(x))] per user = pi(1 - pi) c^2 with pi = P[b=1|x] (derived);
    for x in {0, 1} this is e^eps0/(e^eps0 - 1)^2."""
    p1 = _p_one(_check_x(x), params)
    return p1 * (1.0 - p1) * params.scale**2


def mse(x: np.ndarray, params: RRParams) -> np.ndarray:
    """E[(y - x)^2] per user; equal to `variance` since the decoder is unbiased."""
    return variance(x, params)
