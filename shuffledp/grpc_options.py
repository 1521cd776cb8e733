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
"""

from __future__ import annotations

from typing import Any

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

Options = list[tuple[str, Any]]


def server_options(max_receive: int = CLIENT_MESSAGE_BYTES, max_send: int = BATCH_MESSAGE_BYTES) -> Options:
    """Options of every shuffledp gRPC server: size limits, and permission for the clients' keepalive pings."""
    return [
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.max_send_message_length", max_send),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
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
