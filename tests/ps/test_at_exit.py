"""spread.ps.at_exit: closers run when a script ends without closing, while thread pools still work
and before non-daemon threads are joined, newest first, told whether the script raised; a failing
closer is reported and makes the exit status 1; a cancelled one does not run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.processes

SCRIPT = textwrap.dedent(
    """
    import sys, threading
    from concurrent.futures import ThreadPoolExecutor
    from spread.ps.at_exit import close_at_exit

    mode = sys.argv[1]
    pool = ThreadPoolExecutor(2)
    released = threading.Event()
    # A non-daemon thread that only a closer releases, like a coordinator's session threads.
    threading.Thread(target=released.wait, name="session").start()

    def closer(name):
        def close(failing):
            value = pool.submit(lambda: name).result()  # the pool still works
            print(f"closed {value} failing={failing}", flush=True)
            released.set()
            if mode == "fail" and name == "first":
                raise RuntimeError("servers unreachable")
        return close

    close_at_exit("the first object", closer("first"))
    close_at_exit("the second object", closer("second"))
    close_at_exit("a cancelled object", closer("cancelled")).cancel()
    if mode == "raise":
        raise ValueError("the script failed")
    if mode == "exit":
        sys.exit(0)
    """
)


@pytest.mark.parametrize(
    ("mode", "code", "failing"),
    [("return", 0, False), ("exit", 0, False), ("raise", 1, True), ("fail", 1, False)],
)
def test_closers_run_at_exit_before_pools_and_threads_are_shut_down(tmp_path, mode, code, failing):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout.splitlines() == [f"closed second failing={failing}", f"closed first failing={failing}"]
    if mode == "fail":
        assert done.stderr.strip() == (
            "spread: the first object: closing at exit failed: RuntimeError: servers unreachable"
        )
    elif mode == "raise":
        assert "ValueError: the script failed" in done.stderr
    else:
        assert done.stderr == ""
