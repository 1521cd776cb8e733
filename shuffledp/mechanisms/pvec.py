"""P1D / PVEC: the multi-message binomial summation protocols of Cheu, Joseph, Mao, Peng (ICLR 2022).

Randomizer (client) and decoder (analyzer) live together so that both sides use parameters derived by one
function (design section 4). Sources: paper ../shared/seeds/000 (Alg 1, Alg 2, Lemma 3.1, Thm 3.2, App. A) and
its digest spec 000_shuffle_sco.md sections 2, 3, 7, 8.

Structure (no duplicated logic): PVEC is P1D applied to every coordinate after the shift
w = x + Delta2 in [0, 2 Delta2]. Both reduce to one "unit" protocol on u = w / Delta in [0, 1]:

    xhat  = floor(u g) + Bernoulli(frac(u g))      # fixed-point randomized rounding, xhat in {0..g}
    count = xhat + Binomial(m, p)                  # privacy noise; count in [0, g + m]
    estimate of sum(u) * g = sum(count) - n' m p   # n' = contributors actually aggregated

and P1D multiplies by Delta/g (the scaling trick of section 3.1 of the paper), PVEC by 2 Delta2/g and
re-centres by n' Delta2.

Modes (design 5.2): *count mode* sends the per-coordinate count (the trusted shuffler forwards only per-label
totals and n'); *bit mode* sends the literal d (g + m) labelled bits of Alg 2 for one user.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from shuffledp.mechanisms import _ldp_kernels

__all__ = [
    "count_wire_dtype",
    "P1dParams",
    "PvecParams",
    "p1d_params",
    "pvec_params",
    "clip_rows",
    "shift_to_units",
    "encode_counts",
    "round_counts",
    "summed_noise",
    "encode_bits",
    "decode_counts",
    "decode_bits",
    "pvec_variance",
    "pvec_variance_bound",
    "count_in_range",
    "validate_counts",
    "validate_totals",
    "p1d_encode_counts",
    "p1d_decode",
    "p1d_variance",
    "EPS_MAX",
    "MAX_M",
]

# Lemma 3.1 / Thm 3.2 of paper 000 hold for 0 < eps <= 15 and 0 < delta < 1/2.
EPS_MAX = 15.0
# Largest alpha = eps/(3g) we allow. The proof of Lemma 3.1 (App. A.1) uses ln((1+a)/(1-a)) <= 3a, true only
# for a <= 0.8586... (spec 000 sec 2 "Proof facts"); 0.85 keeps a margin. Only binds for eps > 2.55 g.
ALPHA_MAX = 0.85
# numpy's binomial (BTPE, float64 internally) is accurate while m*p is exactly representable; above 2^53 the
# variance of the draws visibly drifts (measured: +8% at m = 2^62). Larger m is refused.
MAX_M = 2**53
# All totals are int64: n (g + m) must fit with a margin.
_MAX_TOTAL = 2**62
# Default memory guard for bit mode (labels int64 + bits uint8 = 9 bytes per message).
DEFAULT_MAX_BIT_MESSAGES = 2**25

_METHODS = ("paper", "calibrated")


# --------------------------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------------------------
def _check_int(name: str, value: object, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    if int(value) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value}")
    return int(value)


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


def _check_eps_delta(eps: object, delta: object, *, paper: bool) -> tuple[float, float]:
    e = _check_float("eps", eps)
    dl = _check_float("delta", delta)
    if paper:
        # Lemma 3.1 / Thm 3.2 (paper 000): 0 < eps <= 15, 0 < delta < 1/2.
        if not 0.0 < e <= EPS_MAX:
            raise ValueError(f"eps must lie in (0, {EPS_MAX}] (Lemma 3.1 / Thm 3.2 of paper 000), got {e}")
        if not 0.0 < dl < 0.5:
            raise ValueError(f"delta must lie in (0, 1/2) (Lemma 3.1 / Thm 3.2 of paper 000), got {dl}")
    else:
        if not e > 0.0:
            raise ValueError(f"eps must be > 0, got {e}")
        if not 0.0 < dl < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {dl}")
    return e, dl


def _check_gmp(g: object, m: object, p: object, n: int) -> tuple[int, int, float]:
    g = _check_int("g", g)
    m = _check_int("m", m)
    if m > MAX_M:
        raise ValueError(f"m must be <= 2^53 (numpy binomial accuracy), got {m}")
    p = _check_float("p", p)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if n * (g + m) > _MAX_TOTAL:
        raise ValueError(f"n*(g+m) = {n * (g + m)} overflows int64 totals (limit 2^62); reduce m or n")
    return g, m, p


def _noise_size(g: int, eps: float, delta: float, n: int) -> tuple[int, float]:
    """(m, p) of Lemma 3.1 (paper 000): m > 180 g^2 ln(2/delta)/(eps^2 n), p = 90 g^2 ln(2/delta)/(m eps^2 n).

    Concrete choice of spec 000 sec 2: m = floor(180 g^2 ln(2/delta)/(eps^2 n)) + 1, so p is just under 1/2
    and n m p = 90 g^2 ln(2/delta)/eps^2 (the total noise is Bin(n m, p)).
    """
    target = 90.0 * g * g * math.log(2.0 / delta) / (eps * eps)  # = n m p, spec 000 sec 2
    m = math.floor(2.0 * target / n) + 1
    if m > MAX_M:
        raise ValueError(
            f"the paper's constants need m = {m} binomial trials (> 2^53) for eps={eps}, delta={delta}, n={n}, "
            f"g={g}; use larger eps or n, or calibrated parameters"
        )
    p = target / (m * n)
    # Float rounding of ln and of the quotient (~4 roundings) could leave n m p a hair below the target, i.e.
    # slightly less noise than the proof needs; nudge p up (never round noise down).
    p *= 1.0 + 8.0 * np.finfo(float).eps
    while p >= 0.5:  # floor() of a float can land on the boundary; the strict m-bound must give p < 1/2
        m += 1 + m // 2**50
        p = target / (m * n) * (1.0 + 8.0 * np.finfo(float).eps)
    return int(m), float(p)


def _paper_noise_ok(g: int, m: int, p: float, n: int, eps: float, delta: float) -> bool:
    """n m p >= 90 g^2 ln(2/delta)/eps^2 (Lemma 3.1), to float precision, with p < 1/2."""
    target = 90.0 * g * g * math.log(2.0 / delta) / (eps * eps)
    return p < 0.5 and n * m * p >= target * (1.0 - 1e-12)


# --------------------------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class P1dParams:
    """Parameters of P1D (Alg 1 of paper 000) for n users with inputs in [0, Delta].

    With the scaling trick (paper 000 end of sec 3.1) the protocol runs on x/Delta in [0, 1] and the output is
    multiplied by Delta, so one count unit is worth Delta/g.
    """

    n: int
    Delta: float
    g: int
    m: int
    p: float
    eps: float
    delta: float

    def __post_init__(self) -> None:
        n = _check_int("n", self.n)
        Delta = _check_float("Delta", self.Delta)
        if Delta <= 0.0:
            raise ValueError(f"Delta must be > 0, got {Delta}")
        eps, delta = _check_eps_delta(self.eps, self.delta, paper=True)
        g, m, p = _check_gmp(self.g, self.m, self.p, n)
        if p >= 0.5:
            raise ValueError(f"p must lie in (0, 1/2) for Lemma 3.1 of paper 000, got {p}")
        if eps / (3.0 * g) > ALPHA_MAX:
            raise ValueError(f"g={g} too small for eps={eps}: Lemma 3.1's proof needs eps/(3g) <= {ALPHA_MAX}")
        if not _paper_noise_ok(g, m, p, n, eps, delta):
            raise ValueError(
                f"(g, m, p) = ({g}, {m}, {p}) give n*m*p = {n * m * p} < 90 g^2 ln(2/delta)/eps^2 "
                f"(Lemma 3.1 of paper 000) for n={n}, eps={eps}, delta={delta}"
            )
        for name, val in (("n", n), ("Delta", Delta), ("g", g), ("m", m), ("p", p), ("eps", eps), ("delta", delta)):
            object.__setattr__(self, name, val)

    @property
    def scale(self) -> float:
        """Value of one count unit: Delta/g (scaling trick)."""
        return self.Delta / self.g

    @property
    def messages_per_user(self) -> int:
        return self.g + self.m


@dataclass(frozen=True)
class PvecParams:
    """Parameters of PVEC (Alg 2 of paper 000): d coordinates, n users, inputs with ||x||_2 <= delta2.

    method="paper": (g, m, p) from the proof of Thm 3.2 (pvec_params). method="calibrated": (g, m, p) chosen by
    an exact numerical accountant (shuffledp.accountants.calibrated_pvec, an extension beyond the paper); then
    only 0 < p < 1 is required and the privacy claim is that accountant's, not the paper's.
    """

    d: int
    n: int
    delta2: float
    g: int
    m: int
    p: float
    eps: float
    delta: float
    method: str

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {self.method!r}")
        paper = self.method == "paper"
        d = _check_int("d", self.d)
        n = _check_int("n", self.n)
        delta2 = _check_float("delta2", self.delta2)
        if delta2 <= 0.0:
            raise ValueError(f"delta2 must be > 0, got {delta2}")
        eps, delta = _check_eps_delta(self.eps, self.delta, paper=paper)
        g, m, p = _check_gmp(self.g, self.m, self.p, n)
        if paper:
            if p >= 0.5:
                raise ValueError(f"p must lie in (0, 1/2) for method='paper' (Lemma 3.1), got {p}")
            if g < d or g < 4:
                # proof of Thm 3.2: g >= max(d, 4) gives sum_j eps_j^2 <= 9 eps_hat^2 and eps_j < 1
                raise ValueError(f"g must be >= max(d, 4) = {max(d, 4)} for method='paper' (Thm 3.2), got {g}")
            if not _paper_noise_ok(g, m, p, n, self._eps_hat(eps, delta, d), delta / (d + 1)):
                raise ValueError(
                    f"(g, m, p) = ({g}, {m}, {p}) give less noise than Thm 3.2 of paper 000 needs "
                    f"(n*m*p < 90 g^2 ln(2/delta_hat)/eps_hat^2)"
                )
        vals = {"d": d, "n": n, "delta2": delta2, "g": g, "m": m, "p": p, "eps": eps, "delta": delta}
        for name, val in vals.items():
            object.__setattr__(self, name, val)

    @staticmethod
    def _eps_hat(eps: float, delta: float, d: int) -> float:
        # proof of Thm 3.2: gamma = delta_hat = delta/(d+1), eps_hat = eps/(18 sqrt(ln(1/gamma))); rounded down a
        # few ulps so the noise derived from it is never smaller than the proof's.
        return eps / (18.0 * math.sqrt(math.log((d + 1) / delta))) * (1.0 - 4.0 * np.finfo(float).eps)

    @property
    def eps_hat(self) -> float:
        """Per-coordinate eps of the paper's proof of Thm 3.2 (paper constants, whatever the method)."""
        return self._eps_hat(self.eps, self.delta, self.d)

    @property
    def delta_hat(self) -> float:
        """Per-coordinate delta = composition slack gamma = delta/(d+1) (proof of Thm 3.2)."""
        return self.delta / (self.d + 1)

    @property
    def Delta(self) -> float:
        """Range of a shifted coordinate, 2 delta2 (proof of Thm 3.2)."""
        return 2.0 * self.delta2

    @property
    def scale(self) -> float:
        """Value of one count unit: 2 delta2 / g."""
        return 2.0 * self.delta2 / self.g

    @property
    def messages_per_user(self) -> int:
        """d (g + m) labelled bits per user (Alg 2); in count mode d counts instead."""
        return self.d * (self.g + self.m)


