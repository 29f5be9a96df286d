"""The RPC layer under the parameter servers and the coordinator, on ZeroMQ (``pyzmq``).

Same public API and semantics as :mod:`spread.ps.grpc_transport`, so the transport is chosen by
name (:mod:`spread.ps.transports`). Why ZeroMQ: spread's rules ask for a well-kept network library,
not a home-made stack, and ZeroMQ moves multipart messages without the copies that made gRPC's
Python binding several times slower on 4 MB tensors.

How it maps onto ZeroMQ:

* The server owns one ``ROUTER`` socket, driven by one I/O thread; handlers run on a pool of
  threads made as calls need them (a sync push that waits blocks one thread, nobody else). Answers
  go back to the I/O thread through a queue and a wake-up pipe (ZeroMQ sockets are not
  thread-safe).
* A client keeps a small pool of ``DEALER`` sockets, one per concurrent call, each with a monitor
  (connection events tell "unreachable" and "connection lost" apart from a slow answer). A call that
  misses its deadline closes its socket, and every answer carries the request's random id, so a
  late answer can never be taken for the next call's.
* A request is ``[kind, request id, method, proof, frame parts...]``: the :mod:`spread.ps.wire`
  frame's header and each tensor's memory travel as separate parts, sent without copying. The proof
  is ``HMAC(job token, fixed label)`` (the token itself never travels), compared in constant time
  before the method or the frame is looked at; a wrong one is refused and counted.
* An answer is ``[request id, status, body parts...]``. A stream answers ``STREAM_OPEN`` (so a
  wrong token or an unreachable chief is reported by :meth:`RpcClient.stream`), then items, then
  ``STREAM_END``; the caller cancels with a ``CANCEL`` message naming the request id.
* ``zmq.MAXMSGSIZE`` = ``max_frame_bytes``: ZeroMQ drops a connection whose next part declares more,
  before allocating it (the caller sees the connection dropped); a frame whose parts add up to more
  is refused, and :func:`spread.ps.wire.decode` validates every frame.

Servers bind ``127.0.0.1`` unless given an address; :meth:`RpcServer.stop` joins every thread it
started and terminates its ZeroMQ context.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

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
from spread.ps.wire import DEFAULT_MAX_FRAME_BYTES, decode, decode_parts, encode_parts

_PROOF_LABEL = b"zmq-message"
CALL, STREAM, CANCEL = b"C", b"S", b"X"
OK, REFUSED, INVALID, FAULT, DENIED, STREAM_OPEN, STREAM_ITEM, STREAM_END, HEARTBEAT = (
    bytes([i]) for i in range(9)
)
_MAX_CONCURRENT_CALLS = 256  # threads are made as calls need them; sync pushes block one each
_MAX_PARTS = 4096  # a frame's header and tensors; more is refused before decoding
_HEARTBEAT_MS = 10_000  # ZMTP heartbeats: notice a peer whose host died (no FIN ever comes)
_PROBE_INTERVAL = 0.5  # at most one liveness probe per stream this often
_log = logging.getLogger(__name__)


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _message_proof(token: str) -> bytes:
    return token_proof(token, _PROOF_LABEL)


def _decode_body(parts: list[zmq.Frame] | list[bytes], max_tensor_bytes: int) -> tuple[Message, int]:
    """``(message, bytes)`` of a received frame: its tensors view the received parts (no copy)
    when they came as :func:`spread.ps.wire.encode_parts` sent them, else are decoded from a join."""
    views = [p.buffer if isinstance(p, zmq.Frame) else memoryview(p) for p in parts]
    size = sum(v.nbytes for v in views)
    message = decode_parts(views, max_tensor_bytes=max_tensor_bytes)
    if message is None:
        message = decode(_join(parts), max_tensor_bytes=max_tensor_bytes)
    return message, size


def _join(parts: list[zmq.Frame] | list[bytes]) -> bytearray:
    """The frame's parts in one writable buffer (one copy), which decoded tensors then view."""
    views = [p.buffer if isinstance(p, zmq.Frame) else memoryview(p) for p in parts]
    buf = bytearray(sum(v.nbytes for v in views))
    out, offset = memoryview(buf), 0  # memoryview slices copy at memcpy speed (bytearray's do not)
    for view in views:
        out[offset : offset + view.nbytes] = view
        offset += view.nbytes
    return buf


