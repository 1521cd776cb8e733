"""`shuffledp health ADDRESS`: ask a shuffledp service for its status with the standard gRPC health protocol.

Every shuffledp port requires a client certificate from the project CA (shuffledp.transport.tls), so a health probe must
present one too: docker compose healthchecks use the container's own certificate, e.g.

    shuffledp health 127.0.0.1:50052 --pki /pki --name shuffler          # or: python -m shuffledp.transport.health ...

The caller's role is read from its certificate (shuffledp.security.pki.identity_of); the health service is open to every
role (tls.DEFAULT_POLICY). Exit status 0 means SERVING; anything else (not serving, unknown service, TLS or
connection failure, timeout) prints one line saying why and exits 1, which is what a healthcheck needs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shuffledp.security import pki
from shuffledp.transport import grpc_options
from shuffledp.transport.tls import check_plain_text

__all__ = ["HealthError", "role_of", "check", "start_with_health", "start_with_health_aio", "add_parser", "main"]

DEFAULT_TIMEOUT_S = 5.0


class HealthError(RuntimeError):
    """The service could not be asked (connection, TLS, authorization) or gave no SERVING answer."""


def role_of(pki_dir: str | os.PathLike[str], name: str) -> str:
    """Role written in party `name`'s certificate under `pki_dir` (ValueError if it names no shuffledp role)."""
    cert_path, _ = pki.party_paths(pki_dir, name)
    if not cert_path.is_file():
        raise FileNotFoundError(f"{cert_path} not found: is --pki the PKI directory and --name a party in it?")
    ident = pki.identity_of(x509.load_pem_x509_certificate(cert_path.read_bytes()))
    if ident is None or ident.name != name:
        raise ValueError(f"{cert_path} is not a shuffledp certificate of party {name!r}")
    return ident.role


def start_with_health(
    server: grpc.Server,
    listen: str,
    credentials: grpc.ServerCredentials | None,
    service: str,
    serving: bool = True,
) -> tuple[int, health.HealthServicer]:
    """Add the standard gRPC health service to `server`, bind `listen` (mTLS when credentials are given, else plain
    text), start it; returns (bound port, health servicer). The whole server ("") reports SERVING once started;
    `service` reports SERVING or, with serving=False, NOT_SERVING until its owner says otherwise.
    grpc_options.BindError (an OSError) if the address cannot be bound or is in use."""
    servicer = health.HealthServicer()
    port = _bind(server, servicer, listen, credentials)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(service, _status(serving))
    return port, servicer


async def start_with_health_aio(
    server: grpc.aio.Server,
    listen: str,
    credentials: grpc.ServerCredentials | None,
    service: str,
) -> tuple[int, health.aio.HealthServicer]:
    """start_with_health for a grpc.aio server (the shuffler's), `service` SERVING once started; run on the server's
    event loop."""
    servicer = health.aio.HealthServicer()
    port = _bind(server, servicer, listen, credentials)
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return port, servicer


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


def _bind(server: Any, servicer: Any, listen: str, credentials: grpc.ServerCredentials | None) -> int:
    """Add the health servicer and bind `listen` (plain text only where check_plain_text allows it)."""
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if credentials is None:
        check_plain_text(listen, "listen address")  # the one plain-text rule (issue 10 item 12)
    return grpc_options.bind_server(server, listen, credentials)  # BindError: one line naming the address


def check(
    address: str,
    pki_dir: str | os.PathLike[str] | None = None,
    name: str | None = None,
    service: str = "",
    server_name: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    insecure: bool = False,
) -> str:
    """Health status name ("SERVING", "NOT_SERVING", ...) of `service` ("" = the whole server) at `address`.

    Connects with mTLS as party `name` of `pki_dir` (or plain text on loopback if `insecure`); `server_name` is
    the name the server certificate must carry when `address` is not one of its names. Raises HealthError when
    no answer comes back (the message says why), ValueError on bad arguments.
    """
    from shuffledp.transport.tls import ChannelSecurity

    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    if insecure:
        security = ChannelSecurity.insecure_loopback("operator", "health")
    else:
        if pki_dir is None or not name:
            raise ValueError("pki_dir and name are required unless insecure=True")
        security = ChannelSecurity(pki_dir, role_of(pki_dir, name), name)
    with security.channel(address, server_name=server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            label = code.name if code is not None else "ERROR"
            raise HealthError(f"{address}: {label}: {details}") from exc
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `shuffledp health` with the CLI dispatcher (shuffledp.cli)."""
    parser = subparsers.add_parser("health", help="check a service with the gRPC health protocol (exit 0 = SERVING)")
    _arguments(parser)
    parser.set_defaults(func=_health_command)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="HOST:PORT of the service, e.g. 127.0.0.1:50051")
    sec = parser.add_mutually_exclusive_group(required=True)
    sec.add_argument("--pki", type=Path, help="PKI directory holding ca.crt and <name>/ (mTLS)")
    sec.add_argument("--insecure", action="store_true", help="plain text, loopback only (local runs)")
    parser.add_argument("--name", help="with --pki: the party whose certificate to present (e.g. analyzer)")
    parser.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    parser.add_argument("--server-name", help="name expected in the server certificate (default: the host)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the answer")


def _health_command(args: argparse.Namespace) -> int:
    if args.pki is not None and not args.name:
        print("shuffledp health: --name is required with --pki", file=sys.stderr)
        return 2
    try:
        status = check(args.address, args.pki, args.name, args.service, args.server_name, args.timeout, args.insecure)
    except (HealthError, ValueError, OSError) as exc:
        print(f"shuffledp health: {exc}", file=sys.stderr)
        return 1
    what = f"{args.address} {args.service}".rstrip()
    print(f"{what}: {status}")
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m shuffledp.transport.health ...` (the same as `shuffledp health ...`)."""
    parser = argparse.ArgumentParser(prog="shuffledp health", description=__doc__.splitlines()[0])
    _arguments(parser)
    return _health_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