def p1d_params(eps: float, delta: float, n: int, Delta: float = 1.0) -> P1dParams:
    """P1D parameters of Lemma 3.1 (paper 000) with the Delta-scaling trick (spec 000 sec 2).

    g = ceil(sqrt(n)) (raised to ceil(eps/(3*ALPHA_MAX)) if eps is large, see ALPHA_MAX), m = floor(180 g^2
    ln(2/delta)/(eps^2 n)) + 1, p = 90 g^2 ln(2/delta)/(m eps^2 n). Example: (eps=1, delta=1e-3, n=100) gives
    g=10, m=1369, p=0.49969.
    """
    n = _check_int("n", n)
    eps, delta = _check_eps_delta(eps, delta, paper=True)
    Delta = _check_float("Delta", Delta)
    if Delta <= 0.0:
        raise ValueError(f"Delta must be > 0, got {Delta}")
    r = math.isqrt(n)
    g = r + (r * r < n)  # exact ceil(sqrt(n)): Lemma 3.1 needs g >= sqrt(n) on the scaled range [0, 1]
    g = max(g, math.ceil(eps / (3.0 * ALPHA_MAX)))
    m, p = _noise_size(g, eps, delta, n)
    return P1dParams(n=n, Delta=Delta, g=g, m=m, p=p, eps=eps, delta=delta)


