"""ParameterServerStrategy: variables live on parameter servers; workers pull, compute, push.

Roles come from the cluster spec (``TF_CONFIG`` or ``spread run --workers W --ps P``):

* ``ps``: constructing the strategy serves this task's shards until the chief says stop, then
  exits the process (``SystemExit(0)``): a parameter server never runs the rest of the script.
* ``chief`` and ``worker`` (the training tasks, ranks ``0..W-1``): variables created in ``scope()``
  are placed on the servers (dense ones whole, balanced by size; embedding tables split by rows);
  the chief sends their initial values, everyone starts from the servers' values.
* ``evaluator``: reads the variables, never pushes.

The optimizer runs on the servers. A training step is the usual ``zero_grad``; ``strategy.run``
(forward and backward); ``optimizer.step()``: under this strategy ``optimizer.step()`` pushes the
gradients (with a step id: servers apply each step id exactly once), receives the fresh variables in
the same round trip, and leaves nothing for the local optimizer to do. An ``nn.Embedding`` created in
the scope pulls only the rows each batch looks up, and pushes only their gradients.

Modes: ``"async"`` (default) applies each worker's push on arrival; ``"sync"`` waits for every
training worker's share of step ``t`` (weighted by its sample count) and applies one update, the same
as one device on the global batch; ``max_staleness=k`` (async) holds back a worker that is more than
``k`` steps ahead of the slowest unfinished one. Async servers scale a gradient by how stale it is
(``stale_gradients="scale"``, the default; :mod:`spread.ps.server` says how and cites the method): a
worker the machine descheduled for seconds no longer undoes the others' progress when it comes back.

Data: ``distribute_dataset`` splits each global batch over the training tasks in both modes (each
task reads its own slice, so an async step of one task sees ``global_batch_size / W`` samples).
Async tasks may read their own ``shard()`` shards, of any sizes (each steps alone); sync mode refuses
them, and both modes refuse a stream without ``shard()`` (see :meth:`_check_data`).
``reduce`` and ``gather`` are local: training tasks never wait for each other, so logs (and
``Trainer.evaluate``) are per task. Buffers (e.g. BatchNorm statistics) are not variables on the
servers: each training task keeps its own, updated by its own batches, and its ``evaluate`` uses
them, consistent with the task's own logs; the chief's are the ones its checkpoints hold. Sharing them
would need a server-side assignment (not a gradient update) that the servers do not have; the
evaluator task keeps the buffers it built. ``sync_batchnorm=True`` is refused: the training tasks
share no collective to exchange statistics with (they only talk to the servers).

Ending: like TensorFlow's, scripts need not call :meth:`close`. A strategy still open when the
script ends is closed then (:mod:`spread.ps.at_exit`, before Python shuts its thread pools down):
a worker tells the servers it is done (or that it failed, when the script raised), and the chief
waits for every training task, then stops the servers, so the whole job ends by itself. A chief
whose script raised does not wait: it stops the servers at once, and the workers' next calls fail
naming them.

A lost server, restored in place: under ``spread run --ps P --recover`` (or ``restore_in_place=True``)
the launcher starts a parameter server that died again at its address, the chief restores its shards
and optimizer state from its latest backup (``BackupAndRestore``, or :meth:`save_servers`), and the
training tasks wait for it (``restore_timeout``) and continue, none of them restarted. Sync mode
replays the steps since the backup to it (the weights equal the uninterrupted run's); async mode
loses that server's updates since the backup. :mod:`spread.ps.in_place` says how and why.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from spread import env
from spread.checkpoint import CheckpointManager
from spread.checkpoint.remote import is_url
from spread.cluster import ClusterSpec, resolve_cluster
from spread.cluster.rendezvous import default_init_timeout
from spread.cluster.threads import share_cores
from spread.data import DistributedDataset, ReplicaLayout, ShardPolicy
from spread.errors import ParameterServerError, SpreadError
from spread.ps.at_exit import close_at_exit
from spread.ps.client import DEFAULT_TIMEOUT, PSClient
from spread.ps.in_place import DEFAULT_RESTORE_TIMEOUT, InPlaceRestore, ReplayLog, ServerBackup
from spread.ps.optimizers import spec_from_torch
from spread.ps.placement import DEFAULT_MIN_SHARD_BYTES, Placement, VariableInfo, place
from spread.ps.restore import BackupId, StartAnnouncements, resume_point
from spread.ps.server import STALE_GRADIENTS, serve
from spread.ps.step_ids import StepId
from spread.ps.transports import DEFAULT_TRANSPORT, TRANSPORTS
from spread.strategies import checkpointing
from spread.strategies.base import Strategy, one_replica_tensor, replica_weights, run_as_replica
from spread.strategies.checkpointing import OBJECTS, Restored, StateLayout
from spread.strategies.process_group import local_device

MODES = ("async", "sync")
T = TypeVar("T")
TOKEN_ENV = env.JOB_TOKEN
_DEFAULT_TOKEN = "spread-default-job-token"


def _default_token(addresses: tuple[str, ...]) -> str:
    """The token when none is set: a fixed one on loopback only; across machines it must be set."""
    remote = [
        a for a in addresses if not a.rsplit(":", 1)[0].strip("[]").startswith(("127.", "localhost", "::1"))
    ]
    if remote:
        raise SpreadError(
            f"parameter servers on other hosts ({', '.join(remote)}) need {TOKEN_ENV} set to the same secret "
            f"on every task; `spread run --ps` sets it for local jobs; export one for TF_CONFIG jobs"
        )
    return _DEFAULT_TOKEN


class ParameterServerStrategy(Strategy):
    """Asynchronous (or synchronous) training against sharded parameter servers.

    Args:
        mode: ``"async"`` or ``"sync"``.
        max_staleness: with ``"async"``, the most steps a worker may run ahead of the slowest one.
        stale_gradients: with ``"async"``, ``"scale"`` (default) damps a gradient that more than
            the usual ``W - 1`` updates overtook, in proportion; ``"apply"`` applies it as it is.
        cluster: the cluster spec; default: resolved from the environment. Must list ``ps`` tasks.
        min_shard_bytes: embedding tables larger than this are split by rows over the servers.
        timeout: seconds for one call to a server; a dead server is reported, named, within it.
        init_timeout: seconds to wait for the servers and the chief's variables at start-up
            (default ``SPREAD_INIT_TIMEOUT`` or 120).
        shutdown_timeout: seconds the chief waits, when closing, for the workers to finish.
        transport: the RPC layer, ``"zmq"`` (ZeroMQ) or ``"grpc"``; default
            ``SPREAD_PS_TRANSPORT`` or ``"zmq"``. Every task of a job must use the same.
        sync_batchnorm: must stay ``False`` (see the module docstring); ``True`` raises.
        restore_in_place: wait for a lost server to be started again and restored from the chief's
            latest backup, then continue (see the module docstring); default: under
            ``spread run --recover`` (``SPREAD_RECOVER=1``), which starts lost servers again.
        restore_timeout: seconds a training task waits for that (default ``SPREAD_PS_RESTORE_TIMEOUT``
            or 120); then it fails naming the server and the operation.
    """

    def __init__(
        self,
        mode: str = "async",
        *,
        max_staleness: int | None = None,
        stale_gradients: str = "scale",
        cluster: ClusterSpec | None = None,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        init_timeout: float | None = None,
        shutdown_timeout: float = 600.0,
        transport: str | None = None,
        sync_batchnorm: bool = False,
        restore_in_place: bool | None = None,
        restore_timeout: float | None = None,
    ) -> None:
        super().__init__(sync_batchnorm=sync_batchnorm)
        if sync_batchnorm:
            raise ValueError(
                "ParameterServerStrategy does not support sync_batchnorm=True: training tasks exchange "
                "nothing but pushes and pulls with the servers, so there is no collective to compute "
                "global-batch statistics with; each task's BatchNorm uses its own batch"
            )
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an integer >= 0, got {max_staleness!r}")
        if max_staleness is not None and mode == "sync":
            raise ValueError("max_staleness applies to mode='async' only (sync mode has no staleness)")
        if stale_gradients not in STALE_GRADIENTS:
            raise ValueError(f"stale_gradients must be one of {STALE_GRADIENTS}, got {stale_gradients!r}")
        if min_shard_bytes < 1:
            raise ValueError(f"min_shard_bytes must be >= 1, got {min_shard_bytes!r}")
        if restore_in_place is not None and not isinstance(restore_in_place, bool):
            raise ValueError(f"restore_in_place must be None, True or False, got {restore_in_place!r}")
        restore_timeout = _restore_timeout() if restore_timeout is None else restore_timeout
        if (
            isinstance(restore_timeout, bool)
            or not isinstance(restore_timeout, int | float)
            or not (0 < restore_timeout < float("inf"))
        ):
            raise ValueError(
                f"restore_timeout must be a finite number of seconds > 0, got {restore_timeout!r}"
            )
        transport = transport or os.environ.get(env.PS_TRANSPORT, DEFAULT_TRANSPORT)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {transport!r}")
        self.transport = transport
        self.mode = mode
        self.max_staleness = max_staleness
        self.stale_gradients = stale_gradients
        self.min_shard_bytes = min_shard_bytes
        self.init_timeout = default_init_timeout() if init_timeout is None else init_timeout
        self.shutdown_timeout = shutdown_timeout
        self.cluster = cluster if cluster is not None else resolve_cluster()
        share_cores(self.cluster)  # several processes on this host, no launcher: not every core each
        servers = tuple(self.cluster.cluster.get("ps", ()))
        if not servers:
            raise SpreadError(
                "ParameterServerStrategy needs parameter-server tasks: start the job with "
                "`spread run --workers W --ps P script.py`, or list 'ps' tasks in TF_CONFIG"
            )
        token = os.environ.get(TOKEN_ENV) or _default_token(servers)
        if self.cluster.role == "ps":
            serve(
                self.cluster.task_index,
                token=token,
                address=servers[self.cluster.task_index],
                transport=transport,
                replacement=_replacement_number(),
            )
            raise SystemExit(0)
        self._device = local_device(self.cluster) if self.cluster.rank >= 0 else torch.device("cpu")
        self.job_token = token  # for the coordinator's own server; never printed
        self.client = PSClient(list(servers), token=token, timeout=timeout, transport=transport)
        self.placement = Placement({}, len(servers))
        self._variables: dict[str, nn.Parameter] = {}
        self._names: dict[int, str] = {}
        self._embedding_modules: dict[int, nn.Module] = {}  # tables read and written by rows
        self._dense_uses: set[int] = set()  # parameters a non-embedding module also holds (tied)
        self._hooks: list[Any] = []
        self._touched: dict[str, list[torch.Tensor]] = {}
        self._session = secrets.token_hex(4)
        self._announcements = StartAnnouncements(self.client)  # how each fit starts (BackupAndRestore)
        self.local_step = 0
        self._task_step_id: StepId | None = None  # see running_task()
        self._wait_for_workers_on_close = True  # see leave_worker_shutdown_to_coordinator()
        self._weight = 1.0
        self._failing = False  # the script is ending with an uncaught exception
        if restore_in_place is None:
            restore_in_place = os.environ.get(env.RECOVER, "") == "1"
        self._backup_location: tuple[Path, bool] | None = None  # (directory, a Trainer checkpoint)
        self._replay = ReplayLog() if restore_in_place and mode == "sync" else None
        # The evaluator only reads: it stops when a server is gone, as at the end of training.
        self._in_place = (
            InPlaceRestore(
                self.client,
                rank=self.rank,
                timeout=float(restore_timeout),
                backup_of=self._server_backup,
                config=self._server_config,
                replay=self._replay,
                steps_done=lambda: self.local_step,
            )
            if restore_in_place and self.rank >= 0
            else None
        )
        self._step_hook = register_optimizer_step_pre_hook(self._on_optimizer_step)
        task = f"{self.cluster.role} {self.cluster.task_index}"
        self._at_exit = close_at_exit(f"{task}: ParameterServerStrategy", self._close_at_exit)

    # -- topology ----------------------------------------------------------------------------------
    def _cluster_spec(self) -> ClusterSpec:
        return self.cluster

    @property
    def num_replicas_in_sync(self) -> int:
        return self.cluster.world_size if self.mode == "sync" else 1

    @property
    def num_workers(self) -> int:
        """Training tasks (chief and workers) that push to the servers."""
        return self.cluster.world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self.cluster.rank

    @property
    def is_chief(self) -> bool:
        return self.cluster.rank == 0

    @property
    def _layout(self) -> ReplicaLayout:
        if self.cluster.rank < 0:  # the evaluator reads everything
            return ReplicaLayout(1, 0, 1)
        world, rank = self.cluster.world_size, self.cluster.rank
        return ReplicaLayout(world, rank, 1, process_index=rank, num_processes=world)

    def local_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Refused: the variables live on the servers; a task's embedding tables hold only the rows
        pulled for recent batches, and async tasks see each other's updates only when they pull."""
        raise SpreadError(
            "under ParameterServerStrategy a task's model is a cache of the servers' variables, not "
            "their current values: use strategy.full_state_dict(model) for the servers' weights"
        )

    def refresh_weights(self) -> None:
        """Pull every variable, embedding tables whole: a task's copy of a table holds only the rows
        its own batches looked up, as they were then (rows it never read keep their initial values)."""
        self._pull_whole(list(self._variables))

    def _check_data(self, data: DistributedDataset) -> None:
        """Sync mode: every training task must push every step, but the tasks share no channel
        (they talk only to the servers) to agree on where an epoch ends. Data each task reads on its
        own (a ``shard()`` method, or ``shard_policy="off"``) may run out on one task first, leaving
        the servers waiting for its share (the others then fail after the call timeout), so it is
        refused; so is a stream without ``shard()``, which each task would read in full. Async mode
        takes its own shards (each task steps alone; every sample is trained once) and refuses only
        the stream (the default check)."""
        if self.mode == "sync" and data.layout.num_processes > 1:
            kind = type(data.dataset).__name__
            instead = (
                "pass a map-style dataset (with shard_policy='data' if it has a shard method: every "
                "global batch is then split over the tasks and all end together), use mode='async' "
                "(tasks step alone, uneven shards are fine), or MultiWorkerMirroredStrategy (its "
                "processes end an epoch together)"
            )
            if data.shard_policy is not ShardPolicy.DATA:
                raise SpreadError(
                    f"ParameterServerStrategy(mode='sync') cannot train on {kind} with "
                    f"shard_policy='{data.shard_policy.value}': each task would read its own shard, "
                    f"and when one runs out first the servers wait for its share of the next step "
                    f"(the tasks share no channel to end the epoch together); {instead}"
                )
            if data.read_in_full_by_every_process:
                raise SpreadError(
                    f"ParameterServerStrategy(mode='sync') cannot train on {kind}, an iterable "
                    f"without shard(num_shards, index): every task would read it in full; {instead}"
                )
        super()._check_data(data)

    # -- variables ---------------------------------------------------------------------------------
    @contextmanager
    def scope(self) -> Iterator[Strategy]:
        """As :meth:`Strategy.scope`; embedding tables created inside are recognised for row access."""

        def on_param(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is None:
                return
            if name == "weight" and isinstance(module, nn.Embedding | nn.EmbeddingBag):
                self._embedding_modules[id(param)] = module
            else:  # e.g. GPT-2's output layer tied to its token embedding: read whole, every step
                self._dense_uses.add(id(param))

        handle = nn.modules.module.register_module_parameter_registration_hook(on_param)
        try:
            with super().scope() as strategy:
                yield strategy
        finally:
            handle.remove()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        for module in model.modules():
            if not isinstance(module, nn.Embedding | nn.EmbeddingBag):
                self._dense_uses.update(id(p) for p in module.parameters(recurse=False))
            elif id(module.weight) not in self._names:  # placed variables keep how they were placed
                self._embedding_modules[id(module.weight)] = module
        tied_late = [p for p in model.parameters() if id(p) in self._names and self._reads_rows_of_dense(p)]
        if tied_late:
            raise SpreadError(
                f"{len(tied_late)} embedding table(s) of this model were placed on the servers as "
                "row-read tables, but another layer now uses the same weight (tied weights) and reads "
                "every row: tie the weights inside strategy.scope(), where the model is built"
            )
        return super().prepare_model(model)  # nothing more for a model built in the scope

    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        for param in params:  # a table another layer also uses whole is a dense variable
            if id(param) in self._dense_uses:
                self._embedding_modules.pop(id(param), None)
        infos = []
        for param in params:
            name = f"v{len(self._variables)}"
            self._variables[name] = param
            self._names[id(param)] = name
            infos.append(
                VariableInfo(name, tuple(param.shape), param.dtype, id(param) in self._embedding_modules)
            )
        new = place(infos, self.client.num_servers, min_shard_bytes=self.min_shard_bytes)
        self.placement = Placement({**self.placement.shards, **new.shards}, self.client.num_servers)
        if self.is_chief:
            values = {i.name: self._variables[i.name] for i in infos}
            self.client.create(new, values, self._server_config())
        self._pull_whole([i.name for i in infos if not i.sparse], wait=self.init_timeout)
        for info in infos:
            if info.sparse:
                module = self._embedding_modules[id(self._variables[info.name])]
                self._hooks.append(module.register_forward_pre_hook(self._pull_rows_hook))

    def _reads_rows_of_dense(self, param: nn.Parameter) -> bool:
        """Whether ``param`` was placed as a row-read table yet a non-embedding layer uses it whole."""
        return id(param) in self._embedding_modules and id(param) in self._dense_uses

    def _dense_names(self) -> list[str]:
        return [n for n, p in self._variables.items() if id(p) not in self._embedding_modules]

    def _server_config(self) -> dict[str, Any]:
        """The job's settings every server is created (or restored) with."""
        return {
            "mode": self.mode,
            "num_workers": self.num_workers,
            "max_staleness": self.max_staleness,
            "stale_gradients": self.stale_gradients,
        }

    def _calling(self, op: str, fn: Callable[[], T]) -> T:
        """``fn()`` (calls to the servers); with ``restore_in_place``, a lost server is waited for
        until it is restored, then ``fn()`` again (:mod:`spread.ps.in_place`)."""
        return fn() if self._in_place is None else self._in_place.call(op, fn)

    def _pull_whole(self, names: list[str], *, wait: float = 0.0) -> None:
        if not names:
            return
        values = self._calling("pull", lambda: self.client.pull(self.placement, names, wait=wait))
        self._assign(values)

    @torch.no_grad()
    def _assign(self, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            self._variables[name].copy_(value.view_as(self._variables[name]))

    def pull(self) -> None:
        """Refresh this process's copy of every dense variable from the servers (e.g. before evaluating)."""
        self._pull_whole(self._dense_names())

    def _pull_rows_hook(self, module: nn.Module, args: tuple) -> None:
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor):
            return
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        name = self._names[id(weight)]
        unique = torch.unique(ids.detach().reshape(-1).to("cpu", torch.int64))
        if unique.numel() == 0:
            return
        rows = self._calling("pull rows", lambda: self.client.pull_rows(self.placement, name, unique))
        with torch.no_grad():
            weight.index_copy_(0, unique.to(weight.device), rows.to(weight))
        if torch.is_grad_enabled():
            self._touched.setdefault(name, []).append(unique)

    # -- the step: push gradients, receive fresh variables ------------------------------------------
    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if id(p) in self._names]
        if not params or self._closed:
            return
        if self.cluster.rank < 0:
            raise SpreadError(f"the {self.cluster.role} task must not train (optimizer.step was called)")
        spec = spec_from_torch(optimizer)
        scale = self._weight if self.mode == "sync" else 1.0
        dense: dict[str, torch.Tensor] = {}
        sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for p in params:
            name = self._names[id(p)]
            grad = p.grad
            if id(p) in self._embedding_modules:
                touched = self._touched.pop(name, [])
                if grad is None:
                    continue
                ids, values = _row_gradient(grad, touched)
                values = values.detach().to("cpu")
                sparse[name] = (ids, values * scale if scale != 1.0 else values)
            elif grad is not None:
                dense[name] = grad.detach().to("cpu") * scale if scale != 1.0 else grad.detach()
        step_id = self._task_step_id or StepId(task=self.rank, session=self._session, number=self.local_step)
        pull = self._dense_names()
        parts = self.client.push_parts(
            self.placement,
            step_id=step_id.encode(),
            worker=self.rank,
            step=self.local_step,
            optimizer=spec,
            dense=dense,
            sparse=sparse,
            pull=pull,
        )
        if self._replay is not None:
            self._replay.record(self.local_step, parts)
        fresh = self._calling(
            f"push (step {self.local_step})", lambda: self.client.send_push(self.placement, parts, pull=pull)
        )
        self._assign(fresh)
        self.local_step += 1
        for p in params:
            p.grad = None  # the servers applied the update; the local optimizer has nothing to do

    # -- computation -------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``fn`` (forward and backward) on this worker's batch; call ``optimizer.step()`` after."""
        self._weight = replica_weights(self)[0] if self.mode == "sync" else 1.0
        replica = max(self.rank, 0) if self.mode == "sync" else 0
        return run_as_replica(self, fn, args, kwargs, replica, self._weight)

    # -- gradients between backward and the push ----------------------------------------------------
    def clip_gradients(
        self, params: Sequence[nn.Parameter], *, max_norm: float | None = None, max_value: float | None = None
    ) -> torch.Tensor:
        """Async: clip this task's own gradient before it is pushed (what TensorFlow's optimizers do
        on a parameter-server worker); the norm is of this task's gradient. Sync: refused, because
        the gradient one device would clip is the servers' sum of every task's share, which no task
        holds."""
        if self.mode == "sync":
            raise SpreadError(
                "ParameterServerStrategy(mode='sync') does not clip gradients: the gradient one device "
                "would clip is the sum of every task's share, which only the servers hold; clip in "
                "mode='async' (each task's own gradient) or use MultiWorkerMirroredStrategy"
            )
        return super().clip_gradients(params, max_norm=max_norm, max_value=max_value)

    def check_precision(self, precision: str) -> None:
        if precision == "fp16":
            raise ValueError(
                "ParameterServerStrategy does not train with precision='fp16': a step the loss scaler "
                "skips pushes nothing, so in sync mode the other tasks would wait for it, and in async "
                "mode the servers' count of this task's steps (its resume point) would fall behind its "
                "data; use precision='bf16' (no loss scaling needed)"
            )

    def _sum_over_replicas(self, value: Any) -> tuple[torch.Tensor, int]:
        # This worker's value: workers do not wait for each other, so nothing is combined.
        return one_replica_tensor(value, self.device), 1

    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        return one_replica_tensor(value, self.device)

    # -- lifecycle ---------------------------------------------------------------------------------
    def bytes_moved(self) -> int:
        """Bytes this process sent to and received from the servers so far."""
        return self.client.bytes_sent + self.client.bytes_received

    def server_stats(self, *, ids: bool = False) -> list[dict[str, Any]]:
        """Each server's counters: updates applied, duplicates ignored, version, finished workers."""
        return self.client.stats(ids=ids)

    def evaluate_periodically(
        self, fn: Callable[[], Any], *, interval: float = 10.0, max_evaluations: int | None = None
    ) -> int:
        """The evaluator sidecar: every ``interval`` seconds, pull the latest variables and call ``fn()``.

        Meant for the ``evaluator`` task (it only reads, so killing or restarting it never affects
        training; a restarted one simply goes on from the servers' current values). Returns the number
        of evaluations when the servers stop (training ended) or after ``max_evaluations``.
        """
        count = 0
        while max_evaluations is None or count < max_evaluations:
            try:
                self.pull()
            except ParameterServerError:
                break  # the chief stopped the servers: training is over
            fn()
            count += 1
            if max_evaluations is not None and count >= max_evaluations:
                break
            time.sleep(interval)
        return count

    def server_state(self) -> dict[str, Any]:
        """Every server's shards, optimizer state and ledger (counters and applied step ids), each
        server read under its own lock: the payload of :meth:`save_servers` and of a BackupAndRestore
        backup under this strategy."""
        state, spec, ledgers = self._calling("state", self.client.snapshot)
        return {
            "servers": {str(s): tensors for s, tensors in state.items()},
            "optimizer": spec,
            "ledgers": {str(s): ledger for s, ledger in ledgers.items()},
        }

    def save_servers(self, directory: str | Path, *, step: int | None = None, keep: int = 3) -> Path:
        """Checkpoint every server's shards and optimizer state (the chief; atomic and verified).

        Returns the checkpoint directory. Restore with :meth:`restore_servers`; a server lost later
        is restored in place from it (``restore_in_place``).
        """
        saved = CheckpointManager(directory, keep=keep).save(
            self.local_step if step is None else step, self.server_state()
        )
        self._backed_up(Path(directory), checkpoint=False)
        return saved

    def _backed_up(self, directory: Path, *, checkpoint: bool) -> None:
        """A backup of this task's step ``local_step`` is written: the one a lost server is restored
        from (the chief's), and the replay log's new start (sync mode)."""
        if self.is_chief:
            self._backup_location = (directory, checkpoint)
        if self._replay is not None:
            self._replay.backed_up(self.local_step)

    def _server_backup(self, server: int) -> ServerBackup:
        """The chief: ``server``'s part of the latest backup it wrote (for an in-place restore)."""
        if self._backup_location is None:
            raise SpreadError(
                f"parameter server {server} was lost and started again, but the chief has written no "
                "backup to restore it from yet (BackupAndRestore or save_servers): the job cannot go on"
            )
        directory, checkpoint = self._backup_location
        loaded = CheckpointManager(directory).load_latest()
        if loaded is None:
            raise SpreadError(f"parameter server {server} was lost, and {directory} holds no backup")
        step, payload = loaded
        if checkpoint:
            saved = payload[OBJECTS][_SERVERS]["value"]
            servers, name = saved["servers"], str(saved["backup_id"])
        else:
            servers, name = payload, f"{step}-servers"
        return ServerBackup(
            name=name,
            step=step,
            tensors=dict(servers["servers"][str(server)]),
            ledger=dict(servers["ledgers"][str(server)]),
            optimizer=servers.get("optimizer"),
        )

    def load_server_state(self, payload: dict[str, Any], *, restored_from: str | None = None) -> None:
        """Overwrite the servers with a :meth:`server_state` payload. With ``restored_from`` (a name
        for the backup) their ledgers are restored too and they report that name in their stats, so
        the other training tasks can wait for the restore (:meth:`wait_for_restore`)."""
        servers = payload["servers"]
        if len(servers) != self.client.num_servers:
            raise SpreadError(
                f"the checkpoint holds {len(servers)} parameter server(s); "
                f"this job has {self.client.num_servers}"
            )
        config = {
            "mode": self.mode,
            "num_workers": self.num_workers,
            "max_staleness": self.max_staleness,
            "stale_gradients": self.stale_gradients,
        }
        if payload.get("optimizer"):
            config["optimizer"] = payload["optimizer"]
        ledgers = None
        if restored_from is not None:
            stamp = self._announcements.stamp(restored_from)
            ledgers = {
                int(s): {**payload.get("ledgers", {}).get(s, {}), "restored_from": stamp} for s in servers
            }
        self.client.load({int(s): tensors for s, tensors in servers.items()}, config, ledgers)
        self.pull()

    def wait_for_restore(self, timeout: float | None = None) -> BackupId | None:
        """Block until the chief has said how this job starts (every server restored from one backup,
        or a fresh start), then pull the variables; returns the backup's id, or None for a fresh
        start (see :mod:`spread.ps.restore`)."""
        budget = self.init_timeout if timeout is None else timeout
        backup = self._announcements.wait(rank=self.rank, timeout=budget)
        self.pull()
        return backup

    def resume_from_servers(self, payload: dict[str, Any] | None = None) -> int:
        """Continue this task's step numbering after a restore; returns how many of this task's steps
        the restored servers hold (it resumes with the next one). ``payload``: the backup's
        :meth:`server_state`; default: the servers' current ledgers (the same for this task's steps
        as long as it has not pushed since the restore). See :func:`spread.ps.restore.resume_point`.
        """
        if payload is None:
            ledgers = self.server_stats(ids=True)
        else:
            ledgers = list((payload.get("ledgers") or {}).values())
        point = resume_point(ledgers, mode=self.mode, rank=self.rank)
        if point.session is not None:
            self._session = point.session
        self.local_step = point.steps
        return point.steps

    # -- training state: the seam (save_checkpoint, load_checkpoint) ---------------------------------
    # The servers hold the variables and the optimizer state; the chief's checkpoint holds them
    # (every server's shards and ledger) beside the state it is given. Tasks share no collective, so
    # in sync mode every other worker writes its own state (its RNG streams, data position) under
    # ``task-<rank>/``: a sync job resumes bit for bit. Async workers are never bit-exact and write
    # nothing of their own; on load each learns from the servers' ledgers where it resumes.
    @property
    def steps_together(self) -> bool:
        return False  # each task steps on its own: no step boundary to agree on

    def check_recoverable(self) -> None:
        """Under ``spread run --recover`` a parameter-server job recovers a lost *server* in place
        (the module docstring); its training tasks never regroup (they share no collective), and a
        lost one fails the job as without ``--recover``, so there is nothing to refuse."""

    def regroup(self) -> None:
        raise SpreadError(
            "ParameterServerStrategy training tasks do not regroup: a lost parameter server is restored "
            "in place under spread run --recover; a lost chief or worker fails the job (--max-restarts "
            "with BackupAndRestore restarts it from the last backup)"
        )

    def _state_layout(self) -> StateLayout:
        return ServerLayout(self)

    def _own_parts(self) -> list[int]:
        """Workers beside the chief that write their own part of each checkpoint (sync mode)."""
        return list(range(1, self.num_workers)) if self.mode == "sync" else []

    def save_checkpoint(
        self, path: str | Path, state: Mapping[str, Any], *, step: int, keep: int = 3, blocking: bool = True
    ) -> Path | str:
        """The chief writes ``state`` with every server's state; a sync worker its own part; an
        async worker nothing (see the comment above). Not collective: tasks save on their own.
        Always written before it returns (``blocking`` is accepted and ignored): the servers' state
        is already a copy, fetched from them, and the tasks share no step boundary to wait at."""
        _refuse_url(path)
        if self.is_chief:
            servers = {"servers": self.server_state(), "backup_id": BackupId.new(step).encode()}
            saved = checkpointing.save(self, path, {**state, _SERVERS: servers}, step=step, keep=keep)
            self._backed_up(Path(path), checkpoint=True)
            return saved
        own = _task_directory(path, self.rank)
        if self.rank in self._own_parts():
            # One more than the chief keeps: a task may be one checkpoint ahead of a chief that died saving.
            saved = checkpointing.save(self, own, _own_state(state), step=step, keep=keep + 1, writes=True)
            self._backed_up(own, checkpoint=True)
            return saved
        return own / f"ckpt-{step:010d}"

    def load_checkpoint(
        self, path: str | Path, state: MutableMapping[str, Any], *, step: int | None = None
    ) -> Restored | None:
        """The chief restores the newest checkpoint that every sync worker's own part also holds,
        and the servers from it, then tells the other tasks; they wait for its word, pull the
        variables and resume after their last step the servers hold (their own part of that step,
        where they write one)."""
        _refuse_url(path)
        if self.is_chief:
            return self._restore_as_chief(path, state, step)
        backup = self.wait_for_restore()
        if backup is None:
            return None
        held = self.resume_from_servers()
        own = None
        if self.rank in self._own_parts():
            own_state = _own_state(state)
            own = checkpointing.load(self, _task_directory(path, self.rank), own_state, step=held)
            state.update({k: v for k, v in own_state.items() if k in state})
        self._backed_up(Path(path), checkpoint=True)  # the servers now hold that backup
        return Restored(step=backup.step, resume_step=held, restored_objects=own is not None)

    def _restore_as_chief(
        self, path: str | Path, state: MutableMapping[str, Any], step: int | None
    ) -> Restored | None:
        full: dict[str, Any] = {**state, _SERVERS: None}
        restored = None
        for candidate in _steps(path) if step is None else [step]:
            if all((_task_directory(path, r) / f"ckpt-{candidate:010d}").is_dir() for r in self._own_parts()):
                restored = checkpointing.load(self, path, full, step=candidate)
                if restored is not None:
                    break
        if restored is None and step is None and self._own_parts():  # no common step: tasks' RNG afresh
            restored = checkpointing.load(self, path, full, step=None)
        if restored is None:
            self._announcements.announce_fresh_start()
            return None
        state.update({k: v for k, v in full.items() if k in state})
        servers, backup_id = full[_SERVERS]["servers"], full[_SERVERS]["backup_id"]
        self.load_server_state(servers, restored_from=backup_id)
        held = self.resume_from_servers(servers)
        if held != restored.step:
            raise SpreadError(
                f"backup {backup_id}: the servers hold {held} of the chief's steps, "
                f"the chief saved at step {restored.step}"
            )
        self._backed_up(Path(path), checkpoint=True)  # a server lost from now on is restored from it
        return restored

    def delete_checkpoints(self, path: str | Path) -> None:
        # The other tasks train on after the chief (async); one that fails later must still find them.
        self.wait_for_workers()
        super().delete_checkpoints(path)

    def restore_servers(self, directory: str | Path) -> int:
        """Load the latest checkpoint into the servers (a replaced server gets its shards back).

        Returns the checkpoint's step. Raises :class:`SpreadError` when there is none, and
        ``CheckpointCorruptError`` when every checkpoint is corrupt.
        """
        loaded = CheckpointManager(directory).load_latest()
        if loaded is None:
            raise SpreadError(f"no parameter-server checkpoint in {directory}")
        step, payload = loaded
        try:
            self.load_server_state(payload)
        except SpreadError as exc:
            raise SpreadError(f"{exc} (checkpoint in {directory})") from None
        return step

    @contextmanager
    def running_task(self, step_id: StepId) -> Iterator[None]:
        """Pushes made inside carry ``step_id`` (a coordinator's scheduled task) instead of this
        task's own step count: a task rerun on another worker pushes under the same id, so the
        servers apply it once."""
        self._task_step_id = step_id
        try:
            yield
        finally:
            self._task_step_id = None

    def leave_worker_shutdown_to_coordinator(self) -> None:
        """The chief's :meth:`close` stops the servers without waiting for the workers: under a
        ``ClusterCoordinator`` the workers finish when the coordinator tells them to."""
        self._wait_for_workers_on_close = False

    def wait_for_workers(self, timeout: float | None = None) -> None:
        """Mark this training task finished and wait until every training task has (then ``pull``).

        Meant for the chief (to evaluate or save the final model): once every task is finished the
        chief's ``close()`` stops the servers, so other tasks should not read from them afterwards.
        """
        if self.rank < 0:
            return
        budget = self.shutdown_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        done = self._calling("done", lambda: self.client.done(self.rank))
        while not all(len(d) >= self.num_workers for d in done):
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_workers)) - set(done[0]))
                raise SpreadError(
                    f"rank {self.rank}: training task(s) of rank(s) {missing} did not finish within "
                    f"{budget:g}s (a task that died without closing never says it finished)"
                )
            time.sleep(0.1)
            done = [s["done"] for s in self._calling("stats", self.client.stats)]
        failed = sorted({w for s in self._calling("stats", self.client.stats) for w in s.get("failed", [])})
        if failed:
            print(
                f"spread: rank {self.rank}: training task(s) of rank(s) {failed} ended with an error",
                file=sys.stderr,
                flush=True,
            )
        self.pull()

    def _close_at_exit(self, failing: bool) -> None:
        self._failing = failing
        self.close()

    def close(self) -> None:
        """Finish: tell the servers this task is done; the chief waits for the others, then stops them.

        The chief stops the servers even when waiting fails (a task that died never says it is
        done), then raises that error: servers are never left serving.
        """
        if self._closed:
            return
        self._closed = True
        self._at_exit.cancel()
        self._step_hook.remove()
        for hook in self._hooks:
            hook.remove()
        waiting_failed: SpreadError | None = None
        try:
            if self.rank >= 0 and not self.is_chief:
                self._calling("done", lambda: self.client.done(self.rank, failed=self._failing))
            elif self.is_chief and self._wait_for_workers_on_close and not self._failing:
                try:
                    self.wait_for_workers()
                except ParameterServerError:
                    raise
                except SpreadError as exc:
                    waiting_failed = exc
            if self.is_chief:
                self.client.stop()
        except ParameterServerError:
            pass  # a server already gone cannot be stopped; nothing is left to clean
        finally:
            self.client.close()
            super().close()
        if waiting_failed is not None:
            raise waiting_failed


