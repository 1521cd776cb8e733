import os

# The explicit testing switch of shuffledp.security.rng: tests may use fixed seeds (never set outside tests).
os.environ["SHUFFLEDP_ALLOW_TEST_SEED"] = "1"

import numpy as np  # noqa: E402  (after the seed switch, which shuffledp.security.rng reads at import)
import pytest  # noqa: E402


@pytest.fixture
def blobs_data(tmp_path) -> str:
    """A synthetic 2-class problem in R^3 as a [data] section: 225 training users (of 300 examples), one example
    each (central DP-SGD and DP-FTRL runs over the services)."""
    from shuffledp.security.rng import make_rng

    path = tmp_path / "blobs.npz"
    rng = make_rng(7)
    y = np.arange(300) % 2
    np.savez(path, X=rng.normal(size=(300, 3)) * 0.5 + np.where(y[:, None] == 1, 0.6, -0.6), y=y)
    return f'[data]\ndataset = "path"\npath = "{path}"\n'
