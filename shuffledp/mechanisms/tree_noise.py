"""Noise-only binary-counter tree for DP-FTRL (spec 003 sec 1), as pure functions over an explicit state.

The analyzer keeps the exact running sum G_t of the clipped updates itself; this module only produces the
tree's noise Z_t, so that the released prefix sum is s_t = G_t + Z_t (spec 003 sec 1, "noise-only tree").

    state = init_tree(dim)
    z_t, state = add_leaf(state, std, rng)            # prefix noise Z_t after leaf t
    r_t, state = residual_noise(state, std, rng)      # or: the residual Z_t - Z_{t-1} (TreeResidualSumQuery form)
    z_end, virtual, state = complete_tree(state, std, rng)   # tree completion before a restart (spec 003 sec 2)
    state = init_tree(dim)                            # restart: a fresh tree

Online form (spec 003 sec 1): a stack of (height, vector) nodes, one per 1-bit of t, highest first. A leaf
pushes a height-0 node; while the two top nodes have equal height h they are replaced by one height-(h+1) node,
whose noise is drawn only now, when its last leaf has arrived. Stack size = popcount(t) <= depth(t); the state
holds at most lg t + 1 vectors, plus the returned Z_t.

Estimators (the stacked vector depends on it, so the first leaf fixes it for the whole tree):
- vanilla: the vector is the node's noise x_h ~ N(0, std^2 I); Z_t = sum of the stack; Var = popcount(t) std^2.
  x_h is drawn as the discrete Gaussian on a power-of-two grid g (mechanisms.discrete_gaussian: exact sampling,
  std raised by the rounding's sensitivity growth); with leaves rounded to g, every node value and vanilla prefix
  sum is an exact float multiple of g. The efficient estimator's weights 1/(2 - 2^-h) are applied in floating
  point to noise-only values (a post-processing whose rounding errors depend on the noise, not the data).
- efficient (Honaker, bottom-up only; spec 003 sec 1, marked [R]): the vector is u_h = x_h + (u_left + u_right)/2,
  u_0 = x_0. By induction u_h = c_h S + noise with c_h = 1 + c_{h-1}/2 = 2 - 2^-h (S = node's true sum) and
  Var(u_h) = std^2 (1 + Var(u_{h-1})/2) = std^2 (2 - 2^-h), so u_h / (2 - 2^-h) is an unbiased node estimate
  with variance std^2 / (2 - 2^-h). Z_t = sum over the stack of u_h / (2 - 2^-h): zero mean, variance
  std^2 sum_{h in bits(t)} 1/(2 - 2^-h) (spec 003 sec 7.3; checked by Monte Carlo in tests/test_tree_noise.py).
  Privacy is that of the released nodes (post-processing).

Every draw comes from the caller's numpy Generator (shuffledp.security.rng.make_rng, design sec 6). A state is plain
arrays (to_arrays / from_arrays), so the analyzer can checkpoint it and resume without redrawing any node.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from shuffledp.mechanisms import discrete_gaussian

__all__ = [
    "TreeState",
    "init_tree",
    "add_leaf",
    "residual_noise",
    "prefix_noise",
    "complete_tree",
    "prefix_variance",
    "VANILLA",
    "EFFICIENT",
    "UNSET",
]

UNSET, VANILLA, EFFICIENT = -1, 0, 1  # TreeState.estimator


class TreeState(NamedTuple):
    """A noise-only tree after `leaves` leaves (spec 003 sec 1).

    heights: int64 (k,), strictly decreasing, exactly the 1-bits of `leaves` (k = popcount(leaves)).
    values:  float64 (k, dim): node noise x_h (vanilla) or the Honaker u_h (efficient), one row per stacked node.
    estimator: UNSET (empty tree, nothing drawn yet), VANILLA or EFFICIENT; fixed by the first leaf.
    std: the node noise std of this tree (NaN while empty); fixed by the first leaf, since all nodes of a tree
    must have the same std for the Honaker weights and for the accounting.
    The previous prefix noise Z_{t-1} is not stored: it is a function of the stack (prefix_noise).
    """

    leaves: int
    heights: np.ndarray
    values: np.ndarray
    estimator: int
    std: float

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {
            "leaves": np.asarray(self.leaves, dtype=np.int64),
            "heights": np.asarray(self.heights, dtype=np.int64),
            "values": np.asarray(self.values, dtype=np.float64),
            "estimator": np.asarray(self.estimator, dtype=np.int64),
            "std": np.asarray(self.std, dtype=np.float64),
        }

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> TreeState:
        missing = {"leaves", "heights", "values", "estimator", "std"} - set(a)
        if missing:
            raise ValueError(f"tree state is missing arrays {sorted(missing)}")
        scalars = {}
        for key in ("leaves", "estimator", "std"):
            arr = np.asarray(a[key])
            if arr.shape != ():
                raise ValueError(f"tree state {key!r} must be a scalar, got shape {arr.shape}")
            scalars[key] = arr
        if not np.issubdtype(scalars["leaves"].dtype, np.integer) or int(scalars["leaves"]) < 0:
            raise ValueError(f"tree state 'leaves' must be an integer >= 0, got {scalars['leaves']!r}")
        leaves = int(scalars["leaves"])
        if not np.issubdtype(scalars["estimator"].dtype, np.integer) or int(scalars["estimator"]) not in (
            UNSET,
            VANILLA,
            EFFICIENT,
        ):
            raise ValueError(f"tree state 'estimator' must be -1, 0 or 1, got {scalars['estimator']!r}")
        estimator = int(scalars["estimator"])
        std = float(scalars["std"])
        heights = np.asarray(a["heights"])
        if heights.ndim != 1 or not (heights.size == 0 or np.issubdtype(heights.dtype, np.integer)):
            raise ValueError(f"tree state 'heights' must be a 1-D integer array, got {heights.dtype} {heights.shape}")
        heights = heights.astype(np.int64)
        values = np.asarray(a["values"])
        if values.ndim != 2 or values.shape[1] < 1 or not np.issubdtype(values.dtype, np.floating):
            raise ValueError(f"tree state 'values' must be a 2-D float array (k, dim >= 1), got {values.shape}")
        values = values.astype(np.float64)
        # the stack is exactly the binary decomposition of `leaves` (spec 003 sec 1: one node per 1-bit)
        expected = _bits(leaves)
        if heights.tolist() != expected:
            raise ValueError(f"tree state heights {heights.tolist()} are not the 1-bits {expected} of leaves={leaves}")
        if values.shape[0] != heights.size:
            raise ValueError(f"tree state has {heights.size} stacked nodes but {values.shape[0]} value rows")
        if not np.all(np.isfinite(values)):
            raise ValueError("tree state 'values' must be finite")
        if leaves == 0:
            if estimator != UNSET or not math.isnan(std):
                raise ValueError("an empty tree state must have estimator -1 and std NaN")
        elif estimator == UNSET or not (math.isfinite(std) and std >= 0):
            raise ValueError(
                f"a non-empty tree state needs estimator 0/1 and a finite std >= 0, got {estimator}, {std}"
            )
        return cls(leaves, heights, values, estimator, std)


def _bits(t: int) -> list[int]:
    """Heights of t's decomposition nodes, highest first (spec 003 sec 1, GetSum)."""
    return [h for h in range(t.bit_length() - 1, -1, -1) if (t >> h) & 1]


