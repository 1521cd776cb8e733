"""mTLS for every shuffledp gRPC hop, and authorization by the role written into each certificate.

Every service requires a client certificate signed by the project CA (shuffledp.security.pki) and then checks, per
method, that the caller's role may call it (RoleInterceptor). Plain text exists only when a caller asks for
it explicitly (insecure=True, used by `shuffledp run` on loopback) and always logs a warning.

Typical server:

    sec = ServerSecurity(pki_dir, "shuffler", "shuffler")          # or ServerSecurity.insecure_loopback()
    server = grpc.server(
        pool,
        interceptors=sec.interceptors({"/shuffledp.v1.Shuffler/": {"client-node"}}),
        options=grpc_options.server_options(),  # among others: an address in use is refused, not shared
    )
    port = sec.add_port(server, "0.0.0.0:50052")

Typical client:

    chan = ChannelSecurity(pki_dir, "client-node", "client-0").channel("shuffler:50052", server_name="shuffler")
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import grpc
from cryptography import x509

from shuffledp.security import pki
from shuffledp.security.pki import Identity
from shuffledp.transport import grpc_options

log = logging.getLogger(__name__)

ANY_ROLE = "*"  # in an allow-list: any role that pki issues (still requires a valid certificate)
_LOOPBACK_NAMES = {"localhost", "ip6-localhost"}

# Who may call what (proto/shuffledp/v1/shuffledp.proto). Design section 1: the operator drives the analyzer,
# the analyzer drives rounds at the shuffler, client nodes only talk to the shuffler; nothing else is allowed
# (unlisted methods are denied). Health checks are open to every authenticated party (compose healthchecks).
DEFAULT_POLICY: dict[str, frozenset[str]] = {
    "/shuffledp.v1.Analyzer/": frozenset({pki.ROLE_OPERATOR}),
    "/shuffledp.v1.Shuffler/ExecuteRound": frozenset({pki.ROLE_ANALYZER}),
    "/shuffledp.v1.Shuffler/GetPopulation": frozenset({pki.ROLE_ANALYZER}),
    "/shuffledp.v1.Shuffler/FinishAggregation": frozenset({pki.ROLE_ANALYZER}),
    "/shuffledp.v1.Shuffler/RegisterUsers": frozenset({pki.ROLE_CLIENT_NODE}),
    "/shuffledp.v1.Shuffler/Subscribe": frozenset({pki.ROLE_CLIENT_NODE}),
    "/shuffledp.v1.Shuffler/Submit": frozenset({pki.ROLE_CLIENT_NODE}),
    "/shuffledp.v1.Shuffler/Connect": frozenset({pki.ROLE_CLIENT_NODE}),
    "/shuffledp.v1.ClientNode/": frozenset({pki.ROLE_OPERATOR}),
    "/grpc.health.v1.Health/": frozenset({ANY_ROLE}),
    # Watch holds a stream open per caller and nothing here uses it (healthchecks call Check): refused to all
    "/grpc.health.v1.Health/Watch": frozenset(),
}


def server_credentials(pki_dir: str | os.PathLike[str], role: str, name: str) -> grpc.ServerCredentials:
    """TLS server credentials of party `name` that require and verify a client certificate from the CA."""
    m = pki.load_party(pki_dir, role, name)  # every file checked: one line naming a bad one (issue 24 item 11)
    return grpc.ssl_server_credentials([(m.key, m.cert)], root_certificates=m.ca, require_client_auth=True)


def channel_credentials(pki_dir: str | os.PathLike[str], role: str, name: str) -> grpc.ChannelCredentials:
    """TLS channel credentials that trust only the project CA and present party `name`'s certificate."""
    m = pki.load_party(pki_dir, role, name)
    return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)


@functools.lru_cache(maxsize=1024)
def _identity_from_pem(pem: bytes) -> Identity | None:
    try:
        return pki.identity_of(x509.load_pem_x509_certificate(pem))
    except ValueError:
        return None


def peer_identity(context: grpc.ServicerContext) -> Identity | None:
    """Role and name of the authenticated peer (from its verified certificate), or None if there is none."""
    pems = context.auth_context().get("x509_pem_cert") or []
    if len(pems) != 1:
        return None
    return _identity_from_pem(bytes(pems[0]))


@functools.lru_cache(maxsize=1024)
def _serial_from_pem(pem: bytes) -> int | None:
    try:
        return x509.load_pem_x509_certificate(pem).serial_number
    except ValueError:
        return None


