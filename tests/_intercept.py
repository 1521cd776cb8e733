"""A server interceptor that captures what a service receives at its boundary (tests of trust boundaries)."""

from __future__ import annotations

import threading

import grpc

from shuffledp.v1 import shuffledp_pb2 as pb


class Recorder(grpc.ServerInterceptor):
    """Records every Contribution the shuffler receives (capture at the service boundary)."""

    def __init__(self) -> None:
        self.contributions: list[pb.Contribution] = []
        self._lock = threading.Lock()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.endswith("/Submit"):
            return handler
        inner = handler.unary_unary

        def submit(request, context):
            with self._lock:
                self.contributions.append(request)
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            submit, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    def for_round(self, round_: int) -> list[pb.Contribution]:
        with self._lock:
            return [c for c in self.contributions if c.round == round_]