def pvec_params(eps: float, delta: float, n: int, d: int, delta2: float) -> PvecParams:
    """PVEC parameters of the proof of Thm 3.2 (paper 000; spec 000 sec 3).

    delta_hat = gamma = delta/(d+1); eps_hat = eps/(18 sqrt(ln(1/gamma))); g = ceil(max(2 delta2 sqrt(n), d, 4));
    (m, p) from Lemma 3.1 with (eps_hat, delta_hat); the same (g, m, p) for every coordinate.
    """
    n = _check_int("n", n)
    d = _check_int("d", d)
    eps, delta = _check_eps_delta(eps, delta, paper=True)
    delta2 = _check_float("delta2", delta2)
    if delta2 <= 0.0:
        raise ValueError(f"delta2 must be > 0, got {delta2}")
    eps_hat = PvecParams._eps_hat(eps, delta, d)
    delta_hat = delta / (d + 1)
    g = max(math.ceil(2.0 * delta2 * math.sqrt(n)), d, 4)
    m, p = _noise_size(g, eps_hat, delta_hat, n)
    return PvecParams(d=d, n=n, delta2=delta2, g=g, m=m, p=p, eps=eps, delta=delta, method="paper")


# --------------------------------------------------------------------------------------------------------------
# shared unit protocol (P1D on u in [0, 1]; PVEC = this per coordinate after the shift)
# --------------------------------------------------------------------------------------------------------------
def _round_units(u: np.ndarray, g: int, rng: np.random.Generator) -> np.ndarray:
    """Alg 1 lines 3-5: xhat = floor(u g) + Bernoulli(u g - floor(u g)), int64 in {0..g}; E[xhat] = u g."""
    v = u * g
    xbar = np.floor(v)
    frac = v - xbar
    # One uniform per value; comparing with frac in [0,1) is Bernoulli(frac). xbar <= g since u <= 1.
    xhat = xbar.astype(np.int64)
    xhat += rng.random(u.shape) < frac
    return xhat


