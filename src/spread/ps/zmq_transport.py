"""The RPC layer under the parameter servers and the coordinator, on ZeroMQ (``pyzmq``).

Implements the interfaces of :mod:`spread.ps.rpc_api` (:class:`ZmqServer`, :class:`ZmqClient`,
:class:`ZmqStream`), like :mod:`spread.ps.grpc_transport`, so the transport is chosen by name
(:mod:`spread.ps.transports`). Why ZeroMQ: spread's rules ask for a well-kept network library,
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
* A connection opens a session (:mod:`spread.ps.rpc_api`): ``[HELLO, request id, client nonce]``
  is answered ``[request id, WELCOME, session id, server nonce, server proof]``, and the client
  checks the proof before it sends anything else. A request is then ``[kind, request id, method,
  session id, sequence number, MAC, frame parts...]``: the :mod:`spread.ps.wire` frame's header and
  each tensor's memory travel as separate parts, sent without copying; the MAC (over the envelope
  and the header) is checked in constant time, and the sequence number accepted once, before the
  method or the frame is looked at; a failed check is refused and counted.
* An answer is ``[request id, status, MAC, body parts...]``, the MAC binding it to its request (and
  a stream's item to its place in the stream); the client drops the call on an answer that fails
  it. Refusals the server cannot tie to a session (``DENIED``, ``NO_SESSION``, a malformed
  envelope) carry no MAC and only ever end a call. A stream answers ``STREAM_OPEN`` (so a wrong
  token or an unreachable chief is reported by :meth:`ZmqClient.stream`), then items, then
  ``STREAM_END``; the caller cancels with a ``CANCEL`` message naming the request id.
* Every connection speaks CURVE (encrypted and authenticated ZMTP): the server's secret key is
  derived from the job token, clients derive its public key and use a keypair of their own. Why:
  ZeroMQ keeps a multipart message until its last part, so a peer that could connect could make a
  server hold any number of parts for as long as it stayed connected, before the session's checks
  ever saw them; a peer that cannot name the server's key now fails the handshake and is dropped,
  and a client that cannot complete it raises :class:`JobTokenError` (nothing was sent). The
  session protocol stays behind it (defence in depth: it also binds answers to their requests).
  CURVE costs ~2-3x the time of a 4 MB push or pull on loopback (issue 40, item 3).
* Tensors over ``_PART_BYTES`` travel cut into parts of that size, and ``zmq.MAXMSGSIZE`` is that
  (or ``max_frame_bytes`` if smaller): ZeroMQ drops a connection whose next part declares more, before
  allocating it, so an unfinished handshake holds at most that much, for at most ``_HANDSHAKE_MS``. A
  frame whose parts add up to more than ``max_frame_bytes`` is refused, and
  :func:`spread.ps.wire.decode` validates every frame.
* ``SNDHWM``: at most ``_SNDHWM`` answers wait for a peer that reads none; later ones are dropped.

Servers bind ``127.0.0.1`` unless given an address; :meth:`ZmqServer.stop` joins every thread it
started and terminates its ZeroMQ context.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from spread.errors import JobTokenError, RemoteCallError, SpreadError, WireFormatError
from spread.ps.rpc_api import (
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
from spread.ps.wire import DEFAULT_MAX_FRAME_BYTES, decode, decode_parts, encode_parts

HELLO, CALL, STREAM, CANCEL = b"H", b"C", b"S", b"X"
OK, REFUSED, INVALID, FAULT, DENIED, STREAM_OPEN, STREAM_ITEM, STREAM_END, HEARTBEAT, WELCOME, NO_SESSION = (
    bytes([i]) for i in range(11)
)
_UNSIGNED = (DENIED, NO_SESSION)  # refusals not tied to a session: they can only end a call
_REQUEST, _ANSWER = b"zmq-request", b"zmq-answer"  # MAC labels: a request never passes as an answer
_MAX_PARTS = 4096  # a frame's header and tensors; more is refused before decoding
_PART_BYTES = 16 << 20  # a tensor over this travels in several parts: MAXMSGSIZE stays this small
_CURVE_OVERHEAD = 64  # what CURVE adds to each part on the wire (33 bytes), rounded up
_CURVE = zmq.has("curve")  # libzmq built with CURVE (pyzmq's wheels always are)
_HANDSHAKE_MS = 10_000  # a connection that has not finished the CURVE handshake by then is dropped
_HANDSHAKE_TRIES = 3  # failed CURVE handshakes in a row before a client calls the server an impostor
_SNDHWM = 1000  # answers queued for one peer that reads none; then they are dropped
_HEARTBEAT_MS = 10_000  # ZMTP heartbeats: notice a peer whose host died (no FIN ever comes)
_PROBE_INTERVAL = 0.5  # at most one liveness probe per stream this often
_DRAIN_SECONDS = 1.0  # stop() lets calls already being handled answer for this long
_LINGER_MS = 1000  # and then lets their answers leave for this long
_LATE_ANSWER_MS = 50  # after a disconnect, how long answers received before it may take to surface
_log = logging.getLogger(__name__)


def _server_secret_key(token: str) -> bytes:
    """The server's CURVE secret key (Z85), derived from the job token: only the job's processes can
    compute its public key, and a peer that does not know it cannot complete the handshake."""
    return z85.encode(hmac.new(token.encode(), b"spread zmq curve server key", hashlib.sha256).digest())


def server_public_key(token: str) -> bytes:
    """The CURVE public key (Z85) a job's clients expect of its servers."""
    return zmq.curve_public(_server_secret_key(token))


