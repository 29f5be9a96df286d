"""The RPC transports' contract (:mod:`spread.ps.rpc_api`), checked on ZeroMQ and on gRPC by the same
tests: the interfaces implemented, calls, wrong token refused and counted, both ends proving the
token, recorded messages refused when replayed, malformed and oversized frames refused while serving
goes on, dead servers named, streams in order with end and cancel, no threads left. The last
sections hold what only one transport has (ZeroMQ envelopes, raw HTTP/2, how each records answers).
"""

from __future__ import annotations

import inspect
import socket
import struct
import threading
import time
import typing

import pytest
import torch
import zmq
from _transport_peers import FAKE_SERVER_MODES, RAW_CALLERS, TOKEN, fake_server
from _zmq_peers import FakeServer, Relay

from spread.errors import JobTokenError, RemoteCallError, WireFormatError
from spread.ps import grpc_transport as grpc_rpc
from spread.ps import zmq_transport as zmq_rpc
from spread.ps.rpc_api import (
    CallContext,
    ClientHandshake,
    RequestRefused,
    RpcClient,
    RpcServer,
    RpcStream,
    seq_bytes,
)
from spread.ps.transports import TRANSPORTS, Transport, get_transport
from spread.ps.wire import encode


@pytest.fixture(params=TRANSPORTS)
def rpc(request) -> Transport:
    return get_transport(request.param)


def _echo(meta, tensors):
    if meta.get("refuse"):
        raise RequestRefused("no thanks")
    if meta.get("crash"):
        raise RuntimeError("boom")
    return {"seen": meta}, tensors


@pytest.fixture
def server(rpc):
    srv = rpc.server("test server", {"echo": _echo}, token=TOKEN).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(rpc, server):
    c = rpc.client(server.address, peer="test server", token=TOKEN, timeout=30)
    yield c
    c.close()


@pytest.fixture
def raw(rpc):
    """Opens hand-made callers (:mod:`_transport_peers`) and closes them after the test."""
    opened = []

    def open_caller(address: str):
        opened.append(RAW_CALLERS[rpc.name](address))
        return opened[-1]

    yield open_caller
    for caller in opened:
        caller.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the interfaces ------------------------------------------------------------------------------------
def _parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_transport_implements_every_interface_with_its_signatures(rpc):
    """What a type checker would check (none is installed): each class subclasses its interface,
    leaves nothing abstract, and takes exactly the interface's parameters in each method (and the
    constructor, for the classes users construct; a stream is made by its client)."""
    stream_type = typing.get_type_hints(rpc.client.stream)["return"]
    implementations = [
        (rpc.server, RpcServer, ("__init__",)),
        (rpc.client, RpcClient, ("__init__",)),
        (stream_type, RpcStream, ()),
    ]
    for implementation, interface, constructor in implementations:
        assert issubclass(implementation, interface) and not implementation.__abstractmethods__
        for name in (*constructor, *interface.__abstractmethods__):
            assert _parameters(getattr(implementation, name)) == _parameters(getattr(interface, name)), name
    assert rpc.server.transport == rpc.name


def test_unknown_transport_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"transport must be one of \['grpc', 'zmq'\], got 'tcp'"):
        get_transport("tcp")


# -- calls ---------------------------------------------------------------------------------------------
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


def test_taken_port_is_an_error_naming_the_server(rpc, server):
    with pytest.raises(OSError, match="second server: cannot listen on"):
        rpc.server("second server", {}, token=TOKEN, address=server.address)


def test_refusal_and_fault_name_the_server_and_keep_serving(client):
    with pytest.raises(RemoteCallError, match="test server: echo failed: test server: no thanks"):
        client.call("echo", {"refuse": True})
    with pytest.raises(RemoteCallError, match="RuntimeError: boom"):
        client.call("echo", {"crash": True})
    with pytest.raises(RemoteCallError, match="unknown method 'nope'"):
        client.call("nope")
    assert client.call("echo", {"b": 2})[0] == {"seen": {"b": 2}}


def test_calls_after_close_are_refused_clearly(rpc, server):
    client = rpc.client(server.address, peer="test server", token=TOKEN)
    client.close()
    with pytest.raises(RemoteCallError, match="test server: echo failed: the client was closed"):
        client.call("echo")


