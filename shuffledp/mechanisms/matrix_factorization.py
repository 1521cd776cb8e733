"""Matrix-factorization noise for DP-FTRL (issue 27): BLT and banded Toeplitz strategies, as pure functions.

The prefix-sum workload A (T x T lower-triangular ones) is factored A = B C with C lower-triangular Toeplitz. The
mechanism releases C x + Z, Z ~ N(0, (z L)^2) per entry (L = clip norm, z = ``noise_multiplier``); the analyzer adds
w = C^{-1} Z to the round sums x, so the released prefix sums are A x + B Z (Denisov et al. 2022, "Improved
differential privacy for SGD via optimal private linear operators on adaptive streams", sec. 2; Choquette-Choo et
al. 2023, "Multi-epoch matrix factorization mechanisms", sec. 2). Strategies (both are jax_privacy's):
- "blt": a buffered linear Toeplitz C optimised for T rounds and the participation limits (Dvijotham et al. 2024,
  arXiv:2404.16706; McMahan et al. 2024, arXiv:2408.08868), via ``buffered_toeplitz.optimize``;
- "banded": a b-banded Toeplitz C (Choquette-Choo et al. 2023, arXiv:2306.08153), via
  ``toeplitz.optimize_banded_toeplitz`` (optimised for single participation; with b <= the separation the
  worst case of k participations is sqrt(k) times it, so the optimum is the same, loc. cit. sec. 4).

Participation (the tree's convention, spec 003 sec 3): each user at most k = ``max_participations`` rounds of the
T, with at least ``min_separation`` = xi rounds strictly between two of them, so two participations i < j satisfy
j - i >= xi + 1. jax_privacy's ``min_sep`` (the "b-min-separation" of arXiv:2306.08153) is that xi + 1.

Sensitivity (zero-out neighbours, each contribution of norm <= L): Delta = max over feasible patterns u of
sqrt(sum_{i,j in u} |X_ij|), X = C^T C (arXiv:2306.08153 eq. (5); it equals max ||C u||_2 for the 0/1 vector u
when X >= 0 entrywise, as for both strategies here). For C Toeplitz with non-negative non-increasing coefficients
the worst u is k participations exactly xi + 1 apart from round 0 (arXiv:2405.13763 Thm 2), computed by
``toeplitz.minsep_sensitivity_squared``; any other C gets jax_privacy's general upper bound (arXiv:2306.08153
Alg. 4). The released sequence is then one Gaussian mechanism with sensitivity Delta L and std z L, even for
adaptively chosen x (Denisov et al. 2022 Thm 2.1; arXiv:2211.06530 Thm 2.1 for several participations), i.e.
mu-GDP with mu = Delta / z, converted exactly (Balle-Wang 2018): shuffledp.accountants.matrix_factorization.

Streaming noise: w_t = (C^{-1} Z)_t is a recurrence over a small state (``NoiseState``), plain numpy arrays that
the analyzer checkpoints, so a restarted analyzer continues the same sequence and never redraws released noise:
- blt: C^{-1} by Alg. 3 of arXiv:2408.08868 on C's own parameters (theta = buf_decay, omega = output_scale):
  w_t = z_t - sum_j omega_j buf_j, then buf_j <- theta_j buf_j + w_t; state = the nbuf buffers (nbuf x dim);
- banded (coefficients c_0..c_{b-1}): forward substitution in C w = Z, w_t = (z_t - sum_{j=1}^{b-1} c_j
  w_{t-j}) / c_0; state = the last b-1 outputs w (an IIR filter: it needs past outputs, not past draws).
The noise is the continuous Gaussian from the caller's numpy Generator (shuffledp.security.rng.make_rng, design sec 6);
the discrete Gaussian of the other central protocols does not apply (C x is not on a grid).

Only ``build_strategy`` and ``sensitivity`` import JAX (jax_privacy, the optional extra "mf"); the strategy is
plain arrays (``Strategy.to_arrays``), and the streaming, variances and per-pattern costs are numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "KINDS",
    "Strategy",
    "NoiseState",
    "build_strategy",
    "sensitivity",
    "pattern_sensitivity",
    "prefix_variance",
    "init_noise",
    "next_noise",
]

KINDS = ("blt", "banded")
# float64 sums of <= T terms carry a relative error below T * 2^-52; this margin covers T up to ~4e6, and the
# sensitivity is always rounded up by it (never in the unsafe direction).
_SENS_MARGIN = 1e-9


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _check_participation(rounds: int, max_participations: int, min_separation: int) -> tuple[int, int]:
    """(k, jax_privacy min_sep) with k capped at the participations that fit: ceil(T / (xi + 1))."""
    k = _check_int("max_participations", max_participations, 1)
    xi = _check_int("min_separation", min_separation, 0)
    return min(k, -(-rounds // (xi + 1))), xi + 1


class Strategy(NamedTuple):
    """A lower-triangular Toeplitz C for ``rounds`` rounds (module docstring).

    kind: "blt" or "banded". blt: ``buf_decay`` theta and ``output_scale`` omega (nbuf,), C's coefficients
    1, then sum_j omega_j theta_j^(i-1) (jax_privacy BufferedToeplitz). banded: ``coefs`` c_0..c_{b-1}.
    The unused arrays are empty.
    """

    kind: str
    rounds: int
    buf_decay: np.ndarray
    output_scale: np.ndarray
    coefs: np.ndarray

    @property
    def state_rows(self) -> int:
        """Vectors of noise state: nbuf (blt) or b - 1 (banded)."""
        return len(self.buf_decay) if self.kind == "blt" else len(self.coefs) - 1

    def toeplitz_coefs(self) -> np.ndarray:
        """C's first column (length T)."""
        t = self.rounds
        if self.kind == "banded":
            return np.concatenate([self.coefs, np.zeros(max(0, t - len(self.coefs)))])[:t]
        powers = np.arange(t - 1, dtype=np.float64)[:, None]
        # BufferedToeplitz.toeplitz_coefs (arXiv:2408.08868 eq. (2)): c_0 = 1, c_i = sum_j omega_j theta_j^(i-1)
        rest = (self.buf_decay[None, :] ** powers * self.output_scale[None, :]).sum(axis=1)
        return np.concatenate([[1.0], rest])

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {
            "kind": np.asarray(KINDS.index(self.kind), dtype=np.int64),
            "rounds": np.asarray(self.rounds, dtype=np.int64),
            "buf_decay": self.buf_decay.copy(),
            "output_scale": self.output_scale.copy(),
            "coefs": self.coefs.copy(),
        }

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> Strategy:
        missing = {"kind", "rounds", "buf_decay", "output_scale", "coefs"} - set(a)
        if missing:
            raise ValueError(f"matrix-factorization strategy lacks {sorted(missing)}")
        kind_i = int(a["kind"])
        if not 0 <= kind_i < len(KINDS):
            raise ValueError(f"matrix-factorization strategy kind index must be < {len(KINDS)}, got {kind_i}")
        return _make_strategy(KINDS[kind_i], int(a["rounds"]), a["buf_decay"], a["output_scale"], a["coefs"])


