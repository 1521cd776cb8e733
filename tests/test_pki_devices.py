"""Issue 44 item 3: device identity at scale. `shuffledp pki init` issues thousands of node certificates in seconds,
`pki issue` adds nodes to an existing PKI (keys made by the CA's host, or a device's own key through a CSR), and
`pki revoke` writes a CA-signed crl.pem that a running shuffler (`shuffledp serve shuffler --pki`, a real process on
a real socket) checks as each call opens: a revoked node is refused with PERMISSION_DENIED naming the revocation
while the others connect, and a list the CA did not sign is not used."""

from __future__ import annotations

import datetime as dt
import json
import os
import queue
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from _procs import log_text, serve, stop
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from shuffledp.security import pki
from shuffledp.transport import tls
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(300)

RPC_TIMEOUT = 10.0
BULK = 2000  # certificates issued by the timed test; docs/how-to/services.md "Certificates" gives the 10^4 figure
BULK_BOUND_S = 60.0  # generous: a loaded 2-core machine shared with other test runs; ~1 s when idle


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "pki", *argv], capture_output=True, text=True, timeout=120
    )


def test_thousands_of_node_certificates_are_issued_in_seconds(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    started = time.perf_counter()
    res = _cli("init", "--out", str(out), "--client-nodes", str(BULK))
    took = time.perf_counter() - started
    print(f"pki init --client-nodes {BULK}: {took:.1f} s ({took / BULK * 1e3:.2f} ms per certificate, CLI start incl.)")
    assert res.returncode == 0, res.stderr
    assert took < BULK_BOUND_S
    assert len(res.stdout.splitlines()) < 10  # the nodes as one line, not 2000
    manifest = json.loads((out / pki.MANIFEST_FILE).read_text())
    assert len(manifest["parties"]) == BULK + 3
    for i in (0, BULK // 2, BULK - 1):  # private keys 0600 in 0700 directories, every certificate valid
        pki.load_party(out, pki.ROLE_CLIENT_NODE, pki.client_node_name(i))
        key = pki.party_paths(out, pki.client_node_name(i))[1]
        assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    serials = {p["serial"] for p in manifest["parties"]}
    assert len(serials) == BULK + 3  # what a revocation names


def test_issue_adds_nodes_to_an_existing_pki_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    pki.init_pki(out, client_nodes=2)
    before = {p: p.read_bytes() for p in [out / pki.CA_CERT_FILE, *pki.party_paths(out, "client-1")]}
    res = _cli("issue", "--pki", str(out), "--count", "3")
    assert res.returncode == 0, res.stderr
    assert all(p.read_bytes() == data for p, data in before.items())
    for name in ("client-2", "client-3", "client-4"):
        pki.load_party(out, pki.ROLE_CLIENT_NODE, name)  # signed by the same CA, key 0600
    names = [p["name"] for p in json.loads((out / pki.MANIFEST_FILE).read_text())["parties"]]
    assert names.count("client-4") == 1 and not (out / "client-5").exists()
    pki.check_local_run(out, 5)  # a run of 5 nodes over it passes the start-up check
    # mistakes: one line each, nothing written
    for argv, words in [
        (["--count", "0"], "count=0"),
        ([], "give --count N"),
        (["--count", "1", "--csr", str(out / "none.csr"), "--name", "client-9"], "--csr FILE goes with --name"),
    ]:
        res = _cli("issue", "--pki", str(out), *argv)
        assert res.returncode == 1 and words in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
    (out / pki.CA_KEY_FILE).rename(tmp_path / "ca.key")  # the CA key lives elsewhere
    res = _cli("issue", "--pki", str(out), "--count", "1")
    assert res.returncode == 1 and "host that holds the CA key" in res.stderr
    assert not (out / "client-5").exists()


def _device_csr(device_dir: Path, name: str, claim: str = pki.ROLE_ANALYZER) -> Path:
    """What a device does: its own key (never leaves it) and a CSR; the subject claims another role, which the CA
    must not copy."""
    key = pki.generate_key()
    (device_dir / name).mkdir(parents=True, mode=0o700)
    key_path = device_dir / name / pki.KEY_FILE
    key_path.write_bytes(pki.key_pem(key))
    key_path.chmod(0o600)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, claim)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    path = device_dir / "device.csr"
    path.write_bytes(csr.public_bytes(pki.serialization.Encoding.PEM))
    return path


def test_sign_csr_refuses_what_is_not_a_device_request(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    pki.init_pki(out, client_nodes=1)
    csr_path = _device_csr(tmp_path / "dev", "client-50")
    with pytest.raises(ValueError, match="not a PEM certificate signing request"):
        pki.sign_csr(out, b"garbage", "client-50")
    with pytest.raises(ValueError, match="not allowed"):
        pki.sign_csr(out, csr_path.read_bytes(), "Client_50")
    with pytest.raises(FileExistsError, match="has a certificate already"):
        pki.sign_csr(out, csr_path.read_bytes(), "client-0")
    assert not (out / "client-50").exists()
    cert = x509.load_pem_x509_certificate(pki.sign_csr(out, csr_path.read_bytes(), "client-50").read_bytes())
    assert pki.identity_of(cert) == pki.Identity(pki.ROLE_CLIENT_NODE, "client-50")  # not the analyzer it claimed
    assert (
        cert.not_valid_after_utc
        <= x509.load_pem_x509_certificate((out / pki.CA_CERT_FILE).read_bytes()).not_valid_after_utc
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command")
def test_the_readmes_openssl_request_is_accepted(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    pki.init_pki(out, client_nodes=1)
    cmd = ["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    cmd += ["-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "device.csr"), "-subj", "/CN=client-7"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    res = _cli("issue", "--pki", str(out), "--csr", str(tmp_path / "device.csr"), "--name", "client-7")
    assert res.returncode == 0, res.stderr
    assert pki.party_paths(out, "client-7")[0].is_file() and not pki.party_paths(out, "client-7")[1].exists()


def _channel(pki_dir: Path, address: str, name: str) -> grpc.Channel:
    return tls.ChannelSecurity(pki_dir, pki.ROLE_CLIENT_NODE, name).channel(address, server_name="shuffler")


def _register(pki_dir: Path, address: str, name: str) -> pb.RegisterUsersResponse:
    with _channel(pki_dir, address, name) as ch:
        request = pb.RegisterUsersRequest(node_id=name, user_ids=[f"{name}-u0"])
        return pbg.ShufflerStub(ch).RegisterUsers(request, timeout=RPC_TIMEOUT)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


class _Connected:
    """A node's Connect stream held open (its subscribe message sent, then nothing) until close()."""

    def __init__(self, pki_dir: Path, address: str, name: str) -> None:
        self._channel = _channel(pki_dir, address, name)
        self._done = threading.Event()
        self.call = pbg.ShufflerStub(self._channel).Connect(self._messages(name))

    def _messages(self, name: str) -> Iterator[pb.NodeMessage]:
        yield pb.NodeMessage(subscribe=pb.SubscribeRequest(node_id=name))
        self._done.wait()

    def close(self) -> None:
        self._done.set()
        self.call.cancel()
        self._channel.close()


def _connected_nodes(pki_dir: Path, address: str) -> int:
    with tls.ChannelSecurity(pki_dir, pki.ROLE_ANALYZER, "analyzer").channel(address, server_name="shuffler") as ch:
        return pbg.ShufflerStub(ch).GetPopulation(pb.PopulationRequest(), timeout=RPC_TIMEOUT).connected_nodes


def _wait_connected(pki_dir: Path, address: str, nodes: int) -> None:
    end = time.monotonic() + 30
    while _connected_nodes(pki_dir, address) < nodes:
        assert time.monotonic() < end, f"the shuffler does not count {nodes} connected nodes"
        time.sleep(0.05)


def _foreign_crl(tmp_path: Path, serials: list[int]) -> bytes:
    """A revocation list with the same issuer name as the real CA's ("shuffledp CA") but another CA's signature."""
    other = tmp_path / "other-pki"
    pki.init_pki(other, client_nodes=1, force=True)
    ca = x509.load_pem_x509_certificate((other / pki.CA_CERT_FILE).read_bytes())
    key = pki.serialization.load_pem_private_key((other / pki.CA_KEY_FILE).read_bytes(), password=None)
    now = dt.datetime.now(dt.UTC)
    entries = [x509.RevokedCertificateBuilder().serial_number(s).revocation_date(now).build() for s in serials]
    return pki._crl_pem(ca, key, entries, 99)


def test_a_revoked_node_is_refused_by_a_running_shuffler_and_the_others_connect(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    pki.init_pki(out, client_nodes=3)
    # a device enrolled with its own key: its directory holds the CA certificate, its key and the signed certificate
    device = tmp_path / "device"
    csr = _device_csr(device, "client-123")
    res = _cli("issue", "--pki", str(out), "--csr", str(csr), "--name", "client-123")
    assert res.returncode == 0, res.stderr
    shutil.copy(out / pki.CA_CERT_FILE, device / pki.CA_CERT_FILE)
    shutil.copy(pki.party_paths(out, "client-123")[0], pki.party_paths(device, "client-123")[0])

    argv = ["shuffler", "--pki", str(out), "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")]
    proc, port = serve(tmp_path, "shuffler", argv)
    address = f"127.0.0.1:{port}"
    held: list[_Connected] = []
    try:
        for name in ("client-0", "client-1"):
            assert _register(out, address, name).admitted == 1
        assert _register(device, address, "client-123").admitted == 1  # the CSR-enrolled device connects

        res = _cli("revoke", "--pki", str(out), "client-1")
        assert res.returncode == 0, res.stderr
        serial = x509.load_pem_x509_certificate(pki.party_paths(out, "client-1")[0].read_bytes()).serial_number
        # the running shuffler reads the changed file: no restart
        err = _refused(lambda: _register(out, address, "client-1"))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"certificate of client-1 is revoked (serial {serial:x}" in err.details()
        revoked = _Connected(out, address, "client-1")
        err = _refused(lambda: next(revoked.call))
        revoked.close()
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "client-1 is revoked" in err.details()
        # the others still register and connect
        _register(out, address, "client-0")  # accepted (raises if refused)
        held += [_Connected(out, address, "client-0"), _Connected(device, address, "client-123")]
        _wait_connected(out, address, 2)

        # a list signed by another CA, revoking client-0, is not used; client-1 stays revoked
        client0 = x509.load_pem_x509_certificate(pki.party_paths(out, "client-0")[0].read_bytes()).serial_number
        (out / pki.CRL_FILE).write_bytes(_foreign_crl(tmp_path, [client0]))
        _register(out, address, "client-0")
        assert _refused(lambda: _register(out, address, "client-1")).code() == grpc.StatusCode.PERMISSION_DENIED
        (out / pki.CRL_FILE).write_bytes(b"not a list")  # nor a corrupt one
        assert _register(out, address, "client-2").admitted == 1
        assert _refused(lambda: _register(out, address, "client-1")).code() == grpc.StatusCode.PERMISSION_DENIED
        log = log_text(tmp_path, "shuffler")
        assert "crl.pem is not signed by the CA" in log and "not a PEM certificate revocation list" in log, log
    finally:
        for c in held:
            c.close()
        stop(proc)

    # a shuffler does not start with a revocation list its CA did not sign: one line, exit before serving
    (out / pki.CRL_FILE).write_bytes(_foreign_crl(tmp_path, []))
    res = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "serve", *argv[:-1], str(tmp_path / "state2")],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert res.returncode != 0 and "crl.pem is not signed by the CA" in res.stderr.splitlines()[-1], res.stderr


def test_revoke_names_issued_client_nodes_only_and_writes_nothing_on_a_mistake(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    pki.init_pki(out, client_nodes=2)
    empty = (out / pki.CRL_FILE).read_bytes()  # init writes an empty list: a deployment can mount it from the start
    assert not list(pki.verified_crl(out / pki.CRL_FILE, x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())))
    for names, words in [(["client-0", "client-9"], "no certificate"), (["client-0", "shuffler"], "not a client node")]:
        res = _cli("revoke", "--pki", str(out), *names)
        assert res.returncode == 1 and words in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
        assert (out / pki.CRL_FILE).read_bytes() == empty
    assert [new for _, _, new in pki.revoke(out, ["client-0"])] == [True]
    assert [new for _, _, new in pki.revoke(out, ["client-0", "client-1"])] == [False, True]
    ca = x509.load_pem_x509_certificate((out / pki.CA_CERT_FILE).read_bytes())
    crl = pki.verified_crl(out / pki.CRL_FILE, ca)
    assert len(list(crl)) == 2 and crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 3
    pki.init_pki(out, client_nodes=1, force=True)  # a new CA: the old list goes with it
    new_ca = x509.load_pem_x509_certificate((out / pki.CA_CERT_FILE).read_bytes())
    assert not list(pki.verified_crl(out / pki.CRL_FILE, new_ca))


def test_concurrent_issues_and_revocations_lose_nothing(tmp_path: Path) -> None:
    """Four `pki issue --count 50` and two `pki revoke` processes at once (enrolment servers, an operator): every
    certificate gets its own name and a manifest entry, and both revocations are in the CA-signed list. Before, each
    process read the manifest and the list, then wrote its own version: the same client-<i> issued twice and entries
    (or revocations) of the others dropped."""
    pki.init_pki(tmp_path, client_nodes=4)
    cmds = [["issue", "--pki", str(tmp_path), "--count", "50"]] * 4
    cmds += [["revoke", "--pki", str(tmp_path), "client-0"], ["revoke", "--pki", str(tmp_path), "client-1"]]
    procs = [
        subprocess.Popen([sys.executable, "-m", "shuffledp.cli", "pki", *argv], stdout=subprocess.PIPE, text=True)
        for argv in cmds
    ]
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    names = [party["name"] for party in json.loads((tmp_path / pki.MANIFEST_FILE).read_text())["parties"]]
    clients = [n for n in names if n.startswith("client-")]
    assert len(clients) == len(set(clients)) == 4 + 4 * 50, len(clients)
    assert sorted(clients) == sorted(f"client-{i}" for i in range(204))
    ca = x509.load_pem_x509_certificate((tmp_path / pki.CA_CERT_FILE).read_bytes())
    serials = {e.serial_number for e in pki.verified_crl(tmp_path / pki.CRL_FILE, ca)}
    for name in ("client-0", "client-1"):
        cert = x509.load_pem_x509_certificate(pki.party_paths(tmp_path, name)[0].read_bytes())
        assert cert.serial_number in serials, name


class _Sending:
    """A node's Connect stream: its subscribe message, then whatever send() puts on it, until close()."""

    def __init__(self, pki_dir: Path, address: str, name: str) -> None:
        self._channel = _channel(pki_dir, address, name)
        self._out: queue.Queue = queue.Queue()
        self._out.put(pb.NodeMessage(subscribe=pb.SubscribeRequest(node_id=name)))
        self.call = pbg.ShufflerStub(self._channel).Connect(iter(self._out.get, None))

    def send(self, msg: pb.NodeMessage) -> None:
        self._out.put(msg)

    def close(self) -> None:
        self._out.put(None)
        self.call.cancel()
        self._channel.close()


def test_a_device_revoked_while_connected_loses_its_stream_at_its_next_message(tmp_path: Path) -> None:
    """The revocation list is checked as each call opens, and again at each message a stream carries: a device that
    was connected before its revocation has its stream ended (PERMISSION_DENIED naming the revocation) at the next
    message it sends, which is not used; it is no longer counted as connected, and the other device keeps its stream.
    Before, a connected device kept contributing until it reconnected."""
    out = tmp_path / "pki"
    pki.init_pki(out, client_nodes=2)
    argv = ["shuffler", "--pki", str(out), "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")]
    proc, port = serve(tmp_path, "shuffler", argv)
    address = f"127.0.0.1:{port}"
    streams: list[_Sending] = []
    try:
        for name in ("client-0", "client-1"):
            assert _register(out, address, name).admitted == 1
            streams.append(_Sending(out, address, name))
        assert all(s.call.initial_metadata() for s in streams)  # both subscribed
        _wait_connected(out, address, 2)
        assert _cli("revoke", "--pki", str(out), "client-1").returncode == 0
        late = pb.Contribution(run_id="r", round=0, node_id="client-1")
        streams[1].send(pb.NodeMessage(seq=1, contribution=late))
        err = _refused(lambda: next(streams[1].call))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "client-1 is revoked" in err.details(), err
        end = time.monotonic() + 10
        while _connected_nodes(out, address) != 1:
            assert time.monotonic() < end, "the revoked device is still counted as connected"
            time.sleep(0.05)
        assert not streams[0].call.done()  # the other device keeps its stream
    finally:
        for s in streams:
            s.close()
        stop(proc)
