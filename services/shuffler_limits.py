"""What one caller can hold of the shuffler (issue 43 item 3, issue 44 item 1): a grpc.aio interceptor that counts
each call when it opens, before its first message is read: revoked certificates first, the analyzer's methods by
role, streams and requests in flight per identity, the first message's deadline; and the nodes it refused, by
reason, for the run's output and the metrics. Split out of the servicer (issue 47)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from shuffledp.security import pki
from shuffledp.transport import tls

__all__ = ["CallLimits", "RefusedNode", "STREAMS_PER_NODE", "NODE_REQUESTS_IN_FLIGHT", "FIRST_MESSAGE_SECONDS"]

SERVICE = "shuffledp.v1.Shuffler"
STREAMS_PER_NODE = 2  # a node's invitation stream, and the one that replaces it when the node reconnects
# Requests a node may have in flight at once (RegisterUsers and Submit: a node sends its Submits one after another).
# Each can be up to 64 MiB and ~10x that once decoded, so this bounds what one node identity can make the shuffler
# hold (issue 10). Plain text (loopback) has no identities: the budget is per connection.
NODE_REQUESTS_IN_FLIGHT = 2
# From a call's opening to its first message received whole: a RegisterUsers of 2^20 ids (~30 MiB) needs 1 MB/s.
# A call that sends nothing would otherwise hold its memory for ever (issue 43 item 3)
FIRST_MESSAGE_SECONDS = 30.0
REFUSED_NODES_KEPT = 1000  # nodes whose refusals are kept (the newest), for the run's output and the metrics
_ANALYZER_METHODS = frozenset(
    m for m, roles in tls.DEFAULT_POLICY.items() if m.startswith(f"/{SERVICE}/") and roles == {pki.ROLE_ANALYZER}
)


@dataclass
class RefusedNode:
    """A node the shuffler refused: its name, why (the reason of the newest refusal), and how many calls."""

    node: str
    reason: str
    details: str
    calls: int = 0


class CallLimits(grpc.aio.ServerInterceptor):
    """What one caller can hold of the shuffler, counted when its call opens, before its first message is read (issue
    43 item 3). Install it first: it turns every request-unary method into a request-streaming one, so that it runs
    as soon as the call opens instead of after the request was read.

    - a revoked certificate is refused first (PERMISSION_DENIED), before any quota is held;
    - the analyzer's methods (ExecuteRound, GetPopulation): a caller with a certificate of another role is refused
      at once (PERMISSION_DENIED);
    - streams (Connect, Subscribe, health Watch): at most `max_streams` open in all, and STREAMS_PER_NODE per
      certificate identity;
    - other calls (RegisterUsers, Submit, health checks): NODE_REQUESTS_IN_FLIGHT per identity (per connection in
      plain text);
    - a call whose first message has not come whole within `first_message_seconds` ends DEADLINE_EXCEEDED.
    Refusals are RESOURCE_EXHAUSTED with the limit in their details, counted by reason (refusals()) and by node
    (refused_nodes(), with the servicer's own: a node over the shuffler's capacity).

    Plain text has no identities: a connection is not one (in one process, every node's channel shares one), so
    streams are bounded only in all there. Runs on the server's event loop only: no lock.
    """

    def __init__(
        self,
        max_streams: int,
        first_message_seconds: float = FIRST_MESSAGE_SECONDS,
        revocations: tls.RevocationList | None = None,
    ) -> None:
        self._max_streams = int(max_streams)
        self._first_message_seconds = float(first_message_seconds)
        self._revocations = revocations
        self._open: Counter = Counter()  # (kind, caller) -> open calls; (kind, None) -> all of that kind
        self._refused: Counter = Counter()
        self._nodes: OrderedDict[str, dict[str, RefusedNode]] = OrderedDict()  # node -> reason -> refusal
        self._lock = threading.Lock()  # refusals are read from other threads (metrics, GetPopulation)

    def refusals(self) -> dict[str, int]:
        """Calls refused or cut since start, by reason."""
        with self._lock:
            return dict(self._refused)

    def refused_nodes(self) -> list[RefusedNode]:
        """The nodes refused lately and not connected since (at most REFUSED_NODES_KEPT), by node and reason, the
        node refused last at the end."""
        with self._lock:
            held = [r for reasons in self._nodes.values() for r in reasons.values()]
            return [RefusedNode(r.node, r.reason, r.details, r.calls) for r in held]

    def revoked(self, context: grpc.aio.ServicerContext) -> str | None:
        """Why the caller's certificate is revoked now, None if it is not: a stream opened before its revocation is
        checked again at each message it carries (the list is read again when its file changes: a stat per call)."""
        return None if self._revocations is None else self._revocations.refusal(context)

    def forget(self, node: str) -> None:
        """The node connected: its refusals are history (refused_nodes() lists the nodes still left out)."""
        with self._lock:
            self._nodes.pop(node, None)

    def note(self, node: str | None, reason: str, details: str) -> None:
        """Count a refusal, and by node when the caller is known."""
        with self._lock:
            self._refused[reason] += 1
            if node is None:
                return
            reasons = self._nodes.pop(node, None) or {}
            entry = reasons.setdefault(reason, RefusedNode(node, reason, details))
            entry.details, entry.calls = details, entry.calls + 1
            self._nodes[node] = reasons  # the newest last
            while len(self._nodes) > REFUSED_NODES_KEPT:
                self._nodes.popitem(last=False)

    async def _refuse(
        self, context: grpc.aio.ServicerContext, who: str | None, reason: str, code: grpc.StatusCode, details: str
    ) -> None:
        self.note(who, reason, details)
        await context.abort(code, tls.clip_details(details))

    @asynccontextmanager
    async def _slot(self, kind: str, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[str | None]:
        """Hold one of the caller's calls of `kind` while the block runs, which gets the caller's certificate name
        (None in plain text); refuse the call if it has none left."""
        ident = tls.peer_identity(context)
        who = ident.name if ident is not None else None
        if (revoked := self.revoked(context)) is not None:
            await self._refuse(context, who, "revoked", grpc.StatusCode.PERMISSION_DENIED, revoked)
        if kind == "analyzer":
            if ident is not None and ident.role != pki.ROLE_ANALYZER:
                details = f"{method}: role {ident.role!r} ({ident.name}) may not call this method; allowed: analyzer"
                await self._refuse(context, None, "not_analyzer", grpc.StatusCode.PERMISSION_DENIED, details)
            yield who
            return
        if ident is not None:
            caller = ident.name
        elif kind == "request":
            caller = f"peer:{context.peer()}"  # plain text: each connection (one per node process) its own budget
        else:
            caller = None  # plain-text streams: bounded in all only (class docstring)
        keys = [] if caller is None else [(kind, caller)]
        if kind == "stream":
            keys.append(("stream", None))  # all streams
        refusal = self._refusal(kind, caller)
        if refusal is not None:
            await self._refuse(context, who, refusal[0], grpc.StatusCode.RESOURCE_EXHAUSTED, refusal[1])
        for k in keys:
            self._open[k] += 1
        try:
            yield who
        finally:
            for k in keys:
                self._open[k] -= 1
                if not self._open[k]:
                    del self._open[k]

    def _refusal(self, kind: str, caller: str | None) -> tuple[str, str] | None:
        """(reason, details) if the caller may not open one more call of `kind` now, else None."""
        held = self._open[(kind, caller)] if caller is not None else 0
        if kind == "request" and held >= NODE_REQUESTS_IN_FLIGHT:
            return "node_requests", (
                f"{NODE_REQUESTS_IN_FLIGHT} requests of this node are in flight already; send one after another"
            )
        if kind != "stream":
            return None
        if held >= STREAMS_PER_NODE:
            return "node_streams", (
                f"node {caller!r} holds {held} streams already; at most {STREAMS_PER_NODE} per node identity (its "
                "stream and one replacing it)"
            )
        if (total := self._open[("stream", None)]) >= self._max_streams:
            return "streams", f"{total} streams are open at the shuffler; at most {self._max_streams}"
        return None

    async def _first(self, requests: Any, context: grpc.aio.ServicerContext, method: str, who: str | None) -> Any:
        """The call's first message (None if the caller sent none), ending the call if it takes too long."""
        try:
            return await asyncio.wait_for(anext(requests, None), self._first_message_seconds)
        except TimeoutError:
            details = f"{method}: no request within {self._first_message_seconds:g} s of the call's opening"
            await self._refuse(context, who, "first_message_deadline", grpc.StatusCode.DEADLINE_EXCEEDED, details)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        kind = "analyzer" if method in _ANALYZER_METHODS else "stream" if handler.response_streaming else "request"
        unary = not handler.request_streaming

        async def start(requests: Any, context: grpc.aio.ServicerContext, who: str | None) -> Any:
            first = await self._first(requests, context, method, who)
            if not unary:
                return behaviour(_chain(first, requests), context)
            if first is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the call carried no request message")
            return behaviour(first, context)

        if handler.response_streaming:

            async def limited_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async with self._slot(kind, method, context) as who:  # held while the stream runs
                    async for response in tls.aio_responses(await start(requests, context, who)):
                        yield response

            behaviour_out = limited_stream
        else:

            async def limited(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async with self._slot(kind, method, context) as who:
                    return await (await start(requests, context, who))

            behaviour_out = limited
        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(behaviour_out, **kw)
        return grpc.stream_unary_rpc_method_handler(behaviour_out, **kw)


async def _chain(first: Any, rest: Any) -> AsyncIterator[Any]:
    if first is None:
        return
    yield first
    async for item in rest:
        yield item
