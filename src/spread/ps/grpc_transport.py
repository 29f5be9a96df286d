"""The RPC layer under the parameter servers and the coordinator, on gRPC (``grpcio``).

Same public API and semantics as :mod:`spread.ps.zmq_transport`, so the transport is chosen by
name (:mod:`spread.ps.transports`). Why gRPC: spread's rules ask for a well-kept RPC layer, not a
home-made network stack, and ``torch.distributed.rpc`` unpickles network bytes (forbidden).

How it maps onto gRPC, without protobuf code generation:

* Every method is ``/spread.ps/<name>`` behind one generic handler; request and answer are raw
  bytes holding one :mod:`spread.ps.wire` frame (JSON header and tensor bytes, never pickle). Unary
  methods are ``unary_unary``, streaming methods ``unary_stream``.
* Every call carries ``HMAC(job token, fixed label)`` in its metadata (the token itself never
  travels); the server compares it in constant time and answers ``UNAUTHENTICATED`` otherwise,
  before the method or the frame is looked at.
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

import hmac
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
    Handler,
    Message,
    RequestRefused,
    StreamHandler,
    split_address,
    token_proof,
)
from spread.ps.wire import DEFAULT_MAX_FRAME_BYTES, decode, encode_parts

SERVICE = "spread.ps"
PROOF_KEY = "spread-job-proof"
_PROOF_LABEL = b"grpc-metadata"
_READY = "_spread_ready"  # built into every server: lets a stream wait for it and check the token
_MAX_MESSAGE = (1 << 31) - 1  # gRPC's limits are C ints
_WINDOW = ("grpc.http2.lookahead_bytes", 8 << 20)  # a larger receive window: 4 MB push ~30% faster
_MAX_CONCURRENT_CALLS = 256  # threads are made as calls need them; sync pushes block one each
_REFUSED = grpc.StatusCode.FAILED_PRECONDITION
_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_FAULT = grpc.StatusCode.INTERNAL
_log = logging.getLogger(__name__)
_start_lock = threading.Lock()


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _metadata_proof(token: str) -> str:
    return token_proof(token, _PROOF_LABEL).hex()


def _frame(message: Message) -> bytes:
    """One wire frame as one buffer: the tensors' memory is copied once, here (gRPC needs bytes)."""
    return b"".join(encode_parts(*message))


def _identity(data: bytes) -> bytes:
    return data