class RevocationList:
    """The CA's list of revoked certificates, pki.CRL_FILE in the PKI directory (`shuffledp pki revoke` writes it),
    for a server that authenticates client nodes: refusal(context) says why the caller's certificate is revoked.

    The file is read again when it changes (mtime, size or inode; checked at each call, a stat) and used only once its
    signature verifies against the CA: an unsigned, foreign or corrupt list is refused with a log line and the one in
    force stays, so that whoever can write the file but holds no CA key can neither revoke nor restore anyone. At
    start such a file is an error (ValueError naming it): a server does not start without the list it was given. No
    file at start: nothing is revoked; a file removed later leaves the last list in force. Works with any server's
    context (grpc or grpc.aio): it needs only auth_context().
    """

    def __init__(self, pki_dir: str | os.PathLike[str]) -> None:
        self.path = Path(pki_dir) / pki.CRL_FILE
        self._ca = x509.load_pem_x509_certificate((Path(pki_dir) / pki.CA_CERT_FILE).read_bytes())
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None  # of the file last read (used or refused)
        self._serials: frozenset[int] = frozenset()
        stamp = self._file_stamp()  # before the read: a change after it is read again at the next call
        if stamp is not None:
            self._serials = frozenset(entry.serial_number for entry in pki.verified_crl(self.path, self._ca))
            self._stamp = stamp

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def serials(self) -> frozenset[int]:
        """Serial numbers of the revoked certificates, the file read again if it changed since."""
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return self._serials
        with self._lock:
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    crl = pki.verified_crl(self.path, self._ca)
                except (OSError, ValueError) as exc:
                    log.error("%s; not used: %d certificate(s) stay revoked", exc, len(self._serials))
                else:
                    self._serials = frozenset(entry.serial_number for entry in crl)
                    log.info("%s: %d certificate(s) revoked", self.path, len(self._serials))
        return self._serials

    def refusal(self, context: grpc.ServicerContext) -> str | None:
        """Why the caller's certificate is refused ("certificate of client-7 is revoked (serial ...)"), or None if it
        is not revoked (or there is none: plain text)."""
        pems = context.auth_context().get("x509_pem_cert") or []
        if len(pems) != 1:
            return None
        pem = bytes(pems[0])
        serial = _serial_from_pem(pem)
        if serial is None or serial not in self.serials():
            return None
        ident = _identity_from_pem(pem)
        who = ident.name if ident is not None else "the caller"
        return f"certificate of {who} is revoked (serial {serial:x}, {self.path.name} of its CA)"


def peer_role(context: grpc.ServicerContext) -> str | None:
    """Role of the authenticated peer, or None (no certificate, or one without a valid shuffledp role)."""
    ident = peer_identity(context)
    return ident.role if ident else None


def _service_of(method: str) -> str:
    # "/pkg.Service/Method" -> "pkg.Service"
    return method.lstrip("/").split("/", 1)[0]


class DecodeInterceptor(grpc.ServerInterceptor):
    """Decode each request only after a check of the caller has passed, and answer undecodable bytes with
    INVALID_ARGUMENT instead of gRPC's INTERNAL (issue 10 item 9).

    gRPC deserialises a request before any servicer code runs, so an unauthorised caller's bytes would be parsed
    (and their failures handled by grpcio's error path) before the role check. The wrapped handler receives the raw
    bytes, runs the check (nothing here; the role check in RoleInterceptor), then decodes. Used alone in plain-text
    mode, where there are no identities to check. aio() is the same interceptor for a grpc.aio server.
    """

    def _refusal(self, method: str) -> Callable[[grpc.ServicerContext], str | None] | None:
        """The check of a call of `method`: why its caller is refused (PERMISSION_DENIED), None if it is not."""
        return None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        return _wrap_handler(handler, details.method, self._refusal(details.method))

    def aio(self) -> grpc.aio.ServerInterceptor:
        """This interceptor for a grpc.aio server (the shuffler's)."""
        return _AioGuard(self)


class _AioGuard(grpc.aio.ServerInterceptor):
    """DecodeInterceptor's check and decoding around a grpc.aio server's (async) handlers."""

    def __init__(self, sync: DecodeInterceptor) -> None:
        self._sync = sync

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        return _wrap_aio_handler(handler, details.method, self._sync._refusal(details.method))


