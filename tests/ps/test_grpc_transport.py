"""The gRPC RPC layer: the same contract as tests/ps/test_zmq_transport.py (calls, wrong token
refused, both ends proving the token, recorded calls refused when replayed, malformed and oversized
frames refused while serving goes on, dead servers named, no threads left)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest
import torch

from spread.errors import JobTokenError, RemoteCallError, WireFormatError
from spread.ps.grpc_transport import (
    _REQUEST,
    HELLO,
    MAC_KEY,
    SEQ_KEY,
    SERVICE,
    SESSION_KEY,
    RequestRefused,
    RpcClient,
    RpcServer,
    Stream,
)
from spread.ps.rpc_api import ClientHandshake, Session, _keys, seq_bytes
from spread.ps.wire import encode, header_part

TOKEN = "right-token"


def _echo(meta, tensors):
    if meta.get("refuse"):
        raise RequestRefused("no thanks")
    if meta.get("crash"):
        raise RuntimeError("boom")
    return {"seen": meta}, tensors


@pytest.fixture
def server():
    srv = RpcServer("test server", {"echo": _echo}, token=TOKEN).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = RpcClient(server.address, peer="test server", token=TOKEN, timeout=30)
    yield c
    c.close()


class _RawSession:
    """A session opened by hand (the server's proof is not checked), to sign hand-made calls."""

    def __init__(self, address: str, token: str = TOKEN) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
        handshake = ClientHandshake(token)
        answer = self.channel.unary_unary(f"/{SERVICE}/{HELLO}", _registered_method=False)(
            handshake.nonce, timeout=30
        )
        session_id, nonce = answer[:16], answer[16:32]
        self.session = Session(session_id, _keys(token, handshake.nonce, nonce, session_id)[1])

    def metadata(self, method: str, request: bytes, seq: int | None = None) -> list[tuple[str, str]]:
        seq = self.session.next_seq() if seq is None else seq
        mac = self.session.mac(_REQUEST, seq_bytes(seq), method.encode(), header_part(request))
        return [(SESSION_KEY, self.session.session_id.hex()), (SEQ_KEY, str(seq)), (MAC_KEY, mac.hex())]

    def call(self, method: str, request: bytes, metadata: list | None = None) -> bytes:
        stub = self.channel.unary_unary(f"/{SERVICE}/{method}", _registered_method=False)
        return stub(request, timeout=30, metadata=metadata or self.metadata(method, request))

    def close(self) -> None:
        self.channel.close()


def _raw_call(address: str, method: str, request: bytes, token: str = TOKEN) -> bytes:
    """A call with hand-made request bytes in a session of its own, bypassing the client's encoder."""
    raw = _RawSession(address, token)
    try:
        return raw.call(method, request)
    finally:
        raw.close()


def test_call_round_trip_and_bytes_counted(client):
    x = torch.randn(1000)
    meta, tensors = client.call("echo", {"a": 1}, {"x": x})
    assert meta == {"seen": {"a": 1}} and torch.equal(tensors["x"], x)
    assert client.bytes_sent > 4000 and client.bytes_received > 4000


def test_received_tensors_are_writable_and_independent(client):
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    _, tensors = client.call("echo", {}, {"x": x, "empty": torch.zeros(0, dtype=torch.int64)})
    tensors["x"].add_(1)  # a received tensor may be updated in place (it owns its memory)
    assert torch.equal(tensors["x"], x + 1) and tensors["empty"].shape == (0,)


def test_server_binds_loopback_by_default(server):
    assert server.address.startswith("127.0.0.1:")


def test_taken_port_is_an_error_naming_the_server(server):
    with pytest.raises(OSError, match="second server: cannot listen on"):
        RpcServer("second server", {}, token=TOKEN, address=server.address)


def test_refusal_and_fault_name_the_server_and_keep_serving(client):
    with pytest.raises(RemoteCallError, match="test server: echo failed: test server: no thanks"):
        client.call("echo", {"refuse": True})
    with pytest.raises(RemoteCallError, match="RuntimeError: boom"):
        client.call("echo", {"crash": True})
    with pytest.raises(RemoteCallError, match="unknown method 'nope'"):
        client.call("nope")
    assert client.call("echo", {"b": 2})[0] == {"seen": {"b": 2}}


def test_wrong_token_is_refused_before_any_call(server):
    calls = []
    server._handlers["echo"] = lambda m, t: calls.append(m) or ({}, {})
    intruder = RpcClient(server.address, peer="test server", token="wrong-token")
    # The intruder's client cannot verify the server's proof: it sends nothing at all.
    with pytest.raises(JobTokenError, match="SPREAD_JOB_TOKEN does not match this job's"):
        intruder.call("echo", {"x": 1})
    with pytest.raises(JobTokenError, match="SPREAD_JOB_TOKEN does not match this job's"):
        intruder.stream("echo", connect_timeout=10)
    intruder.close()
    no_session = grpc.insecure_channel(server.address, options=[("grpc.enable_http_proxy", 0)])
    with no_session, pytest.raises(grpc.RpcError) as raw:
        no_session.unary_unary(f"/{SERVICE}/echo", _registered_method=False)(b"", timeout=30)
    assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A hand-made caller that ignores the proof and signs with its own token is refused and counted.
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as raw:
            _raw_call(server.address, "echo", encode({}), token="wrong-token")
        assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "SPREAD_JOB_TOKEN does not match" in raw.value.details()
    assert calls == [] and server.refused_connections == 2


def test_a_replayed_call_is_refused(server):
    calls = []
    server._handlers["echo"] = lambda m, t: calls.append(m) or ({}, {})
    raw = _RawSession(server.address)
    request = encode({"stop": True})
    recorded = raw.metadata("echo", request)  # the bytes and headers an eavesdropper would keep
    raw.call("echo", request, recorded)
    with pytest.raises(grpc.RpcError, match="replayed") as refused:
        raw.call("echo", request, recorded)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    raw.close()
    other = _RawSession(server.address)  # replayed from another connection
    with pytest.raises(grpc.RpcError, match="replayed"):
        other.call("echo", request, recorded)
    other.close()
    assert calls == [{"stop": True}] and server.refused_connections == 2


def test_bad_dtype_code_is_refused_with_a_clear_error_and_serving_goes_on(server, client):
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":77,"shape":[2]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header + b"\0" * 8
    for bad in (frame, b"junk", b""):
        with pytest.raises(grpc.RpcError) as refused:
            _raw_call(server.address, "echo", bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("test server: malformed frame")
    with pytest.raises(grpc.RpcError, match="unknown dtype code 77"):
        _raw_call(server.address, "echo", frame)
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


def test_huge_declared_tensor_is_refused_before_allocation(server, client):
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":1,"shape":[1073741824,10]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header
    with pytest.raises(grpc.RpcError, match="over the limit"):
        _raw_call(server.address, "echo", frame)
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


def test_oversized_request_is_refused_by_size_and_serving_goes_on():
    srv = RpcServer("small server", {"echo": _echo}, token=TOKEN, max_frame_bytes=64 * 1024).start()
    client = RpcClient(srv.address, peer="small server", token=TOKEN, timeout=30)
    try:
        with pytest.raises(WireFormatError, match="small server: echo refused: frame over the size limit"):
            client.call("echo", {}, {"x": torch.zeros(1 << 20, dtype=torch.uint8)})
        assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
    finally:
        client.close()
        srv.stop()


def test_http2_message_declaring_4_gib_is_refused_unread(server, client):
    """Raw HTTP/2: a gRPC message declaring 4 GiB is refused at once, without its bytes being sent.

    Stream 1 carries a valid echo request (so the hand-made headers are known to be right: it gets a
    DATA answer); stream 3 the same headers and a message header declaring 4 GiB followed by 1 KiB:
    it must end (trailers or reset) with no DATA, while the rest never arrives.
    """
    valid = encode({"raw": True})
    raw = _RawSession(server.address)
    signed = raw.metadata("echo", valid)
    raw.close()
    host, port = server.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    def literal(name: str, value: str) -> bytes:  # HPACK literal without indexing, no Huffman
        return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()

    headers = b"".join(
        literal(k, v)
        for k, v in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/{SERVICE}/echo"),
            (":authority", server.address),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *signed,
        ]
    )
    sock.sendall(
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + frame(0x4, 0, 0, b"")  # SETTINGS
        + frame(0x1, 0x4, 1, headers)  # HEADERS, END_HEADERS
        + frame(0x0, 0x1, 1, b"\x00" + len(valid).to_bytes(4, "big") + valid)  # DATA, END_STREAM
        + frame(0x1, 0x4, 3, headers)
        + frame(0x0, 0, 3, b"\x00" + (0xFFFFFFFF).to_bytes(4, "big") + b"x" * 1024)
    )
    seen: set[tuple[int, int]] = set()  # (stream, frame type)
    received, deadline = b"", time.monotonic() + 30
    while time.monotonic() < deadline and not ((1, 0x0) in seen and seen & {(3, 0x1), (3, 0x3)}):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
        offset = 0
        while offset + 9 <= len(received):
            length = int.from_bytes(received[offset : offset + 3], "big")
            stream = int.from_bytes(received[offset + 5 : offset + 9], "big") & 0x7FFFFFFF
            seen.add((stream, received[offset + 3]))
            offset += 9 + length
    sock.close()
    assert (1, 0x0) in seen  # the valid request was answered: the raw headers are right
    assert seen & {(3, 0x1), (3, 0x3)} and (3, 0x0) not in seen  # refused without an answer frame
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


def test_unreachable_server_is_named_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RpcClient(f"127.0.0.1:{port}", peer="parameter server 3", token=TOKEN, timeout=5)
    with pytest.raises(RemoteCallError, match="parameter server 3: pull failed: unreachable"):
        client.call("pull")
    client.close()


def test_waiting_for_a_server_that_never_starts_ends_at_the_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RpcClient(f"127.0.0.1:{port}", peer="the chief", token=TOKEN, timeout=1)
    with pytest.raises(
        RemoteCallError, match="the chief: create failed: not reachable or no answer within 1s"
    ):
        client.call("create", wait_for_ready=True)
    with pytest.raises(RemoteCallError, match="the chief: session failed: not reachable"):
        client.stream("session", connect_timeout=1)
    client.close()


def test_slow_handler_hits_the_call_deadline_naming_the_server():
    release = threading.Event()
    srv = RpcServer(
        "slow server", {"wait": lambda m, t: (release.wait(30), ({}, {}))[1]}, token=TOKEN
    ).start()
    client = RpcClient(srv.address, peer="slow server", token=TOKEN)
    try:
        with pytest.raises(RemoteCallError, match=r"slow server: wait failed: no answer within 0\.5s"):
            client.call("wait", timeout=0.5)
    finally:
        release.set()
        client.close()
        srv.stop()


def test_server_that_dies_is_reported_and_a_restart_on_the_same_port_is_found():
    srv = RpcServer("ps 0", {"echo": _echo}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="ps 0", token=TOKEN, timeout=10)
    assert client.call("echo", {"n": 1})[0] == {"seen": {"n": 1}}
    srv.stop()
    with pytest.raises(RemoteCallError, match="ps 0: echo failed: unreachable"):
        client.call("echo")
    srv = RpcServer("ps 0", {"echo": _echo}, token=TOKEN, address=srv.address).start()
    try:
        assert client.call("echo", {"n": 2}, wait_for_ready=True)[0] == {"seen": {"n": 2}}
    finally:
        client.close()
        srv.stop()


def _counting_stream(ended):
    def handler(meta, tensors, ctx):
        ctx.on_end(lambda: ended.append(meta["who"]))
        for i in range(meta["n"]):
            yield {"i": i}, {"t": torch.full((3,), float(i))}
        if meta.get("refuse"):
            raise RequestRefused("enough")

    return handler


def test_stream_delivers_messages_in_order_then_ends():
    ended: list[str] = []
    srv = RpcServer("chief", {}, stream_handlers={"count": _counting_stream(ended)}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="the chief", token=TOKEN, timeout=30)
    try:
        got = [(m["i"], t["t"][0].item()) for m, t in client.stream("count", {"n": 4, "who": "a"})]
        assert got == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
        with pytest.raises(RemoteCallError, match="the chief: count failed: chief: enough"):
            list(client.stream("count", {"n": 1, "who": "b", "refuse": True}))
    finally:
        client.close()
        srv.stop()
    assert sorted(ended) == ["a", "b"]


def test_stream_sees_its_caller_leave():
    parked = threading.Event()
    seen_inactive = threading.Event()
    ended = threading.Event()

    def session(meta, tensors, ctx):
        ctx.on_end(ended.set)
        yield {"op": "hello"}, {}
        parked.set()
        deadline = time.monotonic() + 30
        while ctx.is_active() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not ctx.is_active():
            seen_inactive.set()

    srv = RpcServer("chief", {}, stream_handlers={"session": session}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="the chief", token=TOKEN, timeout=30)
    try:
        stream = client.stream("session", {})
        messages = iter(stream)
        assert next(messages)[0] == {"op": "hello"}
        assert parked.wait(30)
        stream.cancel()
        assert list(messages) == []  # a cancelled stream just ends on this side
        assert seen_inactive.wait(30) and ended.wait(30)
    finally:
        client.close()
        srv.stop()


def test_stopping_the_server_ends_a_blocked_stream_with_a_clear_error():
    started = threading.Event()

    def session(meta, tensors, ctx):
        yield {"op": "hello"}, {}
        started.set()
        while ctx.is_active():
            time.sleep(0.01)

    srv = RpcServer("chief", {}, stream_handlers={"session": session}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="the chief", token=TOKEN, timeout=30)
    messages = iter(client.stream("session", {}))
    assert next(messages)[0] == {"op": "hello"}
    assert started.wait(30)
    srv.stop()  # returns: the handler saw its call end
    with pytest.raises(RemoteCallError, match="the chief: session failed"):
        next(messages)
    client.close()


def test_stop_leaves_no_threads_or_listener():
    before = set(threading.enumerate())
    srv = RpcServer("t", {"echo": _echo}, stream_handlers={"s": _counting_stream([])}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="t", token=TOKEN)
    client.call("echo")
    assert len(list(client.stream("s", {"n": 2, "who": "x"}))) == 2
    srv.stop()
    client.close()
    assert set(threading.enumerate()) <= before
    host, port = srv.address.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_calls_after_close_are_refused_clearly(server):
    client = RpcClient(server.address, peer="test server", token=TOKEN)
    client.close()
    with pytest.raises(RemoteCallError, match="test server: echo failed: the client was closed"):
        client.call("echo")


def test_wire_error_from_server_is_typed(server):
    client = RpcClient(server.address, peer="test server", token=TOKEN, max_frame_bytes=1 << 20)
    server._max_frame_bytes = 100
    with pytest.raises(WireFormatError):
        client.call("echo", {}, {"x": torch.zeros(100)})
    client.close()


def test_concurrent_calls_share_one_client():
    gate = threading.Barrier(8, timeout=30)

    def meet(meta, tensors):
        gate.wait()  # all 8 calls are inside the server at once
        return {"i": meta["i"]}, {}

    srv = RpcServer("ps", {"meet": meet}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="ps", token=TOKEN, timeout=30)
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(client.call("meet", {"i": i})[0]["i"]))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    client.close()
    srv.stop()
    assert sorted(results) == list(range(8))


