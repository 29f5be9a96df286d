"""Hand-made ZeroMQ peers for attack tests: a server without the token, and a recording relay.

A peer without the token cannot know the servers' CURVE key, so it cannot even complete ZeroMQ's
handshake with a client or a server. To test the session layer behind CURVE, a peer may be given the
key (``token=``): it then gets through ZeroMQ's handshake and meets the session's checks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from spread.ps.zmq_transport import _server_secret_key, server_public_key


def curve_client(sock: zmq.Socket, token: str) -> None:
    """Make ``sock`` a CURVE client of the servers of the job with ``token`` (before connecting)."""
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_key(token))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def curve_server(sock: zmq.Socket, token: str) -> None:
    """Make ``sock`` a CURVE server with the key of the job with ``token`` (before binding)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, _server_secret_key(token))


def _bind(router: zmq.Socket, address: str | None) -> str:
    if address is None:
        return f"127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    router.bind(f"tcp://{address}")
    return address


class FakeServer:
    """A process without the token at a server's address: answers each message (the parts after the
    caller's identity) with the messages ``reply`` returns for it. Without ``token`` it cannot
    complete a client's CURVE handshake, so it receives nothing."""

    def __init__(
        self,
        reply: Callable[[list[bytes]], list[list[bytes]]],
        address: str | None = None,
        token: str | None = None,
    ) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if token is not None:
            curve_server(self.router, token)
        self.address = _bind(self.router, address)
        self.received: list[list[bytes]] = []
        self._reply = reply
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, *parts = self.router.recv_multipart()
            self.received.append(parts)
            for answer in self._reply(parts):
                self.router.send_multipart([identity, *answer])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.router.close(0)
        self.context.term()


class Relay:
    """A man in the middle between clients and a server: forwards everything, records the server's
    answers, and can inject messages to the client after the next answer. It holds the job's CURVE
    keys (``token``): the session layer is what it meets."""

    def __init__(self, server_address: str, token: str, address: str | None = None) -> None:
        self.context = zmq.Context()
        self.front = self.context.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        curve_server(self.front, token)
        self._token = token
        self.address = _bind(self.front, address)
        self._server_address = server_address
        self._backs: dict[bytes, zmq.Socket] = {}  # one connection to the server per client
        self.answers: list[list[bytes]] = []
        self.inject_after_next_answer: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _back(self, identity: bytes, poller: zmq.Poller) -> zmq.Socket:
        if identity not in self._backs:
            back = self.context.socket(zmq.DEALER)
            back.setsockopt(zmq.LINGER, 0)
            curve_client(back, self._token)
            back.connect(f"tcp://{self._server_address}")
            poller.register(back, zmq.POLLIN)
            self._backs[identity] = back
        return self._backs[identity]

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if ready.get(self.front):
                identity, *parts = self.front.recv_multipart()
                self._back(identity, poller).send_multipart(parts)
            for identity, back in list(self._backs.items()):
                if ready.get(back):
                    parts = back.recv_multipart()
                    self.answers.append(parts)
                    self.front.send_multipart([identity, *parts])
                    while self.inject_after_next_answer:
                        self.front.send_multipart([identity, *self.inject_after_next_answer.pop(0)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for back in self._backs.values():
            back.close(0)
        self.front.close(0)
        self.context.term()
