"""Pick the RPC layer by name: ``"socket"`` (:mod:`spread.ps.transport`, the default) or ``"grpc"``
(:mod:`spread.ps.grpc_transport`). Both offer the same ``RpcServer``/``RpcClient``/``RequestRefused``
API, so servers, clients and the coordinator are written once."""

from __future__ import annotations

import importlib
from types import ModuleType

TRANSPORTS = {"socket": "spread.ps.transport", "grpc": "spread.ps.grpc_transport"}


def rpc_module(name: str) -> ModuleType:
    """The module implementing transport ``name`` (imported on first use: grpc is optional)."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {name!r}")
    return importlib.import_module(TRANSPORTS[name])
