"""The Prio3SumVec binding (native/, issue 45 phase 1): the crate `prio` 0.18.1 (draft-irtf-cfrg-vdaf-18) through
PyO3. (1) The draft's published test vectors replay byte for byte: shard with their fixed randomness, verifier shares,
verifier message, output shares, aggregate shares, result. (2) Honest reports sum exactly. (3) Invalid reports (an
entry out of range, a wrong length, a forged proof, a mismatched share) are rejected by the joint verification with
a decode error or a verification failure, and no output share comes out. (4) Replay is not the VDAF's to detect:
the servers must refuse a nonce they have seen (draft-18 section 9.2), phase 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

prio = pytest.importorskip(
    "shuffledp_prio",
    reason="shuffledp_prio (native/) is not built: it needs a Rust toolchain (cargo); scripts/_venv.sh builds it",
)

DATA = Path(__file__).resolve().parent / "data" / "prio3"
# Both field choices the issue asks for: Field128 with one proof, Field64 with three (draft-18 section 9.7)
KINDS = [prio.Prio3SumVec, prio.Prio3SumVecField64Multiproof]
FIELD_BYTES = {"Field128": 16, "Field64": 8}


def _verify(vdaf, key: bytes, nonce: bytes, public: bytes, shares: list[bytes]) -> list[bytes]:
    """The two Aggregators' verification of one report (draft-18 section 5.2): their output shares."""
    states, prep_shares = zip(
        *(vdaf.prepare_init(key, i, nonce, public, share) for i, share in enumerate(shares)), strict=True
    )
    message = vdaf.prep_shares_to_prep(list(prep_shares))
    return [vdaf.prepare_next(state, message) for state in states]


def _report(vdaf, measurement) -> tuple[bytes, bytes, list[bytes]]:
    nonce = os.urandom(vdaf.nonce_size)
    public, *shares = vdaf.shard(measurement, nonce)
    return nonce, public, shares


# --- (1) the published test vectors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kind",
    [
        ("Prio3SumVec_0", prio.Prio3SumVec),
        ("Prio3SumVec_1", prio.Prio3SumVec),  # 3 Aggregators, max_measurement 32000 (not 2^k - 1)
        ("Prio3SumVecWithMultiproof_0", prio.Prio3SumVecField64Multiproof),
        ("Prio3SumVecWithMultiproof_1", prio.Prio3SumVecField64Multiproof),
    ],
)
def test_published_test_vectors_replay_byte_for_byte(name, kind):
    tv = json.loads((DATA / f"{name}.json").read_text())
    assert all(op["success"] for op in tv["operations"])  # these files hold honest reports only
    vdaf = kind(
        tv["length"],
        tv["max_measurement"],
        tv["chunk_length"],
        ctx=bytes.fromhex(tv["ctx"]),
        num_aggregators=tv["shares"],
    )
    key = bytes.fromhex(tv["verify_key"])
    out_shares: list[list[bytes]] = [[] for _ in range(tv["shares"])]
    for report in tv["reports"]:
        nonce = bytes.fromhex(report["nonce"])
        measurement = [int(x) for x in report["measurement"]]
        public, *inputs = vdaf._shard_with_rand(measurement, nonce, bytes.fromhex(report["rand"]))
        assert public.hex() == report["public_share"]
        assert [s.hex() for s in inputs] == report["input_shares"]
        states, prep_shares = [], []
        for agg_id, share in enumerate(inputs):
            state, prep_share = vdaf.prepare_init(key, agg_id, nonce, public, share)
            states.append(state)
            prep_shares.append(prep_share)
        assert [s.hex() for s in prep_shares] == report["verifier_shares"][0]
        message = vdaf.prep_shares_to_prep(prep_shares)
        assert [message.hex()] == report["verifier_messages"]
        outs = [vdaf.prepare_next(state, message) for state in states]
        assert [o.hex() for o in outs] == report["out_shares"]
        for agg_id, out in enumerate(outs):
            out_shares[agg_id].append(out)
    agg_shares = [vdaf.aggregate(outs) for outs in out_shares]
    assert [a.hex() for a in agg_shares] == tv["agg_shares"]
    assert vdaf.unshard(agg_shares, len(tv["reports"])) == tv["agg_result"]


def test_the_binding_states_its_crate_and_draft():
    assert prio.PRIO_CRATE_VERSION == "0.18.1" and prio.VDAF_DRAFT == "draft-irtf-cfrg-vdaf-18"
    a, b = prio.Prio3SumVec(650, 65535), prio.Prio3SumVecField64Multiproof(650, 65535)
    assert (a.field, a.num_proofs, a.algorithm_id) == ("Field128", 1, 0x00000003)  # draft-18 section 10
    assert (b.field, b.num_proofs, b.algorithm_id) == ("Field64", 3, 0xFFFFFFFF)
    assert a.bits == b.bits == 16 and a.chunk_length > 1
    with pytest.raises(ValueError, match="at least three proofs"):
        prio.Prio3SumVecField64Multiproof(650, 65535, num_proofs=2)  # draft-18 section 9.7: MUST be >= 3
    with pytest.raises(ValueError, match="one proof"):
        prio.Prio3SumVec(650, 65535, num_proofs=2)