def test_wire_error_from_server_is_typed(rpc, server):
    client = rpc.client(server.address, peer="test server", token=TOKEN, max_frame_bytes=1 << 20)
    server._max_frame_bytes = 100
    with pytest.raises(WireFormatError):
        client.call("echo", {}, {"x": torch.zeros(100)})
    client.close()


def test_concurrent_calls_share_one_client(rpc):
    gate = threading.Barrier(8, timeout=30)

    def meet(meta, tensors):
        gate.wait()  # all 8 calls are inside the server at once
        return {"i": meta["i"]}, {}

    srv = rpc.server("ps", {"meet": meet}, token=TOKEN).start()
    client = rpc.client(srv.address, peer="ps", token=TOKEN, timeout=30)
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


# -- the job token and sessions ------------------------------------------------------------------------
def test_wrong_token_is_refused_before_any_call(rpc, server, raw):
    calls = []
    server._handlers["echo"] = lambda m, t: calls.append(m) or ({}, {})
    intruder = rpc.client(server.address, peer="test server", token="wrong-token")
    # The intruder's client cannot verify the server's proof: it sends nothing at all.
    with pytest.raises(JobTokenError, match="SPREAD_JOB_TOKEN does not match this job's"):
        intruder.call("echo", {"x": 1})
    with pytest.raises(JobTokenError, match="SPREAD_JOB_TOKEN does not match this job's"):
        intruder.stream("echo", connect_timeout=10)
    intruder.close()
    # A hand-made caller that ignores the proof and signs with its own token is refused and counted;
    # the refusal carries no MAC (it is outside any session).
    peer = raw(server.address)
    peer.open("wrong-token")
    for _ in range(2):
        refused = peer.send(peer.request(encode({})))
        assert refused.status == "denied" and not refused.signed
        assert "SPREAD_JOB_TOKEN does not match" in refused.text
    # A session id the server never issued, or none at all: refused (the client would open a
    # session), not counted.
    assert peer.send(peer.in_unknown_session(peer.request(encode({})))).status == "no-session"
    assert peer.send(peer.without_session(encode({}))).status == "no-session"
    assert calls == [] and server.refused_connections == 2


def test_a_replayed_request_is_refused_in_its_session_and_on_any_other_connection(server, raw):
    calls = []
    server._handlers["echo"] = lambda m, t: calls.append(m) or ({}, {})
    peer = raw(server.address)
    recorded = peer.request(encode({"stop": True}))  # what an eavesdropper would keep
    assert peer.send(recorded) == ("ok", "", True)
    again = peer.send(recorded)  # the same bytes again, same connection
    assert again.status == "denied" and "replayed" in again.text
    elsewhere = raw(server.address).send(recorded)  # a recording replayed by another process
    assert elsewhere.status == "denied" and "replayed" in elsewhere.text
    assert calls == [{"stop": True}] and server.refused_connections == 2


@pytest.mark.parametrize("mode", FAKE_SERVER_MODES)
def test_a_client_takes_nothing_from_a_server_that_cannot_prove_the_token(rpc, mode):
    fake = fake_server(rpc.name, mode)
    client = rpc.client(fake.address, peer="the chief", token=TOKEN, timeout=10)
    try:
        with pytest.raises(JobTokenError, match=r"the chief: session refused: .*could not prove the token"):
            client.stream("session", {"worker": 1}, connect_timeout=10)
        with pytest.raises(JobTokenError, match="could not prove the token"):
            client.call("pull")
        assert fake.kinds_received() == ["hello", "hello"]  # nothing but the handshakes was sent
    finally:
        client.close()
        fake.close()


# -- bad frames ----------------------------------------------------------------------------------------
def test_bad_frames_are_refused_with_a_clear_error_and_serving_goes_on(server, client, raw):
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":77,"shape":[2]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header + b"\0" * 8
    for bad in (frame, b"junk", b""):
        peer = raw(server.address)  # each in a session of its own
        refused = peer.send(peer.request(bad))
        assert refused.status == "invalid" and refused.text.startswith("test server: malformed frame")
    peer = raw(server.address)
    assert "unknown dtype code 77" in peer.send(peer.request(frame)).text
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


