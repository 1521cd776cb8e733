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
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import serve, stop
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
EVIL = 6  # dishonest devices, client-200 .. client-205 (test 3)
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


def test_users_who_require_split_trust_refuse_count_mode_by_name_and_join_prio3(tmp_path: Path) -> None:
    """[policy] require_split_trust: every user refuses a count-mode round with the reason named in the run's output,
    and joins the same run over PRIO3 (plain text here: the nodes decide from the spec's transport)."""
    toml = default_toml().replace("require_split_trust = false", "require_split_trust = true")
    toml = toml.replace("# rounds = 16", "rounds = 2 #")
    assert "require_split_trust = true" in toml and "rounds = 2" in toml
    (tmp_path / "counts.toml").write_text(toml)
    cmd = [sys.executable, "-m", "shuffledp.cli", "run", str(tmp_path / "counts.toml"), "--out", str(tmp_path / "c")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    said = res.stdout + res.stderr
    assert "no round released" in said and "eps = 0.0000" in said, said[-3000:]
    assert "1348 users refused: transport_visible_to_shuffler_require_split_trust=1348" in said, said[-3000:]
    (tmp_path / "prio3.toml").write_text(toml.replace('aggregation = "counts"', 'aggregation = "prio3"'))
    said = _shuffledp_run(tmp_path / "prio3.toml", tmp_path / "p")
    assert "state: COMPLETED" in said and said.count("contributors   1348") == 2, said[-3000:]


def test_a_seeded_prio3_run_replays_bit_for_bit(tmp_path: Path) -> None:
    """The reports' shares are fresh OS randomness, but what they add up to is exact: two runs with one seed give the
    same metrics, the same released model and the same spend as each other."""
    toml = (
        default_toml()
        .replace('aggregation = "counts"', 'aggregation = "prio3"')
        .replace("# rounds = 16", "rounds = 3 #")
    )
    (tmp_path / "prio3.toml").write_text(toml)
    runs = []
    for name in ("a", "b"):
        said = _shuffledp_run(tmp_path / "prio3.toml", tmp_path / name, "--seed", "7")
        assert "state: COMPLETED" in said, said[-3000:]
        metrics = [
            {k: v for k, v in m.items() if k != "seconds"}
            for m in json.loads((tmp_path / name / "metrics.json").read_text())
        ]
        with np.load(tmp_path / name / "model.npz") as z:
            model = {k: z[k] for k in z.files}
        runs.append((metrics, model, json.loads((tmp_path / name / "summary.json").read_text())["spend"]))
    (m_a, model_a, spend_a), (m_b, model_b, spend_b) = runs
    assert m_a == m_b and len(m_a) == 3 and spend_a == spend_b
    assert model_a.keys() == model_b.keys() and all(np.array_equal(model_a[k], model_b[k]) for k in model_a)


# ---------------------------------------------------------------------------------------------- the curious shuffler
def _device_toml(aggregation: str) -> str:
    return f"""
[data]
max_users = {DEVICES}
[privacy]
eps = 8.0
[privacy.pvec]
aggregation = "{aggregation}"
report_fraction = 0.9
[schedule]
kind = "fully_interactive"
rounds = 1
learning_rate = 8.0
[deployment]
client_nodes = {DEVICES}
users_per_node = 1
population_wait_seconds = 60
round_deadline_seconds = 30
"""


class _Deployment:
    """The curious shuffler, the analyzer and a fleet of DEVICES single-user devices as processes, all with mTLS."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.pki_dir, self.dump = workdir, workdir / "pki", workdir / "dump"
        pki.init_pki(self.pki_dir, client_nodes=DEVICES + EVIL)
        self.procs: list[subprocess.Popen] = []
        secure = ["--pki", str(self.pki_dir), "--listen", "127.0.0.1:0"]
        try:
            program = [sys.executable, str(HERE / "_curious_shuffler.py"), str(self.dump)]
            proc, port = serve(workdir, "shuffler", ["--state-dir", str(workdir / "shuffler"), *secure], program)
            self.procs.append(proc)
            self.shuffler = f"127.0.0.1:{port}"
            config = workdir / "devices.toml"
            config.write_text(_device_toml("counts"))
            argv = ["analyzer", "--shuffler", self.shuffler, "--state-dir", str(workdir / "analyzer"), *secure]
            proc, port = serve(workdir, "analyzer", argv)
            self.procs.append(proc)
            self.analyzer = f"127.0.0.1:{port}"
            argv = ["fleet", "--shuffler", self.shuffler, "--config", str(config), "--num-nodes", str(DEVICES)]
            argv += ["--count", str(DEVICES), "--state-dir", str(workdir / "devices"), *secure]
            self.procs.append(serve(workdir, "fleet", argv)[0])
        except BaseException:
            stop(*self.procs)
            raise

    def run(self, aggregation: str) -> tuple[dict, dict[str, list[bytes]]]:
        """One run; (its summary, what the shuffler kept during it by kind, in order)."""
        before = set(self.dump.iterdir()) if self.dump.exists() else set()
        config = self.workdir / f"{aggregation}.toml"
        config.write_text(_device_toml(aggregation))
        out = self.workdir / f"out-{aggregation}-{len(before)}"
        _shuffledp_run(config, out, "--analyzer", self.analyzer, "--pki", str(self.pki_dir))
        new = sorted(set(self.dump.iterdir()) - before, key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        kept: dict[str, list[bytes]] = {}
        for path in new:
            kept.setdefault(path.stem.rsplit("-", 1)[0], []).append(path.read_bytes())
        metrics = json.loads((out / "metrics.json").read_text())
        return {**json.loads((out / "summary.json").read_text()), "metrics": metrics}, kept

    def close(self) -> None:
        stop(*self.procs)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    d = _Deployment(tmp_path_factory.mktemp("curious"))
    try:
        yield d
    finally:
        d.close()


def _acting_spec(kept: dict[str, list[bytes]]) -> pb.RoundSpec:
    """The spec the devices reported under: the second invitation's, as a device derives it."""
    for raw in kept["invitation"]:
        inv = pb.Invitation.FromString(raw)
        if inv.checked_in:
            return second_spec(pb.RoundSpec.FromString(inv.signed_spec.spec), inv.checked_in)
    raise AssertionError("no second invitation was relayed")


def _truth(spec: pb.RoundSpec) -> dict[str, tuple[int, np.ndarray]]:
    """Each device's user: (its label, its clipped gradient at the round's model), computed as its device does."""
    from shuffledp.config import parse_config
    from shuffledp.data import load_user_shards
    from shuffledp.models.builtin import builtin

    cfg = parse_config(_device_toml("counts"))
    shards, features, classes = load_user_shards(cfg.data, "logreg", range(DEVICES), DEVICES, 1, DEVICES)
    model = builtin(features, classes, task="logreg")
    theta = tensor_to_array(spec.model)
    out = {}
    for ids, X, y in shards:
        g = model.per_user_gradients(theta, X, y, clip_norm=spec.randomizer.clip_norm)[0]
        out[ids[0]] = (int(y[0, 0]), g)
    return out


def _field_as_counts(leader_share: bytes, d: int, bound: int) -> np.ndarray:
    """The curious shuffler's best reading of its input share as a count vector: the measurement part of the share,
    d entries of bits Field128 elements each (little-endian), recombined with SumVec's weights (draft-18 sec 7.4.3)
    modulo the field, then taken into [0, bound] as a count must lie."""
    bits = bound.bit_length()
    weights = [1 << b for b in range(bits - 1)] + [bound - ((1 << (bits - 1)) - 1)]
    out = np.empty(d, dtype=np.int64)
    for i in range(d):
        row = leader_share[16 * i * bits : 16 * (i + 1) * bits]
        v = sum(w * int.from_bytes(row[16 * b : 16 * b + 16], "little") for b, w in enumerate(weights)) % FIELD128
        out[i] = v % (bound + 1)
    return out


def _attack(views: dict[str, np.ndarray], spec: pb.RoundSpec, truth: dict) -> tuple[float, float, int]:
    """The issue's attack on per-user count vectors: decode each as the user's vector (PVEC's A_VEC with n' = 1),
    guess its label as the class whose block of the gradient is smallest (logreg: the true class's block is
    (p_y - 1) x, the others p_k x), and compare with its clipped gradient. (hit rate, mean cosine, users)."""
    params = pvec_params_from_spec(spec)
    classes = 10
    hits, cosines = 0, []
    for user, counts in views.items():
        label, g = truth[user]
        est = pvec.decode_counts(np.clip(counts, 0, params.g + params.m), 1, params)
        hits += int(np.argmin(est.reshape(classes, -1).sum(axis=1)) == label)
        cosines.append(float(est @ g / (np.linalg.norm(est) * np.linalg.norm(g))))
    return hits / len(views), float(np.mean(cosines)), len(views)


def _reports_by_user(kept: dict[str, list[bytes]]) -> dict[str, pb.Prio3Report]:
    out = {}
    for raw in kept["contribution"]:
        c = pb.Contribution.FromString(raw)
        for u, r in zip(c.columns.user_ids, c.columns.reports, strict=False):
            out[u] = r
    return out


def test_a_curious_shuffler_reads_labels_from_counts_but_nothing_from_prio3_reports(deployment) -> None:
    summary, kept = deployment.run("counts")
    spec = _acting_spec(kept)
    truth = _truth(spec)
    counts = {}
    for raw in kept["contribution"]:
        c = pb.Contribution.FromString(raw)
        if c.columns.sums:  # a device's one-user group: its user's count vector, in the clear
            counts[c.columns.user_ids[0]] = np.frombuffer(c.columns.sums, dtype="<u8").astype(np.int64)
    hit, cosine, users = _attack(counts, spec, truth)
    assert users >= 0.9 * DEVICES
    # the attack works: in count mode a one-user node's counts give its label away
    assert hit >= 0.9 and cosine >= 0.05, (hit, cosine)

    summary, kept = deployment.run("prio3")
    assert summary["metrics"][-1]["contributors"] >= 0.9 * DEVICES, summary["metrics"]
    spec = _acting_spec(kept)
    assert spec.transport == pb.PRIO3
    truth = _truth(spec)
    reports = _reports_by_user(kept)
    assert len(reports) >= 0.9 * DEVICES
    d, bound = spec.randomizer.dim, spec.randomizer.g + spec.randomizer.m
    views = {u: _field_as_counts(r.leader_share, d, bound) for u, r in reports.items()}
    hit, cosine, users = _attack(views, spec, truth)
    # chance is 1/10: 4 standard deviations of the hit rate of `users` guesses; the cosine of an estimate
    # independent of the gradient has mean 0 and sd <= 1/sqrt(d) per user (5 standard errors of the mean)
    sd = (0.1 * 0.9 / users) ** 0.5
    assert hit <= 0.1 + 4 * sd, (hit, users)
    assert abs(cosine) <= 5 / (d * users) ** 0.5, (cosine, users)

    # the shuffler relayed nothing a device's data is in: no totals or ciphertexts; per report the Helper's sealed
    # share, the Leader's prep share and the report's public share; the Leader's aggregate share
    batches = [pb.ShuffledBatch.FromString(raw) for raw in kept["batch"]]
    assert len(batches) == 1 and batches[0].released
    batch = batches[0]
    assert not batch.label_totals and not batch.ciphertexts and len(batch.reports) == len(reports)
    answers = [pb.LeaderAggregate.FromString(raw) for raw in kept["aggregation-answer"]]
    assert len(answers) == 1 and answers[0].released and len(answers[0].aggregate_share) == 16 * d
    to_analyzer = kept["batch"][0] + kept["aggregation-answer"][0]
    helper_len = {len(r.helper_share) for r in batch.reports}
    assert len(helper_len) == 1 and helper_len.pop() < 300  # sealed seeds only
    for r in reports.values():
        assert r.leader_share[:48] not in to_analyzer and r.leader_share[-48:] not in to_analyzer
    assert {len(r.leader_prep_share) for r in batch.reports} != {len(r.leader_share) for r in reports.values()}
    # the verification key came beside the signed spec and went to no device
    (execute,) = kept["execute"]
    key = pb.RoundSpec.FromString(execute).verify_key
    assert len(key) == prio3.VERIFY_KEY_BYTES and key not in pb.RoundSpec.FromString(execute).signed.spec
    assert not any(key in raw for raw in kept["invitation"])


# ------------------------------------------------------------------------------------------------ dishonest devices
def _honest(spec: pb.RoundSpec, vdaf: prio3.Vdaf, value: int = 0) -> tuple[bytes, bytes, bytes, bytes]:
    counts = np.full((1, spec.randomizer.dim), value, dtype=np.uint64)
    return prio3.shard(vdaf, counts, [1], spec.analyzer_public_key)[0]


def _forge(kind: str, spec: pb.RoundSpec, shared: dict) -> tuple[bytes, bytes, bytes, bytes]:
    """A dishonest device's report for the round of `spec` (its second invitation's)."""
    r = spec.randomizer
    vdaf = prio3.Vdaf(spec.prio3.vdaf, r.dim, r.g + r.m, spec.run_id, spec.round)
    if kind in ("zeros", "replay"):  # one valid report, sent by two devices: the second is a replay
        with shared["lock"]:
            if "zeros" not in shared:
                shared["zeros"] = _honest(spec, vdaf)
            return shared["zeros"]
    if kind == "out_of_range":  # entry 0 claims g + m + 1 (a dishonest client built on the crate's own circuit)
        rid = secrets.token_bytes(prio3.REPORT_ID_BYTES)
        public, leader, helper = vdaf.of(1)._shard_out_of_range(np.zeros(r.dim, np.uint64), rid, 0, r.g + r.m + 1)
        return rid, public, leader, sealing.seal(spec.analyzer_public_key, rid + helper, vdaf.info)
    if kind == "wrong_length":  # a valid report of d - 1 entries
        short = prio3.Vdaf(spec.prio3.vdaf, r.dim - 1, r.g + r.m, spec.run_id, spec.round)
        return prio3.shard(short, np.zeros((1, r.dim - 1), np.uint64), [1], spec.analyzer_public_key)[0]
    if kind == "forged_proof":  # one byte of the proof's share changed (the lowest byte of an element near the end)
        rid, public, leader, helper = _honest(spec, vdaf)
        at = len(leader) - 32 - 16
        return rid, public, leader[:at] + bytes([leader[at] ^ 1]) + leader[at + 1 :], helper
    if kind == "mismatched_share":  # the Leader share of another report
        rid, public, _, helper = _honest(spec, vdaf)
        return rid, public, _honest(spec, vdaf, 1)[2], helper
    raise ValueError(kind)


class _DishonestDevice:
    """Device client-<index> played by the test with its real certificate: it registers one user, checks in, and
    answers the second invitation with a forged report."""

    def __init__(self, d: _Deployment, index: int, kind: str, shared: dict) -> None:
        self.name, self.user = pki.client_node_name(index), f"evil-{index}"
        sec = tls.ChannelSecurity(d.pki_dir, pki.ROLE_CLIENT_NODE, self.name)
        self.channel = sec.channel(d.shuffler, server_name="shuffler")
        self.stub = pbg.ShufflerStub(self.channel)
        self.stub.RegisterUsers(pb.RegisterUsersRequest(node_id=self.name, user_ids=[self.user]), timeout=10)
        self.stream = self.stub.Subscribe(pb.SubscribeRequest(node_id=self.name))
        self.acks: list[pb.ContributionAck] = []

        def pump() -> None:
            try:
                for inv in self.stream:
                    if not inv.user_ids:
                        continue
                    spec = pb.RoundSpec.FromString(inv.signed_spec.spec)
                    c = pb.Contribution(run_id=spec.run_id, round=spec.round, node_id=self.name)
                    c.columns.user_ids.append(self.user)
                    c.columns.nonces, c.columns.nonce_bytes = secrets.token_bytes(16), 16
                    if inv.checked_in:
                        rid, public, leader, helper = _forge(kind, second_spec(spec, inv.checked_in), shared)
                        c.columns.sum_users = 1
                        c.columns.reports.add(
                            report_id=rid, public_share=public, leader_share=leader, helper_share=helper
                        )
                    self.acks.append(self.stub.Submit(c, timeout=30))  # a check-in carries no payload
            except grpc.RpcError:
                pass  # closed at the end of the test

        self.thread = threading.Thread(target=pump, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


def test_malformed_and_replayed_reports_are_rejected_by_reason(deployment) -> None:
    kinds = ["zeros", "replay", "out_of_range", "wrong_length", "forged_proof", "mismatched_share"]
    shared: dict = {"lock": threading.Lock()}
    assert len(kinds) == EVIL
    evil = [_DishonestDevice(deployment, DEVICES + i, k, shared) for i, k in enumerate(kinds)]
    try:
        summary, kept = deployment.run("prio3")
    finally:
        for e in evil:
            e.close()
    round_ = summary["metrics"][-1]
    honest = sum(
        1
        for raw in kept["contribution"]
        for u in pb.Contribution.FromString(raw).columns.user_ids
        if pb.Contribution.FromString(raw).columns.reports and not u.startswith("evil")
    )
    assert round_["released"], round_
    assert round_["rejected"] == {"replayed_report": 1, "malformed_report": 1, "invalid_proof": 3}, round_
    assert round_["contributors"] == honest + 1  # the honest devices and the one valid zero report
