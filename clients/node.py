"""Client node: hosts N logical users, each with its own data shard, policy and budget (design 1; issue 4 item 5).

The node dials the shuffler (RegisterUsers, then one long-lived bidirectional Connect stream) and answers each
invitation on that stream with one Contribution holding one message per joining user plus the refusals; the
shuffler answers each with a SubmitResult on the stream (what a unary Submit would have answered: no call per round
trip, issue 30). It reconnects with exponential backoff when the stream drops; a contribution whose result the
broken stream never brought is sent again by unary Submit (the same nonces: a copy that did arrive is caught as a
replay, never counted twice). A contribution larger than grpc_options.SUBMIT_CHUNK_BYTES goes in several parts (the
shuffler aggregates them one by one); users whose messages could not be delivered are reported to the shuffler as
refusals "submit_failed_<status>", so the operator sees the cause in the round's report.
For the invited users it computes, vectorized over users:
gradient of the round's loss at the broadcast iterate (shuffledp.models) -> l2 clipping to clip_norm ->
the local randomizer (PVEC count mode, or bit mode with one HPKE seal per labelled bit, info binding run and
round). Every draw comes from the node's CSPRNG; in PVEC count mode the node sends, per group of its users, the
sum of their counts with the sum of their noise drawn at once (pvec_round._put_sums: the same law). The node
serves GetNodeStatus and the standard gRPC health service.

Layering: NodeCore is the transport-independent logic (spec -> Contribution); NodeRunner owns the connection.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2
from shuffledp.clients.contribution import split_contribution
from shuffledp.clients.policy import PolicyTable, Refusal, RunTable, UserPolicy, noise_key
from shuffledp.clients.spend_store import MemorySpendStore, SpendStore, SqliteSpendStore

from shuffledp.models import DEFAULT_HIDDEN, ModelPlugin, make_model, model_digest
from shuffledp.models.plugin import ModelIdentity
from shuffledp.protocols.base import Nonces, tensor_to_array
from shuffledp.protocols.registry import known_protocol, round_protocol
from shuffledp.security.rng import make_rng
from shuffledp.transport import grpc_options, tls
from shuffledp.transport.health import start_with_health
from shuffledp.transport.spec_signing import SIGNATURE_INVALID, SpecSignatureInvalid, SpecVerifier, invited_spec
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

__all__ = [
    "UserShard",
    "NodeCore",
    "ClientNodeHandle",
    "start_node",
    "start_node_with_shard",
    "split_contribution",
    "SUBMIT_FAILED_PREFIX",
]

log = logging.getLogger(__name__)

NONCE_BYTES = 16
# a check-in's preparation computes the users' vectors by blocks of at least this many users and about this many
# bytes of float64 (the Flax adapter pads each block's last call of USERS_PER_CALL users: blocks are large)
PREPARE_BLOCK_USERS, PREPARE_BLOCK_BYTES = 1024, 16 * 2**20
SUBMIT_FAILED_PREFIX = "submit_failed_"  # + the gRPC status name, lower case: a refusal reason the operator sees


@dataclass(frozen=True)
class UserShard:
    """The node's users: ids (n,), X (n, k, features), y (n, k) with k examples per user."""

    user_ids: list[str]
    X: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.user_ids)
        if self.X.ndim != 3 or self.X.shape[0] != n or self.y.shape != self.X.shape[:2]:
            raise ValueError(f"shard shapes disagree: {n} ids, X {self.X.shape}, y {self.y.shape}")
        if len(set(self.user_ids)) != n:
            raise ValueError("user_ids must be distinct")


def _nonce_blob(k: int) -> bytes:
    """k fresh replay nonces of NONCE_BYTES, concatenated, from one OS CSPRNG read (the UserColumns layout)."""
    return secrets.token_bytes(NONCE_BYTES * k)


def _nonces(k: int) -> Nonces:
    """k fresh replay nonces (slices of independent uniform bytes are independent), as one buffer."""
    return Nonces(_nonce_blob(k), NONCE_BYTES)