def test_huge_declared_tensor_is_refused_before_allocation(server, client, raw):
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":1,"shape":[1073741824,10]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header
    peer = raw(server.address)
    assert "over the limit" in peer.send(peer.request(frame)).text
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}


# A request of one part over max_frame_bytes: ZeroMQ drops the connection before allocating the part
# (zmq.MAXMSGSIZE); gRPC refuses the message from its declared length, unread.
_ONE_PART_OVER_THE_LIMIT = {
    "zmq": (RemoteCallError, "small server: echo failed: connection lost"),
    "grpc": (WireFormatError, "small server: echo refused: frame over the size limit"),
}


def test_oversized_request_is_refused_by_size_and_serving_goes_on(rpc):
    srv = rpc.server("small server", {"echo": _echo}, token=TOKEN, max_frame_bytes=64 * 1024).start()
    client = rpc.client(srv.address, peer="small server", token=TOKEN, timeout=30)
    try:
        error, message = _ONE_PART_OVER_THE_LIMIT[rpc.name]
        with pytest.raises(error, match=message):
            client.call("echo", {}, {"x": torch.zeros(1 << 20, dtype=torch.uint8)})
        # Parts each under the limit that add up to more: refused by their total.
        big = {f"x{i}": torch.zeros(40 * 1024, dtype=torch.uint8) for i in range(2)}
        with pytest.raises(WireFormatError, match=r"small server: echo refused: .*frame over the size limit"):
            client.call("echo", {}, big)
        assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
    finally:
        client.close()
        srv.stop()


# -- dead, missing and slow servers --------------------------------------------------------------------
def test_unreachable_server_is_named_quickly(rpc):
    client = rpc.client(f"127.0.0.1:{_free_port()}", peer="parameter server 3", token=TOKEN, timeout=30)
    started = time.monotonic()
    with pytest.raises(RemoteCallError, match="parameter server 3: pull failed: unreachable"):
        client.call("pull")
    assert time.monotonic() - started < 25  # refused at once, not at the deadline
    client.close()


def test_waiting_for_a_server_that_never_starts_ends_at_the_deadline(rpc):
    client = rpc.client(f"127.0.0.1:{_free_port()}", peer="the chief", token=TOKEN, timeout=1)
    with pytest.raises(
        RemoteCallError, match="the chief: create failed: not reachable or no answer within 1s"
    ):
        client.call("create", wait_for_ready=True)
    with pytest.raises(RemoteCallError, match="the chief: session failed: not reachable"):
        client.stream("session", connect_timeout=1)
    client.close()


def test_slow_handler_hits_the_call_deadline_and_its_late_answer_is_never_taken(rpc):
    release = threading.Event()

    def wait(meta, tensors):
        if meta.get("slow"):
            release.wait(30)
        return {"n": meta["n"]}, {}

    srv = rpc.server("slow server", {"wait": wait}, token=TOKEN).start()
    client = rpc.client(srv.address, peer="slow server", token=TOKEN)
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


def test_server_that_dies_is_reported_and_a_restart_on_the_same_port_is_found(rpc):
    srv = rpc.server("ps 0", {"echo": _echo}, token=TOKEN).start()
    client = rpc.client(srv.address, peer="ps 0", token=TOKEN, timeout=10)
    assert client.call("echo", {"n": 1})[0] == {"seen": {"n": 1}}
    srv.stop()
    with pytest.raises(RemoteCallError, match="ps 0: echo failed: unreachable"):
        client.call("echo")
    srv = rpc.server("ps 0", {"echo": _echo}, token=TOKEN, address=srv.address).start()
    try:
        assert client.call("echo", {"n": 2}, wait_for_ready=True)[0] == {"seen": {"n": 2}}
    finally:
        client.close()
        srv.stop()


def test_server_dying_during_a_call_is_reported_before_the_deadline(rpc):
    entered = threading.Event()
    release = threading.Event()

    def hang(meta, tensors):
        entered.set()
        release.wait(30)
        return {}, {}

    srv = rpc.server("ps 1", {"hang": hang}, token=TOKEN).start()
    client = rpc.client(srv.address, peer="ps 1", token=TOKEN, timeout=60)
    stopper = threading.Thread(target=lambda: (entered.wait(30), srv.stop()))
    stopper.start()
    try:
        started = time.monotonic()
        with pytest.raises(RemoteCallError, match=r"ps 1: hang failed: (unreachable or )?connection lost"):
            client.call("hang")
        assert time.monotonic() - started < 50
    finally:
        release.set()
        stopper.join(60)
        client.close()


