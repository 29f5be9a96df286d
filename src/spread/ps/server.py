"""A parameter server: holds shards, applies the optimizer to them, answers pulls, counts updates.

Contract with the clients (:mod:`spread.ps.client`):

* ``create``: the chief sends the job's settings (mode, number of training workers, staleness bound,
  optimizer spec) and the initial value of each shard; creating a shard that exists is a no-op
  unless ``overwrite`` (a restore).
* ``push``: a step's gradients (dense shards whole, embedding shards as ``rows`` + ``values``) under a
  step id (an opaque string here; :mod:`spread.ps.step_ids` says how clients make them). **Exactly
  once:** a step id already applied is counted as a duplicate and ignored, so a step retried after a
  lost answer, or rescheduled after its worker died, is never applied twice.
  The answer carries the fresh values of the shards named in ``pull`` (one round trip per step).
* ``mode="sync"``: each training worker pushes its share of step ``t`` (already weighted by its
  sample count); the server sums them in worker order once all arrived, applies one update, and
  only then answers the pushes. ``max_staleness=k`` (async): a push from a worker more than ``k``
  steps ahead of the slowest unfinished worker is answered only when that worker catches up.
* Stale gradients (async, ``stale_gradients="scale"``, the default): a push says which version of the
  server's values its gradient was computed on (``base``); one that ``tau`` updates have overtaken
  is scaled by ``min(1, num_workers / (tau + 1))``. With ``W`` workers a gradient is normally about
  ``W - 1`` updates old (scale 1); one from a worker the machine descheduled for seconds is damped in
  proportion, the staleness-dependent learning rate of Zhang, Gupta, Lian and Liu, "Staleness-aware
  Async-SGD for Distributed Deep Learning" (IJCAI 2016), normalised so that the usual staleness of
  ``W`` workers keeps the user's learning rate. ``"apply"`` applies every gradient as it is.
* Every wait has a deadline and fails naming the workers it waited for.
* A replacement (``replacement >= 1``: ``spread run --recover`` started this server again at the
  address of one that was lost) holds nothing and refuses pushes, pulls and ``done`` until the chief
  restores its shards from the backup (``create`` with ``restored_in_place``); its stats say so, and
  carry a digest of the state it was given (:func:`state_digest`), so the chief checks that what
  arrived is what it sent. The training tasks wait for it (:mod:`spread.strategies.parameter_server`).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from spread.ps.optimizers import ServerOptimizer
from spread.ps.rpc_api import Message, RequestRefused, RpcServer
from spread.ps.step_ids import sync_round
from spread.ps.transports import DEFAULT_TRANSPORT, get_transport
from spread.ps.wire import Tensors

MODES = ("async", "sync")
STALE_GRADIENTS = ("scale", "apply")
DEFAULT_WAIT = 300.0


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over a server's state as :meth:`ParameterServer._state` returns it (every shard and
    optimizer slot: name, dtype, shape and bytes, in name order): the same on the chief, over what it
    sends in a restore, and on the server, over what it then holds."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class ParameterServer:
    """One server task. Start with :meth:`start`; :meth:`serve_until_stopped` blocks for the ``ps`` role."""

    def __init__(
        self,
        index: int,
        *,
        token: str,
        address: str | None = None,
        transport: str = DEFAULT_TRANSPORT,
        replacement: int = 0,
    ) -> None:
        self.index = index
        self.name = f"parameter server {index}"
        self.replacement = replacement  # 0: started with the job; N: the Nth started again in its place
        self.incarnation = secrets.token_hex(6)  # this process: a task waits once for each replacement
        self.restored_in_place = ""  # a replacement: the backup it was restored from ("" until then)
        self.restored_digest = ""  # state_digest of what that restore left here
        self.variables: dict[str, torch.Tensor] = {}
        self.optimizer: ServerOptimizer | None = None
        self.mode = "async"
        self.num_workers = 1
        self.max_staleness: int | None = None
        self.stale_gradients = "scale"
        self.version = 0  # updates applied (sync: steps applied)
        self.damped = 0  # async pushes scaled down for staleness
        self.max_seen_staleness = 0  # the most updates a pushed gradient was behind
        self.applied = 0
        self.duplicates = 0
        self.applied_ids: set[str] = set()
        self.restored_from = ""  # the backup this server was last restored from (BackupAndRestore)
        self._pending: dict[int, dict[int, tuple[dict, Tensors]]] = {}
        self._clocks: dict[int, int] = {}
        self._done: set[int] = set()
        self._failed: set[int] = set()  # training workers whose script ended with an error
        self._cond = threading.Condition()
        self._stop_requested = threading.Event()
        self.rpc: RpcServer = get_transport(transport).server(
            self.name,
            {
                "create": self._create,
                "pull": self._unless_awaiting_restore(self._pull),
                "push": self._unless_awaiting_restore(self._push),
                "stats": self._stats,
                "done": self._unless_awaiting_restore(self._worker_done),
                "stop": self._stop,
                "state": self._unless_awaiting_restore(self._state),
            },
            token=token,
            address=address,
        )
        self.address = self.rpc.address

    def start(self) -> ParameterServer:
        self.rpc.start()
        return self

    def serve_until_stopped(self) -> None:
        """Serve until a client calls ``stop`` (the chief, at the end of training)."""
        self._stop_requested.wait()
        self.rpc.stop()  # lets the stop call's own answer leave first

    def stop(self) -> None:
        self._stop_requested.set()
        self.rpc.stop()

    # -- handlers ----------------------------------------------------------------------------------
    def _unless_awaiting_restore(self, handler: Any) -> Any:
        """``handler``, refused while this replacement has not been restored: it holds nothing yet."""

        def guarded(meta: dict[str, Any], tensors: Tensors) -> Message:
            if self.replacement and not self.restored_in_place:
                raise RequestRefused(
                    f"started again in place of a lost server (replacement {self.replacement}); it holds "
                    "nothing until the chief restores it from the last backup"
                )
            return handler(meta, tensors)

        return guarded

    def _create(self, meta: dict[str, Any], tensors: Tensors) -> Message:
        config = meta.get("config") or {}
        with self._cond:
            if config:
                mode = config.get("mode", "async")
                if mode not in MODES:
                    raise RequestRefused(f"mode must be one of {MODES}, got {mode!r}")
                self.mode = mode
                self.num_workers = int(config.get("num_workers", 1))
                staleness = config.get("max_staleness")
                self.max_staleness = None if staleness is None else int(staleness)
                stale = config.get("stale_gradients", "scale")
                if stale not in STALE_GRADIENTS:
                    raise RequestRefused(f"stale_gradients must be one of {STALE_GRADIENTS}, got {stale!r}")
                self.stale_gradients = stale
                if config.get("optimizer") and self.optimizer is None:
                    self.optimizer = ServerOptimizer(config["optimizer"])
            created = []
            for key, value in tensors.items():
                if key.startswith("opt:"):
                    continue
                if key not in self.variables or meta.get("overwrite"):
                    self.variables[key] = value.clone()
                    created.append(key)
            if meta.get("overwrite"):
                self._load_optimizer_state(tensors)
            if meta.get("ledger"):
                self._load_ledger(meta["ledger"])
            if meta.get("restored_from"):  # the chief's word on this job's start: which backup, or none
                self.restored_from = str(meta["restored_from"])
            if meta.get("restored_in_place"):  # a replacement restored: it serves from now on
                self.restored_digest = state_digest(self._state_tensors())
                self.restored_in_place = str(meta["restored_in_place"])
            self._cond.notify_all()
        return {"created": created}, {}

    def _load_ledger(self, ledger: dict[str, Any]) -> None:
        """A restore: the checkpoint's update counters and applied step ids replace this server's, so
        a step re-pushed after the restore is applied only where the checkpoint lacks it."""
        self.version = int(ledger.get("version", 0))
        self.applied = int(ledger.get("applied", 0))
        self.applied_ids = {str(i) for i in ledger.get("applied_ids", [])}
        self._pending.clear()
        self._clocks.clear()
        self._done = {int(w) for w in ledger.get("done", [])}  # an in-place restore carries them over
        self._failed = {int(w) for w in ledger.get("failed", [])}
        self.restored_from = str(ledger.get("restored_from", ""))

    def _load_optimizer_state(self, tensors: Tensors) -> None:
        slots: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("opt:"):
                shard, slot = key[4:].rsplit(":", 1)
                slots.setdefault(shard, {})[slot] = value.clone()
        if slots and self.optimizer is not None:
            for shard, state in slots.items():
                self.optimizer.load_state_tensors(shard, state)

    def _wait_for_variables(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while missing := [n for n in names if n not in self.variables]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestRefused(f"variables {missing[:5]} were not created within {timeout:g}s (chief?)")
            self._cond.wait(remaining)

    def _read(self, names: list[str], tensors: Tensors) -> Tensors:
        out: Tensors = {}
        for name in names:
            var = self.variables.get(name)
            if var is None:
                raise RequestRefused(f"unknown variable {name!r}")
            rows = tensors.get(f"{name}:rows")
            if rows is None:
                # No copy: the answer is encoded from the live variable. In sync mode nothing is
                # applied while a round's answers are sent (the next round needs every worker's
                # push first); in async mode a concurrent push may land mid-read, which async SGD
                # tolerates (TF's parameter servers read without locks too).
                out[name] = var
            else:
                self._check_rows(name, rows, var)
                out[name] = var.index_select(0, rows)  # as var[rows], several times faster
        return out

    def _pull(self, meta: dict[str, Any], tensors: Tensors) -> Message:
        names = list(meta.get("names", []))
        with self._cond:
            self._wait_for_variables(names, float(meta.get("wait", 0.0)))
            return {"version": self.version}, self._read(names, tensors)

    def _check_rows(self, name: str, rows: torch.Tensor, var: torch.Tensor) -> None:
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise RequestRefused(f"rows of {name!r} must be a 1-D int64 tensor")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= var.shape[0]):
            raise RequestRefused(f"rows of {name!r} out of range [0, {var.shape[0]})")

    def _check_push(self, meta: dict[str, Any], tensors: Tensors) -> None:
        if self.optimizer is None:
            spec = meta.get("optimizer")
            if not spec:
                raise RequestRefused("no optimizer configured; the first push must carry its spec")
            self.optimizer = ServerOptimizer(spec)
        elif meta.get("optimizer"):
            try:
                self.optimizer.check_same_kind(meta["optimizer"])
            except ValueError as exc:
                raise RequestRefused(str(exc)) from None
        for key in meta.get("dense", []):
            var, grad = self.variables.get(key), tensors.get(key)
            if var is None or grad is None or grad.shape != var.shape:
                raise RequestRefused(f"dense gradient for {key!r} missing or of the wrong shape")
        for key in meta.get("sparse", []):
            var, rows, values = (
                self.variables.get(key),
                tensors.get(f"{key}:rows"),
                tensors.get(f"{key}:values"),
            )
            if var is None or rows is None or values is None:
                raise RequestRefused(f"sparse gradient for {key!r} incomplete")
            self._check_rows(key, rows, var)
            if values.shape != (rows.numel(), *var.shape[1:]):
                raise RequestRefused(f"sparse values for {key!r} have shape {tuple(values.shape)}")

    def _staleness_scale(self, meta: dict[str, Any]) -> float:
        """How much of an async push's gradient to apply (see the module docstring); 1 in sync mode,
        with ``"apply"``, or when the push does not say which version it was computed on."""
        base = meta.get("base")
        if self.mode != "async" or not isinstance(base, int):
            return 1.0
        staleness = max(0, self.version - base)
        self.max_seen_staleness = max(self.max_seen_staleness, staleness)
        if self.stale_gradients != "scale":
            return 1.0
        scale = min(1.0, self.num_workers / (staleness + 1))
        if scale < 1.0:
            self.damped += 1
        return scale

    def _apply(self, meta: dict[str, Any], tensors: Tensors) -> None:
        hyper = meta.get("optimizer") or self.optimizer.spec  # type: ignore[union-attr]
        opt = self.optimizer
        assert opt is not None
        scale = self._staleness_scale(meta)

        def scaled(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            grad = grad.to(like.dtype)
            return grad * scale if scale != 1.0 else grad

        for key in meta.get("dense", []):
            opt.apply_dense(key, self.variables[key], scaled(tensors[key], self.variables[key]), hyper)
        for key in meta.get("sparse", []):
            rows, values = tensors[f"{key}:rows"], tensors[f"{key}:values"]
            if rows.numel():
                opt.apply_rows(key, self.variables[key], rows, scaled(values, self.variables[key]), hyper)
        self.version += 1
        self.applied += 1

    def _push(self, meta: dict[str, Any], tensors: Tensors) -> Message:
        step_id = str(meta.get("step_id", ""))
        worker, step = int(meta.get("worker", 0)), int(meta.get("step", 0))
        wait = float(meta.get("wait", DEFAULT_WAIT))
        with self._cond:
            self._check_push(meta, tensors)
            if self.mode == "sync":
                self._push_sync(meta, tensors, worker, step, wait)
            else:
                if step_id in self.applied_ids:
                    self.duplicates += 1
                else:
                    self._apply(meta, tensors)
                    self.applied_ids.add(step_id)
                self._clocks[worker] = max(self._clocks.get(worker, 0), step + 1)
                self._cond.notify_all()
                if self.max_staleness is not None:
                    self._wait_for_stragglers(worker, step + 1, wait)
            return {"version": self.version}, self._read(list(meta.get("pull", [])), {})

    def _push_sync(self, meta: dict, tensors: Tensors, worker: int, step: int, wait: float) -> None:
        if step < self.version:
            self.duplicates += 1  # this step was applied already (a retried push)
            return
        contributions = self._pending.setdefault(step, {})
        if worker in contributions:
            self.duplicates += 1
        else:
            contributions[worker] = (meta, {k: v.clone() for k, v in tensors.items()})
        if len(contributions) == self.num_workers and step == self.version:
            self._apply_sync(step)
        deadline = time.monotonic() + wait
        while self.version <= step:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.num_workers)) - set(self._pending.get(step, {})))
                raise RequestRefused(
                    f"sync step {step}: waited {wait:g}s for the gradients of worker(s) {missing}"
                )
            self._cond.wait(remaining)

    def _apply_sync(self, step: int) -> None:
        contributions = self._pending.pop(step)
        ordered = [contributions[w] for w in sorted(contributions)]
        meta0 = dict(ordered[0][0])
        summed: Tensors = {}
        dense = sorted({k for m, _ in ordered for k in m.get("dense", [])})
        for key in dense:
            parts = [t[key] for m, t in ordered if key in m.get("dense", [])]
            total = parts[0].clone()
            for p in parts[1:]:
                total.add_(p)
            summed[key] = total
        sparse = sorted({k for m, _ in ordered for k in m.get("sparse", [])})
        for key in sparse:
            rows = torch.cat([t[f"{key}:rows"] for m, t in ordered if key in m.get("sparse", [])])
            values = torch.cat([t[f"{key}:values"] for m, t in ordered if key in m.get("sparse", [])])
            unique, inverse = torch.unique(rows, return_inverse=True)
            total = values.new_zeros((unique.numel(), *values.shape[1:]))
            total.index_add_(0, inverse, values)
            summed[f"{key}:rows"], summed[f"{key}:values"] = unique, total
        meta0["dense"], meta0["sparse"] = dense, sparse
        self._apply(meta0, summed)
        self.applied_ids.add(sync_round(step).encode())
        self._cond.notify_all()
        if self.version in self._pending and len(self._pending[self.version]) == self.num_workers:
            self._apply_sync(self.version)

    def _wait_for_stragglers(self, worker: int, clock: int, wait: float) -> None:
        bound = clock - int(self.max_staleness or 0)
        deadline = time.monotonic() + wait

        def slow() -> list[int]:
            active = [w for w in range(self.num_workers) if w not in self._done and w != worker]
            return [w for w in active if self._clocks.get(w, 0) < bound]

        while lagging := slow():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestRefused(
                    f"max_staleness={self.max_staleness}: worker {worker} at step {clock} waited {wait:g}s "
                    f"for worker(s) {lagging}"
                )
            self._cond.wait(remaining)

    def _stats(self, meta: dict[str, Any], tensors: Tensors) -> Message:
        with self._cond:
            out: dict[str, Any] = {
                "applied": self.applied,
                "duplicates": self.duplicates,
                "damped": self.damped,
                "max_staleness_seen": self.max_seen_staleness,
                "version": self.version,
                "done": sorted(self._done),
                "failed": sorted(self._failed),
                "variables": sorted(self.variables),
                "restored_from": self.restored_from,
                "replacement": self.replacement,
                "incarnation": self.incarnation,
                "restored_in_place": self.restored_in_place,
                "restored_digest": self.restored_digest,
            }
            if meta.get("ids"):
                out["applied_ids"] = sorted(self.applied_ids)
        return out, {}

    def _worker_done(self, meta: dict[str, Any], tensors: Tensors) -> Message:
        with self._cond:
            self._done.add(int(meta["worker"]))
            if meta.get("failed"):
                self._failed.add(int(meta["worker"]))
            self._cond.notify_all()
            return {"done": sorted(self._done)}, {}

    def _stop(self, meta: dict[str, Any], tensors: Tensors) -> Message:
        self._stop_requested.set()
        return {"stopping": True}, {}

    def _state(self, meta: dict[str, Any], tensors: Tensors) -> Message:
        """Every shard and its optimizer state, for a checkpoint."""
        with self._cond:
            out = {key: value.clone() for key, value in self._state_tensors().items()}
            spec = self.optimizer.spec if self.optimizer is not None else None
            ledger = {
                "version": self.version,
                "applied": self.applied,
                "applied_ids": sorted(self.applied_ids),
            }
            return {"version": self.version, "optimizer": spec, "ledger": ledger}, out

    def _state_tensors(self) -> Tensors:
        """Every shard and optimizer slot as held (no copies; call under the lock)."""
        out: Tensors = dict(self.variables)
        if self.optimizer is not None:
            for key in self.variables:
                for slot, value in self.optimizer.state_tensors(key).items():
                    out[f"opt:{key}:{slot}"] = value
        return out


def serve(
    index: int, *, token: str, address: str, transport: str = DEFAULT_TRANSPORT, replacement: int = 0
) -> None:
    """Run parameter server ``index`` at ``address`` until the chief says stop (the ``ps`` role's main);
    ``replacement``: see :class:`ParameterServer`."""
    server = ParameterServer(
        index, token=token, address=address, transport=transport, replacement=replacement
    ).start()
    server.serve_until_stopped()