def _encode_units(u: np.ndarray, g: int, m: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """Count mode of Alg 1: xhat + Bin(m, p), int64 in [0, g + m]."""
    counts = _round_units(u, g, rng)
    counts += rng.binomial(m, p, size=u.shape)
    return counts


def _debias_units(totals: np.ndarray, n_contrib: int, m: int, p: float) -> np.ndarray:
    """totals - n' m p (Alg 1 line 10 before scaling), computed without float cancellation.

    totals can exceed 2^53, so split n' m p (exact as a rational, p being a binary float) into an integer part
    subtracted in int64 and a fractional part subtracted in float.
    """
    mean = Fraction(p) * (n_contrib * m)
    mean_int = math.floor(mean)
    return (totals - np.int64(mean_int)).astype(np.float64) - float(mean - mean_int)


def _variance_units(u: np.ndarray, g: int, m: int, p: float, axis: int = 0) -> np.ndarray:
    """Count-unit variance of sum(count) (spec 000 sec 2 "Exact variance"): sum_i r_i(1-r_i) + n' m p (1-p)."""
    v = u * g
    r = v - np.floor(v)
    n_contrib = u.shape[axis]
    return np.sum(r * (1.0 - r), axis=axis) + n_contrib * m * p * (1.0 - p)


def _check_n_contrib(n_contrib: object, n: int) -> int:
    k = _check_int("n_contrib", n_contrib, lo=1)
    if k > n:
        # the parameters were derived for n users; more contributors than that means an accounting error upstream
        raise ValueError(f"n_contrib must lie in [1, n={n}], got {k}")
    return k


# --------------------------------------------------------------------------------------------------------------
# client side
# --------------------------------------------------------------------------------------------------------------
def clip_rows(X: np.ndarray, delta2: float) -> np.ndarray:
    """Scale each row of X to l2 norm <= delta2 (rows already inside are unchanged). Returns a new float array.

    Client-side l2 clipping before the shift (spec 000 sec 7 item 7). The result is guaranteed to satisfy
    ||row||_2 <= delta2 in float arithmetic (rows that overshoot by rounding are shrunk by a few ulps).
    """
    delta2 = _check_float("delta2", delta2)
    if delta2 <= 0.0:
        raise ValueError(f"delta2 must be > 0, got {delta2}")
    X = np.array(X, dtype=np.float64, copy=True)
    if X.ndim not in (1, 2):
        raise ValueError(f"X must be a vector or a 2-D array of rows, got shape {X.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError("X must contain only finite values (found NaN or inf)")
    rows = X.reshape(1, -1) if X.ndim == 1 else X
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
    if np.any(big := np.isinf(norms)):
        # finite entries whose squares overflow: the norm of the row over its largest entry, times that entry (as
        # _ldp_kernels.round_rows does; scaling by delta2 / inf would zero the row, losing its direction)
        top = np.max(np.abs(rows[big]), axis=1)
        scaled = rows[big] / top[:, None]
        norms[big] = top * np.sqrt(np.einsum("ij,ij->i", scaled, scaled))
    over = norms > delta2
    if np.any(over):
        rows[over] *= (delta2 / norms[over])[:, None]
        # float rounding can leave a clipped norm an ulp above delta2; shrink those rows a little more
        again = np.sqrt(np.einsum("ij,ij->i", rows[over], rows[over])) > delta2
        if np.any(again):
            idx = np.flatnonzero(over)[again]
            rows[idx] *= 1.0 - 4.0 * np.finfo(float).eps
    return X


def shift_to_units(X: np.ndarray, params: PvecParams) -> np.ndarray:
    """Clip rows to delta2, shift w = x + delta2 in [0, 2 delta2] (Alg 2 line 4), return u = w/(2 delta2) in [0,1]."""
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[1] != params.d:
        raise ValueError(f"X must have shape (k, d={params.d}), got {X.shape}")
    Xc = clip_rows(X, params.delta2)
    u = (Xc + params.delta2) / (2.0 * params.delta2)
    # |x_j| <= ||x|| <= delta2 so u is in [0, 1] mathematically; clamp the float rounding at the ends.
    np.clip(u, 0.0, 1.0, out=u)
    return u


ENCODE_BLOCK_VALUES = 1 << 17  # values per block of encode_counts: ~1 MiB per float64 temporary


def encode_counts(X: np.ndarray, params: PvecParams, rng: np.random.Generator) -> np.ndarray:
    """Count mode of PVEC for k users at once: counts[i, j] = xhat_ij + Bin(m, p), int64 of shape (k, d).

    Inputs are clipped to ||x||_2 <= delta2 here (whatever the caller did) before the shift. A 1-D x is one user.
    """
    return _rounded(X, params, rng, np.dtype(np.int64), noise=True)


def round_counts(
    X: np.ndarray, params: PvecParams, rng: np.random.Generator, dtype: np.dtype | type = np.int64
) -> np.ndarray:
    """encode_counts without the noise: xhat_ij in {0..g} (Alg 1 lines 3-5 of paper 000, on the rows clipped to
    ||x||_2 <= delta2 and shifted as in Alg 2 line 4), of shape (k, d) in `dtype`: int64, or an unsigned width that
    holds g (the wire's, count_wire_dtype). A client node adds its users' noise to their sum instead (summed_noise)."""
    dtype = np.dtype(dtype)
    if not (dtype == np.int64 or dtype.kind == "u"):
        raise ValueError(f"dtype must be int64 or an unsigned integer type, got {dtype}")
    return _rounded(X, params, rng, dtype, noise=False)


def _rounded(X: np.ndarray, params: PvecParams, rng: np.random.Generator, dtype: np.dtype, noise: bool) -> np.ndarray:
    """xhat (plus each value's Bin(m, p) with noise) of the rows of X. One C pass per row (_ldp_kernels.round_rows)
    does what clip_rows, shift_to_units and _round_units (the reference, kept for P1D and the tests) do in ~12 numpy
    passes, with the same arithmetic and the same uniforms (rng.random, block by block in row order; with noise, each
    block's binomials after its uniforms, as before): those passes cost ~4x the uniforms (5.0 ms against 1.2 for 500
    users at d = 650)."""
    X = np.asarray(X)
    one = X.ndim == 1
    rows = X.reshape(1, -1) if one else X
    if rows.ndim != 2 or rows.shape[1] != params.d:
        raise ValueError(f"X must have shape (k, d={params.d}), got {X.shape}")
    rows = np.ascontiguousarray(rows, dtype=np.float64)
    counts = np.empty(rows.shape, dtype=dtype)
    # block by block: a block's uniforms (1 MiB) stay in cache, and no k x d float temporary is made
    step = max(1, ENCODE_BLOCK_VALUES // params.d)
    for i in range(0, rows.shape[0], step):
        block, out = rows[i : i + step], counts[i : i + step]
        uniforms = rng.random(block.shape)
        if _ldp_kernels.round_rows(block, uniforms, out, params.d, params.delta2, params.g, dtype.itemsize) >= 0:
            raise ValueError("X must contain only finite values (found NaN or inf)")
        if noise:
            out += rng.binomial(params.m, params.p, size=out.shape)
    return counts[0] if one else counts


def summed_noise(m: int, users: int, p: float, d: int, rng: np.random.Generator) -> np.ndarray:
    """The sum of `users` users' noise of count mode (each Bin(m, p) per coordinate, Alg 1 line 6 of paper 000) for
    d coordinates, uint64: Bin(users m, p) per coordinate, since independent binomials of one p add up to the
    binomial of the summed trials. Drawn in pieces of at most MAX_M trials (numpy's accuracy bound), which add up
    the same way. The noise depends on nothing of the users' data, so the sum of their counts plus this has the law
    of the sum of their encode_counts rows."""
    if not (isinstance(m, int) and m >= 1 and isinstance(users, int) and users >= 0):
        raise ValueError(f"m must be an integer >= 1 and users an integer >= 0, got m={m!r}, users={users!r}")
    total = np.zeros(d, dtype=np.uint64)
    trials = m * users  # exact (Python int)
    while trials > 0:
        piece = min(trials, MAX_M)
        total += rng.binomial(piece, p, size=d).astype(np.uint64)
        trials -= piece
    return total


def encode_bits(
    x: np.ndarray,
    params: PvecParams,
    rng: np.random.Generator,
    max_messages: int = DEFAULT_MAX_BIT_MESSAGES,
) -> tuple[np.ndarray, np.ndarray]:
    """Bit mode of PVEC for ONE user: the literal d (g + m) labelled bits of Alg 2 (labels int64, bits uint8).

    For label j the user sends g "value" bits, xhat_j of them 1 (xhat_j from the same rounding code as count
    mode), and m independent Bernoulli(p) "noise" bits: g + m messages per label whatever the input. The
    messages are returned in a random order (defence in depth; the shuffler permutes them again anyway).

    Why the per-label total of bit mode has the same distribution as the count-mode total. For label j and a
    set of n' users with inputs x_1..x_n', the bit-mode total is T_j = sum_i (xhat_ij + sum_{k=1..m} B_ijk),
    with B_ijk iid Bernoulli(p) independent of the rounding. A sum of m iid Bernoulli(p) is Bin(m, p) by
    definition, so sum_k B_ijk has exactly the law of the count-mode draw eta2_ij ~ Bin(m, p); xhat_ij is
    produced by the same function (same law) in both modes; all (xhat_ij, noise_ij) are independent across
    users and labels in both modes. Hence the vectors (xhat_ij + noise_ij)_{i,j} have the same joint law in
    both modes, and so do their per-label sums (a fixed function of them); in both cases
    T_j = sum_i xhat_ij + Bin(n' m, p). Moreover the shuffled multiset of labelled bits is a function of
    (T_j, n'(g + m) - T_j)_j (paper 000 App. A.1 proof of Lemma A.2), so the analyzer's views agree in law.
    """
    x = np.asarray(x)
    if x.ndim != 1 or x.shape[0] != params.d:
        raise ValueError(f"x must be one user's vector of shape (d={params.d},), got {x.shape}")
    max_messages = _check_int("max_messages", max_messages)
    d, g, m = params.d, params.g, params.m
    if params.messages_per_user > max_messages:
        raise ValueError(
            f"bit mode would send d*(g+m) = {params.messages_per_user} messages per user (> max_messages="
            f"{max_messages}); use count mode"
        )
    xhat = round_counts(x, params, rng)
    value_bits = np.arange(g)[None, :] < xhat[:, None]  # (d, g), exactly xhat_j ones in row j
    noise_bits = rng.random((d, m)) < params.p  # (d, m) iid Bernoulli(p)
    bits = np.concatenate([value_bits, noise_bits], axis=1).astype(np.uint8).ravel()
    labels = np.repeat(np.arange(d, dtype=np.int64), g + m)
    order = rng.permutation(bits.size)
    return labels[order], bits[order]


# --------------------------------------------------------------------------------------------------------------
# validation for the shuffler / analyzer
# --------------------------------------------------------------------------------------------------------------
def count_in_range(counts: np.ndarray, params: PvecParams | P1dParams) -> np.ndarray:
    """Elementwise: is each per-user count an integer in [0, g + m]? (design 5.3). Non-integers are False."""
    c = np.asarray(counts)
    if c.dtype.kind in "iu":
        return (c >= 0) & (c <= params.g + params.m)
    if c.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            return np.isfinite(c) & (c == np.floor(c)) & (c >= 0) & (c <= params.g + params.m)
    return np.zeros(c.shape, dtype=bool)


def validate_counts(counts: np.ndarray, params: PvecParams | P1dParams) -> np.ndarray:
    """Return counts as int64 or raise ValueError if any is not an integer in [0, g + m] (or shape is wrong)."""
    c = np.asarray(counts)
    if isinstance(params, PvecParams) and (c.ndim not in (1, 2) or c.shape[-1] != params.d):
        raise ValueError(f"counts must have shape (d={params.d},) or (k, {params.d}), got {c.shape}")
    ok = count_in_range(c, params)
    if not np.all(ok):
        bad = c[~ok].ravel()[0]
        raise ValueError(f"every count must be an integer in [0, g+m={params.g + params.m}], got {bad!r}")
    return c.astype(np.int64)


def validate_totals(totals: np.ndarray, n_contrib: int, params: PvecParams | P1dParams) -> np.ndarray:
    """Per-label totals must be integers in [0, n' (g + m)]; returns them as int64 or raises ValueError."""
    t = np.asarray(totals)
    hi = n_contrib * (params.g + params.m)
    if t.dtype.kind == "f":
        if not np.all(np.isfinite(t) & (t == np.floor(t))):
            raise ValueError("totals must be integers")
    elif t.dtype.kind not in "iu":
        raise ValueError(f"totals must be integers, got dtype {t.dtype}")
    if np.any(t < 0) or np.any(t > hi):
        raise ValueError(f"totals must lie in [0, n_contrib*(g+m) = {hi}], got range [{t.min()}, {t.max()}]")
    return t.astype(np.int64)


# --------------------------------------------------------------------------------------------------------------
# analyzer side
# --------------------------------------------------------------------------------------------------------------
def decode_counts(totals: np.ndarray, n_contrib: int, params: PvecParams) -> np.ndarray:
    """A_VEC (Alg 2): o_j = (2 delta2/g)(C_j - n' m p) - n' delta2, unbiased for sum_i x_i (after clipping).

    n_contrib = n' is the number of users actually aggregated (reported by the shuffler), not the nominal n:
    debiasing with n' keeps the estimate unbiased under dropouts (spec 000 sec 3, robust variant note).
    """
    n_contrib = _check_n_contrib(n_contrib, params.n)
    t = np.asarray(totals)
    if t.shape != (params.d,):
        raise ValueError(f"totals must have shape (d={params.d},), got {t.shape}")
    t = validate_totals(t, n_contrib, params)
    return params.scale * _debias_units(t, n_contrib, params.m, params.p) - n_contrib * params.delta2


def decode_bits(labels: np.ndarray, bits: np.ndarray, params: PvecParams) -> np.ndarray:
    """A_VEC on the shuffled labelled bits. n' = len / (d (g + m)); every label must occur exactly n'(g + m) times."""
    labels = np.asarray(labels)
    bits = np.asarray(bits)
    if labels.ndim != 1 or bits.ndim != 1 or labels.shape != bits.shape:
        raise ValueError(f"labels and bits must be 1-D of equal length, got {labels.shape} and {bits.shape}")
    if labels.dtype.kind not in "iu" or bits.dtype.kind not in "iub":
        raise ValueError(f"labels and bits must be integer arrays, got {labels.dtype} and {bits.dtype}")
    per_user = params.messages_per_user
    if labels.size == 0 or labels.size % per_user:
        raise ValueError(f"number of messages must be a positive multiple of d*(g+m) = {per_user}, got {labels.size}")
    if labels.min() < 0 or labels.max() >= params.d:
        raise ValueError(f"labels must lie in [0, d={params.d}), got range [{labels.min()}, {labels.max()}]")
    if bits.dtype.kind != "b" and (bits.min() < 0 or bits.max() > 1):
        raise ValueError(f"bits must be 0 or 1, got range [{bits.min()}, {bits.max()}]")
    n_contrib = labels.size // per_user
    per_label = np.bincount(labels, minlength=params.d)
    if np.any(per_label != n_contrib * (params.g + params.m)):
        raise ValueError(f"every label must carry exactly n'*(g+m) = {n_contrib * (params.g + params.m)} messages")
    totals = np.bincount(labels[bits.astype(bool)], minlength=params.d).astype(np.int64)
    return decode_counts(totals, n_contrib, params)


def pvec_variance(X: np.ndarray, params: PvecParams) -> np.ndarray:
    """Exact per-coordinate variance of decode(encode(X)) for these rows (spec 000 sec 2 "Exact variance").

    Var_j = (2 delta2/g)^2 [ sum_i r_ij (1 - r_ij) + n' m p (1 - p) ], r_ij = frac(u_ij g), n' = rows of X.
    """
    u = shift_to_units(np.asarray(X), params)
    return params.scale**2 * _variance_units(u, params.g, params.m, params.p, axis=0)


def pvec_variance_bound(params: PvecParams, n_contrib: int | None = None) -> float:
    """Data-free upper bound on the per-coordinate variance: scale^2 (n'/4 + n' m p (1 - p)); n' defaults to n."""
    k = params.n if n_contrib is None else _check_n_contrib(n_contrib, params.n)
    return params.scale**2 * k * (0.25 + params.m * params.p * (1.0 - params.p))


# --------------------------------------------------------------------------------------------------------------
# scalar P1D
# --------------------------------------------------------------------------------------------------------------
def _p1d_units(x: np.ndarray, params: P1dParams) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim > 1:
        raise ValueError(f"x must be a scalar or 1-D array of users' values, got shape {x.shape}")
    if not np.all(np.isfinite(x)) or np.any(x < 0.0) or np.any(x > params.Delta):
        raise ValueError(f"P1D inputs must lie in [0, Delta={params.Delta}]")
    return np.atleast_1d(x / params.Delta)  # scaling trick: run on [0, 1]


def p1d_encode_counts(x: np.ndarray, params: P1dParams, rng: np.random.Generator) -> np.ndarray:
    """R1D (Alg 1) in count mode for k users: xhat_i + Bin(m, p), int64 of shape (k,). Inputs in [0, Delta]."""
    return _encode_units(_p1d_units(x, params), params.g, params.m, params.p, rng)


def p1d_decode(total: int, n_contrib: int, params: P1dParams) -> float:
    """A1D (Alg 1): (Delta/g)(Z - n' m p), unbiased for the sum of the n' contributors' inputs."""
    n_contrib = _check_n_contrib(n_contrib, params.n)
    t = validate_totals(np.asarray([total]), n_contrib, params)
    return float(params.scale * _debias_units(t, n_contrib, params.m, params.p)[0])


def p1d_variance(x: np.ndarray, params: P1dParams) -> float:
    """Exact variance of P1D on inputs x (spec 000 sec 2): (Delta/g)^2 [sum r_i(1-r_i) + n' m p(1-p)]."""
    u = _p1d_units(x, params)
    return float(params.scale**2 * _variance_units(u, params.g, params.m, params.p, axis=0))


def count_wire_dtype(max_count: int) -> np.dtype:
    """Count-mode wire format (CountVector.packed, proto/shuffledp/v1/shuffledp.proto): one user's d counts as
    little-endian unsigned integers of the narrowest width in {1, 2, 4, 8} bytes that holds max_count = g + m, the
    largest count one user can send (xhat <= g plus Bin(m, p) <= m). Nodes and the shuffler both derive it from the
    round spec, so nothing on the wire says the width."""
    if not isinstance(max_count, int | np.integer) or max_count < 0:
        raise ValueError(f"max_count must be an integer >= 0, got {max_count!r}")
    for width in (1, 2, 4, 8):
        if int(max_count) < 2 ** (8 * width):
            return np.dtype(f"<u{width}")
    raise ValueError(f"max_count = {max_count} does not fit 64 bits")
