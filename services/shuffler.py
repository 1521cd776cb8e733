"""Shuffler gRPC service: a thin proto <-> domain layer over services/shuffler_state.py (design 1, 5).

Domain errors map to status codes from one table (_STATUS). Whole-contribution rejections (wrong or expired
round) end the Submit call with FAILED_PRECONDITION, details "<reason>: ..." and trailing metadata
``shuffledp-reason``; per-message rejections come back in ContributionAck.rejected (reason -> count).

A node holds one of two kinds of stream: Subscribe (invitations only; it answers each with unary Submits) or Connect
(bidirectional: invitations, and its contributions with their SubmitResults, on one stream; issue 30). A contribution
that comes over Connect goes through the very function Submit calls (_accept), and its SubmitResult carries what
Submit would have answered: the ack, or the status, details and reason Submit would have ended with.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
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

from shuffledp import grpc_options, pki, tls
from shuffledp.health import start_with_health
from shuffledp.spec_signing import second_spec
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

__all__ = [
    "ShufflerServicer",
    "serve_shuffler",
    "start_shuffler",
    "REASON_METADATA_KEY",
    "RESERVED_WORKERS",
    "ANALYZER_WORKERS",
    "CallLimits",
]

log = logging.getLogger(__name__)

REASON_METADATA_KEY = "shuffledp-reason"
# Every call holds a server thread from the moment it opens (gRPC's threaded server reads even a unary request in
# the thread), so what one caller may hold is counted when its call opens, before its first message is read, and
# a call whose first message does not come within FIRST_MESSAGE_SECONDS is cancelled (issue 43 item 3: one client
# certificate held every thread with 70 Connect streams that never sent a message). CallLimits enforces it all.
RESERVED_WORKERS = 16  # nodes' server threads never taken by streams: registrations, submissions, health checks
ANALYZER_WORKERS = 16  # threads of the analyzer's calls (ExecuteRound, GetPopulation) alone: nodes never get them
STREAMS_PER_NODE = 2  # a node's invitation stream, and the one that replaces it when the node reconnects
# Requests a node may have in flight at once (RegisterUsers and Submit: a node sends its Submits one after another).
# Each can be up to 64 MiB and ~10x that once decoded, so this, not the thread pool, bounds what one node identity
# can make the shuffler hold (issue 10). Plain text (loopback) has no identities: the budget is per connection.
NODE_REQUESTS_IN_FLIGHT = 2
# From a call's opening to its first message received whole: a RegisterUsers of 2^20 ids (~30 MiB) needs 1 MB/s
FIRST_MESSAGE_SECONDS = 30.0
_ANALYZER_METHODS = frozenset(
    m
    for m, roles in tls.DEFAULT_POLICY.items()
    if m.startswith("/shuffledp.v1.Shuffler/") and roles == {pki.ROLE_ANALYZER}
)


class _FirstMessageDeadlines:
    """Cancels each armed call that is still waiting for its first message `seconds` after it was armed. One thread
    for all calls, running while any is armed (every call waits the same time, so arrival order is deadline order)."""

    def __init__(self, seconds: float, on_expired: Callable[[], None]) -> None:
        self.seconds = float(seconds)
        self._on_expired = on_expired
        self._cv = threading.Condition()
        self._due: deque[tuple[float, int]] = deque()
        self._armed: dict[int, grpc.ServicerContext] = {}
        self._tokens = itertools.count()
        self._running = False

    def arm(self, context: grpc.ServicerContext) -> int:
        with self._cv:
            token = next(self._tokens)
            self._armed[token] = context
            self._due.append((time.monotonic() + self.seconds, token))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="shuffler-first-message", daemon=True).start()
            return token

    def disarm(self, token: int) -> None:
        with self._cv:
            self._armed.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if not self._due:
                        self._running = False
                        return
                    due, token = self._due[0]
                    if token not in self._armed:  # its call had its first message: dropped without waiting for it
                        self._due.popleft()
                        continue
                    if (left := due - time.monotonic()) > 0:
                        self._cv.wait(left)
                        continue
                    self._due.popleft()
                    context = self._armed.pop(token, None)
                    if context is not None:
                        break
            # the caller sees CANCELLED: gRPC's threaded server offers no other status from outside the call's thread
            context.cancel()
            self._on_expired()


class CallLimits(grpc.ServerInterceptor):
    """What one caller can hold of the shuffler's threads, counted when its call opens, before its first message is
    read (issue 43 item 3). Install it first: it turns every request-unary method into a request-streaming one, so
    that gRPC calls it as soon as the call opens instead of after reading the request in a server thread.

    - the analyzer's methods (ExecuteRound, GetPopulation) run on their own thread pool; a caller with a certificate
      of another role is refused at once (PERMISSION_DENIED), so no node ever holds one of those threads;
    - streams (Connect, Subscribe): at most `max_streams` open in all, and STREAMS_PER_NODE per certificate identity;
    - other calls (RegisterUsers, Submit, health checks): NODE_REQUESTS_IN_FLIGHT per identity (per connection in
      plain text);
    - a call whose first message has not come whole within `first_message_seconds` is cancelled.
    Refusals are RESOURCE_EXHAUSTED with the limit in their details, counted by reason (refusals()).

    Plain text has no identities: a connection is not one (in one process, every node's channel shares one), so
    streams are bounded only in all there, and one local process can hold all of them (for `first_message_seconds`
    at a time if it sends nothing); the analyzer's threads, shared by every plain-text caller of its methods, and
    the deadline still hold.
    """

    def __init__(
        self,
        max_streams: int,
        analyzer_pool: futures.ThreadPoolExecutor | None = None,
        first_message_seconds: float = FIRST_MESSAGE_SECONDS,
        revocations: tls.RevocationList | None = None,
    ) -> None:
        self._max_streams = int(max_streams)
        self._revocations = revocations
        self._analyzer_pool = analyzer_pool
        self._lock = threading.Lock()
        self._open: Counter = Counter()  # (kind, caller) -> open calls; (kind, None) -> all of that kind
        self._refused: Counter = Counter()
        self._deadlines = _FirstMessageDeadlines(first_message_seconds, lambda: self._count("first_message_deadline"))

    def refusals(self) -> dict[str, int]:
        """Calls refused or cancelled since start, by reason."""
        with self._lock:
            return dict(self._refused)

    def _count(self, reason: str) -> None:
        with self._lock:
            self._refused[reason] += 1

    def _refuse(self, context: grpc.ServicerContext, reason: str, code: grpc.StatusCode, details: str) -> None:
        self._count(reason)
        context.abort(code, details)

    @contextmanager
    def _slot(self, kind: str, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Hold one of the caller's calls of `kind` while the block runs; refuse the call if it has none left."""
        if self._revocations is not None and (revoked := self._revocations.refusal(context)) is not None:
            self._refuse(context, "revoked", grpc.StatusCode.PERMISSION_DENIED, revoked)  # before any quota is held
        ident = tls.peer_identity(context)
        if kind == "analyzer":
            if ident is not None and ident.role != pki.ROLE_ANALYZER:
                details = f"{method}: role {ident.role!r} ({ident.name}) may not call this method; allowed: analyzer"
                self._refuse(context, "not_analyzer", grpc.StatusCode.PERMISSION_DENIED, details)
            yield
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
        with self._lock:
            refusal = self._refusal(kind, caller)
            if refusal is None:
                for k in keys:
                    self._open[k] += 1
        if refusal is not None:
            self._refuse(context, refusal[0], grpc.StatusCode.RESOURCE_EXHAUSTED, refusal[1])
        try:
            yield
        finally:
            with self._lock:
                for k in keys:
                    self._open[k] -= 1
                    if not self._open[k]:
                        del self._open[k]

    def _refusal(self, kind: str, caller: str | None) -> tuple[str, str] | None:
        """(reason, details) if the caller may not open one more call of `kind` now, else None. Caller holds the
        lock."""
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
            return "streams", f"{total} streams are open at the shuffler; at most {self._max_streams} (a thread each)"
        return None

    def _first(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """The call's first message (None if the caller sent none), cancelling the call if it takes too long."""
        token = self._deadlines.arm(context)
        try:
            return next(requests, None)
        finally:
            self._deadlines.disarm(token)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        kind = "analyzer" if method in _ANALYZER_METHODS else "stream" if handler.response_streaming else "request"
        unary = not handler.request_streaming

        def call(requests: Iterator[Any], context: grpc.ServicerContext, rest: tuple) -> Any:
            first = self._first(requests, context)
            if not unary:
                return behaviour(itertools.chain(() if first is None else (first,), requests), context, *rest)
            if first is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the call carried no request message")
            return behaviour(first, context, *rest)

        # rest: the response callback gRPC passes to a non-blocking behaviour (health Watch), which returns at once
        if handler.response_streaming and not getattr(behaviour, "experimental_non_blocking", False):

            def limited(requests: Iterator[Any], context: grpc.ServicerContext, *rest: Any) -> Iterator[Any]:
                with self._slot(kind, method, context):  # held while the stream runs: it holds its thread
                    yield from call(requests, context, rest)

        else:

            def limited(requests: Iterator[Any], context: grpc.ServicerContext, *rest: Any) -> Any:
                with self._slot(kind, method, context):
                    return call(requests, context, rest)

        for attr in ("experimental_non_blocking", "experimental_thread_pool"):
            if hasattr(behaviour, attr):
                setattr(limited, attr, getattr(behaviour, attr))
        if kind == "analyzer" and self._analyzer_pool is not None:
            limited.experimental_thread_pool = self._analyzer_pool  # gRPC runs the call on this pool
        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(limited, **kw)
        return grpc.stream_unary_rpc_method_handler(limited, **kw)


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


def _abort(context: grpc.ServicerContext, exc: BaseException, round_refused: bool = False) -> None:
    code = _status(exc)
    if code is None:
        raise exc
    if isinstance(exc, RoundRejected):
        context.set_trailing_metadata(((REASON_METADATA_KEY, exc.reason.value),))
    elif round_refused:
        context.set_trailing_metadata(((grpc_options.ROUND_REFUSED_METADATA_KEY, code.name),))
    context.abort(code, tls.clip_details(str(exc)))


def _node_id(claimed: str, context: grpc.ServicerContext) -> str:
    """The calling node's identity (issue 10 item 1): with mTLS the name in its verified certificate, and a
    node_id field that names another node is refused. Plain text has no identities (loopback only, tls)."""
    ident = tls.peer_identity(context)
    if ident is None:
        return claimed
    if ident.role != pki.ROLE_CLIENT_NODE:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"role {ident.role!r} is not a client node")
    if claimed and claimed != ident.name:
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            tls.clip_details(
                f"node_id {claimed!r} is not the caller's certificate name {ident.name!r}: nodes speak for themselves"
            ),
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
    spec the nodes will act on, and forwarded as it came (shuffledp.spec_signing)."""
    signed = wire.signed if wire.HasField("signed") else None
    spec = wire
    if signed is not None:
        try:
            spec = pb.RoundSpec.FromString(signed.spec)
        except Exception as exc:  # DecodeError
            raise ValueError(f"the signed spec is not a RoundSpec: {exc}") from None
        if spec.HasField("signed"):
            raise ValueError("the signed spec carries another signed spec")
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
        cols = UserColumns(k.user_ids, k.nonces, k.nonce_bytes, k.counts, k.sums, k.sum_users)
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
    return out


def _stream_node(claimed: str, stream_node: str) -> str:
    """The node a contribution on a Connect stream speaks for: the stream's own (whose identity _node_id checked
    when it subscribed); a node_id naming another node is refused, as Submit refuses it under mTLS."""
    if claimed and claimed != stream_node:
        raise PermissionError(
            f"node_id {claimed!r} is not this stream's node {stream_node!r}: nodes speak for themselves"
        )
    return stream_node


class ShufflerServicer(pbg.ShufflerServicer):
    def __init__(self, state: ShufflerState, stream_poll_seconds: float = 0.5) -> None:
        self.state = state
        self._poll = stream_poll_seconds

    def ExecuteRound(self, request: pb.RoundSpec, context: grpc.ServicerContext) -> pb.ShuffledBatch:
        try:
            return _batch(self.state.execute_round(_request(request), is_active=context.is_active))
        except (ValueError, NotImplementedError, RoundExistsError, CohortUnavailable, CallerGone) as exc:
            # raised before anyone was selected or invited (ShufflerState.execute_round): no batch exists
            _abort(context, exc, round_refused=True)

    def GetPopulation(self, request: pb.PopulationRequest, context: grpc.ServicerContext) -> pb.PopulationStatus:
        p = self.state.population(request.run_id)
        return pb.PopulationStatus(
            admitted_users=p.admitted_users, unused_users=p.unused_users, connected_nodes=p.connected_nodes
        )

    def RegisterUsers(
        self, request: pb.RegisterUsersRequest, context: grpc.ServicerContext
    ) -> pb.RegisterUsersResponse:
        node = _node_id(request.node_id, context)
        try:
            admitted, total = self.state.register_users(node, list(request.user_ids))
        except (ValueError, QuotaExceeded) as exc:
            _abort(context, exc)
        return pb.RegisterUsersResponse(admitted=admitted, total_users=total)

    def _subscribe(self, node_id: str, context: grpc.ServicerContext) -> Subscription:
        node = _node_id(node_id, context)
        try:
            sub = self.state.subscribe(node)
        except (ValueError, QuotaExceeded) as exc:
            _abort(context, exc)
        context.add_callback(sub.close)  # wake the loop as soon as the node goes away
        return sub

    def _queued(self, sub: Subscription, context: grpc.ServicerContext):
        """What the state queued for the node (Invites, and on Connect SubmitResults) until its stream ends."""
        try:
            while context.is_active():
                try:
                    item = sub.get(timeout=self._poll)
                except EOFError:
                    return
                if item is not None:
                    yield item
        finally:
            self.state.unsubscribe(sub)

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext):
        for invite in self._queued(self._subscribe(request.node_id, context), context):
            yield _invitation(invite)

    def _accept(self, request: pb.Contribution, node: str) -> pb.ContributionAck:
        """Validate and aggregate one contribution of `node` (design 5.3): the one path of Submit and Connect.
        Raises the state's domain errors (RoundRejected, ValueError)."""
        ack = self.state.submit(_submission(request, node))
        return pb.ContributionAck(accepted=ack.accepted, rejected=ack.rejected)

    def Submit(self, request: pb.Contribution, context: grpc.ServicerContext) -> pb.ContributionAck:
        node = _node_id(request.node_id, context)
        try:
            return self._accept(request, node)
        except (RoundRejected, ValueError) as exc:
            _abort(context, exc)

    def Connect(self, request_iterator, context: grpc.ServicerContext):
        """The node's one stream (issue 30): `subscribe` first, then contributions, each answered by a SubmitResult
        in order; invitations go out on the same stream. The contributions are read by a thread of the stream's
        own, so that an invitation never waits for a contribution or the other way round."""
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        if first.WhichOneof("kind") != "subscribe":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Connect stream starts with `subscribe`")
        sub = self._subscribe(first.subscribe.node_id, context)
        reader = threading.Thread(
            target=self._read, args=(request_iterator, sub), name=f"connect-{sub.node_id}", daemon=True
        )
        reader.start()
        for item in self._queued(sub, context):
            if isinstance(item, pb.SubmitResult):
                yield pb.ShufflerMessage(result=item)
            else:
                yield pb.ShufflerMessage(invitation=_invitation(item))

    def _read(self, requests, sub: Subscription) -> None:
        """Connect's reader: each contribution through _accept, its result queued behind what is queued already.
        The stream ends when the node stops sending (nothing it sends after could be answered)."""
        it = iter(requests)
        try:
            while True:
                try:
                    msg = next(it)
                except StopIteration:
                    return
                except Exception as exc:  # the RPC ended (cancelled, broken, or aborted for an undecodable message)
                    log.debug("Connect stream of node %s ended: %r", sub.node_id, exc)
                    return
                sub.put(self._result(msg, sub.node_id))  # anything but a domain error is a bug: it is not hidden
        finally:
            sub.close()

    def _result(self, msg: pb.NodeMessage, node: str) -> pb.SubmitResult:
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


