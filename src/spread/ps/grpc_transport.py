"""The RPC layer under the parameter servers and the coordinator, on gRPC (``grpcio``).

Implements the interfaces of :mod:`spread.ps.rpc_api` (:class:`GrpcServer`, :class:`GrpcClient`,
:class:`GrpcStream`), like :mod:`spread.ps.zmq_transport`, so the transport is chosen by name
(:mod:`spread.ps.transports`). Why gRPC: spread's rules ask for a well-kept RPC layer, not a
home-made network stack, and ``torch.distributed.rpc`` unpickles network bytes (forbidden).

How it maps onto gRPC, without protobuf code generation:

* Every method is ``/spread.ps/<name>`` behind one generic handler; request and answer are raw
  bytes holding one :mod:`spread.ps.wire` frame (JSON header and tensor bytes, never pickle). Unary
  methods are ``unary_unary``, streaming methods ``unary_stream``.
* A client opens a session (:mod:`spread.ps.rpc_api`) with a ``_spread_hello`` call (its nonce in,
  the session id, the server's nonce and proof out) and checks the proof before it sends anything
  else. Every later call carries the session id, a sequence number and a MAC (over the method and
  the frame header) in its metadata; the server checks them in constant time, accepts each
  sequence number once, and answers ``UNAUTHENTICATED`` otherwise, before the frame is decoded.
* Answers prove the session too: a unary answer's MAC (bound to the request's sequence number)
  travels in its trailing metadata, a stream's items each start with theirs (bound to their place
  in the stream), and a stream's normal end carries one in its trailing metadata; the client drops
  the call on anything that fails. Error statuses carry no MAC: they can only end a call.
* Outcomes travel as gRPC status codes: a handler's :class:`RequestRefused` is
  ``FAILED_PRECONDITION``, a malformed frame ``INVALID_ARGUMENT``, a request over the size limit
  ``RESOURCE_EXHAUSTED`` (gRPC refuses it from its declared length, before buffering it), a
  handler's fault ``INTERNAL``. The client turns them back into the exceptions the ZeroMQ client
  raises: :class:`JobTokenError`, :class:`WireFormatError` and the client's ``error_type``, each
  naming the server.

* Every connection is mutual TLS keyed by the job token (:func:`tls_identity`): a CA and one
  certificate whose P-256 keys are derived from the token, made byte-identically by every process
  of the job; the server requires a client certificate. Why: the session checks run inside an RPC,
  after gRPC has read the request's body (up to ``max_frame_bytes``), on as many streams as a peer
  opens; now a peer that cannot present the job's certificate fails the TLS handshake and gRPC reads
  no HTTP/2 frame of it (a handshake has ``_HANDSHAKE_MS`` to finish). A client whose handshake
  fails, because the server does not hold the token either, raises :class:`JobTokenError` at once,
  even when it waits for the server to come up. The session protocol stays behind TLS (defence in
  depth: it also binds answers to their requests), and a connection carries at most ``_MAX_STREAMS``
  calls at a time (issue 40, item 3).

Servers bind ``127.0.0.1`` unless given an address (a port in use is an error: ``SO_REUSEPORT`` is
off); every client call has a deadline; :meth:`GrpcServer.stop` joins every thread it started.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

# gRPC's C core logs at INFO to stderr (a line per connection a stopping server closes) unless told
# otherwise; keep a user's own setting. Only effective before gRPC is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from spread.errors import JobTokenError, RemoteCallError, WireFormatError
from spread.ps.rpc_api import (
    MAC_BYTES,
    NONCE_BYTES,
    SESSION_ID_BYTES,
    CallContext,
    CallFailed,
    ClientHandshake,
    Handler,
    Message,
    RpcClient,
    RpcServer,
    RpcStream,
    Session,
    SessionRefused,
    StreamHandler,
    seq_bytes,
)
from spread.ps.wire import DEFAULT_MAX_FRAME_BYTES, decode, encode_parts, header_part

SERVICE = "spread.ps"
HELLO = "_spread_hello"  # built into every server: opens a session (and lets a caller wait for it)
SESSION_KEY, SEQ_KEY, MAC_KEY = "spread-session", "spread-seq", "spread-mac"
REFUSAL_KEY = "spread-refusal"  # "no-session": the server forgot the session (the client opens another)
_REQUEST, _ANSWER = b"grpc-request", b"grpc-answer"  # MAC labels: a request never passes as an answer
_MAX_MESSAGE = (1 << 31) - 1  # gRPC's limits are C ints
_WINDOW = ("grpc.http2.lookahead_bytes", 8 << 20)  # a larger receive window: 4 MB push ~30% faster
_STOP_GRACE = 1.0  # seconds stop() lets calls in flight finish
TLS_NAME = "spread-job.invalid"  # the name in the job's certificate (clients override the target's)
_MAX_STREAMS = 100  # calls one connection may have in flight (HTTP/2's advised minimum); more wait
_HANDSHAKE_MS = 10_000  # a connection that has not finished the TLS handshake by then is dropped
_WAIT_POLL = 0.1  # seconds between handshake attempts while waiting for a server to come up
_REFUSED = grpc.StatusCode.FAILED_PRECONDITION
_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_FAULT = grpc.StatusCode.INTERNAL
_threads_lock = threading.Lock()  # one server at a time looks for the threads gRPC starts for it


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _hex(text: str | None) -> bytes:
    try:
        return bytes.fromhex(text or "")
    except ValueError:
        return b""


class TlsIdentity(NamedTuple):
    """A job's TLS material, in PEM: the CA every process trusts, and the certificate and key every
    server and client presents (all of them hold the token, so one identity serves them all)."""

    root: bytes
    chain: bytes
    key: bytes


_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_VALIDITY = (
    datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC),
    datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC),
)


def _derived_key(token: str, label: bytes) -> ec.EllipticCurvePrivateKey:
    secret = int.from_bytes(hmac.new(token.encode(), label, hashlib.sha256).digest(), "big")
    return ec.derive_private_key(secret % (_P256_ORDER - 1) + 1, ec.SECP256R1())


def _key_usage(*, sign_certificates: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not sign_certificates,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=sign_certificates,
        crl_sign=sign_certificates,
        encipher_only=False,
        decipher_only=False,
    )


@functools.cache
def tls_identity(token: str) -> TlsIdentity:
    """The job's TLS identity, derived from the token alone: keys from HMAC-SHA256(token, label),
    fixed names, serials and dates, RFC 6979 signatures, so every process makes the same bytes without
    exchanging any, and a process without the token can make none that the job's processes accept."""
    ca_key, key = _derived_key(token, b"spread grpc tls ca"), _derived_key(token, b"spread grpc tls peer")
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spread job CA")])
    start, end = _VALIDITY
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(sign_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256(), ecdsa_deterministic=True)
    )
    peer = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(sign_certificates=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256(), ecdsa_deterministic=True)
    )
    pem = serialization.Encoding.PEM
    return TlsIdentity(
        ca.public_bytes(pem),
        peer.public_bytes(pem),
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def server_credentials(token: str) -> grpc.ServerCredentials:
    """Mutual TLS: only a client presenting the job's certificate gets past the handshake."""
    identity = tls_identity(token)
    return grpc.ssl_server_credentials(
        [(identity.key, identity.chain)], root_certificates=identity.root, require_client_auth=True
    )


def channel_credentials(token: str) -> grpc.ChannelCredentials:
    """A client's side of :func:`server_credentials`; it accepts only a server holding the token."""
    identity = tls_identity(token)
    return grpc.ssl_channel_credentials(identity.root, identity.key, identity.chain)


def _tls_refused(exc: grpc.RpcError) -> bool:
    """The server's certificate is not the job's (it holds another token), as opposed to nobody
    listening, a connection lost or a handshake that ran out of time; gRPC says so only in the
    details (a client checks the server's certificate before sending its own)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in (exc.details() or "")


def _metadata(metadata: Any) -> dict[str, str]:
    out = {}
    for key, value in metadata or ():
        out[key] = value if isinstance(value, str) else value.decode("ascii", "replace")
    return out


def _frame(message: Message) -> bytes:
    """One wire frame as one buffer: the tensors' memory is copied once, here (gRPC needs bytes)."""
    return b"".join(encode_parts(*message))


def _identity(data: bytes) -> bytes:
    return data


def _threads_started(action: Callable[[], object], name_suffix: str) -> list[threading.Thread]:
    """The threads named ``...name_suffix`` that ``action`` started (gRPC names its threads after
    their function), so that a server can join what gRPC started for it."""
    with _threads_lock:
        before = set(threading.enumerate())
        action()
        return [t for t in set(threading.enumerate()) - before if t.name.endswith(name_suffix)]


class GrpcCallContext(CallContext):
    """A stream's caller is there while gRPC says the call is active. gRPC reports the end from
    its own thread, possibly while the handler is parked at a ``yield`` it will never resume from:
    the end callbacks then run at once, else when the handler returns."""

    def __init__(self, context: grpc.ServicerContext, server: GrpcServer) -> None:
        super().__init__()
        self._context = context
        self._server = server
        self._lock = threading.Lock()
        self._ended = False
        self._running = True  # the handler's code is executing (not parked at a yield)

    def is_active(self) -> bool:
        return not self._ended and not self._server._stopping.is_set() and self._context.is_active()

    def _terminated(self) -> None:
        """gRPC says the call is over: end now if the handler is parked at a yield (it will not
        be resumed), else leave it to the handler's own end (it sees ``is_active()`` False)."""
        with self._lock:
            if self._running or self._ended:
                return
            self._ended = True
        self._run_end_callbacks()

    def _park(self) -> None:
        with self._lock:
            self._running = False

    def _resume(self) -> bool:
        """Whether the handler may run on (False once the call ended while it was parked)."""
        with self._lock:
            if self._ended:
                return False
            self._running = True
            return True

    def _end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._run_end_callbacks()


class _Dispatcher(grpc.GenericRpcHandler):
    """Routes every call: the handshake, streams, and unary methods (unknown ones are refused by the
    unary path, after the caller's session is checked)."""

    def __init__(self, server: GrpcServer) -> None:
        self._server = server

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        server = self._server
        prefix = f"/{SERVICE}/"
        path = handler_call_details.method
        method = path[len(prefix) :] if path.startswith(prefix) else path
        if method == HELLO:
            return _unary(server._hello)
        if method in server._streams:
            return grpc.unary_stream_rpc_method_handler(
                lambda request, context: server._serve_stream(method, request, context),
                request_deserializer=_identity,
                response_serializer=_identity,
            )
        return _unary(lambda request, context: server._serve_unary(method, request, context))


def _unary(behavior: Callable[[bytes, grpc.ServicerContext], bytes]) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        behavior, request_deserializer=_identity, response_serializer=_identity
    )


