"""Shared reference computation of the accountant tests (independent of the library code under test)."""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom, hypergeom


def rr_count_pmf(n: int, ones: int, k: int, eps0: float) -> np.ndarray:
    """Exact pmf of the number of 1-reports of subsampled shuffled binary RR: k of n sampled without replacement
    (hypergeometric number of ones sampled), each randomized response keeps its bit w.p. e^eps0/(1+e^eps0); the
    shuffled multiset of bits is exactly this count."""
    keep = 1.0 / (1.0 + math.exp(-eps0))
    pmf = np.zeros(k + 1)
    for h in range(k + 1):
        w = hypergeom.pmf(h, n, ones, k)
        if w > 0:
            pmf += w * np.convolve(
                binom.pmf(np.arange(h + 1), h, keep), binom.pmf(np.arange(k - h + 1), k - h, 1 - keep)
            )
    return pmf
