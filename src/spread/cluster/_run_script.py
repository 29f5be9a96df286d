"""Run a rank's script the way ``python script.py`` does, then let torch.distributed go before the
interpreter finalizes. ``spread run`` starts every rank of a script as
``python -u <this file> script.py args...``.

Why: gloo's worker threads drop a finished collective a moment after the caller's ``wait()`` has
returned, and dropping a tensor Python also references takes the GIL. A script that ends right after
its last collective (a ``barrier`` then ``destroy_process_group()``, a DDP model still held by a
global) leaves those threads alive into CPython's finalization, where a thread asking for the GIL is
ended inside a C++ destructor: "terminate called without an active exception", SIGABRT, after a
finished run. torchrun shows it on plain DDP scripts (pytorch/pytorch#190489). A process group's
threads are joined when its last reference goes, so at exit, while the interpreter is still whole,
this runner drops the script's objects and destroys what is left of torch.distributed.

Only the standard library (and :mod:`spread.env`, names only) is imported here: a script may set
``OMP_NUM_THREADS`` or ``CUDA_VISIBLE_DEVICES`` before its own ``import torch``. Scripts that never
import torch.distributed are not touched at exit.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib.machinery
import io
import json
import os
import sys
import threading
import time
import traceback
import types

from spread import env  # names only: imports neither torch nor the rest of spread

EXIT_TIMEOUT_ENV = env.EXIT_TIMEOUT  # the same setting as spread.strategies.teardown
_KEEP_AT_EXIT = (types.ModuleType, types.FunctionType, type, types.BuiltinFunctionType, str, bytes, int)


def _exit_timeout() -> float:
    try:
        value = float(os.environ.get(EXIT_TIMEOUT_ENV, "10"))
    except ValueError:
        return 10.0
    return value if value > 0 else 10.0


def _release_distributed(namespace: dict) -> None:
    """Drop the script's objects (models wrapping process groups), destroy the process groups left,
    and collect, on a helper thread with a deadline: a collective a dead peer never joins must not
    keep a finished process alive. Modules, functions and classes stay, for daemon threads still
    running."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return

    def release() -> None:
        for name in [n for n, v in namespace.items() if not isinstance(v, _KEEP_AT_EXIT)]:
            namespace.pop(name, None)
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    helper = threading.Thread(target=release, name="spread-release-at-exit", daemon=True)
    try:
        helper.start()
    except RuntimeError:  # no new threads at exit: the interpreter finalizes as it would have
        return
    timeout = _exit_timeout()
    helper.join(timeout)
    if helper.is_alive():
        sys.stderr.write(
            f"spread: releasing torch.distributed at exit took more than {timeout:g}s "
            f"({EXIT_TIMEOUT_ENV}); a collective is probably still waiting for a peer. Exiting anyway.\n"
        )


def _record_error(error: BaseException) -> None:
    """Write the exception to ``TORCHELASTIC_ERROR_FILE`` as torch's ``@record`` would (unless the
    script's own ``@record`` already did), with when it was raised and its type, so the launcher can
    name the rank whose failure came first rather than a peer that failed because of it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    now = time.time()
    kind = type(error)
    record = {
        "message": {
            "message": f"{kind.__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(error)),
                "timestamp": str(int(now)),
            },
        },
        "spread": {"exception": f"{kind.__module__}.{kind.__qualname__}", "raised_at": now},
    }
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:  # naming the failure is a courtesy; failing here would hide the real error
        pass


def _interrupted(kind: type[BaseException], error: BaseException, tb: types.TracebackType | None) -> None:
    """Ctrl-C, which ``spread run`` forwards to every rank: one line per rank saying where in the script
    it was, not the traceback of the step each rank was in (~110 lines a rank during ``Trainer.fit``).

    Trimmed here, in the rank, rather than in the launcher's relay: the runner holds the exception
    itself, where the relay would have to hold back and parse each rank's stderr for a traceback that
    ends in ``KeyboardInterrupt``. The exception still propagates through the script (its ``except`` and
    ``finally`` blocks run) and python still exits as on any Ctrl-C (killed by SIGINT after ``atexit``);
    under plain ``python`` nothing changes.
    """
    frames = traceback.extract_tb(tb) if tb is not None else []
    script = os.path.abspath(sys.argv[0])
    where = [f for f in frames if os.path.abspath(f.filename) == script][-1:] or frames[-1:]
    at = f" (at {where[0].filename}:{where[0].lineno}, in {where[0].name})" if where else ""
    lines = traceback.format_exception_only(kind, error)
    sys.stderr.write(lines[0].rstrip("\n") + at + "\n" + "".join(lines[1:]))


def _script_module(path: str) -> types.ModuleType:
    """A fresh ``__main__`` as CPython builds it for ``python path``."""
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__dict__.update(__cached__=None, __builtins__=builtins)
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", main.__file__)
    main.__spec__ = None
    return main


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: python {__file__} SCRIPT [ARGS...]")
    sys.argv = sys.argv[1:]
    path = os.path.abspath(sys.argv[0])  # as python names a script: __file__ and tracebacks
    sys.path[0] = os.path.dirname(os.path.realpath(path))  # the script's directory, not this one's
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    module = _script_module(path)
    sys.modules["__main__"] = module
    atexit.register(_release_distributed, module.__dict__)  # registered first: runs after the script's
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.excepthook = _interrupted  # printed by python, which then exits as it does on Ctrl-C
        raise
    except BaseException as error:  # print it as python would, without this runner's frames
        outer = error.__traceback__
        error = error.with_traceback(outer.tb_next if outer else None)
        _record_error(error)
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)


if __name__ == "__main__":
    main()
