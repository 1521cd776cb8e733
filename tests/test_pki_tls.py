"""PKI and mTLS: real gRPC servers on 127.0.0.1 with certificates from `shuffledp pki init`.

Handshake failures (no certificate, self-signed, other CA) must surface as UNAVAILABLE; a verified
certificate of a role the method does not allow as PERMISSION_DENIED.
"""

from __future__ import annotations

import json
import logging
import stat
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shuffledp.security import pki
from shuffledp.transport import tls

HEALTH = "/grpc.health.v1.Health/"
ECHO = "/shuffledp.test.Echo/"
RPC_TIMEOUT = 10.0  # seconds; a handshake failure is reported long before this


def _echo_handler() -> grpc.GenericRpcHandler:
    """A generic service with one method of each streaming kind (bytes in, bytes out)."""
    handlers = {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"uu:" + req),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([b"us:" + req, b"end"])),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(lambda it, ctx: b"su:" + b"".join(it)),
        "StreamStream": grpc.stream_stream_rpc_method_handler(lambda it, ctx: (b"ss:" + r for r in it)),
        "WhoAmI": grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: json.dumps(
                {"role": tls.peer_role(ctx), "name": (tls.peer_identity(ctx) or pki.Identity("", "")).name}
            ).encode()
        ),
    }
    return grpc.method_handlers_generic_handler("shuffledp.test.Echo", handlers)


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pki")
    pki.init_pki(out, client_nodes=2)
    return out


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, unrelated CA issuing certificates with the very same roles and names."""
    out = tmp_path_factory.mktemp("other-pki")
    pki.init_pki(out, client_nodes=1)
    return out


@pytest.fixture(scope="module")
def server(pki_dir: Path):
    """The 'shuffler': health open to client nodes and the analyzer; Echo to client nodes only."""
    sec = tls.ServerSecurity(pki_dir, pki.ROLE_SHUFFLER, "shuffler")
    srv = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=sec.interceptors(
            {
                HEALTH: {pki.ROLE_CLIENT_NODE, pki.ROLE_ANALYZER},
                ECHO: {pki.ROLE_CLIENT_NODE},
                ECHO + "WhoAmI": {tls.ANY_ROLE},
            }
        ),
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    srv.add_generic_rpc_handlers((_echo_handler(),))
    port = sec.add_port(srv, "127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)


def _check(channel: grpc.Channel) -> health_pb2.HealthCheckResponse:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT)


def _code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _channel(target: str, pki_dir: Path, role: str, name: str) -> grpc.Channel:
    return tls.ChannelSecurity(pki_dir, role, name).channel(target, server_name="shuffler")


def _impostor_channel(target: str, d: Path) -> grpc.Channel:
    """A channel presenting client-0's material under `d` as is: an impostor runs raw gRPC, not our loader's checks
    (pki.load_party refuses such a certificate before any connection, see the test below)."""
    c, k = pki.party_paths(d, "client-0")
    ca = (d / pki.CA_CERT_FILE).read_bytes()
    creds = grpc.ssl_channel_credentials(ca, private_key=k.read_bytes(), certificate_chain=c.read_bytes())
    return grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", "shuffler")])


def _write_identity(d: Path, cert: x509.Certificate, key) -> Path:
    """A PKI-shaped directory holding `cert`/`key` as party 'client-0' and trusting the real CA."""
    (d / "client-0").mkdir(parents=True)
    (d / "client-0" / pki.CERT_FILE).write_bytes(pki.cert_pem(cert))
    key_path = d / "client-0" / pki.KEY_FILE
    key_path.write_bytes(pki.key_pem(key))
    key_path.chmod(0o600)
    return d


def test_correct_role_succeeds(server: str, pki_dir: Path) -> None:
    with _channel(server, pki_dir, pki.ROLE_CLIENT_NODE, "client-1") as ch:
        assert _check(ch).status == health_pb2.HealthCheckResponse.SERVING
        assert ch.unary_unary(ECHO + "UnaryUnary")(b"x", timeout=RPC_TIMEOUT) == b"uu:x"
        assert list(ch.unary_stream(ECHO + "UnaryStream")(b"y", timeout=RPC_TIMEOUT)) == [b"us:y", b"end"]
        assert ch.stream_unary(ECHO + "StreamUnary")(iter([b"a", b"b"]), timeout=RPC_TIMEOUT) == b"su:ab"
        assert list(ch.stream_stream(ECHO + "StreamStream")(iter([b"p", b"q"]), timeout=RPC_TIMEOUT)) == [
            b"ss:p",
            b"ss:q",
        ]
        who = json.loads(ch.unary_unary(ECHO + "WhoAmI")(b"", timeout=RPC_TIMEOUT))
        assert who == {"role": "client-node", "name": "client-1"}
    with _channel(server, pki_dir, pki.ROLE_ANALYZER, "analyzer") as ch:
        assert _check(ch).status == health_pb2.HealthCheckResponse.SERVING


def test_wrong_role_is_permission_denied(server: str, pki_dir: Path) -> None:
    # the operator may call nothing on this server but WhoAmI; the analyzer may not call Echo
    with _channel(server, pki_dir, pki.ROLE_OPERATOR, "operator") as ch:
        with pytest.raises(grpc.RpcError) as info:
            _check(ch)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "operator" in info.value.details() and "client-node" in info.value.details()
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
        assert _code_of(lambda: list(watch)) == grpc.StatusCode.PERMISSION_DENIED
        assert json.loads(ch.unary_unary(ECHO + "WhoAmI")(b"", timeout=RPC_TIMEOUT))["role"] == "operator"
    with _channel(server, pki_dir, pki.ROLE_ANALYZER, "analyzer") as ch:
        for kind, call in [
            ("UnaryUnary", lambda: ch.unary_unary(ECHO + "UnaryUnary")(b"x", timeout=RPC_TIMEOUT)),
            ("UnaryStream", lambda: list(ch.unary_stream(ECHO + "UnaryStream")(b"x", timeout=RPC_TIMEOUT))),
            ("StreamUnary", lambda: ch.stream_unary(ECHO + "StreamUnary")(iter([b"x"]), timeout=RPC_TIMEOUT)),
            (
                "StreamStream",
                lambda: list(ch.stream_stream(ECHO + "StreamStream")(iter([b"x"]), timeout=RPC_TIMEOUT)),
            ),
        ]:
            assert _code_of(call) == grpc.StatusCode.PERMISSION_DENIED, kind


def test_unlisted_method_is_denied(pki_dir: Path) -> None:
    # fail closed: a method registered on the server but absent from the allow-list is callable by nobody
    sec = tls.ServerSecurity(pki_dir, pki.ROLE_SHUFFLER, "shuffler")
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=sec.interceptors({HEALTH: {"*"}}))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    srv.add_generic_rpc_handlers((_echo_handler(),))
    port = sec.add_port(srv, "127.0.0.1:0")
    srv.start()
    try:
        with _channel(f"127.0.0.1:{port}", pki_dir, pki.ROLE_CLIENT_NODE, "client-0") as ch:
            assert _check(ch).status == health_pb2.HealthCheckResponse.SERVING
            call = ch.unary_unary(ECHO + "UnaryUnary")
            assert _code_of(lambda: call(b"x", timeout=RPC_TIMEOUT)) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        srv.stop(grace=None)


def test_no_client_certificate_is_refused(server: str, pki_dir: Path) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=(pki_dir / pki.CA_CERT_FILE).read_bytes())
    with grpc.secure_channel(server, creds, options=[("grpc.ssl_target_name_override", "shuffler")]) as ch:
        assert _code_of(lambda: _check(ch)) == grpc.StatusCode.UNAVAILABLE


def test_self_signed_certificate_is_refused(server: str, pki_dir: Path, tmp_path: Path) -> None:
    cert, key = pki.self_signed_cert(pki.ROLE_CLIENT_NODE, "client-0")
    assert pki.identity_of(cert) == pki.Identity("client-node", "client-0")  # it does claim the right role
    d = _write_identity(tmp_path, cert, key)
    (d / pki.CA_CERT_FILE).write_bytes((pki_dir / pki.CA_CERT_FILE).read_bytes())
    with _impostor_channel(server, d) as ch:
        assert _code_of(lambda: _check(ch)) == grpc.StatusCode.UNAVAILABLE
    # our own loader names the problem before any connection (issue 24 item 11)
    with pytest.raises(ValueError, match="client-0/cert.pem is not signed by"):
        tls.channel_credentials(d, pki.ROLE_CLIENT_NODE, "client-0")


def test_certificate_from_other_ca_is_refused(server: str, pki_dir: Path, other_pki: Path, tmp_path: Path) -> None:
    # client cert of the same role/name from another CA; the client trusts our CA so only the server can refuse
    c, k = pki.party_paths(other_pki, "client-0")
    d = _write_identity(
        tmp_path,
        x509.load_pem_x509_certificate(c.read_bytes()),
        serialization.load_pem_private_key(k.read_bytes(), None),
    )
    (d / pki.CA_CERT_FILE).write_bytes((pki_dir / pki.CA_CERT_FILE).read_bytes())
    with _impostor_channel(server, d) as ch:
        assert _code_of(lambda: _check(ch)) == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError, match="client-0/cert.pem is not signed by"):
        tls.channel_credentials(d, pki.ROLE_CLIENT_NODE, "client-0")


def test_client_refuses_server_of_other_ca(server: str, other_pki: Path) -> None:
    # the other direction: a client of the other PKI does not trust our server's certificate
    with _channel(server, other_pki, pki.ROLE_CLIENT_NODE, "client-0") as ch:
        assert _code_of(lambda: _check(ch)) == grpc.StatusCode.UNAVAILABLE


def test_client_refuses_server_with_wrong_name(server: str, pki_dir: Path) -> None:
    # the server is the shuffler: a client that expects the analyzer must not talk to it
    ch = tls.ChannelSecurity(pki_dir, pki.ROLE_SHUFFLER, "shuffler").channel(server, server_name="analyzer")
    with ch:
        assert _code_of(lambda: _check(ch)) == grpc.StatusCode.UNAVAILABLE


def test_certificate_contents(pki_dir: Path) -> None:
    ca = x509.load_pem_x509_certificate((pki_dir / pki.CA_CERT_FILE).read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    manifest = json.loads((pki_dir / pki.MANIFEST_FILE).read_text())
    names = [p["name"] for p in manifest["parties"]]
    assert names == ["analyzer", "shuffler", "client-0", "client-1", "operator"]
    for party in manifest["parties"]:
        cert_path, _ = pki.party_paths(pki_dir, party["name"])
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        cert.verify_directly_issued_by(ca)  # raises if not signed by the CA
        assert pki.identity_of(cert) == pki.Identity(party["role"], party["name"])
        ous = cert.subject.get_attributes_for_oid(x509.oid.NameOID.ORGANIZATIONAL_UNIT_NAME)
        assert [a.value for a in ous] == [party["role"]]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert f"spiffe://shuffledp/{party['role']}/{party['name']}" in san.get_values_for_type(
            x509.UniformResourceIdentifier
        )
        assert {party["name"], "localhost"} <= set(san.get_values_for_type(x509.DNSName))
        assert "127.0.0.1" in {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}


def test_identity_rejects_inconsistent_role(pki_dir: Path) -> None:
    # a cert whose OU and SAN disagree is given no role (built by hand, signed by the real CA)
    ca = x509.load_pem_x509_certificate((pki_dir / pki.CA_CERT_FILE).read_bytes())
    ca_key = serialization.load_pem_private_key((pki_dir / pki.CA_KEY_FILE).read_bytes(), None)
    good, key = pki.issue_cert(ca, ca_key, pki.ROLE_OPERATOR, "operator")
    san = good.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    subject = x509.Name(
        [
            x509.NameAttribute(x509.oid.NameOID.ORGANIZATIONAL_UNIT_NAME, "analyzer"),
            x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "operator"),
        ]
    )
    bad = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(good.not_valid_before_utc)
        .not_valid_after(good.not_valid_after_utc)
        .add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    assert pki.identity_of(good) == pki.Identity("operator", "operator")
    assert pki.identity_of(bad) is None


def test_key_file_modes(pki_dir: Path) -> None:
    keys = [pki_dir / pki.CA_KEY_FILE] + [
        pki.party_paths(pki_dir, n)[1] for n in ("analyzer", "shuffler", "client-0", "client-1", "operator")
    ]
    for k in keys:
        assert stat.S_IMODE(k.stat().st_mode) == 0o600, k
        assert stat.S_IMODE(k.parent.stat().st_mode) == 0o700, k.parent


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "p"
    pki.init_pki(out, client_nodes=3)
    ca_before = (out / pki.CA_CERT_FILE).read_bytes()
    with pytest.raises(FileExistsError, match="--force"):
        pki.init_pki(out, client_nodes=1)
    assert (out / pki.CA_CERT_FILE).read_bytes() == ca_before
    # CLI: same refusal with exit status 1 and nothing changed
    cmd = [sys.executable, "-m", "shuffledp.cli", "pki", "init", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "already exists" in res.stderr
    assert (out / pki.CA_CERT_FILE).read_bytes() == ca_before
    # --force replaces it, and removes the client nodes the new PKI no longer has
    res = subprocess.run(cmd + ["--force", "--client-nodes", "1"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (out / pki.CA_CERT_FILE).read_bytes() != ca_before
    assert (out / "client-0" / pki.CERT_FILE).exists() and not (out / "client-2").exists()


def test_bad_inputs(tmp_path: Path, pki_dir: Path) -> None:
    with pytest.raises(ValueError, match="client_nodes"):
        pki.init_pki(tmp_path / "a", client_nodes=0)
    with pytest.raises(ValueError, match="hosts"):
        pki.init_pki(tmp_path / "b", hosts=["not a host!"])
    with pytest.raises(ValueError, match="days"):
        pki.init_pki(tmp_path / "c", days=0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="role"):
        tls.server_credentials(pki_dir, "admin", "analyzer")
    with pytest.raises(ValueError, match="names"):  # the analyzer's cert is not the shuffler's
        tls.server_credentials(pki_dir, pki.ROLE_SHUFFLER, "analyzer")
    with pytest.raises(FileNotFoundError):
        tls.channel_credentials(pki_dir, pki.ROLE_CLIENT_NODE, "client-9")
    with pytest.raises(ValueError, match="unknown roles"):
        tls.RoleInterceptor({HEALTH: {"admin"}})
    with pytest.raises(ValueError, match="pki_dir is required"):
        tls.ServerSecurity(None, pki.ROLE_ANALYZER, "analyzer")
    with pytest.raises(ValueError, match="choose one"):
        tls.ChannelSecurity(pki_dir, pki.ROLE_ANALYZER, "analyzer", insecure=True)


def test_readable_key_is_refused(tmp_path: Path) -> None:
    pki.init_pki(tmp_path, client_nodes=1)
    pki.party_paths(tmp_path, "client-0")[1].chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        tls.channel_credentials(tmp_path, pki.ROLE_CLIENT_NODE, "client-0")


def test_insecure_mode_is_explicit_and_loopback_only(caplog: pytest.LogCaptureFixture) -> None:
    sec = tls.ServerSecurity.insecure_loopback(pki.ROLE_ANALYZER, "analyzer")
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    with pytest.raises(ValueError, match="loopback"):
        sec.add_port(srv, "0.0.0.0:0")
    with caplog.at_level(logging.WARNING, logger="shuffledp.transport.tls"):
        # no identities to check; requests are still decoded by the interceptor (INVALID_ARGUMENT, not INTERNAL)
        assert [type(i) for i in sec.interceptors({HEALTH: {"*"}})] == [tls.DecodeInterceptor]
        port = sec.add_port(srv, "127.0.0.1:0")
    assert any("WITHOUT TLS" in r.getMessage() for r in caplog.records)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    srv.start()
    try:
        chan_sec = tls.ChannelSecurity.insecure_loopback(pki.ROLE_OPERATOR, "operator")
        with pytest.raises(ValueError, match="loopback"):
            chan_sec.channel("10.1.2.3:50051")
        with chan_sec.channel(f"127.0.0.1:{port}") as ch:
            assert _check(ch).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(grace=None)


def test_cli_init(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "shuffledp.cli", "pki", "init", "--out", str(out), "--client-nodes", "3"]
    res = subprocess.run(cmd + ["--hosts", "node7.example", "10.9.8.7"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    cert = x509.load_pem_x509_certificate(pki.party_paths(out, "client-2")[0].read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "node7.example" in san.get_values_for_type(x509.DNSName)
    assert "10.9.8.7" in {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    op = x509.load_pem_x509_certificate(pki.party_paths(out, "operator")[0].read_bytes())
    op_san = op.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "node7.example" not in op_san.get_values_for_type(x509.DNSName)  # the operator serves nothing


def test_default_policy_covers_every_rpc() -> None:
    # every RPC of the wire contract must be callable by someone (unlisted = denied to all), and the
    # trust boundaries of design section 1 hold: only the analyzer drives rounds, only client nodes submit
    from shuffledp.v1 import shuffledp_pb2

    interceptor = tls.RoleInterceptor(tls.DEFAULT_POLICY)
    methods = [
        f"/{svc.full_name}/{m.name}" for svc in shuffledp_pb2.DESCRIPTOR.services_by_name.values() for m in svc.methods
    ]
    assert len(methods) >= 3
    for method in methods:
        assert interceptor.roles_for(method), f"{method} has no allowed role in tls.DEFAULT_POLICY"
    assert interceptor.roles_for("/shuffledp.v1.Shuffler/ExecuteRound") == {"analyzer"}
    assert interceptor.roles_for("/shuffledp.v1.Shuffler/Submit") == {"client-node"}
    assert interceptor.roles_for("/shuffledp.v1.Analyzer/CreateRun") == {"operator"}
    assert interceptor.roles_for("/shuffledp.v1.Shuffler/NoSuchMethod") == frozenset()
    for method in methods:  # the analyzer has no path to clients, clients none to the analyzer
        roles = interceptor.roles_for(method)
        assert not (method.startswith("/shuffledp.v1.Analyzer/") and "client-node" in roles)
        assert not (method.startswith("/shuffledp.v1.ClientNode/") and "analyzer" in roles)


def test_served_client_node_checks_the_callers_role(pki_dir: Path, tmp_path: Path) -> None:
    """`shuffledp serve client --pki` as a real process: its status RPC is the operator's only; health is open."""
    from shuffledp.v1 import shuffledp_pb2 as pb
    from shuffledp.v1 import shuffledp_pb2_grpc as pbg

    config = tmp_path / "node.toml"
    config.write_text('[data]\ndataset = "digits"\nmax_users = 20\n')
    port_file = tmp_path / "node.port"
    cmd = [sys.executable, "-m", "shuffledp.cli", "serve", "client", "--pki", str(pki_dir), "--config", str(config)]
    # no shuffler listens on port 9: the node keeps retrying in the background, its own server still answers
    cmd += ["--shuffler", "127.0.0.1:9", "--listen", "127.0.0.1:0", "--port-file", str(port_file)]
    cmd += ["--state-dir", str(tmp_path / "state")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.05)
        target = f"127.0.0.1:{port_file.read_text()}"

        def node_channel(role: str, name: str) -> grpc.Channel:
            return tls.ChannelSecurity(pki_dir, role, name).channel(target, server_name="client-0")

        with node_channel(pki.ROLE_OPERATOR, "operator") as ch:
            status = pbg.ClientNodeStub(ch).GetNodeStatus(pb.NodeStatusRequest(), timeout=RPC_TIMEOUT)
            assert status.node_id == "client-0"  # a node's id is its certificate's name
        for role, name in [(pki.ROLE_CLIENT_NODE, "client-1"), (pki.ROLE_SHUFFLER, "shuffler")]:
            with node_channel(role, name) as ch:
                call = pbg.ClientNodeStub(ch).GetNodeStatus
                assert _code_of(lambda call=call: call(pb.NodeStatusRequest(), timeout=RPC_TIMEOUT)) == (
                    grpc.StatusCode.PERMISSION_DENIED
                ), role
                assert _check(ch).status == health_pb2.HealthCheckResponse.SERVING  # health: every role
    finally:
        proc.terminate()
        proc.wait(timeout=30)
