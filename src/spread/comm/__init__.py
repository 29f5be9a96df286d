"""How replicas talk: collectives with named failures, and the bucketed gradient all-reduce."""

from spread.comm.bucketing import DEFAULT_BUCKET_CAP_MB, GradientReducer
from spread.comm.ops import Collectives, PendingCollective

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Collectives", "GradientReducer", "PendingCollective"]
