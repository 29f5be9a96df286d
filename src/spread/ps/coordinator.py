"""``ClusterCoordinator``: the chief schedules step functions on workers, like TF's coordinator.

The same script runs on every task. On the chief, ``schedule(fn, args)`` queues a task and returns a
:class:`RemoteValue` at once; ``join()`` waits for every scheduled task. On a worker, the first
``schedule`` call (or ``join``) never returns: the worker serves the chief's tasks until the chief
shuts the coordinator down, then exits (``SystemExit(0)``), like a TF worker server.

What travels is a *reference*, never code: the function's module and qualified name (it must be a
module-level function of a module the worker has already imported, normally the script itself) and
its arguments as tensors and JSON values, or per-worker iterators (``create_per_worker_dataset``).

Trust: a worker takes tasks only from a chief that proved the job token in a session of its own
(:mod:`spread.ps.rpc_api`: a process at the chief's address without the token, or replaying what it
recorded, gets nothing run). And even the chief can name only plain Python functions defined in the
modules whose functions this worker handed to ``schedule`` (normally the script, ``__main__``, which
is always one): never a builtin (``builtins.exec``), a library function, a class or an object
imported into the script from elsewhere, and a name never causes an import. Why modules, not the
functions themselves: a worker serves from its first ``schedule`` call on, so it never reaches the
script's later calls (TensorFlow's tutorial schedules an evaluation step after training).

Ending: on the chief, a coordinator that is not shut down is shut down when the script ends
(:mod:`spread.ps.at_exit`), so the workers are told to stop and the job ends by itself.

Failure handling: each worker holds one streaming call to the chief and runs one task at a time. If
the worker dies, the chief sees the stream end and puts the worker's in-flight task back at the
front of the queue (``rescheduled``); a restarted worker opens a new stream and gets work again. A
task's gradient push carries the task's step id, so when a task ran on a worker that died after
pushing, the re-run's push is ignored by the servers: **every scheduled step is applied exactly
once**. An error raised inside a task (a dead parameter server included) fails that task's
``RemoteValue`` and is raised by ``join()``.

A worker that is alive but stuck (its stream open, its task never reported) would hang ``join()``
forever; with ``task_timeout`` the chief gives up on that worker after so many seconds, closes its
stream (the worker exits when it comes back) and reruns the task elsewhere, still exactly once
thanks to the step id; after ``max_task_attempts`` timed-out attempts the task fails with an error
naming it, the workers it ran on and the timeout.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from spread.errors import RemoteCallError, SpreadError
from spread.ps.at_exit import close_at_exit
from spread.ps.transports import DEFAULT_TRANSPORT, rpc_module
from spread.ps.wire import Tensors
from spread.ps.zmq_transport import CallContext, Message

DEFAULT_WORKER_TIMEOUT = 300.0
_TICK = 0.1


class RemoteValue:
    """The result of a scheduled function, available once a worker ran it (``fetch``)."""

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self._done = threading.Event()
        self._value: Any = None
        self._error: str | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def fetch(self, timeout: float | None = None) -> Any:
        """The function's return value; raises :class:`SpreadError` if it raised on the worker."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"task {self.task_id} did not finish within {timeout}s")
        if self._error is not None:
            raise SpreadError(f"task {self.task_id} failed on a worker: {self._error}")
        return self._value

    def _set(self, value: Any, error: str | None) -> None:
        self._value, self._error = value, error
        self._done.set()


@dataclass(frozen=True)
class PerWorkerIterator:
    """Stands for each worker's own iterator over a per-worker dataset, when passed to ``schedule``."""

    dataset_id: int

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError("a per-worker iterator is read inside a scheduled function, on a worker")


@dataclass(frozen=True)
class PerWorkerDataset:
    """A dataset built on each worker by ``dataset_fn``; ``iter()`` it to pass to scheduled functions."""

    dataset_id: int

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self.dataset_id)


@dataclass
class _Task:
    task_id: int
    function: tuple[str, str]
    args: Any
    tensors: Tensors
    value: RemoteValue
    attempts: int = 0
    workers: list[int] = field(default_factory=list)
    timeouts: int = 0


