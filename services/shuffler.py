"""Shuffler gRPC service: a thin proto <-> domain layer over services/shuffler_state.py (design 1, 5), on grpc.aio,
behind services/shuffler_limits.py's interceptor (what one caller can hold).

One event loop, on a thread of its own, serves every connection (issue 44 item 1: 10^4 device nodes at once, each a
coroutine and its socket, not a thread). Nothing long runs on it: a node's message above INLINE_BYTES (decoding and
checking it), its registration and its subscription run on a bounded thread pool (NODE_WORKERS), the analyzer's calls
on a pool of their own (ANALYZER_WORKERS: ExecuteRound blocks for the whole round); a small message (a device's
report, a check-in) is handled on the loop, where two thread hand-overs would cost more than its work. What the state
queues for a node (an invitation, a SubmitResult) reaches the loop through one hand-over per burst (_Outbox), not one
wake-up per node.

Domain errors map to status codes from one table (_STATUS). Whole-contribution rejections (wrong or expired
round) end the Submit call with FAILED_PRECONDITION, details "<reason>: ..." and trailing metadata
``shuffledp-reason``; per-message rejections come back in ContributionAck.rejected (reason -> count).

A node holds one of two kinds of stream: Subscribe (invitations only; it answers each with unary Submits) or Connect
(bidirectional: invitations, and its contributions with their SubmitResults, on one stream; issue 30). A contribution
that comes over Connect goes through the very function Submit calls (_accept), and its SubmitResult carries what
Submit would have answered: the ack, or the status, details and reason Submit would have ended with.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from shuffledp.services.shuffler_admission import CLOSED
from shuffledp.services.shuffler_limits import (
    FIRST_MESSAGE_SECONDS,
    SERVICE,
    STREAMS_PER_NODE,
    CallLimits,
    RefusedNode,
)
from shuffledp.services.shuffler_state import (
    BatchResult,
    CallerGone,
    CohortUnavailable,
    Invite,
    QuotaExceeded,
    RoundExistsError,
    RoundRejected,
    RoundRequest,
    Schedule,
    ShufflerState,
    SqliteParticipationStore,
    Submission,
    Subscription,
    Transport,
    TreeLimits,
    UserColumns,
    UserMessage,
)

from shuffledp.security import pki
from shuffledp.transport import grpc_options, tls
from shuffledp.transport.health import start_with_health_aio
from shuffledp.transport.spec_signing import second_spec
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = [
    "ShufflerServicer",
    "ShufflerServer",
    "serve_shuffler",
    "start_shuffler",
    "REASON_METADATA_KEY",
    "DEFAULT_MAX_NODES",
    "CallLimits",
    "RefusedNode",
]

log = logging.getLogger(__name__)

REASON_METADATA_KEY = "shuffledp-reason"
DEFAULT_MAX_NODES = grpc_options.DEFAULT_MAX_NODES
NODE_WORKERS = 4  # threads for the nodes' calls into the state and for decoding their messages (CPU-bound: 2 cores)
# A node's message up to this size is decoded and checked on the event loop (~1 ms or less), larger ones on the pool
INLINE_BYTES = 256 * 1024
ANALYZER_WORKERS = 16  # threads of the analyzer's calls (ExecuteRound, GetPopulation) alone: nodes never get them
REFUSED_NODES_REPORTED = 100  # of the refused nodes CallLimits keeps, in PopulationStatus.refused_nodes


# one table: domain exception -> status code (first match wins, subclasses first)
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (RoundRejected, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (RoundExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (CohortUnavailable, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CallerGone, grpc.StatusCode.CANCELLED),
    (QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def _status(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a domain exception (_STATUS), None if it is not one."""
    return next((code for cls, code in _STATUS if isinstance(exc, cls)), None)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, round_refused: bool = False) -> None:
    code = _status(exc)
    if code is None:
        raise exc
    metadata: tuple[tuple[str, str], ...] = ()
    if isinstance(exc, RoundRejected):
        metadata = ((REASON_METADATA_KEY, exc.reason.value),)
    elif round_refused:
        metadata = ((grpc_options.ROUND_REFUSED_METADATA_KEY, code.name),)
    await context.abort(code, tls.clip_details(str(exc)), trailing_metadata=metadata)


