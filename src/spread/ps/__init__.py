"""The parameter-server runtime: wire format, transport, servers, placement, client, coordinator.

One module per job: :mod:`wire` (tensor frames, never pickle), :mod:`zmq_transport` and
:mod:`grpc_transport` (the RPC layer on ZeroMQ or gRPC, picked by :mod:`transports`),
:mod:`rpc_api` (what both share: sessions in which both ends prove the job token and nothing
replays), :mod:`at_exit` (closing what a script left open, before Python shuts its thread pools
down), :mod:`optimizers` (server-side SGD/Adagrad/Adam/AdamW), :mod:`placement` (which server holds
which variable or row range), :mod:`server` (a parameter server), :mod:`client` (a worker's view of
all servers), :mod:`coordinator` (TF-style ``ClusterCoordinator``).
"""

from spread.ps.client import PSClient
from spread.ps.coordinator import ClusterCoordinator, PerWorkerDataset, RemoteValue
from spread.ps.placement import Placement, Shard, VariableInfo, place
from spread.ps.server import ParameterServer, serve

__all__ = [
    "ClusterCoordinator",
    "PerWorkerDataset",
    "RemoteValue",
    "PSClient",
    "ParameterServer",
    "Placement",
    "Shard",
    "VariableInfo",
    "place",
    "serve",
]