class NodeCore:
    """Turns an Invitation into a Contribution for the node's users; tracks per-user spend and refusals."""

    def __init__(
        self,
        node_id: str,
        shard: UserShard,
        policy: UserPolicy | Sequence[UserPolicy] | None = None,
        rng: np.random.Generator | None = None,
        verifier=None,
        spend_store: SpendStore | None = None,
        model: tuple[ModelPlugin, ModelIdentity] | None = None,
        spec_verifier: SpecVerifier | None = None,
    ) -> None:
        self.node_id = node_id
        # with a PKI: the node acts only on specs the analyzer signed (shuffledp.transport.spec_signing); None =
        # insecure mode,
        # where the relayed spec is taken as it comes
        self.spec_verifier = spec_verifier
        self._verified: tuple[tuple, pb.RoundSpec] | None = None  # the last invitation's spec: handle, then prepare
        # the model plug-in installed here and named by this node's own configuration (shuffledp.models.plugin);
        # None = the built-in tasks, built from the spec's task fields
        self.installed_model = model
        self.shard = shard
        self._index = {u: i for i, u in enumerate(shard.user_ids)}
        kw = {} if verifier is None else {"verifier": verifier}
        # the users' spend so far: durable with a SqliteSpendStore (issue 10 item 3)
        self._spend = spend_store if spend_store is not None else MemorySpendStore()
        eps, delta, history, runs = self._spend.load_all(shard.user_ids)  # one read of the store's log
        policies = policy if policy is not None else UserPolicy()
        self.policy = PolicyTable(policies, len(shard.user_ids), spent=(eps, delta), history=history, **kw)
        parameters = self._spend.run_parameters()
        for run, (counts, paid_eps, paid_delta, last_round) in runs.items():
            # counted_round starts over (-1): a round seen before the restart may be counted eligible again, never
            # less; the run's parameters are those its charges were made at (another protocol or other parameters
            # under the same run id are refused, as before the restart)
            table = RunTable(counts, paid_eps, paid_delta, last_round=last_round, parameters=parameters.get(run))
            self.policy.runs[run] = table
        self._rng = rng if rng is not None else make_rng()
        self._lock = threading.Lock()
        self.rounds_joined = 0
        self.spend_records = 0  # users charged, one record each per round (shuffledp/observability/metrics.py)
        self.refusals: Counter = Counter()
        self._protocol_state: dict[str, Any] = {}  # per run: a stateful client estimator's state (mu2_round)
        # the last check-in: (run, round, indices of the users who checked in here), and what was computed for them
        # (Protocol.prepare): (run, round, those indices, state), for its second invitation
        self._checked_in: tuple[str, int, np.ndarray] | None = None
        self._prepared: tuple[str, int, np.ndarray, Any] | None = None
        self.prepared_rounds = 0  # second invitations answered from the check-in's preparation

    # ----- gradients -------------------------------------------------------------------------------------------
    def _builtin(self, spec: pb.RoundSpec) -> ModelPlugin:
        """The built-in loss the analyzer asks for (its l2 term, Moreau smoothing: spec 000 sec 4)."""
        f = self.shard.X.shape[2]
        hidden = spec.hidden or DEFAULT_HIDDEN
        return make_model(spec.task, f, spec.num_classes, l2=spec.l2, smoothing=spec.smoothing, hidden=hidden)

    def model_differs(self, spec: pb.RoundSpec) -> str:
        """Why the round's model is not the one this node computes with ("" = it is): a plug-in's name and digest
        must be those of the plug-in installed here (issue 26 item 3); a built-in task's digest, when the spec
        states one, that of the built-in model the spec's fields make here (a node of another version)."""
        if self.installed_model is not None:
            mine = self.installed_model[1]
            if (spec.model_name, spec.model_digest) == (mine.name, mine.digest):
                return ""
            asked = f"{spec.model_name or spec.task!r} ({spec.model_digest[:12] or 'no digest'})"
            return f"round asks for {asked}, node has {mine.name!r} ({mine.digest[:12]})"
        if spec.model_name and spec.model_name != spec.task:
            return f"round asks for the plug-in {spec.model_name!r}, none is configured on this node"
        if spec.model_digest:
            try:
                digest = model_digest(self._builtin(spec))
            except ValueError as exc:
                return f"round's built-in model is invalid here: {exc}"
            if digest != spec.model_digest:
                return f"built-in {spec.task!r} digest {digest[:12]} here, {spec.model_digest[:12]} in the round"
        return ""

    def _model(self, spec: pb.RoundSpec, params: np.ndarray) -> ModelPlugin:
        """The model of the round (the installed plug-in, else the built-in task of the spec), checked against the
        broadcast parameters' size."""
        model = self.installed_model[0] if self.installed_model is not None else self._builtin(spec)
        if params.shape != (model.dim,) or spec.randomizer.dim != model.dim:
            raise ValueError(
                f"model of {params.size} values / randomizer.dim={spec.randomizer.dim} do not match "
                f"{model.describe()} (dim {model.dim})"
            )
        return model

    def example_gradients(self, spec: pb.RoundSpec, idx: np.ndarray, theta: np.ndarray, examples: np.ndarray):
        """Gradient at theta of example examples[j] of user idx[j], shape (len(idx), dim) (a stream's next example,
        protocols/mu2_round.py)."""
        params = np.asarray(theta, dtype=np.float64).ravel()
        model = self._model(spec, params)
        return model.per_example_gradients(params, self.shard.X[idx, examples], self.shard.y[idx, examples])

    def protocol_state(self, run_id: str, make: Callable[[int], Any]) -> Any:
        """The run's client-estimator state over this node's users (made by make(number of users) at first use)."""
        if run_id not in self._protocol_state:
            self._protocol_state[run_id] = make(len(self.shard.user_ids))
        return self._protocol_state[run_id]

    def batch_gradients(self, spec: pb.RoundSpec, idx: np.ndarray) -> np.ndarray:
        """Mean loss gradient of each user's local batch at the broadcast iterate, shape (len(idx), dim)."""
        if idx.size and idx[-1] - idx[0] == idx.size - 1 and np.all(np.diff(idx) == 1):
            rows = slice(int(idx[0]), int(idx[-1]) + 1)  # consecutive users (every user, or a block of them)
            X, y = self.shard.X[rows], self.shard.y[rows]  # views: no copy of their data
        else:
            X, y = self.shard.X[idx], self.shard.y[idx]
        n, k, _ = X.shape
        params = tensor_to_array(spec.model).ravel()
        model = self._model(spec, params)
        b = min(max(int(spec.local_batch), 1), k)
        if b < k:
            # each user draws its own b of its k examples (independent random keys per user, vectorized)
            pick = np.argsort(self._rng.random((n, k)), axis=1)[:, :b]
            X = np.take_along_axis(X, pick[:, :, None], axis=1)
            y = np.take_along_axis(y, pick, axis=1)
        return model.per_user_gradients(params, X, y)  # the round's protocol clips them in its own norm

    # ----- one round -------------------------------------------------------------------------------------------
    def spec_of(self, inv: pb.Invitation) -> pb.RoundSpec:
        """The spec this node acts on for `inv` (spec_signing.invited_spec: with a PKI, only what the analyzer signed
        and the checked-in count); the last one is kept, as handle and prepare ask for the same invitation's.
        Raises SpecSignatureInvalid."""
        if self.spec_verifier is None:
            return inv.spec
        s = inv.signed_spec
        key = (
            s.spec,
            s.signature,
            s.certificate,
            inv.checked_in,
            inv.SerializeToString() if inv.HasField("spec") else b"",
        )
        if self._verified is not None and self._verified[0] == key:
            return self._verified[1]
        spec = invited_spec(inv, self.spec_verifier)
        self._verified = (key, spec)
        return spec

    def _refuse_unverified(self, inv: pb.Invitation, idx: np.ndarray, why: str) -> pb.Contribution:
        """Every invited user of this node refuses a spec it cannot verify: nothing is computed, sealed or counted. The
        run and round the refusals are addressed to are read unverified: at worst the shuffler misaddresses them."""
        hint = inv.spec
        if inv.HasField("signed_spec"):
            try:
                hint = pb.RoundSpec.FromString(inv.signed_spec.spec)
            except Exception:  # DecodeError: addressed to the relayed spec's round
                pass
        log.warning("node %s: refusing round %d of %s: %s", self.node_id, hint.round, hint.run_id, why)
        out = pb.Contribution(run_id=hint.run_id, round=hint.round, node_id=self.node_id)
        with self._lock:
            self._refuse(idx, np.full(idx.size, SIGNATURE_INVALID, dtype=object), np.zeros(idx.size, dtype=bool), out)
        return out

    def handle(self, inv: pb.Invitation) -> pb.Contribution:
        """Decide, compute and randomize for the invited users of this node; returns the Contribution."""
        # the invited users hosted here, as indices (no string kept per invited user: memory per hosted user)
        ids = inv.user_ids  # looked up in C (map), not by a Python step per invited user
        idx = np.fromiter(map(self._index.get, ids, itertools.repeat(-1)), dtype=np.int64, count=len(ids))
        idx = idx[idx >= 0]
        try:
            spec = self.spec_of(inv)
        except SpecSignatureInvalid as exc:
            return self._refuse_unverified(inv, idx, str(exc))
        out = pb.Contribution(run_id=spec.run_id, round=spec.round, node_id=self.node_id)
        if idx.size and np.bincount(idx).max() > 1:
            # a user named twice would send two messages for one charge: each user answers once (the first)
            log.warning("node %s: round %d names users more than once; each answers once", self.node_id, spec.round)
            idx = idx[np.sort(np.unique(idx, return_index=True)[1])]
        protocol = known_protocol(spec.randomizer.protocol)
        supported = protocol is not None and protocol.supports(spec)
        account = None
        if supported:
            try:
                account = protocol.user_account(spec)
            except ValueError as exc:
                log.warning("node %s: round %d of %s is malformed: %s", self.node_id, spec.round, spec.run_id, exc)
                supported = False  # every invited user refuses it; nothing is counted
        with self._lock:
            if spec.population and inv.eligible < spec.population:
                # drawn from fewer users than the round is accounted for: a higher rate than charged (item 3)
                reasons, join = np.full(idx.size, Refusal.POPULATION, dtype=object), np.zeros(idx.size, dtype=bool)
            elif idx.size and (differs := self.model_differs(spec)):
                # not the model installed here: nothing is computed or counted (no code comes with a spec)
                log.warning("node %s: refusing round %d of %s: %s", self.node_id, spec.round, spec.run_id, differs)
                reasons, join = np.full(idx.size, Refusal.MODEL_DIFFERS, dtype=object), np.zeros(idx.size, dtype=bool)
            elif account is not None:
                self._handle_in_run(spec, account, idx, supported, out)
                return out
            else:
                reasons, cost = self.policy.decide(spec, idx, supported)
                join = reasons == ""
            if spec.check_in.noise_trials and not spec.check_in.checked_in:
                # check-in invitation (mechanisms/check_in.py): the users whose policy accepts the worst case check
                # in with a payload-free message; nothing is computed or charged until the second invitation
                joined = np.flatnonzero(join)
                out.columns.user_ids.extend(self._names(idx[joined]))
                out.columns.nonce_bytes = NONCE_BYTES
                out.columns.nonces = _nonce_blob(joined.size)
                self._checked_in = (spec.run_id, spec.round, idx[joined])
            elif np.any(join):
                try:
                    self._randomize(spec, idx[join], out)
                except ValueError as exc:
                    log.warning("node %s: round %d of %s is malformed: %s", self.node_id, spec.round, spec.run_id, exc)
                    del out.messages[:]  # nothing of a malformed round is sent or charged
                    out.ClearField("columns")
                    reasons[join] = "invalid_round_spec"
                    join[:] = False
                else:
                    # charged, durably, before sending: a message that may have arrived is spent. If the store
                    # fails, the exception leaves handle() and nothing of the round is sent.
                    # RoundSpec.report_goal (over-selection) is not read here: a report the shuffler refuses after
                    # the round closed on its goal was charged all the same, and what is certified rests on
                    # min_contributors / c_min only (policy.decide), which a goal never undercuts
                    charged, delta = idx[join], float(spec.per_user_cost.delta)
                    keys = self.policy.charge(charged, cost[join], delta, noise_key(spec))
                    self._spend.record(self._names(charged), cost[join], delta, keys)
                    self.spend_records += len(charged)
                    self.rounds_joined += 1
            self._refuse(idx, reasons, join, out)
        return out

    def _names(self, idx: np.ndarray) -> list[str]:
        """The node's own ids of the users at node indices idx."""
        return list(map(self.shard.user_ids.__getitem__, idx.tolist()))

    def _refuse(self, idx: np.ndarray, reasons: np.ndarray, join: np.ndarray, out: pb.Contribution) -> None:
        for i in np.flatnonzero(~join).tolist():  # only the refused: no per-user work when everyone joins
            why = str(reasons[i])
            out.refusals.append(pb.Refusal(user_id=self.shard.user_ids[idx[i]], reason=why))
            self.refusals[why] += 1

    def _handle_in_run(
        self,
        spec: pb.RoundSpec,
        account: Any,
        idx: np.ndarray,
        supported: bool,
        out: pb.Contribution,
    ) -> None:
        """A round of a protocol whose cost composes per run (protocols.base.UserAccount): decide, randomize for
        the users who join, and record every charge of the round (joins and eligibility) durably before anything
        is sent. Caller holds the lock."""
        reasons, charge = self.policy.decide_in_run(spec, account, idx, supported)
        join = reasons == ""
        if np.any(join):
            try:
                self._randomize(spec, idx[join], out)
            except ValueError as exc:
                log.warning("node %s: round %d of %s is malformed: %s", self.node_id, spec.round, spec.run_id, exc)
                del out.messages[:]  # nothing of a malformed round is sent or charged for a join
                reasons[join] = Refusal.INVALID_SPEC
                join[:] = False
                _, charge = self.policy.decide_in_run(spec, account, idx, supported, join_allowed=False)
        if charge.users.size:
            charged = self._names(charge.users)
            # if the store fails, the exception leaves handle() and nothing of the round is sent
            n = len(charged)
            self._spend.record(
                charged, charge.eps, charge.delta, [None] * n, charge.run, charge.steps, charge.round, charge.parameters
            )
            self.spend_records += n
        self.policy.apply_run(charge)
        if np.any(join):
            self.rounds_joined += 1
        self._refuse(idx, reasons, join, out)

    def _randomize(self, spec: pb.RoundSpec, idx: np.ndarray, out: pb.Contribution) -> None:
        """One message per user of idx (in idx order) in out, by the round's protocol plug-in: from the check-in's
        preparation when the protocol prepared this round for these users, else from scratch."""
        ids, nonces = self._names(idx), _nonces(idx.size)
        protocol = round_protocol(spec.randomizer.protocol)
        prepared, self._prepared = self._prepared, None  # computed for one invitation: never used twice
        if prepared is not None and (prepared[0], prepared[1]) == (spec.run_id, spec.round):
            at = _rows_of(prepared[2], idx)
            if at is not None and protocol.randomize_prepared(spec, prepared[3], at, ids, nonces, self._rng, out):
                self.prepared_rounds += 1
                return
        protocol.randomize(spec, protocol.local_vectors(spec, self, idx), ids, nonces, self._rng, out)

    def prepare(self, inv: pb.Invitation) -> None:
        """After this node answered inv's check-in (handle): what the round's protocol can compute for the users who
        checked in before the second invitation (Protocol.prepare, optional), kept for that invitation. Nothing is
        sent or charged here: the second invitation is decided, charged and verified as any other, and its spec
        must match this preparation."""
        try:
            spec = self.spec_of(inv)
        except SpecSignatureInvalid:
            return  # handle() refused it
        protocol = known_protocol(spec.randomizer.protocol)
        with self._lock:
            checked, self._checked_in = self._checked_in, None
            self._prepared = None
            # a plug-in prepares only with both halves (base.py: prepare, randomize_prepared)
            if not (hasattr(protocol, "prepare") and hasattr(protocol, "randomize_prepared")) or checked is None:
                return
            run, round_, idx = checked
            if (run, round_) != (spec.run_id, spec.round) or not idx.size:
                return
            try:
                # by blocks of users: one block's float vectors at a time (at 10^6 users and d = 22, 176 MB at once)
                step = max(PREPARE_BLOCK_USERS, PREPARE_BLOCK_BYTES // (8 * max(1, int(spec.randomizer.dim))))
                blocks = (protocol.local_vectors(spec, self, idx[i : i + step]) for i in range(0, idx.size, step))
                state = protocol.prepare(spec, blocks, self._rng)
            except ValueError as exc:  # the second invitation computes (and reports) it
                log.debug("node %s: round %d not prepared: %s", self.node_id, spec.round, exc)
                return
            if state is not None:
                self._prepared = (spec.run_id, spec.round, idx, state)

    def status(self) -> pb.NodeStatus:
        with self._lock:
            return pb.NodeStatus(
                node_id=self.node_id,
                users=len(self.shard.user_ids),
                rounds_joined=self.rounds_joined,
                refusals=dict(self.refusals),
            )

    def spent(self, user_id: str) -> tuple[float, float]:
        """(eps, delta) charged to this user so far, over every run of this node (basic composition; the RDP
        figure is self.policy.tight_spent)."""
        i = self._index[user_id]
        with self._lock:
            return float(self.policy.eps_spent[i]), float(self.policy.delta_spent[i])


def _rows_of(prepared: np.ndarray, idx: np.ndarray) -> np.ndarray | None:
    """Where each user of idx is in `prepared` (distinct node indices, the users a preparation drew for); None
    if one of them is not there."""
    if np.array_equal(prepared, idx):
        return np.arange(idx.size)
    order = np.argsort(prepared)
    pos = np.searchsorted(prepared, idx, sorter=order)
    if np.any(pos >= prepared.size):
        return None
    at = order[pos]
    return at if np.array_equal(prepared[at], idx) else None


def _lower_priority() -> None:
    """Nice +10 for the calling thread (Linux: a thread has a nice value of its own); elsewhere nothing."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:  # not allowed here: the preparation runs at the node's priority
            pass


class _Stream:
    """The node's side of one Connect stream: the requests it sends, and the results it waits for, by seq."""

    _END = object()

    def __init__(self, node_id: str) -> None:
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._out.put(pb.NodeMessage(subscribe=pb.SubscribeRequest(node_id=node_id)))
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: dict[int, futures.Future] = {}
        self._closed = False

    def requests(self):
        """The request iterator of the call (gRPC drains it in a thread of its own)."""
        while (msg := self._out.get()) is not self._END:
            yield msg

    def send(self, contribution: pb.Contribution) -> tuple[pb.Contribution, futures.Future | None]:
        """Send a contribution; the future's result is its SubmitResult, or None if the stream ended first (None,
        nothing sent, if the stream is closed already). Returns the copy the stream sends (the caller keeps that one
        for a retry and drops its own: one copy of a round's messages in memory) and the future."""
        with self._lock:
            if self._closed:
                return contribution, None
            self._seq += 1
            fut: futures.Future = futures.Future()
            self._pending[self._seq] = fut
            msg = pb.NodeMessage(seq=self._seq, contribution=contribution)
            self._out.put(msg)
            return msg.contribution, fut

    def resolve(self, result: pb.SubmitResult) -> None:
        with self._lock:
            fut = self._pending.pop(result.seq, None)
        if fut is not None:
            fut.set_result(result)

    def close(self) -> None:
        """The stream ended: every contribution still waiting gets None (its sender falls back to Submit)."""
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
        self._out.put(self._END)
        for fut in pending.values():
            fut.set_result(None)


class _NodeServicer(pbg.ClientNodeServicer):
    def __init__(self, core: NodeCore) -> None:
        self._core = core

    def GetNodeStatus(self, request: pb.NodeStatusRequest, context: grpc.ServicerContext) -> pb.NodeStatus:
        return self._core.status()


class ClientNodeHandle:
    """A running node: its gRPC server (status + health) and the thread connected to the shuffler."""

    def __init__(
        self,
        core: NodeCore,
        shuffler_address: str,
        listen: str,
        channel_credentials: grpc.ChannelCredentials | None,
        server_credentials: grpc.ServerCredentials | None,
        backoff: tuple[float, float] = (0.1, 5.0),
        *,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        submit_chunk_bytes: int = grpc_options.SUBMIT_CHUNK_BYTES,
    ) -> None:
        self.core = core
        self._chunk = int(submit_chunk_bytes)
        self._stop = threading.Event()
        self._backoff = backoff
        self._call = None
        self._stream: _Stream | None = None
        # set once the stream is opened from this side: the shuffler may not have registered it yet (a caller that
        # needs the node in a cohort asks the shuffler's population)
        self.connected = threading.Event()
        options = grpc_options.node_channel_options()
        if channel_credentials is None:
            self._channel = tls.plain_channel(shuffler_address, options)
        else:
            self._channel = grpc.secure_channel(shuffler_address, channel_credentials, options=options)
        self._stub = pbg.ShufflerStub(self._channel)
        self._worker = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{core.node_id}-round")
        # a check-in round's preparation (NodeCore.prepare) runs on a thread of lower CPU priority: it uses what a
        # shared host has spare and never delays the shuffler's or another node's work on the round's path
        self._preparer = futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{core.node_id}-prepare", initializer=_lower_priority
        )
        self._preparing: futures.Future | None = None
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"{core.node_id}-rpc"),
            interceptors=list(interceptors),
            options=grpc_options.server_options(),
        )
        pbg.add_ClientNodeServicer_to_server(_NodeServicer(core), self._server)
        # the named service reports whether the node is connected to the shuffler: not yet
        self.port, self._health = start_with_health(
            self._server, listen, server_credentials, "shuffledp.v1.ClientNode", serving=False
        )
        self._thread = threading.Thread(target=self._loop, name=f"{core.node_id}-stream", daemon=True)
        self._thread.start()

    def _set_health(self, status: int) -> None:
        self._health.set("shuffledp.v1.ClientNode", status)

    def _loop(self) -> None:
        delay = self._backoff[0]
        core = self.core
        while not self._stop.is_set():
            try:
                t0 = time.monotonic()
                ack = self._stub.RegisterUsers(
                    pb.RegisterUsersRequest(node_id=core.node_id, user_ids=core.shard.user_ids), timeout=120
                )
                log.info(
                    "node %s: %d users registered at the shuffler (%d in all; %.2f s)",
                    core.node_id,
                    ack.admitted,
                    ack.total_users,
                    time.monotonic() - t0,
                )
                stream = _Stream(core.node_id)
                self._call = self._stub.Connect(stream.requests())
                self._stream = stream
                # connected once the shuffler says so: a refused stream (its capacity, a quota) raises below, and
                # the node backs off instead of retrying at the first delay (issue 44)
                if grpc_options.subscribed(self._call.initial_metadata()):
                    self.connected.set()
                    self._set_health(health_pb2.HealthCheckResponse.SERVING)
                    delay = self._backoff[0]
                for msg in self._call:
                    if msg.WhichOneof("kind") == "invitation":
                        self._worker.submit(self._answer, msg.invitation)
                    elif msg.WhichOneof("kind") == "result":
                        stream.resolve(msg.result)
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    log.warning(
                        "node %s: shuffler stream failed (%s); reconnecting in %.1fs", core.node_id, exc.code(), delay
                    )
            finally:
                self.connected.clear()
                if self._stream is not None:
                    self._stream.close()
                    self._stream = None
                self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            # jittered exponential backoff (the jitter comes from the OS CSPRNG; it carries no privacy)
            self._stop.wait(delay * (0.5 + secrets.randbelow(1000) / 1000))
            delay = min(delay * 2, self._backoff[1])

    def _answer(self, inv: pb.Invitation) -> None:
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            futures.wait([preparing])  # the last check-in's preparation is ready (or failed) before anything is drawn
        try:
            contribution = self.core.handle(inv)
        except Exception:  # a bug for one round must not kill the node
            log.exception("node %s: failed to compute an invitation", self.core.node_id)
            return
        round_index = contribution.round
        try:
            spec = self.core.spec_of(inv)  # as handle() verified it (kept)
            checking_in = bool(spec.check_in.noise_trials and not spec.check_in.checked_in)
        except SpecSignatureInvalid:
            checking_in = False
        if not (contribution.messages or contribution.refusals or contribution.HasField("columns")):
            return  # a notice of a round none of this node's users was invited to: nothing to answer
        parts = split_contribution(contribution, self._chunk)
        del contribution  # the parts hold it (memory: one copy of the round's messages on their way, not three)
        # every part is on its way before the first result is awaited: one round trip for all of them
        sent = []
        for i in range(len(parts)):
            part, parts[i] = parts[i], None
            sent.append(self._send(part))
        del part
        if checking_in:
            # the second invitation is a round trip away: compute what can be computed meanwhile (the next
            # invitation waits for it, above)
            self._preparing = self._preparer.submit(self._prepare, inv)
        for part, result in sent:
            code = self._deliver(part, result, round_index)
            if code is not None and (senders := [m.user_id for m in part.messages] + list(part.columns.user_ids)):
                # the operator sees why these users are missing: refusals with the cause (the users stay charged)
                why = SUBMIT_FAILED_PREFIX + code.name.lower()
                note = pb.Contribution(run_id=part.run_id, round=part.round, node_id=part.node_id)
                note.refusals.extend(pb.Refusal(user_id=u, reason=why) for u in senders)
                self._deliver(*self._send(note), round_index)

    def _prepare(self, inv: pb.Invitation) -> None:
        try:
            self.core.prepare(inv)
        except Exception:  # a failed preparation only costs its time: the second invitation starts over
            log.exception("node %s: failed to prepare a check-in's round", self.core.node_id)

    def _send(self, contribution: pb.Contribution) -> tuple[pb.Contribution, futures.Future | None]:
        """On the current stream: (the contribution as sent, its result's future); the future is None when there is
        no stream (the caller uses Submit)."""
        stream = self._stream
        return stream.send(contribution) if stream is not None else (contribution, None)

    def _log_ack(self, ack: pb.ContributionAck, round_index: int) -> None:
        if ack.rejected:
            rejected = dict(ack.rejected)
            log.warning("node %s: round %d: shuffler rejected %s", self.core.node_id, round_index, rejected)

    def _deliver(
        self, contribution: pb.Contribution, sent: futures.Future | None, round_index: int
    ) -> grpc.StatusCode | None:
        """The outcome of a contribution sent on the stream (sent: its future), or, when it was not sent or the
        stream ended before its result came, of a unary Submit of it. None on success, else the status code."""
        try:
            result = sent.result(timeout=60) if sent is not None else None
        except futures.TimeoutError:
            log.warning("node %s: round %d: no result on the stream within 60 s", self.core.node_id, round_index)
            return grpc.StatusCode.DEADLINE_EXCEEDED
        if result is None:
            return self._submit(contribution, round_index)
        if result.status:
            log.warning("node %s: round %d submit failed: %s", self.core.node_id, round_index, result.status)
            return getattr(grpc.StatusCode, result.status, grpc.StatusCode.UNKNOWN)
        self._log_ack(result.ack, round_index)
        return None

    def _submit(self, contribution: pb.Contribution, round_index: int) -> grpc.StatusCode | None:
        """Unary Submit with retries on UNAVAILABLE; None on success, else the final status code."""
        code = None
        for attempt in range(3):
            try:
                self._log_ack(self._stub.Submit(contribution, timeout=60), round_index)
                return None
            except grpc.RpcError as exc:
                code = exc.code()
                # same nonces on retry: a copy that did arrive is caught as a replay, never counted twice
                if code != grpc.StatusCode.UNAVAILABLE or self._stop.is_set():
                    break
                self._stop.wait(0.2 * (attempt + 1))
        log.warning("node %s: round %d submit failed: %s", self.core.node_id, round_index, code)
        return code

    def stop(self, grace: float = 1.0) -> None:
        """Stop the stream thread, the round worker and the server."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5)
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._preparer.shutdown(wait=True, cancel_futures=True)
        self._server.stop(grace).wait()
        self._channel.close()

    def wait(self) -> None:
        """Block until the node's server terminates (after stop())."""
        self._server.wait_for_termination()


