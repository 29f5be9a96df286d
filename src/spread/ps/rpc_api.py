"""What every RPC transport of the parameter servers shares: the interfaces, messages, sessions.

The interfaces: :class:`RpcServer`, :class:`RpcClient`, :class:`RpcStream` and :class:`CallContext`
are abstract base classes that :mod:`spread.ps.zmq_transport` and :mod:`spread.ps.grpc_transport`
implement, so servers, clients and the coordinator are written once against them (the transport is
picked by name in :mod:`spread.ps.transports`). Base classes rather than ``typing.Protocol``: the two
transports share real code (construction, handler dispatch and its error texts, byte counters, end
callbacks) that a Protocol cannot hold, a missing method fails when a class is instantiated (in
every test, no type checker needed), and both implementations live here, so nominal subtyping costs
nothing.

Sessions: both ends prove the job token, and nothing recorded can be replayed. A client connection
(a ZeroMQ socket, a gRPC channel) opens with a handshake: the client sends a fresh nonce, the server
answers with a session id, its own fresh nonce and ``HMAC(token, "server" | both nonces | id)``. The
client checks that proof before it sends anything else (a process at the server's address without
the token cannot pass it, so a worker never takes work from an impostor) and both ends derive the
session key ``HMAC(token, "session" | both nonces | id)``. Every later message carries a MAC under
that key over its envelope (direction, request id or sequence number, method or status, item index)
and its frame header (the JSON meta and the tensors' names, dtypes and shapes); a request's sequence
number is accepted once, so a message recorded from one session is refused in any other (wrong key)
and in its own (number already seen). The token never travels.

What is not covered here: the tensors' bytes (a MAC over every byte would double the cost of a push)
and secrecy. The ZeroMQ transport adds CURVE under the session (encrypted, and a peer without the
token cannot complete the connection); on gRPC nothing is encrypted: against an attacker who can
modify traffic, use a private network or TLS tunnels.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Self

import torch

from spread.errors import JobTokenError, RemoteCallError
from spread.ps.wire import DEFAULT_MAX_FRAME_BYTES, Tensors

DEFAULT_HOST = "127.0.0.1"
MAX_CONCURRENT_CALLS = 256  # per server; threads are made as calls need them; sync pushes block one each

Message = tuple[dict[str, Any], Tensors]
Handler = Callable[[dict[str, Any], Tensors], Message]
# a generator: the server closes it when the caller cancels or goes away
StreamHandler = Callable[[dict[str, Any], Tensors, "CallContext"], Generator[Message, None, None]]

PROTOCOL = b"spread-rpc-v2"
NONCE_BYTES = 16
SESSION_ID_BYTES = 16
MAC_BYTES = 32
REPLAY_WINDOW = 4096  # requests of one session may arrive this far out of order (gRPC multiplexes)
MAX_SESSIONS = 65536  # per server; the least recently used is forgotten (its client opens another)
Buffer = bytes | bytearray | memoryview


_log = logging.getLogger(__name__)


class RequestRefused(Exception):
    """Raised by a handler to refuse a request with a message for the caller (not a server fault)."""


class CallFailed(Exception):
    """A handler refused a call or failed: the text for the caller, which names the server."""

    def __init__(self, text: str, *, fault: bool) -> None:
        super().__init__(text)
        self.fault = fault  # a server fault (the handler raised), not a refusal


class SessionRefused(Exception):
    """A request that does not belong to a live session (``unknown``) or fails its proof."""

    def __init__(self, reason: str, *, unknown: bool = False) -> None:
        super().__init__(reason)
        self.unknown = unknown  # the session was forgotten: the client may open a new one


def _mac(key: bytes, label: bytes, fields: tuple[Buffer, ...]) -> bytes:
    """HMAC-SHA256 over ``label`` and each field, length-prefixed (no two field lists collide)."""
    h = hmac.new(key, PROTOCOL + b":" + label, hashlib.sha256)
    for field in fields:
        view = memoryview(field)
        h.update(view.nbytes.to_bytes(8, "big"))
        h.update(view)
    return h.digest()


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class Session:
    """One side's view of a session: its id and key, and (server side) the request numbers seen."""

    def __init__(self, session_id: bytes, key: bytes) -> None:
        self.session_id = session_id
        self._key = key
        self._lock = threading.Lock()
        self._next = 0  # the client's next request number
        self._highest = -1  # the server's highest accepted request number
        self._seen: set[int] = set()

    def mac(self, label: bytes, *fields: Buffer) -> bytes:
        return _mac(self._key, label, fields)

    def verify(self, mac: Buffer, label: bytes, *fields: Buffer) -> bool:
        return hmac.compare_digest(bytes(mac), _mac(self._key, label, fields))

    def next_seq(self) -> int:
        with self._lock:
            seq, self._next = self._next, self._next + 1
            return seq

    def accept(self, seq: int) -> bool:
        """True the first time request number ``seq`` is seen within the replay window."""
        with self._lock:
            if seq <= self._highest - REPLAY_WINDOW or seq in self._seen:
                return False
            self._seen.add(seq)
            if seq > self._highest:
                self._highest = seq
                if len(self._seen) > 2 * REPLAY_WINDOW:
                    floor = self._highest - REPLAY_WINDOW
                    self._seen = {s for s in self._seen if s > floor}
            return True