# -- streams -------------------------------------------------------------------------------------------
def _counting_stream(ended):
    def handler(meta, tensors, ctx):
        assert isinstance(ctx, CallContext)
        ctx.on_end(lambda: ended.append(meta["who"]))
        for i in range(meta["n"]):
            yield {"i": i}, {"t": torch.full((3,), float(i))}
        if meta.get("refuse"):
            raise RequestRefused("enough")

    return handler


def test_stream_delivers_messages_in_order_then_ends(rpc):
    ended: list[str] = []
    srv = rpc.server("chief", {}, stream_handlers={"count": _counting_stream(ended)}, token=TOKEN).start()
    client = rpc.client(srv.address, peer="the chief", token=TOKEN, timeout=30)
    try:
        stream = client.stream("count", {"n": 4, "who": "a"})
        assert isinstance(stream, RpcStream)
        got = [(m["i"], t["t"][0].item()) for m, t in stream]
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


@pytest.mark.parametrize("how", ["cancel", "close-without-a-word"])
def test_stream_sees_its_caller_leave(rpc, how):
    """``cancel``, or the caller's iterator closed (as when its process dies: ZeroMQ's socket closes
    and sends nothing, the heartbeat probe notices)."""
    parked, seen_inactive, ended = threading.Event(), threading.Event(), threading.Event()
    srv = rpc.server(
        "chief", {}, stream_handlers={"session": _waiting_session(parked, seen_inactive, ended)}, token=TOKEN
    ).start()
    client = rpc.client(srv.address, peer="the chief", token=TOKEN, timeout=30)
    try:
        stream = client.stream("session", {})
        messages = iter(stream)
        assert next(messages)[0] == {"op": "hello"}
        assert parked.wait(30)
        if how == "cancel":
            stream.cancel()
            assert list(messages) == []  # a cancelled stream just ends on this side
        else:
            messages.close()
        assert seen_inactive.wait(30) and ended.wait(30)
    finally:
        client.close()
        srv.stop()


def test_stopping_the_server_ends_a_blocked_stream_with_a_clear_error(rpc):
    started = threading.Event()

    def session(meta, tensors, ctx):
        yield {"op": "hello"}, {}
        started.set()
        while ctx.is_active():
            time.sleep(0.01)

    srv = rpc.server("chief", {}, stream_handlers={"session": session}, token=TOKEN).start()
    client = rpc.client(srv.address, peer="the chief", token=TOKEN, timeout=30)
    messages = iter(client.stream("session", {}))
    assert next(messages)[0] == {"op": "hello"}
    assert started.wait(30)
    srv.stop()  # returns: the handler saw its call end
    with pytest.raises(
        RemoteCallError, match=r"the chief: session failed: (unreachable or )?connection lost"
    ):
        next(messages)
    client.close()


class _MonitorFirst:
    """A ZeroMQ connection's poller that reports the monitor's disconnect before the socket's data
    (the order seen now and then under load when a server closes right after its last message)."""

    def __init__(self, conn) -> None:
        self._conn, self._real = conn, conn.poller

    def poll(self, timeout_ms):
        ready = dict(self._real.poll(timeout_ms))
        if ready.get(self._conn.monitor):
            return [(self._conn.monitor, zmq.POLLIN)]
        return list(ready.items())


def test_a_stream_reads_what_the_server_sent_before_it_stopped(rpc):
    """A chief yields "stop" to a worker's session and exits at once: the worker still reads "stop"
    (issue 40 item 8: a finished coordinator job's worker failed with "connection lost")."""
    sent = threading.Event()

    def session(meta, tensors, ctx):
        yield {"op": "task"}, {}
        yield {"op": "stop"}, {}
        sent.set()

    srv = rpc.server("chief", {}, stream_handlers={"session": session}, token=TOKEN).start()
    client = rpc.client(srv.address, peer="the chief", token=TOKEN, timeout=30)
    try:
        stream = client.stream("session", {})
        messages = iter(stream)
        assert next(messages)[0] == {"op": "task"}
        assert sent.wait(30)
        srv.stop()
        time.sleep(0.3)  # the last message and the disconnect have both arrived
        if rpc.name == "zmq":
            stream._conn.poller = _MonitorFirst(stream._conn)
        assert next(messages)[0] == {"op": "stop"}
    finally:
        client.close()


