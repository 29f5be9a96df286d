"""``ClusterSpec``: the one resolved answer to "who am I, and who are my peers".

Launchers describe a job in different dialects (torchrun's ``RANK``/``WORLD_SIZE``, TensorFlow's
``TF_CONFIG``, SLURM's ``SLURM_*``). The resolvers in :mod:`spread.cluster.resolvers` translate each
dialect into this one frozen value, so every layer above (rendezvous, strategies, the trainer) reads
the same field names and never parses the environment itself.

Vocabulary: the *training group* is the chief plus the workers, the processes that train
synchronously; ``rank`` and ``world_size`` count only them. Parameter servers (``ps``) and the
``evaluator`` are tasks of the cluster but not of the training group, so their ``rank`` is ``-1``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from spread import env
from spread.errors import ClusterSpecError

ROLES: tuple[str, ...] = ("chief", "worker", "ps", "evaluator")
"""Task roles (TF's vocabulary); ranks go to the chief first, then the workers."""

TRAINING_ROLES: tuple[str, ...] = ("chief", "worker")
"""Roles whose tasks join the synchronous training group (and so have a rank)."""

SOURCES: tuple[str, ...] = ("torchrun", "tf_config", "slurm", "single")
"""Where a spec came from; ``single`` is the one-process default when no launcher is detected."""

_MAX_PORT = 65535


def _check_int(name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass; True as a rank is a bug upstream, not a rank of 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ClusterSpecError(name, "", f"expected an integer, got {value!r}")
    if value < minimum:
        raise ClusterSpecError(name, "", f"expected an integer >= {minimum}, got {value!r}")


class FrozenCluster(Mapping[str, tuple[str, ...]]):
    """A read-only, hashable, picklable role -> addresses mapping.

    Why not ``types.MappingProxyType``: it can be neither hashed nor pickled, and specs travel to
    spawned processes and sit in sets and dict keys.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, tuple[str, ...]] | None = None) -> None:
        # Keep ROLES order so equal clusters also print the same.
        given = dict(data or {})
        self._data = {role: given[role] for role in ROLES if role in given}

    def __getitem__(self, role: str) -> tuple[str, ...]:
        return self._data[role]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(self._data.items()))

    def __reduce__(self) -> tuple[type[FrozenCluster], tuple[dict[str, tuple[str, ...]]]]:
        return (FrozenCluster, (dict(self._data),))

    def __repr__(self) -> str:
        return f"FrozenCluster({self._data!r})"


def _freeze_cluster(cluster: object) -> FrozenCluster:
    if not isinstance(cluster, Mapping):
        raise ClusterSpecError("cluster", "", f"expected a mapping of role -> addresses, got {cluster!r}")
    frozen: dict[str, tuple[str, ...]] = {}
    for role, addresses in cluster.items():
        if role not in ROLES:
            raise ClusterSpecError("cluster", str(role), f"unknown role {role!r}; expected one of {ROLES}")
        if not isinstance(addresses, tuple | list) or not all(isinstance(a, str) for a in addresses):
            raise ClusterSpecError(
                "cluster", role, f"expected a sequence of 'host:port' strings, got {addresses!r}"
            )
        frozen[role] = tuple(addresses)
    return FrozenCluster(frozen)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """Where this process sits in the job, as one immutable, validated value.

    Build one with :func:`spread.cluster.resolve_cluster` (or a specific resolver) rather than by
    hand; constructing it directly is for tests and launchers. Every field is checked in
    ``__post_init__``; a bad value raises :class:`~spread.errors.ClusterSpecError` whose
    ``variable`` is the field's name.

    Attributes:
        role: one of :data:`ROLES`.
        task_index: index of this task among the tasks of its role.
        rank: global rank in the training group (chief first, then workers in order); ``-1`` for
            ``ps`` and ``evaluator`` tasks, which are not in the training group.
        world_size: number of processes in the training group (chief plus workers).
        local_rank: position of this process among the training processes on its node.
        local_world_size: number of training processes on this node.
        node_rank: index of this node among the training nodes.
        nnodes: number of training nodes.
        master_addr: host of the rendezvous store (rank 0 hosts it).
        master_port: port of the rendezvous store; ``0`` means any free port, of use only to a lone
            process (its peers could not find it).
        cluster: role -> task addresses (``"host:port"``); empty when the launcher gives no list
            (torchrun, SLURM). Stored as a read-only, hashable :class:`FrozenCluster`.
        source: which resolver produced the spec; one of :data:`SOURCES`.
        restart_count: how many times the launcher has restarted the job (0 on the first attempt);
            rendezvous namespaces its keys by it so restarted attempts never read stale keys.
    """

    role: str
    task_index: int
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    cluster: Mapping[str, tuple[str, ...]] = field(default_factory=FrozenCluster)
    source: str = "single"
    restart_count: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ClusterSpecError("role", "", f"expected one of {ROLES}, got {self.role!r}")
        if self.source not in SOURCES:
            raise ClusterSpecError("source", "", f"expected one of {SOURCES}, got {self.source!r}")
        _check_int("task_index", self.task_index, minimum=0)
        _check_int("world_size", self.world_size, minimum=1)
        _check_int("rank", self.rank, minimum=-1)
        if self.in_training_group:
            if not 0 <= self.rank < self.world_size:
                raise ClusterSpecError(
                    "rank",
                    "",
                    f"a {self.role} needs 0 <= rank < world_size={self.world_size}, got {self.rank}",
                )
        elif self.rank != -1:
            raise ClusterSpecError(
                "rank",
                "",
                f"a {self.role} task is not in the training group; rank must be -1, got {self.rank}",
            )
        if self.role == "chief" and (self.rank, self.task_index) != (0, 0):
            raise ClusterSpecError(
                "rank", "", f"the chief is rank 0, task 0; got rank {self.rank}, task {self.task_index}"
            )
        _check_int("local_world_size", self.local_world_size, minimum=1)
        _check_int("local_rank", self.local_rank, minimum=0)
        if self.local_rank >= self.local_world_size:
            raise ClusterSpecError(
                "local_rank",
                "",
                f"expected < local_world_size={self.local_world_size}, got {self.local_rank}",
            )
        _check_int("nnodes", self.nnodes, minimum=1)
        _check_int("node_rank", self.node_rank, minimum=0)
        if self.node_rank >= self.nnodes:
            raise ClusterSpecError("node_rank", "", f"expected < nnodes={self.nnodes}, got {self.node_rank}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ClusterSpecError("master_addr", "", f"expected a non-empty host, got {self.master_addr!r}")
        _check_int("master_port", self.master_port, minimum=0)
        if self.master_port > _MAX_PORT:
            raise ClusterSpecError(
                "master_port", "", f"expected a port in 0..{_MAX_PORT}, got {self.master_port}"
            )
        _check_int("restart_count", self.restart_count, minimum=0)
        object.__setattr__(self, "cluster", _freeze_cluster(self.cluster))
        self._check_cluster_agrees()

    def _check_cluster_agrees(self) -> None:
        """When a task list is given, this task and the training group must be in it."""
        if not self.cluster:
            return
        if self.num_workers != self.world_size:
            raise ClusterSpecError(
                "cluster",
                "",
                f"lists {self.num_workers} chief/worker task(s) but world_size is {self.world_size}",
            )
        tasks = self.cluster.get(self.role, ())
        # An evaluator may run outside the cluster (TF convention), so it need not be listed.
        if self.role != "evaluator" and self.task_index >= len(tasks):
            raise ClusterSpecError(
                "task_index",
                "",
                f"{self.role} task {self.task_index} is not in cluster[{self.role!r}] {tasks}",
            )

    @property
    def in_training_group(self) -> bool:
        """Whether this task trains synchronously (chief or worker) and so has a rank."""
        return self.role in TRAINING_ROLES

    @property
    def is_chief(self) -> bool:
        """Rank 0: the task that hosts the store, prints, and writes logs and checkpoints.

        This is the ``chief`` task when there is one, else worker 0 (TF's convention for a cluster
        without a chief, and torchrun's rank 0).
        """
        return self.rank == 0

    @property
    def num_workers(self) -> int:
        """Processes in the training group (chief plus workers); ``world_size`` when no list is known."""
        if not self.cluster:
            return self.world_size
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def num_ps(self) -> int:
        """Parameter-server tasks in the cluster (0 when the launcher lists none)."""
        return len(self.cluster.get("ps", ()))

    @property
    def is_distributed(self) -> bool:
        """Whether the training group has more than one process (a process group is needed)."""
        return self.world_size > 1

    @property
    def task_address(self) -> str | None:
        """This task's own ``host:port`` from the cluster list, or None when there is no list."""
        tasks = self.cluster.get(self.role, ())
        return tasks[self.task_index] if self.task_index < len(tasks) else None

    def to_env(self) -> dict[str, str]:
        """The torchrun-style variables for this process, so a spec survives a trip through a child's env.

        ``from_torchrun_env(spec.to_env())`` gives back this spec with ``source="torchrun"`` and no
        cluster list.

        Raises:
            ClusterSpecError: for a ``ps`` or ``evaluator`` task, which has no rank to export.
        """
        if not self.in_training_group:
            raise ClusterSpecError(
                "role", "", f"a {self.role} task is not in the training group and has no torchrun environment"
            )
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NNODES": str(self.nnodes),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            env.RESTART_COUNT: str(self.restart_count),
        }
