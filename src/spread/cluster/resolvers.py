"""Translate a launcher's environment (torchrun, ``TF_CONFIG``, SLURM) into one :class:`ClusterSpec`.

Each resolver is a pure function of an ``env`` mapping (``os.environ`` by default): no sockets, no
torch, so a malformed environment fails here, at start-up, with a :class:`ClusterSpecError` that
names the variable and the part of it that is wrong, rather than as a hang in rendezvous later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from spread import env as spread_env
from spread.cluster import _hostlist, _tf_json
from spread.cluster._hostlist import expand_nodelist
from spread.cluster.spec import ClusterSpec
from spread.errors import ClusterSpecError

__all__ = ["expand_nodelist", "from_slurm_env", "from_tf_config", "from_torchrun_env", "resolve_cluster"]

DEFAULT_SLURM_PORT = 29500
"""Store port under SLURM when neither ``MASTER_PORT`` nor ``SLURM_JOB_ID`` is set."""


def _first(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set in ``env`` (aliases, most specific first)."""
    return next((n for n in names if n in env), None)


def _int(
    env: Mapping[str, str],
    name: str,
    *,
    default: int | None = None,
    minimum: int = 0,
    below: tuple[int, str] | None = None,
) -> int:
    """``env[name]`` (else ``default``) as an int >= ``minimum``.

    ``below=(limit, condition)`` also requires ``value < limit``; ``condition`` says so in the error.
    """
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ClusterSpecError(name, "", "not set")
        value = default
    else:
        what = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
        try:
            value = int(raw.strip())
        except ValueError:
            raise ClusterSpecError(name, "", f"expected {what}, got {raw!r}") from None
        if value < minimum:
            raise ClusterSpecError(name, "", f"expected {what}, got {raw!r}")
    if below is not None and value >= below[0]:
        raise ClusterSpecError(name, "", f"expected {below[1]}, got {value}")
    return value


def _port(env: Mapping[str, str], name: str, *, default: int | None = None, minimum: int = 0) -> int:
    port = _int(env, name, default=default, minimum=minimum)
    if port > 65535:
        raise ClusterSpecError(name, "", f"expected a port in {minimum}..65535, got {env[name]!r}")
    return port


def _restart_count(env: Mapping[str, str]) -> int:
    """The launcher's attempt number (0 on the first attempt), whatever the dialect."""
    restarts = _first(env, spread_env.RESTART_COUNT, "TORCHELASTIC_RESTART_COUNT")
    return _int(env, restarts) if restarts else 0


def _training_spec(
    env: Mapping[str, str],
    source: str,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    master_port: int,
) -> ClusterSpec:
    """The spec of a rank-based launcher's process: rank 0 is the chief, rank r > 0 is worker r - 1
    (chief first, then workers, as in TF_CONFIG)."""
    return ClusterSpec(
        role="chief" if rank == 0 else "worker",
        task_index=max(rank - 1, 0),
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        nnodes=nnodes,
        master_addr=master_addr,
        master_port=master_port,
        source=source,
        restart_count=_restart_count(env),
    )