def _restore_timeout() -> float:
    text = os.environ.get(env.PS_RESTORE_TIMEOUT, "")
    try:
        return float(text) if text else DEFAULT_RESTORE_TIMEOUT
    except ValueError:
        raise ValueError(f"{env.PS_RESTORE_TIMEOUT} must be a number of seconds, got {text!r}") from None


def _replacement_number() -> int:
    """Which replacement of a lost server this process is (``spread run --recover`` sets it; 0: none)."""
    text = os.environ.get(env.PS_REPLACEMENT, "0") or "0"
    if not text.isdigit():
        raise ValueError(f"{env.PS_REPLACEMENT} must be an integer >= 0, got {text!r}")
    return int(text)


def _row_gradient(grad: torch.Tensor, touched: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted unique row ids, their gradient rows) from a sparse or a dense embedding gradient."""
    if grad.is_sparse:
        g = grad.coalesce()
        return g.indices()[0].to("cpu"), g.values()
    ids = torch.unique(torch.cat(touched)) if touched else grad.new_zeros(0, dtype=torch.int64)
    return ids, grad.index_select(0, ids.to(grad.device))


class ServerLayout(StateLayout):
    """A task's model is a cache of the servers' variables: its one-device state is the model with
    the embedding tables pulled whole (dense variables came back with the task's last push). A
    checkpoint resumes only under parameter servers with as many workers."""

    family = "parameter_server"

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        super().__init__(strategy)
        self.servers = strategy

    def refusal(self, writer: Mapping[str, Any]) -> str | None:
        refusal = super().refusal(writer)
        saved = writer.get("num_replicas_in_sync")
        if refusal is None and saved != self.servers.num_replicas_in_sync:
            return (
                f"a parameter-server checkpoint holds each of its {saved} worker tasks' resume point "
                f"(the steps the servers applied from that task, and in sync mode its RNG states); "
                f"with {self.servers.num_replicas_in_sync} workers those would belong to no task or "
                "be missing: resume with the same number of workers"
            )
        return refusal

    def full_state_dict(self, obj: nn.Module | torch.optim.Optimizer) -> dict[str, Any]:
        """The servers' weights: every variable pulled (tables whole), not only the tables: in async
        mode a task's dense copy is as of its own last step, missing the other tasks' later updates."""
        s = self.servers
        if isinstance(obj, nn.Module) and not s._closed:
            s.refresh_weights()
        return obj.state_dict()


_SERVERS = "parameter_servers"  # the chief's checkpoint: every server's state and the backup's id


def _task_directory(path: str | Path, rank: int) -> Path:
    return Path(path) / f"task-{rank:05d}"


def _own_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a worker writes of its own: not the model or optimizer (the servers' own)."""
    return {k: v for k, v in state.items() if not isinstance(v, nn.Module | torch.optim.Optimizer)}


def _steps(path: str | Path) -> list[int]:
    """The chief's checkpoint steps under ``path``, newest first."""
    return sorted(
        (int(c.name.removeprefix("ckpt-")) for c in CheckpointManager(path).checkpoints()), reverse=True
    )


def _refuse_url(path: str | Path) -> None:
    """Parameter-server backups live in a directory per task: not in object storage yet."""
    if is_url(path):
        raise ValueError(
            f"ParameterServerStrategy backs up to a filesystem path, not to {path}: "
            "use a directory on a shared filesystem"
        )
