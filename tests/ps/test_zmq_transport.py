"""The ZeroMQ RPC layer: the same contract as tests/ps/test_grpc_transport.py (calls, wrong token
refused and counted, malformed and oversized frames refused while serving goes on, dead servers
named, streams in order with end and cancel, no threads left)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch
import zmq

from spread.errors import JobTokenError, RemoteCallError, WireFormatError
from spread.ps.wire import encode
from spread.ps.zmq_transport import (
    CALL,
    INVALID,
    RequestRefused,
    RpcClient,
    RpcServer,
    _message_proof,
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


def _raw_call(address: str, parts: list[bytes]) -> list[bytes]:
    """Hand-made request parts on a bare DEALER socket, bypassing the client's encoder."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart(parts)
        assert sock.poll(30_000), "no answer from the server"
        return sock.recv_multipart()
    finally:
        sock.close(0)
        context.term()


def _request(frame: bytes, token: str = TOKEN, rid: bytes = b"12345678") -> list[bytes]:
    return [CALL, rid, b"echo", _message_proof(token), frame]


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
    with pytest.raises(JobTokenError, match="SPREAD_JOB_TOKEN does not match"):
        intruder.call("echo", {"x": 1})
    with pytest.raises(JobTokenError, match="SPREAD_JOB_TOKEN does not match"):
        intruder.stream("echo", connect_timeout=10)
    rid, _status, text = _raw_call(server.address, [CALL, b"r", b"echo", b"", encode({})])
    assert rid == b"r" and b"SPREAD_JOB_TOKEN does not match" in text
    assert calls == [] and server.refused_connections == 3
    intruder.close()


def test_bad_frames_are_refused_with_a_clear_error_and_serving_goes_on(server, client):
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":77,"shape":[2]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header + b"\0" * 8
    for bad in (frame, b"junk", b""):
        rid, status, text = _raw_call(server.address, _request(bad))
        assert rid == b"12345678" and status == INVALID
        assert text.startswith(b"test server: malformed frame")
    assert b"unknown dtype code 77" in _raw_call(server.address, _request(frame))[2]
    # A request missing its parts is answered too (when it names a request id) or dropped.
    assert _raw_call(server.address, [CALL, b"r9", b"echo"])[1] == INVALID
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


def test_huge_declared_tensor_is_refused_before_allocation(server, client):
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":1,"shape":[1073741824,10]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header
    assert b"over the limit" in _raw_call(server.address, _request(frame))[2]
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