class GrpcServer(RpcServer):
    """:class:`~spread.ps.rpc_api.RpcServer` on a gRPC server with one generic handler; gRPC
    refuses a request over ``max_frame_bytes`` from its declared length, unread."""

    transport = "grpc"

    def __init__(
        self,
        name: str,
        handlers: Mapping[str, Handler],
        *,
        token: str,
        stream_handlers: Mapping[str, StreamHandler] | None = None,
        address: str | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        super().__init__(
            name,
            handlers,
            token=token,
            stream_handlers=stream_handlers,
            address=address,
            max_frame_bytes=max_frame_bytes,
        )
        options = [
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
            ("grpc.max_receive_message_length", min(max_frame_bytes, _MAX_MESSAGE)),
            ("grpc.max_send_message_length", -1),
            ("grpc.keepalive_time_ms", 10_000),  # notice a caller whose host died (stream sessions)
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_concurrent_streams", _MAX_STREAMS),
            ("grpc.server_handshake_timeout_ms", _HANDSHAKE_MS),
            _WINDOW,
        ]
        self._server = grpc.server(self._executor, handlers=[_Dispatcher(self)], options=options)
        host, port = self._bind_host, self._bind_port
        detail: object
        try:
            bound = self._server.add_secure_port(_target(host, port), server_credentials(token))
        except RuntimeError as exc:
            bound, detail = 0, exc
        else:
            detail = "the address is in use or not local"
        if not bound:
            self._executor.shutdown(wait=False)
            raise OSError(f"{name}: cannot listen on {host}:{port}: {detail}")
        self.address = f"{host}:{bound}"
        self._serve_thread: threading.Thread | None = None

    def start(self) -> GrpcServer:
        started = _threads_started(self._server.start, "(_serve)")  # gRPC's polling thread
        self._serve_thread = started[0] if len(started) == 1 else None
        return self

    def stop(self) -> None:
        self._stopping.set()  # streams see their calls end (is_active) and return
        # Calls already handled get a moment to deliver their answers (a stop call's own, a
        # stream's last item); what is still running then is cancelled, like closing sockets.
        stopped: list[threading.Event] = []
        cancelling = _threads_started(
            lambda: stopped.append(self._server.stop(_STOP_GRACE)), "(cancel_all_calls_after_grace)"
        )
        stopped[0].wait()
        inside = threading.current_thread()
        for thread in (self._serve_thread, *cancelling):
            if thread is not None and thread is not inside:
                thread.join()  # the cancelling thread ends just after gRPC reports the stop
        self._release_handlers()

    # -- calls -------------------------------------------------------------------------------------
    def _hello(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            session_id, nonce, proof = self._sessions.hello(request)
        except SessionRefused as exc:
            context.abort(_INVALID, f"{self.name}: malformed handshake: {exc}")
        return session_id + nonce + proof

    def _authenticate(
        self, method: str, request: bytes, context: grpc.ServicerContext
    ) -> tuple[Session, bytes]:
        """The call's session and sequence number, or the call is refused (before decoding)."""
        fields = _metadata(context.invocation_metadata())
        session_id, mac = _hex(fields.get(SESSION_KEY)), _hex(fields.get(MAC_KEY))
        try:
            seq = seq_bytes(int(fields.get(SEQ_KEY, "")))
        except (ValueError, OverflowError):
            seq = b""
        try:
            if not seq:
                raise SessionRefused("the call carries no session", unknown=not session_id)
            session = self._sessions.verify(
                session_id, seq, mac, _REQUEST, method.encode(), header_part(request)
            )
        except SessionRefused as exc:
            if not exc.unknown:
                self._count_refusal()
            context.set_trailing_metadata(((REFUSAL_KEY, "no-session" if exc.unknown else "denied"),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self.name} refused the request: {exc}")
        return session, seq

    def _decode(self, request: bytes) -> Message:
        return decode(request, max_tensor_bytes=self._max_frame_bytes)

    def _serve_unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        session, seq = self._authenticate(method, request, context)
        try:
            meta, tensors = self._decode(request)
        except WireFormatError as exc:
            context.abort(_INVALID, f"{self.name}: {exc}")
        try:
            answer = self._invoke(method, meta, tensors)
        except CallFailed as exc:
            context.abort(_FAULT if exc.fault else _REFUSED, str(exc))
        frame = _frame(answer)
        mac = session.mac(_ANSWER, seq, b"OK", header_part(frame))
        context.set_trailing_metadata(((MAC_KEY, mac.hex()),))
        return frame

    def _serve_stream(self, method: str, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        session, seq = self._authenticate(method, request, context)
        try:
            meta, tensors = self._decode(request)
        except WireFormatError as exc:
            context.set_code(_INVALID)
            context.set_details(f"{self.name}: {exc}")
            return
        call = GrpcCallContext(context, self)
        context.add_callback(call._terminated)  # False: already over; is_active() says so
        messages = self._streams[method](meta, tensors, call)
        index = 0
        try:
            for message in messages:
                frame = _frame(message)
                call._park()
                yield session.mac(_ANSWER, seq, b"item", seq_bytes(index), header_part(frame)) + frame
                index += 1
                if not call._resume():
                    return  # the call ended while parked: do not run the handler any further
            if self._stopping.is_set():  # not the handler's own end: the caller must not take it for one
                context.set_code(grpc.StatusCode.UNAVAILABLE)
                context.set_details(f"{self.name}: the server stopped")
                return
            end = session.mac(_ANSWER, seq, b"end", seq_bytes(index))
            context.set_trailing_metadata(((MAC_KEY, end.hex()),))
        except Exception as exc:
            failure = self._failure(method, exc)
            context.set_code(_FAULT if failure.fault else _REFUSED)
            context.set_details(str(failure))
        finally:
            messages.close()
            call._end()


class GrpcClient(RpcClient):
    """:class:`~spread.ps.rpc_api.RpcClient` on one gRPC channel: concurrent calls share it (HTTP/2
    streams over one connection) and one session."""

    def __init__(
        self,
        address: str,
        *,
        peer: str,
        token: str,
        timeout: float = 60.0,
        error_type: type[RemoteCallError] = RemoteCallError,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        super().__init__(
            address,
            peer=peer,
            token=token,
            timeout=timeout,
            error_type=error_type,
            max_frame_bytes=max_frame_bytes,
        )
        self._session: Session | None = None
        self._session_lock = threading.Lock()  # one handshake at a time
        options = [
            ("grpc.enable_http_proxy", 0),  # a proxy set in the environment must not see job traffic
            ("grpc.max_receive_message_length", min(max_frame_bytes, _MAX_MESSAGE)),
            ("grpc.max_send_message_length", -1),
            ("grpc.use_local_subchannel_pool", 1),
            _WINDOW,  # closing this client closes its connection
            # Retry connecting like the socket client polls (a restarted server is found within
            # ~1 s). Not grpc.min_reconnect_backoff_ms: gRPC also uses it as the connect timeout, and
            # 100 ms of it failed first calls on a loaded machine.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.ssl_target_name_override", TLS_NAME),
        ]
        self._channel = grpc.secure_channel(
            _target(self._host, self._port), channel_credentials(token), options=options
        )
        self._unary: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def _method(self, method: str, op: str) -> grpc.UnaryUnaryMultiCallable:
        with self._lock:
            if self._closed:
                raise self._closed_error(op)
            stub = self._unary.get(method)
            if stub is None:
                stub = self._unary[method] = self._channel.unary_unary(
                    f"/{SERVICE}/{method}",
                    request_serializer=_identity,
                    response_deserializer=_identity,
                    _registered_method=False,
                )
            return stub

    def _error(self, exc: grpc.RpcError, op: str, budget: float | None, wait_for_ready: bool) -> Exception:
        """The spread exception for a failed call (the same types the ZeroMQ client raises)."""
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return JobTokenError(f"{self.peer}: {op} refused: {details}")
        if _tls_refused(exc):
            return self._impostor(op)
        if code == _INVALID:
            return WireFormatError(f"{self.peer}: {op} refused: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return WireFormatError(f"{self.peer}: {op} refused: frame over the size limit ({details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            what = "not reachable or no answer" if wait_for_ready else "no answer"
            return self._failed(op, f"{what} within {budget:g}s")
        if code == grpc.StatusCode.UNAVAILABLE:
            return self._failed(op, f"unreachable or connection lost (it died or never started): {details}")
        if code == grpc.StatusCode.CANCELLED and self._closed:
            return self._closed_error(op)
        if code in (_REFUSED, _FAULT):
            return self._failed(op, details)
        return self._failed(op, f"{code.name}: {details}")

    def _open_session(self, op: str, budget: float, wait_for_ready: bool, *, fresh: bool = False) -> Session:
        """This client's session, opened by a handshake if there is none (or ``fresh``)."""
        with self._session_lock:
            if self._session is not None and not fresh:
                return self._session
            stub = self._method(HELLO, op)
            handshake = ClientHandshake(self._token)
            try:
                answer = self._hello(stub, handshake.nonce, budget, wait_for_ready)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise self._error(exc, op, budget, wait_for_ready) from None
                if exc.code() == grpc.StatusCode.CANCELLED and self._closed:
                    raise self._error(exc, op, budget, wait_for_ready) from None
                raise self._impostor(op) from None
            except ValueError as exc:  # the channel was closed under this call
                raise self._failed(op, f"the client was closed ({exc})") from None
            if answer is None:
                raise self._failed(op, f"not reachable or no answer within {budget:g}s")
            view = memoryview(answer)
            session = None
            if len(answer) == SESSION_ID_BYTES + NONCE_BYTES + MAC_BYTES:
                nonce_at = SESSION_ID_BYTES + NONCE_BYTES
                session = handshake.finish(
                    view[:SESSION_ID_BYTES], view[SESSION_ID_BYTES:nonce_at], view[nonce_at:]
                )
            if session is None:
                raise self._impostor(op)
            self._session = session
            return session

    @staticmethod
    def _hello(
        stub: grpc.UnaryUnaryMultiCallable, nonce: bytes, budget: float, wait_for_ready: bool
    ) -> bytes | None:
        """The handshake's answer, or None if the server was unreachable until the deadline. Waiting
        is done here, by attempts that fail fast, not by gRPC's ``wait_for_ready``: that retries a
        failed TLS handshake silently until the deadline, and a server of another job must be named
        at once."""
        deadline = time.monotonic() + budget
        while True:
            try:
                return stub(nonce, timeout=max(deadline - time.monotonic(), 0.0), wait_for_ready=False)
            except grpc.RpcError as exc:
                if not wait_for_ready or exc.code() != grpc.StatusCode.UNAVAILABLE or _tls_refused(exc):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(_WAIT_POLL, left))

    def _signed(self, session: Session, method: str, request: bytes) -> tuple[bytes, tuple]:
        seq = seq_bytes(session.next_seq())
        mac = session.mac(_REQUEST, seq, method.encode(), header_part(request))
        metadata = (
            (SESSION_KEY, session.session_id.hex()),
            (SEQ_KEY, str(int.from_bytes(seq, "big"))),
            (MAC_KEY, mac.hex()),
        )
        return seq, metadata

    def call(
        self,
        method: str,
        meta: Mapping[str, Any] | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> Message:
        stub = self._method(method, method)
        budget = self.timeout if timeout is None else timeout
        request = b"".join(encode_parts(meta, tensors))
        for attempt in range(2):  # a second time only if the server had forgotten the session
            session = self._open_session(method, budget, wait_for_ready, fresh=attempt > 0)
            seq, metadata = self._signed(session, method, request)
            self._count(len(request), 0)
            try:
                answer, call = stub.with_call(
                    request, timeout=budget, metadata=metadata, wait_for_ready=wait_for_ready
                )
            except grpc.RpcError as exc:
                forgotten = _metadata(exc.trailing_metadata()).get(REFUSAL_KEY) == "no-session"
                if forgotten and not attempt:
                    continue
                raise self._error(exc, method, budget, wait_for_ready) from None
            except ValueError as exc:  # the channel was closed under this call
                raise self._failed(method, f"the client was closed ({exc})") from None
            mac = _hex(_metadata(call.trailing_metadata()).get(MAC_KEY))
            if not session.verify(mac, _ANSWER, seq, b"OK", header_part(answer)):
                raise self._forged(method)
            self._count(0, len(answer))
            return decode(answer, max_tensor_bytes=self._max_frame_bytes)
        raise AssertionError("unreachable")

    def stream(
        self, method: str, meta: Mapping[str, Any] | None = None, *, connect_timeout: float | None = None
    ) -> GrpcStream:
        """See :meth:`RpcClient.stream`; a fresh handshake comes first (the stream's session)."""
        budget = self.timeout if connect_timeout is None else connect_timeout
        session = self._open_session(method, budget, True, fresh=True)
        with self._lock:
            if self._closed:
                raise self._closed_error(method)
            stub = self._channel.unary_stream(
                f"/{SERVICE}/{method}",
                request_serializer=_identity,
                response_deserializer=_identity,
                _registered_method=False,
            )
        request = b"".join(encode_parts(meta, None))
        seq, metadata = self._signed(session, method, request)
        self._count(len(request), 0)
        return GrpcStream(self, method, stub(request, metadata=metadata, wait_for_ready=True), session, seq)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._channel.close()


class GrpcStream(RpcStream):
    """A gRPC ``unary_stream`` call whose items each prove their place in the stream."""

    def __init__(self, client: GrpcClient, op: str, call: Any, session: Session, seq: bytes) -> None:
        self._client, self._op, self._call = client, op, call
        self._session, self._seq = session, seq
        self._cancelled = False

    def __iter__(self) -> Iterator[Message]:
        client = self._client
        try:
            index = 0
            while True:
                try:
                    item = next(self._call)
                except StopIteration:
                    self._check_end(index)
                    return
                except grpc.RpcError as exc:
                    if self._cancelled or (exc.code() == grpc.StatusCode.CANCELLED and client._closed):
                        return
                    raise client._error(exc, self._op, None, True) from None
                except ValueError:  # the channel was closed under this stream
                    if self._cancelled or client._closed:
                        return
                    raise
                view = memoryview(item)
                mac, frame = view[:MAC_BYTES], view[MAC_BYTES:]
                item_fields = (self._seq, b"item", seq_bytes(index), header_part(frame))
                if not self._session.verify(mac, _ANSWER, *item_fields):
                    raise client._forged(self._op)
                index += 1
                client._count(0, len(item))
                yield decode(frame, max_tensor_bytes=client._max_frame_bytes)
        finally:
            self._call.cancel()

    def _check_end(self, count: int) -> None:
        """A normal end must prove it too (else an impostor could end a worker's session)."""
        try:
            fields = _metadata(self._call.trailing_metadata())
        except grpc.RpcError:
            fields = {}
        mac = _hex(fields.get(MAC_KEY))
        if not self._session.verify(mac, _ANSWER, self._seq, b"end", seq_bytes(count)):
            raise self._client._forged(self._op)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
