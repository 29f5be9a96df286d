"""Schema checks for TensorFlow's ``TF_CONFIG`` JSON, kept apart so the resolver reads as a recipe.

Every problem is a :class:`ClusterSpecError` with ``variable="TF_CONFIG"`` and ``field`` a path into
the JSON (``"cluster.worker[1]"``, ``"task.index"``), so a user can find the wrong character.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from spread.cluster.spec import ROLES
from spread.errors import ClusterSpecError


def tf_error(field: str, problem: str) -> ClusterSpecError:
    """An error in ``TF_CONFIG`` at ``field``, a path such as ``"cluster.worker[1]"``."""
    return ClusterSpecError("TF_CONFIG", field, problem)


def split_address(address: object, field: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host without brackets, port)."""
    if not isinstance(address, str):
        raise tf_error(field, f"expected a 'host:port' string, got {address!r}")
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise tf_error(field, f"IPv6 hosts need brackets, as in '[::1]:2222'; got {address!r}")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise tf_error(field, f"expected 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port)


def parse_cluster(config: Mapping[str, object]) -> dict[str, tuple[str, ...]]:
    """The validated ``cluster`` section, role -> addresses, with ``master`` renamed ``chief``."""
    raw = config.get("cluster")
    if not isinstance(raw, dict) or not raw:
        raise tf_error("cluster", f"expected an object of role -> address list, got {raw!r}")
    cluster: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for key, tasks in raw.items():
        role, where = ("chief" if key == "master" else key), f"cluster.{key}"
        if role not in ROLES:
            raise tf_error(where, f"unknown role; expected one of {ROLES} ('master' = 'chief')")
        if role in cluster:
            raise tf_error(where, "'chief' and 'master' name the same role; give one")
        if not isinstance(tasks, list):
            raise tf_error(where, f"expected a list of 'host:port' strings, got {tasks!r}")
        if role in ("chief", "evaluator") and len(tasks) > 1:
            raise tf_error(where, f"at most one {role} task, got {len(tasks)}")
        for i, address in enumerate(tasks):
            split_address(address, f"{where}[{i}]")
            if address in seen:
                raise tf_error(f"{where}[{i}]", f"{address!r} is also {seen[address]}")
            seen[address] = f"{where}[{i}]"
        cluster[role] = tuple(tasks)
    if not cluster.get("chief") and not cluster.get("worker"):
        raise tf_error("cluster", "no chief or worker tasks: nobody would train")
    return cluster


def parse_task(config: Mapping[str, object], cluster: Mapping[str, tuple[str, ...]]) -> tuple[str, int]:
    """The validated ``task`` section as (role, index)."""
    task = config.get("task")
    if not isinstance(task, dict):
        raise tf_error("task", f"expected an object like {{'type': 'worker', 'index': 0}}, got {task!r}")
    kind = task.get("type")
    role = "chief" if kind == "master" else kind
    if role not in ROLES:
        raise tf_error("task.type", f"expected one of {ROLES}, got {kind!r}")
    index = task.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise tf_error("task.index", f"expected a non-negative integer, got {index!r}")
    if role not in cluster and role != "evaluator":
        raise tf_error("task.type", f"{kind!r} has no tasks in cluster (roles there: {', '.join(cluster)})")
    if role not in cluster and index != 0:
        raise tf_error("task.index", f"an evaluator outside the cluster is task 0, got {index}")
    if role in cluster and index >= len(cluster[role]):
        raise tf_error(
            "task.index", f"{index} is out of range: cluster has {len(cluster[role])} {kind} task(s)"
        )
    return role, index


def load(raw: str) -> dict[str, object]:
    """The decoded JSON object; invalid JSON names its line and column."""
    if not raw.strip():
        raise tf_error("", "not set")
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise tf_error("", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(config, dict):
        raise tf_error("", f"expected a JSON object, got {type(config).__name__}")
    return config
