"""Logic shared by the single-message eps0-LDP randomizers of seed 001 (rr, r_inf, r_one, privunit).

* Parameter checks that raise ValueError naming the parameter, its value and the allowed range.
* An exactly-private binary randomized-response coin for numpy's float64 uniform sampler.
* `MessageFormat`: the fixed length and alphabet of a randomizer's messages, their validation (for the shuffler
  and the analyzer) and their fixed-width byte encoding (for sealing).

Why the coin is special. numpy's `Generator.random()` returns k * 2**-53 with k uniform on [0, 2**53), so
`rng.random() < pi` is true with probability ceil(pi * 2**53) / 2**53, not pi. We therefore choose the flip
probability of randomized response ON that grid (rounded up from 1/(1+e^eps0), so never below it) and clamp every
success probability into [flip, 1 - flip], whose ends are grid points. The probabilities the sampler actually
realizes then lie in [flip, 1 - flip] and their ratio is at most (1 - flip)/flip <= e^eps0: the eps0-LDP guarantee
holds for the floating-point implementation, not only for real numbers. `realized_probability` returns these
realized probabilities, so the privacy-ratio tests check the sampler as implemented.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mpmath
import numpy as np

# numpy Generator.random() for float64 returns (next_uint64 >> 11) * 2**-53.
UNIFORM_RESOLUTION = 2.0**-53
# Inputs may exceed the norm bound by this relative amount (floating-point clipping leaves ~1 ulp); they are then
# clamped onto the ball, so the privacy guarantee never depends on this tolerance.
NORM_RTOL = 1e-9
# Above this eps0 the flip probability 1/(1+e^eps0) falls below the sampler's resolution 2**-53 and randomized
# response cannot be realized exactly; nobody needs a local eps0 this large.
MAX_EPS0 = 36.0


def check_eps0(eps0: float) -> float:
    """eps0 must be a finite real in (0, MAX_EPS0]."""
    if isinstance(eps0, bool) or not isinstance(eps0, int | float | np.integer | np.floating):
        raise ValueError(f"eps0 must be a real number, got {eps0!r}")
    eps0 = float(eps0)
    if not (0.0 < eps0 <= MAX_EPS0):
        raise ValueError(f"eps0 must be in (0, {MAX_EPS0}], got {eps0}")
    return eps0


def check_int(name: str, value: int, minimum: int, maximum: int | None = None) -> int:
    """An integer parameter in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        upper = "inf)" if maximum is None else f"{maximum}]"
        raise ValueError(f"{name} must be in [{minimum}, {upper}, got {value}")
    return value


def check_positive(name: str, value: float) -> float:
    """A finite real parameter > 0 (e.g. a radius)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return value


def check_batch(X: np.ndarray, d: int, name: str = "X") -> np.ndarray:
    """A float batch of shape (k, d), one row per user.

    Finiteness is checked by `check_norm_bound` (every norm propagates NaN and inf), which saves a pass over X.
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[1] != d:
        raise ValueError(f"{name} must have shape (k, {d}) (one row per user), got shape {X.shape}")
    return X


def check_norm_bound(norms: np.ndarray, radius: float, norm_name: str) -> None:
    """Every row norm must be finite and <= radius (with relative slack NORM_RTOL)."""
    if not norms.size:
        return
    if not np.isfinite(norms).all():
        i = int(np.argmin(np.isfinite(norms)))
        raise ValueError(f"row {i} of X must be finite (found NaN or inf)")
    if float(norms.max()) > radius * (1.0 + NORM_RTOL):
        i = int(np.argmax(norms))
        raise ValueError(
            f"row {i} of X has {norm_name} norm {float(norms[i])!r} > radius {radius!r}; "
            f"allowed range is [0, radius] (clip inputs before randomizing)"
        )


def rr_flip_probability(eps0: float) -> float:
    """The probability that randomized response reports the other bit, on the sampler's 2**-53 grid.

    It is the smallest grid point >= 1/(1 + e^eps0), checked in 50-digit arithmetic, so that
    (1 - flip)/flip <= e^eps0 holds exactly (module docstring). The relative excess over the real-number value is
    at most 2**-53 (1 + e^eps0), i.e. below 1e-12 for eps0 <= 10.
    """
    eps0 = check_eps0(eps0)
    flip = math.ceil(2.0**53 / (1.0 + math.exp(eps0))) * UNIFORM_RESOLUTION
    with mpmath.workdps(50):
        bound = mpmath.exp(mpmath.mpf(eps0))
        while (1 - mpmath.mpf(flip)) / mpmath.mpf(flip) > bound:  # float rounding went the unsafe way
            flip += UNIFORM_RESOLUTION
    return flip


def rr_success_probability(z: np.ndarray, flip: float) -> np.ndarray:
    """P[report +1] = flip + (1 - 2 flip)(1 + z)/2 for z in [-1, 1], clamped into [flip, 1 - flip].

    This is "b = +1 w.p. (1+z)/2, then keep b w.p. 1 - flip" (spec 001 section 3, R_inf) in one coin.
    """
    z = np.clip(z, -1.0, 1.0)
    return np.clip(0.5 + (0.5 - flip) * z, flip, 1.0 - flip)


def init_ball_rr_params(params: object, d_max: int) -> None:
    """Check eps0, d in [1, d_max] and radius of a frozen R_inf / R_1 parameter dataclass; set flip and scale.

    scale is c = 1/(1 - 2 flip) (spec 001 section 3), with flip on the sampler's grid (`rr_flip_probability`).
    """
    object.__setattr__(params, "eps0", check_eps0(params.eps0))
    object.__setattr__(params, "d", check_int("d", params.d, 1, d_max))
    object.__setattr__(params, "radius", check_positive("radius", params.radius))
    flip = rr_flip_probability(params.eps0)
    object.__setattr__(params, "flip", flip)
    object.__setattr__(params, "scale", 1.0 / (1.0 - 2.0 * flip))