def _node_id(claimed: str, ident: pki.Identity | None) -> str:
    """The calling node's identity (issue 10 item 1): with mTLS the name in its verified certificate, and a
    node_id field that names another node is refused (PermissionError). Plain text has no identities (loopback
    only, tls)."""
    if ident is None:
        return claimed
    if ident.role != pki.ROLE_CLIENT_NODE:
        raise PermissionError(f"role {ident.role!r} is not a client node")
    if claimed and claimed != ident.name:
        raise PermissionError(
            f"node_id {claimed!r} is not the caller's certificate name {ident.name!r}: nodes speak for themselves"
        )
    return ident.name


@dataclass(frozen=True)
class _Relay:
    """What the invited nodes get of a round's spec: the analyzer's signed bytes as they came (mTLS), else the spec
    itself; and in a check-in's second invitation the number of users who checked in."""

    spec: pb.RoundSpec | None
    signed: pb.SignedSpec | None
    checked_in: int = 0


def _request(wire: pb.RoundSpec) -> RoundRequest:
    """The round the analyzer asks for. A signed spec (RoundSpec.signed) is planned from its signed bytes, the very
    spec the nodes will act on, and forwarded as it came (shuffledp.transport.spec_signing)."""
    signed = wire.signed if wire.HasField("signed") else None
    verify_key = bytes(wire.verify_key)
    spec = wire
    if signed is None and verify_key:  # the spec itself is relayed: without the key
        spec = pb.RoundSpec()
        spec.CopyFrom(wire)
        spec.ClearField("verify_key")
    if signed is not None:
        try:
            spec = pb.RoundSpec.FromString(signed.spec)
        except Exception as exc:  # DecodeError
            raise ValueError(f"the signed spec is not a RoundSpec: {exc}") from None
        if spec.HasField("signed"):
            raise ValueError("the signed spec carries another signed spec")
    if spec.verify_key:
        # PRIO3's key travels beside the signed spec, never in what the nodes get (draft-18 sec 9.1)
        raise ValueError("verify_key belongs in ExecuteRound's request, outside the spec the nodes act on")
    r = spec.randomizer
    try:
        schedule, transport = Schedule(spec.schedule), Transport(spec.transport)
    except ValueError as exc:
        raise ValueError(f"unknown schedule/transport value: {exc}") from exc

    def second(c: int, c_min: int, m: int) -> _Relay:
        if signed is not None:  # each node derives c_min and m from c and the signed check-in itself
            return _Relay(None, signed, c)
        return _Relay(second_spec(spec, c), None, c)

    return RoundRequest(
        run_id=spec.run_id,
        round=spec.round,
        schedule=schedule,
        transport=transport,
        dim=r.dim,
        g=r.g,
        m=r.m,
        messages_per_user=r.messages_per_user,
        message_bytes=r.message_bytes,
        cohort_size=spec.cohort_size,
        min_contributors=spec.min_contributors,
        deadline_seconds=spec.deadline_seconds,
        analyzer_public_key=spec.analyzer_public_key,
        limits=_limits(spec.participation) if spec.HasField("participation") else None,
        check_in_trials=spec.check_in.noise_trials,
        check_in_fraction=spec.check_in.report_fraction,
        sampling_rate=spec.sampling_rate,
        population=spec.population,
        report_goal=spec.report_goal,
        verify_key=verify_key,
        prio3_vdaf=spec.prio3.vdaf,
        relay=_Relay(None if signed is not None else spec, signed),
        second_relay=second,
    )


def _limits(p: pb.ParticipationLimit) -> TreeLimits:
    return TreeLimits(int(p.max_per_tree), int(p.min_separation), int(p.rounds_per_tree))