def _limit_parts(socket: zmq.Socket, max_frame_bytes: int) -> None:
    """ZeroMQ drops a connection whose next part declares more than MAXMSGSIZE, before allocating it;
    parts are cut at ``_PART_BYTES``, so that is all a peer can make a socket hold for one part
    (the handshake's included)."""
    size = min(max_frame_bytes, _PART_BYTES) + (_CURVE_OVERHEAD if _CURVE else 0)
    socket.setsockopt(zmq.MAXMSGSIZE, size)
    socket.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)


def _cut(parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """``parts`` with each one over ``_PART_BYTES`` cut into slices (views, no copy); the receiver
    joins a frame that came cut (:func:`_decode_body`)."""
    out: list[bytes | memoryview] = []
    for part in parts:
        view = memoryview(part).cast("B")
        if view.nbytes <= _PART_BYTES:
            out.append(part)
            continue
        out.extend(view[i : i + _PART_BYTES] for i in range(0, view.nbytes, _PART_BYTES))
    return out


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _first(parts: Sequence[zmq.Frame | bytes | memoryview]) -> memoryview | bytes:
    """The part a MAC covers besides the envelope: the frame header (or a refusal's text)."""
    if not parts:
        return b""
    return parts[0].buffer if isinstance(parts[0], zmq.Frame) else parts[0]


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


class ZmqCallContext(CallContext):
    """A stream's caller is still there until it cancels, or its socket is found gone: the I/O
    thread probes it with a heartbeat now and then (the probe's send fails once it left)."""

    def __init__(self, server: ZmqServer, identity: bytes, rid: bytes, session: Session) -> None:
        super().__init__()
        self._server, self._identity, self._rid = server, identity, rid
        self._session = session
        self._index = 0  # the place of the next answer in this stream (bound by its MAC)
        self._gone = False  # the caller cancelled, or its connection is gone
        self._last_probe = 0.0

    def is_active(self) -> bool:
        if self._gone or self._server._stopping.is_set():
            return False
        now = time.monotonic()
        if now - self._last_probe >= _PROBE_INTERVAL:  # ask the I/O thread whether it can reach it
            self._last_probe = now
            self._server._send([self._identity, self._rid, HEARTBEAT], probe=self)
        return not self._gone


class ZmqServer(RpcServer):
    """:class:`~spread.ps.rpc_api.RpcServer` on one ``ROUTER`` socket driven by one I/O thread;
    ``max_frame_bytes`` is also ZeroMQ's ``MAXMSGSIZE`` (a larger part drops the connection)."""

    transport = "zmq"

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
        self._busy = 0  # unary calls being handled (their answers are awaited by stop())
        self._idle = threading.Condition(threading.Lock())
        self._contexts: dict[bytes, ZmqCallContext] = {}  # open streams by request id
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[list[Any], ZmqCallContext | None]] = queue.SimpleQueue()
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a caller that left fails
        # A peer reading none of its answers makes the server hold at most _SNDHWM of them: then a
        # send fails (ROUTER_MANDATORY) and the answer is dropped. A caller waits for each answer.
        self._router.setsockopt(zmq.SNDHWM, _SNDHWM)
        _limit_parts(self._router, max_frame_bytes)
        if _CURVE:  # a peer without the job token never completes the handshake: nothing is buffered
            self._router.setsockopt(zmq.CURVE_SERVER, 1)
            self._router.setsockopt(zmq.CURVE_SECRETKEY, _server_secret_key(token))
        else:
            _log.warning("%s: libzmq has no CURVE: peers without the job token can make it buffer", name)
        self._router.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_MS)
        host, port = self._bind_host, self._bind_port
        if ":" in host:
            self._router.setsockopt(zmq.IPV6, 1)
        try:
            self._router.bind(_endpoint(host, port or "*"))
        except zmq.ZMQError as exc:
            self._router.close(0)
            self._context.term()
            self._executor.shutdown(wait=False)
            raise OSError(f"{name}: cannot listen on {host}:{port}: {exc}") from None
        bound = self._router.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
        self.address = f"{host}:{bound}"
        self._max_parts = _MAX_PARTS + 7 + max_frame_bytes // _PART_BYTES  # envelope and cut tensors
        self.dropped_answers = 0  # answers dropped for a peer that read none of _SNDHWM queued
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._io = threading.Thread(target=self._io_loop, name=f"spread-zmq-{name}-io", daemon=True)

    def start(self) -> ZmqServer:
        self._io.start()
        return self

    def stop(self) -> None:
        """As :meth:`RpcServer.stop`, and the ZeroMQ context ends too.

        Calls already being handled get ``_DRAIN_SECONDS`` to answer, and every answer produced
        gets ``_LINGER_MS`` to leave (a ``stop`` call's own answer, a stream's last item).
        """
        if self._stopping.is_set():
            return
        inside = threading.current_thread()
        if not self._on_handler_thread():
            deadline = time.monotonic() + _DRAIN_SECONDS
            with self._idle:
                while self._busy and time.monotonic() < deadline:
                    self._idle.wait(max(0.0, deadline - time.monotonic()))
        self._stopping.set()
        self._wake()
        if self._io.is_alive() and self._io is not inside:
            self._io.join()
        elif not self._io.is_alive() and not self._io.ident:
            self._router.close(0)  # never started
        self._release_handlers()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._context.term()

    # -- the I/O thread ----------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"w")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the I/O thread is already due to wake up

    def _send(self, parts: list[Any], probe: ZmqCallContext | None = None) -> None:
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
            self._flush()
            self._router.setsockopt(zmq.LINGER, _LINGER_MS)
            self._router.close()

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
                elif exc.errno == zmq.EAGAIN:  # _SNDHWM answers unread: the peer reads nothing
                    self.dropped_answers += 1
                    if self.dropped_answers == 1:
                        _log.warning("%s: dropping answers to a peer that reads none", self.name)
                elif exc.errno != zmq.EHOSTUNREACH:
                    _log.warning("%s: could not send an answer: %s", self.name, exc)

    def _receive(self, parts: list[zmq.Frame]) -> None:
        identity = parts[0].bytes
        if len(parts) < 3:  # no request id to answer to: answer to none
            self._refuse(identity, b"", INVALID, f"{self.name}: malformed request ({len(parts) - 1} part(s))")
            return
        kind, rid = parts[1].bytes, parts[2].bytes
        if kind == HELLO:
            self._hello(identity, rid, parts[3:])
            return
        if kind not in (CALL, STREAM, CANCEL) or len(parts) < 7 or len(parts) > self._max_parts:
            self._refuse(identity, rid, INVALID, f"{self.name}: malformed request")
            return
        method, session_id, seq, mac = (p.bytes for p in parts[3:7])
        body = parts[7:]
        try:
            session = self._sessions.verify(session_id, seq, mac, _REQUEST, kind, rid, method, _first(body))
        except SessionRefused as exc:
            if not exc.unknown:
                self._count_refusal()
            self._refuse(
                identity,
                rid,
                NO_SESSION if exc.unknown else DENIED,
                f"{self.name} refused the request: {exc}",
            )
            return
        if kind == CANCEL:
            with self._lock:
                ctx = self._contexts.get(rid)
            if ctx is not None:
                ctx._gone = True
            return
        size = sum(len(p) for p in body)
        if size > self._max_frame_bytes:
            self._answer(
                identity,
                rid,
                INVALID,
                f"{self.name}: frame over the size limit: {size} bytes, over {self._max_frame_bytes}",
                session,
            )
            return
        name = method.decode("utf-8", "replace")
        if kind == STREAM and name in self._streams:
            ctx = ZmqCallContext(self, identity, rid, session)
            with self._lock:
                self._contexts[rid] = ctx
            self._executor.submit(self._serve_stream, ctx, name, body)
        else:
            with self._idle:
                self._busy += 1
            self._executor.submit(self._serve_unary, identity, rid, name, body, session)

    def _hello(self, identity: bytes, rid: bytes, parts: list[zmq.Frame]) -> None:
        """Open a session: prove the token to the caller, who proves it back in every request."""
        if len(parts) != 1:
            self._refuse(identity, rid, INVALID, f"{self.name}: malformed handshake")
            return
        try:
            session_id, nonce, proof = self._sessions.hello(parts[0].bytes)
        except SessionRefused as exc:
            self._refuse(identity, rid, INVALID, f"{self.name}: malformed handshake: {exc}")
            return
        self._send([identity, rid, WELCOME, session_id, nonce, proof])

    # -- handlers (pool threads) -------------------------------------------------------------------
    def _refuse(self, identity: bytes, rid: bytes, status: bytes, text: str) -> None:
        """An answer outside any session (no MAC): it can only make the caller give up the call."""
        self._send([identity, rid, status, b"", text.encode()])

    def _answer(
        self, identity: bytes, rid: bytes, status: bytes, text: str, session: Session, index: int = 0
    ) -> None:
        self._signed(identity, rid, status, [text.encode()], session, index)

    def _answer_frame(
        self, identity: bytes, rid: bytes, status: bytes, message: Message, session: Session, index: int = 0
    ) -> None:
        self._signed(identity, rid, status, encode_parts(*message), session, index)

    def _signed(
        self, identity: bytes, rid: bytes, status: bytes, body: list[Any], session: Session, index: int
    ) -> None:
        mac = session.mac(_ANSWER, rid, status, seq_bytes(index), _first(body))
        self._send([identity, rid, status, mac, *_cut(body)])

    def _decode(self, identity: bytes, rid: bytes, body: list[zmq.Frame], session: Session) -> Message | None:
        try:
            return _decode_body(body, self._max_frame_bytes)[0]
        except WireFormatError as exc:
            self._answer(identity, rid, INVALID, f"{self.name}: {exc}", session)
            return None

    def _serve_unary(
        self, identity: bytes, rid: bytes, method: str, body: list[zmq.Frame], session: Session
    ) -> None:
        try:
            self._handle_unary(identity, rid, method, body, session)
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _handle_unary(
        self, identity: bytes, rid: bytes, method: str, body: list[zmq.Frame], session: Session
    ) -> None:
        request = self._decode(identity, rid, body, session)
        if request is None:
            return
        try:
            answer = self._invoke(method, *request)
        except CallFailed as exc:
            self._answer(identity, rid, FAULT if exc.fault else REFUSED, str(exc), session)
            return
        try:
            self._answer_frame(identity, rid, OK, answer, session)
        except Exception as exc:  # an answer the wire format cannot carry
            self._answer(identity, rid, FAULT, f"{self.name}: {type(exc).__name__}: {exc}", session)

    def _serve_stream(self, ctx: ZmqCallContext, method: str, body: list[zmq.Frame]) -> None:
        identity, rid, session = ctx._identity, ctx._rid, ctx._session

        def send(status: bytes, message: Message | None = None, text: str | None = None) -> None:
            if text is not None:
                self._answer(identity, rid, status, text, session, ctx._index)
            else:
                self._answer_frame(identity, rid, status, message or ({}, {}), session, ctx._index)
            ctx._index += 1

        try:
            request = self._decode(identity, rid, body, session)
            if request is None:
                return
            send(STREAM_OPEN)
            messages = self._streams[method](*request, ctx)
            try:
                for message in messages:
                    if not ctx.is_active():
                        return  # the caller left: do not run the handler any further
                    send(STREAM_ITEM, message)
                if not self._stopping.is_set():  # else the caller sees the connection go, not an end
                    send(STREAM_END)
            except Exception as exc:
                failure = self._failure(method, exc)
                send(FAULT if failure.fault else REFUSED, text=str(failure))
            finally:
                messages.close()
        finally:
            with self._lock:
                self._contexts.pop(rid, None)
            ctx._gone = True
            ctx._run_end_callbacks()


