"""Shared pieces of the LDP randomizers: exact RR coin, parameter checks, message format and bytes."""

import math

import mpmath
import numpy as np
import pytest

from shuffledp.mechanisms import ldp_common as lc
from shuffledp.security.rng import make_rng


@pytest.mark.parametrize("eps0", [1e-6, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0, 20.0, 36.0])
def test_flip_probability_is_on_grid_and_never_unsafe(eps0):
    flip = lc.rr_flip_probability(eps0)
    assert flip * 2**53 == math.floor(flip * 2**53)  # a multiple of 2**-53
    with mpmath.workdps(60):
        q = 1 / (1 + mpmath.exp(mpmath.mpf(eps0)))
        assert mpmath.mpf(flip) >= q  # rounded up: (1-flip)/flip <= e^eps0
        assert mpmath.mpf(flip) - q <= mpmath.mpf(2) ** -53  # and by at most one grid step
        assert (1 - mpmath.mpf(flip)) / mpmath.mpf(flip) <= mpmath.exp(mpmath.mpf(eps0))


def test_uniform_sampler_is_on_the_2_pow_minus_53_grid():
    # realized_probability relies on Generator.random() returning k * 2**-53
    u = make_rng(11).random(100_000)
    assert np.all(u * 2**53 == np.floor(u * 2**53))
    assert np.all((u >= 0) & (u < 1))


def test_realized_probability_of_bernoulli():
    p = np.array([0.0, 2.0**-53, 0.3, 0.5, 1 - 2.0**-53])
    r = lc.realized_probability(p)
    assert np.all(r >= p) and np.all(r - p < 2.0**-53)
    draws = lc.bernoulli(np.full(200_000, 0.3), make_rng(12))
    se = math.sqrt(0.3 * 0.7 / draws.size)
    assert abs(draws.mean() - 0.3) <= 4 * se  # 4 standard errors


def test_success_probability_is_clamped():
    flip = lc.rr_flip_probability(1.0)
    p = lc.rr_success_probability(np.array([-5.0, -1.0, 0.0, 1.0, 7.0]), flip)
    assert p[0] == p[1] == flip and p[3] == p[4] == 1 - flip and p[2] == 0.5


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 36.5, True, "1"])
def test_eps0_rejected(bad):
    with pytest.raises(ValueError, match="eps0"):
        lc.check_eps0(bad)


def test_int_and_positive_checks():
    with pytest.raises(ValueError, match=r"d must be in \[1"):
        lc.check_int("d", 0, 1)
    with pytest.raises(ValueError, match="d must be an integer"):
        lc.check_int("d", 2.0, 1)
    with pytest.raises(ValueError, match="radius"):
        lc.check_positive("radius", 0.0)
    with pytest.raises(ValueError, match="radius"):
        lc.check_positive("radius", float("nan"))


def test_check_batch_and_norm():
    with pytest.raises(ValueError, match=r"shape \(k, 3\)"):
        lc.check_batch(np.zeros(3), 3)
    with pytest.raises(ValueError, match="row 1 of X must be finite"):
        lc.check_norm_bound(np.array([0.5, np.nan]), 1.0, "l_2")
    with pytest.raises(ValueError, match="finite"):
        lc.check_norm_bound(np.array([np.inf]), 1.0, "l_1")
    lc.check_norm_bound(np.array([1.0, 1.0 + 1e-12]), 1.0, "l_2")  # within the relative slack
    with pytest.raises(ValueError, match=r"row 1 .* l_2 norm"):
        lc.check_norm_bound(np.array([1.0, 1.01]), 1.0, "l_2")


@pytest.mark.parametrize(
    "fmt",
    [
        lc.MessageFormat(1, 2),
        lc.MessageFormat(1, 200),
        lc.MessageFormat(1, 70_000),
        lc.MessageFormat(7, 2**11, vector=True),
        lc.MessageFormat(3, 2**40, vector=True),
    ],
)
def test_message_bytes_roundtrip_fixed_length(fmt):
    rng = make_rng(13)
    msgs = rng.integers(0, fmt.alphabet_size, size=(50, *fmt.shape)).astype(fmt.dtype)
    msgs[0] = fmt.alphabet_size - 1  # the largest symbol
    raw = fmt.to_bytes(msgs)
    assert raw.shape == (50, fmt.message_bytes) and raw.dtype == np.uint8
    blobs = [bytes(row) for row in raw]
    assert {len(b) for b in blobs} == {fmt.message_bytes}
    np.testing.assert_array_equal(fmt.from_bytes(blobs), msgs)
    np.testing.assert_array_equal(fmt.from_bytes(raw), msgs)
    assert fmt.bits == fmt.symbols * math.ceil(math.log2(fmt.alphabet_size))


def test_message_validation_rejects():
    fmt = lc.MessageFormat(1, 10)
    assert fmt.valid_mask(np.array([0, 9, 10, 3])).tolist() == [True, True, False, True]
    assert fmt.valid_mask(np.array([-1, 2], dtype=np.int64)).tolist() == [False, True]
    with pytest.raises(ValueError, match=r"message 2 .* \[0, 10\)"):
        fmt.validate(np.array([0, 9, 10]))
    with pytest.raises(ValueError, match="integer dtype"):
        fmt.validate(np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        fmt.validate(np.zeros((2, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="expected exactly 1"):
        fmt.from_bytes([b"\x01", b"\x01\x02"])
    with pytest.raises(ValueError, match="alphabet"):
        fmt.from_bytes([b"\x0b"])  # symbol 11 >= 10
    vfmt = lc.MessageFormat(4, 16, vector=True)
    assert vfmt.valid_mask(np.zeros((0, 4), dtype=np.uint8)).shape == (0,)
    with pytest.raises(ValueError, match="exactly 1 symbol"):
        lc.MessageFormat(2, 4)
