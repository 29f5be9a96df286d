"""``spread.cluster._run_script``: a rank's script sees what ``python script.py`` gives it, exits with the
same code and traceback, and a plain DDP script ends without torch's abort at exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spread.cluster.launcher import _SCRIPT_RUNNER
from spread.testing.ps_jobs import free_ports

PROBE = """
import os, pickle, sys
print("name", __name__)
print("file", __file__)
print("argv", sys.argv)
print("path0", sys.path[0])
print("main is this module", sys.modules["__main__"].__dict__ is globals())
class Point:
    pass
print("pickles", type(pickle.loads(pickle.dumps(Point()))).__name__)
import sibling
print("sibling", sibling.VALUE)
ending = sys.argv[1]
if ending == "exit3":
    sys.exit(3)
if ending == "raise":
    def inner():
        raise ValueError("bad value")
    inner()
if ending == "interrupt":
    raise KeyboardInterrupt
"""


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p.endswith("src"))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("ending", ["done", "exit3", "raise", "interrupt"])
@pytest.mark.processes
def test_a_script_sees_and_ends_as_under_plain_python(tmp_path: Path, ending: str) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "probe.py").write_text(PROBE)
    (scripts / "sibling.py").write_text("VALUE = 7\n")
    plain = _run([sys.executable, "-u", "scripts/probe.py", ending], tmp_path)
    ran = _run([sys.executable, "-u", _SCRIPT_RUNNER, "scripts/probe.py", ending], tmp_path)
    assert (ran.returncode, ran.stdout) == (plain.returncode, plain.stdout)
    if ending == "interrupt":  # still ends by SIGINT; Ctrl-C reaches every rank: one line, not a traceback
        assert plain.stderr.splitlines()[-1] == "KeyboardInterrupt"
        script = re.escape(str(tmp_path / "scripts" / "probe.py"))
        assert re.fullmatch(rf"KeyboardInterrupt \(at {script}:\d+, in <module>\)\n", ran.stderr), ran.stderr
    else:
        assert ran.stderr == plain.stderr  # the traceback names the script's frames only
    assert "sibling 7" in ran.stdout
    assert plain.returncode == {"done": 0, "exit3": 3, "raise": 1, "interrupt": -2}[ending]


DDP_ENDING = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(64, 64))
for _ in range(3):
    model(torch.randn(8, 64)).sum().backward()
dist.barrier()
dist.destroy_process_group()
print("done", flush=True)
"""


@pytest.mark.processes
def test_plain_ddp_scripts_end_without_the_exit_abort(tmp_path: Path) -> None:
    """The nanoGPT ending (a global DDP model, barrier, destroy_process_group) aborts now and then
    under plain python (2 ranks in 20 here); through the runner, 12 two-rank runs in a row end with 0."""
    (tmp_path / "ddp_ending.py").write_text(textwrap.dedent(DDP_ENDING))
    for _ in range(12):
        port = str(free_ports(1)[0])
        procs = [
            subprocess.Popen(
                [sys.executable, "-u", _SCRIPT_RUNNER, "ddp_ending.py"],
                cwd=tmp_path,
                env={
                    **os.environ,
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "OMP_NUM_THREADS": "1",
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            outputs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=30)
        assert [p.returncode for p in procs] == [0, 0], outputs
        assert all("done" in out for out in outputs)
