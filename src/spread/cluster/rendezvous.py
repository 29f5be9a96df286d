"""Bring up the process group: store, job-token handshake, arrival check, then torch.distributed.

Why not a bare ``init_process_group("gloo")``: it binds the store to every interface, cannot tell a
stray process from the job's own, waits silently for ranks that never start, and under
``torchrun --max-restarts`` the restarted attempt reads the dead attempt's addresses from the agent's
store. Here:

* under a launcher (``spread run``, torchrun) the launcher hosts the ``TCPStore`` and every rank is a
  client; without one, rank 0 hosts it on a socket bound to ``MASTER_ADDR`` only (loopback by
  default), and a rank waiting for it says so every few seconds;
* every key lives under ``spread/<attempt>/``, so restarted attempts never meet stale keys;
* the handshake's keys live under a prefix derived from the job token (an HMAC), so a process without
  the token cannot name them in advance, and every value they hold carries an HMAC of the token over
  its key and content: any local user can connect to the store, list its keys and overwrite them, but
  what they write is told apart from the job's own, and the error says so instead of blaming the
  token or the world size. Without ``SPREAD_JOB_TOKEN`` the token is a public default and none of this
  holds;
* rank 0 publishes a nonce under the job's prefix; other ranks wait for it before they write
  anything, so a process with the wrong token is refused at the deadline and leaves no trace in the
  job. Rank 0 also publishes a token check under a fixed name, only to tell such a process why;
* each rank announces itself; a rank that does not arrive within ``init_timeout`` is named.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from spread import env
from spread.cluster.machine_reports import LossWatch, RankPlace
from spread.cluster.spec import ClusterSpec
from spread.errors import JobTokenError, RendezvousError

TOKEN_ENV = env.JOB_TOKEN
_DEFAULT_TOKEN = "spread-default-job-token"
_WAIT_NOTICE = 10.0  # seconds between "still waiting for the store" messages


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise RendezvousError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise RendezvousError(f"{name} must be positive, got {raw!r}")
    return value


def default_init_timeout() -> float:
    """Seconds to wait for all ranks to join (``SPREAD_INIT_TIMEOUT``, default 120)."""
    return _env_seconds(env.INIT_TIMEOUT, 120.0)


def default_collective_timeout() -> float:
    """Seconds a collective may block before it fails (``SPREAD_COLLECTIVE_TIMEOUT``, default 300)."""
    return _env_seconds(env.COLLECTIVE_TIMEOUT, 300.0)


def regroup_timeout() -> float:
    """Seconds survivors of a lost rank wait for each other at a regroup (``SPREAD_REGROUP_TIMEOUT``,
    default 30): a live rank that has not noticed the loss by then is left out."""
    return _env_seconds(env.REGROUP_TIMEOUT, 30.0)


def _proof(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def _job_prefix(token: str) -> str:
    """The prefix of the job's keys: only a holder of the token can name them before they exist."""
    return hmac.new(token.encode(), b"spread store keys", hashlib.sha256).hexdigest()[:32]


class _SealedKeys:
    """The job's handshake keys, each value stored with an HMAC of the token over its key and content.

    Any local user can list the store's keys and overwrite them; a value not sealed with the token
    reads as absent (the job's own write may still replace it) and its key is kept in ``forged`` so
    that a deadline can say the store's content was not written by this job.
    """

    def __init__(self, store: dist.Store, token: str, scope: str) -> None:
        self.store, self._token, self._scope = store, token.encode(), scope
        self.forged: set[str] = set()

    def _seal(self, key: str, payload: str) -> str:
        message = f"spread store value\0{self._scope}/{key}\0{payload}".encode()
        return hmac.new(self._token, message, hashlib.sha256).hexdigest()

    def set(self, key: str, payload: str) -> None:
        self.store.set(key, f"{self._seal(key, payload)} {payload}")

    def read(self, key: str) -> str | None:
        """The payload under ``key``; ``None`` while it is absent or not sealed with the job token."""
        if not self.store.check([key]):
            self.forged.discard(key)
            return None
        seal, _, payload = self.store.get(key).decode(errors="replace").partition(" ")
        if not hmac.compare_digest(seal, self._seal(key, payload)):
            self.forged.add(key)
            return None
        self.forged.discard(key)
        return payload