class _Lost(Exception):
    """The connection under a call went away (the reason is the message)."""


class _Impostor(Exception):
    """The CURVE handshake failed: the peer does not know the job's server key (or we do not)."""


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class _Connection:
    """One DEALER socket to the server and its monitor; used by one thread at a time."""

    def __init__(self, endpoint: str, max_frame_bytes: int, ipv6: bool, server_key: bytes | None) -> None:
        context = _shared_context()
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        _limit_parts(self.socket, max_frame_bytes)
        if server_key is not None:  # a keypair of its own; the server's key proves the job token
            public, secret = zmq.curve_keypair()
            self.socket.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            self.socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_MS)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 50)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if ipv6:
            self.socket.setsockopt(zmq.IPV6, 1)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | _HANDSHAKE_FAILED
            | zmq.EVENT_CONNECT_RETRIED
            | zmq.EVENT_DISCONNECTED
        )
        self.socket.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.connected = False  # the handshake succeeded (ZeroMQ's, then CURVE's)
        self.lost = False  # connected once, then disconnected: never reused
        self.session: Session | None = None  # opened by the first call on this connection

    def events(self) -> list[int]:
        """Connection events since the last look (updating :attr:`connected` and :attr:`lost`)."""
        seen: list[int] = []
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return seen
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected, self.lost = False, True
            seen.append(event)

    def wait_connected(self, deadline: float, wait_for_ready: bool) -> bool:
        """True once connected; raises :class:`_Lost` if refused (unless waiting for it to start), and
        :class:`_Impostor` when the handshake fails (the peer does not hold the job's CURVE key)."""
        failed_handshakes = 0
        while not self.connected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if not self.monitor.poll(max(1, int(remaining * 1000))):
                continue
            for event in self.events():
                if event == zmq.EVENT_CONNECT_RETRIED and not wait_for_ready and not failed_handshakes:
                    raise _Lost("unreachable (it died or never started): connection refused")
                if event & _HANDSHAKE_FAILED:
                    # A server that dropped a handshake it found too slow (a loaded machine) looks
                    # the same from here as one holding another key: only a repeated failure (ZeroMQ
                    # reconnects at once) is taken for another job's server.
                    failed_handshakes += 1
                    ambiguous = event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL  # dropped, no reason given
                    if not ambiguous or failed_handshakes >= _HANDSHAKE_TRIES:
                        raise _Impostor()
        return True

    def receive(self, rid: bytes, deadline: float | None) -> list[zmq.Frame] | None:
        """The next answer to ``rid`` (``[status, body...]``), or None at the deadline."""
        while True:
            left_ms = 1000 if deadline is None else int((deadline - time.monotonic()) * 1000)
            wait_ms = min(max(0, left_ms), 1000)
            ready = dict(self.poller.poll(wait_ms))
            if ready.get(self.socket):
                parts = self.socket.recv_multipart(copy=False)
                if len(parts) >= 2 and parts[0].bytes == rid:
                    return parts[1:]
                continue  # an answer to an earlier call on this socket: never this call's
            if ready.get(self.monitor):
                self.events()
                if self.lost:
                    # What the server sent before closing (a stream's last "stop") may sit behind the
                    # disconnect event: it is still an answer, not a lost connection.
                    parts = self._already_received(rid)
                    if parts is not None:
                        return parts
                    raise _Lost("connection lost (it died, or dropped a message part over its size limit)")
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _already_received(self, rid: bytes) -> list[zmq.Frame] | None:
        """The answer to ``rid`` among the messages that arrived before the disconnect, if any."""
        while self.socket.poll(_LATE_ANSWER_MS, zmq.POLLIN):
            parts = self.socket.recv_multipart(copy=False)
            if len(parts) >= 2 and parts[0].bytes == rid:
                return parts[1:]
        return None

    def close(self) -> None:
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.socket.close(0)