def _submission(c: pb.Contribution, node_id: str) -> Submission:
    msgs = []
    for m in c.messages:
        kind = m.WhichOneof("payload")
        counts = packed = cts = None
        if kind == "counts":
            # CountVector: packed bytes go to the state as they are (decoded and validated there in one pass per
            # contribution); the repeated field is decoded here. Neither set = the legacy empty vector.
            packed = m.counts.packed or None
            if m.counts.counts or packed is None:
                counts = np.fromiter(m.counts.counts, dtype=np.uint64, count=len(m.counts.counts))
        elif kind == "sealed":
            cts = list(m.sealed.ciphertexts)
        msgs.append(UserMessage(user_id=m.user_id, nonce=m.nonce, counts=counts, ciphertexts=cts, counts_packed=packed))
    cols = None
    if c.HasField("columns"):
        k = c.columns
        # the ids as the message holds them (a str is made per id when read, not a list of them all)
        reports = [(r.report_id, r.public_share, r.leader_share, r.helper_share) for r in k.reports]
        cols = UserColumns(k.user_ids, k.nonces, k.nonce_bytes, k.counts, k.sums, k.sum_users, reports)
    return Submission(
        run_id=c.run_id,
        round=c.round,
        node_id=node_id,
        messages=msgs,
        refusals=[(r.user_id, r.reason) for r in c.refusals],
        columns=cols,
    )


def _invitation(invite: Invite) -> pb.Invitation:
    relay: _Relay = invite.relay
    return pb.Invitation(
        spec=relay.spec,
        signed_spec=relay.signed,
        checked_in=relay.checked_in,
        user_ids=invite.user_ids,
        eligible=invite.eligible,
    )


def _batch(b: BatchResult) -> pb.ShuffledBatch:
    report = pb.BatchReport(
        invited=b.invited,
        contributors=b.contributors,
        rejected=b.rejected,
        refused=b.refused,
        below_threshold=b.below_threshold,
        refused_reasons=b.refused_reasons,
        not_in_run=b.not_in_run,
        checked_in=b.checked_in,
        eligible=b.eligible,
        excluded_silent=b.excluded_silent,
    )
    out = pb.ShuffledBatch(run_id=b.run_id, round=b.round, released=b.released, report=report)
    if b.released:
        if b.label_totals is not None:
            out.label_totals.extend(b.label_totals.tolist())
        out.ciphertexts.extend(b.ciphertexts)
        out.reports.extend(p.for_helper() for p in b.reports)
    return out


def _stream_node(claimed: str, stream_node: str) -> str:
    """The node a contribution on a Connect stream speaks for: the stream's own (whose identity _node_id checked
    when it subscribed); a node_id naming another node is refused, as Submit refuses it under mTLS."""
    if claimed and claimed != stream_node:
        raise PermissionError(
            f"node_id {claimed!r} is not this stream's node {stream_node!r}: nodes speak for themselves"
        )
    return stream_node


class _Outbox:
    """Hands what the state queues for nodes (from its threads) to the event loop: one wake-up of the loop per burst
    (an invitation to 10^4 nodes is one call_soon_threadsafe, not 10^4)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()  # made on the loop (serve_shuffler's start)
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []

    def push(self, q: asyncio.Queue, item: Any) -> None:
        if threading.get_ident() == self._loop_thread:
            # on the loop already (a small contribution's result): no wake-up, after what other threads queued
            self._flush()
            q.put_nowait(item)
            return
        with self._lock:
            first = not self._pending
            self._pending.append((q, item))
        if first:
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed: the server stopped, nobody reads the queue any more
                pass

    def _flush(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for q, item in items:
            q.put_nowait(item)


class _LoopSubscription(Subscription):
    """A node's stream whose items (Invites, SubmitResults) its coroutine awaits on the event loop."""

    def __init__(self, node_id: str, outbox: _Outbox) -> None:  # no super().__init__: its thread queue is unused
        self.node_id = node_id
        self.closed = False
        self._outbox = outbox
        self._items: asyncio.Queue = asyncio.Queue()
        self.revoked: str | None = None  # why the stream ended: its node's certificate was revoked meanwhile

    def put(self, item: Any) -> None:
        self._outbox.push(self._items, item)

    def close(self) -> None:
        self.closed = True
        self._outbox.push(self._items, CLOSED)

    def get(self, timeout: float) -> Any:
        raise TypeError("a stream on the event loop is read with `await next_item()`")

    async def next_item(self) -> Any:
        """The next item; EOFError once closed."""
        item = await self._items.get()
        if item is CLOSED:
            raise EOFError(f"subscription of node {self.node_id!r} closed")
        return item


