"""Processes started without a launcher (TF_CONFIG, srun) share the host's cores instead of each
taking all of them (issue 39: two TF_CONFIG processes on 2 cores ran 0.8-3.4 s per step, 4-23 ms
under spread run)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from spread.cluster import ClusterSpec
from spread.cluster import threads as threads_module
from spread.cluster.threads import share_cores


def _spec(local_world_size: int, local_rank: int = 0) -> ClusterSpec:
    return ClusterSpec(
        role="worker",
        task_index=local_rank,
        rank=local_rank,
        world_size=local_world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_port=29500,
        source="tf_config",
    )


@pytest.fixture
def machine(monkeypatch):
    """8 cores, torch's default of 8 threads, no OMP_NUM_THREADS; records what is set."""
    chosen: list[int] = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads_module, "_cores", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    return chosen


def test_several_processes_on_a_host_get_their_share_and_one_warning(machine, caplog):
    assert share_cores(_spec(3)) == 2 and machine == [2]
    assert "3 training processes share this host's 8 cores and OMP_NUM_THREADS is not set" in caplog.text
    caplog.clear()
    assert share_cores(_spec(3, local_rank=1)) == 2 and not caplog.text  # the host's first process warns


def test_a_lone_process_or_a_chosen_thread_count_is_left_alone(machine, monkeypatch):
    assert share_cores(_spec(1)) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert share_cores(_spec(4)) is None
    assert machine == []


_SCRIPT = textwrap.dedent(
    """
    import os, torch, spread
    before = torch.get_num_threads()
    strategy = spread.MultiWorkerMirroredStrategy()
    print(before, torch.get_num_threads(), len(os.sched_getaffinity(0)), flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.processes
def test_two_tf_config_processes_on_one_host_share_its_cores(tmp_path):
    cluster = {"worker": [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]}
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    configs = [json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}) for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT],
            env={**base, "TF_CONFIG": config},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for config in configs
    ]
    outputs = []
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    warned = 0
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
        before, after, cores = map(int, out.split())
        assert after == min(before, max(1, cores // 2)), out + err
        warned += "OMP_NUM_THREADS is not set" in err
    assert warned == (1 if after < before else 0)
