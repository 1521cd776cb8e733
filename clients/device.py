"""Device nodes: a client node that hosts one user (a phone, a browser), and a fleet runner that runs K of them on one
asyncio event loop (issue 44 item 2).

A device runs the same per-user code as every client node: NodeCore (clients/node.py) over a one-user shard, with
the user's own policy, durable spend store, CSPRNG, and the check of the analyzer's signature on every spec
(shuffledp.transport.spec_signing), so the user's guarantee is the one a node hosting many users gives it. Only the
connection
is lighter: where ClientNodeHandle has a thread for its stream, a worker, a preparer and a gRPC server of its own
(status and health), a device is one grpc.aio channel with its own mTLS identity and a few coroutines, and serves
nothing. NodeCore's CPU work (gradients, the randomizer, sealing, the spend store's fsync) runs in a small thread
pool the fleet shares, off the event loop; a check-in's preparation in one thread of lower priority.

The wire protocol is ClientNodeHandle's: RegisterUsers, then a Connect stream; reconnect with jittered exponential
backoff; invitations answered one at a time in order; a contribution split if large (split_contribution); results
matched by seq; a contribution whose result the broken stream never brought sent again by unary Submit (the same
nonces: a copy that did arrive is caught as a replay, never counted twice); users whose messages could not be
delivered reported as refusals "submit_failed_<status>".

Spend stores: each device keeps its user's record in its own SQLite file, the file a node would keep
(state_dir/<node id>.spend.sqlite, same format), open only while it is read or written (spend_store.DeviceSpendStore):
held open, 10^4 stores would need 3 x 10^4 descriptors besides the sockets, and one shared database would put every
user's account in one file that any device's bug could corrupt.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from cryptography import x509
from shuffledp.clients.contribution import split_contribution
from shuffledp.clients.node import SUBMIT_FAILED_PREFIX, NodeCore, UserShard, _lower_priority
from shuffledp.clients.policy import UserPolicy
from shuffledp.clients.spend_store import DeviceSpendStore, MemorySpendStore

from shuffledp.security import pki
from shuffledp.security.rng import make_rng
from shuffledp.transport import grpc_options, tls
from shuffledp.transport.spec_signing import SpecSignatureInvalid, SpecVerifier
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

__all__ = ["DeviceNode", "Fleet", "start_fleet", "COMPUTE_THREADS"]

log = logging.getLogger(__name__)

COMPUTE_THREADS = 2  # the fleet's pool for NodeCore.handle: CPU-bound (one per core here) plus the stores' fsyncs
RESULT_TIMEOUT_S = 60.0  # as ClientNodeHandle._deliver
CONNECTING = 64  # a fleet's connection attempts in flight at once (_Shared.connecting)
_END = object()


@dataclass(frozen=True)
class _Shared:
    """What the devices of one fleet share: the thread pools, and the connection settings."""

    compute: futures.ThreadPoolExecutor
    prepare: futures.ThreadPoolExecutor
    backoff: tuple[float, float]
    chunk: int
    # connection attempts in flight at once (TLS handshake, RegisterUsers, Connect until subscribed): 10^4 devices
    # dialling together made the shuffler cancel thousands of calls it had no time to pick up, and retry storms
    # followed (bench_devices.py: 9,400 failed attempts, all connected after 100-186 s)
    connecting: asyncio.Semaphore


def _handle(core: NodeCore, inv: pb.Invitation) -> tuple[pb.Contribution, bool]:
    """core.handle(inv), and whether inv was a check-in's first invitation (as ClientNodeHandle._answer asks)."""
    contribution = core.handle(inv)
    try:
        spec = core.spec_of(inv)  # as handle() verified it (kept)
        checking_in = bool(spec.check_in.noise_trials and not spec.check_in.checked_in)
    except SpecSignatureInvalid:
        checking_in = False
    return contribution, checking_in


def _prepare(core: NodeCore, inv: pb.Invitation) -> None:
    try:
        core.prepare(inv)
    except Exception:  # a failed preparation only costs its time: the second invitation starts over
        log.exception("device %s: failed to prepare a check-in's round", core.node_id)


async def _drain(out: asyncio.Queue):
    """The request iterator of a Connect call."""
    while (msg := await out.get()) is not _END:
        yield msg