def _make_strategy(kind: str, rounds: int, buf_decay, output_scale, coefs) -> Strategy:
    theta = np.asarray(buf_decay, dtype=np.float64).reshape(-1)
    omega = np.asarray(output_scale, dtype=np.float64).reshape(-1)
    c = np.asarray(coefs, dtype=np.float64).reshape(-1)
    t = _check_int("rounds", rounds, 1)
    if kind == "blt":
        if c.size or theta.shape != omega.shape:
            raise ValueError("a blt strategy has buf_decay and output_scale of one length and no coefs")
        # Stability of both recurrences: 0 <= theta <= 1 (jax_privacy's optimisation constraints, arXiv:2504.21413).
        if not (np.all(np.isfinite(theta)) and np.all((theta >= 0) & (theta <= 1)) and np.all(np.isfinite(omega))):
            raise ValueError(f"blt buf_decay must lie in [0, 1] and output_scale be finite, got {theta}, {omega}")
    elif kind == "banded":
        if theta.size or omega.size or not 1 <= c.size <= t:
            raise ValueError(f"a banded strategy has 1..rounds={t} coefs and no buffers, got {c.size} coefs")
        if not (np.all(np.isfinite(c)) and c[0] > 0):
            raise ValueError(f"banded coefs must be finite with c_0 > 0, got {c}")
    else:
        raise ValueError(f"strategy kind must be one of {KINDS}, got {kind!r}")
    for arr in (theta, omega, c):
        arr.setflags(write=False)
    return Strategy(kind, t, theta, omega, c)