def from_torchrun_env(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Read torchrun's variables (also what ``spread run`` and ``ClusterSpec.to_env`` set).

    ``RANK`` and ``WORLD_SIZE`` are required; ``MASTER_ADDR`` and ``MASTER_PORT`` too when
    ``WORLD_SIZE > 1`` (else they default to ``127.0.0.1`` and ``0``). Missing layout variables are
    inferred assuming ranks are laid out node by node, as torchrun does: ``LOCAL_WORLD_SIZE``
    defaults to ``WORLD_SIZE / NNODES`` (``NNODES`` or ``GROUP_WORLD_SIZE``), or to ``WORLD_SIZE``
    (one node) when the node count is unknown; ``LOCAL_RANK`` to ``RANK % LOCAL_WORLD_SIZE`` (so
    hand-made single-node envs still give each process its own device); ``GROUP_RANK`` (or
    ``NODE_RANK``) to ``RANK // LOCAL_WORLD_SIZE``.
    """
    env = os.environ if env is None else env
    world = _int(env, "WORLD_SIZE", minimum=1)
    rank = _int(env, "RANK", below=(world, f"< WORLD_SIZE={world}"))
    nnodes_var = _first(env, "NNODES", "GROUP_WORLD_SIZE")
    nnodes = (
        _int(env, nnodes_var, minimum=1, below=(world + 1, f"<= WORLD_SIZE={world}")) if nnodes_var else None
    )
    if "LOCAL_WORLD_SIZE" in env:
        local_world = _int(env, "LOCAL_WORLD_SIZE", minimum=1, below=(world + 1, f"<= WORLD_SIZE={world}"))
    elif nnodes is not None and world % nnodes:
        problem = f"not set, and WORLD_SIZE={world} does not divide over {nnodes_var}={nnodes}"
        raise ClusterSpecError("LOCAL_WORLD_SIZE", "", problem)
    else:
        local_world = world // (nnodes or 1)
    local_rank = _int(
        env,
        "LOCAL_RANK",
        default=rank % local_world,
        below=(local_world, f"< LOCAL_WORLD_SIZE={local_world}"),
    )
    node_var = _first(env, "GROUP_RANK", "NODE_RANK") or "GROUP_RANK"
    nnodes = nnodes or max(-(-world // local_world), _int(env, node_var, default=0) + 1)
    node_rank = _int(
        env,
        node_var,
        default=rank // local_world,
        below=(nnodes, f"< {nnodes_var or 'the node count'}={nnodes}"),
    )
    addr = env.get("MASTER_ADDR", "").strip()
    if world > 1 and not addr:
        raise ClusterSpecError("MASTER_ADDR", "", f"not set; required when WORLD_SIZE={world} > 1")
    # Port 0 means "any free port": fine for a lone process, unreachable for its peers.
    port = _port(env, "MASTER_PORT", minimum=1) if world > 1 else _port(env, "MASTER_PORT", default=0)
    return _training_spec(
        env,
        "torchrun",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        nnodes=nnodes,
        master_addr=addr or "127.0.0.1",
        master_port=port,
    )


def from_tf_config(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Read TensorFlow's ``TF_CONFIG`` JSON: ``{"cluster": {...}, "task": {"type": ..., "index": ...}}``.

    The training group is the chief (if any) then the workers, in list order; the store lives at
    the chief's address, or worker 0's when there is no chief (worker 0 is then rank 0 and
    ``is_chief``). ``master`` is accepted as TF's old name for ``chief``. An ``evaluator`` task may
    be absent from ``cluster`` (TF runs it beside the cluster), but then its index must be 0.
    Training tasks with the same host string form a node; nodes are numbered by first appearance and
    ``local_rank`` is the position among that host's training tasks. ``ps`` and ``evaluator`` tasks
    get ``rank=-1``, ``local_rank=0`` of ``local_world_size=1`` and ``node_rank=0``. Unknown keys
    outside ``cluster`` (``environment``, ``rpc_layer``, ``task.trial``, ...) are ignored, as TF does.
    """
    env = os.environ if env is None else env
    config = _tf_json.load(env.get("TF_CONFIG", ""))
    cluster = _tf_json.parse_cluster(config)
    role, index = _tf_json.parse_task(config, cluster)
    chiefs, workers = cluster.get("chief", ()), cluster.get("worker", ())
    hosts = [_tf_json.split_address(a, "")[0] for a in (*chiefs, *workers)]
    nodes = list(dict.fromkeys(hosts))  # hosts in order of first appearance
    rank, local_rank, local_world, node_rank = -1, 0, 1, 0
    if role in ("chief", "worker"):
        rank = index if role == "chief" else len(chiefs) + index
        same_host = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        local_rank, local_world, node_rank = same_host.index(rank), len(same_host), nodes.index(hosts[rank])
    master_addr, master_port = _tf_json.split_address((*chiefs, *workers)[0], "")
    return ClusterSpec(
        role=role,
        task_index=index,
        rank=rank,
        world_size=len(hosts),
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        nnodes=len(nodes),
        master_addr=master_addr,
        master_port=master_port,
        cluster=cluster,
        source="tf_config",
        restart_count=_restart_count(env),
    )


def from_slurm_env(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Read the variables ``srun`` sets for each task (``SLURM_PROCID``, ``SLURM_NTASKS``, ...).

    ``SLURM_LOCALID``/``SLURM_NODEID`` default to a block layout (``rank % local_world_size``, 0).
    Tasks on this node come from ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE`` or
    ``SLURM_NTASKS_PER_NODE`` (``"4"``, ``"4(x2)"``, ``"2,1"``), else ``SLURM_NTASKS / SLURM_NNODES``.
    The store lives at ``MASTER_ADDR`` if set, else the first host of the step's (else the job's)
    nodelist, where srun places rank 0. Its port is ``MASTER_PORT`` if set, else
    ``10000 + SLURM_JOB_ID % 20000`` (so two jobs sharing a node rarely collide), else
    :data:`DEFAULT_SLURM_PORT`.
    """
    env = os.environ if env is None else env
    world = _int(env, "SLURM_NTASKS", minimum=1)
    rank = _int(env, "SLURM_PROCID", below=(world, f"< SLURM_NTASKS={world}"))
    list_var = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    hosts = expand_nodelist(env[list_var], list_var) if list_var else []
    nnodes = _int(env, "SLURM_NNODES", default=len(hosts) or 1, minimum=1)
    node_rank = _int(env, "SLURM_NODEID", default=0, below=(nnodes, f"< SLURM_NNODES={nnodes}"))
    per_node_var = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    if per_node_var:
        counts = _hostlist.tasks_per_node(env[per_node_var], per_node_var)
        if len(counts) > 1 and node_rank >= len(counts):
            raise ClusterSpecError(
                per_node_var, "", f"lists {len(counts)} node(s), but SLURM_NODEID={node_rank}"
            )
        local_world = counts[node_rank] if len(counts) > 1 else counts[0]
    elif world % nnodes:
        problem = f"not set, and SLURM_NTASKS={world} does not divide over SLURM_NNODES={nnodes}"
        raise ClusterSpecError("SLURM_NTASKS_PER_NODE", "", problem)
    else:
        local_world = world // nnodes
    local_rank = _int(
        env,
        "SLURM_LOCALID",
        default=rank % local_world,
        below=(local_world, f"< {local_world} (tasks on this node)"),
    )
    addr = env.get("MASTER_ADDR", "").strip() or (hosts[0] if hosts else "")
    if world > 1 and not addr:
        raise ClusterSpecError(
            "SLURM_JOB_NODELIST", "", "not set (nor MASTER_ADDR): cannot find rank 0's host"
        )
    if "MASTER_PORT" in env:
        port = _port(env, "MASTER_PORT", minimum=1)
    else:
        port = 10000 + _int(env, "SLURM_JOB_ID") % 20000 if "SLURM_JOB_ID" in env else DEFAULT_SLURM_PORT
    return _training_spec(
        env,
        "slurm",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        nnodes=nnodes,
        master_addr=addr or "127.0.0.1",
        master_port=port,
    )


def resolve_cluster(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """The :class:`ClusterSpec` for this process, from whichever launcher started it.

    Precedence, first match wins:

    1. ``TF_CONFIG`` set and non-blank -> :func:`from_tf_config`;
    2. ``RANK`` or ``WORLD_SIZE`` set -> :func:`from_torchrun_env` (one without the other is an
       error naming the missing one, not a silent single-process run);
    3. ``SLURM_PROCID`` and ``SLURM_NTASKS`` set, and either ``SLURM_NTASKS != 1`` or
       ``SLURM_STEP_ID`` set (inside an ``srun`` step) -> :func:`from_slurm_env`; a one-task
       allocation outside a step is treated as a plain single process;
    4. otherwise a single process: chief, rank 0 of 1, store on ``127.0.0.1`` port 0 (any free port).

    torchrun beats SLURM so that ``srun torchrun ...`` uses torchrun's per-process ranks. Caveat: a
    batch script of a multi-task allocation, run outside ``srun``, looks like SLURM rank 0 and will
    wait for peers that never come; start training with ``srun``.
    """
    env = os.environ if env is None else env
    if env.get("TF_CONFIG", "").strip():
        return from_tf_config(env)
    if "RANK" in env or "WORLD_SIZE" in env:
        return from_torchrun_env(env)
    slurm = "SLURM_PROCID" in env and "SLURM_NTASKS" in env
    if slurm and (env["SLURM_NTASKS"].strip() != "1" or "SLURM_STEP_ID" in env):
        return from_slurm_env(env)
    return ClusterSpec(
        role="chief",
        task_index=0,
        rank=0,
        world_size=1,
        source="single",
        restart_count=_restart_count(env),
    )
