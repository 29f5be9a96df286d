"""Hand-made peers for the transport contract tests, one kind per transport, with the same API.

``RawCaller``: a caller that opens a session without checking the server's proof (so it can sign
with a wrong token) and sends hand-made frames, recorded requests and requests outside any session,
bypassing the client's checks; each answer is an :class:`Outcome`. ``fake_server``: a process at a
server's address without the token, answering the handshake with nothing or a made-up proof and
every other request with a task.
"""

from __future__ import annotations

import socket
import ssl
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import grpc
import zmq
from _zmq_peers import FakeServer, curve_client

from spread.ps import grpc_transport as grpc_rpc
from spread.ps import zmq_transport as zmq_rpc
from spread.ps.rpc_api import ClientHandshake, Session, _keys, seq_bytes
from spread.ps.wire import encode, header_part

TOKEN = "right-token"
FAKE_SERVER_MODES = ("no-handshake", "made-up-proof")
_MADE_UP_WELCOME = (b"s" * 16, b"n" * 16, b"p" * 32)  # session id, nonce, proof


class Outcome(NamedTuple):
    status: str  # "ok", "refused", "invalid", "denied" (a failed proof or a replay), "no-session"
    text: str  # the refusal's message
    signed: bool  # the answer carries a MAC (refusals outside a session cannot)


class RawCaller(Protocol):
    def open(self, token: str = TOKEN) -> Session: ...
    def request(self, frame: bytes, method: str = "echo") -> Any: ...
    def send(self, request: Any) -> Outcome: ...
    def in_unknown_session(self, request: Any) -> Any: ...
    def without_session(self, frame: bytes, method: str = "echo") -> Any: ...
    def close(self) -> None: ...


def task_frame() -> bytes:
    """What an impostor would hand a worker: a task naming ``builtins.exec``."""
    return encode({"op": "task", "function": ["builtins", "exec"], "args": ["print('pwned')"]})


# -- ZeroMQ -------------------------------------------------------------------------------------------
_ZMQ_STATUS = {
    zmq_rpc.OK: "ok",
    zmq_rpc.REFUSED: "refused",
    zmq_rpc.INVALID: "invalid",
    zmq_rpc.DENIED: "denied",
    zmq_rpc.NO_SESSION: "no-session",
}


class ZmqRawCaller:
    """A bare DEALER socket speaking the protocol by hand; it holds the job's CURVE server key (the
    session layer behind it is what it tests), whatever token it signs with."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve_client(self.sock, TOKEN)
        self.sock.connect(f"tcp://{address}")
        self.session: Session | None = None

    def exchange(self, parts: list[bytes]) -> list[bytes]:
        """Send ``parts`` as they are; the answer's parts (after the server's routing)."""
        self.sock.send_multipart(parts)
        assert self.sock.poll(30_000), "no answer from the server"
        return self.sock.recv_multipart()

    def open(self, token: str = TOKEN) -> Session:
        """A handshake; with a wrong token the server's proof fails, and the key is this token's."""
        handshake = ClientHandshake(token)
        _rid, status, session_id, nonce, proof = self.exchange([zmq_rpc.HELLO, b"h", handshake.nonce])
        assert status == zmq_rpc.WELCOME
        self.session = handshake.finish(session_id, nonce, proof)
        if self.session is None:  # what a wrong-token caller would have, had it ignored the proof
            self.session = Session(session_id, _keys(token, handshake.nonce, nonce, session_id)[1])
        return self.session

    def request(self, frame: bytes, method: str = "echo") -> list[bytes]:
        session = self.session or self.open()
        rid, name = b"12345678", method.encode()
        seq = seq_bytes(session.next_seq())
        mac = session.mac(zmq_rpc._REQUEST, seq, zmq_rpc.CALL, rid, name, frame)
        return [zmq_rpc.CALL, rid, name, session.session_id, seq, mac, frame]

    def send(self, request: list[bytes]) -> Outcome:
        rid, status, mac, *body = self.exchange(request)
        assert rid == request[1]  # answered to the request's id
        text = b"".join(body).decode() if status != zmq_rpc.OK else ""
        return Outcome(_ZMQ_STATUS[status], text, mac != b"")

    def in_unknown_session(self, request: list[bytes]) -> list[bytes]:
        return [*request[:3], b"\0" * 16, *request[4:]]

    def without_session(self, frame: bytes, method: str = "echo") -> list[bytes]:
        return [zmq_rpc.CALL, b"12345678", method.encode(), b"", b"", b"", frame]

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


class ZmqFakeServer:
    """A ROUTER at a server's address without the token (:class:`_zmq_peers.FakeServer`), but with
    the job's CURVE key: what it meets is the session's proof, behind CURVE."""

    def __init__(self, mode: str) -> None:
        task = task_frame()
        if mode == "no-handshake":  # speaks the old protocol: opens the stream and sends a task
            self._fake = FakeServer(
                lambda p: [[p[1], zmq_rpc.STREAM_OPEN], [p[1], zmq_rpc.STREAM_ITEM, task]], token=TOKEN
            )
        else:  # answers the handshake with a made-up proof, then a task
            self._fake = FakeServer(
                lambda p: [
                    [p[1], zmq_rpc.WELCOME, *_MADE_UP_WELCOME],
                    [p[1], zmq_rpc.STREAM_ITEM, b"", task],
                ],
                token=TOKEN,
            )
        self.address = self._fake.address

    def kinds_received(self) -> list[str]:
        return ["hello" if parts[0] == zmq_rpc.HELLO else repr(parts[0]) for parts in self._fake.received]

    def close(self) -> None:
        self._fake.close()


# -- gRPC ---------------------------------------------------------------------------------------------
_GRPC_STATUS = {
    grpc.StatusCode.FAILED_PRECONDITION: "refused",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
}


def _grpc_channel(address: str) -> grpc.Channel:
    options = [("grpc.enable_http_proxy", 0), ("grpc.ssl_target_name_override", grpc_rpc.TLS_NAME)]
    return grpc.secure_channel(address, grpc_rpc.channel_credentials(TOKEN), options=options)


def grpc_tls_socket(host: str, port: int, token: str = TOKEN) -> ssl.SSLSocket:
    """A TLS connection to a gRPC server with ``token``'s identity, for hand-made HTTP/2 behind it."""
    identity = grpc_rpc.tls_identity(token)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=identity.root.decode())
    with tempfile.TemporaryDirectory() as folder:  # ssl loads a key only from a file
        chain, key = Path(folder, "chain.pem"), Path(folder, "key.pem")
        chain.write_bytes(identity.chain)
        key.write_bytes(identity.key)
        context.load_cert_chain(chain, key)
    context.set_alpn_protocols(["h2"])
    sock = socket.create_connection((host, port), timeout=30)
    return context.wrap_socket(sock, server_hostname=grpc_rpc.TLS_NAME)


