"""Cryptographically secure randomness for all privacy noise and shuffles (design section 6).

numpy's default PCG64 is predictable from its outputs, so every draw in this project goes through a numpy
Generator over randomgen's ChaCha20 bit generator, keyed from OS entropy. A fixed seed makes the stream
reproducible and therefore breaks privacy: it is refused unless the explicit testing switch is on
(environment variable SHUFFLEDP_ALLOW_TEST_SEED=1, set by the test suite and by `--insecure-test-seed`).
"""

from __future__ import annotations

import os
import secrets

import numpy as np
from randomgen import ChaCha

TEST_SEED_ENV = "SHUFFLEDP_ALLOW_TEST_SEED"


class InsecureSeedError(RuntimeError):
    """A fixed seed was requested outside testing mode."""


def seeds_allowed_for_testing() -> bool:
    return os.environ.get(TEST_SEED_ENV, "") == "1"


def make_rng(seed: int | None = None) -> np.random.Generator:
    """A ChaCha20 (20 rounds) numpy Generator.

    seed=None keys it with 256 bits from the OS CSPRNG. An integer seed is accepted only in testing mode.
    """
    if seed is None:
        return np.random.Generator(ChaCha(key=secrets.randbits(256), rounds=20))
    if not seeds_allowed_for_testing():
        raise InsecureSeedError(
            f"a fixed random seed makes privacy noise predictable; set {TEST_SEED_ENV}=1 "
            "(tests and debugging only) to allow it"
        )
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"test seed must be a non-negative integer, got {seed!r}")
    return np.random.Generator(ChaCha(seed=int(seed), rounds=20))


def secure_permutation(n: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """A uniformly random permutation of range(n) drawn from the CSPRNG (Fisher-Yates in numpy)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (rng or make_rng()).permutation(n)
