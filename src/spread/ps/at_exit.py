"""Close parameter-server objects when a script ends without closing them.

TensorFlow's parameter-server examples never close anything, so a strategy, a coordinator or a
client left open must be closed by the interpreter's exit, reliably, or the servers are never told
to stop and the job never ends.

Why not :mod:`atexit` (or ``weakref.finalize``, which runs from it): Python runs those callbacks
only after ``threading._shutdown`` has shut down every ``concurrent.futures`` thread pool (a later
``submit`` raises "cannot schedule new futures after shutdown": the client could not reach the
servers) and joined every non-daemon thread (a coordinator's session threads wait for the very
``shutdown()`` the callback would make: the process never ends). Why not daemon threads: the pools
belong to ``concurrent.futures`` and gRPC, and a daemon thread killed mid-call would leave the
servers unaware anyway. ``threading._register_atexit`` callbacks run at the start of
``threading._shutdown``, before both, last registered first; ``concurrent.futures`` registers its
own pool shutdown there when it is imported, which is before any of ours, so ours run while every
pool still works. It is a CPython internal (3.9 and later); where it is missing, :mod:`atexit` is
the fallback.

Closers run newest first (a coordinator before the strategy it schedules on). A closer that fails
is reported on one line, the others still run, and the process then exits with status 1: a job
whose closing failed must not look successful.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()
_closers: list[tuple[str, Callable[[bool], None]]] = []
_installed = False


class ExitHandle:
    """Returned by :func:`close_at_exit`; :meth:`cancel` once the object was closed explicitly."""

    def __init__(self, entry: tuple[str, Callable[[bool], None]]) -> None:
        self._entry = entry

    def cancel(self) -> None:
        with _lock:
            if self._entry in _closers:
                _closers.remove(self._entry)


def close_at_exit(what: str, close: Callable[[bool], None]) -> ExitHandle:
    """Call ``close(failing)`` when the interpreter exits, before Python shuts thread pools down.

    ``failing`` is True when the script is ending with an uncaught exception (Python has printed
    it), so a closer can skip work that only makes sense after a successful run. ``what`` names the
    object in the message printed if ``close`` fails.
    """
    global _installed
    entry = (what, close)
    with _lock:
        if not _installed:
            register = getattr(threading, "_register_atexit", None)
            try:
                if register is None:
                    raise RuntimeError("no threading._register_atexit")
                register(_run_closers)
            except RuntimeError:  # missing, or the interpreter is already shutting down
                atexit.register(_run_closers)
            _installed = True
        _closers.append(entry)
    return ExitHandle(entry)


def script_failed() -> bool:
    """Whether the main script ended with an uncaught exception (set by Python before it exits)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _run_closers() -> None:
    failing = script_failed()
    failed = False
    while True:
        with _lock:
            if not _closers:
                break
            what, close = _closers.pop()
        try:
            close(failing)
        except BaseException as exc:  # every closer must run; the exit status says one failed
            failed = True
            print(f"spread: {what}: closing at exit failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if failed:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)
