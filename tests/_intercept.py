"""A server interceptor that captures what a service receives at its boundary (tests of trust boundaries)."""

from __future__ import annotations

import threading

import grpc
import numpy as np

from shuffledp.v1 import shuffledp_pb2 as pb


class Recorder(grpc.aio.ServerInterceptor):
    """Records every Contribution the shuffler receives, by Submit or on a Connect stream (capture at the service
    boundary: the shuffler's grpc.aio handlers take the raw request bytes, decoded here for the record)."""

    def __init__(self) -> None:
        self.contributions: list[pb.Contribution] = []
        self._lock = threading.Lock()

    def _record(self, c: pb.Contribution) -> None:
        with self._lock:
            self.contributions.append(c)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is not None and details.method.endswith("/Connect"):
            return self._connect(handler)
        if handler is None or not details.method.endswith("/Submit"):
            return handler
        inner = handler.unary_unary

        async def submit(raw, context):
            self._record(pb.Contribution.FromString(raw))
            return await inner(raw, context)

        return grpc.unary_unary_rpc_method_handler(
            submit, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    def _connect(self, handler):
        inner = handler.stream_stream

        async def recorded(requests):
            async for raw in requests:
                msg = pb.NodeMessage.FromString(raw)
                if msg.WhichOneof("kind") == "contribution":
                    self._record(msg.contribution)
                yield raw

        async def connect(request_iterator, context):
            async for response in inner(recorded(request_iterator), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            connect, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    def for_round(self, round_: int) -> list[pb.Contribution]:
        with self._lock:
            return [c for c in self.contributions if c.round == round_]


def count_total(c: pb.Contribution, dtype: np.dtype | None = None) -> np.ndarray:
    """A COUNTS contribution's per-label total as the shuffler adds it up (int64): its group sums (UserColumns.sums,
    what client nodes send), plus any per-user rows (columns.counts or CountVector.packed, of `dtype`)."""
    total = 0
    if c.columns.sums:
        groups = -(-len(c.columns.user_ids) // c.columns.sum_users)
        total = np.frombuffer(c.columns.sums, dtype="<u8").astype(np.int64).reshape(groups, -1).sum(axis=0)
    for m in user_messages(c):
        if m.WhichOneof("payload") == "counts":
            total = total + np.frombuffer(m.counts.packed, dtype=dtype).astype(np.int64)
    return np.asarray(total)


def user_messages(c: pb.Contribution) -> list[pb.UserMessage]:
    """Every user message of a Contribution as a UserMessage: `messages`, then one per row of `columns` (a COUNTS
    row as CountVector.packed, a check-in or a user of a group sum without payload), as the shuffler checks them."""
    out = list(c.messages)
    cols = c.columns
    n, w = len(cols.user_ids), cols.nonce_bytes
    row = len(cols.counts) // n if n else 0
    for i, u in enumerate(cols.user_ids):
        m = pb.UserMessage(user_id=u, nonce=cols.nonces[i * w : (i + 1) * w])
        if cols.counts:
            m.counts.packed = cols.counts[i * row : (i + 1) * row]
        out.append(m)
    return out