class _FakeServer:
    """A gRPC server without the token at a server's address: ``answers`` maps a method to what it
    returns (bytes for a unary call, a list of items for a stream)."""

    def __init__(self, answers: dict) -> None:
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

        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(4)
        self.server = grpc.server(self._pool, handlers=[Handler()])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(None).wait()
        self._pool.shutdown()


def _task() -> bytes:
    return encode({"op": "task", "function": ["builtins", "exec"], "args": ["print('pwned')"]})


def test_a_client_takes_nothing_from_a_server_that_cannot_prove_the_token():
    for hello in (None, b"s" * 16 + b"n" * 16 + b"p" * 32):  # no handshake at all; a made-up proof
        fake = _FakeServer({HELLO: hello, "session": [b"m" * 32 + _task()], "pull": _task()})
        client = RpcClient(fake.address, peer="the chief", token=TOKEN, timeout=10)
        try:
            with pytest.raises(
                JobTokenError, match=r"the chief: session refused: .*could not prove the token"
            ):
                client.stream("session", {"worker": 1}, connect_timeout=10)
            with pytest.raises(JobTokenError, match="could not prove the token"):
                client.call("pull")
            assert set(fake.calls) == {HELLO}  # nothing but handshakes reached it
        finally:
            client.close()
            fake.close()


