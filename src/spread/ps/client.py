"""A worker's (or the chief's) view of all parameter servers: create, pull, push, by variable name.

The client turns variable-level requests into per-server calls using a :class:`Placement` and runs
the calls to different servers concurrently. Embedding tables are read and written by rows: a pull
asks each server only for the requested rows of its shard, a push sends only those rows' gradients,
so the bytes moved grow with the rows a batch touches, not with the table (``bytes_sent`` and
``bytes_received`` count every byte on the wire).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch

from spread.errors import ParameterServerError
from spread.ps.placement import Placement
from spread.ps.rpc_api import Message, RpcClient
from spread.ps.transports import DEFAULT_TRANSPORT, get_transport
from spread.ps.wire import DEFAULT_MAX_FRAME_BYTES

DEFAULT_TIMEOUT = 60.0
_CREATE_CHUNK_BYTES = 256 * 1024 * 1024


class PSClient:
    """Calls to every parameter server of a job.

    Args:
        addresses: ``host:port`` of each server, in task-index order.
        token: the job token.
        timeout: deadline of each call in seconds; a dead server is reported within it, named.
        transport: the RPC layer's name (:mod:`spread.ps.transports`).
    """

    def __init__(
        self,
        addresses: list[str],
        *,
        token: str,
        timeout: float = DEFAULT_TIMEOUT,
        transport: str = DEFAULT_TRANSPORT,
    ) -> None:
        if not addresses:
            raise ValueError("a parameter-server job needs at least one server address")
        self.timeout = timeout
        client_type = get_transport(transport).client
        self.clients: list[RpcClient] = [
            client_type(
                address,
                peer=f"parameter server {i} ({address})",
                token=token,
                timeout=timeout,
                error_type=ParameterServerError,
            )
            for i, address in enumerate(addresses)
        ]
        # Room for several threads' calls at once: a sync-mode push blocks its pool thread until the
        # round completes, and threads of one process (tests, the coordinator) may push concurrently.
        self._pool = ThreadPoolExecutor(max_workers=8 * len(addresses), thread_name_prefix="spread-ps-client")
        # Each server's version of the dense values this process last received (pull or push answer):
        # a push says which version its gradient was computed on, so stale ones can be scaled.
        self.versions: dict[int, int] = {}

    @property
    def num_servers(self) -> int:
        return len(self.clients)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.clients)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.clients)

    def _each(
        self, calls: Mapping[int, Callable[[RpcClient], Message]], *, fail_fast: bool = False
    ) -> dict[int, Message]:
        """Run one call per server concurrently; wait for all; raise the first failure (by server),
        a :class:`ParameterServerError` carrying that server's index (``server``).

        ``fail_fast``: raise a server's failure as soon as it comes, the other calls finishing in
        the background on their own deadlines. A sync push needs it: the other servers answer only
        when every task's share of the step is in, and a task that waits for a lost server's restore
        must replay its steps to it first (:mod:`spread.ps.in_place`)."""
        if len(calls) == 1:
            ((server, fn),) = calls.items()
            return {server: self._call_server(server, fn)}
        futures = {s: self._pool.submit(self._call_server, s, fn) for s, fn in calls.items()}
        if fail_fast:
            pending = set(futures.values())
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for server in sorted(s for s, f in futures.items() if f in finished):
                    if isinstance(failure := futures[server].exception(), ParameterServerError):
                        raise failure
        results, first_error = {}, None
        for server in sorted(futures):
            try:
                results[server] = futures[server].result()
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    def _call_server(self, server: int, fn: Callable[[RpcClient], Message]) -> Message:
        """``fn`` on server ``server``'s client; its :class:`ParameterServerError` names the server's
        index (``server``), which the restore in place waits for."""
        try:
            return fn(self.clients[server])
        except ParameterServerError as exc:
            exc.server = server
            raise

    def call(
        self,
        server: int,
        method: str,
        meta: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> Message:
        """One call to one server (its failure carries the server's index, as :meth:`_each`'s)."""
        return self._each(
            {server: lambda c: c.call(method, meta, tensors, timeout=timeout, wait_for_ready=wait_for_ready)}
        )[server]

    # -- set-up ------------------------------------------------------------------------------------
    def create(
        self,
        placement: Placement,
        values: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        *,
        overwrite: bool = False,
        extra: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        wait_for_ready: bool = True,
    ) -> None:
        """Send each server its shards' initial values and the job's settings (the chief does this)."""
        batches: dict[int, list[dict[str, torch.Tensor]]] = {s: [{}] for s in range(self.num_servers)}
        sizes = dict.fromkeys(range(self.num_servers), 0)
        for name, shards in placement.shards.items():
            value = values[name].detach()
            for shard in shards:
                part = value if len(shards) == 1 else value[shard.row_start : shard.row_stop]
                nbytes = part.numel() * part.element_size()
                if sizes[shard.server] and sizes[shard.server] + nbytes > _CREATE_CHUNK_BYTES:
                    batches[shard.server].append({})
                    sizes[shard.server] = 0
                batches[shard.server][-1][shard.key] = part.cpu()
                sizes[shard.server] += nbytes
        for server, tensors in (extra or {}).items():
            batches[server][-1].update(tensors)

        def send(server: int) -> Callable[[RpcClient], Message]:
            def run(client: RpcClient) -> Message:
                for i, tensors in enumerate(batches[server]):
                    meta = {"config": dict(config) if i == 0 else {}, "overwrite": overwrite}
                    client.call("create", meta, tensors, wait_for_ready=wait_for_ready)
                return {}, {}

            return run

        self._each({s: send(s) for s in range(self.num_servers)})

    # -- dense and row reads -----------------------------------------------------------------------
    def pull(self, placement: Placement, names: list[str], *, wait: float = 0.0) -> dict[str, torch.Tensor]:
        """Current values of whole variables (dense ones; row shards are concatenated)."""
        per_server: dict[int, list[str]] = {}
        for name in names:
            for shard in placement.shards[name]:
                per_server.setdefault(shard.server, []).append(shard.key)

        def pull(keys: list[str]) -> Callable[[RpcClient], Message]:
            return lambda c: c.call(
                "pull", {"names": keys, "wait": wait}, timeout=self.timeout + wait, wait_for_ready=wait > 0
            )

        calls = {s: pull(keys) for s, keys in per_server.items()}
        answers = self._each(calls)
        self._note_versions(answers)
        by_key = {k: v for _, tensors in answers.values() for k, v in tensors.items()}
        return {
            name: torch.cat([by_key[s.key] for s in placement.shards[name]])
            if len(placement.shards[name]) > 1
            else by_key[placement.shards[name][0].key]
            for name in names
        }

    def split_rows(
        self, placement: Placement, name: str, ids: torch.Tensor
    ) -> list[tuple[int, torch.Tensor]]:
        """For sorted unique global row ids: (shard index, positions in ``ids``) per touched shard."""
        shards = placement.shards[name]
        if len(shards) == 1:
            return [(0, torch.arange(ids.numel()))]
        which = torch.bucketize(ids, placement.row_boundaries(name), right=True)
        return [(i, (which == i).nonzero().flatten()) for i in range(len(shards)) if bool((which == i).any())]

    def pull_rows(self, placement: Placement, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (sorted, unique, int64) of table ``name``, from the servers holding them."""
        shards = placement.shards[name]
        groups = self.split_rows(placement, name, ids)
        calls = {}
        for i, positions in groups:
            shard = shards[i]
            local = ids if len(shards) == 1 else ids[positions] - shard.row_start
            calls[shard.server] = lambda c, key=shard.key, local=local: c.call(
                "pull", {"names": [key]}, {f"{key}:rows": local}
            )
        answers = self._each(calls) if calls else {}
        if len(shards) == 1 and groups:
            return answers[shards[0].server][1][shards[0].key]  # every row, in order: no copy
        out = None
        for i, positions in groups:
            values = answers[shards[i].server][1][shards[i].key]
            if out is None:
                out = values.new_empty((ids.numel(), *values.shape[1:]))
            out[positions] = values
        if out is None:
            raise ValueError(f"no rows requested from {name!r}")
        return out

    # -- updates -----------------------------------------------------------------------------------
    def push(
        self,
        placement: Placement,
        *,
        step_id: str,
        worker: int,
        step: int,
        optimizer: Mapping[str, Any],
        dense: Mapping[str, torch.Tensor],
        sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        pull: list[str],
        wait: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Send one step's gradients to every server (all of them take part, even with nothing to add,
        so sync mode can count workers) and return the fresh values of the dense variables ``pull``."""
        parts = self.push_parts(
            placement,
            step_id=step_id,
            worker=worker,
            step=step,
            optimizer=optimizer,
            dense=dense,
            sparse=sparse,
            pull=pull,
            wait=wait,
        )
        return self.send_push(placement, parts, pull=pull, wait=wait)

    def push_parts(
        self,
        placement: Placement,
        *,
        step_id: str,
        worker: int,
        step: int,
        optimizer: Mapping[str, Any],
        dense: Mapping[str, torch.Tensor],
        sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        pull: list[str],
        wait: float | None = None,
    ) -> dict[int, Message]:
        """Each server's part of one step's push, ``(meta, tensors)`` by server (see :meth:`push`)."""
        metas: dict[int, dict[str, Any]] = {
            s: {
                "step_id": step_id,
                "worker": worker,
                "step": step,
                "optimizer": dict(optimizer),
                "dense": [],
                "sparse": [],
                "pull": [],
                **({"wait": wait} if wait is not None else {}),
                **({"base": self.versions[s]} if s in self.versions else {}),
            }
            for s in range(self.num_servers)
        }
        tensors: dict[int, dict[str, torch.Tensor]] = {s: {} for s in range(self.num_servers)}
        for name, grad in dense.items():
            for shard in placement.shards[name]:
                metas[shard.server]["dense"].append(shard.key)
                tensors[shard.server][shard.key] = grad
        for name, (ids, values) in sparse.items():
            shards = placement.shards[name]
            for i, positions in self.split_rows(placement, name, ids):
                shard = shards[i]
                metas[shard.server]["sparse"].append(shard.key)
                if len(shards) == 1:  # every row to one server: no gather (row_start is 0)
                    tensors[shard.server][f"{shard.key}:rows"] = ids
                    tensors[shard.server][f"{shard.key}:values"] = values
                    continue
                tensors[shard.server][f"{shard.key}:rows"] = ids[positions] - shard.row_start
                tensors[shard.server][f"{shard.key}:values"] = values.index_select(0, positions)
        for name in pull:
            for shard in placement.shards[name]:
                metas[shard.server]["pull"].append(shard.key)
        return {s: (metas[s], tensors[s]) for s in range(self.num_servers)}

    def send_push(
        self,
        placement: Placement,
        parts: Mapping[int, Message],
        *,
        pull: list[str],
        wait: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Send :meth:`push_parts` to every server; the fresh values of the dense variables ``pull``."""
        budget = self.timeout + (wait or 0.0)

        def push(s: int) -> Callable[[RpcClient], Message]:
            return lambda c: c.call("push", parts[s][0], parts[s][1], timeout=budget)

        calls = {s: push(s) for s in range(self.num_servers)}
        answers = self._each(calls, fail_fast=True)
        self._note_versions({s: answers[s] for s in answers if parts[s][0]["pull"]})
        by_key = {k: v for _, t in answers.values() for k, v in t.items()}
        return {name: by_key[placement.shards[name][0].key] for name in pull}

    def _note_versions(self, answers: Mapping[int, Message]) -> None:
        """Remember the version of the values each answering server sent."""
        for server, (meta, _) in answers.items():
            if isinstance(meta.get("version"), int):
                self.versions[server] = meta["version"]

    # -- control -----------------------------------------------------------------------------------
    def stats(self, *, ids: bool = False) -> list[dict[str, Any]]:
        answers = self._each({s: (lambda c: c.call("stats", {"ids": ids})) for s in range(self.num_servers)})
        return [answers[s][0] for s in range(self.num_servers)]

    def done(self, worker: int, *, failed: bool = False) -> list[list[int]]:
        """Tell every server that training worker ``worker`` finished (``failed``: its script raised);
        returns each server's done list."""
        meta = {"worker": worker, "failed": failed}
        answers = self._each({s: (lambda c: c.call("done", meta)) for s in range(self.num_servers)})
        return [answers[s][0]["done"] for s in range(self.num_servers)]

    def stop(self) -> None:
        """Ask every server to stop serving (the chief does this at the end of the job)."""
        self._each({s: (lambda c: c.call("stop")) for s in range(self.num_servers)})

    def state(self) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, Any] | None]:
        """Every server's shards and optimizer state by server index, and the optimizer spec."""
        state, spec, _ = self.snapshot()
        return state, spec

    def snapshot(
        self,
    ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, Any] | None, dict[int, dict[str, Any]]]:
        """As :meth:`state`, plus each server's ledger (``version``, ``applied``, ``applied_ids``),
        read under the same lock as its shards: what the shards include, step by step."""
        answers = self._each({s: (lambda c: c.call("state")) for s in range(self.num_servers)})
        spec = next((answers[s][0]["optimizer"] for s in answers if answers[s][0].get("optimizer")), None)
        ledgers = {s: dict(answers[s][0].get("ledger") or {}) for s in range(self.num_servers)}
        return {s: answers[s][1] for s in range(self.num_servers)}, spec, ledgers

    def load(
        self,
        state: Mapping[int, Mapping[str, torch.Tensor]],
        config: Mapping[str, Any],
        ledgers: Mapping[int, Mapping[str, Any]] | None = None,
        *,
        restored_in_place: str = "",
    ) -> None:
        """Overwrite the shards and optimizer state of each server in ``state`` (a restore: every
        server, or one restored in place, named by ``restored_in_place``, the backup's name); with
        ``ledgers``, also their update counters and applied step ids (see :meth:`snapshot`)."""

        def meta(s: int) -> dict[str, Any]:
            out: dict[str, Any] = {"config": dict(config), "overwrite": True}
            if ledgers is not None:
                out["ledger"] = dict(ledgers[s])
            if restored_in_place:
                out["restored_in_place"] = restored_in_place
            return out

        def create(s: int) -> Callable[[RpcClient], Message]:
            return lambda c: c.call("create", meta(s), dict(state[s]), wait_for_ready=True)

        calls = {s: create(s) for s in state}
        self._each(calls)

    def announce(self, restored_from: str) -> None:
        """Record on every server which backup this job started from (or a fresh-start name)."""
        self._each(
            {
                s: (lambda c: c.call("create", {"restored_from": restored_from}, {}, wait_for_ready=True))
                for s in range(self.num_servers)
            }
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self.clients:
            client.close()


__all__ = ["DEFAULT_MAX_FRAME_BYTES", "DEFAULT_TIMEOUT", "PSClient"]
