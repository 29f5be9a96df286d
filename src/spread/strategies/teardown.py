"""Release what a strategy owns in its process (process groups, background threads) in reverse order:
at ``close()``, or at interpreter exit when the script never calls it.

Why exit needs care: gloo's worker threads drop a finished collective a moment *after* the caller's
``wait()`` has returned, and dropping a tensor that Python also references takes the GIL. Once CPython
has begun to finalize, a thread that asks for the GIL is ended with ``pthread_exit``; inside a C++
destructor that unwind ends in ``std::terminate`` ("terminate called without an active exception",
SIGABRT, exit code 134) although the script had finished. Destroying the process group joins those
threads, so it must happen while the interpreter is still whole: in an :mod:`atexit` callback. Those
run after ``threading`` has joined the program's non-daemon threads and before finalization, newest
first, so callbacks the script registers after creating its strategy (which may still use it) run
before the strategy is released.

At exit the release runs on a helper thread with a deadline (``SPREAD_EXIT_TIMEOUT`` seconds, default
10): after a failure an operation can still be in flight (a collective a peer never joins) and must
not keep a process alive that has nothing left to do. Past the deadline it says so on stderr and lets
the process end with the script's own exit code.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack

from spread import env

EXIT_TIMEOUT_ENV = env.EXIT_TIMEOUT
DEFAULT_EXIT_TIMEOUT = 10.0


def exit_timeout() -> float:
    """Seconds the release at interpreter exit may take (``SPREAD_EXIT_TIMEOUT``, default 10)."""
    raw = os.environ.get(EXIT_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_EXIT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT
    return value if value > 0 else DEFAULT_EXIT_TIMEOUT


class ProcessResources:
    """Release callbacks for what one owner holds in the process, run newest first, exactly once.

    The callbacks must not refer to the owner itself (a strategy dropped without ``close()`` can then
    still be garbage-collected; its resources are released at exit).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner  # named in messages, e.g. "PipelineStrategy rank 1"
        self._stack = ExitStack()
        self._registered = False

    def push(self, release: Callable[[], object]) -> None:
        """Add ``release``; it runs before every callback pushed earlier."""
        self._stack.callback(release)
        if not self._registered:
            atexit.register(self._release_at_exit)
            self._registered = True

    def release(self) -> None:
        """Run every callback now, newest first; the first error is raised after all have run."""
        if self._registered:
            atexit.unregister(self._release_at_exit)
            self._registered = False
        stack, self._stack = self._stack, ExitStack()
        stack.close()

    def _release_at_exit(self) -> None:
        self._registered = False  # atexit has dropped this callback already
        timeout = exit_timeout()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self.release()
            except BaseException as exc:  # reported below; an exit callback must not raise
                failure.append(exc)

        helper = threading.Thread(target=run, name="spread-release-at-exit", daemon=True)
        try:
            helper.start()
        except RuntimeError:  # an interpreter that refuses new threads at exit: release inline
            run()
        else:
            helper.join(timeout)
            if helper.is_alive():
                _warn(
                    f"{self.owner}: releasing its process group and threads at exit took more than "
                    f"{timeout:g}s ({EXIT_TIMEOUT_ENV}); an operation is probably still waiting for a "
                    f"peer. Exiting without waiting for it."
                )
                return
        if failure:
            _warn(f"{self.owner}: error while releasing at exit: {type(failure[0]).__name__}: {failure[0]}")


def _warn(message: str) -> None:
    try:
        sys.stderr.write(f"spread: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr already closed
        pass
