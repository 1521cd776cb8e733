"""HPKE sealing of client messages to the analyzer (design 5.1; RFC 9180 via `cryptography`'s hpke module).

Suite: DHKEM(X25519, HKDF-SHA256) / HKDF-SHA256 / AES-128-GCM, base mode (sender unauthenticated: the sender's
identity is exactly what the shuffle hides). A ciphertext is ``enc (32 bytes) || AEAD ciphertext || tag (16)``,
so its length is ``len(plaintext) + SEAL_OVERHEAD`` and fixed-length plaintexts give fixed-length ciphertexts
(the shuffler sees nothing in the length). The HPKE ``info`` binds the run and the round (round_info), so a
message replayed into another round or run fails to open at the analyzer.

Wire format of one BITS-mode plaintext (PVEC bit mode, design 5.2): ``label`` as uint32 big-endian followed by
one byte ``bit`` in {0, 1}: BIT_MESSAGE_BYTES = 5 bytes (pack_labelled_bits / unpack_labelled_bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite

__all__ = [
    "SUITE_NAME",
    "PUBLIC_KEY_BYTES",
    "ENC_BYTES",
    "repeated_encapsulation",
    "SEAL_OVERHEAD",
    "BIT_MESSAGE_BYTES",
    "SealingError",
    "generate_keypair",
    "load_public_key",
    "private_key_bytes",
    "private_key_from_bytes",
    "round_info",
    "sealed_length",
    "seal",
    "seal_many",
    "open_sealed",
    "pack_labelled_bits",
    "unpack_labelled_bits",
]

SUITE_NAME = "HPKE-base/DHKEM(X25519,HKDF-SHA256)/HKDF-SHA256/AES-128-GCM"
_SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)
PUBLIC_KEY_BYTES = 32  # raw X25519 public key (RFC 7748)
# RFC 9180 sec 7.1: Nenc of DHKEM(X25519, HKDF-SHA256). A sealed message starts with its encapsulated key, drawn
# afresh by the sender for every message: two messages with the same one are one message sent twice (a replay)
ENC_BYTES = 32
_TAG_BYTES = 16  # RFC 9180 sec 7.3: Nt of AES-128-GCM
SEAL_OVERHEAD = ENC_BYTES + _TAG_BYTES
BIT_MESSAGE_BYTES = 5  # uint32 label + 1 byte bit
_MAX_LABEL = 2**32 - 1


class SealingError(ValueError):
    """A ciphertext did not open: wrong key, wrong run/round (info), tampering or wrong length."""


def generate_keypair() -> tuple[X25519PrivateKey, bytes]:
    """A fresh analyzer key pair from the OS CSPRNG: (private key object, raw 32-byte public key)."""
    private = X25519PrivateKey.generate()
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return private, public


def private_key_bytes(private: X25519PrivateKey) -> bytes:
    """Raw 32-byte private key (for the analyzer's state directory; store it with mode 0600)."""
    return private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def private_key_from_bytes(raw: bytes) -> X25519PrivateKey:
    if len(raw) != 32:
        raise ValueError(f"private key must be 32 raw X25519 bytes, got {len(raw)} bytes")
    return X25519PrivateKey.from_private_bytes(raw)


def load_public_key(public_bytes: bytes) -> X25519PublicKey:
    """Parse a raw X25519 public key; ValueError naming the length if malformed."""
    if not isinstance(public_bytes, bytes | bytearray) or len(public_bytes) != PUBLIC_KEY_BYTES:
        n = len(public_bytes) if isinstance(public_bytes, bytes | bytearray) else type(public_bytes).__name__
        raise ValueError(f"public_bytes must be a raw {PUBLIC_KEY_BYTES}-byte X25519 key, got {n}")
    return X25519PublicKey.from_public_bytes(bytes(public_bytes))


def round_info(run_id: str, round_index: int) -> bytes:
    """HPKE info binding a message to (run_id, round): a replay into another round or run does not open."""
    if not run_id:
        raise ValueError("run_id must be a non-empty string")
    if round_index < 0:
        raise ValueError(f"round must be >= 0, got {round_index}")
    rid = run_id.encode("utf-8")
    # length-prefixed so that (run "a1", round 2) and (run "a", round 12) can never collide
    return b"shuffledp.v1/round/" + len(rid).to_bytes(4, "big") + rid + int(round_index).to_bytes(8, "big")


def repeated_encapsulation(ciphertexts: Sequence[bytes]) -> bool:
    """Whether two of the sealed messages share their encapsulated key (the first ENC_BYTES): one message sent twice.
    Compared by the keys' first 8 bytes (8 bytes per message, not a set of them), exactly where two of those agree."""
    n = len(ciphertexts)
    if n < 2:
        return False
    prefixes = np.fromiter((int.from_bytes(c[:8], "little") for c in ciphertexts), dtype=np.uint64, count=n)
    order = np.argsort(prefixes, kind="stable")
    at = np.flatnonzero(prefixes[order][1:] == prefixes[order][:-1])
    if not at.size:
        return False
    maybe = np.union1d(order[at], order[at + 1]).tolist()
    return len({bytes(ciphertexts[i][:ENC_BYTES]) for i in maybe}) < len(maybe)


def sealed_length(plaintext_bytes: int) -> int:
    """Length of the ciphertext of a plaintext of this length (fixed per round, design 5.1)."""
    if plaintext_bytes < 0:
        raise ValueError(f"plaintext_bytes must be >= 0, got {plaintext_bytes}")
    return plaintext_bytes + SEAL_OVERHEAD


def seal(public_bytes: bytes, plaintext: bytes, info: bytes) -> bytes:
    """HPKE base-mode single-shot seal to the analyzer key: enc || ct || tag, len = len(plaintext) + 48."""
    return _SUITE.encrypt(bytes(plaintext), load_public_key(public_bytes), info=info)


def seal_many(public_bytes: bytes, plaintexts: Sequence[bytes], info: bytes) -> list[bytes]:
    """Seal each plaintext separately (a fresh ephemeral key per message, so messages are unlinkable)."""
    key = load_public_key(public_bytes)
    return [_SUITE.encrypt(bytes(p), key, info=info) for p in plaintexts]


def open_sealed(private: X25519PrivateKey, ciphertext: bytes, info: bytes) -> bytes:
    """Open a sealed message; SealingError if the key, the info (run/round) or any byte is wrong."""
    if len(ciphertext) < SEAL_OVERHEAD:
        raise SealingError(f"ciphertext must be at least {SEAL_OVERHEAD} bytes, got {len(ciphertext)}")
    try:
        return _SUITE.decrypt(bytes(ciphertext), private, info=info)
    except (InvalidTag, ValueError) as exc:
        raise SealingError(
            "ciphertext does not open with this key and run/round (wrong key, round or tampered)"
        ) from exc


def pack_labelled_bits(labels: np.ndarray, bits: np.ndarray) -> list[bytes]:
    """BITS-mode plaintexts: one 5-byte message (uint32 big-endian label, uint8 bit) per labelled bit."""
    labels = np.asarray(labels)
    bits = np.asarray(bits)
    if labels.shape != bits.shape or labels.ndim != 1:
        raise ValueError(f"labels and bits must be 1-D of equal length, got {labels.shape} and {bits.shape}")
    if labels.size and (labels.min() < 0 or labels.max() > _MAX_LABEL):
        raise ValueError(f"labels must lie in [0, 2^32), got range [{labels.min()}, {labels.max()}]")
    if bits.size and (bits.min() < 0 or bits.max() > 1):
        raise ValueError(f"bits must be 0 or 1, got range [{bits.min()}, {bits.max()}]")
    rec = np.empty(labels.size, dtype=[("label", ">u4"), ("bit", "u1")])
    rec["label"] = labels
    rec["bit"] = bits
    raw = rec.tobytes()
    return [raw[i : i + BIT_MESSAGE_BYTES] for i in range(0, len(raw), BIT_MESSAGE_BYTES)]


def unpack_labelled_bits(plaintexts: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of pack_labelled_bits: (labels int64, bits uint8); ValueError on a wrong length or bit value."""
    if any(len(p) != BIT_MESSAGE_BYTES for p in plaintexts):
        raise ValueError(f"every BITS plaintext must be {BIT_MESSAGE_BYTES} bytes")
    rec = np.frombuffer(b"".join(plaintexts), dtype=[("label", ">u4"), ("bit", "u1")])
    bits = rec["bit"].astype(np.uint8)
    if bits.size and bits.max() > 1:
        raise ValueError(f"bits must be 0 or 1, got {bits.max()}")
    return rec["label"].astype(np.int64), bits
