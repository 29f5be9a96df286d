"""Resolvers: each launcher dialect, good and malformed, their precedence, and the ``to_env`` round trip."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from spread.cluster import (
    ClusterSpec,
    expand_nodelist,
    from_slurm_env,
    from_tf_config,
    from_torchrun_env,
    resolve_cluster,
)
from spread.cluster._hostlist import tasks_per_node
from spread.errors import ClusterSpecError

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_ID": "123456",
}
TF_CLUSTER = {"chief": ["h0:2222"], "worker": ["h0:2223", "h1:2222", "h1:2223"], "ps": ["p0:2222"]}


def _tf(config: object, **extra: str) -> dict[str, str]:
    return {"TF_CONFIG": config if isinstance(config, str) else json.dumps(config), **extra}


def _tf_task(kind: str, index: int, cluster: dict[str, list[str]] | None = None) -> dict[str, str]:
    return _tf({"cluster": cluster or TF_CLUSTER, "task": {"type": kind, "index": index}})


def _assert_error(
    env: Any, resolver: Callable[[Any], object], variable: str, field: str, fragment: str
) -> None:
    with pytest.raises(ClusterSpecError) as info:
        resolver(env)
    error = info.value
    assert (error.variable, error.field) == (variable, field)
    assert fragment in error.problem, error.problem
    where = variable if not field else f"{variable}: field {field!r}"
    assert str(error) == f"malformed cluster spec in {where}: {error.problem}"


# --- torchrun ---------------------------------------------------------------------------------------


def test_torchrun_full_env() -> None:
    spec = from_torchrun_env({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert spec == ClusterSpec(
        role="worker",
        task_index=2,
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        node_rank=1,
        nnodes=2,
        master_addr="10.0.0.1",
        master_port=29500,
        source="torchrun",
        restart_count=2,
    )
    assert spec.cluster == {} and spec.num_workers == 4


def test_torchrun_rank_zero_is_the_chief() -> None:
    spec = from_torchrun_env({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    assert (spec.role, spec.task_index, spec.is_chief) == ("chief", 0, True)


def test_torchrun_minimal_env_assumes_one_node() -> None:
    spec = from_torchrun_env({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (spec.local_rank, spec.local_world_size, spec.node_rank, spec.nnodes) == (2, 3, 0, 1)


@pytest.mark.parametrize("nodes_var", ["NNODES", "GROUP_WORLD_SIZE"])
def test_torchrun_infers_layout_from_node_count(nodes_var: str) -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", nodes_var: "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    spec = from_torchrun_env(env)
    assert (spec.local_rank, spec.local_world_size, spec.node_rank, spec.nnodes) == (1, 4, 1, 2)


def test_torchrun_accepts_node_rank_alias_and_spread_restart_count_wins() -> None:
    env = {**TORCHRUN, "SPREAD_RESTART_COUNT": "4", "TORCHELASTIC_RESTART_COUNT": "1"}
    del env["GROUP_RANK"]
    spec = from_torchrun_env({**env, "NODE_RANK": "1"})
    assert spec.node_rank == 1 and spec.restart_count == 4


def test_torchrun_single_process_needs_no_master() -> None:
    spec = from_torchrun_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert (spec.master_addr, spec.master_port, spec.is_distributed) == ("127.0.0.1", 0, False)


@pytest.mark.parametrize(
    ("change", "variable", "fragment"),
    [
        ({"RANK": "abc"}, "RANK", "expected a non-negative integer, got 'abc'"),
        ({"RANK": "-1"}, "RANK", "got '-1'"),
        ({"RANK": "4"}, "RANK", "< WORLD_SIZE=4"),
        ({"RANK": None}, "RANK", "not set"),
        ({"WORLD_SIZE": None}, "WORLD_SIZE", "not set"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE", "integer >= 1"),
        ({"WORLD_SIZE": "2.5"}, "WORLD_SIZE", "'2.5'"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR", "required when WORLD_SIZE=4"),
        ({"MASTER_ADDR": "  "}, "MASTER_ADDR", "not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT", "not set"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT", "'http'"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT", "1..65535"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT", "integer >= 1"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK", "< LOCAL_WORLD_SIZE=2"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK", "'x'"),
        ({"LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE", "<= WORLD_SIZE=4"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE", "integer >= 1"),
        ({"LOCAL_WORLD_SIZE": None, "NNODES": "3"}, "LOCAL_WORLD_SIZE", "does not divide over NNODES=3"),
        ({"GROUP_RANK": "2", "NNODES": "2"}, "GROUP_RANK", "< NNODES=2"),
        ({"GROUP_RANK": "one"}, "GROUP_RANK", "'one'"),
        ({"NNODES": "0"}, "NNODES", "integer >= 1"),
        ({"GROUP_WORLD_SIZE": "9"}, "GROUP_WORLD_SIZE", "<= WORLD_SIZE=4"),
        ({"SPREAD_RESTART_COUNT": "-2"}, "SPREAD_RESTART_COUNT", "'-2'"),
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT", "'x'"),
    ],
)
def test_torchrun_malformed(change: dict[str, str | None], variable: str, fragment: str) -> None:
    env = {**TORCHRUN, **change}
    env = {k: v for k, v in env.items() if v is not None}
    _assert_error(env, from_torchrun_env, variable, "", fragment)


# --- round trip -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        from_torchrun_env(TORCHRUN),
        from_torchrun_env({"RANK": "0", "WORLD_SIZE": "1"}),
        from_torchrun_env({**TORCHRUN, "SPREAD_RESTART_COUNT": "3"}),
        ClusterSpec(
            role="worker",
            task_index=6,
            rank=7,
            world_size=12,
            local_rank=3,
            local_world_size=4,
            node_rank=1,
            nnodes=3,
            master_addr="::1",
            master_port=65535,
            source="torchrun",
        ),
    ],
    ids=["worker", "single", "restarted", "ipv6"],
)
def test_to_env_round_trips_through_torchrun(spec: ClusterSpec) -> None:
    assert from_torchrun_env(spec.to_env()) == spec


def test_tf_config_and_slurm_specs_round_trip_to_their_torchrun_twin() -> None:
    tf_spec = from_tf_config(_tf_task("worker", 2))
    assert from_torchrun_env(tf_spec.to_env()) == dataclasses.replace(tf_spec, source="torchrun", cluster={})
    slurm_spec = from_slurm_env(SLURM)
    assert from_torchrun_env(slurm_spec.to_env()) == dataclasses.replace(slurm_spec, source="torchrun")


# --- TF_CONFIG --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "index", "expected"),
    [
        # role, rank, local_rank, local_world_size, node_rank
        ("chief", 0, ("chief", 0, 0, 2, 0)),
        ("worker", 0, ("worker", 1, 1, 2, 0)),
        ("worker", 1, ("worker", 2, 0, 2, 1)),
        ("worker", 2, ("worker", 3, 1, 2, 1)),
        ("ps", 0, ("ps", -1, 0, 1, 0)),
        ("master", 0, ("chief", 0, 0, 2, 0)),
    ],
)
def test_tf_config_layout(kind: str, index: int, expected: tuple[object, ...]) -> None:
    spec = from_tf_config(_tf_task(kind, index))
    assert (spec.role, spec.rank, spec.local_rank, spec.local_world_size, spec.node_rank) == expected
    assert (spec.world_size, spec.nnodes, spec.master_addr, spec.master_port) == (4, 2, "h0", 2222)
    assert (spec.num_workers, spec.num_ps, spec.source) == (4, 1, "tf_config")
    assert spec.task_address == TF_CLUSTER[spec.role][index]
    assert spec.cluster == {role: tuple(tasks) for role, tasks in TF_CLUSTER.items()}


def test_tf_config_without_chief_makes_worker_zero_rank_zero() -> None:
    cluster = {"worker": ["w0:1", "w1:1"], "ps": ["p:1"]}
    first, second = (from_tf_config(_tf_task("worker", i, cluster)) for i in (0, 1))
    assert (first.rank, first.is_chief, first.role) == (0, True, "worker")
    assert (second.rank, second.is_chief, second.nnodes, second.node_rank) == (1, False, 2, 1)
    assert (first.master_addr, first.master_port) == ("w0", 1)


def test_tf_config_accepts_master_alias_in_cluster() -> None:
    spec = from_tf_config(_tf_task("chief", 0, {"master": ["m:5"], "worker": ["w:5"]}))
    assert spec.cluster == {"chief": ("m:5",), "worker": ("w:5",)} and spec.master_addr == "m"


def test_tf_config_evaluator_inside_and_outside_the_cluster() -> None:
    outside = from_tf_config(_tf_task("evaluator", 0))
    assert (outside.role, outside.rank, outside.task_address, outside.world_size) == (
        "evaluator",
        -1,
        None,
        4,
    )
    inside = from_tf_config(_tf_task("evaluator", 0, {**TF_CLUSTER, "evaluator": ["e:1"]}))
    assert inside.task_address == "e:1" and not inside.is_chief


def test_tf_config_ipv6_defaults_and_ignored_keys() -> None:
    config = {
        "cluster": {"chief": ["[::1]:2222"], "worker": ["[::1]:2223"]},
        "task": {"type": "worker", "trial": "7"},
        "environment": "cloud",
        "rpc_layer": "grpc",
    }
    spec = from_tf_config(_tf({**config}, SPREAD_RESTART_COUNT="1"))
    assert (spec.task_index, spec.rank, spec.local_rank, spec.local_world_size) == (0, 1, 1, 2)
    assert (spec.master_addr, spec.master_port, spec.restart_count) == ("::1", 2222, 1)


_TASK = {"type": "worker", "index": 0}


@pytest.mark.parametrize(
    ("config", "field", "fragment"),
    [
        ("", "", "not set"),
        ('{"cluster": ', "", "invalid JSON at line 1 column 13"),
        ("[1, 2]", "", "JSON object, got list"),
        ({"task": _TASK}, "cluster", "expected an object"),
        ({"cluster": {}, "task": _TASK}, "cluster", "expected an object"),
        ({"cluster": {"workers": ["a:1"]}, "task": _TASK}, "cluster.workers", "unknown role"),
        ({"cluster": {"worker": "a:1"}, "task": _TASK}, "cluster.worker", "list of 'host:port'"),
        ({"cluster": {"worker": ["a:1", "b"]}, "task": _TASK}, "cluster.worker[1]", "got 'b'"),
        ({"cluster": {"worker": ["a:99999"]}, "task": _TASK}, "cluster.worker[0]", "1..65535"),
        ({"cluster": {"worker": [":80"]}, "task": _TASK}, "cluster.worker[0]", "'host:port'"),
        ({"cluster": {"worker": ["::1:80"]}, "task": _TASK}, "cluster.worker[0]", "brackets"),
        ({"cluster": {"worker": [7]}, "task": _TASK}, "cluster.worker[0]", "got 7"),
        (
            {"cluster": {"worker": ["a:1", "a:1"]}, "task": _TASK},
            "cluster.worker[1]",
            "also cluster.worker[0]",
        ),
        ({"cluster": {"chief": ["a:1"], "master": ["b:1"]}, "task": _TASK}, "cluster.master", "same role"),
        ({"cluster": {"chief": ["a:1", "b:1"]}, "task": _TASK}, "cluster.chief", "at most one chief"),
        (
            {"cluster": {"worker": ["a:1"], "evaluator": ["e:1", "e:2"]}, "task": _TASK},
            "cluster.evaluator",
            "one",
        ),
        ({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}}, "cluster", "no chief or worker"),
        ({"cluster": {"worker": ["a:1"]}}, "task", "expected an object"),
        ({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}, "task.type", "got None"),
        ({"cluster": {"worker": ["a:1"]}, "task": {"type": "boss"}}, "task.type", "got 'boss'"),
        ({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps"}}, "task.type", "no tasks in cluster"),
        (
            {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}},
            "task.index",
            "out of range",
        ),
        ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}, "task.index", "got -1"),
        ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}, "task.index", "got '0'"),
        ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": True}}, "task.index", "True"),
        ({"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": 1}}, "task.index", "task 0"),
    ],
)
def test_tf_config_malformed(config: object, field: str, fragment: str) -> None:
    _assert_error(_tf(config), from_tf_config, "TF_CONFIG", field, fragment)


def test_tf_config_bad_restart_count_names_its_variable() -> None:
    _assert_error(
        _tf(_tf_task("worker", 0)["TF_CONFIG"], SPREAD_RESTART_COUNT="x"),
        from_tf_config,
        "SPREAD_RESTART_COUNT",
        "",
        "'x'",
    )


# --- SLURM ------------------------------------------------------------------------------------------


def test_slurm_full_env() -> None:
    spec = from_slurm_env(SLURM)
    assert (spec.role, spec.task_index, spec.rank, spec.world_size) == ("worker", 4, 5, 8)
    assert (spec.local_rank, spec.local_world_size, spec.node_rank, spec.nnodes) == (1, 4, 1, 2)
    # The port is derived from the job id so that jobs sharing a node pick different ports.
    assert (spec.master_addr, spec.master_port, spec.source) == ("gpu07", 10000 + 123456 % 20000, "slurm")


def test_slurm_uneven_tasks_per_node_and_master_overrides() -> None:
    env = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "3",
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODELIST": "a1,b[2-3]",
        "SLURM_TASKS_PER_NODE": "2,1",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "4000",
    }
    spec = from_slurm_env(env)
    assert (spec.local_world_size, spec.nnodes, spec.master_addr, spec.master_port) == (1, 3, "head", 4000)


def test_slurm_defaults_without_optional_variables() -> None:
    spec = from_slurm_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"})
    # nnodes from the nodelist, block layout, default port without a job id.
    assert (spec.nnodes, spec.local_world_size, spec.local_rank, spec.node_rank) == (2, 2, 1, 0)
    assert (spec.master_addr, spec.master_port) == ("n1", 29500)


def test_slurm_step_variables_beat_job_variables() -> None:
    env = {**SLURM, "SLURM_STEP_NODELIST": "gpu08", "SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_NNODES": "1"}
    spec = from_slurm_env({**env, "SLURM_NODEID": "0", "SLURM_LOCALID": "5"})
    assert (spec.master_addr, spec.local_world_size, spec.nnodes) == ("gpu08", 8, 1)


def test_slurm_ntasks_per_node_applies_to_every_node() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    assert from_slurm_env({**env, "SLURM_NTASKS_PER_NODE": "4"}).local_world_size == 4


@pytest.mark.parametrize(
    ("change", "variable", "fragment"),
    [
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID", "'x'"),
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID", "< SLURM_NTASKS=8"),
        ({"SLURM_PROCID": None}, "SLURM_PROCID", "not set"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS", "integer >= 1"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID", "< SLURM_NNODES=2"),
        ({"SLURM_NNODES": "two"}, "SLURM_NNODES", "'two'"),
        ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID", "tasks on this node"),
        ({"SLURM_TASKS_PER_NODE": "4(x)"}, "SLURM_TASKS_PER_NODE", "'4(x)'"),
        ({"SLURM_TASKS_PER_NODE": "0"}, "SLURM_TASKS_PER_NODE", "counts like"),
        (
            {"SLURM_TASKS_PER_NODE": "4,4", "SLURM_NNODES": "3", "SLURM_NODEID": "2"},
            "SLURM_TASKS_PER_NODE",
            "2 node",
        ),
        (
            {"SLURM_TASKS_PER_NODE": None, "SLURM_NTASKS": "7", "SLURM_PROCID": "1"},
            "SLURM_NTASKS_PER_NODE",
            "divide",
        ),
        ({"SLURM_JOB_NODELIST": "gpu[07-"}, "SLURM_JOB_NODELIST", "unclosed"),
        ({"SLURM_JOB_NODELIST": "gpu[08-07]"}, "SLURM_JOB_NODELIST", "bad range"),
        ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST", "cannot find rank 0's host"),
        ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID", "'abc'"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT", "1..65535"),
    ],
)
def test_slurm_malformed(change: dict[str, str | None], variable: str, fragment: str) -> None:
    env = {k: v for k, v in {**SLURM, **change}.items() if v is not None}
    _assert_error(env, from_slurm_env, variable, "", fragment)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("gpu[1-2]-ib, cpu5", ["gpu1-ib", "gpu2-ib", "cpu5"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "fragment"),
    [
        ("", "malformed host"),
        ("a,,b", "malformed host"),
        ("n[1-2", "unclosed"),
        ("n1-2]", "unbalanced"),
        ("n[[1]]", "nested"),
        ("n[]", "bad range"),
        ("n[a-b]", "bad range"),
        ("n[5-1]", "bad range"),
        ("n[0-999999]", "more than"),
    ],
)
def test_expand_nodelist_malformed(nodelist: str, fragment: str) -> None:
    _assert_error(
        nodelist, lambda text: expand_nodelist(text, "SLURM_NODELIST"), "SLURM_NODELIST", "", fragment
    )


@pytest.mark.parametrize(
    ("text", "counts"), [("4", [4]), ("4(x2)", [4, 4]), ("2,1", [2, 1]), ("2(x3),1", [2, 2, 2, 1])]
)
def test_tasks_per_node(text: str, counts: list[int]) -> None:
    assert tasks_per_node(text, "SLURM_TASKS_PER_NODE") == counts


# --- precedence -------------------------------------------------------------------------------------


def test_tf_config_beats_torchrun_and_slurm() -> None:
    env = {**SLURM, **TORCHRUN, **_tf_task("ps", 0)}
    assert resolve_cluster(env).source == "tf_config"


def test_blank_tf_config_is_ignored() -> None:
    assert resolve_cluster({**TORCHRUN, "TF_CONFIG": "  "}).source == "torchrun"


def test_torchrun_beats_slurm() -> None:
    # `srun torchrun ...`: torchrun's per-process ranks win over srun's per-node task.
    assert resolve_cluster({**SLURM, **TORCHRUN}).rank == 3


def test_half_a_torchrun_env_is_an_error_not_a_single_process() -> None:
    _assert_error({"WORLD_SIZE": "2"}, resolve_cluster, "RANK", "", "not set")


def test_slurm_multi_task_or_inside_a_step() -> None:
    assert resolve_cluster(SLURM).source == "slurm"
    one_task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}
    assert resolve_cluster(one_task).source == "single"
    assert resolve_cluster({**one_task, "SLURM_STEP_ID": "0"}).source == "slurm"


def test_malformed_slurm_ntasks_reaches_the_slurm_resolver() -> None:
    _assert_error(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "many"}, resolve_cluster, "SLURM_NTASKS", "", "'many'"
    )


def test_no_launcher_means_a_single_process() -> None:
    spec = resolve_cluster({"SPREAD_RESTART_COUNT": "2", "PATH": "/bin"})
    assert spec == ClusterSpec(role="chief", task_index=0, rank=0, world_size=1, restart_count=2)
    assert spec.source == "single" and spec.is_chief and not spec.is_distributed


def test_resolve_cluster_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher_vars = {"TF_CONFIG", "NNODES", "GROUP_WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RESTART_COUNT"}
    for name in list(os.environ):
        if name in launcher_vars or name.startswith(("SLURM_", "SPREAD_")):
            monkeypatch.delenv(name)
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert resolve_cluster() == from_torchrun_env(TORCHRUN) == from_torchrun_env()