def start_node_with_shard(
    node_id: str,
    shard: UserShard,
    shuffler_address: str,
    listen: str = "127.0.0.1:0",
    channel_credentials: grpc.ChannelCredentials | None = None,
    server_credentials: grpc.ServerCredentials | None = None,
    policy: UserPolicy | Sequence[UserPolicy] | None = None,
    *,
    rng: np.random.Generator | None = None,
    verifier=None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    state_dir: Path | None = None,
    submit_chunk_bytes: int = grpc_options.SUBMIT_CHUNK_BYTES,
    model: tuple[ModelPlugin, ModelIdentity] | None = None,
    spec_verifier: SpecVerifier | None = None,
) -> ClientNodeHandle:
    """Start a node for an explicit shard (tests, benchmarks); start_node loads the shard from the config.
    With state_dir, the users' spend is kept in state_dir/<node_id>.spend.sqlite (else in memory); model is the
    plug-in the node computes with (None: the built-in tasks); spec_verifier, the check of the analyzer's signature
    on every spec (with a PKI; None: insecure mode, specs taken as relayed)."""
    store = None
    if state_dir is not None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        store = SqliteSpendStore(Path(state_dir) / f"{node_id}.spend.sqlite")
    core = NodeCore(node_id, shard, policy, rng, verifier, spend_store=store, model=model, spec_verifier=spec_verifier)
    return ClientNodeHandle(
        core,
        shuffler_address,
        listen,
        channel_credentials,
        server_credentials,
        interceptors=interceptors,
        submit_chunk_bytes=submit_chunk_bytes,
    )


