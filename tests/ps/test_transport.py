"""The RPC layer: calls, wrong token refused (S1), malformed frames refused while serving goes on (S5)."""

from __future__ import annotations

import socket
import struct
import threading

import psutil
import pytest
import torch

from spread.errors import JobTokenError, RemoteCallError, WireFormatError
from spread.ps.transport import _HELLO, RequestRefused, RpcClient, RpcServer, token_proof

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


def test_call_round_trip_and_bytes_counted(server):
    client = RpcClient(server.address, peer="test server", token=TOKEN)
    x = torch.randn(1000)
    meta, tensors = client.call("echo", {"a": 1}, {"x": x})
    assert meta == {"seen": {"a": 1}} and torch.equal(tensors["x"], x)
    assert client.bytes_sent > 4000 and client.bytes_received > 4000
    client.close()


def test_server_binds_loopback_by_default(server):
    assert server.address.startswith("127.0.0.1:")


def test_refusal_and_fault_name_the_server_and_keep_serving(server):
    client = RpcClient(server.address, peer="test server", token=TOKEN)
    with pytest.raises(RemoteCallError, match="test server: echo failed: test server: no thanks"):
        client.call("echo", {"refuse": True})
    with pytest.raises(RemoteCallError, match="RuntimeError: boom"):
        client.call("echo", {"crash": True})
    with pytest.raises(RemoteCallError, match="unknown method"):
        client.call("nope")
    assert client.call("echo", {"b": 2})[0] == {"seen": {"b": 2}}
    client.close()


def test_wrong_token_is_refused_before_any_call(server):
    calls = []
    server._handlers["echo"] = lambda m, t: calls.append(m) or ({}, {})
    intruder = RpcClient(server.address, peer="test server", token="wrong-token")
    with pytest.raises(JobTokenError, match="SPREAD_JOB_TOKEN does not match"):
        intruder.call("echo", {"x": 1})
    assert calls == [] and server.refused_connections == 1
    intruder.close()


def _raw_connection(address: str, token: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    hello = sock.recv(len(_HELLO) + 16, socket.MSG_WAITALL)
    sock.sendall(token_proof(token, hello[len(_HELLO) :]))
    assert sock.recv(9, socket.MSG_WAITALL)[0] == 0
    return sock


def test_ten_gib_declared_frame_is_refused_and_server_keeps_serving(server):
    rss_before = psutil.Process().memory_info().rss
    sock = _raw_connection(server.address, TOKEN)
    sock.sendall(struct.pack("<H", 4) + b"echo" + struct.pack("<Q", 10 << 30))
    status, length = struct.unpack("<BQ", sock.recv(9, socket.MSG_WAITALL))
    message = sock.recv(length, socket.MSG_WAITALL).decode()
    assert status == 2 and "over the limit" in message
    assert sock.recv(1) == b""  # the connection is dropped
    sock.close()
    growth = psutil.Process().memory_info().rss - rss_before
    print(f"S5 figures: RSS growth after a 10 GiB claim {growth / 1e6:.1f} MB")
    assert growth < 64e6  # nothing near the claimed size was allocated
    client = RpcClient(server.address, peer="test server", token=TOKEN)
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
    client.close()


def test_bad_dtype_code_is_refused_with_a_clear_error(server):
    sock = _raw_connection(server.address, TOKEN)
    header = b'{"meta":{},"tensors":[{"name":"x","dtype":77,"shape":[2]}]}'
    frame = b"SPR1" + struct.pack("<I", len(header)) + header + b"\0" * 8
    sock.sendall(struct.pack("<H", 4) + b"echo" + struct.pack("<Q", len(frame)) + frame)
    status, length = struct.unpack("<BQ", sock.recv(9, socket.MSG_WAITALL))
    assert status == 2 and b"unknown dtype code 77" in sock.recv(length, socket.MSG_WAITALL)
    sock.close()


def test_unreachable_server_is_named_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RpcClient(f"127.0.0.1:{port}", peer="parameter server 3", token=TOKEN, timeout=5)
    with pytest.raises(RemoteCallError, match="parameter server 3: pull failed: unreachable"):
        client.call("pull")
    client.close()


def test_stop_leaves_no_threads_or_listener():
    before = set(threading.enumerate())
    srv = RpcServer("t", {"echo": _echo}, token=TOKEN).start()
    client = RpcClient(srv.address, peer="t", token=TOKEN)
    client.call("echo")
    srv.stop()
    client.close()
    assert set(threading.enumerate()) <= before
    host, port = srv.address.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_wire_error_from_server_is_typed(server):
    client = RpcClient(server.address, peer="test server", token=TOKEN, max_frame_bytes=1 << 20)
    server._max_frame_bytes = 100
    with pytest.raises(WireFormatError):
        client.call("echo", {}, {"x": torch.zeros(100)})
    client.close()