def _forged_content(keys: _SealedKeys, world_size: int) -> str:
    """What of the job's handshake in the store now holds values the job did not write ("" if none):
    read again at a deadline, since a forgery may replace what a rank read as genuine earlier."""
    try:
        keys.read("handshake")
        for r in range(world_size):
            keys.read(f"arrived/{r}")
    except (RuntimeError, dist.DistError):  # the store is gone: the deadline's own message says enough
        return ""
    forged_ranks = [r for r in range(world_size) if f"arrived/{r}" in keys.forged]
    parts = ["the job handshake"] if "handshake" in keys.forged else []
    parts += [f"the arrival of rank(s) {forged_ranks}"] if forged_ranks else []
    return " and ".join(parts)


def _not_written_by_the_job(spec: ClusterSpec, what: str) -> str:
    return (
        f"the rendezvous store at {spec.master_addr}:{spec.master_port} holds content that was not written "
        f"by this job ({what}, without the job token's HMAC): another process on this host, or another job "
        f"using the same MASTER_ADDR:MASTER_PORT, wrote to the store. Give each job a port of its own; on a "
        f"shared host any local user can reach the store"
    )


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


@dataclass
class Rendezvous:
    """A joined job: the store (namespaced to this attempt and token) and the default process group."""

    spec: ClusterSpec
    store: dist.Store
    backend: str
    _tcp_store: dist.TCPStore | None = None
    _owns_group: bool = True
    _keys: _SealedKeys | None = None  # the job's sealed keys (membership at a regroup)
    _job_store: dist.Store | None = None  # the attempt's job store (every generation's keys under it)
    generation: int = 0  # regroups survived: each generation's group lives under its own prefix
    collective_timeout: float = 300.0
    # After a regroup: who forms this group, in order: the old ranks (ints) that stayed, then the
    # ranks that joined (``"+n"``, the n-th process to ask to join the running job).
    members: tuple[int | str, ...] = ()
    admitted: int = 0  # joiners admitted so far (the highest n); more than that wait to join
    joined: bool = False  # this process joined a running job: its state comes from a live peer

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def close(self) -> None:
        """Destroy the process group this rendezvous created; safe to call twice."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    def joiners_waiting(self) -> bool:
        """Whether processes wait to join the running job (:func:`rendezvous` with ``SPREAD_JOIN=1``):
        one read of the store (a counter), cheap enough for every step."""
        if self._job_store is None:
            return False
        return int(self._job_store.add(_JOINERS, 0)) > self.admitted

    def regroup(
        self,
        gone: Callable[[], Iterable[int]],
        timeout: float,
        places: Mapping[int, RankPlace] | None = None,
    ) -> Rendezvous:
        """Form the next generation's group of the ranks still alive, and of the processes that wait
        to join (recovery without restart, and growing back).

        The current group must be destroyed already (:meth:`close`). Survivors agree on membership
        through the store, never a collective (the group is broken): each posts itself under the
        next generation; the first survivor to see every rank either posted or known gone, or
        ``timeout`` seconds pass, writes the member list with a compare-and-set (the survivors, then
        every process waiting to join), and every survivor reads that one list. A rank not on it (it
        came too late) raises :class:`RendezvousError`. New ranks follow the old ranks' order,
        joiners last; the group lives under a prefix of its own, so no key of the broken group is
        read again.

        Known gone: ``gone()`` (ranks this process saw exit: those of its own machine), and, given
        ``places`` (each old rank's process group and launcher id), the ranks whose launchers'
        reports in the store show them exited, their machine going away or silent
        (:class:`~spread.cluster.machine_reports.LossWatch`): ranks on other machines, without waiting
        for ``timeout``.
        """
        if self._keys is None or self._job_store is None:
            raise RendezvousError(
                f"rank {self.rank}: cannot regroup a process group this rendezvous did not create"
            )
        generation = self.generation + 1
        old_rank, old_world = self.spec.rank, self.spec.world_size
        keys, scope = self._keys, f"regroup/{generation}"
        others = {rank: place for rank, place in (places or {}).items() if rank != old_rank}
        watch = LossWatch(keys, others)

        def known_gone() -> set[int]:
            return set(gone()) | watch.gone()

        try:
            members = _agree_on_members(keys, scope, old_rank, old_world, known_gone, timeout, self.admitted)
            told = {rank: why for rank, why in sorted(watch.why.items()) if rank not in members}
            if told and members and members[0] == old_rank:  # said once, by the new group's first rank
                print(
                    f"spread: rank {old_rank}: regroup {generation}: known gone from their machines' "
                    f"reports: {'; '.join(f'rank {rank} {why}' for rank, why in told.items())}",
                    file=sys.stderr,
                    flush=True,
                )
            if old_rank not in members:
                raise RendezvousError(
                    f"rank {old_rank}: left out of the job's regroup {generation}: the survivors "
                    f"{members} closed the membership before this rank arrived (within {timeout:.0f}s)"
                )
            new_rank = members.index(old_rank)
            store = dist.PrefixStore(scope, self._job_store)
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore("pg", store),
                rank=new_rank,
                world_size=len(members),
                timeout=timedelta(seconds=self.collective_timeout),
            )
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, RendezvousError):
                raise
            raise RendezvousError(
                f"rank {old_rank}: regroup {generation} failed with the store at {self.spec.master_addr}:"
                f"{self.spec.master_port} (recovery needs a store that outlives the ranks: spread run's or "
                f"torchrun's): {exc}"
            ) from exc
        spec = replace(self.spec, rank=new_rank, world_size=len(members))
        return Rendezvous(
            spec=spec,
            store=store,
            backend=self.backend,
            _tcp_store=self._tcp_store,
            _keys=keys,
            _job_store=self._job_store,
            generation=generation,
            collective_timeout=self.collective_timeout,
            members=tuple(members),
            admitted=max([self.admitted, *_joiner_numbers(members)]),
        )


_JOINERS = "joiners"  # a counter in the job store: processes that asked to join the running job


def _joiner_numbers(members: Iterable[int | str]) -> list[int]:
    return [int(m[1:]) for m in members if isinstance(m, str)]


def _agree_on_members(
    keys: _SealedKeys,
    scope: str,
    rank: int,
    world_size: int,
    gone: Callable[[], Iterable[int]],
    timeout: float,
    admitted: int,
) -> list[int | str]:
    """Who forms the next generation, the same list on every survivor (see :meth:`Rendezvous.regroup`):
    the survivors' old ranks, then ``"+n"`` for every joiner past the ``admitted`` ones."""
    keys.set(f"{scope}/alive/{rank}", str(os.getpid()))
    decision = f"{scope}/members"
    deadline = time.monotonic() + timeout
    while (members := keys.read(decision)) is None:
        posted = [r for r in range(world_size) if keys.read(f"{scope}/alive/{r}") is not None]
        dead = set(gone())
        if all(r in dead or r in posted for r in range(world_size)) or time.monotonic() >= deadline:
            waiting = int(keys.store.add(_JOINERS, 0))
            payload = json.dumps([*posted, *(f"+{n}" for n in range(admitted + 1, waiting + 1))])
            keys.store.compare_set(decision, "", f"{keys._seal(decision, payload)} {payload}")
            continue  # read back what was decided (another survivor's list if it came first)
        time.sleep(0.02)
    return [m if isinstance(m, str) else int(m) for m in json.loads(members)]


def _join_running_job(
    keys: _SealedKeys, spec: ClusterSpec, backend: str, timeout: float, collective_timeout: float
) -> Rendezvous:
    """Join a running job (``SPREAD_JOIN=1``: ``spread run --recover`` on a machine that came back, or
    a new one): take a number from the store's counter, then wait until the running ranks admit it at
    a step boundary (the member list of a later generation names ``"+n"``), and form that group with
    them. The model, optimizer state and data position then come from a live peer (the caller)."""
    job_store = keys.store
    number = int(job_store.add(_JOINERS, 1))
    print(
        f"spread: rank {spec.rank}: joining the running job as joiner {number}; waiting for its ranks to "
        f"admit it at their next step boundary",
        file=sys.stderr,
        flush=True,
    )
    deadline, generation, me = time.monotonic() + timeout, 1, f"+{number}"
    while True:
        decided = keys.read(f"regroup/{generation}/members")
        if decided is not None:
            members = [m if isinstance(m, str) else int(m) for m in json.loads(decided)]
            if me in members:
                break
            generation += 1
            continue
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"rank {spec.rank}: the running job at {spec.master_addr}:{spec.master_port} did not admit "
                f"this process (joiner {number}) within {timeout:.0f}s (SPREAD_INIT_TIMEOUT): its ranks "
                f"admit joiners at a step boundary of Trainer.fit under spread run --recover; the job may "
                f"have finished, or run without --recover"
            )
        time.sleep(0.05)
    scope = f"regroup/{generation}"
    store = dist.PrefixStore(scope, job_store)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=members.index(me),
        world_size=len(members),
        timeout=timedelta(seconds=collective_timeout),
    )
    return Rendezvous(
        spec=replace(spec, rank=members.index(me), world_size=len(members)),
        store=store,
        backend=backend,
        _keys=keys,
        _job_store=job_store,
        generation=generation,
        collective_timeout=collective_timeout,
        members=tuple(members),
        admitted=max(_joiner_numbers(members)),
        joined=True,
    )