def test_stop_leaves_no_threads_or_listener(rpc):
    before = set(threading.enumerate())
    srv = rpc.server("t", {"echo": _echo}, stream_handlers={"s": _counting_stream([])}, token=TOKEN).start()
    client = rpc.client(srv.address, peer="t", token=TOKEN)
    client.call("echo")
    assert len(list(client.stream("s", {"n": 2, "who": "x"}))) == 2
    srv.stop()
    client.close()
    assert set(threading.enumerate()) <= before
    if isinstance(srv, zmq_rpc.ZmqServer):
        assert srv._context.closed
    host, port = srv.address.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


# -- ZeroMQ only: envelopes, and answers recorded by a relay --------------------------------------------
@pytest.fixture
def zmq_server():
    srv = zmq_rpc.ZmqServer("test server", {"echo": _echo}, token=TOKEN).start()
    yield srv
    srv.stop()


def _zmq_exchange(address: str, parts: list[bytes]) -> list[bytes]:
    """Hand-made request parts on a bare DEALER socket, bypassing the client's encoder."""
    from _transport_peers import ZmqRawCaller

    peer = ZmqRawCaller(address)
    try:
        return peer.exchange(parts)
    finally:
        peer.close()


def test_zmq_malformed_envelopes_are_refused_and_serving_goes_on(zmq_server):
    rid, status, mac, text = _zmq_exchange(zmq_server.address, [b"x"])  # one part: no request id
    assert (rid, status, mac) == (b"", zmq_rpc.INVALID, b"") and b"malformed request" in text
    assert _zmq_exchange(zmq_server.address, [zmq_rpc.HELLO, b"r", b"short nonce"])[1] == zmq_rpc.INVALID
    assert _zmq_exchange(zmq_server.address, [b"?", b"r", b"echo", b"", b"", b"", b""])[1] == zmq_rpc.INVALID
    # A request missing its parts is answered too (when it names a request id).
    assert _zmq_exchange(zmq_server.address, [zmq_rpc.CALL, b"r9", b"echo"])[1] == zmq_rpc.INVALID
    client = zmq_rpc.ZmqClient(zmq_server.address, peer="test server", token=TOKEN, timeout=30)
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
    client.close()


def _items(n, gate):
    def handler(meta, tensors, ctx):
        if meta["who"] != "first":
            gate.wait(30)
        for i in range(n):
            yield {"i": i, "who": meta["who"]}, {}

    return handler


def test_zmq_recorded_answers_replayed_by_an_impostor_or_injected_into_a_live_stream_are_refused():
    gate = threading.Event()
    srv = zmq_rpc.ZmqServer("chief", {}, stream_handlers={"tasks": _items(2, gate)}, token=TOKEN).start()
    relay = Relay(srv.address, TOKEN)
    client = zmq_rpc.ZmqClient(relay.address, peer="the chief", token=TOKEN, timeout=10)
    try:
        got = [m for m, _ in client.stream("tasks", {"who": "first"})]
        assert got == [{"i": 0, "who": "first"}, {"i": 1, "who": "first"}]
        recorded = [a for a in relay.answers if a[1] != zmq_rpc.HEARTBEAT]  # WELCOME, open, 2 items, end
        assert recorded[0][1] == zmq_rpc.WELCOME
        assert [a[1] for a in recorded[2:4]] == [zmq_rpc.STREAM_ITEM, zmq_rpc.STREAM_ITEM]

        # 1. An impostor replays the whole recording to a new client: its handshake proof is stale.
        def replay(parts):
            if parts[0] == zmq_rpc.HELLO:
                return [[parts[1], *recorded[0][1:]]]
            return [[parts[1], *answer[1:]] for answer in recorded[1:]]

        fake = FakeServer(replay)
        other = zmq_rpc.ZmqClient(fake.address, peer="the chief", token=TOKEN, timeout=10)
        with pytest.raises(JobTokenError, match="could not prove the token"):
            other.stream("tasks", {"who": "x"}, connect_timeout=10)
        other.close()
        fake.close()

        # 2. Inside a live session (the relay forwards the real handshake), a recorded item from the
        # first stream, re-addressed to the second stream's request id, is refused: its MAC is bound
        # to the first stream's request id.
        stream = client.stream("tasks", {"who": "second"})
        rid = [a for a in relay.answers if a[1] == zmq_rpc.STREAM_OPEN][-1][0]  # the second stream's
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