def _weight(h: int | np.ndarray) -> float | np.ndarray:
    """c_h = 2 - 2^-h: u_h / c_h is the unbiased Honaker node estimate (module docstring)."""
    return 2.0 - np.exp2(-np.asarray(h, dtype=np.float64))


def init_tree(dim: int) -> TreeState:
    """An empty tree over vectors of length dim (also the restart: a fresh tree, spec 003 sec 2)."""
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
    return TreeState(0, np.zeros(0, dtype=np.int64), np.zeros((0, int(dim))), UNSET, math.nan)


def prefix_noise(state: TreeState) -> np.ndarray:
    """Z_t of the current state: sum over the decomposition nodes (vanilla) or of u_h / (2 - 2^-h) (efficient)."""
    if state.leaves == 0:
        return np.zeros(state.dim)
    if state.estimator == EFFICIENT:
        return np.sum(state.values / _weight(state.heights)[:, None], axis=0)
    return np.sum(state.values, axis=0)


def _check_call(state: TreeState, std: float, rng: np.random.Generator, efficient: bool) -> tuple[float, int]:
    if not isinstance(state, TreeState):
        raise TypeError(f"state must be a TreeState, got {type(state).__name__}")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy Generator from shuffledp.security.rng.make_rng, got {type(rng).__name__}")
    std = float(std)
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"std must be a finite number >= 0, got {std!r}")
    estimator = EFFICIENT if efficient else VANILLA
    if state.leaves > 0:
        if estimator != state.estimator:
            names = {VANILLA: "vanilla", EFFICIENT: "efficient"}
            raise ValueError(
                f"this tree uses the {names[state.estimator]} estimator; it cannot switch to "
                f"{names[estimator]} mid-tree (restart with init_tree)"
            )
        if not math.isclose(std, state.std, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(
                f"this tree's nodes have std {state.std!r}; got std {std!r} (all nodes of one tree share it)"
            )
    return std, estimator


def _node_noise(
    dim: int, std: float, rng: np.random.Generator, sensitivity: float | None, grid: float | None, noise: str
) -> np.ndarray:
    """One node's noise: the discrete Gaussian on the grid (mechanisms.discrete_gaussian), for leaves rounded to
    that grid by the caller and a per-leaf sensitivity (None: std, i.e. a noise multiplier of 1); noise =
    "continuous": std N(0, I) in floating point."""
    sens = std if sensitivity is None else sensitivity
    return discrete_gaussian.grid_noise(dim, std, sens, rng, grid, noise=noise)


def add_leaf(
    state: TreeState,
    std: float,
    rng: np.random.Generator,
    efficient: bool = False,
    *,
    sensitivity: float | None = None,
    granularity: float | None = None,
    noise: str = "discrete",
) -> tuple[np.ndarray, TreeState]:
    """AddToTree (spec 003 sec 1): leaf t = state.leaves + 1 arrives; returns (Z_t, new state).

    Draws a node's noise (std, on the grid: _node_noise) for the new leaf node and for every node completed by it
    (the nodes whose last leaf is t), in increasing height. The input state is not modified.
    """
    std, estimator = _check_call(state, std, rng, efficient)
    dim = state.dim
    heights = state.heights.tolist()
    rows = list(state.values)
    heights.append(0)
    rows.append(_node_noise(dim, std, rng, sensitivity, granularity, noise))
    # merge equal-height tops: a node is created (its noise drawn) only now that its last leaf is in (sec 1)
    while len(heights) >= 2 and heights[-1] == heights[-2]:
        h = heights.pop()
        heights.pop()
        right = rows.pop()
        left = rows.pop()
        x = _node_noise(dim, std, rng, sensitivity, granularity, noise)
        # efficient: u_{h+1} = x_{h+1} + (u_left + u_right)/2 (Honaker bottom-up, sec 1 [R]); vanilla keeps x only
        rows.append(x + 0.5 * (left + right) if estimator == EFFICIENT else x)
        heights.append(h + 1)
    new = TreeState(
        state.leaves + 1,
        np.asarray(heights, dtype=np.int64),
        np.stack(rows).astype(np.float64, copy=False),
        estimator,
        std,
    )
    return prefix_noise(new), new


def residual_noise(
    state: TreeState,
    std: float,
    rng: np.random.Generator,
    efficient: bool = False,
    *,
    sensitivity: float | None = None,
    granularity: float | None = None,
    noise: str = "discrete",
) -> tuple[np.ndarray, TreeState]:
    """Adds leaf t and returns (Z_t - Z_{t-1}, new state) (spec 003 sec 1, residual form; Z_0 = 0).

    Released per-round totals r_t = g_t + (Z_t - Z_{t-1}) then have prefix sums G_t + Z_t (telescoping; exact up
    to float rounding). Z_{t-1} is recomputed from the stack, which add_leaf does not consume.
    """
    _check_call(state, std, rng, efficient)
    previous = prefix_noise(state)
    z, new = add_leaf(state, std, rng, efficient, sensitivity=sensitivity, granularity=granularity, noise=noise)
    return z - previous, new


def complete_tree(
    state: TreeState,
    std: float,
    rng: np.random.Generator,
    efficient: bool = False,
    *,
    sensitivity: float | None = None,
    granularity: float | None = None,
    noise: str = "discrete",
) -> tuple[np.ndarray, int, TreeState]:
    """Tree completion before a restart (spec 003 sec 2 [R]): add virtual zero leaves up to the next power of 2.

    Returns (Z_end, virtual leaves added, completed state). The completed stack is the single root node, so
    Z_end is one node's noise: variance std^2 (vanilla) or std^2 / (2 - 2^-h) (efficient, root height h).
    The model must not step on the virtual leaves, but they are released nodes: the accountant counts the padded
    tree of state.leaves (returned state) leaves (spec 003 sec 2/3, zeta_restarts(..., completion=True)).
    An empty tree or one whose size is already a power of two gets no virtual leaves. Then restart = init_tree.
    """
    _check_call(state, std, rng, efficient)
    t = state.leaves
    if t == 0:
        return np.zeros(state.dim), 0, state
    virtual = (1 << (t - 1).bit_length()) - t
    for _ in range(virtual):
        _, state = add_leaf(state, std, rng, efficient, sensitivity=sensitivity, granularity=granularity, noise=noise)
    return prefix_noise(state), virtual, state


def prefix_variance(leaves: int, efficient: bool = False) -> float:
    """Var(Z_t) / std^2 per coordinate after t leaves (spec 003 sec 1 / 7.3).

    vanilla popcount(t); efficient sum_{h in bits(t)} 1/(2 - 2^-h). Divide by the cohort^2 for a mean.
    """
    if isinstance(leaves, bool) or not isinstance(leaves, int | np.integer) or leaves < 0:
        raise ValueError(f"leaves must be an integer >= 0, got {leaves!r}")
    bits = _bits(int(leaves))
    if not efficient:
        return float(len(bits))
    return float(sum(1.0 / (2.0 - 2.0**-h) for h in bits))