class DeviceNode:
    """One device: NodeCore over its one user, a grpc.aio channel with the device's own credentials. Lives on the
    fleet's event loop (create it there)."""

    def __init__(
        self, core: NodeCore, shuffler_address: str, credentials: grpc.ChannelCredentials | None, shared: _Shared
    ) -> None:
        self.core = core
        self._shared = shared
        # a subchannel pool of its own: its connection ends when the channel closes (the global pool keeps it)
        options = [*grpc_options.node_channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        if credentials is None:
            tls.check_plain_text(shuffler_address, "target")
            self._channel = grpc.aio.insecure_channel(shuffler_address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(shuffler_address, credentials, options=options)
        self._stub = pbg.ShufflerStub(self._channel)
        self.connected = False  # the stream is open from this side (the shuffler may not count it yet)
        self._out: asyncio.Queue | None = None  # the open stream's requests; None: no stream
        self._seq = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._busy = asyncio.Lock()  # invitations answered one at a time, in order (FIFO), as by a node's one worker
        self._preparing: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()
        self.task: asyncio.Task | None = None
        # a device switched off mid-round (tests): it vanishes once its check-in to this round reached the shuffler
        self.drop_after_check_in: int | None = None
        # ... or as this round's check-in is computed, before it is sent: it never answers the round (tests)
        self.drop_before_check_in: int | None = None
        # a straggler (tests): (round, whether the check-in) -> seconds its answer waits between being computed (and
        # charged) on time and being sent
        self.delays: dict[tuple[int, bool], float] = {}

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"device-{self.core.node_id}")

    # ----- the connection ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        core, delay, failures = self.core, self._shared.backoff[0], 0
        while True:
            try:
                async with self._shared.connecting:  # a bounded number of the fleet's devices dial at once
                    await self._stub.RegisterUsers(
                        pb.RegisterUsersRequest(node_id=core.node_id, user_ids=core.shard.user_ids), timeout=120
                    )
                    self._out, self._seq = asyncio.Queue(), 0
                    self._out.put_nowait(pb.NodeMessage(subscribe=pb.SubscribeRequest(node_id=core.node_id)))
                    call = self._stub.Connect(_drain(self._out))
                    # connected once the shuffler says so: a refused stream (its capacity, a quota) is a failure to
                    # back off from, not a connection (the retry delay and the log line were reset by each refusal)
                    subscribed = grpc_options.subscribed(await call.initial_metadata())
                if subscribed:
                    self.connected, delay, failures = True, self._shared.backoff[0], 0
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "invitation":
                        self._spawn(self._serve(msg.invitation))
                    elif kind == "result" and (fut := self._pending.pop(msg.result.seq, None)) is not None:
                        fut.set_result(msg.result)
            except grpc.aio.AioRpcError as exc:
                failures += 1
                # one line per outage, not one per retry (10^4 devices retrying every few seconds would flood the log)
                (log.warning if failures == 1 else log.debug)(
                    "device %s: shuffler stream failed (%s: %s); reconnecting", core.node_id, exc.code(), exc.details()
                )
            finally:
                self._close_stream()
            # jittered exponential backoff (the jitter comes from the OS CSPRNG; it carries no privacy)
            await asyncio.sleep(delay * (0.5 + secrets.randbelow(1000) / 1000))
            delay = min(delay * 2, self._shared.backoff[1])

    def _close_stream(self) -> None:
        """The stream ended: every contribution still waiting gets None (its sender falls back to Submit)."""
        self.connected = False
        if self._out is not None:
            self._out.put_nowait(_END)
            self._out = None
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_result(None)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # a reference until it ends (the loop keeps only weak ones)
        task.add_done_callback(self._tasks.discard)

    def _send(self, contribution: pb.Contribution) -> tuple[pb.Contribution, asyncio.Future | None]:
        """On the current stream: (the contribution as sent, its result's future); None: no stream (use Submit)."""
        if self._out is None:
            return contribution, None
        self._seq += 1
        fut = asyncio.get_running_loop().create_future()
        self._pending[self._seq] = fut
        msg = pb.NodeMessage(seq=self._seq, contribution=contribution)
        self._out.put_nowait(msg)
        return msg.contribution, fut

    # ----- one invitation ---------------------------------------------------------------------------------------
    async def _serve(self, inv: pb.Invitation) -> None:
        async with self._busy:
            await self._answer(inv)

    async def _answer(self, inv: pb.Invitation) -> None:
        loop = asyncio.get_running_loop()
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            await asyncio.wait([preparing])  # the last check-in's preparation is ready (or failed) before any draw
        try:
            contribution, checking_in = await loop.run_in_executor(self._shared.compute, _handle, self.core, inv)
        except Exception:  # a bug for one round must not kill the device
            log.exception("device %s: failed to compute an invitation", self.core.node_id)
            return
        if not (contribution.messages or contribution.refusals or contribution.HasField("columns")):
            return  # a notice of a round this device's user was not invited to
        round_index = contribution.round
        if checking_in and self.drop_before_check_in == round_index:
            await self.vanish()
            return
        if delay := self.delays.get((round_index, checking_in)):
            await asyncio.sleep(delay)
        sent = [self._send(part) for part in split_contribution(contribution, self._shared.chunk)]
        del contribution
        if checking_in:  # computed while the second invitation is a round trip away (the next answer waits for it)
            self._preparing = loop.run_in_executor(self._shared.prepare, _prepare, self.core, inv)
        for part, fut in sent:
            code = await self._deliver(part, fut, round_index)
            if code is not None and (senders := [m.user_id for m in part.messages] + list(part.columns.user_ids)):
                # the operator sees why this user is missing: a refusal with the cause (the user stays charged)
                note = pb.Contribution(run_id=part.run_id, round=part.round, node_id=part.node_id)
                note.refusals.extend(
                    pb.Refusal(user_id=u, reason=SUBMIT_FAILED_PREFIX + code.name.lower()) for u in senders
                )
                await self._deliver(*self._send(note), round_index)
        if checking_in and self.drop_after_check_in == round_index:
            await self.vanish()

    async def _deliver(
        self, contribution: pb.Contribution, fut: asyncio.Future | None, round_index: int
    ) -> grpc.StatusCode | None:
        """The outcome of a contribution sent on the stream (fut: its result), or, when it was not sent or the stream
        ended before its result came, of a unary Submit of it. None on success, else the status code."""
        result = None
        if fut is not None:
            try:
                result = await asyncio.wait_for(fut, RESULT_TIMEOUT_S)
            except TimeoutError:
                log.warning("device %s: round %d: no result on the stream in 60 s", self.core.node_id, round_index)
                return grpc.StatusCode.DEADLINE_EXCEEDED
        if result is None:
            return await self._submit(contribution, round_index)
        if result.status:
            log.warning("device %s: round %d submit failed: %s", self.core.node_id, round_index, result.status)
            return getattr(grpc.StatusCode, result.status, grpc.StatusCode.UNKNOWN)
        self._log_ack(result.ack, round_index)
        return None

    async def _submit(self, contribution: pb.Contribution, round_index: int) -> grpc.StatusCode | None:
        """Unary Submit with retries on UNAVAILABLE; None on success, else the final status code."""
        code = None
        for attempt in range(3):
            try:
                self._log_ack(await self._stub.Submit(contribution, timeout=60), round_index)
                return None
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                # same nonces on retry: a copy that did arrive is caught as a replay, never counted twice
                if code != grpc.StatusCode.UNAVAILABLE:
                    break
                await asyncio.sleep(0.2 * (attempt + 1))
        log.warning("device %s: round %d submit failed: %s", self.core.node_id, round_index, code)
        return code

    def _log_ack(self, ack: pb.ContributionAck, round_index: int) -> None:
        if ack.rejected:
            log.warning("device %s: round %d: shuffler rejected %s", self.core.node_id, round_index, dict(ack.rejected))

    # ----- the end ----------------------------------------------------------------------------------------------
    async def vanish(self) -> None:
        """End at once, as a device that is switched off does: no goodbye, nothing more answered or sent."""
        current = asyncio.current_task()
        others = [t for t in (self.task, *self._tasks) if t is not None and t is not current]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        self.task = None
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            # cancels its calls (the shuffler sees the stream end); the connection closes once the channel is freed
            await channel.close(grace=None)
        self._close_stream()


class Fleet:
    """K device nodes on one event loop in a thread of their own; NodeCore's work in a shared pool of `workers`
    threads. The devices start connecting at once; `connected()` counts the open streams."""

    def __init__(
        self,
        cores: Sequence[NodeCore],
        shuffler_address: str,
        credentials: Sequence[grpc.ChannelCredentials | None] | None = None,
        *,
        workers: int = COMPUTE_THREADS,
        backoff: tuple[float, float] = (0.1, 5.0),
        submit_chunk_bytes: int = grpc_options.SUBMIT_CHUNK_BYTES,
    ) -> None:
        if credentials is not None and len(credentials) != len(cores):
            raise ValueError(f"{len(cores)} devices but {len(credentials)} credentials")
        prepare = futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-prepare", initializer=_lower_priority)
        compute = futures.ThreadPoolExecutor(workers, thread_name_prefix="fleet-compute")
        self._shared = _Shared(compute, prepare, backoff, int(submit_chunk_bytes), asyncio.Semaphore(CONNECTING))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet-loop", daemon=True)
        self._thread.start()
        creds = credentials if credentials is not None else [None] * len(cores)

        async def start() -> list[DeviceNode]:
            devices = [DeviceNode(c, shuffler_address, cr, self._shared) for c, cr in zip(cores, creds, strict=True)]
            for d in devices:
                d.start()
            return devices

        self.devices: list[DeviceNode] = self._call(start())

    def _call(self, coro, timeout: float | None = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def connected(self) -> int:
        """Devices whose stream is open (from their side)."""
        return sum(d.connected for d in self.devices)

    def drop_after_check_in(self, i: int, round_index: int) -> None:
        """Device i vanishes once its check-in to round round_index has reached the shuffler (a device switched off
        mid-round: after it checked in, before the round's second invitation)."""
        self._loop.call_soon_threadsafe(setattr, self.devices[i], "drop_after_check_in", round_index)

    def drop_before_check_in(self, i: int, round_index: int) -> None:
        """Device i vanishes as its check-in to round round_index is computed, before it is sent (a device switched off
        mid-round: invited, it never answers)."""
        self._loop.call_soon_threadsafe(setattr, self.devices[i], "drop_before_check_in", round_index)

    def straggle(self, i: int, round_index: int, seconds: float, *, check_in: bool = False) -> None:
        """Device i's answer to round round_index (its check-in with check_in=True, else its report) leaves `seconds`
        after it was computed: a report is charged on time and sent late (a straggler)."""
        self._loop.call_soon_threadsafe(self.devices[i].delays.__setitem__, (round_index, check_in), float(seconds))

    def vanish(self, i: int) -> None:
        """Device i ends at once (DeviceNode.vanish)."""
        self._call(self.devices[i].vanish())

    def stop(self) -> None:
        """Every device vanishes; the loop and the pools end."""
        if not self._loop.is_closed():

            async def vanish_all() -> None:
                await asyncio.gather(*(d.vanish() for d in self.devices))
                # what grpc.aio left running for the closed calls ends here, not with the loop
                rest = asyncio.all_tasks() - {asyncio.current_task()}
                for task in rest:
                    task.cancel()
                await asyncio.gather(*rest, return_exceptions=True)

            try:  # 10^4 devices closing their calls during a connection storm took longer than a minute
                self._call(vanish_all(), timeout=60.0 + len(self.devices) / 100)
            except TimeoutError:
                log.warning("fleet: %d devices did not all end in time; stopping their loop anyway", len(self.devices))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
        self._shared.compute.shutdown(wait=True, cancel_futures=True)
        self._shared.prepare.shutdown(wait=True, cancel_futures=True)


def start_fleet(
    config,
    first_index: int,
    count: int,
    num_nodes: int,
    shuffler_address: str,
    *,
    pki_dir: Path | None = None,
    state_dir: Path | None = None,
    workers: int = COMPUTE_THREADS,
) -> Fleet:
    """Device nodes first_index .. first_index + count - 1 of num_nodes, each hosting the one user that
    shuffledp.data.user_shard gives node i of num_nodes (ValueError if one hosts another number: num_nodes must be
    the data's number of users). Device i is client-<i>: with pki_dir its certificate (mTLS) and the PKI's CA for the
    analyzer's signature on specs, else plain text on loopback; its user's spend in state_dir/client-<i>.spend.sqlite
    (else in memory). Policy and model plug-in: the configuration's, as start_node reads them."""
    from shuffledp.data import load_user_shards
    from shuffledp.models.plugin import build_model, model_identity

    if num_nodes < 1 or count < 1 or first_index < 0 or first_index + count > num_nodes:
        raise ValueError(f"devices {first_index}..{first_index + count - 1} are not among the {num_nodes} nodes")
    # every device's PKI files first: a bad one is one line before anything is loaded or written
    indices = range(first_index, first_index + count)
    names = [pki.client_node_name(i) for i in indices]
    credentials, ca = None, None
    if pki_dir is not None:
        credentials = [tls.channel_credentials(pki_dir, pki.ROLE_CLIENT_NODE, name) for name in names]
        ca = x509.load_pem_x509_certificate((Path(pki_dir) / pki.CA_CERT_FILE).read_bytes())
    data = config.data
    shards, features, classes = load_user_shards(
        data, config.model.task, indices, num_nodes, data.examples_per_user, data.max_users
    )
    for i, (ids, _, _) in zip(indices, shards, strict=True):
        if len(ids) != 1:
            raise ValueError(
                f"device node {i} of {num_nodes} would host {len(ids)} users: a device hosts one, so the number of "
                "nodes must equal the data's number of users"
            )
    fields = asdict(config.policy)  # as start_node: the configuration's [policy] for every user
    policy = UserPolicy(**{**fields, "allowed_protocols": frozenset(fields["allowed_protocols"])})
    model = None
    if config.model.module:  # one plug-in object for the fleet, called from the pool's threads (not one per device)
        plugin = build_model(config.model, features, classes)
        model = (plugin, model_identity(config.model, plugin))
    if state_dir is not None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
    cores = [
        NodeCore(
            name,
            UserShard(ids, X, y),
            policy,
            make_rng(),
            spend_store=MemorySpendStore()
            if state_dir is None
            else DeviceSpendStore(state_dir / f"{name}.spend.sqlite"),
            model=model,
            spec_verifier=None if ca is None else SpecVerifier(ca),  # each device checks every spec itself
        )
        for name, (ids, X, y) in zip(names, shards, strict=True)
    ]
    return Fleet(cores, shuffler_address, credentials, workers=workers)
