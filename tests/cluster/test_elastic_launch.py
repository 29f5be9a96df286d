"""Several machines numbered by torch's elastic rendezvous (issue 36 item 1): ``spread run --nnodes
MIN:MAX --rdzv-endpoint HOST:PORT`` on each "machine" (separate invocations here), no ``--node-rank``,
no secret copied by hand; a machine that joins later starts a new round; a lost one is survived
with ``--max-restarts``; torchrun's ``PET_*`` variables are honoured."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from spread.testing.ps_jobs import free_ports

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

# Trains a few steps of MultiWorkerMirrored (so spread's job-token handshake runs across machines)
# and says where it ran: ``sys.argv[1]`` seconds of steps (0.5 s each) alone, 3 s with others (or
# $TOGETHER_SECONDS).
_SCRIPT = """
import os, sys, time
import torch
import spread

strategy = spread.MultiWorkerMirroredStrategy()
total = strategy.reduce("sum", torch.tensor([float(strategy.rank + 1)]))
print(f"rank {strategy.rank} of {strategy.num_replicas_in_sync} node {os.environ['GROUP_RANK']} "
      f"sum {total.item():g} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
together = float(os.environ.get("TOGETHER_SECONDS", "3"))
seconds = float(sys.argv[1]) if strategy.num_replicas_in_sync == 1 else together  # alike on every rank
for _ in range(int(seconds / 0.5)):
    strategy.reduce("sum", torch.ones(1))
    time.sleep(0.5)
print(f"done rank {strategy.rank} of {strategy.num_replicas_in_sync}", flush=True)
"""


@pytest.fixture
def job(tmp_path: Path) -> dict:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "SPREAD_JOB_TOKEN" and not k.startswith("PET_")}
    env["HOME"] = str(tmp_path / "home")  # the user's secret is made there on first use, shared by all
    return {"script": str(script), "env": env, "port": free_ports(1)[0]}


def _node(job: dict, *flags: str, seconds: float = 0, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "spread.cli.main", "run", *flags, job["script"], str(seconds)]
    return subprocess.Popen(
        command, env=env or job["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _elastic(
    job: dict,
    nproc: int,
    nnodes: str,
    *more: str,
    conf: str = "",
    seconds: float = 0,
    env: dict | None = None,
) -> subprocess.Popen:
    endpoint = f"127.0.0.1:{job['port']}"
    flags = ["-n", str(nproc), "--nnodes", nnodes, "--rdzv-endpoint", endpoint, "--rdzv-id", "job-1"]
    conf = f"last_call_timeout=1,join_timeout=120,{conf}"
    return _node(job, *flags, "--rdzv-conf", conf, *more, seconds=seconds, env=env)


def _finish(*nodes: subprocess.Popen) -> list[tuple[int, str]]:
    return [(node.wait(timeout=200), node.stdout.read()) for node in nodes]  # type: ignore[union-attr]


def test_machines_numbered_by_the_rendezvous_train_together(job: dict) -> None:
    """Two "machines" of 2 and 1 processes: numbered 0 and 1 by the rendezvous, global ranks 0-2,
    one job token derived on each from the user's secret (made by whichever came first)."""
    first, second = _elastic(job, 2, "2"), _elastic(job, 1, "2")
    (code0, out0), (code1, out1) = _finish(first, second)
    assert (code0, code1) == (0, 0), out0 + out1
    lines = sorted(re.findall(r"rank (\d) of 3 node (\d) sum 6 attempt 0", out0 + out1))
    nodes = {rank: node for rank, node in lines}
    assert sorted(nodes) == ["0", "1", "2"], out0 + out1
    assert sorted(Counter(nodes.values()).values()) == [1, 2]  # 2 ranks on one machine, 1 on the other
    two = "".join(out0.splitlines(keepends=True)[1:])  # the 2-process machine's ranks are consecutive
    assert sorted(re.findall(r"\] rank (\d) of 3", two)) in (["0", "1"], ["1", "2"]), two
    assert "this machine is node" in out0 and "this machine is node" in out1
    assert (Path(job["env"]["HOME"]) / ".config" / "spread" / "secret").stat().st_mode & 0o077 == 0


def test_a_machine_that_joins_later_starts_a_new_round_at_the_larger_size(job: dict) -> None:
    first = _elastic(job, 1, "1:2", seconds=30)
    assert first.stdout is not None
    for line in first.stdout:  # until the first round runs alone
        if "rank 0 of 1 node 0 sum 1 attempt 0" in line:
            break
    second = _elastic(job, 1, "1:2")
    (code0, out0), (code1, out1) = _finish(first, second)
    assert (code0, code1) == (0, 0), out0 + out1
    assert "machines wait to join the job: stopped 1 process(es) for a new round" in out0
    assert re.search(r"rank 0 of 2 node 0 sum 3 attempt 1", out0), out0
    assert re.search(r"rank 1 of 2 node 1 sum 3 attempt 1", out1), out1
    assert "done rank 0 of 2" in out0 and "done rank 1 of 2" in out1


def test_a_lost_machine_is_survived_at_the_smaller_size_with_max_restarts(job: dict) -> None:
    # The machine at the endpoint hosts the rendezvous (as under torchrun): the survivor here.
    # Together they train until one is killed: on a loaded machine 3 s could pass before the kill, and
    # the job would end without a loss to survive.
    together = dict(job["env"], TOGETHER_SECONDS="120")
    first = _elastic(job, 1, "1:2", "--max-restarts", "1", conf="is_host=1", seconds=4, env=together)
    second = _elastic(job, 1, "1:2", conf="is_host=0", env=together)
    assert second.stdout is not None
    for line in second.stdout:  # both in the round of two
        if "of 2 node" in line:
            break
    second.kill()  # the machine is gone: its launcher, and with it (PDEATHSIG) its ranks
    second.wait(timeout=30)
    ((code0, out0),) = _finish(first)
    assert code0 == 0, out0
    assert re.search(r"restarting \(attempt 2 of 2\) after rank \d exited with code 1", out0), out0
    assert "rank 0 of 1 node 0 sum 1 attempt 1" in out0 and "done rank 0 of 1" in out0  # attempts grow


def test_pet_variables_alone_make_a_two_machine_job(job: dict) -> None:
    """Kubeflow's training operators set PET_* in place of flags: ``spread run train.py`` with only
    those starts the job they describe (it silently started one process before)."""
    base = dict(job["env"], PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_MASTER_ADDR="127.0.0.1")
    base["PET_MASTER_PORT"] = str(job["port"])
    nodes = [_node(job, env=dict(base, PET_NODE_RANK=str(rank))) for rank in (0, 1)]
    (code0, out0), (code1, out1) = _finish(*nodes)
    assert (code0, code1) == (0, 0), out0 + out1
    assert "rank 0 of 2 node 0 sum 3" in out0 and "rank 1 of 2 node 1 sum 3" in out1


def test_pet_variables_alone_make_an_elastic_job_as_kubeflow_sets_them(job: dict) -> None:
    """An elastic PyTorchJob (Kubeflow's training operator): PET_NNODES is the range MIN:MAX, the
    rendezvous is PET_RDZV_*, and PET_MASTER_ADDR/PORT name the master's service, another address and
    port than the endpoint; PET_NODE_RANK is the pod's index. ``spread run train.py`` with only those
    forms one elastic job of both machines (it refused before: "give either --rdzv-endpoint or
    --master-addr/--master-port"); torchrun, too, uses the endpoint and lets the rendezvous number
    the machines."""
    master_port = free_ports(1)[0]
    base = dict(
        job["env"],
        PET_NNODES="1:2",
        PET_NPROC_PER_NODE="1",
        PET_RDZV_BACKEND="c10d",
        PET_RDZV_ENDPOINT=f"127.0.0.1:{job['port']}",
        PET_RDZV_ID="kubeflow-job",
        PET_MAX_RESTARTS="3",
        PET_MASTER_ADDR="localhost",
        PET_MASTER_PORT=str(master_port),
    )
    # 30 s alone first if the rendezvous started a machine alone: the other's arrival is then a new
    # round of two (as when a machine joins later), never a job that ended before it came.
    nodes = [_node(job, env=dict(base, PET_NODE_RANK=str(rank)), seconds=30) for rank in (0, 1)]
    (code0, out0), (code1, out1) = _finish(*nodes)
    assert (code0, code1) == (0, 0), out0 + out1
    both = out0 + out1
    assert re.search(r"rank 0 of 2 node 0 sum 3", both) and re.search(r"rank 1 of 2 node 1 sum 3", both), both
    assert "done rank 0 of 2" in both and "done rank 1 of 2" in both, both


def test_a_machine_with_another_secret_cannot_join(job: dict, tmp_path: Path) -> None:
    """What makes the derived token safe: a process without the user's secret computes another token
    and is refused by spread's handshake, with a clear error, before any collective."""
    other = dict(job["env"], HOME=str(tmp_path / "another-home"))
    first = _elastic(job, 1, "2")
    second = _node(
        job,
        *("-n", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{job['port']}", "--rdzv-id", "job-1"),
        env=other,
    )
    (code0, out0), (code1, out1) = _finish(first, second)
    assert code0 != 0 and code1 != 0
    assert "JobTokenError" in out0 + out1, out0 + out1