def signed_symbol_probabilities(p_plus: np.ndarray, n: int) -> np.ndarray:
    """(k, 2n) P[symbol] for symbols 2l + [b' = +1] with l ~ Unif[n]: column 2l is (l, -1), 2l+1 is (l, +1)."""
    out = np.empty((p_plus.shape[0], 2 * n))
    out[:, 0::2] = (1.0 - p_plus) / n
    out[:, 1::2] = p_plus / n
    return out


def decode_mean_from_sum(messages: np.ndarray, params: object, decode_sum: Callable) -> np.ndarray | float:
    """Unbiased estimate of mean_i x_i over the k >= 1 messages: decode_sum(messages, params) / k."""
    k = np.asarray(messages).shape[0]
    if k == 0:
        raise ValueError("decode_mean needs at least one message, got 0")
    return decode_sum(messages, params) / k


def bernoulli(prob: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Boolean draws with P[True] = realized_probability(prob), one uniform per entry."""
    prob = np.asarray(prob, dtype=np.float64)
    return rng.random(prob.shape) < prob


def realized_probability(prob: np.ndarray) -> np.ndarray:
    """The exact probability that `bernoulli(prob, rng)` returns True: ceil(prob 2**53) / 2**53."""
    return np.ceil(np.asarray(prob, dtype=np.float64) * 2.0**53) * UNIFORM_RESOLUTION


def _uint_dtype(alphabet_size: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if alphabet_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"alphabet_size must be <= 2**64, got {alphabet_size}")


@dataclass(frozen=True)
class MessageFormat:
    """A message is `symbols` symbols, each an integer in [0, alphabet_size).

    `shape` is the per-message array shape: () for one symbol (encode returns shape (k,)) or (symbols,)
    (encode returns (k, symbols)). On the wire each symbol is a big-endian unsigned integer of
    `bytes_per_symbol` bytes, so every message has exactly `message_bytes` bytes whatever the input.
    """

    symbols: int
    alphabet_size: int
    vector: bool = False

    def __post_init__(self) -> None:
        check_int("symbols", self.symbols, 1)
        check_int("alphabet_size", self.alphabet_size, 2)
        if not self.vector and self.symbols != 1:
            raise ValueError(f"a scalar message format has exactly 1 symbol, got symbols={self.symbols}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.symbols,) if self.vector else ()

    @property
    def dtype(self) -> np.dtype:
        return _uint_dtype(self.alphabet_size)

    @property
    def bits(self) -> int:
        """Information bits per message: symbols * ceil(log2 alphabet_size)."""
        return self.symbols * (self.alphabet_size - 1).bit_length()

    @property
    def bytes_per_symbol(self) -> int:
        return self.dtype.itemsize

    @property
    def message_bytes(self) -> int:
        return self.symbols * self.bytes_per_symbol

    def valid_mask(self, messages: np.ndarray) -> np.ndarray:
        """Per message: True iff every symbol is an integer in [0, alphabet_size). Shape must be right."""
        m = np.asarray(messages)
        if m.ndim != 1 + len(self.shape) or m.shape[1:] != self.shape:
            raise ValueError(f"messages must have shape (k, *{self.shape}), got {m.shape}")
        if m.dtype.kind not in "iu":
            raise ValueError(f"messages must have an integer dtype, got {m.dtype}")
        ok = (m >= 0) & (m < self.alphabet_size) if m.dtype.kind == "i" else m < self.alphabet_size
        return ok.reshape(m.shape[0], self.symbols).all(axis=1)

    def validate(self, messages: np.ndarray) -> np.ndarray:
        """Return the messages as `dtype`, or raise ValueError naming the first bad message."""
        ok = self.valid_mask(messages)
        if not ok.all():
            i = int(np.argmin(ok))
            raise ValueError(
                f"message {i} has a symbol outside the alphabet [0, {self.alphabet_size}): {np.asarray(messages)[i]!r}"
            )
        return np.asarray(messages).astype(self.dtype, copy=False)

    def to_bytes(self, messages: np.ndarray) -> np.ndarray:
        """(k, message_bytes) uint8 array: big-endian fixed-width symbols."""
        m = self.validate(messages)
        be = m.astype(self.dtype.newbyteorder(">"))
        return np.ascontiguousarray(be).view(np.uint8).reshape(m.shape[0], self.message_bytes)

    def from_bytes(self, data: bytes | Sequence[bytes] | np.ndarray) -> np.ndarray:
        """Parse and validate received messages: one `bytes` per message, or a (k, message_bytes) uint8 array."""
        if isinstance(data, bytes | bytearray):
            data = [bytes(data)]
        if isinstance(data, np.ndarray):
            raw = data
            if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != self.message_bytes:
                raise ValueError(f"byte messages must be a (k, {self.message_bytes}) uint8 array, got {raw.shape}")
        else:
            bad = [i for i, b in enumerate(data) if len(b) != self.message_bytes]
            if bad:
                raise ValueError(
                    f"message {bad[0]} has {len(data[bad[0]])} bytes, expected exactly {self.message_bytes}"
                )
            raw = np.frombuffer(b"".join(data), dtype=np.uint8).reshape(len(data), self.message_bytes)
        m = np.ascontiguousarray(raw).view(self.dtype.newbyteorder(">")).astype(self.dtype)
        m = m.reshape((raw.shape[0], *self.shape))
        return self.validate(m)
