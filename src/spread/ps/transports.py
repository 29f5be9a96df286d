"""Pick the RPC layer by name: ``"zmq"`` (:mod:`spread.ps.zmq_transport`, ZeroMQ, the default) or
``"grpc"`` (:mod:`spread.ps.grpc_transport`). Both offer the same ``RpcServer``/``RpcClient``/
``RequestRefused`` API, so servers, clients and the coordinator are written once.

Why these two and this default (``benchmarks/ps_transport.py``,
``docs/results/2026-11-23-ps-transport.md``): both are
well-kept libraries that work across machines and carry spread's own wire frames (no pickle);
ZeroMQ moved 4 MB in ~4 ms per push on this machine, gRPC's Python binding in ~11-14 ms (it copies
each message several times); torch.distributed.rpc (~2 ms) unpickles its network messages, which
spread's security rule forbids. A hand-written framed-TCP transport would take ~2 ms, but the
project keeps no home-made network stack."""

from __future__ import annotations

import importlib
from types import ModuleType

DEFAULT_TRANSPORT = "zmq"  # what ParameterServerStrategy uses unless SPREAD_PS_TRANSPORT says otherwise
TRANSPORTS = {
    "grpc": "spread.ps.grpc_transport",
    "zmq": "spread.ps.zmq_transport",
}


def rpc_module(name: str) -> ModuleType:
    """The module implementing transport ``name`` (imported on first use)."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {name!r}")
    return importlib.import_module(TRANSPORTS[name])
