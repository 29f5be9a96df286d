"""The ZeroMQ RPC layer: the same contract as tests/ps/test_grpc_transport.py (calls, wrong token
refused and counted, both ends proving the token, recorded messages refused when replayed, malformed
and oversized frames refused while serving goes on, dead servers named, streams in order with end and
cancel, no threads left)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch
import zmq
from _zmq_peers import FakeServer, Relay

from spread.errors import JobTokenError, RemoteCallError, WireFormatError
from spread.ps.rpc_api import ClientHandshake, Session, _keys, seq_bytes
from spread.ps.wire import encode
from spread.ps.zmq_transport import (
    _REQUEST,
    CALL,
    DENIED,
    HEARTBEAT,
    HELLO,
    INVALID,
    NO_SESSION,
    OK,
    STREAM_ITEM,
    STREAM_OPEN,
    WELCOME,
    RequestRefused,
    RpcClient,
    RpcServer,
)

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


class _RawPeer:
    """A bare DEALER socket speaking the protocol by hand (bypassing the client's checks)."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{address}")
        self.session: Session | None = None

    def exchange(self, parts: list[bytes]) -> list[bytes]:
        self.sock.send_multipart(parts)
        assert self.sock.poll(30_000), "no answer from the server"
        return self.sock.recv_multipart()

    def open(self, token: str = TOKEN) -> Session:
        """A handshake; with a wrong token the server's proof fails, and the key is this token's."""
        handshake = ClientHandshake(token)
        _rid, status, session_id, nonce, proof = self.exchange([HELLO, b"h", handshake.nonce])
        assert status == WELCOME
        self.session = handshake.finish(session_id, nonce, proof)
        if self.session is None:  # what a wrong-token caller would have, had it ignored the proof
            key = _keys(token, handshake.nonce, nonce, session_id)[1]
            self.session = Session(session_id, key)
        return self.session

    def request(self, frame: bytes, rid: bytes = b"12345678", method: bytes = b"echo") -> list[bytes]:
        """A request's parts, signed in this peer's session (opened at first use)."""
        session = self.session or self.open()
        seq = seq_bytes(session.next_seq())
        mac = session.mac(_REQUEST, seq, CALL, rid, method, frame)
        return [CALL, rid, method, session.session_id, seq, mac, frame]

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def _raw_call(address: str, parts: list[bytes]) -> list[bytes]:
    """Hand-made request parts on a bare DEALER socket, bypassing the client's encoder."""
    peer = _RawPeer(address)
    try:
        return peer.exchange(parts)
    finally:
        peer.close()


def _signed_call(address: str, frame: bytes) -> list[bytes]:
    """A request in a real session whose frame is ``frame`` (to reach the frame checks)."""
    peer = _RawPeer(address)
    try:
        return peer.exchange(peer.request(frame))
    finally:
        peer.close()


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
    # A hand-made caller that ignores the proof and signs with its own token is refused and counted.
    peer = _RawPeer(server.address)
    peer.open("wrong-token")
    for _ in range(2):
        rid, status, mac, text = peer.exchange(peer.request(encode({})))
        assert rid == b"12345678" and status == DENIED and mac == b""
        assert b"SPREAD_JOB_TOKEN does not match" in text
    # A session id the server never issued: refused (the client would open a session).
    parts = peer.request(encode({}))
    parts[3] = b"\0" * 16
    assert peer.exchange(parts)[1] == NO_SESSION
    peer.close()
    assert calls == [] and server.refused_connections == 2


def test_a_replayed_request_is_refused_in_its_session_and_on_any_other_connection(server):
    calls = []
    server._handlers["echo"] = lambda m, t: calls.append(m) or ({}, {})
    peer = _RawPeer(server.address)
    recorded = peer.request(encode({"stop": True}))
    assert peer.exchange(recorded)[1] == OK
    _rid, status, _mac, text = peer.exchange(recorded)  # the same bytes again, same connection
    assert status == DENIED and b"replayed" in text
    peer.close()
    other = _RawPeer(server.address)  # a recording replayed by another process
    assert other.exchange(recorded)[1] == DENIED
    other.close()
    assert calls == [{"stop": True}] and server.refused_connections == 2


def test_a_one_part_message_is_refused_like_other_bad_frames(server, client):
    rid, status, mac, text = _raw_call(server.address, [b"x"])
    assert (rid, status, mac) == (b"", INVALID, b"") and b"malformed request" in text
    assert _raw_call(server.address, [HELLO, b"r", b"short nonce"])[1] == INVALID
    assert _raw_call(server.address, [b"?", b"r", b"echo", b"", b"", b"", b""])[1] == INVALID
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


def test_bad_frames_are_refused_with_a_clear_error_and_serving_goes_on(server, client):
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":77,"shape":[2]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header + b"\0" * 8
    for bad in (frame, b"junk", b""):
        rid, status, _mac, text = _signed_call(server.address, bad)
        assert rid == b"12345678" and status == INVALID
        assert text.startswith(b"test server: malformed frame")
    assert b"unknown dtype code 77" in _signed_call(server.address, frame)[3]
    # A request missing its parts is answered too (when it names a request id) or dropped.
    assert _raw_call(server.address, [CALL, b"r9", b"echo"])[1] == INVALID
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


def test_huge_declared_tensor_is_refused_before_allocation(server, client):
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":1,"shape":[1073741824,10]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header
    assert b"over the limit" in _signed_call(server.address, frame)[3]
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


def test_oversized_request_is_dropped_by_size_and_serving_goes_on():
    srv = RpcServer("small server", {"echo": _echo}, token=TOKEN, max_frame_bytes=64 * 1024).start()
    client = RpcClient(srv.address, peer="small server", token=TOKEN, timeout=30)
    try:
        # One part over zmq.MAXMSGSIZE: ZeroMQ drops the connection before allocating the part.
        with pytest.raises(RemoteCallError, match="small server: echo failed: connection lost"):
            client.call("echo", {}, {"x": torch.zeros(1 << 20, dtype=torch.uint8)})
        # Parts each under the limit that add up to more: refused by their total.
        big = {f"x{i}": torch.zeros(40 * 1024, dtype=torch.uint8) for i in range(2)}
        with pytest.raises(WireFormatError, match=r"small server: echo refused: .*frame over the size limit"):
            client.call("echo", {}, big)
        assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
    finally:
        client.close()
        srv.stop()


def test_unreachable_server_is_named_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RpcClient(f"127.0.0.1:{port}", peer="parameter server 3", token=TOKEN, timeout=30)
    started = time.monotonic()
    with pytest.raises(RemoteCallError, match="parameter server 3: pull failed: unreachable"):
        client.call("pull")
    assert time.monotonic() - started < 25  # refused at once, not at the deadline
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


def test_slow_handler_hits_the_call_deadline_and_its_late_answer_is_never_taken():
    release = threading.Event()

    def wait(meta, tensors):
        if meta.get("slow"):
            release.wait(30)
        return {"n": meta["n"]}, {}

    srv = RpcServer("slow server", {"wait": wait}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="slow server", token=TOKEN)
    try:
        with pytest.raises(RemoteCallError, match=r"slow server: wait failed: no answer within 0\.5s"):
            client.call("wait", {"slow": True, "n": 1}, timeout=0.5)
        release.set()
        assert client.call("wait", {"n": 2}, timeout=30)[0] == {"n": 2}
        assert client.call("wait", {"n": 3}, timeout=30)[0] == {"n": 3}
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


def test_server_dying_during_a_call_is_reported_before_the_deadline():
    entered = threading.Event()
    release = threading.Event()

    def hang(meta, tensors):
        entered.set()
        release.wait(30)
        return {}, {}

    srv = RpcServer("ps 1", {"hang": hang}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="ps 1", token=TOKEN, timeout=60)
    stopper = threading.Thread(target=lambda: (entered.wait(30), srv.stop()))
    stopper.start()
    try:
        started = time.monotonic()
        with pytest.raises(RemoteCallError, match="ps 1: hang failed: connection lost"):
            client.call("hang")
        assert time.monotonic() - started < 50
    finally:
        release.set()
        stopper.join(60)
        client.close()


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


def _waiting_session(parked, seen_inactive, ended):
    def session(meta, tensors, ctx):
        ctx.on_end(ended.set)
        yield {"op": "hello"}, {}
        parked.set()
        deadline = time.monotonic() + 30
        while ctx.is_active() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not ctx.is_active():
            seen_inactive.set()

    return session


def test_stream_sees_its_caller_cancel():
    parked, seen_inactive, ended = threading.Event(), threading.Event(), threading.Event()
    srv = RpcServer(
        "chief", {}, stream_handlers={"session": _waiting_session(parked, seen_inactive, ended)}, token=TOKEN
    ).start()
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


def test_stream_sees_its_caller_leave_without_a_word():
    """The caller's socket closes (as when its process dies): the heartbeat probe notices."""
    parked, seen_inactive, ended = threading.Event(), threading.Event(), threading.Event()
    srv = RpcServer(
        "chief", {}, stream_handlers={"session": _waiting_session(parked, seen_inactive, ended)}, token=TOKEN
    ).start()
    client = RpcClient(srv.address, peer="the chief", token=TOKEN, timeout=30)
    try:
        stream = client.stream("session", {})
        messages = iter(stream)
        assert next(messages)[0] == {"op": "hello"}
        assert parked.wait(30)
        messages.close()  # closes the socket, sends nothing
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
    with pytest.raises(RemoteCallError, match="the chief: session failed: connection lost"):
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
    assert srv._context.closed
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


def _task_frame() -> bytes:
    return encode({"op": "task", "function": ["builtins", "exec"], "args": ["print('pwned')"]})


@pytest.mark.parametrize(
    "reply",
    [
        # speaks the old protocol: opens the stream and sends a task, no handshake at all
        lambda parts: [[parts[1], b"\x05"], [parts[1], STREAM_ITEM, _task_frame()]],
        # answers the handshake with a made-up proof, then a task
        lambda parts: [
            [parts[1], WELCOME, b"s" * 16, b"n" * 16, b"p" * 32],
            [parts[1], STREAM_ITEM, b"", _task_frame()],
        ],
    ],
    ids=["no-handshake", "made-up-proof"],
)
def test_a_client_takes_nothing_from_a_server_that_cannot_prove_the_token(reply):
    fake = FakeServer(reply)
    client = RpcClient(fake.address, peer="the chief", token=TOKEN, timeout=10)
    try:
        with pytest.raises(JobTokenError, match=r"the chief: session refused: .*could not prove the token"):
            client.stream("session", {"worker": 1}, connect_timeout=10)
        with pytest.raises(JobTokenError, match="could not prove the token"):
            client.call("pull")
        assert [p[0] for p in fake.received] == [HELLO, HELLO]  # nothing but the handshakes was sent
    finally:
        client.close()
        fake.close()


def _items(n, gate):
    def handler(meta, tensors, ctx):
        if meta["who"] != "first":
            gate.wait(30)
        for i in range(n):
            yield {"i": i, "who": meta["who"]}, {}

    return handler


def test_recorded_answers_replayed_by_an_impostor_or_injected_into_a_live_stream_are_refused():
    gate = threading.Event()
    srv = RpcServer("chief", {}, stream_handlers={"tasks": _items(2, gate)}, token=TOKEN).start()
    relay = Relay(srv.address)
    client = RpcClient(relay.address, peer="the chief", token=TOKEN, timeout=10)
    try:
        got = [m for m, _ in client.stream("tasks", {"who": "first"})]
        assert got == [{"i": 0, "who": "first"}, {"i": 1, "who": "first"}]
        recorded = [a for a in relay.answers if a[1] != HEARTBEAT]  # WELCOME, open, 2 items, end
        assert recorded[0][1] == WELCOME and [a[1] for a in recorded[2:4]] == [STREAM_ITEM, STREAM_ITEM]

        # 1. An impostor replays the whole recording to a new client: its handshake proof is stale.
        def replay(parts):
            if parts[0] == HELLO:
                return [[parts[1], *recorded[0][1:]]]
            return [[parts[1], *answer[1:]] for answer in recorded[1:]]

        fake = FakeServer(replay)
        other = RpcClient(fake.address, peer="the chief", token=TOKEN, timeout=10)
        with pytest.raises(JobTokenError, match="could not prove the token"):
            other.stream("tasks", {"who": "x"}, connect_timeout=10)
        other.close()
        fake.close()

        # 2. Inside a live session (the relay forwards the real handshake), a recorded item from the
        # first stream, re-addressed to the second stream's request id, is refused: its MAC is bound
        # to the first stream's request id.
        stream = client.stream("tasks", {"who": "second"})
        rid = [a for a in relay.answers if a[1] == STREAM_OPEN][-1][0]  # the second stream's
        relay.inject_after_next_answer.append([rid, *recorded[2][1:]])
        gate.set()
        messages = iter(stream)
        with pytest.raises(JobTokenError, match=r"an answer did not prove .*forged or replayed"):
            while True:
                next(messages)
    finally:
        gate.set()
        client.close()
        relay.close()
        srv.stop()