def _attempt_scope(restart_count: int) -> str:
    return f"spread/{restart_count}"


def job_keys(tcp: dist.Store, token: str, restart_count: int) -> _SealedKeys:
    """The job's sealed keys in attempt ``restart_count`` of the store ``tcp`` (their ``store`` is the
    attempt's job store): what the ranks, ``spread run``'s report of where each rank is, and the
    launchers' machine reports (:mod:`spread.cluster.machine_reports`) all read and write."""
    scope = _attempt_scope(restart_count)
    return _SealedKeys(dist.PrefixStore(_job_prefix(token), dist.PrefixStore(scope, tcp)), token, scope)


def open_job_store(
    host: str, port: int, token: str, restart_count: int, timeout: float
) -> tuple[dist.Store, int | None]:
    """A client of a running job's store, seeing the keys its ranks see now (for a reader outside the
    job, such as ``spread run``'s report of where each rank is): the store of the job's latest group
    (after recoveries, the last regroup's) and that group's size (``None``: the job's first group).
    Raises ``RuntimeError`` when unreachable."""
    tcp = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))
    keys = job_keys(tcp, token, restart_count)
    job_store = keys.store
    store: dist.Store = job_store
    world_size: int | None = None
    generation = 1
    while (members := keys.read(f"regroup/{generation}/members")) is not None:
        store, world_size = dist.PrefixStore(f"regroup/{generation}", job_store), len(json.loads(members))
        generation += 1
    return store, world_size


