"""Issue 43 item 1: a dishonest shuffler can neither read nor rewrite what the analyzer decides. Real processes with
mTLS: the analyzer and two client nodes as `shuffledp serve ... --pki`, and as the shuffler the project's own one
with hooks (tests/_dishonest_shuffler.py) that rewrite every invitation it relays and try to open every sealed
message with a key of their own.

An honest run first: the analyzer's signed specs reach the nodes, the run completes, users are charged and the
shuffler opens none of the sealed messages. Then, one run per rewrite (its own sealing key in the signed bytes, in a
plain spec without the signature, or beside the signed one; the noise multiplier, PVEC's m and p, the participation
limit, the clip norm and the model digest in the signed bytes): every invited user's node refuses with
spec_signature_invalid, nothing sealed to another key leaves a node, no user is charged (the nodes' SQLite spend
stores gain no row), and the run stops FAILED with a message that names the shuffler. On the code before signed
specs, the nodes acted on every rewritten spec: sealed to the shuffler's key, charged at rewritten parameters."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import serve, stop
from _runs import wait_for_run

from shuffledp.security import pki
from shuffledp.transport import tls
from shuffledp.transport.spec_signing import SIGNATURE_INVALID
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).resolve().parent
USERS = 160  # digits users over the two nodes

_PVEC = f"""
[data]
max_users = {USERS}
[privacy]
eps = 8.0
[schedule]
kind = "fully_interactive"
rounds = 2
learning_rate = 8.0
[deployment]
round_deadline_seconds = 10
"""

_GAUSSIAN = f"""
[data]
max_users = {USERS}
[model]
task = "logreg"
[privacy]
eps = 4.0
delta = 1e-5
protocol = "gaussian"
[schedule]
kind = "subsampled"
cohort_size = 40
rounds = 3
learning_rate = 1.0
[transport]
mode = "sealed"
[deployment]
round_deadline_seconds = 10
"""

_MF = _GAUSSIAN.replace(
    'protocol = "gaussian"', 'protocol = "mf"\n[privacy.mf]\nbands = 2\nmax_participations = 2\nmin_separation = 1'
).replace("rounds = 3", "rounds = 4")


class _Deployment:
    """The dishonest shuffler, the analyzer and two nodes as processes; the operator's channel to the analyzer."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.pki_dir = workdir / "pki"
        pki.init_pki(self.pki_dir, client_nodes=2)
        self.mode_file, self.report_file = workdir / "mode", workdir / "report.json"
        self.mode_file.write_text("honest")
        self.procs: list[subprocess.Popen] = []
        secure = ["--pki", str(self.pki_dir), "--listen", "127.0.0.1:0"]
        try:
            self._start_shuffler(secure)
            node_toml = workdir / "node.toml"
            node_toml.write_text(f"[data]\nmax_users = {USERS}\n[policy]\nmax_total_eps = 1000\n")
            for i in range(2):
                argv = ["client", "--shuffler", self.shuffler, "--config", str(node_toml), "--node-index", str(i)]
                argv += ["--num-nodes", "2", "--state-dir", str(workdir / "nodes"), *secure]
                self.procs.append(serve(workdir, f"client-{i}", argv)[0])
            argv = ["analyzer", "--shuffler", self.shuffler, "--state-dir", str(workdir / "analyzer"), *secure]
            proc, port = serve(workdir, "analyzer", argv)
            self.procs.append(proc)
            sec = tls.ChannelSecurity(self.pki_dir, pki.ROLE_OPERATOR, "operator")
            self.channel = sec.channel(f"127.0.0.1:{port}", server_name="analyzer")
            self.analyzer = pbg.AnalyzerStub(self.channel)
        except BaseException:
            stop(*self.procs)
            raise

    def _start_shuffler(self, secure: list[str]) -> None:
        program = [sys.executable, str(HERE / "_dishonest_shuffler.py"), str(self.mode_file), str(self.report_file)]
        proc, port = serve(self.workdir, "shuffler", ["--state-dir", str(self.workdir / "shuffler"), *secure], program)
        self.procs.append(proc)
        self.shuffler = f"127.0.0.1:{port}"

    def run(self, toml: str, mode: str) -> pb.RunStatus:
        self.mode_file.write_text(mode)
        run_id = self.analyzer.CreateRun(pb.CreateRunRequest(config_toml=toml)).run_id
        self.analyzer.StartRun(pb.RunRef(run_id=run_id))
        return wait_for_run(self.analyzer, run_id, timeout=120)

    def report(self) -> dict:
        return json.loads(self.report_file.read_text()) if self.report_file.exists() else {}

    def charges(self) -> int:
        """Rows in the nodes' spend stores (one per charge), read without writing."""
        rows = 0
        for i in range(2):
            path = self.workdir / "nodes" / f"client-{i}.spend.sqlite"
            if path.exists():
                with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
                    rows += db.execute("SELECT COUNT(*) FROM charges").fetchone()[0]
        return rows

    def close(self) -> None:
        self.channel.close()
        stop(*self.procs)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    d = _Deployment(tmp_path_factory.mktemp("dishonest"))
    try:
        yield d
    finally:
        d.close()


def test_an_honest_shuffler_relays_signed_specs_and_reads_nothing(deployment):
    before = deployment.charges()
    st = deployment.run(_GAUSSIAN, "honest")
    assert st.state == pb.COMPLETED, st.message
    assert all(m.contributors > 0 for m in st.metrics), [m.contributors for m in st.metrics]
    assert not any(m.refused_reasons.get(SIGNATURE_INVALID) for m in st.metrics)
    assert deployment.charges() > before  # the users joined and were charged
    seen = deployment.report()
    assert seen["sealed"] > 0 and seen["opened"] == 0, seen


_RUNS = {"pvec": _PVEC, "gaussian": _GAUSSIAN, "mf": _MF}


@pytest.mark.parametrize(
    "protocol, mode",
    [
        ("gaussian", "swap_key_signed"),
        ("gaussian", "swap_key_unsigned"),
        ("gaussian", "swap_key_beside"),
        ("gaussian", "noise_multiplier"),
        ("mf", "noise_multiplier"),
        ("mf", "max_participations"),
        ("pvec", "m"),
        ("pvec", "p"),
        ("gaussian", "clip_norm"),
        ("pvec", "model_digest"),
    ],
)
def test_every_node_refuses_a_spec_the_shuffler_rewrote(deployment, protocol, mode):
    before_charges, before = deployment.charges(), deployment.report()
    st = deployment.run(_RUNS[protocol], mode)
    after = deployment.report()
    assert after["rewritten"] > before.get("rewritten", 0)  # the shuffler did rewrite this run's invitations
    refused = sum(m.refused_reasons.get(SIGNATURE_INVALID, 0) for m in st.metrics)
    assert refused > 0, [dict(m.refused_reasons) for m in st.metrics]
    assert all(m.contributors == 0 for m in st.metrics)
    # nothing sealed to any key left a node; no user was charged for a round it did not join
    assert after.get("sealed", 0) == before.get("sealed", 0) and after.get("opened", 0) == 0, after
    assert deployment.charges() == before_charges
    assert st.state == pb.FAILED and "shuffler" in st.message and SIGNATURE_INVALID in st.message, st.message
    assert len(st.metrics) == 1  # the run stopped at its first round
