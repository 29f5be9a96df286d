"""Machines that come back join a running job (issue 36 item 2): separate ``spread run --recover
--nnodes 2:3`` invocations on this machine are the "machines" of a c10d rendezvous. One is lost (killed,
preempted, stopped, killed mid-all-reduce) or a rank dies mid-save; the survivors train on at the
smaller size without restart; a machine started again joins at a step boundary with the weights,
optimizer state and data position streamed from a live peer; the job ends with the weights of the
uninterrupted run, and no process of any machine is left behind. The same for ShardedStrategy, whose
joiner receives its shards of the parameters and optimizer state from the live ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from spread.testing.processes import reap_survivors, spread_run
from spread.testing.ps_jobs import free_ports

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "scripts" / "rejoin_train.py"
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _results(log: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if "RESULT " in line]


_UNINTERRUPTED: dict[str, dict] = {}


def _uninterrupted_run(shard: str = "") -> dict:
    """Rank 0's result of the uninterrupted 3-rank run (``shard``: of that ShardedStrategy stage; "":
    MultiWorkerMirrored), run once per module."""
    if shard not in _UNINTERRUPTED:
        run = spread_run(SCRIPT, 3, "3", "-", *([shard] if shard else []))
        assert run.returncode == 0, run.log
        results = _results(run.log)
        assert len(results) == 3 and {r["world_size"] for r in results} == {3}
        _UNINTERRUPTED[shard] = results[0]
    return _UNINTERRUPTED[shard]


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    return _uninterrupted_run()


class Machines:
    """``spread run`` invocations as machines of one job; every process they start is remembered."""

    def __init__(self, tmp_path: Path) -> None:
        self.env = {
            k: v for k, v in os.environ.items() if k not in ("SPREAD_JOB_TOKEN", "RANK", "WORLD_SIZE")
        }
        self.env.update(HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", SPREAD_COLLECTIVE_TIMEOUT="20")
        self.port, self.backups = free_ports(1)[0], str(tmp_path / "backups")
        self.nodes: list[subprocess.Popen] = []
        self.pids: set[int] = set()
        self.logs: list[list[str]] = []

    def start(
        self,
        nproc: int,
        *,
        host: bool = False,
        chaos: str = "",
        backups: bool = False,
        full: int = 3,
        host_id: str = "",
        shard: str = "",
    ) -> int:
        """Start a machine of ``nproc`` ranks (``host``: at the rendezvous endpoint); ``host_id``: it
        passes for a host of its own (``SPREAD_HOST_ID``: its ranks' pids cannot be checked by the
        others); ``full``: the world size at which the survivors stop waiting for a machine to join;
        ``shard``: train with ``ShardedStrategy(shard=...)`` instead of MultiWorkerMirrored."""
        endpoint = f"127.0.0.1:{self.port}"
        conf = f"last_call_timeout=1,join_timeout=120,is_host={int(host)}"
        command = [sys.executable, "-m", "spread.cli.main", "run", "--recover", "-n", str(nproc)]
        command += ["--nnodes", "2:3", "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--rdzv-conf", conf]
        command += [str(SCRIPT), str(full), self.backups if backups else "-", *([shard] if shard else [])]
        env = dict(self.env, SPREAD_TEST_CHAOS=chaos) if chaos else dict(self.env)
        if host_id:
            env["SPREAD_HOST_ID"] = host_id
        node = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.nodes.append(node)
        self.logs.append([])
        self.pids.add(node.pid)
        return len(self.nodes) - 1

    def read_until(self, index: int, pattern: str, timeout: float = 120.0) -> None:
        """Read machine ``index``'s output until a line matches ``pattern`` (remembering the pids of
        every process it started so far)."""
        node = self.nodes[index]
        assert node.stdout is not None
        for line in node.stdout:
            self.logs[index].append(line)
            self._remember(node)
            if re.search(pattern, line):
                return
        raise AssertionError(f"machine {index} ended before {pattern!r}:\n{''.join(self.logs[index])}")

    def _remember(self, node: subprocess.Popen) -> None:
        try:
            self.pids.update(p.pid for p in psutil.Process(node.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def finish(self, index: int, timeout: float = 200.0) -> tuple[int, str]:
        node = self.nodes[index]
        out, _ = node.communicate(timeout=timeout)
        self.logs[index].append(out)
        return node.returncode, "".join(self.logs[index])

    def close(self) -> list[int]:
        for node in self.nodes:
            if node.poll() is None:
                node.kill()
                node.communicate(timeout=30)
        return reap_survivors(self.pids, timeout=15)


@pytest.fixture
def machines(tmp_path: Path):
    group = Machines(tmp_path)
    yield group
    assert group.close() == [], "processes left behind"


def _assert_uninterrupted(results: list[dict], uninterrupted: dict, world: int) -> None:
    assert len(results) == world
    for result in results:
        assert result["world_size"] == world
        assert result["global_step"] == uninterrupted["global_step"]
        for key, value in uninterrupted["weights"].items():
            torch.testing.assert_close(torch.tensor(result["weights"][key]), torch.tensor(value), **TOLERANCE)


def test_a_lost_machine_comes_back_and_joins_with_the_state_of_a_live_peer(
    machines: Machines, uninterrupted: dict
) -> None:
    first = machines.start(2, host=True)
    second = machines.start(1, chaos="kill@5")
    machines.read_until(first, r"regrouped at world size 2 without restart")
    again = machines.start(1)
    machines.read_until(again, r"join the running job at its next step boundary")
    code, log = machines.finish(first)
    code_again, log_again = machines.finish(again)
    assert (code, code_again) == (0, 0), log + log_again
    assert machines.nodes[second].wait(timeout=30) != 0
    assert "admitting the machine(s) that wait to join; regrouped at world size 3 without restart" in log
    assert "restarting" not in log
    pids = {int(p) for p in re.findall(r"PIDS (\d+)", "".join(machines.logs[first][:8]))}
    results = _results(log) + _results(log_again)
    assert pids <= {r["pid"] for r in results}  # the survivors are the processes that started
    _assert_uninterrupted(results, uninterrupted, 3)


# Chaos (each a job of about a minute here): how a machine (or the chief) is hurt, and what the
# launcher of the machine that went down says.
CHAOS = {
    "preempted mid-step": ("term", "received SIGTERM"),
    "killed mid-all-reduce": ("backward", None),
    "stopped mid-step": ("stop", "stayed stopped"),
    "the chief killed mid-save": ("save", "exited with code 137 (killed by SIGKILL): rank 0 was lost"),
}


@pytest.mark.parametrize("shard", ["", "parameters"], ids=["mirrored", "sharded"])
@pytest.mark.parametrize("case", sorted(CHAOS))
def test_chaos_then_a_machine_joins_and_the_job_ends_with_the_uninterrupted_weights(
    machines: Machines, case: str, shard: str
) -> None:
    """Each chaos case, for a MultiWorkerMirrored job and for a ``ShardedStrategy(shard="parameters")``
    job with sharded backups (the survivors rebuild the lost shard from its buddy copy)."""
    mode, said = CHAOS[case]
    uninterrupted = _uninterrupted_run(shard)
    chief_chaos = f"{mode}@5" if mode == "save" else ""
    first = machines.start(2, host=True, chaos=chief_chaos, backups=True, shard=shard)
    second = machines.start(1, chaos=f"{mode}@5", backups=True, shard=shard)
    machines.read_until(first, r"regrouped at world size 2 without restart")
    again = machines.start(1, backups=True, shard=shard)
    code, log = machines.finish(first)
    code_again, log_again = machines.finish(again)
    code_second, log_second = machines.finish(second)
    assert (code, code_again) == (0, 0), log + log_again
    assert "admitting the machine(s) that wait to join; regrouped at world size 3 without restart" in log
    if mode != "save":
        assert code_second != 0
    if said:
        assert said in log + log_second, log + log_second
    _assert_uninterrupted(_results(log) + _results(log_again) + _results(log_second), uninterrupted, 3)


def test_two_failures_in_one_job_each_followed_by_a_machine_that_joins(
    machines: Machines, uninterrupted: dict
) -> None:
    first = machines.start(2, host=True)
    machines.start(1, chaos="kill@4")
    machines.read_until(first, r"regrouped at world size 2 without restart")
    again = machines.start(1, chaos="kill@9")  # joins, then is lost in its turn
    machines.read_until(first, r"regrouped at world size 3 without restart")
    machines.read_until(first, r"regrouped at world size 2 without restart")
    third = machines.start(1)
    code, log = machines.finish(first)
    code_third, log_third = machines.finish(third)
    assert (code, code_third) == (0, 0), log + log_third
    assert machines.finish(again)[0] != 0
    assert log.count("admitting the machine(s) that wait to join") == 2, log
    _assert_uninterrupted(_results(log) + _results(log_third), uninterrupted, 3)


# A loss on another machine (issue 36 item 2): each "machine" passes for a host of its own
# (SPREAD_HOST_ID), so the survivors cannot see the lost process exit and learn of the loss from its
# launcher's report in the job store. The regroup timeout is longer than this test's own timeout:
# survivors that waited for it would fail the test. How each machine is lost, and how it is known:
HOST_LOSS = {
    "a rank killed, its launcher reports the exit": "die",
    "the machine preempted, its launcher reports leaving": "term",
    "the machine killed whole, its launcher's beat stops": "kill",
}


@pytest.mark.parametrize("case", sorted(HOST_LOSS))
def test_a_loss_on_another_machine_is_known_without_waiting_for_the_regroup_timeout(
    machines: Machines, uninterrupted: dict, case: str
) -> None:
    machines.env["SPREAD_REGROUP_TIMEOUT"] = "3600"
    first = machines.start(2, host=True, full=2, host_id="machine-a")
    second = machines.start(1, chaos=f"{HOST_LOSS[case]}@5", full=2, host_id="machine-b")
    code, log = machines.finish(first)
    code_second, log_second = machines.finish(second)
    assert code == 0, log + log_second
    assert code_second != 0, log_second
    assert "regrouped at world size 2 without restart" in log, log
    print("FIGURES host loss", case, re.findall(r"without restart in [\d.]+s", log))
    _assert_uninterrupted(_results(log), uninterrupted, 2)


@pytest.mark.parametrize("shard", ["parameters", "gradients"])
def test_a_lost_machine_comes_back_and_joins_a_running_sharded_job(machines: Machines, shard: str) -> None:
    """The 1-process machine (rank 2 of 3) is killed; the survivors rebuild its shard from the buddy
    copy and train on at 2; started again, it joins at a step boundary, every rank cuts the state for
    3 again (the joiner's part streamed from the live ranks) and the job ends with the weights of the
    uninterrupted 3-rank sharded run."""
    expected = _uninterrupted_run(shard)
    first = machines.start(2, host=True, shard=shard)
    second = machines.start(1, chaos="kill@5", shard=shard)
    machines.read_until(first, r"regrouped at world size 2 without restart")
    again = machines.start(1, shard=shard)
    code, log = machines.finish(first)
    code_again, log_again = machines.finish(again)
    assert (code, code_again) == (0, 0), log + log_again
    assert machines.nodes[second].wait(timeout=30) != 0
    assert "admitting the machine(s) that wait to join; regrouped at world size 3 without restart" in log
    assert "restarting" not in log
    assert len(_results(log_again)) == 1  # the joiner finished the job with the others
    _assert_uninterrupted(_results(log) + _results(log_again), expected, 3)
