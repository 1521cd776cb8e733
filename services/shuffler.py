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

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

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
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

__all__ = [
    "ShufflerServicer",
    "serve_shuffler",
    "start_shuffler",
    "REASON_METADATA_KEY",
    "RESERVED_WORKERS",
    "InFlightLimit",
]

log = logging.getLogger(__name__)

REASON_METADATA_KEY = "shuffledp-reason"
RESERVED_WORKERS = 16  # server threads never taken by Subscribe streams: rounds, submissions, GetPopulation
# Requests a node may have in flight at once (RegisterUsers and Submit: a node sends its Submits one after another).
# Each can be up to 64 MiB and ~10x that once decoded, so this, not the thread pool, bounds what one node identity
# can make the shuffler hold (issue 10). Plain text (loopback) has no identities: the budget is per connection.
NODE_REQUESTS_IN_FLIGHT = 2
# Connect is not limited here: its stream's contributions are read and checked one after another (one in flight)
_LIMITED_METHODS = ("/shuffledp.v1.Shuffler/RegisterUsers", "/shuffledp.v1.Shuffler/Submit")


class InFlightLimit(grpc.ServerInterceptor):
    """At most NODE_REQUESTS_IN_FLIGHT RegisterUsers/Submit per caller identity at once; more are refused with
    RESOURCE_EXHAUSTED before their request is decoded. Install it first, ahead of the role check's interceptor."""

    def __init__(self, limit: int = NODE_REQUESTS_IN_FLIGHT) -> None:
        self._limit = int(limit)
        self._lock = threading.Lock()
        self._in_flight: Counter = Counter()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method not in _LIMITED_METHODS or not handler.unary_unary:
            return handler
        inner = handler.unary_unary

        def limited(request, context):
            ident = tls.peer_identity(context)
            # plain text has no identities: each connection (one per node process) gets its own budget
            who = ident.name if ident is not None else f"peer:{context.peer()}"
            with self._lock:
                if self._in_flight[who] >= self._limit:
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{self._limit} requests of this node are in flight already; send one after another",
                    )
                self._in_flight[who] += 1
            try:
                return inner(request, context)
            finally:
                with self._lock:
                    self._in_flight[who] -= 1
                    if not self._in_flight[who]:
                        del self._in_flight[who]

        return grpc.unary_unary_rpc_method_handler(
            limited,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


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


def _request(spec: pb.RoundSpec) -> RoundRequest:
    r = spec.randomizer
    try:
        schedule, transport = Schedule(spec.schedule), Transport(spec.transport)
    except ValueError as exc:
        raise ValueError(f"unknown schedule/transport value: {exc}") from exc
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
        relay=spec,
        second_relay=lambda c, c_min, m: _second_spec(spec, c, c_min, m),
    )


def _second_spec(spec: pb.RoundSpec, checked_in: int, c_min: int, m: int) -> pb.RoundSpec:
    """The check-in round's second invitation (CheckIn): the checked-in count, its threshold and trials per user."""
    out = pb.RoundSpec()
    out.CopyFrom(spec)
    out.check_in.checked_in = checked_in
    out.min_contributors = c_min
    out.randomizer.m = m
    if spec.transport == pb.BITS:  # d (g + m) labelled bits per user (Alg 2 of paper 000)
        out.randomizer.messages_per_user = spec.randomizer.dim * (spec.randomizer.g + m)
    return out


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
    return pb.Invitation(spec=invite.relay, user_ids=invite.user_ids, eligible=invite.eligible)


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
) -> tuple[grpc.Server, int]:
    """Start a Shuffler server over an existing state; returns (started server, bound port).

    Every subscribed node holds one worker thread (its Subscribe stream): the state admits at most
    max_workers - RESERVED_WORKERS streams (one per node identity), so rounds and submissions always find a thread.
    """
    if max_workers <= RESERVED_WORKERS:
        raise ValueError(f"max_workers must exceed RESERVED_WORKERS={RESERVED_WORKERS}, got {max_workers}")
    state.set_max_streams(max_workers - RESERVED_WORKERS)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shuffler"),
        interceptors=[InFlightLimit(), *interceptors],  # first: refuses before the request is decoded
        options=grpc_options.server_options(),
    )
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
) -> tuple[grpc.Server, int]:
    """The shuffler entry point (issue 4 contract): participation record in SQLite at state_path if given; rng
    (cohorts, Poisson draws, permutations) defaults to a fresh CSPRNG (a seeded one exists only in testing mode)."""
    store = SqliteParticipationStore(state_path) if state_path is not None else None
    state = ShufflerState(store, clock=clock, rng=rng)
    server, port = serve_shuffler(state, listen, server_credentials, interceptors)
    server.shuffler_state = state  # for in-process inspection (tests, benchmarks); not on the wire
    log.info("shuffler listening on port %d (participation record: %s)", port, state_path or "memory")
    return server, port
