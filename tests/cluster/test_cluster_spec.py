"""``ClusterSpec`` as a value: validation by field name, derived properties, immutability, ``to_env``."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from spread.cluster import ROLES, ClusterSpec, FrozenCluster
from spread.errors import ClusterSpecError

TF_CLUSTER = {"chief": ("h0:1",), "worker": ("h0:2", "h1:1"), "ps": ("p:1", "p:2")}


def _spec(**overrides: object) -> ClusterSpec:
    fields: dict[str, object] = dict(
        role="worker",
        task_index=1,
        rank=2,
        world_size=4,
        local_rank=0,
        local_world_size=2,
        node_rank=1,
        nnodes=2,
        master_addr="10.0.0.1",
        master_port=29500,
        source="torchrun",
    )
    fields.update(overrides)
    return ClusterSpec(**fields)  # type: ignore[arg-type]


def test_roles_are_the_tf_vocabulary() -> None:
    assert ROLES == ("chief", "worker", "ps", "evaluator")


def test_minimal_spec_is_a_single_process() -> None:
    spec = ClusterSpec(role="chief", task_index=0, rank=0, world_size=1)
    assert (spec.local_rank, spec.local_world_size, spec.node_rank, spec.nnodes) == (0, 1, 0, 1)
    assert (spec.master_addr, spec.master_port, spec.source) == ("127.0.0.1", 0, "single")
    assert spec.is_chief and not spec.is_distributed
    assert spec.cluster == {} and spec.num_ps == 0 and spec.num_workers == 1
    assert spec.restart_count == 0 and spec.task_address is None


def test_properties_of_a_worker() -> None:
    spec = _spec()
    assert not spec.is_chief and spec.is_distributed and spec.in_training_group
    assert spec.num_workers == 4 and spec.num_ps == 0


def test_worker_zero_is_chief_when_there_is_no_chief_task() -> None:
    spec = _spec(task_index=0, rank=0, node_rank=0)
    assert spec.role == "worker" and spec.is_chief


def test_cluster_list_drives_counts_and_address() -> None:
    spec = _spec(role="ps", task_index=1, rank=-1, world_size=3, cluster=TF_CLUSTER, source="tf_config")
    assert spec.num_ps == 2 and spec.num_workers == 3
    assert spec.task_address == "p:2" and not spec.in_training_group and not spec.is_chief


def test_evaluator_may_sit_outside_the_cluster_list() -> None:
    spec = _spec(role="evaluator", task_index=0, rank=-1, world_size=3, cluster=TF_CLUSTER)
    assert spec.task_address is None


def test_spec_is_frozen_hashable_picklable_and_its_cluster_read_only() -> None:
    spec = _spec(world_size=3, rank=2, cluster=TF_CLUSTER, source="tf_config")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rank = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.cluster["worker"] = ()  # type: ignore[index]
    assert isinstance(spec.cluster, FrozenCluster)
    assert spec.cluster == TF_CLUSTER and list(spec.cluster) == ["chief", "worker", "ps"]
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(spec) == spec
    twin = _spec(
        world_size=3, rank=2, cluster={k: list(v) for k, v in TF_CLUSTER.items()}, source="tf_config"
    )
    assert twin == spec and hash(twin) == hash(spec) and len({spec, twin}) == 1


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        ({"role": "boss"}, "role", "'boss'"),
        ({"role": "master"}, "role", "expected one of"),
        ({"source": "mpi"}, "source", "'mpi'"),
        ({"task_index": -1}, "task_index", ">= 0"),
        ({"world_size": 0}, "world_size", ">= 1"),
        ({"rank": 4}, "rank", "world_size=4"),
        ({"rank": -1}, "rank", "rank < world_size"),
        ({"rank": True}, "rank", "expected an integer"),
        ({"rank": "2"}, "rank", "expected an integer"),
        ({"role": "ps", "rank": 0}, "rank", "must be -1"),
        ({"role": "chief", "task_index": 0, "rank": 1}, "rank", "the chief is rank 0"),
        ({"role": "chief", "task_index": 1, "rank": 0}, "rank", "task 1"),
        ({"local_rank": 2}, "local_rank", "local_world_size=2"),
        ({"local_world_size": 0, "local_rank": 0}, "local_world_size", ">= 1"),
        ({"node_rank": 2}, "node_rank", "nnodes=2"),
        ({"nnodes": 0}, "nnodes", ">= 1"),
        ({"master_addr": ""}, "master_addr", "non-empty"),
        ({"master_port": 65536}, "master_port", "0..65535"),
        ({"master_port": -1}, "master_port", ">= 0"),
        ({"restart_count": -1}, "restart_count", ">= 0"),
        ({"cluster": {"boss": ("a:1",)}}, "cluster", "unknown role"),
        ({"cluster": {"worker": "a:1"}}, "cluster", "'host:port' strings"),
        ({"cluster": [("worker", ("a:1",))]}, "cluster", "mapping"),
        ({"cluster": {"chief": ("a:1",), "worker": ("a:2",)}}, "cluster", "world_size is 4"),
        (
            {"cluster": {"worker": ("a:1", "a:2", "a:3", "a:4")}, "task_index": 4, "rank": 3},
            "task_index",
            "not in",
        ),
    ],
)
def test_invalid_fields_are_named(overrides: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        _spec(**overrides)
    assert info.value.variable == field
    assert fragment in info.value.problem
    assert str(info.value).startswith(f"malformed cluster spec in {field}")


def test_cluster_spec_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="rank"):
        _spec(rank=9)


def test_to_env_gives_torchrun_variables() -> None:
    env = _spec(local_rank=1, restart_count=2).to_env()
    assert env == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NNODES": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "SPREAD_RESTART_COUNT": "2",
    }
    assert all(isinstance(v, str) for v in env.values())


@pytest.mark.parametrize("role", ["ps", "evaluator"])
def test_to_env_refuses_tasks_outside_the_training_group(role: str) -> None:
    spec = _spec(role=role, task_index=0, rank=-1, world_size=3, cluster=TF_CLUSTER)
    with pytest.raises(ClusterSpecError) as info:
        spec.to_env()
    assert info.value.variable == "role" and role in info.value.problem
