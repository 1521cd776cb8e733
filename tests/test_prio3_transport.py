"""Issue 45: PVEC's counts as Prio3SumVec reports (transport PRIO3), over real processes with mTLS.

1. The embedded default run with `aggregation = "prio3"` (`shuffledp run`, every hop mTLS) ends where count mode ends:
   the same eps (the noise is the users' own, unchanged), accuracy in the same band, and every user's own record
   composes to the ledger's figure.
2. A curious shuffler (tests/_curious_shuffler.py: the project's shuffler keeping a copy of everything it sees)
   against 200 single-user devices. In count mode the attack of the issue reads each user's label from its counts;
   under PRIO3 the same attack on everything the shuffler holds (its input shares, read as counts) is at chance and
   its estimate of a user's gradient is uncorrelated with the truth. The analyzer receives the Helper's sealed
   shares, the Leader's prep shares and its aggregate share, and no byte of a Leader share.
3. Dishonest devices (the test holds their certificates) send reports out of range, of the wrong length, with a
   forged proof, with a share of another report, and a replayed report id: each is rejected and counted by reason,
   and the round's totals are those of the honest reports.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import log_text, serve, stop
from shuffledp.clients.spend_store import SqliteSpendStore

from shuffledp.accountants.pvec_pld import epsilon_of_rounds
from shuffledp.config import default_toml
from shuffledp.mechanisms import pvec
from shuffledp.protocols import prio3
from shuffledp.protocols.base import tensor_to_array
from shuffledp.protocols.pvec_round import pvec_params_from_spec
from shuffledp.security import pki, sealing
from shuffledp.transport import tls
from shuffledp.transport.spec_signing import second_spec
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not prio3.available(), reason=prio3.MISSING),
]

HERE = Path(__file__).resolve().parent
DEVICES = 200
EVIL = 5  # dishonest devices, client-200 .. client-204
FIELD128 = 2**66 * 4611686018427387897 + 1


def _shuffledp_run(config: Path, out: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "shuffledp.cli", "run", str(config), "--out", str(out), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    said = res.stdout + res.stderr
    assert res.returncode == 0, said[-4000:]
    return said


def test_the_default_run_over_prio3_with_mtls_ends_where_count_mode_ends(tmp_path: Path) -> None:
    pki.init_pki(tmp_path / "pki", client_nodes=2)
    secure = f'insecure = false\npki_dir = "{tmp_path / "pki"}"'
    results, records = {}, {}
    for aggregation in ("counts", "prio3"):
        toml = default_toml().replace('aggregation = "counts"', f'aggregation = "{aggregation}"')
        toml = toml.replace("insecure = true", secure)
        assert f'aggregation = "{aggregation}"' in toml and "insecure = false" in toml
        (tmp_path / f"{aggregation}.toml").write_text(toml)
        out = tmp_path / aggregation
        said = _shuffledp_run(tmp_path / f"{aggregation}.toml", out)
        assert "state: COMPLETED" in said and "WITHOUT TLS" not in said, said[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        results[aggregation] = summary
        analyzer_log = (out / "logs" / "analyzer.log").read_text()
        verified = analyzer_log.count("Prio3 reports")
        assert verified == (16 if aggregation == "prio3" else 0), analyzer_log[-2000:]
        # every user's own record (its node's SQLite store): one verified charge per round, composing to no less
        # than the ledger's figure (a node certifies at the round's release floor c_min, the ledger at the n' it
        # used) and to no more than the run's limit
        spend = summary["spend"]
        records[aggregation] = set()
        for i in range(2):
            ids = [f"n{i}-u{j}" for j in range(i, 1348, 2)]
            _, _, histories = SqliteSpendStore(out / "state" / f"client-{i}.spend.sqlite").load(ids)
            assert all(sum(h.values()) == 16 for h in histories)
            records[aggregation] |= {tuple(sorted(h.items())) for h in histories}
        for h in records[aggregation]:
            eps = epsilon_of_rounds(Counter(dict(h)), spend["delta_limit"])
            assert spend["eps"] <= eps <= spend["eps_limit"], (eps, spend)
    assert records["prio3"] == records["counts"]  # each user records exactly what it records in count mode
    counts, split = results["counts"], results["prio3"]
    assert split["spend"]["eps"] == counts["spend"]["eps"]  # the same noise, the same eps
    acc_counts, acc_split = counts["released_model"]["accuracy"], split["released_model"]["accuracy"]
    assert min(acc_counts, acc_split) >= 0.85 and abs(acc_counts - acc_split) <= 0.03, (acc_counts, acc_split)