def _host_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """Rank 0 without a launcher's store: bind ``host:port`` ourselves (TCPStore alone would listen on
    every interface) and serve the store on that socket, which the store then owns and closes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(128)
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            None,
            True,
            timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except (OSError, RuntimeError) as exc:
        listener.close()
        raise RendezvousError(f"rank 0: cannot host the rendezvous store on {host}:{port}: {exc}") from exc
    listener.detach()  # the store closes the descriptor when it is destroyed: never close it twice
    return store


def _connect_store(spec: ClusterSpec, timeout: float) -> dist.TCPStore:
    """Connect to the store as a client, saying every ``_WAIT_NOTICE`` seconds whom we are waiting for:
    a worker started before its chief must not look hung."""
    host, port = spec.master_addr, spec.master_port
    start = time.monotonic()
    deadline = start + timeout
    last_error: Exception | None = None
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            return dist.TCPStore(host, port, None, False, timedelta(seconds=min(remaining, _WAIT_NOTICE)))
        except (RuntimeError, ValueError) as exc:  # refused or timed out until the store's host is up
            last_error = exc
        waited = time.monotonic() - start
        if waited >= _WAIT_NOTICE and deadline - time.monotonic() > 0:
            print(
                f"spread: rank {spec.rank}: waiting for the rendezvous store at {host}:{port} "
                f"(rank 0 or the launcher hosts it) for {waited:.0f}s of {timeout:.0f}s",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(0.05)
    raise RendezvousError(
        f"rank {spec.rank}: could not reach the rendezvous store at {host}:{port} within {timeout:.0f}s "
        f"(is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?): {last_error}"
    )


def _open_store(spec: ClusterSpec, timeout: float) -> dist.TCPStore:
    """The job's store.

    Under ``spread run`` or torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the launcher hosts the
    store and every rank is a client; without a launcher rank 0 hosts it.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if spec.rank == 0 and not agent_store:
        return _host_store(spec.master_addr, spec.master_port, timeout)
    return _connect_store(spec, timeout)


