"""Noise-only binary-counter tree (spec 003 sec 1, properties of sec 7.1-7.3, tree completion of sec 2)."""

import io

import numpy as np
import pytest

from shuffledp.accountants.tree_aggregation import tree_depth, zeta_restarts
from shuffledp.mechanisms import tree_noise
from shuffledp.mechanisms.tree_noise import (
    TreeState,
    add_leaf,
    complete_tree,
    init_tree,
    prefix_noise,
    prefix_variance,
    residual_noise,
)
from shuffledp.security.rng import make_rng

# spec 003 sec 7.3 [C]: Var(Z_t)/std^2 of the efficient (Honaker) estimator for t = 1..8
EFFICIENT_VAR = [1.0, 0.667, 1.667, 0.571, 1.571, 1.238, 2.238, 0.533]


class OnesGenerator(np.random.Generator):
    """Unit-noise test mode (spec 003 sec 7.2): every standard normal draw is 1."""

    def standard_normal(self, size=None, dtype=np.float64, out=None):
        return np.ones(size, dtype=dtype)


def ones_rng() -> OnesGenerator:
    return OnesGenerator(np.random.PCG64(0))


@pytest.fixture(autouse=True)
def _unit_nodes(monkeypatch):
    """With ones_rng, every node's noise is std * 1 (the structural tests); else the real discrete Gaussian."""
    real = tree_noise._node_noise

    def node(dim, std, rng, sensitivity, grid, noise):
        if isinstance(rng, OnesGenerator):
            return std * rng.standard_normal(dim)
        return real(dim, std, rng, sensitivity, grid, noise)

    monkeypatch.setattr(tree_noise, "_node_noise", node)


def popcount(t: int) -> int:
    return bin(t).count("1")


def run(steps: int, std: float, rng, efficient: bool, dim: int = 3) -> tuple[list[np.ndarray], list[TreeState]]:
    state = init_tree(dim)
    zs, states = [], []
    for _ in range(steps):
        z, state = add_leaf(state, std, rng, efficient)
        zs.append(z)
        states.append(state)
    return zs, states


@pytest.mark.parametrize("efficient", [False, True])
def test_zero_std_gives_exactly_zero_noise(efficient):
    # spec 7.1: std 0 -> s_t = G_t exactly, i.e. Z_t == 0 at every t (exact comparison, no tolerance)
    zs, _ = run(40, 0.0, make_rng(1), efficient)
    assert all(np.array_equal(z, np.zeros(3)) for z in zs)
    # the residual form too
    state = init_tree(3)
    for _ in range(20):
        r, state = residual_noise(state, 0.0, make_rng(2), efficient)
        assert np.array_equal(r, np.zeros(3))


def test_unit_noise_vanilla_is_popcount():
    # spec 7.2: unit node noise -> Z_t == popcount(t) exactly; stack size popcount(t) <= depth(t)
    zs, states = run(70, 1.0, ones_rng(), efficient=False)
    for t, (z, st) in enumerate(zip(zs, states, strict=True), start=1):
        assert np.array_equal(z, np.full(3, float(popcount(t)))), t
        assert len(st.heights) == st.values.shape[0] == popcount(t) <= tree_depth(t)
        assert st.heights.tolist() == [h for h in range(t.bit_length() - 1, -1, -1) if (t >> h) & 1]
        assert st.leaves == t


def test_unit_noise_efficient_recursion():
    # with x_h = 1 everywhere u_h = h + 1 (u_h = 1 + (u_{h-1} + u_{h-1})/2), so Z_t = sum_{h in bits(t)} (h+1)/(2-2^-h)
    zs, _ = run(40, 1.0, ones_rng(), efficient=True)
    for t, z in enumerate(zs, start=1):
        bits = [h for h in range(t.bit_length()) if (t >> h) & 1]
        expected = sum((h + 1) / (2.0 - 2.0**-h) for h in bits)
        np.testing.assert_allclose(z, expected, rtol=1e-14)  # rounding only


def test_std_scales_noise():
    zs, _ = run(13, 2.5, ones_rng(), efficient=False)
    assert np.array_equal(zs[-1], np.full(3, 2.5 * popcount(13)))


@pytest.mark.parametrize("efficient", [False, True])
def test_monte_carlo_variance_and_mean(efficient):
    # spec 7.3: coordinates are independent replicas, so one run with dim = 40,000 gives 40k samples per t.
    # The relative standard error of a variance estimate is sqrt(2/n) = 0.7 %, so 5 % is a ~7 sigma bound; the
    # mean's standard error is sqrt(var/n), checked to 6 sigma.
    n, std = 40_000, 1.7
    zs, _ = run(8, std, make_rng(123), efficient, dim=n)
    for t, z in enumerate(zs, start=1):
        want = EFFICIENT_VAR[t - 1] if efficient else popcount(t)
        assert prefix_variance(t, efficient) == pytest.approx(want, abs=5e-4)  # the closed form vs spec's 3 digits
        var = float(np.var(z)) / std**2
        assert var == pytest.approx(want, rel=0.05), (t, var, want)
        assert abs(float(np.mean(z))) < 6 * std * np.sqrt(want / n), t


def test_residual_prefix_sums_equal_prefix_noise():
    # r_t = Z_t - Z_{t-1}: the prefix sums telescope to Z_t (float rounding only: <= 1e-12 at this scale)
    for efficient in (False, True):
        a, b = make_rng(5), make_rng(5)
        state_r, state_z = init_tree(4), init_tree(4)
        total = np.zeros(4)
        for _ in range(37):
            r, state_r = residual_noise(state_r, 3.0, a, efficient)
            z, state_z = add_leaf(state_z, 3.0, b, efficient)
            total += r
            np.testing.assert_allclose(total, z, rtol=0, atol=1e-12)
            assert np.array_equal(prefix_noise(state_r), z)


