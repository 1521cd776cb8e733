"""The analyzer's own rejection path of design 5.3: undecryptable / malformed BITS ciphertexts.

The shuffler cannot see inside sealed messages, so a ciphertext sealed to the wrong key, bound to another round,
tampered with or carrying a malformed plaintext reaches the analyzer. The analyzer skips each such message, counts
it by reason ("undecryptable", "malformed_plaintext"), decodes the remaining whole contributions with their n', and
fails the round (no optimizer step, round charged) when fewer than the threshold remain.

Real components only: the HPKE sealing module, a real Shuffler and a real Analyzer gRPC server on loopback, and a
client node of the test's own that speaks the real protocol (RegisterUsers, Subscribe, Submit) and seals real PVEC
bit messages (pvec.encode_bits + sealing), misbehaving for chosen users in chosen rounds.
"""

from __future__ import annotations

import logging
import secrets
import threading

import grpc
import numpy as np
import pytest
from _runs import wait_for_run
from shuffledp.clients.policy import pvec_params_from_spec
from shuffledp.services.analyzer import start_analyzer
from shuffledp.services.run_manager import MALFORMED_PLAINTEXT, UNDECRYPTABLE
from shuffledp.services.shuffler import start_shuffler

from shuffledp.accountants.pvec_pld import composed_epsilon
from shuffledp.mechanisms import pvec
from shuffledp.mechanisms.pvec import PvecParams
from shuffledp.optimizers.pgd import pgd
from shuffledp.protocols.pvec_round import open_bit_messages
from shuffledp.security.rng import make_rng
from shuffledp.security.sealing import (
    BIT_MESSAGE_BYTES,
    generate_keypair,
    pack_labelled_bits,
    private_key_bytes,
    round_info,
    seal,
    seal_many,
)
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------------------------------- unit: one batch
def test_open_bit_messages_skips_and_counts_every_bad_message():
    key, pub = generate_keypair()
    _, other_pub = generate_keypair()
    d, info = 3, round_info("run-a", 3)
    rng = make_rng(21)
    labels = rng.integers(0, d, size=40)
    bits = rng.integers(0, 2, size=40)
    good = seal_many(pub, pack_labelled_bits(labels, bits), info)
    one = pack_labelled_bits(np.array([1]), np.array([1]))[0]
    flipped_tag = bytearray(good[0])
    flipped_tag[-1] ^= 1
    flipped_enc = bytearray(good[1])
    flipped_enc[0] ^= 1
    undecryptable = [
        seal(other_pub, one, info),  # sealed to another key
        seal(pub, one, round_info("run-a", 4)),  # bound to another round
        seal(pub, one, round_info("run-b", 3)),  # bound to another run
        bytes(flipped_tag),  # tampered AEAD tag
        bytes(flipped_enc),  # tampered encapsulated key
        good[2][:-1],  # truncated by one byte
        good[3][:20],  # shorter than the HPKE overhead
        b"",
    ]
    malformed = [
        seal(pub, one + b"\x00", info),  # 6-byte plaintext
        seal(pub, b"", info),  # empty plaintext
        seal(pub, one[:4] + b"\x02", info),  # bit 2
        seal(pub, (d).to_bytes(4, "big") + b"\x01", info),  # label d: outside [0, d)
    ]
    batch = [*malformed[:2], *good, *undecryptable, *malformed[2:]]
    got_labels, got_bits, rejected = open_bit_messages(key, batch, info, d)
    assert dict(rejected) == {UNDECRYPTABLE: len(undecryptable), MALFORMED_PLAINTEXT: len(malformed)}
    np.testing.assert_array_equal(got_labels, labels)  # the good ones, all of them, in order
    np.testing.assert_array_equal(got_bits, bits)
    assert got_labels.dtype == np.int64 and got_bits.dtype == np.uint8
    # nothing to skip: the whole batch comes back and no reason is counted
    got_labels, got_bits, rejected = open_bit_messages(key, good, info, d)
    assert not rejected and got_labels.size == 40


# ---------------------------------------------------------------------------------------------- a real run
N_USERS = 10
USERS = [f"u{i}" for i in range(N_USERS)]
MIN_FRACTION = 0.5  # n_min = ceil(0.5 * 10) = 5
# round -> {user: fault}; users not listed are honest. Round 0: four bad contributors (n' = 6 >= 5, released);
# round 1: one tampered ciphertext of one user (scattered: not decodable); round 2: six bad (n' = 4 < 5).
FAULTS = {
    0: {"u0": "wrong_key", "u1": "wrong_round", "u2": "tampered", "u3": "malformed"},
    1: {"u4": "one_tampered"},
    2: {**{f"u{i}": "wrong_key" for i in range(5)}, "u5": "malformed"},
}