def _keys(token: str, client_nonce: bytes, server_nonce: bytes, session_id: bytes) -> tuple[bytes, bytes]:
    """(the server's proof, the session key) for one handshake."""
    secret = token.encode()
    fields = (client_nonce, server_nonce, session_id)
    return _mac(secret, b"server", fields), _mac(secret, b"session", fields)


class ClientHandshake:
    """The client's half of a handshake: send :attr:`nonce`, then :meth:`finish` with the answer."""

    def __init__(self, token: str) -> None:
        self._token = token
        self.nonce = secrets.token_bytes(NONCE_BYTES)

    def finish(self, session_id: Buffer, server_nonce: Buffer, proof: Buffer) -> Session | None:
        """The session, or None when the server did not prove this job's token."""
        session_id, server_nonce = bytes(session_id), bytes(server_nonce)
        if len(session_id) != SESSION_ID_BYTES or len(server_nonce) != NONCE_BYTES:
            return None
        expected, key = _keys(self._token, self.nonce, server_nonce, session_id)
        if not hmac.compare_digest(bytes(proof), expected):
            return None
        return Session(session_id, key)


class SessionTable:
    """The server's sessions: opened by :meth:`hello`, checked on every request by :meth:`verify`."""

    def __init__(self, token: str, max_sessions: int = MAX_SESSIONS) -> None:
        self._token = token
        self._max = max_sessions
        self._lock = threading.Lock()
        self._sessions: collections.OrderedDict[bytes, Session] = collections.OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def hello(self, client_nonce: Buffer) -> tuple[bytes, bytes, bytes]:
        """Open a session for a client's nonce: ``(session id, server nonce, server proof)``."""
        client_nonce = bytes(client_nonce)
        if len(client_nonce) != NONCE_BYTES:
            raise SessionRefused(f"a handshake nonce must be {NONCE_BYTES} bytes")
        session_id = secrets.token_bytes(SESSION_ID_BYTES)
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        proof, key = _keys(self._token, client_nonce, server_nonce, session_id)
        with self._lock:
            self._sessions[session_id] = Session(session_id, key)
            while len(self._sessions) > self._max:
                self._sessions.popitem(last=False)
        return session_id, server_nonce, proof

    def verify(self, session_id: Buffer, seq: Buffer, mac: Buffer, label: bytes, *fields: Buffer) -> Session:
        """The request's session, once its MAC over ``seq`` and ``fields`` checks out and ``seq`` is
        new; raises :class:`SessionRefused` otherwise."""
        with self._lock:
            session = self._sessions.get(bytes(session_id))
            if session is not None:
                self._sessions.move_to_end(session.session_id)
        if session is None:
            raise SessionRefused("unknown or expired session", unknown=True)
        if len(seq) != 8 or not session.verify(mac, label, seq, *fields):
            raise SessionRefused("the caller's SPREAD_JOB_TOKEN does not match this job's (wrong proof)")
        if not session.accept(int.from_bytes(seq, "big")):
            raise SessionRefused("a replayed request (its sequence number was used already)")
        return session


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected a 'host:port' address, got {address!r}")
    return host.strip("[]"), int(port)


