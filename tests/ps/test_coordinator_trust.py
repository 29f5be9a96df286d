"""A ClusterCoordinator worker takes work only from a chief that proves the job token, never from a
replay of a real chief's messages, and runs only functions of its own script, whoever asks.

Each test runs a real worker process (tests/ps/scripts/coordinated_worker.py) against a real
parameter server; the chief's address is held by a forged chief without the token, by a recording
relay, or by a real coordinator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from _zmq_peers import FakeServer, Relay

from spread.cluster import ClusterSpec
from spread.errors import SpreadError
from spread.ps import ClusterCoordinator, ParameterServer
from spread.ps.wire import encode
from spread.ps.zmq_transport import HELLO, STREAM_ITEM, STREAM_OPEN, WELCOME
from spread.testing.processes import process_alive
from spread.testing.ps_jobs import free_ports

pytestmark = pytest.mark.processes

WORKER = Path(__file__).parent / "scripts" / "coordinated_worker.py"
TOKEN = "the-job-token"


@pytest.fixture
def job(tmp_path):
    """A real parameter server, the cluster's addresses, and a way to start the worker task."""
    chief, worker, ps = (f"127.0.0.1:{p}" for p in free_ports(3))
    server = ParameterServer(0, token=TOKEN, address=ps).start()
    markers = tmp_path / "markers"
    markers.mkdir()
    cluster = {"chief": [chief], "worker": [worker], "ps": [ps]}

    def run_worker(timeout: float = 60) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}),
            "SPREAD_JOB_TOKEN": TOKEN,
            "SPREAD_TEST_MARKERS": str(markers),
        }
        proc = subprocess.Popen(
            [sys.executable, str(WORKER)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        assert not process_alive(proc.pid)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    yield SimpleNamespace(chief=chief, cluster=cluster, markers=markers, run_worker=run_worker)
    server.stop()


def _exec_task(markers: Path) -> bytes:
    """What an attacker sends: a task naming builtins.exec with code that leaves a marker."""
    code = f"open({str(markers / 'pwned')!r}, 'w').write('pwned')"
    args = {"$list": [{"$list": [code]}, {"$dict": {}}]}
    return encode({"op": "task", "id": 0, "step_id": "x:0", "function": ["builtins", "exec"], "args": args})


def _real_chief(cluster: dict, address: str) -> ClusterCoordinator:
    """A real coordinator, as the chief task runs it, serving at ``address``."""
    spec = ClusterSpec(
        role="chief",
        task_index=0,
        rank=0,
        world_size=2,
        cluster={**cluster, "chief": [address]},
        source="tf_config",
    )
    strategy = SimpleNamespace(
        cluster=spec,
        job_token=TOKEN,
        transport="zmq",
        init_timeout=30,
        leave_worker_shutdown_to_coordinator=lambda: None,
    )
    return ClusterCoordinator(strategy)


@pytest.mark.parametrize(
    "reply",
    [
        # speaks the old protocol: opens the stream and sends the task, no handshake
        lambda parts, task: [[parts[1], STREAM_OPEN], [parts[1], STREAM_ITEM, task]],
        # answers the handshake with a made-up proof, then the task
        lambda parts, task: [
            [parts[1], WELCOME, b"s" * 16, b"n" * 16, b"p" * 32],
            [parts[1], STREAM_OPEN, b"m" * 32],
            [parts[1], STREAM_ITEM, b"m" * 32, task],
        ],
    ],
    ids=["no-handshake", "made-up-proof"],
)
def test_a_worker_refuses_a_forged_chief_without_the_token(job, reply):
    task = _exec_task(job.markers)
    fake = FakeServer(lambda parts: reply(parts, task), address=job.chief)
    try:
        done = job.run_worker()
    finally:
        fake.close()
    assert done.returncode == 1, done.stderr
    assert f"the chief (coordinator at {job.chief}): session refused" in done.stderr
    assert "could not prove the token" in done.stderr and "JobTokenError" in done.stderr
    assert not (job.markers / "pwned").exists()  # the forged task never ran
    assert fake.received == []  # the worker sent nothing: CURVE's handshake failed (no server key)


def test_a_recorded_chief_session_replayed_to_a_worker_runs_nothing(job):
    # 1. A real chief (behind a relay at the chief's address that records its answers) runs one
    # task on a real worker, then stops it.
    real = _real_chief(job.cluster, f"127.0.0.1:{free_ports(1)[0]}")
    relay = Relay(real._chief.server.address, TOKEN, address=job.chief)
    try:
        value = real._chief.schedule(("__main__", "step"), ("first",), None)
        outcome = {}
        runner = threading.Thread(target=lambda: outcome.update(done=job.run_worker()))
        runner.start()
        assert value.fetch(timeout=60) == "first"
        real.shutdown()
        runner.join(90)
    finally:
        real.shutdown()
        relay.close()
    assert outcome["done"].returncode == 0, outcome["done"].stderr
    assert (job.markers / "first").read_text() == "ran"
    (job.markers / "first").unlink()
    recorded = [a for a in relay.answers if a[1] in (WELCOME, STREAM_OPEN, STREAM_ITEM)]
    assert [a[1] for a in recorded][:3] == [WELCOME, STREAM_OPEN, STREAM_ITEM]

    # 2. A process without the token replays the recording to the next worker, answer for answer.
    def replay(parts):
        if parts[0] == HELLO:
            return [[parts[1], *recorded[0][1:]]]
        return [[parts[1], *answer[1:]] for answer in recorded[1:]]

    fake = FakeServer(replay, address=job.chief)
    try:
        done = job.run_worker()
    finally:
        fake.close()
    assert done.returncode == 1, done.stderr
    assert "could not prove the token" in done.stderr
    assert not (job.markers / "first").exists()  # the recorded task did not run again


def test_a_worker_runs_only_functions_of_its_own_script_even_for_the_real_chief(job):
    real = _real_chief(job.cluster, job.chief)
    code = f"open({str(job.markers / 'pwned')!r}, 'w').write('pwned')"
    try:
        refused = [
            real._chief.schedule(("builtins", "exec"), (code,), None),
            real._chief.schedule(("os", "system"), (f"touch {job.markers / 'pwned'}",), None),
            real._chief.schedule(("__main__", "Path"), (str(job.markers / "pwned"),), None),  # imported class
            real._chief.schedule(
                ("spread.ps.coordinator_tasks", "encode_value"), (1, {}), None
            ),  # a library function
        ]
        ran = real._chief.schedule(("__main__", "step"), ("allowed",), None)
        outcome = {}
        runner = threading.Thread(target=lambda: outcome.update(done=job.run_worker()))
        runner.start()
        assert ran.fetch(timeout=60) == "allowed"
        for value in refused:
            with pytest.raises(SpreadError, match="which this worker does not run"):
                value.fetch(timeout=60)
        real.shutdown()
        runner.join(90)
    finally:
        real.shutdown()
    assert outcome["done"].returncode == 0, outcome["done"].stderr
    assert not (job.markers / "pwned").exists()
    assert (job.markers / "allowed").exists()