_SUBSCRIBED = ((grpc_options.SUBSCRIBED_METADATA_KEY, "1"),)


def _decode(cls: type, raw: bytes, what: str) -> Any:
    """A node's request decoded (on a worker thread: a contribution can be 64 MiB); ValueError if it is not one."""
    try:
        return cls.FromString(raw)
    except Exception:  # DecodeError: the caller's malformed request, never an internal error
        raise ValueError(f"{what}: the request is not a valid message") from None


class ShufflerServicer:
    """The Shuffler service's methods, as grpc.aio coroutines over raw request bytes (decoded off the loop)."""

    def __init__(
        self,
        state: ShufflerState,
        limits: CallLimits,
        outbox: _Outbox,
        nodes: futures.ThreadPoolExecutor,
        analyzer: futures.ThreadPoolExecutor,
    ) -> None:
        self.state = state
        self._limits = limits
        self._outbox = outbox
        self._nodes = nodes
        self._analyzer = analyzer

    async def _on(self, pool: futures.Executor, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _on_or_here(self, raw: bytes, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) for a node's message `raw`: on the loop itself if it is small (a device's report, a check-in:
        two thread hand-overs cost more than its work), else on the nodes' pool (decoding and checking 64 MiB would
        hold every connection)."""
        if len(raw) <= INLINE_BYTES:
            return fn(*args)
        return await self._on(self._nodes, fn, *args)

    async def ExecuteRound(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        gone = threading.Event()  # the analyzer's call ended: execute_round stops collecting, releases nothing
        context.add_done_callback(lambda _: gone.set())
        try:
            return await self._on(self._analyzer, self._execute, raw, gone)
        except asyncio.CancelledError:
            gone.set()
            raise
        except (ValueError, NotImplementedError, RoundExistsError, CohortUnavailable, CallerGone) as exc:
            # raised before anyone was selected or invited (ShufflerState.execute_round): no batch exists
            await _abort(context, exc, round_refused=True)

    def _execute(self, raw: bytes, gone: threading.Event) -> bytes:
        request = _request(_decode(pb.RoundSpec, raw, "ExecuteRound"))
        return _batch(self.state.execute_round(request, is_active=lambda: not gone.is_set())).SerializeToString()

    async def FinishAggregation(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = _decode(pb.AggregationRequest, raw, "FinishAggregation")
            return await self._on(self._analyzer, self._finish_aggregation, request)
        except (ValueError, RoundRejected) as exc:
            await _abort(context, exc)

    def _finish_aggregation(self, request: pb.AggregationRequest) -> bytes:
        preps = [(p.report_id, p.prep_share) for p in request.preps]
        a = self.state.finish_aggregation(request.run_id, request.round, preps)
        return pb.LeaderAggregate(
            released=a.released,
            aggregate_share=a.aggregate_share,
            reports=a.reports,
            contributors=a.contributors,
            rejected=a.rejected,
        ).SerializeToString()

    async def GetPopulation(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = _decode(pb.PopulationRequest, raw, "GetPopulation")
        except ValueError as exc:
            await _abort(context, exc)
        p = await self._on(self._analyzer, self.state.population, request.run_id)
        refused = self._limits.refused_nodes()[-REFUSED_NODES_REPORTED:]
        return pb.PopulationStatus(
            admitted_users=p.admitted_users,
            unused_users=p.unused_users,
            connected_nodes=p.connected_nodes,
            refused_nodes=[
                pb.RefusedNode(node=r.node, reason=r.reason, details=r.details, calls=r.calls) for r in refused
            ],
        ).SerializeToString()

    async def RegisterUsers(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await self._on(self._nodes, self._register, raw, tls.peer_identity(context))
        except (ValueError, QuotaExceeded, PermissionError) as exc:
            await _abort(context, exc)

    def _register(self, raw: bytes, caller: pki.Identity | None) -> bytes:
        request = _decode(pb.RegisterUsersRequest, raw, "RegisterUsers")
        node = _node_id(request.node_id, caller)
        admitted, total = self.state.register_users(node, list(request.user_ids))
        return pb.RegisterUsersResponse(admitted=admitted, total_users=total).SerializeToString()

    async def _subscribe(self, node_id: str, context: grpc.aio.ServicerContext) -> _LoopSubscription:
        try:
            node = _node_id(node_id, tls.peer_identity(context))
            sub = await self._on(self._nodes, self.state.subscribe, node, self._subscription)
            self._limits.forget(node)
            return sub
        except QuotaExceeded as exc:  # over the shuffler's capacity: reported by node (the run's output, metrics)
            self._limits.note(node, "capacity", str(exc))
            await _abort(context, exc)
        except (ValueError, PermissionError) as exc:
            await _abort(context, exc)

    def _subscription(self, node_id: str) -> _LoopSubscription:
        return _LoopSubscription(node_id, self._outbox)

    async def _queued(self, sub: _LoopSubscription) -> AsyncIterator[Any]:
        """What the state queued for the node (Invites, and on Connect SubmitResults) until its stream ends (the
        node gone: gRPC cancels this coroutine)."""
        try:
            while True:
                try:
                    yield await sub.next_item()
                except EOFError:
                    return
        finally:
            try:
                self._nodes.submit(self.state.unsubscribe, sub)  # not awaited: the coroutine may be cancelled
            except RuntimeError:  # the server is stopping (its pool shut down): nobody will be invited any more
                self.state.unsubscribe(sub)

    async def Subscribe(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Invitation]:
        try:
            request = _decode(pb.SubscribeRequest, raw, "Subscribe")
        except ValueError as exc:
            await _abort(context, exc)
        sub = await self._subscribe(request.node_id, context)
        await context.send_initial_metadata(_SUBSCRIBED)
        queued = self._queued(sub)
        try:
            async for invite in queued:
                if self._cut_if_revoked(sub, context):
                    break
                yield _invitation(invite)
        finally:
            await queued.aclose()
        await self._end_if_revoked(sub, context)

    def _accept(self, request: pb.Contribution, node: str) -> pb.ContributionAck:
        """Validate and aggregate one contribution of `node` (design 5.3): the one path of Submit and Connect.
        Raises the state's domain errors (RoundRejected, ValueError)."""
        ack = self.state.submit(_submission(request, node))
        return pb.ContributionAck(accepted=ack.accepted, rejected=ack.rejected)

    async def Submit(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await self._on_or_here(raw, self._submit, raw, tls.peer_identity(context))
        except (RoundRejected, ValueError, PermissionError) as exc:
            await _abort(context, exc)

    def _submit(self, raw: bytes, caller: pki.Identity | None) -> bytes:
        request = _decode(pb.Contribution, raw, "Submit")
        return self._accept(request, _node_id(request.node_id, caller)).SerializeToString()

    async def Connect(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ShufflerMessage]:
        """The node's one stream (issue 30): `subscribe` first, then contributions, each answered by a SubmitResult
        in order; invitations go out on the same stream. The contributions are read by a task of the stream's own,
        so that an invitation never waits for a contribution or the other way round."""
        first_raw = await anext(requests, None)
        if first_raw is None:
            return
        try:
            first = _decode(pb.NodeMessage, first_raw, "Connect")
        except ValueError as exc:
            await _abort(context, exc)
        if first.WhichOneof("kind") != "subscribe":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Connect stream starts with `subscribe`")
        sub = await self._subscribe(first.subscribe.node_id, context)
        await context.send_initial_metadata(_SUBSCRIBED)
        reader = asyncio.create_task(self._read(requests, sub, context))
        queued = self._queued(sub)
        try:
            async for item in queued:
                if isinstance(item, pb.SubmitResult):
                    yield pb.ShufflerMessage(result=item)
                elif self._cut_if_revoked(sub, context):
                    break
                else:
                    yield pb.ShufflerMessage(invitation=_invitation(item))
        finally:
            reader.cancel()
            await queued.aclose()
        await self._end_if_revoked(sub, context)

    def _cut_if_revoked(self, sub: _LoopSubscription, context: grpc.aio.ServicerContext) -> bool:
        """Whether the node's certificate was revoked since its stream opened (then the stream ends: no invitation
        reaches it, nothing it sends is used)."""
        if sub.revoked is None:
            sub.revoked = self._limits.revoked(context)
        return sub.revoked is not None

    async def _end_if_revoked(self, sub: _LoopSubscription, context: grpc.aio.ServicerContext) -> None:
        if sub.revoked is not None:
            self._limits.note(sub.node_id, "revoked", sub.revoked)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, tls.clip_details(sub.revoked))

    async def _read(self, requests: Any, sub: _LoopSubscription, context: grpc.aio.ServicerContext) -> None:
        """Connect's reader: each contribution through _accept (on a worker thread), its result queued behind what
        is queued already. The stream ends when the node stops sending (nothing it sends after could be
        answered), or once its certificate is revoked (what it sent then is not used)."""
        try:
            async for raw in requests:
                if self._cut_if_revoked(sub, context):
                    return
                # anything but a domain error is a bug: it is not hidden
                sub.put(await self._on_or_here(raw, self._result, raw, sub.node_id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the RPC ended (cancelled, broken)
            log.debug("Connect stream of node %s ended: %r", sub.node_id, exc)
        finally:
            sub.close()

    def _result(self, raw: bytes, node: str) -> pb.SubmitResult:
        try:
            msg = _decode(pb.NodeMessage, raw, "Connect")
        except ValueError as exc:
            return pb.SubmitResult(status=grpc.StatusCode.INVALID_ARGUMENT.name, details=str(exc))
        out = pb.SubmitResult(seq=msg.seq)
        if msg.WhichOneof("kind") != "contribution":
            out.status, out.details = grpc.StatusCode.INVALID_ARGUMENT.name, "after `subscribe`, only contributions"
            return out
        try:
            out.ack.CopyFrom(self._accept(msg.contribution, _stream_node(msg.contribution.node_id, node)))
        except (RoundRejected, ValueError, PermissionError) as exc:
            out.status, out.details = _status(exc).name, tls.clip_details(str(exc))
            if isinstance(exc, RoundRejected):
                out.reason = exc.reason.value
        return out


def _handlers(servicer: ShufflerServicer) -> grpc.GenericRpcHandler:
    """The Shuffler service's methods, taking raw request bytes (decoded on a worker thread after the role check);
    unary answers are serialized there too, streams' messages here (small: invitations, results)."""
    raw: dict[str, Any] = {"request_deserializer": None, "response_serializer": None}
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "ExecuteRound": grpc.unary_unary_rpc_method_handler(servicer.ExecuteRound, **raw),
            "GetPopulation": grpc.unary_unary_rpc_method_handler(servicer.GetPopulation, **raw),
            "FinishAggregation": grpc.unary_unary_rpc_method_handler(servicer.FinishAggregation, **raw),
            "RegisterUsers": grpc.unary_unary_rpc_method_handler(servicer.RegisterUsers, **raw),
            "Submit": grpc.unary_unary_rpc_method_handler(servicer.Submit, **raw),
            "Subscribe": grpc.unary_stream_rpc_method_handler(
                servicer.Subscribe, request_deserializer=None, response_serializer=pb.Invitation.SerializeToString
            ),
            "Connect": grpc.stream_stream_rpc_method_handler(
                servicer.Connect, request_deserializer=None, response_serializer=pb.ShufflerMessage.SerializeToString
            ),
        },
    )


