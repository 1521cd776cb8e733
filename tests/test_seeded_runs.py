"""Issue 46 item 3: a seeded local simulation replays bit for bit, and a seed is never taken where noise must stay
secret (a PKI, a remote analyzer)."""

from __future__ import annotations

import subprocess
import sys

from shuffledp.protocols.base import canonical_order
from shuffledp.security import sealing
from shuffledp.security.rng import make_rng


def test_a_sealed_batch_in_any_arrival_order_gets_one_order():
    """The shuffler's order follows the nodes' arrival and the sealing is keyed from OS entropy: a seeded analyzer
    orders by plaintext, then by its own seeded permutation, so two runs decode the same sequence."""
    private, public = sealing.generate_keypair()
    info = sealing.round_info("run", 0)
    plaintexts = [bytes([i]) * 8 for i in range(20)]
    first = [sealing.seal(public, p, info) for p in plaintexts]
    again = [sealing.seal(public, p, info) for p in reversed(plaintexts)]  # other ciphertexts, other arrival order
    broken = b"\x00" * len(first[0])
    a = canonical_order(private, [*first, broken], info, make_rng(5))
    b = canonical_order(private, [broken, *again], info, make_rng(5))
    opened = [[sealing.open_sealed(private, c, info) for c in order[:-1]] for order in (a, b)]
    assert opened[0] == opened[1] and sorted(opened[0]) == plaintexts  # the same plaintext sequence, all of them
    assert opened[0] != plaintexts  # permuted, not left sorted
    assert a[-1] == b[-1] == broken  # what does not open goes last
    c = canonical_order(private, first, info, make_rng(6))
    assert [sealing.open_sealed(private, x, info) for x in c] != opened[0]  # the permutation is the seed's


def test_serve_refuses_a_simulation_seed_with_a_pki(tmp_path):
    argv = ["serve", "shuffler", "--pki", str(tmp_path), "--simulation-seed", "3", "--state-dir", str(tmp_path)]
    res = subprocess.run([sys.executable, "-m", "shuffledp.cli", *argv], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "--simulation-seed is for local simulations in plain text (--insecure)" in res.stderr
    assert list(tmp_path.iterdir()) == []  # refused before any state was opened
