"""What every RPC transport of the parameter servers shares: message types, refusal, sessions.

:mod:`spread.ps.zmq_transport` and :mod:`spread.ps.grpc_transport` re-export these names, so servers,
clients and the coordinator see one ``RequestRefused`` and one session protocol whichever transport
runs.

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

What is not covered: the tensors' bytes (a MAC over every byte would double the cost of a push) and
secrecy (nothing is encrypted). Against an attacker who can modify traffic, use a private network
or TLS tunnels.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

from spread.ps.wire import Tensors

DEFAULT_HOST = "127.0.0.1"

Message = tuple[dict[str, Any], Tensors]
Handler = Callable[[dict[str, Any], Tensors], Message]
StreamHandler = Callable[[dict[str, Any], Tensors, "CallContext"], Iterator[Message]]  # noqa: F821

PROTOCOL = b"spread-rpc-v2"
NONCE_BYTES = 16
SESSION_ID_BYTES = 16
MAC_BYTES = 32
REPLAY_WINDOW = 4096  # requests of one session may arrive this far out of order (gRPC multiplexes)
MAX_SESSIONS = 65536  # per server; the least recently used is forgotten (its client opens another)
Buffer = bytes | bytearray | memoryview


class RequestRefused(Exception):
    """Raised by a handler to refuse a request with a message for the caller (not a server fault)."""


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