def _flip_last(c: bytes) -> bytes:
    b = bytearray(c)
    b[-1] ^= 1
    return bytes(b)


class SealingNode:
    """The test's client node: on every BITS invitation each user sends d(g+m) sealed labelled bits (real PVEC
    encoding and HPKE sealing); users listed in FAULTS for the round send bad ciphertexts instead. It keeps the
    honest users' plaintext bits per round (ground truth for the decode) and the shuffler's acks."""

    def __init__(self, address: str, node_id: str, x: dict[str, np.ndarray], seed: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pbg.ShufflerStub(self.channel)
        self.node_id, self.x, self.rng = node_id, x, make_rng(seed)
        self.honest: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.acks: dict[int, pb.ContributionAck] = {}
        self.errors: list[BaseException] = []
        self._other_pub = generate_keypair()[1]
        self.stub.RegisterUsers(pb.RegisterUsersRequest(node_id=node_id, user_ids=list(x)), timeout=5)
        self._call = self.stub.Subscribe(pb.SubscribeRequest(node_id=node_id))
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for inv in self._call:
                try:
                    self._answer(inv)
                except Exception as exc:  # surfaced by the test, never swallowed
                    self.errors.append(exc)
        except grpc.RpcError:
            pass

    def _ciphertexts(self, spec: pb.RoundSpec, user: str, fault: str | None) -> list[bytes]:
        params = pvec_params_from_spec(spec)  # the client's own reading of the spec (clients/policy.py)
        labels, bits = pvec.encode_bits(pvec.clip_rows(self.x[user], params.delta2), params, self.rng)
        plains = pack_labelled_bits(labels, bits)
        pub, info = spec.analyzer_public_key, round_info(spec.run_id, spec.round)
        if fault is None:
            self.honest.setdefault(int(spec.round), []).append((labels, bits))
            return seal_many(pub, plains, info)
        if fault == "wrong_key":
            return seal_many(self._other_pub, plains, info)
        if fault == "wrong_round":
            return seal_many(pub, plains, round_info(spec.run_id, spec.round + 1))
        if fault == "tampered":
            return [_flip_last(c) for c in seal_many(pub, plains, info)]
        if fault == "malformed":  # opens fine, but bit = 2 is not a labelled bit
            return seal_many(pub, [p[:4] + b"\x02" for p in plains], info)
        if fault == "one_tampered":
            cts = seal_many(pub, plains, info)
            return [_flip_last(cts[0]), *cts[1:]]
        raise AssertionError(fault)

    def _answer(self, inv: pb.Invitation) -> None:
        spec = inv.spec
        assert spec.transport == pb.BITS and spec.randomizer.message_bytes == BIT_MESSAGE_BYTES
        faults = FAULTS.get(int(spec.round), {})
        msgs = [
            pb.UserMessage(
                user_id=u,
                nonce=secrets.token_bytes(16),
                sealed=pb.SealedMessages(ciphertexts=self._ciphertexts(spec, u, faults.get(u))),
            )
            for u in inv.user_ids
        ]
        contribution = pb.Contribution(run_id=spec.run_id, round=spec.round, node_id=self.node_id, messages=msgs)
        self.acks[int(spec.round)] = self.stub.Submit(contribution, timeout=30)

    def close(self) -> None:
        self._call.cancel()
        self.channel.close()


def test_analyzer_skips_bad_ciphertexts_decodes_the_rest_and_fails_below_threshold(tmp_path, caplog):
    rng = make_rng(31)
    X = rng.uniform(-1, 1, size=(40, 1))
    np.savez(tmp_path / "tiny.npz", X=X, y=0.5 * X[:, 0] + 0.2)
    # eps = 60 keeps d(g+m) (messages per user) near 10^3 so that a round seals and opens ~10^4 messages in ~1 s;
    # the privacy level is irrelevant to what is tested here
    cfg_text = (
        f'[data]\ndataset = "path"\npath = "{tmp_path / "tiny.npz"}"\n[model]\ntask = "leastsq"\nradius = 2.0\n'
        f"[privacy]\neps = 60.0\ndelta = 1e-3\nmin_contributors_fraction = {MIN_FRACTION}\n"
        "[privacy.pvec]\ncheck_in = false\n"  # this node answers every invitation with its messages (no check-in)
        '[schedule]\nrounds = 3\nlearning_rate = 1.0\noutput = "last"\n[transport]\nmode = "bits"\n'
        "[deployment]\nclient_nodes = 1\nround_deadline_seconds = 30\n"
    )
    user_x = {u: rng.normal(size=2) for u in USERS}  # d = 2 (leastsq, 1 feature + bias); clipped by the node
    shuffler, sport = start_shuffler("127.0.0.1:0")
    analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state")
    channel = grpc.insecure_channel(f"127.0.0.1:{aport}")
    node = SealingNode(f"127.0.0.1:{sport}", "node-bad", user_x, seed=32)
    try:
        stub = pbg.AnalyzerStub(channel)
        with caplog.at_level(logging.WARNING, logger="shuffledp.services.run_manager"):
            run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=cfg_text)).run_id
            stub.StartRun(pb.RunRef(run_id=run_id))
            st = wait_for_run(stub, run_id, timeout=120)
            result = stub.GetRunResult(pb.RunRef(run_id=run_id))
        assert not node.errors, node.errors
        manager = analyzer.manager
        plan = manager.ledger.run(run_id)["plan"]
        params = PvecParams(**plan["params"])
        per_user = params.messages_per_user
        assert plan["min_contributors"] == 5 and plan["cohort"] == N_USERS and params.d == 2

        # the shuffler cannot tell: it accepted and forwarded every contribution of every round
        assert {r: (a.accepted, dict(a.rejected)) for r, a in node.acks.items()} == {r: (N_USERS, {}) for r in FAULTS}
        assert st.state == pb.COMPLETED, st.message  # two failed rounds in a row < 3: the run goes on and ends

        # per-round outcome and exact per-reason counts (per message), in the analyzer's round metrics
        metrics = manager.view(run_id).metrics
        assert [m["round"] for m in metrics] == [0, 1, 2]
        assert [m["released"] for m in metrics] == [True, False, False]
        assert [m["contributors"] for m in metrics] == [6, 0, 4]
        assert metrics[0]["rejected"] == {UNDECRYPTABLE: 3 * per_user, MALFORMED_PLAINTEXT: per_user}
        assert metrics[1]["rejected"] == {UNDECRYPTABLE: 1}
        assert metrics[2]["rejected"] == {UNDECRYPTABLE: 5 * per_user, MALFORMED_PLAINTEXT: per_user}
        assert "failure" not in metrics[0]
        assert "not decodable" in metrics[1]["failure"] and "4 < 5" in metrics[2]["failure"]
        assert [(m.released, m.contributors) for m in st.metrics] == [(True, 6), (False, 0), (False, 4)]
        # ... and over the wire, in RunStatus (what `shuffledp run` writes to metrics.json / metrics.csv)
        assert [dict(m.rejected) for m in st.metrics] == [m["rejected"] for m in metrics]
        assert [m.refused for m in st.metrics] == [0, 0, 0]

        # the estimate of round 0 is the decode of the six honest contributions alone, debiased with n' = 6
        labels = np.concatenate([lb for lb, _ in node.honest[0]])
        bits = np.concatenate([b for _, b in node.honest[0]])
        assert len(node.honest[0]) == 6
        total = pvec.decode_bits(labels, bits, params)
        opt = pgd(plan["learning_rate"], plan["radius"])
        expected, _ = opt.step(total / 6, opt.init(np.zeros(2)), np.zeros(2))
        assert np.linalg.norm(expected) > 0
        # output = "last": the released model is the last iterate; rounds 1 and 2 must have left it unchanged
        model = np.frombuffer(result.model.f64, dtype="<f8")
        np.testing.assert_array_equal(model, expected)  # same decode and step code on the same multiset: exact

        # ledger: every round's batch was delivered and opened, so every round is charged, none released:
        # round 0 at n' = 6, round 1 at the contributions certainly intact (10 - 1 bad message) and round 2 at
        # the n' = 4 honest users whose messages were read (more than the reservation at n_min = 5)
        rows = manager.ledger.rounds(run_id)
        assert [(r["state"], r["contributors"]) for r in rows] == [("committed", 6), ("committed", 9), ("committed", 4)]
        delta = plan["delta"]
        after_1 = composed_epsilon([(params, 6), (params, 9)], delta)
        after_2 = composed_epsilon([(params, 6), (params, 9), (params, 4)], delta)
        assert metrics[1]["eps_spent"] == pytest.approx(after_1, rel=1e-12) and np.isfinite(after_1)
        assert st.budget.eps_spent == pytest.approx(after_2, rel=1e-12) and st.budget.rounds_committed == 3
        # honest, not the reservation: round 2 costs more than it would at n_min = 5 (with these parameters the
        # exact accountant certifies no finite eps at n' = 4, so the run's budget is spent: inf > 60)
        assert st.budget.eps_spent > composed_epsilon([(params, 6), (params, 9), (params, 5)], delta)

        # the analyzer logged the counts, never a message or key
        logged = " ".join(rec.getMessage() for rec in caplog.records)
        assert "skipped" in logged and "failed" in logged
        key_hex = private_key_bytes(manager._live[run_id].private_key).hex()
        assert "b'" not in logged and 'b"' not in logged and key_hex not in logged
    finally:
        node.close()
        channel.close()
        analyzer.stop(0)
        shuffler.stop(0)
