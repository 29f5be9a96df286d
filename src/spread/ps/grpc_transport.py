"""The RPC layer under the parameter servers and the coordinator, on gRPC (``grpcio``).

Same public API and semantics as :mod:`spread.ps.zmq_transport`, so the transport is chosen by name
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
  handler's fault ``INTERNAL``. The client turns them back into the exceptions the socket client
  raises: :class:`JobTokenError`, :class:`WireFormatError` and the client's ``error_type``, each
  naming the server.

Servers bind ``127.0.0.1`` unless given an address (a port in use is an error: ``SO_REUSEPORT`` is
off); every client call has a deadline; :meth:`RpcServer.stop` joins every thread it started.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# gRPC's C core logs at INFO to stderr (a line per connection a stopping server closes) unless told
# otherwise; keep a user's own setting. Only effective before gRPC is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import torch

from spread.errors import JobTokenError, RemoteCallError, WireFormatError
from spread.ps.rpc_api import (
    DEFAULT_HOST,
    MAC_BYTES,
    ClientHandshake,
    Handler,
    Message,
    RequestRefused,
    Session,
    SessionRefused,
    SessionTable,
    StreamHandler,
    seq_bytes,
    split_address,
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
_MAX_CONCURRENT_CALLS = 256  # threads are made as calls need them; sync pushes block one each
_REFUSED = grpc.StatusCode.FAILED_PRECONDITION
_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_FAULT = grpc.StatusCode.INTERNAL
_log = logging.getLogger(__name__)
_start_lock = threading.Lock()


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _hex(text: str | None) -> bytes:
    try:
        return bytes.fromhex(text or "")
    except ValueError:
        return b""


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


class CallContext:
    """What a streaming handler may ask about its call: is the caller still connected?"""

    def __init__(self, context: grpc.ServicerContext, server: RpcServer) -> None:
        self._context = context
        self._server = server
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._ended = False
        self._running = True  # the handler's code is executing (not parked at a yield)

    def is_active(self) -> bool:
        """False once the caller cancelled, closed the connection or died, or the server stopped."""
        return not self._ended and not self._server._stopping.is_set() and self._context.is_active()

    def on_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the call ends for any reason (the caller died included)."""
        self._callbacks.append(callback)

    def _terminated(self) -> None:
        """gRPC says the call is over: end now if the handler is parked at a yield (it will not
        be resumed), else leave it to the handler's own end (it sees ``is_active()`` False)."""
        with self._lock:
            if self._running or self._ended:
                return
            self._ended = True
        self._run_callbacks()

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
        self._run_callbacks()

    def _run_callbacks(self) -> None:
        for callback in self._callbacks:
            try:
                callback()
            except Exception:
                _log.exception("stream end callback failed")


class _Dispatcher(grpc.GenericRpcHandler):
    """Routes every call: the handshake, streams, and unary methods (unknown ones are refused by the
    unary path, after the caller's session is checked)."""

    def __init__(self, server: RpcServer) -> None:
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