def start_node(
    node_id: str,
    config,
    node_index: int,
    num_nodes: int,
    shuffler_address: str,
    listen: str = "127.0.0.1:0",
    channel_credentials: grpc.ChannelCredentials | None = None,
    server_credentials: grpc.ServerCredentials | None = None,
    policy: UserPolicy | Sequence[UserPolicy] | None = None,
    *,
    rng: np.random.Generator | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    state_dir: Path | None = None,
    spec_verifier: SpecVerifier | None = None,
) -> ClientNodeHandle:
    """The client-node entry point (issue 4 contract): users = shuffledp.data.user_shard of config.data; their
    policy is `policy` or else the configuration's [policy] section; their spend persists in state_dir. With
    [model] module set, the node loads that plug-in here, from what is installed on it (shuffledp.models.plugin)."""
    from shuffledp.data import load_user_shard
    from shuffledp.models.plugin import build_model, model_identity

    t0 = time.monotonic()
    data = config.data
    ids, X, y, features, classes = load_user_shard(
        data, config.model.task, node_index, num_nodes, data.examples_per_user, data.max_users
    )
    log.info("node %s: %d users' data loaded (%.2f s)", node_id, len(ids), time.monotonic() - t0)
    model = None
    if config.model.module:
        plugin = build_model(config.model, features, classes)
        model = (plugin, model_identity(config.model, plugin))
        log.info("node %s: model %s (dim %d, digest %s)", node_id, model[1].name, plugin.dim, model[1].digest[:12])
    if policy is None:
        fields = asdict(config.policy)
        policy = UserPolicy(**{**fields, "allowed_protocols": frozenset(fields["allowed_protocols"])})
    return start_node_with_shard(
        node_id,
        UserShard(ids, X, y),
        shuffler_address,
        listen,
        channel_credentials,
        server_credentials,
        policy,
        rng=rng,
        interceptors=interceptors,
        state_dir=state_dir,
        model=model,
        spec_verifier=spec_verifier,
    )
