"""Issue 24 C16: a PVEC count-mode round on a node encodes its users by blocks, straight into the wire width.

At mnist5k (1875 users x 7850 parameters per node) the whole-array copies (the clipped gradients and int64 counts,
8 bytes per value each) cost more CPU in page faults than the rounding, and doubled the node's memory. Measured with
tracemalloc (numpy reports its buffers to it): the peak beyond the gradients is the users' rounding in the width of g
(2 bytes per value here; the node sends their sum, pvec_round._put_sums) plus blocks, never the 16+ bytes per value
of whole-array temporaries."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from shuffledp.protocols.pvec_round import PvecRound
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb


def test_counts_round_allocates_no_whole_array_temporaries():
    k, d = 600, 7850
    spec = pb.RoundSpec(run_id="r", round=0, transport=pb.COUNTS, cohort_size=k, min_contributors=k)
    spec.randomizer.protocol, spec.randomizer.dim, spec.randomizer.clip_norm = "pvec", d, 1.0
    spec.randomizer.g, spec.randomizer.m, spec.randomizer.p = 5671, 168208, 0.5  # mnist5k's plan: 4-byte counts
    spec.per_user_cost.eps, spec.per_user_cost.delta = 1.0, 1e-5
    G = np.random.default_rng(0).standard_normal((k, d)) * 0.05
    out = pb.Contribution()
    ids = [f"u{i}" for i in range(k)]
    tracemalloc.start()
    try:
        PvecRound().randomize(spec, G, ids, [bytes(16)] * k, make_rng(), out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    sums = np.frombuffer(out.columns.sums, dtype="<u8").reshape(-1, d)
    assert sums.shape == (3, d) and not out.columns.counts and list(out.columns.user_ids) == ids  # 256 + 256 + 88
    assert sums.min() >= 0 and sums.max() <= 256 * (5671 + 168208)
    # the users' rounding in the wire width of g (2 bytes per value) and one block's temporaries; per-user counts
    # took 12 bytes per value (wire buffer, its bytes and the protobuf's copy), whole-array temporaries 16 more
    assert peak < 4 * k * d, peak / (k * d)


_RETAINED = """
import sys, threading
import numpy as np
from shuffledp.cli.serve import return_large_blocks
if sys.argv[1] == "fixed":
    assert return_large_blocks()
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
keep = []
def round_():  # a round's worker thread: large per-user arrays, and small objects that outlive them
    np.ones(6 * 2**20 // 8)  # freed: glibc's own threshold rises to 6 MiB
    blocks = []
    for _ in range(50):
        blocks.append(np.ones(6 * 2**20 // 8))
        keep.append(np.ones(2000))
base = rss()
t = threading.Thread(target=round_)
t.start()
t.join()
print(rss() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc")
def test_a_service_returns_a_rounds_large_blocks_to_the_os():
    """serve sets a fixed mmap threshold (issue 30 item 3): 50 blocks of 6 MiB freed by a round's thread leave the
    process, where glibc's own threshold keeps them in that thread's heap (~300 MB here, behind small objects that
    outlive the round)."""
    mib = {}
    for mode in ("fixed", "glibc"):
        out = subprocess.run([sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, check=True)
        mib[mode] = float(out.stdout)
    assert mib["fixed"] < 30 and mib["glibc"] > 150, mib