def build_strategy(
    kind: str,
    rounds: int,
    max_participations: int = 1,
    min_separation: int = 0,
    bands: int | None = None,
    error: str = "mean",
    max_buffers: int = 6,
    min_buffers: int = 0,
) -> Strategy:
    """Optimise C for ``rounds`` rounds with jax_privacy (needs the "mf" extra).

    blt: ``buffered_toeplitz.optimize`` for (T, min_sep = xi + 1, k), minimising the ``error`` ("mean" or "max")
    squared error of the prefix sums times the squared sensitivity, trying min_buffers..max_buffers buffers in
    turn while one more buffer still gains 1% (jax_privacy's rtol); each count is one L-BFGS optimisation (minutes
    on 2 busy cores), so min_buffers = max_buffers optimises one count only.
    banded: ``toeplitz.optimize_banded_toeplitz`` with ``bands`` b (1 <= b <= T; b <= xi + 1 recommended when
    k > 1, module docstring). Deterministic given the inputs on one machine; keep the result (``to_arrays``) in
    the run's state rather than recomputing it.
    """
    t = _check_int("rounds", rounds, 1)
    k, min_sep = _check_participation(t, max_participations, min_separation)
    if error not in ("mean", "max"):
        raise ValueError(f'error must be "mean" or "max", got {error!r}')
    import jax
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz

    with jax.enable_x64():  # jax_privacy's strategies need float64 (buffered_toeplitz.check_float64_dtype)
        if kind == "blt":
            if bands is not None:
                raise ValueError("bands applies to the banded strategy only")
            hi = _check_int("max_buffers", max_buffers, 1)
            lo = _check_int("min_buffers", min_buffers, 0)
            if lo > hi:
                raise ValueError(f"min_buffers must be <= max_buffers={hi}, got {lo}")
            blt = buffered_toeplitz.optimize(
                n=t, min_sep=min_sep, max_participations=k, error=error, min_buffers=lo, max_buffers=hi
            )
            return _make_strategy("blt", t, np.asarray(blt.buf_decay), np.asarray(blt.output_scale), [])
        if kind == "banded":
            b = _check_int("bands", bands, 1)
            if b > t:
                raise ValueError(f"bands must be <= rounds={t}, got {b}")
            reduction = jnp.mean if error == "mean" else jnp.max
            coefs = toeplitz.optimize_banded_toeplitz(t, b, reduction_fn=reduction) if b > 1 else jnp.ones(1)
            return _make_strategy("banded", t, [], [], np.asarray(coefs))
    raise ValueError(f"strategy kind must be one of {KINDS}, got {kind!r}")


def sensitivity(
    strategy: Strategy, max_participations: int = 1, min_separation: int = 0, rounds: int | None = None
) -> float:
    """Delta: the worst case over patterns of <= k participations >= xi + 1 apart (module docstring), per unit
    clip norm, rounded up by a relative 1e-9. Uses jax_privacy (the "mf" extra).

    ``rounds`` = t <= T charges only the first t rounds released so far: C is lower-triangular, so they are
    C[:t, :t] x[:t] + Z[:t], the Toeplitz matrix of the first t coefficients (a run stopped early).
    """
    n = strategy.rounds if rounds is None else _check_int("rounds", rounds, 1)
    if n > strategy.rounds:
        raise ValueError(f"rounds must be <= the strategy's {strategy.rounds}, got {n}")
    k, min_sep = _check_participation(n, max_participations, min_separation)
    import jax
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import sensitivity as jp_sensitivity
    from jax_privacy.matrix_factorization import toeplitz

    coefs = strategy.toeplitz_coefs()[:n]
    with jax.enable_x64():
        if np.all(coefs >= 0) and np.all(np.diff(coefs) <= 0):
            # Non-negative non-increasing Toeplitz: exact (arXiv:2405.13763 Thm 2).
            sq = float(toeplitz.minsep_sensitivity_squared(jnp.asarray(coefs), min_sep=min_sep, max_participations=k))
            value = math.sqrt(sq)
        else:
            # Any C: the upper bound of arXiv:2306.08153 Alg. 4 (valid, possibly loose).
            c = jnp.asarray(_materialize(coefs))
            value = float(jp_sensitivity.get_min_sep_sensitivity_upper_bound(c, min_sep=min_sep, max_participations=k))
    return value * (1.0 + _SENS_MARGIN)


def _materialize(coefs: np.ndarray) -> np.ndarray:
    """The T x T lower-triangular Toeplitz matrix with first column ``coefs``."""
    t = len(coefs)
    idx = np.arange(t)[:, None] - np.arange(t)[None, :]
    return np.where(idx >= 0, coefs[np.clip(idx, 0, t - 1)], 0.0)


