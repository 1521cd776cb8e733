"""Cryptographically secure randomness for all privacy noise and shuffles (design section 6).

numpy's default PCG64 is predictable from its outputs, so every draw in this project goes through a numpy
Generator over a CSPRNG bit generator keyed from OS entropy (design section 6): randomgen's AESCounter (AES-128 in
counter mode, the block cipher of NIST SP 800-90A's CTR_DRBG) where the CPU has AES-NI, else its ChaCha20. AES-NI
makes PVEC's binomial noise ~1.7x and its rounding's uniforms ~2.7x cheaper than ChaCha20 (measured here: 44 vs 76
ns per Bin(11635, 1/2) draw, 8.8 vs 23.7 ns per uniform); without it AES runs on table lookups, whose cache timing
can leak the key, so ChaCha20 stays. A key draws far fewer than the 2^64 blocks up to which AES-CTR output cannot
be told from random. A fixed seed makes the stream
reproducible and therefore breaks privacy: it is refused unless the explicit testing switch is on
(environment variable SHUFFLEDP_ALLOW_TEST_SEED=1, set by the test suite).

A seeded simulation (issue 46 item 3: `shuffledp run --seed N`, local and without a PKI only) keys every generator
a party's process makes from (N, the party, the order of make_rng() calls in it) instead: a run replays bit for bit,
and its noise is known to anyone who holds N. start_simulation() turns it on for a process, once, before any draw.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
from collections.abc import Iterator

import numpy as np
from randomgen import AESCounter, ChaCha

TEST_SEED_ENV = "SHUFFLEDP_ALLOW_TEST_SEED"


class InsecureSeedError(RuntimeError):
    """A fixed seed was requested outside testing mode."""


def seeds_allowed_for_testing() -> bool:
    return os.environ.get(TEST_SEED_ENV, "") == "1"


def _aes_ni() -> bool:
    try:
        return bool(AESCounter(key=0).use_aesni)
    except Exception:  # a randomgen without the switch: take the portable generator
        return False


AES_NI = _aes_ni()

# (seed, party label, counter of make_rng() calls) of a seeded simulation in this process; None: OS entropy
_simulation: tuple[int, int, Iterator[int]] | None = None


SIMULATION_SEED_LIMIT = 2**63  # a simulation seed lies in [0, 2^63): what the CLI and the services accept


def start_simulation(seed: int, party: str) -> None:
    """Key every later make_rng() of this process from (seed, party, call order): a replayable local simulation,
    whose noise anyone who holds `seed` knows. Refused a second time (two seeds in one process would be ambiguous)."""
    global _simulation
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SIMULATION_SEED_LIMIT:
        raise ValueError(f"a simulation seed must be an integer in [0, 2^63), got {seed!r}")
    if _simulation is not None:
        raise RuntimeError("this process already runs a seeded simulation")
    # the party's label as a 64-bit word: SeedSequence mixes (seed, label, call) into independent streams
    label = int.from_bytes(hashlib.blake2b(party.encode(), digest_size=8).digest(), "little")
    _simulation = (seed, label, itertools.count())


def simulation_seed() -> int | None:
    """The seed of this process's simulation, or None (the normal case: every generator keyed from OS entropy)."""
    return None if _simulation is None else _simulation[0]


def make_rng(seed: int | None = None) -> np.random.Generator:
    """A numpy Generator over AES-128-CTR (with AES-NI) or ChaCha20 (20 rounds).

    seed=None keys it from the OS CSPRNG (128 bits for AES, 256 for ChaCha20), or in a seeded simulation
    (start_simulation) from the simulation's seed, the party and this call's place among the process's calls. An
    integer seed is accepted only in testing mode.
    """
    if seed is None and _simulation is None:
        if AES_NI:
            return np.random.Generator(AESCounter(key=secrets.randbits(128)))
        return np.random.Generator(ChaCha(key=secrets.randbits(256), rounds=20))
    if seed is None:
        base, label, calls = _simulation
        material: int | np.random.SeedSequence = np.random.SeedSequence(base, spawn_key=(label, next(calls)))
    else:
        if not seeds_allowed_for_testing():
            raise InsecureSeedError(
                f"a fixed random seed makes privacy noise predictable; set {TEST_SEED_ENV}=1 "
                "(tests and debugging only) to allow it"
            )
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"test seed must be a non-negative integer, got {seed!r}")
        material = int(seed)
    if AES_NI:
        return np.random.Generator(AESCounter(seed=material))
    return np.random.Generator(ChaCha(seed=material, rounds=20))


def secure_permutation(n: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """A uniformly random permutation of range(n) drawn from the CSPRNG (Fisher-Yates in numpy)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (rng or make_rng()).permutation(n)