class ShufflerServer:
    """A running shuffler: its grpc.aio server on an event loop of its own thread, with grpc.Server's stop() and
    wait_for_termination(). `shuffler_state` and `call_limits` are there for in-process inspection (tests,
    benchmarks, metrics)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread, pools: list[futures.Executor]):
        self._loop, self._thread, self._pools = loop, thread, pools
        self._server: grpc.aio.Server | None = None
        self._stopped = threading.Event()
        self.shuffler_state: ShufflerState | None = None
        self.call_limits: CallLimits | None = None

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving (calls in flight get `grace` seconds); the event is set once everything is released."""
        if self._loop.is_running() and not self._stopped.is_set():

            async def stop() -> None:
                if self._server is not None:
                    await self._server.stop(grace)

            future = asyncio.run_coroutine_threadsafe(stop(), self._loop)
            future.add_done_callback(lambda _: self._shutdown())
        elif not self._stopped.is_set():
            self._shutdown()
        return self._stopped

    def _shutdown(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._stopped.set()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True once stopped, False if `timeout` passed first."""
        return not self._stopped.wait(timeout)


def _loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return loop, thread


def serve_shuffler(
    state: ShufflerState,
    listen: str,
    server_credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_nodes: int = DEFAULT_MAX_NODES,
    first_message_seconds: float = FIRST_MESSAGE_SECONDS,
    revocations: tls.RevocationList | None = None,
    max_receive: int = grpc_options.CLIENT_MESSAGE_BYTES,
) -> tuple[ShufflerServer, int]:
    """Start a Shuffler server over an existing state; returns (started server, bound port). `max_nodes`: nodes
    connected at once (over it: RESOURCE_EXHAUSTED, reported by node); `interceptors`: grpc.aio ones (tls's .aio());
    `revocations`: the PKI's revocation list (a call with a revoked certificate is refused when it opens);
    `max_receive`: the largest request in bytes."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    state.set_max_streams(max_nodes)
    nodes = futures.ThreadPoolExecutor(max_workers=NODE_WORKERS, thread_name_prefix="shuffler-nodes")
    analyzer = futures.ThreadPoolExecutor(max_workers=ANALYZER_WORKERS, thread_name_prefix="shuffler-analyzer")
    loop, thread = _loop_thread("shuffler-loop")
    out = ShufflerServer(loop, thread, [nodes, analyzer])
    # streams in all: each node's, one replacing it, health watches; the state bounds the nodes (max_nodes)
    limits = CallLimits(STREAMS_PER_NODE * max_nodes + 16, first_message_seconds, revocations)

    async def start() -> int:
        server = grpc.aio.server(
            interceptors=[limits, *interceptors],  # first: counts each call when it opens, before anything is read
            options=grpc_options.server_options(max_receive=max_receive),
        )
        servicer = ShufflerServicer(state, limits, _Outbox(asyncio.get_running_loop()), nodes, analyzer)
        server.add_generic_rpc_handlers((_handlers(servicer),))
        out._server = server
        # with the standard gRPC health protocol: compose healthchecks and `shuffledp health` ask for it
        port, _ = await start_with_health_aio(server, listen, server_credentials, SERVICE)
        return port

    try:
        port = out._call(start(), timeout=30)
    except BaseException:
        out.stop(None)
        raise
    out.shuffler_state, out.call_limits = state, limits
    return out, port


def start_shuffler(
    listen: str,
    state_path: Path | None = None,
    server_credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    clock: Callable[[], float] = time.monotonic,
    rng: np.random.Generator | None = None,
    revocations: tls.RevocationList | None = None,
    max_nodes: int = DEFAULT_MAX_NODES,
) -> tuple[ShufflerServer, int]:
    """The shuffler entry point (issue 4 contract): participation record in SQLite at state_path if given; rng
    (cohorts, Poisson draws, permutations) defaults to a fresh CSPRNG (a seeded one exists only in testing mode)."""
    store = SqliteParticipationStore(state_path) if state_path is not None else None
    state = ShufflerState(store, clock=clock, rng=rng)
    server, port = serve_shuffler(
        state, listen, server_credentials, interceptors, max_nodes=max_nodes, revocations=revocations
    )
    log.info(
        "shuffler listening on port %d (capacity %d nodes; participation record: %s)",
        port,
        max_nodes,
        state_path or "memory",
    )
    return server, port