def test_add_leaf_does_not_mutate_input():
    _, states = run(6, 1.0, make_rng(9), efficient=True)
    before = {k: v.copy() for k, v in states[-1].to_arrays().items()}
    add_leaf(states[-1], 1.0, make_rng(10), efficient=True)
    after = states[-1].to_arrays()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def _npz_round_trip(state: TreeState) -> TreeState:
    buf = io.BytesIO()
    np.savez(buf, **state.to_arrays())
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        return TreeState.from_arrays(dict(f))


@pytest.mark.parametrize("efficient", [False, True])
def test_checkpoint_mid_tree_continues_identically(efficient):
    # an uninterrupted run vs a run checkpointed (npz, no pickle) after 11 leaves, same rng stream: bit-identical
    full, _ = run(29, 0.8, make_rng(77), efficient)
    rng = make_rng(77)
    state = init_tree(3)
    got = []
    for t in range(29):
        if t == 11:
            state = _npz_round_trip(state)
        z, state = add_leaf(state, 0.8, rng, efficient)
        got.append(z)
    assert all(np.array_equal(x, y) for x, y in zip(full, got, strict=True))
    # an empty tree round-trips as well
    empty = _npz_round_trip(init_tree(5))
    assert empty.leaves == 0 and empty.dim == 5


def _valid_arrays() -> dict[str, np.ndarray]:
    _, states = run(6, 1.0, make_rng(3), efficient=False)  # 6 = 110b: heights [2, 1]
    return states[-1].to_arrays()


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.pop("values"), "missing"),
        (lambda a: a.update(heights=np.array([2, 0])), "1-bits"),
        (lambda a: a.update(leaves=np.asarray(7)), "1-bits"),
        (lambda a: a.update(leaves=np.asarray(-1)), "leaves"),
        (lambda a: a.update(leaves=np.asarray(6.0)), "leaves"),
        (lambda a: a.update(values=a["values"][:1]), "value rows"),
        (lambda a: a.update(values=a["values"][0]), "2-D"),
        (lambda a: a.update(values=np.full((2, 3), np.nan)), "finite"),
        (lambda a: a.update(estimator=np.asarray(2)), "estimator"),
        (lambda a: a.update(estimator=np.asarray(-1)), "non-empty"),
        (lambda a: a.update(std=np.asarray(np.nan)), "non-empty"),
        (lambda a: a.update(std=np.asarray([1.0])), "scalar"),
    ],
)
def test_bad_arrays_rejected(change, match):
    a = _valid_arrays()
    TreeState.from_arrays(a)  # the unmodified arrays load
    change(a)
    with pytest.raises(ValueError, match=match):
        TreeState.from_arrays(a)


def test_mode_and_std_fixed_per_tree_and_argument_errors():
    _, state = add_leaf(init_tree(2), 1.0, make_rng(1), efficient=False)
    with pytest.raises(ValueError, match="cannot switch"):
        add_leaf(state, 1.0, make_rng(1), efficient=True)
    with pytest.raises(ValueError, match="share"):
        add_leaf(state, 2.0, make_rng(1))
    with pytest.raises(ValueError, match="std"):
        add_leaf(init_tree(2), -1.0, make_rng(1))
    with pytest.raises(ValueError, match="std"):
        add_leaf(init_tree(2), float("inf"), make_rng(1))
    with pytest.raises(TypeError, match="Generator"):
        add_leaf(init_tree(2), 1.0, np.random)
    with pytest.raises(ValueError, match="dim"):
        init_tree(0)
    # a fresh tree (restart) may use another estimator and std
    add_leaf(init_tree(2), 2.0, make_rng(1), efficient=True)


@pytest.mark.parametrize("t, virtual", [(1, 0), (2, 0), (3, 1), (5, 3), (8, 0), (9, 7), (12, 4)])
def test_completion_pads_to_power_of_two(t, virtual):
    _, states = run(t, 1.0, ones_rng(), efficient=False)
    z_end, added, done = complete_tree(states[-1], 1.0, ones_rng(), efficient=False)
    assert added == virtual and done.leaves == t + virtual
    assert done.leaves & (done.leaves - 1) == 0  # a power of two
    assert done.heights.tolist() == [done.leaves.bit_length() - 1]  # a single root node
    assert np.array_equal(z_end, np.ones(3))  # unit noise: one node
    # the padded tree is what the accountant counts for a completed (non-final) tree (spec 003 sec 2/3)
    assert zeta_restarts([t, 1], completion=True) == tree_depth(done.leaves) + 1


def test_completion_of_empty_tree_is_a_no_op():
    z, added, state = complete_tree(init_tree(4), 1.0, make_rng(0))
    assert added == 0 and state.leaves == 0 and np.array_equal(z, np.zeros(4))


@pytest.mark.parametrize("efficient", [False, True])
def test_completion_root_variance(efficient):
    # after 5 leaves (Var popcount 2 vanilla) completion to 8 leaves leaves one root: Var std^2 (vanilla) or
    # std^2/(2 - 2^-3) (efficient). 40k replicas: 5 % is ~7 standard errors.
    n, std = 40_000, 0.9
    _, states = run(5, std, make_rng(11), efficient, dim=n)
    z_end, added, done = complete_tree(states[-1], std, make_rng(12), efficient)
    assert added == 3
    want = 1.0 / (2.0 - 2.0**-3) if efficient else 1.0
    assert float(np.var(z_end)) / std**2 == pytest.approx(want, rel=0.05)
    assert np.array_equal(z_end, prefix_noise(done))