def pattern_sensitivity(strategy: Strategy, rounds: Sequence[int]) -> float:
    """Sensitivity of one user's actual participation rounds u (0-based): sqrt(sum_{i,j in u} |X_ij|), X = C^T C
    (arXiv:2306.08153 eq. (5)); what a node charges for the rounds it was in. Numpy only."""
    u = sorted({_check_int("round", r, 0) for r in rounds})
    if not u:
        return 0.0
    if u[-1] >= strategy.rounds:
        raise ValueError(f"rounds must be < the strategy's {strategy.rounds}, got {u[-1]}")
    c = strategy.toeplitz_coefs()
    cols = np.stack([np.concatenate([np.zeros(j), c[: strategy.rounds - j]]) for j in u], axis=1)  # C[:, u]
    return math.sqrt(float(np.abs(cols.T @ cols).sum())) * (1.0 + _SENS_MARGIN)


def prefix_variance(strategy: Strategy) -> np.ndarray:
    """Per-coordinate variance of the prefix-sum noise at rounds 1..T, per unit Z std: the squared row norms of
    B = A C^{-1} (jax_privacy toeplitz.per_query_error: B's coefficients are cumsum of C^{-1}'s)."""
    impulse = np.zeros((strategy.rounds, 1))
    impulse[0, 0] = 1.0
    inv = _run(strategy, impulse)[:, 0]  # C^{-1}'s first column: the recurrence applied to e_0
    return np.cumsum(np.cumsum(inv) ** 2)


# ----------------------------------------------------------------------------------------- streaming noise
class NoiseState(NamedTuple):
    """The streaming C^{-1} Z after ``round`` rounds: ``buffers`` (state_rows x dim), module docstring.

    banded: row j holds w_{round-1-j} (zeros before round 0). blt: the nbuf buffers.
    """

    round: int
    buffers: np.ndarray

    @property
    def dim(self) -> int:
        return int(self.buffers.shape[1])

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"round": np.asarray(self.round, dtype=np.int64), "buffers": self.buffers.copy()}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> NoiseState:
        if "round" not in a or "buffers" not in a or np.asarray(a["round"]).shape != ():
            raise ValueError("matrix-factorization noise state needs a scalar round and a buffers array")
        buffers = np.array(a["buffers"], dtype=np.float64)
        if buffers.ndim != 2 or not np.all(np.isfinite(buffers)):
            raise ValueError(f"noise state buffers must be a finite 2-D array, got shape {buffers.shape}")
        return cls(_check_int("noise state round", int(a["round"]), 0), buffers)


def init_noise(strategy: Strategy, dim: int) -> NoiseState:
    """The state before round 0: zero buffers."""
    return NoiseState(0, np.zeros((strategy.state_rows, _check_int("dim", dim, 1))))


def _step(strategy: Strategy, buffers: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One row of C^{-1} Z given the next draw z (module docstring); returns (w_t, new buffers)."""
    if strategy.kind == "blt":
        # arXiv:2408.08868 Alg. 3: x_i = y_i - omega . bufs; bufs <- diag(theta) bufs + x_i
        w = z - strategy.output_scale @ buffers
        return w, strategy.buf_decay[:, None] * buffers + w[None, :]
    c = strategy.coefs
    # forward substitution in the banded lower-triangular C w = Z: w_t = (z_t - sum_{j>=1} c_j w_{t-j}) / c_0
    w = (z - c[1:] @ buffers) / c[0]
    return w, np.concatenate([w[None, :], buffers[:-1]]) if len(buffers) else buffers


def _run(strategy: Strategy, draws: np.ndarray) -> np.ndarray:
    buffers = np.zeros((strategy.state_rows, draws.shape[1]))
    out = np.empty_like(draws)
    for t in range(draws.shape[0]):
        out[t], buffers = _step(strategy, buffers, draws[t])
    return out


def next_noise(
    state: NoiseState, strategy: Strategy, std: float, rng: np.random.Generator
) -> tuple[np.ndarray, NoiseState]:
    """The noise w_t to add to round t's sum (t = state.round), and the state after it.

    Draws z_t ~ N(0, std^2 I_dim) from ``rng`` (std = z L; the accounting's noise multiplier times the clip norm).
    Refuses a round beyond the strategy's T (its sensitivity covers T rounds only).
    """
    s = float(std)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"std must be a finite number > 0, got {std!r}")
    if state.round >= strategy.rounds:
        raise ValueError(f"the strategy covers {strategy.rounds} rounds; round {state.round} is beyond it")
    if state.buffers.shape[0] != strategy.state_rows:
        raise ValueError(
            f"noise state has {state.buffers.shape[0]} buffer rows, the {strategy.kind} strategy needs "
            f"{strategy.state_rows}"
        )
    z = rng.standard_normal(state.dim) * s
    w, buffers = _step(strategy, state.buffers, z)
    return w, NoiseState(state.round + 1, buffers)