class CallContext:
    """What a streaming handler may ask about its call: is the caller still connected?"""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._ended = False
        self._running = True  # the handler's code is executing (not parked at a yield)

    def is_active(self) -> bool:
        """False once the caller cancelled, closed the connection or died, or the server stopped."""
        return not self._ended and self._context.is_active()

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
    """Looks up every call: token first, then the method; unknown methods get a clear refusal."""

    def __init__(self, server: RpcServer) -> None:
        self._server = server

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        server = self._server
        prefix = f"/{SERVICE}/"
        path = handler_call_details.method
        method = path[len(prefix) :] if path.startswith(prefix) else path
        proof = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == PROOF_KEY:
                proof = value if isinstance(value, str) else value.decode("ascii", "replace")
        if not hmac.compare_digest(proof.encode(), server._proof.encode()):
            return _unary(server._refuse_token)
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
        token: the job token; calls that cannot prove it are refused before anything else.
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
        self._proof = _metadata_proof(token)
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
        self._stopping.set()
        self._server.stop(None).wait()  # None: cancel in-flight calls now, like closing sockets
        inside = threading.current_thread()
        if self._serve_thread is not None and self._serve_thread is not inside:
            self._serve_thread.join()
        # Handlers still running (a sync push waiting for its round) finish on their own deadline.
        self._executor.shutdown(wait=not inside.name.startswith(self._pool_prefix))

    # -- calls -------------------------------------------------------------------------------------
    def _refuse_token(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._count_lock:
            self.refused_connections += 1
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{self.name} refused the connection: the caller's SPREAD_JOB_TOKEN does not match this job's",
        )
        raise AssertionError("unreachable")  # abort raises

    def _decode(self, request: bytes) -> Message:
        return decode(request, max_tensor_bytes=self._max_frame_bytes)

    def _serve_unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            meta, tensors = self._decode(request)
        except WireFormatError as exc:
            context.abort(_INVALID, f"{self.name}: {exc}")
        if method == _READY:
            return _frame(({}, {}))
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
        return _frame(answer)

    def _serve_stream(self, method: str, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            meta, tensors = self._decode(request)
        except WireFormatError as exc:
            context.set_code(_INVALID)
            context.set_details(f"{self.name}: {exc}")
            return
        call = CallContext(context)
        context.add_callback(call._terminated)  # False: already over; is_active() says so
        messages = self._streams[method](meta, tensors, call)
        try:
            for message in messages:
                frame = _frame(message)
                call._park()
                yield frame
                if not call._resume():
                    return  # the call ended while parked: do not run the handler any further
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
        token: the job token (proved in each call's metadata, never sent).
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
        self._metadata = ((PROOF_KEY, _metadata_proof(token)),)
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
        refuses this job token, :class:`WireFormatError` when it refuses the frame, and the
        client's ``error_type`` (naming the peer and ``method``) for everything else.
        """
        return self._call(method, method, meta, tensors, timeout, wait_for_ready)

    def _call(
        self,
        method: str,
        op: str,
        meta: Mapping[str, Any] | None,
        tensors: Mapping[str, torch.Tensor] | None,
        timeout: float | None,
        wait_for_ready: bool,
    ) -> Message:
        """:meth:`call`, with errors naming ``op`` (a stream's readiness call names the stream)."""
        stub = self._method(method, op)
        budget = self.timeout if timeout is None else timeout
        request = b"".join(encode_parts(meta, tensors))
        self._count(len(request), 0)
        try:
            answer = stub(request, timeout=budget, metadata=self._metadata, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise self._error(exc, op, budget, wait_for_ready) from None
        except ValueError as exc:  # the channel was closed under this call
            raise self._error_type(self.peer, op, f"the client was closed ({exc})") from None
        self._count(0, len(answer))
        return decode(answer, max_tensor_bytes=self._max_frame_bytes)

    def stream(
        self, method: str, meta: Mapping[str, Any] | None = None, *, connect_timeout: float | None = None
    ) -> Stream:
        """Open a streaming call (it waits for the server to start, within ``connect_timeout``).

        The server's answer to a readiness call comes first, so an unreachable server or a wrong
        token is reported here, like the socket client's handshake; the stream itself has no
        deadline (it lasts as long as the server keeps answering).
        """
        budget = self.timeout if connect_timeout is None else connect_timeout
        self._call(_READY, method, None, None, budget, wait_for_ready=True)
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
        self._count(len(request), 0)
        return Stream(self, method, stub(request, metadata=self._metadata, wait_for_ready=True))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._channel.close()


class Stream:
    """The messages of a streaming call, in order; :meth:`cancel` ends it from this side."""

    def __init__(self, client: RpcClient, op: str, call: Any) -> None:
        self._client, self._op, self._call = client, op, call
        self._cancelled = False

    def __iter__(self) -> Iterator[Message]:
        client = self._client
        try:
            while True:
                try:
                    frame = next(self._call)
                except StopIteration:
                    return
                except grpc.RpcError as exc:
                    if self._cancelled or (exc.code() == grpc.StatusCode.CANCELLED and client._closed):
                        return
                    raise client._error(exc, self._op, None, True) from None
                except ValueError:  # the channel was closed under this stream
                    if self._cancelled or client._closed:
                        return
                    raise
                client._count(0, len(frame))
                yield decode(frame, max_tensor_bytes=client._max_frame_bytes)
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
