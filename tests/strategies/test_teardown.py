"""Strategies release their process groups and threads before the interpreter finalizes (issue 16).

The abort this guards against is a race (a gloo worker thread taking the GIL after finalization has
begun), so the multi-process tests check its cause instead of counting aborts: by the time the
script's earliest ``atexit`` callback runs, no process group and no gloo or heartbeat thread is left.
``benchmarks/exit_stress.py`` counts the aborts themselves over many runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from spread.strategies.teardown import EXIT_TIMEOUT_ENV, ProcessResources, exit_timeout

ROOT = Path(__file__).resolve().parents[2]
SPREAD = Path(sys.executable).parent / "spread"
ABORT = "terminate called"


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run(argv: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


# -- ProcessResources, in this process ----------------------------------------------------------------
def test_release_runs_callbacks_newest_first_and_once():
    calls: list[str] = []
    resources = ProcessResources("test")
    for name in ("group", "threads", "heartbeat"):
        resources.push(lambda name=name: calls.append(name))
    resources.release()
    resources.release()
    assert calls == ["heartbeat", "threads", "group"]


def test_release_runs_every_callback_and_raises_the_error():
    calls: list[str] = []
    resources = ProcessResources("test")
    resources.push(lambda: calls.append("group"))
    resources.push(lambda: (_ for _ in ()).throw(ValueError("broken heartbeat")))
    with pytest.raises(ValueError, match="broken heartbeat"):
        resources.release()
    assert calls == ["group"]


def test_exit_release_gives_up_at_the_deadline_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv(EXIT_TIMEOUT_ENV, "0.2")
    unblock = threading.Event()
    resources = ProcessResources("PipelineStrategy rank 1")
    resources.push(unblock.wait)  # an operation that waits for a peer that never comes
    watchdog = threading.Timer(60, unblock.set)  # ends the wait if the deadline does not
    watchdog.start()
    try:
        resources._release_at_exit()
        ended_by_deadline = not unblock.is_set()
    finally:
        unblock.set()  # let the helper thread finish
        watchdog.cancel()
    assert ended_by_deadline
    err = capsys.readouterr().err
    assert "PipelineStrategy rank 1" in err and EXIT_TIMEOUT_ENV in err


def test_exit_release_reports_an_error_instead_of_raising(capsys):
    resources = ProcessResources("MultiWorkerMirroredStrategy rank 0")
    resources.push(lambda: (_ for _ in ()).throw(RuntimeError("store gone")))
    resources._release_at_exit()
    assert "MultiWorkerMirroredStrategy rank 0: error while releasing at exit" in capsys.readouterr().err


def test_exit_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv(EXIT_TIMEOUT_ENV, "2.5")
    assert exit_timeout() == 2.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv(EXIT_TIMEOUT_ENV, bad)
        assert exit_timeout() == 10.0


@pytest.mark.processes
def test_released_at_exit_after_later_exit_callbacks_with_the_scripts_exit_code(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, sys
            from spread.strategies.teardown import ProcessResources
            closed = ProcessResources("closed")
            closed.push(lambda: print("closed released"))
            closed.release()
            open_ = ProcessResources("open")
            open_.push(lambda: print("group released"))
            open_.push(lambda: print("threads released"))
            atexit.register(lambda: print("script's exit callback"))  # may still use the strategy
            sys.exit(3)
            """
        )
    )
    out = _run([sys.executable, str(script)], timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stdout.splitlines() == [
        "closed released",
        "script's exit callback",
        "threads released",
        "group released",
    ]


# -- strategies under `spread run` ------------------------------------------------------------------
PROBE = """
import atexit, json, os, sys, threading

def probe():  # registered first, so it runs last: after spread's release, before finalization
    import torch.distributed as dist
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    state = {
        "initialized": dist.is_available() and dist.is_initialized(),
        "native_threads": sorted(names),
        "python_threads": sorted(t.name for t in threading.enumerate()),
    }
    print("PROBE " + json.dumps(state), flush=True)

atexit.register(probe)
"""

TRAIN = """
import os, sys, torch, spread
from torch import nn
from spread.train.callbacks import Callback

kind, fault = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
if kind == "pipeline":
    strategy = spread.PipelineStrategy(stages=2, microbatches=4, schedule="gpipe")
else:
    strategy = spread.MultiWorkerMirroredStrategy()
x, y = torch.randn(512, 16), torch.randint(0, 4, (512,))
with strategy.scope():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)], nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


class Fault(Callback):
    def on_train_batch_end(self, step, logs=None):
        if step == 3 and fault == "exit":
            sys.exit(3)
        if step == 3 and fault == "raise" and rank == 1:
            raise ValueError("injected on rank 1")


trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
trainer.fit((x, y), epochs=2, global_batch_size=64, verbose=0, callbacks=[Fault()])
trainer.evaluate((x, y))
print("trained", flush=True)  # and no strategy.close(): the README's example does not call it
"""


def _spread_run(tmp_path: Path, body: str, *args: str, timeout: float = 180, **env: str):
    script = tmp_path / "job.py"
    script.write_text(PROBE + body)
    return _run([str(SPREAD), "run", "-n", "2", str(script), *args], timeout=timeout, **env)


def _probes(stdout: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        head, sep, payload = line.partition("PROBE ")
        if sep:
            found[int(head.split("]")[0].removeprefix("[rank "))] = json.loads(payload)
    return found


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["pipeline", "multi_worker_mirrored"])
def test_process_group_and_threads_are_gone_before_the_interpreter_finalizes(tmp_path, kind):
    out = _spread_run(tmp_path, TRAIN, kind, "none")
    assert out.returncode == 0, out.stderr[-3000:]
    assert ABORT not in out.stdout + out.stderr
    probes = _probes(out.stdout)
    assert sorted(probes) == [0, 1], out.stdout[-3000:]
    for rank, state in probes.items():
        assert not state["initialized"], (rank, state)
        gloo = [n for n in state["native_threads"] if "gloo" in n]
        assert not gloo, (rank, state)  # ProcessGroupGloo's work and transport threads were joined
        assert state["python_threads"] == ["MainThread"], (rank, state)  # heartbeat joined


@pytest.mark.processes
@pytest.mark.parametrize(
    ("kind", "fault", "code"), [("pipeline", "exit", 3), ("multi_worker_mirrored", "raise", 1)]
)
def test_exit_code_is_the_scripts_after_sys_exit_or_an_exception(tmp_path, kind, fault, code):
    out = _spread_run(tmp_path, TRAIN, kind, fault)
    assert out.returncode == code, out.stderr[-3000:]
    assert ABORT not in out.stdout + out.stderr
    assert "trained" not in out.stdout


STUCK = """
import os, sys, time, torch, spread

strategy = spread.MultiWorkerMirroredStrategy(communication="native")
if int(os.environ["RANK"]) == 1:
    pending = strategy.collectives.all_reduce_async(torch.ones(4), name="never_joined")
    sys.exit(5)  # rank 0 never joins that all-reduce
time.sleep(600)
"""


@pytest.mark.processes
def test_an_operation_in_flight_does_not_hold_the_exit(tmp_path):
    # Before: rank 1 waited at exit until rank 0 ended (here: 600 s). Now the release gives up after
    # SPREAD_EXIT_TIMEOUT, rank 1 exits with its own code, and `spread run` stops rank 0.
    out = _spread_run(tmp_path, STUCK, timeout=120, SPREAD_EXIT_TIMEOUT="2")
    assert out.returncode == 5, out.stderr[-3000:]
    assert "MultiWorkerMirroredStrategy rank 1: releasing its process group" in out.stdout + out.stderr
    assert ABORT not in out.stdout + out.stderr
