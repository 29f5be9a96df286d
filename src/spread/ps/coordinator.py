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

Layout: this class is the public face; :mod:`spread.ps.coordinator_chief` holds the chief's side
(the task queue and the workers' sessions), :mod:`spread.ps.coordinator_worker` the worker's (running
tasks), :mod:`spread.ps.coordinator_tasks` what travels between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from spread.cluster import ClusterSpec
from spread.errors import SpreadError
from spread.ps.client import PSClient
from spread.ps.coordinator_chief import ChiefCoordinator
from spread.ps.coordinator_tasks import (
    DatasetSource,
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
    function_reference,
)
from spread.ps.coordinator_worker import TaskRunner, WorkerCoordinator

DEFAULT_WORKER_TIMEOUT = 300.0

__all__ = ["ClusterCoordinator", "PerWorkerDataset", "PerWorkerIterator", "RemoteValue"]


class CoordinatedStrategy(TaskRunner, Protocol):
    """What ``ClusterCoordinator`` needs of its strategy (``ParameterServerStrategy``)."""

    cluster: ClusterSpec
    job_token: str
    transport: str
    client: PSClient

    def leave_worker_shutdown_to_coordinator(self) -> None: ...


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
        strategy: CoordinatedStrategy,
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
        self._chief: ChiefCoordinator | None = None
        self._worker: WorkerCoordinator | None = None
        if self.role == "chief":
            strategy.leave_worker_shutdown_to_coordinator()
            self._chief = ChiefCoordinator(
                address=self.chief_address,
                token=strategy.job_token,
                transport=strategy.transport,
                worker_ranks=range(1, cluster.world_size),
                late_worker_timeout=strategy.init_timeout,
                worker_timeout=worker_timeout,
                task_timeout=task_timeout,
                max_task_attempts=max_task_attempts,
            )
        elif self.role == "worker":
            self._worker = WorkerCoordinator(
                strategy,
                chief_address=self.chief_address,
                token=strategy.job_token,
                transport=strategy.transport,
                call_timeout=strategy.client.timeout,
                task_timeout=task_timeout,
            )
        else:
            raise SpreadError(f"ClusterCoordinator runs on the chief and worker tasks, not on a {self.role}")

    def create_per_worker_dataset(self, dataset_fn: DatasetSource) -> PerWorkerDataset:
        """A dataset each worker builds for itself (``dataset_fn()`` is called on the worker, lazily).

        Iterators over it restart when exhausted (each worker cycles through its data).
        """
        if self._worker is not None:
            return self._worker.create_per_worker_dataset(dataset_fn)
        return self._chief_side("create_per_worker_dataset").create_per_worker_dataset(dataset_fn)

    def schedule(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns its :class:`RemoteValue` at once.

        On a worker task this call serves the chief's tasks and ends the process when told to stop;
        the chief may then name only functions of ``fn``'s module (or of the script).
        """
        reference = function_reference(fn)
        if self._worker is not None:
            self._serve(script_module=reference[0])
        return self._chief_side("schedule").schedule(reference, args, kwargs)

    def join(self, timeout: float | None = None) -> None:
        """Wait until every scheduled task finished; raise the first task error.

        Fails if no worker has been connected for ``worker_timeout`` seconds while tasks are pending.
        On a worker task, serves the chief's tasks like :meth:`schedule`.
        """
        if self._worker is not None:
            self._serve()
        self._chief_side("join").join(timeout)

    def done(self) -> bool:
        return self._chief_side("done").done()

    def stats(self) -> dict[str, int]:
        """scheduled, completed, rescheduled (a worker died or timed out), workers_lost, timed_out
        (task attempts given up after ``task_timeout``), sessions opened."""
        return self._chief_side("stats").stats()

    def shutdown(self) -> None:
        """Tell every worker to stop, stop serving, release every thread and socket. Idempotent.

        A worker that never connected (it started late, after the others did all the work) is
        waited for as long as a worker waits for the chief (the strategy's ``init_timeout``), so it
        too is told to stop instead of waiting for a chief that is gone. Nothing to do on a worker.
        """
        if self._chief is not None:
            self._chief.shutdown()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _serve(self, script_module: str | None = None) -> NoReturn:
        assert self._worker is not None
        self._worker.serve(script_module=script_module)

    def _chief_side(self, op: str) -> ChiefCoordinator:
        if self._chief is None:
            raise SpreadError(f"ClusterCoordinator.{op} runs on the chief, not on a {self.role} task")
        return self._chief
