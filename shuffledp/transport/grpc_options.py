"""One place for every gRPC size limit and keepalive setting, so that every channel and server agree (issue 10).

Sizes, per hop (design section 1):
- client node -> shuffler (Submit, RegisterUsers): at most CLIENT_MESSAGE_BYTES per request. Nodes split larger
  contributions into Submits of at most SUBMIT_CHUNK_BYTES (the shuffler aggregates a round's Submits one by one).
- shuffler -> analyzer (ShuffledBatch) and analyzer -> operator (RunResult): at most BATCH_MESSAGE_BYTES. The shuffler
  refuses, before any state changes, a round whose worst-case batch would not fit (ShufflerState._validate), so an
  answer the analyzer cannot receive never exists.
Keepalive: nodes ping their idle Subscribe stream every KEEPALIVE_TIME_MS to notice a dead shuffler; servers must
permit pings at least that often (MIN_PING_INTERVAL_MS < KEEPALIVE_TIME_MS), or gRPC answers GOAWAY "too_many_pings"
and the stream drops. The option names are gRPC core's (grpc/impl/channel_arg_names.h).
Binding (issue 24 item 6): gRPC sets SO_REUSEPORT on Linux by default, so a second server on a running one's address
binds too and the kernel splits the connections between them. Every server here turns it off and binds through
bind_server, which refuses an address in use with one line naming it.
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: this module is imported by light modules that never serve
    import grpc

__all__ = [
    "CLIENT_MESSAGE_BYTES",
    "SUBMIT_CHUNK_BYTES",
    "BATCH_MESSAGE_BYTES",
    "KEEPALIVE_TIME_MS",
    "MIN_PING_INTERVAL_MS",
    "server_options",
    "node_channel_options",
    "analyzer_channel_options",
    "operator_channel_options",
    "ROUND_REFUSED_METADATA_KEY",
    "BindError",
    "check_address_free",
    "bind_server",
]

CLIENT_MESSAGE_BYTES = 64 * 2**20
SUBMIT_CHUNK_BYTES = 16 * 2**20  # well below CLIENT_MESSAGE_BYTES: the chunking estimate may be off by a little
BATCH_MESSAGE_BYTES = 1024 * 2**20  # protobuf's own hard limit is 2 GiB
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_PING_INTERVAL_MS = 5_000

# Trailing metadata the shuffler sets on an ExecuteRound it refused before selecting or inviting anyone (value: the
# status code's name). Only this tells the analyzer that no batch exists: the same code without it (a size limit or
# deadline hit inside gRPC, a lost connection) may follow a collected batch, which the ledger must count as spent.
ROUND_REFUSED_METADATA_KEY = "shuffledp-round-refused"
# The shuffler's capacity: nodes connected at once (`serve shuffler --max-nodes`). Sized for this 2-core machine:
# 10^4 idle mTLS connections take ~1 GB (benchmarks/bench_devices.py); over it a node is refused (RESOURCE_EXHAUSTED,
# reason "capacity") and reported by name (RefusedNode), never left to wait unseen.
DEFAULT_MAX_NODES = 10_000
# Initial metadata the shuffler sends on a node's stream (Connect, Subscribe) once the node is subscribed: until it
# comes the node is not connected (a refusal, e.g. over the shuffler's capacity, ends the call instead), so that it
# backs off and logs one line per outage rather than counting each refused attempt as a connection (issue 44).
SUBSCRIBED_METADATA_KEY = "shuffledp-subscribed"


def subscribed(initial_metadata: Any) -> bool:
    """Whether the shuffler accepted a node's stream: SUBSCRIBED_METADATA_KEY in its initial metadata."""
    return any(key == SUBSCRIBED_METADATA_KEY for key, _ in initial_metadata or ())


Options = list[tuple[str, Any]]


def server_options(max_receive: int = CLIENT_MESSAGE_BYTES, max_send: int = BATCH_MESSAGE_BYTES) -> Options:
    """Options of every shuffledp gRPC server: size limits, and permission for the clients' keepalive pings."""
    return [
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.max_send_message_length", max_send),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.so_reuseport", 0),  # an address in use is refused, never shared with another process (item 6)
    ]


def node_channel_options(keepalive_ms: int = KEEPALIVE_TIME_MS) -> Options:
    """A client node's channel to the shuffler: keepalive on the idle Subscribe stream, the client size limit."""
    if keepalive_ms < MIN_PING_INTERVAL_MS:
        raise ValueError(f"keepalive_ms={keepalive_ms} < the servers' minimum ping interval {MIN_PING_INTERVAL_MS}")
    return [
        ("grpc.max_send_message_length", CLIENT_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", CLIENT_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging however long the stream is idle
    ]


def analyzer_channel_options() -> Options:
    """The analyzer's channel to the shuffler: receives whole batches (up to BATCH_MESSAGE_BYTES)."""
    return [("grpc.max_receive_message_length", BATCH_MESSAGE_BYTES), ("grpc.max_send_message_length", -1)]


def operator_channel_options() -> Options:
    """The operator's channel to the analyzer: RunResult carries the model and the whole ledger; a restarted
    analyzer is found again within seconds (gRPC's default reconnect backoff grows to 120 s)."""
    return [("grpc.max_receive_message_length", BATCH_MESSAGE_BYTES), ("grpc.max_reconnect_backoff_ms", 5000)]


class BindError(OSError):
    """A server could not listen on its address; str() is the one line to print."""


def _bind_problem(address: str, in_use_only: bool = False) -> str | None:
    """Why `address` ('host:port') cannot be bound by a new listener, or None when it can (or cannot be probed here:
    port 0, a unix socket). Binds a throw-away socket the way gRPC does once SO_REUSEPORT is off (SO_REUSEADDR on,
    which on Linux lets a port in TIME_WAIT be reused but never one that a socket listens on). With in_use_only,
    other failures (no IPv6 for "localhost", a name that does not resolve) are left to gRPC, which may still bind
    one of the name's addresses."""
    if address.startswith(("unix:", "unix-abstract:")) or ":" not in address:
        return None
    host, port_text = address.rsplit(":", 1)
    host = host.strip("[]") or None  # ":50051" is every address, as in gRPC
    try:
        port = int(port_text)
    except ValueError:
        return None if in_use_only else f"{port_text!r} is not a port number"
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return None if in_use_only else f"cannot resolve {host!r} ({exc.strerror})"
    other = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the address is already in use (is this service already running?)"
            other = other or exc.strerror or str(exc)
    return None if in_use_only else other


def check_address_free(address: str) -> None:
    """BindError (one line naming `address`) if a server could not listen on it now: called before a service opens
    any state, so that a second instance of a running service stops before touching the first one's files."""
    problem = _bind_problem(address, in_use_only=True)
    if problem is not None:
        raise BindError(f"cannot listen on {address}: {problem}")


def bind_server(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `server` to `address` (mTLS with `credentials`, else plain text; the caller checks plain text is
    allowed) and return the bound port. BindError with one line naming the address if it cannot: gRPC returns 0 or
    raises RuntimeError depending on its version, and never says why, so the reason is probed here."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise BindError(f"cannot listen on {address}: {_bind_problem(address) or 'gRPC could not bind it'}")
    return port