class RoleInterceptor(DecodeInterceptor):
    """Allow a method only to peers whose certificate role is listed for it; deny everything unlisted.

    `allowed` maps a full method name ("/pkg.Service/Method"), or a service ("/pkg.Service/",
    "pkg.Service"), to the set of roles (or {ANY_ROLE}). An exact method entry wins over its service entry.
    The check runs before the request is decoded (DecodeInterceptor).
    """

    def __init__(self, allowed: Mapping[str, Iterable[str]]):
        self._methods: dict[str, frozenset[str]] = {}
        self._services: dict[str, frozenset[str]] = {}
        for key, roles in allowed.items():
            roles = frozenset(roles)
            bad = roles - set(pki.ROLES) - {ANY_ROLE}
            if bad:
                raise ValueError(f"allowed[{key!r}] has unknown roles {sorted(bad)}; allowed: {pki.ROLES} or '*'")
            stripped = key.strip("/")
            if "/" in stripped:
                self._methods["/" + stripped] = roles
            elif stripped:
                self._services[stripped] = roles
            else:
                raise ValueError(f"allowed key {key!r} names no method or service")

    def roles_for(self, method: str) -> frozenset[str]:
        """Roles allowed to call full method name `method` (empty: nobody)."""
        if method in self._methods:
            return self._methods[method]
        return self._services.get(_service_of(method), frozenset())

    def _refusal(self, method: str) -> Callable[[grpc.ServicerContext], str | None]:
        roles = self.roles_for(method)

        def refusal(context: grpc.ServicerContext) -> str | None:
            ident = peer_identity(context)
            if ident is None:
                return f"{method}: no shuffledp client certificate role"
            if ANY_ROLE not in roles and ident.role not in roles:
                who = "nobody" if not roles else ", ".join(sorted(roles))
                return f"{method}: role {ident.role!r} ({ident.name}) may not call this method; allowed: {who}"
            return None

        return refusal


MAX_STATUS_DETAILS = 512  # characters of a status message: it must never carry a caller's unbounded input back


def clip_details(text: str) -> str:
    """A status message cut to MAX_STATUS_DETAILS characters (gRPC drops a call whose trailing metadata is too large,
    so an error echoing a 17 KB id would reach the caller as RESOURCE_EXHAUSTED instead of its real status)."""
    return text if len(text) <= MAX_STATUS_DETAILS else text[: MAX_STATUS_DETAILS - 3] + "..."


def _decoder(handler: grpc.RpcMethodHandler, method: str) -> Callable[[bytes], tuple[Any, None] | tuple[None, str]]:
    """(request, None) for raw bytes, or (None, why) if they are not a valid request (INVALID_ARGUMENT)."""
    decode = handler.request_deserializer

    def parse(raw: bytes) -> tuple[Any, None] | tuple[None, str]:
        if decode is None:  # the behaviour takes raw bytes (the shuffler's decode off its event loop)
            return raw, None
        try:
            return decode(raw), None
        except Exception:  # any decoding failure is the caller's malformed request, never an internal error
            return None, f"{method}: the request is not a valid message"

    return parse


def _wrap_handler(
    handler: grpc.RpcMethodHandler, method: str, refusal: Callable[[grpc.ServicerContext], str | None] | None
) -> grpc.RpcMethodHandler:
    """The same handler, taking raw request bytes: `refusal(context)` first, then decode, then the behaviour."""
    parse = _decoder(handler, method)

    def decoded(raw: bytes, context: grpc.ServicerContext) -> Any:
        request, why = parse(raw)
        if why is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        return request

    def guard(behaviour: Callable[[Any, grpc.ServicerContext], Any], streaming_request: bool) -> Callable:
        def guarded(request_or_iterator: Any, context: grpc.ServicerContext, *rest: Any) -> Any:
            # rest: the response callback grpcio passes to a non-blocking behaviour
            if refusal is not None and (why := refusal(context)) is not None:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            if streaming_request:
                return behaviour((decoded(raw, context) for raw in request_or_iterator), context, *rest)
            return behaviour(decoded(request_or_iterator, context), context, *rest)

        # grpcio reads these from the behaviour: the health service's Watch is non-blocking (no thread per open
        # stream); dropping the flag would let a few open Watch streams take every worker thread
        for attr in ("experimental_non_blocking", "experimental_thread_pool"):
            if hasattr(behaviour, attr):
                setattr(guarded, attr, getattr(behaviour, attr))
        return guarded

    return _handler_like(handler, guard)