class RpcServer:
    """Serve ``handlers`` (method name -> function of ``(meta, tensors)``) for one job.

    Args:
        name: who this server is, in logs and in messages sent to callers (``"parameter server 1"``).
        handlers: unary methods; a handler returns ``(meta, tensors)`` or raises
            :class:`RequestRefused` (the caller gets the message) or any other exception (a fault;
            the caller gets its type and message, the server keeps serving).
        stream_handlers: methods answering with a sequence of messages (a generator).
        token: the job token; calls outside a session that proved it are refused before anything
            else (:mod:`spread.ps.rpc_api`).
        address: ``host:port`` to bind; default ``127.0.0.1`` on a free port.
        max_frame_bytes: the largest request accepted (gRPC refuses larger ones unread).
    """

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
        self.name = name
        self._sessions = SessionTable(token)
        self._handlers = dict(handlers)
        self._streams = dict(stream_handlers or {})
        self._max_frame_bytes = max_frame_bytes
        self.refused_connections = 0
        self._count_lock = threading.Lock()
        self._stopping = threading.Event()
        self._pool_prefix = f"spread-grpc-{name}"
        self._executor = ThreadPoolExecutor(_MAX_CONCURRENT_CALLS, thread_name_prefix=self._pool_prefix)
        options = [
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
            ("grpc.max_receive_message_length", min(max_frame_bytes, _MAX_MESSAGE)),
            ("grpc.max_send_message_length", -1),
            ("grpc.keepalive_time_ms", 10_000),  # notice a caller whose host died (stream sessions)
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.max_pings_without_data", 0),
            _WINDOW,
        ]
        self._server = grpc.server(self._executor, handlers=[_Dispatcher(self)], options=options)
        host, port = split_address(address) if address else (DEFAULT_HOST, 0)
        try:
            bound = self._server.add_insecure_port(_target(host, port))
        except RuntimeError as exc:
            bound, detail = 0, exc
        else:
            detail = "the address is in use or not local"
        if not bound:
            self._executor.shutdown(wait=False)
            raise OSError(f"{name}: cannot listen on {host}:{port}: {detail}")
        self.address = f"{host}:{bound}"
        self._serve_thread: threading.Thread | None = None

    def start(self) -> RpcServer:
        with _start_lock:  # find the one polling thread gRPC starts, to join it in stop()
            before = set(threading.enumerate())
            self._server.start()
            started = [t for t in set(threading.enumerate()) - before if t.name.endswith("(_serve)")]
        self._serve_thread = started[0] if len(started) == 1 else None
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` was called; True if it was within ``timeout``."""
        return self._stopping.wait(timeout)

    def stop(self) -> None:
        """Cancel every call, close the port, and join every thread this server started."""
        self._stopping.set()  # streams see their calls end (is_active) and return
        # Calls already handled get a moment to deliver their answers (a stop call's own, a
        # stream's last item); what is still running then is cancelled, like closing sockets.
        self._server.stop(_STOP_GRACE).wait()
        inside = threading.current_thread()
        if self._serve_thread is not None and self._serve_thread is not inside:
            self._serve_thread.join()
        # Handlers still running (a sync push waiting for its round) finish on their own deadline.
        self._executor.shutdown(wait=not inside.name.startswith(self._pool_prefix))

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
                with self._count_lock:
                    self.refused_connections += 1
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
        handler = self._handlers.get(method)
        if handler is None:
            context.abort(_REFUSED, f"{self.name}: unknown method {method!r}")
        try:
            answer = handler(meta, tensors)
        except RequestRefused as exc:
            context.abort(_REFUSED, f"{self.name}: {exc}")
        except Exception as exc:
            _log.exception("%s: %s failed", self.name, method)
            context.abort(_FAULT, f"{self.name}: {type(exc).__name__}: {exc}")
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
        call = CallContext(context, self)
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
        except RequestRefused as exc:
            context.set_code(_REFUSED)
            context.set_details(f"{self.name}: {exc}")
        except Exception as exc:
            _log.exception("%s: stream %s failed", self.name, method)
            context.set_code(_FAULT)
            context.set_details(f"{self.name}: {type(exc).__name__}: {exc}")
        finally:
            messages.close()
            call._end()


class RpcClient:
    """Calls to one server: a deadline on each, errors naming the peer, and byte counters.

    Thread-safe: concurrent calls share one gRPC channel (HTTP/2 streams over one connection).

    Args:
        address: the server's ``host:port``.
        peer: how errors name the server (``"parameter server 1 (10.0.0.2:2222)"``).
        token: the job token (proved in each call's metadata, and required of the server; never sent).
        timeout: default deadline of a call, in seconds.
        error_type: the :class:`RemoteCallError` subclass raised for failed calls.
        max_frame_bytes: the largest answer accepted.
    """

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
        self.address = address
        self.peer = peer
        self.timeout = timeout
        host, port = split_address(address)
        self._token = token
        self._session: Session | None = None
        self._session_lock = threading.Lock()  # one handshake at a time
        self._error_type = error_type
        self._max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
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
        ]
        self._channel = grpc.insecure_channel(_target(host, port), options=options)
        self._unary: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def _count(self, sent: int, received: int) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def _method(self, method: str, op: str) -> grpc.UnaryUnaryMultiCallable:
        with self._lock:
            if self._closed:
                raise self._error_type(self.peer, op, "the client was closed")
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
        """The spread exception for a failed call (the same types the socket client raises)."""
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return JobTokenError(f"{self.peer}: {op} refused: {details}")
        if code == _INVALID:
            return WireFormatError(f"{self.peer}: {op} refused: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return WireFormatError(f"{self.peer}: {op} refused: frame over the size limit ({details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            what = "not reachable or no answer" if wait_for_ready else "no answer"
            return self._error_type(self.peer, op, f"{what} within {budget:g}s")
        if code == grpc.StatusCode.UNAVAILABLE:
            return self._error_type(
                self.peer, op, f"unreachable or connection lost (it died or never started): {details}"
            )
        if code == grpc.StatusCode.CANCELLED and self._closed:
            return self._error_type(self.peer, op, "the client was closed")
        if code in (_REFUSED, _FAULT):
            return self._error_type(self.peer, op, details)
        return self._error_type(self.peer, op, f"{code.name}: {details}")

    def _impostor(self, op: str) -> JobTokenError:
        return JobTokenError(
            f"{self.peer}: {op} refused: its SPREAD_JOB_TOKEN does not match this job's: it could not prove "
            f"the token (another job's server, or a process impersonating it at {self.address}); nothing "
            f"was sent to it"
        )

    def _forged(self, op: str) -> JobTokenError:
        return JobTokenError(
            f"{self.peer}: {op} refused: an answer did not prove this job's SPREAD_JOB_TOKEN (a forged or "
            f"replayed message from {self.address}); the call was abandoned"
        )

    def _open_session(self, op: str, budget: float, wait_for_ready: bool, *, fresh: bool = False) -> Session:
        """This client's session, opened by a handshake if there is none (or ``fresh``)."""
        with self._session_lock:
            if self._session is not None and not fresh:
                return self._session
            stub = self._method(HELLO, op)
            handshake = ClientHandshake(self._token)
            try:
                answer = stub(handshake.nonce, timeout=budget, wait_for_ready=wait_for_ready)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise self._error(exc, op, budget, wait_for_ready) from None
                if exc.code() == grpc.StatusCode.CANCELLED and self._closed:
                    raise self._error(exc, op, budget, wait_for_ready) from None
                raise self._impostor(op) from None
            except ValueError as exc:  # the channel was closed under this call
                raise self._error_type(self.peer, op, f"the client was closed ({exc})") from None
            view = memoryview(answer)
            session = None
            if len(answer) == 2 * 16 + MAC_BYTES:
                session = handshake.finish(view[:16], view[16:32], view[32:])
            if session is None:
                raise self._impostor(op)
            self._session = session
            return session

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
        """One request and its answer, within ``timeout`` seconds (default: the client's).

        ``wait_for_ready`` keeps trying to connect (within the deadline) to a server that has not
        started yet, instead of failing at once. Raises :class:`JobTokenError` when the server
        refuses this job token or cannot prove it, :class:`WireFormatError` when it refuses the
        frame, and the client's ``error_type`` (naming the peer and ``method``) for everything else.
        """
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
                raise self._error_type(self.peer, method, f"the client was closed ({exc})") from None
            mac = _hex(_metadata(call.trailing_metadata()).get(MAC_KEY))
            if not session.verify(mac, _ANSWER, seq, b"OK", header_part(answer)):
                raise self._forged(method)
            self._count(0, len(answer))
            return decode(answer, max_tensor_bytes=self._max_frame_bytes)
        raise AssertionError("unreachable")

    def stream(
        self, method: str, meta: Mapping[str, Any] | None = None, *, connect_timeout: float | None = None
    ) -> Stream:
        """Open a streaming call (it waits for the server to start, within ``connect_timeout``).

        A fresh handshake comes first, so an unreachable server, a wrong token or an impostor is
        reported here; the stream itself has no deadline (it lasts as long as the server keeps
        answering).
        """
        budget = self.timeout if connect_timeout is None else connect_timeout
        session = self._open_session(method, budget, True, fresh=True)
        with self._lock:
            if self._closed:
                raise self._error_type(self.peer, method, "the client was closed")
            stub = self._channel.unary_stream(
                f"/{SERVICE}/{method}",
                request_serializer=_identity,
                response_deserializer=_identity,
                _registered_method=False,
            )
        request = b"".join(encode_parts(meta, None))
        seq, metadata = self._signed(session, method, request)
        self._count(len(request), 0)
        return Stream(self, method, stub(request, metadata=metadata, wait_for_ready=True), session, seq)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._channel.close()


class Stream:
    """The messages of a streaming call, in order; :meth:`cancel` ends it from this side."""

    def __init__(self, client: RpcClient, op: str, call: Any, session: Session, seq: bytes) -> None:
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