def serve_shuffler(
    state: ShufflerState,
    listen: str,
    server_credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_workers: int = 64,
    first_message_seconds: float = FIRST_MESSAGE_SECONDS,
    revocations: tls.RevocationList | None = None,
) -> tuple[grpc.Server, int]:
    """Start a Shuffler server over an existing state; returns (started server, bound port). `revocations`: the PKI's
    revocation list; a call with a revoked certificate is refused when it opens (PERMISSION_DENIED).

    Every open stream holds one of the nodes' max_workers threads: at most max_workers - RESERVED_WORKERS streams
    are open (and as many nodes subscribed), so registrations and submissions always find a thread; the analyzer's
    calls have ANALYZER_WORKERS threads of their own. CallLimits counts each call when it opens.
    """
    if max_workers <= RESERVED_WORKERS:
        raise ValueError(f"max_workers must exceed RESERVED_WORKERS={RESERVED_WORKERS}, got {max_workers}")
    state.set_max_streams(max_workers - RESERVED_WORKERS)
    analyzer_pool = futures.ThreadPoolExecutor(max_workers=ANALYZER_WORKERS, thread_name_prefix="shuffler-analyzer")
    limits = CallLimits(max_workers - RESERVED_WORKERS, analyzer_pool, first_message_seconds, revocations)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shuffler"),
        interceptors=[limits, *interceptors],  # first: counts each call when it opens, before anything is read
        options=grpc_options.server_options(),
    )
    server.call_limits = limits  # for in-process inspection (tests); not on the wire
    pbg.add_ShufflerServicer_to_server(ShufflerServicer(state), server)
    # with the standard gRPC health protocol: compose healthchecks and `shuffledp health` ask for it
    port, _ = start_with_health(server, listen, server_credentials, "shuffledp.v1.Shuffler")
    return server, port


def start_shuffler(
    listen: str,
    state_path: Path | None = None,
    server_credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    clock: Callable[[], float] = time.monotonic,
    rng: np.random.Generator | None = None,
    revocations: tls.RevocationList | None = None,
) -> tuple[grpc.Server, int]:
    """The shuffler entry point (issue 4 contract): participation record in SQLite at state_path if given; rng
    (cohorts, Poisson draws, permutations) defaults to a fresh CSPRNG (a seeded one exists only in testing mode)."""
    store = SqliteParticipationStore(state_path) if state_path is not None else None
    state = ShufflerState(store, clock=clock, rng=rng)
    server, port = serve_shuffler(state, listen, server_credentials, interceptors, revocations=revocations)
    server.shuffler_state = state  # for in-process inspection (tests, benchmarks); not on the wire
    log.info("shuffler listening on port %d (participation record: %s)", port, state_path or "memory")
    return server, port
