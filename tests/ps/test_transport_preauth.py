"""What a peer without the job token can make a parameter server, the coordinator or the evaluator
hold before it is refused (issue 40, item 3). Attacks run in another process of the same user.

ZeroMQ keeps a multipart message until its last part arrives, so before the servers spoke CURVE one
connection could make a server hold any number of parts, each up to ``max_frame_bytes``, for as long
as it stayed connected. Now a peer that does not know the job's CURVE key is dropped at the greeting.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq
from _transport_peers import TOKEN, ZmqRawCaller

from spread.errors import JobTokenError
from spread.ps import zmq_transport as zmq_rpc

ATTACKER = Path(__file__).parent / "_zmtp_attacker.py"
PARTS, MIB = 3, 50


def _rss_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS in /proc/self/status")


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