class ClusterCoordinator:
    """Schedule functions on the workers of a :class:`ParameterServerStrategy` job.

    Args:
        strategy: the job's ``ParameterServerStrategy`` (created first, on every task).
        worker_timeout: seconds ``join()`` waits while no worker is connected before failing.
        task_timeout: seconds one attempt of a task may run on a worker before the chief gives up on
            that worker and reruns the task on another (None: no limit, as in TensorFlow).
        max_task_attempts: timed-out attempts after which the task fails instead of running again.
    """

    def __init__(
        self,
        strategy: Any,
        *,
        worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
        task_timeout: float | None = None,
        max_task_attempts: int = 3,
    ) -> None:
        if task_timeout is not None and not task_timeout > 0:
            raise ValueError(f"task_timeout must be positive seconds or None, got {task_timeout!r}")
        if not isinstance(max_task_attempts, int) or max_task_attempts < 1:
            raise ValueError(f"max_task_attempts must be a positive integer, got {max_task_attempts!r}")
        self.strategy = strategy
        cluster = strategy.cluster
        chiefs = cluster.cluster.get("chief", ())
        if not chiefs:
            raise SpreadError("ClusterCoordinator needs a chief task in the cluster (TF_CONFIG 'chief')")
        self.chief_address = chiefs[0]
        self.role = cluster.role
        self.worker_timeout = worker_timeout
        self.task_timeout = task_timeout
        self.max_task_attempts = max_task_attempts
        self._token = strategy.job_token
        self._rpc = rpc_module(getattr(strategy, "transport", DEFAULT_TRANSPORT))
        self._dataset_builders: list[Callable[[], Iterable[Any]] | Iterable[Any]] = []
        self._script_modules = {"__main__"}  # where a worker looks up scheduled functions
        self._closed = False
        if self.role == "chief":
            self._lock = threading.Condition()
            self._queue: collections.deque[_Task] = collections.deque()
            self._tasks: dict[int, _Task] = {}
            self._ids = itertools.count()
            self._nonce = secrets.token_hex(4)
            self._inflight: dict[int, _Task | None] = {}  # by session (a worker may reconnect)
            self._session_ids = itertools.count()
            self._stopping = False
            self.scheduled = self.completed = self.rescheduled = self.workers_lost = self.timed_out = 0
            self.sessions: collections.Counter[int] = collections.Counter()
            strategy.wait_for_workers_on_close = False  # workers finish when this coordinator says so
            self._server = self._rpc.RpcServer(
                "coordinator (chief)",
                {"report": self._report},
                stream_handlers={"session": self._session},
                token=self._token,
                address=self.chief_address,
            ).start()
            self._at_exit = close_at_exit(
                "the chief's ClusterCoordinator",
                lambda failing: self._shutdown(wait_for_late_workers=not failing),
            )
        elif self.role != "worker":
            raise SpreadError(f"ClusterCoordinator runs on the chief and worker tasks, not on a {self.role}")

    # -- the chief's API ---------------------------------------------------------------------------
    def create_per_worker_dataset(
        self, dataset_fn: Callable[[], Iterable[Any]] | Iterable[Any]
    ) -> PerWorkerDataset:
        """A dataset each worker builds for itself (``dataset_fn()`` is called on the worker, lazily).

        Iterators over it restart when exhausted (each worker cycles through its data).
        """
        self._dataset_builders.append(dataset_fn)
        return PerWorkerDataset(len(self._dataset_builders) - 1)

    def schedule(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns its :class:`RemoteValue` at once.

        On a worker task this call serves the chief's tasks and ends the process when told to stop;
        the chief may then name only functions of ``fn``'s module (or of the script).
        """
        reference = _function_reference(fn)
        if self.role == "worker":
            self._script_modules.add(reference[0])
            self._serve()
        return self._enqueue(reference, args, kwargs)

    def _enqueue(self, reference: tuple[str, str], args: tuple, kwargs: dict | None) -> RemoteValue:
        """Queue a task naming ``reference`` (checked by :meth:`schedule`, and again by the worker)."""
        tensors: Tensors = {}
        encoded = _encode((list(args), dict(kwargs or {})), tensors)
        with self._lock:
            if self._closed:
                raise SpreadError("the coordinator was shut down")
            task_id = next(self._ids)
            task = _Task(task_id, reference, encoded, tensors, RemoteValue(task_id))
            self._tasks[task_id] = task
            self._queue.append(task)
            self.scheduled += 1
            self._lock.notify_all()
        return task.value

    def join(self, timeout: float | None = None) -> None:
        """Wait until every scheduled task finished; raise the first task error.

        Fails if no worker has been connected for ``worker_timeout`` seconds while tasks are pending.
        """
        if self.role == "worker":
            self._serve()
        deadline = None if timeout is None else time.monotonic() + timeout
        idle_since: float | None = None
        with self._lock:
            while self.completed < self.scheduled:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"join: {self.scheduled - self.completed} task(s) still pending after {timeout}s"
                    )
                if not self._inflight:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > self.worker_timeout:
                        raise SpreadError(
                            f"join: no worker connected for {self.worker_timeout:g}s with "
                            f"{self.scheduled - self.completed} task(s) pending"
                        )
                else:
                    idle_since = None
                self._lock.wait(_TICK)
            failed = next((t for t in self._tasks.values() if t.value._error is not None), None)
        if failed is not None:
            failed.value.fetch()

    def done(self) -> bool:
        with self._lock:
            return self.completed == self.scheduled

    def stats(self) -> dict[str, int]:
        """scheduled, completed, rescheduled (a worker died or timed out), workers_lost, timed_out
        (task attempts given up after ``task_timeout``), sessions opened."""
        with self._lock:
            return {
                "scheduled": self.scheduled,
                "completed": self.completed,
                "rescheduled": self.rescheduled,
                "workers_lost": self.workers_lost,
                "timed_out": self.timed_out,
                "sessions": sum(self.sessions.values()),
            }

    def shutdown(self) -> None:
        """Tell every worker to stop, stop serving, release every thread and socket. Idempotent.

        A worker that never connected (it started late, after the others did all the work) is
        waited for as long as a worker waits for the chief (the strategy's ``init_timeout``), so it
        too is told to stop instead of waiting for a chief that is gone.
        """
        self._shutdown(wait_for_late_workers=True)

    def _shutdown(self, *, wait_for_late_workers: bool) -> None:
        if self._closed or self.role != "chief":
            return
        self._at_exit.cancel()
        with self._lock:
            self._closed = True
            self._stopping = True
            self._lock.notify_all()
        now = time.monotonic()
        deadline = now + 10.0
        late_deadline = now + (self.strategy.init_timeout if wait_for_late_workers else 0.0)
        expected = range(1, self.strategy.cluster.world_size)  # the worker tasks' ranks
        with self._lock:
            while True:  # let sessions say "stop" first, late workers included
                now = time.monotonic()
                never_connected = [rank for rank in expected if not self.sessions[rank]]
                if not (self._inflight and now < deadline) and not (never_connected and now < late_deadline):
                    break
                self._lock.wait(_TICK)
        if never_connected and wait_for_late_workers:
            print(
                f"spread: the chief's coordinator: worker(s) of rank(s) {never_connected} never connected "
                f"within {self.strategy.init_timeout:g}s; stopping without them",
                file=sys.stderr,
                flush=True,
            )
        self._server.stop()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- chief side of the protocol ----------------------------------------------------------------
    def _session(self, meta: dict[str, Any], tensors: Tensors, ctx: CallContext) -> Iterator[Message]:
        worker = int(meta.get("worker", -1))
        with self._lock:
            session = next(self._session_ids)
            self._inflight[session] = None
            self.sessions[worker] += 1
        ctx.on_end(lambda: self._session_ended(session))
        while True:
            with self._lock:
                task = self._next_task(ctx)
                if task is None:
                    stop = self._stopping
                else:
                    self._inflight[session] = task
                    task.attempts += 1
                    task.workers.append(worker)
            if task is None:
                if stop:
                    yield {"op": "stop"}, {}
                return
            yield (
                {
                    "op": "task",
                    "id": task.task_id,
                    "step_id": f"{self._nonce}:{task.task_id}",
                    "function": list(task.function),
                    "args": task.args,
                },
                task.tensors,
            )
            started = time.monotonic()
            with self._lock:
                while not task.value.done() and ctx.is_active():
                    if self.task_timeout is not None and time.monotonic() - started > self.task_timeout:
                        self._give_up_on(session, task, worker)
                        return  # ends this worker's stream: it exits when its task comes back
                    self._lock.wait(_TICK)
                if not task.value.done():
                    return  # the worker is gone; _session_ended puts the task back
                self._inflight[session] = None

    def _next_task(self, ctx: CallContext) -> _Task | None:
        """The next undone task, or None when stopping or the worker went away (lock held)."""
        while True:
            while self._queue and self._queue[0].value.done():
                self._queue.popleft()
            if self._queue and not self._stopping:
                return self._queue.popleft()
            if (self._stopping and not self._queue) or not ctx.is_active():
                return None
            if self._stopping:
                return None
            self._lock.wait(_TICK)

    def _give_up_on(self, session: int, task: _Task, worker: int) -> None:
        """``task`` ran past ``task_timeout`` on ``worker``: rerun it elsewhere, or fail it (lock held)."""
        self._inflight[session] = None  # not put back again when the session ends
        self.timed_out += 1
        task.timeouts += 1
        if task.timeouts >= self.max_task_attempts:
            task.value._set(
                None,
                f"TaskTimeout: task {task.task_id} ran longer than task_timeout={self.task_timeout:g}s on "
                f"each of {task.timeouts} attempt(s) (workers {task.workers}); the worker is stuck or "
                f"the step is slower than the timeout allows",
            )
            self.completed += 1
        else:
            print(
                f"spread: task {task.task_id} ran longer than {self.task_timeout:g}s on worker {worker}; "
                f"dropping that worker and running the task again",
                file=sys.stderr,
                flush=True,
            )
            self._queue.appendleft(task)
            self.rescheduled += 1
        self._lock.notify_all()

    def _session_ended(self, session: int) -> None:
        with self._lock:
            task = self._inflight.pop(session, None)
            if task is not None and not task.value.done():
                self._queue.appendleft(task)
                self.rescheduled += 1
                self.workers_lost += 1
            elif not self._stopping:
                self.workers_lost += 1
            self._lock.notify_all()

    def _report(self, meta: dict[str, Any], tensors: Tensors) -> Message:
        with self._lock:
            task = self._tasks.get(int(meta["id"]))
            if task is None:
                raise self._rpc.RequestRefused(f"unknown task {meta['id']}")
            if not task.value.done():  # a re-run's report after the first one counts once
                value = _decode(meta.get("result"), tensors) if meta.get("ok") else None
                task.value._set(value, None if meta.get("ok") else str(meta.get("error")))
                self.completed += 1
            self._lock.notify_all()
        return {"ok": True}, {}

    # -- worker side -------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Run the chief's tasks until told to stop, then end this worker process."""
        strategy = self.strategy
        client = self._rpc.RpcClient(
            self.chief_address,
            peer=f"the chief (coordinator at {self.chief_address})",
            token=self._token,
            timeout=strategy.client.timeout,
        )
        iterators: dict[int, Iterator[Any]] = {}
        try:
            stream = client.stream(
                "session", {"worker": strategy.rank}, connect_timeout=strategy.init_timeout
            )
            for meta, tensors in stream:
                if meta.get("op") == "stop" or not self._run_task(client, meta, tensors, iterators):
                    break
        finally:
            client.close()
        strategy.close()
        raise SystemExit(0)

    def _run_task(self, client: Any, meta: dict, tensors: Tensors, iterators: dict) -> bool:
        """Run one task and report it; False when this worker should stop serving."""
        strategy = self.strategy
        ok, error, result_meta, result_tensors = True, None, None, {}
        started = time.monotonic()
        try:
            fn = _resolve_function(*meta["function"], modules=self._script_modules)
            args, kwargs = _decode(meta["args"], tensors, lambda i: self._iterator(i, iterators))
            strategy.task_step_id = str(meta["step_id"])
            try:
                value = fn(*args, **kwargs)
            finally:
                strategy.task_step_id = None
            result_meta = _encode(value, result_tensors)
        except Exception as exc:  # reported to the chief (a dead parameter server included)
            ok, error = False, f"{type(exc).__name__}: {exc}"
        try:
            client.call(
                "report", {"id": meta["id"], "ok": ok, "error": error, "result": result_meta}, result_tensors
            )
        except RemoteCallError:
            took = time.monotonic() - started
            if self.task_timeout is None or took <= self.task_timeout:
                raise
            # The chief gave up on this worker after task_timeout and may have finished since.
            print(
                f"spread: worker {strategy.rank}: task {meta['id']} took {took:.1f}s, past task_timeout="
                f"{self.task_timeout:g}s; the chief dropped this worker and is gone, so it stops",
                file=sys.stderr,
                flush=True,
            )
            return False
        return True

    def _iterator(self, dataset_id: int, iterators: dict[int, Iterator[Any]]) -> Iterator[Any]:
        if dataset_id not in iterators:
            iterators[dataset_id] = _Cycle(self._dataset_builders[dataset_id])
        return iterators[dataset_id]


class _Cycle:
    """An iterator over a per-worker dataset that starts over when it runs out."""

    def __init__(self, source: Callable[[], Iterable[Any]] | Iterable[Any]) -> None:
        self._data = source() if callable(source) else source
        self._it = iter(self._data)

    def __iter__(self) -> _Cycle:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self._data)
            return next(self._it)


# -- references and values on the wire ---------------------------------------------------------------
def _function_reference(fn: Callable[..., Any]) -> tuple[str, str]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or not _is_own_function(_lookup(module, qualname), module, qualname):
        raise ValueError(
            f"schedule() needs a module-level Python function that workers can find by name; got {fn!r}. "
            f"Define it at the top level of the script (workers run the same script)."
        )
    if _lookup(module, qualname) is not fn:
        raise ValueError(f"schedule() got {fn!r}, but {module}.{qualname} is another object")
    return module, qualname


def _is_own_function(obj: Any, module: str, qualname: str) -> bool:
    """A plain Python function defined where its name says (not a builtin, a class, or a function
    of another module reached through an attribute or an import into this one)."""
    return isinstance(obj, types.FunctionType) and obj.__module__ == module and obj.__qualname__ == qualname


def _lookup(module: str, qualname: str) -> Any:
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _resolve_function(module: str, qualname: str, *, modules: set[str]) -> Callable[..., Any]:
    """The function the chief named, if it is one this worker may run: a plain Python function
    defined in one of ``modules`` (the script's); a name never causes an import."""
    module, qualname = str(module), str(qualname)
    fn = _lookup(module, qualname) if module in modules and "<" not in qualname else None
    if not _is_own_function(fn, module, qualname):
        raise SpreadError(
            f"the chief scheduled {module}.{qualname}, which this worker does not run: a worker runs only "
            f"Python functions defined at the top level of its script's modules "
            f"({', '.join(sorted(modules))})"
        )
    return fn


def _encode(value: Any, tensors: Tensors) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach()
        return {"$tensor": key}
    if isinstance(value, PerWorkerIterator):
        return {"$iterator": value.dataset_id}
    if isinstance(value, list | tuple):
        return {"$list": [_encode(v, tensors) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("dict keys in scheduled arguments and results must be strings")
        return {"$dict": {k: _encode(v, tensors) for k, v in value.items()}}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"scheduled arguments and results must be tensors, numbers, strings, lists, dicts or "
        f"per-worker iterators; got {type(value).__name__}"
    )


def _decode(value: Any, tensors: Tensors, iterator: Callable[[int], Any] | None = None) -> Any:
    if isinstance(value, dict):
        if "$tensor" in value:
            return tensors[value["$tensor"]]
        if "$iterator" in value:
            if iterator is None:
                raise SpreadError("a per-worker iterator cannot be returned to the chief")
            return iterator(int(value["$iterator"]))
        if "$list" in value:
            return [_decode(v, tensors, iterator) for v in value["$list"]]
        if "$dict" in value:
            return {k: _decode(v, tensors, iterator) for k, v in value["$dict"].items()}
        raise SpreadError(f"malformed scheduled value {value!r}")
    return value