# -- the interfaces ------------------------------------------------------------------------------------
class CallContext(ABC):
    """What a streaming handler may ask about its call (one per streaming call).

    The handler gets it as its third argument; it polls :meth:`is_active` while it waits for work
    to send, and registers clean-up with :meth:`on_end`.
    """

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []

    @abstractmethod
    def is_active(self) -> bool:
        """False once the caller cancelled, closed the connection or died, or the server stopped."""

    def on_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the call ends for any reason (the caller died included)."""
        self._callbacks.append(callback)

    def _run_end_callbacks(self) -> None:
        """Called once by the transport when the call is over; a failing callback is logged."""
        for callback in self._callbacks:
            try:
                callback()
            except Exception:
                _log.exception("stream end callback failed")


class RpcServer(ABC):
    """Serve ``handlers`` (method name -> function of ``(meta, tensors)``) for one job.

    Args:
        name: who this server is, in logs and in messages sent to callers (``"parameter server 1"``).
        handlers: unary methods; a handler returns ``(meta, tensors)`` or raises
            :class:`RequestRefused` (the caller gets the message) or any other exception (a fault;
            the caller gets its type and message, the server keeps serving).
        token: the job token; requests outside a session that proved it are refused before anything
            else, and counted in :attr:`refused_connections`.
        stream_handlers: methods answering with a sequence of messages: generators of
            ``(meta, tensors, context)``, ``context`` a :class:`CallContext`.
        address: ``host:port`` to bind; default ``127.0.0.1`` on a free port. A port in use is an
            ``OSError`` naming the server.
        max_frame_bytes: the largest request accepted.

    The constructor binds the port (:attr:`address` holds the one bound); :meth:`start` serves.
    """

    transport: ClassVar[str]  # the name :mod:`spread.ps.transports` knows it by
    address: str

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
        self._refused_lock = threading.Lock()
        self._stopping = threading.Event()
        self._bind_host, self._bind_port = split_address(address) if address else (DEFAULT_HOST, 0)
        self._pool_prefix = f"spread-{self.transport}-{name}"
        self._executor = ThreadPoolExecutor(MAX_CONCURRENT_CALLS, thread_name_prefix=self._pool_prefix)

    @abstractmethod
    def start(self) -> Self:
        """Begin serving (in threads of its own); returns the server."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` was called; True if it was within ``timeout``."""
        return self._stopping.wait(timeout)

    @abstractmethod
    def stop(self) -> None:
        """End every call, close the port and join every thread this server started. Idempotent.

        Calls already being handled get a moment to answer; a stream's handler sees
        :meth:`CallContext.is_active` turn False. Callable from a handler (a ``stop`` method).
        """

    def _count_refusal(self) -> None:
        with self._refused_lock:
            self.refused_connections += 1

    def _on_handler_thread(self) -> bool:
        return threading.current_thread().name.startswith(self._pool_prefix)

    def _release_handlers(self) -> None:
        """Let the handler pool go; handlers still running (a sync push waiting for its round)
        finish on their own deadline. Not waited for from a handler (it would wait for itself)."""
        self._executor.shutdown(wait=not self._on_handler_thread())

    def _invoke(self, method: str, meta: dict[str, Any], tensors: Tensors) -> Message:
        """Run unary ``method``'s handler; raises :class:`CallFailed` with the caller's text."""
        handler = self._handlers.get(method)
        if handler is None:
            raise CallFailed(f"{self.name}: unknown method {method!r}", fault=False)
        try:
            return handler(meta, tensors)
        except Exception as exc:
            raise self._failure(method, exc) from None

    def _failure(self, method: str, exc: Exception) -> CallFailed:
        """What the caller is told of a handler's exception (call it in the ``except`` block: a
        fault is logged here with its traceback)."""
        if isinstance(exc, RequestRefused):
            return CallFailed(f"{self.name}: {exc}", fault=False)
        _log.exception("%s: %s failed", self.name, method)
        return CallFailed(f"{self.name}: {type(exc).__name__}: {exc}", fault=True)


class RpcStream(ABC):
    """The messages of a streaming call (:meth:`RpcClient.stream`), in order.

    Iterating ends when the server ends the stream, or quietly after :meth:`cancel` or the client's
    ``close``; a lost server, a refusal or a message that fails its proof raises (the errors of
    :meth:`RpcClient.call`).
    """

    @abstractmethod
    def __iter__(self) -> Iterator[Message]: ...

    @abstractmethod
    def cancel(self) -> None:
        """End the stream from this side (from any thread); the server's handler sees it end."""


class RpcClient(ABC):
    """Calls to one server: a deadline on each, errors naming the peer, and byte counters.

    Thread-safe: concurrent calls may share one client.

    Args:
        address: the server's ``host:port``.
        peer: how errors name the server (``"parameter server 1 (10.0.0.2:2222)"``).
        token: the job token (proved in each request, and required of the server; never sent).
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
        self._host, self._port = split_address(address)
        self._token = token
        self._error_type = error_type
        self._max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_sent = 0  # every byte of every frame, both ways (handshakes not included)
        self.bytes_received = 0

    @abstractmethod
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

    @abstractmethod
    def stream(
        self, method: str, meta: Mapping[str, Any] | None = None, *, connect_timeout: float | None = None
    ) -> RpcStream:
        """Open a streaming call (it waits for the server to start, within ``connect_timeout``).

        The handshake and the server's first answer come first, so an unreachable server, a wrong
        token or an impostor is reported here; the stream itself has no deadline (it lasts as long
        as the server keeps answering).
        """

    @abstractmethod
    def close(self) -> None:
        """Close every connection; later calls fail naming the peer, open streams end. Idempotent."""

    def _count(self, sent: int, received: int) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def _failed(self, op: str, reason: str) -> RemoteCallError:
        return self._error_type(self.peer, op, reason)

    def _closed_error(self, op: str) -> RemoteCallError:
        return self._failed(op, "the client was closed")

    def _impostor(self, op: str) -> JobTokenError:
        """The server did not prove the job token in the handshake: nothing was sent to it."""
        return JobTokenError(
            f"{self.peer}: {op} refused: its SPREAD_JOB_TOKEN does not match this job's: it could not prove "
            f"the token (another job's server, or a process impersonating it at {self.address}); nothing "
            f"was sent to it"
        )

    def _forged(self, op: str) -> JobTokenError:
        """An answer failed its proof: the call is abandoned."""
        return JobTokenError(
            f"{self.peer}: {op} refused: an answer did not prove this job's SPREAD_JOB_TOKEN (a forged or "
            f"replayed message from {self.address}); the call was abandoned"
        )
