"""HPKE sealing (design 5.1): roundtrip, binding to run and round, tamper detection, fixed length."""

import numpy as np
import pytest

from shuffledp.security.sealing import (
    BIT_MESSAGE_BYTES,
    SEAL_OVERHEAD,
    SealingError,
    generate_keypair,
    open_sealed,
    pack_labelled_bits,
    private_key_bytes,
    private_key_from_bytes,
    round_info,
    seal,
    seal_many,
    sealed_length,
    unpack_labelled_bits,
)


def test_roundtrip_and_fixed_length():
    priv, pub = generate_keypair()
    info = round_info("run-a", 3)
    for n in (0, 1, 5, 100, 4096):
        msg = bytes(range(256)) * (n // 256) + bytes(n % 256)
        ct = seal(pub, msg, info)
        assert len(ct) == n + SEAL_OVERHEAD == sealed_length(n)
        assert open_sealed(priv, ct, info) == msg
    # fresh ephemeral key per seal: equal plaintexts give different, equally long ciphertexts
    a, b = seal(pub, b"x" * 5, info), seal(pub, b"x" * 5, info)
    assert a != b and len(a) == len(b)


def test_wrong_round_or_run_fails_to_open():
    priv, pub = generate_keypair()
    ct = seal(pub, b"hello", round_info("run-a", 3))
    for info in (round_info("run-a", 4), round_info("run-b", 3), round_info("run-a3", 0), b""):
        with pytest.raises(SealingError):
            open_sealed(priv, ct, info)


def test_info_is_unambiguous():
    # length prefix: ("a1", 2) vs ("a", 12) style collisions cannot happen
    assert round_info("a1", 2) != round_info("a", 12)
    assert round_info("ab", 0) != round_info("a", int.from_bytes(b"b" + bytes(7), "big"))


def test_tampering_and_wrong_key_fail():
    priv, pub = generate_keypair()
    other, _ = generate_keypair()
    info = round_info("r", 0)
    ct = seal(pub, b"0123456789", info)
    for pos in (0, 31, 32, len(ct) - 17, len(ct) - 1):  # enc, ciphertext body, tag
        bad = bytearray(ct)
        bad[pos] ^= 0x01
        with pytest.raises(SealingError):
            open_sealed(priv, bytes(bad), info)
    with pytest.raises(SealingError):
        open_sealed(priv, ct[:-1], info)
    with pytest.raises(SealingError):
        open_sealed(other, ct, info)


def test_bad_public_key_and_private_roundtrip():
    priv, pub = generate_keypair()
    with pytest.raises(ValueError, match="32-byte"):
        seal(pub[:31], b"x", b"i")
    again = private_key_from_bytes(private_key_bytes(priv))
    assert open_sealed(again, seal(pub, b"k", b"i"), b"i") == b"k"


def test_labelled_bits_format_roundtrip():
    priv, pub = generate_keypair()
    labels = np.array([0, 7, 2**32 - 1, 3], dtype=np.int64)
    bits = np.array([1, 0, 1, 1], dtype=np.uint8)
    pts = pack_labelled_bits(labels, bits)
    assert all(len(p) == BIT_MESSAGE_BYTES for p in pts)
    info = round_info("r", 9)
    cts = seal_many(pub, pts, info)
    assert {len(c) for c in cts} == {BIT_MESSAGE_BYTES + SEAL_OVERHEAD}
    lab2, bit2 = unpack_labelled_bits([open_sealed(priv, c, info) for c in cts])
    np.testing.assert_array_equal(lab2, labels)
    np.testing.assert_array_equal(bit2, bits)
    with pytest.raises(ValueError, match="bits must be 0 or 1"):
        pack_labelled_bits(np.array([1]), np.array([2]))


def test_a_message_sent_twice_is_found_by_its_encapsulated_key():
    """Found by probing as a dishonest shuffler: copies of one user's sealed message were opened as that many users'
    (a sum holding the user 20 times, an LDP crowd of one). Every sealed message has its own encapsulated key."""
    from shuffledp.security.sealing import ENC_BYTES, repeated_encapsulation

    _, public = generate_keypair()
    cts = seal_many(public, [bytes([i]) * 8 for i in range(50)], b"round")
    assert not repeated_encapsulation(cts) and not repeated_encapsulation(cts[:1]) and not repeated_encapsulation([])
    assert repeated_encapsulation([*cts, cts[17]])
    tail = cts[3][:ENC_BYTES] + bytes(len(cts[3]) - ENC_BYTES)  # the same key with another ciphertext
    assert repeated_encapsulation([*cts, tail])
    near = cts[5][:8] + bytes(len(cts[5]) - 8)  # the first 8 bytes only: another key, not a copy
    assert not repeated_encapsulation([*cts, near])
