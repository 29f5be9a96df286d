"""What every RPC transport of the parameter servers shares: message types, refusal, token proof.

:mod:`spread.ps.zmq_transport` and :mod:`spread.ps.grpc_transport` re-export these names, so servers,
clients and the coordinator see one ``RequestRefused`` and one proof whichever transport runs.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator
from typing import Any

from spread.ps.wire import Tensors

DEFAULT_HOST = "127.0.0.1"

Message = tuple[dict[str, Any], Tensors]
Handler = Callable[[dict[str, Any], Tensors], Message]
StreamHandler = Callable[[dict[str, Any], Tensors, "CallContext"], Iterator[Message]]  # noqa: F821


class RequestRefused(Exception):
    """Raised by a handler to refuse a request with a message for the caller (not a server fault)."""


def token_proof(token: str, nonce: bytes) -> bytes:
    """``HMAC-SHA256(token, label + nonce)``: proves the token without sending it."""
    return hmac.new(token.encode(), b"spread-rpc-v1:" + nonce, hashlib.sha256).digest()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected a 'host:port' address, got {address!r}")
    return host.strip("[]"), int(port)
