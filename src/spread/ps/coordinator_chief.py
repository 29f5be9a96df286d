"""The chief's side of ``ClusterCoordinator``: a task queue served to the workers' sessions.

Each worker holds one streaming call (a *session*) to the chief's RPC server and runs one task at a
time: the session hands it the next queued task, waits for its ``report``, then hands it the next.
When a session ends with its task unreported (the worker died), the task goes back to the front of
the queue; with ``task_timeout``, a task that runs too long is taken from its worker (the session
ends) and rerun elsewhere, and fails after ``max_task_attempts`` such attempts. Every task carries a
step id of its own (:mod:`spread.ps.step_ids`), the same on every attempt, so the servers apply its
push once however often it runs.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import sys
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from spread.errors import SpreadError
from spread.ps.at_exit import close_at_exit
from spread.ps.coordinator_tasks import (
    DatasetSource,
    FunctionReference,
    PerWorkerDataset,
    RemoteValue,
    decode_value,
    encode_value,
)
from spread.ps.rpc_api import CallContext, Message, RequestRefused, RpcServer
from spread.ps.step_ids import StepId
from spread.ps.transports import get_transport
from spread.ps.wire import Tensors

_TICK = 0.1
_STOP_GRACE = 10.0  # seconds shutdown() lets connected workers' sessions say "stop"


@dataclass
class _Task:
    task_id: int
    function: FunctionReference
    args: Any
    tensors: Tensors
    value: RemoteValue
    attempts: int = 0
    workers: list[int] = field(default_factory=list)
    timeouts: int = 0


class ChiefCoordinator:
    """Queues tasks and serves them to the workers' sessions at ``address`` (started at once).

    Args:
        address: ``host:port`` the workers reach the chief at.
        token: the job token (workers take tasks only from a server that proves it).
        transport: the RPC layer's name (:mod:`spread.ps.transports`).
        worker_ranks: the worker tasks' ranks; :meth:`shutdown` waits for each to have connected
            once (so each is told to stop), up to ``late_worker_timeout`` seconds.
        worker_timeout, task_timeout, max_task_attempts: as in ``ClusterCoordinator``.
    """

    def __init__(
        self,
        *,
        address: str,
        token: str,
        transport: str,
        worker_ranks: Sequence[int],
        late_worker_timeout: float,
        worker_timeout: float,
        task_timeout: float | None,
        max_task_attempts: int,
    ) -> None:
        self.worker_timeout = worker_timeout
        self.task_timeout = task_timeout
        self.max_task_attempts = max_task_attempts
        self._worker_ranks = worker_ranks
        self._late_worker_timeout = late_worker_timeout
        self._lock = threading.Condition()
        self._queue: collections.deque[_Task] = collections.deque()
        self._tasks: dict[int, _Task] = {}
        self._ids = itertools.count()
        self._datasets = itertools.count()
        self._step_session = secrets.token_hex(4)  # this coordinator's step ids: <session>:<task id>
        self._inflight: dict[int, _Task | None] = {}  # by session (a worker may reconnect)
        self._session_ids = itertools.count()
        self._stopping = False
        self._closed = False
        self.scheduled = self.completed = self.rescheduled = self.workers_lost = self.timed_out = 0
        self.sessions: collections.Counter[int] = collections.Counter()  # sessions opened, by worker rank
        self.server: RpcServer = (
            get_transport(transport)
            .server(
                "coordinator (chief)",
                {"report": self._report},
                stream_handlers={"session": self._session},
                token=token,
                address=address,
            )
            .start()
        )
        self._at_exit = close_at_exit(
            "the chief's ClusterCoordinator",
            lambda failing: self._shutdown(wait_for_late_workers=not failing),
        )

    # -- the coordinator's API, chief side -----------------------------------------------------------
    def create_per_worker_dataset(self, source: DatasetSource) -> PerWorkerDataset:
        """The chief only numbers datasets; each worker builds its own from the same call."""
        return PerWorkerDataset(next(self._datasets))

    def schedule(self, reference: FunctionReference, args: tuple, kwargs: dict | None) -> RemoteValue:
        """Queue a task naming ``reference`` (the worker checks it is a function it may run)."""
        tensors: Tensors = {}
        encoded = encode_value((list(args), dict(kwargs or {})), tensors)
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
        """Tell every worker to stop (late ones included), stop serving. Idempotent."""
        self._shutdown(wait_for_late_workers=True)

    def _shutdown(self, *, wait_for_late_workers: bool) -> None:
        if self._closed:
            return
        self._at_exit.cancel()
        with self._lock:
            self._closed = True
            self._stopping = True
            self._lock.notify_all()
        now = time.monotonic()
        deadline = now + _STOP_GRACE
        late_deadline = now + (self._late_worker_timeout if wait_for_late_workers else 0.0)
        with self._lock:
            while True:  # let sessions say "stop" first, late workers included
                now = time.monotonic()
                never_connected = [rank for rank in self._worker_ranks if not self.sessions[rank]]
                if not (self._inflight and now < deadline) and not (never_connected and now < late_deadline):
                    break
                self._lock.wait(_TICK)
        if never_connected and wait_for_late_workers:
            print(
                f"spread: the chief's coordinator: worker(s) of rank(s) {never_connected} never connected "
                f"within {self._late_worker_timeout:g}s; stopping without them",
                file=sys.stderr,
                flush=True,
            )
        self.server.stop()

    # -- the protocol: one session per worker connection, and its reports -------------------------------
    def _session(
        self, meta: dict[str, Any], tensors: Tensors, ctx: CallContext
    ) -> Generator[Message, None, None]:
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
            step_id = StepId(task=None, session=self._step_session, number=task.task_id)
            yield (
                {
                    "op": "task",
                    "id": task.task_id,
                    "step_id": step_id.encode(),
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
        assert self.task_timeout is not None
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
                raise RequestRefused(f"unknown task {meta['id']}")
            if not task.value.done():  # a re-run's report after the first one counts once
                value = decode_value(meta.get("result"), tensors) if meta.get("ok") else None
                task.value._set(value, None if meta.get("ok") else str(meta.get("error")))
                self.completed += 1
            self._lock.notify_all()
        return {"ok": True}, {}