def test_recorded_answers_replayed_by_an_impostor_are_refused():
    def items(meta, tensors, ctx):
        yield {"op": "task", "function": ["__main__", "step"]}, {}

    srv = RpcServer("chief", {}, stream_handlers={"session": items}, token=TOKEN).start()
    recorded: dict = {}
    try:
        raw = _RawSession(srv.address)  # records what a real chief answers a real worker
        handshake = ClientHandshake(TOKEN)
        recorded[HELLO] = raw.channel.unary_unary(f"/{SERVICE}/{HELLO}", _registered_method=False)(
            handshake.nonce, timeout=30
        )
        request = encode({"worker": 1})
        stub = raw.channel.unary_stream(f"/{SERVICE}/session", _registered_method=False)
        recorded["session"] = list(stub(request, timeout=30, metadata=raw.metadata("session", request)))
        raw.close()
    finally:
        srv.stop()
    assert len(recorded["session"]) == 1
    fake = _FakeServer(recorded)
    client = RpcClient(fake.address, peer="the chief", token=TOKEN, timeout=10)
    try:
        with pytest.raises(JobTokenError, match="could not prove the token"):
            client.stream("session", {"worker": 1}, connect_timeout=10)
        # Even past a handshake (a session of its own), the recorded item proves another session.
        client._session = handshake.finish(recorded[HELLO][:16], recorded[HELLO][16:32], recorded[HELLO][32:])
        assert client._session is not None
        stream = Stream(
            client,
            "session",
            client._channel.unary_stream(f"/{SERVICE}/session", _registered_method=False)(b"", metadata=()),
            client._session,
            seq_bytes(7),
        )
        with pytest.raises(JobTokenError, match="forged or replayed"):
            list(stream)
    finally:
        client.close()
        fake.close()
