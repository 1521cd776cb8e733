"""Matrix-factorization noise (shuffledp.mechanisms.matrix_factorization, issue 27): the sensitivity against a
brute force over all participation patterns, the streaming noise's covariance (Monte Carlo, and rejection of wrong
noise), save/restore of the noise state, and the noise multiplier against dp_accounting."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_mechanism
from dp_accounting.rdp import rdp_privacy_accountant

from shuffledp.accountants import matrix_factorization as mf_acc
from shuffledp.mechanisms import matrix_factorization as mf
from shuffledp.security.rng import make_rng

# jax_privacy (the "mf" extra) is in the dev extra, so the test command installs it: no skip when it is missing.

T = 12


@pytest.fixture(scope="module")
def strategies() -> dict[str, mf.Strategy]:
    # Optimised once per module (jax_privacy's JIT compilation dominates: ~10-60 s on a busy 2-core machine).
    return {
        "blt": mf.build_strategy("blt", T, max_participations=3, min_separation=3, min_buffers=2, max_buffers=2),
        "banded": mf.build_strategy("banded", T, bands=4),
    }


def _matrix(strategy: mf.Strategy) -> np.ndarray:
    c = strategy.toeplitz_coefs()
    return np.array([[c[i - j] if i >= j else 0.0 for j in range(T)] for i in range(T)])


def _patterns(k: int, xi: int):
    """Every set of 1..k rounds of range(T) with >= xi rounds strictly between two of them."""
    for size in range(1, k + 1):
        for u in itertools.combinations(range(T), size):
            if all(b - a >= xi + 1 for a, b in itertools.pairwise(u)):
                yield u


def _brute_force(c: np.ndarray, k: int, xi: int) -> tuple[float, float]:
    """(max ||C u||_2 over 0/1 patterns u, max sqrt(sum_{i,j in u} |X_ij|)), X = C^T C."""
    x = c.T @ c
    best_norm = best_abs = 0.0
    for u in _patterns(k, xi):
        ind = np.zeros(T)
        ind[list(u)] = 1.0
        best_norm = max(best_norm, float(np.linalg.norm(c @ ind)))
        best_abs = max(best_abs, math.sqrt(float(np.abs(x[np.ix_(u, u)]).sum())))
    return best_norm, best_abs


# ------------------------------------------------------------------------------------------- (a) sensitivity
@pytest.mark.parametrize("kind", ["blt", "banded"])
@pytest.mark.parametrize(("k", "xi"), [(1, 0), (2, 0), (3, 3), (3, 1), (4, 2), (6, 1), (12, 0)])
def test_sensitivity_equals_brute_force_over_all_patterns(strategies, kind, k, xi):
    s = strategies[kind]
    c = _matrix(s)
    assert np.all(c.T @ c >= 0)  # so max ||C u|| is the worst case over gradient directions too
    by_norm, by_abs = _brute_force(c, k, xi)
    assert by_norm == pytest.approx(by_abs, rel=1e-12)
    sens = mf.sensitivity(s, k, xi)
    assert sens >= by_norm  # never below the true worst case
    assert sens == pytest.approx(by_norm, rel=1e-8)
    # a node's cost for the worst pattern is the same figure (numpy path, no JAX)
    worst = max(_patterns(k, xi), key=lambda u: mf.pattern_sensitivity(s, u))
    assert mf.pattern_sensitivity(s, worst) == pytest.approx(by_norm, rel=1e-8)


@pytest.mark.parametrize("kind", ["blt", "banded"])
def test_sensitivity_of_the_rounds_released_so_far(strategies, kind):
    s = strategies[kind]
    for t in (1, 5, 8):
        c = _matrix(s)[:t, :t]
        best = max(
            float(np.linalg.norm(c.sum(axis=1, where=np.isin(np.arange(t), u)[None, :])))
            for u in _patterns(3, 1)
            if u[-1] < t
        )
        assert mf.sensitivity(s, 3, 1, rounds=t) == pytest.approx(best, rel=1e-8)
        assert mf.sensitivity(s, 3, 1, rounds=t) <= mf.sensitivity(s, 3, 1) * (1 + 1e-12)
    with pytest.raises(ValueError, match="rounds must be <="):
        mf.sensitivity(s, 1, 0, rounds=T + 1)


def test_sensitivity_is_not_the_single_participation_figure_times_sqrt_k(strategies):
    # Bands 4 > separation 2 (xi = 1): the columns overlap, so k participations cost more than sqrt(k) columns.
    s = strategies["banded"]
    assert mf.sensitivity(s, 3, 1) > math.sqrt(3) * mf.sensitivity(s, 1, 0) * (1 + 1e-6)
    # With separation >= bands the columns are orthogonal: exactly sqrt(k) (unit-norm columns).
    assert mf.sensitivity(s, 3, 3) == pytest.approx(math.sqrt(3), rel=1e-8)


def test_a_non_monotone_strategy_gets_an_upper_bound():
    s = mf.Strategy.from_arrays(
        {
            "kind": np.asarray(mf.KINDS.index("banded")),
            "rounds": np.asarray(T),
            "buf_decay": np.zeros(0),
            "output_scale": np.zeros(0),
            "coefs": np.array([1.0, -0.5, 0.7]),
        }
    )
    by_norm, by_abs = _brute_force(_matrix(s), 3, 1)
    assert mf.sensitivity(s, 3, 1) >= by_abs >= by_norm


def test_bad_inputs_are_refused_with_one_line(strategies):
    s = strategies["banded"]
    for call, msg in [
        (lambda: mf.sensitivity(s, 0, 0), "max_participations"),
        (lambda: mf.sensitivity(s, 1, -1), "min_separation"),
        (lambda: mf.pattern_sensitivity(s, [0, T]), "rounds must be <"),
        (lambda: mf.build_strategy("tree", 8), "kind"),
        (lambda: mf.build_strategy("banded", 8, bands=9), "bands must be <="),
        (lambda: mf.build_strategy("blt", 8, error="median"), "error"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call()


# ------------------------------------------------------------------------------------ (b) noise covariance
STD = 1.7
SAMPLES = 40_000  # the dim axis: independent copies of the T-round stream
Z_LIMIT = 5.0  # per-entry z-score limit; P(|N(0,1)| > 5) = 5.7e-7, 78 entries


def _stream(strategy: mf.Strategy, std: float, seed: int) -> np.ndarray:
    rng = make_rng(seed)
    state = mf.init_noise(strategy, SAMPLES)
    rows = []
    for _ in range(T):
        w, state = mf.next_noise(state, strategy, std, rng)
        rows.append(w)
    return np.array(rows)  # (T, SAMPLES): the per-round noise w_t


def _max_z_score(prefix: np.ndarray, expected: np.ndarray) -> float:
    """Largest |empirical - expected| covariance entry in standard errors (Gaussian: Var(S_ij hat) =
    (S_ii S_jj + S_ij^2) / N)."""
    n = prefix.shape[1]
    emp = prefix @ prefix.T / n  # zero mean is known
    se = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / n)
    return float(np.max(np.abs(emp - expected) / se))


@pytest.mark.parametrize("kind", ["blt", "banded"])
def test_prefix_noise_has_the_covariance_of_the_factorization(strategies, kind):
    s = strategies[kind]
    a = np.tril(np.ones((T, T)))
    b = a @ np.linalg.inv(_matrix(s))  # B = A C^{-1}
    expected = STD**2 * b @ b.T
    np.testing.assert_allclose(mf.prefix_variance(s), np.diag(b @ b.T), rtol=1e-10)

    w = _stream(s, STD, seed=27)
    # exactness first: the recurrence is C^{-1} Z for the Z the generator drew
    rng = make_rng(27)
    z = np.array([rng.standard_normal(SAMPLES) * STD for _ in range(T)])
    np.testing.assert_allclose(w, np.linalg.solve(_matrix(s), z), rtol=1e-9, atol=1e-9)

    assert _max_z_score(np.cumsum(w, axis=0), expected) < Z_LIMIT

    # the same check rejects wrong noise: a 5% larger scale, white (uncorrelated) noise of the same Z std, and
    # prefix noise with the right variances but independent across rounds
    wrong_scale = np.cumsum(_stream(s, STD * 1.05, seed=27), axis=0)
    white = np.cumsum(make_rng(28).standard_normal((T, SAMPLES)) * STD, axis=0)
    independent = make_rng(29).standard_normal((T, SAMPLES)) * np.sqrt(np.diag(expected))[:, None]
    for bad in (wrong_scale, white, independent):
        assert _max_z_score(bad, expected) > 2 * Z_LIMIT


# -------------------------------------------------------------------------------------- (c) save / restore
@pytest.mark.parametrize("kind", ["blt", "banded"])
def test_a_restored_noise_state_continues_the_identical_sequence(strategies, kind, tmp_path):
    s0 = strategies[kind]
    np.savez(tmp_path / "strategy.npz", **s0.to_arrays())
    with np.load(tmp_path / "strategy.npz") as f:
        s = mf.Strategy.from_arrays(dict(f))
    assert np.array_equal(s.toeplitz_coefs(), s0.toeplitz_coefs())

    rng = make_rng(5)
    state = mf.init_noise(s, 7)
    straight = []
    for _ in range(T):
        w, state = mf.next_noise(state, s, STD, rng)
        straight.append(w)

    rng = make_rng(5)
    state = mf.init_noise(s, 7)
    resumed = []
    for _ in range(5):
        w, state = mf.next_noise(state, s, STD, rng)
        resumed.append(w)
    np.savez(tmp_path / "noise.npz", **state.to_arrays())
    del state
    with np.load(tmp_path / "noise.npz") as f:
        state = mf.NoiseState.from_arrays(dict(f))
    assert state.round == 5
    for _ in range(5, T):
        w, state = mf.next_noise(state, s, STD, rng)
        resumed.append(w)
    assert np.array_equal(np.array(resumed), np.array(straight))

    # the state is what carries the correlation: restarting from a fresh state would not continue the sequence
    rng = make_rng(5)
    for _ in range(5):
        rng.standard_normal(7)
    fresh = mf.NoiseState(5, mf.init_noise(s, 7).buffers)
    w, _ = mf.next_noise(fresh, s, STD, rng)
    assert not np.allclose(w, straight[5])

    with pytest.raises(ValueError, match="covers 12 rounds"):
        mf.next_noise(mf.NoiseState(T, state.buffers), s, STD, rng)
    with pytest.raises(ValueError, match="buffer rows"):
        mf.next_noise(mf.NoiseState(0, np.zeros((s.state_rows + 1, 7))), s, STD, rng)
    with pytest.raises(ValueError, match="scalar round"):
        mf.NoiseState.from_arrays({"buffers": np.zeros((1, 2))})


# ------------------------------------------------------------------------------------------ (d) planning
@pytest.mark.parametrize("sens", [1.0, math.sqrt(3), 2.184602225546725])
@pytest.mark.parametrize("eps", [0.5, 1.0, 4.0, 8.0])
def test_noise_multiplier_is_the_least_that_fits_per_dp_accounting(sens, eps):
    delta = 1e-6
    z = mf_acc.min_noise_multiplier(sens, eps, delta)

    def exact_delta(zz: float) -> float:  # Balle-Wang 2018, dp_accounting's Gaussian privacy loss
        return privacy_loss_mechanism.GaussianPrivacyLoss(zz / sens, sensitivity=1.0).get_delta_for_epsilon(eps)

    assert exact_delta(z) <= delta  # fits
    assert exact_delta(z * (1 - 1e-6)) > delta  # and is the least (to 1e-6)
    from dp_accounting import gaussian_mechanism

    assert z == pytest.approx(sens * gaussian_mechanism.get_sigma_gaussian(eps, delta), rel=1e-7)
    assert mf_acc.epsilon(z, sens, delta) <= eps
    # the run's dp_event is the Gaussian with noise multiplier z / Delta; RDP (looser) never reports less
    event = mf_acc.dp_event(z, sens)
    assert event.noise_multiplier == pytest.approx(z / sens, rel=1e-15)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(event)
    assert acc.get_epsilon(delta) >= eps * (1 - 1e-9)
