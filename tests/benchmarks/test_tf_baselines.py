"""``benchmarks/tf_baselines.py``: options, TF_CONFIG per process, the import guard and the launcher's
failure report. The runs that need TensorFlow are skipped where it is not installed (CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tf_baselines as tfb  # noqa: E402

pytestmark = pytest.mark.timeout(200)


def test_defaults_pin_one_thread_and_the_inter_op_threads_per_mode():
    ps = tfb.parse_args(["--mode", "ps", "--workload", "w3"])
    assert (ps.workload, ps.threads, ps.inter, ps.workers, ps.ps, ps.role) == ("W3", 1, 2, 2, 1, "launcher")
    assert ps.per_step is None and ps.embedding == "lookup"
    mwms = tfb.parse_args(["--mode", "mwms"])
    assert (mwms.workload, mwms.inter) == ("W1", 1)
    assert tfb.parse_args(["--mode", "ps", "--inter", "3"]).inter == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "mwms", "--workload", "W3"],
        ["--mode", "ps", "--workers", "0"],
        ["--mode", "ps", "--reps", "0"],
    ],
)
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        tfb.parse_args(argv)


def test_ps_tf_config_has_servers_workers_and_chief_on_loopback():
    ports = [5001, 5002, 5003, 5004, 5005]
    configs = tfb.tf_configs("ps", 3, 1, ports)
    assert list(configs) == [("ps", 0), ("worker", 0), ("worker", 1), ("worker", 2), ("chief", 0)]
    cluster = {
        "ps": ["127.0.0.1:5001"],
        "worker": ["127.0.0.1:5002", "127.0.0.1:5003", "127.0.0.1:5004"],
        "chief": ["127.0.0.1:5005"],
    }
    for (role, index), config in configs.items():
        assert config == {"cluster": cluster, "task": {"type": role, "index": index}}
    assert json.loads(json.dumps(configs[("worker", 2)]))["task"] == {"type": "worker", "index": 2}


def test_mwms_tf_config_is_workers_only():
    configs = tfb.tf_configs("mwms", 2, 1, [6001, 6002])
    assert configs[("worker", 1)] == {
        "cluster": {"worker": ["127.0.0.1:6001", "127.0.0.1:6002"]},
        "task": {"type": "worker", "index": 1},
    }


@pytest.mark.parametrize("ports", [[7001, 7002], [7001, 7001, 7002, 7003]])
def test_tf_config_needs_one_distinct_port_per_process(ports):
    with pytest.raises(ValueError, match="distinct ports"):
        tfb.tf_configs("ps", 2, 1, ports)


def test_free_ports_are_distinct():
    ports = tfb.free_ports(5)
    assert len(set(ports)) == 5 and all(p > 0 for p in ports)


def test_child_argv_round_trips_the_launchers_settings():
    a = tfb.parse_args(["--mode", "ps", "--workload", "W3", "--per-step", "256", "--embedding", "keras"])
    argv = tfb.child_argv(a, "worker", 1, "/tmp/d.npz", "/tmp/o.jsonl")
    assert argv[:2] == [sys.executable, str(ROOT / "benchmarks" / "tf_baselines.py")]
    child = tfb.parse_args(argv[2:])
    for key in ("mode", "workload", "per_step", "embedding", "threads", "inter", "reps", "steps", "timeout"):
        assert getattr(child, key) == getattr(a, key), key
    assert (child.role, child.index, child.data, child.out) == ("worker", 1, "/tmp/d.npz", "/tmp/o.jsonl")


def test_child_env_pins_threads_and_carries_tf_config():
    env = tfb.child_env({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}, 1)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert json.loads(env["TF_CONFIG"])["task"]["type"] == "worker"


@pytest.mark.processes
def test_importing_the_runner_loads_neither_framework():
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import tf_baselines; "
        "print('tensorflow' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def _launch(*args: str, timeout: float = 150) -> tuple[int, list[dict]]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tf_baselines.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_without_tensorflow_the_launcher_says_so(monkeypatch, capsys):
    monkeypatch.setattr(tfb, "tensorflow_available", lambda: False)
    assert tfb.main(["--mode", "ps", "--quick"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["error"] == "tensorflow not installed"


def test_a_job_past_its_timeout_is_killed_and_the_roles_named():
    pytest.importorskip("tensorflow")
    rc, records = _launch("--mode", "ps", "--quick", "--timeout", "2")
    assert rc == 1
    (record,) = records
    assert "no result within 2 s; still running:" in record["error"]
    assert record["role"] in {"ps0", "worker0", "worker1", "chief0"}


def test_smoke_tf_parameter_server_w1_moves_variables_and_gradients():
    pytest.importorskip("tensorflow")
    rc, records = _launch(
        "--mode", "ps", "--quick", "--warmup", "1", "--reps", "2", "--steps", "1", "--timeout", "120"
    )
    assert rc == 0, records
    (record,) = records
    assert record["median"] > 0 and len(record["rates"]) == 2 and record["per_step"] == 64
    params = (784 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)  # the quick W1
    # each worker step pulls every variable and pushes every gradient, through the server: 2 x 4 bytes
    assert 1.0 <= record["bytes_per_step"] / (2 * 4 * params) < 1.3, record["bytes_per_step"]
