"""Pick the RPC layer by name: ``"socket"`` (:mod:`spread.ps.transport`, the default), ``"grpc"``
(:mod:`spread.ps.grpc_transport`) or ``"zmq"`` (:mod:`spread.ps.zmq_transport`). All offer the same
``RpcServer``/``RpcClient``/``RequestRefused`` API, so servers, clients and the coordinator are
written once."""

from __future__ import annotations

import importlib
from types import ModuleType

DEFAULT_TRANSPORT = "socket"  # what ParameterServerStrategy uses unless SPREAD_PS_TRANSPORT says otherwise
TRANSPORTS = {
    "socket": "spread.ps.transport",
    "grpc": "spread.ps.grpc_transport",
    "zmq": "spread.ps.zmq_transport",
}


def rpc_module(name: str) -> ModuleType:
    """The module implementing transport ``name`` (imported on first use)."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {name!r}")
    return importlib.import_module(TRANSPORTS[name])