# --- (2) honest reports ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_fifty_honest_reports_sum_exactly(kind):
    d, n = 650, 50
    vdaf = kind(d, 65535)
    key = os.urandom(vdaf.verify_key_size)
    rng = np.random.default_rng(45)
    measurements = rng.integers(0, 65536, size=(n, d), dtype=np.uint64)
    measurements[0] = 65535  # the bounds themselves are valid
    measurements[1] = 0
    out_shares: list[list[bytes]] = [[], []]
    for i, m in enumerate(measurements):
        # numpy arrays and lists of ints are both measurements
        nonce, public, shares = _report(vdaf, m if i % 2 else m.tolist())
        assert len(shares) == 2 and len(shares[1]) == 2 * vdaf.verify_key_size  # the Helper's share: two seeds
        for agg_id, out in enumerate(_verify(vdaf, key, nonce, public, shares)):
            out_shares[agg_id].append(out)
    # an aggregate share built in two parts equals the one built at once
    leader = vdaf.aggregate(out_shares[0][25:], vdaf.aggregate(out_shares[0][:25]))
    assert leader == vdaf.aggregate(out_shares[0])
    result = vdaf.unshard([leader, vdaf.aggregate(out_shares[1])], n)
    assert result == measurements.sum(axis=0).tolist()


def test_shard_releases_the_gil():
    # while another thread shards large reports, this one keeps running: with the GIL held the gap between its
    # ticks would be a whole shard (~0.3 s at this size)
    vdaf = prio.Prio3SumVec(50_000, 65535)
    m = np.full(50_000, 7, dtype=np.uint16)
    nonce = os.urandom(16)
    t0 = time.perf_counter()
    vdaf.shard(m, nonce)
    one_shard = time.perf_counter() - t0
    worker = threading.Thread(target=lambda: [vdaf.shard(m, nonce) for _ in range(3)])
    ticks = [time.perf_counter()]
    worker.start()
    while worker.is_alive():
        time.sleep(0.002)
        ticks.append(time.perf_counter())
    worker.join()
    assert max(np.diff(ticks)) < 0.5 * one_shard, (max(np.diff(ticks)), one_shard)


# --- (3) invalid reports ---------------------------------------------------------------------------------------


