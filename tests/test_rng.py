import json
import subprocess
import sys

import numpy as np
import pytest
from randomgen import AESCounter, ChaCha

from shuffledp.security.rng import AES_NI, InsecureSeedError, make_rng, secure_permutation


def test_generator_is_aes_ctr_with_aes_ni_else_chacha20():
    for rng in (make_rng(), make_rng(3)):
        if AES_NI:
            assert isinstance(rng.bit_generator, AESCounter) and rng.bit_generator.use_aesni
        else:
            assert isinstance(rng.bit_generator, ChaCha)


def test_unseeded_streams_differ():
    assert not np.array_equal(make_rng().integers(0, 2**62, 8), make_rng().integers(0, 2**62, 8))


def test_test_seed_reproducible():
    assert np.array_equal(make_rng(7).integers(0, 2**62, 8), make_rng(7).integers(0, 2**62, 8))


def test_seed_refused_without_switch():
    code = "from shuffledp.security.rng import make_rng\nmake_rng(1)"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert InsecureSeedError.__name__ in out.stderr


@pytest.mark.parametrize("bad", [-1, 1.5, "3"])
def test_bad_seed(bad):
    with pytest.raises(ValueError):
        make_rng(bad)


def test_permutation_uniform_chi_square():
    # Position of element 0 over many permutations of 10 items: uniform. Fixed seed; chi-square with
    # 9 dof, 99.99% quantile 33.7, so a correct shuffle fails this with probability 1e-4.
    rng = make_rng(123)
    counts = np.zeros(10)
    for _ in range(20000):
        counts[int(np.argmax(secure_permutation(10, rng) == 0))] += 1
    chi2 = ((counts - 2000) ** 2 / 2000).sum()
    assert chi2 < 33.7


def _simulated_draws(seed: int, party: str, calls: int = 3) -> list[list[int]]:
    """make_rng() draws of a fresh process running a seeded simulation (start_simulation is once per process)."""
    code = (
        "import json, sys\nfrom shuffledp.security import rng\n"
        f"rng.start_simulation({seed}, {party!r})\n"
        f"print(json.dumps([rng.make_rng().integers(0, 2**62, 4).tolist() for _ in range({calls})]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_a_seeded_simulation_replays_and_keeps_parties_and_calls_apart():
    """Issue 46 item 3: the same (seed, party) gives the same generators in call order, in another process and
    without the test switch; another party, another seed or another call gives another stream."""
    a = _simulated_draws(7, "client:client-0")
    assert a == _simulated_draws(7, "client:client-0")
    assert len({tuple(x) for x in a}) == 3  # each call its own stream
    for other in (_simulated_draws(7, "client:client-1"), _simulated_draws(8, "client:client-0")):
        assert not {tuple(x) for x in a} & {tuple(x) for x in other}


def test_a_simulation_seed_is_checked_and_set_once():
    code = (
        "from shuffledp.security import rng\n"
        "for bad in (-1, 2**63, 1.5, True):\n"
        "    try:\n        rng.start_simulation(bad, 'p')\n        print('accepted', bad)\n"
        "    except ValueError:\n        pass\n"
        "assert rng.simulation_seed() is None\n"
        "rng.start_simulation(3, 'p')\nassert rng.simulation_seed() == 3\n"
        "try:\n    rng.start_simulation(4, 'p')\nexcept RuntimeError:\n    print('refused again')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:-1] == ["refused again"], out.stdout