class ZmqClient(RpcClient):
    """:class:`~spread.ps.rpc_api.RpcClient` on ``DEALER`` sockets: concurrent calls use separate
    sockets (kept in a small pool), so a slow call never holds up another."""

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
        self._endpoint = _endpoint(self._host, self._port)
        self._ipv6 = ":" in self._host
        self._server_key = server_public_key(token) if _CURVE else None
        self._idle: list[_Connection] = []

    def _take(self, op: str) -> _Connection:
        with self._lock:
            if self._closed:
                raise self._closed_error(op)
            while self._idle:
                conn = self._idle.pop()
                conn.events()
                if not conn.lost:
                    return conn
                conn.close()  # it died while idle (the server restarted): a fresh one instead
        return _Connection(self._endpoint, self._max_frame_bytes, self._ipv6, self._server_key)

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and not conn.lost:
                self._idle.append(conn)
                return
        conn.close()

    def _open_session(self, conn: _Connection, deadline: float, op: str) -> Session:
        """The handshake on a new connection: nothing is sent to a server that cannot prove the token."""
        if conn.session is not None:
            return conn.session
        handshake = ClientHandshake(self._token)
        rid = secrets.token_bytes(8)
        conn.socket.send_multipart([HELLO, rid, handshake.nonce])
        answer = conn.receive(rid, deadline)
        if answer is None:
            raise self._failed(op, "no answer to the handshake before the deadline")
        session = None
        if answer[0].bytes == WELCOME and len(answer) == 4:
            session = handshake.finish(*(p.buffer for p in answer[1:]))
        if session is None:
            raise self._impostor(op)
        conn.session = session
        return session

    def _send(self, conn: _Connection, kind: bytes, rid: bytes, method: str, meta: Any, tensors: Any) -> None:
        session = conn.session
        assert session is not None
        parts = encode_parts(meta, tensors)
        name = method.encode()
        seq = seq_bytes(session.next_seq())
        mac = session.mac(_REQUEST, seq, kind, rid, name, _first(parts))
        conn.socket.send_multipart([kind, rid, name, session.session_id, seq, mac, *_cut(parts)], copy=False)
        self._count(sum(len(p) for p in parts), 0)

    def _open_answer(
        self, conn: _Connection, rid: bytes, answer: list[zmq.Frame], index: int, op: str
    ) -> tuple[bytes, list[zmq.Frame]]:
        """``(status, body)`` of an answer that proves it belongs to this call (and to this place in a
        stream); an unsigned one only when it ends the call (a refusal outside the session)."""
        status = answer[0].bytes
        if status in _UNSIGNED and len(answer) >= 2:
            return status, answer[2:]
        session = conn.session
        if (
            session is None
            or len(answer) < 2
            or not session.verify(
                answer[1].buffer, _ANSWER, rid, status, seq_bytes(index), _first(answer[2:])
            )
        ):
            raise self._forged(op)
        return status, answer[2:]

    def _raise_for(self, status: bytes, body: list[zmq.Frame], op: str) -> None:
        text = _text(body)
        if status == DENIED:
            raise JobTokenError(f"{self.peer}: {op} refused: {text}")
        if status == INVALID:
            raise WireFormatError(f"{self.peer}: {op} refused: {text}")
        raise self._failed(op, text)

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
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        for attempt in range(2):  # a second time only if the server had forgotten the session
            status, body = self._call_once(method, meta, tensors, budget, deadline, wait_for_ready)
            if status != NO_SESSION or attempt:
                break
        if status != OK:
            self._raise_for(status, body, method)
        return self._decode(body)

    def _call_once(
        self,
        method: str,
        meta: Mapping[str, Any] | None,
        tensors: Mapping[str, torch.Tensor] | None,
        budget: float,
        deadline: float,
        wait_for_ready: bool,
    ) -> tuple[bytes, list[zmq.Frame]]:
        conn = self._take(method)
        answer = None
        try:
            if not conn.wait_connected(deadline, wait_for_ready):
                what = "not reachable or no answer" if wait_for_ready else "not reachable"
                raise self._failed(method, f"{what} within {budget:g}s")
            self._open_session(conn, deadline, method)
            rid = secrets.token_bytes(8)
            self._send(conn, CALL, rid, method, meta, tensors)
            answer = conn.receive(rid, deadline)
            if answer is None:
                raise self._failed(method, f"no answer within {budget:g}s")
            status, body = self._open_answer(conn, rid, answer, 0, method)
            if status == NO_SESSION:
                conn.session = None  # the server forgot it (or restarted): open another
            return status, body
        except _Lost as exc:
            raise self._failed(method, str(exc)) from None
        except _Impostor:
            raise self._impostor(method) from None
        except JobTokenError:
            answer = None  # nothing more is taken from this connection
            raise
        finally:
            if answer is None:
                conn.close()  # a late answer must not meet the next call
            else:
                self._give_back(conn)

    def stream(
        self, method: str, meta: Mapping[str, Any] | None = None, *, connect_timeout: float | None = None
    ) -> ZmqStream:
        budget = self.timeout if connect_timeout is None else connect_timeout
        deadline = time.monotonic() + budget
        with self._lock:
            if self._closed:
                raise self._closed_error(method)
        conn = _Connection(self._endpoint, self._max_frame_bytes, self._ipv6, self._server_key)
        rid = secrets.token_bytes(8)
        try:
            if not conn.wait_connected(deadline, wait_for_ready=True):
                raise self._failed(method, f"not reachable within {budget:g}s")
            self._open_session(conn, deadline, method)
            self._send(conn, STREAM, rid, method, meta, None)
            answer = conn.receive(rid, deadline)
            if answer is None:
                raise self._failed(method, f"not reachable or no answer within {budget:g}s")
            status, body = self._open_answer(conn, rid, answer, 0, method)
            if status != STREAM_OPEN:
                self._raise_for(status, body, method)
        except _Lost as exc:
            conn.close()
            raise self._failed(method, str(exc)) from None
        except _Impostor:
            conn.close()
            raise self._impostor(method) from None
        except BaseException:
            conn.close()
            raise
        return ZmqStream(self, method, conn, rid)

    def _cancel(self, rid: bytes) -> None:
        """Tell the server a stream is over (from any thread: on a pooled socket, no answer)."""
        try:
            conn = self._take("cancel")
        except RemoteCallError:
            return
        deadline = time.monotonic() + 1.0
        try:
            if conn.wait_connected(deadline, wait_for_ready=False):
                self._open_session(conn, deadline, "cancel")
                self._send(conn, CANCEL, rid, "", None, None)
        except (SpreadError, _Lost, _Impostor):
            conn.close()  # the server is gone or unproven: the stream ends with it anyway
            return
        self._give_back(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class ZmqStream(RpcStream):
    """A streaming call on a socket of its own; it wakes up now and then to see a cancel."""

    def __init__(self, client: ZmqClient, op: str, conn: _Connection, rid: bytes) -> None:
        self._client, self._op, self._conn, self._rid = client, op, conn, rid
        self._cancelled = False
        self._finished = False
        self._index = 1  # STREAM_OPEN was answer 0

    def __iter__(self) -> Iterator[Message]:
        client = self._client
        try:
            while not self._cancelled:
                try:
                    answer = self._conn.receive(self._rid, time.monotonic() + 0.2)
                except _Lost as exc:
                    if self._cancelled:
                        return
                    raise client._failed(self._op, str(exc)) from None
                if answer is None:
                    if client._closed:
                        return
                    continue  # wake up now and then to see a cancel from another thread
                if answer[0].bytes == HEARTBEAT:
                    continue  # a liveness probe: carries nothing
                status, body = client._open_answer(self._conn, self._rid, answer, self._index, self._op)
                self._index += 1
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