def _rejected(vdaf, key, nonce, public, shares, error):
    """The report fails the joint verification with `error`; no output share comes out of any step."""
    outputs: list[bytes] = []
    with pytest.raises(error) as info:
        outputs = _verify(vdaf, key, nonce, public, shares)
    assert outputs == []
    return str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_out_of_range_is_refused_by_the_client_and_rejected_by_the_aggregators(kind):
    vdaf = kind(100, 40000)  # not 2^k - 1: the last bit's weight is max_measurement - 2^15 + 1
    key = os.urandom(32)
    m = [40000] * 100
    _report(vdaf, m)  # the bound itself is fine
    with pytest.raises(prio.VdafError):  # an honest Client's shard refuses it
        _report(vdaf, [*m[:-1], 40001])
    # a dishonest Client runs the crate's sharding and proving on an encoding that claims 70000 for entry 3
    nonce = os.urandom(16)
    public, *shares = vdaf._shard_out_of_range(m, nonce, 3, 70000)
    msg = _rejected(vdaf, key, nonce, public, shares, prio.VerificationError)
    assert "proof verifier check failed" in msg


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_length_is_a_decode_error(kind):
    vdaf = kind(100, 65535)
    key = os.urandom(32)
    with pytest.raises(prio.VdafError, match="length"):
        _report(vdaf, [1] * 101)
    # a Client that shards 101 entries with its own instance: the Leader's share does not decode (the Helper's is
    # two seeds, whatever the length)
    nonce, public, shares = _report(kind(101, 65535), [1] * 101)
    msg = _rejected(vdaf, key, nonce, public, shares, prio.DecodeError)
    assert "input share of aggregator 0" in msg
    assert not isinstance(prio.DecodeError("x"), prio.VerificationError)  # the two reasons are distinguishable
    with pytest.raises(prio.DecodeError, match="public share"):
        vdaf.prepare_init(key, 0, nonce, public[:-1], shares[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("part", ["proof", "measurement"])
def test_a_forged_leader_share_is_rejected(kind, part):
    vdaf = kind(100, 65535)
    key = os.urandom(32)
    nonce, public, shares = _report(vdaf, [5] * 100)
    leader = bytearray(shares[0])
    # the Leader's share: measurement share (length * bits elements), proof shares, joint randomness blind
    # (draft-18 section 7.2.7); flip the low bit of an element's first (least significant) byte so it still decodes
    offset = vdaf.length * vdaf.bits * FIELD_BYTES[vdaf.field] if part == "proof" else 0
    leader[offset] ^= 1
    msg = _rejected(vdaf, key, nonce, public, [bytes(leader), shares[1]], prio.VerificationError)
    assert "proof verifier check failed" in msg or "joint randomness mismatch" in msg


@pytest.mark.parametrize("kind", KINDS)
def test_a_helper_share_from_another_report_is_rejected(kind):
    vdaf = kind(100, 65535)
    key = os.urandom(32)
    nonce, public, shares = _report(vdaf, [5] * 100)
    _, _, other = _report(vdaf, [5] * 100)
    _rejected(vdaf, key, nonce, public, [shares[0], other[1]], prio.VerificationError)
    # nor does the verifier message of another (valid) report unlock an output share
    states = [vdaf.prepare_init(key, i, nonce, public, s)[0] for i, s in enumerate([shares[0], other[1]])]
    n2, p2, s2 = _report(vdaf, [5] * 100)
    message = vdaf.prep_shares_to_prep([vdaf.prepare_init(key, i, n2, p2, s)[1] for i, s in enumerate(s2)])
    for state in states:
        with pytest.raises(prio.VerificationError, match="joint randomness mismatch"):
            vdaf.prepare_next(state, message)


def test_a_report_for_another_context_or_key_is_rejected():
    vdaf = prio.Prio3SumVec(100, 65535)
    key = os.urandom(32)
    nonce, public, shares = _report(prio.Prio3SumVec(100, 65535, ctx=b"another application"), [5] * 100)
    _rejected(vdaf, key, nonce, public, shares, prio.VerificationError)
    nonce, public, shares = _report(vdaf, [5] * 100)  # Aggregators that do not share one verification key
    s0, p0 = vdaf.prepare_init(key, 0, nonce, public, shares[0])
    s1, p1 = vdaf.prepare_init(os.urandom(32), 1, nonce, public, shares[1])
    with pytest.raises(prio.VerificationError):
        vdaf.prep_shares_to_prep([p0, p1])


def test_bad_arguments_are_value_errors():
    vdaf = prio.Prio3SumVec(10, 255)
    with pytest.raises(ValueError, match="nonce must be 16 bytes"):
        vdaf.shard([1] * 10, b"short")
    nonce, public, shares = _report(vdaf, [1] * 10)
    with pytest.raises(ValueError, match="verify_key must be 32 bytes"):
        vdaf.prepare_init(b"k", 0, nonce, public, shares[0])
    with pytest.raises(ValueError, match="agg_id"):
        vdaf.prepare_init(os.urandom(32), 2, nonce, public, shares[0])
    with pytest.raises(OverflowError):
        vdaf.shard([-1] * 10, nonce)
    with pytest.raises(prio.DecodeError):
        vdaf.prepare_next(b"", b"")
    with pytest.raises(ValueError, match="2 aggregate shares"):
        vdaf.unshard([vdaf.aggregate([])], 0)


# --- (4) replay ------------------------------------------------------------------------------------------------


def test_replay_is_the_callers_to_refuse():
    # The VDAF keeps no memory of reports: the same report verifies twice and would be counted twice. Refusing a
    # nonce (report id) already seen is the servers' job (draft-18 section 9.2 recommends the nonce for it), phase 2.
    vdaf = prio.Prio3SumVec(10, 255)
    key = os.urandom(32)
    nonce, public, shares = _report(vdaf, [1] * 10)
    first = _verify(vdaf, key, nonce, public, shares)
    assert _verify(vdaf, key, nonce, public, shares) == first


# --- the benchmark ----------------------------------------------------------------------------------------------


def test_bench_prio3_native_quick_prints_both_fields_at_every_size():
    # benchmarks/bench_prio3_native.py --quick (tests/test_benchmark_scripts.py names each script it runs; this is
    # the binding's): a row per (field, d) with positive times and the share sizes of the measurement
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_prio3_native.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(
        r"^\s*(Field128|Field64)\s+(1|3)\s+(\d+)\s+\d+((?:\s+[0-9.]+){4})((?:\s+\d+){4})$", proc.stdout, re.M
    )
    assert [(r[0], r[2]) for r in rows] == [(f, d) for d in ("100", "650", "10000") for f in ("Field128", "Field64")]
    for field, _, d, times, sizes in rows:
        assert all(float(t) > 0 for t in times.split()), proc.stdout
        leader, helper, public, _ = (int(s) for s in sizes.split())
        assert helper == public == 64  # two seeds each (draft-18 section 7.2.7)
        if d == "650":  # the figures: 173 kB with Field128, 93 kB with Field64
            assert leader == {"Field128": 173136, "Field64": 93288}[field]
