"""`shuffledp health`: the gRPC health probe that the compose healthchecks run, against a real mTLS server.

No Docker needed: an in-process server on 127.0.0.1 with the standard health service and the project's role
policy, certificates from `shuffledp pki init` (tests/test_docker_deploy.py runs the same probe in containers).
"""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shuffledp.security import pki
from shuffledp.transport import health as shealth
from shuffledp.transport import tls


@pytest.fixture(scope="module")
def health_pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    ours = tmp_path_factory.mktemp("health-pki")
    pki.init_pki(ours, client_nodes=1)
    other = tmp_path_factory.mktemp("health-other-pki")
    pki.init_pki(other, client_nodes=1)
    return ours, other


@pytest.fixture
def health_server(health_pki):
    """A shuffler-like mTLS server with the standard health service and the project's role policy."""
    ours, _ = health_pki
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), interceptors=[tls.RoleInterceptor(tls.DEFAULT_POLICY)]
    )
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(ours, "shuffler", "shuffler"))
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("shuffledp.v1.ClientNode", health_pb2.HealthCheckResponse.NOT_SERVING)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait()


def test_health_probe_reports_serving_over_mtls(health_pki, health_server, capsys):
    ours, _ = health_pki
    # every role may ask (compose probes with the container's own certificate); the role comes from the cert
    for name in ("shuffler", "client-0", "analyzer", "operator"):
        assert shealth.check(health_server, ours, name) == "SERVING"
    assert shealth.role_of(ours, "client-0") == pki.ROLE_CLIENT_NODE
    assert shealth.main([health_server, "--pki", str(ours), "--name", "client-0"]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_health_probe_fails_when_not_serving_or_unauthenticated(health_pki, health_server, capsys):
    ours, other = health_pki
    svc = "shuffledp.v1.ClientNode"
    assert shealth.check(health_server, ours, "client-0", service=svc) == "NOT_SERVING"
    assert shealth.main([health_server, "--pki", str(ours), "--name", "client-0", "--service", svc]) == 1
    with pytest.raises(shealth.HealthError, match="NOT_FOUND"):
        shealth.check(health_server, ours, "client-0", service="no.such.Service")
    # a certificate from another CA: the TLS handshake fails, the probe says so and exits 1
    with pytest.raises(shealth.HealthError, match="UNAVAILABLE"):
        shealth.check(health_server, other, "client-0", timeout=5)
    assert shealth.main([health_server, "--pki", str(other), "--name", "client-0", "--timeout", "5"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    with pytest.raises(ValueError, match="timeout"):
        shealth.check(health_server, ours, "client-0", timeout=0)
    with pytest.raises(FileNotFoundError, match="client-7"):
        shealth.check(health_server, ours, "client-7")