# -- gRPC only: raw HTTP/2, and answers recorded by a raw session ----------------------------------------
@pytest.fixture
def grpc_server():
    srv = grpc_rpc.GrpcServer("test server", {"echo": _echo}, token=TOKEN).start()
    yield srv
    srv.stop()


def test_grpc_http2_message_declaring_4_gib_is_refused_unread(grpc_server):
    """Raw HTTP/2: a gRPC message declaring 4 GiB is refused at once, without its bytes being sent.

    Stream 1 carries a valid echo request (so the hand-made headers are known to be right: it gets a
    DATA answer); stream 3 the same headers and a message header declaring 4 GiB followed by 1 KiB:
    it must end (trailers or reset) with no DATA, while the rest never arrives.
    """
    from _transport_peers import GrpcRawCaller, grpc_tls_socket

    valid = encode({"raw": True})
    raw = GrpcRawCaller(grpc_server.address)
    signed = raw.metadata("echo", valid)
    raw.close()
    host, port = grpc_server.address.rsplit(":", 1)
    sock = grpc_tls_socket(host, int(port))

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    def literal(name: str, value: str) -> bytes:  # HPACK literal without indexing, no Huffman
        return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()

    headers = b"".join(
        literal(k, v)
        for k, v in [
            (":method", "POST"),
            (":scheme", "https"),
            (":path", f"/{grpc_rpc.SERVICE}/echo"),
            (":authority", grpc_server.address),
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
    client = grpc_rpc.GrpcClient(grpc_server.address, peer="test server", token=TOKEN, timeout=30)
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
    client.close()


def test_grpc_recorded_answers_replayed_by_an_impostor_are_refused():
    from _transport_peers import GrpcFakeServer, GrpcRawCaller

    def items(meta, tensors, ctx):
        yield {"op": "task", "function": ["__main__", "step"]}, {}

    srv = grpc_rpc.GrpcServer("chief", {}, stream_handlers={"session": items}, token=TOKEN).start()
    recorded: dict = {}
    try:
        raw = GrpcRawCaller(srv.address)  # records what a real chief answers a real worker
        handshake = ClientHandshake(TOKEN)
        hello = raw.channel.unary_unary(f"/{grpc_rpc.SERVICE}/{grpc_rpc.HELLO}", _registered_method=False)
        recorded[grpc_rpc.HELLO] = hello(handshake.nonce, timeout=30)
        request = encode({"worker": 1})
        stub = raw.channel.unary_stream(f"/{grpc_rpc.SERVICE}/session", _registered_method=False)
        recorded["session"] = list(stub(request, timeout=30, metadata=raw.metadata("session", request)))
        raw.close()
    finally:
        srv.stop()
    assert len(recorded["session"]) == 1
    fake = GrpcFakeServer(recorded)
    client = grpc_rpc.GrpcClient(fake.address, peer="the chief", token=TOKEN, timeout=10)
    try:
        with pytest.raises(JobTokenError, match="could not prove the token"):
            client.stream("session", {"worker": 1}, connect_timeout=10)
        # Even past a handshake (a session of its own), the recorded item proves another session.
        welcome = recorded[grpc_rpc.HELLO]
        client._session = handshake.finish(welcome[:16], welcome[16:32], welcome[32:])
        assert client._session is not None
        stream = grpc_rpc.GrpcStream(
            client,
            "session",
            client._channel.unary_stream(f"/{grpc_rpc.SERVICE}/session", _registered_method=False)(
                b"", metadata=()
            ),
            client._session,
            seq_bytes(7),
        )
        with pytest.raises(JobTokenError, match="forged or replayed"):
            list(stream)
    finally:
        client.close()
        fake.close()
