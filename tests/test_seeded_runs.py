"""Issue 46 item 3: a seeded local simulation replays bit for bit, and a seed is never taken where noise must stay
secret (a PKI, a remote analyzer)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

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


def _run(tmp_path, name: str, *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shuffledp.cli", "run", *argv, "--quiet", "--out", str(tmp_path / name)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _results(out) -> tuple[list[dict], np.ndarray, dict]:
    rows = json.loads((out / "metrics.json").read_text())
    for row in rows:
        row.pop("seconds")  # the round's wall time: the one figure a replay need not repeat
    with np.load(out / "model.npz") as z:
        return rows, z["params"], json.loads((out / "summary.json").read_text())


def test_two_local_runs_with_one_seed_are_the_same_run(tmp_path):
    """The embedded default (PVEC counts with the check-in: sampling, binomial noise, the shuffler's cohort) and
    PNSGD (sealed messages and a pass over them in the batch's order) replay bit for bit: every metric but the
    round's seconds, the released model, the spend. Another seed is another run."""
    pnsgd = tmp_path / "pnsgd.toml"
    listing = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "run", "--print-default", "--protocol", "pnsgd"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pnsgd.write_text(listing.stdout)
    for name, argv, other in ((("a", "b"), (), "c"), (("p", "q"), (str(pnsgd),), None)):
        for n in name:
            res = _run(tmp_path, n, *argv, "--seed", "7")
            assert res.returncode == 0, res.stderr
            assert "seed 7: a seeded simulation" in res.stdout.splitlines()[0]  # the start line says so
        (rows_a, model_a, sum_a), (rows_b, model_b, sum_b) = (_results(tmp_path / n) for n in name)
        assert rows_a == rows_b and rows_a
        assert np.array_equal(model_a, model_b)
        assert sum_a["spend"] == sum_b["spend"] and sum_a["seed"] == 7
        assert "known to anyone who holds the seed" in sum_a["seed_note"]
        if other:
            assert _run(tmp_path, other, *argv, "--seed", "8").returncode == 0
            rows_c, model_c, sum_c = _results(tmp_path / other)
            assert not np.array_equal(model_a, model_c) and sum_c["seed"] == 8


def test_a_seed_is_refused_with_a_pki_or_a_remote_analyzer(tmp_path):
    pki_run = tmp_path / "pki.toml"
    pki_run.write_text(f'[deployment]\ninsecure = false\npki_dir = "{tmp_path / "pki"}"\n')
    for argv, why in (
        ((str(pki_run), "--seed", "1"), "--seed is for local simulations in plain text: this run has a PKI"),
        (("--analyzer", "127.0.0.1:9", "--seed", "1"), "--seed is for local simulations: a deployment's"),
        (("--seed", "-1"), "--seed must be in [0, 2^63)"),
    ):
        res = _run(tmp_path, "out", *argv)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        assert why in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # one line
        assert not (tmp_path / "out").exists()  # before the results directory or any process