def _token_check_differs(store: dist.Store, token: str) -> bool:
    """Whether the fixed-name token check holds a handshake made with another token (or forged)."""
    if not store.check(["token-check"]):
        return False
    nonce, _, proof = store.get("token-check").decode(errors="replace").partition(" ")
    return not hmac.compare_digest(_proof(token, nonce), proof)


def _check_token(store: dist.Store, keys: _SealedKeys, spec: ClusterSpec, token: str, timeout: float) -> None:
    """Rank 0 publishes the handshake; the others wait for one sealed with their token.

    A rank with another token cannot see the job's handshake at all, and cannot tell rank 0 of a job
    with another token from a process that wrote the fixed-name check: so it waits until the deadline
    (saying so) instead of failing at once, which would let any local user stop every start.
    """
    if spec.rank == 0:
        nonce = secrets.token_hex(16)
        keys.set("handshake", nonce)
        store.set("token-check", f"{nonce} {_proof(token, nonce)}")
        return
    deadline = time.monotonic() + timeout
    told = False
    while (handshake := keys.read("handshake")) is None and time.monotonic() < deadline:
        if not told and _token_check_differs(store, token):
            told = True
            print(
                f"spread: rank {spec.rank}: the store at {spec.master_addr}:{spec.master_port} holds a job "
                f"handshake made with another {TOKEN_ENV} (or by a process outside the job); waiting up to "
                f"{timeout:.0f}s for one made with this process's token",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(0.02)
    if handshake is not None:
        return
    if "handshake" in keys.forged:
        raise RendezvousError(f"rank {spec.rank}: {_not_written_by_the_job(spec, 'the job handshake')}")
    if _token_check_differs(store, token):
        raise JobTokenError(
            f"rank {spec.rank}: no job started with this process's {TOKEN_ENV} published its handshake at "
            f"{spec.master_addr}:{spec.master_port} within {timeout:.0f}s, but one made with another token "
            f"is there: this process's {TOKEN_ENV} does not match the job's (unless a process outside the "
            f"job wrote that handshake). Start every process of a job with the same token (`spread run` "
            f"sets it for local jobs)."
        )
    if store.check(["token-check"]):  # rank 0 with this token was there: its handshake was removed
        raise RendezvousError(
            f"rank {spec.rank}: rank 0 published the job handshake at {spec.master_addr}:{spec.master_port} "
            f"but it is gone from the store: a process outside the job (on this host, or another job using "
            f"the same MASTER_ADDR:MASTER_PORT) removed it"
        )
    raise RendezvousError(f"rank {spec.rank}: rank 0 did not publish the job handshake within {timeout:.0f}s")


def _announce_and_wait(keys: _SealedKeys, spec: ClusterSpec, timeout: float) -> None:
    me = {"world_size": spec.world_size, "pid": os.getpid(), "host": socket.gethostname()}
    keys.set(f"arrived/{spec.rank}", json.dumps(me))
    # Rank 0 hosts the store: it waits a little longer so the others can still read it when they give up.
    deadline = time.monotonic() + timeout + (1.0 if spec.rank == 0 else 0.0)
    sizes: dict[int, int] = {}
    missing = list(range(spec.world_size))
    while missing:
        try:
            for r in missing:
                payload = keys.read(f"arrived/{r}")
                if payload is not None:
                    sizes[r] = json.loads(payload)["world_size"]
        except (RuntimeError, dist.DistError) as exc:
            raise RendezvousError(
                f"rank {spec.rank}: lost the rendezvous store at {spec.master_addr}:{spec.master_port} "
                f"while waiting for rank(s) {missing} of {spec.world_size} to join (did rank 0 exit?)"
            ) from exc
        missing = [r for r in missing if r not in sizes]
        if not missing:
            break
        if time.monotonic() >= deadline:
            message = (
                f"rank {spec.rank}: rank(s) {missing} of {spec.world_size} did not join "
                f"within {timeout:.0f}s at {spec.master_addr}:{spec.master_port}"
            )
            if forged := _forged_content(keys, spec.world_size):
                message += f"; {_not_written_by_the_job(spec, forged)}"
            raise RendezvousError(message)
        time.sleep(0.02)
    sizes = dict(sorted(sizes.items()))
    if len(set(sizes.values())) > 1:
        raise RendezvousError(f"rank {spec.rank}: ranks disagree on WORLD_SIZE: {sizes}")


def default_backend(device: torch.device | None = None) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    if device is not None and device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rendezvous(
    spec: ClusterSpec,
    *,
    backend: str = "gloo",
    init_timeout: float | None = None,
    collective_timeout: float | None = None,
    token: str | None = None,
) -> Rendezvous:
    """Join the job described by ``spec`` and initialise the default process group.

    Raises :class:`JobTokenError` when the token does not match, :class:`RendezvousError` when the
    store is unreachable, ranks are missing after ``init_timeout`` seconds, ranks disagree on the
    world size, or the store holds handshake content that the job did not write. Must be called once
    per process, by every rank of the training group.
    """
    if dist.is_initialized():
        raise RendezvousError("torch.distributed is already initialised in this process")
    init_timeout = init_timeout or default_init_timeout()
    collective_timeout = collective_timeout or default_collective_timeout()
    token = token if token is not None else os.environ.get(TOKEN_ENV, _DEFAULT_TOKEN)
    if _is_loopback(spec.master_addr):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tcp = _open_store(spec, init_timeout)
    scope = _attempt_scope(spec.restart_count)
    attempt_store = dist.PrefixStore(scope, tcp)
    job_store = dist.PrefixStore(_job_prefix(token), attempt_store)
    keys = _SealedKeys(job_store, token, scope)
    joining = os.environ.get(env.JOIN, "") == "1"
    phase = "the job-token handshake"
    try:
        # A joiner checks its token as any rank but 0 does: against the handshake the job's rank 0
        # published when the job started.
        _check_token(
            attempt_store,
            keys,
            replace(spec, rank=max(spec.rank, 1)) if joining else spec,
            token,
            init_timeout,
        )
        if joining:
            phase = "joining the running job"
            joined = _join_running_job(keys, spec, backend, init_timeout, collective_timeout)
            joined._tcp_store = tcp
            return joined
        phase = "the arrival check"
        _announce_and_wait(keys, spec, init_timeout)
        phase = f"{backend} process-group setup"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", job_store),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
    except RendezvousError:
        raise
    except (RuntimeError, dist.DistError) as exc:  # the store host (rank 0) or a peer went away
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(
            f"rank {spec.rank}: rendezvous failed during {phase} with the store at "
            f"{spec.master_addr}:{spec.master_port} (did rank 0 or another rank exit?): {detail}"
        ) from exc
    return Rendezvous(
        spec=spec,
        store=job_store,
        backend=backend,
        _tcp_store=tcp,
        _keys=keys,
        _job_store=job_store,
        collective_timeout=collective_timeout,
        members=tuple(range(spec.world_size)),
    )
