"""The parameter-server runtime: wire format, transport, servers, placement, client, coordinator.

One module per job: :mod:`wire` (tensor frames, never pickle), :mod:`rpc_api` (the RPC interfaces
every transport implements, and the sessions in which both ends prove the job token and nothing
replays), :mod:`zmq_transport` and :mod:`grpc_transport` (those interfaces on ZeroMQ or gRPC, picked
by :mod:`transports`), :mod:`at_exit` (closing what a script left open, before Python shuts its
thread pools down), :mod:`optimizers` (server-side SGD/Adagrad/Adam/AdamW), :mod:`placement` (which
server holds which variable or row range), :mod:`step_ids` (the ids under which a step is applied
once), :mod:`server` (a parameter server), :mod:`client` (a worker's view of all servers),
:mod:`coordinator` (TF-style ``ClusterCoordinator``; its chief and worker sides in
:mod:`coordinator_chief` and :mod:`coordinator_worker`, what travels between them in
:mod:`coordinator_tasks`).
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
