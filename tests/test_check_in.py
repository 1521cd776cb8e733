"""The check-in rule (shuffledp.mechanisms.check_in.share) and how a run reports it; the protocol itself runs over
real services in tests/test_shuffler.py, tests/test_e2e.py and tests/test_seed000_runs.py."""

from __future__ import annotations

import math

import pytest

from shuffledp.cli.run import _progress_line
from shuffledp.mechanisms.check_in import share
from shuffledp.v1 import shuffledp_pb2 as pb


@pytest.mark.parametrize("trials", [1, 7, 1214 * 31451, 10**12 + 3])
@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.99, 1.0])
def test_share_never_leaves_less_noise_than_reserved(trials, fraction):
    # exhaustive over c for a small threshold: the released noise m n' >= m c_min >= N*, c_min <= c
    n_min = 5
    for c in range(n_min, 400):
        c_min, m = share(trials, fraction, n_min, c)
        assert n_min <= c_min <= c and c_min == max(n_min, math.ceil(fraction * c))
        assert m * c_min >= trials and (m - 1) * c_min < trials  # the least such m
    # every user reporting: the noise exceeds the reservation by at most c / c_min (plus one trial each)
    c_min, m = share(trials, 0.99, 1214, 1348)
    assert c_min == 1335 and m * 1348 <= (trials / 1335 + 1) * 1348


def test_share_refuses_what_admits_no_round():
    with pytest.raises(ValueError, match="fewer than the threshold"):
        share(100, 0.99, 10, 9)
    with pytest.raises(ValueError, match="report_fraction"):
        share(100, 0.0, 1, 9)
    with pytest.raises(ValueError, match="report_fraction"):
        share(100, float("nan"), 1, 9)
    with pytest.raises(ValueError, match="noise_trials"):
        share(0, 0.9, 1, 9)


def test_progress_line_names_dropouts_after_check_in():
    m = pb.RoundMetrics(round=2, released=False, contributors=211, checked_in=235, failure="")
    line = _progress_line(m, 16)
    assert "NOT RELEASED" in line and "24 of 235 checked-in users did not report" in line
    ok = pb.RoundMetrics(round=2, released=True, contributors=235, checked_in=235)
    assert "checked-in" not in _progress_line(ok, 16)
