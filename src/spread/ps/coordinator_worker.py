"""The worker's side of ``ClusterCoordinator``: run the chief's tasks until told to stop, then exit.

The worker opens one session (a streaming call) to the chief, which must prove the job token
(:mod:`spread.ps.rpc_api`), runs each task it is handed (only functions of its own script's modules:
:func:`~spread.ps.coordinator_tasks.resolve_function`), pushes under the task's step id, and reports
the result. The chief saying "stop", or ending the session, ends the process (``SystemExit(0)``),
like a TF worker server.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, NoReturn, Protocol

from spread.errors import RemoteCallError
from spread.ps.coordinator_tasks import (
    DatasetSource,
    PerWorkerDataset,
    decode_value,
    encode_value,
    resolve_function,
)
from spread.ps.rpc_api import RpcClient
from spread.ps.step_ids import StepId
from spread.ps.transports import get_transport
from spread.ps.wire import Tensors


class TaskRunner(Protocol):
    """What the worker side needs of its strategy (``ParameterServerStrategy``)."""

    init_timeout: float  # how long the worker waits for the chief to start

    @property
    def rank(self) -> int: ...

    def close(self) -> None: ...

    def running_task(self, step_id: StepId) -> AbstractContextManager[None]:
        """Pushes made inside carry ``step_id`` (applied once however often the task reruns)."""
        ...


class WorkerCoordinator:
    """Serves the chief at ``chief_address``: see :meth:`serve`.

    Args:
        strategy: runs the tasks' pushes (and is closed when the worker stops).
        chief_address, token, transport: where the chief is, the job token, the RPC layer's name.
        call_timeout: deadline of each report to the chief.
        task_timeout: the chief's ``task_timeout``: a report failing after a task ran longer than
            it means the chief gave up on this worker (and may be gone), so the worker stops.
    """

    def __init__(
        self,
        strategy: TaskRunner,
        *,
        chief_address: str,
        token: str,
        transport: str,
        call_timeout: float,
        task_timeout: float | None,
    ) -> None:
        self.strategy = strategy
        self.chief_address = chief_address
        self.task_timeout = task_timeout
        self._token = token
        self._transport = get_transport(transport)
        self._call_timeout = call_timeout
        self._datasets: list[DatasetSource] = []
        self._script_modules = {"__main__"}  # where functions the chief names are looked up

    def create_per_worker_dataset(self, source: DatasetSource) -> PerWorkerDataset:
        """Keep ``source`` to build this worker's own dataset when a task first reads it."""
        self._datasets.append(source)
        return PerWorkerDataset(len(self._datasets) - 1)

    def serve(self, *, script_module: str | None = None) -> NoReturn:
        """Run the chief's tasks until told to stop, then end this worker process.

        ``script_module``: a module whose functions the chief may name too (that of the function
        the script handed to ``schedule``).
        """
        if script_module is not None:
            self._script_modules.add(script_module)
        client = self._transport.client(
            self.chief_address,
            peer=f"the chief (coordinator at {self.chief_address})",
            token=self._token,
            timeout=self._call_timeout,
        )
        iterators: dict[int, Iterator[Any]] = {}
        try:
            stream = client.stream(
                "session", {"worker": self.strategy.rank}, connect_timeout=self.strategy.init_timeout
            )
            for meta, tensors in stream:
                if meta.get("op") == "stop" or not self._run_task(client, meta, tensors, iterators):
                    break
        finally:
            client.close()
        self.strategy.close()
        raise SystemExit(0)

    def _run_task(
        self, client: RpcClient, meta: dict[str, Any], tensors: Tensors, iterators: dict[int, Iterator[Any]]
    ) -> bool:
        """Run one task and report it; False when this worker should stop serving."""
        strategy = self.strategy
        ok, error, result_meta = True, None, None
        result_tensors: Tensors = {}
        started = time.monotonic()
        try:
            fn = resolve_function(*meta["function"], modules=self._script_modules)
            args, kwargs = decode_value(meta["args"], tensors, lambda i: self._iterator(i, iterators))
            with strategy.running_task(StepId.decode(str(meta["step_id"]))):
                value = fn(*args, **kwargs)
            result_meta = encode_value(value, result_tensors)
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
            iterators[dataset_id] = _Cycle(self._datasets[dataset_id])
        return iterators[dataset_id]


class _Cycle:
    """An iterator over a per-worker dataset that starts over when it runs out."""

    def __init__(self, source: DatasetSource) -> None:
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
