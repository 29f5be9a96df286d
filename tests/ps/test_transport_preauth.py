"""What a peer without the job token can make a parameter server, the coordinator or the evaluator
hold before it is refused (issue 40, item 3). Attacks run in another process of the same user.

ZeroMQ keeps a multipart message until its last part arrives, so before the servers spoke CURVE one
connection could make a server hold any number of parts, each up to ``max_frame_bytes``, for as long
as it stayed connected. Now a peer that does not know the job's CURVE key is dropped at the greeting.

gRPC read a request's body whole (up to ``max_frame_bytes``) before the session check inside the RPC
refused it, on as many streams as a peer opened. Now the servers speak mutual TLS keyed by the job
token: a peer without the job's certificate fails the TLS handshake and gRPC reads nothing of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from _transport_peers import TOKEN, ZmqRawCaller, grpc_tls_socket

from spread.errors import JobTokenError
from spread.ps import grpc_transport as grpc_rpc
from spread.ps import zmq_transport as zmq_rpc

ATTACKER = Path(__file__).parent / "_zmtp_attacker.py"
GRPC_ATTACKER = Path(__file__).parent / "_grpc_attacker.py"
PARTS, MIB = 3, 50


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) // 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _rss_mib() -> int:
    return _status_mib("VmRSS")


def _reset_peak_rss() -> None:
    """VmHWM (the peak RSS) starts again from the current RSS (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _echo(meta, tensors):
    return {"seen": meta}, tensors


@pytest.fixture
def zmq_server():
    srv = zmq_rpc.ZmqServer("test server", {"echo": _echo}, token=TOKEN).start()
    yield srv
    srv.stop()


@pytest.mark.processes
def test_zmq_parts_without_their_last_from_a_peer_without_the_token_are_not_held(zmq_server):
    """3 x 50 MiB parts, never the last, from another process: before CURVE the server held all
    150 MiB for as long as the peer stayed connected; now the peer is dropped at the greeting."""
    port = zmq_server.address.rpartition(":")[2]
    before = _rss_mib()
    attacker = subprocess.Popen(
        [sys.executable, str(ATTACKER), port, str(PARTS), str(MIB)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert attacker.stdout is not None
        outcome = attacker.stdout.readline().strip()  # once every byte is out, or the server hung up
        held = _rss_mib() - before
        client = zmq_rpc.ZmqClient(zmq_server.address, peer="test server", token=TOKEN, timeout=30)
        assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
        client.close()
    finally:
        attacker.kill()
        attacker.communicate(timeout=30)
    assert outcome == "dropped", f"the peer's parts all went out; the server holds {held} MiB more"
    assert held < MIB, f"the server holds {held} MiB more"


def test_zmq_a_client_without_the_servers_key_is_refused_naming_the_token(zmq_server):
    client = zmq_rpc.ZmqClient(zmq_server.address, peer="test server", token="another job's token")
    try:
        with pytest.raises(JobTokenError, match="echo refused: its SPREAD_JOB_TOKEN does not match"):
            client.call("echo", {}, timeout=10)
    finally:
        client.close()


def test_zmq_answers_to_a_peer_that_reads_none_are_bounded(zmq_server):
    """A peer (past CURVE) sends handshakes and reads no answer: the server queues at most
    ``_SNDHWM`` answers for it and drops the rest (before: ``SNDHWM=0``, every answer kept)."""
    peer = ZmqRawCaller(zmq_server.address)
    peer.sock.setsockopt(zmq.RCVHWM, 1)
    peer.sock.setsockopt(zmq.RCVBUF, 4096)
    peer.sock.setsockopt(zmq.SNDTIMEO, 30_000)
    try:
        for _ in range(30):
            for _ in range(2000):
                peer.sock.send_multipart([zmq_rpc.HELLO, b"r", b"n" * 16])
            if zmq_server.dropped_answers:
                break
        assert zmq_server.dropped_answers > 0
        client = zmq_rpc.ZmqClient(zmq_server.address, peer="test server", token=TOKEN, timeout=30)
        assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
        client.close()
    finally:
        peer.close()


def test_zmq_a_tensor_over_the_part_size_travels_cut_and_comes_back_whole(monkeypatch):
    """Parts are cut at ``_PART_BYTES`` (so MAXMSGSIZE, what a handshake may make a server hold,
    stays that small), and a frame that came cut is joined again."""
    monkeypatch.setattr(zmq_rpc, "_PART_BYTES", 64 << 10)
    srv = zmq_rpc.ZmqServer("test server", {"echo": _echo}, token=TOKEN).start()
    client = zmq_rpc.ZmqClient(srv.address, peer="test server", token=TOKEN, timeout=30)
    try:
        x, small = torch.randn(300_000), torch.arange(10)
        meta, tensors = client.call("echo", {"k": 1}, {"x": x, "small": small})
        assert meta == {"seen": {"k": 1}}
        assert torch.equal(tensors["x"], x) and torch.equal(tensors["small"], small)
    finally:
        client.close()
        srv.stop()


# -- gRPC --------------------------------------------------------------------------------------------
@pytest.fixture
def grpc_server():
    srv = grpc_rpc.GrpcServer("test server", {"echo": _echo}, token=TOKEN).start()
    yield srv
    srv.stop()


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["plaintext", "other-tls"])
def test_grpc_request_bodies_from_a_peer_without_the_token_are_not_read(grpc_server, mode):
    """3 concurrent calls of 50 MiB each, no session, from another process: before TLS gRPC read every
    body whole before the session check refused it (server peak RSS +234 MiB); now the peer fails
    the TLS handshake, over plaintext or with another job's certificate, and nothing is read."""
    port = grpc_server.address.rpartition(":")[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    before = _rss_mib()
    _reset_peak_rss()
    attacker = subprocess.run(
        [sys.executable, str(GRPC_ATTACKER), port, mode, str(PARTS), str(MIB)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    peak = _status_mib("VmHWM") - before
    outcome = attacker.stdout.strip()
    client = grpc_rpc.GrpcClient(grpc_server.address, peer="test server", token=TOKEN, timeout=30)
    assert client.call("echo", {"alive": True})[0] == {"seen": {"alive": True}}
    client.close()
    assert outcome == "UNAVAILABLE", f"the calls ended {outcome} {attacker.stderr}; server peak +{peak} MiB"
    assert peak < MIB, f"the server's RSS peaked {peak} MiB higher"


def test_grpc_a_client_with_another_jobs_token_fails_the_tls_handshake_naming_the_token(grpc_server):
    """The server never sees its handshake (no session opened), and a caller that waits for the
    server to come up is told at once, not at its deadline."""
    client = grpc_rpc.GrpcClient(grpc_server.address, peer="test server", token="another job's token")
    try:
        started = time.monotonic()
        with pytest.raises(JobTokenError, match="echo refused: its SPREAD_JOB_TOKEN does not match"):
            client.call("echo", {}, timeout=60, wait_for_ready=True)
        with pytest.raises(JobTokenError, match="session refused: its SPREAD_JOB_TOKEN does not match"):
            client.stream("session", connect_timeout=60)
        assert time.monotonic() - started < 30
    finally:
        client.close()
    assert len(grpc_server._sessions) == 0


def test_grpc_a_connection_carries_at_most_100_calls_at_a_time(grpc_server):
    """The server's HTTP/2 SETTINGS (read past TLS with the job's identity) cap concurrent streams."""
    host, port = grpc_server.address.rsplit(":", 1)
    sock = grpc_tls_socket(host, int(port))
    try:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0\0\0\x04\0\0\0\0\0")  # preface, SETTINGS
        received = b""
        while len(received) < 9 or len(received) < 9 + int.from_bytes(received[:3], "big"):
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            received += chunk
    finally:
        sock.close()
    assert received[3] == 0x4  # the server's first frame is its SETTINGS
    payload = received[9 : 9 + int.from_bytes(received[:3], "big")]
    settings = {
        int.from_bytes(payload[i : i + 2], "big"): int.from_bytes(payload[i + 2 : i + 6], "big")
        for i in range(0, len(payload), 6)
    }
    assert settings.get(0x3) == grpc_rpc._MAX_STREAMS == 100  # SETTINGS_MAX_CONCURRENT_STREAMS


def test_grpc_the_tls_identity_is_made_from_the_token_alone():
    """Every process makes the same certificates (no exchange), another token other keys."""
    make = grpc_rpc.tls_identity.__wrapped__
    assert make(TOKEN) == make(TOKEN)
    other = make("another job's token")
    assert other.root != make(TOKEN).root and other.key != make(TOKEN).key
