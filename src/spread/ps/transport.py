"""The RPC layer under the parameter servers and the coordinator: framed TCP with a token handshake.

Why not gRPC or ``torch.distributed.rpc`` (measured by ``benchmarks/ps_transport.py``, numbers in
``docs/benchmarks.md``): gRPC's Python binding moved a 4 MB tensor ~10x slower than a plain socket
on this machine (it copies every message several times), and ``torch.distributed.rpc`` pickles its
Python arguments and results, which spread's security rule forbids for network bytes. A socket
carrying :mod:`spread.ps.wire` frames works across machines, sends tensor memory without copying and
receives into one buffer that the tensors then view.

Protocol, per TCP connection:

1. handshake: the server sends ``b"SPRH"`` and a random nonce; the client answers with
   ``HMAC(job token, nonce)`` (the token itself never travels); the server answers one byte, and
   closes the connection without reading anything else when the proof is wrong;
2. calls, one at a time: ``u16 method length | method | u64 frame length | frame``; the answer is
   ``u8 status | u64 length | body`` (a frame, or a UTF-8 message for a refused or failed call). A
   streaming method answers with any number of ``STREAM_ITEM`` messages, then ``STREAM_END``.

A declared frame length over the server's limit is refused before any buffer is allocated, and the
connection is closed (its remaining bytes cannot be trusted). Every client call has a deadline.
Servers bind ``127.0.0.1`` unless given an address.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from spread.errors import JobTokenError, RemoteCallError, WireFormatError
from spread.ps.wire import DEFAULT_MAX_FRAME_BYTES, Tensors, decode, encode_parts

DEFAULT_HOST = "127.0.0.1"
_HELLO = b"SPRH"
_NONCE_BYTES = 16
_CALL = struct.Struct("<H")
_LEN = struct.Struct("<Q")
_STATUS = struct.Struct("<BQ")
OK, REFUSED, INVALID, FAULT, STREAM_ITEM, STREAM_END = range(6)
_SMALL = 64 * 1024  # parts smaller than this are coalesced into one send
_log = logging.getLogger(__name__)

Message = tuple[dict[str, Any], Tensors]
Handler = Callable[[dict[str, Any], Tensors], Message]
StreamHandler = Callable[[dict[str, Any], Tensors, "CallContext"], Iterator[Message]]


class RequestRefused(Exception):
    """Raised by a handler to refuse a request with a message for the caller (not a server fault)."""


def token_proof(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), b"spread-rpc-v1:" + nonce, hashlib.sha256).digest()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected a 'host:port' address, got {address!r}")
    return host.strip("[]"), int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return buf


def _send_parts(sock: socket.socket, head: bytes, parts: list[bytes | memoryview]) -> None:
    pending: list[bytes | memoryview] = [head]
    for part in parts:
        if len(part) < _SMALL:
            pending.append(part)
            continue
        sock.sendall(b"".join(pending))
        pending = []
        sock.sendall(part)
    if pending:
        sock.sendall(b"".join(pending))


class CallContext:
    """What a streaming handler may ask about its call: is the caller still connected?"""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._callbacks: list[Callable[[], None]] = []

    def is_active(self) -> bool:
        """False once the caller closed the connection or died (EOF or reset pending on the socket)."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:
                return True
            return bool(self._sock.recv(1, socket.MSG_PEEK))
        except (OSError, ValueError):
            return False

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
        token: the job token; connections that cannot prove it are closed after the handshake.
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
        self._token = token
        self._handlers = dict(handlers)
        self._streams = dict(stream_handlers or {})
        self._max_frame_bytes = max_frame_bytes
        host, port = split_address(address) if address else (DEFAULT_HOST, 0)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(128)
        except OSError as exc:
            self._listener.close()
            raise OSError(f"{name}: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"spread-rpc-{name}", daemon=True)
        self.refused_connections = 0

    def start(self) -> RpcServer:
        self._acceptor.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` was called; True if it was within ``timeout``."""
        return self._stopping.wait(timeout)

    def stop(self) -> None:
        """Close the listener and every connection, and join every thread this server started."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if self._acceptor.is_alive() and self._acceptor is not threading.current_thread():
            self._acceptor.join()
        with self._lock:
            connections = dict(self._connections)
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in connections.values():
            if thread is not threading.current_thread():
                thread.join()

    # -- connections -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve_connection, args=(sock,), name=f"spread-rpc-{self.name}-conn", daemon=True
            )
            with self._lock:
                if self._stopping.is_set():
                    sock.close()
                    return
                self._connections[sock] = thread
            thread.start()

    def _handshake(self, sock: socket.socket) -> bool:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sock.settimeout(30.0)  # a silent peer must not hold a thread forever
        sock.sendall(_HELLO + nonce)
        proof = bytes(_recv_exact(sock, hashlib.sha256().digest_size))
        if not hmac.compare_digest(proof, token_proof(self._token, nonce)):
            self.refused_connections += 1
            message = (
                f"{self.name} refused the connection: the caller's SPREAD_JOB_TOKEN does not match this job's"
            )
            sock.sendall(_STATUS.pack(REFUSED, len(message.encode())) + message.encode())
            return False
        sock.sendall(_STATUS.pack(OK, 0))
        sock.settimeout(None)
        return True

    def _serve_connection(self, sock: socket.socket) -> None:
        try:
            if not self._handshake(sock):
                return
            while not self._stopping.is_set():
                (method_len,) = _CALL.unpack(_recv_exact(sock, _CALL.size))
                method = bytes(_recv_exact(sock, method_len)).decode("utf-8", "replace")
                (frame_len,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
                if frame_len > self._max_frame_bytes:
                    self._reply(
                        sock,
                        INVALID,
                        f"{self.name}: malformed frame: declares {frame_len} bytes, "
                        f"over the limit of {self._max_frame_bytes}".encode(),
                    )
                    return  # the rest of this stream cannot be trusted: drop the connection
                self._dispatch(sock, method, _recv_exact(sock, frame_len))
        except (OSError, ConnectionError):
            pass  # the caller went away; nothing to answer
        finally:
            with self._lock:
                self._connections.pop(sock, None)
            sock.close()

    def _reply(self, sock: socket.socket, status: int, body: bytes) -> None:
        sock.sendall(_STATUS.pack(status, len(body)) + body)

    def _reply_frame(self, sock: socket.socket, status: int, message: Message) -> None:
        parts = encode_parts(*message)
        _send_parts(sock, _STATUS.pack(status, sum(len(p) for p in parts)), parts)

    def _dispatch(self, sock: socket.socket, method: str, frame: bytearray) -> None:
        try:
            meta, tensors = decode(frame, max_tensor_bytes=self._max_frame_bytes)
        except WireFormatError as exc:
            self._reply(sock, INVALID, f"{self.name}: {exc}".encode())
            return
        if method in self._streams:
            self._serve_stream(sock, method, meta, tensors)
            return
        handler = self._handlers.get(method)
        if handler is None:
            self._reply(sock, REFUSED, f"{self.name}: unknown method {method!r}".encode())
            return
        try:
            answer = handler(meta, tensors)
        except RequestRefused as exc:
            self._reply(sock, REFUSED, f"{self.name}: {exc}".encode())
            return
        except Exception as exc:
            _log.exception("%s: %s failed", self.name, method)
            self._reply(sock, FAULT, f"{self.name}: {type(exc).__name__}: {exc}".encode())
            return
        self._reply_frame(sock, OK, answer)

    def _serve_stream(self, sock: socket.socket, method: str, meta: dict, tensors: Tensors) -> None:
        context = CallContext(sock)
        try:
            for message in self._streams[method](meta, tensors, context):
                self._reply_frame(sock, STREAM_ITEM, message)
            self._reply(sock, STREAM_END, b"")
        except RequestRefused as exc:
            self._reply(sock, REFUSED, f"{self.name}: {exc}".encode())
        finally:
            context._end()


class RpcClient:
    """Calls to one server: a deadline on each, errors naming the peer, and byte counters.

    Thread-safe: concurrent calls use separate connections (kept in a small pool).

    Args:
        address: the server's ``host:port``.
        peer: how errors name the server (``"parameter server 1 (10.0.0.2:2222)"``).
        token: the job token (proved in each connection's handshake, never sent).
        timeout: default deadline of a call, in seconds.
        error_type: the :class:`RemoteCallError` subclass raised for failed calls.
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
        self._host, self._port = split_address(address)
        self._token = token
        self._error_type = error_type
        self._max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._closed = False
        self.bytes_sent = 0
        self.bytes_received = 0

    def _count(self, sent: int, received: int) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def _connect(self, op: str, deadline: float, wait_for_ready: bool) -> socket.socket:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._error_type(self.peer, op, f"not reachable within {self.timeout:g}s")
            try:
                sock = socket.create_connection((self._host, self._port), timeout=remaining)
            except OSError as exc:
                if not wait_for_ready:
                    raise self._error_type(
                        self.peer, op, f"unreachable (it died or never started): {exc}"
                    ) from None
                time.sleep(min(0.05, max(remaining, 0)))
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello = _recv_exact(sock, len(_HELLO) + _NONCE_BYTES)
                if bytes(hello[: len(_HELLO)]) != _HELLO:
                    raise ConnectionError("the peer is not a spread server")
                sock.sendall(token_proof(self._token, bytes(hello[len(_HELLO) :])))
                status, length = _STATUS.unpack(_recv_exact(sock, _STATUS.size))
                if status != OK:
                    message = bytes(_recv_exact(sock, min(length, 4096))).decode("utf-8", "replace")
                    sock.close()
                    raise JobTokenError(f"{self.peer}: {op} refused: {message}")
                return sock
            except (OSError, ConnectionError) as exc:
                sock.close()
                if not wait_for_ready:
                    raise self._error_type(self.peer, op, f"connection failed: {exc}") from None
                time.sleep(0.05)

    def _take(self, op: str, deadline: float, wait_for_ready: bool) -> tuple[socket.socket, bool]:
        """A connection, and whether it is a kept-alive one from the pool."""
        with self._lock:
            if self._closed:
                raise self._error_type(self.peer, op, "the client was closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(op, deadline, wait_for_ready), False

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def _send_request(self, sock: socket.socket, method: str, meta: Any, tensors: Any) -> int:
        name = method.encode()
        parts = encode_parts(meta, tensors)
        size = sum(len(p) for p in parts)
        _send_parts(sock, _CALL.pack(len(name)) + name + _LEN.pack(size), parts)
        return size

    def _read_answer(self, sock: socket.socket, op: str) -> tuple[int, bytearray]:
        status, length = _STATUS.unpack(_recv_exact(sock, _STATUS.size))
        if status in (OK, STREAM_ITEM) and length > self._max_frame_bytes:
            raise self._error_type(self.peer, op, f"answer of {length} bytes is over the frame limit")
        body = _recv_exact(sock, length if status in (OK, STREAM_ITEM) else min(length, 1 << 20))
        self._count(0, _STATUS.size + length)
        return status, body

    def _raise_for(self, status: int, body: bytearray, op: str) -> None:
        text = bytes(body).decode("utf-8", "replace")
        if status == INVALID:
            raise WireFormatError(f"{self.peer}: {op} refused: {text}")
        raise self._error_type(self.peer, op, text)

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
        for attempt in (0, 1):
            sock, reused = self._take(method, deadline, wait_for_ready)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                sent = self._send_request(sock, method, meta, tensors)
                self._count(sent, 0)
                status, body = self._read_answer(sock, method)
                break
            except TimeoutError:
                sock.close()
                raise self._error_type(self.peer, method, f"no answer within {budget:g}s") from None
            except (OSError, ConnectionError) as exc:
                sock.close()
                # A kept-alive connection may have died while idle (the server restarted): try once
                # on a fresh one. Safe because every call is idempotent (pushes by their step id).
                if reused and attempt == 0:
                    continue
                raise self._error_type(self.peer, method, f"connection lost (it died?): {exc}") from None
        self._give_back(sock)
        if status != OK:
            self._raise_for(status, body, method)
        return decode(body, max_tensor_bytes=self._max_frame_bytes)

    def stream(
        self, method: str, meta: Mapping[str, Any] | None = None, *, connect_timeout: float | None = None
    ) -> Stream:
        """Open a streaming call (it waits for the server to start, within ``connect_timeout``)."""
        deadline = time.monotonic() + (self.timeout if connect_timeout is None else connect_timeout)
        sock = self._connect(method, deadline, wait_for_ready=True)
        try:
            sock.settimeout(None)
            self._count(self._send_request(sock, method, meta, None), 0)
        except OSError as exc:
            sock.close()
            raise self._error_type(self.peer, method, f"connection lost: {exc}") from None
        return Stream(self, method, sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


class Stream:
    """The messages of a streaming call, in order; :meth:`cancel` ends it from this side."""

    def __init__(self, client: RpcClient, op: str, sock: socket.socket) -> None:
        self._client, self._op, self._sock = client, op, sock
        self._cancelled = False

    def __iter__(self) -> Iterator[Message]:
        try:
            while True:
                try:
                    status, body = self._client._read_answer(self._sock, self._op)
                except (OSError, ConnectionError) as exc:
                    if self._cancelled:
                        return
                    raise self._client._error_type(
                        self._client.peer, self._op, f"connection lost (it died?): {exc}"
                    ) from None
                if status == STREAM_END:
                    return
                if status != STREAM_ITEM:
                    self._client._raise_for(status, body, self._op)
                yield decode(body, max_tensor_bytes=self._client._max_frame_bytes)
        finally:
            self._sock.close()

    def cancel(self) -> None:
        self._cancelled = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