class GrpcRawCaller:
    """A gRPC channel calling ``/spread.ps/<method>`` with hand-made bytes and metadata; it holds the
    job's TLS identity (the session layer behind it is what it tests), whatever token it signs with."""

    def __init__(self, address: str) -> None:
        self.channel = _grpc_channel(address)
        self.session: Session | None = None

    def open(self, token: str = TOKEN) -> Session:
        handshake = ClientHandshake(token)
        hello = self.channel.unary_unary(f"/{grpc_rpc.SERVICE}/{grpc_rpc.HELLO}", _registered_method=False)
        answer = hello(handshake.nonce, timeout=30)
        session_id, nonce = answer[:16], answer[16:32]
        self.session = Session(session_id, _keys(token, handshake.nonce, nonce, session_id)[1])
        return self.session

    def metadata(self, method: str, frame: bytes, seq: int | None = None) -> list[tuple[str, str]]:
        session = self.session or self.open()
        seq = session.next_seq() if seq is None else seq
        mac = session.mac(grpc_rpc._REQUEST, seq_bytes(seq), method.encode(), header_part(frame))
        return [
            (grpc_rpc.SESSION_KEY, session.session_id.hex()),
            (grpc_rpc.SEQ_KEY, str(seq)),
            (grpc_rpc.MAC_KEY, mac.hex()),
        ]

    def request(self, frame: bytes, method: str = "echo") -> tuple[str, bytes, list]:
        return method, frame, self.metadata(method, frame)

    def call(self, request: tuple[str, bytes, list]) -> tuple[bytes, grpc.Call]:
        method, frame, metadata = request
        stub = self.channel.unary_unary(f"/{grpc_rpc.SERVICE}/{method}", _registered_method=False)
        return stub.with_call(frame, timeout=30, metadata=metadata)

    def send(self, request: tuple[str, bytes, list]) -> Outcome:
        try:
            _answer, call = self.call(request)
        except grpc.RpcError as exc:
            trailing = dict(exc.trailing_metadata() or ())
            status = _GRPC_STATUS.get(exc.code(), exc.code().name)
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                status = trailing.get(grpc_rpc.REFUSAL_KEY)
            return Outcome(status, exc.details() or "", grpc_rpc.MAC_KEY in trailing)
        return Outcome("ok", "", grpc_rpc.MAC_KEY in dict(call.trailing_metadata() or ()))

    def in_unknown_session(self, request: tuple[str, bytes, list]) -> tuple[str, bytes, list]:
        method, frame, metadata = request
        return method, frame, [(k, "00" * 16 if k == grpc_rpc.SESSION_KEY else v) for k, v in metadata]

    def without_session(self, frame: bytes, method: str = "echo") -> tuple[str, bytes, list]:
        return method, frame, []

    def close(self) -> None:
        self.channel.close()


class GrpcFakeServer:
    """A gRPC server without the token at a server's address, but with the job's TLS identity (what
    it meets is the session's proof, behind TLS): ``answers`` maps a method to what it returns (bytes
    for a unary call, a list of items for a stream)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.calls: list[str] = []
        fake = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                method = details.method.rsplit("/", 1)[1]
                fake.calls.append(method)
                answer = answers.get(method)
                if isinstance(answer, list):
                    return grpc.unary_stream_rpc_method_handler(lambda request, context: iter(answer))
                return grpc.unary_unary_rpc_method_handler(lambda request, context: answer or b"")

        self._pool = ThreadPoolExecutor(4)
        self.server = grpc.server(self._pool, handlers=[Handler()])
        port = self.server.add_secure_port("127.0.0.1:0", grpc_rpc.server_credentials(TOKEN))
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    @classmethod
    def in_mode(cls, mode: str) -> GrpcFakeServer:
        hello = None if mode == "no-handshake" else b"".join(_MADE_UP_WELCOME)
        return cls({grpc_rpc.HELLO: hello, "session": [b"m" * 32 + task_frame()], "pull": task_frame()})

    def kinds_received(self) -> list[str]:
        return ["hello" if method == grpc_rpc.HELLO else method for method in self.calls]

    def close(self) -> None:
        self.server.stop(None).wait()
        self._pool.shutdown()


RAW_CALLERS: dict[str, type[ZmqRawCaller] | type[GrpcRawCaller]] = {
    "zmq": ZmqRawCaller,
    "grpc": GrpcRawCaller,
}


def fake_server(transport: str, mode: str) -> ZmqFakeServer | GrpcFakeServer:
    return ZmqFakeServer(mode) if transport == "zmq" else GrpcFakeServer.in_mode(mode)