def _handler_like(handler: grpc.RpcMethodHandler, guard: Callable[[Callable, bool], Callable]) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` whose behaviour is guard(behaviour, request_streaming), taking raw
    request bytes."""
    kw = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(guard(handler.unary_unary, False), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(guard(handler.unary_stream, False), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(guard(handler.stream_unary, True), **kw)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(guard(handler.stream_stream, True), **kw)
    raise ValueError("RPC method handler has no behaviour")


async def aio_responses(result: Any) -> Any:
    """The responses of a grpc.aio response-streaming behaviour's `result`: an async generator's, passed on; or none,
    once a coroutine that writes its responses with context.write (the health service's Watch) has ended."""
    if hasattr(result, "__aiter__"):
        async for response in result:
            yield response
    else:
        await result


def _wrap_aio_handler(
    handler: grpc.RpcMethodHandler, method: str, refusal: Callable[[grpc.ServicerContext], str | None] | None
) -> grpc.RpcMethodHandler:
    """_wrap_handler for a grpc.aio server: the behaviours are coroutines, or async generators when they stream."""
    parse = _decoder(handler, method)

    async def decoded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        request, why = parse(raw)
        if why is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        return request

    async def decoded_stream(raws: Any, context: grpc.aio.ServicerContext) -> Any:
        async for raw in raws:
            yield await decoded(raw, context)

    async def prepared(request_or_iterator: Any, context: grpc.aio.ServicerContext, streaming_request: bool) -> Any:
        if refusal is not None and (why := refusal(context)) is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        if streaming_request:
            return decoded_stream(request_or_iterator, context)
        return await decoded(request_or_iterator, context)

    def guard(behaviour: Callable[[Any, grpc.aio.ServicerContext], Any], streaming_request: bool) -> Callable:
        if handler.response_streaming:

            async def guarded_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                result = behaviour(await prepared(request_or_iterator, context, streaming_request), context)
                async for response in aio_responses(result):
                    yield response

            return guarded_stream

        async def guarded(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(await prepared(request_or_iterator, context, streaming_request), context)

        return guarded

    return _handler_like(handler, guard)


def is_loopback(address: str) -> bool:
    """True for 'host:port' whose host is a loopback address or localhost, or a unix socket (local only)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]")
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plain_text(address: str, what: str = "address") -> None:
    """The one rule for plain text, for every party, on what is bound or dialled (issue 10 item 12): only a literal
    loopback address, `localhost` or a unix socket. A name is never resolved here: what it resolves to can change
    (hosts file, DNS) between this check and the connection."""
    if not is_loopback(address):
        raise ValueError(
            f"{what} {address!r}: plain text (insecure mode) is allowed only on loopback "
            "(127.0.0.1, ::1, localhost, unix:); use a PKI (`shuffledp pki init`) for anything else"
        )


def plain_channel(target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A plain-text channel, to a loopback target only (check_plain_text)."""
    check_plain_text(target, "target")
    return grpc.insecure_channel(target, options=list(options))


class _PartySecurity:
    """Shared constructor of ServerSecurity / ChannelSecurity: mTLS from `pki_dir`, or plain text if asked."""

    def __init__(
        self,
        pki_dir: str | os.PathLike[str] | None,
        role: str,
        name: str,
        insecure: bool = False,
    ):
        if insecure and pki_dir is not None:
            raise ValueError("insecure=True and pki_dir given: choose one")
        if not insecure and pki_dir is None:
            raise ValueError("pki_dir is required unless insecure=True (plain text must be asked for explicitly)")
        self.pki_dir = None if pki_dir is None else Path(pki_dir)
        self.role = role
        self.name = name
        self.insecure = insecure
        # load now: a missing or wrong certificate should fail at start-up, not at the first call
        self._credentials = None if insecure else self._load_credentials()

    def _load_credentials(self) -> Any:
        raise NotImplementedError

    @classmethod
    def insecure_loopback(cls, role: str, name: str) -> Self:
        return cls(None, role, name, insecure=True)


class ServerSecurity(_PartySecurity):
    """How a service listens: mTLS with role checks (default) or, only if asked, plain text on loopback."""

    def _load_credentials(self) -> grpc.ServerCredentials:
        return server_credentials(self.pki_dir, self.role, self.name)

    def interceptors(self, allowed: Mapping[str, Iterable[str]]) -> list[grpc.ServerInterceptor]:
        """Interceptors to pass to grpc.server(): the role check, or none in insecure mode (no identities)."""
        if self.insecure:
            log.warning("%s %s: INSECURE mode, no authentication or role checks on any RPC", self.role, self.name)
            return [DecodeInterceptor()]
        return [RoleInterceptor(allowed)]

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Bind `address` ('host:port', port 0 = any free) with TLS, or plain text on loopback only."""
        if self.insecure:
            check_plain_text(address, "listen address")
            log.warning("%s %s: listening WITHOUT TLS on %s (insecure mode)", self.role, self.name, address)
        return grpc_options.bind_server(server, address, self._credentials)  # BindError if in use


class ChannelSecurity(_PartySecurity):
    """How a party connects: mTLS presenting its certificate (default) or, only if asked, plain text."""

    def _load_credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.pki_dir, self.role, self.name)

    def channel(
        self, target: str, server_name: str | None = None, options: Sequence[tuple[str, Any]] = ()
    ) -> grpc.Channel:
        """A channel to `target`. `server_name` (e.g. "shuffler") is the name the server's certificate must
        carry; give it whenever the target is an IP or localhost, which every certificate lists."""
        opts = list(options)
        if self.insecure:
            log.warning("%s %s: connecting WITHOUT TLS to %s (insecure mode)", self.role, self.name, target)
            return plain_channel(target, opts)
        if server_name is not None:
            opts.append(("grpc.ssl_target_name_override", server_name))
        return grpc.secure_channel(target, self._credentials, options=opts)
