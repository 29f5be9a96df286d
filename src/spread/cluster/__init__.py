"""Who am I, who are my peers: the cluster spec, its resolvers, rendezvous and the local launcher.

``resolve_cluster()`` reads whichever launcher started this process (``TF_CONFIG``, torchrun,
SLURM, or none) and returns one :class:`ClusterSpec`; everything above this layer reads that value.
"""

from spread.cluster.resolvers import (
    expand_nodelist,
    from_slurm_env,
    from_tf_config,
    from_torchrun_env,
    resolve_cluster,
)
from spread.cluster.spec import ROLES, SOURCES, TRAINING_ROLES, ClusterSpec, FrozenCluster

__all__ = [
    "ROLES",
    "SOURCES",
    "TRAINING_ROLES",
    "ClusterSpec",
    "FrozenCluster",
    "expand_nodelist",
    "from_slurm_env",
    "from_tf_config",
    "from_torchrun_env",
    "resolve_cluster",
]