def _text(parts: list[zmq.Frame]) -> str:
    return b"".join(p.bytes for p in parts)[: 1 << 20].decode("utf-8", "replace")


_context_lock = threading.Lock()
_client_context: tuple[int, zmq.Context] | None = None


def _shared_context() -> zmq.Context:
    """The ZeroMQ context of this process's clients (made again after a fork)."""
    global _client_context
    with _context_lock:
        if _client_context is None or _client_context[0] != os.getpid():
            _client_context = (os.getpid(), zmq.Context())
        return _client_context[1]


class CallContext:
    """What a streaming handler may ask about its call: is the caller still connected?"""

    def __init__(self, server: RpcServer, identity: bytes, rid: bytes) -> None:
        self._server, self._identity, self._rid = server, identity, rid
        self._callbacks: list[Callable[[], None]] = []
        self._gone = False  # the caller cancelled, or its connection is gone
        self._last_probe = 0.0

    def is_active(self) -> bool:
        """False once the caller cancelled, closed the connection or died, or the server stopped."""
        if self._gone or self._server._stopping.is_set():
            return False
        now = time.monotonic()
        if now - self._last_probe >= _PROBE_INTERVAL:  # ask the I/O thread whether it can reach it
            self._last_probe = now
            self._server._send([self._identity, self._rid, HEARTBEAT], probe=self)
        return not self._gone

    def on_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the call ends for any reason (the caller died included)."""
        self._callbacks.append(callback)

    def _end(self) -> None:
        for callback in self._callbacks:
            try:
                callback()
            except Exception:
                _log.exception("stream end callback failed")


class RpcServer:
    """Serve ``handlers`` (method name -> function of ``(meta, tensors)``) for one job.

    Args:
        name: who this server is, in logs and in messages sent to callers (``"parameter server 1"``).
        handlers: unary methods; a handler returns ``(meta, tensors)`` or raises
            :class:`RequestRefused` (the caller gets the message) or any other exception (a fault;
            the caller gets its type and message, the server keeps serving).
        stream_handlers: methods answering with a sequence of messages (a generator).
        token: the job token; messages that cannot prove it are refused before anything else.
        address: ``host:port`` to bind; default ``127.0.0.1`` on a free port.
        max_frame_bytes: the largest request accepted.
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
        self._proof = _message_proof(token)
        self._handlers = dict(handlers)
        self._streams = dict(stream_handlers or {})
        self._max_frame_bytes = max_frame_bytes
        self.refused_connections = 0
        self._stopping = threading.Event()
        self._contexts: dict[bytes, CallContext] = {}  # open streams by request id
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[list[Any], CallContext | None]] = queue.SimpleQueue()
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a caller that left fails
        self._router.setsockopt(zmq.SNDHWM, 0)  # answers are never dropped for a slow reader
        self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._router.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_MS)
        host, port = split_address(address) if address else (DEFAULT_HOST, 0)
        if ":" in host:
            self._router.setsockopt(zmq.IPV6, 1)
        try:
            self._router.bind(_endpoint(host, port or "*"))
        except zmq.ZMQError as exc:
            self._router.close(0)
            self._context.term()
            raise OSError(f"{name}: cannot listen on {host}:{port}: {exc}") from None
        bound = self._router.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
        self.address = f"{host}:{bound}"
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._pool_prefix = f"spread-zmq-{name}"
        self._executor = ThreadPoolExecutor(_MAX_CONCURRENT_CALLS, thread_name_prefix=self._pool_prefix)
        self._io = threading.Thread(target=self._io_loop, name=f"spread-zmq-{name}-io", daemon=True)

    def start(self) -> RpcServer:
        self._io.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` was called; True if it was within ``timeout``."""
        return self._stopping.wait(timeout)

    def stop(self) -> None:
        """End every call, close the port, join every thread this server started, end the context."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake()
        inside = threading.current_thread()
        if self._io.is_alive() and self._io is not inside:
            self._io.join()
        elif not self._io.is_alive() and not self._io.ident:
            self._router.close(0)  # never started
        # Handlers still running (a sync push waiting for its round) finish on their own deadline.
        self._executor.shutdown(wait=not inside.name.startswith(self._pool_prefix))
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._context.term()

    # -- the I/O thread ----------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"w")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the I/O thread is already due to wake up

    def _send(self, parts: list[Any], probe: CallContext | None = None) -> None:
        """Queue an answer for the I/O thread (the only thread that touches the socket)."""
        self._outbox.put((parts, probe))
        self._wake()

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll())
                if ready.get(self._wake_read):
                    os.read(self._wake_read, 4096)
                self._flush()
                if ready.get(self._router):
                    for _ in range(64):  # then answers get their turn again
                        try:
                            parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._receive(parts)
        finally:
            with self._lock:
                contexts = list(self._contexts.values())
            for ctx in contexts:
                ctx._gone = True
            self._router.close(0)

    def _flush(self) -> None:
        while True:
            try:
                parts, probe = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._router.send_multipart(parts, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the caller left (closed, cancelled, died)
                if probe is not None:
                    probe._gone = True
                elif exc.errno != zmq.EHOSTUNREACH:
                    _log.warning("%s: could not send an answer: %s", self.name, exc)

    def _receive(self, parts: list[zmq.Frame]) -> None:
        if len(parts) < 5 or len(parts) > _MAX_PARTS + 5:
            if len(parts) >= 3:
                self._answer(parts[0].bytes, parts[2].bytes, INVALID, f"{self.name}: malformed request")
            return
        identity, kind, rid, method, proof = (p.bytes for p in parts[:5])
        if not hmac.compare_digest(proof, self._proof):
            with self._lock:
                self.refused_connections += 1
            self._answer(
                identity,
                rid,
                DENIED,
                f"{self.name} refused the connection: "
                "the caller's SPREAD_JOB_TOKEN does not match this job's",
            )
            return
        if kind == CANCEL:
            with self._lock:
                ctx = self._contexts.get(rid)
            if ctx is not None:
                ctx._gone = True
            return
        body = parts[5:]
        size = sum(len(p) for p in body)
        if size > self._max_frame_bytes:
            self._answer(
                identity,
                rid,
                INVALID,
                f"{self.name}: frame over the size limit: {size} bytes, over {self._max_frame_bytes}",
            )
            return
        name = method.decode("utf-8", "replace")
        if kind == STREAM and name in self._streams:
            ctx = CallContext(self, identity, rid)
            with self._lock:
                self._contexts[rid] = ctx
            self._executor.submit(self._serve_stream, ctx, name, body)
        else:
            self._executor.submit(self._serve_unary, identity, rid, name, body)

    # -- handlers (pool threads) -------------------------------------------------------------------
    def _answer(self, identity: bytes, rid: bytes, status: bytes, text: str) -> None:
        self._send([identity, rid, status, text.encode()])

    def _answer_frame(self, identity: bytes, rid: bytes, status: bytes, message: Message) -> None:
        self._send([identity, rid, status, *encode_parts(*message)])

    def _decode(self, identity: bytes, rid: bytes, body: list[zmq.Frame]) -> Message | None:
        try:
            return _decode_body(body, self._max_frame_bytes)[0]
        except WireFormatError as exc:
            self._answer(identity, rid, INVALID, f"{self.name}: {exc}")
            return None

    def _serve_unary(self, identity: bytes, rid: bytes, method: str, body: list[zmq.Frame]) -> None:
        request = self._decode(identity, rid, body)
        if request is None:
            return
        handler = self._handlers.get(method)
        if handler is None:
            self._answer(identity, rid, REFUSED, f"{self.name}: unknown method {method!r}")
            return
        try:
            answer = handler(*request)
        except RequestRefused as exc:
            self._answer(identity, rid, REFUSED, f"{self.name}: {exc}")
            return
        except Exception as exc:
            _log.exception("%s: %s failed", self.name, method)
            self._answer(identity, rid, FAULT, f"{self.name}: {type(exc).__name__}: {exc}")
            return
        try:
            self._answer_frame(identity, rid, OK, answer)
        except Exception as exc:  # an answer the wire format cannot carry
            self._answer(identity, rid, FAULT, f"{self.name}: {type(exc).__name__}: {exc}")

    def _serve_stream(self, ctx: CallContext, method: str, body: list[zmq.Frame]) -> None:
        identity, rid = ctx._identity, ctx._rid
        try:
            request = self._decode(identity, rid, body)
            if request is None:
                return
            self._send([identity, rid, STREAM_OPEN])
            messages = self._streams[method](*request, ctx)
            try:
                for message in messages:
                    if not ctx.is_active():
                        return  # the caller left: do not run the handler any further
                    self._answer_frame(identity, rid, STREAM_ITEM, message)
                self._send([identity, rid, STREAM_END])
            except RequestRefused as exc:
                self._answer(identity, rid, REFUSED, f"{self.name}: {exc}")
            except Exception as exc:
                _log.exception("%s: stream %s failed", self.name, method)
                self._answer(identity, rid, FAULT, f"{self.name}: {type(exc).__name__}: {exc}")
            finally:
                messages.close()
        finally:
            with self._lock:
                self._contexts.pop(rid, None)
            ctx._gone = True
            ctx._end()


class _Lost(Exception):
    """The connection under a call went away (the reason is the message)."""


class _Connection:
    """One DEALER socket to the server and its monitor; used by one thread at a time."""

    def __init__(self, endpoint: str, max_frame_bytes: int, ipv6: bool) -> None:
        context = _shared_context()
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_MS)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 50)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if ipv6:
            self.socket.setsockopt(zmq.IPV6, 1)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
        )
        self.socket.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.connected = False
        self.lost = False  # connected once, then disconnected: never reused

    def events(self) -> list[int]:
        """Connection events since the last look (updating :attr:`connected` and :attr:`lost`)."""
        seen = []
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return seen
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected, self.lost = False, True
            seen.append(event)

    def wait_connected(self, deadline: float, wait_for_ready: bool) -> bool:
        """True once connected; raises :class:`_Lost` if refused (unless waiting for it to start)."""
        while not self.connected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if not self.monitor.poll(max(1, int(remaining * 1000))):
                continue
            for event in self.events():
                if event == zmq.EVENT_CONNECT_RETRIED and not wait_for_ready:
                    raise _Lost("unreachable (it died or never started): connection refused")
        return True

    def receive(self, rid: bytes, deadline: float | None) -> list[zmq.Frame] | None:
        """The next answer to ``rid`` (``[status, body...]``), or None at the deadline."""
        while True:
            timeout = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self.poller.poll(timeout if deadline is None else min(timeout, 1000)))
            if ready.get(self.socket):
                parts = self.socket.recv_multipart(copy=False)
                if len(parts) >= 2 and parts[0].bytes == rid:
                    return parts[1:]
                continue  # an answer to an earlier call on this socket: never this call's
            if ready.get(self.monitor):
                self.events()
                if self.lost:
                    raise _Lost("connection lost (it died, or dropped a message part over its size limit)")
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.socket.close(0)


class RpcClient:
    """Calls to one server: a deadline on each, errors naming the peer, and byte counters.

    Thread-safe: concurrent calls use separate sockets (kept in a small pool).

    Args:
        address: the server's ``host:port``.
        peer: how errors name the server (``"parameter server 1 (10.0.0.2:2222)"``).
        token: the job token (proved in each message, never sent).
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
        self._endpoint = _endpoint(host, port)
        self._ipv6 = ":" in host
        self._proof = _message_proof(token)
        self._error_type = error_type
        self._max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._closed = False
        self.bytes_sent = 0
        self.bytes_received = 0

    def _count(self, sent: int, received: int) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def _take(self, op: str) -> _Connection:
        with self._lock:
            if self._closed:
                raise self._error_type(self.peer, op, "the client was closed")
            while self._idle:
                conn = self._idle.pop()
                conn.events()
                if not conn.lost:
                    return conn
                conn.close()  # it died while idle (the server restarted): a fresh one instead
        return _Connection(self._endpoint, self._max_frame_bytes, self._ipv6)

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and not conn.lost:
                self._idle.append(conn)
                return
        conn.close()

    def _send(self, conn: _Connection, kind: bytes, rid: bytes, method: str, meta: Any, tensors: Any) -> None:
        parts = encode_parts(meta, tensors)
        conn.socket.send_multipart([kind, rid, method.encode(), self._proof, *parts], copy=False)
        self._count(sum(len(p) for p in parts), 0)

    def _raise_for(self, status: bytes, body: list[zmq.Frame], op: str) -> None:
        text = _text(body)
        if status == DENIED:
            raise JobTokenError(f"{self.peer}: {op} refused: {text}")
        if status == INVALID:
            raise WireFormatError(f"{self.peer}: {op} refused: {text}")
        raise self._error_type(self.peer, op, text)

    def _decode(self, body: list[zmq.Frame]) -> Message:
        message, size = _decode_body(body, self._max_frame_bytes)
        self._count(0, size)
        return message

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
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        conn = self._take(method)
        answer = None
        try:
            if not conn.wait_connected(deadline, wait_for_ready):
                what = "not reachable or no answer" if wait_for_ready else "not reachable"
                raise self._error_type(self.peer, method, f"{what} within {budget:g}s")
            rid = secrets.token_bytes(8)
            self._send(conn, CALL, rid, method, meta, tensors)
            answer = conn.receive(rid, deadline)
            if answer is None:
                raise self._error_type(self.peer, method, f"no answer within {budget:g}s")
        except _Lost as exc:
            raise self._error_type(self.peer, method, str(exc)) from None
        finally:
            if answer is None:
                conn.close()  # a late answer must not meet the next call
            else:
                self._give_back(conn)
        status, body = answer[0].bytes, answer[1:]
        if status != OK:
            self._raise_for(status, body, method)
        return self._decode(body)

    def stream(
        self, method: str, meta: Mapping[str, Any] | None = None, *, connect_timeout: float | None = None
    ) -> Stream:
        """Open a streaming call (it waits for the server to start, within ``connect_timeout``).

        The server's first answer says the stream is open, so an unreachable server or a wrong
        token is reported here; the stream itself has no deadline (it lasts as long as the server
        keeps answering).
        """
        budget = self.timeout if connect_timeout is None else connect_timeout
        deadline = time.monotonic() + budget
        with self._lock:
            if self._closed:
                raise self._error_type(self.peer, method, "the client was closed")
        conn = _Connection(self._endpoint, self._max_frame_bytes, self._ipv6)
        rid = secrets.token_bytes(8)
        try:
            if not conn.wait_connected(deadline, wait_for_ready=True):
                raise self._error_type(self.peer, method, f"not reachable within {budget:g}s")
            self._send(conn, STREAM, rid, method, meta, None)
            answer = conn.receive(rid, deadline)
            if answer is None:
                raise self._error_type(self.peer, method, f"not reachable or no answer within {budget:g}s")
            if answer[0].bytes != STREAM_OPEN:
                self._raise_for(answer[0].bytes, answer[1:], method)
        except _Lost as exc:
            conn.close()
            raise self._error_type(self.peer, method, str(exc)) from None
        except BaseException:
            conn.close()
            raise
        return Stream(self, method, conn, rid)

    def _cancel(self, rid: bytes) -> None:
        """Tell the server a stream is over (from any thread: on a pooled socket, no answer)."""
        try:
            conn = self._take("cancel")
        except RemoteCallError:
            return
        if conn.wait_connected(time.monotonic() + 1.0, wait_for_ready=False):
            conn.socket.send_multipart([CANCEL, rid, b"", self._proof])
        self._give_back(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class Stream:
    """The messages of a streaming call, in order; :meth:`cancel` ends it from this side."""

    def __init__(self, client: RpcClient, op: str, conn: _Connection, rid: bytes) -> None:
        self._client, self._op, self._conn, self._rid = client, op, conn, rid
        self._cancelled = False
        self._finished = False

    def __iter__(self) -> Iterator[Message]:
        client = self._client
        try:
            while not self._cancelled:
                try:
                    answer = self._conn.receive(self._rid, time.monotonic() + 0.2)
                except _Lost as exc:
                    if self._cancelled:
                        return
                    raise client._error_type(client.peer, self._op, str(exc)) from None
                if answer is None:
                    if client._closed:
                        return
                    continue  # wake up now and then to see a cancel from another thread
                status, body = answer[0].bytes, answer[1:]
                if status == HEARTBEAT:
                    continue
                if status == STREAM_END:
                    self._finished = True
                    return
                if status != STREAM_ITEM:
                    self._finished = True
                    client._raise_for(status, body, self._op)
                yield client._decode(body)
        finally:
            self._conn.close()

    def cancel(self) -> None:
        if self._cancelled or self._finished:
            return
        self._cancelled = True
        self._client._cancel(self._rid)
