"""Pick the RPC layer by name: ``"zmq"`` (:mod:`spread.ps.zmq_transport`, ZeroMQ, the default) or
``"grpc"`` (:mod:`spread.ps.grpc_transport`). Both implement the interfaces of
:mod:`spread.ps.rpc_api` (``RpcServer``, ``RpcClient``, ``RpcStream``, ``CallContext``), so servers,
clients and the coordinator are written once, against those.

Why these two and this default (``benchmarks/ps_transport.py``,
``docs/results/2026-11-23-ps-transport.md``): both are
well-kept libraries that work across machines and carry spread's own wire frames (no pickle);
ZeroMQ moved 4 MB in ~4 ms per push on this machine, gRPC's Python binding in ~11-14 ms (it copies
each message several times); torch.distributed.rpc (~2 ms) unpickles its network messages, which
spread's security rule forbids. A hand-written framed-TCP transport would take ~2 ms, but the
project keeps no home-made network stack."""

from __future__ import annotations

from dataclasses import dataclass

from spread.ps.rpc_api import RpcClient, RpcServer

DEFAULT_TRANSPORT = "zmq"  # what ParameterServerStrategy uses unless SPREAD_PS_TRANSPORT says otherwise
TRANSPORTS = ("grpc", "zmq")


@dataclass(frozen=True, slots=True)
class Transport:
    """One RPC layer: its name and the classes that implement the :mod:`spread.ps.rpc_api` interfaces
    (constructed with the arguments those document)."""

    name: str
    server: type[RpcServer]
    client: type[RpcClient]


def get_transport(name: str) -> Transport:
    """Transport ``name``; its module is imported on first use (gRPC's takes a while to load)."""
    if name == "zmq":
        from spread.ps.zmq_transport import ZmqClient, ZmqServer

        return Transport(name, ZmqServer, ZmqClient)
    if name == "grpc":
        from spread.ps.grpc_transport import GrpcClient, GrpcServer

        return Transport(name, GrpcServer, GrpcClient)
    raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {name!r}")
